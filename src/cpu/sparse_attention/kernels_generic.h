// fp32 attention microkernels written for the compiler's vectorizer. Included
// by kernels_portable.cpp, kernels_avx2.cpp and kernels_avx512.cpp, which
// compile it for their ISA and name it through DSA_GENERIC_KERNEL_NAME.
//
// Every gathered key block is converted to fp32 once and shared by all heads.
// Dot products keep kLanes independent partial sums (no reassociation needed
// for the vectorizer), so results are identical run to run.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "cpu/isa/rows.h"
#include "cpu/sparse_attention/attention_kernels.h"

namespace dsa::cpu::attention_kernels {
namespace {

constexpr std::int64_t kLanes = 16;

std::int64_t pad(std::int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Converts n storage-dtype elements to fp32, zero-filling up to pad(n).
void to_float(const char* src, DType dtype, std::int64_t n, float* dst) { rows::to_float(src, dtype, n, pad(n), dst); }

using rows::from_float;

// n is a multiple of kLanes (buffers are zero padded).
inline float dot(const float* __restrict a, const float* __restrict b, std::int64_t n) {
  float acc[kLanes] = {};
  for (std::int64_t i = 0; i < n; i += kLanes)
    for (std::int64_t l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (std::int64_t l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

inline void axpy(float a, const float* __restrict x, float* __restrict y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

struct Padded {
  std::int64_t qk, v;  // padded qk_dim and d_v
  std::int64_t heads;
  explicit Padded(const Shape& s) : qk(pad(s.qk_dim())), v(pad(s.d_v)), heads(s.heads) {}
};

std::size_t generic_scratch_bytes(const Shape& s) {
  const Padded L(s);
  const std::int64_t block = std::max(kKeyBlock, s.owner_rows);
  const std::int64_t floats = L.heads * L.qk     // query (scaled)
                              + L.heads * L.qk   // d_query
                              + L.heads * L.v    // out accumulator / grad_out
                              + block * L.qk     // gathered keys
                              + block * L.qk     // d_key block accumulator
                              + L.heads * block * 3  // logits, probabilities, dprob
                              + L.heads * 4 + 64;
  return static_cast<std::size_t>(floats) * sizeof(float) + 256;
}

float* align64(void* p) {
  return reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(p) + 63) & ~std::uintptr_t(63));
}

// Loads all heads of a query row, scaled: logits become plain dot products.
void load_query(const Shape& s, const Padded& L, const QueryRow& q, float scale, float* dst) {
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t h = 0; h < s.heads; ++h) {
    float* row = dst + h * L.qk;
    to_float(q.q + h * q.q_head_stride * es, s.dtype, s.dim, row);
    if (s.rope_dim) to_float(q.q_rope + h * q.q_rope_head_stride * es, s.dtype, s.rope_dim, row + s.dim);
    for (std::int64_t d = s.qk_dim(); d < L.qk; ++d) row[d] = 0.0f;
    if (scale != 1.0f)
      for (std::int64_t d = 0; d < L.qk; ++d) row[d] *= scale;
  }
}

void load_keys(const Shape& s, const Padded& L, const KeyRows& keys, std::int64_t first,
               std::int64_t n, float* dst) {
  for (std::int64_t k = 0; k < n; ++k) {
    float* row = dst + k * L.qk;
    to_float(keys.main[first + k], s.dtype, s.dim, row);
    if (s.rope_dim) to_float(keys.rope[first + k], s.dtype, s.rope_dim, row + s.dim);
    for (std::int64_t d = s.qk_dim(); d < L.qk; ++d) row[d] = 0.0f;
  }
}

void load_grad_out(const Shape& s, const Padded& L, const RowBackward& r, float* dst) {
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t h = 0; h < s.heads; ++h) to_float(r.grad_out + h * r.go_head_stride * es, s.dtype, s.d_v, dst + h * L.v);
}

void generic_forward_row(const Shape& s, const float* sinks, const QueryRow& query, const KeyRows& keys,
                         void* scratch, void* out, float* max, float* sum) {
  const Padded L(s);
  const std::int64_t H = s.heads, dv = s.d_v;
  float* q = align64(scratch);
  float* acc = q + H * L.qk;
  float* kb = acc + H * L.v;
  float* logits = kb + kKeyBlock * L.qk;
  load_query(s, L, query, s.scale, q);
  std::fill(acc, acc + H * L.v, 0.0f);
  for (std::int64_t h = 0; h < H; ++h) {
    max[h] = core::kNegInf;
    sum[h] = 0.0f;
  }
  for (std::int64_t first = 0; first < keys.count; first += kKeyBlock) {
    const std::int64_t n = std::min(kKeyBlock, keys.count - first);
    load_keys(s, L, keys, first, n, kb);
    for (std::int64_t h = 0; h < H; ++h) {
      float* l = logits + h * kKeyBlock;
      float block_max = core::kNegInf;
      for (std::int64_t k = 0; k < n; ++k) {
        l[k] = dot(q + h * L.qk, kb + k * L.qk, L.qk);
        block_max = std::max(block_max, l[k]);
      }
      const float new_max = std::max(max[h], block_max);
      // Online softmax: rescale what was accumulated under the old max.
      const float alpha = max[h] == core::kNegInf ? 0.0f : std::exp(max[h] - new_max);
      float* a = acc + h * L.v;
      if (alpha != 1.0f)
        for (std::int64_t d = 0; d < dv; ++d) a[d] *= alpha;
      float block_sum = 0.0f;
      for (std::int64_t k = 0; k < n; ++k) {
        const float w = std::exp(l[k] - new_max);
        block_sum += w;
        axpy(w, kb + k * L.qk, a, dv);
      }
      sum[h] = sum[h] * alpha + block_sum;
      max[h] = new_max;
    }
  }
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t h = 0; h < H; ++h) {
    float* a = acc + h * L.v;
    if (max[h] == core::kNegInf && keys.count == 0) {
      std::fill(a, a + dv, 0.0f);  // empty row
    } else {  // (keys whose logits are all NaN or -inf: the sum is NaN, so is the output)
      const SinkShare sink = sink_share(max[h], sinks, h);
      const float f = sink.scale_m / (sum[h] * sink.scale_m + sink.sink_term);
      for (std::int64_t d = 0; d < dv; ++d) a[d] *= f;
    }
    if (s.out_fp32) std::memcpy(static_cast<float*>(out) + h * dv, a, dv * sizeof(float));
    else from_float(a, s.dtype, dv, static_cast<char*>(out) + h * dv * es);
  }
}

void generic_backward_query_row(const Shape& s, const QueryRow& query, const RowBackward& row,
                                const KeyRows& keys, void* scratch, void* d_query, void* d_query_rope) {
  const Padded L(s);
  const std::int64_t H = s.heads;
  float* q = align64(scratch);
  float* dq = q + H * L.qk;
  float* go = dq + H * L.qk;
  float* kb = go + H * L.v;
  load_query(s, L, query, s.scale, q);
  load_grad_out(s, L, row, go);
  std::fill(dq, dq + H * L.qk, 0.0f);
  for (std::int64_t first = 0; first < keys.count; first += kKeyBlock) {
    const std::int64_t n = std::min(kKeyBlock, keys.count - first);
    load_keys(s, L, keys, first, n, kb);
    for (std::int64_t h = 0; h < H; ++h) {
      if (row.max[h] == core::kNegInf) continue;
      for (std::int64_t k = 0; k < n; ++k) {
        const float* key = kb + k * L.qk;
        const float prob = std::exp(dot(q + h * L.qk, key, L.qk) - row.max[h]) * row.coef[h];
        const float dprob = dot(go + h * L.v, key, L.v);
        axpy(prob * (dprob - row.delta[h]), key, dq + h * L.qk, L.qk);
      }
    }
  }
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t h = 0; h < H; ++h) {
    float* r = dq + h * L.qk;
    for (std::int64_t d = 0; d < s.qk_dim(); ++d) r[d] *= s.scale;
    from_float(r, s.dtype, s.dim, static_cast<char*>(d_query) + h * s.dim * es);
    if (s.rope_dim) from_float(r + s.dim, s.dtype, s.rope_dim, static_cast<char*>(d_query_rope) + h * s.rope_dim * es);
  }
}

void generic_backward_key_block(const Shape& s, const KeyRows& block, const TokenEntries* tokens,
                                std::int64_t n_tokens, void* scratch, float* partial, void* d_main, void* d_rope) {
  const Padded L(s);
  const std::int64_t H = s.heads, dv = s.d_v;
  float* q = align64(scratch);
  float* go = q + H * L.qk;
  float* kb = go + H * L.v;
  float* dk = kb + s.owner_rows * L.qk;
  float* prob = dk + s.owner_rows * L.qk;
  float* dlogit = prob + H;
  load_keys(s, L, block, 0, block.count, kb);
  start_block_sums(s, partial, block.count, block.count, L.qk, dk);
  for (std::int64_t t = 0; t < n_tokens; ++t) {
    const TokenEntries& tok = tokens[t];
    load_query(s, L, tok.query, s.scale, q);
    load_grad_out(s, L, tok.row, go);
    for (std::int64_t e = 0; e < tok.count; ++e) {
      const std::int64_t o = tok.offsets[e];
      const float* key = kb + o * L.qk;
      for (std::int64_t h = 0; h < H; ++h) {
        if (tok.row.max[h] == core::kNegInf) {
          prob[h] = dlogit[h] = 0.0f;
          continue;
        }
        prob[h] = std::exp(dot(q + h * L.qk, key, L.qk) - tok.row.max[h]) * tok.row.coef[h];
        dlogit[h] = prob[h] * (dot(go + h * L.v, key, L.v) - tok.row.delta[h]);
      }
      float* d = dk + o * L.qk;
      // The key part: dS^T q (q is pre-scaled, which is the logit's scale), then
      // the value part on the first d_v dims: P^T dO. A head with max -inf adds
      // nothing (as in the reference): not 0 * a NaN of its query or grad_out.
      for (std::int64_t h = 0; h < H; ++h)
        if (tok.row.max[h] != core::kNegInf) axpy(dlogit[h], q + h * L.qk, d, L.qk);
      for (std::int64_t h = 0; h < H; ++h)
        if (tok.row.max[h] != core::kNegInf) axpy(prob[h], go + h * L.v, d, dv);
    }
  }
  if (keep_block_sums(s, dk, block.count, L.qk, partial)) return;
  const std::size_t es = dtype_size(s.dtype);
  for (std::int64_t k = 0; k < block.count; ++k) {
    from_float(dk + k * L.qk, s.dtype, s.dim, static_cast<char*>(d_main) + k * s.dim * es);
    if (s.rope_dim) from_float(dk + k * L.qk + s.dim, s.dtype, s.rope_dim, static_cast<char*>(d_rope) + k * s.rope_dim * es);
  }
}

std::size_t generic_packed_row_bytes(const Shape&) { return 0; }

}  // namespace

const AttentionKernel& DSA_GENERIC_KERNEL_NAME() {
  static const AttentionKernel kernel{DSA_GENERIC_KERNEL_LABEL, generic_scratch_bytes, generic_packed_row_bytes,
                                      generic_forward_row, generic_backward_query_row,
                                      generic_backward_key_block};
  return kernel;
}

}  // namespace dsa::cpu::attention_kernels
