// libFuzzer target of the decode family: the paged caches' cache_write and
// cache_gather (bf16 and FP8 records, plain and ring block tables), and the
// decode ops that read them in place (indexer_decode, sparse_attention_decode),
// over block tables, positions, context lengths and indices that may point
// anywhere.
#include "dsa/indexer_decode.h"
#include "dsa/paged_cache.h"
#include "dsa/sparse_attention_decode.h"

#include "fuzz_common.h"

using namespace dsa_fuzz;

namespace {

struct CacheInput {
  dsa::CacheLayout layout;
  std::int64_t blocks = 0, block_size = 0, width = 0;
  TensorView cache, block_table;
};

// A cache of some DeepSeek layout (or any), random bytes, and a block table of
// ids mostly in range. False: skip the input (too large).
bool make_cache(Input& in, Arena& a, std::int64_t batch, CacheInput& c) {
  c.layout.dtype = in.rare(16) ? static_cast<dsa::CacheDType>(in.range(0, 4))
                               : in.pick<dsa::CacheDType>({dsa::CacheDType::bf16, dsa::CacheDType::fp8_e4m3, dsa::CacheDType::f32});
  const std::int64_t dim = in.pick<std::int64_t>({128, 576, 512, 8, 130});
  c.layout.dim = in.param(dim, 700);
  c.layout.rope_dim = in.param(dim == 576 || dim == 512 ? 64 : 0, 700);
  c.layout.ring = in.rare(4);
  c.block_size = in.size(4, 80);
  c.blocks = in.size(6, 40);
  c.width = in.size(3, 12);
  std::int64_t token_bytes = 0;
  try {
    token_bytes = dsa::cache_token_bytes(c.layout);
  } catch (const dsa::Error&) {
    token_bytes = in.range(0, 700);  // the op must reject the layout
  }
  if (in.rare(16)) token_bytes += in.range(-2, 2);
  if (!a.view(c.cache, in.dtype(DType::u8), {c.blocks, c.block_size, token_bytes}) ||
      !a.view(c.block_table, in.dtype(DType::i32), {batch, c.width}))
    return false;
  a.fill_bytes(c.cache);
  a.fill_indices(c.block_table, plain(c.blocks), in.rare(8));
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  choose_isa(in);
  Arena a(in);
  const std::int64_t batch = in.size(2, 5), n = in.size(3, 40);
  CacheInput c;
  if (!make_cache(in, a, batch, c)) return 0;
  if (work({plain(batch), plain(n), plain(c.layout.dim), 128}) > kMaxWork) return 0;

  dsa::CacheWriteParams params;
  params.layout = c.layout;
  params.num_threads = in.num_threads();
  TensorView positions, values, out;
  if (!a.view(positions, in.dtype(DType::i32), {batch, n}) ||
      !a.view(values, in.dtype(in.float_dtype()), {batch, n, c.layout.dim}) ||
      !a.view(out, in.dtype(in.pick<DType>({DType::f32, DType::bf16})), {batch, n, c.layout.dim}))
    return 0;
  // Positions mostly inside what the table covers, -1 now and then, sometimes wild.
  a.fill_indices(positions, plain(c.width) * plain(c.block_size), in.rare(8));
  a.fill(values, FloatFill{4.0f, in.rare(4)});

  const std::vector<dsa::Backend> backends_used = backends(in);
  Agreement write("cache_write");
  for (dsa::Backend backend : backends_used)
    write.run([&] { dsa::cache_write(c.cache, c.block_table, positions, values, params, backend); });
  Agreement gather("cache_gather");
  for (dsa::Backend backend : backends_used)
    gather.run([&] { dsa::cache_gather(c.cache, c.block_table, positions, params, out, backend); });

  // The decode ops over the cache just written: next_n rows of H heads per
  // request, context lengths mostly within what the table covers.
  const std::int64_t next_n = in.size(2, 5), heads = in.size(3, 9), topk = in.param(16, 300);
  const std::int64_t dim = c.layout.dim, keys = plain(c.width) * plain(c.block_size);
  if (work({plain(batch), plain(next_n), plain(heads), plain(dim), plain(keys), 4}) > kMaxWork) return 0;
  TensorView lens, query, weights, indices, topk_lens, sinks, attn_out, lse, index_out;
  if (!a.view(lens, in.dtype(in.pick<DType>({DType::i32, DType::i64})), {batch}) ||
      !a.view(query, in.dtype(in.float_dtype()), {batch, next_n, heads, dim}) ||
      !a.view(weights, in.dtype(in.float_dtype()), {batch, next_n, heads}) ||
      !a.view(indices, in.dtype(DType::i32), {batch, next_n, topk}) ||
      !a.view(topk_lens, in.dtype(DType::i32), {batch}) || !a.view(sinks, in.dtype(DType::f32), {heads}) ||
      !a.view(index_out, in.dtype(DType::i32), {batch, next_n, topk}))
    return 0;
  // Context lengths: next_n plus what the table covers, now and then anything.
  // (Only views whose extent the arena allocated: a stride of 2^55 claims memory it did not.)
  if (lens.data && lens.ndim == 1 && lens.shape[0] > 0 && lens.shape[0] <= 64 && lens.strides[0] >= 0 &&
      lens.strides[0] <= 16)
    for (std::int64_t i = 0; i < lens.shape[0]; ++i) {
      const std::int64_t v = in.rare(16) ? in.range(-3, 1ll << 40) : std::clamp<std::int64_t>(next_n, 0, 1 << 20) + in.range(0, static_cast<std::int64_t>(keys));
      const std::int64_t at = i * lens.strides[0];
      if (lens.dtype == DType::i64) static_cast<std::int64_t*>(lens.data)[at] = v;
      else if (lens.dtype == DType::i32) static_cast<std::int32_t*>(lens.data)[at] = static_cast<std::int32_t>(v);
    }
  a.fill(query, FloatFill{2.0f, in.rare(8)});
  a.fill(weights, FloatFill{1.0f, in.rare(8)});
  a.fill(sinks, FloatFill{2.0f, in.rare(8)});
  a.fill_indices(indices, static_cast<std::int64_t>(keys), in.rare(8));
  a.fill_indices(topk_lens, std::clamp<std::int64_t>(topk, 0, 1 << 20), in.rare(8));

  dsa::IndexerDecodeParams ip;
  ip.topk = topk;
  ip.scale = in.real(0.5f);
  ip.cmp_ratio = in.param(1, 8);
  ip.key_layout = c.layout;
  ip.num_threads = in.num_threads();
  Agreement index("indexer_decode");
  for (dsa::Backend backend : backends_used)
    index.run([&] { dsa::indexer_decode(query, weights, c.cache, c.block_table, lens, ip, index_out, backend); });

  dsa::SparseAttentionDecodeParams sp;
  sp.scale = in.real(0.1f);
  sp.d_v = in.param(0, std::clamp<std::int64_t>(dim, 0, 1 << 20) + 2);
  sp.window = in.rare(4) ? in.range(0, 40) : 0;
  sp.kv_layout = c.layout;
  sp.num_threads = in.num_threads();
  dsa::SparseAttentionDecodeInputs si;
  si.query = query;
  si.kv_cache = c.cache;
  si.block_table = c.block_table;
  si.context_lens = lens;
  if (!in.rare(4)) si.indices = indices;
  if (in.rare(2)) si.topk_lens = topk_lens;
  if (in.rare(2)) si.sinks = sinks;
  if (in.rare(4)) {  // V4: the same cache as the compressed stream too
    si.cmp_cache = c.cache;
    si.cmp_block_table = c.block_table;
    sp.cmp_ratio = in.param(4, 8);
    sp.cmp_layout = c.layout;
    if (in.flag()) si.cmp_indices = indices;
  }
  const std::int64_t dv = sp.d_v == 0 ? dim : sp.d_v;
  if (!a.view(attn_out, in.dtype(query.dtype), {batch, next_n, heads, dv}) ||
      !a.view(lse, in.dtype(DType::f32), {batch, next_n, heads}))
    return 0;
  Agreement attention("sparse_attention_decode");
  for (dsa::Backend backend : backends_used)
    attention.run([&] { dsa::sparse_attention_decode(si, sp, attn_out, lse, backend); });
  return 0;
}
