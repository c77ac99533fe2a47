// Causal attention of a step's queries over a paged KV cache, reading only the keys the queries can see.
//
// query [B, T, H, D]; key_cache / value_cache [L, num_blocks, block_size, KVH, D] (layer `layer`); row b's
// keys are its blocks block_tables[b] in order; query t of row b sees keys 0..positions[b, t] (capped at
// the row's capacity). `paged_attention_varlen` takes sequences packed along the tokens instead: query
// [1, N, H, D], sequence s is tokens [cu_seqlens[s], cu_seqlens[s + 1]) with the blocks block_tables[s];
// tokens after the last sequence get zeros. The compiled graphs' own attention reads every block of the table under a mask, so
// a prefill chunk early in a long table pays for the whole table; here a query block stops at its last
// visible key.
//
// bfloat16 with AVX-512 BF16: flash attention per (row, KV head, block of query rows), the G = H / KVH
// query heads sharing a KV head stacked as rows of one block. Keys and values are packed into pairs along the
// contracted dimension (the operand layout of vdpbf16ps): once per (row, KV head) where its queries fill
// several blocks, else block of keys by block of keys as they are read (a decode row then reads its KV from
// memory once). Q K^T and P V are both register-blocked products: 8 query rows x 32 columns per inner loop,
// bf16 products summed in float32. Scores, the online softmax and the output accumulate in float32; P is rounded to bf16 for P V,
// as every flash kernel does. Other dtypes and CPUs: the same visible keys gathered per row and handed to
// ATen's scaled_dot_product_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "denormals.h"
#include "vec_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define QWEN36_BF16_AVX512 1
#include "amx.h"
#endif

namespace {

using bf16 = c10::BFloat16;

// The queries of one sequence: flat tokens [first, first + count) of the step (token t of row b of a
// [B, T] step is b * T + t), its blocks block_tables[table_row], and the keys it reads: max position + 1,
// capped at the table's capacity (0 when it has no tokens).
struct Segment {
  int64_t first, count, table_row, keys;
};

std::vector<Segment> segments_of(const std::vector<int64_t>& bounds, const at::Tensor& positions, int64_t capacity) {
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  std::vector<Segment> segments;
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    int64_t last = -1;
    for (int64_t t = bounds[s]; t < bounds[s + 1]; ++t) last = std::max(last, p[t]);
    const int64_t keys = bounds[s + 1] > bounds[s] ? std::clamp<int64_t>(last + 1, 1, capacity) : 0;
    segments.push_back({bounds[s], bounds[s + 1] - bounds[s], int64_t(s), keys});
  }
  return segments;
}

// Flat query tokens [N, H, D] attended per segment by ATen's attention over the visible keys.
at::Tensor attention_aten(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          int64_t layer, const at::Tensor& block_tables, const at::Tensor& positions,
                          const std::vector<Segment>& segments, double scale) {
  const int64_t heads = query.size(1), kv_heads = key_cache.size(3);
  const int64_t block_size = key_cache.size(2);
  const at::Tensor layer_keys = key_cache.select(0, layer), layer_values = value_cache.select(0, layer);
  at::Tensor out = at::zeros(query.sizes(), query.options());
  for (const Segment& seg : segments) {
    if (seg.count == 0) continue;
    const int64_t n = seg.keys;
    const at::Tensor blocks =
        block_tables[seg.table_row].slice(0, 0, (n + block_size - 1) / block_size).to(at::kLong);
    const auto gather = [&](const at::Tensor& cache) {  // [1, KVH, n, D]
      return cache.index_select(0, blocks).flatten(0, 1).slice(0, 0, n).transpose(0, 1).unsqueeze(0);
    };
    const at::Tensor seg_positions = positions.slice(0, seg.first, seg.first + seg.count);
    const at::Tensor mask = at::arange(n, positions.options()).unsqueeze(0) <= seg_positions.unsqueeze(1);
    const at::Tensor o = at::scaled_dot_product_attention(
        query.slice(0, seg.first, seg.first + seg.count).transpose(0, 1).unsqueeze(0), gather(layer_keys),
        gather(layer_values), mask, 0.0, false, scale, heads != kv_heads);
    out.slice(0, seg.first, seg.first + seg.count).copy_(o.squeeze(0).transpose(0, 1));
  }
  return out;
}

#ifdef QWEN36_BF16_AVX512

