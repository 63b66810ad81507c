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
    """The attention backward: where its kernel packs its operands (bf16 on AMX and
    avx512_bf16, the pair kernels) they are the largest workspace dsa takes."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(tokens, 16, 128, generator=g).bfloat16().requires_grad_()
    kv = torch.randn(tokens, 128, generator=g).bfloat16().requires_grad_()
    idx = torch.randint(0, tokens, (tokens, 32), generator=g, dtype=torch.int32)
    out, _, _ = dsa.dsa_sparse_attention(query, kv, idx, scale=0.1)
    return torch.autograd.grad(out.float().sum(), (query, kv))


def compressor_backward(tokens: int, channels: int = 2048, seed: int = 0):
    """The HCA compressor backward: its per-group position-bias gradient partials
    (one per 1024 tokens, ratio x channels fp32: 1 MiB at 2048 channels) are a
    workspace at every ISA, cached from 4 MiB on."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(tokens, channels, generator=g).bfloat16().requires_grad_()
    gate = torch.randn(tokens, channels, generator=g).bfloat16().requires_grad_()
    bias = (torch.randn(128, channels, generator=g) * 0.1).requires_grad_()
    out, _ = dsa.dsa_compressor(kv, gate, bias, ratio=128)
    return torch.autograd.grad(out.float().sum(), (kv, gate, bias))


# The AVX2 and AVX-512 FMA attention kernels pack nothing (a Zen 3 takes no
# attention workspace), so the attention variant runs only where the pair kernels
# do; the compressor variant runs on every CPU. Each: (call, op in the error,
# its small and large sizes for the cache test).
ATTENTION_PACKS = _C.cpu_isa() in ("amx", "avx512_bf16")
WORKLOADS = {"compressor": (compressor_backward, "compressor_bwd", 5120, 12288)}
if ATTENTION_PACKS:
    WORKLOADS["attention"] = (attention_backward, "sparse_attention_bwd", 500, 1400)


