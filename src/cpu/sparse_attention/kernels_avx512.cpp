// The generic fp32 attention kernels compiled for avx512.
#define DSA_GENERIC_KERNEL_NAME avx512_kernel
#define DSA_GENERIC_KERNEL_LABEL "avx512"
#include "cpu/sparse_attention/kernels_generic.inc"
