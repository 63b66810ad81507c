"""Context parallelism for the patched models (``patch(model, cp_group=group)``).

Each rank runs the model on its contiguous run of the packed token stream (TND, one
row). Everything but attention is token-local (embeddings, norms, MLP/MoE with its
per-token routing, V4's hyper-connections, the LM head), so it runs unchanged on the
local rows. The patched attention layers call the ``dsa.cp`` wrappers through
:class:`CPOps`: key-side tensors are all-gathered once per layer, V4's compressors run
once per entry with the halo, the KL losses return each rank's share. The parts of a
call that mix tokens across the sequence are handled here:

- RoPE: the model computes it from ``position_ids``; ``cp_batch`` passes each local
  row's position in its document (``shard.positions()``), and the compressed entries
  get their global positions from the shard.
- The mask: transformers describes it from the local rows (a ``DsaMask``, never
  built); the shard, not the mask, defines what each query sees, so the mask is only
  checked to be the causal (windowed) one of the local position ids, with no padding
  mask (a caller's own mask is refused; a caller's dense 4-D mask is compared as before).
- The LM loss: ``cp_batch`` shifts the labels over the rank boundary and passes the
  global target count, so ``out.loss`` is this rank's share of the global mean.
- The MoE load-balancing loss (``output_router_logits=True``, DeepSeek-V4): while the
  CP-patched model runs, its modeling module's ``load_balancing_loss_func`` is the
  CP form below: the expert pick counts and the row count are summed over the ranks,
  so ``out.aux_loss`` (and its part of ``out.loss``) is this rank's share.
- Everything else that would need the whole sequence (a cache, output_attentions,
  attention dropout) raises :class:`PatchFallbackError`:
  under CP the model's own forward would attend to local keys only, and a rank that
  left the collectives would stall the others, so there is no fallback to run.
"""
from __future__ import annotations

import itertools

import torch

from . import _metrics
from ._checks import call_reason
from ._geometry import Geometry, _visibility
from ._mask import DsaMask, function_reason
from ._state import PatchFallbackError

SHARD_KWARG = "dsa_cp_shard"


def _cp():
    import dsa.cp as cp  # imports torch.distributed: only where CP is used
    return cp


class CPOps:
    """:class:`._ops.Local`'s interface over the CP group: query-side tensors local,
    key-side tensors gathered by ``keys`` (once; the indexer, the attention and the KL
    reuse the gathered tensor)."""

    def __init__(self, shard, backend: str, grads_averaged: bool):
        self.shard, self.backend, self.grads_averaged = shard, backend, grads_averaged
        self.geom = shard_geometry(shard)

    def keys(self, t):
        return None if t is None else _cp().gather(t, self.shard)

    def indexer(self, q, k, w, **kw):
        return _cp().indexer(q, k, w, shard=self.shard, backend=self.backend, **kw)

    def attention(self, q, kv, indices, **kw):
        return _cp().sparse_attention(q, kv, indices, shard=self.shard, backend=self.backend, **kw)

    def kl(self, *args, **kw):
        return _cp().kl_loss(*args, shard=self.shard, grads_averaged_over_cp=self.grads_averaged,
                             backend=self.backend, **kw)

    def dense_lse(self, *args, **kw):
        return _cp().dense_indexer_lse(*args, shard=self.shard, backend=self.backend, **kw)

    def dense_kl(self, *args, **kw):
        return _cp().dense_indexer_kl_loss(*args, shard=self.shard, grads_averaged_over_cp=self.grads_averaged,
                                           backend=self.backend, **kw)

    def compressor(self, kv, gate, position_bias, ratio: int, overlap: bool):
        """The GLOBAL pooled stream [S_cmp, c] before kv_norm (owner computes, halo from the
        ranks before; gathered, differentiable); [0, c] when the global count is 0."""
        comp = _cp().compressor(kv, gate, position_bias, ratio=ratio, overlap=overlap, shard=self.shard,
                                backend=self.backend)
        if comp.compressed is None:
            width = kv.shape[-1] // 2 if overlap else kv.shape[-1]
            return kv.new_zeros((0, width))
        return comp.compressed

    def compressed_positions(self, ratio: int, rows: int, device) -> torch.Tensor:
        return self.shard.cmp_positions(ratio, device).unsqueeze(0)

    def recall(self, q, cmp_kv, cmp_idx, scale: float, ratio: int):
        """recall@k over this rank's rows, call by call (a zigzag shard's two runs read
        different key prefixes), each call reading the prefix its queries see, as the
        attention does; the sampled rows of the calls pooled into one mean."""
        values = []
        for call in self.shard.op_calls():
            rows = call.query_slice or slice(0, q.shape[0])
            geom = Geometry("TND", 1, rows.stop - rows.start, 0, call.query_lengths, call.key_lengths, [])
            keys = self.shard.call_keys(self.shard.key_prefix(cmp_kv, "cmp_kv", ratio), call, ratio)
            part = _metrics.recall_values(q[rows], keys, cmp_idx[rows], scale, ratio, geom)
            if part is not None:
                values.append(part)
        return float(torch.cat(values).mean()) if values else None


