#include "cublaslt_gemm.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "layout.h"

// The block-FP8 scale modes arrived in the cuBLASLt 12.9 headers; with older headers the core
// refuses block-FP8 calls instead of failing to compile.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
#define JAXMX_HAS_BLOCK_FP8_SCALING 1
#endif

namespace jaxmx {
namespace {

const char* TypeName(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_8F_E4M3:
      return "float8_e4m3fn";
    case CUDA_R_8F_E5M2:
      return "float8_e5m2";
    case CUDA_R_4F_E2M1:
      return "float4_e2m1fn";
    case CUDA_R_16BF:
      return "bfloat16";
    case CUDA_R_16F:
      return "float16";
    case CUDA_R_32F:
      return "float32";
    default:
      return "an unsupported type";
  }
}

int64_t TypeBytes(cudaDataType_t t) {
  return t == CUDA_R_32F ? 4 : (t == CUDA_R_16BF || t == CUDA_R_16F) ? 2 : 1;
}

bool IsFp4(const LtGemm& g) {
  return g.lhs_type == CUDA_R_4F_E2M1 || g.rhs_type == CUDA_R_4F_E2M1 ||
         g.scaling == LtScaling::kBlockVec16E4M3;
}

// Bytes of one batch element of an operand [rows, k] of type `t` (FP4: two elements per byte).
int64_t OperandBytes(cudaDataType_t t, int64_t rows, int64_t k) {
  return t == CUDA_R_4F_E2M1 ? rows * k / 2 : rows * k;
}

// Per-tensor scales, the float32 scale of each batch element one after the other, sit 4 bytes
// apart; cuBLASLt refuses a scale pointer that is not 16-byte aligned (NOT_SUPPORTED, measured on
// an H200 with cuBLASLt 13.1: offsets of 4 and 8 bytes refused, 16 taken). Each call therefore
// reads its two scales from slots 16 bytes apart at the end of the workspace, copied there on the
// stream before the calls (two strided copies).
constexpr int64_t kScaleSlot = 16;

// Bytes between the scales of consecutive batch elements of one operand.
int64_t ScaleStride(const LtGemm& g, int64_t rows, bool tiled) {
  switch (g.scaling) {
    case LtScaling::kTensorF32:
      return kScaleSlot;  // read from the slots (Run)
    case LtScaling::kBlockVec32E8M0:
      return SwizzledSize(rows, g.k / kBlock).value_or(0);
    case LtScaling::kBlockVec16E4M3:
      return SwizzledSize(rows, g.k / kFp4Block16).value_or(0);
    default:
      return Fp8BlockScaleShape(rows, g.k, tiled).elements() * static_cast<int64_t>(sizeof(float));
  }
}

const char* ScalingName(LtScaling s) {
  switch (s) {
    case LtScaling::kBlockVec32E8M0:
      return "MX block-scaled";
    case LtScaling::kBlockF32:
      return "block-FP8 (1x128 / 128x128 float32 scales)";
    case LtScaling::kBlockVec16E4M3:
      return "NVFP4 block-scaled";
    default:
      return "per-tensor FP8";
  }
}

std::string Capability(int cc) { return std::to_string(cc / 10) + "." + std::to_string(cc % 10); }

std::string Version(int v) {  // 120803 -> "12.8.3"
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

// " [rows, k]", or " [k, rows] (K-first)"
std::string Dims(int64_t rows, int64_t k, bool k_first) {
  const std::string r = std::to_string(rows), c = std::to_string(k);
  return k_first ? " [" + c + ", " + r + "] (K-first)" : " [" + r + ", " + c + "]";
}

LtStatus Error(LtCode code, std::string message) { return {code, std::move(message)}; }

std::string CublasError(const CublasLtApi& api, const char* what, cublasStatus_t s) {
  return std::string(what) + " failed: " + api.cublasLtGetStatusString(s) + " (" +
         std::to_string(static_cast<int>(s)) + ")";
}

// Runs `fn` with `ordinal` as the calling thread's current CUDA device, then restores the
// previous one (the handle and the heuristic belong to the device of the call, not to whichever
// device the thread last used).
template <typename Fn>
LtStatus OnDevice(const CublasLtApi& api, int ordinal, Fn&& fn) {
  int previous = 0;
  cudaError_t e = api.cudaGetDevice(&previous);
  if (e == cudaSuccess && previous != ordinal) e = api.cudaSetDevice(ordinal);
  if (e != cudaSuccess)
    return Error(LtCode::kInternal, "selecting CUDA device " + std::to_string(ordinal) +
                                        " failed: " + api.cudaGetErrorString(e));
  LtStatus status = fn();
  if (previous != ordinal) api.cudaSetDevice(previous);
  return status;
}

// Bytes at the end of the workspace that hold the slots of a per-tensor GEMM (none for the other
// scalings), a multiple of the workspace alignment so that cuBLASLt's part keeps it.
uint64_t ScaleSlotBytes(const LtGemm& g) {
  if (g.scaling != LtScaling::kTensorF32) return 0;
  const uint64_t bytes = static_cast<uint64_t>(2 * kScaleSlot * std::max<int64_t>(g.batch, 1));
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// The workspace split into cuBLASLt's part and the scale slots (ScaleSlotBytes) after it; a
// workspace too small for both leaves cuBLASLt none (the heuristic then picks an algorithm that
// needs none) and the slots null, which Run reports.
struct SplitWorkspace {
  AlignedWorkspace lt;
  uint8_t* slots = nullptr;
};

SplitWorkspace Split(const LtGemm& g, void* workspace, uint64_t workspace_bytes) {
  const AlignedWorkspace ws = AlignWorkspace(workspace, workspace_bytes);
  const uint64_t slot_bytes = ScaleSlotBytes(g);
  if (slot_bytes > ws.size) return {{ws.data, 0}, nullptr};
  // the slots start at an aligned address: after cuBLASLt's part, rounded down to the alignment
  const uint64_t lt_bytes = (ws.size - slot_bytes) / kWorkspaceAlignment * kWorkspaceAlignment;
  return {{ws.data, lt_bytes}, static_cast<uint8_t*>(ws.data) + lt_bytes};
}

// Largest power of two <= 256 that divides the address of every batch element.
uint32_t Alignment(const void* base, int64_t stride_bytes, int64_t batch) {
  uint64_t bits = reinterpret_cast<uintptr_t>(base) | 256u;
  if (batch > 1) bits |= static_cast<uint64_t>(stride_bytes);
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// Batch elements one cublasLtMatmul covers: all of them for MXFP8 (strided batch: each operand,
// the output and each scale tensor advance by one element's size), one for per-tensor and block
// FP8 scales and for FP4 (each call gets its element's scale and alpha pointers).
int64_t StridedBatch(const LtGemm& g) {
  return g.scaling == LtScaling::kBlockVec32E8M0 && !IsFp4(g) ? g.batch : 1;
}

// A matrix layout to create: column-major [rows, cols], ld = rows.
struct Matrix {
  cublasLtMatrixLayout_t* layout;
  cudaDataType_t type;
  int64_t rows, cols;
  const char* what;
};

// `s` as a status: ok, or kInternal naming the step (`what`) and cuBLASLt's status string.
LtStatus Status(const CublasLtApi& api, cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return {};
  return Error(LtCode::kInternal, CublasError(api, what, s));
}

// Sets one matmul-descriptor attribute to `value` (its size: sizeof value).
template <typename T>
LtStatus SetDesc(const CublasLtApi& api, cublasLtMatmulDesc_t desc,
                 cublasLtMatmulDescAttributes_t attr, const T& value, const char* what) {
  return Status(api, api.cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof value), what);
}

// TRANSA / TRANSB: TN, or for a K-first operand its untransposed storage (see cublaslt_gemm.h);
// for FP4, alpha and beta read from device memory (POINTER_MODE_DEVICE).
LtStatus SetOperations(const CublasLtApi& api, cublasLtMatmulDesc_t desc, const LtGemm& g) {
  const cublasOperation_t op_a = g.rhs_k_first ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_b = g.lhs_k_first ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (LtStatus s = SetDesc(api, desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a, "setting TRANSA"); !s.ok())
    return s;
  if (LtStatus s = SetDesc(api, desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b, "setting TRANSB"); !s.ok())
    return s;
  if (g.alpha_beta == nullptr) return {};
  const int32_t device_mode = CUBLASLT_POINTER_MODE_DEVICE;
  return SetDesc(api, desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, device_mode, "setting POINTER_MODE");
}

// A_SCALE_MODE (the rhs's) and B_SCALE_MODE (the lhs's).
LtStatus SetScaleModePair(const CublasLtApi& api, cublasLtMatmulDesc_t desc,
                          cublasLtMatmulMatrixScale_t a_mode, cublasLtMatmulMatrixScale_t b_mode) {
  if (LtStatus s =
          SetDesc(api, desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, a_mode, "setting A_SCALE_MODE");
      !s.ok())
    return s;
  return SetDesc(api, desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, b_mode, "setting B_SCALE_MODE");
}

// A_SCALE_POINTER (rhs scales) and B_SCALE_POINTER (lhs scales): the heuristic sees this call's
// pointers; every call sets its own before the matmul (LtContext::Enqueue).
LtStatus SetScalePointers(const CublasLtApi& api, cublasLtMatmulDesc_t desc, const LtGemm& g) {
  if (LtStatus s = SetDesc(api, desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, g.rhs_scale,
                           "setting A_SCALE_POINTER");
      !s.ok())
    return s;
  return SetDesc(api, desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, g.lhs_scale,
                 "setting B_SCALE_POINTER");
}

// One matrix layout, stored column-major [rows, cols] with ld = rows; with batch > 1, strided
// batched (rows * cols elements between batch elements).
LtStatus CreateLayout(const CublasLtApi& api, const Matrix& x, int32_t batch) {
  if (LtStatus s = Status(
          api, api.cublasLtMatrixLayoutCreate(x.layout, x.type, x.rows, x.cols, x.rows), x.what);
      !s.ok())
    return s;
  if (batch <= 1) return {};
  const int64_t stride = x.rows * x.cols;
  if (LtStatus s = Status(api,
                          api.cublasLtMatrixLayoutSetAttribute(
                              *x.layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch),
                          x.what);
      !s.ok())
    return s;
  return Status(api,
                api.cublasLtMatrixLayoutSetAttribute(
                    *x.layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
                x.what);
}

// Sets one preference attribute to `value`.
template <typename T>
LtStatus SetPref(const CublasLtApi& api, cublasLtMatmulPreference_t pref,
                 cublasLtMatmulPreferenceAttributes_t attr, const T& value, const char* what) {
  return Status(api, api.cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value),
                what);
}

// The heuristic's constraints: the workspace size and the alignments of A = rhs, B = lhs and
// C = D = out.
LtStatus SetPreferences(const CublasLtApi& api, cublasLtMatmulPreference_t pref, uint64_t workspace,
                        uint32_t align_lhs, uint32_t align_rhs, uint32_t align_out) {
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    uint32_t value;
    const char* what;
  } alignments[4] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_rhs, "setting MIN_ALIGNMENT_A_BYTES"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_lhs, "setting MIN_ALIGNMENT_B_BYTES"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_out, "setting MIN_ALIGNMENT_C_BYTES"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_out, "setting MIN_ALIGNMENT_D_BYTES"},
  };
  if (LtStatus s = SetPref(api, pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace,
                           "setting MAX_WORKSPACE_BYTES");
      !s.ok())
    return s;
  for (const auto& a : alignments) {
    if (LtStatus s = SetPref(api, pref, a.attr, a.value, a.what); !s.ok()) return s;
  }
  return {};
}

}  // namespace

