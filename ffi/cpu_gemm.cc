// CPU handlers of jaxmx_mx_matmul, jaxmx_fp8_matmul, jaxmx_block_fp8_matmul and
// jaxmx_fp4_matmul: the GEMMs computed from the same operands the cuBLASLt handler receives (fp8
// codes or packed fp4 codes; swizzled E8M0 / E4M3, per-tensor or block float32 scales), in plain
// C++.
//
// FP4 numerics (NVFP4 and MXFP4): every E2M1 code and every scale is decoded exactly (an E4M3
// scale as float32, an E8M0 one as 2^(byte - 127), byte 0xFF and the E4M3 NaN codes as NaN).
// Within a block (16 elements for NVFP4, 32 for MXFP4) the code products are summed exactly in
// float64 and multiplied by s_a * s_b (exact in float64), then rounded once to float32 and
// accumulated over K in float32, block after block: acc = the float32 sum of the exact products
// (code_a * s_a) * (code_b * s_b), blockwise. (For NVFP4 each block's value is exact in float32:
// at most 20 significant bits.) The result is float32(alpha * acc), then rounded to the output
// type. A NaN scale makes its block, and so the outputs it reaches, NaN.
//
// jaxmx_mx_matmul takes each operand in TN form [rows, K] or K-first [K, rows] (attributes
// lhs_k_first / rhs_k_first, the layouts cuBLASLt takes untransposed on compute capability 10.x):
// the same products, summed in the same order, so both layouts give the same bits.
//
// Block FP8 numerics are those of the emulation: each code times its block's (or tile's) float32
// scale, rounded to float32, then a float32 dot accumulated along K in order.
//
// Numerics: every fp8 code and E8M0 scale is decoded exactly. Within a 32-element block the
// products are summed in float64: exact for E4M3 x E4M3 blocks (a product has at most 8
// significant bits and spans 2^-18..2^17.6, so 32 of them fit in 53 bits); otherwise (E5M2
// products span about 64 bits) within float64 rounding of the block sum. The block sum is scaled
// by 2^(sa + sb - 254) exactly, then rounded once to float32 per block and accumulated over K in
// float32, block after block: the float32 accumulation of the GPU, with exact products. NaN scales
// (0xFF) and NaN codes propagate. The handler runs with IEEE subnormals (it clears the
// flush-to-zero bits XLA's CPU threads may set, and restores them).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "handlers.h"
#include "mx_common.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#define JAXMX_X86 1
#endif

