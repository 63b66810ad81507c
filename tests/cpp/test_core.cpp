// Core services: the thread pool, backend resolution, contiguous views, the
// workspace cache, allocation failure.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/sequences.h"
#include "core/thread_pool.h"
#include "dsa/backend.h"
#include "dsa/runtime.h"
#include "dsa/error.h"
#include "dsa/indexer.h"
#include "dsa/tensor.h"

namespace {

using dsa::Backend;
using dsa::Device;
using dsa::Error;
using dsa::ErrorKind;

TEST(ThreadPool, EveryTaskRunsExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    for (std::int64_t n : {1, 2, 7, 100, 1000}) {
      std::vector<std::atomic<int>> runs(n);
      std::atomic<int> bad_thread{0};
      dsa::core::parallel_for(n, threads, [&](std::int64_t task, int thread) {
        runs[task].fetch_add(1);
        if (thread < 0 || thread >= threads) bad_thread.fetch_add(1);
      });
      for (std::int64_t t = 0; t < n; ++t) EXPECT_EQ(runs[t].load(), 1) << "threads " << threads << " n " << n << " task " << t;
      EXPECT_EQ(bad_thread.load(), 0);
    }
  }
}

TEST(ThreadPool, NoTasksNoCalls) {
  int calls = 0;
  dsa::core::parallel_for(0, 4, [&](std::int64_t, int) { ++calls; });
  dsa::core::parallel_for(-3, 4, [&](std::int64_t, int) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ThreadPool, ExceptionPropagatesAndPoolStaysUsable) {
  for (int threads : {1, 2, 4}) {
    try {
      dsa::core::parallel_for(64, threads, [&](std::int64_t task, int) {
        if (task == 5) throw Error(ErrorKind::internal, "task five failed");
      });
      ADD_FAILURE() << "no exception with " << threads << " threads";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::internal);
      EXPECT_NE(std::string(e.what()).find("task five"), std::string::npos);
    }
    // The pool must still run a full region after a failed one.
    std::atomic<std::int64_t> sum{0};
    dsa::core::parallel_for(100, threads, [&](std::int64_t task, int) { sum.fetch_add(task); });
    EXPECT_EQ(sum.load(), 99 * 100 / 2);
  }
}

TEST(ThreadPool, NestedRegionRunsInline) {
  std::vector<std::atomic<int>> runs(4 * 8);
  dsa::core::parallel_for(4, 2, [&](std::int64_t outer, int) {
    dsa::core::parallel_for(8, 2, [&](std::int64_t inner, int thread) {
      EXPECT_EQ(thread, 0);  // inline: the nested region never uses another worker slot
      runs[outer * 8 + inner].fetch_add(1);
    });
  });
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
}

TEST(ThreadPool, ResolveNumThreads) {
  EXPECT_EQ(dsa::core::resolve_num_threads(3), 3);
  EXPECT_EQ(dsa::core::resolve_num_threads(0), dsa::default_num_threads());
  EXPECT_EQ(dsa::core::resolve_num_threads(-2), dsa::default_num_threads());
  EXPECT_GE(dsa::default_num_threads(), 1);
}

TEST(Backends, ResolveAutoAndExplicit) {
  EXPECT_EQ(dsa::resolve_backend(Backend::automatic, Device::cpu), Backend::cpu);
  EXPECT_EQ(dsa::resolve_backend(Backend::cpu, Device::cpu), Backend::cpu);
  EXPECT_EQ(dsa::resolve_backend(Backend::reference, Device::cpu), Backend::reference);
}

void expect_unsupported_naming(Backend b, Device d, const std::string& word) {
  try {
    dsa::resolve_backend(b, d);
    ADD_FAILURE() << "no error for backend " << dsa::backend_name(b);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::unsupported);
    EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
  }
}

TEST(Backends, NeverFallsBack) {
  expect_unsupported_naming(Backend::cuda, Device::cpu, "cuda");
  expect_unsupported_naming(Backend::automatic, Device::cuda, "cuda");  // auto on CUDA tensors -> cuda, not built
  expect_unsupported_naming(Backend::cpu, Device::cuda, "cpu");
  expect_unsupported_naming(Backend::reference, Device::cuda, "reference");
}

