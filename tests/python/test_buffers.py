"""dsa's pool for large CPU op outputs (python/dsa/_buffers.py): reuse only of
blocks no tensor holds, the limit, and ops that stay correct on pooled memory."""
from __future__ import annotations

import pytest
import torch

import dsa
from dsa import _buffers, dsa_compressor

CPU = torch.device("cpu")
MIB = 1 << 20


@pytest.fixture
def pool():
    """A fresh pool with the default limit, restored afterwards."""
    saved = _buffers._limit >> 20
    dsa.empty_buffer_pool()
    dsa.set_buffer_pool_limit(512)
    yield
    dsa.set_buffer_pool_limit(saved)
    dsa.empty_buffer_pool()


def test_free_block_is_reused_held_block_is_not(pool):
    a = _buffers.empty((1024, 512), torch.float32, CPU)  # 2 MiB
    a_ptr = a.data_ptr()
    b = _buffers.empty((512, 1024), torch.float32, CPU)
    assert b.data_ptr() != a_ptr  # a still holds its block
    view = a[3:]
    del a
    c = _buffers.empty((1024, 1024), torch.bfloat16, CPU)  # same bytes, other dtype
    assert c.data_ptr() != a_ptr  # the view keeps the block alive
    del view
    d = _buffers.empty((2 * MIB,), torch.uint8, CPU)
    assert d.data_ptr() == a_ptr
    assert d.shape == (2 * MIB,) and d.dtype == torch.uint8 and d.is_contiguous()
    stats = dsa.buffer_pool_stats()
    assert stats["blocks"] == 3 and stats["pooled_bytes"] == 6 * MIB and stats["free_bytes"] == 0


def test_small_and_off_pool_tensors_are_plain(pool):
    small = _buffers.empty((100, 100), torch.float32, CPU)
    assert dsa.buffer_pool_stats()["blocks"] == 0
    dsa.set_buffer_pool_limit(0)
    big = _buffers.empty((1024, 1024), torch.float32, CPU)
    assert dsa.buffer_pool_stats()["blocks"] == 0
    assert small.shape == (100, 100) and big.shape == (1024, 1024)


def test_limit_falls_back_and_empty_releases_free_blocks(pool):
    dsa.set_buffer_pool_limit(5)
    held = [_buffers.empty((MIB,), torch.float16, CPU) for _ in range(3)]  # 2 MiB each
    assert dsa.buffer_pool_stats()["pooled_bytes"] == 4 * MIB  # the third is a plain tensor
    assert all(t.numel() == MIB for t in held)
    del held[0]
    dsa.empty_buffer_pool()
    assert dsa.buffer_pool_stats()["pooled_bytes"] == 2 * MIB  # the held block stays
    with pytest.raises(ValueError, match="mib"):
        dsa.set_buffer_pool_limit(-1)


def _compressor_grads(kv, gate, bias, grad):
    kv, gate, bias = (t.detach().clone().requires_grad_(True) for t in (kv, gate, bias))
    out, _ = dsa_compressor(kv, gate, bias, ratio=4, backend="cpu")
    return (out,) + torch.autograd.grad(out, (kv, gate, bias), grad)


def test_compressor_outputs_on_pooled_memory_do_not_alias(pool):
    g = torch.Generator().manual_seed(0)
    kv, gate = (torch.randn(2048, 512, generator=g).bfloat16() for _ in range(2))  # 2 MiB each
    bias = torch.randn(4, 512, generator=g)
    grad = torch.randn(512, 256, generator=g).bfloat16()
    first = _compressor_grads(kv, gate, bias, grad)
    assert dsa.buffer_pool_stats()["blocks"] >= 2  # d kv and d gate came from the pool
    snapshot = [t.clone() for t in first]
    second = _compressor_grads(kv, 2 * gate, bias, grad)  # other values, while `first` is held
    for a, b in zip(first, snapshot):
        assert torch.equal(a, b)
    assert not torch.equal(first[2], second[2])
    dsa.set_buffer_pool_limit(0)
    plain = _compressor_grads(kv, gate, bias, grad)
    for a, b in zip(first, plain):
        assert torch.equal(a, b)


def test_gradient_accumulation_into_pooled_grad(pool):
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2048, 512, generator=g).bfloat16().requires_grad_(True)
    gate = torch.randn(2048, 512, generator=g).bfloat16()
    bias = torch.randn(4, 512, generator=g)
    out, _ = dsa_compressor(kv, gate, bias, ratio=4, backend="cpu")
    out.float().sum().backward()
    once = kv.grad.clone()
    out, _ = dsa_compressor(kv, gate, bias, ratio=4, backend="cpu")
    out.float().sum().backward()  # accumulates into the pooled .grad
    assert torch.equal(kv.grad, (once.float() * 2).bfloat16())


def _attention_grads(query, kv, grad):
    query, kv = (t.detach().clone().requires_grad_(True) for t in (query, kv))
    out, _, _ = dsa.dsa_sparse_attention(query, kv, scale=0.1, window=64, backend="cpu")
    return (out,) + torch.autograd.grad(out, (query, kv), grad)


def test_workspace_cache_reuse_gives_the_same_bits(pool):
    # The attention backward's packed operands (AMX: about 2 x (query + grad_out),
    # here 8 MiB) go back to the C++ core's workspace cache and are reused,
    # uninitialised, by the next call: the results must not change.
    g = torch.Generator().manual_seed(0)
    query = torch.randn(512, 16, 128, generator=g).bfloat16()
    kv = torch.randn(512, 128, generator=g).bfloat16()
    grad = torch.randn(512, 16, 128, generator=g).bfloat16()
    assert dsa.buffer_pool_stats()["workspace_cached_bytes"] == 0  # emptied by the fixture
    fresh = _attention_grads(query, kv, grad)
    cached = dsa.buffer_pool_stats()["workspace_cached_bytes"]
    if dsa._C.cpu_isa() in ("amx", "avx512_bf16"):  # only the pair kernels pack operands for phase 2
        assert cached >= 8 * MIB
    again = _attention_grads(query, kv, grad)
    for a, b in zip(fresh, again):
        assert torch.equal(a, b)
    dsa.empty_buffer_pool()
    assert dsa.buffer_pool_stats()["workspace_cached_bytes"] == 0
    saved = dsa._C.workspace_cache_limit()
    dsa.set_workspace_cache_limit(0)
    try:
        off = _attention_grads(query, kv, grad)
        assert dsa.buffer_pool_stats()["workspace_cached_bytes"] == 0
    finally:
        dsa._C.set_workspace_cache_limit(saved)
    for a, b in zip(fresh, off):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="mib"):
        dsa.set_workspace_cache_limit(-1)
