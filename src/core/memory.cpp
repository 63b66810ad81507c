#include "core/memory.h"

#include <pthread.h>

#include <atomic>
#include <cstring>
#include <cstdlib>
#include <iomanip>
#include <mutex>
#include <new>
#include <sstream>
#include <vector>

#include "core/validate.h"
#include "dsa/runtime.h"
#include "dsa/error.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
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

namespace {

// Buffers below this size come from plain new[] and go straight back. Larger
// ones go through the cache: a kernel's per-thread scratch of a few hundred
// KiB freed to the C library was unmapped or trimmed and faulted in again by
// the next call, depending on malloc's adaptive thresholds (a decode attention
// call at H = 16: ~320 page faults and 0.7 -> 1.5-2.5 ms in some processes, Zen 4 VM).
constexpr std::size_t kCacheMin = std::size_t{64} << 10;

// allocate_cached's buffers start with this header: the capacity of the
// buffer as allocated or taken from the cache (up to twice the request), which
// free_cached, told only the request, needs to give it back. Kept in the buffer
// rather than in a table so that a fork child, which starts a fresh cache,
// still frees its parent's buffers at their size.
constexpr std::size_t kHeader = 64;
std::size_t alignment_for(std::size_t bytes) { return bytes >= 2 * kHugePage ? kHugePage : 64; }

// What dsa's allocator holds from the system (in use and cached), and the
// test cap on it (0: none). Counted only to enforce the cap.
std::atomic<std::size_t> live_bytes{0};
std::atomic<std::size_t> memory_cap{0};

// One attempt: null when the cap would be exceeded or the system refuses.
std::uint8_t* try_allocate(std::size_t bytes) {
  std::size_t live = live_bytes.load();
  const std::size_t cap = memory_cap.load();
  do {
    if (cap && (bytes > cap || live > cap - bytes)) return nullptr;
  } while (!live_bytes.compare_exchange_weak(live, live + bytes));
  auto* p = static_cast<std::uint8_t*>(
      ::operator new[](bytes, std::align_val_t(alignment_for(bytes)), std::nothrow));
  if (!p) {
    live_bytes -= bytes;
    return nullptr;
  }
  advise_huge_pages(p, bytes);
  return p;
}

// DSA_WORKSPACE_CACHE_MIB, else an eighth of the physical memory (2 GiB where
// that is unknown): enough for the attention backward's packed operands at
// H=128, T=4096 (2.2 GiB) on a 24 GB machine, and only ever what calls used.
std::size_t initial_limit() {
  if (const char* env = std::getenv("DSA_WORKSPACE_CACHE_MIB")) {
    char* end = nullptr;
    const long long mib = std::strtoll(env, &end, 10);
    if (end != env && mib >= 0) return static_cast<std::size_t>(mib) << 20;
  }
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 8;
#endif
  return std::size_t{2} << 30;
}

// Idle buffers, oldest first. Taking one picks the smallest that fits and is
// at most twice the request: a small call must not hold a large buffer that a
// large call running beside it would then allocate a second time.
class WorkspaceCache;
// The process's cache. A child made by fork() may inherit its mutex locked by a
// parent thread that does not exist there (an op running beside the fork), and
// then hangs in its first call: the child starts a fresh cache with the same
// limit; the old one (idle copy-on-write pages) is left behind.
std::atomic<WorkspaceCache*> g_cache{nullptr};
void start_fresh_cache_in_fork_child();

class WorkspaceCache {
 public:
  explicit WorkspaceCache(std::size_t limit) : limit_(limit) {}

  static WorkspaceCache& instance() {
    static const bool fork_handler = [] {
      pthread_atfork(nullptr, nullptr, start_fresh_cache_in_fork_child);
      return true;
    }();
    (void)fork_handler;
    WorkspaceCache* cache = g_cache.load(std::memory_order_acquire);
    if (!cache) {
      auto* fresh = new WorkspaceCache(initial_limit());  // never destroyed: used until exit
      if (g_cache.compare_exchange_strong(cache, fresh)) cache = fresh;
      else delete fresh;
    }
    return *cache;
  }

  // Only where no other thread can run: in a fork child.
  std::size_t limit_unlocked() const { return limit_; }

  // A cached buffer of at least `bytes` and at most `most` bytes (its
  // capacity in *capacity), or null.
  std::uint8_t* take(std::size_t bytes, std::size_t most, std::size_t* capacity) {
    std::lock_guard<std::mutex> lk(mutex_);
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it)
      if (it->bytes >= bytes && it->bytes <= most && (best == idle_.end() || it->bytes < best->bytes))
        best = it;
    if (best == idle_.end()) return nullptr;
    std::uint8_t* p = best->data;
    *capacity = best->bytes;
    held_ -= best->bytes;
    idle_.erase(best);
    return p;
  }

  // A buffer over the limit goes in as the oldest idle one, so it is the
  // first (and only) one the trim frees.
  void give(std::uint8_t* p, std::size_t bytes) {
    update([&] {
      if (bytes > limit_) idle_.insert(idle_.begin(), {p, bytes});
      else idle_.push_back({p, bytes});
      held_ += bytes;
      return limit_;
    });
  }

  void set_limit(std::size_t bytes) {
    update([&] { return limit_ = bytes; });
  }

  void release() {
    update([] { return std::size_t{0}; });
  }

