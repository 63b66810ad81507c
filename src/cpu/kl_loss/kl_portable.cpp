// The generic fused sparse KL kernels compiled for portable.
#define DSA_KL_SPARSE_KERNELS portable_sparse_kernels
#define DSA_KL_LABEL "portable"
#define DSA_KL_ROW_BLOCK 4
#include "cpu/kl_loss/kl_generic_sparse.h"
