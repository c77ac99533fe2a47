// One decode step of the gated delta rule, updating the recurrent states in place in the cache tensor.
//
// q, k [B, H, K] and v [B, HV, V] (any float dtype), g (log decay) and beta [B, HV]; recurrent_state
// [L, slots, HV, K, V] float32, of which layer `cache_idx`, slot slots[b] is row b's state S. With q and k
// L2-normalised (eps 1e-6, as the flash-linear-attention kernels) and q scaled:
//   S' = e^g S,  delta = beta (v - k^T S'),  o = q^T S' + (q . k) delta,  S <- S' + k delta^T.
// A decode step is bound by moving the states (64 KB per value head of Qwen3.6): each state is read once
// for k^T S and q^T S together and then rewritten from the cache, instead of being gathered into a copy,
// read, rebuilt and scattered back as the PyTorch form of the same step does. All arithmetic is float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn_state.h"

namespace {

at::Tensor gdn_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, at::Tensor recurrent_state, const at::Tensor& cache_idx,
                           const at::Tensor& slots, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gdn_decode_step: q, k [B, H, K] and v [B, HV, V] expected");
  const int64_t batch = q.size(0), k_heads = q.size(1), k_dim = q.size(2);
  const int64_t v_heads = v.size(1), v_dim = v.size(2);
  TORCH_CHECK(v_heads % k_heads == 0, "gdn_decode_step: value heads must be a multiple of key heads");
  TORCH_CHECK(g.sizes() == v.sizes().slice(0, 2) && beta.sizes() == g.sizes(), "gdn_decode_step: g, beta [B, HV]");
  optimum_qwen36::check_recurrent_state(recurrent_state, v_heads, k_dim, v_dim, "gdn_decode_step");
  TORCH_CHECK(cache_idx.numel() == 1 && slots.numel() == batch, "gdn_decode_step: one layer, one slot per row");
  const int64_t layer = cache_idx.item<int64_t>();
  const at::Tensor slot = slots.to(at::kLong).contiguous();
  std::vector<float*> row_states(batch);
  for (int64_t b = 0; b < batch; ++b)
    row_states[b] = optimum_qwen36::slot_state(recurrent_state, layer, slot.data_ptr<int64_t>()[b], "gdn_decode_step");
  const at::Tensor qf = q.to(at::kFloat).contiguous(), kf = k.to(at::kFloat).contiguous();
  const at::Tensor vf = v.to(at::kFloat).contiguous(), gf = g.to(at::kFloat).contiguous();
  const at::Tensor bf = beta.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({batch, v_heads, v_dim}, v.options().dtype(at::kFloat));
  const int64_t group = v_heads / k_heads, state_size = k_dim * v_dim;

  at::parallel_for(0, batch * v_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(k_dim), kn(k_dim), reads_k(v_dim), reads_q(v_dim), delta(v_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / v_heads, hv = i % v_heads, h = hv / group;
      std::copy_n(qf.data_ptr<float>() + (b * k_heads + h) * k_dim, k_dim, qn.data());
      std::copy_n(kf.data_ptr<float>() + (b * k_heads + h) * k_dim, k_dim, kn.data());
      optimum_qwen36::normalise(qn.data(), k_dim, float(scale));
      optimum_qwen36::normalise(kn.data(), k_dim, 1.0f);
      float* state = row_states[b] + hv * state_size;
      const float decay = std::exp(gf.data_ptr<float>()[i]), b_i = bf.data_ptr<float>()[i];
      // k^T S and q^T S, one pass over S
      std::fill(reads_k.begin(), reads_k.end(), 0.0f);
      std::fill(reads_q.begin(), reads_q.end(), 0.0f);
      for (int64_t r = 0; r < k_dim; ++r) {
        const float* row = state + r * v_dim;
        const float kr = kn[r], qr = qn[r];
        for (int64_t c = 0; c < v_dim; ++c) {
          reads_k[c] += kr * row[c];
          reads_q[c] += qr * row[c];
        }
      }
      float qk = 0.0f;
      for (int64_t r = 0; r < k_dim; ++r) qk += qn[r] * kn[r];
      const float* v_i = vf.data_ptr<float>() + i * v_dim;
      float* o = out.data_ptr<float>() + i * v_dim;
      for (int64_t c = 0; c < v_dim; ++c) {
        delta[c] = b_i * (v_i[c] - decay * reads_k[c]);
        o[c] = decay * reads_q[c] + qk * delta[c];
      }
      // S <- e^g S + k delta^T
      for (int64_t r = 0; r < k_dim; ++r) {
        float* row = state + r * v_dim;
        const float kr = kn[r];
        for (int64_t c = 0; c < v_dim; ++c) row[c] = decay * row[c] + kr * delta[c];
      }
    }
  });
  return out.to(v.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_qwen36, m) {
  m.def(
      "gdn_decode_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) recurrent_state, "
      "Tensor cache_idx, Tensor slots, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("gdn_decode_step", &gdn_decode_step);
}
