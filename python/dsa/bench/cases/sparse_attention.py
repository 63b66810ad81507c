"""Benchmark cases of sparse attention with one shared KV head (docs/ops.md 4.2), bf16.

* DeepSeek-V3.2 sparse: H = 64 and 128 heads, d_qk = 576 (kv [S, 576]), d_v = 512,
  top-2048 indices (random distinct visible positions, a stand-in for the indexer's);
  (a) a chunk of 1024 queries at the end of a 4096-token sequence (prefix KV), forward
  and forward+backward, against the naive peer; (b) T = S = 4096, fused only.
* DeepSeek-V4 CSA: H = 64, d = 512, window 128 + compressed ratio 4 with top-512
  cmp_indices, T = S = 4096, per-head sinks.
  (c) long context: chunks of 1024 and 4096 queries at the end of a 131072-token
  prefix, forward+backward.
* Dense causal warm-up attention, T = S = 4096 (H = 64, d_qk 576, d_v 512).

FLOPs over valid work (FlashMLA convention): forward ``2*H*(Dqk+Dv)*pairs``, backward
``2*H*(3*Dqk+2*Dv)*pairs``; ``pairs`` counts attended (query, key) pairs, duplicates
and invalid entries excluded. "bwd" cases time the backward op alone on saved forward
outputs; "fwd+bwd" cases time forward, then backward through autograd.
"""
from __future__ import annotations

import torch

from dsa import dsa_sparse_attention
from dsa.bench.case import FUSED, NAIVE, Case
from dsa.naive import naive_sparse_attention

GIB = float(1 << 30)
DQK, DV = 576, 512


