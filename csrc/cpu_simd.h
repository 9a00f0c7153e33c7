// SIMD helpers shared by the native decoder (cpu_forward.cpp) and the child scoring (cpu_kernels.cpp)
// The extension is compiled with -march=native on the machine that runs it,
// so the vector width is chosen at build time: AVX-512 (16 lanes) or AVX2+FMA+F16C (8 lanes).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace se_simd {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload_tail(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vmax_all(vec a) { return _mm512_reduce_max_ps(a); }
inline float vmin_all(vec a) { return _mm512_reduce_min_ps(a); }
// Bit l set where lane l of a is > t (false for NaN).
inline uint32_t vmask_gt(vec a, float t) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(t), _CMP_GT_OQ); }
// Bit l set where lane l of a equals t (false for NaN).
inline uint32_t vmask_eq(vec a, float t) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(t), _CMP_EQ_OQ); }
inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vec vexp2i(vec y, vec n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
// The lane sums of four vectors, as 4 floats; each sum uses one fixed tree of its own lanes.
inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
  auto half = [](vec a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline void vstore_tail(float* p, vec a, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), a);
}
// float16 weights, widened to float32 in registers (exact).
inline vec vload_h(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vec vload_h_tail(const uint16_t* p, int64_t n) {
  alignas(32) uint16_t buf[16] = {0};
  for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)));
}
// bfloat16 weights: the upper halves of float32s, widened by shifting them back (exact).
inline vec vload_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// Two vectors of bfloat16 weights stored interleaved, a's lane l in the low half of 32-bit word
// l and b's in its high half: one load, then a shift and a mask, no shuffle.
inline void vload_bf16_pair(const uint16_t* p, vec& a, vec& b) {
  const __m512i x = _mm512_loadu_si512(p);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i tail_mask(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}
inline vec vload_tail(const float* p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 lo = _mm256_castps256_ps128(a), hi = _mm256_extractf128_ps(a, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline uint32_t vmask_gt(vec a, float t) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(t), _CMP_GT_OQ)));
}
inline uint32_t vmask_eq(vec a, float t) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(t), _CMP_EQ_OQ)));
}
inline float vmax_all(vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline float vmin_all(vec a) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline vec vexp2i(vec y, vec n) {  // y * 2^n for integral n in [-127, 128]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline void vstore_tail(float* p, vec a, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), a); }
inline vec vload_h(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vec vload_h_tail(const uint16_t* p, int64_t n) {
  alignas(16) uint16_t buf[8] = {0};
  for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}
inline vec vload_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void vload_bf16_pair(const uint16_t* p, vec& a, vec& b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
#error "staged_engine._cpu needs AVX2+FMA+F16C or AVX-512 (built with -march=native)"
#endif

// K/V cache entries, float32 or float16 (widened to float32 in registers, exactly), and the new
// tokens' entries stored into either (float16 rounded to nearest even, as torch's conversion).
inline vec kv_load(const float* p) { return vload(p); }
inline vec kv_load(const uint16_t* p) { return vload_h(p); }
inline vec kv_load_tail(const float* p, int64_t n) { return vload_tail(p, n); }
inline vec kv_load_tail(const uint16_t* p, int64_t n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p));
#else
  return vload_h_tail(p, n);
#endif
}
inline void kv_store_row(float* dst, const float* src, int64_t n) { std::copy(src, src + n, dst); }
inline void kv_store_row(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

// exp() on every lane (Cephes expf: range reduction by ln 2, degree-6 polynomial; about 1 ulp).
// One fixed sequence of operations per lane, so a lane's result never depends on its neighbours.
inline vec vexp(vec x) {
  x = vmax(x, vset1(-87.3365f));
  x = vmin(x, vset1(88.3762f));
  const vec n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfma(n, vset1(-0.693359375f), x);
  x = vfma(n, vset1(2.12194440e-4f), x);
  vec y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset1(1.0f)));
  return vexp2i(y, n);
}

}  // namespace se_simd