namespace jaxmx {
namespace {

// Clears flush-to-zero / denormals-are-zero for the handler's duration.
class IeeeSubnormals {
 public:
  IeeeSubnormals() {
#if defined(JAXMX_X86)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u));  // FTZ, DAZ
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    fpcr &= ~(uint64_t{1} << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
  }
  ~IeeeSubnormals() {
#if defined(JAXMX_X86)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  IeeeSubnormals(const IeeeSubnormals&) = delete;
  IeeeSubnormals& operator=(const IeeeSubnormals&) = delete;

 private:
  uint64_t saved_ = 0;
};

using Table = std::array<double, 256>;

const Table& DecodeTable(ffi::DataType t) {
  static const Table e4m3 = [] {
    Table tb;
    for (int c = 0; c < 256; ++c) tb[c] = DecodeE4M3(static_cast<uint8_t>(c));
    return tb;
  }();
  static const Table e5m2 = [] {
    Table tb;
    for (int c = 0; c < 256; ++c) tb[c] = DecodeE5M2(static_cast<uint8_t>(c));
    return tb;
  }();
  return t == ffi::DataType::F8E4M3FN ? e4m3 : e5m2;
}

// 2^(i - 254) for i = byte_a + byte_b in [0, 508]: the product of two E8M0 scales, exact.
const std::array<double, 509>& ScaleProducts() {
  static const std::array<double, 509> table = [] {
    std::array<double, 509> tb;
    for (int i = 0; i < 509; ++i) tb[i] = std::ldexp(1.0, i - 254);
    return tb;
  }();
  return table;
}

constexpr int64_t kTile = 4;      // micro-tile: 4 lhs rows x 4 rhs rows
constexpr int64_t kPanel = 64;    // rhs rows decoded at a time
constexpr int64_t kChunk = 2048;  // elements of K decoded at a time (a multiple of kBlock)

struct Operands {
  const uint8_t* lhs;        // [m, k] codes, or [k, m] (K-first)
  const uint8_t* rhs;        // [n, k] codes, or [k, n] (K-first)
  const uint8_t* lhs_scale;  // swizzled (mx) or nullptr
  const uint8_t* rhs_scale;
  double tensor_scale;  // per-tensor mode: lhs_scale * rhs_scale; 1 in mx mode
};

// Element (row r, K index c) of an operand with `rows` rows: at r * k + c ([rows, k]), or at
// c * rows + r when it is K-first ([k, rows]). The same products, summed in the same order.
struct Strides {
  int64_t row, k;
};
inline Strides OperandStrides(bool k_first, int64_t rows, int64_t k) {
  return k_first ? Strides{1, rows} : Strides{k, 1};
}

template <typename Store>
void GemmOne(const GemmProblem& p, const Operands& op, Store store) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const int64_t kp = RoundUp(k, kBlock), nb = kp / kBlock;
  const int64_t mp = RoundUp(m, kTile);
  const Table& ta = DecodeTable(p.lhs_type);
  const Table& tb = DecodeTable(p.rhs_type);
  const auto& pow2 = ScaleProducts();
  const Strides sl = OperandStrides(p.lhs_k_first, m, k), sr = OperandStrides(p.rhs_k_first, n, k);

  // Scale bytes per row and K-block, read from the swizzled layout (127 = 2^0 without scales).
  const int64_t cols_padded = RoundUp(nb, kColTile);
  std::vector<uint8_t> sa(mp * nb, 127), sb(RoundUp(n, kTile) * nb, 127);
  if (op.lhs_scale != nullptr) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < nb; ++c)
        sa[r * nb + c] = op.lhs_scale[SwizzledOffset(r, c, cols_padded)];
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < nb; ++c)
        sb[r * nb + c] = op.rhs_scale[SwizzledOffset(r, c, cols_padded)];
  }

