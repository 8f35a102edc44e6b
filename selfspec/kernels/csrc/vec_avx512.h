// A 16-lane float vector on AVX-512. vec_avx2.h defines the same operations with the same
// rounding on two AVX2 registers (lanes 0-7, 8-15), so both paths give the same bits.
// Included only by isa_avx512.cpp, inside its own namespace, after `#pragma GCC target`.
// (immintrin.h is included by the isa file, at global scope)

struct V {
  __m512 v;
};

SS_INLINE V vzero() { return {_mm512_setzero_ps()}; }
SS_INLINE V vset1(float a) { return {_mm512_set1_ps(a)}; }
SS_INLINE V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
SS_INLINE V vload_n(const float* p, int n) {  // lanes >= n read as 0
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p)};
}
SS_INLINE void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
SS_INLINE V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
SS_INLINE V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
SS_INLINE V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
SS_INLINE V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
SS_INLINE V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
SS_INLINE V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }

// Sum of the 16 lanes in one fixed order: lanes i and i+8, then i and i+4, i and i+2, 0 and 1.
SS_INLINE float vhsum(V a) {
  __m256 lo = _mm512_castps512_ps256(a.v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

// out[j] = vhsum(acc[j]) for 16 vectors, bit for bit (each addition pairs the same two partial
// sums as vhsum does), in a butterfly of 15 vector additions instead of 16 separate reductions.
SS_INLINE void vhsum16(const V* acc, float* out) {
  __m512 s8[8], s4[4], s2[2];
  for (int j = 0; j < 8; ++j) {  // lanes i + i+8 of keys j and j+8
    s8[j] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[j].v, acc[j + 8].v, 0x44),
                          _mm512_shuffle_f32x4(acc[j].v, acc[j + 8].v, 0xEE));
  }
  for (int j = 0; j < 4; ++j) {  // then i + i+4
    s4[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[j], s8[j + 4], 0x88),
                          _mm512_shuffle_f32x4(s8[j], s8[j + 4], 0xDD));
  }
  for (int j = 0; j < 2; ++j) {  // then i + i+2
    s2[j] = _mm512_add_ps(_mm512_shuffle_ps(s4[j], s4[j + 2], 0x44),
                          _mm512_shuffle_ps(s4[j], s4[j + 2], 0xEE));
  }
  __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x88),  // then 0 + 1
                            _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
  // Lane of each key's sum after the butterfly, put back in key order.
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, s1));
}

// A Q4_1 block's 32 weights (q * d) + m (two roundings, GGUF's reference dequantization) from its
// 16 nibble bytes: `lo` elements 0-15, `hi` 16-31. The 16 values a block can take are computed
// once into a table and looked up by code (vpermps reads the low 4 bits of each lane), so the
// bits are those of computing each weight, in 8 instructions instead of 14.
SS_INLINE void vdequant_q4(const uint8_t* p, float d, float m, V& lo, V& hi) {
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
  lo = {_mm512_permutexvar_ps(codes, table)};  // low nibble: bits 0-3 of each lane
  hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table)};
}

SS_INLINE V vload_bf16(const uint16_t* p) {  // 16 bf16 values, exactly widened
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
// 32 bf16 values as lane j's pair: `odd` element 2j + 1, `even` element 2j, exactly widened
// (the high half of each 32-bit word is the odd element, already a float's top bits).
SS_INLINE void vload_bf16_pairs(const uint16_t* p, V& odd, V& even) {
  const __m512i words = _mm512_loadu_si512(p);
  odd = {_mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(int(0xFFFF0000u))))};
  even = {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16))};
}
SS_INLINE V vload_i8(const int8_t* p) {  // 16 int8 values as floats
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
// Half `half` of a Q4_1 block's 32 elements from its 16 nibble bytes: 0 = elements 0-15 (the
// low nibbles), 1 = elements 16-31 (the high nibbles).
SS_INLINE V vload_q4_half(const uint8_t* p, int64_t half) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (half) b = _mm_srli_epi16(b, 4);
  b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))};
}

// exp(x) for x <= 0 (clamped at -87): Cody-Waite reduction, degree-6 polynomial, 2^n by exponent
// bits. The same operations in the same order as vec_avx2.h.
SS_INLINE V vexp_nonpositive(V x) {
  __m512 c = _mm512_max_ps(x.v, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), c);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return {_mm512_mul_ps(p, _mm512_castsi512_ps(e))};
}