bool LtContext::PlanKey::operator<(const PlanKey& o) const {
  return std::tie(device, scaling, lhs_type, rhs_type, out_type, batch, m, n, k, align_lhs,
                  align_rhs, align_out, workspace, fast_accum, lhs_tiled, rhs_tiled, lhs_k_first,
                  rhs_k_first) < std::tie(o.device, o.scaling, o.lhs_type, o.rhs_type, o.out_type,
                                          o.batch, o.m, o.n, o.k, o.align_lhs, o.align_rhs,
                                          o.align_out, o.workspace, o.fast_accum, o.lhs_tiled,
                                          o.rhs_tiled, o.lhs_k_first, o.rhs_k_first);
}

LtContext::LtContext(const CublasLtApi& api)
    : api_(api), cublaslt_version_(static_cast<int>(api.cublasLtGetVersion())) {}

LtContext::~LtContext() {
  for (auto& [key, plan] : plans_) Destroy(*plan);
  for (auto& [ordinal, device] : devices_) {
    if (device->handle != nullptr) api_.cublasLtDestroy(device->handle);
  }
}

void LtContext::Destroy(Plan& plan) const {
  if (plan.a != nullptr) api_.cublasLtMatrixLayoutDestroy(plan.a);
  if (plan.b != nullptr) api_.cublasLtMatrixLayoutDestroy(plan.b);
  if (plan.d != nullptr) api_.cublasLtMatrixLayoutDestroy(plan.d);
  if (plan.desc != nullptr) api_.cublasLtMatmulDescDestroy(plan.desc);
}

