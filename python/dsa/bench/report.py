"""The benchmark table (stdout) and JSON file."""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Optional

from .machine import CEILING_LABEL
from .runner import Result, finite

COLUMNS = ("case", "impl", "median ms", "throughput", "% of ceiling", "ceiling", "peak extra MiB",
           "speed-up vs naive", "memory vs naive")


def _num(x: Optional[float], fmt: str, suffix: str = "") -> str:
    return (format(x, fmt) + suffix) if finite(x) else "-"


def _ms(x: Optional[float]) -> str:
    if not finite(x):
        return "-"
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def _flops(x: Optional[float]) -> str:
    if not finite(x):
        return "-"
    return f"{x / 1e12:.2f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.3g} GFLOP/s"


def _torch_isa(machine: dict) -> str:
    info = machine.get("torch_isa") or {}
    if not info:
        return ""
    held = ", ".join(f"{k}={v}" for k, v in info.get("env", {}).items())
    return f" (ATen {info.get('aten', '?')}" + (f"; held by {held}" if held else "") + ")"


def header_lines(machine: dict, ceilings: dict) -> list[str]:
    """``ceilings``: the measured values by key; ``machine["bf16"]`` the probe_bf16 result."""
    isa = machine["isa"]
    peaks = ", ".join(f"{CEILING_LABEL[k]} {_flops(ceilings[k])}"
                      for k in ("fp32_portable", "fp32_fma_avx2", "fp32_fma_avx512", "bf16_dot_avx512")
                      if k in ceilings)
    probe = machine.get("bf16", {})
    n = probe.get("n", "?")
    if "bf16_gemm" in ceilings:
        bf16 = (f"bf16 GEMM {_flops(ceilings['bf16_gemm'])} (native: {n}^3 bf16 at "
                f"{probe.get('bf16_flops', 0) / max(probe.get('fp32_flops', 1), 1):.1f}x fp32 on one thread)")
    else:
        bf16 = (f"bf16 GEMM not measured: emulated (one thread: {probe.get('bf16_n', n)}^3 bf16 "
                f"{_flops(probe.get('bf16_flops'))} vs {n}^3 fp32 {_flops(probe.get('fp32_flops'))}); "
                f"bf16 cases also run the naive peer in fp32")
    if probe.get("forced"):
        bf16 += f" [treated as {probe['forced']} by --bf16]"
    used = list(machine.get("ceilings_used", []))
    budget = machine.get("budget_s")
    budget = f"{budget:.0f} s" if isinstance(budget, (int, float)) else "a time budget"
    return [
        f"machine: {machine['cpu']}, {machine['threads']} of {machine['logical_cpus']} "
        f"logical CPUs used, ISA {isa} (dsa's, after DSA_ISA), torch {machine['torch']}{_torch_isa(machine)}, "
        f"load avg {machine['load_avg_1min_at_start']} at start, "
        f"{machine.get('load_avg_1min_at_end', '?')} at end",
        f"ceilings (same run, best of start/end): dsa peak {peaks}; "
        f"torch fp32 GEMM {_flops(ceilings.get('fp32_gemm'))}, {bf16}; "
        f"copy {ceilings['copy_bw'] / 1e9:.1f} GB/s (read + write)"
        + (f"; {isa} vector ops {ceilings['vector_ops'] / 1e9:.3g} G/s (its FMA peak / 2 x lanes)"
           if "vector_ops" in ceilings else ""),
        "compared with: " + (", ".join(used) if used else "-")
        + " (compute cases: the bf16 GEMM on AMX where torch's bf16 is native, else the peak of dsa's ISA)",
        f"timing: median of runs after warm-up, each run after {machine.get('cache_flush_mib', '?')} MiB "
        f"written to flush the caches, garbage collector off; each implementation in a child process "
        f"given {budget} (then killed: 'skipped: over N s')",
    ]


def rows(results: list[Result]) -> list[tuple[str, ...]]:
    out = []
    for r in results:
        if r.skipped or r.error:
            why = f"skipped: {r.skipped}" if r.skipped else f"failed: {r.error}"
            out.append((r.case, r.impl, why))
            continue
        if finite(r.tflops):
            thr = f"{r.tflops:.3g} TFLOP/s"
        elif finite(r.gbps):
            thr = f"{r.gbps:.3g} GB/s"
        elif finite(r.gops):
            thr = f"{r.gops:.3g} Gop/s"
        else:
            thr = "-"
        pct = f"{r.pct_of_ceiling:.1f}%" if finite(r.pct_of_ceiling) else "-"
        if r.single_run:
            pct += " (1 run)"
        elif r.warmup_only:
            pct += " (warm-up)"
        elif r.timing_cut:
            pct += " (cut)"
        mem = "error" if r.memory_error is not None else (
            _num(r.peak_extra_mib, ".2f" if finite(r.peak_extra_mib) and r.peak_extra_mib < 10 else ".1f"))
        out.append((r.case, r.impl, _ms(r.median_ms), thr, pct, r.ceiling_label or r.ceiling, mem,
                    _num(r.speedup_vs_naive, ".2f", "x"), _num(r.memory_vs_naive, ".3g", "x")))
    return out


def format_table(results: list[Result]) -> str:
    body = rows(results)
    full = [r for r in body if len(r) == len(COLUMNS)]
    widths = [max([len(COLUMNS[i])] + [len(r[i]) for r in full]) for i in range(len(COLUMNS))]
    for r in body:  # the case and impl columns also fit the skipped rows
        if len(r) != len(COLUMNS):
            widths[0], widths[1] = max(widths[0], len(r[0])), max(widths[1], len(r[1]))

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    text = [line(COLUMNS), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in body:
        if len(r) == len(COLUMNS):
            text.append(line(r))
        else:
            rest = sum(widths[2:]) + 3 * (len(widths) - 3)
            text.append(f"| {r[0].ljust(widths[0])} | {r[1].ljust(widths[1])} | {r[2][:rest].ljust(rest)} |")
    return "\n".join(text)


def notes(results: list[Result], case_notes: dict[str, str]) -> list[str]:
    out = [f"{name}: {note}" for name, note in case_notes.items() if note]
    if any(r.impl == "naive_fp32" for r in results):
        out.append("naive_fp32: the naive peer on the inputs cast to fp32 at set-up (torch's bf16 is "
                   "emulated here); the speed-up and memory columns use the faster of naive and naive_fp32")
    if any(r.timing_cut and not r.warmup_only for r in results):
        out.append("(cut): the timing budget ran out before the planned runs; the median is over those that finished")
    if any(r.single_run for r in results):
        out.append("(1 run): a long-context case timed by one cold call, without warm-up, its peak extra "
                   "memory read in the same run (lazy initialisation included in both)")
    if any(r.warmup_only for r in results):
        out.append("(warm-up): no timed run fit the budget after the warm-up run, so the time is that of the "
                   "warm-up run (lazy initialisation included, no cache flush before it)")
    for r in results:
        if r.memory_error:
            what = r.memory_error if r.memory_error.startswith("not measured") else \
                f"memory measurement failed: {r.memory_error}"
            out.append(f"{r.case} [{r.impl}]: {what}")
    return out


def write_json(path: str, machine: dict, ceilings: dict, results: list[Result],
               case_notes: dict[str, str], options: dict) -> None:
    doc = {"machine": machine, "ceilings": ceilings, "options": options,
           "notes": case_notes, "results": [asdict(r) for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")