@pytest.fixture
def allocator():
    """Restores the cap and the cache's limit after each test."""
    cap, limit = _C.scratch_memory_limit(), _C.workspace_cache_limit()
    _C.release_workspace_cache()
    yield
    _C.set_scratch_memory_limit(cap)
    _C.set_workspace_cache_limit(limit)


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_scratch_failure_names_op_and_size_and_the_next_call_works(allocator, workload):
    run, op, small_tokens, large_tokens = WORKLOADS[workload]
    expected = run(small_tokens)
    assert _C.workspace_cache_bytes() > 0  # the workspace went back to the cache
    _C.set_scratch_memory_limit(_C.scratch_memory_bytes() + 4096)  # nothing large fits
    with pytest.raises(RuntimeError) as info:
        run(large_tokens)  # the cached workspace is too small for it
    message = str(info.value)
    assert not isinstance(info.value, ValueError)
    assert re.search(op + r": out of memory: could not allocate \d+ bytes \([\d.]+ MiB\)", message), message
    assert _C.workspace_cache_bytes() == 0  # released before giving up
    _C.set_scratch_memory_limit(0)
    for a, b in zip(run(small_tokens), expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_cache_is_released_so_a_larger_call_fits(allocator, workload):
    """A cached workspace plus the next call's would exceed the cap, the next call's
    alone would not: the call must succeed, by giving the cached one up."""
    run, _, small_tokens, large_tokens = WORKLOADS[workload]
    expected = run(large_tokens)
    large = _C.workspace_cache_bytes()  # the larger call's workspace, now idle
    _C.release_workspace_cache()
    run(small_tokens)
    small = _C.workspace_cache_bytes()
    assert 0 < small and 2 * small < large  # too small to be reused for the larger call
    others = _C.scratch_memory_bytes() - small  # live bytes besides the cached buffer (none expected)
    _C.set_scratch_memory_limit(others + large + small // 2)
    for a, b in zip(run(large_tokens), expected):
        assert torch.equal(a, b)
    # The small call's buffers went, the large call's are idle now: at most what it
    # left behind alone (its per-thread scratch vectors are cached too, and those it
    # had already returned when the cap was reached were given up with the small ones).
    assert 0 < _C.workspace_cache_bytes() <= large


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
        # indices [512, 2^31 - 1] int32: 4 TiB (the largest topk int32 positions allow;
        # a larger one is refused as an argument before anything is allocated)
        T, topk = 512, (1 << 31) - 1
        big = torch.randn(T, 2, 8), torch.randn(T, 8), torch.randn(T, 2)
        with pytest.raises(RuntimeError) as info:
            dsa.dsa_indexer(*big, topk=topk)
        message = str(info.value)
        assert f"dsa_indexer: out of memory: could not allocate {T * topk * 4} bytes" in message, message
        assert dsa.buffer_pool_stats()["free_bytes"] == 0
    finally:  # a failure here must not leave later tests a 64 MiB pool (test_bench's peak memory read 0)
        gc.enable()
        dsa.set_buffer_pool_limit(int(os.environ.get("DSA_BUFFER_POOL_MIB", "512")))
    assert dsa.dsa_indexer(q, k, w, topk=2).shape == (4, 2)


# A real limit: the address space capped at what the process maps plus a
# headroom, after a warm-up call started every thread.
# - attention (where its kernel packs): headroom 160 MiB. The backward's outputs
#   (d_query 32 MiB) still fit, its packed operands (~200 MiB here) do not.
# - compressor (every CPU): headroom 8 MiB. A warm-up at the same size leaves the
#   outputs' blocks (d kv, d gate: 128 MiB each) free in dsa's buffer pool, which
#   hands them out again without mapping; the workspace cache is emptied, so the
#   32 MiB of bias-gradient partials must be mapped anew, and do not fit.
RLIMIT_CHILD = {
    "attention": """
        import re, resource, torch, dsa
        from test_allocation import attention_backward
        attention_backward(256)
        g = torch.Generator().manual_seed(0)
        query = torch.randn(8192, 16, 128, generator=g).bfloat16().requires_grad_()
        kv = torch.randn(8192, 128, generator=g).bfloat16().requires_grad_()
        idx = torch.randint(0, 8192, (8192, 8), generator=g, dtype=torch.int32)
        out, _, _ = dsa.dsa_sparse_attention(query, kv, idx, scale=0.1)
        inputs, headroom = (query, kv), 160 << 20
        dsa.empty_buffer_pool()
    """,
    "compressor": """
        import re, resource, torch, dsa
        from dsa import _C
        g = torch.Generator().manual_seed(0)
        kv = torch.randn(16384, 4096, generator=g).bfloat16().requires_grad_()
        gate = torch.randn(16384, 4096, generator=g).bfloat16().requires_grad_()
        bias = torch.zeros(128, 4096).requires_grad_()
        out, _ = dsa.dsa_compressor(kv, gate, bias, ratio=128)
        inputs, headroom = (kv, gate, bias), 8 << 20
        warm = torch.autograd.grad(out, inputs, torch.ones_like(out), retain_graph=True)
        del warm
        _C.release_workspace_cache()
    """,
}
RLIMIT_CHECK = """
    grad = torch.ones_like(out)
    mapped = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, hard))
    try:
        torch.autograd.grad(out, inputs, grad, retain_graph=True)
        print("NO ERROR")
    except RuntimeError as e:
        print("ERROR", e)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    first = torch.autograd.grad(out, inputs, grad)[0]
    print("AFTER", bool(torch.isfinite(first.float()).all()))
"""


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_real_address_space_limit(workload):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = textwrap.dedent(RLIMIT_CHILD[workload]) + textwrap.dedent(RLIMIT_CHECK)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    error = [line for line in lines if line.startswith(("ERROR", "NO ERROR"))]
    op = WORKLOADS[workload][1]
    assert error and re.search(op + r": out of memory: could not allocate \d+ bytes", error[0]), lines
    assert "AFTER True" in lines, lines
