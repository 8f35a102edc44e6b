// The kernels compiled for AVX-512 (F, BW, VL, DQ) with FMA. No torch header here: see params.h.
// VNNI is enabled for the *_A8 formats' integer dot products only: ops.cpp runs those (and
// quantize_rows) on this path only where the CPU has VNNI; the other kernels are float code, in
// which the compiler has no integer dot product to turn into a VNNI instruction.
#include <cmath>
#include <cstdint>

#include "params.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

namespace selfspec_kernels {
namespace avx512 {
#include "vec_avx512.h"
#include "body.h"
}  // namespace avx512
}  // namespace selfspec_kernels
