"""The benchmark harness works: discovery, timing, memory measurement, table, JSON, CLI.

Performance itself is never asserted here (docs/testing.md); these check the machinery
on tiny cases so a broken `make run` shows up in `make test`.
"""
from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time

import pytest
from dataclasses import replace
import torch

import dsa
from dsa import _C
from dsa.bench import machine, runner
from dsa.bench.case import FUSED, NAIVE, NAIVE_FP32, REFERENCE, Case, work_of
from dsa.bench.machine import LANES_OF_ISA, ceiling_label, choose_ceiling
from dsa.bench.report import COLUMNS, format_table
from dsa.naive import naive_indexer

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(dsa.__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def test_cases_are_discovered_and_well_formed():
    cases = runner.load_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    assert any(n.startswith("indexer/") for n in names)
    quick = runner.select_cases(cases, quick=True, pattern=None)
    assert quick and all(c.quick for c in quick)
    # Comma-separated filter parts: the union of what each part selects, in case order.
    either = runner.select_cases(cases, quick=False, pattern="compressor/,indexer/bf16/T512/")
    assert [c.name for c in either] == [c.name for c in cases
                                        if c.name.startswith("compressor/") or "indexer/bf16/T512/" in c.name]
    assert {c.name.split("/")[0] for c in either} == {"compressor", "indexer"}
    for c in cases:
        if c.ceiling == "binding":  # resolved per machine: two bounds at least must be known
            assert c.bytes_moved > 0 and (c.flops > 0 or set(c.vector_ops) == set(LANES_OF_ISA)), c.name
            c = replace(c, ceiling="compute" if c.flops else "copy_bw")
        assert work_of(c) in (("compute", "bf16"), ("compute", "fp32"), ("copy_bw", "bf16"), ("copy_bw", "fp32"))
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


def _small_decode_cases():
    from dsa.bench.cases import decode
    for dt in ("bf16", "fp8"):
        yield decode.attention_case(4, 512, 2, dt, topk=64)
        yield decode.indexer_case(512, 2, 2, dt, Hi=4, Di=32, topk=64)
        yield decode.v4_attention_case("csa", 2048, 2, dt, H=4, topk=16)
        yield decode.v4_attention_case("hca", 2048, 2, dt, H=4)
    yield decode.compressor_append_case("csa", 2)


def test_decode_peers_run_in_fp32_where_the_harness_upcasts():
    # On a CPU whose torch bf16 matmul is emulated (AVX2-only), the harness runs the naive
    # peer on the inputs cast to fp32 (naive_fp32): the decode peers must then compute in
    # fp32 too, not mix fp32 queries with rows gathered as bf16 (an AVX2 run failed so).
    for case in _small_decode_cases():
        x = case.setup()
        want, got = case.impls[NAIVE](x), case.impls[NAIVE](runner.upcast(x))
        for w, g in zip(want if isinstance(want, list) else [want], got if isinstance(got, list) else [got]):
            assert w.shape == g.shape, case.name
            if w.is_floating_point():
                assert g.dtype == torch.float32, case.name
                if "/fp8/" not in case.name:  # FP8 rows reach |k| ~ 28: logits of hundreds, bf16 moves the softmax
                    torch.testing.assert_close(g, w.float(), atol=5e-2, rtol=5e-2, msg=case.name)


def _alloc_case(mib: int) -> Case:
    def grow(x):  # touches every page, so RSS sees it
        return torch.ones(mib * (1 << 18), dtype=torch.float32)
    return Case(name="test/alloc", setup=dict, impls={FUSED: grow, NAIVE: grow},
                bytes_moved=mib * (1 << 20), ceiling="copy_bw",
                skip={REFERENCE: "not here"}, repeats=3)


def test_run_case_ratios_and_table():
    ceilings = {"bf16_gemm": 1e12, "fp32_gemm": 1e11, "copy_bw": 1e10}
    results = runner.run_case(_alloc_case(8), ceilings, threads=1, memory=False, log=lambda m: None,
                              ceiling_label="copy BW", isolate=False)
    assert [r.impl for r in results] == [FUSED, NAIVE, REFERENCE]
    fused, naive, ref = results
    assert ref.skipped == "not here" and ref.median_ms is None
    assert len(fused.times_ms) == 3 and fused.median_ms > 0
    assert fused.gbps > 0 and fused.pct_of_ceiling > 0
    assert fused.pct_of_ceiling == pytest.approx(100 * fused.gbps * 1e9 / ceilings["copy_bw"])
    assert naive.speedup_vs_naive == 1.0 and naive.naive_peer == NAIVE
    table = format_table(results)
    assert all(col in table for col in COLUMNS)
    assert "skipped: not here" in table and "copy BW" in table


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
         "--bf16", "native", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "ceilings" in proc.stdout and "indexer/bf16/T512" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["machine"]["threads"] == 1 and doc["ceilings"]["fp32_gemm"] > 0
    assert doc["machine"]["bf16"]["native"] is True and doc["ceilings"]["bf16_gemm"] > 0  # --bf16 native
    for k in _C.peak_kernels():
        assert doc["ceilings"][k] > 0
    expected = choose_ceiling("compute", "bf16", _C.cpu_isa(), True, set(_C.peak_kernels()))
    by_impl = {r["impl"]: r for r in doc["results"]}
    assert set(by_impl) == {FUSED, NAIVE, REFERENCE}  # bf16 native: no fp32 peer
    for r in by_impl.values():
        assert r["median_ms"] > 0 and r["tflops"] > 0 and r["error"] is None
        assert r["peak_extra_mib"] is not None and r["memory_error"] is None
        assert r["ceiling"] == expected and r["ceiling_label"] == ceiling_label(expected, _C.cpu_isa())
        assert r["pct_of_ceiling"] == pytest.approx(100 * r["tflops"] * 1e12 / doc["ceilings"][expected])
    assert by_impl[NAIVE]["speedup_vs_naive"] == 1.0 and by_impl[FUSED]["naive_peer"] == NAIVE
    assert by_impl[FUSED]["ceiling_label"] in proc.stdout


@pytest.mark.parametrize("listing", [False, True])
def test_cli_rejects_an_empty_selection(listing):
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    proc = subprocess.run([sys.executable, "-m", "dsa.bench", "--filter", "no-such-case"] + ["--list"] * listing,
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "no case" in proc.stderr


# ------------------------------------------------------------------ ceilings and budgets

PEAKS_ALL = {"fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512", "bf16_dot_avx512"}


@pytest.mark.parametrize("work,dtype,isa,native,peaks,expected", [
    ("copy_bw", "bf16", "amx", True, PEAKS_ALL, "copy_bw"),
    ("copy_bw", "bf16", "avx2", False, PEAKS_ALL, "copy_bw"),
    # Sapphire Rapids: oneDNN's AMX GEMM is what bf16 reaches there.
    ("compute", "bf16", "amx", True, PEAKS_ALL, "bf16_gemm"),
    ("compute", "fp32", "amx", True, PEAKS_ALL, "fp32_fma_avx512"),
    ("compute", "bf16", "amx", False, PEAKS_ALL, "bf16_dot_avx512"),
    # Zen 4/5 (avx512_bf16, no AMX): the vdpbf16ps peak, native torch bf16 or not.
    ("compute", "bf16", "avx512_bf16", True, PEAKS_ALL, "bf16_dot_avx512"),
    ("compute", "bf16", "avx512_bf16", False, PEAKS_ALL, "bf16_dot_avx512"),
    ("compute", "fp32", "avx512_bf16", True, PEAKS_ALL, "fp32_fma_avx512"),
    # DSA_ISA=avx512 there: dsa's kernels convert bf16 to fp32 and run FMAs.
    ("compute", "bf16", "avx512", True, PEAKS_ALL, "fp32_fma_avx512"),
    # Skylake-class AVX-512 without bf16 dot products.
    ("compute", "bf16", "avx512", True, {"fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512"}, "fp32_fma_avx512"),
    # DSA_ISA=avx2 on an AVX-512 machine, and Zen 3: the AVX2 FMA peak, not torch's GEMM.
    ("compute", "bf16", "avx2", True, PEAKS_ALL, "fp32_fma_avx2"),
    ("compute", "bf16", "avx2", False, {"fp32_portable", "fp32_fma_avx2"}, "fp32_fma_avx2"),
    ("compute", "fp32", "avx2", False, {"fp32_portable", "fp32_fma_avx2"}, "fp32_fma_avx2"),
    ("compute", "bf16", "portable", True, PEAKS_ALL, "fp32_portable"),
])
def test_choose_ceiling(work, dtype, isa, native, peaks, expected):
    assert choose_ceiling(work, dtype, isa, native, peaks) == expected


def test_ceiling_labels_name_the_kind():
    assert ceiling_label("bf16_gemm", "amx") == "bf16 GEMM (AMX)"
    assert ceiling_label("fp32_fma_avx2", "avx2") == "fp32 FMA avx2"
    assert ceiling_label("fp32_fma_avx512", "avx512") == "fp32 FMA avx512"
    assert ceiling_label("bf16_dot_avx512", "avx512") == "bf16 dot avx512"
    with pytest.raises(ValueError):
        choose_ceiling("compute", "bf16", "sse9", True, PEAKS_ALL)


def test_legacy_ceiling_names_still_mean_compute():
    def case(**kw):
        return Case(name="x", setup=dict, impls={FUSED: len}, flops=1.0, **kw)
    assert work_of(case(ceiling="bf16_gemm")) == ("compute", "bf16")
    assert work_of(case(ceiling="fp32_gemm")) == ("compute", "fp32")
    assert work_of(case(ceiling="copy_bw", dtype="fp32")) == ("copy_bw", "fp32")
    with pytest.raises(ValueError):
        work_of(case(ceiling="gemm"))


def test_fp32_peer_only_for_bf16_cases_where_bf16_is_emulated():
    cases = {c.name: c for c in runner.load_cases()}
    idx = cases["indexer/bf16/T512/Hi8/K64"]
    assert runner.wants_fp32_peer(idx, bf16_native=False)
    assert not runner.wants_fp32_peer(idx, bf16_native=True)
    assert runner.impls_of(idx, fp32_peer=True) == [FUSED, NAIVE, NAIVE_FP32, REFERENCE]
    assert runner.impls_of(idx, fp32_peer=False) == [FUSED, NAIVE, REFERENCE]
    # A skipped naive peer skips its fp32 version, for the same reason.
    big = cases["indexer/bf16/T16384/Hi64/K2048"]
    assert runner.skip_reason(big, NAIVE_FP32) == big.skip[NAIVE]
    fp32 = Case(name="y", setup=dict, impls={FUSED: len, NAIVE: len}, flops=1.0, dtype="fp32")
    assert not runner.wants_fp32_peer(fp32, bf16_native=False)
    # The dense KL peer fits in bf16 on this project's 24 GiB machines, not in fp32.
    from dsa.bench.case import memory_gib
    from dsa.bench.cases.kl_loss import DENSE_T4096_FP32_PEER_GIB
    dense = cases["kl_loss/dense/bf16/T4096"]
    assert runner.skip_reason(dense, NAIVE) is None
    fp32_skip = runner.skip_reason(dense, NAIVE_FP32)
    assert (fp32_skip is not None) == (memory_gib() < DENSE_T4096_FP32_PEER_GIB), fp32_skip


def test_emulated_bf16_peer_is_skipped_only_where_it_cannot_fit_the_budget():
    bf16 = Case(name="z", setup=dict, impls={FUSED: len, NAIVE: len}, flops=1e12, dtype="bf16")
    # 1 TFLOP at 1 GFLOP/s: 1000 s, over a 150 s budget.
    why = runner.emulation_skip(bf16, NAIVE, 1e9, 150)
    assert why and "emulated" in why and "1000 s" in why and "150 s" in why
    assert runner.emulation_skip(bf16, NAIVE, 1e10, 150) is None  # 100 s fits
    assert runner.emulation_skip(bf16, NAIVE, None, 150) is None  # bf16 native
    assert runner.emulation_skip(bf16, NAIVE_FP32, 1e9, 150) is None  # the fp32 peer always runs
    assert runner.emulation_skip(bf16, FUSED, 1e9, 150) is None
    fp32 = Case(name="y", setup=dict, impls={FUSED: len, NAIVE: len}, flops=1e12, dtype="fp32")
    assert runner.emulation_skip(fp32, NAIVE, 1e9, 150) is None
    (r_fused, r_naive) = runner.run_case(bf16, {"compute": 1e12}, threads=1, memory=False, log=lambda *a: None,
                                         isolate=False, emulated_bf16_flops=1e9, budget_s=5)
    assert r_naive.skipped and "emulated" in r_naive.skipped and r_fused.median_ms is not None


def test_torch_isa_env_covers_every_dsa_isa():
    assert set(machine.TORCH_ISA_ENV) == {"portable", "avx2", "avx512", "avx512_bf16", "amx"}
    assert machine.torch_isa_env("avx2") == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                             "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert machine.torch_isa_env("amx") == {}
    with pytest.raises(ValueError, match="isa"):
        machine.torch_isa_env("sse2")


def test_upcast_casts_bf16_tensors_only_and_keeps_requires_grad():
    x = {"a": torch.ones(3, dtype=torch.bfloat16).requires_grad_(), "n": 7,
         "kw": {"b": torch.ones(2, dtype=torch.bfloat16), "i": torch.arange(3), "f": torch.ones(1)},
         "l": [torch.ones(1, dtype=torch.bfloat16)]}
    y = runner.upcast(x)
    assert y["a"].dtype == torch.float32 and y["a"].requires_grad and y["a"].is_leaf
    assert y["kw"]["b"].dtype == torch.float32 and y["kw"]["i"].dtype == torch.int64
    assert y["kw"]["f"] is x["kw"]["f"] and y["n"] == 7 and y["l"][0].dtype == torch.float32
    assert x["a"].dtype == torch.bfloat16  # the case's own inputs are untouched


def test_dsa_peak_microbenchmark_is_short_and_validates():
    kernels = _C.peak_kernels()
    assert kernels[0] == "fp32_portable"
    isa = _C.cpu_isa()
    # The kernel of the ISA dsa runs is always there to compare with.
    assert {"avx2": "fp32_fma_avx2", "avx512": "fp32_fma_avx512", "avx512_bf16": "fp32_fma_avx512",
            "amx": "fp32_fma_avx512", "portable": "fp32_portable"}[isa] in kernels
    if isa in ("avx512_bf16", "amx"):
        assert "bf16_dot_avx512" in kernels
    for k in kernels:
        t0 = time.perf_counter()
        flops = _C.measure_peak_flops(k, 0, 0.1)
        assert math.isfinite(flops) and flops > 1e9, (k, flops)
        assert time.perf_counter() - t0 < 1.0, k
    with pytest.raises(ValueError):
        _C.measure_peak_flops("fp64_fma_avx1024", 1, 0.1)
    with pytest.raises(ValueError):
        _C.measure_peak_flops("fp32_portable", 1, 0.0)
    if "bf16_dot_avx512" not in kernels:
        with pytest.raises(ValueError):
            _C.measure_peak_flops("bf16_dot_avx512", 1, 0.1)


def test_probe_bf16_is_bounded():
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    probe = machine.probe_bf16(budget_s=1.0)
    assert time.perf_counter() - t0 < 10
    assert torch.get_num_threads() == threads  # it runs on one thread, then restores the count
    assert probe["fp32_flops"] > 0 and probe["bf16_flops"] > 0
    assert probe["native"] == (probe["bf16_flops"] >= machine.BF16_NATIVE_MIN_RATIO * probe["fp32_flops"])


def test_gemm_ceiling_shrinks_where_a_call_would_be_slow():
    # A 1 GFLOP/s hint (emulated bf16): 4096^3 would take ~2 minutes a call.
    t0 = time.perf_counter()
    flops, n = machine.gemm_flops(torch.float32, 4096, reps=1, rate_hint=1e9, max_call_s=0.5)
    assert n == 512 and flops > 0 and time.perf_counter() - t0 < 10


def _slow_env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([PYTHON_DIR, TESTS_DIR]),
                DSA_BENCH_CASE_MODULES="bench_slow_cases")


def test_a_slow_peer_is_cut_at_its_budget(tmp_path):
    # --bf16 emulated: the fp32 peer is added too (without it, the native rule, is
    # test_fp32_peer_only_for_bf16_cases_where_bf16_is_emulated; one CLI run is a minute).
    out = tmp_path / "bench.json"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dsa.bench", "--filter", "test/slow", "--gemm-size", "512",
         "--budget", "14", "--bf16", "emulated", "--json", str(out)],
        capture_output=True, text=True, env=_slow_env(), timeout=600)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    # A bf16 naive call sleeps 300 s: waiting for it would take over five minutes.
    assert wall < 250, wall
    assert "skipped: over 14 s" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["options"]["budget_s"] == 14
    by_impl = {r["impl"]: r for r in doc["results"] if r["case"] == "test/slow/bf16"}
    assert by_impl[NAIVE]["skipped"].startswith("over 14 s") and by_impl[NAIVE]["median_ms"] is None
    assert by_impl[FUSED]["median_ms"] > 0
    # The fp32 peer runs (fast here) and is the one the speed-up is against.
    assert doc["machine"]["bf16"]["native"] is False and "bf16_gemm" not in doc["ceilings"]
    fp32 = by_impl[NAIVE_FP32]
    assert fp32["median_ms"] > 0 and by_impl[FUSED]["naive_peer"] == NAIVE_FP32
    assert by_impl[FUSED]["speedup_vs_naive"] == pytest.approx(fp32["median_ms"] / by_impl[FUSED]["median_ms"])
    assert "naive_fp32" in proc.stdout and "not measured: emulated" in proc.stdout
    # A 6 s call: the warm-up run finished, no timed run fit; reported as the warm-up, marked.
    slowish = {r["impl"]: r for r in doc["results"] if r["case"] == "test/slowish/fp32"}
    assert NAIVE_FP32 not in slowish  # an fp32 case has no fp32 peer to add
    naive = slowish[NAIVE]
    assert naive["warmup_only"] and naive["timing_cut"] and len(naive["times_ms"]) == 1, naive
    assert 6000 <= naive["median_ms"] < 9000, naive["median_ms"]
    assert naive["memory_error"].startswith("not measured") and naive["peak_extra_mib"] is None
    assert slowish[FUSED]["naive_peer"] == NAIVE and "(warm-up)" in proc.stdout


