// The AVX-512 pooling kernels built with the AVX512-BF16 flag set that the
// _avx512bf16 suffix selects, for its conversion (one vcvtneps2bf16 per store
// instead of an integer rounding sequence).
#define DSA_POOL_NATIVE_BF16 1
#define DSA_POOL_KERNEL_FUNCTION avx512_bf16_kernel
#define DSA_POOL_KERNEL_NAME "avx512-bf16"
#include "cpu/compressor/pool_avx512.h"
