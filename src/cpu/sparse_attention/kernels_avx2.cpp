// The register-blocked fp32 FMA attention kernels compiled for avx2.
#define DSA_FMA_KERNEL_NAME avx2_kernel
#define DSA_FMA_KERNEL_LABEL "avx2"
#include "cpu/sparse_attention/kernels_fma.h"