def test_a_single_run_case_is_called_once_and_measured_in_that_call(tmp_path, monkeypatch):
    # Long-context cases (minutes per call): no warm-up and no second child for the memory.
    calls = tmp_path / "calls"
    for k, v in _slow_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DSA_TEST_CALLS", str(calls))
    case = next(c for c in runner.load_cases() if c.name == "test/single/fp32")
    (r,) = runner.run_case(case, {"compute": 1e12}, threads=1, memory=True, log=lambda *a: None, budget_s=5)
    assert calls.read_text().count("call") == 1
    assert r.single_run and len(r.times_ms) == 1 and r.error is None and r.skipped is None
    assert 60 <= r.peak_extra_mib <= 80 and r.memory_method.endswith("(the timed run)"), r
    assert "(1 run)" in format_table([r])


def test_quick_benchmark_under_a_lower_isa_is_bounded_and_names_its_ceiling():
    """`dsa-bench --quick` with DSA_ISA=avx2 (portable where the CPU lacks AVX2), on its
    smallest case: finishes within the bound its budgets give, and compares with that
    ISA's own peak."""
    isa = "avx2" if "fp32_fma_avx2" in _C.peak_kernels() else "portable"
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR, DSA_ISA=isa)
    pattern = "indexer/bf16/T512/"
    quick = runner.select_cases(runner.load_cases(), quick=True, pattern=pattern)
    assert quick
    runs = sum(1 for c in quick for i in runner.impls_of(c, fp32_peer=True) if runner.skip_reason(c, i) is None)
    budget = 15
    bound = 60 + runs * (budget + 5)  # two ceiling rounds, then each child at most its budget
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dsa.bench", "--quick", "--no-memory", "--gemm-size", "1024",
                           "--budget", str(budget), "--filter", pattern],
                          capture_output=True, text=True, env=env, timeout=bound + 60)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert wall < bound, (wall, bound)
    label = {"avx2": "fp32 FMA avx2", "portable": "fp32 mul+add portable"}[isa]
    assert f"ISA {isa}" in proc.stdout
    # torch held to the same ISA (its own variables, in a restarted process): on an
    # AVX-512 machine its bf16 matmul is then the emulation an AVX2 CPU has.
    assert f"ATEN_CPU_CAPABILITY={machine.torch_isa_env(isa)['ATEN_CPU_CAPABILITY']}" in proc.stdout
    assert "torch held to" in proc.stderr
    compute_rows = [l for l in proc.stdout.splitlines() if l.startswith("| indexer/") and "| fused " in l]
    assert compute_rows and all(label in l for l in compute_rows), compute_rows


