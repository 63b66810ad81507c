"""Benchmark cases of the KL losses (docs/ops.md 4.3, 4.4): forward + backward.

Shapes follow DeepSeek-V3.2: indexer Hi=64, Di=128, top-2048; main attention
H=64, MQA d_qk=576 for the sparse loss, MHA D=128 + rope 64 for the dense loss.
The attention statistics are computed once at set-up (they are inputs).
"""
from __future__ import annotations

import torch

from ..case import FUSED, NAIVE, NAIVE_FP32, REFERENCE, Case, memory_gib

HI, DI, TOPK, H = 64, 128, 2048, 64


def _sparse_setup(T, S, seed=0):
    def setup():
        from ..._common import num_threads  # noqa: F401  (keeps the package import side effects)
        from ... import dsa_indexer
        from ...naive import naive_attention_stats
        g = torch.Generator().manual_seed(seed)
        bf = torch.bfloat16
        q = (torch.randn(T, H, 576, generator=g) * 0.05).to(bf)
        kv = (torch.randn(S, 576, generator=g)).to(bf)
        iq = (torch.randn(T, HI, DI, generator=g) * 0.1).to(bf)
        ik = (torch.randn(S, DI, generator=g) * 0.1).to(bf)
        w = torch.rand(T, HI, generator=g).to(bf)
        ql, kl = [T], [S]
        idx = dsa_indexer(iq, ik, w, topk=TOPK, query_lengths=ql, key_lengths=kl)
        # Stats over the selection, computed in chunks to bound set-up memory.
        mx = torch.empty(T, H)
        sm = torch.empty(T, H)
        for c in range(0, T, 256):
            rows = slice(c, min(T, c + 256))
            kg = kv[idx[rows].clamp(min=0).long()].float()
            l = torch.einsum("thd,tkd->thk", q[rows].float(), kg) * (576 ** -0.5)
            valid = (idx[rows] >= 0)[:, None, :]
            l = l.masked_fill(~valid, float("-inf"))
            mx[rows] = l.amax(-1)
            sm[rows] = torch.exp(l - mx[rows, :, None]).sum(-1)
        return dict(q=q, kv=kv, idx=idx, mx=mx, sm=sm, iq=iq, ik=ik, w=w, ql=ql, kl=kl)
    return setup


def _sparse_run(fn_name, backend="auto"):
    def run(x):
        from ... import dsa_kl_loss
        from ...naive import naive_kl_loss
        iq, ik, w = (t.detach().requires_grad_() for t in (x["iq"], x["ik"], x["w"]))
        kw = dict(scale=576 ** -0.5, query_lengths=x["ql"], key_lengths=x["kl"])
        if fn_name == "fused":
            loss = dsa_kl_loss(x["q"], x["kv"], x["idx"], x["mx"], x["sm"], iq, ik, w, backend=backend, **kw)
        else:
            loss = naive_kl_loss(x["q"], x["kv"], x["idx"], x["mx"], x["sm"], iq, ik, w, **kw)
        loss.backward()
        return loss
    return run


def _dense_setup(T, seed=0):
    def setup():
        from ... import dsa_dense_indexer_lse
        g = torch.Generator().manual_seed(seed)
        bf = torch.bfloat16
        q = (torch.randn(T, H, 128, generator=g) * 0.1).to(bf)
        k = torch.randn(T, H, 128, generator=g).to(bf)
        qr = (torch.randn(T, H, 64, generator=g) * 0.1).to(bf)
        kr = torch.randn(T, H, 64, generator=g).to(bf)
        iq = (torch.randn(T, HI, DI, generator=g) * 0.1).to(bf)
        ik = (torch.randn(T, DI, generator=g) * 0.1).to(bf)
        w = torch.rand(T, HI, generator=g).to(bf)
        # Approximate stats (the causal row maximum is bounded by the full-row one); set-up only.
        mx = torch.full((T, H), 3.0)
        sm = torch.arange(1, T + 1, dtype=torch.float32)[:, None].expand(T, H).contiguous()
        lse = dsa_dense_indexer_lse(iq, ik, w)
        return dict(q=q, k=k, qr=qr, kr=kr, iq=iq, ik=ik, w=w, mx=mx, sm=sm, lse=lse)
    return setup


def _dense_run(kind, backend="auto"):
    def run(x):
        from ... import dsa_dense_indexer_kl_loss, dsa_dense_indexer_lse
        from ...naive import naive_dense_indexer_kl_loss, naive_dense_indexer_lse
        iq, ik, w = (t.detach().requires_grad_() for t in (x["iq"], x["ik"], x["w"]))
        kw = dict(scale=192 ** -0.5, query_rope=x["qr"], key_rope=x["kr"])
        if kind == "fused":
            lse = dsa_dense_indexer_lse(iq, ik, w, backend=backend)
            loss = dsa_dense_indexer_kl_loss(iq, ik, w, x["q"], x["k"], x["mx"], x["sm"], lse, backend=backend, **kw)
        else:
            lse = naive_dense_indexer_lse(iq, ik, w)
            loss = naive_dense_indexer_kl_loss(iq, ik, w, x["q"], x["k"], x["mx"], x["sm"], lse, **kw)
        loss.backward()
        return loss
    return run


def _sparse_flops(T, S):
    # Valid pairs only (FlashMLA convention): a query sees at most S - T + i + 1 keys, so
    # the first TOPK - 1 queries of a causal sequence have fewer than TOPK.
    pairs = sum(min(TOPK, S - T + i + 1) for i in range(T))
    # teacher logits (H x 576) once; indexer dots: forward, dQ/dW pass and dK pass (each dot + update).
    return 2 * H * 576 * pairs + 2 * HI * DI * pairs * 5


def _dense_flops(T):
    pairs = T * (T + 1) / 2
    return 3 * 2 * H * 192 * pairs + 2 * HI * DI * pairs * 6


DENSE_T4096_FP32_PEER_GIB = 40

CASES = [
    Case("kl_loss/sparse/bf16/prefix_T1024_S4096", _sparse_setup(1024, 4096),
         {FUSED: _sparse_run("fused"), NAIVE: _sparse_run("naive")}, flops=_sparse_flops(1024, 4096),
         note="query chunk of 1024 at the end of a 4096-token sequence (prefix KV)"),
    Case("kl_loss/sparse/bf16/T4096", _sparse_setup(4096, 4096),
         {FUSED: _sparse_run("fused")}, flops=_sparse_flops(4096, 4096),
         skip={NAIVE: "the naive peer gathers [T, 2048, 576] and does not fit", REFERENCE: "too slow"}),
    Case("kl_loss/dense/bf16/T4096", _dense_setup(4096),
         {FUSED: _dense_run("fused"), NAIVE: _dense_run("naive")}, flops=_dense_flops(4096),
         skip={REFERENCE: "too slow",
               # The bf16 peer's peak is 19.6 GB (measured, Zen 5); on fp32 inputs (the
               # peer where bf16 is emulated) twice that: killed for memory on 24 GiB.
               **({} if memory_gib() >= DENSE_T4096_FP32_PEER_GIB else
                  {NAIVE_FP32: f"the naive peer in fp32 needs ~{DENSE_T4096_FP32_PEER_GIB} GiB "
                               f"(its [H, T, S] teacher and their gradients)"})}),
    Case("kl_loss/dense/bf16/T16384", _dense_setup(16384),
         {FUSED: _dense_run("fused")}, flops=_dense_flops(16384),
         skip={NAIVE: "[H, T, S] teacher does not fit", REFERENCE: "too slow"}),
]
