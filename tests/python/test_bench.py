"""The benchmark harness works: discovery, timing, memory measurement, table, JSON, CLI.

Performance itself is never asserted here (quality.md); these check the machinery
on tiny cases so a broken `make run` shows up in `make test`.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import torch

import dsa
from dsa.bench import machine, runner
from dsa.bench.case import FUSED, NAIVE, REFERENCE, Case
from dsa.bench.report import COLUMNS, format_table
from dsa.naive import naive_indexer

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(dsa.__file__)))


def test_cases_are_discovered_and_well_formed():
    cases = runner.load_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    assert any(n.startswith("indexer/") for n in names)
    quick = runner.select_cases(cases, quick=True, pattern=None)
    assert quick and all(c.quick for c in quick)
    for c in cases:
        assert c.ceiling in ("bf16_gemm", "fp32_gemm", "copy_bw")
        assert c.flops > 0 or c.bytes_moved > 0, c.name
        assert FUSED in c.impls, c.name
        assert not (set(c.skip) & set(c.impls)), c.name  # skipped means not run


def test_indexer_case_flops_and_naive_skip():
    big = next(c for c in runner.load_cases() if c.name.startswith("indexer/bf16/T16384/"))
    assert big.flops == 2 * 64 * 128 * (16384 * 16385 // 2)
    assert NAIVE in big.skip and "GiB" in big.skip[NAIVE]


def test_naive_indexer_matches_reference_backend():
    g = torch.Generator().manual_seed(0)
    # Positive q and k: no relu zeros, so no exact score ties (torch.topk, which the naive
    # peer uses like a model would, does not promise the spec's smaller-position tie rule).
    q = torch.rand(40, 3, 16, generator=g, dtype=torch.float64)
    k = torch.rand(40, 16, generator=g, dtype=torch.float64)
    w = torch.randn(40, 3, generator=g, dtype=torch.float64)
    ours, _ = naive_indexer(q, k, w, topk=9, scale=0.5, query_lengths=[15, 40], key_lengths=[15, 40])
    ref = dsa.dsa_indexer(q.float(), k.float(), w.float(), topk=9, scale=0.5,
                          query_lengths=[15, 40], key_lengths=[15, 40], backend="reference")
    assert torch.equal(ours, ref)
    assert (ours[0, 1:] == -1).all() and ours[0, 0] == 0  # one visible key, then padding


def _alloc_case(mib: int) -> Case:
    def grow(x):  # touches every page, so RSS sees it
        return torch.ones(mib * (1 << 18), dtype=torch.float32)
    return Case(name="test/alloc", setup=dict, impls={FUSED: grow, NAIVE: grow},
                bytes_moved=mib * (1 << 20), ceiling="copy_bw",
                skip={REFERENCE: "not here"}, repeats=3)


def test_run_case_ratios_and_table():
    ceilings = {"bf16_gemm": 1e12, "fp32_gemm": 1e11, "copy_bw": 1e10}
    results = runner.run_case(_alloc_case(8), ceilings, threads=1, memory=False, log=lambda m: None)
    assert [r.impl for r in results] == [FUSED, NAIVE, REFERENCE]
    fused, naive, ref = results
    assert ref.skipped == "not here" and ref.median_ms is None
    assert len(fused.times_ms) == 3 and fused.median_ms > 0
    assert fused.gbps > 0 and fused.pct_of_ceiling > 0
    assert naive.speedup_vs_naive == 1.0
    table = format_table(results)
    assert all(col in table for col in COLUMNS)
    assert "skipped: not here" in table


def test_timed_runs_start_flushed_with_the_collector_off(monkeypatch):
    events = []
    monkeypatch.setattr(runner, "flush_caches", lambda: events.append("flush"))

    def op(_):
        events.append("gc on" if gc.isenabled() else "gc off")
        return 0
    assert gc.isenabled()
    times = runner.time_impl(op, {}, repeats=3)
    assert len(times) == 3 and gc.isenabled()
    # Two warm-up runs (a cheap op), then flush + run three times.
    assert events == ["gc on", "gc on"] + ["flush", "gc off"] * 3
    assert machine.cache_flush_bytes() >= max(256 << 20, machine.last_level_cache_bytes())


def test_peak_memory_counts_what_the_op_allocates():
    # In this (warm) process: the op touches 64 MiB; setup and warm-up are not counted.
    m = runner.measure_here(_alloc_case(64), FUSED)
    assert 60 <= m["peak_extra_mib"] <= 80, m


def test_cli_small_case_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    proc = subprocess.run(
        [sys.executable, "-m", "dsa.bench", "--filter", "T512/", "--threads", "1", "--gemm-size", "1024",
         "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "ceilings" in proc.stdout and "indexer/bf16/T512" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["machine"]["threads"] == 1 and doc["ceilings"]["bf16_gemm"] > 0
    by_impl = {r["impl"]: r for r in doc["results"]}
    assert set(by_impl) == {FUSED, NAIVE, REFERENCE}
    for r in by_impl.values():
        assert r["median_ms"] > 0 and r["tflops"] > 0 and r["error"] is None
        assert r["peak_extra_mib"] is not None and r["memory_error"] is None
    assert by_impl[NAIVE]["speedup_vs_naive"] == 1.0


def test_cli_rejects_an_empty_selection():
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    proc = subprocess.run([sys.executable, "-m", "dsa.bench", "--filter", "no-such-case"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "no case" in proc.stderr
