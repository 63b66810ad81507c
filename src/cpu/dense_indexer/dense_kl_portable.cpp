// The generic fused dense-indexer KL kernels compiled for portable.
#define DSA_KL_DENSE_KERNELS portable_dense_kernels
#define DSA_KL_LABEL "portable"
#define DSA_KL_ROW_BLOCK 4
#include "cpu/dense_indexer/dense_kl_generic.h"
