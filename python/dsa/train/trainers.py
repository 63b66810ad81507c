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


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's) local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class Trainer:
    """What the training loop asks of a step's runner.

    ``cp_group``: the group ``patch(model, cp_group=...)`` takes (None: no CP);
    ``is_main``: whether this process reports and saves; ``profiles``: whether the op
    profile of a step (``op_breakdown``) is measured here."""
    cp_group = None
    is_main = True
    profiles = True
    replaces_parameters = False  # prepare() swapped the model's parameters (FSDP2)

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

    def prepare(self, model) -> None:
        """Wraps the (patched) model where the runner needs a wrapper (DDP, FSDP2)."""

    def annotate(self, result: dict) -> None:
        """Adds what this runner alone knows to the run's result."""

    def close(self) -> None:
        pass


def make_trainer(spec) -> Trainer:
    """The runner ``spec`` asks for: ``--dp D`` x ``--cp C`` > 1 process a rank of the
    mesh, else one process."""
    return Distributed(spec) if getattr(spec, "dp", 1) * spec.cp > 1 else Trainer()


DP_WRAPS = ("ddp", "fsdp")


class Distributed(Trainer):
    """dsa-train --dp D --cp C: D x C processes (torchrun's environment), gloo, on a
    ``("dp", "cp")`` device mesh (rank = d * C + c). Every rank draws the same batch of
    D x B rows; data-parallel replica d takes rows [d B, (d + 1) B), packs them into one
    stream (a row is a document), and CP rank c of the replica trains on its contiguous
    run of that stream. The loss shares and the gradients are summed over the CP ranks of
    a replica and averaged over the replicas (by the DP wrapper: DDP's all-reduce, or
    FSDP2's reduce-scatter), so every replica takes the step of one process that runs
    the D x B rows."""

    profiles = False  # the op profile (op_breakdown) is a single-process figure

    def __init__(self, spec):
        import datetime

        import torch.distributed as dist

        self.dist = dist
        self.dp, self.cp = getattr(spec, "dp", 1), spec.cp
        self.balance = getattr(spec, "cp_balance", "contiguous")
        self.dp_wrap = getattr(spec, "dp_wrap", "ddp")
        if self.dp_wrap not in DP_WRAPS:
            raise ValueError(f"--dp-wrap: expected one of {', '.join(DP_WRAPS)}, got {self.dp_wrap!r}")
        if self.dp > 1 and self.dp_wrap == "fsdp" and (spec.save or spec.resume):
            raise ValueError("--save / --resume: not with --dp-wrap fsdp (the checkpoint format holds whole "
                             "parameters; use --dp-wrap ddp)")
        if not dist.is_initialized():
            # torchrun's MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE; a bounded wait, so a
            # rank that died does not leave the others waiting forever.
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Checked before any collective, identically on every rank: a bad mesh is an
        # error everywhere, never a rank waiting for the others.
        if self.world != self.dp * self.cp:
            raise ValueError(f"--dp {self.dp} --cp {self.cp}: the mesh needs dp x cp = {self.dp * self.cp} "
                             f"processes, the process group has {self.world}")
        tokens = spec.seq_len * spec.batch
        if tokens < self.cp:
            raise ValueError(f"--cp: {self.cp} ranks need at least one token each; a replica's batch has {tokens}")
        self.batch = spec.batch
        self.dp_rank, self.cp_rank = divmod(self.rank, self.cp)
        self.group = self.dp_group = None
        if self.dp == 1:
            self.group = dist.group.WORLD
        elif self.cp == 1:
            self.dp_group = dist.group.WORLD
        else:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh("cpu", (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
            self.group, self.dp_group = self.mesh.get_group("cp"), self.mesh.get_group("dp")
        # An even contiguous split of a replica's stream (the first `tokens % C` ranks take one more row).
        base, extra = divmod(tokens, self.cp)
        self.offsets = [0]
        for q in range(self.cp):
            self.offsets.append(self.offsets[-1] + base + (q < extra))
        self.shard = None
        self.wrapped = None
        self.cp_group, self.is_main = self.group, self.rank == 0

    def prepare(self, model) -> None:
        """Wraps the (patched) model for data parallelism over the replicas."""
        if self.dp == 1:
            return
        if self.dp_wrap == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # Experts no token of a replica picked take no gradient there: DDP must look.
            self.wrapped = DistributedDataParallel(model, process_group=self.dp_group,
                                                   find_unused_parameters=True)
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = self.mesh["dp"] if self.cp > 1 else None
            if mesh is None:
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (self.dp,), mesh_dim_names=("dp",))
            fully_shard(model, mesh=mesh)
            self.wrapped = model
            self.replaces_parameters = True

    def forward_backward(self, model, ids: torch.Tensor, step: int) -> torch.Tensor:
        """One step's forward and backward on this rank's part of the batch; returns the
        global loss (the mean over every replica's tokens)."""
        run = self.wrapped if self.wrapped is not None else model
        rows = ids[self.dp_rank * self.batch:(self.dp_rank + 1) * self.batch] if self.dp > 1 else ids
        if self.cp == 1:
            loss = run(input_ids=rows, labels=rows, use_cache=False).loss
            loss.backward()
            loss = loss.detach().clone()
        else:
            from ..cp import loss_for_logging
            from ..integrations.transformers import cp_batch

            batch, seq = rows.shape
            flat = rows.reshape(-1)
            ends = [seq * (b + 1) for b in range(batch)]
            # The unpacked rows' targets: no row's last token predicts the next row's first.
            labels = flat.clone()
            labels[ends[:-1]] = -100
            mine = self._rows(ends)
            kw = cp_batch(model, mine(flat), ends, labels=mine(labels), balance=self.balance)
            self.shard = kw["dsa_cp_shard"]
            share = run(**kw).loss
            share.backward()
            loss = loss_for_logging(share, self.shard)
            self._sum_grads(model)
        if self.dp > 1:
            self.dist.all_reduce(loss, group=self.dp_group)
            loss = loss / self.dp
        if not torch.isfinite(loss):
            raise RuntimeError(f"step {step}: the loss is {loss.item()} (diverged)")
        return loss

    def _rows(self, ends):
        """This rank's rows of a replica's stream: its contiguous run, or its two zigzag chunks."""
        if self.balance == "zigzag":
            from ..cp import ZigzagTNDShard
            return ZigzagTNDShard(self.cp_rank, self.cp, ends).rows_of
        o, e = self.offsets[self.cp_rank], self.offsets[self.cp_rank + 1]
        return lambda t: t[o:e]

    def _sum_grads(self, model) -> None:
        """Sums every parameter's gradient over the CP ranks of the replica (one fp32
        all-reduce; FSDP2's shards as they lie). A parameter no rank's rows reached (an
        expert no token picked) keeps grad None, as in a single process: AdamW skips it
        instead of decaying it."""
        params = list(model.parameters())
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int64)
        self.dist.all_reduce(present, group=self.group)
        local = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in local])
        self.dist.all_reduce(flat, group=self.group)
        at = 0
        for p, g, seen in zip(params, local, present.tolist()):
            n = g.numel()
            summed = flat[at:at + n].view_as(g).to(g.dtype)
            at += n
            if not seen:
                continue  # None on every rank
            if p.grad is not None:
                g.copy_(summed)  # in place: DDP's and FSDP2's gradients stay theirs
            elif hasattr(p, "to_local"):
                from torch.distributed.tensor import DTensor

                p.grad = DTensor.from_local(summed, p.device_mesh, p.placements)
            else:
                p.grad = summed

    def indexer_figures(self, model, types):
        """Per layer type: the indexer KL (the sum of a replica's CP shares, averaged over
        the replicas) and recall@k (the mean of the ranks' values, each over its own rows)."""
        from ..integrations.transformers import indexer_losses, indexer_recall

        losses = dict(sorted(indexer_losses(model).items()))
        recall = dict(sorted(indexer_recall(model).items()))
        # Same layers on every rank (the decisions behind them are global); a rank whose rows
        # see no more than k entries has recall None and is left out of that layer's mean.
        t = torch.tensor([float(v) for v in losses.values()] + [float(v or 0.0) for v in recall.values()]
                         + [float(v is not None) for v in recall.values()], dtype=torch.float64)
        # Over every rank: the KL shares of a replica sum to its KL, and the replicas'
        # KLs are averaged (as their losses are).
        self.dist.all_reduce(t)
        n_kl, n_rec = len(losses), len(recall)
        kl = dict(zip(losses, (t[:n_kl] / self.dp).tolist()))
        sums, counts = t[n_kl:n_kl + n_rec].tolist(), t[n_kl + n_rec:].tolist()
        rec = {k: v / c for k, v, c in zip(recall, sums, counts) if c > 0}
        return by_layer_type(kl, types), by_layer_type(rec, types)

    def annotate(self, result: dict) -> None:
        """result["cp"]: the mesh, and every rank's rows, steady-state step time and peak
        RSS (VmHWM), gathered on every rank."""
        rows = (self.shard.local_rows if self.shard is not None
                else self.offsets[self.cp_rank + 1] - self.offsets[self.cp_rank])
        mine = {"rank": self.rank, "dp_rank": self.dp_rank, "cp_rank": self.cp_rank, "rows": rows,
                "step_seconds_median": result["step_seconds"]["median"],
                "peak_rss_gib": result["memory_gib"]["peak_rss"]}
        ranks = [None] * self.world
        self.dist.all_gather_object(ranks, mine)
        result["cp"] = {"world_size": self.world, "dp": self.dp, "cp": self.cp,
                        "dp_wrap": self.dp_wrap if self.dp > 1 else None, "backend": "gloo",
                        "balance": self.balance, "offsets": self.offsets if self.balance == "contiguous" else None,
                        "ranks": ranks}

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
