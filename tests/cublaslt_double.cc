// A test double of the CUDA runtime and cuBLASLt functions the cuBLASLt core (ffi/cublaslt_gemm.h)
// calls, with host memory standing in for device memory, plus a C interface for the tests
// (tests/test_cublaslt_core.py compiles this file with the core and loads it with ctypes).
//
// It implements the documented cuBLASLt behaviour the core relies on:
//   D = alpha * scale_A * scale_B * op(A) op(B) (+ beta C, beta = 0 here), all column-major,
//   FP8 A and B (E4M3 / E5M2), bf16 / f16 / f32 D, float32 accumulation;
//   CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F (the default): one float32 per operand;
//   CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0: one E8M0 byte per 32 elements along K of each row
//   of op(A) / column of op(B), in the 128x4 tiled layout of the cuBLAS documentation;
//   CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / BLK128x128_32F (block FP8, CUDA 12.9, sm_90): one
//   float32 per 128 elements along K of each row of op(A) / column of op(B), stored [K/128, rows]
//   with the rows contiguous, or per 128x128 tile, stored [ceil(rows/128), roundup(K/128, 4)]
//   with the K-blocks contiguous; each 128-block's exact sum of products times both scales is
//   added to a float32 accumulator;
//   FP4 (CUDA 12.8, sm_100+): CUDA_R_4F_E2M1 A and B, two elements per byte (element 2i of the
//   column-major storage in the low nibble of byte i, 2i + 1 in the high nibble: CUDA's
//   __nv_fp4x2 storage), leading dimensions and batch strides in elements, with
//   CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 (NVFP4: one unsigned E4M3 byte per 16 elements, the
//   sign bit ignored, in the 128x4 tiled layout) or VEC32_UE8M0 (MXFP4); each block's exact sum
//   of products times both scales is added to a float32 accumulator;
//   alpha and beta on the host (CUBLASLT_POINTER_MODE_HOST, the default) or in device memory
//   (CUBLASLT_POINTER_MODE_DEVICE), D = alpha * accumulator in float32;
//   any TRANSA / TRANSB where the architecture has them (element (i, k) of op(A) read through
//   TRANSA and lda, likewise for B), the block scales indexed by (row of op(A) / column of op(B),
//   K-block) whatever the layout;
//   strided batches (CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT / STRIDED_BATCH_OFFSET), the scale
//   tensors of consecutive batch elements one after the other;
// and refuses what cuBLASLt refuses:
//   a workspace not 256-byte aligned (CUBLAS_STATUS_INVALID_VALUE);
//   A, B, C or D not 16-byte aligned, or a heuristic asked for less (CUBLAS_STATUS_NOT_SUPPORTED);
//   E5M2 x E5M2, mixed scale modes (but 1x128 with 128x128), 128x128 x 128x128, VEC32 below
//   compute capability 10.0 or cuBLASLt 12.8, block FP8 off compute capability 9.x or below
//   cuBLASLt 12.9, FP8 below 8.9, K not a multiple of 32 (VEC32), 128 (block FP8) or 16 (FP8 and
//   VEC16), a 1x128 scale tensor whose rows are not a multiple of 4 (16 bytes), a block-FP8 scale
//   tensor or a SCALAR_32F scale not 16-byte aligned (the latter measured on an H200, cuBLASLt
//   13.1: a scale 4 or 8 bytes past an aligned address refused), a leading dimension not a multiple
//   of 16 bytes, and any layout but TN (A transposed, B not) on architectures that only have TN
//   kernels (compute capability 8.9, 9.x and 12.x); FP4 mixed with FP8, FP4 without block scaling
//   (VEC16 or VEC32), VEC16 on FP8 operands, FP4 below compute capability 10.0 or cuBLASLt 12.8,
//   and FP4 in any layout but TN on every architecture (all CUBLAS_STATUS_NOT_SUPPORTED);
//   inconsistent shapes or batch counts (CUBLAS_STATUS_INVALID_VALUE).
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cublaslt_api.h"
#include "cublaslt_gemm.h"

struct cublasLtContext {
  int device;
};

