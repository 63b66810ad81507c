// The fp32 FMA attention kernels compiled for AVX-512-BF16, whose forward
// computes the logits on vdpbf16ps (bf16 inputs only; see DSA_FMA_BF16_SCORES
// in kernels_fma.h). The bf16 forward of AVX-512-BF16 CPUs without AMX.
#define DSA_FMA_BF16_SCORES 1
#define DSA_FMA_KERNEL_NAME avx512_bf16_forward_kernel
#define DSA_FMA_KERNEL_LABEL "avx512_bf16"
#include "cpu/sparse_attention/kernels_fma.h"