def shard_geometry(shard) -> Geometry:
    """The local call in Geometry terms (keep-all-documents form: every document, local
    query segments, prefix key segments); flat/unflat map [1, T_r, ...] <-> [T_r, ...].
    A zigzag shard's two runs are two calls with lengths of their own, which one Geometry
    cannot hold: its lengths are None (CPOps.recall, the one reader, goes call by call)."""
    calls = shard.op_calls()
    one = len(calls) == 1
    return Geometry("TND", 1, shard.local_rows, 0, calls[0].query_lengths if one else None,
                    calls[0].key_lengths if one else None,
                    [e - s for s, e in zip(shard.doc_starts, shard.doc_ends)])


def _local_pieces(shard) -> list:
    """Lengths of the local runs of each document, call by call (the block-diagonal parts
    of the local mask: transformers starts a new part where the position ids do not go up
    by one, which they do not across a zigzag shard's two runs)."""
    pieces = []
    for call in shard.op_calls():
        ends = call.query_lengths
        pieces += [b - a for a, b in zip([0] + ends[:-1], ends) if b > a]
    return pieces


def call_shard(module, state, kwargs, past_key_values, attention_mask, position_ids, batch, seq, window):
    """The call's shard under CP (None without CP). Raises where the call cannot run exactly
    under CP, on the first layer that sees it."""
    shard = kwargs.get(SHARD_KWARG)
    group = state.cp_group
    if group is None:
        if shard is not None:
            raise ValueError(f"{SHARD_KWARG}: this model was patched without cp_group; "
                             "patch(model, cp_group=group) to run it context parallel")
        return None
    if shard is None:
        raise ValueError(f"{SHARD_KWARG}: the model is patched with a CP group, so every call needs its shard: "
                         "model(**cp_batch(model, local_input_ids, doc_ends))")
    from dsa.cp import TNDShard, ZigzagTNDShard
    if not isinstance(shard, (TNDShard, ZigzagTNDShard)) or shard.group is not group:
        raise ValueError(f"{SHARD_KWARG}: expected the shard of cp_batch(model, ...) on the patch's cp_group")
    reason = call_reason(module, kwargs)
    if reason is None and past_key_values is not None:
        reason = "a cache (pass use_cache=False: cp_batch does)"
    if reason is None and (batch != 1 or seq != shard.local_rows):
        reason = f"input of shape [{batch}, {seq}]; the shard holds one row of {shard.local_rows} tokens"
    if reason is None and position_ids is not None:
        expect = shard.positions(position_ids.device).unsqueeze(0)
        if position_ids.shape != expect.shape or not torch.equal(position_ids, expect.to(position_ids.dtype)):
            reason = "position_ids other than the shard's document positions (pass cp_batch's)"
    if reason is None:
        reason = _mask_reason(state, attention_mask, shard, window)
    if reason is not None:
        raise PatchFallbackError(f"dsa patch under context parallelism cannot run a call with {reason}; "
                                 "the model's own forward would attend to this rank's keys only, so there is "
                                 "no fallback under CP")
    return shard