namespace {

// --- the simulated machine and what the tests read back ----------------------------------------

struct MatmulRecord {  // one cublasLtMatmul that ran
  int64_t device;      // device of the handle
  uint64_t workspace, workspace_bytes;
  int64_t batch_count;
  int64_t transa, transb;
  int64_t fast_accum;                 // -1: never set
  int64_t alpha_vector_batch_stride;  // -1: never set
  int64_t a_scale_mode, b_scale_mode;
  int64_t pointer_mode;  // -1: never set
  double alpha;          // the alpha read, from the host or device pointer
};

struct Machine {
  std::map<int, int> capability;  // device -> major * 10 + minor
  int current_device = 0;
  int cublaslt_version = 130100;
  std::vector<int> handle_devices;  // current device at each cublasLtCreate
  int heuristics = 0;               // cublasLtMatmulAlgoGetHeuristic calls
  std::vector<MatmulRecord> matmuls;
  std::string refusal;  // why the last refused call was refused
};

Machine& machine() {
  static Machine m;
  return m;
}

cublasStatus_t Refuse(cublasStatus_t status, const std::string& why) {
  machine().refusal = why;
  return status;
}

// --- descriptors: attributes kept as raw bytes, read back typed with a default -----------------

struct Attributes {
  std::map<int, std::vector<uint8_t>> values;
  void Set(int attr, const void* buf, size_t size) {
    const auto* p = static_cast<const uint8_t*>(buf);
    values[attr] = std::vector<uint8_t>(p, p + size);
  }
  template <typename T>
  T Get(int attr, T fallback) const {
    auto it = values.find(attr);
    if (it == values.end() || it->second.size() != sizeof(T)) return fallback;
    T v;
    std::memcpy(&v, it->second.data(), sizeof v);
    return v;
  }
  bool Has(int attr) const { return values.count(attr) != 0; }
};

struct Desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  Attributes attrs;
};

struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
  Attributes attrs;
  int64_t batch() const { return attrs.Get<int32_t>(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, 1); }
  int64_t stride() const {
    return attrs.Get<int64_t>(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, 0);
  }
};

struct Preference {
  Attributes attrs;
};

Desc* AsDesc(cublasLtMatmulDesc_t d) { return reinterpret_cast<Desc*>(d); }
Layout* AsLayout(cublasLtMatrixLayout_t l) { return reinterpret_cast<Layout*>(l); }
Preference* AsPref(cublasLtMatmulPreference_t p) { return reinterpret_cast<Preference*>(p); }

constexpr uint64_t kAlgoMagic = 0x6a61786d78ull;  // marks algorithms this double handed out

// --- element types -----------------------------------------------------------------------------

bool IsFp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }
bool IsFp4(cudaDataType_t t) { return t == CUDA_R_4F_E2M1; }
bool IsOutput(cudaDataType_t t) { return t == CUDA_R_32F || t == CUDA_R_16BF || t == CUDA_R_16F; }
int64_t Bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : IsFp8(t) ? 1 : 2; }
int64_t Bits(cudaDataType_t t) { return IsFp4(t) ? 4 : 8 * Bytes(t); }

// E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; no infinities or NaN.
double DecodeFp4(uint8_t nibble) {
  const int e = (nibble >> 1) & 3, m = nibble & 1;
  const double v = e == 0 ? m * 0.5 : std::ldexp(2 + m, e - 2);
  return (nibble & 8) ? -v : v;
}

double DecodeFp8(uint8_t code, cudaDataType_t t);

// Element `index` (in elements from `base`) of a matrix of type `t`: FP4 packed two per byte.
double Element(const uint8_t* base, int64_t index, cudaDataType_t t) {
  if (!IsFp4(t)) return DecodeFp8(base[index], t);
  const uint8_t byte = base[index / 2];
  return DecodeFp4(index % 2 ? byte >> 4 : byte & 0xF);
}

double DecodeFp8(uint8_t code, cudaDataType_t t) {
  const int sign = code >> 7;
  const int mbits = t == CUDA_R_8F_E4M3 ? 3 : 2, ebits = 7 - mbits;
  const int bias = (1 << (ebits - 1)) - 1;
  const int e = (code >> mbits) & ((1 << ebits) - 1), m = code & ((1 << mbits) - 1);
  double v;
  if (t == CUDA_R_8F_E4M3 && e == 15 && m == 7) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (t == CUDA_R_8F_E5M2 && e == 31) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(m, 1 - bias - mbits);
  } else {
    v = std::ldexp((1 << mbits) + m, e - bias - mbits);
  }
  return sign ? -v : v;
}

// IEEE half bits of v, rounded to nearest even: the value is rounded on the half grid with
// std::nearbyint (the default rounding mode is to nearest even), then encoded.
uint16_t HalfBits(float v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(v));
  if (std::isnan(a)) return sign | 0x7E00;
  int e = 0;
  std::frexp(a, &e);  // a = f * 2^e, 0.5 <= f < 1: a is in the binade of 2^(e - 1)
  const double quantum = std::ldexp(1.0, std::max(e - 1, -14) - 10);
  const double r = std::nearbyint(a / quantum) * quantum;
  if (r >= 65520.0 || std::isinf(a)) return sign | 0x7C00;
  if (r < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(r / std::ldexp(1.0, -24));
  std::frexp(r, &e);
  const int exponent = e - 1;  // r = 2^exponent * (1 + m / 1024)
  const auto mantissa = static_cast<uint16_t>(r / std::ldexp(1.0, exponent - 10) - 1024);
  return sign | static_cast<uint16_t>((exponent + 15) << 10) | mantissa;
}

