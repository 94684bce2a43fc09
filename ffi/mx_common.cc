#include "mx_common.h"

#include <algorithm>
#include <initializer_list>
#include <sstream>
#include <vector>

namespace jaxmx {

const char* DataTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::S8:
      return "int8";
    case ffi::DataType::S16:
      return "int16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U16:
      return "uint16";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::U64:
      return "uint64";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F8E5M2:
      return "float8_e5m2";
    case ffi::DataType::F8E4M3:
      return "float8_e4m3";
    case ffi::DataType::F8E4M3FN:
      return "float8_e4m3fn";
    case ffi::DataType::F8E4M3FNUZ:
      return "float8_e4m3fnuz";
    case ffi::DataType::F8E5M2FNUZ:
      return "float8_e5m2fnuz";
    case ffi::DataType::F4E2M1FN:
      return "float4_e2m1fn";
    case ffi::DataType::F8E8M0FNU:
      return "float8_e8m0fnu";
    default:
      return "an unsupported element type";
  }
}

namespace {

std::string Shape(const ffi::AnyBuffer& b) {
  std::ostringstream os;
  os << "[";
  const auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

ffi::Unexpected<ffi::Error> Invalid(const char* target, const std::string& what) {
  return ffi::Unexpected<ffi::Error>(
      ffi::Error::InvalidArgument(std::string(target) + ": " + what));
}

// Block FP8: K % 128 == 0, at most one operand in 128x128 tiles, and per operand the float32
// scale matrix of layout.h (Fp8BlockScaleShape) behind the batch dims.
ffi::ErrorOr<GemmProblem> CheckBlockF32Scales(const char* target, GemmProblem p,
                                              ffi::Span<const int64_t> ld,
                                              const ffi::AnyBuffer& lhs_scale,
                                              const ffi::AnyBuffer& rhs_scale, ScaleTiles tiles) {
  if (p.k % kFp8Block != 0)
    return Invalid(target,
                   "K must be a multiple of 128 for block FP8, got K = " + std::to_string(p.k));
  if (tiles.lhs && tiles.rhs)
    return Invalid(target,
                   "lhs and rhs cannot both have 128x128 tiles: cuBLASLt's block-FP8 GEMM takes "
                   "1x128 x 1x128, 1x128 x 128x128 and 128x128 x 1x128 scales");
  const ffi::AnyBuffer* scales[2] = {&lhs_scale, &rhs_scale};
  const int64_t rows[2] = {p.m, p.n};
  const bool tiled[2] = {tiles.lhs, tiles.rhs};
  const char* names[2] = {"lhs", "rhs"};
  const size_t rank = ld.size();
  int64_t strides[2] = {0, 0};
  for (int s = 0; s < 2; ++s) {
    const ffi::AnyBuffer& sc = *scales[s];
    if (sc.element_type() != ffi::DataType::F32)
      return Invalid(target, std::string(names[s]) + " scales must be float32, got " +
                                 DataTypeName(sc.element_type()));
    const BlockScaleShape want = Fp8BlockScaleShape(rows[s], p.k, tiled[s]);
    const auto sd = sc.dimensions();
    bool ok = sd.size() == rank && sd[rank - 2] == want.outer && sd[rank - 1] == want.inner;
    for (size_t i = 0; ok && i + 2 < rank; ++i) ok = sd[i] == ld[i];
    if (!ok) {
      std::ostringstream os;
      os << names[s] << " scales of a [" << rows[s] << ", " << p.k << "] operand must have shape"
         << " [..., " << want.outer << ", " << want.inner << "] ("
         << (tiled[s] ? "128x128 tiles: [ceil(rows / 128), roundup(K / 128, 4)]"
                      : "1x128 blocks: [K / 128, rows]")
         << "), got " << Shape(sc);
      return Invalid(target, os.str());
    }
    strides[s] = want.elements();
  }
  p.lhs_scale_stride = strides[0];
  p.rhs_scale_stride = strides[1];
  p.lhs_tiled = tiles.lhs;
  p.rhs_tiled = tiles.rhs;
  return p;
}

// The batch dims, M, N and K (or K/2 packed bytes) of lhs [..., M, K], rhs [..., N, K] and out
// [..., M, N], into `p`; an operand marked in `k_first` is [..., K, rows] instead.
ffi::ErrorOr<GemmProblem> CheckShapes(const char* target, GemmProblem p, const ffi::AnyBuffer& lhs,
                                      const ffi::AnyBuffer& rhs, const ffi::AnyBuffer& out,
                                      KFirst k_first = {}) {
  const auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out.dimensions();
  const size_t rank = ld.size();
  const char* lhs_form = k_first.lhs ? "[..., K, M]" : "[..., M, K]";
  const char* rhs_form = k_first.rhs ? "[..., K, N]" : "[..., N, K]";
  if (rank < 2)
    return Invalid(target, std::string("lhs must have shape ") + lhs_form + ", got " + Shape(lhs));
  if (rd.size() != rank || od.size() != rank)
    return Invalid(target, "lhs " + Shape(lhs) + ", rhs " + Shape(rhs) + " and output " +
                               Shape(out) + " must have the same rank");
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (rd[i] != ld[i] || od[i] != ld[i])
      return Invalid(target, "batch dimensions differ: lhs " + Shape(lhs) + ", rhs " + Shape(rhs) +
                                 ", output " + Shape(out));
    p.batch *= ld[i];
  }
  p.m = ld[rank - (k_first.lhs ? 1 : 2)];
  p.k = ld[rank - (k_first.lhs ? 2 : 1)];
  p.n = rd[rank - (k_first.rhs ? 1 : 2)];
  if (rd[rank - (k_first.rhs ? 2 : 1)] != p.k)
    return Invalid(target, "contracting sizes differ: lhs " + Shape(lhs) + " vs rhs " + Shape(rhs) +
                               " (operands are " + lhs_form + " and " + rhs_form + ")");
  if (od[rank - 2] != p.m || od[rank - 1] != p.n)
    return Invalid(target, "the output must have shape [..., " + std::to_string(p.m) + ", " +
                               std::to_string(p.n) + "], got " + Shape(out));
  p.lhs_k_first = k_first.lhs;
  p.rhs_k_first = k_first.rhs;
  return p;
}

// The swizzled scale bytes of both operands: `kb` blocks along K, one of the element types
// `types` (named `type_names`), [..., SwizzledSize(rows, kb)] behind the batch dims of `ld`.
ffi::ErrorOr<GemmProblem> CheckSwizzledScales(const char* target, GemmProblem p,
                                              ffi::Span<const int64_t> ld, int64_t kb,
                                              const ffi::AnyBuffer& lhs_scale,
                                              const ffi::AnyBuffer& rhs_scale,
                                              std::initializer_list<ffi::DataType> types,
                                              const char* type_names) {
  const size_t rank = ld.size();
  const ffi::AnyBuffer* scales[2] = {&lhs_scale, &rhs_scale};
  const int64_t rows[2] = {p.m, p.n};
  const char* names[2] = {"lhs", "rhs"};
  for (int s = 0; s < 2; ++s) {
    const ffi::AnyBuffer& sc = *scales[s];
    const auto t = sc.element_type();
    if (std::find(types.begin(), types.end(), t) == types.end())
      return Invalid(target, std::string(names[s]) + " scales must be " + type_names +
                                 " (swizzled), got " + DataTypeName(t));
    const auto sd = sc.dimensions();
    const std::optional<int64_t> size = SwizzledSize(rows[s], kb);
    if (!size)
      return Invalid(target, std::string(names[s]) + " scales of a [" + std::to_string(rows[s]) +
                                 ", " + std::to_string(kb) + "] matrix overflow 64 bits");
    const int64_t want = *size;
    bool ok = sd.size() == rank - 1 && sd[rank - 2] == want;
    for (size_t i = 0; ok && i + 2 < rank; ++i) ok = sd[i] == ld[i];
    if (!ok) {
      std::ostringstream os;
      os << names[s] << " scales must be the swizzled [..., " << want << "] bytes of a [" << rows[s]
         << ", " << kb << "] scale matrix (roundup(" << rows[s] << ", 128) * roundup(" << kb
         << ", 4)), got " << Shape(sc);
      return Invalid(target, os.str());
    }
  }
  p.lhs_scale_stride = *SwizzledSize(p.m, kb);  // both checked above
  p.rhs_scale_stride = *SwizzledSize(p.n, kb);
  return p;
}

}  // namespace

