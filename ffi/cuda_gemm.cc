// The XLA FFI handlers of jaxmx_mx_matmul (MXFP8, CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0),
// jaxmx_fp8_matmul (per-tensor FP8, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F),
// jaxmx_block_fp8_matmul (block FP8, VEC128_32F / BLK128x128_32F) and jaxmx_fp4_matmul (NVFP4,
// VEC16_UE4M3, or MXFP4, VEC32_UE8M0, on CUDA_R_4F_E2M1 operands) on CUDA: a thin shell
// that checks the buffers (CheckGemm), describes the call as an LtGemm and hands it to the core
// (cublaslt_gemm.h) with the CUDA runtime and cuBLASLt loaded here.
//
// Host code only (no kernels, no nvcc). The CUDA runtime and cuBLASLt are loaded with dlopen on
// first use, so the extension imports and its CPU handlers run on machines without CUDA; the
// headers only provide types, enums and the function signatures.
//
// Each target has two stages: initialize (XLA runs it before executing, outside any CUDA graph
// capture) creates the device's cuBLASLt handle and the problem's plan; execute enqueues the
// GEMM, with no host synchronisation and, after the plan exists, no allocation. The workspace is
// an XLA-allocated output buffer, so execute may be captured into a command buffer (CUDA graph).
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cublaslt_api.h"
#include "cublaslt_gemm.h"
#include "handlers.h"
#include "mx_common.h"

#define JAXMX_STR2(x) #x
#define JAXMX_STR(x) JAXMX_STR2(x)

namespace jaxmx {
namespace {

// --- run-time loading of libcudart and libcublasLt -------------------------------------------

struct Api {
  CublasLtApi functions;
  CudaLibraryInfo info;
};

// Directory of this extension module (site-packages/jaxmx), to find pip-installed NVIDIA wheels.
std::string ModuleDirectory() {
  Dl_info dl;
  if (dladdr(reinterpret_cast<void*>(&ModuleDirectory), &dl) == 0 || dl.dli_fname == nullptr)
    return "";
  std::string path = dl.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

// Tries `soname` as is (a copy already loaded by JAX's CUDA plugin, LD_LIBRARY_PATH, the system
// cache), then the NVIDIA wheels next to the jaxmx package, then the toolkit found at build time.
void* OpenLibrary(const char* env_override, const std::string& soname,
                  const std::vector<std::string>& wheel_dirs, std::string* path,
                  std::string* errors) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_override); env != nullptr && *env != '\0')
    candidates.emplace_back(env);
  candidates.push_back(soname);
  const std::string module_dir = ModuleDirectory();
  if (!module_dir.empty()) {
    for (const auto& d : wheel_dirs) candidates.push_back(module_dir + "/../" + d + "/" + soname);
  }
#ifdef JAXMX_CUDA_LIBRARY_HINT
  candidates.push_back(std::string(JAXMX_CUDA_LIBRARY_HINT) + "/" + soname);
#endif
  for (const auto& c : candidates) {
    if (void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      *path = c;
      return h;
    }
    const char* e = dlerror();
    *errors += "\n  " + c + ": " + (e ? e : "not found");
  }
  return nullptr;
}