TEST(Backends, ParseNames) {
  EXPECT_EQ(dsa::parse_backend("auto"), Backend::automatic);
  EXPECT_EQ(dsa::parse_backend("reference"), Backend::reference);
  EXPECT_EQ(dsa::parse_backend("cpu"), Backend::cpu);
  EXPECT_EQ(dsa::parse_backend("cuda"), Backend::cuda);
  for (Backend b : {Backend::automatic, Backend::reference, Backend::cpu, Backend::cuda})
    EXPECT_EQ(dsa::parse_backend(dsa::backend_name(b)), b);
  try {
    dsa::parse_backend("gpu");
    ADD_FAILURE() << "unknown backend accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("backend"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("gpu"), std::string::npos);
  }
}

TEST(Backends, ReportProvesBuiltOnesRun) {
  const auto infos = dsa::backends();
  ASSERT_EQ(infos.size(), 3u);
  for (const auto& info : infos) {
    if (info.name == "cuda") {
      EXPECT_FALSE(info.built);
      EXPECT_FALSE(info.works);
    } else {
      EXPECT_TRUE(info.built) << info.name;
      EXPECT_TRUE(info.works) << info.name << ": " << info.detail;
    }
  }
  const std::string isa = dsa::cpu_isa_name();
  EXPECT_TRUE(isa == "amx" || isa == "avx512_bf16" || isa == "avx512" || isa == "avx2" || isa == "portable") << isa;
}

TEST(TensorViews, MakeViewIsContiguousAndChecksItsShape) {
  float data[24];
  const std::vector<std::int64_t> shape{2, 3, 4};
  for (const dsa::TensorView& v : {dsa::make_view(data, dsa::DType::f32, shape),
                                   dsa::make_view(data, dsa::DType::f32, {2, 3, 4})}) {
    EXPECT_EQ(v.ndim, 3);
    EXPECT_EQ(v.stride(0), 12);
    EXPECT_EQ(v.stride(1), 4);
    EXPECT_EQ(v.stride(2), 1);
    EXPECT_EQ(v.numel(), 24);
    EXPECT_TRUE(v.is_contiguous());
  }
  const std::vector<std::int64_t> too_many(dsa::kMaxDims + 1, 1);
  for (const auto& bad : {too_many, std::vector<std::int64_t>{2, -1}}) {
    try {
      dsa::make_view(data, dsa::DType::f32, bad);
      ADD_FAILURE() << "accepted a bad shape";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("shape"), std::string::npos) << e.what();
    }
  }
}

