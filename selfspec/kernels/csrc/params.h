// Plain-data descriptions of one kernel call, shared by the dispatcher (which includes torch) and
// the ISA files (which must not: they are compiled for one instruction set each, and an inline
// function from a shared header compiled for AVX-512 could be picked by the linker for an AVX2
// machine).
#pragma once
#include <cstdint>

// The vector helpers and tile loops must inline: on AVX2 a 16-lane vector is a pair of
// registers, which a real call would pass through memory.
#define SS_INLINE static inline __attribute__((always_inline))

// Where the kernels prefetch the weight stream: into the core's L2 (_MM_HINT_T1), not L1. A
// prefetch into L1 holds one of its few fill buffers until the line arrives from a shared L3 or
// memory, so a stream ahead in L1 keeps few lines on their way; into L2 many (AMX Xeon, 1
// thread, the other core training, two alternated runs: the int24 body's 1-token forward
// 10.7-10.9 -> 9.2-9.5 ms, the Q8_0 output layer at one row 3.1-3.4 -> 2.5-2.6 ms; with no
// prefetch at all 11.7-12.0 ms).
#define SS_WEIGHT_PREFETCH _MM_HINT_T1

namespace selfspec_kernels {

// How a linear layer's weight [N, K] is stored.
enum WeightFormat : int64_t {
  kFloat32 = 0,   // w: float [N, K]
  kBFloat16 = 1,  // w: uint16 (bf16 bits) [N, K]; summed in AVX-512 BF16's dot-product order:
                  //    lane j takes elements 32b + 2j + 1, then 32b + 2j, of each block b of 32
                  //    (fused multiply-adds, denormals flushed as that instruction does), so
                  //    vdpbf16ps gives the bits of two fmas where the CPU has it. x arrives in
                  //    that order: per block its 16 odd elements, then its 16 even ones, zeros
                  //    to bf16_length(K) (bf16_order in ops.cpp)
  kInt8 = 2,      // w: int8 [N, K]; scale: float [N, K / group]; value = q * scale
  kQ4_1 = 3,      // w: uint8 [N, K / 32, 16] (GGUF Q4_1 nibbles: byte j = element j | element j+16
                  //    << 4); scale, min: float [N, K / 32]; value = (q * scale) + min
  // The same weights with activations quantized to int8 per block of 32 at run time (W4A8 /
  // W8A8, llama.cpp's arithmetic): integer dot products per block, see body.h. K % 32 == 0.
  kQ4_1_A8 = 4,   // kQ4_1's bytes interleaved by 16 columns: w uint8 [ceil(N / 16), K / 32, 4, 64]
                  //    (per group and block, run t: bytes 4t..4t+3 of columns 0-15); scale, min:
                  //    float [ceil(N / 16), K / 32, 16], grouped like the codes (group g's 16
                  //    columns' values per block; the last group's padded columns 0)
  kInt8_A8 = 5,   // kInt8's codes interleaved by 16 columns: w int8 [ceil(N / 16), K / 32, 8, 64]
                  //    (per group and block, run t: elements 4t..4t+3 of columns 0-15); scale:
                  //    float [ceil(N / 16), scale_rows, 16] grouped the same way (scale_rows =
                  //    K / group, group a multiple of 32; or K: one row)
  // The same interleaved weights with each block of 32 activations as integers of 23 bits under
  // a power-of-two scale, cut into three int8 digits (body.h): three integer dot products per
  // block, summed exactly; float32-grade activations (the exact mode's arithmetic on AMX).
  kQ4_1_A24 = 6,  // kQ4_1_A8's weight and tables
  kInt8_A24 = 7,  // kInt8_A8's weight and tables
};

// How a format's weight is stored (the integer-activation formats: interleaved, see above).
static constexpr int64_t stored_format(int64_t format) {
  return (format == kQ4_1_A8 || format == kQ4_1_A24)  ? kQ4_1
         : (format == kInt8_A8 || format == kInt8_A24) ? kInt8
                                                        : format;
}
// Whether activations are quantized per block of 32 at run time (*_A8, *_A24).
static constexpr bool integer_activations(int64_t format) { return format >= kQ4_1_A8 && format <= kInt8_A24; }
// int8 planes of a quantized activation block: 1 (*_A8) or 3 digits (*_A24).
static constexpr int activation_planes(int64_t format) { return format >= kQ4_1_A24 ? 3 : 1; }

// From this many rows the integer-activation formats run on AMX tiles where the CPU has them
// (ops.cpp, isa_amx.cpp): Int8_A8 from 8, Q4_1_A8 (whose nibbles are spread to bytes first) from
// 12; the *_A24 formats, with three products per block, from kAmxMinRowsA24.
constexpr int64_t kAmxMinRows = 8;
constexpr int64_t kAmxMinRowsQ4 = 12;
constexpr int64_t kAmxMinRowsA24 = 8;
SS_INLINE int64_t amx_min_rows(int64_t format) {
  return activation_planes(format) == 3 ? kAmxMinRowsA24 : format == kQ4_1_A8 ? kAmxMinRowsQ4 : kAmxMinRows;
}

// An x row's length as the bf16 kernels read it: K rounded up to whole blocks of 32.
SS_INLINE int64_t bf16_length(int64_t K) { return (K + 31) / 32 * 32; }

struct LinearParams {
  const float* x;        // [M, K] fp32 activations (kBFloat16: [M, bf16_length(K)], reordered)
  const void* w;         // the weight, laid out as `format` says
  const float* scale;    // [N, K / group] (int8, q4_1; interleaved: grouped, see above) or null
  const float* minimum;  // [N, K / 32] (q4_1; interleaved: grouped) or null
  const float* bias;     // [N] or null
  float* y;              // [M, N] output
  int64_t M, N, K;
  int64_t format;
  int64_t group;         // elements per scale along K (int8: K for per-channel, or e.g. 32)
  int64_t group_shift;   // log2(group), or -1 when one scale covers the row (group >= K)
  const int64_t* rows;   // [N] the weight row output column n reads, or null (row n)
  // The integer-activation formats: x quantized per block of 32 (quantize_rows /
  // quantize_rows_a24, before the columns run); P = activation_planes(format).
  const int8_t* xq;       // [P, M, K] codes (*_A24: digit planes X0, X1, X2)
  const float* x_scales;  // [M, K / 32] each block's scale d
  const float* x_sums;    // [M, K / 32] d * the sum of the block's codes (the integers X)
  const int32_t* x_corr;  // [P, M, K / 32] -128 * the sum of each plane's codes (AVX-512 int8)
  // kBFloat16 where every row of x is bf16-valued and the CPU has AVX-512 BF16: x as bf16 bits
  // in its own order (isa_avx512bf16.cpp), or null.
  const uint16_t* x_bf16;  // [M, bf16_length(K)]
};

// Scales per weight row: 1 (one per row), or one per `group` elements (the last maybe shorter;
// group a power of two: a shift, not a division, in the kernels' block loops).
SS_INLINE int64_t scale_rows(const LinearParams& p) {
  return p.group_shift < 0 ? 1 : (p.K + p.group - 1) >> p.group_shift;
}

struct AttentionParams {
  const float* q;        // [B, S, H, D] fp32, rotated
  const void* k;         // [B, Hkv, T, D] fp32 or bf16 (kv_bf16); rows of D contiguous
  const void* v;         // [B, Hkv, T, D], the same strides as k
  const float* mask;     // [B, S, T] additive fp32 (<= -1e30: masked out), or null (causal)
  float* out;            // [B, S, H, D]
  int64_t B, S, H, Hkv, T, D;
  int64_t kv_batch_stride, kv_head_stride;  // elements between batch rows / heads of k and v
  float scale;
  bool kv_bf16;
};

struct NormParams {
  const float* x;       // [rows, H] fp32
  const float* weight;  // [H] fp32
  float* out;           // [rows, H]
  int64_t rows, H;
  float eps;
};

// Scratch a call needs per thread, in floats.
// (4 columns of a row as the tiles read it, rounded up to 32 for bf16, and 16 to spare.)
inline int64_t linear_scratch_floats(const LinearParams& p) { return 4 * (bf16_length(p.K) + 16); }
// Attention: the allowed keys' indices, then their mask values, then every head of a group's
// scores, then its denominators.
inline int64_t attention_scratch_floats(const AttentionParams& p) {
  return (2 + p.H / p.Hkv) * (p.T + 16) + p.H / p.Hkv + 16;
}

}  // namespace selfspec_kernels
