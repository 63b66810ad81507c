// The generic fused dense-indexer KL kernels compiled for avx2.
#define DSA_KL_DENSE_KERNELS avx2_dense_kernels
#define DSA_KL_LABEL "avx2"
#define DSA_KL_ROW_BLOCK 4
#include "cpu/dense_indexer/dense_kl_generic.h"
