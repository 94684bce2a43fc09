// The CUDA runtime and cuBLASLt functions the cuBLASLt core (cublaslt_gemm.h) calls, as a table of
// function pointers: filled by dlopen/dlsym in ffi/cuda_gemm.cc, and by a test double in tests/.
#ifndef JAXMX_FFI_CUBLASLT_API_H_
#define JAXMX_FFI_CUBLASLT_API_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

namespace jaxmx {

#define JAXMX_CUDART_FUNCTIONS(X) \
  X(cudaRuntimeGetVersion)        \
  X(cudaGetErrorString)           \
  X(cudaGetDevice)                \
  X(cudaSetDevice)                \
  X(cudaDeviceGetAttribute)       \
  X(cudaMemsetAsync)              \
  X(cudaMemcpy2DAsync)

#define JAXMX_CUBLASLT_FUNCTIONS(X)       \
  X(cublasLtGetVersion)                   \
  X(cublasLtGetStatusString)              \
  X(cublasLtCreate)                       \
  X(cublasLtDestroy)                      \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)          \
  X(cublasLtMatrixLayoutSetAttribute)     \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmul)

struct CublasLtApi {
#define JAXMX_DECLARE(name) decltype(&::name) name = nullptr;
  JAXMX_CUDART_FUNCTIONS(JAXMX_DECLARE)
  JAXMX_CUBLASLT_FUNCTIONS(JAXMX_DECLARE)
#undef JAXMX_DECLARE
};

}  // namespace jaxmx

#endif  // JAXMX_FFI_CUBLASLT_API_H_
