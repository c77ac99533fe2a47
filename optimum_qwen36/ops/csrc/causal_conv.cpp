// The GDN layers' depthwise causal conv1d + SiLU over the sequences of a packed prefill step, token-major.
//
// The native form of ops/conv.py's `causal_conv1d_varlen`, with the same inputs and outputs: x [N, D] (the
// packed tokens), weight [D, W], conv_state [S, D, W - 1], and the step's indices into the "source rows"
// (the S conv states' W - 1 rows each, then the N tokens): head_tokens [S, W - 1] (the tokens whose taps
// reach into a conv state; N: none), head_taps [S, W - 1, W] (their taps' source rows), conv_tail [R, W - 1]
// (W - 1 source rows per returned state: each sequence's last ones, its new conv state, and any more that a
// caller wants, e.g. the conv state at a prefix cache checkpoint inside a sequence). Every other token's taps are the W - 1
// tokens before it and itself. Taps are multiplied and summed in float32 in tap order, then SiLU; outputs in
// x's dtype, the new states in conv_state's (which must be x's). Products are fused multiply-adds (the
// PyTorch form rounds each product first): a float32 rounding apart.
//
// Each output row is computed 16 channels at a time from its taps' rows (cache-resident neighbours), so the
// op streams x and its output once: the compiled PyTorch form materialised padded float32 copies of the
// whole step.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "denormals.h"
#include "vec_math.h"

namespace {

#ifdef QWEN36_F32_VECTOR
namespace f32 = optimum_qwen36::f32;

// x * sigmoid(x): sigmoid(v) = 1 / (1 + e^-v) = e^v / (1 + e^v), with e = e^-|v| <= 1 nothing overflows.
inline f32::Vec silu(f32::Vec v) {
  const f32::Vec one = f32::set1(1.0f);
  const f32::Vec e = f32::exp_nonpositive(f32::min(v, f32::mul(v, f32::set1(-1.0f))));
  return f32::div(f32::mul(v, f32::select_nonnegative(v, one, e)), f32::add(one, e));
}
#endif

// x * sigmoid(x) over n floats, in place.
void silu(float* x, int64_t n) {
  int64_t d = 0;
#ifdef QWEN36_F32_VECTOR
  for (; d + f32::kLanes <= n; d += f32::kLanes) f32::store(x + d, silu(f32::load(x + d)));
#endif
  for (; d < n; ++d) x[d] = x[d] / (1.0f + std::exp(-x[d]));
}

template <typename T>
void from_float(const float* src, int64_t n, T* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = T(src[d]);
}

#if defined(__AVX512F__)
// float32 -> bf16 16 values at a time (the scalar loop above does not vectorise): rounding to nearest even
// with NaN kept a quiet NaN, as c10::BFloat16 rounds.
template <>
void from_float(const float* src, int64_t n, c10::BFloat16* dst) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 v = _mm512_loadu_ps(src + d);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), _mm512_cvtepi32_epi16(rounded));
  }
  for (; d < n; ++d) dst[d] = c10::BFloat16(src[d]);
}
#endif

// One token's output row from its taps (rows[tap]: x rows, null where the tap is before the first token):
// the taps' products summed, SiLU, rounded to T; 16 channels at a time, nothing stored in between.
template <typename T>
void conv_row(const T* const* rows, const float* w, int64_t width, int64_t channels, float* scratch, T* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    alignas(64) float lanes[16];
    for (; d + 16 <= channels; d += 16) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t tap = 0; tap < width; ++tap) {
        if (rows[tap] == nullptr) continue;
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[tap] + d));
        const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
        sum = _mm512_fmadd_ps(x, _mm512_loadu_ps(w + tap * channels + d), sum);
      }
      _mm512_store_ps(lanes, silu(sum));
      from_float(lanes, 16, out + d);
    }
  }
#endif
  const int64_t rest = channels - d;
  if (rest == 0) return;
  std::fill(scratch, scratch + rest, 0.0f);
  for (int64_t tap = 0; tap < width; ++tap) {
    if (rows[tap] == nullptr) continue;
    for (int64_t c = 0; c < rest; ++c) scratch[c] += float(rows[tap][d + c]) * w[tap * channels + d + c];
  }
  silu(scratch, rest);
  from_float(scratch, rest, out + d);
}