def _mask_reason(state, mask, shard, window):
    """The mask transformers builds from cp_batch's inputs is causal (and windowed) within
    each local piece of a document; anything else came from the caller and would be
    ignored, so it is refused. Checked once per mask object (every layer shares it)."""
    if mask is None:
        return None  # implementations that build no mask: the shard alone defines visibility
    if isinstance(mask, DsaMask):
        # The patched model's mask, never built: cp_batch passes no padding mask, and the mask
        # function must be transformers' causal (or the layer's window) one, packed or not.
        kw = mask.kwargs
        if mask.attention_mask is not None or function_reason(mask, window) is not None:
            return "a caller's attention mask (under CP the shard defines visibility; pass no attention_mask)"
        if kw.get("q_length") != shard.local_rows or kw.get("kv_length") != shard.local_rows:
            return "an attention mask of unexpected shape or type"
        return None
    cached = state.cp_mask_checked
    if cached is not None and cached[0]() is mask and cached[1] == window:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (shard.local_rows,) * 2:
        return "an attention mask of unexpected shape or type"
    m = mask[:, 0]
    allowed = m if m.dtype == torch.bool else m == 0
    expected = _visibility(1, shard.local_rows, shard.local_rows, 0, window, [_local_pieces(shard)], m.device)
    if not torch.equal(allowed.expand_as(expected), expected):
        return "a caller's attention mask (under CP the shard defines visibility; pass no attention_mask)"
    import weakref
    state.cp_mask_checked = (weakref.ref(mask), window)
    return None


BALANCES = ("contiguous", "zigzag")