const Api& GetApi() {
  static const Api* api = [] {
    auto* a = new Api();
    const std::string cudart_so = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
    const std::string cublaslt_so = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    const std::string cu = "nvidia/cu" + std::to_string(CUDART_VERSION / 1000) + "/lib";
    std::string errors;
    void* rt = OpenLibrary("JAXMX_CUDART_LIBRARY", cudart_so, {cu, "nvidia/cuda_runtime/lib"},
                           &a->info.cudart, &errors);
    void* lt = OpenLibrary("JAXMX_CUBLASLT_LIBRARY", cublaslt_so, {cu, "nvidia/cublas/lib"},
                           &a->info.cublaslt, &errors);
    if (rt == nullptr || lt == nullptr) {
      a->info.error = "could not load " + std::string(rt == nullptr ? cudart_so : cublaslt_so) +
                      " (set JAXMX_CUDART_LIBRARY / JAXMX_CUBLASLT_LIBRARY to its path, or "
                      "pip install nvidia-cuda-runtime nvidia-cublas); tried:" +
                      errors;
      return a;
    }
    std::string missing;
#define JAXMX_RESOLVE(lib, name)                                                                  \
  a->functions.name = reinterpret_cast<decltype(a->functions.name)>(dlsym(lib, JAXMX_STR(name))); \
  if (a->functions.name == nullptr) missing += std::string(" ") + JAXMX_STR(name);
#define JAXMX_RESOLVE_RT(name) JAXMX_RESOLVE(rt, name)
#define JAXMX_RESOLVE_LT(name) JAXMX_RESOLVE(lt, name)
    JAXMX_CUDART_FUNCTIONS(JAXMX_RESOLVE_RT)
    JAXMX_CUBLASLT_FUNCTIONS(JAXMX_RESOLVE_LT)
#undef JAXMX_RESOLVE_RT
#undef JAXMX_RESOLVE_LT
#undef JAXMX_RESOLVE
    if (!missing.empty()) {
      a->info.error =
          "symbols missing from " + a->info.cudart + " / " + a->info.cublaslt + ":" + missing;
      return a;
    }
    a->info.cublaslt_version = static_cast<int>(a->functions.cublasLtGetVersion());
    int rt_version = 0;
    if (a->functions.cudaRuntimeGetVersion(&rt_version) == cudaSuccess)
      a->info.cudart_version = rt_version;
    a->info.loaded = true;
    return a;
  }();
  return *api;
}

// --- the handlers ----------------------------------------------------------------------------

LtContext& Context(const Api& api) {
  static auto* context = new LtContext(api.functions);  // lives as long as the process
  return *context;
}

cudaDataType_t CudaType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN:
      return CUDA_R_8F_E4M3;
    case ffi::DataType::F8E5M2:
      return CUDA_R_8F_E5M2;
    case ffi::DataType::BF16:
      return CUDA_R_16BF;
    case ffi::DataType::F16:
      return CUDA_R_16F;
    default:  // F32: CheckGemm admits nothing else
      return CUDA_R_32F;
  }
}

ffi::ErrorCode FfiCode(LtCode code) {
  switch (code) {
    case LtCode::kInvalidArgument:
      return ffi::ErrorCode::kInvalidArgument;
    case LtCode::kFailedPrecondition:
      return ffi::ErrorCode::kFailedPrecondition;
    case LtCode::kUnimplemented:
      return ffi::ErrorCode::kUnimplemented;
    default:
      return ffi::ErrorCode::kInternal;
  }
}

enum class Stage { kInitialize, kExecute };

LtScaling Scaling(ScaleKind kind) {
  switch (kind) {
    case ScaleKind::kE8m0:
      return LtScaling::kBlockVec32E8M0;
    case ScaleKind::kFloat32:
      return LtScaling::kBlockF32;
    default:
      return LtScaling::kTensorF32;
  }
}

// Plans (initialize) or runs (execute) `gemm`, whose problem and pointers are filled in from the
// checked buffers, in the core.
ffi::Error RunInCore(Stage stage, const char* target, LtGemm gemm, const GemmProblem& p,
                     cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                     ffi::AnyBuffer lhs_scale, ffi::AnyBuffer rhs_scale,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  const Api& api = GetApi();
  if (!api.info.loaded)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(target) + ": " + api.info.error);
  gemm.batch = p.batch;
  gemm.m = p.m;
  gemm.n = p.n;
  gemm.k = p.k;
  gemm.out_type = CudaType(p.out_type);
  gemm.lhs = lhs.untyped_data();
  gemm.rhs = rhs.untyped_data();
  gemm.lhs_scale = lhs_scale.untyped_data();
  gemm.rhs_scale = rhs_scale.untyped_data();
  gemm.out = out->untyped_data();
  LtContext& context = Context(api);
  const LtStatus s =
      stage == Stage::kInitialize
          ? context.Prepare(device, gemm, workspace->untyped_data(), workspace->size_bytes())
          : context.Run(device, gemm, workspace->untyped_data(), workspace->size_bytes(), stream);
  if (s.ok()) return ffi::Error::Success();
  return ffi::Error(FfiCode(s.code), std::string(target) + ": " + s.message);
}

