// Sizes and offsets shared by the handlers and the cuBLASLt core (ffi/cublaslt_gemm.cc): the
// cuBLAS scale layout and the workspace alignment. Needs neither XLA nor CUDA headers.
#ifndef JAXMX_FFI_LAYOUT_H_
#define JAXMX_FFI_LAYOUT_H_

#include <cstdint>
#include <optional>

namespace jaxmx {

inline constexpr int64_t kBlock = 32;     // elements per E8M0 scale (MXFP8)
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
