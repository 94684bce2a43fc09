// cuBLASLt handlers of jaxmx_mx_matmul (MXFP8, CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0) and
// jaxmx_fp8_matmul (per-tensor FP8, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F).
//
// Host code only (no kernels, no nvcc). The CUDA runtime and cuBLASLt are loaded with dlopen on
// first use, so the extension imports and its CPU handlers run on machines without CUDA; the
// headers only provide types, enums and the function signatures.
//
// Row-major JAX operands, TN form: out [M, N] = lhs [M, K] . rhs [N, K]^T. cuBLASLt is
// column-major, so the handler computes out^T [N, M] (column-major, ld N == row-major out):
//   cuBLAS A := rhs, stored col-major [K, N] with ld K, op T      (A scale pointer: rhs scales)
//   cuBLAS B := lhs, stored col-major [K, M] with ld K, op N      (B scale pointer: lhs scales)
//   cuBLAS D := out, col-major [N, M] with ld N.
// Batched calls ([..., M, K]) issue one cublasLtMatmul per batch element on the same stream.
//
// Per call: no host synchronisation and, after the first call of a problem, no allocation: the
// cuBLASLt handle (per device), matmul descriptor, layouts and heuristic algorithm are cached by
// problem; the workspace is an XLA-allocated output buffer, so the handler is safe to capture
// into a command buffer (CUDA graph).
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "handlers.h"
#include "mx_common.h"

#define JAXMX_STR2(x) #x
#define JAXMX_STR(x) JAXMX_STR2(x)

namespace jaxmx {
namespace {

// --- run-time loading of libcudart and libcublasLt -------------------------------------------

#define JAXMX_CUDART_FUNCTIONS(X) \
  X(cudaRuntimeGetVersion)        \
  X(cudaGetErrorString)           \
  X(cudaDeviceGetAttribute)       \
  X(cudaMemsetAsync)

#define JAXMX_CUBLASLT_FUNCTIONS(X)       \
  X(cublasLtGetVersion)                   \
  X(cublasLtGetStatusString)              \
  X(cublasLtCreate)                       \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)          \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmul)

struct Api {
#define JAXMX_DECLARE(name) decltype(&::name) name = nullptr;
  JAXMX_CUDART_FUNCTIONS(JAXMX_DECLARE)
  JAXMX_CUBLASLT_FUNCTIONS(JAXMX_DECLARE)
#undef JAXMX_DECLARE
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
#define JAXMX_RESOLVE(lib, name)                                              \
  a->name = reinterpret_cast<decltype(a->name)>(dlsym(lib, JAXMX_STR(name))); \
  if (a->name == nullptr) missing += std::string(" ") + JAXMX_STR(name);
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
    a->info.cublaslt_version = static_cast<int>(a->cublasLtGetVersion());
    int rt_version = 0;
    if (a->cudaRuntimeGetVersion(&rt_version) == cudaSuccess) a->info.cudart_version = rt_version;
    a->info.loaded = true;
    return a;
  }();
  return *api;
}

// --- per-device state and the plan cache -----------------------------------------------------

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
  int capability = 0;  // major * 10 + minor
  std::string error;   // set when the device could not be initialised
};

struct PlanKey {
  int device, kind, lhs_type, rhs_type, out_type;
  int64_t m, n, k;
  uint32_t align_lhs, align_rhs, align_out;
  uint64_t workspace;
  bool operator<(const PlanKey& o) const {
    return std::tie(device, kind, lhs_type, rhs_type, out_type, m, n, k, align_lhs, align_rhs,
                    align_out, workspace) < std::tie(o.device, o.kind, o.lhs_type, o.rhs_type,
                                                     o.out_type, o.m, o.n, o.k, o.align_lhs,
                                                     o.align_rhs, o.align_out, o.workspace);
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::mutex mu;  // the scale pointers are set on `desc` right before each cublasLtMatmul
};

std::mutex g_mu;  // guards the two maps below (entries are never removed)
std::map<int, DeviceState>& Devices() {
  static auto* m = new std::map<int, DeviceState>();
  return *m;
}
std::map<PlanKey, std::unique_ptr<Plan>>& Plans() {
  static auto* m = new std::map<PlanKey, std::unique_ptr<Plan>>();
  return *m;
}

std::string CublasError(const Api& api, const char* what, cublasStatus_t s) {
  return std::string(what) + " failed: " + api.cublasLtGetStatusString(s) + " (" +
         std::to_string(static_cast<int>(s)) + ")";
}

DeviceState InitDevice(const Api& api, int device) {
  DeviceState st;
  int major = 0, minor = 0;
  cudaError_t e = api.cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess)
    e = api.cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e != cudaSuccess) {
    st.error = "cudaDeviceGetAttribute(device " + std::to_string(device) +
               ") failed: " + api.cudaGetErrorString(e);
    return st;
  }
  st.capability = major * 10 + minor;
  const cublasStatus_t s = api.cublasLtCreate(&st.handle);
  if (s != CUBLAS_STATUS_SUCCESS) st.error = CublasError(api, "cublasLtCreate", s);
  return st;
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
    default:
      return CUDA_R_32F;
  }
}

