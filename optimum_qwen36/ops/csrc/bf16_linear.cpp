// y = x @ weight.T (+ bias) for bfloat16 x and weight, accumulated in float32, rounded once to bfloat16.
//
// Up to kStreamRows rows of x (decode, verify): each thread streams its share of the weight once, and
// multiplies every 32-value slice of a weight row with up to kRowGroup x rows by AVX-512 BF16 dot products
// (vdpbf16ps: bf16 pairs multiplied exactly, summed in float32). A decode step reads every weight once, so
// its time follows how close this loop comes to the memory's read bandwidth: the weight is read in
// sequential streams, and prefetched in software kPrefetchBytes ahead into L2 (the hardware prefetcher falls
// behind the slower loops of several x rows, and of several weight rows at a time): in the one-row loop from
// kHardwarePrefetchRows + 1 x rows on (for fewer the hardware prefetcher keeps up alone and software
// prefetches only cost), in the blocked loop always (measured on the AMD EPYC, Zen 4: docs/EXPORT.md 1c).
// Weights with rows of kBlockedMinFeatures values or more go kWeightRows rows at a time: each x slice is
// loaded once for those rows, and their accumulators' lanes are summed together at the end, so a few x rows
// cost little more than one (one weight row at a time, the x loads and the horizontal sums, not the memory,
// bound those rows); shorter rows keep the one-row loop, which measured faster for them at one to eight x
// rows.
// With AMX (and Linux granting this process the tile data), weights whose rows are a multiple of 32 values go
// 16 weight rows at a time through the tile unit instead: C[16 weight rows, x rows] += A[16 weight rows, 32
// values] * B[32 values, x rows], A loaded straight from the row-major weight (16 strided 64-byte loads), B
// from x rearranged once per call into pairs (the layout the tile product takes). One tile product costs
// about the same for any x row count up to 16, where the dot products above cost one per x row, so several
// rows stream the weight faster (docs/EXPORT.md 1c). Weight rows past the last 16 keep the dot products.
// The path depends on the weight's shape only (and the machine), and an output's arithmetic does not depend
// on how many x rows it is computed with: a row's result is the same alone and in a batch. More rows
// (prefill) go to ATen's matrix product (where there are no bf16 dot products for it, in float32 on tiles of
// widened weight rows). With AVX2 and FMA but no AVX-512 BF16, x is widened to float32 once per call and
// each weight slice is widened as it streams (a bf16 is the top half of a float32), then multiplied by FMAs:
// the weight is still read as bf16, half the bytes of a float32 model. Without either, the same loop runs
// in scalar float32 (the same values up to summation order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define QWEN36_BF16_AVX512 1
#include "amx.h"
#ifdef QWEN36_AMX
#define QWEN36_BF16_AMX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#define QWEN36_BF16_AVX2 1
#endif

namespace {

constexpr int64_t kStreamRows = 16;      // x rows up to this count stream the weight
// x rows sharing one pass over a weight row (the one-row loop: two accumulators per x row, within the 32
// AVX-512 registers; AVX2 has 16)
#ifdef QWEN36_BF16_AVX512
constexpr int kRowGroup = 8;
#else
constexpr int kRowGroup = 4;
#endif
constexpr int kBlockRowGroup = 4;        // x rows sharing one pass over kWeightRows weight rows
constexpr int kWeightRows = 4;           // weight rows sharing each load of an x slice (AVX-512 BF16: at
                                         // most 4, the lanes one sum_lanes4 adds up)...
constexpr int64_t kBlockedMinFeatures = 2048;  // ...in weights with rows of at least this many values
constexpr int64_t kPrefetchBytes = 32768;     // how far ahead of the loads the weight is prefetched (L2)...
constexpr int64_t kHardwarePrefetchRows = 3;  // ...in the one-row loop beyond this many x rows (AVX-512 BF16)
constexpr int64_t kNearPrefetchBytes = 2048;  // the same into L1, for the AVX2 loop and the AMX tiles
constexpr int64_t kGrain = 16;            // weight rows per parallel work item, at least
constexpr int64_t kTileBytes = 4 << 20;   // widened weight rows per tile, for more than kStreamRows x rows

using bf16 = c10::BFloat16;
#ifdef QWEN36_BF16_AVX2
using XValue = float;  // x as the FMAs take it, widened once per call
#else
using XValue = bf16;
#endif

#ifdef QWEN36_BF16_AVX2
// 8 bfloat16 -> 8 float32, exactly: a bf16 is the high 16 bits of a float32.
inline __m256 widen_bf16x8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// out[g * out_stride] = dot(w, x[g]) for one weight row w and G x rows (stride K). Two accumulators per x
// row (even and odd slices): a dot product's latency, not the loads, would bound a single chain.
template <int G, bool Prefetch>
inline void dot_row(const bf16* w, const XValue* x, int64_t K, float* out, int64_t out_stride) {
  float sums[G] = {};
  int64_t k = 0;
#ifdef QWEN36_BF16_AVX512
  __m512 even[G], odd[G];
  for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  const auto slice = [](const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  for (; k + 64 <= K; k += 64) {
    if constexpr (Prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + k + 32) + kPrefetchBytes, _MM_HINT_T1);
    }
    const __m512bh w0 = slice(w + k), w1 = slice(w + k + 32);
    for (int g = 0; g < G; ++g) {
      even[g] = _mm512_dpbf16_ps(even[g], w0, slice(x + g * K + k));
      odd[g] = _mm512_dpbf16_ps(odd[g], w1, slice(x + g * K + k + 32));
    }
  }
  for (; k < K; k += 32) {  // the last one or two slices, the final one masked to K
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int g = 0; g < G; ++g)
      even[g] = _mm512_dpbf16_ps(even[g], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + g * K + k));
  }
  for (int g = 0; g < G; ++g) sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(even[g], odd[g]));
