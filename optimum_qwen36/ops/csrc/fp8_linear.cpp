// y = x @ dequantize(weight, scale_inv).T for block-scaled float8_e4m3fn weights (Qwen's FP8 layout:
// weight [M, K] e4m3, scale_inv [ceil(M / block_rows), ceil(K / block_cols)], W ~ weight * scale_inv).
//
// Up to kStreamRows rows of x (decode): every weight byte is read once, widened in registers, accumulated
// per column block in float32 and scaled once per block; the weight is read at one byte per parameter, half
// of bf16's traffic. bfloat16 x on a CPU with AVX-512 BF16 and VBMI: 64 bytes at a time become bf16 through
// two 128-entry byte tables (vpermi2b: the low and the high byte of each value's bf16 bits, exact for every
// e4m3 value) and meet x in vdpbf16ps, as bf16_linear streams bf16 weights. Otherwise (float32 x, or no
// such CPU) each byte is widened to float32 (AVX2 + F16C) and multiplied in float32 FMAs. Either way a row
// of x gets the same result alone and in a batch. More rows
// (prefill): the weight is dequantized in x's dtype (bf16 through the same tables where built), one tile of
// output features at a time below kWholeWeightRows rows, whole from there, and multiplied with ATen's matrix
// kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "dequantized_product.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "vec_math.h"
#define QWEN36_FP8_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define QWEN36_FP8_AVX512 1
#endif

namespace {

constexpr int64_t kStreamRows = 8;  // decode batches up to this size stream the weight once
constexpr int64_t kRowGroup = 4;    // float32 path: x rows sharing one pass over a weight row
// How far ahead of the loads the bf16 path prefetches the weight: into L2 far ahead for up to
// kFarPrefetchRows x rows (bound by memory), into L1 near for more (bound by the byte conversion, where the
// far prefetch measured slower; bench_matvec.py --fp8).
constexpr int64_t kFarPrefetchBytes = 16384;
constexpr int64_t kNearPrefetchBytes = 2048;
constexpr int kFarPrefetchRows = 4;

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

using optimum_qwen36::horizontal_sum;
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

#ifdef QWEN36_FP8_AVX512
using bf16 = c10::BFloat16;

// The bf16 bits of every e4m3 magnitude (the low 7 bits of a byte), split into four 64-byte tables: low bytes
// of magnitudes 0-63 and 64-127, then high bytes. Every finite e4m3 value, subnormals included, is a bf16
// value; 0x7F (NaN) maps to a bf16 NaN.
struct E4m3Tables {
  alignas(64) uint8_t bytes[4][64];
  E4m3Tables() {
    for (int m = 0; m < 128; ++m) {
      const uint16_t bits = c10::BFloat16(e4m3_to_float(uint8_t(m))).x;
      bytes[m / 64][m % 64] = uint8_t(bits & 0xFF);
      bytes[2 + m / 64][m % 64] = uint8_t(bits >> 8);
    }
  }
};
const E4m3Tables kE4m3Tables;

// The four tables and the sign mask, in registers for a kernel's loop.
struct ByteTables {
  __m512i low0, low1, high0, high1, sign;
  ByteTables()
      : low0(_mm512_load_si512(kE4m3Tables.bytes[0])),
        low1(_mm512_load_si512(kE4m3Tables.bytes[1])),
        high0(_mm512_load_si512(kE4m3Tables.bytes[2])),
        high1(_mm512_load_si512(kE4m3Tables.bytes[3])),
        sign(_mm512_set1_epi8(int8_t(0x80))) {}
};

// 64 e4m3 bytes -> two vectors of 32 bf16 values, exactly. The byte unpacks interleave within 128-bit lanes:
// `first` holds values 0-7, 16-23, 32-39, 48-55 and `second` the other halves of each 16 (slice_position).
inline void e4m3x64_to_bf16(const uint8_t* p, const ByteTables& t, __m512i& first, __m512i& second) {
  const __m512i bytes = _mm512_loadu_si512(p);
  const __m512i low = _mm512_permutex2var_epi8(t.low0, bytes, t.low1);
  // the high byte of the magnitude's bits, with the byte's sign bit: A | (B & C)
  const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.high0, bytes, t.high1), bytes, t.sign,
                                                 0xF8);
  first = _mm512_unpacklo_epi8(low, high);
  second = _mm512_unpackhi_epi8(low, high);
}

// The position in a 64-value slice that each bf16 lane of e4m3x64_to_bf16's two vectors holds.
inline int64_t slice_position(int64_t lane) {
  const int64_t half = lane / 32, i = lane % 32;
  return 16 * (i / 8) + 8 * half + i % 8;
}

