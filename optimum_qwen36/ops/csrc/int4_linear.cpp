// y = x @ W.T for 4-bit weights W[m, k] = scale[m, g] * (q[m, k] - zero[m, g]), g = k / group_size, in the
// layout of ops/int4.py: `packed` uint8 [M, Kp / 2] (Kp = K rounded up to 128), two codes a byte ordered so
// that in each 128-feature block byte 16L + j holds feature 8L + j (j < 8) or 32 + 8L + j - 8 in its low
// nibble and that feature + 64 in its high one; `scales` [M, groups] (float32, float16 or bfloat16) and
// `zeros` uint8 [M, groups] over the padded input.
//
// Up to kStreamRows rows of x (decode): every weight byte is read once and widened in registers. bfloat16 x
// on a CPU with AVX-512 BF16: the 64 bytes of a block split into low and high nibbles, and interleaving each
// with the byte 0x43 gives the bf16 bits of 128 + q, features 0-31, 32-63, 64-95 and 96-127 in order (the
// byte unpacks work within 128-bit lanes, which the layout undoes); they meet x in vdpbf16ps, one chain per
// group, scaled once per group. Since sum((128 + q) x) - (128 + zero) sum(x) = sum((q - zero) x), each x row's
// group sums (computed once per call) take the zero points and the offset out of the inner loop. Otherwise
// (float32 x, or no such CPU) each block's codes are widened to float32 (AVX2) and multiplied in float32
// FMAs, per group scale * sum((q - zero) x). Either way a row of x goes through the same operations
// alone and in a batch: its result is bitwise the same (batch-invariant decode).
//
// More rows (prefill): the weight is dequantized in the compute dtype one tile of output features at a time
// (bit for bit ops/int4.py's dequantize_int4) and multiplied with ATen's matrix kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "dequantized_product.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#define QWEN36_INT4_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define QWEN36_INT4_AVX512 1
#endif

namespace {

constexpr int64_t kStreamRows = 8;  // decode batches up to this size stream the weight once
// bf16 path: x rows sharing one pass over a weight row (the next rows take another pass, over the row then in
// cache): more would not keep their chains and totals in the 32 vector registers.
constexpr int kPassRows = 4;
constexpr int64_t kBlock = 128;     // features per packed block
constexpr int64_t kBlockBytes = 64;
// How far ahead of the loads the streaming paths prefetch the weight (into L2).
constexpr int64_t kPrefetchBytes = 8192;

// The feature of the low nibble of byte b in a block (the high nibble's is 64 more).
inline int64_t low_feature(int64_t b) {
  const int64_t lane = b / 16, j = b % 16;
  return j < 8 ? 8 * lane + j : 32 + 8 * lane + j - 8;
}

template <typename S>
inline float to_float(S value) {
  return static_cast<float>(value);
}

// Codes of one 128-feature block (64 bytes) as float32 in natural order.
inline void block_codes(const uint8_t* p, float* out) {
#ifdef QWEN36_INT4_AVX2
  // Each run of 8 bytes holds 8 consecutive features in its low nibbles and the 8 that are 64 further on in
  // its high ones.
  const __m256i low_mask = _mm256_set1_epi32(0xF);
  for (int64_t run = 0; run < 8; ++run) {
    const int64_t first = low_feature(8 * run);
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * run)));
    _mm256_storeu_ps(out + first, _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low_mask)));
    _mm256_storeu_ps(out + first + 64, _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
  }
#else
  for (int64_t b = 0; b < kBlockBytes; ++b) {
    out[low_feature(b)] = float(p[b] & 0xF);
    out[low_feature(b) + 64] = float(p[b] >> 4);
  }
#endif
}

// sum((codes[i] - zero) * x[i]) over 32 floats, in a fixed order (codes - zero is exact).
inline float dot32(const float* codes, float zero, const float* x) {
#ifdef QWEN36_INT4_AVX2
  const __m256 zero_v = _mm256_set1_ps(zero);
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8)
    acc = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_loadu_ps(codes + i), zero_v), _mm256_loadu_ps(x + i), acc);
  return optimum_qwen36::horizontal_sum(acc);
#else
  float total = 0;
  for (int i = 0; i < 32; ++i) total += (codes[i] - zero) * x[i];
  return total;
#endif
}

struct Weights {
  const uint8_t* packed;
  const void* scales;
  const uint8_t* zeros;
  int64_t M, Kp, groups, group_size;
  // Per 32-feature chunk: its group, and whether it is the group's last (no division in the loops).
  const int64_t* chunk_group;
  const bool* chunk_ends_group;
};