LtStatus LtContext::GetDevice(int ordinal, Device** device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = devices_.find(ordinal);
  if (it == devices_.end()) {
    auto made = std::make_unique<Device>();
    int major = 0, minor = 0;
    cudaError_t e = api_.cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal);
    if (e == cudaSuccess)
      e = api_.cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal);
    if (e != cudaSuccess) {
      made->error = "cudaDeviceGetAttribute(device " + std::to_string(ordinal) +
                    ") failed: " + api_.cudaGetErrorString(e);
    } else {
      made->capability = major * 10 + minor;
      const LtStatus created = OnDevice(api_, ordinal, [&] {
        const cublasStatus_t s = api_.cublasLtCreate(&made->handle);
        return s == CUBLAS_STATUS_SUCCESS
                   ? LtStatus{}
                   : Error(LtCode::kInternal, CublasError(api_, "cublasLtCreate", s));
      });
      if (!created.ok()) made->error = created.message;
    }
    it = devices_.emplace(ordinal, std::move(made)).first;
  }
  *device = it->second.get();
  if (!(*device)->error.empty()) return Error(LtCode::kInternal, (*device)->error);
  return {};
}

// What the device and the loaded cuBLASLt support, compute capability first (an old cuBLASLt on
// an old GPU is told about the GPU).
LtStatus LtContext::Check(int ordinal, const Device& device, const LtGemm& g) const {
  const std::string on = "device " + std::to_string(ordinal) + " has compute capability " +
                         Capability(device.capability);
  if (g.batch < 0 || g.m < 0 || g.n < 0 || g.k < 0)
    return Error(LtCode::kInvalidArgument, "negative GEMM dimensions");
  if (g.lhs_k_first || g.rhs_k_first) {
    if (LtStatus s = CheckKFirst(on, device.capability, g); !s.ok()) return s;
  }
  if (IsFp4(g)) return CheckFp4(on, device.capability, g);
  if (g.lhs_type == CUDA_R_8F_E5M2 && g.rhs_type == CUDA_R_8F_E5M2)
    return Error(LtCode::kUnimplemented,
                 "cuBLASLt has no float8_e5m2 x float8_e5m2 matmul (its FP8 GEMMs take E4M3 x "
                 "E4M3, E4M3 x E5M2 and E5M2 x E4M3); make one operand float8_e4m3fn");
  if (g.scaling == LtScaling::kBlockVec32E8M0) {
    if (device.capability < 100)
      return Error(LtCode::kFailedPrecondition,
                   on + "; MX block scaling (CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0) needs "
                        "compute capability >= 10.0 and CUDA >= 12.8 (use the emulation "
                        "backend on this device)");
    if (cublaslt_version_ < 120800)
      return Error(LtCode::kFailedPrecondition,
                   "cuBLASLt " + Version(cublaslt_version_) +
                       " is loaded; MX block scaling needs CUDA/cuBLASLt >= 12.8");
    if (g.k % kBlock != 0)
      return Error(
          LtCode::kInvalidArgument,
          "K must be a multiple of 32 for MX block scaling, got K = " + std::to_string(g.k));
  } else if (g.scaling == LtScaling::kBlockF32) {
    if (LtStatus s = CheckBlockF32(on, device.capability, g); !s.ok()) return s;
  } else {
    if (device.capability < 89)
      return Error(LtCode::kFailedPrecondition,
                   on + "; cuBLASLt FP8 matmul needs compute capability >= 8.9");
    if (g.k % 16 != 0)
      return Error(LtCode::kInvalidArgument,
                   "cuBLASLt FP8 matmul needs K % 16 == 0, got K = " + std::to_string(g.k));
  }
  return {};
}