// Hand-made views that no tensor can be: more dims than a view holds, a
// negative size, more elements than int64 counts, or strides whose offsets
// overflow int64 (the kernels compute index * stride, which would wrap).
// Every op rejects them with invalid_argument naming the argument; shown
// here on the indexer, whose query passes the same check as any view.
TEST(TensorViews, ViewsNoTensorCanBeAreRejected) {
  std::vector<float> q(4 * 2 * 8, 0.5f), k(6 * 8, 0.5f), w(4 * 2, 1.0f);
  std::vector<std::int32_t> indices(4 * 3);
  const dsa::TensorView good = dsa::make_view(q.data(), dsa::DType::f32, {4, 2, 8});
  std::vector<dsa::TensorView> bad(4, good);
  bad[0].ndim = dsa::kMaxDims + 1;
  bad[1].shape[1] = -2;
  bad[2].shape[0] = std::int64_t{1} << 40;  // 2^40 * 2^40 * 8 elements, with zero strides: no extent at all
  bad[2].shape[1] = std::int64_t{1} << 40;
  bad[2].strides[0] = bad[2].strides[1] = 0;
  bad[3].strides[0] = std::int64_t{1} << 62;  // row 2 sits at 2^63 elements
  dsa::IndexerParams params;
  params.topk = 3;
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    dsa::indexer_topk(good, dsa::make_view(k.data(), dsa::DType::f32, {6, 8}),
                      dsa::make_view(w.data(), dsa::DType::f32, {4, 2}), params,
                      dsa::make_view(indices.data(), dsa::DType::i32, {4, 3}), dsa::TensorView{}, backend);
    for (std::size_t i = 0; i < bad.size(); ++i) {
      try {
        dsa::indexer_topk(bad[i], dsa::make_view(k.data(), dsa::DType::f32, {6, 8}),
                          dsa::make_view(w.data(), dsa::DType::f32, {4, 2}), params,
                          dsa::make_view(indices.data(), dsa::DType::i32, {4, 3}), dsa::TensorView{}, backend);
        ADD_FAILURE() << "accepted bad view " << i;
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
        EXPECT_NE(std::string(e.what()).find("index_query"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(WorkspaceCache, ReusesIdleBuffersWithinItsLimit) {
  const std::size_t old_limit = dsa::workspace_cache_limit();
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  dsa::release_workspace_cache();
  dsa::set_workspace_cache_limit(64 * kMiB);
  std::uint8_t* first = nullptr;
  {
    dsa::core::ScratchBuffer a(16 * kMiB);
    first = a.data();
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % 64, 0u);
    a.data()[16 * kMiB - 1] = 1;  // the whole request is usable
    EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);  // in use: not counted
  }
  EXPECT_EQ(dsa::workspace_cache_bytes(), 16 * kMiB);
  {
    dsa::core::ScratchBuffer small(6 * kMiB);  // under half the idle one: a buffer of its own
    EXPECT_NE(small.data(), first);
    EXPECT_EQ(dsa::workspace_cache_bytes(), 16 * kMiB);
  }
  dsa::release_workspace_cache();  // frees both idle buffers: a fresh 16 MiB one is the idle one below
  {
    dsa::core::ScratchBuffer again(16 * kMiB);
    first = again.data();
  }
  {
    dsa::core::ScratchBuffer b(12 * kMiB);  // fits in the idle one: reused
    EXPECT_EQ(b.data(), first);
    dsa::core::ScratchBuffer c(12 * kMiB);  // the idle one is taken: a new one
    EXPECT_NE(c.data(), first);
    EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
  }
  EXPECT_EQ(dsa::workspace_cache_bytes(), 16 * kMiB + 12 * kMiB);
  { dsa::core::ScratchBuffer big(80 * kMiB); }  // over the limit: freed, not kept
  EXPECT_EQ(dsa::workspace_cache_bytes(), 16 * kMiB + 12 * kMiB);
  // c went back first (destroyed before b), so it is the oldest idle buffer and goes first.
  dsa::set_workspace_cache_limit(20 * kMiB);
  EXPECT_EQ(dsa::workspace_cache_bytes(), 16 * kMiB);
  dsa::release_workspace_cache();
  EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
  dsa::set_workspace_cache_limit(0);
  { dsa::core::ScratchBuffer off(8 * kMiB); }
  EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
  { dsa::core::ScratchBuffer small(1024); }  // small buffers never go through the cache
  EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
  dsa::set_workspace_cache_limit(old_limit);
}

// The kernels' per-thread scratch vectors (ScratchVector) go through the cache
// from 64 KiB: a decode call's scratch stays mapped for the next call instead of
// being unmapped and faulted in again.
TEST(WorkspaceCache, ScratchVectorsAreReusedFromTheCache) {
  const std::size_t old_limit = dsa::workspace_cache_limit();
  constexpr std::size_t kKiB = std::size_t{1} << 10;
  dsa::release_workspace_cache();
  dsa::set_workspace_cache_limit(std::size_t{64} << 20);
  const float* first = nullptr;
  {
    dsa::core::ScratchVector<float> v(64 * kKiB);  // 256 KiB
    first = v.data();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % 64, 0u);
    v.back() = 1.0f;
    EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
  }
  const std::size_t idle = dsa::workspace_cache_bytes();
  EXPECT_GE(idle, 256 * kKiB);  // the buffer and its small header
  EXPECT_LT(idle, 257 * kKiB);
  {
    dsa::core::ScratchVector<float> again(48 * kKiB);  // 192 KiB: fits the idle one
    EXPECT_EQ(again.data(), first);
    EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
    dsa::core::ScratchVector<float> other(64 * kKiB);  // the idle one is taken: a new one
    EXPECT_NE(other.data(), first);
  }
  EXPECT_GE(dsa::workspace_cache_bytes(), 2 * idle);
  {
    dsa::core::ScratchVector<float> tiny(1024);  // 4 KiB: plain allocation, never cached
    (void)tiny;
  }
  EXPECT_LT(dsa::workspace_cache_bytes(), 2 * idle + 4 * kKiB);
  dsa::release_workspace_cache();
  EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
  dsa::set_workspace_cache_limit(old_limit);
}

// Restores the allocator's cap and the cache's limit whatever a test does.
struct AllocatorState {
  std::size_t cap = dsa::scratch_memory_limit(), cache = dsa::workspace_cache_limit();
  ~AllocatorState() {
    dsa::set_scratch_memory_limit(cap);
    dsa::set_workspace_cache_limit(cache);
  }
};

TEST(AllocationFailure, CacheIsReleasedBeforeARequestFails) {
  AllocatorState restore;
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  dsa::release_workspace_cache();
  dsa::set_workspace_cache_limit(64 * kMiB);
  const std::size_t base = dsa::scratch_memory_bytes();  // other tests' live buffers (none expected)
  { dsa::core::ScratchBuffer a(16 * kMiB); }
  ASSERT_EQ(dsa::workspace_cache_bytes(), 16 * kMiB);
  // 18 MiB does not fit the idle 16 MiB buffer; both together exceed the cap,
  // the request alone does not: the cache must give its buffer up.
  dsa::set_scratch_memory_limit(base + 20 * kMiB);
  {
    dsa::core::ScratchBuffer b(18 * kMiB);
    ASSERT_NE(b.data(), nullptr);
    b.data()[18 * kMiB - 1] = 1;
    EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
  }
  // A request over the cap fails with its size, after the cache was emptied.
  try {
    dsa::core::ScratchBuffer c(24 * kMiB);
    FAIL() << "a 24 MiB request under a 20 MiB cap succeeded";
  } catch (const dsa::core::AllocationFailure& e) {
    EXPECT_EQ(e.bytes(), 24 * kMiB);
  }
  EXPECT_EQ(dsa::workspace_cache_bytes(), 0u);
  EXPECT_EQ(dsa::scratch_memory_bytes(), base);  // nothing leaked by the failed attempts
  { dsa::core::ScratchBuffer d(8 * kMiB); }       // the allocator still works
  EXPECT_EQ(dsa::scratch_memory_bytes(), base + dsa::workspace_cache_bytes());
}

TEST(AllocationFailure, OpBoundaryNamesOpAndSize) {
  using dsa::core::run_kernel;
  // dsa's allocator failing: the error names the op and the bytes.
  try {
    run_kernel("some_op", [] { throw dsa::core::AllocationFailure(std::size_t{3} << 30); });
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::out_of_memory);
    const std::string m = e.what();
    EXPECT_NE(m.find("some_op"), std::string::npos) << m;
    EXPECT_NE(m.find("3221225472 bytes (3072.0 MiB)"), std::string::npos) << m;
  }
  // Another bad_alloc: the cache is released and the kernel rerun once.
  int runs = 0;
  run_kernel("retried_op", [&] {
    if (++runs == 1) throw std::bad_alloc();
  });
  EXPECT_EQ(runs, 2);
  runs = 0;
  try {
    run_kernel("failing_op", [&] {
      ++runs;
      throw std::bad_alloc();
    });
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::out_of_memory);
    EXPECT_NE(std::string(e.what()).find("failing_op"), std::string::npos) << e.what();
  }
  EXPECT_EQ(runs, 2);
  // Other errors pass through untouched, and are not retried.
  runs = 0;
  EXPECT_THROW(run_kernel("op", [&] {
                 ++runs;
                 throw Error(ErrorKind::internal, "bug");
               }),
               Error);
  EXPECT_EQ(runs, 1);
}

