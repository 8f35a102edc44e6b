// The kernels, written once against the 16-lane vector `V` of vec_<isa>.h and included by each
// isa_<name>.cpp inside its own namespace.
//
// Row invariance by construction: every output element is reduced in one fixed order that
// depends on nothing but its own inputs. A linear output y[m, n] accumulates x[m, k] * w[n, k]
// with lane k % 16 of one vector (fused multiply-add, k ascending), then sums the 16 lanes in
// vhsum's fixed order; how many rows share the call, which tile a row falls in and which thread
// computes it change nothing. bf16 weights take AVX-512 BF16's dot-product order instead
// (params.h, kBFloat16): lane j sums elements 32b + 2j + 1, then 32b + 2j, of each block b of
// 32; the dispatcher hands x in that order (odd elements, then even, per block), so the tiles
// below read it as 16-element chunks like any other format. Attention for one query row and
// head visits only the keys its mask allows, in key order, so a masked-out key (another tree
// branch, padding) contributes nothing, not even a rounding: a tree token attends exactly as
// the same token decoded alone.

SS_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Linear: y[M, N] = x[M, K] . w[N, K]^T (+ bias)

// Bytes of one stored weight row, for prefetching the next tile while this one computes.
SS_INLINE int64_t row_bytes(const LinearParams& p) {
  switch (stored_format(p.format)) {
    case kFloat32: return p.K * 4;
    case kBFloat16: return p.K * 2;
    case kInt8: return p.K;
    default: return p.K / 2;
  }
}

// Where weight row n's codes and scales start.
struct RowRef {
  const char* data;
  const float* scale;
  const float* minimum;
  int64_t length;  // elements in the row (K)
};

SS_INLINE RowRef row_ref(const LinearParams& p, int64_t n) {
  if (p.rows) n = p.rows[n];  // output column n reads a chosen weight row (a draft vocabulary)
  const char* base = static_cast<const char*>(p.w);
  switch (stored_format(p.format)) {
    case kInt8: {
      const int64_t groups = p.group_shift < 0 ? 1 : (p.K >> p.group_shift) + ((p.K & ((int64_t{1} << p.group_shift) - 1)) != 0);
      return {base + n * p.K, p.scale + n * groups, nullptr, p.K};
    }
    case kQ4_1: return {base + n * (p.K / 32) * 16, p.scale + n * (p.K / 32), p.minimum + n * (p.K / 32), p.K};
    default: return {base + n * row_bytes(p), nullptr, nullptr, p.K};
  }
}

// Block `block` of 32 bf16 weights of a row as its odd elements (32 block + 2j + 1 in lane j)
// and its even ones (32 block + 2j), exactly widened; elements past the row's end read as 0.
SS_INLINE void bf16_block(const RowRef& row, int64_t block, V& odd, V& even) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(row.data) + 32 * block;
  const int64_t rest = row.length - 32 * block;
  if (rest >= 32) return vload_bf16_pairs(src, odd, even);
  alignas(64) uint16_t buffer[32] = {0};
  for (int64_t i = 0; i < rest; ++i) buffer[i] = src[i];
  vload_bf16_pairs(buffer, odd, even);
}

// 16 weights of a row from element k (k a multiple of 16), as floats; `rest` < 16 reads only
// that many (the others 0). Every format's dequantization in one place, so the direct path
// (few rows) and the scratch path (many rows) compute the same values. bf16: k counts in the
// dot-product order (bf16_length elements, see kBFloat16): chunk 2b is block b's odd
// elements, chunk 2b + 1 its even ones (`rest` is always 16 there).
template <int64_t FORMAT>
SS_INLINE V weight_chunk(const RowRef& row, int64_t k, int rest, int64_t group_shift) {
  if constexpr (FORMAT == kFloat32) {
    const float* src = reinterpret_cast<const float*>(row.data) + k;
    return rest == 16 ? vload(src) : vload_n(src, rest);
  } else if constexpr (FORMAT == kBFloat16) {
    V odd, even;
    bf16_block(row, k >> 5, odd, even);
    return (k >> 4) & 1 ? even : odd;
  } else if constexpr (FORMAT == kInt8) {
    const int8_t* src = reinterpret_cast<const int8_t*>(row.data) + k;
    const V scale = vset1(row.scale[group_shift < 0 ? 0 : k >> group_shift]);
    if (rest == 16) return vmul(vload_i8(src), scale);
    alignas(64) int8_t buffer[16] = {0};
    for (int i = 0; i < rest; ++i) buffer[i] = src[i];
    return vmul(vload_i8(buffer), scale);
  } else {  // kQ4_1, K a multiple of 32: elements k..k+15 are one half of block k / 32
    const int64_t block = k >> 5;
    const V q = vload_q4_half(reinterpret_cast<const uint8_t*>(row.data) + block * 16, (k >> 4) & 1);
    // (q * d) + m, as GGUF's reference dequantization computes it (two roundings); one fused
    // multiply-add gives the same bits, q * d being exact (see vdequant_q4 in vec_avx2.h).
    return vfma(q, vset1(row.scale[block]), vset1(row.minimum[block]));
  }
}

