// libFuzzer target of the V4 KV compressor: dsa::compressor_fwd / _bwd, with
// and without the saved softmax statistics, overlapping (CSA) or not (HCA).
#include "dsa/compressor.h"

#include "fuzz_common.h"

using namespace dsa_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  choose_isa(in);
  dsa::CompressorParams params;
  params.ratio = in.param(in.pick<std::int64_t>({4, 128, 4, 1, 2, 3, 8}), 300);
  if (in.flag()) params.overlap = in.flag();
  const std::int64_t ratio = std::max<std::int64_t>(params.ratio, 1);
  const bool overlap = params.overlap.value_or(params.ratio == 4);
  const Sequences seq = sequences(in, ratio, ratio > 8 ? 400 : 40, 0, /*self=*/true);
  params.layout = seq.layout;
  params.cu_seqlens = seq.cu_q;
  params.num_threads = in.num_threads();
  const std::int64_t channels = in.size(24, 300);
  // C = coff * c, or an odd width with overlap; an extreme c stays as it is.
  std::int64_t in_channels = channels;
  if (overlap && __builtin_mul_overflow(channels, 2, &in_channels)) in_channels = channels;
  if (in.rare(16) && in_channels < std::numeric_limits<std::int64_t>::max()) in_channels += 1;
  const std::int64_t cmp_rows = seq.tnd ? seq.c_rows : seq.q_rows / ratio + (in.rare(16) ? 1 : 0);
  if (work({plain(seq.q_rows), plain(in_channels), plain(seq.batch), 4}) > kMaxWork) return 0;

  Arena a(in);
  const DType dtype = in.float_dtype();
  TensorView kv, gate, position_bias, compressed, stats;
  if (!a.view(kv, in.dtype(dtype), seq.rows(seq.q_rows, {in_channels})) ||
      !a.view(gate, in.dtype(dtype), seq.rows(seq.q_rows, {in_channels})) ||
      !a.view(position_bias, in.dtype(DType::f32), {ratio, in_channels}) ||
      !a.view(compressed, in.dtype(dtype), seq.rows(cmp_rows, {channels})))
    return 0;
  const bool with_stats = in.flag();
  if (with_stats && !a.view(stats, in.dtype(DType::f32), seq.rows(cmp_rows, {3, channels}))) return 0;
  const FloatFill fill{2.0f, in.rare(4)};
  a.fill(kv, fill);
  // -inf gates make whole channels empty (pooled to 0, zero gradients).
  a.fill(gate, FloatFill{4.0f, in.rare(3)});
  a.fill(position_bias, FloatFill{2.0f, in.rare(4)});

  const std::vector<dsa::Backend> backends_used = backends(in);
  bool forward_ok = false;
  Agreement fwd("compressor_fwd");
  for (dsa::Backend backend : backends_used)
    forward_ok |= fwd.run([&] {
      if (with_stats) dsa::compressor_fwd(kv, gate, position_bias, params, compressed, stats, backend);
      else dsa::compressor_fwd(kv, gate, position_bias, params, compressed, backend);
    });
  if (with_stats && (!forward_ok || in.rare(8))) a.fill(stats, FloatFill{4.0f, in.rare(2)});

  TensorView grad_compressed, grad_kv, grad_gate, grad_position_bias;
  if (!a.like(grad_compressed, compressed) || !a.like(grad_kv, kv) || !a.like(grad_gate, gate) ||
      !a.view(grad_position_bias, in.dtype(DType::f32), {ratio, in_channels}))
    return 0;
  a.fill(grad_compressed, fill);
  Agreement bwd("compressor_bwd");
  for (dsa::Backend backend : backends_used)
    bwd.run([&] {
      if (with_stats)
        dsa::compressor_bwd(grad_compressed, kv, gate, position_bias, stats, params, grad_kv, grad_gate,
                            grad_position_bias, backend);
      else
        dsa::compressor_bwd(grad_compressed, kv, gate, position_bias, params, grad_kv, grad_gate,
                            grad_position_bias, backend);
    });
  return 0;
}
