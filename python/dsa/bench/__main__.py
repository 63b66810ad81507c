"""dsa-bench: times the fused ops against the naive PyTorch peer and the machine's ceilings.

    python -m dsa.bench [--quick] [--filter SUBSTR] [--json PATH] [--no-memory] [--threads N] [--budget S]

Discovers python/dsa/bench/cases/*.py (each defines ``CASES``), measures the
machine ceilings in the same process (dsa's FMA / bf16-dot peaks per ISA,
torch's fp32 GEMM, its bf16 GEMM where native, copy bandwidth), then for each
case and implementation: the median time after warm-up (in a child process
killed at a wall-time budget), TFLOP/s over valid work (GB/s for memory-bound
cases, G vector operations/s for instruction-bound ones: the compressor where its
operations bind), the fraction of the case's ceiling and which ceiling that is, the peak
extra memory (fresh subprocess per case and implementation) and the ratios
against the faster naive peer. See docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load_avg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


_HELD = "DSA_BENCH_TORCH_ISA"  # set once torch has been held to dsa's ISA


def _restart_with_torch_held(argv) -> None:
    """Runs this benchmark again in a process whose torch is held to dsa's ISA.

    torch is imported (and its ISA fixed) before this module runs, so the
    variables only take effect in a new process.
    """
    from .. import _C
    from .machine import torch_isa_env
    isa = _C.cpu_isa()
    env = dict(os.environ, **{_HELD: isa})
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k, v in torch_isa_env(isa).items():
        env.setdefault(k, v)  # what the user set stays
    args = sys.argv[1:] if argv is None else list(argv)
    _log(f"dsa-bench: DSA_ISA={os.environ['DSA_ISA']}: torch held to {isa} too (--torch-isa native: not)")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "dsa.bench", *args], env)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsa-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the quick cases (what `make bench-quick` runs)")
    ap.add_argument("--filter", metavar="SUBSTR", help="only cases whose name contains SUBSTR (several: "
                    "SUBSTR,SUBSTR,... selects a case that contains any of them)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--no-memory", action="store_true",
                    help="skip the peak-memory subprocesses (faster)")
    ap.add_argument("--threads", type=int, metavar="N",
                    help="threads for torch and dsa (default: torch's default, all cores)")
    ap.add_argument("--gemm-size", type=int, default=4096, metavar="N",
                    help="side of the square GEMMs that measure the ceilings (default 4096)")
    ap.add_argument("--budget", type=float, metavar="S",
                    help="wall seconds one implementation's timing may take, set-up included; over it "
                         "the row reads 'skipped: over S s' (default 150, with --quick 45)")
    ap.add_argument("--bf16", choices=("auto", "native", "emulated"), default="auto",
                    help="treat torch's bf16 matmul as native or emulated instead of detecting it "
                         "(emulated: no bf16 GEMM ceiling, bf16 cases also run the naive peer in fp32)")
    ap.add_argument("--torch-isa", choices=("auto", "native"), default="auto",
                    help="auto: where DSA_ISA is set, torch (naive peers, its GEMM ceilings) is held to the "
                         "same ISA, as on a CPU of that kind; native: torch uses all the CPU has")
    ap.add_argument("--list", action="store_true", help="list the selected cases and exit")
    args = ap.parse_args(argv)
    if args.torch_isa == "auto" and os.environ.get("DSA_ISA") and not os.environ.get(_HELD):
        _restart_with_torch_held(argv)
    if args.budget is not None and not args.budget > 0:
        ap.error(f"--budget: expected a positive number of seconds, got {args.budget}")

    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads: expected an integer >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    from .. import _C
    from .case import work_of
    from .machine import binding_case, ceiling_label, choose_ceiling, machine_info, measure_ceilings, probe_bf16
    from .report import format_table, header_lines, notes, write_json
    from .runner import BUDGET_S, QUICK_BUDGET_S, impls_of, load_cases, run_case, select_cases, wants_fp32_peer

    cases = select_cases(load_cases(), args.quick, args.filter)
    if args.list:
        for c in cases:
            print(f"{c.name}{'  (quick)' if c.quick else ''}: {', '.join(impls_of(c))}")
        if not cases:
            _log("dsa-bench: no case matches the selection")
        return 0 if cases else 2
    if not cases:
        _log("dsa-bench: no case matches the selection")
        return 2

    budget = args.budget if args.budget is not None else (QUICK_BUDGET_S if args.quick else BUDGET_S)
    start = time.perf_counter()
    machine = machine_info(threads)
    machine["budget_s"] = budget
    _log(f"dsa-bench: {len(cases)} case(s), {threads} thread(s); measuring ceilings ...")
    probe = probe_bf16()
    if args.bf16 != "auto":
        probe = dict(probe, native=args.bf16 == "native", forced=args.bf16)
    machine["bf16"] = probe
    isa, peaks = machine["isa"], set(_C.peak_kernels())
    ceilings, sizes = measure_ceilings(threads, probe, args.gemm_size)
    results, used = [], []
    cases = [binding_case(c, ceilings, isa, probe["native"], peaks) if c.ceiling == "binding" else c for c in cases]
    for case in cases:
        work, dtype = work_of(case)
        key = choose_ceiling(work, dtype, isa, probe["native"], peaks)
        label = ceiling_label(key, isa)
        if label not in used:
            used.append(label)
        _log(f"dsa-bench: {case.name} (ceiling: {label})")
        results.extend(run_case(case, ceilings, threads, memory=not args.no_memory, log=_log,
                                ceiling=key, ceiling_label=label,
                                fp32_peer=wants_fp32_peer(case, probe["native"]), budget_s=budget,
                                emulated_bf16_flops=None if probe["native"] else probe["bf16_flops"] * threads,
                                isa=isa))
    machine["ceilings_used"] = used
    # Ceilings again at the end: with other load on the machine the two differ, and
    # the better of them is the fairer "what this machine reaches" (the lower % of ceiling).
    _log("dsa-bench: measuring ceilings again ...")
    ceilings_end, _ = measure_ceilings(threads, probe, args.gemm_size)
    ceilings_start = ceilings
    ceilings = {k: max(v, ceilings_end.get(k, v)) for k, v in ceilings_start.items()}
    for r in results:
        if r.pct_of_ceiling is not None and ceilings.get(r.ceiling):
            r.pct_of_ceiling *= ceilings_start[r.ceiling] / ceilings[r.ceiling]
    machine["load_avg_1min_at_end"] = _load_avg()
    elapsed = time.perf_counter() - start

    case_notes = {c.name: c.note for c in cases}
    print("\n".join(header_lines(machine, ceilings)))
    print()
    print(format_table(results))
    extra = notes(results, case_notes)
    if extra:
        print()
        print("\n".join("- " + n for n in extra))
    print()
    print(f"{len(cases)} case(s) in {elapsed:.0f} s"
          + ("" if not args.no_memory else "; peak memory not measured (--no-memory)"))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        options = {"gemm_size": args.gemm_size, "gemm_sizes_used": sizes,
                   "ceilings_at_start": ceilings_start, "ceilings_at_end": ceilings_end,
                   "quick": args.quick, "filter": args.filter, "memory": not args.no_memory,
                   "threads": threads, "budget_s": budget, "bf16": args.bf16,
                   "elapsed_s": round(elapsed, 1)}
        write_json(args.json, machine, ceilings, results, case_notes, options)
        _log(f"dsa-bench: wrote {args.json}")
    failed = [r for r in results if r.error]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
