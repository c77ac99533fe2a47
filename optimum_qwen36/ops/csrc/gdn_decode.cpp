// The gated delta rule one token at a time: a decode step, updating the recurrent states in place in the
// cache tensor, and a verify step (MTP speculative decoding), T tokens per row from the slot's state, each
// token's state written to the speculative state tensor and the slot's own state left as it was.
//
// q, k [B, H, K] and v [B, HV, V] (any float dtype), g (log decay) and beta [B, HV]; recurrent_state
// [L, slots, HV, K, V] float32, of which layer `cache_idx`, slot slots[b] is row b's state S. With q and k
// L2-normalised (eps 1e-6, as the flash-linear-attention kernels) and q scaled:
//   S' = e^g S,  delta = beta (v - k^T S'),  o = q^T S' + (q . k) delta,  S <- S' + k delta^T.
// A decode step's row with a negative slot is padding (the batched graphs' dummy row): its state is neither read
// nor written and its output is zeros.
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

using optimum_qwen36::delta_rule_token;
using optimum_qwen36::FlushDenormals;
using optimum_qwen36::HeadScratch;

// The state of each row's slot in layer `cache_idx`, checked; with `padding`, null for a row whose slot is
// negative (a padding row).
std::vector<float*> row_states(at::Tensor& states, const at::Tensor& cache_idx, const at::Tensor& slots,
                               const char* op, bool padding = false) {
  TORCH_CHECK(cache_idx.numel() == 1, op, ": one layer");
  const int64_t layer = cache_idx.item<int64_t>();
  const at::Tensor slot = slots.to(at::kLong).contiguous();
  std::vector<float*> rows(slot.numel());
  for (int64_t b = 0; b < slot.numel(); ++b) {
    const int64_t s = slot.data_ptr<int64_t>()[b];
    rows[b] = padding && s < 0 ? nullptr : optimum_qwen36::slot_state(states, layer, s, op);
  }
  return rows;
}

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
  TORCH_CHECK(slots.numel() == batch, "gdn_decode_step: one slot per row");
  const std::vector<float*> states = row_states(recurrent_state, cache_idx, slots, "gdn_decode_step", true);
  const at::Tensor qf = q.to(at::kFloat).contiguous(), kf = k.to(at::kFloat).contiguous();
  const at::Tensor vf = v.to(at::kFloat).contiguous(), gf = g.to(at::kFloat).contiguous();
  const at::Tensor bf = beta.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({batch, v_heads, v_dim}, v.options().dtype(at::kFloat));
  const int64_t group = v_heads / k_heads, state_size = k_dim * v_dim;
  // The rows that have a slot: the (row, head) pairs of those only are shared among the threads.
  std::vector<int64_t> real_rows;
  for (int64_t b = 0; b < batch; ++b)
    if (states[b] != nullptr) real_rows.push_back(b);

  at::parallel_for(0, int64_t(real_rows.size()) * v_heads, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush_denormals;
    HeadScratch scratch(k_dim, v_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = real_rows[item / v_heads], hv = item % v_heads, h = hv / group, i = b * v_heads + hv;
      float* state = states[b] + hv * state_size;
      delta_rule_token(qf.data_ptr<float>() + (b * k_heads + h) * k_dim,
                       kf.data_ptr<float>() + (b * k_heads + h) * k_dim, vf.data_ptr<float>() + i * v_dim,
                       gf.data_ptr<float>()[i], bf.data_ptr<float>()[i], float(scale), state, state,
                       out.data_ptr<float>() + i * v_dim, k_dim, v_dim, scratch);
    }
  });
  return out.to(v.scalar_type());
}

// q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV]; recurrent_state [L, slots, HV, K, V] (read) and
// spec_recurrent_state [L, slots, T', HV, K, V] (T' >= T): row b starts from its slot's state in layer
// cache_idx and the state after its token t goes to spec_recurrent_state[cache_idx, slots[b], t], the same
// arithmetic as T decode steps. Returns o [B, T, HV, V].
at::Tensor gdn_verify_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, at::Tensor recurrent_state, at::Tensor spec_recurrent_state,
                           const at::Tensor& cache_idx, const at::Tensor& slots, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 2) == q.sizes().slice(0, 2),
              "gdn_verify_step: q, k [B, T, H, K] and v [B, T, HV, V] expected");
  const int64_t batch = q.size(0), tokens = q.size(1), k_heads = q.size(2), k_dim = q.size(3);
  const int64_t v_heads = v.size(2), v_dim = v.size(3);
  TORCH_CHECK(v_heads % k_heads == 0, "gdn_verify_step: value heads must be a multiple of key heads");
  TORCH_CHECK(g.sizes() == v.sizes().slice(0, 3) && beta.sizes() == g.sizes(), "gdn_verify_step: g, beta [B, T, HV]");
  optimum_qwen36::check_recurrent_state(recurrent_state, v_heads, k_dim, v_dim, "gdn_verify_step");
  TORCH_CHECK(spec_recurrent_state.scalar_type() == at::kFloat && spec_recurrent_state.is_contiguous() &&
                  spec_recurrent_state.dim() == 6 && spec_recurrent_state.size(0) == recurrent_state.size(0) &&
                  spec_recurrent_state.size(1) == recurrent_state.size(1) && spec_recurrent_state.size(2) >= tokens &&
                  spec_recurrent_state.sizes().slice(3) == recurrent_state.sizes().slice(2),
              "gdn_verify_step: spec_recurrent_state must be a contiguous float32 [L, slots, T, HV, K, V] of the "
              "recurrent state's layers, slots and heads");
  TORCH_CHECK(slots.numel() == batch, "gdn_verify_step: one slot per row");
  const std::vector<float*> starts = row_states(recurrent_state, cache_idx, slots, "gdn_verify_step");
  const std::vector<float*> specs = row_states(spec_recurrent_state, cache_idx, slots, "gdn_verify_step");
  const at::Tensor qf = q.to(at::kFloat).contiguous(), kf = k.to(at::kFloat).contiguous();
  const at::Tensor vf = v.to(at::kFloat).contiguous(), gf = g.to(at::kFloat).contiguous();
  const at::Tensor bf = beta.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({batch, tokens, v_heads, v_dim}, v.options().dtype(at::kFloat));
  const int64_t group = v_heads / k_heads, state_size = k_dim * v_dim;
  const int64_t spec_stride = spec_recurrent_state.stride(2);

  at::parallel_for(0, batch * v_heads, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush_denormals;
    HeadScratch scratch(k_dim, v_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / v_heads, hv = i % v_heads, h = hv / group;
      const float* src = starts[b] + hv * state_size;
      for (int64_t t = 0; t < tokens; ++t) {
        float* dst = specs[b] + t * spec_stride + hv * state_size;
        const int64_t token = b * tokens + t, head = token * v_heads + hv;
        delta_rule_token(qf.data_ptr<float>() + (token * k_heads + h) * k_dim,
                         kf.data_ptr<float>() + (token * k_heads + h) * k_dim, vf.data_ptr<float>() + head * v_dim,
                         gf.data_ptr<float>()[head], bf.data_ptr<float>()[head], float(scale), src, dst,
                         out.data_ptr<float>() + head * v_dim, k_dim, v_dim, scratch);
        src = dst;
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
  m.def(
      "gdn_verify_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor recurrent_state, "
      "Tensor(a!) spec_recurrent_state, Tensor cache_idx, Tensor slots, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("gdn_decode_step", &gdn_decode_step);
  m.impl("gdn_verify_step", &gdn_verify_step);
}