// Largest power of two <= 256 that divides the address of every batch element.
uint32_t Alignment(const void* base, int64_t stride_bytes, int64_t batch) {
  uint64_t bits = reinterpret_cast<uintptr_t>(base) | 256u;
  if (batch > 1) bits |= static_cast<uint64_t>(stride_bytes);
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// Builds descriptor, layouts and algorithm of a problem; `error` explains a failure.
std::string Capability(int cc) { return std::to_string(cc / 10) + "." + std::to_string(cc % 10); }

std::unique_ptr<Plan> MakePlan(const Api& api, const DeviceState& dev, const PlanKey& key,
                               const GemmProblem& p, ScaleKind kind, const void* a_scale,
                               const void* b_scale, std::string* error) {
  auto plan = std::make_unique<Plan>();
  cublasLtMatmulPreference_t pref = nullptr;
  bool ok = false;
  auto check = [&](cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS && error->empty()) *error = CublasError(api, what, s);
    return s == CUBLAS_STATUS_SUCCESS;
  };
  do {
    if (!check(api.cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate"))
      break;
    // Sets an A and a B attribute of the matmul descriptor (the A value first), naming them in
    // the error.
    auto set_pair = [&](cublasLtMatmulDescAttributes_t attr_a, const void* value_a,
                        cublasLtMatmulDescAttributes_t attr_b, const void* value_b, size_t size,
                        const char* what_a, const char* what_b) {
      return check(api.cublasLtMatmulDescSetAttribute(plan->desc, attr_a, value_a, size), what_a) &&
             check(api.cublasLtMatmulDescSetAttribute(plan->desc, attr_b, value_b, size), what_b);
    };
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    if (!set_pair(CUBLASLT_MATMUL_DESC_TRANSA, &op_t, CUBLASLT_MATMUL_DESC_TRANSB, &op_n,
                  sizeof op_t, "setting TRANSA", "setting TRANSB"))
      break;
    if (kind == ScaleKind::kBlockE8M0) {
      const cublasLtMatmulMatrixScale_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
      if (!set_pair(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                    &mode, sizeof mode, "setting A_SCALE_MODE = VEC32_UE8M0",
                    "setting B_SCALE_MODE = VEC32_UE8M0"))
        break;
    }
    // The heuristic sees this call's scale pointers; every call sets its own before the matmul.
    if (!set_pair(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                  CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof a_scale,
                  "setting A_SCALE_POINTER", "setting B_SCALE_POINTER"))
      break;
    if (!check(api.cublasLtMatrixLayoutCreate(&plan->a, CudaType(p.rhs_type), p.k, p.n, p.k),
               "cublasLtMatrixLayoutCreate(A = rhs)") ||
        !check(api.cublasLtMatrixLayoutCreate(&plan->b, CudaType(p.lhs_type), p.k, p.m, p.k),
               "cublasLtMatrixLayoutCreate(B = lhs)") ||
        !check(api.cublasLtMatrixLayoutCreate(&plan->d, CudaType(p.out_type), p.n, p.m, p.n),
               "cublasLtMatrixLayoutCreate(D = out^T)"))
      break;
    if (!check(api.cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate")) break;
    const uint64_t ws = key.workspace;
    auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value,
                        const char* what) {
      return check(api.cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value),
                   what);
    };
    if (!set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws, "setting MAX_WORKSPACE_BYTES") ||
        !set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_rhs,
                  "setting MIN_ALIGNMENT_A_BYTES") ||
        !set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_lhs,
                  "setting MIN_ALIGNMENT_B_BYTES") ||
        !set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_out,
                  "setting MIN_ALIGNMENT_C_BYTES") ||
        !set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_out,
                  "setting MIN_ALIGNMENT_D_BYTES"))
      break;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t s = api.cublasLtMatmulAlgoGetHeuristic(
        dev.handle, plan->desc, plan->a, plan->b, plan->d, plan->d, pref, 1, &result, &found);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
      *error = "cuBLASLt has no algorithm for " +
               std::string(kind == ScaleKind::kBlockE8M0 ? "MX block-scaled" : "per-tensor FP8") +
               " lhs " + DataTypeName(p.lhs_type) + " [" + std::to_string(p.m) + ", " +
               std::to_string(p.k) + "] x rhs " + DataTypeName(p.rhs_type) + " [" +
               std::to_string(p.n) + ", " + std::to_string(p.k) + "] -> " +
               DataTypeName(p.out_type) + " on compute capability " + Capability(dev.capability) +
               " (alignment lhs/rhs/out " + std::to_string(key.align_lhs) + "/" +
               std::to_string(key.align_rhs) + "/" + std::to_string(key.align_out) +
               " bytes, workspace " + std::to_string(ws) + " bytes)" +
               (s != CUBLAS_STATUS_SUCCESS ? ": " + CublasError(api, "heuristic", s) : "");
      break;
    }
    plan->algo = result.algo;
    ok = true;
  } while (false);
  if (pref != nullptr) api.cublasLtMatmulPreferenceDestroy(pref);
  if (!ok) {
    if (plan->a != nullptr) api.cublasLtMatrixLayoutDestroy(plan->a);
    if (plan->b != nullptr) api.cublasLtMatrixLayoutDestroy(plan->b);
    if (plan->d != nullptr) api.cublasLtMatrixLayoutDestroy(plan->d);
    if (plan->desc != nullptr) api.cublasLtMatmulDescDestroy(plan->desc);
    return nullptr;
  }
  return plan;
}

