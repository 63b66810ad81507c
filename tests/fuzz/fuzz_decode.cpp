// libFuzzer target of the decode family: the paged caches' cache_write and
// cache_gather (bf16 and FP8 records, plain and ring block tables), over block
// tables and positions that may point anywhere.
#include "dsa/paged_cache.h"

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
  return 0;
}