// Block FP8: compute capability 9.x, cuBLASLt >= 12.9 (and headers that know the modes),
// K % 128 == 0, not 128x128 x 128x128, and a 1x128 operand's rows (the leading dimension of its
// [K / 128, rows] scale matrix) a multiple of 4, so that every scale column is 16-byte aligned.
// K-first operands (a non-TN matmul, see cublaslt_gemm.h): MXFP8 only, on compute capability
// 10.x only, and their rows (the leading dimension) a multiple of 16 bytes.
LtStatus LtContext::CheckKFirst(const std::string& on, int capability, const LtGemm& g) const {
  if (g.scaling != LtScaling::kBlockVec32E8M0 || IsFp4(g))
    return Error(LtCode::kUnimplemented,
                 std::string("K-first ([K, rows]) operands are taken by the MXFP8 GEMM only; ") +
                     ScalingName(g.scaling) + (IsFp4(g) ? " FP4" : "") +
                     " operands must be in TN form ([rows, K])");
  if (capability / 10 != 10)
    return Error(LtCode::kFailedPrecondition,
                 on + "; cuBLASLt runs MXFP8 with K-first (non-TN) operands on compute capability "
                      "10.x only (8.9, 9.x and 12.x have TN kernels only): pass the operands in "
                      "TN form ([rows, K])");
  const int64_t rows[2] = {g.m, g.n};
  const bool k_first[2] = {g.lhs_k_first, g.rhs_k_first};
  const char* names[2] = {"lhs rows M", "rhs rows N"};
  for (int s = 0; s < 2; ++s) {
    if (k_first[s] && rows[s] % 16 != 0)
      return Error(LtCode::kInvalidArgument,
                   std::string(names[s]) +
                       " of a K-first operand must be a multiple of 16 (its leading dimension, "
                       "16-byte aligned for cuBLASLt), got " +
                       std::to_string(rows[s]));
  }
  return {};
}