ffi::ErrorOr<GemmProblem> CheckGemm(const char* target, ScaleKind kind, const ffi::AnyBuffer& lhs,
                                    const ffi::AnyBuffer& rhs, const ffi::AnyBuffer& lhs_scale,
                                    const ffi::AnyBuffer& rhs_scale, const ffi::AnyBuffer& out,
                                    ScaleTiles tiles, KFirst k_first) {
  GemmProblem p;
  p.lhs_type = lhs.element_type();
  p.rhs_type = rhs.element_type();
  p.out_type = out.element_type();
  if (!IsFp8(p.lhs_type))
    return Invalid(target, std::string("lhs must be float8_e4m3fn or float8_e5m2, got ") +
                               DataTypeName(p.lhs_type));
  if (!IsFp8(p.rhs_type))
    return Invalid(target, std::string("rhs must be float8_e4m3fn or float8_e5m2, got ") +
                               DataTypeName(p.rhs_type));
  if (p.lhs_type == ffi::DataType::F8E5M2 && p.rhs_type == ffi::DataType::F8E5M2)
    return Invalid(target,
                   "float8_e5m2 x float8_e5m2 is not supported: cuBLASLt's FP8 GEMMs (per-tensor "
                   "and block-scaled) take E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3");
  if (!IsGemmOutput(p.out_type))
    return Invalid(target, std::string("the output must be bfloat16, float16 or float32, got ") +
                               DataTypeName(p.out_type));
  if ((k_first.lhs || k_first.rhs) && kind != ScaleKind::kE8m0)
    return Invalid(target, "only the MX GEMM takes K-first ([..., K, rows]) operands");
  auto shaped = CheckShapes(target, p, lhs, rhs, out, k_first);
  if (shaped.has_error()) return shaped;
  p = *shaped;
  const auto ld = lhs.dimensions();

  if (kind == ScaleKind::kE8m0) {
    if (p.k % kBlock != 0)
      return Invalid(target, "K must be a multiple of 32 for MX block scaling, got K = " +
                                 std::to_string(p.k));
    return CheckSwizzledScales(target, p, ld, p.k / kBlock, lhs_scale, rhs_scale,
                               {ffi::DataType::U8, ffi::DataType::F8E8M0FNU},
                               "uint8 or float8_e8m0fnu");
  }
  if (kind == ScaleKind::kFloat32)
    return CheckBlockF32Scales(target, p, ld, lhs_scale, rhs_scale, tiles);
  const ffi::AnyBuffer* scales[2] = {&lhs_scale, &rhs_scale};
  const char* names[2] = {"lhs", "rhs"};
  for (int s = 0; s < 2; ++s) {
    const ffi::AnyBuffer& sc = *scales[s];
    if (sc.element_type() != ffi::DataType::F32)
      return Invalid(target, std::string(names[s]) + " scale must be float32, got " +
                                 DataTypeName(sc.element_type()));
    if (static_cast<int64_t>(sc.element_count()) != p.batch)
      return Invalid(target, std::string(names[s]) + " scale must hold one float32 per GEMM (" +
                                 std::to_string(p.batch) + "), got shape " + Shape(sc));
  }
  p.lhs_scale_stride = 1;
  p.rhs_scale_stride = 1;
  return p;
}

