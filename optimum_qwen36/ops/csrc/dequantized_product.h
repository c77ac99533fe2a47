// The matrix path of the quantized linears (fp8_linear, int4_linear) for more rows of x than they stream:
// the weight dequantized in x's compute dtype one tile of output features at a time, multiplied with ATen's
// matrix kernel.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace optimum_qwen36 {

constexpr int64_t kTileRows = 1024;         // output features dequantized per tile...
constexpr int64_t kWholeWeightRows = 256;   // ...up to this many x rows; from here, as many as fit:
constexpr int64_t kMaxTileElements = int64_t(16) << 20;

// Output features per dequantized tile, a multiple of `row_multiple` (a scale block's rows). A few x rows
// multiply a tile that stays in cache; from kWholeWeightRows the product is bound by arithmetic, and one
// product over the whole weight (up to kMaxTileElements) runs faster than one per tile, each of which packs
// x again and writes its part of y through a copy.
inline int64_t matrix_tile_rows(int64_t N, int64_t M, int64_t K, int64_t row_multiple) {
  if (N >= kWholeWeightRows && M * K <= kMaxTileElements) return M;
  const int64_t rows = N >= kWholeWeightRows ? kMaxTileElements / K : kTileRows;
  return std::max<int64_t>(row_multiple, rows / row_multiple * row_multiple);
}

// y [N, M] in xm's dtype = xm [N, K] @ W.T, W dequantized by `dequantize(m0, m1, tile)` into tile
// ([m1 - m0, K], xm's dtype) one tile at a time.
template <typename Dequantize>
at::Tensor tiled_product(const at::Tensor& xm, int64_t M, int64_t row_multiple, Dequantize dequantize) {
  const int64_t N = xm.size(0), K = xm.size(1);
  const int64_t tile = matrix_tile_rows(N, M, K, row_multiple);
  at::Tensor dequantized = at::empty({std::min(tile, M), K}, xm.options());
  at::Tensor y = at::empty({N, M}, xm.options());
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    const int64_t m1 = std::min(M, m0 + tile);
    at::Tensor part = dequantized.narrow(0, 0, m1 - m0);
    dequantize(m0, m1, part);
    if (tile >= M) {
      at::mm_out(y, xm, part.t());
    } else {
      y.narrow(1, m0, m1 - m0).copy_(at::mm(xm, part.t()));
    }
  }
  return y;
}

}  // namespace optimum_qwen36