constexpr int64_t kKeyTile = 32;    // keys per packed key tile: the columns of one Q K^T micro-kernel
constexpr int64_t kKeyBlock = 128;  // keys per online-softmax step
constexpr int64_t kRowBlock = 64;   // query rows (tokens x the heads of one KV head) per work item
constexpr int kMicroRows = 8;

// c[r][0..32) = (accumulate ? c[r] : 0) + sum over pairs p of a[r][p] . b[p * ldb + 0..32), R rows: a[r] holds
// bf16 pairs (as uint32), b the packed pairs of 32 columns.
template <int R>
inline void micro_kernel(const uint32_t* const* a, const uint32_t* b, int64_t ldb, int64_t pairs, float* c,
                         int64_t ldc, bool accumulate) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
    hi[r] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b_lo = (__m512bh)_mm512_loadu_si512(b + p * ldb);
    const __m512bh b_hi = (__m512bh)_mm512_loadu_si512(b + p * ldb + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r][p]));
      lo[r] = _mm512_dpbf16_ps(lo[r], av, b_lo);
      hi[r] = _mm512_dpbf16_ps(hi[r], av, b_hi);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, lo[r]);
    _mm512_storeu_ps(c + r * ldc + 16, hi[r]);
  }
}

template <int R>
void micro_kernel_rows(int rows, const uint32_t* const* a, const uint32_t* b, int64_t ldb, int64_t pairs, float* c,
                       int64_t ldc, bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) return micro_kernel_rows<R - 1>(rows, a, b, ldb, pairs, c, ldc, accumulate);
  }
  micro_kernel<R>(a, b, ldb, pairs, c, ldc, accumulate);
}

// c [rows, cols] (row stride ldc) (+)= a . b over `pairs` pairs: a row r's pairs at a[r]; b packed with
// row stride ldb, its 32-column groups `group_stride` apart (cols a multiple of 32).
void product(int64_t rows, int64_t cols, const uint32_t* const* a, const uint32_t* b, int64_t ldb,
             int64_t group_stride, int64_t pairs, float* c, int64_t ldc, bool accumulate) {
  for (int64_t col = 0; col < cols; col += 32)
    for (int64_t r = 0; r < rows; r += kMicroRows)
      micro_kernel_rows<kMicroRows>(int(std::min<int64_t>(kMicroRows, rows - r)), a + r, b + (col / 32) * group_stride,
                                    ldb, pairs, c + r * ldc + col, ldc, accumulate);
}

#ifdef QWEN36_AMX
// The same two products on AMX tiles, where the process may use them: 16 query rows x 32 columns (two float32
// tiles) per tile product over 32 contracted values. A's rows are bf16 with a uniform stride (the queries
// and P are copied into padded row-major buffers for that); B is the packed pairs the vector path reads.
// Each float32 result is one row's dot product (the tile unit's own summation order), whatever the other
// rows hold, so attention stays row-invariant.
namespace amx = optimum_qwen36::amx;

// c [R * 16 rows, 32 columns] (row stride ldc) (+)= a [R * 16 rows, steps * 32] (bf16, row stride lda) . b,
// b's two 16-column tiles of contraction step s at b + s * b_step and b + s * b_step + 16 (row stride ldb,
// uint32 pairs). Tiles: 0-3 the accumulators, 4-5 a, 6-7 b.
template <int R>
void tile_block(const bf16* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t b_step, int64_t steps, float* c,
                int64_t ldc, bool accumulate) {
  const int64_t a_bytes = lda * int64_t(sizeof(bf16)), b_bytes = ldb * 4, c_bytes = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, c, c_bytes);
    _tile_loadd(1, c + 16, c_bytes);
    if constexpr (R == 2) {
      _tile_loadd(2, c + 16 * ldc, c_bytes);
      _tile_loadd(3, c + 16 * ldc + 16, c_bytes);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (R == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a + s * amx::kValues, a_bytes);
    _tile_loadd(6, b + s * b_step, b_bytes);
    _tile_loadd(7, b + s * b_step + 16, b_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, a + 16 * lda + s * amx::kValues, a_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_bytes);
  _tile_stored(1, c + 16, c_bytes);
  if constexpr (R == 2) {
    _tile_stored(2, c + 16 * ldc, c_bytes);
    _tile_stored(3, c + 16 * ldc + 16, c_bytes);
  }
}

