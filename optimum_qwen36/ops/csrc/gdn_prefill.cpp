// A prefill chunk of the gated delta rule for one or more sequences packed along the tokens, each from and
// into its recurrent state in the cache.
//
// q, k [1, T, H, K], v [1, T, HV, V], g (log decay) and beta [1, T, HV]; sequence s is tokens
// [cu_seqlens[s], cu_seqlens[s + 1]); recurrent_state [L, slots, HV, K, V] float32, of which layer
// `cache_idx`, slot slots[s] is sequence s's state S, read as the initial state and overwritten with the state
// after its last token. Padding tokens inside a sequence must carry g = 0 and beta = 0 (then they leave S
// untouched); tokens after the last sequence get o = 0. Snapshots (optional, snapshot_ends and snapshot_slots
// [P]): where a sequence s has cu_seqlens[s] < snapshot_ends[p] < cu_seqlens[s + 1], its state after the
// tokens before snapshot_ends[p] is also written to slot snapshot_slots[p] (a prefix cache checkpoint inside
// a chunk); an end inside no sequence is ignored. A sequence of one token runs the decode step's
// arithmetic (gdn_state.h's delta_rule_token) instead of a whole chunk's. q and k are L2-normalised (eps 1e-6) and q scaled, as
// `use_qk_l2norm_in_kernel=True`. Returns o [1, T, HV, V] in v's dtype; q, k and v are read where they lie
// (any strides).
//
// The chunked form of the PyTorch twin (nki/kernels/chunk_gated_delta_rule_torch.py), on chunks of kChunk
// tokens, per key head (its HV / H value heads share the key-head work: normalised q and k, K K^T, Q K^T):
//   [k S; q S] = [k; q] S                                  one pass over S
//   v_new = (I + A)^-1 diag(beta) (v - e^c . k S)          A = diag(beta) (K K^T . G) strictly lower,
//                                                          solved by forward substitution (no inverse)
//   o = (Q K^T . G, causal) v_new + e^c . q S
//   S <- e^(c_last) S + K^T (e^(c_last - c) . v_new)
// with c the in-chunk cumulative log decay and G_ij = e^(c_i - c_j) (j <= i; c summed in float64, so the
// difference does not cancel under strong decays, and every exponent is <= 0). All arithmetic is float32.
// The products are register-blocked float32 vector loops (vec_math.h's f32: AVX-512, or AVX2 + FMA); without
// either the same loops run in scalar code.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn_state.h"
#include "vec_math.h"