  // Working memory is bounded by tiles, whatever M, N and K: K is walked in chunks of kChunk,
  // the rhs decoded kPanel rows at a time (interleaved by 4: b[(j / 4) * kc * 4 + c * 4 + j % 4])
  // and the lhs kTile rows at a time. Each output accumulates its K-blocks in order, in float32.
  const int64_t kc_max = std::min(kChunk, kp), panel = std::min(kPanel, RoundUp(n, kTile));
  std::vector<double> a(kTile * kc_max), b(panel * kc_max);
  std::vector<float> acc(m * n, 0.0f);
  for (int64_t k0 = 0; k0 < kp; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, kp - k0), k_end = std::min(k, k0 + kc);
    for (int64_t j0 = 0; j0 < n; j0 += panel) {
      const int64_t rows = std::min(panel, n - j0), tiles = (rows + kTile - 1) / kTile;
      std::fill(b.begin(), b.end(), 0.0);
      for (int64_t jj = 0; jj < rows; ++jj) {
        const uint8_t* src = op.rhs + (j0 + jj) * sr.row;
        double* dst = b.data() + (jj / kTile) * kc * kTile + jj % kTile;
        for (int64_t c = k0; c < k_end; ++c) dst[(c - k0) * kTile] = tb[src[c * sr.k]];
      }
      for (int64_t i0 = 0; i0 < m; i0 += kTile) {
        std::fill(a.begin(), a.end(), 0.0);
        for (int64_t ii = 0; ii < kTile && i0 + ii < m; ++ii) {
          const uint8_t* src = op.lhs + (i0 + ii) * sl.row;
          for (int64_t c = k0; c < k_end; ++c) a[ii * kc + c - k0] = ta[src[c * sl.k]];
        }
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t jt = j0 + t * kTile;
          const double* bt = b.data() + t * kc * kTile;
          for (int64_t c0 = 0; c0 < kc; c0 += kBlock) {
            const int64_t blk = (k0 + c0) / kBlock;
            double s[kTile][kTile] = {};
            for (int64_t c = c0; c < c0 + kBlock; ++c) {
              const double* bv = bt + c * kTile;
              for (int64_t ii = 0; ii < kTile; ++ii) {
                const double av = a[ii * kc + c];
                for (int64_t jj = 0; jj < kTile; ++jj) s[ii][jj] += av * bv[jj];
              }
            }
            for (int64_t ii = 0; ii < kTile && i0 + ii < m; ++ii) {
              const int ea = sa[(i0 + ii) * nb + blk];
              for (int64_t jj = 0; jj < kTile && jt + jj < n; ++jj) {
                const int eb = sb[(jt + jj) * nb + blk];
                const double v = (ea == kE8M0NaN || eb == kE8M0NaN)
                                     ? std::numeric_limits<double>::quiet_NaN()
                                     : s[ii][jj] * pow2[ea + eb];
                acc[(i0 + ii) * n + jt + jj] += static_cast<float>(v);
              }
            }
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < m * n; ++i) {
    float v = acc[i];
    if (op.tensor_scale != 1.0) v = static_cast<float>(v * op.tensor_scale);
    store(i, v);
  }
}

// Calls fn(store) with store(i, v) writing float v to element `offset + i` of the output, rounded
// to its type (bfloat16, float16 or float32: CheckGemm admits nothing else).
template <typename Fn>
void WithStore(ffi::DataType type, void* out, int64_t offset, Fn fn) {
  if (type == ffi::DataType::F32) {
    float* dst = static_cast<float*>(out) + offset;
    fn([dst](int64_t i, float v) { dst[i] = v; });
  } else if (type == ffi::DataType::BF16) {
    uint16_t* dst = static_cast<uint16_t*>(out) + offset;
    fn([dst](int64_t i, float v) { dst[i] = FloatToBf16(v); });
  } else {
    uint16_t* dst = static_cast<uint16_t*>(out) + offset;
    fn([dst](int64_t i, float v) { dst[i] = FloatToF16(v); });
  }
}

ffi::Error RunGemm(const char* target, ScaleKind kind, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                   ffi::AnyBuffer lhs_scale, ffi::AnyBuffer rhs_scale,
                   ffi::Result<ffi::AnyBuffer> out, KFirst k_first = {}) {
  auto checked = CheckGemm(target, kind, lhs, rhs, lhs_scale, rhs_scale, *out, {}, k_first);
  if (checked.has_error()) return checked.error();
  const GemmProblem& p = *checked;
  IeeeSubnormals ieee;
  const auto* a = static_cast<const uint8_t*>(lhs.untyped_data());
  const auto* b = static_cast<const uint8_t*>(rhs.untyped_data());
  void* o = out->untyped_data();
  const int64_t mn = p.m * p.n;
  for (int64_t g = 0; g < p.batch; ++g) {
    Operands op{a + g * p.m * p.k, b + g * p.n * p.k, nullptr, nullptr, 1.0};
    if (kind == ScaleKind::kE8m0) {
      op.lhs_scale = static_cast<const uint8_t*>(lhs_scale.untyped_data()) + g * p.lhs_scale_stride;
      op.rhs_scale = static_cast<const uint8_t*>(rhs_scale.untyped_data()) + g * p.rhs_scale_stride;
    } else {
      const float sa = static_cast<const float*>(lhs_scale.untyped_data())[g];
      const float sb = static_cast<const float*>(rhs_scale.untyped_data())[g];
      op.tensor_scale = static_cast<double>(sa) * static_cast<double>(sb);
    }
    WithStore(p.out_type, o, g * mn, [&](auto store) { GemmOne(p, op, store); });
  }
  return ffi::Error::Success();
}

// Block FP8: out[g] = dequantize(lhs[g]) . dequantize(rhs[g])^T, every value code * scale in
// float32, the dot accumulated in float32 along K.
void DequantizeRows(const uint8_t* codes, const float* scales, int64_t rows, int64_t k, bool tiled,
                    ffi::DataType type, std::vector<float>& out) {
  const Table& table = DecodeTable(type);
  out.resize(rows * k);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const float s = scales[Fp8BlockScaleOffset(r, c / kFp8Block, rows, k, tiled)];
      out[r * k + c] = static_cast<float>(table[codes[r * k + c]]) * s;
    }
}

ffi::Error BlockFp8MatmulCpuImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale,
                                 ffi::AnyBuffer rhs_scale, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> /*workspace*/, bool lhs_tiled,
                                 bool rhs_tiled) {
  auto checked = CheckGemm("jaxmx_block_fp8_matmul", ScaleKind::kFloat32, lhs, rhs, lhs_scale,
                           rhs_scale, *out, ScaleTiles{lhs_tiled, rhs_tiled});
  if (checked.has_error()) return checked.error();
  const GemmProblem& p = *checked;
  IeeeSubnormals ieee;
  const auto* a = static_cast<const uint8_t*>(lhs.untyped_data());
  const auto* b = static_cast<const uint8_t*>(rhs.untyped_data());
  const auto* sa = static_cast<const float*>(lhs_scale.untyped_data());
  const auto* sb = static_cast<const float*>(rhs_scale.untyped_data());
  std::vector<float> x, w;
  for (int64_t g = 0; g < p.batch; ++g) {
    DequantizeRows(a + g * p.m * p.k, sa + g * p.lhs_scale_stride, p.m, p.k, p.lhs_tiled,
                   p.lhs_type, x);
    DequantizeRows(b + g * p.n * p.k, sb + g * p.rhs_scale_stride, p.n, p.k, p.rhs_tiled,
                   p.rhs_type, w);
    WithStore(p.out_type, out->untyped_data(), g * p.m * p.n, [&](auto store) {
      for (int64_t i = 0; i < p.m; ++i)
        for (int64_t j = 0; j < p.n; ++j) {
          float acc = 0.0f;
          for (int64_t c = 0; c < p.k; ++c) acc += x[i * p.k + c] * w[j * p.k + c];
          store(i * p.n + j, acc);
        }
    });
  }
  return ffi::Error::Success();
}