// c [rows, cols] (+)= a . b for rows a multiple of 16 and cols of 32: b's 32-column groups `group_stride`
// apart, each contraction step of 32 values `b_step` further.
void tile_product(int64_t rows, int64_t cols, const bf16* a, int64_t lda, const uint32_t* b, int64_t ldb,
                  int64_t group_stride, int64_t b_step, int64_t steps, float* c, int64_t ldc, bool accumulate) {
  for (int64_t col = 0; col < cols; col += 32) {
    const uint32_t* group = b + (col / 32) * group_stride;
    int64_t r = 0;
    for (; r + 32 <= rows; r += 32)
      tile_block<2>(a + r * lda, lda, group, ldb, b_step, steps, c + r * ldc + col, ldc, accumulate);
    for (; r < rows; r += 16)
      tile_block<1>(a + r * lda, lda, group, ldb, b_step, steps, c + r * ldc + col, ldc, accumulate);
  }
}
#endif

// One (sequence, KV head)'s keys and values in the cache: key and value j's D values at offset(j) in their layer.
struct KVSource {
  const bf16 *key_layer, *value_layer;  // the layer's [num_blocks, block_size, KVH, D]
  const int64_t* table;                 // the sequence's blocks
  int64_t block_size, kv_heads, kh, dim;
  int64_t offset(int64_t j) const { return ((table[j / block_size] * block_size + j % block_size) * kv_heads + kh) * dim; }
  const bf16* value(int64_t j) const { return value_layer + offset(j); }
};

// Keys [j0, j0 + count) packed (count a multiple of 32; keys from n on are zeros: masked, never NaN): keys as
// tiles of 32 keys, [D / 2][32] pairs each, at keys_out; values as [count / 2][D] pairs of consecutive keys at
// values_out. Keys are gathered pair by pair (16 keys per instruction), values interleaved 16 columns at a time.
void pack_range(const KVSource& src, int64_t j0, int64_t count, int64_t n, uint32_t* keys_out, uint32_t* values_out) {
  const int64_t pairs = src.dim / 2;
  const auto* key_words = reinterpret_cast<const int*>(src.key_layer);
  for (int64_t t = 0; t < count; t += kKeyTile) {
    uint32_t* tile = keys_out + t * pairs;
    alignas(64) int32_t offsets[kKeyTile];  // each key's row, in pairs from the layer's start
    uint32_t live = 0;
    for (int64_t i = 0; i < kKeyTile; ++i) {
      const int64_t j = j0 + t + i;
      offsets[i] = j < n ? int32_t(src.offset(j) / 2) : 0;
      live |= uint32_t(j < n) << i;
    }
    const __m512i low = _mm512_load_si512(offsets), high = _mm512_load_si512(offsets + 16);
    const __mmask16 live_low = __mmask16(live), live_high = __mmask16(live >> 16);
    for (int64_t p = 0; p < pairs; ++p) {
      _mm512_storeu_si512(tile + p * kKeyTile,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live_low, low, key_words + p, 4));
      _mm512_storeu_si512(tile + p * kKeyTile + 16,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live_high, high, key_words + p, 4));
    }
  }
  const auto widened = [](const bf16* v, int64_t d) {  // 16 values as the low halves of 16 words
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d)));
  };
  for (int64_t i = 0; i < count; i += 2) {
    const int64_t j = j0 + i;
    uint32_t* dst = values_out + (i / 2) * src.dim;
    const bf16* first = j < n ? src.value(j) : nullptr;
    const bf16* second = j + 1 < n ? src.value(j + 1) : nullptr;
    for (int64_t d = 0; d < src.dim; d += 16) {
      const __m512i lo = first ? widened(first, d) : _mm512_setzero_si512();
      const __m512i hi = second ? _mm512_slli_epi32(widened(second, d), 16) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, hi));
    }
  }
}

struct PackedKV {
  // keys: per tile of 32 keys, [D / 2][32] pairs (key_tiles x D/2 x 32); values: [n_pad / 2][D] pairs.
  std::vector<uint32_t> keys, values;
};

struct Block {  // one work item: segment seg, KV head kh, flat query tokens [t0, t0 + tokens)
  int64_t seg, kh, t0, tokens;
};