// Checks the buffers of an FP8 GEMM, then runs it in the core.
ffi::Error GemmCuda(Stage stage, const char* target, ScaleKind kind, bool fast_accum,
                    ScaleTiles tiles, KFirst k_first, cudaStream_t stream, int32_t device,
                    ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale,
                    ffi::AnyBuffer rhs_scale, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> workspace) {
  auto checked = CheckGemm(target, kind, lhs, rhs, lhs_scale, rhs_scale, *out, tiles, k_first);
  if (checked.has_error()) return checked.error();
  const GemmProblem& p = *checked;
  LtGemm gemm;
  gemm.scaling = Scaling(kind);
  gemm.lhs_type = CudaType(p.lhs_type);
  gemm.rhs_type = CudaType(p.rhs_type);
  gemm.fast_accum = fast_accum;
  gemm.lhs_tiled = p.lhs_tiled;
  gemm.rhs_tiled = p.rhs_tiled;
  gemm.lhs_k_first = p.lhs_k_first;
  gemm.rhs_k_first = p.rhs_k_first;
  return RunInCore(stage, target, gemm, p, stream, device, lhs, rhs, lhs_scale, rhs_scale, out,
                   workspace);
}

template <Stage stage>
ffi::Error MxMatmulCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                        ffi::AnyBuffer lhs_scale, ffi::AnyBuffer rhs_scale,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                        bool lhs_k_first, bool rhs_k_first) {
  return GemmCuda(stage, "jaxmx_mx_matmul", ScaleKind::kE8m0, false, {},
                  KFirst{lhs_k_first, rhs_k_first}, stream, device, lhs, rhs, lhs_scale, rhs_scale,
                  out, workspace);
}

template <Stage stage>
ffi::Error Fp8MatmulCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs,
                         ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale, ffi::AnyBuffer rhs_scale,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                         bool fast_accum) {
  return GemmCuda(stage, "jaxmx_fp8_matmul", ScaleKind::kFloat32Current, fast_accum, {}, {}, stream,
                  device, lhs, rhs, lhs_scale, rhs_scale, out, workspace);
}

template <Stage stage>
ffi::Error BlockFp8MatmulCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs,
                              ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale,
                              ffi::AnyBuffer rhs_scale, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace, bool lhs_tiled,
                              bool rhs_tiled) {
  return GemmCuda(stage, "jaxmx_block_fp8_matmul", ScaleKind::kFloat32, false,
                  ScaleTiles{lhs_tiled, rhs_tiled}, {}, stream, device, lhs, rhs, lhs_scale,
                  rhs_scale, out, workspace);
}

template <Stage stage>
ffi::Error Fp4MatmulCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs,
                         ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale, ffi::AnyBuffer rhs_scale,
                         ffi::AnyBuffer alpha_beta, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> workspace, bool nvfp4) {
  const char* target = "jaxmx_fp4_matmul";
  auto checked =
      CheckFp4Gemm(target, Fp4Format{nvfp4}, lhs, rhs, lhs_scale, rhs_scale, alpha_beta, *out);
  if (checked.has_error()) return checked.error();
  LtGemm gemm;
  gemm.scaling = nvfp4 ? LtScaling::kBlockVec16E4M3 : LtScaling::kBlockVec32E8M0;
  gemm.lhs_type = CUDA_R_4F_E2M1;
  gemm.rhs_type = CUDA_R_4F_E2M1;
  gemm.alpha_beta = static_cast<const float*>(alpha_beta.untyped_data());
  return RunInCore(stage, target, gemm, *checked, stream, device, lhs, rhs, lhs_scale, rhs_scale,
                   out, workspace);
}

}  // namespace

CudaLibraryInfo LoadCudaLibraries() { return GetApi().info; }

}  // namespace jaxmx

