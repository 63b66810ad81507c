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

from .case import FUSED, NAIVE, NAIVE_FP32, REFERENCE, Case, work_of

IMPL_ORDER = (FUSED, NAIVE, NAIVE_FP32, REFERENCE)

# Timing: at least MIN_REPEATS timed runs, more while they fit in TIME_BUDGET_S.
MIN_REPEATS, MAX_REPEATS, TIME_BUDGET_S = 3, 25, 1.5
SLOW_RUN_S = 20.0  # a run longer than this is timed once

# Wall-time budget of one implementation's timing (its child process: start,
# set-up, warm-up and timed runs); over it the row reads "skipped: over N s".
BUDGET_S, QUICK_BUDGET_S = 150.0, 45.0

# Extra case modules (comma-separated importable names), e.g. the test suite's.
CASE_MODULES_ENV = "DSA_BENCH_CASE_MODULES"


def load_cases() -> list[Case]:
    """Every CASES list of python/dsa/bench/cases/*.py, in module then list order."""
    from . import cases as pkg
    found: list[Case] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        found.extend(getattr(module, "CASES", []))
    for name in filter(None, os.environ.get(CASE_MODULES_ENV, "").split(",")):
        found.extend(getattr(importlib.import_module(name.strip()), "CASES", []))
    names = [c.name for c in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RuntimeError(f"benchmark case names must be unique, repeated: {', '.join(dup)}")
    return found


def select_cases(cases: list[Case], quick: bool, pattern: Optional[str]) -> list[Case]:
    """The cases `--quick` / `--filter` ask for; a filter of comma-separated parts
    selects the cases whose name contains any of them (one run, one set of ceilings)."""
    parts = [p for p in pattern.split(",") if p] if pattern is not None else None
    return [c for c in cases if (c.quick or not quick) and (parts is None or any(p in c.name for p in parts))]


def wants_fp32_peer(case: Case, bf16_native: bool) -> bool:
    """A bf16 case gets the fp32 naive peer where torch's bf16 is emulated."""
    return not bf16_native and work_of(case)[1] == "bf16" and (NAIVE in case.impls or NAIVE in case.skip)


def impls_of(case: Case, fp32_peer: bool = False) -> list[str]:
    """Implementations the table shows for a case: runnable ones and skipped ones."""
    keys = set(case.impls) | set(case.skip)
    if fp32_peer and NAIVE in keys:
        keys.add(NAIVE_FP32)
    return [k for k in IMPL_ORDER if k in keys] + sorted(keys - set(IMPL_ORDER))


def skip_reason(case: Case, impl: str) -> Optional[str]:
    if impl == NAIVE_FP32 and NAIVE_FP32 not in case.impls and NAIVE_FP32 not in case.skip:
        impl = NAIVE  # the fp32 peer runs the naive one: skipped when it is
    if impl in case.skip:
        return case.skip[impl]
    return None if impl in case.impls else "no implementation given"


def upcast(x: Any) -> Any:
    """``x`` with every bf16 tensor cast to fp32 (requires_grad kept), through dicts, lists and tuples."""
    import torch
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.bfloat16:
            return x
        return x.detach().float().requires_grad_(x.requires_grad)
    if isinstance(x, dict):
        return {k: upcast(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(upcast(v) for v in x)
    return x


def impl_callable(case: Case, impl: str):
    """(run(inputs), setup()) of one implementation; the fp32 peer is the naive
    callable on the case's inputs cast to fp32 at set-up (not timed: a user
    with emulated bf16 would hold fp32 tensors in the first place)."""
    if impl == NAIVE_FP32 and NAIVE_FP32 not in case.impls:
        return case.impls[NAIVE], lambda: upcast(case.setup())
    return case.impls[impl], case.setup


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


def time_impl(fn, inputs: dict[str, Any], repeats: Optional[int], deadline: Optional[float] = None,
              progress=None) -> list[float]:
    """Seconds of each timed run, after warm-up (first call: lazy init, page faults).

    Each timed run starts the way an op starts inside a model step: its data out
    of the caches (flush_caches(), as Triton's do_bench clears the GPU's L2) and
    the cores awake (the flush runs on every thread). The garbage collector runs
    once before the timed runs and is off during them, as timeit does, so no
    collection lands inside a run. (Collecting before every run instead left one
    vCPU idle for ~60 ms each time, and on a VM an idle vCPU comes back slow:
    that measured the host's wake-up, not the op.)

    ``deadline`` (a time.perf_counter() value): no timed run starts that the
    warm-up predicts to end after it; the result may then be empty. ``progress``
    is called with ("warmup" | "run", seconds) after every call, and with
    ("cut", 0.0) when the deadline leaves fewer runs than planned.
    """
    report = progress or (lambda kind, sec: None)
    t0 = time.perf_counter()
    out = fn(inputs)
    estimate = time.perf_counter() - t0
    del out
    report("warmup", estimate)
    # A second warm-up run estimates better: the first carries lazy initialisation
    # (~1 s on a first decode call), which made a 5 ms op look slow enough for only
    # MIN_REPEATS timed runs, the first of them still settling. Skipped only for runs
    # long enough that the budget cannot afford one, or when the deadline would not
    # leave a timed run after it.
    if estimate < 2.0 and (deadline is None
                           or time.perf_counter() + 2 * (estimate * 1.1 + 0.1) <= deadline):
        t0 = time.perf_counter()
        out = fn(inputs)
        estimate = time.perf_counter() - t0
        del out
        report("warmup", estimate)
    auto = repeats is None
    if auto:
        repeats = int(min(MAX_REPEATS, max(MIN_REPEATS, TIME_BUDGET_S / max(estimate, 1e-6))))
        if estimate > SLOW_RUN_S:  # minutes-long naive peers: one timed run after the warm-up
            repeats = 1
    if deadline is not None:
        # The flush before each run costs time too: ~0.1 s at most here.
        fit = int((deadline - time.perf_counter()) // (estimate * 1.1 + 0.1))
        if fit < repeats:
            report("cut", 0.0)
            repeats = max(0, fit)
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
            report("run", times[-1])
            # The estimate can be off on a loaded machine: bound the wall time, not only the count.
            if auto and len(times) >= MIN_REPEATS and time.perf_counter() - start > 2 * TIME_BUDGET_S:
                break
            if (deadline is not None and len(times) < repeats
                    and time.perf_counter() + times[-1] * 1.1 + 0.1 > deadline):
                report("cut", 0.0)
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


def measure_run(fn, inputs: dict[str, Any], warm: bool = True) -> tuple[float, dict]:
    """(seconds, peak extra resident memory) of one call of ``fn(inputs)``.

    After an optional warm-up call (lazy initialisation is not the op's memory),
    the RSS high-water mark is reset to the current RSS; the peak is the
    high-water after one more call minus the RSS right before it. It counts every
    page the op touches: outputs, scratch, intermediate tensors.
    """
    import resource
    can_reset = _reset_high_water()
    if warm and can_reset:
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
    t0 = time.perf_counter()
    out = fn(inputs)
    seconds = time.perf_counter() - t0
    peak = _proc_status_kib("VmHWM") if can_reset else None
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del out
    return seconds, {"peak_extra_mib": max(0, peak - base) / 1024.0, "base_rss_mib": base / 1024.0,
                     "method": method}


def measure_here(case: Case, impl: str) -> dict:
    """Peak extra memory of one warm run of ``impl``; runs in a fresh process."""
    fn, setup = impl_callable(case, impl)
    return measure_run(fn, setup())[1]


# A fixed glibc mmap threshold turns off its dynamic raise, so blocks freed by a
# warm-up run go back to the OS instead of being reused silently by the measured one.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def _child_env() -> dict:
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def time_in_subprocess(case: Case, impl: str, threads: int, budget_s: float) -> dict:
    """Times one (case, impl) in ``python -m dsa.bench._time``, killed after ``budget_s``.

    Returns {"times": [s, ...]} (possibly cut short by the budget: "cut": True),
    {"over_budget": True} when no timed run finished in time, or {"error": msg}.
    A child process is the only way to stop a torch op that runs for minutes
    (an emulated bf16 matmul) without waiting for it.
    """
    cmd = [sys.executable, "-m", "dsa.bench._time", "--case", case.name, "--impl", impl,
           "--threads", str(threads), "--deadline", f"{time.time() + budget_s:.3f}"]
    env = _child_env()
    if case.single_run:  # the child also measures the run's peak memory
        env.update(MEMORY_ENV)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=budget_s)
        out, err, code, killed = proc.stdout, proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as e:
        out, err, code, killed = _text(e.stdout), _text(e.stderr), None, True
    events = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    times = [e["run_s"] for e in events if "run_s" in e]
    warmups = [e["warmup_s"] for e in events if "warmup_s" in e]
    final = next((e for e in events if "done" in e), None)
    cut = killed or any("cut_s" in e for e in events)
    if killed or (final is not None and final.get("over_budget")):
        if times:
            return {"times": times, "cut": True}
        # A call of many seconds: its warm-up run is a measurement too (lazy
        # initialisation is milliseconds of it), better than none; marked.
        return {"times": warmups[-1:], "cut": True, "warmup_only": True} if warmups else {"over_budget": True}
    if code != 0:
        tail = (err or out).strip().splitlines()[-1:] or [f"exit {code}"]
        return {"error": tail[0]}
    if final is None or not times:
        return {"error": "no timing printed"}
    got = {"times": times, "cut": cut}
    memory = next((e["memory"] for e in events if "memory" in e), None)
    if memory is not None:
        got["memory"] = memory
    return got


def measure_in_subprocess(case: Case, impl: str, threads: int, timeout_s: float = 900) -> dict:
    """Runs ``python -m dsa.bench._memory`` for one (case, impl) and returns its JSON."""
    env = _child_env()
    env.update(MEMORY_ENV)
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
    gops: Optional[float] = None             # instruction-bound cases: G vector operations / s
    ceiling: str = ""                        # key in the ceilings (machine.CEILING_LABEL)
    ceiling_label: str = ""                  # what the table calls it, e.g. "bf16 dot avx512"
    pct_of_ceiling: Optional[float] = None
    timing_cut: bool = False                 # fewer timed runs than planned: the budget ran out
    warmup_only: bool = False                # not even one timed run fit: the time is the warm-up run's
    single_run: bool = False                 # a long-context case: one cold run (case.py)
    peak_extra_mib: Optional[float] = None
    memory_method: Optional[str] = None
    memory_error: Optional[str] = None
    speedup_vs_naive: Optional[float] = None  # faster naive peer's median / this median
    memory_vs_naive: Optional[float] = None   # this peak extra / that peer's peak extra
    naive_peer: Optional[str] = None          # the peer both ratios use: "naive" or "naive_fp32"
    error: Optional[str] = None


def emulation_skip(case: Case, impl: str, emulated_bf16_flops: Optional[float], budget_s: float) -> Optional[str]:
    """Why the bf16 naive peer is not run where torch's bf16 matmul is emulated: the
    case's own FLOPs at the emulation's rate (the probe's, times the threads; a lower
    bound of the peer's time, which computes at least those) would not fit the budget.
    It would only burn the budget to read 'over budget'; the fp32 peer runs instead."""
    if impl != NAIVE or not emulated_bf16_flops or not case.flops or work_of(case) != ("compute", "bf16"):
        return None
    predicted = case.flops / emulated_bf16_flops
    if predicted <= budget_s:
        return None
    return (f"bf16 matmul emulated here ({emulated_bf16_flops / 1e9:.2g} GFLOP/s): at least "
            f"{predicted:.0f} s predicted, over the {budget_s:.0f} s budget")


def run_case(case: Case, ceilings: dict, threads: int, memory: bool, log=print, *,
             ceiling: Optional[str] = None, ceiling_label: str = "", fp32_peer: bool = False,
             budget_s: float = BUDGET_S, isolate: bool = True,
             emulated_bf16_flops: Optional[float] = None, isa: str = "") -> list[Result]:
    """Times every implementation of ``case`` and compares it with ``ceiling``
    (a key of ``ceilings``; default: the case's own work kind, for callers that
    pass ceilings keyed "compute" / "copy_bw").

    isolate: time each implementation in a child process killed after
    ``budget_s`` (what the CLI does); False times in this process, which
    bounds the number of runs but cannot stop a single slow call (tests).
    emulated_bf16_flops: torch's emulated bf16 matmul rate where it is not native
    (see emulation_skip). isa: dsa's ISA level, which picks the case's vector_ops count
    for an instruction-bound case.
    """
    work, _ = work_of(case)
    key = ceiling or work
    budget_s = case.budget_s or budget_s
    results: list[Result] = []
    inputs = {}
    for impl in impls_of(case, fp32_peer):
        r = Result(case=case.name, impl=impl, ceiling=key, ceiling_label=ceiling_label or key,
                   single_run=case.single_run)
        results.append(r)
        why = skip_reason(case, impl) or emulation_skip(case, impl, emulated_bf16_flops, budget_s)
        if why is not None:
            r.skipped = why
            continue
        log(f"  {case.name} [{impl}] timing ...")
        if isolate:
            got = time_in_subprocess(case, impl, threads, budget_s)
            if "error" in got:
                r.error = got["error"]
                continue
            if got.get("over_budget"):
                r.skipped = f"over {budget_s:.0f} s (timing budget per implementation)"
                continue
            times, r.timing_cut, r.warmup_only = got["times"], bool(got.get("cut")), bool(got.get("warmup_only"))
            if "memory" in got:
                r.peak_extra_mib = got["memory"]["peak_extra_mib"]
                r.memory_method = got["memory"]["method"] + " (the timed run)"
        else:
            fn, setup = impl_callable(case, impl)
            kind = "fp32" if impl == NAIVE_FP32 else "case"  # one set-up per kind of inputs
            if kind not in inputs:
                inputs[kind] = setup()
            try:
                if case.single_run:
                    times = [measure_run(fn, inputs[kind], warm=False)[0]]
                else:
                    times = time_impl(fn, inputs[kind], case.repeats,
                                      deadline=time.perf_counter() + budget_s)
            except Exception as e:  # one failing implementation must not hide the others
                r.error = f"{type(e).__name__}: {e}"
                continue
            if not times:
                r.skipped = f"over {budget_s:.0f} s (timing budget per implementation)"
                continue
        r.times_ms = [t * 1e3 for t in times]
        med = statistics.median(times)
        r.median_ms = med * 1e3
        ceil = ceilings.get(key)
        if work == "copy_bw":
            if case.bytes_moved:
                r.gbps = case.bytes_moved / med / 1e9
                r.pct_of_ceiling = 100.0 * case.bytes_moved / med / ceil if ceil else None
        elif work == "vector_ops":
            if ops := case.vector_ops.get(isa):
                r.gops = ops / med / 1e9
                r.pct_of_ceiling = 100.0 * ops / med / ceil if ceil else None
        elif case.flops:
            r.tflops = case.flops / med / 1e12
            r.pct_of_ceiling = 100.0 * case.flops / med / ceil if ceil else None
    del inputs
    gc.collect()
    if memory:
        for r in results:
            if r.skipped or r.error or r.memory_method:
                continue
            if case.single_run:
                r.memory_error = "not measured: single-run case timed in this process"
                continue
            if r.warmup_only:  # set-up and two calls would not fit twice the budget either
                r.memory_error = "not measured: one call took the whole timing budget"
                continue
            log(f"  {case.name} [{r.impl}] peak memory (fresh process) ...")
            # Set-up, a warm-up and one run: what the timing child did within its budget.
            m = measure_in_subprocess(case, r.impl, threads, timeout_s=2 * budget_s)
            if "error" in m:
                r.memory_error = m["error"]
            else:
                r.peak_extra_mib = m["peak_extra_mib"]
                r.memory_method = m["method"]
    peers = [r for r in results if r.impl in (NAIVE, NAIVE_FP32) and r.median_ms]
    naive = min(peers, key=lambda r: r.median_ms) if peers else None
    if naive is not None:
        for r in results:
            r.naive_peer = naive.impl
            if r.median_ms:
                r.speedup_vs_naive = naive.median_ms / r.median_ms
            if r.peak_extra_mib is not None and naive.peak_extra_mib:
                r.memory_vs_naive = r.peak_extra_mib / naive.peak_extra_mib
    return results


def finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)
