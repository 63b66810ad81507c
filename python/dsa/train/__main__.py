"""dsa-train: trains a small DeepSeek-V4 language model (transformers' own model,
random init) on the Python standard library's source bytes, unpatched or on dsa's
fused ops, and with --compare shows the difference.

    python -m dsa.train [--config unpatched|sas|sas+li] [--steps N] [--seq-len L] ...
    python -m dsa.train --compare [--memory-budget GIB]      # what `make run` runs
    torchrun --nproc-per-node 2 -m dsa.train --cp 2 [...]    # context parallel, gloo

Per step: loss, each layer type's indexer KL and recall@k (patched runs with an
indexer loss), tokens/s, behind a progress bar. Writes a JSON of every figure and,
with --compare, a PNG of loss and step time per configuration. See docs/training.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

from .._common import missing_extra
from .._cli import check_writable, dtype_arg
from .loop import CONFIGS, RunSpec


def _number(name, kind=int):
    """argparse type: a number of `kind` > 0, the error naming the flag."""
    what = "an integer" if kind is int else "a number"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name}: expected {what} {'>= 1' if kind is int else '> 0'}, got {value}")
        return value
    return parse




def parser() -> argparse.ArgumentParser:
    d = RunSpec()
    ap = argparse.ArgumentParser(prog="dsa-train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=list(CONFIGS), default=d.config, help="which ops run (default %(default)s)")
    ap.add_argument("--compare", action="store_true", help="train every configuration and compare them")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="with --compare: which configurations, comma separated (default %(default)s)")
    ap.add_argument("--steps", type=_number("--steps"), default=d.steps,
                    help="optimizer steps this run trains (with --resume: that many more after the saved ones, "
                         "not a total like transformers' max_steps; default %(default)s)")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help=f"steps left out of the step-time figures (default {d.warmup_steps}, fewer for short runs)")
    ap.add_argument("--seq-len", type=_number("--seq-len"), default=d.seq_len,
                    help="tokens per sequence (default %(default)s)")
    ap.add_argument("--batch", type=_number("--batch"), default=d.batch, help="sequences per step (default %(default)s)")
    ap.add_argument("--layers", type=_number("--layers"), default=d.layers,
                    help="decoder layers of the random V4 model (default %(default)s)")
    ap.add_argument("--hidden", type=_number("--hidden"), default=d.hidden, help="hidden size (default %(default)s)")
    ap.add_argument("--heads", type=_number("--heads"), default=d.heads, help="attention heads (default %(default)s)")
    ap.add_argument("--head-dim", type=_number("--head-dim"), default=d.head_dim,
                    help="attention head dim (default %(default)s)")
    ap.add_argument("--index-topk", type=_number("--index-topk"), default=d.index_topk,
                    help="compressed entries each CSA query attends (default %(default)s)")
    ap.add_argument("--dtype", type=dtype_arg, default=d.dtype, metavar="{fp32,bf16}",
                    help="the model's dtype: fp32 / float32 or bf16 / bfloat16 (default %(default)s)")
    ap.add_argument("--lr", type=_number("--lr", float), default=d.lr, help="AdamW learning rate (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed, help="model init and data order (default %(default)s)")
    ap.add_argument("--indexer-loss", choices=["sparse", "none"], default=d.indexer_loss,
                    help="indexer KL loss of patched runs (default %(default)s)")
    ap.add_argument("--loss-coefficient", type=float, default=d.loss_coefficient,
                    help="weight of the indexer KL in the loss (default %(default)s)")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch / dsa threads (0: all cores)")
    ap.add_argument("--save", metavar="DIR", help="save_pretrained the model (and optimizer state) here at the end")
    ap.add_argument("--resume", metavar="DIR", help="continue from a folder written by --save")
    ap.add_argument("--memory-budget", type=_number("--memory-budget", float), metavar="GIB",
                    help="with --compare: find the most layers each configuration trains within GIB")
    ap.add_argument("--timeout", type=_number("--timeout", float), default=1800.0,
                    help="seconds one configuration may run before it is stopped (default %(default)s)")
    ap.add_argument("--json", metavar="PATH", default="build/train.json",
                    help="every figure of the run as JSON (default %(default)s)")
    ap.add_argument("--plot", metavar="PATH", default=None,
                    help="with --compare: the PNG of loss and step time (default build/train.png)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--cp", type=_number("--cp"), default=d.cp, metavar="W",
                    help="context parallel over W ranks (gloo; start with torchrun --nproc-per-node W); "
                         "each rank trains on its contiguous run of every batch")
    ap.add_argument("--cp-balance", choices=("contiguous", "zigzag"), default=d.cp_balance,
                    help="with --cp W: each rank's rows of a replica's stream, a contiguous run or, for the causal "
                         "balance of long documents, chunks r and 2W-1-r of 2W (default %(default)s)")
    ap.add_argument("--dp", type=_number("--dp"), default=d.dp, metavar="D",
                    help="data parallel over D replicas, each taking its own --batch rows (with --cp C: "
                         "torchrun --nproc-per-node D*C; the ranks form a (dp, cp) mesh)")
    ap.add_argument("--dp-wrap", choices=("ddp", "fsdp"), default=d.dp_wrap,
                    help="how the replicas share gradients: DistributedDataParallel, or FSDP2's fully_shard "
                         "over the dp dimension (default %(default)s)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute each decoder layer in the backward instead of keeping its activations "
                         "(transformers' activation_checkpointing_enable, non-reentrant; less memory, one more "
                         "forward)")
    ap.add_argument("--_child-spec", help=argparse.SUPPRESS)
    ap.add_argument("--_child-out", help=argparse.SUPPRESS)
    ap.add_argument("--_child-budget", type=float, help=argparse.SUPPRESS)
    return ap


# The model-shape flags and the checkpoint config field each one sets.
_SHAPE_FLAGS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                "head_dim": "head_dim", "index_topk": "index_topk"}


def _resume_shape(ap, args, argv) -> None:
    """--resume trains the checkpoint's model: a shape flag given on the command line
    that contradicts it is an error before any work, and the run's spec records the
    checkpoint's shape (what trains), not the flags' defaults."""
    config_file = os.path.join(args.resume, "config.json")
    if not os.path.isfile(config_file):
        return  # the loader reports a folder --save did not write
    with open(config_file) as f:
        saved = json.load(f)
    quiet = parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    given = vars(quiet.parse_args(argv))
    for flag, field in _SHAPE_FLAGS.items():
        if field not in saved:
            continue
        if flag in given and given[flag] != saved[field]:
            ap.error(f"--{flag.replace('_', '-')} {given[flag]}: the checkpoint in --resume {args.resume} has "
                     f"{field} = {saved[field]}; --resume continues that model (drop the flag)")
        setattr(args, flag, saved[field])


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check_cp(ap, args) -> None:
    """--dp D --cp C runs D x C processes under torchrun; a mismatch is an error before
    any process group is made, on every rank (and a torchrun start without them would
    train W copies)."""
    world = os.environ.get("WORLD_SIZE")
    ranks = args.dp * args.cp
    mesh = f"--dp {args.dp} --cp {args.cp}" if args.dp > 1 else f"--cp {args.cp}"
    if args.cp_balance != "contiguous" and args.cp == 1:
        ap.error(f"--cp-balance {args.cp_balance}: splits a stream over context-parallel ranks; needs --cp >= 2")
    if ranks == 1:
        if world is not None and int(world) > 1:
            ap.error(f"--cp: started with WORLD_SIZE={world} (torchrun?) but without --cp {world} (or --dp); "
                     "every process would train the whole batch")
        return
    if world is None:
        ap.error(f"{mesh}: needs one process per rank, started by torchrun (WORLD_SIZE is not set): "
                 f"torchrun --nproc-per-node {ranks} -m dsa.train {mesh} ...")
    if int(world) != ranks:
        ap.error(f"{mesh}: needs {ranks} processes, torchrun started {world} (WORLD_SIZE={world}); "
                 f"use --nproc-per-node {ranks}")
    if args.compare or args.memory_budget:
        ap.error(f"{mesh.split()[0]}: not with --compare / --memory-budget (run each configuration by itself)")
    if args.cp > 1 and args.config != "sas+li":
        ap.error(f"--cp: needs --config sas+li (dsa's attention, indexer and compressors; got {args.config}): "
                 "transformers' own attention would see each rank's rows only")
    if args.seq_len * args.batch < args.cp:
        ap.error(f"--cp {args.cp}: a batch of {args.seq_len * args.batch} tokens cannot give every rank one")
    if args.cp_balance == "zigzag" and args.seq_len * args.batch < 2 * args.cp:
        ap.error(f"--cp-balance zigzag: {2 * args.cp} chunks need a batch of at least {2 * args.cp} tokens, "
                 f"got {args.seq_len * args.batch}")
    if args.dp > 1 and args.dp_wrap == "fsdp" and (args.save or args.resume):
        ap.error("--save / --resume: not with --dp-wrap fsdp (the checkpoint format holds whole parameters; "
                 "use --dp-wrap ddp)")


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    from . import compare as cmp
    from .loop import run, write_json

    if args._child_spec:  # one configuration of --compare, in its own process
        spec = RunSpec(**json.loads(args._child_spec))
        if args._child_budget is not None:
            from .loop import search_layers

            write_json(search_layers(spec, args._child_budget, _log), args._child_out)
        else:
            write_json(run(spec), args._child_out)
        return 0
    needed = ["transformers"] + ["tqdm"] * (not args.no_progress) + ["matplotlib"] * args.compare
    missing = missing_extra(needed, "train", "dsa-train" + (" --compare" if args.compare else ""))
    if missing:
        print(f"dsa-train: error: {missing}", file=sys.stderr)
        return 2
    if args.resume and not args.compare:
        _resume_shape(ap, args, sys.argv[1:] if argv is None else argv)
    if args.warmup_steps is None:
        args.warmup_steps = min(RunSpec().warmup_steps, args.steps - 1)
    names = {f.name for f in fields(RunSpec)}
    spec = RunSpec(**{k: v for k, v in vars(args).items() if k in names})
    spec.indexer_loss = None if args.indexer_loss == "none" else args.indexer_loss
    spec.progress = not args.no_progress
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        ap.error(f"--warmup-steps: expected 0 <= N < --steps ({args.steps}), got {args.warmup_steps}")
    if args.threads < 0:
        ap.error(f"--threads: expected an integer >= 0, got {args.threads}")
    if args.memory_budget and not args.compare:
        ap.error("--memory-budget: only with --compare")
    if args.plot is not None and not args.compare:
        ap.error("--plot: only with --compare (the plot compares the configurations)")
    if args.compare and args.plot is None:
        args.plot = "build/train.png"
    _check_cp(ap, args)
    rank0 = int(os.environ.get("RANK", "0")) == 0 if args.dp * args.cp > 1 else True
    try:
        for path, what in ((args.json, "--json"), (args.plot, "--plot")):
            if path is not None and rank0:  # under --dp / --cp only rank 0 writes them
                check_writable(path, what)
        if args.compare:
            if args.save or args.resume:
                ap.error("--save / --resume: not with --compare (each configuration runs in its own process)")
            configs = [c.strip() for c in args.configs.split(",") if c.strip()]
            unknown = [c for c in configs if c not in CONFIGS]
            if unknown or not configs:
                ap.error(f"--configs: expected a comma list of {', '.join(CONFIGS)}, got {args.configs!r}")
            result = cmp.compare(spec, args.memory_budget, args.timeout, _log, configs)
            print(cmp.tables(result))
            write_json(result, args.json)
            cmp.plot(result, args.plot)
            _log(f"[compare] wrote {args.json} and {args.plot}")
            failed = [n for n, r in result["runs"].items() if "error" in r]
            return 1 if failed else 0
        result = run(spec)
        if not rank0:  # under --dp / --cp only rank 0 reports and writes
            return 0
        write_json(result, args.json)
        last = result["steps"][-1]
        print(f"{spec.config}: {len(result['steps'])} steps, loss {result['loss_first']:.4f} -> "
              f"{result['loss_last']:.4f}, {result['step_seconds']['median']:.2f} s/step, "
              f"{result['tokens_per_s']:.0f} tokens/s, peak {result['memory_gib']['peak_rss']:.2f} GiB"
              + (f", indexer KL {last['indexer_kl']}" if last["indexer_kl"] else ""))
        if "cp" in result:
            print(cmp.cp_table(result["cp"]))
        _log(f"wrote {args.json}")
        return 0
    except ValueError as e:
        print(f"dsa-train: error: {e}", file=sys.stderr)
        return 2


def command(argv=None) -> None:
    """The dsa-train command, as `python -m dsa.train` and as the installed console
    script: main(), then the process's exit."""
    code = main(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank here has destroyed its process group and written its results;
        # the interpreter's teardown can still abort in a torch / gloo thread's destructor
        # ("terminate called without an active exception", SIGABRT: once in six `make
        # test` runs of the CP tests on a 2-core Zen 1 class EPYC, 2026-12-07), failing a
        # finished run. Leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    command()