// 32 weights of a row from element k (k a multiple of 32, all 32 present): the two chunks
// weight_chunk gives, with a Q4_1 block's bytes, scale and minimum read once for both.
template <int64_t FORMAT>
SS_INLINE void weight_pair(const RowRef& row, int64_t k, int64_t group_shift, V& lo, V& hi) {
  if constexpr (FORMAT == kQ4_1) {
    const int64_t block = k >> 5;
    vdequant_q4(reinterpret_cast<const uint8_t*>(row.data) + block * 16, row.scale[block],
                row.minimum[block], lo, hi);
  } else if constexpr (FORMAT == kBFloat16) {
    bf16_block(row, k >> 5, lo, hi);
  } else {
    lo = weight_chunk<FORMAT>(row, k, 16, group_shift);
    hi = weight_chunk<FORMAT>(row, k + 16, 16, group_shift);
  }
}

SS_INLINE const char* row_start(const LinearParams& p, int64_t n) {
  if (p.rows) n = p.rows[n];
  return static_cast<const char*>(p.w) + n * row_bytes(p);
}

// out[r][c] = sum over k of x_rows[r][k] * w(c, k), in the fixed order described above, where
// the weights come from `load(c, k, rest)`. Prefetches `next[c]` (the next tile's rows,
// `next_bytes` each) along the way, so memory streams while this tile computes.
template <int R, int C, typename Load, typename LoadPair>
SS_INLINE void dot_tile(const float* const* x_rows, Load load, LoadPair load_pair, int64_t K,
                        const char* const* next, int64_t from, int64_t to,
                        float (*out)[C]) {
  V acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  const int64_t full = K / 16, steps = (K + 15) / 16;
  // Cache lines [from, to) of each next row, a few per step.
  const int64_t lines_per_step = (to - from + 64 * steps - 1) / (64 * steps);
  int64_t line = from;
  auto prefetch = [&](int64_t count) __attribute__((always_inline)) {
    for (int64_t j = 0; j < count && line < to; ++j, line += 64) {
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) _mm_prefetch(next[c] + line, SS_WEIGHT_PREFETCH);
    }
  };
  // Chunk k of every row into its accumulators: lane k % 16, chunks in ascending k.
  auto accumulate = [&](int64_t k, int rest, const V* w) __attribute__((always_inline)) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V x = rest == 16 ? vload(x_rows[r] + k) : vload_n(x_rows[r] + k, rest);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(x, w[c], acc[r][c]);
    }
  };
  int64_t chunk = 0;
  for (; chunk + 2 <= full; chunk += 2) {  // two chunks at a time: a Q4_1 block per column
    prefetch(2 * lines_per_step);
    V lo[C], hi[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) load_pair(c, 16 * chunk, lo[c], hi[c]);
    accumulate(16 * chunk, 16, lo);
    accumulate(16 * chunk + 16, 16, hi);
  }
  for (; chunk < steps; ++chunk) {
    prefetch(lines_per_step);
    const int rest = chunk < full ? 16 : static_cast<int>(K - 16 * full);
    V w[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) w[c] = load(c, 16 * chunk, rest);
    accumulate(16 * chunk, rest, w);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) out[r][c] = vhsum(acc[r][c]);
}

// dot_tile for `rows` (1..R) rows, chosen at run time, compiled for each count.
template <int R, int C, typename Load, typename LoadPair>
SS_INLINE void dot_rows(int rows, const float* const* x_rows, Load load, LoadPair load_pair,
                        int64_t K, const char* const* next, int64_t from, int64_t to,
                        float (*out)[C]) {
  if (rows == R) {
    dot_tile<R, C>(x_rows, load, load_pair, K, next, from, to, out);
  } else if constexpr (R > 1) {
    dot_rows<R - 1, C>(rows, x_rows, load, load_pair, K, next, from, to, out);
  }
}

