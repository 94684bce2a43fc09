// jaxmx._ffi: the XLA FFI handlers of the native GEMM (as capsules for jax.ffi.register_ffi_target)
// and a few helpers for tests and diagnostics.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "handlers.h"
#include "mx_common.h"

#ifdef JAXMX_WITH_CUDA
#include <cublas_api.h>
#include <cuda_runtime_api.h>
#ifndef JAXMX_CUDA_INCLUDE_DIR
#define JAXMX_CUDA_INCLUDE_DIR "unknown"  // set by CMake; not by other build systems
#endif
#ifndef JAXMX_CUDA_INCLUDE_DIRS
#define JAXMX_CUDA_INCLUDE_DIRS JAXMX_CUDA_INCLUDE_DIR  // ':'-separated, set by CMake
#endif
#endif

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes a call frame");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#ifdef JAXMX_WITH_CUDA
// A handler bundle: XLA runs `initialize` before each execution, outside graph capture.
template <typename T>
nb::dict Stages(T* initialize, T* execute) {
  nb::dict stages;
  stages["initialize"] = Capsule(initialize);
  stages["execute"] = Capsule(execute);
  return stages;
}
#endif

nb::dict Registrations() {
  nb::dict platforms, cpu;
  cpu["jaxmx_mx_matmul"] = Capsule(JaxmxMxMatmulCpu);
  cpu["jaxmx_fp8_matmul"] = Capsule(JaxmxFp8MatmulCpu);
  cpu["jaxmx_block_fp8_matmul"] = Capsule(JaxmxBlockFp8MatmulCpu);
  cpu["jaxmx_fp4_matmul"] = Capsule(JaxmxFp4MatmulCpu);
  platforms["cpu"] = cpu;
#ifdef JAXMX_WITH_CUDA
  nb::dict cuda;
  cuda["jaxmx_mx_matmul"] = Stages(JaxmxMxMatmulCudaInitialize, JaxmxMxMatmulCuda);
  cuda["jaxmx_fp8_matmul"] = Stages(JaxmxFp8MatmulCudaInitialize, JaxmxFp8MatmulCuda);
  cuda["jaxmx_block_fp8_matmul"] =
      Stages(JaxmxBlockFp8MatmulCudaInitialize, JaxmxBlockFp8MatmulCuda);
  cuda["jaxmx_fp4_matmul"] = Stages(JaxmxFp4MatmulCudaInitialize, JaxmxFp4MatmulCuda);
  platforms["CUDA"] = cuda;
#endif
  return platforms;
}

using Bytes1D = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes2D = nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>;

Bytes2D Unswizzle(Bytes1D buf, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) throw nb::value_error("rows and cols must be non-negative");
  const std::optional<int64_t> size = jaxmx::SwizzledSize(rows, cols);
  int64_t elements = 0;
  if (!size || __builtin_mul_overflow(rows, cols, &elements))
    throw nb::value_error(("a " + std::to_string(rows) + "x" + std::to_string(cols) +
                           " scale matrix is too large: its size overflows 64 bits")
                              .c_str());
  const int64_t want = *size;
  if (static_cast<int64_t>(buf.shape(0)) != want)
    throw nb::value_error(("a swizzled buffer of " + std::to_string(rows) + "x" +
                           std::to_string(cols) + " scales has " + std::to_string(want) +
                           " bytes, got " + std::to_string(buf.shape(0)))
                              .c_str());
  auto* out = new uint8_t[elements > 0 ? elements : 1];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<uint8_t*>(p); });
  jaxmx::UnswizzleScales(buf.data(), rows, cols, out);
  return Bytes2D(out, {static_cast<size_t>(rows), static_cast<size_t>(cols)}, owner);
}

nb::dict BuildInfo() {
  nb::dict info;
  info["has_cuda"] = bool(
#ifdef JAXMX_WITH_CUDA
      true
#else
      false
#endif
  );
#ifdef JAXMX_WITH_CUDA
  info["cuda_include_dir"] = std::string(JAXMX_CUDA_INCLUDE_DIR);
  info["cuda_include_dirs"] = std::string(JAXMX_CUDA_INCLUDE_DIRS);
  info["cudart_header_version"] = int(CUDART_VERSION);
  info["cublas_header_version"] = int(CUBLAS_VERSION);
#endif
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
  return info;
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "jaxmx native extension: XLA FFI handlers of the MX / FP8 / FP4 GEMMs";
#ifdef JAXMX_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.def("registrations", &Registrations,
        "{platform: {target name: handler capsule, or {stage: capsule}}} for "
        "jax.ffi.register_ffi_target.");
  m.def("build_info", &BuildInfo, "How the extension was built (CUDA header versions, compiler).");
  m.def(
      "align_workspace",
      [](uint64_t address, uint64_t size) {
        const auto ws = jaxmx::AlignWorkspace(reinterpret_cast<void*>(address), size);
        return nb::make_tuple(reinterpret_cast<uintptr_t>(ws.data) - address, ws.size);
      },
      nb::arg("address"), nb::arg("size"),
      "(offset, usable bytes) of the 256-byte aligned cuBLASLt workspace the CUDA handler "
      "takes from an XLA buffer at `address` of `size` bytes.");
  m.def("unswizzle_scales", &Unswizzle, nb::arg("buf"), nb::arg("rows"), nb::arg("cols"),
        "Reads a swizzled (cuBLAS 128x4 tiled) uint8 scale buffer back to [rows, cols], with the "
        "same C++ layout code the CPU GEMM handler uses.");
#ifdef JAXMX_WITH_CUDA
  m.def(
      "cuda_libraries",
      [] {
        const jaxmx::CudaLibraryInfo info = jaxmx::LoadCudaLibraries();
        nb::dict d;
        d["loaded"] = info.loaded;
        d["error"] = info.error;
        d["cudart"] = info.cudart;
        d["cublaslt"] = info.cublaslt;
        d["cudart_version"] = info.cudart_version;
        d["cublaslt_version"] = info.cublaslt_version;
        return d;
      },
      "Loads libcudart / libcublasLt (dlopen; no GPU needed) and reports paths and versions.");
#endif
}