std::string Version(int v, int major_div) {  // 130100 -> "13.1" (div 10000); 13000 -> "13.0"
  return std::to_string(v / major_div) + "." + std::to_string(v % major_div / (major_div / 100));
}

ffi::Error GemmCuda(const char* target, ScaleKind kind, cudaStream_t stream, int32_t device,
                    ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale,
                    ffi::AnyBuffer rhs_scale, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> workspace) {
  auto checked = CheckGemm(target, kind, lhs, rhs, lhs_scale, rhs_scale, *out);
  if (checked.has_error()) return checked.error();
  const GemmProblem& p = *checked;
  const auto name = [target] { return std::string(target); };  // error paths only: no allocation

  const Api& api = GetApi();
  if (!api.info.loaded)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, name() + ": " + api.info.error);

  if (kind == ScaleKind::kBlockE8M0 && api.info.cublaslt_version < 120800)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      name() + ": cuBLASLt " + Version(api.info.cublaslt_version, 10000) +
                          " is loaded; MX block scaling needs CUDA/cuBLASLt >= 12.8");

  cudaError_t e = cudaSuccess;

  const DeviceState* dev;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto& devices = Devices();
    auto it = devices.find(device);
    if (it == devices.end()) it = devices.emplace(device, InitDevice(api, device)).first;
    dev = &it->second;
  }
  if (!dev->error.empty()) return ffi::Error::Internal(name() + ": " + dev->error);

  if (kind == ScaleKind::kBlockE8M0 && dev->capability < 100)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      name() + ": device " + std::to_string(device) + " has compute capability " +
                          Capability(dev->capability) +
                          "; MX block scaling (CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0) needs "
                          "compute capability >= 10.0 and CUDA >= 12.8 (use the emulation "
                          "backend on this device)");
  if (kind == ScaleKind::kTensorF32) {
    if (dev->capability < 89)
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        name() + ": device " + std::to_string(device) + " has compute capability " +
                            Capability(dev->capability) +
                            "; cuBLASLt FP8 matmul needs compute capability >= 8.9");
    if (p.lhs_type == ffi::DataType::F8E5M2 && p.rhs_type == ffi::DataType::F8E5M2)
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        name() +
                            ": cuBLASLt has no float8_e5m2 x float8_e5m2 matmul; make one "
                            "operand float8_e4m3fn");
    if (p.k % 16 != 0)
      return ffi::Error::InvalidArgument(
          name() + ": cuBLASLt FP8 matmul needs K % 16 == 0, got K = " + std::to_string(p.k));
  }

  const int64_t out_bytes = p.m * p.n * static_cast<int64_t>(ffi::ByteWidth(p.out_type));
  if (p.batch == 0 || p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {  // an empty sum: zeros
    e = api.cudaMemsetAsync(out->untyped_data(), 0, static_cast<size_t>(out_bytes * p.batch),
                            stream);
    if (e != cudaSuccess)
      return ffi::Error::Internal(name() +
                                  ": cudaMemsetAsync failed: " + api.cudaGetErrorString(e));
    return ffi::Error::Success();
  }

  const PlanKey key{device,
                    static_cast<int>(kind),
                    static_cast<int>(p.lhs_type),
                    static_cast<int>(p.rhs_type),
                    static_cast<int>(p.out_type),
                    p.m,
                    p.n,
                    p.k,
                    Alignment(lhs.untyped_data(), p.m * p.k, p.batch),
                    Alignment(rhs.untyped_data(), p.n * p.k, p.batch),
                    Alignment(out->untyped_data(), out_bytes, p.batch),
                    AlignWorkspace(workspace->untyped_data(), workspace->size_bytes()).size};
  Plan* plan;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto& plans = Plans();
    auto it = plans.find(key);
    if (it == plans.end()) {
      std::string error;
      auto made = MakePlan(api, *dev, key, p, kind, rhs_scale.untyped_data(),
                           lhs_scale.untyped_data(), &error);
      if (made == nullptr) return ffi::Error(ffi::ErrorCode::kUnimplemented, name() + ": " + error);
      it = plans.emplace(key, std::move(made)).first;
    }
    plan = it->second.get();
  }

  const float alpha = 1.0f, beta = 0.0f;
  const AlignedWorkspace ws = AlignWorkspace(workspace->untyped_data(), workspace->size_bytes());
  const auto* a_data = static_cast<const uint8_t*>(rhs.untyped_data());
  const auto* b_data = static_cast<const uint8_t*>(lhs.untyped_data());
  const auto* a_scale = static_cast<const uint8_t*>(rhs_scale.untyped_data());
  const auto* b_scale = static_cast<const uint8_t*>(lhs_scale.untyped_data());
  const int64_t scale_width = kind == ScaleKind::kBlockE8M0 ? 1 : 4;  // bytes per scale element
  auto* d = static_cast<uint8_t*>(out->untyped_data());
  std::lock_guard<std::mutex> lock(plan->mu);
  for (int64_t g = 0; g < p.batch; ++g) {
    const void* sa = a_scale + g * p.rhs_scale_stride * scale_width;
    const void* sb = b_scale + g * p.lhs_scale_stride * scale_width;
    cublasStatus_t s = api.cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = api.cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb,
                                             sizeof sb);
    if (s != CUBLAS_STATUS_SUCCESS)
      return ffi::Error::Internal(name() + ": " +
                                  CublasError(api, "setting the scale pointers", s));
    void* dg = d + g * out_bytes;
    s = api.cublasLtMatmul(dev->handle, plan->desc, &alpha, a_data + g * p.n * p.k, plan->a,
                           b_data + g * p.m * p.k, plan->b, &beta, dg, plan->d, dg, plan->d,
                           &plan->algo, ws.data, ws.size, stream);
    if (s != CUBLAS_STATUS_SUCCESS)
      return ffi::Error::Internal(name() + ": " + CublasError(api, "cublasLtMatmul", s));
  }
  return ffi::Error::Success();
}

