// AVX-512 pooling kernels (bf16 rounding done with integer ops): the kernels of
// pool_simd.h over the AVX-512 layer of pool_avx512.h.
#include "cpu/compressor/pool_avx512.h"