LtStatus LtContext::CheckBlockF32(const std::string& on, int capability, const LtGemm& g) const {
#ifndef JAXMX_HAS_BLOCK_FP8_SCALING
  return Error(LtCode::kUnimplemented,
               "the extension was built with cuBLASLt headers older than 12.9, which lack the "
               "block-FP8 scale modes (VEC128_32F, BLK128x128_32F); rebuild with CUDA >= 12.9");
#else
  if (capability / 10 != 9)
    return Error(LtCode::kFailedPrecondition,
                 on + "; block-FP8 scaling (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / "
                      "BLK128x128_32F) runs on compute capability 9.x (Hopper) with CUDA >= 12.9 "
                      "(use the emulation backend on this device)");
  if (cublaslt_version_ < 120900)
    return Error(LtCode::kFailedPrecondition,
                 "cuBLASLt " + Version(cublaslt_version_) +
                     " is loaded; block-FP8 scaling needs CUDA/cuBLASLt >= 12.9");
  if (g.k % kFp8Block != 0)
    return Error(
        LtCode::kInvalidArgument,
        "K must be a multiple of 128 for block-FP8 scaling, got K = " + std::to_string(g.k));
  if (g.lhs_tiled && g.rhs_tiled)
    return Error(LtCode::kUnimplemented,
                 "cuBLASLt has no 128x128 x 128x128 block-FP8 matmul (it takes 1x128 x 1x128, "
                 "1x128 x 128x128 and 128x128 x 1x128 scales)");
  const int64_t rows[2] = {g.m, g.n};
  const bool tiled[2] = {g.lhs_tiled, g.rhs_tiled};
  const char* names[2] = {"lhs rows M", "rhs rows N"};
  for (int s = 0; s < 2; ++s) {
    if (!tiled[s] && rows[s] % 4 != 0)
      return Error(LtCode::kInvalidArgument,
                   std::string(names[s]) +
                       " must be a multiple of 4 with 1x128 scales (the "
                       "[K / 128, rows] float32 scale matrix keeps 16-byte aligned columns), got " +
                       std::to_string(rows[s]));
  }
  return {};
#endif
}

// FP4 (CUDA_R_4F_E2M1 A and B): NVFP4 (VEC16_UE4M3) or MXFP4 (VEC32_UE8M0) block scaling, compute
// capability >= 10.0, cuBLASLt >= 12.8, K a multiple of 32 (16-byte leading dimensions: cuBLASLt
// needs 16-byte aligned operands and leading dimensions, i.e. 32 packed E2M1 elements) and
// device alpha / beta.
LtStatus LtContext::CheckFp4(const std::string& on, int capability, const LtGemm& g) const {
  const bool lhs_fp4 = g.lhs_type == CUDA_R_4F_E2M1, rhs_fp4 = g.rhs_type == CUDA_R_4F_E2M1;
  if (lhs_fp4 != rhs_fp4)
    return Error(LtCode::kUnimplemented, std::string("cuBLASLt has no matmul of ") +
                                             TypeName(g.lhs_type) + " x " + TypeName(g.rhs_type) +
                                             ": FP4 operands go with FP4 operands");
  if (!lhs_fp4)
    return Error(LtCode::kUnimplemented,
                 std::string("NVFP4 block scaling (VEC16_UE4M3) takes float4_e2m1fn operands, "
                             "got ") +
                     TypeName(g.lhs_type) + " x " + TypeName(g.rhs_type));
  if (g.scaling != LtScaling::kBlockVec16E4M3 && g.scaling != LtScaling::kBlockVec32E8M0)
    return Error(LtCode::kUnimplemented,
                 "FP4 operands need block scaling: NVFP4 (VEC16_UE4M3) or MXFP4 (VEC32_UE8M0)");
  if (capability < 100)
    return Error(LtCode::kFailedPrecondition,
                 on + "; FP4 block-scaled matmul (NVFP4 / MXFP4) needs compute capability >= 10.0 "
                      "and CUDA >= 12.8 (use the emulation backend on this device)");
  if (cublaslt_version_ < 120800)
    return Error(LtCode::kFailedPrecondition,
                 "cuBLASLt " + Version(cublaslt_version_) +
                     " is loaded; FP4 block scaling needs CUDA/cuBLASLt >= 12.8");
  if (g.k % kFp4KMultiple != 0)
    return Error(LtCode::kInvalidArgument,
                 "K must be a multiple of 32 for FP4 (16-byte leading dimensions of packed E2M1 "
                 "codes), got K = " +
                     std::to_string(g.k));
  if (g.alpha_beta == nullptr)
    return Error(LtCode::kInvalidArgument,
                 "an FP4 GEMM takes alpha and beta from device memory; alpha_beta is null");
  return {};
}

