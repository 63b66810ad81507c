"""Benchmark cases of the lightning indexer with top-k (docs/ops.md 4.1).

DeepSeek-V3.2 indexer shapes: Hi = 64 heads of Di = 128, top-2048, one causal
sequence (T = S). FLOPs over valid work: ``2 * Hi * Di * pairs`` with
``pairs = T * (T + 1) / 2`` attended (query, visible key) pairs.
"""
from __future__ import annotations

import torch

from dsa import dsa_indexer
from dsa.bench.case import FUSED, NAIVE, REFERENCE, Case
from dsa.naive import naive_indexer

GIB = float(1 << 30)


def _setup(T: int, Hi: int, Di: int, topk: int, dtype: torch.dtype):
    def setup():
        g = torch.Generator().manual_seed(1234)
        return {
            "q": torch.randn(T, Hi, Di, generator=g).to(dtype),
            "k": torch.randn(T, Di, generator=g).to(dtype),
            # Per-head weights of either sign, as the model's weights projection gives.
            "w": (torch.randn(T, Hi, generator=g) * Hi ** -0.5).to(dtype),
            "topk": topk,
            "scale": Di ** -0.5,
        }
    return setup


def _fused(backend: str):
    def run(x):
        return dsa_indexer(x["q"], x["k"], x["w"], topk=x["topk"], scale=x["scale"], backend=backend)
    return run


def _naive(x):
    return naive_indexer(x["q"], x["k"], x["w"], topk=x["topk"], scale=x["scale"])


def naive_bytes(T: int, S: int, Hi: int, dtype: torch.dtype) -> float:
    """Peak of the naive peer: the [T, Hi, S] logits and their weighted copy, plus [T, S] scores."""
    item = torch.empty(0, dtype=dtype).element_size()
    return (2 * T * Hi * S + 2 * T * S) * item


def indexer_case(T: int, *, Hi: int = 64, Di: int = 128, topk: int = 2048,
                 dtype: torch.dtype = torch.bfloat16, quick: bool = False,
                 naive: bool = True, reference: bool = False, long_context: bool = False) -> Case:
    pairs = T * (T + 1) // 2  # causal, one sequence, T = S
    impls = {FUSED: _fused("cpu")}
    skip = {}
    if naive:
        impls[NAIVE] = _naive
    else:
        skip[NAIVE] = (f"needs ~{naive_bytes(T, T, Hi, dtype) / GIB:.0f} GiB "
                       f"([T,Hi,S] logits + weighted copy)")
    if reference:
        impls[REFERENCE] = _fused("reference")
    else:
        skip[REFERENCE] = "scalar reference loops: small case only"
    dt = str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")
    note = ""
    if not naive:
        note = (f"naive peer skipped: its [T,Hi,S] logits alone are {T * Hi * T * 2 / GIB:,.0f} GiB in "
                f"{dt} ({T * Hi * T * 4 / GIB:,.0f} GiB in fp32), its weighted copy as much again, "
                f"and the [T,S] score matrix {T * T * 2 / GIB:.2f} GiB")
    return Case(
        name=f"indexer/{dt}/T{T}/Hi{Hi}/K{topk}",
        setup=_setup(T, Hi, Di, topk, dtype),
        impls=impls,
        flops=2.0 * Hi * Di * pairs,
        ceiling="compute", dtype="fp32" if dtype == torch.float32 else "bf16",
        quick=quick,
        note=note,
        skip=skip,
        # Minutes per call at T = 131072: one cold run (case.py), time and memory at once.
        single_run=long_context,
        budget_s=1200.0 if long_context else None,
    )


CASES = [
    indexer_case(512, Hi=8, topk=64, quick=True, reference=True),
    indexer_case(4096, quick=True),
    indexer_case(16384, naive=False),
    # Long context: peak extra memory is the [T, topk] int32 output plus bounded
    # scratch, so it grows with T * topk (4 -> 16 -> 128 Ki tokens), never with T * S.
    indexer_case(131072, naive=False, long_context=True),
]