#elif defined(QWEN36_BF16_AVX2)
  __m256 even[G], odd[G];
  for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    if constexpr (Prefetch)
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kNearPrefetchBytes, _MM_HINT_T0);
    const __m256 w0 = widen_bf16x8(w + k), w1 = widen_bf16x8(w + k + 8);
    for (int g = 0; g < G; ++g) {
      even[g] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + g * K + k), even[g]);
      odd[g] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + g * K + k + 8), odd[g]);
    }
  }
  for (int g = 0; g < G; ++g) sums[g] = optimum_qwen36::horizontal_sum(_mm256_add_ps(even[g], odd[g]));
#endif
  for (; k < K; ++k)
    for (int g = 0; g < G; ++g) sums[g] += float(w[k]) * float(x[g * K + k]);
  for (int g = 0; g < G; ++g) out[g * out_stride] = sums[g];
}

template <int G, bool Prefetch>
void dot_row_rows(const bf16* w, const XValue* x, int64_t K, int rows, float* out, int64_t out_stride) {
  if constexpr (G > 1) {
    if (rows < G) return dot_row_rows<G - 1, Prefetch>(w, x, K, rows, out, out_stride);
  }
  dot_row<G, Prefetch>(w, x, K, out, out_stride);
}

// Whether the one-row loop prefetches the weight in software for `rows` x rows (always on AVX2, where it was
// not measured otherwise).
inline bool software_prefetch(int64_t rows) {
#ifdef QWEN36_BF16_AVX512
  return rows > kHardwarePrefetchRows;
#else
  (void)rows;
  return true;
#endif
}

// y [N, M] (float32) for x [N, K], weight [M, K], N <= kStreamRows.
template <bool Prefetch>
void stream_rows_of(const XValue* x, const bf16* weight, int64_t N, int64_t M, int64_t K, float* y) {
  at::parallel_for(0, M, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      // The weight row stays in L1 for the later groups of x rows.
      for (int64_t n0 = 0; n0 < N; n0 += kRowGroup)
        dot_row_rows<kRowGroup, Prefetch>(weight + m * K, x + n0 * K, K,
                                          int(std::min<int64_t>(kRowGroup, N - n0)), y + n0 * M + m, M);
  });
}

void stream_rows(const XValue* x, const bf16* weight, int64_t N, int64_t M, int64_t K, float* y) {
  if (software_prefetch(N)) return stream_rows_of<true>(x, weight, N, M, K, y);
  stream_rows_of<false>(x, weight, N, M, K, y);
}

