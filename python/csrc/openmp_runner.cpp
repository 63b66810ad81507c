// Runs dsa's parallel regions on PyTorch's OpenMP thread team.
//
// PyTorch's CPU ops run on an OpenMP team whose threads keep spinning for a
// while after each op. dsa's own pool would then compete with them for the
// same cores: on a 2-vCPU machine a compressor call right after a torch op
// was measured ~40% slower. When the process has an OpenMP runtime loaded
// (torch's bundled libgomp), regions go through its GOMP_parallel entry point
// instead -- what a `#pragma omp parallel` compiled against that runtime
// does -- so they reuse the awake team. The runtime is found among the
// loaded libraries, not linked: the extension must not bring a second one.
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

#include "tensor_view.h"

namespace dsa::python {
namespace {

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
using OmpThreadNum = int (*)();

GompParallel g_parallel = nullptr;
// Set in a child made by fork(): the OpenMP runtime's team exists only in the
// parent (libgomp then hangs in the child's first parallel region; torch's own
// ops hang there too), so the child runs dsa's regions on dsa's pool.
std::atomic<bool> g_forked{false};
OmpThreadNum g_thread_num = nullptr;
std::string g_runtime;

struct Region {
  const std::function<void(std::int64_t, int)>* body;
  std::int64_t n_tasks;
  int num_threads;
  std::atomic<std::int64_t> next{0};
  std::mutex error_mutex;
  std::exception_ptr error;
};

// Every team thread claims tasks until none is left (the same dynamic
// claiming as dsa's pool, so results depend only on task indices).
void run_region(void* data) {
  auto* r = static_cast<Region*>(data);
  const int thread = g_thread_num();
  if (thread >= r->num_threads) return;  // a larger team than asked for: not expected, but safe
  for (;;) {
    const std::int64_t task = r->next.fetch_add(1);
    if (task >= r->n_tasks) return;
    try {
      (*r->body)(task, thread);
    } catch (...) {
      std::lock_guard<std::mutex> lk(r->error_mutex);
      if (!r->error) r->error = std::current_exception();
      r->next.store(r->n_tasks);
    }
  }
}

void openmp_runner(std::int64_t n_tasks, int num_threads, const std::function<void(std::int64_t, int)>& body) {
  Region r;
  r.body = &body;
  r.n_tasks = n_tasks;
  r.num_threads = num_threads;
  g_parallel(run_region, &r, static_cast<unsigned>(num_threads), 0);
  if (r.error) std::rethrow_exception(r.error);
}

int find_runtime(dl_phdr_info* info, size_t, void*) {
  const char* name = info->dlpi_name;
  if (!name || (!std::strstr(name, "libgomp") && !std::strstr(name, "libiomp"))) return 0;
  void* handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD);  // already loaded: only a handle
  if (!handle) return 0;
  auto parallel = reinterpret_cast<GompParallel>(dlsym(handle, "GOMP_parallel"));
  auto thread_num = reinterpret_cast<OmpThreadNum>(dlsym(handle, "omp_get_thread_num"));
  if (!parallel || !thread_num) return 0;
  g_parallel = parallel;
  g_thread_num = thread_num;
  g_runtime = name;
  return 1;  // stop at the first runtime found
}

}  // namespace

void register_openmp_runner(nb::module_& m) {
  // Returns the runtime's path, or "" when none is loaded (dsa keeps its pool).
  m.def("use_openmp_threads", [](bool enable) -> std::string {
    if (!enable || g_forked.load()) {
      set_parallel_runner(nullptr);
      return "";
    }
    static const bool fork_handler = [] {
      pthread_atfork(nullptr, nullptr, [] {
        g_forked.store(true);
        set_parallel_runner(nullptr);
      });
      return true;
    }();
    (void)fork_handler;
    if (!g_parallel) dl_iterate_phdr(find_runtime, nullptr);
    set_parallel_runner(g_parallel ? openmp_runner : nullptr);
    return g_runtime;
  });
}

}  // namespace dsa::python