template <typename T>
void conv_varlen(const T* x, const float* w, const T* conv_state, const int64_t* head_tokens,
                 const int64_t* head_taps, const int64_t* conv_tail, int64_t tokens, int64_t channels,
                 int64_t width, int64_t sequences, int64_t tails, T* out, T* new_state) {
  const int64_t history = width - 1, state_rows = sequences * history;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    const optimum_qwen36::FlushDenormals flush_denormals;
    std::vector<float> scratch(channels);
    std::vector<const T*> rows(width);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t tap = 0; tap < width; ++tap) {
        const int64_t source = t - history + tap;
        rows[tap] = source < 0 ? nullptr : x + source * channels;
      }
      conv_row(rows.data(), w, width, channels, scratch.data(), out + t * channels);
    }
  });
  const optimum_qwen36::FlushDenormals flush_denormals;  // as in the workers above
  // The first W - 1 tokens of each sequence, again from their own taps (conv state rows where they reach
  // back past the sequence's start), and each sequence's new conv state. A token source row is x's own; a
  // state row (strided in conv_state) is gathered into `buffer`.
  std::vector<T> gathered(width * channels);
  std::vector<float> scratch(channels);
  std::vector<const T*> rows(width);
  const auto source_row = [&](int64_t r, T* buffer) -> const T* {
    if (r >= state_rows) return x + (r - state_rows) * channels;
    const T* state = conv_state + (r / history) * channels * history + r % history;
    for (int64_t d = 0; d < channels; ++d) buffer[d] = state[d * history];
    return buffer;
  };
  for (int64_t i = 0; i < sequences * history; ++i) {
    const int64_t token = head_tokens[i];
    if (token < 0 || token >= tokens) continue;
    for (int64_t tap = 0; tap < width; ++tap)
      rows[tap] = source_row(head_taps[i * width + tap], gathered.data() + tap * channels);
    conv_row(rows.data(), w, width, channels, scratch.data(), out + token * channels);
  }
  for (int64_t s = 0; s < tails; ++s)
    for (int64_t j = 0; j < history; ++j) {
      const T* row = source_row(conv_tail[s * history + j], gathered.data());
      T* dst = new_state + s * channels * history + j;
      for (int64_t d = 0; d < channels; ++d) dst[d * history] = row[d];
    }
}

std::tuple<at::Tensor, at::Tensor> causal_conv1d_varlen(const at::Tensor& x, const at::Tensor& weight,
                                                        const at::Tensor& conv_state, const at::Tensor& head_tokens,
                                                        const at::Tensor& head_taps, const at::Tensor& conv_tail) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && conv_state.dim() == 3,
              "causal_conv1d_varlen: x [N, D], weight [D, W] and conv_state [S, D, W - 1] expected");
  const int64_t tokens = x.size(0), channels = x.size(1), width = weight.size(1), sequences = conv_state.size(0);
  TORCH_CHECK(weight.size(0) == channels && conv_state.size(1) == channels && conv_state.size(2) == width - 1,
              "causal_conv1d_varlen: weight [D, W] and conv_state [S, D, W - 1] must match x's D channels");
  TORCH_CHECK(x.scalar_type() == conv_state.scalar_type(),
              "causal_conv1d_varlen: x and conv_state must have the same dtype");
  const std::vector<int64_t> index_shape{sequences, width - 1};
  TORCH_CHECK(head_tokens.sizes() == index_shape && conv_tail.dim() == 2 && conv_tail.size(1) == width - 1 &&
                  head_taps.dim() == 3 && head_taps.size(0) == sequences && head_taps.size(1) == width - 1 &&
                  head_taps.size(2) == width,
              "causal_conv1d_varlen: head_tokens [S, W - 1], head_taps [S, W - 1, W] and conv_tail [R, W - 1] "
              "expected");
  const int64_t tails = conv_tail.size(0);
  const at::Tensor xc = x.contiguous(), state = conv_state.contiguous();
  const at::Tensor w = weight.to(at::kFloat).t().contiguous();  // [W, D]: one row per tap
  const at::Tensor heads = head_tokens.to(at::kLong).contiguous(), taps = head_taps.to(at::kLong).contiguous();
  const at::Tensor tail = conv_tail.to(at::kLong).contiguous();
  const int64_t source_rows = sequences * (width - 1) + tokens;
  for (const at::Tensor* index : {&taps, &tail}) {
    const int64_t* p = index->data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(p, p + index->numel(), [&](int64_t r) { return r >= 0 && r < source_rows; }),
                "causal_conv1d_varlen: a source row index is outside the ", source_rows, " source rows");
  }
  at::Tensor out = at::empty_like(xc), new_state = at::empty({tails, channels, width - 1}, state.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "causal_conv1d_varlen", [&] {
    conv_varlen<scalar_t>(xc.data_ptr<scalar_t>(), w.data_ptr<float>(), state.data_ptr<scalar_t>(),
                          heads.data_ptr<int64_t>(), taps.data_ptr<int64_t>(), tail.data_ptr<int64_t>(), tokens,
                          channels, width, sequences, tails, out.data_ptr<scalar_t>(),
                          new_state.data_ptr<scalar_t>());
  });
  return {out, new_state};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_qwen36, m) {
  m.def(
      "causal_conv1d_varlen(Tensor x, Tensor weight, Tensor conv_state, Tensor head_tokens, Tensor head_taps, "
      "Tensor conv_tail) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("causal_conv1d_varlen", &causal_conv1d_varlen);
}
