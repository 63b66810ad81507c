// The generic fp32 score kernel compiled for avx512.
#define DSA_GENERIC_KERNEL_NAME avx512_kernel
#define DSA_GENERIC_KERNEL_LABEL "avx512"
#include "cpu/indexer/score_generic.inc"