// Columns [n_begin, n_end) of y, every row, in register tiles of R rows x C columns.
// `scratch`: linear_scratch_floats(p) floats.
//
// `direct`: the tiles read the stored weights directly (dequantizing as they go); otherwise each
// tile of weight rows is dequantized once into `scratch` and read from there by every tile of
// rows. Both give the same floats, and each output element is summed in the same order whatever
// the tile shape, so a row's result is the same every way.
template <int64_t FORMAT, int R, int C>
static void linear_columns_tiled(const LinearParams& p, int64_t n_begin, int64_t n_end,
                                 float* scratch, bool direct) {
  // K: elements of an x row as the tiles read it (bf16: in dot-product order, padded to 32).
  const int64_t K = FORMAT == kBFloat16 ? bf16_length(p.K) : p.K, M = p.M, N = p.N;
  const int64_t stride = ((K + 15) / 16) * 16 + 16;
  const int64_t bytes = row_bytes(p);
  const int64_t shift = p.group_shift;
  for (int64_t n = n_begin; n < n_end; n += C) {
    // Fewer columns than a tile only at the end of the range: spare slots repeat the last one.
    const int columns = static_cast<int>(min64(C, n_end - n));
    int64_t rows_of[C];
    RowRef refs[C];
    const char* next[C];
    for (int c = 0; c < C; ++c) {
      rows_of[c] = n + (c < columns ? c : columns - 1);
      refs[c] = row_ref(p, rows_of[c]);
      // Eight tiles ahead: at one row a tile computes in ~0.1 us, less than memory latency;
      // two tiles ahead measured 2x slower on a stream of MLP layers (AVX-512 EPYC, 1 thread).
      next[c] = row_start(p, min64(rows_of[c] + 8 * C, N - 1));
    }
    const float* dense[C];
    if (!direct) {
      for (int c = 0; c < C; ++c) {
        float* dst = scratch + c * stride;
        dense[c] = dst;
        if (c >= columns) continue;
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {  // whole blocks: a Q4_1 or bf16 block read once
          V lo, hi;
          weight_pair<FORMAT>(refs[c], k, shift, lo, hi);
          vstore(dst + k, lo);
          vstore(dst + k + 16, hi);
        }
        for (; k < K; k += 16) {
          vstore(dst + k, weight_chunk<FORMAT>(refs[c], k, k + 16 <= K ? 16 : static_cast<int>(K - k), shift));
        }
      }
      for (int c = columns; c < C; ++c) dense[c] = dense[columns - 1];
    }
    auto from_store = [&](int c, int64_t k, int rest) __attribute__((always_inline)) { return weight_chunk<FORMAT>(refs[c], k, rest, shift); };
    auto pair_from_store = [&](int c, int64_t k, V& lo, V& hi) __attribute__((always_inline)) {
      weight_pair<FORMAT>(refs[c], k, shift, lo, hi);
    };
    auto pair_from_scratch = [&](int c, int64_t k, V& lo, V& hi) __attribute__((always_inline)) {
      lo = vload(dense[c] + k);
      hi = vload(dense[c] + k + 16);
    };
    auto from_scratch = [&](int c, int64_t k, int rest) __attribute__((always_inline)) {
      return rest == 16 ? vload(dense[c] + k) : vload_n(dense[c] + k, rest);
    };
    // Each tile of rows prefetches its share of the next weight rows' bytes.
    const int64_t row_tiles = (M + R - 1) / R;
    for (int64_t m = 0; m < M; m += R) {
      const int rows = static_cast<int>(min64(R, M - m));
      const int64_t tile = m / R;
      const int64_t from = bytes * tile / row_tiles, to = bytes * (tile + 1) / row_tiles;
      const float* x_rows[R];
      for (int r = 0; r < R; ++r) x_rows[r] = p.x + (m + (r < rows ? r : rows - 1)) * K;
      float out[R][C];
      if (direct) {
        dot_rows<R, C>(rows, x_rows, from_store, pair_from_store, K, next, from, to, out);
      } else {
        dot_rows<R, C>(rows, x_rows, from_scratch, pair_from_scratch, K, next, from, to, out);
      }
      for (int r = 0; r < rows; ++r) {
        float* y = p.y + (m + r) * N + n;
        for (int c = 0; c < columns; ++c) y[c] = p.bias ? out[r][c] + p.bias[n + c] : out[r][c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The *_A8 formats: activations quantized to int8 per block of 32, integer dot products per
// block (llama.cpp's arithmetic for Q4_1 x Q8_1 and Q8_0 x Q8_0, in our own fixed order).
//
// Row m's block b: d = max|x| / 127, codes c = round(x * (1 / d)) (ties to even; d = 0: all 0).
// The weights are interleaved by 16 output columns (weights.py): one lane per output column.
// With weight codes q, block scale s (and Q4_1's minimum mn), I_b the exact integer sum of q * c
// over the block and S_b = d_b * sum(c over block b), blocks ascending:
//   y = fma(float(I_b), s_b * d_b, y)    and, for Q4_1:   y = fma(mn_b, S_b, y)
// Integers are exact and every float step is lane-wise and fixed by the row's and the column's
// own values, so a row's result never depends on the other rows of the call (row invariance),
// and both ISA paths give the same bits.

// Rows [begin, end) of x quantized into p.xq / scales / sums / corr (const there: the
// dispatcher owns the buffers and hands them in writable).
void quantize_rows(const LinearParams& p, int8_t* xq, float* scales, float* sums, int32_t* corr,
                   int64_t begin, int64_t end) {
  const int64_t K = p.K, blocks = K / 32;
  for (int64_t m = begin; m < end; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* x = p.x + m * K + 32 * b;
      int8_t* q = xq + m * K + 32 * b;
      const V lo = vload(x), hi = vload(x + 16);
      const float d = vhmax(vmax(vabs(lo), vabs(hi))) / 127.0f;
      const V inverse = vset1(d != 0.0f ? 1.0f / d : 0.0f);
      const V code_lo = vround(vmul(lo, inverse)), code_hi = vround(vmul(hi, inverse));
      vstore_i8(q, code_lo);
      vstore_i8(q + 16, code_hi);
      // Integers below 2^24: the float sum is exact in any order.
      const float total = vhsum(vadd(code_lo, code_hi));
      scales[m * blocks + b] = d;
      sums[m * blocks + b] = d * total;
      corr[m * blocks + b] = -128 * static_cast<int32_t>(total);
    }
  }
}

// The *_A24 formats: row m's block b as integers X = round(x / d), d = 2^(e - 22) for the
// block's largest magnitude in [2^(e - 1), 2^e): x / d is exact (a power of two) and |X| <= 2^22,
// so an element keeps its bits down to d / 2 (the block's largest keeps 23 of fp32's 24). Blocks
// whose largest magnitude is below 2^-105 (or zero) read as zero. X is cut into three signed
// digits X = (X2 * 256 + X1) * 256 + X0, X0 and X1 in [-128, 127], X2 in [-64, 64], one int8
// plane each: three integer dot products per block, each summed exactly, combined as
//   I = fma(float(I2 * 256 + I1), 256, float(I0))
// (I2 * 256 + I1 is an exact int32) and then added as an *_A8 block sum (add_block). All float
// steps here are exact but that one rounding and S = d * the same combination of digit sums.
void quantize_rows_a24(const LinearParams& p, int8_t* xq, float* scales, float* sums,
                       int32_t* corr, int64_t begin, int64_t end) {
  const int64_t K = p.K, blocks = K / 32, plane = p.M * K, corr_plane = p.M * blocks;
  const V radix = vset1(256.0f), half = vset1(0.5f), step = vset1(1.0f / 256.0f);
  // Balanced digit: v - 256 * floor(v / 256 + 1/2) in [-128, 127], and the carry; exact.
  auto digit = [&](V v, V& carry) __attribute__((always_inline)) {
    carry = vfloor(vadd(vmul(v, step), half));
    return vsub(v, vmul(carry, radix));
  };
  for (int64_t m = begin; m < end; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t row_block = m * blocks + b;
      const float* x = p.x + m * K + 32 * b;
      const V lo = vload(x), hi = vload(x + 16);
      const float top = vhmax(vmax(vabs(lo), vabs(hi)));
      int exponent = 0;
      std::frexp(top, &exponent);  // top in [2^(exponent - 1), 2^exponent)
      const bool live = top > 0.0f && exponent >= -104;
      const float d = live ? std::ldexp(1.0f, exponent - 22) : 0.0f;
      const V inverse = vset1(live ? std::ldexp(1.0f, 22 - exponent) : 0.0f);
      const V halves[2] = {vround(vmul(lo, inverse)), vround(vmul(hi, inverse))};
      float digit_sums[3] = {0.0f, 0.0f, 0.0f};
      for (int h = 0; h < 2; ++h) {
        V carry, x2;
        const V x0 = digit(halves[h], carry);
        const V x1 = digit(carry, x2);
        const V digits[3] = {x0, x1, x2};
        for (int j = 0; j < 3; ++j) {
          vstore_i8(xq + j * plane + m * K + 32 * b + 16 * h, digits[j]);
          digit_sums[j] += vhsum(digits[j]);  // small integers: exact
        }
      }
      for (int j = 0; j < 3; ++j) {
        corr[j * corr_plane + row_block] = -128 * static_cast<int32_t>(digit_sums[j]);
      }
      scales[row_block] = d;
      sums[row_block] = d * std::fma(digit_sums[2] * 256.0f + digit_sums[1], 256.0f, digit_sums[0]);
    }
  }
}

// A *_A24 block's three exact digit sums (high, middle, low) as one float (see above).
SS_INLINE V combine_digits(Q high, Q middle, Q low) {
  return vfma(qfloat(qadd(qshl8(high), middle)), vset1(256.0f), qfloat(low));
}

// One block's contribution to 16 columns of a row: `sum` the exact integer sums (as floats), `s`
// and `mn` the columns' block scales and minimums, `d` and `S` the row's block scale and d * code
// sum. Every path of the integer-activation formats (VNNI, AVX2, AMX) ends a block here.
template <int64_t FORMAT>
SS_INLINE V add_block(V acc, V sum, V s, V mn, float d, float S) {
  acc = vfma(sum, vmul(s, vset1(d)), acc);
  if constexpr (stored_format(FORMAT) == kQ4_1) acc = vfma(mn, vset1(S), acc);
  return acc;
}

// Bytes of one interleaved group's block: 32 codes of 16 columns.
template <int64_t FORMAT>
constexpr int64_t kGroupBlockBytes = stored_format(FORMAT) == kQ4_1 ? 256 : 512;

// Block b's scales `s` and (Q4_1) minimums `mn` of the 16 columns from n0 (a padded column reads
// 0). The tables are grouped like the codes ([ceil(N / 16), rows, 16], params.h): a group's
// blocks read one line after another, one stream per table, prefetched 4 blocks ahead (read
// [rows, N] instead, a block's line lay N floats past the last one's: at one row, ~40 % of the
// Q4_1 kernel's perf samples sat on those loads, AMX Xeon).
template <int64_t FORMAT>
SS_INLINE void block_scales(const LinearParams& p, int64_t b, int64_t n0, V& s, V& mn) {
  constexpr bool q4 = stored_format(FORMAT) == kQ4_1;
  const int64_t rows = q4 ? p.K / 32 : scale_rows(p);
  const int64_t row = q4 ? b : (p.group_shift < 0 ? 0 : (32 * b) >> p.group_shift);
  const int64_t at = ((n0 / 16) * rows + row) * 16;
  const float* scale = p.scale + at;
  _mm_prefetch(reinterpret_cast<const char*>(scale + 64), SS_WEIGHT_PREFETCH);
  s = vload(scale);
  mn = vzero();
  if constexpr (q4) {
    const float* minimum = p.minimum + at;
    _mm_prefetch(reinterpret_cast<const char*>(minimum + 64), SS_WEIGHT_PREFETCH);
    mn = vload(minimum);
  }
}

// Rows [m, m + rows) of the 16 columns from n0 (the first `columns` of them real) into y, with
// the bias.
SS_INLINE void store_group_rows(const LinearParams& p, int64_t m, int rows, int64_t n0,
                                int columns, const V* out) {
  for (int r = 0; r < rows; ++r) {
    alignas(64) float lanes[16];
    vstore(lanes, out[r]);
    float* y = p.y + (m + r) * p.N + n0;
    for (int c = 0; c < columns; ++c) y[c] = p.bias ? lanes[c] + p.bias[n0 + c] : lanes[c];
  }
}

// A block's exact integer sums for one row: the 8 runs of codes times the row's activation codes
// at `x` (32 bytes), from `start` (the AVX-512 int8 offset's correction, else 0). Two chains
// (elements 0-15, 16-31), added at the end: exact integers. Q4_1 codes: each ISA's own
// qblock_q4 (same integers).
template <bool Q4>
SS_INLINE Q block_dot(const Q* codes, const int8_t* x, int32_t start) {
  if constexpr (Q4) return qblock_q4(codes, x);
  Q low = qinit_i8(start), high = qzero();
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    int32_t x_lo, x_hi;
    __builtin_memcpy(&x_lo, x + 4 * t, 4);
    __builtin_memcpy(&x_hi, x + 16 + 4 * t, 4);
    low = qdot_bcast_i8(low, codes[t], x_lo);
    high = qdot_bcast_i8(high, codes[4 + t], x_hi);
  }
  return qadd(low, high);
}

// Rows m.. (R of them) of the 16 columns of interleaved group g, into out[r].
template <int R, int64_t FORMAT>
SS_INLINE void group_tile(const LinearParams& p, int64_t m, int64_t g, V* out) {
  constexpr int64_t bytes = kGroupBlockBytes<FORMAT>;
  constexpr bool q4 = stored_format(FORMAT) == kQ4_1;
  const int64_t blocks = p.K / 32, n0 = 16 * g;
  const int64_t plane = p.M * p.K, corr_plane = p.M * blocks;  // *_A24's digit planes
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + g * blocks * bytes;
  V acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    // codes[t]: elements 4t..4t+3 of the block for t < 4, 16+4(t-4).. for t >= 4, 16 columns.
    Q codes[8];
    if constexpr (q4) {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) qnibbles(w + b * bytes + 64 * t, codes[t], codes[4 + t]);
    } else {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) codes[t] = qcodes_i8(w + b * bytes + 64 * t);
    }
    // Four groups ahead, on their way.
    const uint8_t* ahead = w + (4 * blocks + b) * bytes;
#pragma GCC unroll 8
    for (int64_t line = 0; line < bytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), SS_WEIGHT_PREFETCH);
    }
    V s, mn;
    block_scales<FORMAT>(p, b, n0, s, mn);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t row_block = (m + r) * blocks + b;
      const int8_t* x = p.xq + row_block * 32;
      V sum;
      if constexpr (activation_planes(FORMAT) == 1) {
        sum = qfloat(block_dot<q4>(codes, x, p.x_corr[row_block]));
      } else {
        const Q low = block_dot<q4>(codes, x, p.x_corr[row_block]);
        const Q middle = block_dot<q4>(codes, x + plane, p.x_corr[corr_plane + row_block]);
        const Q high = block_dot<q4>(codes, x + 2 * plane, p.x_corr[2 * corr_plane + row_block]);
        sum = combine_digits(high, middle, low);
      }
      acc[r] = add_block<FORMAT>(acc[r], sum, s, mn, p.x_scales[row_block], p.x_sums[row_block]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int R, int64_t FORMAT>
SS_INLINE void group_rows(int rows, const LinearParams& p, int64_t m, int64_t g, V* out) {
  if (rows == R) {
    group_tile<R, FORMAT>(p, m, g, out);
  } else if constexpr (R > 1) {
    group_rows<R - 1, FORMAT>(rows, p, m, g, out);
  }
}

// The integer-activation formats' columns [n_begin, n_end), n_begin a multiple of 16: whole
// groups, every row.
template <int64_t FORMAT>
static void linear_groups_int(const LinearParams& p, int64_t n_begin, int64_t n_end) {
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int columns = static_cast<int>(min64(16, n_end - n0));
    for (int64_t m = 0; m < p.M; m += kQGroupRows) {
      const int rows = static_cast<int>(min64(kQGroupRows, p.M - m));
      V out[kQGroupRows];
      group_rows<kQGroupRows, FORMAT>(rows, p, m, n0 / 16, out);
      store_group_rows(p, m, rows, n0, columns, out);
    }
  }
}

