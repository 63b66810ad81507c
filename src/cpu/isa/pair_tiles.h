// The row of a bf16 pair operand: 64 bytes, one AMX tile row or one zmm of
// vdpbf16ps, so every pair kernel (AMX or AVX-512-BF16) takes dims in chunks of
// 32 bf16. Plain constants: includable from any file.
#pragma once

#include <cstdint>

namespace dsa::cpu::kl_kernels {

inline constexpr std::int64_t kPairChunk = 32;  // bf16 elements per 64-byte tile row

}  // namespace dsa::cpu::kl_kernels
