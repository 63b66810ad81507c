"""Allocation failure: when a kernel's scratch or workspace, or an op's output,
cannot be allocated, the call raises RuntimeError naming the op and the bytes,
the process goes on, and dsa's caches are released first (they may hold exactly
the memory the call needs), so the next call works.

Three ways to make memory run out: dsa's test cap on its own allocator
(_C.set_scratch_memory_limit), an output too large for any machine, and a real
address-space limit (RLIMIT_AS) in a child process.
"""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import dsa
from dsa import _C


def attention_backward(tokens: int, seed: int = 0):
    """The attention backward: its packed operands are the largest workspace dsa takes."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(tokens, 16, 128, generator=g).bfloat16().requires_grad_()
    kv = torch.randn(tokens, 128, generator=g).bfloat16().requires_grad_()
    idx = torch.randint(0, tokens, (tokens, 32), generator=g, dtype=torch.int32)
    out, _, _ = dsa.dsa_sparse_attention(query, kv, idx, scale=0.1)
    return torch.autograd.grad(out.float().sum(), (query, kv))


@pytest.fixture
def allocator():
    """Restores the cap and the cache's limit after each test."""
    cap, limit = _C.scratch_memory_limit(), _C.workspace_cache_limit()
    _C.release_workspace_cache()
    yield
    _C.set_scratch_memory_limit(cap)
    _C.set_workspace_cache_limit(limit)


def test_scratch_failure_names_op_and_size_and_the_next_call_works(allocator):
    expected = attention_backward(512)
    assert _C.workspace_cache_bytes() > 0  # the packed operands went back to the cache
    _C.set_scratch_memory_limit(_C.scratch_memory_bytes() + 4096)  # nothing large fits
    with pytest.raises(RuntimeError) as info:
        attention_backward(512)
    message = str(info.value)
    assert not isinstance(info.value, ValueError)
    assert re.search(r"sparse_attention_bwd: out of memory: could not allocate \d+ bytes \([\d.]+ MiB\)", message), message
    assert _C.workspace_cache_bytes() == 0  # released before giving up
    _C.set_scratch_memory_limit(0)
    for a, b in zip(attention_backward(512), expected):
        assert torch.equal(a, b)


def test_cache_is_released_so_a_larger_call_fits(allocator):
    """A cached workspace plus the next call's would exceed the cap, the next call's
    alone would not: the call must succeed, by giving the cached one up."""
    expected = attention_backward(1400)
    large = _C.workspace_cache_bytes()  # the larger call's workspace, now idle
    _C.release_workspace_cache()
    attention_backward(500)
    small = _C.workspace_cache_bytes()
    assert 0 < small and 2 * small < large  # too small to be reused for the larger call
    others = _C.scratch_memory_bytes() - small  # live bytes besides the cached buffer (none expected)
    _C.set_scratch_memory_limit(others + large + small // 2)
    for a, b in zip(attention_backward(1400), expected):
        assert torch.equal(a, b)
    assert _C.workspace_cache_bytes() == large  # the small buffer went, the large one is idle now


def test_output_too_large_for_any_machine(allocator):
    q, k, w = torch.randn(4, 2, 8), torch.randn(4, 8), torch.randn(4, 2)
    # A pooled output freed: the buffer pool holds a free block, which the failure must release.
    dsa.set_buffer_pool_limit(64)
    # The collector is off until the end, so that no block is freed behind the test's
    # back: a pooled output that an earlier test (or a process's first op call) left
    # in a reference cycle became free when a collection ran between the release and
    # the check below (free_bytes 6 MiB, once in 2026-12-02's runs).
    gc.collect()
    gc.disable()
    try:
        dsa.dsa_indexer(torch.randn(4096, 1, 8), torch.randn(4096, 8), torch.randn(4096, 1), topk=128)
        gc.collect()  # now, not later
        assert dsa.buffer_pool_stats()["free_bytes"] > 0
        topk = 1 << 42  # indices [4, 2^42] int32: 64 TiB
        with pytest.raises(RuntimeError) as info:
            dsa.dsa_indexer(q, k, w, topk=topk)
        message = str(info.value)
        assert f"dsa_indexer: out of memory: could not allocate {4 * topk * 4} bytes" in message, message
        assert dsa.buffer_pool_stats()["free_bytes"] == 0
    finally:
        gc.enable()
    assert dsa.dsa_indexer(q, k, w, topk=2).shape == (4, 2)
    dsa.set_buffer_pool_limit(int(os.environ.get("DSA_BUFFER_POOL_MIB", "512")))


# A real limit: the address space capped at what the process maps plus 160 MiB,
# after a warm-up call started every thread. The backward's outputs (d_query
# 32 MiB) still fit, its packed operands (~200 MiB here) do not.
RLIMIT_CHILD = """
    import re, resource, torch, dsa
    from test_allocation import attention_backward
    attention_backward(256)
    g = torch.Generator().manual_seed(0)
    query = torch.randn(8192, 16, 128, generator=g).bfloat16().requires_grad_()
    kv = torch.randn(8192, 128, generator=g).bfloat16().requires_grad_()
    idx = torch.randint(0, 8192, (8192, 8), generator=g, dtype=torch.int32)
    out, _, _ = dsa.dsa_sparse_attention(query, kv, idx, scale=0.1)
    grad = torch.ones_like(out)
    dsa.empty_buffer_pool()
    mapped = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (160 << 20), hard))
    try:
        torch.autograd.grad(out, (query, kv), grad, retain_graph=True)
        print("NO ERROR")
    except RuntimeError as e:
        print("ERROR", e)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    d_query, _ = torch.autograd.grad(out, (query, kv), grad)
    print("AFTER", bool(torch.isfinite(d_query.float()).all()))
"""


def test_real_address_space_limit():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RLIMIT_CHILD)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    error = [line for line in lines if line.startswith(("ERROR", "NO ERROR"))]
    assert error and re.search(r"sparse_attention_bwd: out of memory: could not allocate \d+ bytes", error[0]), lines
    assert "AFTER True" in lines, lines
