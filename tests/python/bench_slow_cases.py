"""Benchmark cases for test_bench.py only (loaded through DSA_BENCH_CASE_MODULES).

"test/slow/bf16": its naive peer takes five minutes on bf16 inputs, as torch's
emulated bf16 does on AVX2-only CPUs, and is fast on fp32 ones; the harness must
kill the bf16 run at its budget instead of waiting, and use the fp32 peer where
it runs one. "test/slowish/fp32": a naive call of 6 s, so that with a 14 s budget
the warm-up fits (child start-up under 7.5 s, even on a loaded machine) and no timed
run does after it (any start-up): the warm-up is reported. "test/single/fp32": a
single-run (long-context) case whose call touches 64 MiB and notes each call in
the file $DSA_TEST_CALLS, so a test can count the calls the harness made.
"""
from __future__ import annotations

import os
import time

import torch

from dsa.bench.case import FUSED, NAIVE, Case

SLOW_S = 300.0
SLOWISH_S = 6.0


def _setup():
    return {"x": torch.ones(256, 256, dtype=torch.bfloat16)}


def _fused(x):
    return x["x"] @ x["x"]


def _naive(x):
    if x["x"].dtype == torch.bfloat16:
        time.sleep(SLOW_S)  # a child process that is not killed holds the test for five minutes
    return x["x"] @ x["x"]


def _naive_slowish(x):
    time.sleep(SLOWISH_S)
    return x["x"] @ x["x"]


def _single(x):
    with open(os.environ["DSA_TEST_CALLS"], "a") as f:
        f.write("call\n")
    return torch.ones(64 << 18)  # 64 MiB of fp32


CASES = [
    Case(name="test/single/fp32", setup=lambda: {}, impls={FUSED: _single}, flops=1e9,
         ceiling="compute", dtype="fp32", single_run=True, budget_s=60.0),
    Case(name="test/slow/bf16", setup=_setup, impls={FUSED: _fused, NAIVE: _naive},
         flops=2.0 * 256 ** 3, ceiling="compute", dtype="bf16", repeats=3),
    Case(name="test/slowish/fp32", setup=lambda: {"x": torch.ones(256, 256)},
         impls={FUSED: _fused, NAIVE: _naive_slowish}, flops=2.0 * 256 ** 3, ceiling="compute", dtype="fp32"),
]