// x [N, K] (contiguous bf16) with each whole 64-value slice in slice_position order (the tail past the last
// whole slice as is): a plain copy, cheap beside the weight it meets.
at::Tensor x_in_slice_order(const at::Tensor& x) {
  const int64_t N = x.size(0), K = x.size(1), whole = K / 64 * 64;
  static const auto positions = [] {
    std::array<int64_t, 64> p{};
    for (int64_t lane = 0; lane < 64; ++lane) p[lane] = slice_position(lane);
    return p;
  }();
  at::Tensor ordered = at::empty_like(x);
  const bf16* in = reinterpret_cast<const bf16*>(x.data_ptr());
  bf16* out = reinterpret_cast<bf16*>(ordered.data_ptr());
  for (int64_t n = 0; n < N; ++n) {
    const bf16* row = in + n * K;
    bf16* o = out + n * K;
    for (int64_t k0 = 0; k0 < whole; k0 += 64)
      for (int64_t lane = 0; lane < 64; ++lane) o[k0 + lane] = row[k0 + positions[lane]];
    std::copy(row + whole, row + K, o + whole);
  }
  return ordered;
}

// out[g][m] for G bf16 rows of x (row stride K, in slice order) against weight row m: 64 bytes at a time
// turned into two vectors of 32 bf16 values (e4m3x64_to_bf16), dot products summed in float32 per column
// block and scaled once per block. Whole 64-value slices inside a block run vectorized (block_cols % 64 == 0), the rest is
// scalar. One chain of dot products per x row, whatever G: a row's arithmetic does not depend on how many
// rows share the pass, so a row of x gets the same result alone and in a batch (batch-invariant decode).
// Two chains per row for small G (to hide the dot product's latency) ran no faster in an ad-hoc comparison.
template <int G>
inline void dot_weight_row_bf16(const uint8_t* w_row, const float* scale_row, const bf16* x, int64_t K,
                                int64_t block_cols, float* out, int64_t out_stride) {
  const ByteTables tables;
  __m512 total[G];
  float tail[G] = {};
  for (int g = 0; g < G; ++g) total[g] = _mm512_setzero_ps();
  for (int64_t k0 = 0, block = 0; k0 < K; k0 += block_cols, ++block) {
    const int64_t k1 = std::min(K, k0 + block_cols);
    __m512 chain[G];
    for (int g = 0; g < G; ++g) chain[g] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      if constexpr (G <= kFarPrefetchRows)
        _mm_prefetch(reinterpret_cast<const char*>(w_row + k) + kFarPrefetchBytes, _MM_HINT_T1);
      else
        _mm_prefetch(reinterpret_cast<const char*>(w_row + k) + kNearPrefetchBytes, _MM_HINT_T0);
      __m512i first, second;
      e4m3x64_to_bf16(w_row + k, tables, first, second);
      const __m512bh w0 = (__m512bh)first, w1 = (__m512bh)second;
      for (int g = 0; g < G; ++g) {
        chain[g] = _mm512_dpbf16_ps(chain[g], w0, (__m512bh)_mm512_loadu_si512(x + g * K + k));
        chain[g] = _mm512_dpbf16_ps(chain[g], w1, (__m512bh)_mm512_loadu_si512(x + g * K + k + 32));
      }
    }
    float partial[G] = {};
    for (; k < k1; ++k) {
      const float w = e4m3_to_float(w_row[k]);
      for (int g = 0; g < G; ++g) partial[g] += w * float(x[g * K + k]);
    }
    const float scale = scale_row[block];
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int g = 0; g < G; ++g) {
      total[g] = _mm512_fmadd_ps(chain[g], scale_v, total[g]);
      tail[g] += partial[g] * scale;
    }
  }
  for (int g = 0; g < G; ++g) out[g * out_stride] = _mm512_reduce_add_ps(total[g]) + tail[g];
}

template <int G>
void dot_weight_row_bf16_rows(const uint8_t* w_row, const float* scale_row, const bf16* x, int64_t K,
                              int64_t block_cols, int rows, float* out, int64_t out_stride) {
  if constexpr (G > 1) {
    if (rows < G)
      return dot_weight_row_bf16_rows<G - 1>(w_row, scale_row, x, K, block_cols, rows, out, out_stride);
  }
  dot_weight_row_bf16<G>(w_row, scale_row, x, K, block_cols, out, out_stride);
}

// y [N, M] (float32) for bf16 x [N, K] in slice order, N <= kStreamRows: all rows in one pass over the
// weight, which is converted once.
void stream_rows_bf16(const bf16* x, const uint8_t* weight, const float* scale, int64_t N, int64_t M, int64_t K,
                      int64_t block_rows, int64_t block_cols, int64_t scale_cols, float* y) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const uint8_t* w_row = weight + m * K;
      const float* scale_row = scale + (m / block_rows) * scale_cols;
      dot_weight_row_bf16_rows<kStreamRows>(w_row, scale_row, x, K, block_cols, int(N), y + m, M);
    }
  });
}

