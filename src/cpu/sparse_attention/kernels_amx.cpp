// AMX-BF16 attention kernels (bf16 inputs). Placeholder until the tile kernels land.
#include "cpu/sparse_attention/attention_kernels.h"

namespace dsa::cpu::attention_kernels {

const AttentionKernel& amx_kernel() { return avx512_kernel(); }

}  // namespace dsa::cpu::attention_kernels
