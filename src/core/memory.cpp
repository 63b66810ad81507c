#include "core/memory.h"

#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dsa::core {

namespace {
constexpr std::uintptr_t kHugePage = std::uintptr_t{2} << 20;
}  // namespace

void advise_huge_pages(void* data, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (!data || bytes < 2 * kHugePage) return;
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // a hint: errors ignored
#else
  (void)data;
  (void)bytes;
#endif
}

ScratchBuffer::ScratchBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  // Large buffers start on a huge-page boundary, so all of them can be huge pages.
  const std::size_t align = bytes >= 2 * kHugePage ? kHugePage : 64;
  data_ = static_cast<std::uint8_t*>(::operator new[](bytes, std::align_val_t(align)));
  advise_huge_pages(data_, bytes);
}

ScratchBuffer::~ScratchBuffer() {
  if (data_) ::operator delete[](data_, std::align_val_t(bytes_ >= 2 * kHugePage ? kHugePage : 64));
}

}  // namespace dsa::core