TEST(AllocationFailure, AnOpFailsCleanlyAndTheNextCallWorks) {
  AllocatorState restore;
  float q[2] = {1.0f, 0.5f};        // [T=1, Hi=1, Di=2]
  float k[6] = {1, 0, 0, 1, 2, 2};  // [S=3, Di=2] -> scores 1, 0.5, 3
  float w[1] = {2.0f};
  std::int32_t idx[2] = {-7, -7};
  dsa::IndexerParams p;
  p.topk = 2;
  p.cu_seqlens_q = {0, 1};
  p.cu_seqlens_k = {0, 3};
  p.num_threads = 1;
  auto call = [&] {
    dsa::indexer_topk(dsa::make_view(q, dsa::DType::f32, {1, 1, 2}), dsa::make_view(k, dsa::DType::f32, {3, 2}),
                      dsa::make_view(w, dsa::DType::f32, {1, 1}), p, dsa::make_view(idx, dsa::DType::i32, {1, 2}),
                      dsa::TensorView{}, Backend::cpu);
  };
  dsa::release_workspace_cache();
  // The fused indexer's per-thread scratch goes through dsa's allocator; a cap
  // of one byte over what is live makes its first request fail.
  dsa::set_scratch_memory_limit(dsa::scratch_memory_bytes() + 1);
  try {
    call();
    FAIL() << "the indexer ran under a one-byte scratch cap";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::out_of_memory);
    const std::string m = e.what();
    EXPECT_NE(m.find("indexer_topk: out of memory: could not allocate "), std::string::npos) << m;
    EXPECT_NE(m.find(" bytes ("), std::string::npos) << m;
  }
  dsa::set_scratch_memory_limit(0);
  call();
  EXPECT_EQ(idx[0], 0);
  EXPECT_EQ(idx[1], 2);
}

}  // namespace