// Work item blk over its sequence's first n keys: packed in kv, or (kv null) packed block by block from src into
// the thread's block buffers, which then stay in cache between the two products.
void attend_block(const Block& blk, const bf16* query, const int64_t* positions, const KVSource& src,
                  const PackedKV* kv, int64_t n, int64_t heads, int64_t group, int64_t dim, float scale, bool tiles,
                  std::vector<uint32_t>& block_keys, std::vector<uint32_t>& block_values, bf16* out) {
  const int64_t rows = blk.tokens * group, pairs = dim / 2;
  // With tiles, the buffers have whole tiles of rows (padding rows stay zero).
  const int64_t padded = tiles ? (rows + 15) / 16 * 16 : rows;
  std::vector<const uint32_t*> q_rows(rows), p_rows(rows);
  std::vector<int64_t> limit(rows);  // keys row r sees: [0, limit)
  int64_t last = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = blk.t0 + r / group, h = blk.kh * group + r % group;
    q_rows[r] = reinterpret_cast<const uint32_t*>(query + (t * heads + h) * dim);
    limit[r] = std::clamp<int64_t>(positions[t] + 1, 1, n);
    last = std::max(last, limit[r]);
  }
  std::vector<float> scores(padded * kKeyBlock), acc(padded * dim, 0.0f), row_max(rows, -INFINITY),
      row_sum(rows, 0.0f);
  std::vector<bf16> probs(padded * kKeyBlock), q_tiles(tiles ? padded * dim : 0);
  for (int64_t r = 0; r < rows; ++r) p_rows[r] = reinterpret_cast<const uint32_t*>(probs.data() + r * kKeyBlock);
  for (int64_t r = 0; tiles && r < rows; ++r)
    std::memcpy(q_tiles.data() + r * dim, q_rows[r], size_t(dim) * sizeof(bf16));
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < last; j0 += kKeyBlock) {
    const int64_t cols = std::min<int64_t>(kKeyBlock, (last - j0 + kKeyTile - 1) / kKeyTile * kKeyTile);
    const uint32_t *keys = nullptr, *values = nullptr;
    if (kv != nullptr) {
      keys = kv->keys.data() + j0 * pairs;
      values = kv->values.data() + (j0 / 2) * dim;
    } else {
      pack_range(src, j0, cols, n, block_keys.data(), block_values.data());
      keys = block_keys.data();
      values = block_values.data();
    }
#ifdef QWEN36_AMX
    if (tiles)
      tile_product(padded, cols, q_tiles.data(), dim, keys, kKeyTile, pairs * kKeyTile, 16 * kKeyTile, dim / 32,
                   scores.data(), kKeyBlock, false);
    else
#endif
      product(rows, cols, q_rows.data(), keys, kKeyTile, pairs * kKeyTile, pairs, scores.data(), kKeyBlock, false);
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores.data() + r * kKeyBlock;
      const int64_t visible = std::clamp<int64_t>(limit[r] - j0, 0, cols);
      __m512 block_max = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 keep = visible - j >= 16 ? __mmask16(0xFFFF)
                               : visible > j     ? __mmask16((1u << (visible - j)) - 1)
                                                 : __mmask16(0);
        const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep, _mm512_loadu_ps(s + j), scale_v);
        _mm512_storeu_ps(s + j, x);
        block_max = _mm512_max_ps(block_max, x);
      }
      const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(block_max));
      const float correction = std::exp(row_max[r] - new_max);  // 0 on the first block (-inf)
      row_max[r] = new_max;
      const __m512 max_v = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      bf16* p = probs.data() + r * kKeyBlock;
      for (int64_t j = 0; j < cols; j += 32) {
        // masked scores are -inf, which exp_nonpositive clamps to e^-87: zero them exactly
        const __m512 s_lo = _mm512_loadu_ps(s + j), s_hi = _mm512_loadu_ps(s + j + 16);
        const __mmask16 live_lo = _mm512_cmp_ps_mask(s_lo, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __mmask16 live_hi = _mm512_cmp_ps_mask(s_hi, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 e_lo = _mm512_maskz_mov_ps(live_lo, optimum_qwen36::exp_nonpositive(_mm512_sub_ps(s_lo, max_v)));
        const __m512 e_hi = _mm512_maskz_mov_ps(live_hi, optimum_qwen36::exp_nonpositive(_mm512_sub_ps(s_hi, max_v)));
        // P as bf16 (round to nearest even); the sum is of the rounded values, as P V uses them
        const __m512bh packed = _mm512_cvtne2ps_pbh(e_hi, e_lo);
        _mm512_storeu_si512(p + j, (__m512i)packed);
        const __m512i bits = (__m512i)packed;
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF0000))));
      }
      row_sum[r] = row_sum[r] * correction + _mm512_reduce_add_ps(sum);
      if (correction != 1.0f) {
        float* o = acc.data() + r * dim;
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), c));
      }
    }
    // acc += P V over this block's keys (pairs of keys): values packed [n_pad / 2][D]