// Up to kTileRows rows: one direct tile of rows. Up to kTallRows: one direct tall tile (the
// weights dequantized once, in registers, for every row). More: dequantized once into scratch.
// Dense fp32 always reads directly (nothing to dequantize), up to kTallRows rows one column at
// a time: a single weight row streamed per tile, which the memory system serves faster than
// four side by side (SmolLM2-135M's layers, AMD EPYC Zen 4, 1 thread: 1-8 rows 0.66-0.81x the
// time of 4-column tiles on the AVX-512 path, 1-6 rows 0.73-0.83x on the AVX2 one; the formats
// that dequantize gain nothing or lose).
template <int64_t FORMAT>
static void linear_columns_as(const LinearParams& p, int64_t n_begin, int64_t n_end, float* scratch) {
  if (FORMAT == kFloat32 && p.M <= kTallRows) {
    linear_columns_tiled<FORMAT, kTallRows, 1>(p, n_begin, n_end, scratch, true);
  } else if (p.M > kTileRows && p.M <= kTallRows && FORMAT != kFloat32) {
    linear_columns_tiled<FORMAT, kTallRows, kTallCols>(p, n_begin, n_end, scratch, true);
  } else {
    const bool direct = p.M <= kTileRows || FORMAT == kFloat32;
    linear_columns_tiled<FORMAT, kTileRows, kTileCols>(p, n_begin, n_end, scratch, direct);
  }
}

