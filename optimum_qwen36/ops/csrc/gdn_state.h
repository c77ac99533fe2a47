// What the GDN ops share: the L2 norm of q and k, the checked address of a slot's recurrent state, and the
// delta rule of one token (a decode step's, also a packed prefill's one-token sequences').
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "denormals.h"

namespace optimum_qwen36 {

// x <- x / sqrt(sum(x^2) + eps) * factor over n values (eps as the flash-linear-attention kernels).
inline void normalise(float* x, int64_t n, float factor) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = factor / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// Refuses a recurrent_state that is not a contiguous float32 [L, slots, HV, K, V] of these head sizes.
inline void check_recurrent_state(const at::Tensor& state, int64_t v_heads, int64_t k_dim, int64_t v_dim,
                                  const char* op) {
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 5 &&
                  state.size(2) == v_heads && state.size(3) == k_dim && state.size(4) == v_dim,
              op, ": recurrent_state must be a contiguous float32 [L, slots, HV, K, V]");
}

// The [HV, K, V] state of (layer, slot), both checked against the tensor.
inline float* slot_state(at::Tensor& state, int64_t layer, int64_t slot, const char* op) {
  TORCH_CHECK(layer >= 0 && layer < state.size(0), op, ": layer ", layer, " out of range");
  TORCH_CHECK(slot >= 0 && slot < state.size(1), op, ": slot ", slot, " out of range");
  return state.data_ptr<float>() + (layer * state.size(1) + slot) * state.stride(1);
}

// Per-thread buffers of one (row, value head) token.
struct HeadScratch {
  std::vector<float> qn, kn, reads_k, reads_q, delta;
  HeadScratch(int64_t k_dim, int64_t v_dim) : qn(k_dim), kn(k_dim), reads_k(v_dim), reads_q(v_dim), delta(v_dim) {}
};

// One token of one (row, value head): reads the state at `src`, writes the next one at `dst` (the same
// address for an in-place step) and the output at `o`. q, k are the head's raw [K] values, v its [V].
inline void delta_rule_token(const float* q, const float* k, const float* v, float g, float beta, float scale,
                      const float* src, float* dst, float* o, int64_t k_dim, int64_t v_dim, HeadScratch& s) {
  std::copy_n(q, k_dim, s.qn.data());
  std::copy_n(k, k_dim, s.kn.data());
  optimum_qwen36::normalise(s.qn.data(), k_dim, scale);
  optimum_qwen36::normalise(s.kn.data(), k_dim, 1.0f);
  const float decay = std::exp(g);
  // k^T S and q^T S, one pass over S
  std::fill(s.reads_k.begin(), s.reads_k.end(), 0.0f);
  std::fill(s.reads_q.begin(), s.reads_q.end(), 0.0f);
  for (int64_t r = 0; r < k_dim; ++r) {
    const float* row = src + r * v_dim;
    const float kr = s.kn[r], qr = s.qn[r];
    for (int64_t c = 0; c < v_dim; ++c) {
      s.reads_k[c] += kr * row[c];
      s.reads_q[c] += qr * row[c];
    }
  }
  float qk = 0.0f;
  for (int64_t r = 0; r < k_dim; ++r) qk += s.qn[r] * s.kn[r];
  for (int64_t c = 0; c < v_dim; ++c) {
    s.delta[c] = beta * (v[c] - decay * s.reads_k[c]);
    o[c] = decay * s.reads_q[c] + qk * s.delta[c];
  }
  // S <- e^g S + k delta^T
  for (int64_t r = 0; r < k_dim; ++r) {
    const float* row = src + r * v_dim;
    float* out_row = dst + r * v_dim;
    const float kr = s.kn[r];
    for (int64_t c = 0; c < v_dim; ++c) out_row[c] = decay * row[c] + kr * s.delta[c];
  }
}

}  // namespace optimum_qwen36
