// Google Benchmark microbenchmark of the indexer kernels (C++ only, no torch).
// The full comparison against PyTorch and the machine ceilings is `make bench`.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "dsa/dsa.h"

static void BM_indexer_topk(benchmark::State& state) {
  const std::int64_t T = state.range(0), Hi = 64, Di = 128, topk = 2048;
  std::mt19937 gen(0);
  std::normal_distribution<float> dist;
  auto bf16 = [](float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<std::uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  };
  std::vector<std::uint16_t> q(T * Hi * Di), k(T * Di), w(T * Hi);
  for (auto& x : q) x = bf16(dist(gen));
  for (auto& x : k) x = bf16(dist(gen));
  for (auto& x : w) x = bf16(dist(gen));
  std::vector<std::int32_t> idx(T * topk);
  dsa::IndexerParams p;
  p.topk = topk;
  for (auto _ : state) {
    dsa::indexer_topk(dsa::make_view(q.data(), dsa::DType::bf16, {T, Hi, Di}),
                      dsa::make_view(k.data(), dsa::DType::bf16, {T, Di}),
                      dsa::make_view(w.data(), dsa::DType::bf16, {T, Hi}), p,
                      dsa::make_view(idx.data(), dsa::DType::i32, {T, topk}), dsa::TensorView{},
                      dsa::Backend::cpu);
  }
  const double pairs = static_cast<double>(T) * (T + 1) / 2;
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * Hi * Di * pairs, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_indexer_topk)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond)->UseRealTime();
