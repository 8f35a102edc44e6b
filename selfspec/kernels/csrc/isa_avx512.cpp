// The kernels compiled for AVX-512 (F, BW, VL, DQ) with FMA. No torch header here: see params.h.
#include <cmath>
#include <cstdint>

#include "params.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

namespace selfspec_kernels {
namespace avx512 {
#include "vec_avx512.h"
#include "body.h"
}  // namespace avx512
}  // namespace selfspec_kernels
