// The generic fp32 attention kernels compiled for portable.
#define DSA_GENERIC_KERNEL_NAME portable_kernel
#define DSA_GENERIC_KERNEL_LABEL "portable"
#include "cpu/sparse_attention/kernels_generic.h"
