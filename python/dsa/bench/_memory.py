"""Child process of the harness: peak extra memory of one (case, implementation).

Usage (the harness runs it): python -m dsa.bench._memory --case NAME --impl IMPL --threads N
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsa.bench._memory")
    ap.add_argument("--case", required=True)
    ap.add_argument("--impl", required=True)
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from .runner import impls_of, load_cases, measure_here, skip_reason
    case = next((c for c in load_cases() if c.name == args.case), None)
    if case is None or args.impl not in impls_of(case, fp32_peer=True) or skip_reason(case, args.impl):
        print(f"unknown case/implementation: {args.case} [{args.impl}]", file=sys.stderr)
        return 2
    print(json.dumps(measure_here(case, args.impl)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
