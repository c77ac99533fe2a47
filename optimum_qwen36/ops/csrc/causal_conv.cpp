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
//
// `causal_conv1d_decode` is one decode step of the same conv (ops/conv.py's `causal_conv1d_decode`): x [B, D]
// (one token per row), conv_state the cache's whole [L, slots, D, W - 1] tensor, of which entry cache_idx,
// slot slots[b] is row b's state. Each row's output is computed as a packed token's (the same taps, the same
// float32 sums), and its slot's state becomes its last W - 1 inputs, in place: no gathered copy of the
// states, no scatter back. A row with a negative slot is padding: no state is read or written, its output
// is zeros.
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

#if defined(__AVX512F__)
// 16 bf16 values -> 16 float32, exactly (a bf16 is the high half of a float32).
inline __m512 widen16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
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
        const __m512 x = widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[tap] + d)));
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

constexpr int64_t kMaxDecodeWidth = 8;  // taps of a decode step's conv (Qwen3.5 / 3.6: 4)

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The 16 bf16 values in the low half of v -> 16 float32.
inline __m512 widen_low16(__m512i v) { return widen16(_mm512_castsi512_si256(v)); }

// The 32 16-bit lanes of an index vector from f(lane).
template <typename F>
__m512i lanes16(F f) {
  alignas(64) int16_t lanes[32];
  for (int i = 0; i < 32; ++i) lanes[i] = int16_t(f(i));
  return _mm512_load_si512(lanes);
}

// decode_row's 16-channel blocks for a 4-tap conv of bf16 values: the 48 state values and 64 weights of a
// block are loaded whole (two registers of 32 values each) and rearranged by 16-bit lane permutes (the
// scalar loops below, one value at a time, took ~25 us per row of 6144 channels). Returns the channels done
// (a multiple of 16).
int64_t decode_blocks_w4(const c10::BFloat16* x, const c10::BFloat16* weight, int64_t channels, c10::BFloat16* state,
                         c10::BFloat16* out) {
  // Tap j of channel c is state value 3c + j (j < 3) and weight 4c + j. The new state value i is the old
  // value i + 1, or x[i / 3] where i % 3 == 2 (bits of `from_x`); the second register holds values 32-47.
  static const __m512i tap_index[3] = {lanes16([](int c) { return 3 * (c % 16); }),
                                       lanes16([](int c) { return 3 * (c % 16) + 1; }),
                                       lanes16([](int c) { return 3 * (c % 16) + 2; })};
  static const __m512i weight_index[4] = {lanes16([](int c) { return 4 * (c % 16); }),
                                          lanes16([](int c) { return 4 * (c % 16) + 1; }),
                                          lanes16([](int c) { return 4 * (c % 16) + 2; }),
                                          lanes16([](int c) { return 4 * (c % 16) + 3; })};
  static const __m512i next_index[2] = {lanes16([](int i) { return std::min(i + 1, 63); }),
                                     lanes16([](int i) { return std::min(32 + i + 1, 63); })};
  static const __m512i x_index[2] = {lanes16([](int i) { return i / 3; }),
                                     lanes16([](int i) { return std::min((32 + i) / 3, 15); })};
  const auto from_x = [](int base) {
    __mmask32 mask = 0;
    for (int i = 0; i < 32; ++i)
      if ((base + i) % 3 == 2) mask |= __mmask32(1) << i;
    return mask;
  };
  static const __mmask32 x_lanes[2] = {from_x(0), from_x(32)};
  alignas(64) float lanes[16];
  int64_t d = 0;
  for (; d + 16 <= channels; d += 16) {
    c10::BFloat16* inputs = state + d * 3;
    const __m512i low = _mm512_loadu_si512(inputs), high = _mm512_maskz_loadu_epi16(0xFFFF, inputs + 32);
    const __m512i xv = _mm512_maskz_loadu_epi16(0xFFFF, x + d);
    const __m512i w_low = _mm512_loadu_si512(weight + d * 4), w_high = _mm512_loadu_si512(weight + d * 4 + 32);
    __m512 sum = _mm512_setzero_ps();
    for (int tap = 0; tap < 3; ++tap)
      sum = _mm512_fmadd_ps(widen_low16(_mm512_permutex2var_epi16(low, tap_index[tap], high)),
                            widen_low16(_mm512_permutex2var_epi16(w_low, weight_index[tap], w_high)), sum);
    sum = _mm512_fmadd_ps(widen_low16(xv), widen_low16(_mm512_permutex2var_epi16(w_low, weight_index[3], w_high)),
                          sum);
    _mm512_store_ps(lanes, silu(sum));
    from_float(lanes, 16, out + d);
    for (int r = 0; r < 2; ++r) {
      const __m512i kept = _mm512_permutex2var_epi16(low, next_index[r], high);
      const __m512i next = _mm512_mask_permutexvar_epi16(kept, x_lanes[r], x_index[r], xv);
      if (r == 0)
        _mm512_storeu_si512(inputs, next);
      else
        _mm512_mask_storeu_epi16(inputs + 32, 0xFFFF, next);
    }
  }
  return d;
}
#endif

// One decode row: out[d] = SiLU(sum over the taps of window[tap][d] * weight[d][tap]), the window being the
// state's W - 1 inputs (state [D, W - 1]) then x; summed as conv_row sums (fused multiply-adds in tap order,
// 16 channels at a time, the same SiLU; the remaining channels as its scalar tail), so a row's output is
// bitwise the same token's in the varlen op. The weight is read as it lies ([D, W], any float dtype). The
// state then takes the row's last W - 1 inputs, in place.
template <typename T, typename W>
void decode_row(const T* x, const W* weight, int64_t channels, int64_t width, T* state, float* scratch, T* out) {
  const int64_t history = width - 1;
  int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<W, c10::BFloat16>) {
    if (width == 4) d = decode_blocks_w4(x, weight, channels, state, out);
  }