// float32 path: out[r][m] for `rows` rows of x (float32 [rows, Kp], zero-padded): per group
// scale * sum((q - zero) x).
template <typename S>
void row_float(const Weights& w, int64_t m, const float* x, int rows, float* out, int64_t out_stride) {
  const uint8_t* w_row = w.packed + m * (w.Kp / 2);
  const S* s_row = static_cast<const S*>(w.scales) + m * w.groups;
  const uint8_t* z_row = w.zeros + m * w.groups;
  float total[kStreamRows] = {}, group_dot[kStreamRows] = {};
  alignas(64) float codes[kBlock];
  for (int64_t k0 = 0; k0 < w.Kp; k0 += kBlock) {
    block_codes(w_row + k0 / 2, codes);
    for (int64_t c = 0; c < kBlock; c += 32) {
      const int64_t k = k0 + c, chunk = k / 32, g = w.chunk_group[chunk];
      const float zero = float(z_row[g]);
      for (int r = 0; r < rows; ++r) group_dot[r] += dot32(codes + c, zero, x + r * w.Kp + k);
      if (w.chunk_ends_group[chunk]) {
        const float scale = to_float(s_row[g]);
        for (int r = 0; r < rows; ++r) {
          total[r] += scale * group_dot[r];
          group_dot[r] = 0;
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) out[r * out_stride] = total[r];
}

#ifdef QWEN36_INT4_AVX512
using bf16 = c10::BFloat16;

// bf16 path: out[r][m] for G rows of x (bf16 [G, Kp], zero-padded; xsum [G, groups]). Groups of 32 or 64
// features take one or two of a block's four vectors; larger ones whole blocks. Two chains of dot products
// per x row and group (a block's first and second halves: the dot product's latency, not the loads, would
// bound a single chain), summed at the group's end, the same whatever G.
template <typename S, int G>
void row_bf16(const Weights& w, int64_t m, const bf16* x, int64_t chunk_stride, const float* xsum, float* out,
              int64_t out_stride) {
  const uint8_t* w_row = w.packed + m * (w.Kp / 2);
  const S* s_row = static_cast<const S*>(w.scales) + m * w.groups;
  const uint8_t* z_row = w.zeros + m * w.groups;
  const __m512i nibble = _mm512_set1_epi8(0x0F), offset = _mm512_set1_epi8(0x43);
  __m512 total[G], chain[2][G];
  float correction[G];
  for (int r = 0; r < G; ++r) {
    total[r] = chain[0][r] = chain[1][r] = _mm512_setzero_ps();
    correction[r] = 0;
  }
  for (int64_t k0 = 0; k0 < w.Kp; k0 += kBlock) {
    _mm_prefetch(reinterpret_cast<const char*>(w_row + k0 / 2) + kPrefetchBytes, _MM_HINT_T1);
    const __m512i bytes = _mm512_loadu_si512(w_row + k0 / 2);
    const __m512i low = _mm512_and_si512(bytes, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    const __m512bh vectors[4] = {(__m512bh)_mm512_unpacklo_epi8(low, offset), (__m512bh)_mm512_unpackhi_epi8(low, offset),
                                 (__m512bh)_mm512_unpacklo_epi8(high, offset), (__m512bh)_mm512_unpackhi_epi8(high, offset)};
    // Unrolled, so that every chain index is a constant and the chains stay in registers.
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const int64_t k = k0 + 32 * c;
#pragma GCC unroll 8
      for (int r = 0; r < G; ++r)
        chain[c / 2][r] = _mm512_dpbf16_ps(chain[c / 2][r], vectors[c],
                                           (__m512bh)_mm512_loadu_si512(x + (k / 32) * chunk_stride + 32 * r));
      if (w.chunk_ends_group[k / 32]) {
        const int64_t g = w.chunk_group[k / 32];
        const float scale = to_float(s_row[g]);
        const float shifted = scale * (float(z_row[g]) + 128.0f);
        const __m512 scale_v = _mm512_set1_ps(scale);
#pragma GCC unroll 8
        for (int r = 0; r < G; ++r) {
          total[r] = _mm512_fmadd_ps(_mm512_add_ps(chain[0][r], chain[1][r]), scale_v, total[r]);
          chain[0][r] = chain[1][r] = _mm512_setzero_ps();
          correction[r] += shifted * xsum[r * w.groups + g];
        }
      }
    }
  }
  for (int r = 0; r < G; ++r) out[r * out_stride] = _mm512_reduce_add_ps(total[r]) - correction[r];
}

template <typename S, int G>
void row_bf16_rows(const Weights& w, int64_t m, const bf16* x, int64_t chunk_stride, const float* xsum, int rows,
                   float* out, int64_t out_stride) {
  if constexpr (G > 1) {
    if (rows < G) return row_bf16_rows<S, G - 1>(w, m, x, chunk_stride, xsum, rows, out, out_stride);
  }
  row_bf16<S, G>(w, m, x, chunk_stride, xsum, out, out_stride);
}
#endif

// x [N, K] as the bf16 streaming path reads it: zero-padded to Kp, chunk-major ([Kp / 32, N, 32]: the rows'
// 32 features of a chunk side by side, so that a pass over a weight row reads x in order, which the caches
// prefetch, however many rows); and each row's sum over each group.
at::Tensor padded_rows(const at::Tensor& x, int64_t N, int64_t K, int64_t Kp, at::ScalarType dtype) {
  at::Tensor padded = at::zeros({N, Kp}, x.options().dtype(dtype));
  padded.narrow(1, 0, K).copy_(x.reshape({N, K}));
  return padded;
}

std::pair<at::Tensor, at::Tensor> padded_rows_and_sums(const at::Tensor& x, int64_t N, int64_t K, const Weights& w) {
  at::Tensor padded = padded_rows(x, N, K, w.Kp, at::kBFloat16);
  const at::Tensor widened = padded.to(at::kFloat);
  const float* xf = widened.data_ptr<float>();
  at::Tensor sums = at::empty({N, w.groups}, x.options().dtype(at::kFloat));
  float* s = sums.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r)
    for (int64_t g = 0; g < w.groups; ++g) {
      float total = 0;
      for (int64_t k = g * w.group_size; k < std::min(w.Kp, (g + 1) * w.group_size); ++k) total += xf[r * w.Kp + k];
      s[r * w.groups + g] = total;
    }
  const at::Tensor chunk_major = padded.view({N, w.Kp / 32, 32}).transpose(0, 1).contiguous();
  return {chunk_major, sums};
}

template <typename S>
void stream(const Weights& w, const at::Tensor& x, int64_t N, int64_t K, at::Tensor& y) {
  float* out = y.data_ptr<float>();
#ifdef QWEN36_INT4_AVX512
  if (x.scalar_type() == at::kBFloat16) {
    const auto [padded, sums] = padded_rows_and_sums(x, N, K, w);
    const bf16* xp = reinterpret_cast<const bf16*>(padded.data_ptr());
    const float* xs = sums.data_ptr<float>();
    at::parallel_for(0, w.M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        for (int64_t r0 = 0; r0 < N; r0 += kPassRows)
          row_bf16_rows<S, kPassRows>(w, m, xp + 32 * r0, 32 * N, xs + r0 * w.groups,
                                      int(std::min<int64_t>(kPassRows, N - r0)), out + r0 * w.M + m, w.M);
    });
    return;
  }
#endif
  const at::Tensor padded = padded_rows(x, N, K, w.Kp, at::kFloat);
  const float* xp = padded.data_ptr<float>();
  at::parallel_for(0, w.M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) row_float<S>(w, m, xp, int(N), out + m, w.M);
  });
}

