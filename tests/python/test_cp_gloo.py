"""dsa.cp over real gloo process groups on the CPU (world sizes 2 and 4): every output and
gradient against the single-process run. One process group per world size runs every
case (torch import costs seconds per process); each process is bounded in time and
killed on failure, so a hang becomes a test failure, never a stuck CI."""
import json
import multiprocessing
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import pytest

import cp_gloo_cases

TIMEOUT_S = 240          # whole group (both world sizes run well under a minute each on 2 cores)
COLLECTIVE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    results = {}
    try:
        import torch
        torch.set_num_threads(1)
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        import cp_gloo_cases as cases
        for name, fn in cases.cases(world):
            chk = cases.Checker(rank)
            try:
                fn(chk, world, rank)
            except Exception:  # noqa: BLE001 - reported per case
                chk.errors.append(traceback.format_exc())
            results[name] = chk.errors
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
            # keep the ranks in step between cases
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        results["__worker__"] = [traceback.format_exc()]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        sys.exit(1)


_RESULTS = {}


def _run_group(world, tmp_path_factory):
    if world in _RESULTS:
        return _RESULTS[world]
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with gloo is required for the CP tests")
    for attempt in range(2):
        result = _spawn(world, str(tmp_path_factory.mktemp(f"cp_w{world}_{attempt}")))
        per_rank, hung, _ = result
        # The free port can be taken by another process between the probe and rank 0's
        # bind; only then (a rank reports it, and no rank got to its first case) is one
        # retry honest.
        started = any(set(res) - {"__worker__"} for res in per_rank)
        lost_port = not started and any("address already in use" in "".join(res.get("__worker__", [])).lower()
                                        for res in per_rank)
        if not lost_port:
            break
    _RESULTS[world] = result
    return result


def _spawn(world, out_dir):
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, out_dir), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
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


CASES = [(w, name) for w in (2, 4) for name, _ in cp_gloo_cases.cases(w)]


@pytest.mark.parametrize("world,case", CASES, ids=[f"W{w}-{n}" for w, n in CASES])
def test_cp_gloo(world, case, tmp_path_factory):
    per_rank, hung, codes = _run_group(world, tmp_path_factory)
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
