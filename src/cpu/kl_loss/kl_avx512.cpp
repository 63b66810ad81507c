// The generic fused sparse KL kernels compiled for avx512.
#define DSA_KL_SPARSE_KERNELS avx512_sparse_kernels
#define DSA_KL_LABEL "avx512"
#define DSA_KL_ROW_BLOCK 8
#include "cpu/kl_loss/kl_generic_sparse.h"
