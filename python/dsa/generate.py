"""``dsa-generate`` (``python -m dsa.generate``): greedy generation with a DeepSeek model
through dsa, and ``--compare``: the unpatched model against dsa's paged cache.

The model is a folder (``save_pretrained`` output, e.g. what ``dsa-train --save``
writes) or the small random V3.2 / V4 that ``dsa-train`` builds (``--arch``). With
``--compare`` every (prompt length, configuration) runs in a fresh interpreter (its
peak memory is its own), within ``--timeout`` seconds: ``unpatched`` (transformers'
own cache), then ``dsa`` with a cache in the model's dtype and ``dsa-fp8`` (plus
``dsa-bf16`` for an fp32 model). The model's dtype defaults to ``auto``: bf16 where
torch's bf16 matmul is native on this CPU, fp32 where torch emulates it (AVX2-only CPUs,
where a bf16 model's prefill ran ~6x slower than the same model in fp32). Each reports
prefill tokens/s, decode ms per token and tokens/s, KV-cache bytes per token, peak RSS
and whether its tokens agree with the unpatched model's. A table on stdout,
``build/generate.json`` and ``build/generate.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from ._child import parse_token_counts, run_json_child
from ._cli import check_writable, dtype_arg
from ._common import missing_extra

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _dtype_or_auto(text: str) -> str:
    """argparse type of --dtype: auto, or what dtype_arg takes."""
    if text == "auto":
        return text
    try:
        return dtype_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--dtype: expected auto, fp32 / float32 or bf16 / bfloat16, "
                                         f"got {text!r}") from None


def resolve_dtype(dtype: str, probe: dict | None = None) -> tuple[str, str]:
    """(the model dtype, why) for --dtype: auto is bf16 where torch's bf16 matmul is native
    here and fp32 where torch emulates it, by ``probe`` (``probe_bf16``'s result; measured
    here when None: bf16 against fp32 GEMM FLOP/s on one thread, under a second). On an
    AVX2-only CPU the emulation runs at ~1 GFLOP/s: the small V3.2's 1024-token prefill
    took 3.5 s in bf16 and 0.56 s in fp32 (Zen 1 class EPYC)."""
    if dtype != "auto":
        return dtype, "--dtype"
    if probe is None:
        from .bench.machine import probe_bf16
        probe = probe_bf16(budget_s=0.5)
    rates = f"bf16 {probe['bf16_flops'] / 1e9:.3g} / fp32 {probe['fp32_flops'] / 1e9:.3g} GFLOP/s, one thread"
    if probe["native"]:
        return "bf16", f"auto: torch's bf16 matmul is native here ({rates})"
    return "fp32", f"auto: torch's bf16 matmul is emulated here ({rates}), so the model runs in fp32"


def _configs(dtype: str) -> list:
    """(name, patched, cache dtype) of a --compare run."""
    out = [("unpatched", False, None), (f"dsa-{dtype}", True, dtype)]
    if dtype == "fp32":
        out.append(("dsa-bf16", True, "bf16"))
    out.append(("dsa-fp8", True, "fp8"))
    return out


def _load(spec: dict):
    import torch

    dtype = getattr(torch, _DTYPES[spec["dtype"]])
    if spec.get("model"):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=dtype).eval()
    from .train.model import build_small
    return build_small(spec["arch"], spec["layers"], spec["prompt"] + spec["new_tokens"], dtype).eval()


def _cache_bytes(cache) -> int:
    """Bytes the cache holds (a DsaCache: its records; transformers': its tensors)."""
    import torch

    from .integrations.transformers import DsaCache
    if isinstance(cache, DsaCache):
        return sum(layer.nbytes for layer in cache.layers)
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def run_one(spec: dict) -> dict:
    """One generation, in this process: spec = model, arch, layers, dtype, prompt, new_tokens,
    batch, patched, cache_dtype."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from .integrations.transformers import fallback_counts, patch
    from .train.loop import proc_gib

    model = _load(spec)
    if spec["patched"]:
        patch(model, cache_dtype=spec["cache_dtype"])
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (spec["batch"], spec["prompt"]), generator=torch.Generator().manual_seed(0))

    stamps = []
    # generate() need not hand its cache back (out.past_key_values is None for
    # some models and versions): take it from the last forward's arguments.
    caches = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: caches.append(kwargs.get("past_key_values")), with_kwargs=True)

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    start = time.perf_counter()
    with torch.no_grad():
        # use_cache: the training configs switch the cache off (use_cache=False).
        out = model.generate(ids, max_new_tokens=spec["new_tokens"], min_new_tokens=spec["new_tokens"],
                             do_sample=False, use_cache=True, return_dict_in_generate=True,
                             stopping_criteria=StoppingCriteriaList([Clock()]))
    prefill = stamps[0] - start  # the prompt's forward and the first token
    steps = [b - a for a, b in zip(stamps[:-1], stamps[1:])]
    cached = (spec["prompt"] + spec["new_tokens"] - 1) * spec["batch"]
    return {
        "prefill_seconds": prefill, "prefill_tokens_per_s": spec["prompt"] * spec["batch"] / prefill,
        "decode_ms_per_token": 1e3 * statistics.median(steps) if steps else float("nan"),
        "decode_tokens_per_s": spec["batch"] / statistics.median(steps) if steps else float("nan"),
        "cache_bytes_per_token": _cache_bytes(caches[-1]) / cached,
        "cache_type": type(caches[-1]).__name__,
        "peak_rss_gib": proc_gib("/proc/self/status", "VmHWM"),
        "tokens": out.sequences[:, spec["prompt"]:].tolist(),
        "fallbacks": dict(fallback_counts(model)) if spec["patched"] else {},
        "threads": torch.get_num_threads(),
    }


def _agreement(tokens, reference) -> float:
    pairs = [(a, b) for ra, rb in zip(tokens, reference) for a, b in zip(ra, rb)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def table(rows: list) -> str:
    head = (f"{'prompt':>7} {'config':<13} {'prefill tok/s':>13} {'decode ms/tok':>13} {'decode tok/s':>12} "
            f"{'KV B/token':>10} {'peak GiB':>8} {'tokens agree':>12}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['prompt']:>7} {r['config']:<13} failed: {r['error']}")
            continue
        agree = "-" if r.get("agreement") is None else f"{100 * r['agreement']:.0f} %"
        note = r["cache_type"] + (f"; fallbacks {r['fallbacks']}" if r["fallbacks"] else "")
        lines.append(f"{r['prompt']:>7} {r['config']:<13} {r['prefill_tokens_per_s']:>13.1f} "
                     f"{r['decode_ms_per_token']:>13.2f} {r['decode_tokens_per_s']:>12.2f} "
                     f"{r['cache_bytes_per_token']:>10.0f} {r['peak_rss_gib']:>8.2f} {agree:>12}  {note}")
    return "\n".join(lines)


def plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_d, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["prompt"], r["decode_ms_per_token"], r["prefill_tokens_per_s"]) for r in rows
                     if r["config"] == name and "error" not in r)
        ax_d.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        ax_p.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=name)
    for ax, what in ((ax_d, "decode ms per token"), (ax_p, "prefill tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    ax_d.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsa-generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", metavar="DIR",
                    help="a save_pretrained folder (default: the small random model of --arch)")
    ap.add_argument("--arch", choices=("v32", "v4"), default="v32",
                    help="the random model: DeepSeek-V3.2 or V4 (default %(default)s)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the random model (default %(default)s)")
    ap.add_argument("--dtype", type=_dtype_or_auto, default="auto", metavar="{auto,fp32,bf16}",
                    help="the model's dtype: fp32 / float32 or bf16 / bfloat16; auto: bf16 where torch's "
                         "bf16 matmul is native on this CPU, else fp32 (default %(default)s)")
    ap.add_argument("--prompt-lengths", default="1k,4k", metavar="LIST",
                    help="prompt tokens, a comma list such as 1k,4k,16k (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=32,
                    help="tokens generated after each prompt, >= 2 (default %(default)s)")
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate() call (default %(default)s)")
    ap.add_argument("--compare", action="store_true",
                    help="the unpatched model against dsa with each cache dtype, one process per run")
    ap.add_argument("--timeout", type=float, default=900.0, metavar="S",
                    help="seconds one run may take before it is stopped (default %(default)s)")
    ap.add_argument("--json", default="build/generate.json", metavar="PATH",
                    help="the results as JSON (default %(default)s)")
    ap.add_argument("--plot", default="build/generate.png", metavar="PATH",
                    help="with --compare: decode ms/token and prefill tokens/s against prompt length "
                         "(default %(default)s)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--_spec", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._spec:
        Path(args._out).write_text(json.dumps(run_one(json.loads(args._spec))))
        return 0
    needed = ["transformers"] + ["tqdm"] * (not args.no_progress) + ["matplotlib"] * args.compare
    missing = missing_extra(needed, "train" if args.compare else "transformers", "dsa-generate")
    if missing:
        print(f"dsa-generate: error: {missing}", file=sys.stderr)
        return 2
    if args.new_tokens < 2 or args.batch < 1 or args.layers < 1:
        ap.error("--new-tokens >= 2, --batch >= 1 and --layers >= 1")
    try:
        prompts = parse_token_counts(args.prompt_lengths)
    except ValueError:
        ap.error("--prompt-lengths: expected numbers such as 1024 or 4k")
    try:  # before any run, not after minutes of them
        for path, what in ((args.json, "--json"), (args.plot if args.compare else None, "--plot")):
            if path:
                check_writable(path, what)
    except ValueError as e:
        ap.error(str(e))
    args.dtype, why = resolve_dtype(args.dtype)
    print(f"dsa-generate: model dtype {args.dtype} ({why})", flush=True)
    configs = _configs(args.dtype) if args.compare else [(f"dsa-{args.dtype}", True, args.dtype)]
    runs = [(p, c) for p in prompts for c in configs]
    from tqdm import tqdm
    bar = tqdm(runs, desc="generate", unit="run", disable=args.no_progress, dynamic_ncols=True)
    rows, reference = [], {}
    for prompt, (name, patched, cache_dtype) in bar:
        bar.set_postfix_str(f"{name} {prompt}")
        spec = dict(model=args.model, arch=args.arch, layers=args.layers, dtype=args.dtype, prompt=prompt,
                    new_tokens=args.new_tokens, batch=args.batch, patched=patched, cache_dtype=cache_dtype)
        r = dict(prompt=prompt, config=name,
                 **run_json_child(["-m", "dsa.generate", "--_spec", json.dumps(spec)], "--_out", args.timeout))
        if "error" not in r:
            if not patched:
                reference[prompt] = r["tokens"]
            r["agreement"] = _agreement(r["tokens"], reference[prompt]) if prompt in reference else None
        rows.append(r)
    print(table(rows))
    for path in (args.json, args.plot):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    import platform
    import torch
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "arch": args.model or args.arch, "dtype": args.dtype,
            "dtype_reason": why,
            "batch": args.batch, "new_tokens": args.new_tokens}
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
