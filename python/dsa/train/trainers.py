"""How a training step runs: one process, or the ranks of a context-parallel group.

``dsa.train.loop`` is written once against :class:`Trainer`; a new way to split a step
(data x context parallel on a device mesh) is a new trainer, not a branch in the loop.
"""
from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


def by_layer_type(values: dict, types: list[str]) -> dict[str, float]:
    """{module name: value} -> {layer type: mean value} (None values left out)."""
    by_type: dict[str, list[float]] = {}
    for name, value in values.items():
        m = _LAYER.search(name)
        if m is None or value is None:
            continue
        by_type.setdefault(types[int(m.group(1))], []).append(float(value))
    return {t: sum(v) / len(v) for t, v in by_type.items()}


class Trainer:
    """What the training loop asks of a step's runner.

    ``cp_group``: the group ``patch(model, cp_group=...)`` takes (None: no CP);
    ``is_main``: whether this process reports and saves; ``profiles``: whether the op
    profile of a step (``op_breakdown``) is measured here."""
    cp_group = None
    is_main = True
    profiles = True

    def forward_backward(self, model, ids: torch.Tensor, step: int) -> torch.Tensor:
        """One step's forward and backward on the batch ``ids`` [B, S]; the gradients are
        the whole batch's when it returns. Returns the loss (detached or not)."""
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        if not torch.isfinite(loss):
            raise RuntimeError(f"step {step}: the loss is {loss.item()} (diverged)")
        loss.backward()
        return loss

    def indexer_figures(self, model, types: list[str]) -> tuple[dict[str, float], dict[str, float]]:
        """Per layer type: the mean indexer KL and recall@k of the last step."""
        from ..integrations.transformers import indexer_losses, indexer_recall

        return by_layer_type(indexer_losses(model), types), by_layer_type(indexer_recall(model), types)

    def annotate(self, result: dict) -> None:
        """Adds what this runner alone knows to the run's result."""

    def close(self) -> None:
        pass


def make_trainer(spec) -> Trainer:
    """The runner ``spec`` asks for: ``--cp W`` > 1 a context-parallel rank, else one process."""
    return ContextParallel(spec) if spec.cp > 1 else Trainer()


class ContextParallel(Trainer):
    """dsa-train --cp W: one process per rank (torchrun's environment), gloo. Every rank
    draws the same batch; its rows are packed into one stream (a row is a document) and
    rank r trains on its contiguous run. The loss shares and the replicated parameters'
    gradients are summed over the ranks, so every rank takes the single-process step."""

    profiles = False  # the op profile (op_breakdown) is a single-process figure

    def __init__(self, spec):
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
        self.cp_group, self.is_main = self.group, self.rank == 0

    def forward_backward(self, model, ids: torch.Tensor, step: int) -> torch.Tensor:
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
            raise RuntimeError(f"step {step}: the loss is {loss.item()} (diverged)")
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
        return by_layer_type(kl, types), by_layer_type(rec, types)

    def annotate(self, result: dict) -> None:
        """result["cp"]: every rank's rows, steady-state step time and peak RSS (VmHWM),
        gathered on every rank."""
        mine = {"rank": self.rank, "rows": self.offsets[self.rank + 1] - self.offsets[self.rank],
                "step_seconds_median": result["step_seconds"]["median"],
                "peak_rss_gib": result["memory_gib"]["peak_rss"]}
        ranks = [None] * self.world
        self.dist.all_gather_object(ranks, mine, group=self.group)
        result["cp"] = {"world_size": self.world, "backend": "gloo", "offsets": self.offsets, "ranks": ranks}

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
