"""Cases for dsa-train's data x context parallel trainer on a (dp, cp) = (2, 2) mesh (run
in 4 spawned gloo processes by test_train_mesh.py).

Every rank builds the same tiny DeepSeek-V4 model (dsa.train.model, seeded) and draws the
same batch of D x B rows. The reference, on every rank: one process running all D x B
rows in one step through the patched model (Trainer, the single-process runner). The
mesh: each replica takes its B rows, its CP ranks split the replica's packed stream,
gradients summed over cp and averaged over dp by DDP or FSDP2. The loss and every
parameter's gradient must equal the reference (fp32, relative error <= 1e-4, the CP
tests' rule; Checker.close). A bad mesh raises the same clear error on
every rank before any collective."""
from __future__ import annotations

import copy

import torch

from cp_gloo_cases import Checker  # noqa: F401 - the harness takes it from this module

from dsa.train.loop import CONFIGS, RunSpec
from dsa.train.model import build_model, v4_config
from dsa.train.trainers import Distributed, Trainer

D, C, B, S = 2, 2, 3, 66  # replica d's 3 rows of 66 tokens pack into 198: CP cut at row 99, inside row 2


def _spec(**kw):
    return RunSpec(seq_len=S, batch=B, layers=3, hidden=64, heads=2, head_dim=64, index_topk=16, threads=1,
                   progress=False, dp=D, cp=C, **kw)


def _model(spec, cp_group):
    from dsa.integrations.transformers import patch

    config = v4_config(spec.layers, spec.hidden, spec.heads, spec.head_dim, spec.seq_len, spec.index_topk,
                       torch.float32)
    model = build_model(config, spec.seed, torch.float32)
    patch(model, **CONFIGS["sas+li"], indexer_loss="sparse", strict=True, cp_group=cp_group)
    return model


def _grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()  # FSDP2: the whole gradient from the dp shards
        out[name] = None if g is None else g.detach().clone()
    return out


def _ids():
    g = torch.Generator().manual_seed(11)
    return torch.randint(1, 128, (D * B, S), generator=g)


def case_mesh_equals_single(chk, world, rank, wrap):
    spec = _spec(dp_wrap=wrap)
    ids = _ids()
    ref_model = _model(spec, None)
    want_loss = Trainer().forward_backward(ref_model, ids, 0).detach()
    want = _grads(ref_model)

    trainer = Distributed(spec)
    model = _model(spec, trainer.cp_group)
    trainer.prepare(model)
    got_loss = trainer.forward_backward(model, ids, 0).detach()
    got = _grads(model)
    chk.close(f"{wrap} loss", got_loss.reshape(1), want_loss.reshape(1))
    assert set(got) == set(want), "parameter names differ"
    for name in want:
        # An expert no row picked has no gradient in either run (None); one that only the
        # reference saw would be None here and fail.
        chk.close(f"{wrap} grad {name}", got[name], want[name])
    # The test is not vacuous: the mesh run produced gradients for most parameters.
    if sum(g is not None for g in got.values()) < len(got) // 2:
        chk.errors.append(f"{wrap}: only {sum(g is not None for g in got.values())} of {len(got)} gradients")


def case_bad_mesh(chk, world, rank):
    for dp, cp in ((3, 2), (1, 3)):
        try:
            Distributed(RunSpec(seq_len=S, batch=B, dp=dp, cp=cp, progress=False))
        except ValueError as e:
            words = [f"--dp {dp} --cp {cp}", f"dp x cp = {dp * cp}", f"has {world}"]
            if not all(w in str(e) for w in words):
                chk.errors.append(f"dp={dp} cp={cp}: message {e} lacks {words}")
        else:
            chk.errors.append(f"dp={dp} cp={cp} on {world} processes: no error")


def cases(world):
    assert world == D * C
    return [("ddp", lambda c, w, r: case_mesh_equals_single(c, w, r, "ddp")),
            ("fsdp", lambda c, w, r: case_mesh_equals_single(c, w, r, "fsdp")),
            ("bad_mesh", case_bad_mesh)]
