"""One training run: model, optional dsa patch, AdamW, per-step figures."""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .._cli import check_writable
from .data import Batches, stdlib_corpus
from .model import build_model, layer_types, v4_config
from .trainers import Trainer, make_trainer

# What each configuration switches on (dsa.integrations.transformers.patch flags).
CONFIGS = {
    "unpatched": None,
    "sas": dict(sas=True, li=False, compressor=True),
    "sas+li": dict(sas=True, li=True, compressor=True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATE_FILE = "trainer_state.pt"


@dataclass
class RunSpec:
    config: str = "sas+li"
    steps: int = 5
    warmup_steps: int = 2  # excluded from the steady-state step-time figures
    seq_len: int = 2048
    batch: int = 1
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    head_dim: int = 128
    index_topk: int = 512
    dtype: str = "fp32"
    lr: float = 1e-3
    seed: int = 0
    indexer_loss: str | None = "sparse"  # None: no indexer loss (the indexer gets no gradient)
    loss_coefficient: float = 1.0
    threads: int = 0  # 0: torch's default
    save: str | None = None
    resume: str | None = None
    progress: bool = True
    cp: int = 1  # context-parallel ranks (> 1: one process each, started by torchrun)
    cp_balance: str = "contiguous"  # how a replica's stream is split over its cp ranks: or "zigzag"
    dp: int = 1  # data-parallel replicas, each of `batch` rows (dp x cp processes under torchrun)
    dp_wrap: str = "ddp"  # how the replicas share gradients: "ddp" or "fsdp" (FSDP2's fully_shard)
    gradient_checkpointing: bool = False  # transformers' activation checkpointing (non-reentrant) per layer


@dataclass
class StepRecord:
    step: int
    loss: float
    seconds: float
    tokens_per_s: float
    layer_seconds: list[float] = field(default_factory=list)  # forward + backward per decoder layer
    indexer_kl: dict[str, float] = field(default_factory=dict)  # per layer type
    indexer_recall: dict[str, float] = field(default_factory=dict)


def proc_gib(path: str, field_name: str) -> float:
    """A "Name:  N kB" field of a /proc file (GiB); nan where /proc is missing."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("nan")


def _rss_gib(field_name: str) -> float:
    """VmRSS / VmHWM of this process (GiB)."""
    return proc_gib("/proc/self/status", field_name)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpointed
    layer's forward then is its recompute)."""
    return torch._C._current_graph_task_id() != -1


class LayerTimer:
    """Wall time of each decoder layer's forward and backward, from module hooks."""

    def __init__(self, layers):
        self.totals = [0.0] * len(layers)
        self._start_fwd = [0.0] * len(layers)
        self._start_bwd = [0.0] * len(layers)
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles += [
                layer.register_forward_pre_hook(self._mark(self._start_fwd, i, forward=True)),
                layer.register_forward_hook(self._add(self._start_fwd, i, forward=True)),
                layer.register_full_backward_pre_hook(self._mark(self._start_bwd, i)),
                layer.register_full_backward_hook(self._add(self._start_bwd, i)),
            ]

    # A forward hook firing inside a backward is a checkpointed layer's recompute:
    # its backward span already counts it.
    def _mark(self, starts, i, forward=False):
        def hook(*_):
            if not (forward and _in_backward()):
                starts[i] = time.perf_counter()
        return hook

    def _add(self, starts, i, forward=False):
        def hook(*_):
            if not (forward and _in_backward()):
                self.totals[i] += time.perf_counter() - starts[i]
        return hook

    def take(self) -> list[float]:
        out, self.totals = self.totals, [0.0] * len(self.totals)
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def _patch(model, spec: RunSpec, cp_group=None):
    flags = CONFIGS[spec.config]
    if flags is None:
        return None
    from ..integrations.transformers import patch, track_indexer_recall

    patch(model, **flags, indexer_loss=spec.indexer_loss, loss_coefficient=spec.loss_coefficient, strict=True,
          cp_group=cp_group)
    track_indexer_recall(model)  # the selection's recall, whichever indexer (dsa's or the model's) made it
    return model


def run(spec: RunSpec) -> dict:
    """Trains `spec.steps` steps (continuing from `spec.resume`) and returns every figure."""
    if spec.config not in CONFIGS:
        raise ValueError(f"--config: expected one of {', '.join(CONFIGS)}, got {spec.config!r}")
    if spec.dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    for path, what in ((spec.save, "--save"),):
        if path:
            check_writable(path, what, folder=True)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    trainer = make_trainer(spec)
    try:
        return _run(spec, trainer)
    finally:
        trainer.close()


def _run(spec: RunSpec, trainer: Trainer) -> dict:
    dtype = DTYPES[spec.dtype]
    corpus = stdlib_corpus()
    # Under --dp D every rank draws the D replicas' rows (D x batch) and keeps its own.
    batches = Batches(corpus, spec.seq_len, spec.batch * spec.dp, spec.seed)
    start_step = 0
    if spec.resume:
        model, optimizer, start_step = _load(spec, batches, dtype)
    else:
        config = v4_config(spec.layers, spec.hidden, spec.heads, spec.head_dim, spec.seq_len, spec.index_topk, dtype)
        model = build_model(config, spec.seed, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    patched = _patch(model, spec, trainer.cp_group)
    if spec.gradient_checkpointing:
        # Each decoder layer keeps only its input and recomputes the rest in the
        # backward (dsa's ops are deterministic, so the recompute is the same bits;
        # under CP its collectives rerun in the same order on every rank).
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    trainer.prepare(model)
    if trainer.replaces_parameters:  # FSDP2 swapped every parameter for its shard: optimise those
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    types = layer_types(model)
    timer = LayerTimer(model.model.layers)
    rss_start = _rss_gib("VmRSS")
    records: list[StepRecord] = []
    bar = None
    if spec.progress and trainer.is_main:
        from tqdm import tqdm

        bar = tqdm(total=spec.steps, desc=f"train {spec.config}", unit="step", dynamic_ncols=True, leave=False)
    try:
        for step in range(start_step, start_step + spec.steps):
            ids = batches.next()
            t0 = time.perf_counter()
            loss = trainer.forward_backward(model, ids, step)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            kl, recall = trainer.indexer_figures(model, types) if patched is not None else ({}, {})
            rec = StepRecord(step=step, loss=float(loss.item()), seconds=seconds,
                             tokens_per_s=ids.numel() / seconds, layer_seconds=timer.take(), indexer_kl=kl,
                             indexer_recall=recall)
            records.append(rec)
            if bar is not None:
                bar.set_postfix(loss=f"{rec.loss:.3f}", tok_s=f"{rec.tokens_per_s:.0f}")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        timer.remove()
    breakdown = op_breakdown(model, ids) if trainer.profiles and records else None
    if spec.save and trainer.is_main:  # under CP every rank holds the same model
        _save(spec.save, model, optimizer, batches, start_step + spec.steps)
    result = summarise(spec, types, records, rss_start, _rss_gib("VmHWM"))
    if breakdown is not None:
        result["time_breakdown"] = breakdown
    trainer.annotate(result)
    return result


def _release_memory() -> None:
    """Returns what a finished probe held to the OS, so the next probe's peak is its own."""
    import ctypes
    import gc

    gc.collect()
    from .. import empty_buffer_pool

    empty_buffer_pool()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _reset_peak_rss() -> bool:
    """Linux: '5' in /proc/self/clear_refs resets VmHWM to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


MAX_LAYERS = 256
MAX_PROBES = 12
NOISE_GIB = 16 / 1024  # peak RSS of equal probes differs by a few MiB


def search_layers(spec: RunSpec, budget_gib: float, log=lambda msg: None) -> dict:
    """The most layers whose two training steps stay within `budget_gib` of peak RSS, found
    in this one process (run it in a fresh one). Each probe builds the model at a layer
    count and trains two steps; its peak is this process's RSS after the imports plus what
    the probe added over the RSS it started from (freed memory is returned to the OS and
    the kernel's high-water mark reset in between, so probes do not see each other).

    Probes: 1 and 2 layers, extrapolated linearly; the estimate and its neighbours; then
    bisection between the largest count that fits and the smallest that does not
    (doubling while none is over). `exact` says whether the two ended adjacent."""
    # A first one-step run at 1 layer puts the one-time costs (imports, library
    # initialisation, first-use caches) into the baseline instead of the first probe.
    run(replace(spec, layers=1, steps=1, warmup_steps=0, save=None, resume=None, progress=False))
    _release_memory()
    base = _rss_gib("VmRSS")
    measured: dict[int, float] = {}
    can_reset = True

    def measure(layers: int) -> None:
        nonlocal can_reset
        if layers in measured or not 1 <= layers <= MAX_LAYERS or not can_reset or len(measured) >= MAX_PROBES:
            return
        _release_memory()
        can_reset = _reset_peak_rss()
        start = _rss_gib("VmRSS")
        run(replace(spec, layers=layers, steps=2, warmup_steps=1, save=None, resume=None, progress=False))
        measured[layers] = base + max(0.0, _rss_gib("VmHWM") - start)
        log(f"  {spec.config}: {layers} layers -> peak {measured[layers]:.2f} GiB")

    def bracket():
        over = min((c for c, v in measured.items() if v > budget_gib), default=None)
        fits = max((c for c, v in measured.items() if v <= budget_gib and (over is None or c < over)), default=0)
        return fits, over

    measure(1)
    measure(2)
    # Extrapolate only from a growth above the probes' noise (RSS moves by a few MiB
    # between equal runs): a tiny model's 1- and 2-layer peaks can come out in either
    # order, and a guess from that difference sent the search to MAX_LAYERS. Without
    # one, the loop below doubles the layer count until a probe is over the budget.
    if len(measured) == 2 and measured[1] <= budget_gib and measured[2] - measured[1] > NOISE_GIB:
        per_layer = measured[2] - measured[1]
        guess = int((budget_gib - measured[1]) / per_layer) + 1
        for c in (guess, guess + 1, guess - 1):
            measure(min(MAX_LAYERS, max(1, c)))
    while len(measured) < MAX_PROBES and can_reset:
        fits, over = bracket()
        if fits == 0 or fits >= MAX_LAYERS or (over is not None and over == fits + 1):
            break
        nxt = (fits + over) // 2 if over is not None else min(MAX_LAYERS, 2 * fits)
        if nxt in measured:
            break
        measure(nxt)
    fits, over = bracket()
    exact = fits == 0 or fits >= MAX_LAYERS or (over is not None and over == fits + 1)
    return {"layers": fits, "exact": exact, "baseline_gib": base,
            "measured": {str(k): v for k, v in sorted(measured.items())}}


class _c_stderr_silenced:
    """File descriptor 2 pointed at /dev/null for the block (C libraries print there
    directly; Python's sys.stderr is flushed first and unaffected afterwards)."""

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)


def op_breakdown(model, ids: torch.Tensor) -> dict:
    """Where a step's time goes: one more forward and backward on the last batch (no
    optimizer step, the gradients dropped, so the run's results are untouched) under
    torch's profiler. dsa's ops are torch.library ops named ``dsa::...``, forward and
    backward kernels apart; each call's time is summed by op, and the rest of the phase is
    the model's own work (projections, norms, RoPE, MoE, the patch's glue, autograd)."""
    from torch.profiler import ProfilerActivity, profile

    def dsa_ops(prof) -> dict:
        """Inclusive time of each outermost dsa op call (the kernel runs in a nested
        autograd-wrapper event, so self time would miss it)."""
        ops = {}
        for ev in prof.events():
            if not ev.name.startswith("dsa::"):
                continue
            parent = ev.cpu_parent
            while parent is not None and not parent.name.startswith("dsa::"):
                parent = parent.cpu_parent
            if parent is None:
                name = ev.name[len("dsa::"):]
                ops[name] = ops.get(name, 0.0) + ev.cpu_time_total / 1e6
        return ops

    def profiled(fn):
        # The profiler's start and stop print "USDT: ... profiler_start / _stop" lines on
        # the C stderr: silenced for those two calls only, not for the model's work.
        prof = profile(activities=[ProfilerActivity.CPU])
        with _c_stderr_silenced():
            prof.start()
        try:
            t0 = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - t0
        finally:
            with _c_stderr_silenced():
                prof.stop()
        return result, (seconds, prof)

    model.zero_grad(set_to_none=True)
    phases = {}
    loss, phases["forward"] = profiled(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
    _, phases["backward"] = profiled(loss.backward)
    model.zero_grad(set_to_none=True)
    out = {}
    for name, (seconds, prof) in phases.items():
        ops = dsa_ops(prof)
        out[name] = {"seconds": seconds, "dsa_ops": ops, "dsa_seconds": sum(ops.values()),
                     "rest_seconds": seconds - sum(ops.values())}
    return out


def summarise(spec: RunSpec, types: list[str], records: list[StepRecord], rss_start: float, rss_peak: float) -> dict:
    steady = [r.seconds for r in records[spec.warmup_steps:]] or [r.seconds for r in records]
    layers = [list(x) for x in zip(*[r.layer_seconds for r in records[spec.warmup_steps:] or records])]
    per_layer = [statistics.median(x) for x in layers] if layers else []
    by_type: dict[str, list[float]] = {}
    for t, s in zip(types, per_layer):
        by_type.setdefault(t, []).append(s)
    return {
        "spec": asdict(spec),
        "layer_types": types,
        "steps": [asdict(r) for r in records],
        "step_seconds": {"median": statistics.median(steady), "min": min(steady), "max": max(steady),
                         "steady_steps": len(steady)},
        "layer_seconds": per_layer,
        "layer_seconds_by_type": {t: statistics.median(v) for t, v in by_type.items()},
        "tokens_per_s": spec.seq_len * spec.batch * spec.dp / statistics.median(steady),  # every replica
        "memory_gib": {"rss_at_start": rss_start, "peak_rss": rss_peak, "peak_extra": rss_peak - rss_start},
        "loss_first": records[0].loss if records else math.nan,
        "loss_last": records[-1].loss if records else math.nan,
    }


def _save(folder: str, model, optimizer, batches: Batches, next_step: int) -> None:
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    torch.save({"optimizer": optimizer.state_dict(), "next_step": next_step, "data_rng": batches.state(),
                "torch_rng": torch.get_rng_state()}, path / STATE_FILE)


def _load(spec: RunSpec, batches: Batches, dtype: torch.dtype):
    from transformers import DeepseekV4ForCausalLM

    path = Path(spec.resume)
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"--resume: {spec.resume!r} holds no {STATE_FILE} (was it written by --save?)")
    model = DeepseekV4ForCausalLM.from_pretrained(path, torch_dtype=dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = torch.load(path / STATE_FILE, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    batches.load(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    return model, optimizer, int(state["next_step"])


def write_json(result: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