// Rows [m0, m1) of the dequantized weight into `tile` ([m1 - m0, K], float32 or bf16): scale * (q - zero)
// in float32, rounded to nearest even for bf16.
template <typename S>
void dequantize_rows(const Weights& w, int64_t m0, int64_t m1, int64_t K, at::Tensor& tile) {
  const bool to_bf16 = tile.scalar_type() == at::kBFloat16;
  at::parallel_for(m0, m1, 8, [&](int64_t begin, int64_t end) {
    alignas(64) float codes[kBlock];
    for (int64_t m = begin; m < end; ++m) {
      const uint8_t* w_row = w.packed + m * (w.Kp / 2);
      const S* s_row = static_cast<const S*>(w.scales) + m * w.groups;
      const uint8_t* z_row = w.zeros + m * w.groups;
      float* out_f = to_bf16 ? nullptr : tile.data_ptr<float>() + (m - m0) * K;
      c10::BFloat16* out_b = to_bf16 ? reinterpret_cast<c10::BFloat16*>(tile.data_ptr()) + (m - m0) * K : nullptr;
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        block_codes(w_row + k0 / 2, codes);
        const int64_t n = std::min(kBlock, K - k0);
        for (int64_t c = 0; c < n; c += 32) {
          const int64_t g = w.chunk_group[(k0 + c) / 32];
          const float scale = to_float(s_row[g]), zero = float(z_row[g]);
          const int64_t count = std::min<int64_t>(32, n - c);
          float* values = codes + c;
#ifdef QWEN36_INT4_AVX2
          if (count == 32) {
            const __m256 scale_v = _mm256_set1_ps(scale), zero_v = _mm256_set1_ps(zero);
            for (int i = 0; i < 32; i += 8)
              _mm256_storeu_ps(values + i, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(values + i), zero_v), scale_v));
          } else
#endif
          {
            for (int64_t i = 0; i < count; ++i) values[i] = (values[i] - zero) * scale;
          }
          if (!to_bf16) {
            std::copy(values, values + count, out_f + k0 + c);
            continue;
          }
#ifdef QWEN36_INT4_AVX512
          if (count == 32) {
            const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(values + 16), _mm512_loadu_ps(values));
            _mm512_storeu_si512(out_b + k0 + c, (__m512i)packed);
            continue;
          }
#endif
          for (int64_t i = 0; i < count; ++i) out_b[k0 + c + i] = c10::BFloat16(values[i]);
        }
      }
    }
  });
}