def _sparse_indices(T: int, S: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """Distinct visible positions per query (bottom-right aligned), -1 padded."""
    idx = torch.full((T, topk), -1, dtype=torch.int32)
    for i in range(T):
        visible = S - T + i + 1
        take = min(topk, visible)
        idx[i, :take] = torch.randperm(visible, generator=g)[:take].int()
    return idx


def _cmp_indices(T: int, S: int, ratio: int, topk: int, g: torch.Generator) -> torch.Tensor:
    idx = torch.full((T, topk), -1, dtype=torch.int32)
    for i in range(T):
        visible = (S - T + i + 1) // ratio
        take = min(topk, visible)
        if take:
            idx[i, :take] = torch.randperm(visible, generator=g)[:take].int()
    return idx


def _v32_setup(T: int, S: int, H: int, topk: int, backward: bool):
    def setup():
        g = torch.Generator().manual_seed(1234)
        x = {
            "query": torch.randn(T, H, DQK, generator=g).bfloat16(),
            "kv": torch.randn(S, DQK, generator=g).bfloat16(),
            "kw": dict(indices=_sparse_indices(T, S, topk, g), scale=DQK ** -0.5, d_v=DV,
                       query_lengths=[T], key_lengths=[S]),
        }
        if backward:
            x["grad_out"] = torch.randn(T, H, DV, generator=g).bfloat16()
        return x
    return setup


def _v4_setup(T: int, H: int, D: int, window: int, ratio: int, topk: int, backward: bool):
    def setup():
        g = torch.Generator().manual_seed(1234)
        x = {
            "query": torch.randn(T, H, D, generator=g).bfloat16(),
            "kv": torch.randn(T, D, generator=g).bfloat16(),
            "kw": dict(window=window, cmp_kv=torch.randn(T // ratio, D, generator=g).bfloat16(),
                       cmp_indices=_cmp_indices(T, T, ratio, topk, g), cmp_ratio=ratio,
                       sinks=torch.randn(H, generator=g), scale=D ** -0.5),
        }
        if backward:
            x["grad_out"] = torch.randn(T, H, D, generator=g).bfloat16()
        return x
    return setup


def _dense_setup(T: int, H: int, backward: bool):
    def setup():
        g = torch.Generator().manual_seed(1234)
        x = {
            "query": torch.randn(T, H, DQK, generator=g).bfloat16(),
            "kv": torch.randn(T, DQK, generator=g).bfloat16(),
            "kw": dict(scale=DQK ** -0.5, d_v=DV),
        }
        if backward:
            x["grad_out"] = torch.randn(T, H, DV, generator=g).bfloat16()
        return x
    return setup


def _forward(fn):
    def run(x):
        with torch.no_grad():
            return fn(x["query"], x["kv"], **x["kw"])
    return run


def _forward_backward(fn):
    def run(x):
        q = x["query"].detach().requires_grad_()
        kv = x["kv"].detach().requires_grad_()
        out = fn(q, kv, **x["kw"])[0]
        out.backward(x["grad_out"])
        return q.grad, kv.grad
    return run


def _backward_only(x):
    """The fused backward op on saved forward outputs (what autograd calls)."""
    if "saved" not in x:
        with torch.no_grad():
            x["saved"] = dsa_sparse_attention(x["query"], x["kv"], **x["kw"])
    out, mx, sm = x["saved"]
    kw = x["kw"]

    def lengths(name):
        v = kw.get(name)
        return None if v is None else torch.tensor(v, dtype=torch.int64)
    return torch.ops.dsa.sparse_attention_bwd(
        x["grad_out"], out, mx, sm, x["query"], x["kv"], kw.get("indices"), kw.get("cmp_kv"),
        kw.get("cmp_indices"), kw.get("sinks"), None, None, lengths("query_lengths"),
        lengths("key_lengths"), float(kw["scale"]), kw.get("d_v", 0) or 0, kw.get("window") or 0,
        kw.get("cmp_ratio", 1), "TND", "cpu")


def _fused(x_fn=dsa_sparse_attention):
    return lambda q, kv, **kw: x_fn(q, kv, backend="cpu", **kw)


def _flops(H: int, dqk: int, dv: int, pairs: int, direction: str) -> float:
    fwd = 2.0 * H * (dqk + dv) * pairs
    bwd = 2.0 * H * (3 * dqk + 2 * dv) * pairs
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[direction]


def v32_case(T: int, S: int, H: int, direction: str, *, topk: int = 2048, naive: bool) -> Case:
    pairs = sum(min(topk, S - T + i + 1) for i in range(T))
    backward = direction != "fwd"
    impls, skip = {}, {}
    if direction == "bwd":
        impls[FUSED] = _backward_only
    elif direction == "fwd":
        impls[FUSED] = _forward(_fused())
    else:
        impls[FUSED] = _forward_backward(_fused())
    note = ""
    if naive and direction != "bwd":
        impls[NAIVE] = (_forward(naive_sparse_attention) if direction == "fwd"
                        else _forward_backward(naive_sparse_attention))
    else:
        gathered = T * topk * DQK * 2 / GIB
        skip[NAIVE] = f"gathers [T, K, 576] kv ({gathered:.0f} GiB bf16) plus [T, H, K] logits"
        note = "fused only"
    return Case(name=f"sparse_attention/v32/bf16/H{H}/T{T}/S{S}/K{topk}/{direction}",
                setup=_v32_setup(T, S, H, topk, backward), impls=impls,
                flops=_flops(H, DQK, DV, pairs, "fwd+bwd" if direction == "fwd+bwd" else direction),
                ceiling="compute", note=note, skip=skip | {"reference": "scalar loops: too slow here"},
                quick=(T == 1024 and H == 64 and direction == "fwd"))


def v4_csa_case(direction: str, *, T: int = 4096, H: int = 64, D: int = 512, window: int = 128,
                ratio: int = 4, topk: int = 512) -> Case:
    pairs = sum(min(window, i + 1) + min(topk, (i + 1) // ratio) for i in range(T))
    impls = {FUSED: _backward_only if direction == "bwd" else _forward(_fused())}
    return Case(name=f"sparse_attention/v4_csa/bf16/H{H}/T{T}/w{window}/m{ratio}/K{topk}/{direction}",
                setup=_v4_setup(T, H, D, window, ratio, topk, direction == "bwd"), impls=impls,
                flops=_flops(H, D, D, pairs, direction), ceiling="compute", note="fused only",
                skip={NAIVE: "[T, H, S] masked logits of the window part alone are 4 GiB",
                      "reference": "scalar loops: too slow here"})


def dense_case(direction: str, *, T: int = 4096, H: int = 64) -> Case:
    pairs = T * (T + 1) // 2
    impls = {FUSED: _backward_only if direction == "bwd" else _forward(_fused())}
    return Case(name=f"sparse_attention/dense_causal/bf16/H{H}/T{T}/{direction}",
                setup=_dense_setup(T, H, direction == "bwd"), impls=impls,
                flops=_flops(H, DQK, DV, pairs, direction), ceiling="compute", note="fused only",
                skip={NAIVE: f"[T, H, S] logits are {T * T * H * 2 / GIB:.0f} GiB bf16",
                      "reference": "scalar loops: too slow here"})


CASES = [
    v32_case(1024, 4096, 64, "fwd", naive=True),
    v32_case(1024, 4096, 64, "fwd+bwd", naive=True),
    v32_case(1024, 4096, 128, "fwd", naive=True),
    v32_case(1024, 4096, 128, "fwd+bwd", naive=True),
    # Long context, a prefill chunk at the end of a 128 Ki-token prefix: the same
    # 1024 queries x top-2048 as on the 4096 prefix above, so time and peak extra
    # memory should match those rows (O(T * topk), nothing of size T * S).
    v32_case(1024, 131072, 64, "fwd+bwd", naive=True),
    v32_case(4096, 131072, 64, "fwd+bwd", naive=False),
    v32_case(4096, 4096, 64, "fwd", naive=False),
    v32_case(4096, 4096, 64, "bwd", naive=False),
    v32_case(4096, 4096, 128, "fwd", naive=False),
    v32_case(4096, 4096, 128, "bwd", naive=False),
    v4_csa_case("fwd"),
    v4_csa_case("bwd"),
    dense_case("fwd"),
    dense_case("bwd"),
]