// FP4: out[g] = float32(alpha[g] * acc), acc accumulated block by block in float32 (see the top).
ffi::Error Fp4MatmulCpuImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale,
                            ffi::AnyBuffer rhs_scale, ffi::AnyBuffer alpha_beta,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> /*workspace*/, bool nvfp4) {
  const Fp4Format format{nvfp4};
  auto checked =
      CheckFp4Gemm("jaxmx_fp4_matmul", format, lhs, rhs, lhs_scale, rhs_scale, alpha_beta, *out);
  if (checked.has_error()) return checked.error();
  const GemmProblem& p = *checked;
  IeeeSubnormals ieee;
  const Table& e4m3 = DecodeTable(ffi::DataType::F8E4M3FN);
  static const Table e8m0 = [] {
    Table tb;
    for (int c = 0; c < 256; ++c)
      tb[c] = c == kE8M0NaN ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, c - 127);
    return tb;
  }();
  const Table& scale_table = nvfp4 ? e4m3 : e8m0;
  const int64_t block = format.block(), nb = p.k / block, cols_padded = RoundUp(nb, kColTile);
  const int64_t row_bytes = p.k / 2;
  const auto* a = static_cast<const uint8_t*>(lhs.untyped_data());
  const auto* b = static_cast<const uint8_t*>(rhs.untyped_data());
  const auto* sa_bytes = static_cast<const uint8_t*>(lhs_scale.untyped_data());
  const auto* sb_bytes = static_cast<const uint8_t*>(rhs_scale.untyped_data());
  const auto* alphas = static_cast<const float*>(alpha_beta.untyped_data());

  // Each operand decoded once per GEMM: element values (exact in float) and block scales.
  auto decode = [&](const uint8_t* codes, const uint8_t* scales, int64_t rows,
                    std::vector<float>& values, std::vector<double>& row_scales) {
    values.resize(rows * p.k);
    row_scales.resize(rows * nb);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < row_bytes; ++c) {
        const uint8_t byte = codes[r * row_bytes + c];
        values[r * p.k + 2 * c] = DecodeE2M1(byte & 0xF);  // element 2c: the low nibble
        values[r * p.k + 2 * c + 1] = DecodeE2M1(byte >> 4);
      }
      for (int64_t c = 0; c < nb; ++c)
        row_scales[r * nb + c] = scale_table[scales[SwizzledOffset(r, c, cols_padded)]];
    }
  };
  std::vector<float> x, w;
  std::vector<double> sx, sw;
  for (int64_t g = 0; g < p.batch; ++g) {
    decode(a + g * p.m * row_bytes, sa_bytes + g * p.lhs_scale_stride, p.m, x, sx);
    decode(b + g * p.n * row_bytes, sb_bytes + g * p.rhs_scale_stride, p.n, w, sw);
    const float alpha = alphas[2 * g];
    WithStore(p.out_type, out->untyped_data(), g * p.m * p.n, [&](auto store) {
      for (int64_t i = 0; i < p.m; ++i)
        for (int64_t j = 0; j < p.n; ++j) {
          const float* xi = x.data() + i * p.k;
          const float* wj = w.data() + j * p.k;
          float acc = 0.0f;
          for (int64_t c = 0; c < nb; ++c) {
            double sum = 0.0;  // exact: at most 32 products of 4 significant bits each
            for (int64_t e = c * block; e < (c + 1) * block; ++e)
              sum += static_cast<double>(xi[e]) * wj[e];
            acc += static_cast<float>(sum * (sx[i * nb + c] * sw[j * nb + c]));
          }
          store(i * p.n + j, alpha * acc);
        }
    });
  }
  return ffi::Error::Success();
}

