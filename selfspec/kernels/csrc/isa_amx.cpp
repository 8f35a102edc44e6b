// The integer-activation formats' linear on AMX tiles (amx-int8) for calls of several rows: per
// 16-column group and block, one tile product per activation plane (*_A8: one, *_A24: three
// digits) gives every row's exact int32 block sums (the integers the VNNI and AVX2 paths add up
// in registers), and the same float steps follow (body.h's combine_digits and add_block), so
// the bits are those of the other paths. Interleaved int8 codes are a tile as stored; Q4_1's
// nibbles are spread to bytes for a whole group before its products (a tile load right after
// the stores it reads waits for them). ops.cpp runs it where the CPU has AMX, the OS grants the
// tile state, and a call has enough rows (params.h). No torch header here: see params.h.
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "params.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
#include <immintrin.h>

namespace selfspec_kernels {
namespace amx {
#include "vec_avx512.h"
#include "body.h"

namespace {

// Tiles 0, 3, 4: C, rows x 16 int32 (a block's sums, per activation plane); tiles 1, 5, 6: A,
// rows x 32 int8 (a block of the rows' activation codes, per plane); tile 2: B, 8 x 64 bytes (a
// block of 16 columns' codes, 4 consecutive elements of each column per 64 bytes: the
// interleaved layout is the tiles' order).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure(int rows) {
  TileConfig config{};
  config.palette_id = 1;
  config.rows[0] = static_cast<uint8_t>(rows);
  config.colsb[0] = 64;
  config.rows[1] = static_cast<uint8_t>(rows);
  config.colsb[1] = 32;
  config.rows[2] = 8;
  config.colsb[2] = 64;
  for (int plane = 1; plane < 3; ++plane) {  // the *_A24 formats' other two digit planes
    config.rows[2 + plane] = static_cast<uint8_t>(rows);
    config.colsb[2 + plane] = 64;
    config.rows[4 + plane] = static_cast<uint8_t>(rows);
    config.colsb[4 + plane] = 32;
  }
  asm volatile("" : : "r"(&config) : "memory");  // the stores above happen before the load
  _tile_loadconfig(&config);
}

// A Q4_1 weight: group g's blocks with their nibbles spread to bytes, blocks x 512 bytes.
void spread_group(const LinearParams& p, int64_t g, uint8_t* spread) {
  const int64_t blocks = p.K / 32;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + g * blocks * 256;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int t = 0; t < 4; ++t) {
      Q lo, hi;
      qnibbles(w + b * 256 + 64 * t, lo, hi);
      _mm512_store_si512(spread + b * 512 + 64 * t, lo.v);
      _mm512_store_si512(spread + b * 512 + 64 * (4 + t), hi.v);
    }
  }
}

// One row's block sums from the tile stores: plane sums of 16 columns each, 64 bytes apart per
// row (sums[plane] + 16 * r).
SS_INLINE Q stored_sums(const int32_t* sums, int r) { return {_mm512_load_si512(sums + 16 * r)}; }

// Block b's tile products for rows [m, m + rows) of group g: each plane's int32 sums into its
// C tile (0, 3, 4), computed by the tile unit while the caller goes on.
template <int64_t FORMAT>
SS_INLINE void issue_block(const LinearParams& p, int64_t m, int64_t g, int64_t b,
                           const uint8_t* spread) {
  constexpr int64_t bytes = kGroupBlockBytes<FORMAT>;
  constexpr bool q4 = stored_format(FORMAT) == kQ4_1, digits = activation_planes(FORMAT) == 3;
  const int64_t K = p.K, blocks = K / 32, plane = p.M * K;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + g * blocks * bytes;
  const uint8_t* ahead = w + (4 * blocks + b) * bytes;  // four groups on
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + line), SS_WEIGHT_PREFETCH);
  }
  const int8_t* x = p.xq + m * K + 32 * b;
  _tile_zero(0);
  _tile_loadd(1, x, K);
  if constexpr (digits) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_loadd(5, x + plane, K);
    _tile_loadd(6, x + 2 * plane, K);
  }
  if constexpr (q4) {
    _tile_loadd(2, spread + b * 512, 64);
    _tile_dpbsud(0, 1, 2);  // s8 x u8
    if constexpr (digits) {
      _tile_dpbsud(3, 5, 2);
      _tile_dpbsud(4, 6, 2);
    }
  } else {
    _tile_loadd(2, w + b * bytes, 64);
    _tile_dpbssd(0, 1, 2);  // s8 x s8: the exact sums, no offset to take out
    if constexpr (digits) {
      _tile_dpbssd(3, 5, 2);
      _tile_dpbssd(4, 6, 2);
    }
  }
}

