"""Attaching the indexer's KL loss to the model's graph without touching its loss."""
from __future__ import annotations

import torch


class _InjectLoss(torch.autograd.Function):
    """Identity on ``out``; its backward also sends gradient 1 into ``loss``.

    transformers computes only the LM loss, so the indexer's loss rides on the
    attention output: ``loss.backward()`` reaches the attention output of every
    layer, and from there this function starts the KL's own backward (the KL
    already carries ``loss_coefficient``). The forward value is unchanged, so
    logits are the same with and without the indexer loss."""

    @staticmethod
    def forward(ctx, out, loss):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, torch.ones((), dtype=torch.float32, device=grad_out.device)


def attach(out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return out
    return _InjectLoss.apply(out, loss)
