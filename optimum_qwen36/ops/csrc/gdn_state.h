// What the GDN ops share: the L2 norm of q and k, and the checked address of a slot's recurrent state.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

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

}  // namespace optimum_qwen36