ffi::Error MxMatmulCpuImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale,
                           ffi::AnyBuffer rhs_scale, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> /*workspace: used by cuBLASLt only*/,
                           bool lhs_k_first, bool rhs_k_first) {
  return RunGemm("jaxmx_mx_matmul", ScaleKind::kE8m0, lhs, rhs, lhs_scale, rhs_scale, out,
                 KFirst{lhs_k_first, rhs_k_first});
}

ffi::Error Fp8MatmulCpuImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer lhs_scale,
                            ffi::AnyBuffer rhs_scale, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> /*workspace*/,
                            bool /*fast_accum: a cuBLASLt speed knob; the CPU sums in float32*/) {
  return RunGemm("jaxmx_fp8_matmul", ScaleKind::kFloat32Current, lhs, rhs, lhs_scale, rhs_scale,
                 out);
}

}  // namespace

void UnswizzleScales(const uint8_t* buf, int64_t rows, int64_t cols, uint8_t* out) {
  // An empty matrix has nothing to copy: without this, 2^62 rows of 0 columns (a 0-byte buffer,
  // which the size check accepts) would loop over every row.
  if (rows <= 0 || cols <= 0) return;
  const int64_t cols_padded = RoundUp(cols, kColTile);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = buf[SwizzledOffset(r, c, cols_padded)];
}

}  // namespace jaxmx

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxMxMatmulCpu, jaxmx::MxMatmulCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs [..., M, K] fp8
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs [..., N, K] fp8
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs scales, swizzled u8
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs scales, swizzled u8
                                  .Ret<xla::ffi::AnyBuffer>()   // out [..., M, N]
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace (unused here)
                                  .Attr<bool>("lhs_k_first")    // lhs is [..., K, M]
                                  .Attr<bool>("rhs_k_first"));  // rhs is [..., K, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxFp8MatmulCpu, jaxmx::Fp8MatmulCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs [..., M, K] fp8
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs [..., N, K] fp8
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs scale f32 [...]
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs scale f32 [...]
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., M, N]
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace (unused here)
                                  .Attr<bool>("fast_accum"));  // cuBLASLt only

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxBlockFp8MatmulCpu, jaxmx::BlockFp8MatmulCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs [..., M, K] fp8
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs [..., N, K] fp8
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs scales f32 (layout.h)
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs scales f32 (layout.h)
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., M, N]
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace (unused here)
                                  .Attr<bool>("lhs_tiled")     // lhs scales per 128x128 tile
                                  .Attr<bool>("rhs_tiled"));   // rhs scales per 128x128 tile

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmxFp4MatmulCpu, jaxmx::Fp4MatmulCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs [..., M, K/2] packed E2M1
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs [..., N, K/2] packed E2M1
                                  .Arg<xla::ffi::AnyBuffer>()  // lhs scales, swizzled u8
                                  .Arg<xla::ffi::AnyBuffer>()  // rhs scales, swizzled u8
                                  .Arg<xla::ffi::AnyBuffer>()  // alpha_beta f32 [..., 2]
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., M, N]
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace (unused here)
                                  .Attr<bool>("nvfp4"));       // NVFP4 (else MXFP4) scales