#ifdef QWEN36_BF16_AVX512
// The sums of the 16 lanes of a, b, c and d, each by the same tree (halves, then adjacent pairs twice, then
// the two 128-bit halves), whatever the other three hold.
inline __m128 sum_lanes4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const auto fold = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 ab = _mm256_hadd_ps(fold(a), fold(b));  // a01 a23 b01 b23 | a45 a67 b45 b67 (of the folded)
  const __m256 cd = _mm256_hadd_ps(fold(c), fold(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// out[g * out_stride + j] = dot(w[j], x[g]) for W weight rows w[j] = w + j * K and G x rows (stride K).
template <int G, int W>
inline void dot_rows(const bf16* w, const bf16* x, int64_t K, float* out, int64_t out_stride) {
  __m512 acc[G][W];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < W; ++j) acc[g][j] = _mm512_setzero_ps();
  const auto slice = [](const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[W];
    // kPrefetchBytes ahead of each of the W loads: over the stream of blocks every line is prefetched once
    // (a prefetch past the weight's end is dropped, never faults).
    for (int j = 0; j < W; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k) + kPrefetchBytes, _MM_HINT_T1);
    for (int j = 0; j < W; ++j) wv[j] = slice(w + j * K + k);
    for (int g = 0; g < G; ++g) {
      const __m512bh xv = slice(x + g * K + k);
      for (int j = 0; j < W; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], wv[j], xv);
    }
  }
  if (k < K) {  // the last slice, masked to K
    const __mmask32 mask = (__mmask32(1) << (K - k)) - 1;
    const auto masked = [mask](const bf16* p) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); };
    __m512bh wv[W];
    for (int j = 0; j < W; ++j) wv[j] = masked(w + j * K + k);
    for (int g = 0; g < G; ++g) {
      const __m512bh xv = masked(x + g * K + k);
      for (int j = 0; j < W; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], wv[j], xv);
    }
  }
  for (int g = 0; g < G; ++g) {
    __m512 parts[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int j = 0; j < W; ++j) parts[j] = acc[g][j];
    const __m128 sums = sum_lanes4(parts[0], parts[1], parts[2], parts[3]);
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, sums);
    for (int j = 0; j < W; ++j) out[g * out_stride + j] = lanes[j];
  }
}

template <int W, int G = kBlockRowGroup>
void dot_rows_of(const bf16* w, const bf16* x, int64_t K, int rows, float* out, int64_t out_stride) {
  if constexpr (G > 1) {
    if (rows < G) return dot_rows_of<W, G - 1>(w, x, K, rows, out, out_stride);
  }
  dot_rows<G, W>(w, x, K, out, out_stride);
}

// y[:, m:m + W] for all N x rows, kBlockRowGroup x rows at a time (the W weight rows stay in cache for the
// later groups).
template <int W>
void weight_rows_times_x(const bf16* x, const bf16* weight, int64_t N, int64_t M, int64_t K, int64_t m, float* y) {
  for (int64_t n0 = 0; n0 < N; n0 += kBlockRowGroup)
    dot_rows_of<W>(weight + m * K, x + n0 * K, K, int(std::min<int64_t>(kBlockRowGroup, N - n0)),
                   y + n0 * M + m, M);
}

// y [N, M] (float32) for x [N, K], weight [M, K], N <= kStreamRows: kWeightRows weight rows at a time (the
// rows left over one at a time, with the same arithmetic).
void stream_row_blocks(const bf16* x, const bf16* weight, int64_t N, int64_t M, int64_t K, float* y) {
  at::parallel_for(0, M, kGrain, [&](int64_t begin, int64_t end) {
    int64_t m = begin;
    for (; m + kWeightRows <= end; m += kWeightRows)
      weight_rows_times_x<kWeightRows>(x, weight, N, M, K, m, y);
    for (; m < end; ++m) weight_rows_times_x<1>(x, weight, N, M, K, m, y);
  });
}
#endif

#ifdef QWEN36_BF16_AMX
constexpr int64_t kTileRows = optimum_qwen36::amx::kRows;      // weight rows per tile
constexpr int64_t kTileValues = optimum_qwen36::amx::kValues;  // values per tile row (64 bytes of bf16)

// The tiles used (the intrinsics take literal tile numbers): the float32 accumulator, the weight, x.
#define ACC_TILE 0
#define WEIGHT_TILE 1
#define X_TILE 2

// y[:, m0:m0 + kTileRows * tiles] for N <= kTileRows x rows: x_pairs is x as [K / 2][N][2] (B), each weight
// tile 16 rows x 32 values (A), the product accumulated in one float32 tile over K.
void weight_tiles_times_x(const bf16* x_pairs, const bf16* weight, int64_t N, int64_t M, int64_t K, int64_t m0,
                          int64_t tiles, float* y) {
  alignas(64) float acc[kTileRows * kTileRows];
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m = m0 + t * kTileRows;
    const bf16* w = weight + m * K;
    _tile_zero(ACC_TILE);
    for (int64_t k = 0; k < K; k += kTileValues) {
      for (int64_t r = 0; r < kTileRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kNearPrefetchBytes, _MM_HINT_T0);
      _tile_loadd(X_TILE, x_pairs + k * N, N * 2 * int64_t(sizeof(bf16)));
      _tile_loadd(WEIGHT_TILE, w + k, K * int64_t(sizeof(bf16)));
      _tile_dpbf16ps(ACC_TILE, WEIGHT_TILE, X_TILE);
    }
    _tile_stored(ACC_TILE, acc, N * int64_t(sizeof(float)));
    for (int64_t r = 0; r < kTileRows; ++r)
      for (int64_t n = 0; n < N; ++n) y[n * M + m + r] = acc[r * N + n];
  }
}