ffi::ErrorOr<GemmProblem> CheckFp4Gemm(const char* target, Fp4Format format,
                                       const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                                       const ffi::AnyBuffer& lhs_scale,
                                       const ffi::AnyBuffer& rhs_scale,
                                       const ffi::AnyBuffer& alpha_beta,
                                       const ffi::AnyBuffer& out) {
  GemmProblem p;
  p.lhs_type = lhs.element_type();
  p.rhs_type = rhs.element_type();
  p.out_type = out.element_type();
  if (p.lhs_type != ffi::DataType::U8 || p.rhs_type != ffi::DataType::U8)
    return Invalid(target, std::string("lhs and rhs must be uint8 (E2M1 codes packed two per "
                                       "byte), got ") +
                               DataTypeName(p.lhs_type) + " and " + DataTypeName(p.rhs_type));
  if (!IsGemmOutput(p.out_type))
    return Invalid(target, std::string("the output must be bfloat16, float16 or float32, got ") +
                               DataTypeName(p.out_type));
  auto shaped = CheckShapes(target, p, lhs, rhs, out);
  if (shaped.has_error()) return shaped;
  p = *shaped;
  p.k *= 2;  // elements: two per byte
  const auto ld = lhs.dimensions();
  const int64_t block = format.block();
  if (p.k % block != 0)
    return Invalid(target, std::string("K must be a multiple of ") + std::to_string(block) +
                               " for " + format.name() + ", got K = " + std::to_string(p.k));
  const auto ad = alpha_beta.dimensions();
  bool ok = alpha_beta.element_type() == ffi::DataType::F32 && ad.size() == ld.size() - 1 &&
            ad[ad.size() - 1] == 2;
  for (size_t i = 0; ok && i + 2 < ld.size(); ++i) ok = ad[i] == ld[i];
  if (!ok)
    return Invalid(target,
                   "alpha_beta must be float32 [..., 2] (alpha and beta = 0 per GEMM, "
                   "behind the batch dims), got " +
                       std::string(DataTypeName(alpha_beta.element_type())) + Shape(alpha_beta));
  if (format.nvfp4)
    return CheckSwizzledScales(target, p, ld, p.k / block, lhs_scale, rhs_scale,
                               {ffi::DataType::U8, ffi::DataType::F8E4M3FN},
                               "uint8 or float8_e4m3fn");
  return CheckSwizzledScales(target, p, ld, p.k / block, lhs_scale, rhs_scale,
                             {ffi::DataType::U8, ffi::DataType::F8E8M0FNU},
                             "uint8 or float8_e8m0fnu");
}

}  // namespace jaxmx
