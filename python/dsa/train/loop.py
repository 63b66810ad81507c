"""One training run: model, optional dsa patch, AdamW, per-step figures."""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .._cli import check_writable
from .data import Batches, stdlib_corpus
from .model import build_model, layer_types, v4_config

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


_LAYER = re.compile(r"layers\.(\d+)\.")


def _by_layer_type(values: dict, types: list[str]) -> dict[str, float]:
    """{module name: value} -> {layer type: mean value} (None values left out)."""
    by_type: dict[str, list[float]] = {}
    for name, value in values.items():
        m = _LAYER.search(name)
        if m is None or value is None:
            continue
        by_type.setdefault(types[int(m.group(1))], []).append(float(value))
    return {t: sum(v) / len(v) for t, v in by_type.items()}


def _indexer_figures(model, types: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Per layer type: the mean indexer KL and recall@k of the last step."""
    from ..integrations.transformers import indexer_losses, indexer_recall

    return _by_layer_type(indexer_losses(model), types), _by_layer_type(indexer_recall(model), types)


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
    cp = _CP(spec) if spec.cp > 1 else None
    try:
        return _run(spec, cp)
    finally:
        if cp is not None:
            cp.close()


def _run(spec: RunSpec, cp) -> dict:
    dtype = DTYPES[spec.dtype]
    corpus = stdlib_corpus()
    batches = Batches(corpus, spec.seq_len, spec.batch, spec.seed)
    start_step = 0
    if spec.resume:
        model, optimizer, start_step = _load(spec, batches, dtype)
    else:
        config = v4_config(spec.layers, spec.hidden, spec.heads, spec.head_dim, spec.seq_len, spec.index_topk, dtype)
        model = build_model(config, spec.seed, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    patched = _patch(model, spec, cp.group if cp is not None else None)
    if spec.gradient_checkpointing:
        # Each decoder layer keeps only its input and recomputes the rest in the
        # backward (dsa's ops are deterministic, so the recompute is the same bits;
        # under CP its collectives rerun in the same order on every rank).
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    types = layer_types(model)
    timer = LayerTimer(model.model.layers)
    rss_start = _rss_gib("VmRSS")
    records: list[StepRecord] = []
    bar = None
    if spec.progress and (cp is None or cp.rank == 0):
        from tqdm import tqdm

        bar = tqdm(total=spec.steps, desc=f"train {spec.config}", unit="step", dynamic_ncols=True, leave=False)
    try:
        for step in range(start_step, start_step + spec.steps):
            ids = batches.next()
            t0 = time.perf_counter()
            if cp is None:
                out = model(input_ids=ids, labels=ids, use_cache=False)
                loss = out.loss
                if not torch.isfinite(loss):
                    raise RuntimeError(f"step {step}: the loss is {loss.item()} (diverged)")
                loss.backward()
            else:
                loss = cp.forward_backward(model, ids)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            if cp is not None:
                kl, recall = cp.indexer_figures(model, types)
            else:
                kl, recall = _indexer_figures(model, types) if patched is not None else ({}, {})
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
    breakdown = op_breakdown(model, ids) if cp is None and records else None
    if spec.save and (cp is None or cp.rank == 0):  # under CP every rank holds the same model
        _save(spec.save, model, optimizer, batches, start_step + spec.steps)
    result = summarise(spec, types, records, rss_start, _rss_gib("VmHWM"))
    if breakdown is not None:
        result["time_breakdown"] = breakdown
    if cp is not None:
        result["cp"] = cp.per_rank(result)
    return result


class _CP:
    """dsa-train --cp W: one process per rank (torchrun's environment), gloo. Every rank
    draws the same batch; its rows are packed into one stream (a row is a document) and
    rank r trains on its contiguous run. The loss shares and the replicated parameters'
    gradients are summed over the ranks, so every rank takes the single-process step."""

    def __init__(self, spec: RunSpec):
        import datetime

        import torch.distributed as dist

        self.dist = dist
        if not dist.is_initialized():
            # torchrun's MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE; a bounded wait, so a
            # rank that died does not leave the others waiting forever.
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != spec.cp:
            raise ValueError(f"--cp: {spec.cp} ranks asked for, the process group has {self.world}")
        tokens = spec.seq_len * spec.batch
        if tokens < self.world:
            raise ValueError(f"--cp: {self.world} ranks need at least one token each; a batch has {tokens}")
        # An even contiguous split (the first `tokens % W` ranks take one more row).
        base, extra = divmod(tokens, self.world)
        self.offsets = [0]
        for q in range(self.world):
            self.offsets.append(self.offsets[-1] + base + (q < extra))
        self.shard = None

    def forward_backward(self, model, ids: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward on this rank's run; returns the global loss."""
        from ..cp import loss_for_logging
        from ..integrations.transformers import cp_batch

        batch, seq = ids.shape
        flat = ids.reshape(-1)
        ends = [seq * (b + 1) for b in range(batch)]
        # The unpacked rows' targets: no row's last token predicts the next row's first.
        labels = flat.clone()
        labels[ends[:-1]] = -100
        o, e = self.offsets[self.rank], self.offsets[self.rank + 1]
        kw = cp_batch(model, flat[o:e], ends, labels=labels[o:e])
        self.shard = kw["dsa_cp_shard"]
        share = model(**kw).loss
        share.backward()
        loss = loss_for_logging(share, self.shard)
        if not torch.isfinite(loss):
            raise RuntimeError(f"the loss is {loss.item()} (diverged)")
        self._sum_grads(model)
        return loss

    def _sum_grads(self, model) -> None:
        """Sums every parameter's gradient over the ranks (one fp32 all-reduce). A parameter
        no rank's rows reached (an expert no token picked) keeps grad None, as in a
        single process: AdamW skips it instead of decaying it."""
        params = list(model.parameters())
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int64)
        self.dist.all_reduce(present, group=self.group)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params])
        self.dist.all_reduce(flat, group=self.group)
        at = 0
        for p, seen in zip(params, present.tolist()):
            n = p.numel()
            p.grad = flat[at:at + n].view_as(p).to(p.dtype) if seen else None
            at += n

    def indexer_figures(self, model, types):
        """Per layer type: the indexer KL (the sum of the ranks' shares) and recall@k (the
        mean of the ranks' values, each over its own rows)."""
        from ..integrations.transformers import indexer_losses, indexer_recall

        losses = dict(sorted(indexer_losses(model).items()))
        recall = dict(sorted(indexer_recall(model).items()))
        # Same layers on every rank (the decisions behind them are global); a rank whose rows
        # see no more than k entries has recall None and is left out of that layer's mean.
        t = torch.tensor([float(v) for v in losses.values()] + [float(v or 0.0) for v in recall.values()]
                         + [float(v is not None) for v in recall.values()], dtype=torch.float64)
        self.dist.all_reduce(t, group=self.group)
        n_kl, n_rec = len(losses), len(recall)
        kl = dict(zip(losses, t[:n_kl].tolist()))
        sums, counts = t[n_kl:n_kl + n_rec].tolist(), t[n_kl + n_rec:].tolist()
        rec = {k: v / c for k, v, c in zip(recall, sums, counts) if c > 0}
        return _by_layer_type(kl, types), _by_layer_type(rec, types)

    def per_rank(self, result: dict) -> dict:
        """Every rank's rows, steady-state step time and peak RSS (VmHWM), gathered on every rank."""
        mine = {"rank": self.rank, "rows": self.offsets[self.rank + 1] - self.offsets[self.rank],
                "step_seconds_median": result["step_seconds"]["median"],
                "peak_rss_gib": result["memory_gib"]["peak_rss"]}
        ranks = [None] * self.world
        self.dist.all_gather_object(ranks, mine, group=self.group)
        return {"world_size": self.world, "backend": "gloo", "offsets": self.offsets, "ranks": ranks}

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


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
        "tokens_per_s": spec.seq_len * spec.batch / statistics.median(steady),
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