namespace {

constexpr int64_t kChunk = 64;
constexpr int kRows = 4;  // rows per register block
#ifdef QWEN36_F32_VECTOR
namespace f32 = optimum_qwen36::f32;
constexpr int kLanes = f32::kLanes;
#else
constexpr int kLanes = 16;
#endif
// Vectors of C columns per register block: kRows x kPanel accumulators, plus kPanel of B and one of A, fit
// the register file (AVX-512: 4 rows x 64 columns; AVX2: 4 rows x 16 columns).
constexpr int kPanel = kLanes == 16 ? 4 : 2;

// c[i][0 .. kLanes NV) = (accumulate ? c[i] : 0) + sum over j < depth of a(i, j) b[j][0 .. kLanes NV), for
// i < kRows; a(i, j) = a[i * a_row + j * a_col].
template <int NV>
inline void block(const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, int64_t depth,
                  float* c, int64_t ldc, bool accumulate) {
#ifdef QWEN36_F32_VECTOR
  f32::Vec acc[kRows][NV];
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = accumulate ? f32::load(c + i * ldc + kLanes * v) : f32::zero();
  for (int64_t j = 0; j < depth; ++j) {
    f32::Vec bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = f32::load(b + j * ldb + kLanes * v);
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i) {
      const f32::Vec av = f32::set1(a[i * a_row + j * a_col]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = f32::fmadd(av, bv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) f32::store(c + i * ldc + kLanes * v, acc[i][v]);
#else
  for (int i = 0; i < kRows; ++i)
    for (int64_t n = 0; n < kLanes * NV; ++n) {
      float sum = accumulate ? c[i * ldc + n] : 0.0f;
      for (int64_t j = 0; j < depth; ++j) sum += a[i * a_row + j * a_col] * b[j * ldb + n];
      c[i * ldc + n] = sum;
    }
#endif
}

// C [rows, cols] (+)= A [rows, depth] B [depth, cols] (rows a multiple of kRows, cols of 16); A(i, j) =
// a[i * a_row + j * a_col], B row j at b + j * ldb. causal: row i only needs j <= i (A is zero above), so a
// block of rows stops at its last row.
void gemm(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t a_row, int64_t a_col, const float* b,
          int64_t ldb, float* c, int64_t ldc, bool accumulate, bool causal = false) {
  // Columns outside, rows inside: a panel of B stays in L1 while every row block reads it.
  for (int64_t n = 0; n < cols; n += kLanes * kPanel) {
    const int64_t width = std::min<int64_t>(kLanes * kPanel, cols - n);
    for (int64_t i = 0; i < rows; i += kRows) {
      const int64_t d = causal ? std::min(depth, i + kRows) : depth;
      const float* a_i = a + i * a_row;
      float* c_i = c + i * ldc + n;
      switch (width / kLanes) {
        case 4: block<4>(a_i, a_row, a_col, b + n, ldb, d, c_i, ldc, accumulate); break;
        case 3: block<3>(a_i, a_row, a_col, b + n, ldb, d, c_i, ldc, accumulate); break;
        case 2: block<2>(a_i, a_row, a_col, b + n, ldb, d, c_i, ldc, accumulate); break;
        default: block<1>(a_i, a_row, a_col, b + n, ldb, d, c_i, ldc, accumulate); break;
      }
    }
  }
}

// Element (token t, head h, d) of a [1, T, heads, dim] tensor of any strides: the model's q, k and v are
// slices of the conv output (channel-major, token stride 1, for one sequence; token-major when packed); they
// are read in place, never copied.
template <typename T>
struct Rows {
  T* data;
  int64_t token_stride, head_stride, dim_stride;
  explicit Rows(const at::Tensor& x)
      : data(reinterpret_cast<T*>(x.data_ptr())),
        token_stride(x.stride(1)),
        head_stride(x.stride(2)),
        dim_stride(x.stride(3)) {}
  T* at(int64_t t, int64_t h) const { return data + t * token_stride + h * head_stride; }
  // The rows from token `first` on (a packed sequence's own tokens).
  Rows from(int64_t first) const {
    Rows rows = *this;
    rows.data += first * token_stride;
    return rows;
  }

  // rows [t0, t0 + n) of head h as float32 [n, dim] (row stride dim), in the order the memory is laid out.
  void load(int64_t t0, int64_t n, int64_t h, int64_t dim, float* out) const {
    if (dim_stride == 1 || token_stride != 1) {
      for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < dim; ++d) out[i * dim + d] = float(at(t0 + i, h)[d * dim_stride]);
    } else {  // channel-major: consecutive tokens are neighbours
      for (int64_t d = 0; d < dim; ++d) {
        const T* column = at(t0, h) + d * dim_stride;
        for (int64_t i = 0; i < n; ++i) out[i * dim + d] = float(column[i]);
      }
    }
  }
};

template <typename T>
struct Inputs {
  Rows<T> q, k, v, o;         // [1, T, H, K], [1, T, H, K], [1, T, HV, V], the output [1, T, HV, V]
  const float *g, *beta;      // [T, HV]
  int64_t tokens, k_heads, v_heads, k_dim, v_dim;
  float scale;
};

// Per-thread buffers of one key head's chunk.
struct Scratch {
  std::vector<float> kq, k_t, kk, qk, reads, gamma, a, attn, x, decayed;
  Scratch(int64_t k_dim, int64_t v_dim)
      : kq(2 * kChunk * k_dim), k_t(k_dim * kChunk), kk(kChunk * kChunk), qk(kChunk * kChunk),
        reads(2 * kChunk * v_dim), gamma(kChunk * kChunk), a(kChunk * kChunk), attn(kChunk * kChunk),
        x(kChunk * v_dim), decayed(kChunk * v_dim) {}
};

// G_ij = e^(c_i - c_j) (j <= i, else 0); A = diag(beta) (K K^T . G) strictly below the diagonal; the causal
// attention Q K^T . G (diagonal included), for i, j < m. c in float64: c_i - c_j rounds once.
void decay_products(const double* cum, const float* beta, int64_t m, Scratch& s) {
  for (int64_t i = 0; i < m; ++i) {
    float* a = s.a.data() + i * kChunk;
    float* attn = s.attn.data() + i * kChunk;
    const float* kk = s.kk.data() + i * kChunk;
    const float* qk = s.qk.data() + i * kChunk;
#ifdef QWEN36_F32_VECTOR
    for (int64_t j = 0; j < m; j += kLanes) {
      const f32::Vec gamma =
          f32::first_lanes(f32::exp_nonpositive(f32::min(f32::differences(cum[i], cum + j), f32::zero())), i - j + 1);
      const f32::Vec beta_kk = f32::mul(f32::set1(beta[i]), f32::load(kk + j));
      f32::store(a + j, f32::first_lanes(f32::mul(beta_kk, gamma), i - j));
      f32::store(attn + j, f32::mul(f32::load(qk + j), gamma));
    }
#else
    for (int64_t j = 0; j < m; ++j) {
      const float gamma = j <= i ? std::exp(float(cum[i] - cum[j])) : 0.0f;
      a[j] = j < i ? beta[i] * kk[j] * gamma : 0.0f;
      attn[j] = qk[j] * gamma;
    }
#endif
  }
}

// x <- (I + A)^-1 x for A strictly lower triangular [m, m] (row stride C) and x [m, V] (V a multiple of 16):
// row i minus sum_{j<i} A_ij x_j, rows in order (forward substitution), 4 vectors of columns at a time kept in
// registers.
void forward_substitute(const float* a, float* x, int64_t m, int64_t V) {
#ifdef QWEN36_F32_VECTOR
  constexpr int kColumns = 4;  // vectors of x per pass: independent chains of FMAs
  for (int64_t n = 0; n < V; n += kLanes) {
    const int nv = int(std::min<int64_t>(kColumns, (V - n) / kLanes));
    for (int64_t i = 1; i < m; ++i) {
      f32::Vec acc[kColumns];
      for (int v = 0; v < nv; ++v) acc[v] = f32::load(x + i * V + n + kLanes * v);
      for (int64_t j = 0; j < i; ++j) {
        const f32::Vec aij = f32::set1(-a[i * kChunk + j]);
        for (int v = 0; v < nv; ++v) acc[v] = f32::fmadd(aij, f32::load(x + j * V + n + kLanes * v), acc[v]);
      }
      for (int v = 0; v < nv; ++v) f32::store(x + i * V + n + kLanes * v, acc[v]);
    }
    n += kLanes * (nv - 1);
  }
#else
  for (int64_t i = 1; i < m; ++i)
    for (int64_t j = 0; j < i; ++j)
      for (int64_t d = 0; d < V; ++d) x[i * V + d] -= a[i * kChunk + j] * x[j * V + d];
#endif
}

// Key head h over all chunks: its value heads' states (states[r], [K, V]) updated in place, o [T, HV, V].
template <typename T>
void key_head(const Inputs<T>& in, int64_t h, float* const* states, Scratch& s) {
  const int64_t K = in.k_dim, V = in.v_dim, group = in.v_heads / in.k_heads;
  float* keys = s.kq.data();                 // [C, K]
  float* queries = s.kq.data() + kChunk * K;  // [C, K], scaled
  for (int64_t t0 = 0; t0 < in.tokens; t0 += kChunk) {
    const int64_t n = std::min(kChunk, in.tokens - t0);
    // A partial chunk computes on its first m rows only: the rows past n are zeros (keys, queries) and carry
    // g = beta = 0, so every product over them adds exact zeros and the first m rows come out the same.
    const int64_t m = (n + 15) / 16 * 16;
    std::fill(s.kq.begin(), s.kq.end(), 0.0f);  // a partial chunk: zero rows past n
    in.k.load(t0, n, h, K, keys);
    in.q.load(t0, n, h, K, queries);
    for (int64_t i = 0; i < n; ++i) {
      optimum_qwen36::normalise(keys + i * K, K, 1.0f);
      optimum_qwen36::normalise(queries + i * K, K, in.scale);
    }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t d = 0; d < K; ++d) s.k_t[d * kChunk + i] = keys[i * K + d];
    // K K^T and (scale Q) K^T, lower triangles (diagonal included)
    gemm(m, m, K, keys, K, 1, s.k_t.data(), kChunk, s.kk.data(), kChunk, false);
    gemm(m, m, K, queries, K, 1, s.k_t.data(), kChunk, s.qk.data(), kChunk, false);
    for (int64_t r = 0; r < group; ++r) {
      const int64_t hv = h * group + r;
      float* state = states[r];
      // in-chunk cumulative log decay (float64: differences of it do not cancel), e^c, G = e^(c_i - c_j)
      double cum[kChunk];
      float beta[kChunk], exp_cum[kChunk];
      double running = 0.0;
      for (int64_t i = 0; i < kChunk; ++i) {
        const bool real = i < n;
        running += real ? double(in.g[(t0 + i) * in.v_heads + hv]) : 0.0;
        cum[i] = running;
        beta[i] = real ? in.beta[(t0 + i) * in.v_heads + hv] : 0.0f;
        exp_cum[i] = std::exp(float(running));
      }
      decay_products(cum, beta, m, s);
      // k S and q S
      float* k_reads = s.reads.data();
      float* q_reads = s.reads.data() + kChunk * V;
      gemm(m, V, K, keys, K, 1, state, V, k_reads, V, false);
      gemm(m, V, K, queries, K, 1, state, V, q_reads, V, false);
      // x = (I + A)^-1 diag(beta) (v - e^c k S), row by row (forward substitution)
      for (int64_t i = 0; i < m; ++i) {
        float* xi = s.x.data() + i * V;
        if (i >= n) {
          std::fill_n(xi, V, 0.0f);
          continue;
        }
        const T* vi = in.v.at(t0 + i, hv);
        for (int64_t d = 0; d < V; ++d)
          xi[d] = beta[i] * (float(vi[d * in.v.dim_stride]) - exp_cum[i] * k_reads[i * V + d]);
      }
      forward_substitute(s.a.data(), s.x.data(), m, V);
      // o = e^c q S + attn x
      for (int64_t i = 0; i < m; ++i)
        for (int64_t d = 0; d < V; ++d) q_reads[i * V + d] *= exp_cum[i];
      gemm(m, V, m, s.attn.data(), kChunk, 1, s.x.data(), V, q_reads, V, true, true);
      for (int64_t i = 0; i < n; ++i) {
        T* oi = in.o.at(t0 + i, hv);
        for (int64_t d = 0; d < V; ++d) oi[d] = T(q_reads[i * V + d]);
      }
      // S <- e^(c_last) S + K^T (e^(c_last - c) x)
      const float last = float(cum[kChunk - 1]);
      for (int64_t i = 0; i < m; ++i) {
        const float f = std::exp(float(cum[kChunk - 1] - cum[i]));
        for (int64_t d = 0; d < V; ++d) s.decayed[i * V + d] = f * s.x[i * V + d];
      }
      const float tile_decay = std::exp(last);
      for (int64_t e = 0; e < K * V; ++e) state[e] *= tile_decay;
      gemm(K, V, m, keys, 1, K, s.decayed.data(), V, state, V, true);
    }
  }
}

// A one-token sequence, key head h: its value heads' states updated in place by the decode step's rule.
template <typename T>
void single_token(const Inputs<T>& in, int64_t h, float* const* states, optimum_qwen36::HeadScratch& s,
                  std::vector<float>& buffer) {
  const int64_t K = in.k_dim, V = in.v_dim, group = in.v_heads / in.k_heads;
  float* q = buffer.data();
  float* k = q + K;
  float* v = k + K;
  float* o = v + V;
  in.q.load(0, 1, h, K, q);
  in.k.load(0, 1, h, K, k);
  for (int64_t r = 0; r < group; ++r) {
    const int64_t hv = h * group + r;
    const T* vi = in.v.at(0, hv);
    for (int64_t d = 0; d < V; ++d) v[d] = float(vi[d * in.v.dim_stride]);
    optimum_qwen36::delta_rule_token(q, k, v, in.g[hv], in.beta[hv], in.scale, states[r], states[r], o, K, V, s);
    T* oi = in.o.at(0, hv);
    for (int64_t d = 0; d < V; ++d) oi[d * in.o.dim_stride] = T(o[d]);
  }
}

at::Tensor gdn_prefill_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, at::Tensor recurrent_state, const at::Tensor& cache_idx,
                             const at::Tensor& slots, const at::Tensor& cu_seqlens, double scale,
                             const c10::optional<at::Tensor>& snapshot_ends,
                             const c10::optional<at::Tensor>& snapshot_slots) {
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && k.sizes() == q.sizes(), "gdn_prefill_chunk: q, k [1, T, H, K]");
  TORCH_CHECK(v.dim() == 4 && v.size(0) == 1 && v.size(1) == q.size(1), "gdn_prefill_chunk: v [1, T, HV, V]");
  const int64_t tokens = q.size(1), k_heads = q.size(2), k_dim = q.size(3), v_heads = v.size(2), v_dim = v.size(3);
  TORCH_CHECK(v_heads % k_heads == 0, "gdn_prefill_chunk: value heads must be a multiple of key heads");
  TORCH_CHECK(k_dim % 16 == 0 && v_dim % 16 == 0, "gdn_prefill_chunk: head sizes must be multiples of 16");
  TORCH_CHECK(g.sizes() == v.sizes().slice(0, 3) && beta.sizes() == g.sizes(), "gdn_prefill_chunk: g, beta [1, T, HV]");
  optimum_qwen36::check_recurrent_state(recurrent_state, v_heads, k_dim, v_dim, "gdn_prefill_chunk");
  TORCH_CHECK(cache_idx.numel() == 1, "gdn_prefill_chunk: one layer");
  const int64_t sequences = slots.numel();
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() == sequences + 1,
              "gdn_prefill_chunk: cu_seqlens [S + 1] for slots [S]");
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous(), slot_ids = slots.to(at::kLong).contiguous();
  const int64_t* bounds = cu.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[sequences] <= tokens, "gdn_prefill_chunk: cu_seqlens must run from 0 to at most T");
  const int64_t layer = cache_idx.item<int64_t>();
  std::vector<float*> first_state(sequences);
  for (int64_t s = 0; s < sequences; ++s) {
    TORCH_CHECK(bounds[s] <= bounds[s + 1], "gdn_prefill_chunk: cu_seqlens must not decrease");
    first_state[s] = optimum_qwen36::slot_state(recurrent_state, layer, slot_ids.data_ptr<int64_t>()[s], "gdn_prefill_chunk");
  }
  // Per sequence, its snapshots in token order: (end, the snapshot slot's state).
  std::vector<std::vector<std::pair<int64_t, float*>>> cuts(sequences);
  TORCH_CHECK(snapshot_ends.has_value() == snapshot_slots.has_value(),
              "gdn_prefill_chunk: snapshot_ends and snapshot_slots go together");
  if (snapshot_ends.has_value()) {
    const at::Tensor ends = snapshot_ends->to(at::kLong).contiguous();
    const at::Tensor targets = snapshot_slots->to(at::kLong).contiguous();
    TORCH_CHECK(ends.dim() == 1 && targets.sizes() == ends.sizes(),
                "gdn_prefill_chunk: snapshot_ends and snapshot_slots [P]");
    for (int64_t p = 0; p < ends.numel(); ++p) {
      const int64_t end = ends.data_ptr<int64_t>()[p], target = targets.data_ptr<int64_t>()[p];
      for (int64_t s = 0; s < sequences; ++s) {
        if (!(bounds[s] < end && end < bounds[s + 1])) continue;
        // Written while the other sequences run: it must be nobody's state.
        for (int64_t other = 0; other < sequences; ++other)
          TORCH_CHECK(bounds[other] == bounds[other + 1] || target != slot_ids.data_ptr<int64_t>()[other],
                      "gdn_prefill_chunk: a snapshot slot must not be a sequence's own slot");
        for (int64_t q = 0; q < p; ++q)
          TORCH_CHECK(targets.data_ptr<int64_t>()[q] != target || ends.data_ptr<int64_t>()[q] == 0,
                      "gdn_prefill_chunk: two snapshots into one slot");
        cuts[s].emplace_back(end, optimum_qwen36::slot_state(recurrent_state, layer, target, "gdn_prefill_chunk"));
      }
    }
    for (auto& cut : cuts) std::sort(cut.begin(), cut.end());
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "gdn_prefill_chunk: q, k and v must have one dtype");
  const at::Tensor gf = g.to(at::kFloat).contiguous(), bf = beta.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({1, tokens, v_heads, v_dim}, v.options());
  if (bounds[sequences] < tokens) out.narrow(1, bounds[sequences], tokens - bounds[sequences]).zero_();
  const int64_t group = v_heads / k_heads, state_size = k_dim * v_dim;
  // Work items: (sequence, key head) of the sequences that have tokens, longest sequences first, dealt to the
  // threads round-robin: a long prompt's heads spread over every thread however many short sequences there are.
  std::vector<int64_t> order;
  for (int64_t s = 0; s < sequences; ++s)
    if (bounds[s + 1] > bounds[s]) order.push_back(s);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return bounds[a + 1] - bounds[a] > bounds[b + 1] - bounds[b]; });
  std::vector<std::pair<int64_t, int64_t>> items;
  for (const int64_t s : order)
    for (int64_t h = 0; h < k_heads; ++h) items.emplace_back(s, h);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), int64_t(items.size())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "gdn_prefill_chunk", [&] {
    const Rows<scalar_t> q_rows(q), k_rows(k), v_rows(v), o_rows(out);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      const optimum_qwen36::FlushDenormals flush_denormals;
      Scratch scratch(k_dim, v_dim);
      optimum_qwen36::HeadScratch token_scratch(k_dim, v_dim);
      std::vector<float> token_buffer(2 * (k_dim + v_dim));
      std::vector<float*> states(group);
      for (int64_t thread = begin; thread < end; ++thread)
      for (int64_t i = thread; i < int64_t(items.size()); i += threads) {
        const auto [s, h] = items[i];
        for (int64_t r = 0; r < group; ++r) states[r] = first_state[s] + (h * group + r) * state_size;
        // The sequence's tokens in parts ending at its snapshots, each part's final state copied out.
        int64_t first = bounds[s];
        for (size_t part = 0; part <= cuts[s].size(); ++part) {
          const int64_t end = part < cuts[s].size() ? cuts[s][part].first : bounds[s + 1];
          const Inputs<scalar_t> in{q_rows.from(first), k_rows.from(first), v_rows.from(first), o_rows.from(first),
                                    gf.data_ptr<float>() + first * v_heads, bf.data_ptr<float>() + first * v_heads,
                                    end - first, k_heads, v_heads, k_dim, v_dim, float(scale)};
          if (in.tokens == 1)
            single_token(in, h, states.data(), token_scratch, token_buffer);
          else
            key_head(in, h, states.data(), scratch);
          if (part < cuts[s].size())
            for (int64_t r = 0; r < group; ++r)
              std::copy(states[r], states[r] + state_size, cuts[s][part].second + (h * group + r) * state_size);
          first = end;
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_qwen36, m) {
  m.def(
      "gdn_prefill_chunk(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) recurrent_state, "
      "Tensor cache_idx, Tensor slots, Tensor cu_seqlens, float scale, Tensor? snapshot_ends=None, "
      "Tensor? snapshot_slots=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("gdn_prefill_chunk", &gdn_prefill_chunk);
}