ffi::Error MxMatmulCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs,
                            ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale, ffi::AnyBuffer rhs_scale,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> workspace) {
  return GemmCuda("jaxmx_mx_matmul", ScaleKind::kBlockE8M0, stream, device, lhs, rhs, lhs_scale,
                  rhs_scale, out, workspace);
}

ffi::Error Fp8MatmulCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs,
                             ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale, ffi::AnyBuffer rhs_scale,
                             ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> workspace) {
  return GemmCuda("jaxmx_fp8_matmul", ScaleKind::kTensorF32, stream, device, lhs, rhs, lhs_scale,
                  rhs_scale, out, workspace);
}

}  // namespace

CudaLibraryInfo LoadCudaLibraries() { return GetApi().info; }

}  // namespace jaxmx

#define JAXMX_CUDA_BINDING                                            \
  xla::ffi::Ffi::Bind()                                               \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                  \
      .Ctx<xla::ffi::DeviceOrdinal>() /* XLA's CUDA device ordinal */ \
      .Arg<xla::ffi::AnyBuffer>()     /* lhs [..., M, K] fp8 */       \
      .Arg<xla::ffi::AnyBuffer>()     /* rhs [..., N, K] fp8 */       \
      .Arg<xla::ffi::AnyBuffer>()     /* lhs scales */                \
      .Arg<xla::ffi::AnyBuffer>()     /* rhs scales */                \
      .Ret<xla::ffi::AnyBuffer>()     /* out [..., M, N] */           \
      .Ret<xla::ffi::AnyBuffer>()     /* cuBLASLt workspace (u8) */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxMxMatmulCuda, jaxmx::MxMatmulCudaImpl, JAXMX_CUDA_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxFp8MatmulCuda, jaxmx::Fp8MatmulCudaImpl, JAXMX_CUDA_BINDING,
                              {xla::ffi::Traits::kCmdBufferCompatible});