void linear_columns(const LinearParams& p, int64_t n_begin, int64_t n_end, float* scratch) {
  switch (p.format) {
    case kQ4_1_A8: linear_groups_int<kQ4_1_A8>(p, n_begin, n_end); return;
    case kInt8_A8: linear_groups_int<kInt8_A8>(p, n_begin, n_end); return;
    case kQ4_1_A24: linear_groups_int<kQ4_1_A24>(p, n_begin, n_end); return;
    case kInt8_A24: linear_groups_int<kInt8_A24>(p, n_begin, n_end); return;
    case kFloat32: linear_columns_as<kFloat32>(p, n_begin, n_end, scratch); break;
    case kBFloat16: linear_columns_as<kBFloat16>(p, n_begin, n_end, scratch); break;
    case kInt8: linear_columns_as<kInt8>(p, n_begin, n_end, scratch); break;
    default: linear_columns_as<kQ4_1>(p, n_begin, n_end, scratch); break;
  }
}

// ---------------------------------------------------------------------------------------------
// Attention: out[b, s, h] = softmax(q . k^T * scale + mask) . v over the allowed keys

template <bool BF16>
SS_INLINE V load_kv(const void* base, int64_t offset) {
  if constexpr (BF16) return vload_bf16(static_cast<const uint16_t*>(base) + offset);
  else return vload(static_cast<const float*>(base) + offset);
}

