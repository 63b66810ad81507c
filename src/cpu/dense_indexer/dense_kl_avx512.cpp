// The generic fused dense-indexer KL kernels compiled for avx512.
#define DSA_KL_DENSE_KERNELS avx512_dense_kernels
#define DSA_KL_LABEL "avx512"
#define DSA_KL_ROW_BLOCK 8
#include "cpu/dense_indexer/dense_kl_generic.h"