// A plan: the matmul descriptor (compute type, transposes, scale modes and pointers), the
// layouts of A, B and D, and the algorithm the heuristic picks for them. On an error the parts
// made so far stay in `plan` for Destroy.
LtStatus LtContext::MakePlan(const Device& device, const PlanKey& key, const LtGemm& g,
                             Plan* plan) {
  if (LtStatus s =
          Status(api_, api_.cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "cublasLtMatmulDescCreate");
      !s.ok())
    return s;
  if (LtStatus s = SetOperations(api_, plan->desc, g); !s.ok()) return s;
  if (LtStatus s = SetScaleModes(plan->desc, g); !s.ok()) return s;
  if (LtStatus s = SetScalePointers(api_, plan->desc, g); !s.ok()) return s;
  if (LtStatus s = CreateLayouts(key, g, plan); !s.ok()) return s;
  return ChooseAlgorithm(device, key, g, plan);
}

// The scale modes: VEC32_UE8M0 / VEC16_UE4M3 on both operands (plus, on the cuBLASLt versions
// whose heuristic cache MX shares with per-tensor FP8, the dummy ALPHA_VECTOR_BATCH_STRIDE),
// VEC128_32F / BLK128x128_32F per operand for block FP8, or per-tensor scaling's default
// (SCALAR_32F) with FAST_ACCUM when asked.
LtStatus LtContext::SetScaleModes(cublasLtMatmulDesc_t desc, const LtGemm& g) const {
  if (g.scaling == LtScaling::kBlockVec32E8M0 || g.scaling == LtScaling::kBlockVec16E4M3) {
    const cublasLtMatmulMatrixScale_t mode = g.scaling == LtScaling::kBlockVec16E4M3
                                                 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3
                                                 : CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    if (LtStatus s = SetScaleModePair(api_, desc, mode, mode); !s.ok()) return s;
    if (IsFp4(g) || cublaslt_version_ > kLastCublasLtWithSharedHeuristicCache) return {};
    const int64_t dummy_stride = 1;
    return SetDesc(api_, desc, CUBLASLT_MATMUL_DESC_ALPHA_VECTOR_BATCH_STRIDE, dummy_stride,
                   "setting ALPHA_VECTOR_BATCH_STRIDE");
  }
  if (g.scaling == LtScaling::kBlockF32) {
#ifdef JAXMX_HAS_BLOCK_FP8_SCALING
    auto mode = [](bool tiled) {
      return tiled ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                   : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    };
    return SetScaleModePair(api_, desc, mode(g.rhs_tiled), mode(g.lhs_tiled));
#else
    return {};
#endif
  }
  if (!g.fast_accum) return {};
  const int8_t on = 1;
  return SetDesc(api_, desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, on, "setting FAST_ACCUM");
}

// The layouts of A = rhs, B = lhs and D = out^T, column-major [rows, cols] with ld = rows (see
// cublaslt_gemm.h), strided-batched over key.batch elements.
LtStatus LtContext::CreateLayouts(const PlanKey& key, const LtGemm& g, Plan* plan) const {
  const Matrix matrices[3] = {
      g.rhs_k_first ? Matrix{&plan->a, g.rhs_type, g.n, g.k, "the layout of A = rhs (K-first)"}
                    : Matrix{&plan->a, g.rhs_type, g.k, g.n, "the layout of A = rhs"},
      g.lhs_k_first ? Matrix{&plan->b, g.lhs_type, g.m, g.k, "the layout of B = lhs (K-first)"}
                    : Matrix{&plan->b, g.lhs_type, g.k, g.m, "the layout of B = lhs"},
      {&plan->d, g.out_type, g.n, g.m, "the layout of D = out^T"},
  };
  for (const Matrix& x : matrices) {
    if (LtStatus s = CreateLayout(api_, x, static_cast<int32_t>(key.batch)); !s.ok()) return s;
  }
  return {};
}

