// y = x @ dequantize(weight, scale_inv).T for block-scaled float8_e4m3fn weights (Qwen's FP8 layout:
// weight [M, K] e4m3, scale_inv [ceil(M / block_rows), ceil(K / block_cols)], W ~ weight * scale_inv).
//
// Up to kStreamRows rows of x (decode): every weight byte is read once and widened to float32 in
// registers, accumulated per column block in float32 and scaled once per block; the weight is read at one
// byte per parameter, half of bf16's traffic. More rows (prefill): the weight is dequantized one tile of
// output features at a time into float32 and multiplied with ATen's matrix kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QWEN36_FP8_AVX2 1
#endif

namespace {

constexpr int64_t kStreamRows = 8;  // decode batches up to this size stream the weight once
constexpr int64_t kRowGroup = 4;    // x rows sharing one pass over a weight row (registers: 2 per row)
constexpr int64_t kTileRows = 512;  // output features dequantized per tile for the matrix path

inline float e4m3_to_float(uint8_t byte) {
  return static_cast<float>(c10::bit_cast<c10::Float8_e4m3fn>(byte));
}

#ifdef QWEN36_FP8_AVX2
// 16 e4m3 bytes -> 16 floats, exactly, each 2^-8 times its value (callers fold 2^8 into the block scale).
// The byte's sign goes to bit 15 and its exponent and mantissa to bits 7..13 of a float16, whose exponent
// bias is 8 more than e4m3's; F16C widens that to float32, subnormals included.
inline void e4m3x16_to_float(const uint8_t* p, __m256& low, __m256& high) {
  __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(h, 8), 1), _mm256_set1_epi16(int16_t(0xBFFF)));
  low = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  high = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

constexpr float kF16Unscale = 256.0f;  // e4m3x16_to_float's 2^-8

inline float horizontal_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// out[g][m] for G rows of x (row stride K): one pass over weight row m, block by block.
template <int G>
inline void dot_weight_row(const uint8_t* w_row, const float* scale_row, const float* x, int64_t K,
                           int64_t block_cols, float* out, int64_t out_stride) {
  float total[G] = {};
  for (int64_t k0 = 0, block = 0; k0 < K; k0 += block_cols, ++block) {
    const int64_t k1 = std::min(K, k0 + block_cols);
    float partial[G] = {};
    int64_t k = k0;
#ifdef QWEN36_FP8_AVX2
    // Two accumulators per row: the FMA latency, not the load, would bound a single chain.
    __m256 acc_low[G], acc_high[G];
    for (int g = 0; g < G; ++g) acc_low[g] = acc_high[g] = _mm256_setzero_ps();
    for (; k + 16 <= k1; k += 16) {
      __m256 w_low, w_high;
      e4m3x16_to_float(w_row + k, w_low, w_high);
      for (int g = 0; g < G; ++g) {
        acc_low[g] = _mm256_fmadd_ps(w_low, _mm256_loadu_ps(x + g * K + k), acc_low[g]);
        acc_high[g] = _mm256_fmadd_ps(w_high, _mm256_loadu_ps(x + g * K + k + 8), acc_high[g]);
      }
    }
    for (int g = 0; g < G; ++g) partial[g] = horizontal_sum(_mm256_add_ps(acc_low[g], acc_high[g])) * kF16Unscale;
#endif
    for (; k < k1; ++k) {
      const float w = e4m3_to_float(w_row[k]);
      for (int g = 0; g < G; ++g) partial[g] += w * x[g * K + k];
    }
    const float scale = scale_row[block];
    for (int g = 0; g < G; ++g) total[g] += partial[g] * scale;
  }
  for (int g = 0; g < G; ++g) out[g * out_stride] = total[g];
}

using RowKernel = void (*)(const uint8_t*, const float*, const float*, int64_t, int64_t, float*, int64_t);
constexpr RowKernel kRowKernels[kRowGroup] = {dot_weight_row<1>, dot_weight_row<2>, dot_weight_row<3>,
                                              dot_weight_row<4>};

// y [N, M] (float32) for x [N, K] (float32), N <= kStreamRows.
void stream_rows(const float* x, const uint8_t* weight, const float* scale, int64_t N, int64_t M, int64_t K,
                 int64_t block_rows, int64_t block_cols, int64_t scale_cols, float* y) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const uint8_t* w_row = weight + m * K;
      const float* scale_row = scale + (m / block_rows) * scale_cols;
      // The weight row stays in L1 for the later groups of x rows.
      for (int64_t n0 = 0; n0 < N; n0 += kRowGroup) {
        const int64_t rows = std::min(kRowGroup, N - n0);
        kRowKernels[rows - 1](w_row, scale_row, x + n0 * K, K, block_cols, y + n0 * M + m, M);
      }
    }
  });
}