void Store(float v, cudaDataType_t t, void* dst) {
  if (t == CUDA_R_32F) {
    std::memcpy(dst, &v, 4);
  } else if (t == CUDA_R_16F) {
    const uint16_t h = HalfBits(v);
    std::memcpy(dst, &h, 2);
  } else {  // bfloat16: round to nearest even on the top 16 bits
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint16_t b = std::isnan(v) ? static_cast<uint16_t>((u >> 16) | 0x40)
                                     : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
    std::memcpy(dst, &b, 2);
  }
}

// Offset of scale (row, block) in the 128x4 tiled layout: 128-row by 4-block tiles of 512 bytes,
// tile-row-major; within a tile, row r sits at (r % 32) * 16 + (r / 32) * 4, block c at c % 4.
int64_t TiledOffset(int64_t row, int64_t block, int64_t blocks) {
  const int64_t tiles_per_row = (blocks + 3) / 4;
  return (row / 128 * tiles_per_row + block / 4) * 512 + (row % 32) * 16 + (row % 128 / 32) * 4 +
         block % 4;
}

int64_t TiledBytes(int64_t rows, int64_t blocks) {
  return (rows + 127) / 128 * 128 * ((blocks + 3) / 4 * 4);
}

// --- what a problem needs ------------------------------------------------------------------------

struct Problem {  // op(A) [m, k], op(B) [k, n], D [m, n]
  int64_t m, n, k, batch;
  bool vec32;
  bool vec16;             // VEC16_UE4M3 (NVFP4)
  bool block_fp8;         // VEC128_32F / BLK128x128_32F
  bool scalar;            // SCALAR_32F (per-tensor)
  bool a_tiles, b_tiles;  // block FP8: BLK128x128_32F for A / B
};

bool IsBlockFp8Mode(int32_t mode) {
  return mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ||
         mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}

// Offset of the float32 block-FP8 scale of (row, K-block) of an operand with `rows` rows.
int64_t BlockFp8Offset(bool tiles, int64_t row, int64_t block, int64_t rows, int64_t blocks) {
  return tiles ? row / 128 * ((blocks + 3) / 4 * 4) + block : block * rows + row;
}

int64_t BlockFp8Elements(bool tiles, int64_t rows, int64_t blocks) {
  return tiles ? (rows + 127) / 128 * ((blocks + 3) / 4 * 4) : blocks * rows;
}

bool OnlyTn(int cc) { return cc == 89 || (cc >= 90 && cc < 100) || (cc >= 120 && cc < 130); }

