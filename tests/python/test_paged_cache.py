"""Paged caches: dsa_cache_write / dsa_cache_gather against torch's own
float8_e4m3fn cast and bf16 rounding, both backends, and bad input."""
import math

import pytest
import torch

import dsa
from dsa.paged_cache import _cache_gather_op, _cache_write_op, huge_page_zeros, new_paged_cache


def layout_cases():
    # (dim, rope_dim, dtype): V3.2 latent, indexer key, V4 latent (448 quantised values:
    # a short last scale group), and a bf16 latent.
    return [(576, 64, "fp8"), (128, 0, "fp8"), (512, 64, "fp8"), (576, 64, "bf16"), (128, 0, "bf16"),
            (576, 64, "fp32")]


def shuffled_table(batch, width, num_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[: batch * width].to(torch.int32).view(batch, width)


def values_of(batch, n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-12, 12, (batch, n, 1), generator=g).float())
    return torch.randn(batch, n, dim, generator=g) * magnitude


def torch_oracle(values, rope_dim, dtype):
    """What a cache read gives back, written with torch's casts: bf16 rounding, or
    per group of 128 a power-of-two scale 2^ceil(log2(amax / 448)) (at least 2^-126) and
    (x / scale).to(float8_e4m3fn)."""
    if dtype == "fp32":
        return values.clone()
    if dtype == "bf16":
        return values.to(torch.bfloat16).float()
    nq = values.shape[-1] - rope_dim
    out = values.clone().double()
    for g0 in range(0, nq, 128):
        group = values[..., g0:min(nq, g0 + 128)].double()
        amax = group.abs().amax(-1, keepdim=True)
        # At least 2^-126 (docs/serving.md): 1 / scale stays a finite fp32.
        scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448.0))).clamp(min=2.0 ** -126),
                            torch.ones_like(amax))
        q = (group / scale).float().to(torch.float8_e4m3fn)
        out[..., g0:min(nq, g0 + 128)] = q.double() * scale
    out[..., nq:] = values[..., nq:].to(torch.bfloat16).double()
    return out.float()


