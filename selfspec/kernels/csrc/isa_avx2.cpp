// The kernels compiled for AVX2 with FMA. No torch header here: see params.h.
#include <cmath>
#include <cstdint>

#include "params.h"

#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace selfspec_kernels {
namespace avx2 {
#include "vec_avx2.h"
#include "body.h"
}  // namespace avx2
}  // namespace selfspec_kernels