// The shape of the problem, or a refusal in `status`.
cublasStatus_t Support(int device, const Desc& desc, const Layout& a, const Layout& b,
                       const Layout& d, Problem* p) {
  const Machine& mc = machine();
  const auto cc_it = mc.capability.find(device);
  if (cc_it == mc.capability.end()) return Refuse(CUBLAS_STATUS_INVALID_VALUE, "unknown device");
  const int cc = cc_it->second;
  if (desc.compute != CUBLAS_COMPUTE_32F || desc.scale != CUDA_R_32F)
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8 needs CUBLAS_COMPUTE_32F, scale type 32F");
  if (IsFp4(a.type) != IsFp4(b.type)) return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP4 with FP8");
  const bool fp4 = IsFp4(a.type);
  if ((!fp4 && (!IsFp8(a.type) || !IsFp8(b.type))) || !IsOutput(d.type))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "unsupported types");
  if (a.type == CUDA_R_8F_E5M2 && b.type == CUDA_R_8F_E5M2)
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "E5M2 x E5M2");
  const auto ta = desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_N);
  const auto tb = desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  if (OnlyTn(cc) && !(ta == CUBLAS_OP_T && tb == CUBLAS_OP_N))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "only TN on this architecture");
  if (fp4 && !(ta == CUBLAS_OP_T && tb == CUBLAS_OP_N))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP4 only TN");
  const int scale_default = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  const int32_t sa = desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_default);
  const int32_t sb = desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_default);
  p->block_fp8 = IsBlockFp8Mode(sa) && IsBlockFp8Mode(sb);
  p->a_tiles = sa == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  p->b_tiles = sb == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  if (!p->block_fp8 && (sa != sb || (sa != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F &&
                                     sa != CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 &&
                                     sa != CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3)))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "scale modes");
  p->vec16 = sa == CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  p->scalar = sa == CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  if (p->vec16 && !fp4) return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "VEC16_UE4M3 on FP8");
  if (fp4 && sa != CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 &&
      sa != CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0)
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP4 without block scaling");
  if (fp4 && (cc < 100 || mc.cublaslt_version < 120800))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP4 needs sm_100+ and cuBLASLt 12.8");
  if (p->a_tiles && p->b_tiles)
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "BLK128x128_32F x BLK128x128_32F");
  if (p->block_fp8 && (cc / 10 != 9 || mc.cublaslt_version < 120900))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "block FP8 scaling needs sm_90 and cuBLASLt 12.9");
  p->vec32 = sa == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
  if (p->vec32 && (cc < 100 || mc.cublaslt_version < 120800))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "VEC32_UE8M0 needs sm_100+ and cuBLASLt 12.8");
  if (cc < 89) return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "FP8 needs sm_89+");
  // op(A) = A or A^T, [m, k]; op(B) [k, n]
  p->m = static_cast<int64_t>(ta == CUBLAS_OP_T ? a.cols : a.rows);
  p->k = static_cast<int64_t>(ta == CUBLAS_OP_T ? a.rows : a.cols);
  const int64_t kb = static_cast<int64_t>(tb == CUBLAS_OP_T ? b.cols : b.rows);
  p->n = static_cast<int64_t>(tb == CUBLAS_OP_T ? b.rows : b.cols);
  if (kb != p->k || static_cast<int64_t>(d.rows) != p->m || static_cast<int64_t>(d.cols) != p->n)
    return Refuse(CUBLAS_STATUS_INVALID_VALUE, "inconsistent shapes");
  if (a.ld < static_cast<int64_t>(a.rows) || b.ld < static_cast<int64_t>(b.rows) ||
      d.ld < static_cast<int64_t>(d.rows))
    return Refuse(CUBLAS_STATUS_INVALID_VALUE, "leading dimension below the rows");
  if (a.batch() != d.batch() || b.batch() != d.batch())
    return Refuse(CUBLAS_STATUS_INVALID_VALUE, "batch counts differ");
  p->batch = d.batch();
  if (p->k % (p->block_fp8 ? 128 : p->vec32 ? 32 : 16) != 0)
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "K is not a multiple of the block");
  if (p->block_fp8 && ((!p->a_tiles && p->m % 4 != 0) || (!p->b_tiles && p->n % 4 != 0)))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "1x128 scale rows not a multiple of 16 bytes");
  if (a.ld * Bits(a.type) % 128 != 0 || b.ld * Bits(b.type) % 128 != 0 ||
      d.ld * Bytes(d.type) % 16 != 0)
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "leading dimensions not multiples of 16 bytes");
  return CUBLAS_STATUS_SUCCESS;
}

// --- the CUDA runtime --------------------------------------------------------------------------

cudaError_t RuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}

const char* GetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "invalid device ordinal (test double)";
}

cudaError_t GetDevice(int* device) {
  *device = machine().current_device;
  return cudaSuccess;
}

cudaError_t SetDevice(int device) {
  if (machine().capability.count(device) == 0) return cudaErrorInvalidDevice;
  machine().current_device = device;
  return cudaSuccess;
}

cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  const auto it = machine().capability.find(device);
  if (it == machine().capability.end()) return cudaErrorInvalidDevice;
  if (attr == cudaDevAttrComputeCapabilityMajor)
    *value = it->second / 10;
  else if (attr == cudaDevAttrComputeCapabilityMinor)
    *value = it->second % 10;
  else
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

cudaError_t MemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

cudaError_t Memcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                          size_t height, cudaMemcpyKind kind, cudaStream_t) {
  if (kind != cudaMemcpyDeviceToDevice || width > dpitch || width > spitch)
    return cudaErrorInvalidValue;
  for (size_t row = 0; row < height; ++row)
    std::memcpy(static_cast<uint8_t*>(dst) + row * dpitch,
                static_cast<const uint8_t*>(src) + row * spitch, width);
  return cudaSuccess;
}

// --- cuBLASLt ----------------------------------------------------------------------------------

size_t GetVersion() { return static_cast<size_t>(machine().cublaslt_version); }

const char* GetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
  }
}

