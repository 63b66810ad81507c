"""``python -m dsa.train.long_context``: time and peak memory of a patched DeepSeek-V4 /
V3.2 forward and training step from 4K to 128K tokens.

Each (model, tokens, mode) runs in a fresh interpreter, so its peak RSS (``VmHWM``)
is its own: the model, its activations, dsa's workspaces and the allocator's slack.
``forward``: eval, ``torch.no_grad``, ``use_cache=False``, batch 1. ``step``: train
mode, forward + backward of the LM loss with ``indexer_loss="sparse"`` (the indexer's
KL per layer), one optimizer-free step (the gradients are what a step keeps alive).
Every case is patched with ``strict=True``: a call dsa could not run raises instead of
falling back. ``--geometry`` also times what the patch spends on masks and geometry
(transformers' mask creation, the DsaMask, ``_geometry``'s analysis) against the whole
forward. Table on stdout, every figure in a JSON, time and memory against tokens in a
PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .._child import parse_token_counts, run_json_child



class _Timer:
    """Wraps functions to add up the seconds spent in them (outermost calls only)."""

    def __init__(self):
        self.seconds, self.depth = 0.0, 0

    def wrap(self, owner, name):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - start
        setattr(owner, name, timed)


def _geometry_timer(kind: str) -> _Timer:
    """Times the mask and geometry work of a patched call: the model's create_*_mask call
    (which returns a DsaMask) and the patch's analysis (cached per forward)."""
    from dsa.integrations.transformers import _geometry
    timer = _Timer()
    if kind == "v4":
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod
        timer.wrap(mod, "create_sliding_window_causal_mask")
    else:
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mod
        timer.wrap(mod, "create_causal_mask")
    timer.wrap(_geometry, "cached_analyse")
    return timer


def run_case(kind: str, layers: int, tokens: int, mode: str, geometry: bool) -> dict:
    """One measurement, in this process."""
    import torch

    from dsa.integrations.transformers import fallback_counts, indexer_losses, patch

    from .loop import proc_gib  # with torch: not at module level, where the parent runs without it
    from .model import build_small
    model = build_small(kind, layers, tokens, torch.bfloat16)
    patch(model, strict=True, indexer_loss="sparse" if mode == "step" else None)
    timer = _geometry_timer(kind) if geometry else None
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    rss_model = proc_gib("/proc/self/status", "VmHWM")
    start = time.perf_counter()
    if mode == "forward":
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        loss = None
        finite = bool(torch.isfinite(logits[0, -1]).all())
    else:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        loss = float(out.loss)
        finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        finite = finite and all(bool(torch.isfinite(v)) for v in indexer_losses(model).values())
    seconds = time.perf_counter() - start
    result = {"kind": kind, "layers": layers, "tokens": tokens, "mode": mode, "seconds": seconds,
              "peak_rss_gib": proc_gib("/proc/self/status", "VmHWM"),
              "rss_after_build_gib": rss_model, "loss": loss, "finite": finite,
              "fallbacks": dict(fallback_counts(model)), "threads": torch.get_num_threads()}
    if timer is not None:
        result["geometry_seconds"] = timer.seconds
        result["geometry_share"] = timer.seconds / seconds
    return result


def _child(case: dict, timeout_s: float) -> dict:
    result = run_json_child(["-m", "dsa.train.long_context", "--_case", json.dumps(case)], "--_out", timeout_s)
    return dict(case, **result) if "error" in result else result


def table(rows: list) -> str:
    head = f"{'model':<6} {'layers':>6} {'tokens':>7} {'mode':<8} {'seconds':>8} {'peak RSS GiB':>12} " \
           f"{'geometry %':>10}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['kind']:<6} {r['layers']:>6} {r['tokens']:>7} {r['mode']:<8} failed: {r['error']}")
            continue
        share = f"{100 * r['geometry_share']:.2f}" if "geometry_share" in r else "-"
        note = "" if r["finite"] else "NON-FINITE"
        if r["fallbacks"]:
            note += f" fallbacks {r['fallbacks']}"
        lines.append(f"{r['kind']:<6} {r['layers']:>6} {r['tokens']:>7} {r['mode']:<8} {r['seconds']:>8.2f} "
                     f"{r['peak_rss_gib']:>12.2f} {share:>10}  {note}")
    return "\n".join(lines)


def plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    keys = sorted({(r["kind"], r["layers"], r["mode"]) for r in rows if "error" not in r})
    for kind, layers, mode in keys:
        pts = sorted((r["tokens"], r["seconds"], r["peak_rss_gib"]) for r in rows
                     if "error" not in r and (r["kind"], r["layers"], r["mode"]) == (kind, layers, mode))
        label = f"{kind} {layers}L {mode}"
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax_m.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
    for ax, what in ((ax_t, "seconds"), (ax_m, "peak RSS (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    ax_t.set_yscale("log")
    ax_m.legend(fontsize=8)
    fig.suptitle("patched DeepSeek models, long context (bf16, batch 1, strict)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsa.train.long_context", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="v4,v32", help="comma list of v4, v32 (default %(default)s)")
    ap.add_argument("--tokens", default="4k,8k,16k,32k,64k,128k", help="comma list (default %(default)s)")
    ap.add_argument("--modes", default="forward,step", help="comma list of forward, step")
    ap.add_argument("--forward-layers", type=int, default=3, help="layers of the forward model (V4: sliding, CSA, HCA)")
    ap.add_argument("--step-layers", type=int, default=2, help="layers of the training-step model")
    ap.add_argument("--max-step-tokens", default="64k", help="longest training step (default %(default)s)")
    ap.add_argument("--geometry", action="store_true", help="time the mask and geometry work too")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument("--json", default="build/long_context.json")
    ap.add_argument("--plot", default="build/long_context.png")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--_case", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._case:
        c = json.loads(args._case)
        Path(args._out).write_text(json.dumps(run_case(c["kind"], c["layers"], c["tokens"], c["mode"],
                                                       c["geometry"])))
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in models:
        if m not in ("v4", "v32"):
            ap.error(f"--models: expected v4 or v32, got {m!r}")
    for m in modes:
        if m not in ("forward", "step"):
            ap.error(f"--modes: expected forward or step, got {m!r}")
    try:
        tokens = parse_token_counts(args.tokens)
        max_step = parse_token_counts(args.max_step_tokens)[0]
    except ValueError:
        ap.error("--tokens / --max-step-tokens: expected numbers such as 4096 or 4k")
    cases = [dict(kind=k, layers=args.forward_layers if mode == "forward" else args.step_layers, tokens=t, mode=mode,
                  geometry=args.geometry)
             for k in models for mode in modes for t in tokens if mode == "forward" or t <= max_step]
    rows = []
    from tqdm import tqdm
    bar = tqdm(cases, desc="long context", unit="case", disable=args.no_progress, dynamic_ncols=True)
    for case in bar:
        bar.set_postfix_str(f"{case['kind']} {case['mode']} {case['tokens']}")
        rows.append(_child(case, args.timeout))
    print(table(rows))
    for path in (args.json, args.plot):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    import platform
    import torch
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0 if all("error" not in r and r["finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