template <bool BF16>
SS_INLINE V load_kv_n(const void* base, int64_t offset, int n) {
  if constexpr (BF16) {
    alignas(64) uint16_t buffer[16] = {0};
    const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
    for (int i = 0; i < n; ++i) buffer[i] = src[i];
    return vload_bf16(buffer);
  } else {
    return vload_n(static_cast<const float*>(base) + offset, n);
  }
}

// Lane partial sums of a query row times a key row over D (lane d % 16); vhsum finishes it.
template <bool BF16>
SS_INLINE V query_key(const float* q, const void* k, int64_t k_offset, int64_t D) {
  V acc = vzero();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc = vfma(vload(q + d), load_kv<BF16>(k, k_offset + d), acc);
  if (d < D) {
    const int rest = static_cast<int>(D - d);
    acc = vfma(vload_n(q + d, rest), load_kv_n<BF16>(k, k_offset + d, rest), acc);
  }
  return acc;
}

// Scores of 16 keys for one query head: acc[u] = query_key(q, k, offset of keys[u]), the same
// fused multiply-adds in the same order per key, but the 16 keys' chains interleaved (a loop over
// D per key left each chain waiting on the last).
template <bool BF16>
SS_INLINE void query_keys16(const float* q, const void* k, int64_t kv_base, const int32_t* keys,
                            int64_t D, V* acc) {
  int64_t offsets[16];
  for (int u = 0; u < 16; ++u) {
    acc[u] = vzero();
    offsets[u] = kv_base + static_cast<int64_t>(keys[u]) * D;
  }
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const V query = vload(q + d);
    for (int u = 0; u < 16; ++u) acc[u] = vfma(query, load_kv<BF16>(k, offsets[u] + d), acc[u]);
  }
  if (d < D) {
    const int rest = static_cast<int>(D - d);
    const V query = vload_n(q + d, rest);
    for (int u = 0; u < 16; ++u) acc[u] = vfma(query, load_kv_n<BF16>(k, offsets[u] + d, rest), acc[u]);
  }
}