def test_time_impl_starts_no_run_past_its_deadline(monkeypatch):
    monkeypatch.setattr(runner, "flush_caches", lambda: None)
    events = []

    def op(_):
        time.sleep(0.3)
        return 0
    t0 = time.perf_counter()
    times = runner.time_impl(op, {}, repeats=None, deadline=t0 + 1.0,
                             progress=lambda kind, sec: events.append(kind))
    # Warm-up 0.3 s; the 0.7 s left hold one more run (0.3 s plus margins), not the three planned.
    assert len(times) == 1 and time.perf_counter() - t0 < 1.0
    assert events == ["warmup", "cut", "run"]
    assert runner.time_impl(op, {}, repeats=None, deadline=time.perf_counter() + 0.35) == []


def test_a_binding_case_takes_the_slower_bound():
    from dsa.bench.machine import binding_case
    c = Case(name="x", setup=dict, impls={FUSED: len}, flops=1e9, bytes_moved=1e9, ceiling="binding", dtype="fp32")
    ceilings = {"fp32_fma_avx2": 1e11, "copy_bw": 1e10}
    assert binding_case(c, ceilings, "avx2", False, set()).ceiling == "copy_bw"  # 100 ms of bytes > 10 ms
    assert binding_case(replace(c, bytes_moved=1e6), ceilings, "avx2", False, set()).ceiling == "compute"


