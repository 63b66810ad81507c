// Large buffers and first-touch cost.
//
// A fresh allocation of many MiB is mapped lazily: its first touch takes a page
// fault per 4 KiB page, and on the VMs this project runs on that costs more
// than the kernels that then fill the memory (~17 ms per 32 MiB measured, vs
// ~1.3 ms to write it once mapped). Where the system leaves transparent huge
// pages to madvise, asking for them cuts the faults 512-fold.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsa::core {

// Asks for huge pages on the 2 MiB-aligned interior of [data, data + bytes),
// memory about to be overwritten entirely. A hint: ignored where unsupported.
void advise_huge_pages(void* data, std::size_t bytes);

// An uninitialised, 64-byte-aligned scratch buffer of `bytes` bytes (none for
// 0), with the huge-page hint when it is large. Large ones come from and go
// back to the workspace cache (dsa/backend.h: set_workspace_cache_limit).
class ScratchBuffer {
 public:
  explicit ScratchBuffer(std::size_t bytes);
  ~ScratchBuffer();
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  std::uint8_t* data() const { return data_; }

 private:
  std::uint8_t* data_ = nullptr;
  std::size_t capacity_ = 0;  // what data_ was allocated with (>= the request)
};

}  // namespace dsa::core
