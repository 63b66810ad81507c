"""Runs a module's cases in real gloo process groups (spawned processes, one thread each)
and hands each case's errors back to pytest. One process group per (module, world size)
runs every case (importing torch and transformers costs seconds per process); each group
is bounded in time and its processes killed on failure, so a hang becomes a test
failure, never a stuck CI.

A case module defines ``cases(world) -> [(name, fn)]`` and a ``Checker(rank)`` class
with an ``errors`` list; ``fn(checker, world, rank)`` runs on every rank."""
import importlib
import json
import multiprocessing
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import pytest

COLLECTIVE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir, module):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    results = {}
    out = os.path.join(out_dir, f"rank{rank}.json")
    try:
        import torch
        torch.set_num_threads(1)
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        cases = importlib.import_module(module)
        for name, fn in cases.cases(world):
            chk = cases.Checker(rank)
            try:
                fn(chk, world, rank)
            except Exception:  # noqa: BLE001 - reported per case
                chk.errors.append(traceback.format_exc())
            results[name] = chk.errors
            with open(out, "w") as f:
                json.dump(results, f)
            # keep the ranks in step between cases
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        results["__worker__"] = [traceback.format_exc()]
        with open(out, "w") as f:
            json.dump(results, f)
        sys.exit(1)


def _spawn(module, world, out_dir, timeout_s):
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, out_dir, module), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    per_rank = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        per_rank.append(json.load(open(path)) if os.path.exists(path) else {})
    return per_rank, hung, [p.exitcode for p in procs]


_RESULTS = {}


def run_group(module, world, tmp_path_factory, timeout_s):
    """Every case of `module` at `world` ranks, run once per session: (per-rank results, hung ranks, exit codes)."""
    key = (module, world)
    if key in _RESULTS:
        return _RESULTS[key]
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with gloo is required for the CP tests")
    for attempt in range(2):
        result = _spawn(module, world, str(tmp_path_factory.mktemp(f"{module}_w{world}_{attempt}")), timeout_s)
        per_rank = result[0]
        # The free port can be taken by another process between the probe and rank 0's
        # bind; only then (a rank reports it, and no rank got to its first case) is one
        # retry honest.
        started = any(set(res) - {"__worker__"} for res in per_rank)
        lost_port = not started and any("address already in use" in "".join(res.get("__worker__", [])).lower()
                                        for res in per_rank)
        if not lost_port:
            break
    _RESULTS[key] = result
    return result


def check_case(module, world, case, tmp_path_factory, timeout_s):
    per_rank, hung, codes = run_group(module, world, tmp_path_factory, timeout_s)
    problems = []
    for r, res in enumerate(per_rank):
        if "__worker__" in res:
            problems.append(f"rank {r} worker failed:\n" + "\n".join(res["__worker__"]))
        if case not in res:
            problems.append(f"rank {r}: case did not finish" + (" (process hung, killed)" if r in hung else
                                                                  f" (exit code {codes[r]})"))
        else:
            problems += [f"rank {r}: {e}" for e in res[case]]
    assert not problems, "\n".join(problems)
