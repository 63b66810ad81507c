"""The benchmark case API. Each op family adds python/dsa/bench/cases/<op>.py
defining ``CASES: list[Case]``; the harness (dsa.bench.__main__) discovers them.

A case builds its inputs once (deterministic, seeded) and names one callable per
implementation. The harness times each implementation (median after warm-up),
measures its peak extra memory in a fresh subprocess, counts FLOP/s over valid
work only and compares with the machine ceiling named by ``ceiling``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# Implementation keys, in the order the table shows them.
FUSED, NAIVE, REFERENCE = "fused", "naive", "reference"


@dataclass
class Case:
    name: str                                   # "indexer/bf16/T4096" — op family first
    setup: Callable[[], dict[str, Any]]         # builds the inputs (seeded)
    impls: dict[str, Callable[[dict[str, Any]], Any]]  # FUSED / NAIVE / REFERENCE -> run(inputs)
    flops: float = 0.0                          # valid work (FlashMLA convention); 0 if memory-bound
    bytes_moved: float = 0.0                    # bytes the op must move (memory-bound cases)
    ceiling: str = "bf16_gemm"                  # "bf16_gemm" | "fp32_gemm" | "copy_bw"
    quick: bool = False                         # part of `make run` (dsa-bench --quick)
    note: str = ""                              # e.g. why an implementation is skipped
    skip: dict[str, str] = field(default_factory=dict)  # impl -> reason it does not run here
    repeats: Optional[int] = None               # timed runs (default chosen by the harness)
