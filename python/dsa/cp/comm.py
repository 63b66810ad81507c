"""Collectives inside autograd, over torch.distributed (imported lazily: nothing that
`import dsa` loads needs it)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["all_gather_rows", "tie", "all_reduce_count", "comm_device"]


def _dist():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dsa.cp: torch.distributed is not initialised (call init_process_group first)")
    return dist


def comm_device(group=None) -> torch.device:
    """Where small metadata tensors (counts, fingerprints) must live for the group's backend:
    NCCL only moves CUDA tensors, gloo moves CPU ones."""
    dist = _dist()
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_rows(x: torch.Tensor, counts: Sequence[int], group, dim: int) -> torch.Tensor:
    dist = _dist()
    x = x.movedim(dim, 0).contiguous()
    width = max(max(counts), 1)
    # all_gather needs one size on every rank: pad to the largest run, then cut.
    padded = x.new_zeros((width,) + tuple(x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    out = torch.cat([p[:n] for p, n in zip(parts, counts)], 0)
    return out.movedim(0, dim)


class _AllGatherRows(torch.autograd.Function):
    """Forward: concatenate every rank's rows (rank order). Backward: a reduce-scatter, which
    sums the gathered gradient over ranks and returns each rank its own rows."""

    @staticmethod
    def forward(ctx, x, counts, rank, group, dim):
        ctx.counts, ctx.rank, ctx.group, ctx.dim = counts, rank, group, dim
        return _gather_rows(x, counts, group, dim)

    @staticmethod
    def backward(ctx, grad):
        dist = _dist()
        # contiguous(): a non-contiguous gradient must not be reduced in place of a view
        # (the PyTorch #120582 class of bug).
        g = grad.movedim(ctx.dim, 0).contiguous()
        # Sum half-precision partial gradients in fp32: a single process accumulates every
        # key's gradient in fp32 and rounds once; W roundings of the running sum would not.
        if g.dtype in (torch.bfloat16, torch.float16):
            g = g.to(torch.float32)
        mine = g.new_empty((ctx.counts[ctx.rank],) + tuple(g.shape[1:]))
        # Uneven list reduce-scatter (gloo and NCCL both take it on the pinned torch).
        dist.reduce_scatter(mine, list(g.split(list(ctx.counts), 0)), op=dist.ReduceOp.SUM, group=ctx.group)
        mine = mine.movedim(0, ctx.dim).to(grad.dtype).contiguous()
        return mine, None, None, None, None


def all_gather_rows(x: torch.Tensor, counts: Sequence[int], rank: int, group=None, dim: int = 0) -> torch.Tensor:
    """Differentiable all-gather of runs of uneven length along ``dim`` (``counts[q]`` rows from
    rank q). Every rank must call it, and its result must reach every rank's loss (use
    ``tie`` where a rank does not read it) so that every rank runs the backward collective."""
    counts = tuple(int(c) for c in counts)
    if x.shape[dim] != counts[rank]:
        raise ValueError(f"x: expected {counts[rank]} rows on rank {rank} along dim {dim}, got {x.shape[dim]}")
    return _AllGatherRows.apply(x, counts, rank, group, dim)


class _Tie(torch.autograd.Function):
    """Returns ``out`` unchanged and makes ``deps`` part of its graph with a zero gradient, so
    a collective behind ``deps`` runs its backward on this rank even when this rank's result
    does not depend on it (otherwise the other ranks would wait for it forever)."""

    @staticmethod
    def forward(ctx, out, *deps):
        ctx.shapes = [(d.shape, d.dtype, d.device) if isinstance(d, torch.Tensor) else None for d in deps]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad, *unused):
        return (grad,) + tuple(None if s is None else torch.zeros(s[0], dtype=s[1], device=s[2])
                               for s in ctx.shapes)


def tie(out: torch.Tensor, *deps: Optional[torch.Tensor]) -> torch.Tensor:
    live = [d for d in deps if isinstance(d, torch.Tensor) and d.requires_grad]
    if not live or not torch.is_grad_enabled():
        return out
    return _Tie.apply(out, *live)


def all_reduce_count(n: int, group=None, device=None) -> int:
    """Sum of an integer over the group (no gradient)."""
    dist = _dist()
    t = torch.tensor([int(n)], dtype=torch.int64, device=device if device is not None else comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())
