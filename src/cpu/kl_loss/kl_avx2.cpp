// The generic fused sparse KL kernels compiled for avx2.
#define DSA_KL_SPARSE_KERNELS avx2_sparse_kernels
#define DSA_KL_LABEL "avx2"
#define DSA_KL_ROW_BLOCK 4
#include "cpu/kl_loss/kl_generic_sparse.h"
