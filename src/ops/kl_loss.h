// Internal: the KL-loss problems (sparse 4.3, dense warm-up 4.4) after
// validation, shared by their backends.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/numeric.h"
#include "core/sequences.h"
#include "dsa/kl_loss.h"
#include "dsa/tensor.h"

namespace dsa {

// A [rows, heads, dim] tensor with unit stride in dim (BSND rows merged).
// Absent when data is null.
struct HeadMatrix {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t row_stride = 0, head_stride = 0;
  std::int64_t heads = 0, dim = 0;

  bool present() const { return data != nullptr; }
  std::int64_t offset(std::int64_t row, std::int64_t head) const {
    return row * row_stride + head * head_stride;
  }
  float at(std::int64_t row, std::int64_t head, std::int64_t d) const {
    return core::load_float(data, dtype, offset(row, head) + d);
  }
  const char* bytes(std::int64_t row, std::int64_t head) const {
    return static_cast<const char*>(data) + offset(row, head) * dtype_size(dtype);
  }
};

// What the sparse KL's forward and backward share: the indexer side (indices,
// the indexer's query, key and head weights) and the sequences.
struct SparseKlIndexerSide {
  const std::int32_t* indices = nullptr;  // [rows, topk]
  std::int64_t index_row_stride = 0, topk = 0;
  HeadMatrix index_query;  // [rows, Hi, Di]
  HeadMatrix index_key;    // [key rows, 1, Di]
  HeadMatrix weights;      // [rows, Hi, 1]
  float index_scale = 1.0f;
  std::int64_t ratio = 1;
  int num_threads = 1;
  core::SequencePlan plan;  // keys of sequence b: rows [c_begin, c_begin + c_len)

  // Whether entry `idx` of query i of `seq` is read (section 2).
  bool valid(const core::SequenceSlice& seq, std::int64_t i, std::int32_t idx) const {
    return idx >= 0 && idx < seq.c_len && idx < visible_compressed(seq.position(i), ratio);
  }

  // Whether some sequence has a key. Only then do the key dims address memory, so only
  // then may a kernel size buffers from them: without keys a [0, 2^40] key tensor is
  // legal (found by fuzz_kl_loss).
  bool any_key_rows() const {
    return std::any_of(plan.seqs.begin(), plan.seqs.end(), [](const core::SequenceSlice& s) { return s.c_len > 0; });
  }
};

struct SparseKlProblem : SparseKlIndexerSide {
  HeadMatrix query, query_rope;  // [rows, H, D], [rows, H, Dr]
  HeadMatrix kv, key_rope;       // [key rows, 1, D], [key rows, 1, Dr]
  const float* softmax_max = nullptr;  // [rows, H] contiguous
  const float* softmax_sum = nullptr;
  const float* sinks = nullptr;  // [H] or null
  float scale = 1.0f, coefficient = 1.0f;
  Reduction reduction = Reduction::mean;
  float* loss = nullptr;        // one element
  float* score_grad = nullptr;  // [rows, topk] contiguous, or null
};

struct SparseKlBackwardProblem : SparseKlIndexerSide {
  const float* score_grad = nullptr;  // [rows, topk] contiguous
  float grad_loss = 1.0f;
  std::int64_t key_rows = 0;  // rows of the flattened index_key
  void* d_index_query = nullptr;  // contiguous, dtypes of the inputs
  void* d_index_key = nullptr;
  void* d_weights = nullptr;
};

struct DenseLseProblem {
  HeadMatrix index_query, index_key, weights;
  float scale = 1.0f;
  std::int64_t ratio = 1;
  int num_threads = 1;
  core::SequencePlan plan;
  float* lse = nullptr;  // [rows]
};

// Dense KL, forward (loss) and backward (gradients) share one description.
struct DenseKlProblem {
  HeadMatrix index_query, index_key, weights;  // [rows, Hi, Di], [S, 1, Di], [rows, Hi, 1]
  HeadMatrix query, query_rope;                // [rows, H, D]
  HeadMatrix key, key_rope;                    // [S, Hk, D]
  const float* softmax_max = nullptr;          // [rows, H] contiguous
  const float* softmax_sum = nullptr;
  const float* lse = nullptr;  // [rows]
  float scale = 1.0f, index_scale = 1.0f, coefficient = 1.0f;
  Reduction reduction = Reduction::mean;
  int num_threads = 1;
  core::SequencePlan plan;
  std::int64_t key_rows = 0;
  // forward
  float* loss = nullptr;
  // backward
  float grad_loss = 1.0f;
  void* d_index_query = nullptr;
  void* d_index_key = nullptr;
  void* d_weights = nullptr;

  std::int64_t group() const { return query.heads / key.heads; }  // query heads per key head
};

// Rows that take part in the mean: those with at least one valid entry.
inline double reduction_factor(Reduction reduction, float coefficient, std::int64_t counted_rows) {
  if (reduction == Reduction::sum) return coefficient;
  return counted_rows > 0 ? static_cast<double>(coefficient) / static_cast<double>(counted_rows) : 0.0;
}

namespace reference {
void kl_loss_fwd(const SparseKlProblem& p);
void kl_loss_bwd(const SparseKlBackwardProblem& p);
void dense_indexer_lse(const DenseLseProblem& p);
void dense_indexer_kl_loss_fwd(const DenseKlProblem& p);
void dense_indexer_kl_loss_bwd(const DenseKlProblem& p);
}  // namespace reference
namespace cpu {
void kl_loss_fwd(const SparseKlProblem& p);
void kl_loss_bwd(const SparseKlBackwardProblem& p);
void dense_indexer_lse(const DenseLseProblem& p);
void dense_indexer_kl_loss_fwd(const DenseKlProblem& p);
void dense_indexer_kl_loss_bwd(const DenseKlProblem& p);
}  // namespace cpu

}  // namespace dsa

namespace dsa::detail {

// Views `t` ([lead..., rows, heads, dim] or, without a head dim, [lead..., rows, dim])
// as a HeadMatrix; BSND leading dims must merge into rows. Absent views give an
// absent matrix.
HeadMatrix head_matrix(const TensorView& t, int lead, const char* name);

// A caller-allocated gradient: present, CPU, contiguous, same shape and dtype as `input`.
void require_gradient_output(const TensorView& grad, const TensorView& input, const char* name);

// fp32 [rows, H] statistics of the main attention.
void require_statistics(const TensorView& t, const char* name, const TensorView& query, int lead);

}  // namespace dsa::detail