// The heuristic's first algorithm for the plan's descriptors under the key's workspace size and
// operand alignments, or an error that names the problem.
LtStatus LtContext::ChooseAlgorithm(const Device& device, const PlanKey& key, const LtGemm& g,
                                    Plan* plan) const {
  cublasLtMatmulPreference_t pref = nullptr;
  if (LtStatus s = Status(api_, api_.cublasLtMatmulPreferenceCreate(&pref),
                          "cublasLtMatmulPreferenceCreate");
      !s.ok())
    return s;
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t heuristic = CUBLAS_STATUS_SUCCESS;
  LtStatus status =
      SetPreferences(api_, pref, key.workspace, key.align_lhs, key.align_rhs, key.align_out);
  if (status.ok())
    heuristic = api_.cublasLtMatmulAlgoGetHeuristic(device.handle, plan->desc, plan->a, plan->b,
                                                    plan->d, plan->d, pref, 1, &result, &found);
  api_.cublasLtMatmulPreferenceDestroy(pref);
  if (!status.ok()) return status;
  if (heuristic != CUBLAS_STATUS_SUCCESS || found == 0)
    return NoAlgorithm(device, key, g, heuristic);
  plan->algo = result.algo;
  return {};
}

LtStatus LtContext::NoAlgorithm(const Device& device, const PlanKey& key, const LtGemm& g,
                                cublasStatus_t heuristic) const {
  return Error(
      LtCode::kUnimplemented,
      "cuBLASLt has no algorithm for " + std::string(ScalingName(g.scaling)) + " lhs " +
          TypeName(g.lhs_type) + Dims(g.m, g.k, g.lhs_k_first) + " x rhs " + TypeName(g.rhs_type) +
          Dims(g.n, g.k, g.rhs_k_first) + " -> " + TypeName(g.out_type) + ", batch " +
          std::to_string(key.batch) + ", on compute capability " + Capability(device.capability) +
          " (alignment lhs/rhs/out " + std::to_string(key.align_lhs) + "/" +
          std::to_string(key.align_rhs) + "/" + std::to_string(key.align_out) +
          " bytes, workspace " + std::to_string(key.workspace) + " bytes)" +
          (heuristic != CUBLAS_STATUS_SUCCESS ? ": " + CublasError(api_, "heuristic", heuristic)
                                              : ""));
}

LtStatus LtContext::GetPlan(int ordinal, const Device& device, const LtGemm& g, uint64_t workspace,
                            Plan** plan) {
  const int64_t batch = StridedBatch(g), out_bytes = g.m * g.n * TypeBytes(g.out_type);
  const PlanKey key{ordinal,
                    static_cast<int>(g.scaling),
                    static_cast<int>(g.lhs_type),
                    static_cast<int>(g.rhs_type),
                    static_cast<int>(g.out_type),
                    batch,
                    g.m,
                    g.n,
                    g.k,
                    Alignment(g.lhs, OperandBytes(g.lhs_type, g.m, g.k), g.batch),
                    Alignment(g.rhs, OperandBytes(g.rhs_type, g.n, g.k), g.batch),
                    Alignment(g.out, out_bytes, g.batch),
                    workspace,
                    g.scaling == LtScaling::kTensorF32 && g.fast_accum,
                    g.scaling == LtScaling::kBlockF32 && g.lhs_tiled,
                    g.scaling == LtScaling::kBlockF32 && g.rhs_tiled,
                    g.lhs_k_first,
                    g.rhs_k_first};
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto made = std::make_unique<Plan>();
    const LtStatus s =
        OnDevice(api_, ordinal, [&] { return MakePlan(device, key, g, made.get()); });
    if (!s.ok()) {
      Destroy(*made);
      return s;
    }
    it = plans_.emplace(key, std::move(made)).first;
  }
  *plan = it->second.get();
  return {};
}

LtStatus LtContext::Prepare(int device, const LtGemm& gemm, void* workspace,
                            uint64_t workspace_bytes) {
  Device* dev = nullptr;
  if (LtStatus s = GetDevice(device, &dev); !s.ok()) return s;
  if (LtStatus s = Check(device, *dev, gemm); !s.ok()) return s;
  if (gemm.batch == 0 || gemm.m == 0 || gemm.n == 0 || gemm.k == 0) return {};
  Plan* plan = nullptr;
  return GetPlan(device, *dev, gemm, Split(gemm, workspace, workspace_bytes).lt.size, &plan);
}

