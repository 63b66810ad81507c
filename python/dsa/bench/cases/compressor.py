"""Benchmark cases of dsa_compressor (forward + backward, memory-bound).

bytes_moved counts what the op must read and write once: forward reads kv,
gate and position_bias and writes compressed; backward reads grad_compressed,
kv, gate and position_bias and writes grad_kv, grad_gate and
grad_position_bias. The ceiling is the measured copy bandwidth.
"""
from __future__ import annotations

import torch

from ..case import FUSED, NAIVE, REFERENCE, Case


def _setup(tokens: int, c: int, ratio: int, overlap: bool, dtype: torch.dtype):
    def build():
        g = torch.Generator().manual_seed(0)
        channels = (2 if overlap else 1) * c
        kv = torch.randn(tokens, channels, generator=g).to(dtype).requires_grad_(True)
        gate = torch.randn(tokens, channels, generator=g).to(dtype).requires_grad_(True)
        bias = torch.randn(ratio, channels, generator=g).requires_grad_(True)
        grad = torch.randn(tokens // ratio, c, generator=g).to(dtype)
        return dict(kv=kv, gate=gate, bias=bias, grad=grad, ratio=ratio, overlap=overlap)
    return build


def _forward_backward(backend: str):
    def run(x):
        from dsa import dsa_compressor
        out, _ = dsa_compressor(x["kv"], x["gate"], x["bias"], ratio=x["ratio"], overlap=x["overlap"],
                                backend=backend)
        return torch.autograd.grad(out, (x["kv"], x["gate"], x["bias"]), x["grad"])
    return run


def _naive(x):
    from dsa.naive import naive_compressor
    # The unfused model path: view, add bias, softmax, multiply, sum (no empty-channel guard).
    out = naive_compressor(x["kv"], x["gate"], x["bias"], ratio=x["ratio"], overlap=x["overlap"],
                           guard_empty=False)
    return torch.autograd.grad(out, (x["kv"], x["gate"], x["bias"]), x["grad"])


def bytes_moved(tokens: int, c: int, ratio: int, overlap: bool, element_size: int) -> float:
    channels = (2 if overlap else 1) * c
    inputs = 2 * tokens * channels * element_size        # kv + gate
    bias = ratio * channels * 4
    compressed = (tokens // ratio) * c * element_size
    forward = inputs + bias + compressed
    backward = compressed + inputs + bias + inputs + bias  # grad in; kv, gate, bias; grads out
    return float(forward + backward)


def _case(tokens: int, c: int, ratio: int, overlap: bool, *, quick: bool = False, with_reference: bool = False):
    kind = "csa" if overlap else "hca"
    return Case(
        name=f"compressor/{kind}-r{ratio}/bf16/S{tokens}/c{c}/fwd+bwd",
        setup=_setup(tokens, c, ratio, overlap, torch.bfloat16),
        impls={FUSED: _forward_backward("auto"), NAIVE: _naive,
               **({REFERENCE: _forward_backward("reference")} if with_reference else {})},
        bytes_moved=bytes_moved(tokens, c, ratio, overlap, 2),
        ceiling="copy_bw",
        quick=quick,
        skip={} if with_reference else {REFERENCE: "double-precision loops: minutes at this size"},
    )


CASES = [
    _case(16384, 512, 4, True),
    _case(16384, 512, 128, False),
    _case(2048, 512, 4, True, quick=True, with_reference=True),
]
