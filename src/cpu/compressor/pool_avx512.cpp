// AVX-512 pooling kernels (bf16 rounding done with integer ops).
#include "cpu/compressor/pool_avx512.inc"
