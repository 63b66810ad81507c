// dsa::sparse_attention_decode: validation, problem set-up and backend dispatch.
#include "ops/sparse_attention_decode.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/thread_pool.h"
#include "core/validate.h"
#include "dsa/sparse_attention_decode.h"
#include "ops/op_table.h"

namespace dsa {

std::int64_t SparseAttentionDecodeProblem::max_attended() const {
  std::int64_t max_ctx = 0;
  for (std::int64_t c : context_lens) max_ctx = std::max(max_ctx, c);
  const std::int64_t raw = indices ? topk : (window > 0 ? std::min(window, max_ctx) : max_ctx);
  const std::int64_t compressed = has_cmp ? (cmp_indices ? cmp_topk : max_ctx / cmp_ratio) : 0;
  return raw + compressed;
}

namespace {

using namespace core;

// Positions are int32 in every index tensor: no request can be longer.
constexpr std::int64_t kMaxContext = std::numeric_limits<std::int32_t>::max();

// A ring table holds the blocks of the last `width` columns only: a position
// in an older block was overwritten, and reading it would be silently wrong.
void require_in_ring(const BlockTable& t, std::int64_t b, std::int64_t pos, std::int64_t held, const char* what) {
  if (!t.ring || held <= 0) return;
  const std::int64_t newest = (held - 1) / t.block_size;
  if (pos / t.block_size + t.width <= newest)
    fail_argument(what, ": position ", pos, " of request ", b, " has left the ring ", t.name, " (", t.width,
                  " columns of ", t.block_size, " tokens, newest position ", held - 1, ")");
}

void check_index_tensor(const TensorView& t, const char* name, std::int64_t batch, std::int64_t next_n) {
  require_present(t, name);
  require_cpu(t, name);
  require_dtype(t, name, {DType::i32});
  require_ndim(t, name, {3}, "[B, next_n, K]");
  require_size(t, name, 0, batch, "B of query");
  require_size(t, name, 1, next_n, "next_n of query");
  require_last_dim_contiguous(t, name);
  if (t.size(2) < 1) fail_argument(name, ": expected at least one index per row, got shape ", shape_string(t));
}

SparseAttentionDecodeProblem set_up(const SparseAttentionDecodeInputs& in, const SparseAttentionDecodeParams& params,
                                    const TensorView& out, const TensorView& lse) {
  SparseAttentionDecodeProblem p;
  require_float_input(in.query, "query", {4}, "[B, next_n, H, D]");
  p.dtype = in.query.dtype;
  p.batch = in.query.size(0);
  p.next_n = in.query.size(1);
  p.heads = in.query.size(2);
  p.dim = in.query.size(3);
  if (p.next_n < 1) fail_argument("query: expected next_n >= 1 rows per request in dim 1, got shape ", shape_string(in.query));
  if (p.heads < 1) fail_argument("query: expected at least one head, got shape ", shape_string(in.query));
  if (params.kv_layout.dim != p.dim)
    fail_argument("kv_layout: dim ", params.kv_layout.dim, " differs from query's head dim ", p.dim);
  p.d_v = params.d_v == 0 ? p.dim : params.d_v;
  if (p.d_v < 1 || p.d_v > p.dim) fail_argument("d_v: expected a value in [1, D = ", p.dim, "] (or 0: D), got ", params.d_v);
  p.query = in.query.data;
  p.q_batch_stride = in.query.stride(0);
  p.q_row_stride = in.query.stride(1);
  p.q_head_stride = in.query.stride(2);
  if (!std::isfinite(params.scale)) fail_argument("scale: expected a finite number, got ", params.scale);
  p.scale = params.scale;
  if (params.window < 0) fail_argument("window: expected >= 0 (0: every token), got ", params.window);
  p.window = params.window;
  p.num_threads = resolve_num_threads(params.num_threads);
  // The outputs first: they are contiguous, so B, next_n and H are backed by
  // memory before any loop runs over them (an empty query can claim 2^40 requests).
  require_present(out, "out");
  require_cpu(out, "out");
  require_dtype(out, "out", {p.dtype});
  require_ndim(out, "out", {4}, "[B, next_n, H, d_v]");
  require_size(out, "out", 0, p.batch, "B of query");
  require_size(out, "out", 1, p.next_n, "next_n of query");
  require_size(out, "out", 2, p.heads, "H of query");
  require_size(out, "out", 3, p.d_v, "d_v");
  require_contiguous(out, "out");
  require_present(lse, "lse");
  require_cpu(lse, "lse");
  require_dtype(lse, "lse", {DType::f32});
  require_ndim(lse, "lse", {3}, "[B, next_n, H]");
  require_size(lse, "lse", 0, p.batch, "B of query");
  require_size(lse, "lse", 1, p.next_n, "next_n of query");
  require_size(lse, "lse", 2, p.heads, "H of query");
  require_contiguous(lse, "lse");

  p.kv = validate_paged_cache(in.kv_cache, params.kv_layout, "kv_cache");
  p.kv_table = validate_block_table(in.block_table, p.batch, p.kv, "block_table");
  p.context_lens = read_lengths(in.context_lens, "context_lens", p.batch, kMaxContext, "int32 positions");
  for (std::int64_t b = 0; b < p.batch; ++b)
    if (p.context_lens[b] < p.next_n)
      fail_argument("context_lens[", b, "] = ", p.context_lens[b], ": expected at least next_n = ", p.next_n,
                    " (the rows asked for are the last next_n of the context)");

  if (in.indices.present()) {
    if (p.window > 0) fail_argument("window: the band applies only without indices, got window ", p.window);
    check_index_tensor(in.indices, "indices", p.batch, p.next_n);
    p.indices = in.indices.ptr<const std::int32_t>();
    p.idx_batch_stride = in.indices.stride(0);
    p.idx_row_stride = in.indices.stride(1);
    p.topk = in.indices.size(2);
    p.topk_lens = in.topk_lens.present()
                      ? read_lengths(in.topk_lens, "topk_lens", p.batch, p.topk, "K, the indices per row")
                      : std::vector<std::int64_t>(p.batch, p.topk);
  } else if (in.topk_lens.present()) {
    fail_argument("topk_lens: given without indices");
  }

  const bool has_cmp = in.cmp_cache.present();
  if (has_cmp != (params.cmp_ratio > 1))
    fail_argument("cmp_ratio: expected > 1 exactly when cmp_cache is given (got ", params.cmp_ratio,
                  has_cmp ? " with" : " without", " cmp_cache)");
  p.has_cmp = has_cmp;
  p.cmp_ratio = params.cmp_ratio;
  if (has_cmp) {
    if (params.cmp_layout.dim != p.dim)
      fail_argument("cmp_layout: dim ", params.cmp_layout.dim, " differs from query's head dim ", p.dim);
    p.cmp = validate_paged_cache(in.cmp_cache, params.cmp_layout, "cmp_cache");
    p.cmp_table = validate_block_table(in.cmp_block_table, p.batch, p.cmp, "cmp_block_table");
    if (in.cmp_indices.present()) {
      check_index_tensor(in.cmp_indices, "cmp_indices", p.batch, p.next_n);
      p.cmp_indices = in.cmp_indices.ptr<const std::int32_t>();
      p.cidx_batch_stride = in.cmp_indices.stride(0);
      p.cidx_row_stride = in.cmp_indices.stride(1);
      p.cmp_topk = in.cmp_indices.size(2);
    }
  } else if (in.cmp_block_table.present() || in.cmp_indices.present()) {
    fail_argument(in.cmp_indices.present() ? "cmp_indices" : "cmp_block_table", ": given without cmp_cache");
  }

  if (in.sinks.present()) {
    require_cpu(in.sinks, "sinks");
    require_dtype(in.sinks, "sinks", {DType::f32});
    require_ndim(in.sinks, "sinks", {1}, "[H]");
    require_size(in.sinks, "sinks", 0, p.heads, "H of query");
    require_contiguous(in.sinks, "sinks");
    p.sinks = in.sinks.ptr<const float>();
  }

  // Every key a row reads has a block (and, in a ring, is still there): the
  // kernels then look slots up unchecked. The work is what the call reads.
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t ctx = p.context_lens[b];
    if (p.indices) {
      // A position the request does not hold is a caller's mistake (a global
      // slot for a position, say), never skipped in silence; -1 marks "none",
      // and a position after the row is causally masked (one index list can
      // serve next_n rows).
      for (std::int64_t j = 0; j < p.next_n; ++j) {
        const std::int32_t* idx = p.indices + b * p.idx_batch_stride + j * p.idx_row_stride;
        for (std::int64_t k = 0; k < p.topk_lens[b]; ++k) {
          if (idx[k] < -1 || idx[k] >= ctx)
            fail_argument("indices[", b, ", ", j, ", ", k, "] = ", idx[k], ": expected a position in [0, context_lens[",
                          b, "] = ", ctx, ") or -1");
          if (idx[k] < 0 || idx[k] > p.position(b, j)) continue;  // not read
          require_covered(p.kv_table, b, idx[k], idx[k] + 1, "indices");
          require_in_ring(p.kv_table, b, idx[k], ctx, "indices");
        }
      }
    } else {
      const std::int64_t first = p.position(b, 0), lo = p.window > 0 ? std::max<std::int64_t>(0, first - p.window + 1) : 0;
      require_covered(p.kv_table, b, lo, ctx, "context_lens");
      require_in_ring(p.kv_table, b, lo, ctx, "window");
    }
    if (!has_cmp) continue;
    const std::int64_t held = ctx / p.cmp_ratio;
    if (p.cmp_indices) {
      for (std::int64_t j = 0; j < p.next_n; ++j) {
        const std::int32_t* idx = p.cmp_indices + b * p.cidx_batch_stride + j * p.cidx_row_stride;
        const std::int64_t visible = p.cmp_visible(b, j);
        for (std::int64_t k = 0; k < p.cmp_topk; ++k) {
          if (idx[k] < -1 || idx[k] >= held)
            fail_argument("cmp_indices[", b, ", ", j, ", ", k, "] = ", idx[k],
                          ": expected a compressed entry in [0, context_lens[", b, "] / cmp_ratio = ", held, ") or -1");
          if (idx[k] < 0 || idx[k] >= visible) continue;  // not read
          require_covered(p.cmp_table, b, idx[k], idx[k] + 1, "cmp_indices");
          require_in_ring(p.cmp_table, b, idx[k], held, "cmp_indices");
        }
      }
    } else {
      require_covered(p.cmp_table, b, 0, held, "context_lens");
      require_in_ring(p.cmp_table, b, 0, held, "cmp_block_table");
    }
  }
  return p;
}

}  // namespace

void sparse_attention_decode(const SparseAttentionDecodeInputs& inputs, const SparseAttentionDecodeParams& params,
                             const TensorView& out, const TensorView& lse, Backend backend) {
  using namespace core;
  SparseAttentionDecodeProblem p = set_up(inputs, params, out, lse);
  p.out = out.data;
  p.lse = lse.ptr<float>();
  backend = resolve_backend(backend, inputs.query.device);
  ops::dispatch(&ops::OpTable::sparse_attention_decode, backend, p);
}

}  // namespace dsa