template <typename S>
at::Tensor int4_linear_typed(const at::Tensor& x, const Weights& w, int64_t K, at::IntArrayRef out_shape) {
  const int64_t N = x.numel() / K;
  if (N == 0) return at::empty(out_shape, x.options());
  if (N <= kStreamRows) {
    at::Tensor y = at::empty({N, w.M}, x.options().dtype(at::kFloat));
    stream<S>(w, x, N, K, y);
    return y.to(x.scalar_type()).reshape(out_shape);
  }
  // bf16 activations multiply bf16 tiles where the CPU has bf16 dot products (ATen's bf16 kernels use them);
  // without them ATen's bf16 product runs several times slower than its float32 one, so they multiply
  // float32 tiles, rounded once at the end as the streaming path does.
#ifdef __AVX512BF16__
  const bool bf16_tiles = x.scalar_type() == at::kBFloat16;
#else
  const bool bf16_tiles = false;
#endif
  const at::Tensor xm = x.reshape({N, K}).to(bf16_tiles ? at::kBFloat16 : at::kFloat).contiguous();
  const at::Tensor y = optimum_qwen36::tiled_product(xm, w.M, 1, [&](int64_t m0, int64_t m1, at::Tensor& part) {
    dequantize_rows<S>(w, m0, m1, K, part);
  });
  return y.to(x.scalar_type()).reshape(out_shape);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                       int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu() && zeros.device().is_cpu(),
              "int4_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2, "int4_linear: packed must be 2-D uint8");
  const int64_t K = x.size(-1), M = packed.size(0), Kp = (K + kBlock - 1) / kBlock * kBlock;
  TORCH_CHECK(K > 0, "int4_linear: x has no features");
  TORCH_CHECK(packed.size(1) == Kp / 2, "int4_linear: packed must be [", M, ", ", Kp / 2, "] for ", K,
              " input features, got ", packed.sizes());
  TORCH_CHECK(group_size == 32 || group_size == 64 || (group_size > 0 && group_size % kBlock == 0),
              "int4_linear: group_size must be 32, 64 or a multiple of 128, got ", group_size);
  const int64_t groups = (Kp + group_size - 1) / group_size;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == M && scales.size(1) == groups && zeros.sizes() == scales.sizes(),
              "int4_linear: scales and zeros must be [", M, ", ", groups, "], got ", scales.sizes(), " and ",
              zeros.sizes());
  TORCH_CHECK(zeros.scalar_type() == at::kByte, "int4_linear: zeros must be uint8");
  const at::Tensor p = packed.contiguous(), s = scales.contiguous(), z = zeros.contiguous();
  std::vector<int64_t> chunk_group(Kp / 32);
  std::unique_ptr<bool[]> chunk_ends_group(new bool[Kp / 32]);
  for (int64_t chunk = 0; chunk < Kp / 32; ++chunk) {
    chunk_group[chunk] = chunk * 32 / group_size;
    chunk_ends_group[chunk] = (chunk + 1) * 32 % group_size == 0 || (chunk + 1) * 32 == Kp;
  }
  const Weights w{p.data_ptr<uint8_t>(), s.data_ptr(), z.data_ptr<uint8_t>(), M, Kp, groups, group_size,
                  chunk_group.data(), chunk_ends_group.get()};
  const at::Tensor xc = x.contiguous();
  auto out_shape = x.sizes().vec();
  out_shape.back() = M;
  switch (s.scalar_type()) {
    case at::kFloat:
      return int4_linear_typed<float>(xc, w, K, out_shape);
    case at::kHalf:
      return int4_linear_typed<c10::Half>(xc, w, K, out_shape);
    case at::kBFloat16:
      return int4_linear_typed<c10::BFloat16>(xc, w, K, out_shape);
    default:
      TORCH_CHECK(false, "int4_linear: scales must be float32, float16 or bfloat16, got ", s.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_qwen36, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("int4_linear", &int4_linear);
}
