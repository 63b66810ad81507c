"""Cases for the model-level CP tests (run in spawned gloo processes by test_cp_model.py).

Every rank builds the same tiny transformers model (seeded), runs the single-process
patched model on the whole packed stream (the reference) and the CP-patched model on
its contiguous run, and compares: the logits of its rows; the LM loss and each layer's
indexer KL as the sum of the ranks' shares; every parameter's gradient all-reduced
(SUM) over the ranks. fp32, relative error <= 1e-4 (Checker.close). Where the
unpatched transformers model computes the same thing (V3.2 packed with use_cache=False,
V4 on one document; transformers' packed V4 pools across documents), the CP run is
also held to docs/testing.md's rule against it and its float64 twin (_hf_models.check_rule).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from _hf_models import build, check_rule
from cp_gloo_cases import Checker  # noqa: F401 - the harness takes it from this module

from dsa.cp import ZigzagTNDShard, loss_for_logging
from dsa.integrations.transformers import (PatchFallbackError, cp_batch, indexer_losses, indexer_recall, patch,
                                          track_indexer_recall)

# (global document ends, rank row offsets) per world size.
# Packed: a 1-token-short-of-a-block document, a 7-token one (< HCA's 8) and a
# long one over the rank boundary, which falls inside a CSA block and an HCA block
# (doc-relative row 9 at W = 2; 4 and 15 at W = 3) and inside the sliding window.
PACKED = {2: ([13, 20, 48], [0, 29, 48]), 3: ([13, 20, 48], [0, 24, 35, 48])}
# One document over every rank, boundaries off the block edges (for the unpatched model).
SINGLE = {2: ([40], [0, 22, 40]), 3: ([40], [0, 13, 26, 40])}
VOCAB = 128


def _inputs(ends, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ends[-1],), generator=g)
    pos = torch.cat([torch.arange(e - s) for s, e in zip([0] + ends[:-1], ends)])
    return ids, pos


def _grads(model):
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def _single(model, ids, pos, labels=None, **extra):
    """The single-process packed call (one row, position ids restarting per document)."""
    model.zero_grad(set_to_none=True)
    labels = ids if labels is None else labels
    out = model(input_ids=ids[None], position_ids=pos[None], labels=labels[None], use_cache=False, **extra)
    out.loss.backward()
    return out.logits.detach()[0], out.loss.detach(), _grads(model)


def _cp_run(model, ids, ends, offsets, rank, balance="contiguous", labels=None, **extra):
    model.zero_grad(set_to_none=True)
    if balance == "zigzag":  # chunks r and 2W-1-r of 2W
        rows = ZigzagTNDShard(rank, dist.get_world_size(), ends).rows_of
    else:
        rows = lambda x: x[offsets[rank]:offsets[rank + 1]]  # noqa: E731
    kw = cp_batch(model, rows(ids), ends, labels=None if labels is None else rows(labels), balance=balance)
    out = model(**kw, **extra)
    model._dsa_last_out = out
    out.loss.backward()
    grads = _grads(model)
    # Replicated parameters: each rank holds its part of the gradient; one flat all-reduce.
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    dist.all_reduce(flat)
    summed, at = {}, 0
    for n, g in grads.items():
        summed[n] = flat[at:at + g.numel()].view_as(g)
        at += g.numel()
    return out.logits.detach()[0], loss_for_logging(out.loss, kw["dsa_cp_shard"]), summed, kw["dsa_cp_shard"]


def _kl_sums(model, shard):
    return {n: loss_for_logging(v, shard) for n, v in sorted(indexer_losses(model).items())}


def case_vs_single(chk, world, rank, kind, layout, indexer_loss, seed=0, balance="contiguous"):
    """balance="zigzag": each rank holds chunks r and 2W-1-r of the stream; the packed
    layout's chunk edges then fall inside CSA / HCA blocks and across documents too."""
    ends, offsets = (PACKED if layout == "packed" else SINGLE)[world]
    base = build(kind, seed=seed)
    ids, pos = _inputs(ends)
    # No document predicts the next one's first token, and the row after the first rank
    # boundary (contiguous) or chunk edge (zigzag) has no target either: cp_batch's shift
    # must carry that ignore_index across the ranks.
    labels = ids.clone()
    labels[[0] + ends[:-1]] = -100
    labels[offsets[1] if balance == "contiguous" else ends[-1] // (2 * world)] = -100
    ref = patch(copy.deepcopy(base), indexer_loss=indexer_loss, strict=True)
    logits, loss, grads = _single(ref, ids, pos, labels)
    cpm = patch(copy.deepcopy(base), indexer_loss=indexer_loss, strict=True, cp_group=dist.group.WORLD)
    if balance == "zigzag":
        track_indexer_recall(cpm)  # read call by call: a zigzag rank's two runs see different key prefixes
    c_logits, c_loss, c_grads, shard = _cp_run(cpm, ids, ends, offsets, rank, balance, labels)
    for name, value in indexer_recall(cpm).items():
        chk.true(f"recall of {name} in [0, 1]: {value}", value is None or -1e-6 <= value <= 1 + 1e-6)
    chk.close("logits of the local rows", c_logits, shard.rows_of(logits))
    chk.close("LM loss (sum of shares)", c_loss, loss)
    want_kl = {n: v for n, v in sorted(indexer_losses(ref).items())}
    got_kl = _kl_sums(cpm, shard)
    chk.true(f"indexer losses of the same layers: {sorted(got_kl)} vs {sorted(want_kl)}",
             sorted(got_kl) == sorted(want_kl) and (indexer_loss is None) == (not want_kl))
    for n in want_kl:
        if n in got_kl:
            chk.close(f"indexer KL {n} (sum of shares)", got_kl[n], want_kl[n])
    for n, g in grads.items():
        chk.close(f"grad {n} (summed over ranks)", c_grads[n], g)
    if indexer_loss is not None:
        trained = [n for n, g in c_grads.items() if ".indexer." in n and bool(g.abs().sum() > 0)]
        chk.true("the indexer KL reaches the indexer's parameters", bool(trained))
    return c_logits, c_grads


def case_grads_averaged(chk, world, rank):
    """patch(grads_averaged_over_cp=True): every share (LM loss, indexer KL) is W times
    the summing form's, so gradients AVERAGED over the ranks equal the single-process ones."""
    ends, offsets = PACKED[world]
    base = build("v32")
    ids, pos = _inputs(ends)
    ref = patch(copy.deepcopy(base), indexer_loss="sparse", strict=True)
    _, loss, grads = _single(ref, ids, pos)
    cpm = patch(copy.deepcopy(base), indexer_loss="sparse", strict=True, cp_group=dist.group.WORLD,
                grads_averaged_over_cp=True)
    _, c_loss, c_grads, shard = _cp_run(cpm, ids, ends, offsets, rank)
    chk.close("LM shares sum to W * loss", c_loss, world * loss)
    want_kl = indexer_losses(ref)
    for n, v in _kl_sums(cpm, shard).items():
        chk.close(f"indexer KL {n}: shares sum to W * loss", v, world * want_kl[n])
    for n, g in grads.items():
        chk.close(f"grad {n} (averaged over ranks)", c_grads[n] / world, g)


def case_router_logits(chk, world, rank, averaged=False):
    """output_router_logits=True (V4's MoE balance loss) under CP: the aux-loss shares and
    the loss shares sum to the single-process values, and the gradients (the router's
    included) summed over the ranks equal its gradients; averaged: W times the shares."""
    ends, offsets = PACKED[world]
    base = build("v4")
    ids, pos = _inputs(ends)
    ref = patch(copy.deepcopy(base), strict=True)
    ref_out = ref(input_ids=ids[None], position_ids=pos[None], labels=ids[None], use_cache=False,
                  output_router_logits=True)
    _, loss, grads = _single(ref, ids, pos, output_router_logits=True)
    chk.true(f"the single-process run has a balance loss: {ref_out.aux_loss}",
             isinstance(ref_out.aux_loss, torch.Tensor) and bool(ref_out.aux_loss > 0))
    cpm = patch(copy.deepcopy(base), strict=True, cp_group=dist.group.WORLD, grads_averaged_over_cp=averaged)
    _, c_loss, c_grads, shard = _cp_run(cpm, ids, ends, offsets, rank, output_router_logits=True)
    scale = world if averaged else 1
    chk.close("aux loss (sum of shares)", loss_for_logging(cpm._dsa_last_out.aux_loss, shard),
              scale * ref_out.aux_loss.detach())
    chk.close("loss with the balance term (sum of shares)", c_loss, scale * loss)
    for n, g in grads.items():
        chk.close(f"grad {n} (summed over ranks)", c_grads[n] / scale, g)
    # The balance loss reaches the score-routed layers' routers (the first layers of
    # V4 route by token hash: no router gradient there, in either run).
    router = [n for n in grads if n.endswith("mlp.gate.weight") and bool(grads[n].abs().sum() > 0)]
    chk.true(f"router weights get a gradient: {router}", bool(router) and all(
        bool(c_grads[n].abs().sum() > 0) for n in router))
    import sys
    module = sys.modules[type(cpm).__module__]
    chk.true("the modeling module's balance loss is transformers' own again after the call",
             module.load_balancing_loss_func.__module__ == module.__name__)


def case_vs_unpatched(chk, world, rank, kind, layout):
    """CP against transformers' own model, fp32 as the naive peer and float64 as the oracle."""
    ends, offsets = (PACKED if layout == "packed" else SINGLE)[world]
    base = build(kind)
    ids, pos = _inputs(ends)
    naive = _single(copy.deepcopy(base), ids, pos)
    oracle = _single(copy.deepcopy(base).double(), ids, pos)
    cpm = patch(copy.deepcopy(base), strict=True, cp_group=dist.group.WORLD)
    c_logits, _, c_grads, _ = _cp_run(cpm, ids, ends, offsets, rank)
    o, e = offsets[rank], offsets[rank + 1]
    checks = [("logits", c_logits, naive[0][o:e], oracle[0][o:e])]
    checks += [(f"grad {n}", c_grads[n], naive[2][n], oracle[2][n]) for n in oracle[2]]
    for what, got, nv, orc in checks:
        try:
            check_rule(what, got, nv, orc, torch.float32)
        except AssertionError as err:
            chk.errors.append(str(err))


def _expect_raise(chk, what, exc, words, fn):
    try:
        fn()
    except exc as e:  # noqa: PERF203
        chk.true(f"{what}: the error names {words}: {e}", all(w in str(e) for w in words))
    else:
        chk.errors.append(f"{what}: no {exc.__name__} raised")


def case_errors(chk, world, rank):
    """Bad calls raise on every rank before any collective (so nothing hangs)."""
    ends, offsets = PACKED[world]
    ids, pos = _inputs(ends)
    local = ids[offsets[rank]:offsets[rank + 1]]
    base = build("v4")
    _expect_raise(chk, "li=False under CP", ValueError, ["cp_group", "li=True"],
                  lambda: patch(copy.deepcopy(base), li=False, cp_group=dist.group.WORLD))
    cpm = patch(copy.deepcopy(base), cp_group=dist.group.WORLD)
    _expect_raise(chk, "a call without the shard", ValueError, ["dsa_cp_shard", "cp_batch"],
                  lambda: cpm(input_ids=local[None], use_cache=False))
    kw = cp_batch(cpm, local, ends)
    _expect_raise(chk, "use_cache=True", PatchFallbackError, ["cache"], lambda: cpm(**{**kw, "use_cache": True}))
    _expect_raise(chk, "a caller's attention mask", PatchFallbackError, ["mask"],
                  lambda: cpm(**kw, attention_mask=torch.ones(1, local.numel(), dtype=torch.long).index_fill_(
                      1, torch.tensor([0]), 0)))
    _expect_raise(chk, "position ids not from the shard", PatchFallbackError, ["position_ids"],
                  lambda: cpm(**{**kw, "position_ids": torch.arange(local.numel())[None] + 1}))
    wrong = list(ends)
    if rank == 1:
        wrong[0] += 1
    _expect_raise(chk, "ranks with different doc_ends", ValueError, ["doc_ends"],
                  lambda: cp_batch(cpm, local, wrong))
    _expect_raise(chk, "an unknown balance", ValueError, ["balance", "zigzag"],
                  lambda: cp_batch(cpm, local, ends, balance="ring"))
    _expect_raise(chk, "a contiguous run under balance='zigzag'", ValueError, ["input_ids", "zigzag", "shard_rows"],
                  lambda: cp_batch(cpm, local, ends, balance="zigzag"))
    _expect_raise(chk, "a stream shorter than 2W chunks", ValueError, ["doc_ends", f"{2 * world} tokens"],
                  lambda: cp_batch(cpm, ids[:1], [2 * world - 1], balance="zigzag"))
    plain = patch(copy.deepcopy(base))
    _expect_raise(chk, "cp_batch on a model patched without CP", ValueError, ["cp_group"],
                  lambda: cp_batch(plain, local, ends))
    _expect_raise(chk, "a shard passed to a model patched without CP", ValueError, ["dsa_cp_shard", "cp_group"],
                  lambda: plain(**kw))


def cases(world):
    out = [
        ("v4_packed_sparse_kl", lambda c, w, r: case_vs_single(c, w, r, "v4", "packed", "sparse")),
        ("v4_router_logits", case_router_logits),
        ("v32_packed_sparse_kl", lambda c, w, r: case_vs_single(c, w, r, "v32", "packed", "sparse")),
        ("v4_packed_sparse_kl_zigzag",
         lambda c, w, r: case_vs_single(c, w, r, "v4", "packed", "sparse", balance="zigzag")),
        ("v32_packed_sparse_kl_zigzag",
         lambda c, w, r: case_vs_single(c, w, r, "v32", "packed", "sparse", balance="zigzag")),
    ]
    if world == 2:  # the rest once: W = 3 adds a rank whose run is inside one document, not new code paths
        out += [
            ("v4_single_vs_unpatched", lambda c, w, r: case_vs_unpatched(c, w, r, "v4", "single")),
            ("v32_packed_dense_kl", lambda c, w, r: case_vs_single(c, w, r, "v32", "packed", "dense")),
            ("v32_packed_dense_kl_zigzag",
             lambda c, w, r: case_vs_single(c, w, r, "v32", "packed", "dense", balance="zigzag")),
            ("v32_packed_vs_unpatched", lambda c, w, r: case_vs_unpatched(c, w, r, "v32", "packed")),
            ("grads_averaged_over_cp", case_grads_averaged),
            ("v4_router_logits_averaged", lambda c, w, r: case_router_logits(c, w, r, averaged=True)),
            ("errors", case_errors),
        ]
    return out