// out_j[0:D] = sum over allowed keys i (in order) of p_j[i] * v[key i] for the G heads j of one
// key/value head, one fused multiply-add per key, head and lane: each value row is read once for
// all G heads, and head j's sums are exactly what it would get alone. CHUNKS vectors of 16 lanes
// per head held in registers; p_j = p + j * p_stride, out_j = out + j * D.
template <bool BF16, int CHUNKS, int G>
SS_INLINE void weighted_values(const float* p, int64_t p_stride, const int32_t* keys,
                               int64_t count, const void* v, int64_t v_base, int64_t D,
                               float* out) {
  V acc[G][CHUNKS];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < CHUNKS; ++c) acc[j][c] = vzero();
  const int64_t full = D / 16;
  const int rest = static_cast<int>(D - full * 16);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = v_base + static_cast<int64_t>(keys[i]) * D;
    V value[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) {
      value[c] = c < full ? load_kv<BF16>(v, row + 16 * c) : load_kv_n<BF16>(v, row + 16 * c, rest);
    }
    for (int j = 0; j < G; ++j) {
      const V weight = vset1(p[j * p_stride + i]);
      for (int c = 0; c < CHUNKS; ++c) acc[j][c] = vfma(weight, value[c], acc[j][c]);
    }
  }
  for (int j = 0; j < G; ++j) {
    for (int c = 0; c < CHUNKS; ++c) {
      alignas(64) float buffer[16];
      vstore(buffer, acc[j][c]);
      const int lanes = c < full ? 16 : rest;
      for (int l = 0; l < lanes; ++l) out[j * D + 16 * c + l] = buffer[l];
    }
  }
}

template <bool BF16, int G>
SS_INLINE void weighted_values_heads(const float* p, int64_t p_stride, const int32_t* keys,
                                     int64_t count, const void* v, int64_t v_base, int64_t D,
                                     float* out) {
  switch ((D + 15) / 16) {
    case 1: weighted_values<BF16, 1, G>(p, p_stride, keys, count, v, v_base, D, out); break;
    case 2: weighted_values<BF16, 2, G>(p, p_stride, keys, count, v, v_base, D, out); break;
    case 3: weighted_values<BF16, 3, G>(p, p_stride, keys, count, v, v_base, D, out); break;
    case 4: weighted_values<BF16, 4, G>(p, p_stride, keys, count, v, v_base, D, out); break;
    case 5: weighted_values<BF16, 5, G>(p, p_stride, keys, count, v, v_base, D, out); break;
    case 6: weighted_values<BF16, 6, G>(p, p_stride, keys, count, v, v_base, D, out); break;
    case 7: weighted_values<BF16, 7, G>(p, p_stride, keys, count, v, v_base, D, out); break;
    default: weighted_values<BF16, 8, G>(p, p_stride, keys, count, v, v_base, D, out); break;
  }
}

