// The generic fused KL kernels compiled for avx512.
#define DSA_KL_KERNELS_NAME avx512_kernels
#define DSA_KL_KERNELS_LABEL "avx512"
#define DSA_KL_ROW_BLOCK 8
#include "cpu/kl_loss/kl_generic.inc"
