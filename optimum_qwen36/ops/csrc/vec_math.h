// Float32 vector math shared by the native kernels.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

namespace optimum_qwen36 {

inline float horizontal_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

}  // namespace optimum_qwen36

#endif

// f32: one float32 vector register of the widest set this build has (AVX-512: 16 lanes, AVX2 + FMA: 8), for
// kernels written once over `kLanes`. QWEN36_F32_VECTOR is defined where it exists.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define QWEN36_F32_VECTOR 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace optimum_qwen36::f32 {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
// a where v >= 0, else b, per lane.
inline Vec select_nonnegative(Vec v, Vec a, Vec b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, zero(), _CMP_GE_OQ), b, a);
}
inline Vec round_nearest(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p 2^n for an integral n in [-126, 0].
inline Vec times_power_of_2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }
// The first `count` lanes of v (count clamped to 0..kLanes), the others zero.
inline Vec first_lanes(Vec v, int64_t count) {
  return _mm512_maskz_mov_ps(__mmask16((1u << std::clamp<int64_t>(count, 0, kLanes)) - 1), v);
}
// float(c - d[l]) for the kLanes doubles at d (the difference in float64, rounded once).
inline Vec differences(double c, const double* d) {
  const __m512d c_v = _mm512_set1_pd(c);
  const __m256 lo = _mm512_cvtpd_ps(_mm512_sub_pd(c_v, _mm512_loadu_pd(d)));
  const __m256 hi = _mm512_cvtpd_ps(_mm512_sub_pd(c_v, _mm512_loadu_pd(d + 8)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
#else
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec select_nonnegative(Vec v, Vec a, Vec b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(v, zero(), _CMP_GE_OQ));
}
inline Vec round_nearest(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_power_of_2(Vec p, Vec n) {  // 2^n built in the exponent bits: n >= -126 is a normal number
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23)));
}
inline Vec first_lanes(Vec v, int64_t count) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps(float(std::clamp<int64_t>(count, 0, kLanes))), _CMP_LT_OQ);
  return _mm256_and_ps(v, keep);
}
inline Vec differences(double c, const double* d) {
  const __m256d c_v = _mm256_set1_pd(c);
  const __m128 lo = _mm256_cvtpd_ps(_mm256_sub_pd(c_v, _mm256_loadu_pd(d)));
  const __m128 hi = _mm256_cvtpd_ps(_mm256_sub_pd(c_v, _mm256_loadu_pd(d + 4)));
  return _mm256_set_m128(hi, lo);
}
#endif

// exp(x) for x <= 0 (Cody-Waite reduction, degree-7 Taylor on |r| <= ln2/2: relative error < 1e-7); inputs
// below -87 give e^-87, so callers zero masked lanes themselves.
inline Vec exp_nonpositive(Vec x) {
  x = max(x, set1(-87.0f));
  const Vec n = round_nearest(mul(x, set1(1.44269504088896341f)));
  Vec r = fnmadd(n, set1(0.693145751953125f), x);
  r = fnmadd(n, set1(1.428606765330187045e-06f), r);
  Vec p = set1(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fmadd(p, r, set1(c));
  return times_power_of_2(p, n);
}

}  // namespace optimum_qwen36::f32

namespace optimum_qwen36 {
using f32::exp_nonpositive;
}  // namespace optimum_qwen36

#endif