#endif
  const int64_t shifted = d;  // the blocks above shifted their channels' states already
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    alignas(64) float taps[kMaxDecodeWidth][16], weights[kMaxDecodeWidth][16], lanes[16];
    for (; d + 16 <= channels; d += 16) {
      for (int64_t c = 0; c < 16; ++c) {
        const T* inputs = state + (d + c) * history;
        for (int64_t j = 0; j < history; ++j) taps[j][c] = float(inputs[j]);
        taps[history][c] = float(x[d + c]);
        for (int64_t tap = 0; tap < width; ++tap) weights[tap][c] = float(weight[(d + c) * width + tap]);
      }
      __m512 sum = _mm512_setzero_ps();
      for (int64_t tap = 0; tap < width; ++tap)
        sum = _mm512_fmadd_ps(_mm512_load_ps(taps[tap]), _mm512_load_ps(weights[tap]), sum);
      _mm512_store_ps(lanes, silu(sum));
      from_float(lanes, 16, out + d);
    }
  }
#endif
  const int64_t rest = channels - d;
  for (int64_t c = 0; c < rest; ++c) {
    const T* inputs = state + (d + c) * history;
    const W* w = weight + (d + c) * width;
    float sum = 0.0f;
    for (int64_t j = 0; j < history; ++j) sum += float(inputs[j]) * float(w[j]);
    scratch[c] = sum + float(x[d + c]) * float(w[history]);
  }
  silu(scratch, rest);
  from_float(scratch, rest, out + d);
  for (int64_t c = shifted; c < channels; ++c) {
    T* inputs = state + c * history;
    for (int64_t j = 0; j + 1 < history; ++j) inputs[j] = inputs[j + 1];
    inputs[history - 1] = x[c];
  }
}

at::Tensor causal_conv1d_decode(const at::Tensor& x, const at::Tensor& weight, at::Tensor conv_state,
                                const at::Tensor& cache_idx, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && conv_state.dim() == 4,
              "causal_conv1d_decode: x [B, D], weight [D, W] and conv_state [L, slots, D, W - 1] expected");
  const int64_t rows = x.size(0), channels = x.size(1), width = weight.size(1);
  TORCH_CHECK(width >= 2 && width <= kMaxDecodeWidth && weight.size(0) == channels && conv_state.size(2) == channels &&
                  conv_state.size(3) == width - 1,
              "causal_conv1d_decode: weight [D, 2 <= W <= 8] and conv_state [L, slots, D, W - 1] must match x's D "
              "channels");
  TORCH_CHECK(x.scalar_type() == conv_state.scalar_type(),
              "causal_conv1d_decode: x and conv_state must have the same dtype");
  TORCH_CHECK(conv_state.is_contiguous(), "causal_conv1d_decode: conv_state must be contiguous (updated in place)");
  TORCH_CHECK(cache_idx.numel() == 1 && slots.dim() == 1 && slots.size(0) == rows,
              "causal_conv1d_decode: one cache entry and one slot per row expected");
  const int64_t layer = cache_idx.item<int64_t>();
  TORCH_CHECK(layer >= 0 && layer < conv_state.size(0), "causal_conv1d_decode: cache entry ", layer,
              " outside the ", conv_state.size(0), " entries");
  const at::Tensor slot = slots.to(at::kLong).contiguous();
  std::vector<int64_t> offsets(rows, -1);  // -1: a padding row
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t s = slot.data_ptr<int64_t>()[b];
    if (s < 0) continue;
    TORCH_CHECK(s < conv_state.size(1), "causal_conv1d_decode: slot ", s, " outside the ", conv_state.size(1),
                " slots");
    offsets[b] = layer * conv_state.stride(0) + s * conv_state.stride(1);
  }
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "causal_conv1d_decode: the weight must be float32 or x's dtype");
  const at::Tensor xc = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "causal_conv1d_decode", [&] {
    using T = scalar_t;
    const T* x_ptr = xc.data_ptr<T>();
    T* state = conv_state.data_ptr<T>();
    T* out_ptr = out.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      const optimum_qwen36::FlushDenormals flush_denormals;
      std::vector<float> scratch(channels);
      for (int64_t b = begin; b < end; ++b) {
        if (offsets[b] < 0) {
          std::fill(out_ptr + b * channels, out_ptr + (b + 1) * channels, T(0));
          continue;
        }
        if (w.scalar_type() == at::kFloat)
          decode_row(x_ptr + b * channels, w.data_ptr<float>(), channels, width, state + offsets[b],
                     scratch.data(), out_ptr + b * channels);
        else
          decode_row(x_ptr + b * channels, w.data_ptr<T>(), channels, width, state + offsets[b], scratch.data(),
                     out_ptr + b * channels);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_qwen36, m) {
  m.def(
      "causal_conv1d_varlen(Tensor x, Tensor weight, Tensor conv_state, Tensor head_tokens, Tensor head_taps, "
      "Tensor conv_tail) -> (Tensor, Tensor)");
  m.def(
      "causal_conv1d_decode(Tensor x, Tensor weight, Tensor(a!) conv_state, Tensor cache_idx, Tensor slots) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("causal_conv1d_varlen", &causal_conv1d_varlen);
  m.impl("causal_conv1d_decode", &causal_conv1d_decode);
}
