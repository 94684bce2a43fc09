// Sizes and offsets shared by the handlers and the cuBLASLt core (ffi/cublaslt_gemm.cc): the
// cuBLAS scale layout and the workspace alignment. Needs neither XLA nor CUDA headers.
#ifndef JAXMX_FFI_LAYOUT_H_
#define JAXMX_FFI_LAYOUT_H_

#include <cstdint>
#include <optional>

namespace jaxmx {

inline constexpr int64_t kBlock = 32;       // elements per E8M0 scale (MXFP8, MXFP4)
inline constexpr int64_t kFp4Block16 = 16;  // elements per E4M3 scale (NVFP4)
// FP4 operands: K a multiple of 32 elements, so that rows of packed E2M1 codes (the leading
// dimension cuBLASLt sees) are multiples of 16 bytes.
inline constexpr int64_t kFp4KMultiple = 32;
inline constexpr int64_t kRowTile = 128;  // scale tile: 128 rows ...
inline constexpr int64_t kColTile = 4;    // ... by 4 K-blocks, 512 bytes

inline constexpr int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Bytes of the swizzled scale buffer of one [rows, cols] scale matrix (padding included), for
// rows, cols >= 0; std::nullopt where the padded size does not fit in int64.
inline std::optional<int64_t> SwizzledSize(int64_t rows, int64_t cols) {
  int64_t r = 0, c = 0, size = 0;
  if (__builtin_add_overflow(rows, kRowTile - 1, &r) ||
      __builtin_add_overflow(cols, kColTile - 1, &c) ||
      __builtin_mul_overflow(r / kRowTile * kRowTile, c / kColTile * kColTile, &size))
    return std::nullopt;
  return size;
}

// Offset of scale (r, c) in the cuBLAS 128x4 tiled layout (docs/quantization.md), where
// `cols_padded` is the number of K-blocks rounded up to a multiple of 4.
inline constexpr int64_t SwizzledOffset(int64_t r, int64_t c, int64_t cols_padded) {
  return ((r / 128) * (cols_padded / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 +
         (c % 4);
}

// Block FP8 (cuBLASLt VEC128_32F / BLK128x128_32F): one float32 scale per 128 elements along K
// (1x128 blocks) or per 128x128 tile of an operand [rows, K], K a multiple of 128. The scale
// tensor of one operand is a row-major [outer, inner] float32 matrix:
//   1x128 blocks:  [K / 128, rows], the rows contiguous (scale of row r, K-block c at c * rows +
//   r); 128x128 tiles: [ceil(rows / 128), roundup(K / 128, 4)], the K-blocks contiguous,
//   zero-padded.
inline constexpr int64_t kFp8Block = 128;

struct BlockScaleShape {
  int64_t outer, inner;
  int64_t elements() const { return outer * inner; }
};

inline constexpr BlockScaleShape Fp8BlockScaleShape(int64_t rows, int64_t k, bool tiled) {
  return tiled ? BlockScaleShape{(rows + kFp8Block - 1) / kFp8Block, RoundUp(k / kFp8Block, 4)}
               : BlockScaleShape{k / kFp8Block, rows};
}

// Element offset of the scale of (row, K-block) in that matrix.
inline constexpr int64_t Fp8BlockScaleOffset(int64_t row, int64_t block, int64_t rows, int64_t k,
                                             bool tiled) {
  return tiled ? row / kFp8Block * RoundUp(k / kFp8Block, 4) + block : block * rows + row;
}

// cuBLASLt requires a 256-byte aligned workspace; XLA's buffers need not be. The custom calls
// ask XLA for kWorkspaceAlignment extra bytes and hand cuBLASLt the aligned part, always
// size - kWorkspaceAlignment bytes long (so plans keyed by the size do not depend on where XLA
// put the buffer). A buffer too small to align gives size 0.
inline constexpr uint64_t kWorkspaceAlignment = 256;

struct AlignedWorkspace {
  void* data;
  uint64_t size;
};

inline AlignedWorkspace AlignWorkspace(void* data, uint64_t size) {
  if (size < kWorkspaceAlignment) return {data, 0};
  const uintptr_t p = reinterpret_cast<uintptr_t>(data);
  const uintptr_t aligned = (p + kWorkspaceAlignment - 1) & ~uintptr_t{kWorkspaceAlignment - 1};
  return {reinterpret_cast<void*>(aligned), size - kWorkspaceAlignment};
}

}  // namespace jaxmx

#endif  // JAXMX_FFI_LAYOUT_H_