// Rows [m, m + rows) (rows <= 16, tiles configured for them) of group g's 16 columns into out;
// `spread`: a Q4_1 weight's codes as bytes (spread_group). Software-pipelined: block b + 1's
// tile products run while the float steps of block b read b's stored sums (two buffers), so
// the tile unit's latency hides behind them instead of stalling every block.
template <int64_t FORMAT>
void group_rows(const LinearParams& p, int64_t m, int rows, int64_t g, const uint8_t* spread,
                V* out) {
  constexpr bool digits = activation_planes(FORMAT) == 3;
  const int64_t blocks = p.K / 32, n0 = 16 * g;
  alignas(64) int32_t sums[2][3][16 * 16];
  for (int r = 0; r < rows; ++r) out[r] = vzero();
  issue_block<FORMAT>(p, m, g, 0, spread);
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t(*const stored)[16 * 16] = sums[b & 1];
    _tile_stored(0, stored[0], 64);
    if constexpr (digits) {
      _tile_stored(3, stored[1], 64);
      _tile_stored(4, stored[2], 64);
    }
    if (b + 1 < blocks) issue_block<FORMAT>(p, m, g, b + 1, spread);
    V s, mn;
    block_scales<FORMAT>(p, b, n0, s, mn);
    for (int r = 0; r < rows; ++r) {
      const int64_t row_block = (m + r) * blocks + b;
      const V sum = digits ? combine_digits(stored_sums(stored[2], r), stored_sums(stored[1], r),
                                            stored_sums(stored[0], r))
                           : qfloat(stored_sums(stored[0], r));
      out[r] = add_block<FORMAT>(out[r], sum, s, mn, p.x_scales[row_block], p.x_sums[row_block]);
    }
  }
}

template <int64_t FORMAT>
void linear_groups(const LinearParams& p, int64_t n_begin, int64_t n_end) {
  int configured = 0;
  constexpr bool q4 = stored_format(FORMAT) == kQ4_1;
  uint8_t* spread = q4 ? static_cast<uint8_t*>(std::aligned_alloc(64, p.K / 32 * 512)) : nullptr;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int columns = static_cast<int>(min64(16, n_end - n0));
    if constexpr (q4) spread_group(p, n0 / 16, spread);
    for (int64_t m = 0; m < p.M; m += 16) {
      const int rows = static_cast<int>(min64(16, p.M - m));
      if (rows != configured) {
        configure(rows);
        configured = rows;
      }
      V out[16];
      group_rows<FORMAT>(p, m, rows, n0 / 16, spread, out);
      store_group_rows(p, m, rows, n0, columns, out);
    }
  }
  _tile_release();
  std::free(spread);
}

}  // namespace

void linear_columns_amx(const LinearParams& p, int64_t n_begin, int64_t n_end) {
  switch (p.format) {
    case kQ4_1_A8: linear_groups<kQ4_1_A8>(p, n_begin, n_end); break;
    case kInt8_A8: linear_groups<kInt8_A8>(p, n_begin, n_end); break;
    case kQ4_1_A24: linear_groups<kQ4_1_A24>(p, n_begin, n_end); break;
    default: linear_groups<kInt8_A24>(p, n_begin, n_end); break;
  }
}

}  // namespace amx
}  // namespace selfspec_kernels
