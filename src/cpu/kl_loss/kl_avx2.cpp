// The generic fused KL kernels compiled for avx2.
#define DSA_KL_KERNELS_NAME avx2_kernels
#define DSA_KL_KERNELS_LABEL "avx2"
#define DSA_KL_ROW_BLOCK 4
#include "cpu/kl_loss/kl_generic.inc"
