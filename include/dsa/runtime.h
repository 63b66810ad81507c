// What the fused kernels run on: threads, the parallel runner that hosts
// their parallel regions, and dsa's scratch memory (the workspace cache and
// the scratch limit). Backends are in dsa/backend.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace dsa {

// Threads used by fused kernels when a call passes num_threads = 0:
// DSA_NUM_THREADS if set, else the cores this process may run on.
int default_num_threads();

// Where the fused CPU kernels run their parallel regions: by default dsa's own
// thread pool. An embedding layer with a thread team of its own may install a
// runner for it (the Python package uses PyTorch's OpenMP team, so dsa's
// regions do not compete with OpenMP threads still spinning after a torch
// op). A runner must call body(task, thread) exactly once for every task in
// [0, n_tasks), with `thread` in [0, num_threads) (it indexes per-thread
// scratch; results never depend on it), and rethrow the first exception a
// task throws. nullptr restores dsa's own pool.
using ParallelRunner = void (*)(std::int64_t n_tasks, int num_threads,
                                const std::function<void(std::int64_t task, int thread)>& body);
void set_parallel_runner(ParallelRunner runner);

// Large scratch buffers of the fused CPU kernels (e.g. the attention backward's
// packed query and grad_out, about twice their size) are kept when a call
// ends, so the next call reuses mapped memory instead of page-faulting fresh
// memory in (a kernel-zeroed page per first touch: ~0.1 s per GiB here). At
// most `bytes` of idle buffers are kept (default: DSA_WORKSPACE_CACHE_MIB, else
// an eighth of the physical memory); 0 turns the cache off. Lowering the limit frees
// idle buffers over it. Buffers in use are never counted or freed.
void set_workspace_cache_limit(std::size_t bytes);
std::size_t workspace_cache_limit();
// Bytes of idle buffers the cache holds now.
std::size_t workspace_cache_bytes();
// Frees every idle cached buffer.
void release_workspace_cache();

// When a kernel's scratch or workspace cannot be allocated, dsa frees the idle
// cached buffers and tries once more; if that fails too the call throws
// dsa::Error of kind out_of_memory naming the op and the bytes, and the process
// goes on. For testing that path: caps the bytes dsa's own allocator (kernel
// scratch and workspaces, cached ones included) may hold from the system at
// once, as a memory limit would; a request over it fails as if the system had
// refused it. 0 (the default) removes the cap.
void set_scratch_memory_limit(std::size_t bytes);
std::size_t scratch_memory_limit();
// Bytes dsa's allocator holds from the system now (in use and cached).
std::size_t scratch_memory_bytes();

}  // namespace dsa