#ifdef QWEN36_AMX
    if (tiles)
      tile_product(padded, dim, probs.data(), kKeyBlock, values, dim, 32, 16 * dim, cols / 32, acc.data(), dim, true);
    else
#endif
      product(rows, dim, p_rows.data(), values, dim, 32, cols / 2, acc.data(), dim, true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = blk.t0 + r / group, h = blk.kh * group + r % group;
    bf16* o = out + (t * heads + h) * dim;
    const float inv = 1.0f / row_sum[r];
    for (int64_t d = 0; d < dim; ++d) o[d] = bf16(acc[r * dim + d] * inv);
  }
}

at::Tensor attention_bf16(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          int64_t layer, const at::Tensor& block_tables, const at::Tensor& positions,
                          const std::vector<Segment>& segments, double scale) {
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = key_cache.size(1), block_size = key_cache.size(2), kv_heads = key_cache.size(3);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const at::Tensor q = query.contiguous(), kc = key_cache.contiguous(), vc = value_cache.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
  const int64_t layer_offset = layer * num_blocks * block_size * kv_heads * dim;
  const auto* k_ptr = reinterpret_cast<const bf16*>(kc.data_ptr()) + layer_offset;
  const auto* v_ptr = reinterpret_cast<const bf16*>(vc.data_ptr()) + layer_offset;
  const int64_t count = int64_t(segments.size());
  const auto source = [&](int64_t seg, int64_t kh) {
    return KVSource{k_ptr, v_ptr, tables.data_ptr<int64_t>() + segments[seg].table_row * max_blocks, block_size,
                    kv_heads, kh, dim};
  };

  // A sequence whose queries fill several work items has its keys packed once for all of them; one of a
  // single work item (a decode row, a short prefill) packs each block of keys as it reads it.
  const int64_t tokens_per_block = std::max<int64_t>(1, kRowBlock / group);
  std::vector<PackedKV> packed(count * kv_heads);
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Segment& seg = segments[i / kv_heads];
      if (seg.count <= tokens_per_block) continue;
      const int64_t n_pad = (seg.keys + kKeyTile - 1) / kKeyTile * kKeyTile;
      packed[i].keys.resize(n_pad * dim / 2);
      packed[i].values.resize(n_pad / 2 * dim);
      pack_range(source(i / kv_heads, i % kv_heads), 0, n_pad, seg.keys, packed[i].keys.data(),
                 packed[i].values.data());
    }
  });

  std::vector<Block> blocks;
  for (int64_t s = 0; s < count; ++s)
    for (int64_t t0 = 0; t0 < segments[s].count; t0 += tokens_per_block)
      for (int64_t kh = 0; kh < kv_heads; ++kh)
        blocks.push_back({s, kh, segments[s].first + t0, std::min(tokens_per_block, segments[s].count - t0)});
  at::Tensor out = at::zeros_like(q);
  auto* out_ptr = reinterpret_cast<bf16*>(out.data_ptr());
  const auto* q_ptr = reinterpret_cast<const bf16*>(q.data_ptr());
  // Tiles take the head size in steps of 32 values (the vector path's condition too) and 32 output columns.
#ifdef QWEN36_AMX
  const bool tiles = dim % 32 == 0 && optimum_qwen36::amx::granted();
#else
  const bool tiles = false;
#endif
  // Round-robin over threads: causal blocks grow with t0, so contiguous ranges would be unbalanced.
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), int64_t(blocks.size()));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const optimum_qwen36::FlushDenormals flush_denormals;
#ifdef QWEN36_AMX
    if (tiles) optimum_qwen36::amx::configure_full_tiles();