// The query heads sharing key/value head `kv_head` of row (b, s), attended together: the group
// shares its allowed keys, reads each block of 16 key rows once while they are in L1 for all
// its heads, and each value row once (GQA: SmolLM2 has 3 query heads per key/value head). Every
// head's scores, softmax and weighted sum are computed in the same order as for a head alone,
// so the bits are the same as attending head by head.
template <bool BF16>
static void attend_group(const AttentionParams& p, int64_t group, float* scratch) {
  const int64_t G = p.H / p.Hkv;
  const int64_t kv_head = group % p.Hkv, s = (group / p.Hkv) % p.S, b = group / (p.Hkv * p.S);
  const int64_t T = p.T, D = p.D, stride = T + 16;
  const int64_t kv_base = b * p.kv_batch_stride + kv_head * p.kv_head_stride;
  const int64_t first = (b * p.S + s) * p.H + kv_head * G;  // the group's first (b, s, h) item
  int32_t* keys = reinterpret_cast<int32_t*>(scratch);       // [allowed keys]
  float* key_mask = scratch + stride;                        // [allowed keys] their mask values
  float* scores = key_mask + stride;                         // head j: [allowed keys] at j * stride
  float* denominators = scores + G * stride;                 // [G]

  // 1. The allowed keys, in key order (the same for every head of the row).
  const float* mask = p.mask ? p.mask + (b * p.S + s) * T : nullptr;
  const int64_t end = mask ? T : T - p.S + s + 1;  // without a mask: causal over the cache
  int64_t count = 0;
  for (int64_t j = 0; j < end; ++j) {
    if (!mask || mask[j] > -1.0e30f) {
      if (mask) key_mask[count] = mask[j];
      keys[count++] = static_cast<int32_t>(j);
    }
  }
  if (count == 0) {  // nothing to attend to (a padding row): zeros, never NaN
    for (int64_t d = 0; d < G * D; ++d) p.out[first * D + d] = 0.0f;
    return;
  }
  // 2. Scores, 16 keys at a time for every head (the block's key rows stay in L1), then the
  // tail; each head's maximum.
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    for (int64_t h = 0; h < G; ++h) {
      const float* q = p.q + (first + h) * D;
      V acc[16];
      query_keys16<BF16>(q, p.k, kv_base, keys + i, D, acc);
      vhsum16(acc, scores + h * stride + i);
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const float* q = p.q + (first + h) * D;
    float* head_scores = scores + h * stride;
    for (int64_t k = i; k < count; ++k) {
      head_scores[k] = vhsum(query_key<BF16>(q, p.k, kv_base + keys[k] * D, D));
    }
    // Scaled and masked (a product, then a sum: each rounding as written), 16 at a time; the
    // maximum is exact in any order.
    const V scale_v = vset1(p.scale);
    V top_lanes = vset1(-3.0e38f);
    int64_t k = 0;
    for (; k + 16 <= count; k += 16) {
      V score = vmul(vload(head_scores + k), scale_v);
      if (mask) score = vadd(score, vload(key_mask + k));
      vstore(head_scores + k, score);
      top_lanes = vmax(score, top_lanes);  // a NaN score leaves the maximum as it was
    }
    float top = vhmax(top_lanes);
    for (; k < count; ++k) {
      float score = head_scores[k] * p.scale;
      if (mask) score = score + key_mask[k];
      head_scores[k] = score;
      top = score > top ? score : top;
    }
    // 3. Softmax weights; the denominator summed by position in the compacted list.
    const V top_v = vset1(top);
    V total = vzero();
    k = 0;
    for (; k + 16 <= count; k += 16) {
      V e = vexp_nonpositive(vsub(vload(head_scores + k), top_v));
      vstore(head_scores + k, e);
      total = vadd(total, e);
    }
    if (k < count) {
      const int rest = static_cast<int>(count - k);
      alignas(64) float buffer[16];
      V e = vexp_nonpositive(vsub(vload_n(head_scores + k, rest), top_v));
      vstore(buffer, e);
      for (int l = 0; l < rest; ++l) head_scores[k + l] = buffer[l];
      total = vadd(total, vload_n(buffer, rest));
    }
    denominators[h] = vhsum(total);
  }

  // 4. Weighted values, up to four heads per pass over the value rows; one division per lane.
  float* out = p.out + first * D;
  for (int64_t h = 0; h < G; h += 4) {
    const float* weights = scores + h * stride;
    float* head_out = out + h * D;
    switch (min64(4, G - h)) {
      case 1: weighted_values_heads<BF16, 1>(weights, stride, keys, count, p.v, kv_base, D, head_out); break;
      case 2: weighted_values_heads<BF16, 2>(weights, stride, keys, count, p.v, kv_base, D, head_out); break;
      case 3: weighted_values_heads<BF16, 3>(weights, stride, keys, count, p.v, kv_base, D, head_out); break;
      default: weighted_values_heads<BF16, 4>(weights, stride, keys, count, p.v, kv_base, D, head_out); break;
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = out[h * D + d] / denominators[h];
  }
}

// Groups [begin, end) of the flattened (b, s, kv_head) grid. `scratch`:
// attention_scratch_floats(p).
void attention_groups(const AttentionParams& p, int64_t begin, int64_t end, float* scratch) {
  for (int64_t group = begin; group < end; ++group) {
    if (p.kv_bf16) attend_group<true>(p, group, scratch);
    else attend_group<false>(p, group, scratch);
  }
}

// ---------------------------------------------------------------------------------------------
// RMS norm: out = weight * (x * r), r = 1 / sqrt(mean(x^2) + eps), per row; the sum of squares
// in lane h % 16 (h ascending), then vhsum's fixed order: a row's result depends on that row.

void rms_norm_rows(const NormParams& p, int64_t begin, int64_t end) {
  const int64_t H = p.H, full = H / 16;
  const int rest = static_cast<int>(H - 16 * full);
  for (int64_t row = begin; row < end; ++row) {
    const float* x = p.x + row * H;
    float* out = p.out + row * H;
    V acc = vzero();
    for (int64_t c = 0; c < full; ++c) {
      const V v = vload(x + 16 * c);
      acc = vfma(v, v, acc);
    }
    if (rest) {
      const V v = vload_n(x + 16 * full, rest);
      acc = vfma(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(vhsum(acc) / static_cast<float>(H) + p.eps);
    const V rv = vset1(r);
    for (int64_t c = 0; c < full; ++c) {
      vstore(out + 16 * c, vmul(vload(p.weight + 16 * c), vmul(vload(x + 16 * c), rv)));
    }
    if (rest) {
      alignas(64) float buffer[16];
      vstore(buffer, vmul(vload_n(p.weight + 16 * full, rest), vmul(vload_n(x + 16 * full, rest), rv)));
      for (int l = 0; l < rest; ++l) out[16 * full + l] = buffer[l];
    }
  }
}
