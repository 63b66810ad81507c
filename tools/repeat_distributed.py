"""Runs the distributed (gloo) suites again and again and records what fails.

    python tools/repeat_distributed.py [--runs 30] [--timeout 600] [--json build/distributed_repeat.json]

Each run is a fresh ``pytest`` process over the context-parallel suites (real gloo
process groups: tests/python/test_cp_gloo.py, test_cp_model.py, test_train_cp.py),
bounded by ``--timeout`` seconds, so a hang is a recorded failure, never a stuck
run. A rank that dies by a signal shows in the harness's messages as a negative exit
code ("exit code -6" for SIGABRT); those are counted apart. Prints a progress line
per run, a table at the end, and writes a JSON of every run's outcome.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = ["tests/python/test_cp_gloo.py", "tests/python/test_cp_model.py", "tests/python/test_train_cp.py"]


def one_run(timeout_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s)
        out, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    failed = sorted(set(re.findall(r"^FAILED (\S+)", out, flags=re.M)))
    signals = sorted(set(re.findall(r"exit code (-\d+)", out)))
    summary = (out.strip().splitlines() or [""])[-1]  # pytest -q's last line: "51 passed in 44.04s"
    return {"seconds": round(time.monotonic() - start, 1), "exit": code, "failed": failed,
            "rank_signals": signals, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--json", default=str(ROOT / "build" / "distributed_repeat.json"))
    args = ap.parse_args(argv)
    runs = []
    for i in range(args.runs):
        r = one_run(args.timeout)
        runs.append(r)
        bad = "ok" if r["exit"] == 0 else f"FAILED ({r['exit']}): {', '.join(r['failed']) or r['summary']}"
        print(f"[{i + 1}/{args.runs}] {r['seconds']:.0f} s {bad}"
              + (f"; rank signals {r['rank_signals']}" if r["rank_signals"] else ""), flush=True)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"suites": SUITES, "runs": runs}, indent=1))
    ok = sum(r["exit"] == 0 for r in runs)
    tests = {}
    for r in runs:
        for t in r["failed"]:
            tests[t] = tests.get(t, 0) + 1
    print(f"\n| runs | passed | failed | timed out | runs with a rank killed by a signal |")
    print(f"|---|---|---|---|---|")
    print(f"| {len(runs)} | {ok} | {sum(r['exit'] not in (0, 'timeout') for r in runs)} | "
          f"{sum(r['exit'] == 'timeout' for r in runs)} | {sum(bool(r['rank_signals']) for r in runs)} |")
    for t, n in sorted(tests.items(), key=lambda kv: -kv[1]):
        print(f"- {t}: failed in {n} run(s)")
    print(f"wrote {args.json}")
    return 0 if ok == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
