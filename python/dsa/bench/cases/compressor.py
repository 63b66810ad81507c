"""Benchmark cases of dsa_compressor (forward + backward).

Each case is compared with the slower of two bounds (``ceiling="binding"``):

* bytes: what the op must read and write once: forward reads kv, gate and
  position_bias and writes compressed; backward reads grad_compressed, kv, gate and
  position_bias and writes grad_kv, grad_gate and grad_position_bias; at the
  measured copy bandwidth.
* vector operations (``vector_ops``): what the math needs per fp32 vector of
  (slot, channel) and (entry, channel) pairs at the ISA dsa runs, at the ISA's
  vector issue rate (machine.vector_op_rate). Which one binds depends on the CPU:
  on a core that retires one 256-bit operation per cycle (Zen 1 class) the
  operations take longer than the bytes.
"""
from __future__ import annotations

import torch

from ..case import FUSED, NAIVE, REFERENCE, Case
from ..machine import LANES_OF_ISA

# Operations of one exp(x) vector at each level, the cheapest form dsa has found
# (docs/compressor.md): the argument as one fma against the channel's shift, then
# AVX-512 vreduceps, a degree-4 polynomial (4 fmas) and vscalefps = 7; AVX2 a
# magic-number round (add, subtract), the fraction, 4 fmas, the exponent shift and
# the scaling multiply = 10.
_EXP_OPS = {"avx2": 10, "avx512": 7, "avx512_bf16": 7, "amx": 7}
# Rounding one fp32 vector to bf16 for its store: vcvtneps2bf16 where the ISA has it,
# else the integer form (the lsb by a shift and an and, two adds, the pack) = 4.
_BF16_ROUND_OPS = {"avx2": 4, "avx512": 4, "avx512_bf16": 1, "amx": 1}


def vector_ops(tokens: int, c: int, ratio: int, overlap: bool, isa: str) -> float:
    """Vector operations a forward + backward needs at ``isa``, bf16 data, counting
    only the math (loads and stores of fp32 scratch, loop control, NaN care and
    prefetches are free here, so this is a lower bound of any kernel's count):

    per (slot, channel), forward: widen kv and gate (2), add the bias (1), the max
    (1), exp (E), the sum (1), the weighted sum (1); backward from the saved max and
    1 / sum: widen kv and gate (2), the logit (1), exp (E), p = e / sum (1), p g (1),
    kv - out (1), d logit = p g (kv - out) (1), the bias gradient's sum (1), two
    rounded gradient stores (2 R).
    per (entry, channel): forward 1 / sum, the scale and a rounded store (2 + R);
    backward widening the output gradient (1).
    """
    lanes = LANES_OF_ISA[isa]
    e, r = _EXP_OPS[isa], _BF16_ROUND_OPS[isa]
    entries = tokens // ratio
    slots = entries * ratio * c + (max(entries - 1, 0) * ratio * c if overlap else 0)
    per_slot = (6 + e) + (8 + e + 2 * r)
    per_entry = (2 + r) + 1
    return (slots * per_slot + entries * c * per_entry) / lanes


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
        vector_ops={isa: vector_ops(tokens, c, ratio, overlap, isa) for isa in LANES_OF_ISA},
        ceiling="binding",
        quick=quick,
        skip={} if with_reference else {REFERENCE: "double-precision loops: minutes at this size"},
    )


CASES = [
    _case(16384, 512, 4, True),
    _case(16384, 512, 128, False),
    _case(2048, 512, 4, True, quick=True, with_reference=True),
]