#endif
    std::vector<uint32_t> block_keys(kKeyBlock * dim / 2), block_values(kKeyBlock / 2 * dim);
    for (int64_t thread = begin; thread < end; ++thread)
      for (size_t i = thread; i < blocks.size(); i += threads) {
        const Block& blk = blocks[i];
        const PackedKV& whole = packed[blk.seg * kv_heads + blk.kh];  // empty: packed block by block
        attend_block(blk, q_ptr, pos.data_ptr<int64_t>(), source(blk.seg, blk.kh), whole.keys.empty() ? nullptr : &whole,
                     segments[blk.seg].keys, heads, group, dim, float(scale), tiles, block_keys, block_values, out_ptr);
      }
#ifdef QWEN36_AMX
    if (tiles) optimum_qwen36::amx::release();
#endif
  });
  return out;
}

#endif  // QWEN36_BF16_AVX512

// Flat queries [N, H, D] of `segments` over the cache's layer `cache_idx`.
at::Tensor attend_segments(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& cache_idx, const at::Tensor& block_tables, const at::Tensor& positions,
                           const std::vector<int64_t>& bounds, double scale, const char* op) {
  TORCH_CHECK(key_cache.dim() == 5 && value_cache.sizes() == key_cache.sizes(), op,
              ": caches [L, blocks, block_size, KVH, D] expected");
  TORCH_CHECK(query.size(2) == key_cache.size(4) && query.size(1) % key_cache.size(3) == 0, op,
              ": query heads must be a multiple of the cache's KV heads, with the same head size");
  TORCH_CHECK(cache_idx.numel() == 1, op, ": cache_idx must hold one layer index");
  const int64_t layer = cache_idx.item<int64_t>();
  const std::vector<Segment> segments =
      segments_of(bounds, positions, block_tables.size(1) * key_cache.size(2));
#ifdef QWEN36_BF16_AVX512
  // pack_range gathers keys by int32 offsets (in pairs of values) from the layer's start
  const bool gatherable = key_cache[0].numel() / 2 <= std::numeric_limits<int32_t>::max();
  if (query.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 && query.size(2) % 32 == 0 &&
      gatherable)
    return attention_bf16(query, key_cache, value_cache, layer, block_tables, positions, segments, scale);
#endif
  return attention_aten(query, key_cache, value_cache, layer, block_tables, positions, segments, scale);
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& cache_idx, const at::Tensor& block_tables, const at::Tensor& positions,
                           double scale) {
  TORCH_CHECK(query.dim() == 4, "paged_attention: query [B, T, H, D] expected");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && positions.sizes() == query.sizes().slice(0, 2),
              "paged_attention: block_tables [B, max_blocks] and positions [B, T] must match the query");
  const int64_t batch = query.size(0), seq = query.size(1);
  std::vector<int64_t> bounds(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) bounds[b] = b * seq;
  return attend_segments(query.flatten(0, 1), key_cache, value_cache, cache_idx, block_tables,
                         positions.flatten(), bounds, scale, "paged_attention")
      .view(query.sizes());
}

at::Tensor paged_attention_varlen(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& cache_idx, const at::Tensor& block_tables,
                                  const at::Tensor& cu_seqlens, const at::Tensor& positions, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1, "paged_attention_varlen: query [1, N, H, D] expected");
  TORCH_CHECK(positions.numel() == query.size(1), "paged_attention_varlen: positions [1, N] must match the query");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() == block_tables.size(0) + 1,
              "paged_attention_varlen: cu_seqlens [S + 1] for block_tables [S, max_blocks]");
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  std::vector<int64_t> bounds(cu.data_ptr<int64_t>(), cu.data_ptr<int64_t>() + cu.numel());
  TORCH_CHECK(bounds.front() == 0 && bounds.back() <= query.size(1) && std::is_sorted(bounds.begin(), bounds.end()),
              "paged_attention_varlen: cu_seqlens must run from 0 to at most N without decreasing");
  return attend_segments(query[0], key_cache, value_cache, cache_idx, block_tables, positions.flatten(), bounds,
                         scale, "paged_attention_varlen")
      .unsqueeze(0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(optimum_qwen36, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cache_idx, Tensor block_tables, "
      "Tensor positions, float scale) -> Tensor");
  m.def(
      "paged_attention_varlen(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cache_idx, "
      "Tensor block_tables, Tensor cu_seqlens, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(optimum_qwen36, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_varlen", &paged_attention_varlen);
}