// y [N, M] (float32) for x [N, K], weight [M, K], N <= kStreamRows, K a multiple of kTileValues: the first
// M / 16 * 16 weight rows through tiles, the rest by dot products.
void stream_row_tiles(const bf16* x, const bf16* weight, int64_t N, int64_t M, int64_t K, float* y) {
  std::vector<bf16> x_pairs(size_t(N * K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) x_pairs[size_t((k / 2) * N * 2 + n * 2 + k % 2)] = x[n * K + k];
  const int64_t tiles = M / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    optimum_qwen36::amx::TileConfig config;
    config.rows[ACC_TILE] = config.rows[WEIGHT_TILE] = config.rows[X_TILE] = kTileRows;
    config.colsb[ACC_TILE] = uint16_t(N * sizeof(float));
    config.colsb[WEIGHT_TILE] = uint16_t(kTileValues * sizeof(bf16));
    config.colsb[X_TILE] = uint16_t(N * 2 * sizeof(bf16));
    _tile_loadconfig(&config);
    weight_tiles_times_x(x_pairs.data(), weight, N, M, K, begin * kTileRows, end - begin, y);
    optimum_qwen36::amx::release();
  });
  for (int64_t m = tiles * kTileRows; m < M; ++m) weight_rows_times_x<1>(x, weight, N, M, K, m, y);
}
#endif

#ifdef QWEN36_BF16_AVX2
// More than kStreamRows rows without bf16 dot products (ATen's bf16 product then runs several times slower
// than its float32 one): the float32 product of the widened values (exact), kTileBytes of widened weight rows
// at a time in a buffer that stays in cache, so the weight is read once as bf16 rather than widened whole
// into memory and read back.
at::Tensor widened_tiles_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t M = weight.size(0), K = weight.size(1), N = x.numel() / K;
  const at::Tensor xf = x.reshape({N, K}).to(at::kFloat).contiguous();
  const at::Tensor w = weight.contiguous();
  const bf16* w_ptr = reinterpret_cast<const bf16*>(w.data_ptr());
  const int64_t tile_rows =
      std::max<int64_t>(2 * kGrain, kTileBytes / int64_t(sizeof(float) * K) / kGrain * kGrain);
  at::Tensor tile = at::empty({std::min(tile_rows, M), K}, xf.options());
  at::Tensor y = at::empty({N, M}, xf.options());
  for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, M - m0);
    float* t = tile.data_ptr<float>();
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const bf16* src = w_ptr + (m0 + r) * K;
        float* dst = t + r * K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, widen_bf16x8(src + k));
        for (; k < K; ++k) dst[k] = float(src[k]);
      }
    });
    y.narrow(1, m0, rows).copy_(at::mm(xf, tile.narrow(0, 0, rows).t()));
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  auto out_shape = x.sizes().vec();
  out_shape.back() = M;
  return y.to(at::kBFloat16).reshape(out_shape);
}
#endif

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "bf16_linear: x and a 2-D weight must be bfloat16");
  const int64_t M = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, "bf16_linear: x has ", x.size(-1), " features, the weight ", K);
  const int64_t N = x.numel() / K;
  if (N > kStreamRows) {
#ifdef QWEN36_BF16_AVX2
    return widened_tiles_linear(x, weight, bias);
#else
    return at::linear(x, weight, bias);
#endif
  }
  auto out_shape = x.sizes().vec();
  out_shape.back() = M;
  const at::Tensor xc = x.reshape({N, K}).to(c10::CppTypeToScalarType<XValue>::value).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty({N, M}, x.options().dtype(at::kFloat));
  const auto* x_ptr = reinterpret_cast<const XValue*>(xc.data_ptr());
  const auto* w_ptr = reinterpret_cast<const bf16*>(w.data_ptr());
#ifdef QWEN36_BF16_AVX512
  // Whether weight rows go through tiles or in blocks depends on the weight's shape only (and the machine),
  // so a row's result does not depend on the batch (short weight rows measured faster one at a time, at one
  // to three x rows).
#ifdef QWEN36_BF16_AMX
  if (N > 0 && K % kTileValues == 0 && M >= kTileRows && optimum_qwen36::amx::granted()) {
    stream_row_tiles(x_ptr, w_ptr, N, M, K, y.data_ptr<float>());
  } else if (K >= kBlockedMinFeatures) {
#else
  if (K >= kBlockedMinFeatures) {
#endif
    stream_row_blocks(x_ptr, w_ptr, N, M, K, y.data_ptr<float>());
  } else {
    stream_rows(x_ptr, w_ptr, N, M, K, y.data_ptr<float>());
  }
#else
  stream_rows(x_ptr, w_ptr, N, M, K, y.data_ptr<float>());
#endif
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y.to(at::kBFloat16).reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_qwen36, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
}
