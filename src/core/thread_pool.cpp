#include "core/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "dsa/runtime.h"

namespace dsa {

int default_num_threads() {
  if (const char* env = std::getenv("DSA_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

namespace core {
namespace {

thread_local bool t_inside_pool = false;

// Waiting threads spin this long before they block: a blocked thread's core
// may halt, and on a VM waking it again (an interrupt through the host) has
// been measured at ~0.15 ms, more than a short kernel runs. Spinning briefly
// lets back-to-back regions (a forward and its backward, two phases of one op)
// reuse awake workers.
constexpr auto kSpin = std::chrono::microseconds(200);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until done() or kSpin passes; true if done() became true.
template <class Done>
bool spin_until(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

class Pool;
// The process's pool. A child made by fork() has none of the parent's workers
// (fork copies only the calling thread) and may have inherited its mutexes
// locked, so a region there waited forever for workers that do not exist (a
// DataLoader worker calling an op hung). The child therefore starts a fresh
// pool; the old one is left behind, never destroyed.
std::atomic<Pool*> g_pool{nullptr};

class Pool {
 public:
  static Pool& instance() {
    static const bool fork_handler = [] {
      pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); });
      return true;
    }();
    (void)fork_handler;
    Pool* pool = g_pool.load(std::memory_order_acquire);
    if (!pool) {
      auto* fresh = new Pool();  // never destroyed: workers may outlive static teardown
      if (g_pool.compare_exchange_strong(pool, fresh)) pool = fresh;
      else delete fresh;  // another thread installed one first (it has no workers yet)
    }
    return *pool;
  }

  void run(std::int64_t n_tasks, int num_threads,
           const std::function<void(std::int64_t, int)>& body) {
    std::unique_lock<std::mutex> call_lock(call_mutex_);  // one parallel region at a time
    grow(num_threads - 1);
    {
      std::lock_guard<std::mutex> lk(mutex_);
      body_ = &body;
      n_tasks_ = n_tasks;
      next_task_.store(0);
      error_ = nullptr;
      active_workers_ = num_threads - 1;
      pending_.store(num_threads - 1);
      generation_.fetch_add(1, std::memory_order_release);  // publishes the fields above
    }
    cv_.notify_all();
    t_inside_pool = true;  // a nested parallel_for from a task runs inline
    work(0);
    t_inside_pool = false;
    if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lk(mutex_);
      done_cv_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    body_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int n_workers) {
    while (static_cast<int>(workers_.size()) < n_workers) {
      int index = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, index] { loop(index); });
      workers_.back().detach();
    }
  }

  void loop(int index) {
    t_inside_pool = true;
    std::uint64_t seen = 0;
    for (;;) {
      const auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(fresh)) {
        std::unique_lock<std::mutex> lk(mutex_);
        cv_.wait(lk, fresh);
      }
      seen = generation_.load(std::memory_order_acquire);
      if (index > active_workers_) continue;
      work(index);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        { std::lock_guard<std::mutex> lk(mutex_); }  // the waiter is blocked or sees pending_ == 0
        done_cv_.notify_one();
      }
    }
  }

  void work(int thread) {
    for (;;) {
      std::int64_t task = next_task_.fetch_add(1);
      if (task >= n_tasks_) return;
      try {
        (*body_)(task, thread);
      } catch (...) {
        std::lock_guard<std::mutex> lk(error_mutex_);
        if (!error_) error_ = std::current_exception();
        next_task_.store(n_tasks_);  // stop handing out work
      }
    }
  }

  std::mutex call_mutex_, mutex_, error_mutex_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(std::int64_t, int)>* body_ = nullptr;
  std::int64_t n_tasks_ = 0;
  std::atomic<std::int64_t> next_task_{0};
  std::exception_ptr error_;
  int active_workers_ = 0;
  std::atomic<int> pending_{0};
  std::atomic<std::uint64_t> generation_{0};
};

}  // namespace

int resolve_num_threads(int requested) {
  if (requested < 0) requested = 0;
  return requested > 0 ? requested : default_num_threads();
}

namespace {
std::atomic<ParallelRunner> g_runner{nullptr};
}  // namespace

void parallel_for(std::int64_t n_tasks, int num_threads,
                  const std::function<void(std::int64_t task, int thread)>& body) {
  if (n_tasks <= 0) return;
  if (num_threads > n_tasks) num_threads = static_cast<int>(n_tasks);
  if (num_threads <= 1 || t_inside_pool) {
    // Nested regions and single-thread calls run inline with thread index 0.
    for (std::int64_t t = 0; t < n_tasks; ++t) body(t, 0);
    return;
  }
  if (ParallelRunner runner = g_runner.load()) {
    // Tasks mark their thread as inside a region, so nested ones run inline.
    runner(n_tasks, num_threads, [&body](std::int64_t task, int thread) {
      const bool outer = t_inside_pool;
      t_inside_pool = true;
      struct Restore {
        bool value;
        ~Restore() { t_inside_pool = value; }
      } restore{outer};
      body(task, thread);
    });
    return;
  }
  Pool::instance().run(n_tasks, num_threads, body);
}

}  // namespace core

void set_parallel_runner(ParallelRunner runner) { core::g_runner.store(runner); }

}  // namespace dsa
