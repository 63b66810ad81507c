// The register-blocked fp32 FMA score kernel compiled for avx512.
#define DSA_FMA_KERNEL_NAME avx512_kernel
#define DSA_FMA_KERNEL_LABEL "avx512"
#include "cpu/score/score_fma.h"
