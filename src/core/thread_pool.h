// The library's one thread pool. Tasks are claimed dynamically, so a kernel's
// results must depend only on the task index, never on the thread running it:
// that is what keeps every op bit-identical for any thread count.
#pragma once

#include <cstdint>
#include <functional>

namespace dsa::core {

// Resolves a caller's request (0 = default_num_threads()) to a thread count >= 1.
int resolve_num_threads(int requested);

// Runs body(task, thread) for every task in [0, n_tasks) on up to num_threads
// threads (the calling thread included); `thread` is in [0, num_threads) and
// indexes per-thread scratch. The first exception thrown by a task is rethrown.
void parallel_for(std::int64_t n_tasks, int num_threads,
                  const std::function<void(std::int64_t task, int thread)>& body);

}  // namespace dsa::core