cublasStatus_t Create(cublasLtHandle_t* handle) {
  machine().handle_devices.push_back(machine().current_device);
  *handle = new cublasLtContext{machine().current_device};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t Destroy(cublasLtHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t DescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                          cudaDataType_t scale) {
  *desc = reinterpret_cast<cublasLtMatmulDesc_t>(new Desc{compute, scale, {}});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t DescDestroy(cublasLtMatmulDesc_t desc) {
  delete AsDesc(desc);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t DescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                const void* buf, size_t size) {
  AsDesc(desc)->attrs.Set(attr, buf, size);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t LayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                            uint64_t cols, int64_t ld) {
  *layout = reinterpret_cast<cublasLtMatrixLayout_t>(new Layout{type, rows, cols, ld, {}});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t LayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete AsLayout(layout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t LayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                  cublasLtMatrixLayoutAttribute_t attr, const void* buf,
                                  size_t size) {
  AsLayout(layout)->attrs.Set(attr, buf, size);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t PrefCreate(cublasLtMatmulPreference_t* pref) {
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(new Preference{});
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t PrefDestroy(cublasLtMatmulPreference_t pref) {
  delete AsPref(pref);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t PrefSetAttribute(cublasLtMatmulPreference_t pref,
                                cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                size_t size) {
  AsPref(pref)->attrs.Set(attr, buf, size);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t AlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                cublasLtMatmulPreference_t pref, int requested,
                                cublasLtMatmulHeuristicResult_t results[], int* found) {
  *found = 0;
  ++machine().heuristics;
  if (requested < 1 || c != d) return Refuse(CUBLAS_STATUS_INVALID_VALUE, "heuristic arguments");
  Problem p;
  const cublasStatus_t s =
      Support(handle->device, *AsDesc(desc), *AsLayout(a), *AsLayout(b), *AsLayout(d), &p);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const Attributes& prefs = AsPref(pref)->attrs;
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (prefs.Get<uint32_t>(attr, 256) < 16)
      return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "operands aligned to less than 16 bytes");
  }
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].algo.data[0] = kAlgoMagic;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

bool Aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

cublasStatus_t Matmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc_handle, const void* alpha,
                      const void* a_data, cublasLtMatrixLayout_t a_layout, const void* b_data,
                      cublasLtMatrixLayout_t b_layout, const void* beta, const void* c_data,
                      cublasLtMatrixLayout_t c_layout, void* d_data,
                      cublasLtMatrixLayout_t d_layout, const cublasLtMatmulAlgo_t* algo,
                      void* workspace, size_t workspace_bytes, cudaStream_t) {
  if (algo == nullptr || algo->data[0] != kAlgoMagic)
    return Refuse(CUBLAS_STATUS_INVALID_VALUE, "not an algorithm from the heuristic");
  if (workspace_bytes > 0 && !Aligned(workspace, 256))
    return Refuse(CUBLAS_STATUS_INVALID_VALUE, "workspace not 256-byte aligned");
  if (!Aligned(a_data, 16) || !Aligned(b_data, 16) || !Aligned(c_data, 16) || !Aligned(d_data, 16))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "operand not 16-byte aligned");
  if (c_layout != d_layout || c_data != d_data || *static_cast<const float*>(beta) != 0.0f)
    return Refuse(CUBLAS_STATUS_INVALID_VALUE, "this double implements C = D, beta = 0 only");
  const Desc& desc = *AsDesc(desc_handle);
  const Layout &a = *AsLayout(a_layout), &b = *AsLayout(b_layout), &d = *AsLayout(d_layout);
  Problem p;
  const cublasStatus_t s = Support(handle->device, desc, a, b, d, &p);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const void* a_scale = desc.attrs.Get<const void*>(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, nullptr);
  const void* b_scale = desc.attrs.Get<const void*>(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, nullptr);
  if (a_scale == nullptr || b_scale == nullptr)
    return Refuse(CUBLAS_STATUS_INVALID_VALUE, "FP8 needs A and B scale pointers");
  if ((p.block_fp8 || p.scalar) && (!Aligned(a_scale, 16) || !Aligned(b_scale, 16)))
    return Refuse(CUBLAS_STATUS_NOT_SUPPORTED, "scales not 16-byte aligned");
  const bool ta = desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_N) == CUBLAS_OP_T;
  const bool tb = desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N) == CUBLAS_OP_T;
  // alpha and beta: host values, or (CUBLASLT_POINTER_MODE_DEVICE) device pointers
  const int32_t pointer_mode =
      desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_HOST);
  if (pointer_mode != CUBLASLT_POINTER_MODE_HOST && pointer_mode != CUBLASLT_POINTER_MODE_DEVICE)
    return Refuse(CUBLAS_STATUS_INVALID_VALUE, "this double implements host and device scalars");
  const float alpha_value = *static_cast<const float*>(alpha);
  const int64_t blocks = p.k / 32, blocks16 = p.k / 16, blocks128 = p.k / 128;
  const int64_t block = p.block_fp8 ? 128 : p.vec16 ? 16 : 32;
  const auto* a8 = static_cast<const uint8_t*>(a_data);
  const auto* b8 = static_cast<const uint8_t*>(b_data);
  auto* d8 = static_cast<uint8_t*>(d_data);
  for (int64_t g = 0; g < p.batch; ++g) {
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = 0; j < p.n; ++j) {
        float acc = 0.0f;
        for (int64_t k0 = 0; k0 < p.k; k0 += block) {  // float32 accumulation, exact products
          double sum = 0.0;
          for (int64_t k = k0; k < k0 + block && k < p.k; ++k) {
            const int64_t x = g * a.stride() + (ta ? k + i * a.ld : i + k * a.ld);
            const int64_t y = g * b.stride() + (tb ? j + k * b.ld : k + j * b.ld);
            sum += Element(a8, x, a.type) * Element(b8, y, b.type);
          }
          if (p.vec16) {  // unsigned E4M3 scales: the sign bit is ignored
            const auto* sa = static_cast<const uint8_t*>(a_scale) + g * TiledBytes(p.m, blocks16);
            const auto* sb = static_cast<const uint8_t*>(b_scale) + g * TiledBytes(p.n, blocks16);
            sum *= DecodeFp8(sa[TiledOffset(i, k0 / 16, blocks16)] & 0x7F, CUDA_R_8F_E4M3) *
                   DecodeFp8(sb[TiledOffset(j, k0 / 16, blocks16)] & 0x7F, CUDA_R_8F_E4M3);
          } else if (p.vec32) {
            const auto* sa = static_cast<const uint8_t*>(a_scale) + g * TiledBytes(p.m, blocks);
            const auto* sb = static_cast<const uint8_t*>(b_scale) + g * TiledBytes(p.n, blocks);
            const int ea = sa[TiledOffset(i, k0 / 32, blocks)];
            const int eb = sb[TiledOffset(j, k0 / 32, blocks)];
            sum = (ea == 0xFF || eb == 0xFF) ? std::numeric_limits<double>::quiet_NaN()
                                             : std::ldexp(sum, ea + eb - 254);
          } else if (p.block_fp8) {
            const auto* sa = static_cast<const float*>(a_scale) +
                             g * BlockFp8Elements(p.a_tiles, p.m, blocks128);
            const auto* sb = static_cast<const float*>(b_scale) +
                             g * BlockFp8Elements(p.b_tiles, p.n, blocks128);
            sum *= static_cast<double>(sa[BlockFp8Offset(p.a_tiles, i, k0 / 128, p.m, blocks128)]) *
                   sb[BlockFp8Offset(p.b_tiles, j, k0 / 128, p.n, blocks128)];
          }
          acc += static_cast<float>(sum);
        }
        float v = alpha_value * acc;
        if (!p.vec32 && !p.vec16 && !p.block_fp8)
          v *= *static_cast<const float*>(a_scale) * *static_cast<const float*>(b_scale);
        Store(v, d.type, d8 + (g * d.stride() + i + j * d.ld) * Bytes(d.type));
      }
    }
  }
  machine().matmuls.push_back(
      MatmulRecord{handle->device, reinterpret_cast<uintptr_t>(workspace), workspace_bytes, p.batch,
                   desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_N),
                   desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N),
                   desc.attrs.Get<int8_t>(CUBLASLT_MATMUL_DESC_FAST_ACCUM, -1),
                   desc.attrs.Get<int64_t>(CUBLASLT_MATMUL_DESC_ALPHA_VECTOR_BATCH_STRIDE, -1),
                   desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, 0),
                   desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, 0),
                   desc.attrs.Get<int32_t>(CUBLASLT_MATMUL_DESC_POINTER_MODE, -1), alpha_value});
  return CUBLAS_STATUS_SUCCESS;
}

