// bf16 weights on AVX-512 BF16: one vdpbf16ps per block of 32 elements, row and column, where
// the other paths take two fused multiply-adds per lane, with the same bits (params.h,
// kBFloat16: lane j adds element 2j + 1's product, then 2j's, each rounded once, denormals
// flushed; the products of two bf16 values are exact in fp32). ops.cpp runs it where the CPU
// has avx512bf16 and every row of x holds bf16 values (p.x_bf16: a bf16 model's activations);
// other calls run body.h's tiles on x in fp32. No torch header here: see params.h.
#include <cstdint>

#include "params.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

namespace selfspec_kernels {
namespace avx512bf16 {
#include "vec_avx512.h"

namespace {

constexpr int kOutColumns = 4;  // the widest tile's columns: `out` of every tile is [R][4]

// out[r][c] = row r of x . weight row c for R rows and C columns, blocks of 32 ascending.
// `next`: C weight rows to prefetch, a cache line (a block of 32 bf16) per block, or null.
template <int R, int C>
SS_INLINE void dot_tile(const uint16_t* const* x, const uint16_t* const* w, int64_t K,
                        const char* const* next, float (*out)[kOutColumns]) {
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t blocks = bf16_length(K) / 32, full = K / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i weights[C];
    if (b < full) {
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) weights[c] = _mm512_loadu_si512(w[c] + 32 * b);
    } else {  // the row's last, partial block: the rest reads as 0, as x's padding does
      const __mmask32 present = static_cast<__mmask32>((uint64_t{1} << (K - 32 * b)) - 1);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) weights[c] = _mm512_maskz_loadu_epi16(present, w[c] + 32 * b);
    }
    if (next) {
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) _mm_prefetch(next[c] + 64 * b, SS_WEIGHT_PREFETCH);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh activations = (__m512bh)_mm512_loadu_si512(x[r] + 32 * b);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], activations, (__m512bh)weights[c]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) out[r][c] = vhsum(V{acc[r][c]});
}

// dot_tile for `rows` (1..R) rows, chosen at run time, compiled for each count.
template <int R, int C>
SS_INLINE void dot_rows(int rows, const uint16_t* const* x, const uint16_t* const* w, int64_t K,
                        const char* const* next, float (*out)[kOutColumns]) {
  if (rows == R) {
    dot_tile<R, C>(x, w, K, next, out);
  } else if constexpr (R > 1) {
    dot_rows<R - 1, C>(rows, x, w, K, next, out);
  }
}

SS_INLINE const uint16_t* weight_row(const LinearParams& p, int64_t n) {
  return static_cast<const uint16_t*>(p.w) + (p.rows ? p.rows[n] : n) * p.K;
}

// Columns [n_begin, n_end) of y, every row, in tiles of R rows x C columns.
template <int R, int C>
void columns_tiled(const LinearParams& p, int64_t n_begin, int64_t n_end) {
  static_assert(C <= kOutColumns, "a tile has at most kOutColumns columns");
  const int64_t K = p.K, M = p.M, N = p.N, stride = bf16_length(K);
  for (int64_t n = n_begin; n < n_end; n += C) {
    // Fewer columns than a tile only at the end of the range: spare slots repeat the last one.
    const int columns = static_cast<int>(n_end - n < C ? n_end - n : C);
    const uint16_t* w[C];
    const char* next[C];
    for (int c = 0; c < C; ++c) {
      const int64_t column = n + (c < columns ? c : columns - 1);
      w[c] = weight_row(p, column);
      const int64_t ahead = column + 8 * C < N ? column + 8 * C : N - 1;  // eight tiles ahead
      next[c] = reinterpret_cast<const char*>(weight_row(p, ahead));
    }
    for (int64_t m = 0; m < M; m += R) {
      const int rows = static_cast<int>(M - m < R ? M - m : R);
      const uint16_t* x[R];
      for (int r = 0; r < R; ++r) x[r] = p.x_bf16 + (m + (r < rows ? r : rows - 1)) * stride;
      float out[R][kOutColumns];
      dot_rows<R, C>(rows, x, w, K, m == 0 ? next : nullptr, out);
      for (int r = 0; r < rows; ++r) {
        float* y = p.y + (m + r) * N + n;
        for (int c = 0; c < columns; ++c) y[c] = p.bias ? out[r][c] + p.bias[n + c] : out[r][c];
      }
    }
  }
}

}  // namespace

// Tiles by row count, measured on SmolLM2-135M's layers (AMD EPYC Zen 4, 1 thread): one column
// at a time up to 8 rows (one weight row streamed per tile: 1-8 rows cost about what 1 does,
// 0.7x four columns at a time), 12 x 2 up to 32 rows, 4 x 4 beyond (taller tiles stream x
// from L2 there: 64 rows 1.35x slower in 12 x 2).
void linear_columns_bf16(const LinearParams& p, int64_t n_begin, int64_t n_end) {
  if (p.M <= 8) columns_tiled<8, 1>(p, n_begin, n_end);
  else if (p.M <= 32) columns_tiled<12, 2>(p, n_begin, n_end);
  else columns_tiled<4, 4>(p, n_begin, n_end);
}

}  // namespace avx512bf16
}  // namespace selfspec_kernels
