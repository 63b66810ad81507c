"""dsa-train --cp 2 under torchrun (gloo, 2 processes): the fp32 loss curve and indexer KL
equal the single-process run's step by step; only rank 0 reports; per-rank step time and
peak memory in the JSON; clear errors for --cp without torchrun or with the wrong world."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
# A batch of 3 rows of 130 tokens packs into 390 (3 documents); the rank boundary (row
# 195) is 65 tokens into the second document: inside a CSA block (4) and inside its HCA
# block (128). 3 layers: sliding, CSA, HCA; top-16 of up to 32 entries.
TINY = ["--seq-len", "130", "--batch", "3", "--layers", "3", "--hidden", "64", "--heads", "2", "--head-dim", "64",
        "--index-topk", "16", "--threads", "1", "--no-progress", "--steps", "3", "--warmup-steps", "1",
        "--lr", "3e-3"]
TIMEOUT_S = 300


def _run(prefix, args, json_path):
    # A clean environment: no torchrun variables from an outer launcher.
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT / "python")
    return subprocess.run([*prefix, "-m", "dsa.train", *args, *TINY, "--json", str(json_path)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """The plain one-process run of TINY, the oracle of the CP and checkpointing tests
    (run once: on a 2-core machine a dsa.train process costs ~10 s)."""
    path = tmp_path_factory.mktemp("single") / "single.json"
    r = _run([sys.executable], [], path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(path.read_text())


def test_cp2_matches_single_process(tmp_path, single_process_run):
    parallel = tmp_path / "cp.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    r = _run(torchrun, ["--cp", "2"], parallel)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = single_process_run, json.loads(parallel.read_text())
    assert len(a["steps"]) == len(b["steps"]) == 3
    for x, y in zip(a["steps"], b["steps"]):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
        assert set(x["indexer_kl"]) == set(y["indexer_kl"]) == {"CSA"}
        for t in x["indexer_kl"]:
            assert abs(x["indexer_kl"][t] - y["indexer_kl"][t]) <= 1e-4 * abs(x["indexer_kl"][t]), (x, y)
    # The model learns (so the equality is not two runs that never moved).
    assert b["steps"][-1]["loss"] < b["steps"][0]["loss"] - 0.05
    cp = b["cp"]
    assert cp["world_size"] == 2 and [q["rank"] for q in cp["ranks"]] == [0, 1]
    assert [q["rows"] for q in cp["ranks"]] == [195, 195]
    assert all(q["step_seconds_median"] > 0 and q["peak_rss_gib"] > 0 for q in cp["ranks"])
    # Only rank 0 prints the summary and the per-rank table.
    assert r.stdout.count("sas+li: 3 steps") == 1 and r.stdout.count("context parallel: 2 ranks") == 1, r.stdout
    # The zigzag split (chunks r and 3 - r of 4: rows [0, 97) + [292, 390) and [97, 292))
    # trains the same steps.
    zigzag = tmp_path / "zigzag.json"
    r = _run(torchrun, ["--cp", "2", "--cp-balance", "zigzag"], zigzag)
    assert r.returncode == 0, r.stderr[-3000:]
    z = json.loads(zigzag.read_text())
    for x, y in zip(a["steps"], z["steps"]):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
        for t in x["indexer_kl"]:
            assert abs(x["indexer_kl"][t] - y["indexer_kl"][t]) <= 1e-4 * abs(x["indexer_kl"][t]), (x, y)
    assert z["cp"]["balance"] == "zigzag" and [q["rows"] for q in z["cp"]["ranks"]] == [195, 195]


def test_dp2_cp2_matches_single_process(tmp_path):
    """--dp 2 --cp 2 (4 processes, DDP) on 2 x 3 rows equals one process on the 6 rows."""
    single, mesh = tmp_path / "single.json", tmp_path / "mesh.json"
    at = TINY.index("--batch") + 1
    six = TINY[:at] + ["6"] + TINY[at + 1:]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT / "python")
    r = subprocess.run([sys.executable, "-m", "dsa.train", *six, "--json", str(single)], capture_output=True,
                       text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    r = _run(torchrun, ["--dp", "2", "--cp", "2"], mesh)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = json.loads(single.read_text()), json.loads(mesh.read_text())
    for x, y in zip(a["steps"], b["steps"]):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
        for t in x["indexer_kl"]:
            assert abs(x["indexer_kl"][t] - y["indexer_kl"][t]) <= 1e-4 * abs(x["indexer_kl"][t]), (x, y)
    assert b["steps"][-1]["loss"] < b["steps"][0]["loss"] - 0.05
    m = b["cp"]
    assert (m["world_size"], m["dp"], m["cp"], m["dp_wrap"]) == (4, 2, 2, "ddp")
    assert [(q["dp_rank"], q["cp_rank"], q["rows"]) for q in m["ranks"]] == [(0, 0, 195), (0, 1, 195),
                                                                             (1, 0, 195), (1, 1, 195)]
    assert r.stdout.count("data x context parallel: 2 x 2 ranks (gloo, ddp)") == 1, r.stdout


def _main(monkeypatch, capsys, argv, world=None):
    from dsa.train.__main__ import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_cp_flag_errors(monkeypatch, capsys):
    err = _main(monkeypatch, capsys, ["--cp", "2"])
    assert "--cp 2" in err and "torchrun" in err and "WORLD_SIZE is not set" in err, err
    err = _main(monkeypatch, capsys, ["--cp", "2"], world=3)
    assert "--cp 2" in err and "WORLD_SIZE=3" in err, err
    err = _main(monkeypatch, capsys, ["--cp", "2", "--config", "sas"], world=2)
    assert "--cp: needs --config sas+li" in err, err
    err = _main(monkeypatch, capsys, ["--cp", "2", "--compare"], world=2)
    assert "--cp: not with --compare" in err, err
    err = _main(monkeypatch, capsys, [], world=2)
    assert "without --cp 2" in err, err
    err = _main(monkeypatch, capsys, ["--dp", "2", "--cp", "2"], world=2)
    assert "--dp 2 --cp 2: needs 4 processes" in err and "WORLD_SIZE=2" in err, err
    err = _main(monkeypatch, capsys, ["--dp", "2", "--cp", "2"])
    assert "torchrun --nproc-per-node 4" in err, err
    err = _main(monkeypatch, capsys, ["--dp", "2", "--dp-wrap", "fsdp", "--save", "x"], world=2)
    assert "--save / --resume: not with --dp-wrap fsdp" in err, err
    err = _main(monkeypatch, capsys, ["--cp-balance", "zigzag"])
    assert "--cp-balance zigzag" in err and "--cp >= 2" in err, err
    err = _main(monkeypatch, capsys, ["--cp", "0"])
    assert "--cp: expected an integer >= 1, got 0" in err, err


def test_gradient_checkpointing_keeps_the_loss_curve(tmp_path, single_process_run):
    """--gradient-checkpointing (one process, and under --cp 2) trains the same steps as
    the run that keeps its activations: dsa's ops recompute the same bits, and under CP
    the recompute's collectives run in the same order on both ranks."""
    ckpt, cp_ckpt = tmp_path / "ckpt.json", tmp_path / "cp_ckpt.json"
    for prefix, args, path in (([sys.executable], ["--gradient-checkpointing"], ckpt),
                               ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2"], ["--cp", "2", "--gradient-checkpointing"], cp_ckpt)):
        r = _run(prefix, args, path)
        assert r.returncode == 0, r.stderr[-3000:]
    a = single_process_run
    b, c = (json.loads(p.read_text()) for p in (ckpt, cp_ckpt))
    assert b["spec"]["gradient_checkpointing"] and c["spec"]["gradient_checkpointing"]
    for x, y, z in zip(a["steps"], b["steps"], c["steps"]):
        assert y["loss"] == x["loss"], (x["step"], x["loss"], y["loss"])  # one process: the same bits
        assert abs(z["loss"] - x["loss"]) <= 1e-4 * abs(x["loss"]), (x["step"], x["loss"], z["loss"])
        for t in x["indexer_kl"]:
            assert y["indexer_kl"][t] == x["indexer_kl"][t]
            assert abs(z["indexer_kl"][t] - x["indexer_kl"][t]) <= 1e-4 * abs(x["indexer_kl"][t])
    assert a["steps"][-1]["loss"] < a["steps"][0]["loss"] - 0.05
