"""Child process of the harness: times one (case, implementation) within a budget.

Usage (the harness runs it): python -m dsa.bench._time --case NAME --impl IMPL --threads N --budget S
Prints one JSON line per call ({"warmup_s": s} / {"run_s": s}) as it goes, so a
parent that kills it at the budget still has the runs that finished, then
{"done": true} (with "over_budget": true when no timed run fit).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

_START = time.perf_counter()  # the budget counts from here: imports and set-up included

import torch  # noqa: E402


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsa.bench._time")
    ap.add_argument("--case", required=True)
    ap.add_argument("--impl", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--budget", type=float, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from .runner import impl_callable, impls_of, load_cases, skip_reason, time_impl
    case = next((c for c in load_cases() if c.name == args.case), None)
    if case is None or args.impl not in impls_of(case, fp32_peer=True) or skip_reason(case, args.impl):
        print(f"unknown or skipped case/implementation: {args.case} [{args.impl}]", file=sys.stderr)
        return 2
    fn, setup = impl_callable(case, args.impl)
    inputs = setup()
    # A margin under the parent's kill: the last line must get out in time.
    deadline = _START + args.budget - 0.5
    times = time_impl(fn, inputs, case.repeats, deadline=deadline,
                      progress=lambda kind, sec: _emit({f"{kind}_s": sec}))
    _emit({"done": True, "over_budget": not times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