// Rows [m0, m1) of the dequantized weight, as float32 [m1 - m0, K].
void dequantize_rows(const uint8_t* weight, const float* scale, int64_t m0, int64_t m1, int64_t K,
                     int64_t block_rows, int64_t block_cols, int64_t scale_cols, float* out) {
  at::parallel_for(m0, m1, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const uint8_t* w_row = weight + m * K;
      const float* scale_row = scale + (m / block_rows) * scale_cols;
      float* o = out + (m - m0) * K;
      for (int64_t k0 = 0, block = 0; k0 < K; k0 += block_cols, ++block) {
        const int64_t k1 = std::min(K, k0 + block_cols);
        const float s = scale_row[block];
        int64_t k = k0;
#ifdef QWEN36_FP8_AVX2
        const __m256 sv = _mm256_set1_ps(s * kF16Unscale);
        for (; k + 16 <= k1; k += 16) {
          __m256 w_low, w_high;
          e4m3x16_to_float(w_row + k, w_low, w_high);
          _mm256_storeu_ps(o + k, _mm256_mul_ps(w_low, sv));
          _mm256_storeu_ps(o + k + 8, _mm256_mul_ps(w_high, sv));
        }
#endif
        for (; k < k1; ++k) o[k] = e4m3_to_float(w_row[k]) * s;
      }
    }
  });
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale_inv,
                      int64_t block_rows, int64_t block_cols) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale_inv.device().is_cpu(),
              "fp8_linear: CPU tensors only");
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn && weight.dim() == 2,
              "fp8_linear: weight must be a 2-D float8_e4m3fn tensor");
  TORCH_CHECK(block_rows > 0 && block_cols > 0, "fp8_linear: block sizes must be positive");
  const int64_t M = weight.size(0), K = weight.size(1);
  const int64_t scale_rows = (M + block_rows - 1) / block_rows, scale_cols = (K + block_cols - 1) / block_cols;
  TORCH_CHECK(scale_inv.dim() == 2 && scale_inv.size(0) == scale_rows && scale_inv.size(1) == scale_cols,
              "fp8_linear: scale_inv must be [", scale_rows, ", ", scale_cols, "] for a [", M, ", ", K,
              "] weight in blocks of [", block_rows, ", ", block_cols, "]");
  TORCH_CHECK(x.size(-1) == K, "fp8_linear: x has ", x.size(-1), " features, the weight ", K);
  const auto out_shape = [&] {
    auto shape = x.sizes().vec();
    shape.back() = M;
    return shape;
  }();
  const at::Tensor x2d = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor s = scale_inv.to(at::kFloat).contiguous();
  const int64_t N = x2d.size(0);
  const uint8_t* w_ptr = reinterpret_cast<const uint8_t*>(w.data_ptr());
  at::Tensor y = at::empty({N, M}, x2d.options());
  if (N <= kStreamRows) {
    stream_rows(x2d.data_ptr<float>(), w_ptr, s.data_ptr<float>(), N, M, K, block_rows, block_cols, scale_cols,
                y.data_ptr<float>());
  } else {
    // Tiles start on a block-row boundary, so each tile's scales are whole rows of scale_inv.
    const int64_t tile = std::max<int64_t>(block_rows, kTileRows / block_rows * block_rows);
    // bf16 activations multiply bf16 tiles: ATen's bf16 kernels (AMX / avx512_bf16 where present) instead of
    // a float32 product.
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const at::Tensor xm = bf16 ? x.reshape({-1, K}).contiguous() : x2d;
    at::Tensor dequantized = at::empty({std::min(tile, M), K}, x2d.options());
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t m1 = std::min(M, m0 + tile);
      at::Tensor part = dequantized.narrow(0, 0, m1 - m0);
      dequantize_rows(w_ptr, s.data_ptr<float>(), m0, m1, K, block_rows, block_cols, scale_cols,
                      part.data_ptr<float>());
      y.narrow(1, m0, m1 - m0).copy_(at::mm(xm, (bf16 ? part.to(at::kBFloat16) : part).t()));
    }
  }
  return y.to(x.scalar_type()).reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY(optimum_qwen36, m) {
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor scale_inv, int block_rows, int block_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("fp8_linear", &fp8_linear);
}