// ---------------------------------------------------------------------------------------------
// Integer dot products for the *_A8 formats (body.h), on AVX-512 VNNI: 16 int32 lanes, one per
// output column of an interleaved group, each summing its column's 4 codes times 4 broadcast
// activation codes. vec_avx2.h computes the same integers.

struct Q {
  __m512i v;
};

// q4_1_a8: 64 interleaved bytes (4 consecutive elements of each of 16 columns in the low
// nibbles, the 4 elements 16 further on in the high ones) -> the low and the high codes (u8).
SS_INLINE void qnibbles(const uint8_t* p, Q& lo, Q& hi) {
  const __m512i b = _mm512_loadu_si512(p), mask = _mm512_set1_epi8(0x0F);
  lo = {_mm512_and_si512(b, mask)};
  hi = {_mm512_and_si512(_mm512_srli_epi16(b, 4), mask)};
}
SS_INLINE Q qzero() { return {_mm512_setzero_si512()}; }
// acc + per lane: its 4 codes (u8) times the 4 signed bytes of `x4`, summed (exact).
SS_INLINE Q qdot_bcast(Q acc, Q w, int32_t x4) {
  return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))};
}
// A Q4_1 block's exact integer sums for one row: the 8 runs of codes (runs 0-3 elements 0-15,
// 4-7 elements 16-31) times the row's 32 activation codes at `x`, in two chains (elements 0-15,
// 16-31) added at the end.
SS_INLINE Q qblock_q4(const Q* codes, const int8_t* x) {
  __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    int32_t x_lo, x_hi;
    __builtin_memcpy(&x_lo, x + 4 * t, 4);
    __builtin_memcpy(&x_hi, x + 16 + 4 * t, 4);
    low = _mm512_dpbusd_epi32(low, codes[t].v, _mm512_set1_epi32(x_lo));
    high = _mm512_dpbusd_epi32(high, codes[4 + t].v, _mm512_set1_epi32(x_hi));
  }
  return {_mm512_add_epi32(low, high)};
}
// int8_a8: 64 interleaved code bytes offset by 128 (VNNI's first operand is unsigned), ...
SS_INLINE Q qcodes_i8(const uint8_t* p) {
  return {_mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(static_cast<char>(0x80)))};
}
// ... the offset taken back out by starting a block's sums at `corr` = -128 * the sum of the
// block's activation codes, ...
SS_INLINE Q qinit_i8(int32_t corr) { return {_mm512_set1_epi32(corr)}; }
// ... and the same dot product.
SS_INLINE Q qdot_bcast_i8(Q acc, Q w, int32_t x4) { return qdot_bcast(acc, w, x4); }
SS_INLINE Q qadd(Q a, Q b) { return {_mm512_add_epi32(a.v, b.v)}; }
SS_INLINE V qfloat(Q a) { return {_mm512_cvtepi32_ps(a.v)}; }
SS_INLINE Q qshl8(Q a) { return {_mm512_slli_epi32(a.v, 8)}; }  // a * 256

SS_INLINE V vabs(V a) { return {_mm512_abs_ps(a.v)}; }
SS_INLINE float vhmax(V a) { return _mm512_reduce_max_ps(a.v); }  // exact in any order

// Each lane rounded to the nearest integer, ties to even.
SS_INLINE V vround(V a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}

// Each lane rounded down to an integer.
SS_INLINE V vfloor(V a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
}

// 16 integer-valued lanes stored as int8, saturated.
SS_INLINE void vstore_i8(int8_t* p, V a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(a.v)));
}

// Register tile of the linear kernel: rows x columns of accumulators (16 + 4 + 4 of 32 zmm).
constexpr int kTileRows = 4;
constexpr int kTileCols = 4;
// A taller one for 5-8 rows of quantized weights (16 + 4 + 1 zmm).
constexpr int kTallRows = 8;
constexpr int kTallCols = 2;
// The *_A8 formats' 16-column groups: rows of accumulators (12 + 8 codes + scale, minimum, sum).
constexpr int kQGroupRows = 12;
