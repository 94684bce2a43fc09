// Shared pieces of the jaxmx native GEMM: the fp8 / fp4 / E8M0 decoders and the operand checks
// that every handler (CPU and CUDA) runs before touching memory. The scale layout is in layout.h.
#ifndef JAXMX_FFI_MX_COMMON_H_
#define JAXMX_FFI_MX_COMMON_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "layout.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmx {

namespace ffi = xla::ffi;

// --- element decoding ------------------------------------------------------------------------

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Exact value of an OCP E4M3 ("fn": no infinities, S.1111.111 is NaN) byte.
inline float DecodeE4M3(uint8_t code) {
  const int sign = code >> 7, exponent = (code >> 3) & 0xF, mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m * 2^-6 / 8
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 7 - 3);
  }
  return sign ? -magnitude : magnitude;
}

// Exact value of an E5M2 byte (IEEE-like: 0x7C is infinity, 0x7D..0x7F NaN).
inline float DecodeE5M2(uint8_t code) {
  const int sign = code >> 7, exponent = (code >> 2) & 0x1F, mantissa = code & 0x3;
  float magnitude;
  if (exponent == 0x1F) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -16);  // m * 2^-14 / 4
  } else {
    magnitude = std::ldexp(static_cast<float>(4 + mantissa), exponent - 15 - 2);
  }
  return sign ? -magnitude : magnitude;
}

inline constexpr uint8_t kE8M0NaN = 0xFF;

// Exact value of an E2M1 code (the low 4 bits of `code`): no infinities, no NaN.
inline float DecodeE2M1(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float magnitude = kMagnitude[code & 0x7];
  return (code & 0x8) ? -magnitude : magnitude;
}

// --- output encoding (round to nearest even, like XLA's converts) ----------------------------

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t FloatToF16(float f) {
  const uint32_t u = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return sign | (a > 0x7F800000u ? 0x7E00 : 0x7C00);  // NaN / inf
  if (a >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to infinity
  if (a >= 0x38800000u) {                      // normal half: rebias and round at bit 13
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
    return sign | static_cast<uint16_t>(r >> 13);
  }
  // Subnormal half (units of 2^-24): integer round-to-nearest-even of the significand.
  const int exponent = static_cast<int>(a >> 23);
  if (exponent == 0) return sign;  // float32 subnormals are far below 2^-25
  const uint32_t significand = (a & 0x7FFFFFu) | 0x800000u;
  const int shift = 126 - exponent;  // value = significand * 2^(exponent - 150)
  if (shift > 24) return sign;
  uint32_t q = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

// --- operand checks --------------------------------------------------------------------------

const char* DataTypeName(ffi::DataType t);

inline bool IsFp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

inline bool IsGemmOutput(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32;
}

// The problem a handler was called with: `batch` independent GEMMs
// out[b] [m, n] = lhs[b] [m, k] . rhs[b] [n, k]^T, all row-major; an operand marked K-first is
// stored [k, rows] instead (the MX GEMM only).
struct GemmProblem {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  ffi::DataType lhs_type{}, rhs_type{}, out_type{};
  // Scale elements between batch elements: bytes (mx), float32 elements (per-tensor, block FP8).
  int64_t lhs_scale_stride = 0, rhs_scale_stride = 0;
  bool lhs_tiled = false, rhs_tiled = false;  // block FP8: 128x128 tiles instead of 1x128 blocks
  bool lhs_k_first = false, rhs_k_first = false;
};

// MX GEMM (jaxmx_mx_matmul): which operands arrive K-first, [..., K, rows] (row-major) instead of
// the TN form [..., rows, K]. Their scales are the same swizzled bytes either way: the cuBLAS
// block-scale layout is indexed by (row of the operand, K-block) whatever the data layout.
struct KFirst {
  bool lhs = false, rhs = false;
};

// The scale kinds of the GEMMs' operands, named as Python's (jaxmx/_src/core/formats.py:
// ScaleKind.name "e8m0", "float32_current", "float32"). kE8m0: MX, swizzled E8M0 bytes per 32
// elements along K; kFloat32Current: one float32 per operand and GEMM (per-tensor FP8);
// kFloat32: block FP8, float32 per 1x128 block or 128x128 tile (layout.h).
enum class ScaleKind { kE8m0, kFloat32Current, kFloat32 };

// Block FP8: which operands have one scale per 128x128 tile (the others per 1x128 block).
struct ScaleTiles {
  bool lhs = false, rhs = false;
};

// FP4 (jaxmx_fp4_matmul): E2M1 codes packed two per byte along K (element 2i in the low nibble of
// byte i, element 2i + 1 in the high nibble, as CUDA's __nv_fp4x2 storage), one scale per block
// of K: NVFP4, an E4M3 byte per 16 elements; MXFP4, an E8M0 byte per 32 elements.
struct Fp4Format {
  bool nvfp4;
  int64_t block() const { return nvfp4 ? 16 : 32; }
  const char* name() const { return nvfp4 ? "NVFP4" : "MXFP4"; }
};

// Checks a jaxmx_fp4_matmul call: lhs uint8 [..., M, K/2] and rhs uint8 [..., N, K/2] (packed
// codes), K a multiple of the block, swizzled scale bytes [..., roundup(rows, 128) *
// roundup(K/block, 4)] per operand, `alpha_beta` float32 [..., 2] (alpha, beta = 0 per GEMM) and
// the output. The problem's k counts elements (twice the bytes).
ffi::ErrorOr<GemmProblem> CheckFp4Gemm(const char* target, Fp4Format format,
                                       const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                                       const ffi::AnyBuffer& lhs_scale,
                                       const ffi::AnyBuffer& rhs_scale,
                                       const ffi::AnyBuffer& alpha_beta, const ffi::AnyBuffer& out);

// Checks element types and shapes of a jaxmx GEMM call and derives its problem. Every handler calls
// this first, so malformed calls (e.g. a raw jax.ffi.ffi_call that skips the Python checks) fail
// with a readable message instead of reading out of bounds. `k_first` (MX only) marks operands
// stored [..., K, rows].
ffi::ErrorOr<GemmProblem> CheckGemm(const char* target, ScaleKind kind, const ffi::AnyBuffer& lhs,
                                    const ffi::AnyBuffer& rhs, const ffi::AnyBuffer& lhs_scale,
                                    const ffi::AnyBuffer& rhs_scale, const ffi::AnyBuffer& out,
                                    ScaleTiles tiles = {}, KFirst k_first = {});

}  // namespace jaxmx

#endif  // JAXMX_FFI_MX_COMMON_H_