// One binding per stage: XLA runs initialize before each execution (outside graph capture), then
// execute (possibly captured into a command buffer).
#define JAXMX_CUDA_BINDING(stage)                                     \
  xla::ffi::Ffi::Bind<stage>()                                        \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                  \
      .Ctx<xla::ffi::DeviceOrdinal>() /* XLA's CUDA device ordinal */ \
      .Arg<xla::ffi::AnyBuffer>()     /* lhs [..., M, K] fp8 */       \
      .Arg<xla::ffi::AnyBuffer>()     /* rhs [..., N, K] fp8 */       \
      .Arg<xla::ffi::AnyBuffer>()     /* lhs scales */                \
      .Arg<xla::ffi::AnyBuffer>()     /* rhs scales */                \
      .Ret<xla::ffi::AnyBuffer>()     /* out [..., M, N] */           \
      .Ret<xla::ffi::AnyBuffer>()     /* cuBLASLt workspace (u8) */

using jaxmx::Stage;
using xla::ffi::ExecutionStage;

// jaxmx_mx_matmul: either operand may be K-first ([..., K, rows]; compute capability 10.x).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxMxMatmulCudaInitialize, jaxmx::MxMatmulCuda<Stage::kInitialize>,
                              JAXMX_CUDA_BINDING(ExecutionStage::kInitialize)
                                  .Attr<bool>("lhs_k_first")
                                  .Attr<bool>("rhs_k_first"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxMxMatmulCuda, jaxmx::MxMatmulCuda<Stage::kExecute>,
                              JAXMX_CUDA_BINDING(ExecutionStage::kExecute)
                                  .Attr<bool>("lhs_k_first")
                                  .Attr<bool>("rhs_k_first"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxmxFp8MatmulCudaInitialize, jaxmx::Fp8MatmulCuda<Stage::kInitialize>,
    JAXMX_CUDA_BINDING(ExecutionStage::kInitialize).Attr<bool>("fast_accum"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxFp8MatmulCuda, jaxmx::Fp8MatmulCuda<Stage::kExecute>,
                              JAXMX_CUDA_BINDING(ExecutionStage::kExecute).Attr<bool>("fast_accum"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxBlockFp8MatmulCudaInitialize,
                              jaxmx::BlockFp8MatmulCuda<Stage::kInitialize>,
                              JAXMX_CUDA_BINDING(ExecutionStage::kInitialize)
                                  .Attr<bool>("lhs_tiled")
                                  .Attr<bool>("rhs_tiled"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxmxBlockFp8MatmulCuda, jaxmx::BlockFp8MatmulCuda<Stage::kExecute>,
    JAXMX_CUDA_BINDING(ExecutionStage::kExecute).Attr<bool>("lhs_tiled").Attr<bool>("rhs_tiled"),
    {xla::ffi::Traits::kCmdBufferCompatible});

// jaxmx_fp4_matmul: the packed codes, the swizzled scales, then alpha_beta [..., 2] (device).
#define JAXMX_FP4_CUDA_BINDING(stage)                                 \
  xla::ffi::Ffi::Bind<stage>()                                        \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                  \
      .Ctx<xla::ffi::DeviceOrdinal>()                                 \
      .Arg<xla::ffi::AnyBuffer>() /* lhs [..., M, K/2] packed E2M1 */ \
      .Arg<xla::ffi::AnyBuffer>() /* rhs [..., N, K/2] packed E2M1 */ \
      .Arg<xla::ffi::AnyBuffer>() /* lhs scales, swizzled u8 */       \
      .Arg<xla::ffi::AnyBuffer>() /* rhs scales, swizzled u8 */       \
      .Arg<xla::ffi::AnyBuffer>() /* alpha_beta f32 [..., 2] */       \
      .Ret<xla::ffi::AnyBuffer>() /* out [..., M, N] */               \
      .Ret<xla::ffi::AnyBuffer>() /* cuBLASLt workspace (u8) */       \
      .Attr<bool>("nvfp4")        /* NVFP4 (VEC16_UE4M3), else MXFP4 (VEC32) */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxFp4MatmulCudaInitialize,
                              jaxmx::Fp4MatmulCuda<Stage::kInitialize>,
                              JAXMX_FP4_CUDA_BINDING(ExecutionStage::kInitialize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxFp4MatmulCuda, jaxmx::Fp4MatmulCuda<Stage::kExecute>,
                              JAXMX_FP4_CUDA_BINDING(ExecutionStage::kExecute),
                              {xla::ffi::Traits::kCmdBufferCompatible});
