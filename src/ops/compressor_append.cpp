// dsa::compressor_append: validation, problem set-up and backend dispatch.
#include "ops/compressor_append.h"

#include <limits>
#include <vector>

#include "core/paged_cache.h"
#include "core/thread_pool.h"
#include "core/validate.h"
#include "dsa/compressor_append.h"
#include "ops/op_table.h"

namespace dsa {

std::int64_t compressor_state_rows(std::int64_t ratio, bool overlap) {
  if (ratio < 1) core::fail_argument("ratio: expected an integer >= 1, got ", ratio);
  return (overlap ? 2 : 1) * ratio;
}

void compressor_append(const TensorView& kv, const TensorView& gate, const TensorView& position_bias,
                       const TensorView& state_kv, const TensorView& state_gate, const TensorView& lengths,
                       const TensorView& new_lens, const CompressorAppendParams& params,
                       const TensorView& compressed, Backend backend) {
  using namespace core;
  CompressorAppendProblem p;
  if (params.ratio < 1) fail_argument("ratio: expected an integer >= 1, got ", params.ratio);
  // A ring of R rows is allocated per request: keep R * C far from overflow.
  if (params.ratio > (std::int64_t{1} << 24))
    fail_argument("ratio: expected at most 2^24 tokens per block, got ", params.ratio);
  require_float_input(kv, "kv", {3}, "[B, n, C]");
  require_float_input(gate, "gate", {3}, "[B, n, C]");
  backend = resolve_backend(backend, kv.device);
  if (gate.dtype != kv.dtype)
    fail_argument("gate: expected the dtype of kv (", dtype_name(kv.dtype), "), got ", dtype_name(gate.dtype));
  for (int d = 0; d < 3; ++d)
    if (gate.shape[d] != kv.shape[d])
      fail_argument("gate: expected the shape of kv ", shape_string(kv), ", got ", shape_string(gate));
  p.dtype = kv.dtype;
  p.ratio = params.ratio;
  p.overlap = params.overlap.value_or(params.ratio == 4);
  p.batch = kv.size(0);
  p.new_rows = kv.size(1);
  p.in_channels = kv.size(2);
  if (p.in_channels < 1) fail_argument("kv: expected at least one channel in its last dim, got ", shape_string(kv));
  if (p.overlap && p.in_channels % 2 != 0)
    fail_argument("kv: with overlap the last dim holds 2*c channels (two halves), got an odd size ",
                  p.in_channels, " in shape ", shape_string(kv));
  p.channels = p.overlap ? p.in_channels / 2 : p.in_channels;
  p.kv = kv.data;
  p.gate = gate.data;
  p.kv_batch_stride = kv.stride(0);
  p.kv_row_stride = kv.stride(1);
  p.gate_batch_stride = gate.stride(0);
  p.gate_row_stride = gate.stride(1);

  require_present(position_bias, "position_bias");
  require_cpu(position_bias, "position_bias");
  require_dtype(position_bias, "position_bias", {DType::f32});
  require_ndim(position_bias, "position_bias", {2}, p.overlap ? "[ratio, 2*c]" : "[ratio, c]");
  require_size(position_bias, "position_bias", 0, p.ratio, "ratio");
  require_size(position_bias, "position_bias", 1, p.in_channels, "the last dim of kv");
  require_last_dim_contiguous(position_bias, "position_bias");
  p.position_bias = position_bias.ptr<const float>();
  p.bias_row_stride = position_bias.stride(0);

  // The state and the output are contiguous: B, n and C are backed by memory
  // before anything loops over them.
  const TensorView state_shape = shape_like({p.batch, p.ring(), p.in_channels});
  require_output(state_kv, "state_kv", DType::f32, state_shape, "[B, (overlap ? 2 : 1) * ratio, C]");
  require_output(state_gate, "state_gate", DType::f32, state_shape, "[B, (overlap ? 2 : 1) * ratio, C]");
  p.state_kv = state_kv.ptr<float>();
  p.state_gate = state_gate.ptr<float>();
  if (p.state_kv == p.state_gate && p.batch > 0)
    fail_argument("state_gate: expected a tensor of its own, got the memory of state_kv");
  p.out_rows = p.new_rows / p.ratio + (p.new_rows % p.ratio != 0);
  require_output(compressed, "compressed", p.dtype, shape_like({p.batch, p.out_rows, p.channels}),
                 "[B, ceil(n / ratio), c]");
  p.compressed = compressed.data;

  // Appended tokens must keep an absolute position an int64 (and a rope position) holds.
  constexpr std::int64_t kMaxTokens = std::numeric_limits<std::int32_t>::max();
  p.lengths = read_lengths(lengths, "lengths", p.batch, kMaxTokens, "tokens appended before");
  p.new_lens = new_lens.present() ? read_lengths(new_lens, "new_lens", p.batch, p.new_rows, "n, the rows of kv")
                                  : std::vector<std::int64_t>(p.batch, p.new_rows);
  for (std::int64_t b = 0; b < p.batch; ++b)
    if (p.lengths[b] + p.new_lens[b] > kMaxTokens)
      fail_argument("lengths[", b, "] + new_lens[", b, "] = ", p.lengths[b] + p.new_lens[b],
                    ": expected at most 2^31 - 1 tokens in a request");
  p.num_threads = resolve_num_threads(params.num_threads);
  ops::dispatch(&ops::OpTable::compressor_append, backend, p);
}

}  // namespace dsa
