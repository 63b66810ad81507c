"""Tensors from PyTorch need only their element alignment: a slice such as
``buf[1:]`` starts 2 bytes (bf16) past the allocator's 64-byte boundary. Every
op must accept such inputs and give the same bits as on aligned copies (the
kernels' unaligned heads and tails may not change a sum's order)."""
from __future__ import annotations

import pytest
import torch

import dsa

LENGTHS = [37, 137]  # cumulative ends: sequences of 37 and 100 tokens (odd sizes, partial tiles)
T = LENGTHS[-1]


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t that starts one element past t's own alignment."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t.detach())
    assert out.data_ptr() % 64 != 0
    return out.requires_grad_(t.requires_grad)


def _same_bits(run, inputs: dict):
    aligned = run(**inputs)
    unaligned = run(**{k: _shifted(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    assert len(aligned) == len(unaligned)
    for i, (a, b) in enumerate(zip(aligned, unaligned)):
        assert torch.equal(a, b), f"output {i} differs between aligned and unaligned inputs"


def _grads(out: torch.Tensor, inputs):
    wanted = [t for t in inputs if t.requires_grad]
    return torch.autograd.grad(out.float().square().sum(), wanted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_attention(dtype):
    g = torch.Generator().manual_seed(1)
    H, D, R, K = 16, 64, 32, 24
    inputs = dict(
        query=torch.randn(T, H, D, generator=g).to(dtype).requires_grad_(),
        query_rope=torch.randn(T, H, R, generator=g).to(dtype).requires_grad_(),
        kv=torch.randn(T, D, generator=g).to(dtype).requires_grad_(),
        key_rope=torch.randn(T, R, generator=g).to(dtype).requires_grad_(),
        indices=torch.randint(-1, 37, (T, K), generator=g, dtype=torch.int32),
        sinks=torch.randn(H, generator=g).requires_grad_(),
    )

    def run(query, query_rope, kv, key_rope, indices, sinks):
        out, lse = dsa.dsa_sparse_attention(query, kv, indices, scale=0.1, query_rope=query_rope, key_rope=key_rope,
                                            sinks=sinks, query_lengths=LENGTHS, key_lengths=LENGTHS)[:2]
        return (out, lse) + _grads(out, (query, query_rope, kv, key_rope, sinks))
    _same_bits(run, inputs)


def test_sparse_attention_window_and_compressed():
    g = torch.Generator().manual_seed(2)
    H, D, ratio = 16, 64, 4
    C = 37 // ratio + 100 // ratio
    inputs = dict(
        query=torch.randn(T, H, D, generator=g).bfloat16().requires_grad_(),
        kv=torch.randn(T, D, generator=g).bfloat16().requires_grad_(),
        cmp_kv=torch.randn(C, D, generator=g).bfloat16().requires_grad_(),
        cmp_indices=torch.randint(-1, 9, (T, 8), generator=g, dtype=torch.int32),
    )

    def run(query, kv, cmp_kv, cmp_indices):
        out = dsa.dsa_sparse_attention(query, kv, scale=0.1, window=16, cmp_kv=cmp_kv, cmp_indices=cmp_indices,
                                       cmp_ratio=ratio, query_lengths=LENGTHS, key_lengths=LENGTHS)[0]
        return (out,) + _grads(out, (query, kv, cmp_kv))
    _same_bits(run, inputs)


def test_indexer():
    g = torch.Generator().manual_seed(3)
    inputs = dict(q=torch.randn(T, 8, 64, generator=g).bfloat16(), k=torch.randn(T, 64, generator=g).bfloat16(),
                  w=torch.randn(T, 8, generator=g))

    def run(q, k, w):
        return dsa.dsa_indexer(q, k, w, topk=16, query_lengths=LENGTHS, key_lengths=LENGTHS, return_scores=True)
    _same_bits(run, inputs)


def test_compressor():
    g = torch.Generator().manual_seed(4)
    S, c = 3000, 96
    for ratio, overlap in ((4, True), (16, False)):
        C = (2 if overlap else 1) * c
        inputs = dict(kv=torch.randn(S, C, generator=g).bfloat16().requires_grad_(),
                      gate=torch.randn(S, C, generator=g).bfloat16().requires_grad_(),
                      bias=torch.randn(ratio, C, generator=g).requires_grad_())

        def run(kv, gate, bias):
            out, _ = dsa.dsa_compressor(kv, gate, bias, ratio=ratio, overlap=overlap, query_lengths=[1001, 3000])
            return (out,) + _grads(out, (kv, gate, bias))
        _same_bits(run, inputs)


def test_kl_losses():
    g = torch.Generator().manual_seed(5)
    H, D, Hi, Di, K = 16, 64, 32, 64, 16
    query = torch.randn(T, H, D, generator=g).bfloat16()
    kv = torch.randn(T, D, generator=g).bfloat16()
    iq = torch.randn(T, Hi, Di, generator=g).bfloat16()
    ik = torch.randn(T, Di, generator=g).bfloat16()
    w = torch.randn(T, Hi, generator=g)
    indices = dsa.dsa_indexer(iq, ik, w, topk=K, query_lengths=LENGTHS, key_lengths=LENGTHS)
    _, sparse_max, sparse_sum = dsa.dsa_sparse_attention(query, kv, indices, scale=0.1, query_lengths=LENGTHS,
                                                         key_lengths=LENGTHS)
    window = T  # every earlier key: the dense teacher's statistics
    _, dense_max, dense_sum = dsa.dsa_sparse_attention(query, kv, scale=0.1, window=window, query_lengths=LENGTHS,
                                                       key_lengths=LENGTHS)
    inputs = dict(query=query, kv=kv, iq=iq.requires_grad_(), ik=ik.requires_grad_(), w=w.requires_grad_(),
                  indices=indices, sparse_max=sparse_max, sparse_sum=sparse_sum, dense_max=dense_max,
                  dense_sum=dense_sum)

    def run(query, kv, iq, ik, w, indices, sparse_max, sparse_sum, dense_max, dense_sum):
        sparse = dsa.dsa_kl_loss(query, kv, indices, sparse_max, sparse_sum, iq, ik, w, scale=0.1,
                                 query_lengths=LENGTHS, key_lengths=LENGTHS)
        lse = dsa.dsa_dense_indexer_lse(iq, ik, w, query_lengths=LENGTHS, key_lengths=LENGTHS)
        dense = dsa.dsa_dense_indexer_kl_loss(iq, ik, w, query, kv.unsqueeze(1), dense_max, dense_sum, lse,
                                              scale=0.1, query_lengths=LENGTHS, key_lengths=LENGTHS)
        return (sparse, lse, dense) + torch.autograd.grad(sparse + dense, (iq, ik, w))
    _same_bits(run, inputs)