jaxmx::CublasLtApi DoubleApi() {
  jaxmx::CublasLtApi api;
  api.cudaRuntimeGetVersion = RuntimeGetVersion;
  api.cudaGetErrorString = GetErrorString;
  api.cudaGetDevice = GetDevice;
  api.cudaSetDevice = SetDevice;
  api.cudaDeviceGetAttribute = DeviceGetAttribute;
  api.cudaMemsetAsync = MemsetAsync;
  api.cudaMemcpy2DAsync = Memcpy2DAsync;
  api.cublasLtGetVersion = GetVersion;
  api.cublasLtGetStatusString = GetStatusString;
  api.cublasLtCreate = Create;
  api.cublasLtDestroy = Destroy;
  api.cublasLtMatmulDescCreate = DescCreate;
  api.cublasLtMatmulDescDestroy = DescDestroy;
  api.cublasLtMatmulDescSetAttribute = DescSetAttribute;
  api.cublasLtMatrixLayoutCreate = LayoutCreate;
  api.cublasLtMatrixLayoutDestroy = LayoutDestroy;
  api.cublasLtMatrixLayoutSetAttribute = LayoutSetAttribute;
  api.cublasLtMatmulPreferenceCreate = PrefCreate;
  api.cublasLtMatmulPreferenceDestroy = PrefDestroy;
  api.cublasLtMatmulPreferenceSetAttribute = PrefSetAttribute;
  api.cublasLtMatmulAlgoGetHeuristic = AlgoGetHeuristic;
  api.cublasLtMatmul = Matmul;
  return api;
}