  std::size_t limit() {
    std::lock_guard<std::mutex> lk(mutex_);
    return limit_;
  }
  std::size_t held() {
    std::lock_guard<std::mutex> lk(mutex_);
    return held_;
  }

 private:
  struct Block {
    std::uint8_t* data;
    std::size_t bytes;
  };

  // Applies `change` under the lock; it returns how many idle bytes may stay.
  // The oldest idle buffers over that are freed after the lock is released.
  template <class Change>
  void update(Change change) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      const std::size_t keep = change();
      while (held_ > keep && !idle_.empty()) {
        evicted.push_back(idle_.front());
        held_ -= idle_.front().bytes;
        idle_.erase(idle_.begin());
      }
    }
    for (const Block& b : evicted) free_scratch(b.data, b.bytes);
  }

  std::mutex mutex_;
  std::vector<Block> idle_;
  std::size_t held_ = 0;
  std::size_t limit_;
};

void start_fresh_cache_in_fork_child() {
  // The child has one thread: nothing can race these loads and stores.
  if (WorkspaceCache* old = g_cache.load()) g_cache.store(new WorkspaceCache(old->limit_unlocked()));
}

}  // namespace

std::uint8_t* allocate_scratch(std::size_t bytes) {
  if (std::uint8_t* p = try_allocate(bytes)) return p;
  // The idle cached workspaces are the memory this call most likely needs:
  // give them back before calling it a failure.
  WorkspaceCache::instance().release();
  if (std::uint8_t* p = try_allocate(bytes)) return p;
  throw AllocationFailure(bytes);
}

void free_scratch(std::uint8_t* p, std::size_t bytes) {
  if (!p) return;
  ::operator delete[](p, std::align_val_t(alignment_for(bytes)));
  live_bytes -= bytes;
}

void run_kernel(const char* op, void (*body)(const void*), const void* context) {
  for (int attempt = 0;; ++attempt) {
    try {
      body(context);
      return;
    } catch (const AllocationFailure& e) {
      // allocate_scratch released the cache and retried already; what the
      // kernel held went back to the cache as it unwound: give that up too,
      // the process is short of memory.
      WorkspaceCache::instance().release();
      std::ostringstream mib;
      mib << std::fixed << std::setprecision(1) << static_cast<double>(e.bytes()) / (1 << 20);
      throw Error(ErrorKind::out_of_memory,
                  concat(op, ": out of memory: could not allocate ", e.bytes(), " bytes (", mib.str(),
                         " MiB) of kernel scratch, even after releasing dsa's workspace cache"));
    } catch (const std::bad_alloc&) {
      // Not from dsa's allocator (a plan or index vector): the cache may hold
      // what it needed, so release it and rerun once.
      WorkspaceCache::instance().release();
      if (attempt == 0) continue;
      throw Error(ErrorKind::out_of_memory,
                  concat(op, ": out of memory: an allocation of the kernel failed (size not known "
                             "here), even after releasing dsa's workspace cache and rerunning"));
    }
  }
}

namespace {

// The one way into and out of the workspace cache, for allocate_cached and
// ScratchBuffer alike: a buffer of kCacheMin or more is taken from the cache
// (up to twice the request) or allocated; `capacity` is what it holds, which
// give_back needs.
std::uint8_t* take_or_allocate(std::size_t bytes, std::size_t* capacity) {
  *capacity = bytes;
  std::uint8_t* p = bytes >= kCacheMin ? WorkspaceCache::instance().take(bytes, 2 * bytes, capacity) : nullptr;
  return p ? p : allocate_scratch(bytes);  // *capacity is still `bytes`: take() sets it only on success
}

void give_back(std::uint8_t* p, std::size_t capacity) {
  if (capacity >= kCacheMin) WorkspaceCache::instance().give(p, capacity);
  else free_scratch(p, capacity);
}

}  // namespace

std::uint8_t* allocate_cached(std::size_t bytes) {
  if (bytes < kCacheMin) return allocate_scratch(bytes);
  std::size_t capacity;
  std::uint8_t* p = take_or_allocate(bytes + kHeader, &capacity);
  std::memcpy(p, &capacity, sizeof capacity);
  return p + kHeader;
}

void free_cached(std::uint8_t* p, std::size_t bytes) {
  if (!p) return;
  if (bytes < kCacheMin) return free_scratch(p, bytes);
  std::uint8_t* base = p - kHeader;
  std::size_t capacity;
  std::memcpy(&capacity, base, sizeof capacity);
  give_back(base, capacity);
}

alignas(64) std::uint8_t ScratchBuffer::empty_[64];

ScratchBuffer::ScratchBuffer(std::size_t bytes) {
  if (bytes) data_ = take_or_allocate(bytes, &capacity_);
}

ScratchBuffer::~ScratchBuffer() {
  if (data_) give_back(data_, capacity_);
}

}  // namespace dsa::core

namespace dsa {

void set_workspace_cache_limit(std::size_t bytes) { core::WorkspaceCache::instance().set_limit(bytes); }
std::size_t workspace_cache_limit() { return core::WorkspaceCache::instance().limit(); }
std::size_t workspace_cache_bytes() { return core::WorkspaceCache::instance().held(); }
void release_workspace_cache() { core::WorkspaceCache::instance().release(); }
void set_scratch_memory_limit(std::size_t bytes) { core::memory_cap = bytes; }
std::size_t scratch_memory_limit() { return core::memory_cap.load(); }
std::size_t scratch_memory_bytes() { return core::live_bytes.load(); }

}  // namespace dsa
