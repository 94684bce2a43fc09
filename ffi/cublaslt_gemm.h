// The core of the cuBLASLt handlers: one jaxmx GEMM call (problem, device pointers, stream and
// XLA's workspace) -> matmul and matrix-layout descriptors -> heuristic -> cublasLtMatmul, all
// through a CublasLtApi table. No XLA here: the XLA FFI handlers (cuda_gemm.cc) fill an LtGemm
// from their buffers and pass the dlopen'ed libraries; the tests pass a test double of cuBLASLt.
//
// Row-major JAX operands, TN form: out [M, N] = lhs [M, K] . rhs [N, K]^T. cuBLASLt is
// column-major, so the core computes out^T [N, M] (column-major, ld N == row-major out):
//   cuBLAS A := rhs, stored col-major [K, N] with ld K, op T      (A scale pointer: rhs scales)
//   cuBLAS B := lhs, stored col-major [K, M] with ld K, op N      (B scale pointer: lhs scales)
//   cuBLAS D := out, col-major [N, M] with ld N.
// MXFP8 operands may also arrive K-first (LtGemm::lhs_k_first / rhs_k_first), row-major [K, rows]:
//   rhs K-first: A stored col-major [N, K] with ld N, op N;  lhs K-first: B stored col-major
//   [M, K] with ld M, op T.
// Their scales do not change: the VEC32_UE8M0 scale tensor of an operand is indexed by (row of
// op(A) / column of op(B), K-block) whatever the data layout (cuBLAS documentation, "1D Block
// Scaling Factors Layout"; TransformerEngine's cublaslt_gemm.cu passes MXFP8 columnwise data with
// CUBLAS_OP_N and lda = m and its columnwise scales swizzled by the same 128x4 rule, its
// swizzle.h: "padded to 128x4 for row-scale and 4x128 for col-scale"). cuBLASLt runs such non-TN
// FP8 layouts on compute capability 10.x only: 8.9, 9.x and 12.x have TN kernels only
// (TransformerEngine's nvte_is_non_tn_fp8_gemm_supported: sm_100..sm_11x and sm_130+). FP4
// (NVFP4 / MXFP4) is TN everywhere (TransformerEngine: "NVFP4 gemm is only supported in TN
// layout").
// FP4 operands (CUDA_R_4F_E2M1) are packed two per byte along K (ld K still counts elements).
#ifndef JAXMX_FFI_CUBLASLT_GEMM_H_
#define JAXMX_FFI_CUBLASLT_GEMM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cublaslt_api.h"

namespace jaxmx {

enum class LtScaling {
  kBlockVec32E8M0,  // CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0, scales swizzled (layout.h)
  kTensorF32,       // CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, one float32 per operand
  // Block FP8: CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F (1x128 blocks) or, for the operand marked
  // tiled, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F (128x128 tiles), float32 scale matrices in
  // the layouts of layout.h (Fp8BlockScaleShape). CUDA 12.9+, compute capability 9.x.
  kBlockF32,
  // NVFP4: CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3, one E4M3 byte per 16 elements, swizzled like
  // the E8M0 scales (CUDA_R_4F_E2M1 operands only; MXFP4 is kBlockVec32E8M0 with FP4 operands).
  kBlockVec16E4M3,
};

// `batch` independent GEMMs out[b] [m, n] = alpha[b] * lhs[b] [m, k] . rhs[b] [n, k]^T, row-major,
// the batch elements of each operand contiguous. Scales: kBlockVec32E8M0 / kBlockVec16E4M3, the
// swizzled bytes of each batch element one after the other; kTensorF32, one float32 per batch
// element; kBlockF32, the float32 scale matrices of each batch element one after the other.
// FP4 operands (CUDA_R_4F_E2M1, both or neither) take their alpha from device memory:
// `alpha_beta` points to `batch` float32 pairs (alpha, beta = 0), read by cuBLASLt in
// CUBLASLT_POINTER_MODE_DEVICE, one cublasLtMatmul per batch element; other GEMMs use alpha = 1.
struct LtGemm {
  LtScaling scaling = LtScaling::kBlockVec32E8M0;
  int64_t batch = 1, m = 0, n = 0, k = 0;
  cudaDataType_t lhs_type = CUDA_R_8F_E4M3, rhs_type = CUDA_R_8F_E4M3, out_type = CUDA_R_32F;
  const void* lhs = nullptr;
  const void* rhs = nullptr;
  const void* lhs_scale = nullptr;
  const void* rhs_scale = nullptr;
  void* out = nullptr;
  bool fast_accum = false;  // kTensorF32 only: CUBLASLT_MATMUL_DESC_FAST_ACCUM (forward GEMMs)
  bool lhs_tiled = false, rhs_tiled = false;  // kBlockF32: which operand has 128x128 tiles
  const float* alpha_beta = nullptr;          // FP4: device (alpha, beta = 0) per batch element
  // MXFP8 (kBlockVec32E8M0 on FP8 operands) on compute capability 10.x: operands stored
  // row-major [k, rows] instead of [rows, k] (see the top), rows a multiple of 16.
  bool lhs_k_first = false, rhs_k_first = false;
};

enum class LtCode { kOk, kInvalidArgument, kFailedPrecondition, kUnimplemented, kInternal };

struct LtStatus {
  LtCode code = LtCode::kOk;
  std::string message;
  bool ok() const { return code == LtCode::kOk; }
};

// The cuBLASLt versions up to this one share cached heuristic results between block-scaled and
// per-tensor problems of one shape; MX descriptors then get a dummy ALPHA_VECTOR_BATCH_STRIDE (an
// attribute block-scaled kernels do not read) so that their cache keys differ.
inline constexpr int kLastCublasLtWithSharedHeuristicCache = 120803;

// The state of the core: per CUDA device a cuBLASLt handle (created with that device current),
// its compute capability and the plans (descriptors + algorithm) of the problems seen. Thread-safe;
// entries live as long as the context.
class LtContext {
 public:
  explicit LtContext(const CublasLtApi& api);
  ~LtContext();
  LtContext(const LtContext&) = delete;
  LtContext& operator=(const LtContext&) = delete;

