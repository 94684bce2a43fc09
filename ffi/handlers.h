// The XLA FFI handlers jaxmx exports, and the helpers the Python module exposes.
#ifndef JAXMX_FFI_HANDLERS_H_
#define JAXMX_FFI_HANDLERS_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/c_api.h"

// CPU handlers (always built).
extern "C" XLA_FFI_Error* JaxmxMxMatmulCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxFp8MatmulCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxBlockFp8MatmulCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxFp4MatmulCpu(XLA_FFI_CallFrame* call_frame);

#ifdef JAXMX_WITH_CUDA
// cuBLASLt handlers (built when the CUDA runtime and cuBLASLt headers were found), per target an
// initialize stage (handle and plan, outside graph capture) and an execute stage.
extern "C" XLA_FFI_Error* JaxmxMxMatmulCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxMxMatmulCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxFp8MatmulCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxFp8MatmulCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxBlockFp8MatmulCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxBlockFp8MatmulCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxFp4MatmulCudaInitialize(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxmxFp4MatmulCuda(XLA_FFI_CallFrame* call_frame);
#endif

namespace jaxmx {

// Reads a swizzled [roundup(rows, 128) * roundup(cols, 4)] scale buffer back to [rows, cols].
void UnswizzleScales(const uint8_t* buf, int64_t rows, int64_t cols, uint8_t* out);

#ifdef JAXMX_WITH_CUDA
// The CUDA libraries the handler loads at run time (dlopen), without needing a GPU.
struct CudaLibraryInfo {
  bool loaded = false;
  std::string error;         // why loading failed
  std::string cublaslt;      // path of the loaded libcublasLt
  std::string cudart;        // path of the loaded libcudart
  int cublaslt_version = 0;  // cublasLtGetVersion(), e.g. 130100
  int cudart_version = 0;    // cudaRuntimeGetVersion(), e.g. 13000
};
CudaLibraryInfo LoadCudaLibraries();
#endif

}  // namespace jaxmx

#endif  // JAXMX_FFI_HANDLERS_H_
