// The generic fp32 attention kernels compiled for avx2.
#define DSA_GENERIC_KERNEL_NAME avx2_kernel
#define DSA_GENERIC_KERNEL_LABEL "avx2"
#include "cpu/sparse_attention/kernels_generic.inc"