const jaxmx::CublasLtApi& Api() {
  static const jaxmx::CublasLtApi api = DoubleApi();
  return api;
}

cudaDataType_t TypeNamed(const char* name) {
  const std::string n = name;
  if (n == "float8_e4m3fn") return CUDA_R_8F_E4M3;
  if (n == "float8_e5m2") return CUDA_R_8F_E5M2;
  if (n == "float4_e2m1fn") return CUDA_R_4F_E2M1;
  if (n == "bfloat16") return CUDA_R_16BF;
  if (n == "float16") return CUDA_R_16F;
  if (n == "float32") return CUDA_R_32F;
  std::abort();  // the tests pass only these names
}

}  // namespace

// --- the C interface of tests/test_cublaslt_core.py ----------------------------------------------

extern "C" {

// A fresh machine: `devices` GPUs with the given compute capabilities (major * 10 + minor), the
// given cuBLASLt version (e.g. 130100), device 0 current, nothing recorded.
void double_reset(int devices, const int* capabilities, int cublaslt_version) {
  machine() = Machine{};
  for (int i = 0; i < devices; ++i) machine().capability[i] = capabilities[i];
  machine().cublaslt_version = cublaslt_version;
}

int double_current_device() { return machine().current_device; }
void double_set_current_device(int device) { machine().current_device = device; }
const char* double_refusal() { return machine().refusal.c_str(); }

// Devices current at each cublasLtCreate, into `out` (at most `max`); returns how many.
int double_handle_devices(int* out, int max) {
  const auto& v = machine().handle_devices;
  for (int i = 0; i < max && i < static_cast<int>(v.size()); ++i) out[i] = v[i];
  return static_cast<int>(v.size());
}

int double_heuristic_count() { return machine().heuristics; }
int double_matmul_count() { return static_cast<int>(machine().matmuls.size()); }
void double_matmul(int i, MatmulRecord* out) { *out = machine().matmuls.at(i); }

// A core context on the double's functions (one per test).
void* core_new() { return new jaxmx::LtContext(Api()); }
void core_free(void* context) { delete static_cast<jaxmx::LtContext*>(context); }

// LtContext::Run (`prepare_only`: LtContext::Prepare) of the GEMM described by the arguments;
// returns the LtCode and copies the message into `message`.
// `scaling`: 0 per-tensor, 1 MX (VEC32_UE8M0; MXFP4 with float4_e2m1fn types), 2 block FP8 with
// 1x128 blocks, 3 block FP8 with 128x128 rhs tiles, 4 block FP8 with 128x128 lhs tiles, 5 block
// FP8 with both tiled, 6 NVFP4 (VEC16_UE4M3). `alpha_beta`: LtGemm::alpha_beta (may be null).
// `lhs_k_first` / `rhs_k_first`: LtGemm::lhs_k_first / rhs_k_first (operands [k, rows]).
int core_gemm(void* context, int prepare_only, int device, int scaling, int64_t batch, int64_t m,
              int64_t n, int64_t k, const char* lhs_type, const char* rhs_type,
              const char* out_type, const void* lhs, const void* rhs, const void* lhs_scale,
              const void* rhs_scale, void* out, int fast_accum, void* workspace,
              uint64_t workspace_bytes, char* message, int message_size, const float* alpha_beta,
              int lhs_k_first, int rhs_k_first) {
  jaxmx::LtGemm g;
  g.scaling = scaling == 0   ? jaxmx::LtScaling::kTensorF32
              : scaling == 1 ? jaxmx::LtScaling::kBlockVec32E8M0
              : scaling == 6 ? jaxmx::LtScaling::kBlockVec16E4M3
                             : jaxmx::LtScaling::kBlockF32;
  g.rhs_tiled = scaling == 3 || scaling == 5;
  g.lhs_tiled = scaling == 4 || scaling == 5;
  g.batch = batch;
  g.m = m;
  g.n = n;
  g.k = k;
  g.lhs_type = TypeNamed(lhs_type);
  g.rhs_type = TypeNamed(rhs_type);
  g.out_type = TypeNamed(out_type);
  g.lhs = lhs;
  g.rhs = rhs;
  g.lhs_scale = lhs_scale;
  g.rhs_scale = rhs_scale;
  g.out = out;
  g.fast_accum = fast_accum != 0;
  g.alpha_beta = alpha_beta;
  g.lhs_k_first = lhs_k_first != 0;
  g.rhs_k_first = rhs_k_first != 0;
  auto* c = static_cast<jaxmx::LtContext*>(context);
  const jaxmx::LtStatus s = prepare_only ? c->Prepare(device, g, workspace, workspace_bytes)
                                         : c->Run(device, g, workspace, workspace_bytes, nullptr);
  std::snprintf(message, message_size, "%s", s.message.c_str());
  return static_cast<int>(s.code);
}

// A plain cuBLASLt user of the double, without the core: D [m, n] = op(A) op(B), A [k, m] and
// B [k, n] as stored (both K-major), on device 0, with the workspace at `workspace_offset` bytes
// past a 256-byte boundary. `scaling`: 0 per-tensor scales 1, 1 VEC32 scales 2^0, 2..5 block FP8
// scales 1 (2: VEC128_32F for A and B, 3: BLK128x128_32F for A, 4: for B, 5: for both), 6 VEC16
// scales 1 (UE4M3). Returns the status name of the heuristic (if it refused) or of
// cublasLtMatmul.
const char* double_plain_matmul(int64_t m, int64_t n, int64_t k, const char* a_type,
                                const char* b_type, int transa, int transb, int scaling,
                                uint64_t workspace_offset) {
  const bool block_scaled = scaling == 1 || scaling == 6;
  const cudaDataType_t ta = TypeNamed(a_type), tb = TypeNamed(b_type);
  auto buffer = [](size_t bytes) {
    return std::unique_ptr<uint8_t, decltype(&std::free)>(
        static_cast<uint8_t*>(std::aligned_alloc(256, (bytes + 511) / 256 * 256)), &std::free);
  };
  auto a = buffer(m * k), b = buffer(n * k), d = buffer(m * n * 4), ws = buffer(1024);
  const int64_t blocks = k / (scaling == 6 ? 16 : 32);
  const int64_t scale_bytes = std::max(TiledBytes(std::max(m, n), blocks), (m + n + 128) * k) + 4;
  auto sa = buffer(scale_bytes), sb = buffer(scale_bytes);
  std::memset(a.get(), 0, m * k);
  std::memset(b.get(), 0, n * k);
  const float one = 1.0f, zero = 0.0f;
  const int scale_one = scaling == 6 ? 0x38 : 127;  // E4M3 1.0, E8M0 2^0
  std::memset(sa.get(), scale_one, TiledBytes(m, blocks));
  std::memset(sb.get(), scale_one, TiledBytes(n, blocks));
  if (scaling != 1) {
    std::fill_n(reinterpret_cast<float*>(sa.get()), scale_bytes / 4, 1.0f);
    std::fill_n(reinterpret_cast<float*>(sb.get()), scale_bytes / 4, 1.0f);
  }
  cublasLtHandle_t handle;
  Create(&handle);
  cublasLtMatmulDesc_t desc;
  DescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const int32_t op_a = transa ? CUBLAS_OP_T : CUBLAS_OP_N,
                op_b = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a);
  DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b);
  if (block_scaled) {
    const int32_t mode = scaling == 6 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3
                                      : CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode);
    DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode);
  } else if (scaling >= 2) {
    const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const int32_t blk = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t mode_a = scaling == 3 || scaling == 5 ? blk : vec;
    const int32_t mode_b = scaling == 4 || scaling == 5 ? blk : vec;
    DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof mode_a);
    DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof mode_b);
  }
  const void* pa = sa.get();
  const void* pb = sb.get();
  DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof pa);
  DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof pb);
  cublasLtMatrixLayout_t la, lb, ld;  // stored shapes for the requested ops
  LayoutCreate(&la, ta, transa ? k : m, transa ? m : k, transa ? k : m);
  LayoutCreate(&lb, tb, transb ? n : k, transb ? k : n, transb ? n : k);
  LayoutCreate(&ld, CUDA_R_32F, m, n, m);
  cublasLtMatmulPreference_t pref;
  PrefCreate(&pref);
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  cublasStatus_t s = AlgoGetHeuristic(handle, desc, la, lb, ld, ld, pref, 1, &result, &found);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = Matmul(handle, desc, &one, a.get(), la, b.get(), lb, &zero, d.get(), ld, d.get(), ld,
               &result.algo, ws.get() + workspace_offset, 512, nullptr);
  PrefDestroy(pref);
  LayoutDestroy(la);
  LayoutDestroy(lb);
  LayoutDestroy(ld);
  DescDestroy(desc);
  Destroy(handle);
  return GetStatusString(s);
}

}  // extern "C"