def test_an_instruction_bound_case_is_timed_at_the_vector_issue_rate():
    from dsa.bench.machine import binding_case, vector_op_rate
    # 1e11 FLOP/s of 8-lane FMAs: 6.25e9 vector operations per second.
    ceilings = {"fp32_fma_avx2": 1e11, "fp32_fma_avx512": 2e11, "copy_bw": 1e10}
    assert vector_op_rate(ceilings, "avx2") == 1e11 / 16
    assert vector_op_rate(ceilings, "avx512_bf16") == 2e11 / 32
    assert vector_op_rate(ceilings, "portable") == 0.0  # no fixed width: no such bound
    c = Case(name="x", setup=dict, impls={FUSED: len}, bytes_moved=1e8, ceiling="binding",
             vector_ops={"avx2": 1.25e8, "avx512": 1e7})

    def on(isa):  # the ceilings measure_ceilings keeps on a machine running `isa`
        rate = vector_op_rate(ceilings, isa)
        return {**ceilings, "vector_ops": rate} if rate else dict(ceilings)

    slow = binding_case(c, on("avx2"), "avx2", False, set())  # 20 ms of operations > 10 ms of bytes
    assert slow.ceiling == "vector_ops" and work_of(slow) == ("vector_ops", "bf16")
    assert "binding bound here: vector operations" in slow.note and "20 ms" in slow.note and "10 ms" in slow.note
    assert binding_case(c, on("avx512"), "avx512", False, set()).ceiling == "copy_bw"  # 1.6 ms < 10 ms
    assert binding_case(c, on("portable"), "portable", False, set()).ceiling == "copy_bw"  # no count there
    assert binding_case(c, ceilings, "avx2", False, set()).ceiling == "copy_bw"  # no rate measured: no such bound
    assert choose_ceiling("vector_ops", "bf16", "avx2", False, set()) == "vector_ops"
    assert ceiling_label("vector_ops", "avx2") == "avx2 vector ops at the FMA rate"
    # The runner reads the count of the ISA it is told and reports G operations / s.
    ceilings["vector_ops"] = vector_op_rate(ceilings, "avx2")
    (r,) = runner.run_case(replace(slow, impls={FUSED: lambda x: time.sleep(0.04)}, repeats=2), ceilings, threads=1,
                           memory=False, log=lambda *a: None, ceiling="vector_ops", isolate=False, budget_s=5,
                           isa="avx2")
    assert r.gops is not None and r.tflops is None and r.gbps is None
    # 20 ms of operations at the rate, in a run of at least 40 ms (however loaded the machine).
    assert r.pct_of_ceiling == pytest.approx(100 * 1.25e8 / (r.median_ms / 1e3) / ceilings["vector_ops"])
    assert r.gops == pytest.approx(1.25e8 / (r.median_ms / 1e3) / 1e9)
    assert 0 < r.pct_of_ceiling <= 50
    assert "Gop/s" in format_table([r])


def test_compressor_cases_count_vector_operations_per_isa():
    from dsa.bench.cases.compressor import vector_ops
    # HCA, one entry of 128 slots, 16 channels: (128 * 16 slots x ((6 + E) + (8 + E + 2 R)) + 16 x (3 + R)) / lanes.
    assert vector_ops(128, 16, 128, False, "avx512_bf16") == (128 * 16 * 30 + 16 * 4) / 16
    assert vector_ops(128, 16, 128, False, "avx2") == (128 * 16 * (16 + 26) + 16 * 7) / 8
    # CSA: entry 0 has no previous block's half.
    assert vector_ops(8, 16, 4, True, "avx512") == ((8 + 4) * 16 * (13 + 23) + 2 * 16 * 7) / 16