  // Creates what `gemm` needs on `device` (handle, descriptors, algorithm) and enqueues nothing.
  // The XLA initialize stage calls it, outside any CUDA graph capture. `workspace` is the raw
  // buffer from XLA; cuBLASLt gets its 256-byte aligned part (AlignWorkspace).
  LtStatus Prepare(int device, const LtGemm& gemm, void* workspace, uint64_t workspace_bytes);

  // Prepare (a cache hit after the first call of a problem), then enqueues the GEMM on `stream`:
  // one cublasLtMatmul, strided-batched over MXFP8 batch elements; per-tensor, block-FP8 and FP4
  // batches enqueue one cublasLtMatmul per batch element, each with that element's scale (and
  // FP4: alpha / beta) pointers.
  LtStatus Run(int device, const LtGemm& gemm, void* workspace, uint64_t workspace_bytes,
               cudaStream_t stream);

 private:
  struct Device {
    cublasLtHandle_t handle = nullptr;
    int capability = 0;  // major * 10 + minor
    std::string error;   // set when the device could not be initialised
  };
  struct PlanKey {
    int device, scaling, lhs_type, rhs_type, out_type;
    int64_t batch, m, n, k;
    uint32_t align_lhs, align_rhs, align_out;
    uint64_t workspace;
    bool fast_accum, lhs_tiled, rhs_tiled, lhs_k_first, rhs_k_first;
    bool operator<(const PlanKey& o) const;
  };
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    std::mutex mu;  // the scale pointers are set on `desc` right before each cublasLtMatmul
  };
  void Destroy(Plan& plan) const;
  LtStatus MakePlan(const Device& device, const PlanKey& key, const LtGemm& gemm, Plan* plan);
  LtStatus SetScaleModes(cublasLtMatmulDesc_t desc, const LtGemm& gemm) const;
  LtStatus CreateLayouts(const PlanKey& key, const LtGemm& gemm, Plan* plan) const;
  LtStatus ChooseAlgorithm(const Device& device, const PlanKey& key, const LtGemm& gemm,
                           Plan* plan) const;
  LtStatus NoAlgorithm(const Device& device, const PlanKey& key, const LtGemm& gemm,
                       cublasStatus_t heuristic) const;
  LtStatus GetDevice(int ordinal, Device** device);
  LtStatus Check(int ordinal, const Device& device, const LtGemm& gemm) const;
  LtStatus CheckBlockF32(const std::string& on, int capability, const LtGemm& gemm) const;
  LtStatus CheckFp4(const std::string& on, int capability, const LtGemm& gemm) const;
  LtStatus CheckKFirst(const std::string& on, int capability, const LtGemm& gemm) const;
  LtStatus GetPlan(int ordinal, const Device& device, const LtGemm& gemm, uint64_t workspace,
                   Plan** plan);
  LtStatus Enqueue(const Device& device, const LtGemm& gemm, Plan& plan, void* workspace,
                   uint64_t workspace_bytes, cudaStream_t stream);

  const CublasLtApi& api_;
  const int cublaslt_version_;
  std::mutex mu_;  // guards the two maps
  std::map<int, std::unique_ptr<Device>> devices_;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace jaxmx

#endif  // JAXMX_FFI_CUBLASLT_GEMM_H_
