"""Where dsa's fused kernels run their parallel regions from Python: PyTorch's
OpenMP team (when torch uses OpenMP) or dsa's own pool. Both must give the
same bits, for any thread count."""
from __future__ import annotations

import pytest
import torch

import dsa
from dsa import _C, dsa_compressor, dsa_indexer


def _runs(fn):
    """fn() under dsa's own pool and under the OpenMP runner."""
    results = []
    try:
        for openmp in (False, True):
            _C.use_openmp_threads(openmp)
            results.append(fn())
    finally:
        _C.use_openmp_threads(bool(dsa.THREAD_RUNTIME))
    return results


def test_openmp_runner_is_found_when_torch_uses_openmp():
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch build does not use OpenMP")
    assert "gomp" in dsa.THREAD_RUNTIME or "iomp" in dsa.THREAD_RUNTIME
    assert _C.use_openmp_threads(False) == ""
    assert _C.use_openmp_threads(True) == dsa.THREAD_RUNTIME


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_same_bits_on_either_thread_team(threads):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(3000, 256, generator=g).bfloat16().requires_grad_()
    gate = torch.randn(3000, 256, generator=g).bfloat16().requires_grad_()
    bias = torch.randn(16, 256, generator=g).requires_grad_()  # 16 slots: the statistics path
    q = torch.randn(300, 4, 64, generator=g).bfloat16()
    k = torch.randn(300, 64, generator=g).bfloat16()
    w = torch.randn(300, 4, generator=g)

    def run():
        out, _ = dsa_compressor(kv, gate, bias, ratio=16, query_lengths=[1000, 3000])
        grads = torch.autograd.grad(out.float().square().sum(), (kv, gate, bias))
        idx = dsa_indexer(q, k, w, topk=64)
        return (out,) + grads + tuple(idx if isinstance(idx, tuple) else (idx,))

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        own, openmp = _runs(run)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(own, openmp):
        assert torch.equal(a, b)
