// The generic fp32 score kernel compiled for avx2.
#define DSA_GENERIC_KERNEL_NAME avx2_kernel
#define DSA_GENERIC_KERNEL_LABEL "avx2"
#include "cpu/indexer/score_generic.inc"
