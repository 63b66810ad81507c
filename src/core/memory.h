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
#include <new>
#include <vector>

namespace dsa::core {

// Asks for huge pages on the 2 MiB-aligned interior of [data, data + bytes),
// memory about to be overwritten entirely. A hint: ignored where unsupported.
void advise_huge_pages(void* data, std::size_t bytes);

// An uninitialised, 64-byte-aligned scratch buffer of `bytes` bytes (none for
// 0), with the huge-page hint when it is large. Those of 64 KiB or more come
// from and go back to the workspace cache (dsa/backend.h: set_workspace_cache_limit).
// Why a class of its own: dsa's allocator throws this (never a bare
// std::bad_alloc) so that the op boundary (run_kernel) can name the request.
// It has already released the workspace cache and retried once.
class AllocationFailure : public std::bad_alloc {
 public:
  explicit AllocationFailure(std::size_t bytes) : bytes_(bytes) {}
  std::size_t bytes() const { return bytes_; }
  const char* what() const noexcept override { return "dsa: a scratch allocation failed"; }

 private:
  std::size_t bytes_;
};

// dsa's allocator for scratch and workspaces: `bytes` bytes, 64-byte aligned
// (2 MiB for large ones, with the huge-page hint). When memory cannot be had
// -- the system refuses, or the test cap (set_scratch_memory_limit) would be
// exceeded -- it frees the idle cached workspaces and tries once more, then
// throws AllocationFailure. free_scratch takes the same byte count back.
std::uint8_t* allocate_scratch(std::size_t bytes);
void free_scratch(std::uint8_t* p, std::size_t bytes);

// As allocate_scratch / free_scratch, but a buffer of 64 KiB or more is taken
// from and given back to the workspace cache (free_cached is given the same
// `bytes`): per-call scratch then stays mapped from one call to the next.
std::uint8_t* allocate_cached(std::size_t bytes);
void free_cached(std::uint8_t* p, std::size_t bytes);

// A std::allocator that goes through allocate_cached, for the kernels'
// per-thread scratch vectors: their failures then name the size too, and a
// decode step's scratch is not faulted in afresh every call.
template <class T>
struct ScratchAllocator {
  using value_type = T;
  ScratchAllocator() = default;
  template <class U>
  ScratchAllocator(const ScratchAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) throw AllocationFailure(static_cast<std::size_t>(-1));
    return reinterpret_cast<T*>(allocate_cached(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { free_cached(reinterpret_cast<std::uint8_t*>(p), n * sizeof(T)); }
  template <class U>
  bool operator==(const ScratchAllocator<U>&) const noexcept { return true; }
};
template <class T>
using ScratchVector = std::vector<T, ScratchAllocator<T>>;

// Runs an op's kernel. An allocation that fails inside it (dsa's allocator or
// any other std::bad_alloc, e.g. a plan's vectors) becomes dsa::Error of kind
// out_of_memory naming the op and, where known, the bytes requested. A bare
// std::bad_alloc first releases the workspace cache and reruns the kernel
// once: every kernel writes all of its outputs, so a rerun is a clean start.
// The process goes on; what the kernel held is freed on the way out.
void run_kernel(const char* op, void (*body)(const void*), const void* context);
template <class Body>
void run_kernel(const char* op, const Body& body) {
  run_kernel(op, [](const void* c) { (*static_cast<const Body*>(c))(); }, &body);
}

class ScratchBuffer {
 public:
  explicit ScratchBuffer(std::size_t bytes);
  ~ScratchBuffer();
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  // Never null, also for 0 bytes: callers memset / loop over `bytes` without a
  // special case, and memset on a null pointer is undefined even for 0 bytes.
  std::uint8_t* data() const { return data_ ? data_ : empty_; }

 private:
  std::uint8_t* data_ = nullptr;
  std::size_t capacity_ = 0;  // what data_ was allocated with (>= the request)
  alignas(64) static std::uint8_t empty_[64];  // what data() gives for 0 bytes
};

}  // namespace dsa::core
