"""Benchmark cases for test_bench.py only (loaded through DSA_BENCH_CASE_MODULES).

"test/slow": its naive peer takes a minute on bf16 inputs, as torch's emulated
bf16 does on AVX2-only CPUs, and is fast on fp32 ones; the harness must cut the
bf16 run at its budget instead of waiting, and use the fp32 peer where it runs one.
"""
from __future__ import annotations

import time

import torch

from dsa.bench.case import FUSED, NAIVE, Case

SLOW_S = 60.0


def _setup():
    return {"x": torch.ones(256, 256, dtype=torch.bfloat16)}


def _fused(x):
    return x["x"] @ x["x"]


def _naive(x):
    if x["x"].dtype == torch.bfloat16:
        time.sleep(SLOW_S)  # one call: a child process that is not killed hangs the test for a minute
    return x["x"] @ x["x"]


CASES = [
    Case(name="test/slow/bf16", setup=_setup, impls={FUSED: _fused, NAIVE: _naive},
         flops=2.0 * 256 ** 3, ceiling="compute", dtype="bf16", repeats=3),
]
