"""The benchmark case API. Each op family adds python/dsa/bench/cases/<op>.py
defining ``CASES: list[Case]``; the harness (dsa.bench.__main__) discovers them.

A case builds its inputs once (deterministic, seeded) and names one callable per
implementation. The harness times each implementation (median after warm-up,
in a child process with a wall-time budget), measures its peak extra memory in
a fresh subprocess, counts FLOP/s over valid work only and compares with the
machine ceiling that ``ceiling`` and ``dtype`` select (machine.choose_ceiling:
for compute cases it depends on the ISA dsa runs and on whether torch's bf16
GEMM is native here).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# Implementation keys, in the order the table shows them.
FUSED, NAIVE, REFERENCE = "fused", "naive", "reference"
# The naive peer on inputs cast to fp32: added by the harness to a bf16 case
# where torch's bf16 is emulated (what a user there would run instead).
NAIVE_FP32 = "naive_fp32"

def memory_gib() -> float:
    """This machine's physical memory in GiB, for cases whose peer fits only on some."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30


# Old ceiling names, still accepted: they name the work and the dtype at once.
LEGACY_CEILINGS = {"bf16_gemm": ("compute", "bf16"), "fp32_gemm": ("compute", "fp32")}


@dataclass
class Case:
    name: str                                   # "indexer/bf16/T4096" — op family first
    setup: Callable[[], dict[str, Any]]         # builds the inputs (seeded)
    impls: dict[str, Callable[[dict[str, Any]], Any]]  # FUSED / NAIVE / REFERENCE -> run(inputs)
    flops: float = 0.0                          # valid work (FlashMLA convention); 0 if memory-bound
    bytes_moved: float = 0.0                    # bytes the op must move (memory-bound cases)
    ceiling: str = "compute"                    # "compute" (FLOP/s) | "copy_bw" (bytes/s) | "binding" (the slowest
                                                # of flops, bytes_moved and vector_ops on this machine)
    dtype: str = "bf16"                         # "bf16" | "fp32": the inputs' dtype
    quick: bool = False                         # part of `make bench-quick` (dsa-bench --quick)
    note: str = ""                              # e.g. why an implementation is skipped
    skip: dict[str, str] = field(default_factory=dict)  # impl -> reason it does not run here
    repeats: Optional[int] = None               # timed runs (default chosen by the harness)
    # Long-context cases whose one call takes minutes: no warm-up, one timed run
    # whose peak extra memory is read in the same child process (no second child
    # repeating the call). Lazy initialisation then counts into time and memory:
    # milliseconds and kilobytes next to minutes and GiBs.
    single_run: bool = False
    budget_s: Optional[float] = None            # wall-time budget of one implementation (default: the harness's)
    # Vector operations the op needs, by dsa's ISA level ("avx2", "avx512", ...): for
    # ops bound by their instructions rather than by FLOPs of a product or by bytes
    # (the compressor: widenings, maxima, exps, sums per element). With ceiling
    # "binding" they are one of the bounds, timed at the ISA's vector issue rate
    # (machine.vector_op_rate); a level missing here has no such bound.
    vector_ops: dict[str, float] = field(default_factory=dict)


def work_of(case: Case) -> tuple[str, str]:
    """("compute" | "copy_bw" | "vector_ops", "bf16" | "fp32") of a case."""
    if case.ceiling in LEGACY_CEILINGS:
        return LEGACY_CEILINGS[case.ceiling]
    if case.ceiling not in ("compute", "copy_bw", "vector_ops") or case.dtype not in ("bf16", "fp32"):
        raise ValueError(f"{case.name}: ceiling must be 'compute', 'copy_bw' or 'vector_ops' and dtype 'bf16' or "
                         f"'fp32', got {case.ceiling!r} / {case.dtype!r}")
    return case.ceiling, case.dtype