def cp_batch(state, input_ids, doc_ends, labels=None, ignore_index: int = -100, balance: str = "contiguous") -> dict:
    """See ``dsa.integrations.transformers.cp_batch``."""
    cp = _cp()
    group = state.cp_group
    if balance not in BALANCES:
        raise ValueError(f"balance: expected 'contiguous' or 'zigzag', got {balance!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2) or (
            input_ids.dim() == 2 and input_ids.shape[0] != 1):
        raise ValueError(f"input_ids: expected this rank's run as [T_r] or [1, T_r], got "
                         f"{list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
    ids = input_ids.reshape(-1)
    if labels is None:
        labels = ids
    elif not isinstance(labels, torch.Tensor) or labels.numel() != ids.numel():
        raise ValueError(f"labels: expected this rank's run of labels, {ids.numel()} of them")
    labels = labels.reshape(-1)
    if balance == "zigzag":
        shard = cp.zigzag_tnd_shard(doc_ends, group=group)
        if ids.numel() != shard.local_rows:
            raise ValueError(f"input_ids: under balance='zigzag' rank {shard.rank} holds rows {shard.runs} of the "
                             f"packed stream ({shard.local_rows} tokens: dsa.cp.shard_rows(global_ids, shard)), "
                             f"got {ids.numel()}")
    else:
        shard = cp.tnd_shard(doc_ends, ids.numel(), group=group)
    if 0 in shard.local_counts:
        raise ValueError(f"input_ids: rank(s) {[q for q, n in enumerate(shard.local_counts) if n == 0]} hold no "
                         "token; under CP every rank needs at least one row of the packed stream")
    # The model shifts labels inside its call; the target of a run's last row is the
    # label of the next global row, on another rank, so shift over the whole stream here
    # (as transformers shifts a single-process packed row) and pass it as shift_labels.
    shift = _shift_over_stream(shard, labels.detach(), ignore_index)
    from dsa.cp.comm import all_reduce_count
    n = all_reduce_count(int((shift != ignore_index).sum()), group)
    # transformers divides the summed loss by num_items_in_batch: the global target count
    # makes out.loss this rank's share of the single-process mean. A framework that
    # averages gradients over the CP ranks wants W times that.
    items = (n / shard.world_size if state.cp_grads_averaged else n) if n else 1
    return {"input_ids": ids.unsqueeze(0), "position_ids": shard.positions(ids.device).unsqueeze(0),
            "labels": labels.unsqueeze(0), "shift_labels": shift.unsqueeze(0),
            "num_items_in_batch": torch.tensor(float(items)), "use_cache": False,
            SHARD_KWARG: shard}


def _shift_over_stream(shard, labels, ignore_index):
    """``labels`` (this rank's runs, in local order) shifted by one row of the global
    stream. Row ``e`` after a run ``[a, e)`` starts some rank's run, so each rank sends
    the first label of its runs (one or two values), not its whole run."""
    from dsa.cp.comm import all_gather_rows
    runs = [shard.runs_of(q) for q in range(shard.world_size)]
    ends = list(itertools.accumulate(e - a for a, e in shard.runs))  # local end of each run
    firsts = all_gather_rows(labels[[0] + ends[:-1]], [len(r) for r in runs], shard.rank, shard.group, 0)
    first_at = dict(zip((a for r in runs for a, _ in r), firsts.tolist()))
    # Inside a run the next row is local; a run's last row takes the first label of
    # the run that starts where it ends (none after the stream's last row).
    shift = labels.roll(-1)
    for (_, e), end in zip(shard.runs, ends):
        shift[end - 1] = first_at.get(e, ignore_index)
    return shift


# ---------------------------------------------------------------- MoE balance loss

def balance_loss_share(group, scale: float):
    """transformers' ``load_balancing_loss_func`` (Switch Transformer's loss,
    ``E * sum_e f_e * P_e``: f_e the share of top-k picks that went to expert e, P_e its
    mean router probability, both over every row of every layer) as this rank's share.
    f is a count (no gradient): its sums, and the row count, are all-reduced over
    ``group``. P is linear in the rows, so ``E * sum_e f_e * P_e(local rows) / N`` summed
    over the ranks is the single-process loss, and each rank's gradient is its rows'
    part of it. ``scale`` is W where the gradients will be averaged over the ranks."""
    import torch.distributed as dist

    def share(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        device = gate_logits[0].device
        picks = torch.zeros(num_experts, dtype=torch.float32, device=device)
        probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        flat_mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
        for layer_gate in gate_logits:
            weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
            _, chosen = torch.topk(weights, top_k, dim=-1)
            if flat_mask is None:
                picks = picks + torch.histc(chosen.reshape(-1).float(), bins=num_experts, min=0, max=num_experts)
                probs = probs + weights.float().sum(dim=0)
                rows = rows + weights.shape[0]
            else:
                picks = picks + torch.zeros_like(picks).scatter_add_(0, chosen.reshape(-1),
                                                                     flat_mask.repeat_interleave(top_k))
                probs = probs + (weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
                rows = rows + flat_mask.sum()
        totals = torch.cat([picks, rows.reshape(1)]).detach()
        dist.all_reduce(totals, group=group)
        picks, rows = totals[:-1], totals[-1]
        return torch.sum((picks / rows) * (probs / rows)) * num_experts * scale

    return share


def install_balance_loss(model, state) -> list:
    """Hooks that make the model's modeling module compute the balance loss as a CP share
    while the model runs (restored after, an exception included). [] where the module
    has no ``load_balancing_loss_func`` (DeepSeek-V3.2 has no auxiliary loss)."""
    import sys

    module = sys.modules.get(type(model).__module__)
    if state.cp_group is None or module is None or not hasattr(module, "load_balancing_loss_func"):
        return []
    import torch.distributed as dist

    world = dist.get_world_size(state.cp_group)
    cp_form = balance_loss_share(state.cp_group, float(world) if state.cp_grads_averaged else 1.0)
    saved = []

    def before(mod, args, kwargs):
        saved.append(module.load_balancing_loss_func)
        module.load_balancing_loss_func = cp_form

    def after(mod, args, kwargs, output):
        if saved:
            module.load_balancing_loss_func = saved.pop()

    return [model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True, always_call=True)]