LtStatus LtContext::Run(int device, const LtGemm& gemm, void* workspace, uint64_t workspace_bytes,
                        cudaStream_t stream) {
  Device* dev = nullptr;
  if (LtStatus s = GetDevice(device, &dev); !s.ok()) return s;
  if (LtStatus s = Check(device, *dev, gemm); !s.ok()) return s;
  if (gemm.batch == 0 || gemm.m == 0 || gemm.n == 0) return {};
  if (gemm.k == 0) {  // an empty sum: zeros
    const size_t bytes =
        static_cast<size_t>(gemm.batch * gemm.m * gemm.n * TypeBytes(gemm.out_type));
    const cudaError_t e = api_.cudaMemsetAsync(gemm.out, 0, bytes, stream);
    if (e != cudaSuccess)
      return Error(LtCode::kInternal,
                   std::string("cudaMemsetAsync failed: ") + api_.cudaGetErrorString(e));
    return {};
  }
  const SplitWorkspace ws = Split(gemm, workspace, workspace_bytes);
  Plan* plan = nullptr;
  if (LtStatus s = GetPlan(device, *dev, gemm, ws.lt.size, &plan); !s.ok()) return s;
  // every call's scales read in place where they are aligned already (one GEMM, in practice)
  if (ScaleSlotBytes(gemm) == 0 ||
      std::min(Alignment(gemm.rhs_scale, sizeof(float), gemm.batch),
               Alignment(gemm.lhs_scale, sizeof(float), gemm.batch)) >= kScaleSlot)
    return Enqueue(*dev, gemm, *plan, ws.lt.data, ws.lt.size, stream);
  if (ws.slots == nullptr)
    return Error(LtCode::kInternal, "the workspace (" + std::to_string(workspace_bytes) +
                                        " bytes) has no room for the scale slots of a batch of " +
                                        std::to_string(gemm.batch));
  LtGemm slotted = gemm;  // the scales, 16 bytes apart: rhs (A) slots first, then lhs (B)
  for (const auto& [from, to] : {std::pair{gemm.rhs_scale, ws.slots},
                                 std::pair{gemm.lhs_scale, ws.slots + kScaleSlot * gemm.batch}}) {
    const cudaError_t e = api_.cudaMemcpy2DAsync(to, kScaleSlot, from, sizeof(float), sizeof(float),
                                                 gemm.batch, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess)
      return Error(LtCode::kInternal,
                   std::string("copying the scales to their slots: ") + api_.cudaGetErrorString(e));
  }
  slotted.rhs_scale = ws.slots;
  slotted.lhs_scale = ws.slots + kScaleSlot * gemm.batch;
  return Enqueue(*dev, slotted, *plan, ws.lt.data, ws.lt.size, stream);
}

LtStatus LtContext::Enqueue(const Device& device, const LtGemm& g, Plan& plan, void* workspace,
                            uint64_t workspace_bytes, cudaStream_t stream) {
  const float one = 1.0f, zero = 0.0f;
  const auto* a = static_cast<const uint8_t*>(g.rhs);
  const auto* b = static_cast<const uint8_t*>(g.lhs);
  const auto* a_scale = static_cast<const uint8_t*>(g.rhs_scale);
  const auto* b_scale = static_cast<const uint8_t*>(g.lhs_scale);
  // Strides of the per-call pointers (a strided-batched MXFP8 call makes one call: i = 0 only).
  const int64_t a_scale_stride = ScaleStride(g, g.n, g.rhs_tiled);
  const int64_t b_scale_stride = ScaleStride(g, g.m, g.lhs_tiled);
  const int64_t a_bytes = OperandBytes(g.rhs_type, g.n, g.k);
  const int64_t b_bytes = OperandBytes(g.lhs_type, g.m, g.k);
  auto* d = static_cast<uint8_t*>(g.out);
  const int64_t calls = g.batch / StridedBatch(g), d_bytes = g.m * g.n * TypeBytes(g.out_type);
  std::lock_guard<std::mutex> lock(plan.mu);
  for (int64_t i = 0; i < calls; ++i) {  // per-tensor, block FP8, FP4: one per batch element
    const void* sa = a_scale + i * a_scale_stride;
    const void* sb = b_scale + i * b_scale_stride;
    cublasStatus_t s = api_.cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = api_.cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb,
                                              sizeof sb);
    if (s != CUBLAS_STATUS_SUCCESS)
      return Error(LtCode::kInternal, CublasError(api_, "setting the scale pointers", s));
    void* di = d + i * d_bytes;
    const float* alpha = g.alpha_beta != nullptr ? g.alpha_beta + 2 * i : &one;
    const float* beta = g.alpha_beta != nullptr ? g.alpha_beta + 2 * i + 1 : &zero;
    s = api_.cublasLtMatmul(device.handle, plan.desc, alpha, a + i * a_bytes, plan.a,
                            b + i * b_bytes, plan.b, beta, di, plan.d, di, plan.d, &plan.algo,
                            workspace, workspace_bytes, stream);
    if (s != CUBLAS_STATUS_SUCCESS)
      return Error(LtCode::kInternal, CublasError(api_, "cublasLtMatmul", s));
  }
  return {};
}

}  // namespace jaxmx
