// The 16-lane float vector of vec_avx512.h on AVX2 + FMA: two 8-lane registers, lanes 0-7 and
// 8-15, every operation lane for lane the same IEEE operation, so results equal the AVX-512
// path's bit for bit. Included only by isa_avx2.cpp, inside its own namespace.
// (immintrin.h is included by the isa file, at global scope)

struct V {
  __m256 lo, hi;
};

SS_INLINE V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
SS_INLINE V vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
SS_INLINE V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
SS_INLINE V vload_n(const float* p, int n) {  // lanes >= n read as 0
  alignas(32) float buffer[16] = {0};
  for (int i = 0; i < n; ++i) buffer[i] = p[i];
  return vload(buffer);
}
SS_INLINE void vstore(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
SS_INLINE V vfma(V a, V b, V c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
SS_INLINE V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
SS_INLINE V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
SS_INLINE V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
SS_INLINE V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
SS_INLINE V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }

// Same fixed order as the AVX-512 path: lanes i and i+8, then i and i+4, i and i+2, 0 and 1.
SS_INLINE float vhsum(V a) {
  __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

// out[j] = vhsum(acc[j]) for 16 vectors (the AVX-512 path's butterfly gives the same bits).
SS_INLINE void vhsum16(const V* acc, float* out) {
  for (int j = 0; j < 16; ++j) out[j] = vhsum(acc[j]);
}

SS_INLINE __m256 widen_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
SS_INLINE V vload_bf16(const uint16_t* p) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
SS_INLINE V vload_i8(const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
SS_INLINE V widen_u8(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
SS_INLINE void vload_q4(const uint8_t* p, V& lo, V& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  lo = widen_u8(_mm_and_si128(b, low_mask));
  hi = widen_u8(_mm_and_si128(_mm_srli_epi16(b, 4), low_mask));
}

// A Q4_1 block's 32 weights (q * d) + m, two roundings; the same bits as vec_avx512.h's table.
SS_INLINE void vdequant_q4(const uint8_t* p, float d, float m, V& lo, V& hi) {
  V q_lo, q_hi;
  vload_q4(p, q_lo, q_hi);
  lo = vadd(vmul(q_lo, vset1(d)), vset1(m));
  hi = vadd(vmul(q_hi, vset1(d)), vset1(m));
}

SS_INLINE V vload_q4_half(const uint8_t* p, int64_t half) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (half) b = _mm_srli_epi16(b, 4);
  return widen_u8(_mm_and_si128(b, _mm_set1_epi8(0x0F)));
}

SS_INLINE __m256 exp_half(__m256 x) {
  __m256 c = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), c);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
SS_INLINE V vexp_nonpositive(V x) { return {exp_half(x.lo), exp_half(x.hi)}; }

// 16 registers: 3 x 2 tiles of two-register accumulators (12) and two columns of weights (4);
// activations are read as memory operands of the multiply-adds.
constexpr int kTileRows = 3;
constexpr int kTileCols = 2;