@pytest.mark.parametrize("dim,rope_dim,dtype", layout_cases())
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_write_then_gather_matches_torch(dim, rope_dim, dtype, backend):
    batch, n, block = 3, 37, 16
    width = math.ceil((n + 2) / block)
    cache = dsa.new_paged_cache(batch * width + 2, dim, rope_dim=rope_dim, dtype=dtype, block_size=block)
    assert cache.shape[-1] == dsa.cache_token_bytes(dim, rope_dim, dtype)
    table = shuffled_table(batch, width, cache.shape[0], seed=dim + rope_dim)
    values = values_of(batch, n, dim, seed=7)
    positions = (torch.arange(n) + torch.arange(batch).view(-1, 1)).to(torch.int64)
    positions[1, 5] = -1  # skipped
    dsa.dsa_cache_write(cache, table, positions, values, rope_dim=rope_dim, dtype=dtype, backend=backend)
    back = dsa.dsa_cache_gather(cache, table, positions, dim=dim, rope_dim=rope_dim, dtype=dtype, backend=backend)
    want = torch_oracle(values, rope_dim, dtype)
    want[1, 5] = 0
    torch.testing.assert_close(back, want, rtol=0, atol=0)
    # The FP8 bytes are torch's float8_e4m3fn bytes: look at one record.
    if dtype == "fp8":
        b, i = 2, 30
        pos = int(positions[b, i])
        record = cache[table[b, pos // block], pos % block]
        scale = float(2.0 ** math.ceil(math.log2(float(values[b, i, :128].abs().max()) / 448.0)))
        q = (values[b, i, :128] / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(record[:128], q)
        assert record[dim - rope_dim:dim - rope_dim + 4].view(torch.float32).item() == scale


def test_backends_write_the_same_bytes_and_bf16_gather():
    dim, rope_dim = 576, 64
    table = shuffled_table(2, 3, 8, seed=1)
    values = values_of(2, 40, dim, seed=2).to(torch.bfloat16)
    positions = torch.arange(40, dtype=torch.int32).repeat(2, 1)
    caches = []
    for backend in ("reference", "cpu"):
        cache = dsa.new_paged_cache(8, dim, rope_dim=rope_dim, dtype="fp8", block_size=16)
        dsa.dsa_cache_write(cache, table, positions, values, rope_dim=rope_dim, dtype="fp8", backend=backend)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    back = dsa.dsa_cache_gather(caches[0], table, positions, dim=dim, rope_dim=rope_dim, dtype="fp8",
                                out_dtype=torch.bfloat16)
    # e4m3 times a power of two is exact in bf16.
    full = dsa.dsa_cache_gather(caches[0], table, positions, dim=dim, rope_dim=rope_dim, dtype="fp8")
    assert torch.equal(back.float(), full)


def test_ring_cache_keeps_the_last_window():
    # A ring of 2 columns of 4 tokens: position p lands in column (p // 4) % 2.
    cache = dsa.new_paged_cache(4, 8, block_size=4)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    for p in range(12):
        v = torch.full((1, 1, 8), float(p))
        dsa.dsa_cache_write(cache, table, torch.tensor([[p]]), v, ring=True)
    back = dsa.dsa_cache_gather(cache, table, torch.arange(4, 12).view(1, -1), dim=8, ring=True)
    assert torch.equal(back[0, :, 0], torch.arange(4, 12).float())
    # Position 1 was overwritten by 9 (same column, same row): a ring holds the last
    # width * block_size tokens only; the decode ops, which know each request's
    # length, check that their window fits the ring.
    old = dsa.dsa_cache_gather(cache, table, torch.tensor([[1]]), dim=8, ring=True)
    assert old[0, 0, 0].item() == 9.0


def test_new_cache_is_zeroed_and_starts_on_a_huge_page():
    big = new_paged_cache(40, 576, rope_dim=64)  # 2.8 MiB: huge-page backed
    assert big.shape == (40, 64, 1152) and big.dtype == torch.uint8 and big.is_contiguous()
    assert big.data_ptr() % (2 << 20) == 0 and not big.any()
    small = new_paged_cache(2, 128, rope_dim=0, dtype="fp8", block_size=16)  # under 2 MiB: plain zeros
    assert small.shape == (2, 16, 132) and not small.any()
    # Written and read back through the ops like any cache.
    table = torch.arange(40, dtype=torch.int32).view(1, 40)
    values = torch.randn(1, 100, 576).bfloat16()
    pos = torch.arange(100, dtype=torch.int32).view(1, 100)
    dsa.dsa_cache_write(big, table, pos, values, rope_dim=64, dtype="bf16")
    back = dsa.dsa_cache_gather(big, table, pos, dim=576, rope_dim=64, dtype="bf16", out_dtype=torch.bfloat16)
    assert torch.equal(back, values)
    assert huge_page_zeros((3, 5)).shape == (3, 5)


def test_bad_input_names_the_argument():
    cache = dsa.new_paged_cache(4, 128, dtype="fp8", block_size=4)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    values = torch.randn(2, 3, 128)
    pos = torch.tensor([[0, 1, 2], [0, 1, 2]])
    dsa.dsa_cache_write(cache, table, pos, values, dtype="fp8")
    with pytest.raises(ValueError, match="positions"):
        dsa.dsa_cache_write(cache, table, torch.tensor([[0, 1, 8], [0, 1, 2]]), values, dtype="fp8")
    with pytest.raises(ValueError, match="same cache slot"):
        dsa.dsa_cache_write(cache, table, torch.tensor([[0, 1, 1], [0, 1, 2]]), values, dtype="fp8")
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
        dsa.dsa_cache_write(cache, torch.tensor([[0, 1], [4, 3]], dtype=torch.int32), pos, values, dtype="fp8")
    with pytest.raises(ValueError, match="bytes per token"):
        dsa.dsa_cache_write(cache, table, pos, values, dtype="bf16")
    with pytest.raises(ValueError, match="cache_dtype"):
        dsa.dsa_cache_write(cache, table, pos, values, dtype="int4")
    with pytest.raises(ValueError, match="block_table"):
        dsa.dsa_cache_write(cache, table.long(), pos, values, dtype="fp8")
    with pytest.raises(ValueError, match="out_dtype"):
        dsa.dsa_cache_gather(cache, table, pos, dim=128, dtype="fp8", out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"positions: expected \[B, n\]"):
        dsa.dsa_cache_gather(cache, table, pos[0], dim=128, dtype="fp8")


def test_opcheck():
    cache = dsa.new_paged_cache(4, 128, dtype="fp8", block_size=4)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    pos = torch.tensor([[0, 1, 2], [0, 1, 2]])
    values = torch.randn(2, 3, 128)
    torch.library.opcheck(_cache_write_op, (cache, table, pos, values, 0, "fp8", False, "cpu"))
    torch.library.opcheck(_cache_gather_op, (cache, table, pos, 128, 0, "fp8", False, torch.float32, "cpu"))
