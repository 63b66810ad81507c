"""Case discovery, timing and peak-memory measurement of the benchmark harness."""
from __future__ import annotations

import gc
import importlib
import json
import math
import os
import pkgutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .case import FUSED, NAIVE, REFERENCE, Case

IMPL_ORDER = (FUSED, NAIVE, REFERENCE)

# Timing: at least MIN_REPEATS timed runs, more while they fit in TIME_BUDGET_S.
MIN_REPEATS, MAX_REPEATS, TIME_BUDGET_S = 3, 25, 1.5
SLOW_RUN_S = 20.0  # a run longer than this is timed once


def load_cases() -> list[Case]:
    """Every CASES list of python/dsa/bench/cases/*.py, in module then list order."""
    from . import cases as pkg
    found: list[Case] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        found.extend(getattr(module, "CASES", []))
    names = [c.name for c in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RuntimeError(f"benchmark case names must be unique, repeated: {', '.join(dup)}")
    return found


def select_cases(cases: list[Case], quick: bool, pattern: Optional[str]) -> list[Case]:
    return [c for c in cases if (c.quick or not quick) and (pattern is None or pattern in c.name)]


def impls_of(case: Case) -> list[str]:
    """Implementations the table shows for a case: runnable ones and skipped ones."""
    keys = set(case.impls) | set(case.skip)
    return [k for k in IMPL_ORDER if k in keys] + sorted(keys - set(IMPL_ORDER))


# ------------------------------------------------------------------------- timing

_flush_buffer = None


def flush_caches() -> None:
    """Writes a buffer larger than the last-level cache, on all of torch's threads."""
    global _flush_buffer
    if _flush_buffer is None:
        import torch
        from .machine import cache_flush_bytes
        _flush_buffer = torch.empty(cache_flush_bytes(), dtype=torch.uint8)
    _flush_buffer.zero_()


def time_impl(fn, inputs: dict[str, Any], repeats: Optional[int]) -> list[float]:
    """Seconds of each timed run, after warm-up (first call: lazy init, page faults).

    Each timed run starts the way an op starts inside a model step: its data out
    of the caches (flush_caches(), as Triton's do_bench clears the GPU's L2) and
    the cores awake (the flush runs on every thread). The garbage collector runs
    once before the timed runs and is off during them, as timeit does, so no
    collection lands inside a run. (Collecting before every run instead left one
    vCPU idle for ~60 ms each time, and on a VM an idle vCPU comes back slow:
    that measured the host's wake-up, not the op.)
    """
    t0 = time.perf_counter()
    out = fn(inputs)
    estimate = time.perf_counter() - t0
    del out
    if estimate < 0.2:  # cheap enough for a second warm-up run, which also estimates better
        t0 = time.perf_counter()
        out = fn(inputs)
        estimate = time.perf_counter() - t0
        del out
    auto = repeats is None
    if auto:
        repeats = int(min(MAX_REPEATS, max(MIN_REPEATS, TIME_BUDGET_S / max(estimate, 1e-6))))
        if estimate > SLOW_RUN_S:  # minutes-long naive peers: one timed run after the warm-up
            repeats = 1
    times: list[float] = []
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(repeats):
            flush_caches()
            t0 = time.perf_counter()
            out = fn(inputs)
            times.append(time.perf_counter() - t0)
            del out
            # The estimate can be off on a loaded machine: bound the wall time, not only the count.
            if auto and len(times) >= MIN_REPEATS and time.perf_counter() - start > 2 * TIME_BUDGET_S:
                break
    finally:
        if collecting:
            gc.enable()
    return times


# ------------------------------------------------------------------------- memory

def _proc_status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_high_water() -> bool:
    """Resets VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_here(case: Case, impl: str) -> dict:
    """Peak extra resident memory of one run of ``impl``; runs in a fresh process.

    After setup and one warm-up run (lazy initialisation is not the op's memory),
    the RSS high-water mark is reset to the current RSS; the result is the
    high-water after one more run minus the RSS right before it. It counts every
    page the op touches: outputs, scratch, intermediate tensors.
    """
    import resource
    inputs = case.setup()
    fn = case.impls[impl]
    can_reset = _reset_high_water()
    if can_reset:
        out = fn(inputs)
        del out
    gc.collect()
    # Blocks the warm-up left in dsa's buffer pool would be reused without
    # new pages: unmap them so the measured run's outputs count.
    from .._buffers import empty_buffer_pool
    empty_buffer_pool()
    if can_reset:
        _reset_high_water()
        method = "VmHWM after clear_refs"
    else:  # ru_maxrss also holds setup's high-water: may under-count a small op
        method = "ru_maxrss"
    base = _proc_status_kib("VmRSS")
    if base is None:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fn(inputs)
    peak = _proc_status_kib("VmHWM") if can_reset else None
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del out
    return {"peak_extra_mib": max(0, peak - base) / 1024.0, "base_rss_mib": base / 1024.0,
            "method": method}


def measure_in_subprocess(case: Case, impl: str, threads: int, timeout_s: float = 900) -> dict:
    """Runs ``python -m dsa.bench._memory`` for one (case, impl) and returns its JSON."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # A fixed glibc mmap threshold turns off its dynamic raise, so blocks freed by the
    # warm-up run go back to the OS instead of being reused silently by the timed one.
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["MALLOC_TRIM_THRESHOLD_"] = "65536"
    cmd = [sys.executable, "-m", "dsa.bench._memory", "--case", case.name, "--impl", impl,
           "--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0]}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": "no result printed"}


# ------------------------------------------------------------------------- results

@dataclass
class Result:
    case: str
    impl: str
    skipped: Optional[str] = None            # reason, when the implementation did not run
    times_ms: list[float] = field(default_factory=list)
    median_ms: Optional[float] = None
    tflops: Optional[float] = None           # compute-bound cases
    gbps: Optional[float] = None             # memory-bound cases
    ceiling: str = ""
    pct_of_ceiling: Optional[float] = None
    peak_extra_mib: Optional[float] = None
    memory_method: Optional[str] = None
    memory_error: Optional[str] = None
    speedup_vs_naive: Optional[float] = None  # naive median / this median
    memory_vs_naive: Optional[float] = None   # this peak extra / naive peak extra
    error: Optional[str] = None


def run_case(case: Case, ceilings: dict, threads: int, memory: bool, log=print) -> list[Result]:
    results: list[Result] = []
    inputs = None
    for impl in impls_of(case):
        r = Result(case=case.name, impl=impl, ceiling=case.ceiling)
        results.append(r)
        if impl in case.skip or impl not in case.impls:
            r.skipped = case.skip.get(impl, "no implementation given")
            continue
        if inputs is None:
            inputs = case.setup()
        log(f"  {case.name} [{impl}] timing ...")
        try:
            times = time_impl(case.impls[impl], inputs, case.repeats)
        except Exception as e:  # one failing implementation must not hide the others
            r.error = f"{type(e).__name__}: {e}"
            continue
        r.times_ms = [t * 1e3 for t in times]
        med = statistics.median(times)
        r.median_ms = med * 1e3
        ceil = ceilings.get(case.ceiling)
        if case.ceiling == "copy_bw":
            if case.bytes_moved:
                r.gbps = case.bytes_moved / med / 1e9
                r.pct_of_ceiling = 100.0 * case.bytes_moved / med / ceil if ceil else None
        elif case.flops:
            r.tflops = case.flops / med / 1e12
            r.pct_of_ceiling = 100.0 * case.flops / med / ceil if ceil else None
    del inputs
    gc.collect()
    if memory:
        for r in results:
            if r.skipped or r.error:
                continue
            log(f"  {case.name} [{r.impl}] peak memory (fresh process) ...")
            m = measure_in_subprocess(case, r.impl, threads)
            if "error" in m:
                r.memory_error = m["error"]
            else:
                r.peak_extra_mib = m["peak_extra_mib"]
                r.memory_method = m["method"]
    naive = next((r for r in results if r.impl == NAIVE and r.median_ms), None)
    if naive is not None:
        for r in results:
            if r.median_ms:
                r.speedup_vs_naive = naive.median_ms / r.median_ms
            if r.peak_extra_mib is not None and naive.peak_extra_mib:
                r.memory_vs_naive = r.peak_extra_mib / naive.peak_extra_mib
    return results


def finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)
