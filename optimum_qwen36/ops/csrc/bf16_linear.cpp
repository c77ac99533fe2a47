// y = x @ weight.T (+ bias) for bfloat16 x and weight, accumulated in float32, rounded once to bfloat16.
//
// Up to kStreamRows rows of x (decode): each thread streams its share of the weight, row after row, and
// multiplies every 32-value slice of a weight row with up to kRowGroup x rows by AVX-512 BF16 dot products
// (vdpbf16ps: bf16 pairs multiplied exactly, summed in float32). A decode step reads every weight once, so
// its time follows how close this loop comes to the memory's read bandwidth: the weight is read in one
// sequential stream per thread, prefetched kPrefetchBytes ahead (without that, the hardware prefetcher
// falls behind as soon as more than one x row is multiplied). More rows (prefill) go to ATen's matrix
// product (where there are no bf16 dot products for it, in float32 on tiles of widened weight rows). With
// AVX2 and FMA but no AVX-512 BF16, x is widened to float32 once per call and each weight slice is widened
// as it streams (a bf16 is the top half of a float32), then multiplied by FMAs: the weight is still read as
// bf16, half the bytes of a float32 model. Without either, the same loop runs in
// scalar float32 (the same values up to summation order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define QWEN36_BF16_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#define QWEN36_BF16_AVX2 1
#endif

namespace {

constexpr int64_t kStreamRows = 16;      // x rows up to this count stream the weight
constexpr int kRowGroup = 4;             // x rows sharing one pass over a weight row
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of the loads the weight is prefetched
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
template <int G>
inline void dot_row(const bf16* w, const XValue* x, int64_t K, float* out, int64_t out_stride) {
  float sums[G] = {};
  int64_t k = 0;
#ifdef QWEN36_BF16_AVX512
  __m512 even[G], odd[G];
  for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  const auto slice = [](const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + k + 32) + kPrefetchBytes, _MM_HINT_T0);
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
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes, _MM_HINT_T0);
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

template <int G>
void dot_row_rows(const bf16* w, const XValue* x, int64_t K, int rows, float* out, int64_t out_stride) {
  if constexpr (G > 1) {
    if (rows < G) return dot_row_rows<G - 1>(w, x, K, rows, out, out_stride);
  }
  dot_row<G>(w, x, K, out, out_stride);
}

// y [N, M] (float32) for x [N, K], weight [M, K], N <= kStreamRows.
void stream_rows(const XValue* x, const bf16* weight, int64_t N, int64_t M, int64_t K, float* y) {
  at::parallel_for(0, M, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      // The weight row stays in L1 for the later groups of x rows.
      for (int64_t n0 = 0; n0 < N; n0 += kRowGroup)
        dot_row_rows<kRowGroup>(weight + m * K, x + n0 * K, K, int(std::min<int64_t>(kRowGroup, N - n0)),
                                y + n0 * M + m, M);
  });
}

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
  stream_rows(reinterpret_cast<const XValue*>(xc.data_ptr()), reinterpret_cast<const bf16*>(w.data_ptr()), N, M,
              K, y.data_ptr<float>());
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