// Rows [m0, m1) of the dequantized weight as bf16 [m1 - m0, K]: each value times its block's scale in
// float32, rounded to nearest even (the values dequantize_fp8 gives).
void dequantize_rows_bf16(const uint8_t* weight, const float* scale, int64_t m0, int64_t m1, int64_t K,
                          int64_t block_rows, int64_t block_cols, int64_t scale_cols, bf16* out) {
  const __m512i first_half = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);  // slice order back to natural order
  const __m512i second_half = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  at::parallel_for(m0, m1, 8, [&](int64_t begin, int64_t end) {
    const ByteTables tables;
    for (int64_t m = begin; m < end; ++m) {
      const uint8_t* w_row = weight + m * K;
      const float* scale_row = scale + (m / block_rows) * scale_cols;
      bf16* o = out + (m - m0) * K;
      for (int64_t k0 = 0, block = 0; k0 < K; k0 += block_cols, ++block) {
        const int64_t k1 = std::min(K, k0 + block_cols);
        const float s = scale_row[block];
        const __m512 sv = _mm512_set1_ps(s);
        const auto scaled = [&](__m512i values) {
          const auto widen = [](__m256i half) {
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
          };
          const __m512 low = _mm512_mul_ps(widen(_mm512_castsi512_si256(values)), sv);
          const __m512 high = _mm512_mul_ps(widen(_mm512_extracti64x4_epi64(values, 1)), sv);
          return (__m512i)_mm512_cvtne2ps_pbh(high, low);
        };
        int64_t k = k0;
        for (; k + 64 <= k1; k += 64) {
          __m512i first, second;
          e4m3x64_to_bf16(w_row + k, tables, first, second);
          first = scaled(first);
          second = scaled(second);
          _mm512_storeu_si512(o + k, _mm512_permutex2var_epi64(first, first_half, second));
          _mm512_storeu_si512(o + k + 32, _mm512_permutex2var_epi64(first, second_half, second));
        }
        for (; k < k1; ++k) o[k] = bf16(e4m3_to_float(w_row[k]) * s);
      }
    }
  });
}
#endif

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

// Rows [m0, m1) of the dequantized weight into `out` (float32 or bf16 [m1 - m0, K]).
void dequantize_tile(const uint8_t* weight, const float* scale, int64_t m0, int64_t m1, int64_t K,
                     int64_t block_rows, int64_t block_cols, int64_t scale_cols, at::Tensor& out) {
  if (out.scalar_type() == at::kFloat) {
    dequantize_rows(weight, scale, m0, m1, K, block_rows, block_cols, scale_cols, out.data_ptr<float>());
    return;
  }
#ifdef QWEN36_FP8_AVX512
  dequantize_rows_bf16(weight, scale, m0, m1, K, block_rows, block_cols, scale_cols,
                       reinterpret_cast<bf16*>(out.data_ptr()));
#else
  at::Tensor widened = at::empty(out.sizes(), out.options().dtype(at::kFloat));
  dequantize_rows(weight, scale, m0, m1, K, block_rows, block_cols, scale_cols, widened.data_ptr<float>());
  out.copy_(widened);
#endif
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
  TORCH_CHECK(K > 0, "fp8_linear: the weight has no input features");
  const auto out_shape = [&] {
    auto shape = x.sizes().vec();
    shape.back() = M;
    return shape;
  }();
  const at::Tensor w = weight.contiguous();
  const at::Tensor s = scale_inv.to(at::kFloat).contiguous();
  const int64_t N = x.numel() / K;
  if (N == 0) return at::empty(out_shape, x.options());
  const uint8_t* w_ptr = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  if (N <= kStreamRows) {
    at::Tensor y = at::empty({N, M}, x.options().dtype(at::kFloat));
#ifdef QWEN36_FP8_AVX512
    if (bf16_x && block_cols % 64 == 0) {
      const at::Tensor xs = x_in_slice_order(x.reshape({N, K}).contiguous());
      stream_rows_bf16(reinterpret_cast<const bf16*>(xs.data_ptr()), w_ptr, s.data_ptr<float>(), N, M, K,
                       block_rows, block_cols, scale_cols, y.data_ptr<float>());
      return y.to(x.scalar_type()).reshape(out_shape);
    }
#endif
    const at::Tensor xf = x.reshape({N, K}).to(at::kFloat).contiguous();
    stream_rows(xf.data_ptr<float>(), w_ptr, s.data_ptr<float>(), N, M, K, block_rows, block_cols, scale_cols,
                y.data_ptr<float>());
    return y.to(x.scalar_type()).reshape(out_shape);
  }
  // Tiles start on a block-row boundary, so each tile's scales are whole rows of scale_inv. bf16 activations
  // multiply bf16 tiles where the CPU has bf16 dot products (ATen's bf16 kernels use them, or AMX); without
  // them ATen's bf16 product runs several times slower than its float32 one, so they multiply float32 tiles
  // of the exact dequantized values, rounded once at the end as the streaming path does.
#ifdef __AVX512BF16__
  const bool bf16_tiles = bf16_x;
#else
  const bool bf16_tiles = false;
#endif
  const at::Tensor xm = x.reshape({N, K}).to(bf16_tiles ? at::kBFloat16 : at::kFloat).contiguous();
  const at::Tensor y = optimum_qwen36::tiled_product(xm, M, block_rows, [&](int64_t m0, int64_t m1, at::Tensor& part) {
    dequantize_tile(w_ptr, s.data_ptr<float>(), m0, m1, K, block_rows, block_cols, scale_cols, part);
  });
  return y.to(x.scalar_type()).reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY(optimum_qwen36, m) {
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor scale_inv, int block_rows, int block_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("fp8_linear", &fp8_linear);
}
