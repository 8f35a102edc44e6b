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
// 32 bf16 values as lane j's pair: `odd` element 2j + 1, `even` element 2j (vec_avx512.h).
SS_INLINE void vload_bf16_pairs(const uint16_t* p, V& odd, V& even) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i top = _mm256_set1_epi32(int(0xFFFF0000u));
  odd = {_mm256_castsi256_ps(_mm256_and_si256(lo, top)), _mm256_castsi256_ps(_mm256_and_si256(hi, top))};
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
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

// A Q4_1 block's 32 weights (q * d) + m as one fused multiply-add: q * d is exact (q has 4
// bits, d at most 11 significant ones: a float16 value, checked by weights.py), so the single
// rounding gives the bits of vec_avx512.h's table, (q * d) + m rounded twice, one uop sooner.
SS_INLINE void vdequant_q4(const uint8_t* p, float d, float m, V& lo, V& hi) {
  V q_lo, q_hi;
  vload_q4(p, q_lo, q_hi);
  lo = vfma(q_lo, vset1(d), vset1(m));
  hi = vfma(q_hi, vset1(d), vset1(m));
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

// ---------------------------------------------------------------------------------------------
// Integer dot products for the *_A8 formats: vec_avx512.h's 16 int32 lanes (one per column) on
// two registers (columns 0-7, 8-15), its dot product as maddubs (u8 x s8 -> pairs summed to
// int16, never saturating here: at most 2 * 127 * 127) then madd with ones (-> int32 sums of 4
// bytes): the same integers as VNNI.

struct Q {
  __m256i lo, hi;
};

// q4_1_a8: vec_avx512.h's low and high codes (u8, 0-15) on two registers.
SS_INLINE void qnibbles(const uint8_t* p, Q& lo, Q& hi) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  lo = {_mm256_and_si256(a, mask), _mm256_and_si256(b, mask)};
  hi = {_mm256_and_si256(_mm256_srli_epi16(a, 4), mask), _mm256_and_si256(_mm256_srli_epi16(b, 4), mask)};
}
SS_INLINE Q qzero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
// A Q4_1 block's exact integer sums for one row (vec_avx512.h's qblock_q4): maddubs pair sums,
// each at most 2 * 15 * 128 = 3840 in magnitude (codes 0-15, activation codes or digits within
// [-128, 127]), added as int16 over the block's 8 runs (at most 30720: no overflow) and widened
// to int32 once, instead of after every run: the same integers, a quarter fewer instructions.
SS_INLINE Q qblock_q4(const Q* codes, const int8_t* x) {
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    int32_t x4;
    __builtin_memcpy(&x4, x + (t < 4 ? 4 * t : 16 + 4 * (t - 4)), 4);
    const __m256i xs = _mm256_set1_epi32(x4);
    lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(codes[t].lo, xs));
    hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(codes[t].hi, xs));
  }
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)};
}
SS_INLINE Q qadd(Q a, Q b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
SS_INLINE V qfloat(Q a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
SS_INLINE Q qshl8(Q a) { return {_mm256_slli_epi32(a.lo, 8), _mm256_slli_epi32(a.hi, 8)}; }
// int8_a8: the signed codes as they are; no offset to take out (qdot_bcast_i8 multiplies the
// activation codes' magnitudes by the weights carrying the activations' signs).
SS_INLINE Q qcodes_i8(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
SS_INLINE Q qinit_i8(int32_t) { return qzero(); }
SS_INLINE Q qdot_bcast_i8(Q acc, Q w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4), magnitude = _mm256_abs_epi8(x), ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w.lo, x)), ones)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w.hi, x)), ones))};
}

SS_INLINE V vabs(V a) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask)};
}
SS_INLINE float vhmax(V a) {
  alignas(32) float buffer[16];
  vstore(buffer, a);
  float top = buffer[0];
  for (int i = 1; i < 16; ++i) top = buffer[i] > top ? buffer[i] : top;
  return top;
}

SS_INLINE V vround(V a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}

SS_INLINE V vfloor(V a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
}

SS_INLINE void vstore_i8(int8_t* p, V a) {
  const __m256i lo = _mm256_cvtps_epi32(a.lo), hi = _mm256_cvtps_epi32(a.hi);
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // in order
  const __m128i w = _mm256_castsi256_si128(_mm256_packs_epi16(words, words));
  const __m128i bytes = _mm_unpacklo_epi64(w, _mm256_extracti128_si256(_mm256_packs_epi16(words, words), 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
}

// 16 registers: 3 x 2 tiles of two-register accumulators (12) and two columns of weights (4);
// activations are read as memory operands of the multiply-adds.
constexpr int kTileRows = 3;
constexpr int kTileCols = 2;
// A taller one for 4-6 rows of quantized weights: 6 two-register accumulators, one column.
constexpr int kTallRows = 6;
constexpr int kTallCols = 1;
// The *_A8 formats' 16-column groups (the codes spill: too few registers).
constexpr int kQGroupRows = 4;
