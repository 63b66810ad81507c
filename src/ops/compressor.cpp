// dsa::compressor_fwd / compressor_bwd: validation, problem set-up and backend dispatch.
#include "ops/compressor.h"

#include "core/sequences.h"
#include "core/memory.h"
#include "core/thread_pool.h"
#include "core/validate.h"
#include "ops/op_table.h"
#include "dsa/compressor.h"

namespace dsa {
namespace {

using namespace core;

// Validates the inputs shared by forward and backward and fills everything of
// the problem except the output pointers.
CompressorProblem make_problem(const TensorView& kv, const TensorView& gate,
                               const TensorView& position_bias, const CompressorParams& params,
                               Backend& backend) {
  const bool tnd = params.layout == Layout::TND;
  const int lead = tnd ? 0 : 1;
  if (params.ratio < 1) fail_argument("ratio: expected an integer >= 1, got ", params.ratio);
  require_float_input(kv, "kv", {2 + lead}, tnd ? "[S, C]" : "[B, Sk, C]");
  require_float_input(gate, "gate", {2 + lead}, tnd ? "[S, C]" : "[B, Sk, C]");
  backend = resolve_backend(backend, kv.device);
  if (gate.dtype != kv.dtype)
    fail_argument("gate: expected the dtype of kv (", dtype_name(kv.dtype), "), got ",
                  dtype_name(gate.dtype));
  for (int d = 0; d < kv.ndim; ++d)
    if (gate.shape[d] != kv.shape[d])
      fail_argument("gate: expected the shape of kv ", shape_string(kv), ", got ", shape_string(gate));
  const bool overlap = params.overlap.value_or(params.ratio == 4);
  const std::int64_t in_channels = kv.size(-1);
  if (overlap && in_channels % 2 != 0)
    fail_argument("kv: with overlap the last dim holds 2*c channels (two halves), got an odd size ",
                  in_channels, " in shape ", shape_string(kv));
  require_present(position_bias, "position_bias");
  require_cpu(position_bias, "position_bias");
  require_dtype(position_bias, "position_bias", {DType::f32});
  require_ndim(position_bias, "position_bias", {2}, overlap ? "[ratio, 2*c]" : "[ratio, c]");
  require_size(position_bias, "position_bias", 0, params.ratio, "ratio");
  require_size(position_bias, "position_bias", 1, in_channels, "the last dim of kv");
  require_last_dim_contiguous(position_bias, "position_bias");
  if (!tnd) {
    require_mergeable_rows(kv, "kv");
    require_mergeable_rows(gate, "gate");
  }

  LengthSpec spec;
  spec.layout = params.layout;
  spec.batch = tnd ? 1 : kv.size(0);
  spec.q_extent = kv.size(lead);
  spec.cu_q = &params.cu_seqlens;
  const SequencePlan plan = plan_sequences(spec);

  CompressorProblem p;
  p.dtype = kv.dtype;
  p.ratio = params.ratio;
  p.overlap = overlap;
  p.in_channels = in_channels;
  p.channels = overlap ? in_channels / 2 : in_channels;
  p.kv = kv.data;
  p.gate = gate.data;
  p.kv_row_stride = kv.stride(lead);
  p.gate_row_stride = gate.stride(lead);
  p.position_bias = position_bias.ptr<const float>();
  p.bias_row_stride = position_bias.stride(0);
  p.rows = plan.q_rows;
  const std::int64_t out_per_row = tnd ? 0 : kv.size(1) / params.ratio;
  std::int64_t out_offset = 0;
  for (std::size_t b = 0; b < plan.seqs.size(); ++b) {
    const SequenceSlice& s = plan.seqs[b];
    CompressorSequence seq;
    seq.token_begin = s.q_begin;
    seq.length = s.q_len;
    seq.entries = s.q_len / params.ratio;
    seq.row_extent = tnd ? s.q_len : kv.size(1);
    seq.out_begin = tnd ? out_offset : static_cast<std::int64_t>(b) * out_per_row;
    seq.out_extent = tnd ? seq.entries : out_per_row;
    out_offset += seq.entries;
    p.seqs.push_back(seq);
  }
  p.out_rows = tnd ? out_offset : spec.batch * out_per_row;
  p.num_threads = resolve_num_threads(params.num_threads);
  return p;
}

TensorView compressed_shape(const TensorView& kv, const CompressorProblem& p, bool tnd) {
  return tnd ? shape_like({p.out_rows, p.channels})
             : shape_like({kv.size(0), kv.size(1) / p.ratio, p.channels});
}

TensorView stats_shape(const TensorView& kv, const CompressorProblem& p, bool tnd) {
  return tnd ? shape_like({p.out_rows, 3, p.channels})
             : shape_like({kv.size(0), kv.size(1) / p.ratio, 3, p.channels});
}

const char* stats_shape_name(bool tnd) { return tnd ? "[sum of L // ratio, 3, c]" : "[B, Sk // ratio, 3, c]"; }

void run_fwd(const TensorView& kv, const TensorView& gate, const TensorView& position_bias,
             const CompressorParams& params, const TensorView& compressed, const TensorView* stats,
             Backend backend) {
  CompressorProblem p = make_problem(kv, gate, position_bias, params, backend);
  const bool tnd = params.layout == Layout::TND;
  require_output(compressed, "compressed", kv.dtype, compressed_shape(kv, p, tnd),
                 tnd ? "[sum of L // ratio, c]" : "[B, Sk // ratio, c]");
  if (stats) {
    require_output(*stats, "stats", DType::f32, stats_shape(kv, p, tnd), stats_shape_name(tnd));
    p.stats = stats->ptr<float>();
  }
  p.compressed = compressed.data;
  ops::dispatch(&ops::OpTable::compressor_fwd, backend, p);
}

void run_bwd(const TensorView& grad_compressed, const TensorView& kv, const TensorView& gate,
             const TensorView& position_bias, const TensorView* stats, const CompressorParams& params,
             const TensorView& grad_kv, const TensorView& grad_gate, const TensorView& grad_position_bias,
             Backend backend) {
  CompressorProblem p = make_problem(kv, gate, position_bias, params, backend);
  const bool tnd = params.layout == Layout::TND;
  const TensorView out_shape = compressed_shape(kv, p, tnd);
  require_float_input(grad_compressed, "grad_compressed", {out_shape.ndim},
                      tnd ? "[sum of L // ratio, c]" : "[B, Sk // ratio, c]");
  require_dtype(grad_compressed, "grad_compressed", {kv.dtype});
  for (int d = 0; d < out_shape.ndim; ++d)
    if (grad_compressed.shape[d] != out_shape.shape[d])
      fail_argument("grad_compressed: expected shape ", shape_string(out_shape), ", got ",
                    shape_string(grad_compressed));
  if (!tnd) require_mergeable_rows(grad_compressed, "grad_compressed");
  require_output(grad_kv, "grad_kv", kv.dtype, kv, "the shape of kv");
  require_output(grad_gate, "grad_gate", kv.dtype, kv, "the shape of kv");
  require_output(grad_position_bias, "grad_position_bias", DType::f32, position_bias,
                 "the shape of position_bias");
  p.grad_compressed = grad_compressed.data;
  p.grad_compressed_row_stride = grad_compressed.stride(tnd ? 0 : 1);
  p.grad_kv = grad_kv.data;
  p.grad_gate = grad_gate.data;
  p.grad_position_bias = grad_position_bias.ptr<float>();
  if (stats) {
    // The same checks as for the forward's output (CPU, fp32, exact shape, contiguous).
    require_output(*stats, "stats", DType::f32, stats_shape(kv, p, tnd), stats_shape_name(tnd));
    p.stats = const_cast<float*>(stats->ptr<const float>());  // read only by the backward
  }
  ops::dispatch(&ops::OpTable::compressor_bwd, backend, p);
}

}  // namespace

CuSeqlens compressed_cu_seqlens(const CuSeqlens& raw_cu_seqlens, std::int64_t ratio) {
  if (ratio < 1) fail_argument("ratio: expected an integer >= 1, got ", ratio);
  CuSeqlens out{0};
  for (std::size_t b = 1; b < raw_cu_seqlens.size(); ++b) {
    const std::int64_t length = raw_cu_seqlens[b] - raw_cu_seqlens[b - 1];
    if (length < 0) fail_argument("cu_seqlens: expected non-decreasing entries, got a negative length");
    out.push_back(out.back() + length / ratio);
  }
  return out;
}

// The fused kernels keep up to 8 slots in registers, where recomputing the
// softmax costs less than moving 12 bytes of statistics per output value.
std::int64_t compressor_stats_min_slots() { return 9; }

bool compressor_stats_pay_off(std::int64_t ratio, bool overlap) {
  return (overlap ? 2 : 1) * ratio >= compressor_stats_min_slots();
}

void compressor_fwd(const TensorView& kv, const TensorView& gate, const TensorView& position_bias,
                    const CompressorParams& params, const TensorView& compressed, Backend backend) {
  run_fwd(kv, gate, position_bias, params, compressed, nullptr, backend);
}

void compressor_fwd(const TensorView& kv, const TensorView& gate, const TensorView& position_bias,
                    const CompressorParams& params, const TensorView& compressed, const TensorView& stats,
                    Backend backend) {
  run_fwd(kv, gate, position_bias, params, compressed, &stats, backend);
}

void compressor_bwd(const TensorView& grad_compressed, const TensorView& kv, const TensorView& gate,
                    const TensorView& position_bias, const CompressorParams& params,
                    const TensorView& grad_kv, const TensorView& grad_gate,
                    const TensorView& grad_position_bias, Backend backend) {
  run_bwd(grad_compressed, kv, gate, position_bias, nullptr, params, grad_kv, grad_gate, grad_position_bias,
          backend);
}

void compressor_bwd(const TensorView& grad_compressed, const TensorView& kv, const TensorView& gate,
                    const TensorView& position_bias, const TensorView& stats, const CompressorParams& params,
                    const TensorView& grad_kv, const TensorView& grad_gate,
                    const TensorView& grad_position_bias, Backend backend) {
  run_bwd(grad_compressed, kv, gate, position_bias, &stats, params, grad_kv, grad_gate, grad_position_bias,
          backend);
}

}  // namespace dsa
