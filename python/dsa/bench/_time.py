"""Child process of the harness: times one (case, implementation) within a budget.

Usage (the harness runs it): python -m dsa.bench._time --case NAME --impl IMPL --threads N --deadline T
Prints one JSON line per call ({"warmup_s": s} / {"run_s": s}) as it goes, so a
parent that kills it at the budget still has the runs that finished, then
{"done": true} (with "over_budget": true when no timed run fit after the
warm-up; the parent then reports the warm-up run, marked as such). A
single-run case (case.py) gets one call without warm-up, printed with its
peak extra memory: {"run_s": s, "memory": {...}}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsa.bench._time")
    ap.add_argument("--case", required=True)
    ap.add_argument("--impl", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--deadline", type=float, required=True,
                    help="time.time() at which the parent kills this process")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from .runner import flush_caches, impl_callable, impls_of, load_cases, measure_run, skip_reason, time_impl
    case = next((c for c in load_cases() if c.name == args.case), None)
    if case is None or args.impl not in impls_of(case, fp32_peer=True) or skip_reason(case, args.impl):
        print(f"unknown or skipped case/implementation: {args.case} [{args.impl}]", file=sys.stderr)
        return 2
    fn, setup = impl_callable(case, args.impl)
    inputs = setup()
    # The parent's clock, started before this interpreter (and `import dsa`, which
    # `-m` runs first), so in wall-clock time; a margin before its kill.
    deadline = time.perf_counter() + (args.deadline - time.time()) - 0.5
    if case.single_run:  # one cold call, its time and its peak memory (case.py)
        flush_caches()
        seconds, memory = measure_run(fn, inputs, warm=False)
        _emit({"run_s": seconds, "memory": memory})
        _emit({"done": True, "over_budget": False})
        return 0
    times = time_impl(fn, inputs, case.repeats, deadline=deadline,
                      progress=lambda kind, sec: _emit({f"{kind}_s": sec}))
    _emit({"done": True, "over_budget": not times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
