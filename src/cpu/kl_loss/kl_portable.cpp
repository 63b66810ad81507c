// The generic fused KL kernels compiled for portable.
#define DSA_KL_KERNELS_NAME portable_kernels
#define DSA_KL_KERNELS_LABEL "portable"
#define DSA_KL_ROW_BLOCK 4
#include "cpu/kl_loss/kl_generic.inc"
