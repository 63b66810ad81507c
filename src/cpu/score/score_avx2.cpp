// The register-blocked fp32 FMA score kernel compiled for avx2.
#define DSA_FMA_KERNEL_NAME avx2_kernel
#define DSA_FMA_KERNEL_LABEL "avx2"
#include "cpu/score/score_fma.h"
