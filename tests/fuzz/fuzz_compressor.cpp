// libFuzzer target of the V4 KV compressor: dsa::compressor_fwd / _bwd, with
// and without the saved softmax statistics, overlapping (CSA) or not (HCA),
// and the decode compressor dsa::compressor_append over a batch of states.
#include "dsa/compressor.h"
#include "dsa/compressor_append.h"

#include "fuzz_common.h"

using namespace dsa_fuzz;

namespace {

// compressor_append: B requests with their fp32 rings, lengths and new_lens
// (mostly valid, sometimes anything), n new rows.
int fuzz_append(Input& in) {
  dsa::CompressorAppendParams params;
  params.ratio = in.param(in.pick<std::int64_t>({4, 128, 4, 1, 2, 3, 8}), 300);
  if (in.flag()) params.overlap = in.flag();
  params.num_threads = in.num_threads();
  const std::int64_t ratio = std::max<std::int64_t>(params.ratio, 1);
  const bool overlap = params.overlap.value_or(params.ratio == 4);
  const std::int64_t batch = in.size(4, 40), n = in.size(9, 300), channels = in.size(24, 300);
  std::int64_t in_channels = channels;
  if (overlap && __builtin_mul_overflow(channels, 2, &in_channels)) in_channels = channels;
  if (in.rare(16) && in_channels < std::numeric_limits<std::int64_t>::max()) in_channels += 1;
  // The ring and output sizes the op expects, now and then one more; an extreme ratio or
  // n stays as it is (the harness's own arithmetic must not overflow).
  std::int64_t ring = ratio;
  if (overlap && __builtin_mul_overflow(ratio, 2, &ring)) ring = ratio;
  if (in.rare(16) && ring < std::numeric_limits<std::int64_t>::max()) ring += 1;
  std::int64_t out_rows = n / ratio + (n % ratio > 0);
  if (in.rare(16) && out_rows < std::numeric_limits<std::int64_t>::max()) out_rows += 1;
  if (work({plain(batch), plain(n) + plain(ratio), plain(in_channels), 4}) > kMaxWork) return 0;

  Arena a(in);
  const DType dtype = in.float_dtype();
  TensorView kv, gate, position_bias, state_kv, state_gate, lengths, new_lens, compressed;
  if (!a.view(kv, in.dtype(dtype), {batch, n, in_channels}) || !a.view(gate, in.dtype(dtype), {batch, n, in_channels}) ||
      !a.view(position_bias, in.dtype(DType::f32), {ratio, in_channels}) ||
      !a.view(state_kv, in.dtype(DType::f32), {batch, ring, in_channels}) ||
      !a.view(state_gate, in.dtype(DType::f32), {batch, ring, in_channels}) ||
      !a.view(lengths, in.dtype(in.pick<DType>({DType::i32, DType::i64})), {batch}) ||
      !a.view(compressed, in.dtype(dtype), {batch, out_rows, channels}))
    return 0;
  if (in.flag() && !a.view(new_lens, in.dtype(in.pick<DType>({DType::i32, DType::i64})), {batch})) return 0;
  a.fill(kv, FloatFill{2.0f, in.rare(4)});
  a.fill(gate, FloatFill{4.0f, in.rare(3)});
  a.fill(position_bias, FloatFill{2.0f, in.rare(4)});
  a.fill(state_kv, FloatFill{2.0f, in.rare(4)});
  a.fill(state_gate, FloatFill{4.0f, in.rare(4)});
  // Lengths: mostly small valid counts; new_lens mostly within n.
  a.fill(lengths, FloatFill{in.rare(4) ? 3e9f : 4.0f * static_cast<float>(ratio), false, !in.rare(8)});
  a.fill(new_lens, FloatFill{static_cast<float>(std::min<std::int64_t>(std::max<std::int64_t>(n, 0), 1 << 20)) + 1,
                             false, !in.rare(8)});
  // Each backend gets the same state: the op updates it in place.
  std::vector<std::uint8_t> saved_kv, saved_gate;
  // Only views the arena really backs (an overflowing extent gets a token buffer that
  // only the library's validation may look at); sizes multiplied with overflow checks.
  auto bytes_of = [](const TensorView& v) -> std::size_t {
    if (!v.present() || v.dtype != DType::f32) return 0;
    std::int64_t n = 1;
    for (int d = 0; d < v.ndim; ++d)
      if (v.shape[d] <= 0 || __builtin_mul_overflow(n, v.shape[d], &n)) return 0;
    return n <= kMaxInputBytes / 4 && v.is_contiguous() ? static_cast<std::size_t>(n) * 4 : 0;
  };
  if (bytes_of(state_kv)) saved_kv.assign(static_cast<std::uint8_t*>(state_kv.data), static_cast<std::uint8_t*>(state_kv.data) + bytes_of(state_kv));
  if (bytes_of(state_gate)) saved_gate.assign(static_cast<std::uint8_t*>(state_gate.data), static_cast<std::uint8_t*>(state_gate.data) + bytes_of(state_gate));
  Agreement agree("compressor_append");
  for (dsa::Backend backend : backends(in)) {
    if (!saved_kv.empty()) std::memcpy(state_kv.data, saved_kv.data(), saved_kv.size());
    if (!saved_gate.empty()) std::memcpy(state_gate.data, saved_gate.data(), saved_gate.size());
    agree.run([&] {
      dsa::compressor_append(kv, gate, position_bias, state_kv, state_gate, lengths, new_lens, params, compressed,
                             backend);
    });
  }
  return 0;
}

// compressor_fwd / _bwd (the input's first bytes, as before the decode
// compressor joined: older corpus inputs keep their meaning).
void fuzz_compressor(Input& in) {
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
  if (work({plain(seq.q_rows), plain(in_channels), plain(seq.batch), 4}) > kMaxWork) return;

  Arena a(in);
  const DType dtype = in.float_dtype();
  TensorView kv, gate, position_bias, compressed, stats;
  if (!a.view(kv, in.dtype(dtype), seq.rows(seq.q_rows, {in_channels})) ||
      !a.view(gate, in.dtype(dtype), seq.rows(seq.q_rows, {in_channels})) ||
      !a.view(position_bias, in.dtype(DType::f32), {ratio, in_channels}) ||
      !a.view(compressed, in.dtype(dtype), seq.rows(cmp_rows, {channels})))
    return;
  const bool with_stats = in.flag();
  if (with_stats && !a.view(stats, in.dtype(DType::f32), seq.rows(cmp_rows, {3, channels}))) return;
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
    return;
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
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  choose_isa(in);
  fuzz_compressor(in);
  return fuzz_append(in);  // from the bytes the first part left
}
