"""``dsa-train --compare``: the same model, data and seed trained unpatched, with SAS and
with SAS+LI, each configuration in a fresh process (so its peak memory is its own);
then the most layers each configuration trains within a memory budget. Tables on
stdout, every figure in one JSON, loss and step time in one PNG."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

from .._child import run_json_child
from .loop import CONFIGS, RunSpec, proc_gib

GIB = 1.0


def _child(spec: RunSpec, timeout_s: float, budget_gib: float | None = None) -> dict:
    """Runs one configuration (or, with `budget_gib`, its layers-within-budget search) in a
    fresh interpreter and returns its result JSON."""
    args = ["-m", "dsa.train", "--_child-spec", json.dumps(asdict(spec))]
    if budget_gib is not None:
        args += ["--_child-budget", str(budget_gib)]
    return run_json_child(args, "--_child-out", timeout_s, show_stderr=True)


def unpatched_skip(spec: RunSpec) -> str | None:
    """Why the unpatched model cannot run this spec here, or None. Its eager attention forms
    each layer's [B, H, T, T] scores in the model dtype and their softmax in fp32 (plus the
    compressed entries on V4's compressed layers): a lower bound on its peak. Past the
    memory available it would be killed by the OOM killer after minutes of swapping, so it
    is skipped with the figure instead."""
    available = proc_gib("/proc/meminfo", "MemAvailable")
    elem = 4 if spec.dtype == "fp32" else 2
    need = spec.batch * spec.heads * spec.seq_len * spec.seq_len * (elem + 4) / 2**30
    if math.isnan(available) or need <= available:
        return None
    return (f"skipped: its eager attention needs >= {need:.0f} GiB for one layer's [B, H, T, T] scores "
            f"and fp32 softmax, {available:.0f} GiB available")


def compare(spec: RunSpec, budget_gib: float | None, timeout_s: float, log, configs=tuple(CONFIGS)) -> dict:
    runs = {}
    skip = unpatched_skip(spec)
    for name in configs:
        log(f"[compare] {name}: {spec.steps} steps, {spec.layers} layers, {spec.seq_len} tokens, {spec.dtype}")
        if name == "unpatched" and skip:
            log(f"[compare] {name}: {skip}")
            runs[name] = {"skipped": skip}
            continue
        runs[name] = _child(replace(spec, config=name, save=None, resume=None), timeout_s)
    result = {"spec": asdict(spec), "runs": runs}
    base = runs.get("unpatched", {"error": "not run"})
    if "error" not in base and "skipped" not in base:
        agree = {}
        for name, r in runs.items():
            if name == "unpatched" or "error" in r:
                continue
            diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(base["steps"], r["steps"])]
            agree[name] = {"max_abs_loss_diff": max(diffs), "per_step": diffs}
        result["loss_agreement"] = agree
    if budget_gib:
        log(f"[compare] layers within {budget_gib} GiB")
        result["memory_budget_gib"] = budget_gib
        result["layers_within_budget"] = {
            name: {"skipped": skip} if name == "unpatched" and skip
            else _child(replace(spec, config=name), timeout_s, budget_gib) for name in configs}
    return result


def _fmt(x, nd=2):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


# Steady steps of one run do the same work: a slowest step this many times the fastest
# means other load took the cores for part of the run (once one disturbed step of
# --steps 3 printed a speed-up of 0.02 with no word of it).
DISTURBED_SPREAD = 1.5


def _disturbed(step_seconds: dict) -> bool:
    return step_seconds.get("min", 0) > 0 and step_seconds["max"] > DISTURBED_SPREAD * step_seconds["min"]


def tables(result: dict) -> str:
    runs = result["runs"]
    lines = []
    spec = result["spec"]
    lines.append(f"DeepSeek-V4 {spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads x "
                 f"{spec['head_dim']}, {spec['seq_len']} tokens x batch {spec['batch']}, {spec['dtype']}, "
                 f"{spec['steps']} steps ({spec['warmup_steps']} warm-up)")
    lines.append("")
    head = f"{'config':<10} {'s/step median':>13} {'min-max':>13} {'speed-up':>8} {'tokens/s':>9} " \
           f"{'peak GiB':>9} {'loss first->last':>17}"
    lines += [head, "-" * len(head)]
    base = runs.get("unpatched", {})
    base_t = base.get("step_seconds", {}).get("median")
    disturbed = {name for name, r in runs.items() if "step_seconds" in r and _disturbed(r["step_seconds"])}
    for name, r in runs.items():
        if "error" in r:
            lines.append(f"{name:<10} failed: {r['error']}")
            continue
        if "skipped" in r:
            lines.append(f"{name:<10} {r['skipped']}")
            continue
        st = r["step_seconds"]
        speed = base_t / st["median"] if base_t else None
        mark = "*" if name in disturbed or (speed is not None and "unpatched" in disturbed) else " "
        lines.append(f"{name:<10} {st['median']:>13.2f} {st['min']:>6.2f}-{st['max']:<6.2f} {_fmt(speed):>7}{mark} "
                     f"{r['tokens_per_s']:>9.0f} {r['memory_gib']['peak_rss']:>9.2f} "
                     f"{r['loss_first']:>8.3f}->{r['loss_last']:<8.3f}")
    if disturbed:
        lines.append(f"* step times of {', '.join(sorted(disturbed))} spread over {DISTURBED_SPREAD:g}x from fastest "
                     "to slowest: the machine was busy with something else; rerun before trusting these speed-ups")
    lines.append("")
    types = next((r["layer_types"] for r in runs.values() if "layer_types" in r), [])
    kinds = sorted(set(types), key=types.index)
    head = f"{'config':<10} " + " ".join(f"{k + ' s/layer':>14}" for k in kinds)
    lines += [head, "-" * len(head)]
    for name, r in runs.items():
        if "error" in r or "skipped" in r:
            continue
        lines.append(f"{name:<10} " + " ".join(f"{r['layer_seconds_by_type'].get(k, math.nan):>14.3f}" for k in kinds))
    breakdowns = [(name, r["time_breakdown"]) for name, r in runs.items() if "time_breakdown" in r]
    if breakdowns:
        lines.append("")
        lines.append("where a step's time goes (one profiled forward + backward after the run):")
        head = f"{'config':<10} {'phase':<8} {'seconds':>8} {'in dsa ops':>10} {'rest':>8} {'dsa %':>6}  dsa ops (s)"
        lines += [head, "-" * len(head)]
        for name, b in breakdowns:
            for phase in ("forward", "backward"):
                p = b[phase]
                share = 100 * p["dsa_seconds"] / p["seconds"] if p["seconds"] else math.nan
                ops = ", ".join(f"{k} {v:.3f}" for k, v in sorted(p["dsa_ops"].items(), key=lambda kv: -kv[1]))
                lines.append(f"{name:<10} {phase:<8} {p['seconds']:>8.3f} {p['dsa_seconds']:>10.3f} "
                             f"{p['rest_seconds']:>8.3f} {_fmt(share, 1):>6}  {ops or '-'}")
    if "loss_agreement" in result:
        lines.append("")
        for name, a in result["loss_agreement"].items():
            lines.append(f"loss vs unpatched, {name}: max |diff| over {len(a['per_step'])} steps = "
                         f"{a['max_abs_loss_diff']:.2e}")
    indexer = [(name, r["steps"][-1]) for name, r in runs.items() if "steps" in r and r["steps"]
               and r["steps"][-1].get("indexer_kl")]
    if indexer:
        lines.append("")
        for name, last in indexer:
            kl = ", ".join(f"{t} {v:.4f}" for t, v in last["indexer_kl"].items())
            rec = ", ".join(f"{t} {v:.3f}" for t, v in last.get("indexer_recall", {}).items())
            lines.append(f"{name}: last step indexer KL {kl}" + (f"; recall@k {rec}" if rec else ""))
    if "layers_within_budget" in result:
        lines.append("")
        lines.append(f"most layers within {result['memory_budget_gib']} GiB:")
        base_l = result["layers_within_budget"].get("unpatched", {}).get("layers")
        for name, b in result["layers_within_budget"].items():
            if "error" in b or "skipped" in b:
                lines.append(f"  {name:<10} " + (f"failed: {b['error']}" if "error" in b else b["skipped"]))
                continue
            ratio = f" ({b['layers'] / base_l:.1f}x)" if base_l else ""
            bound = "" if b.get("exact", True) else " (at least: search stopped)"
            lines.append(f"  {name:<10} {b['layers']}{ratio}{bound}")
    return "\n".join(lines)


def cp_table(cp: dict) -> str:
    """Per rank of a --dp / --cp run: its place in the mesh, its rows, median step time
    and peak RSS (VmHWM)."""
    head = f"{'rank':>4} {'dp':>3} {'cp':>3} {'rows':>6} {'s/step median':>13} {'peak GiB':>9}"
    dp = cp.get("dp", 1)
    title = (f"data x context parallel: {dp} x {cp['cp']} ranks ({cp['backend']}, {cp['dp_wrap']})" if dp > 1
             else f"context parallel: {cp['world_size']} ranks ({cp['backend']})")
    if cp.get("balance", "contiguous") != "contiguous":
        title += f", {cp['balance']} split"
    lines = [title, head, "-" * len(head)]
    for r in cp["ranks"]:
        lines.append(f"{r['rank']:>4} {r.get('dp_rank', 0):>3} {r.get('cp_rank', r['rank']):>3} {r['rows']:>6} "
                     f"{r['step_seconds_median']:>13.2f} {r['peak_rss_gib']:>9.2f}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in result["runs"].items():
        if "steps" not in r:
            continue
        steps = [s["step"] for s in r["steps"]]
        ax_loss.plot(steps, [s["loss"] for s in r["steps"]], marker="o", label=name)
        ax_time.plot(steps, [s["seconds"] for s in r["steps"]], marker="o", label=name)
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_time.set(xlabel="step", ylabel="seconds", title="step time")
    ax_time.set_yscale("log")
    for ax in (ax_loss, ax_time):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
