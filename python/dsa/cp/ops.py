"""Context-parallel wrappers of the dsa ops (docs/context_parallel.md).

Query-side tensors are passed local; key-side tensors (raw KV, key rope, indexer keys,
compressed KV) are passed *gathered* (``dsa.cp.gather``), so one gather feeds the indexer,
the attention and the KL loss. Each wrapper calls the normal op on the prefix view the
shard names, with the shard's lengths.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Optional

import torch

from ..compressor import dsa_compressor
from ..dense_indexer import dsa_dense_indexer_kl_loss, dsa_dense_indexer_lse
from ..indexer import dsa_indexer
from ..kl_loss import dsa_kl_loss
from ..layer import CompressedKV, LayerCompressMode, layer_compress_mode
from ..sparse_attention import dsa_sparse_attention
from .comm import _dist, all_gather_rows, all_reduce_count, comm_device, tie
from .shard import OpCall, Shard, TNDShard, ZigzagShard, ZigzagTNDShard, _check_ends, check_shard

__all__ = ["tnd_shard", "zigzag_tnd_shard", "zigzag_shard", "shard_rows", "gather", "compressor", "indexer",
           "sparse_attention", "dense_indexer_lse", "kl_loss", "dense_indexer_kl_loss", "loss_for_logging"]


def _check_ring(ring_degree) -> None:
    if ring_degree != 1:
        raise ValueError(f"ring_degree: dsa.cp implements KV all-gather context parallelism only; "
                         f"ring_degree must be 1, got {ring_degree!r} (see docs/context_parallel.md)")


def _fingerprint(values) -> int:
    digest = hashlib.sha256(",".join(str(int(v)) for v in values).encode()).digest()
    return int.from_bytes(digest[:7], "little")  # fits int64


def _rank_world(group):
    dist = _dist()
    return dist.get_rank(group), dist.get_world_size(group)


def _gather_and_agree(own: int, agreed: list[int], group, what: str) -> list[int]:
    """All-gathers every rank's ``own`` value beside a fingerprint of ``agreed`` (values
    every rank must pass alike). When they do not agree it raises on every rank, naming
    the ranks whose values differ (rank 0's are the yardstick). Returns every rank's
    ``own``, in rank order."""
    dist = _dist()
    _, world = _rank_world(group)
    mine = torch.tensor([own, len(agreed), _fingerprint(agreed)], dtype=torch.int64, device=comm_device(group))
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    table = torch.stack(parts).cpu().tolist()
    bad = [q for q, row in enumerate(table) if row[1:] != table[0][1:]]
    if bad:
        raise ValueError(f"{what}: ranks {bad} passed values that differ from rank 0's "
                         "(every rank must pass the same global lengths)")
    return [row[0] for row in table]


def tnd_shard(doc_ends, local_rows: int, *, group=None, ring_degree: int = 1) -> TNDShard:
    """The shard of this rank for a packed TND stream split contiguously (rank order).

    ``doc_ends``: the global cumulative document ends, the same on every rank;
    ``local_rows``: rows this rank holds (uneven and 0 allowed). Collective: all-gathers
    the row counts and a fingerprint of ``doc_ends``, and raises on every rank if the
    ranks disagree."""
    _check_ring(ring_degree)
    ends = _check_ends(doc_ends)
    if isinstance(local_rows, bool) or not isinstance(local_rows, int) or local_rows < 0:
        raise ValueError(f"local_rows: expected an integer >= 0, got {local_rows!r}")
    rank, world = _rank_world(group)
    counts = _gather_and_agree(local_rows, list(ends), group, "doc_ends (global document ends)")
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    return TNDShard(rank, world, ends, tuple(offsets), group)


def zigzag_tnd_shard(doc_ends, *, group=None) -> ZigzagTNDShard:
    """The zigzag shard of this rank for a packed TND stream: the stream cut into 2W
    chunks, rank r holding chunks r and 2W-1-r (causal load balance; see
    ``ZigzagTNDShard``). ``doc_ends``: the global cumulative document ends, the same on
    every rank. Collective: raises on every rank if the ranks disagree."""
    ends = _check_ends(doc_ends)
    rank, world = _rank_world(group)
    _gather_and_agree(0, list(ends), group, "doc_ends (global document ends)")
    return ZigzagTNDShard(rank, world, ends, group)


def zigzag_shard(seq_len: int, lengths=None, *, batch: Optional[int] = None, group=None,
                 ring_degree: int = 1) -> ZigzagShard:
    """The BSND zigzag shard of this rank (chunks r and 2W-1-r of 2W). ``lengths``: the
    global valid length of each batch row (None: ``[seq_len] * batch``). Collective: checks
    that every rank passed the same lengths."""
    _check_ring(ring_degree)
    if lengths is None:
        if batch is None:
            raise ValueError("lengths: pass the row lengths or batch=")
        lengths = [seq_len] * batch
    lens = [int(v) for v in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    rank, world = _rank_world(group)
    _gather_and_agree(0, [seq_len] + lens, group, "lengths (seq_len and the row lengths)")
    return ZigzagShard(rank, world, seq_len, tuple(lens), group)


def shard_rows(x_global: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This rank's rows of a global tensor (TND: dim 0; BSND: dim 1, zigzag order). For data
    loaders and tests."""
    return check_shard(shard).rows_of(x_global)


def gather(x_local: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Differentiable all-gather of a key-side tensor into natural global order; its backward
    sums the gradient over ranks and returns each rank the part of its own rows."""
    return check_shard(shard).gather(x_local)


# -- V4 compressor ---------------------------------------------------------------------------

def compressor(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, *, ratio: int,
               shard: Shard, overlap: Optional[bool] = None, backend: str = "auto") -> CompressedKV:
    """The layer compressor under CP. TND: returns ``CompressedKV`` whose ``compressed`` is
    the *global* compressed stream (gathered, differentiable) and ``compressed_lengths`` its
    global cumulative ends. Each entry is computed once, by the rank holding the last token
    of its block, from a halo of earlier ranks' rows; the gather's backward returns each
    owner the gradient of its entries, and the halo gather's backward returns the halo rows'
    gradient to their ranks. The ratio-1 fallback (spec 4.5) is decided from the global
    count, identically on every rank. BSND zigzag: local ``[B, 2c, C]`` inputs, the whole
    ``[B, S // m, c]`` compressed tensor in natural order (see ``_compressor_replicated``).
    Collective: every rank must call it."""
    mode = layer_compress_mode(ratio)
    if mode is LayerCompressMode.NO_COMPRESS:
        return CompressedKV(mode, 1, None, None)
    if overlap is None:
        overlap = mode is LayerCompressMode.INDEXER
    shard = check_shard(shard)
    form = _compressor_tnd if shard.compressor_form == "halo" else _compressor_replicated
    return form(kv, gate, position_bias, ratio, overlap, shard, mode, backend)


def _compressor_tnd(kv, gate, position_bias, ratio, overlap, shard, mode, backend) -> CompressedKV:
    """TND: each entry computed once, by its owner, from a halo of earlier ranks' rows."""
    if kv.shape[0] != shard.local_rows or gate.shape != kv.shape:
        raise ValueError(f"kv, gate: expected [{shard.local_rows}, C] local rows of the same shape, "
                         f"got {list(kv.shape)} and {list(gate.shape)}")
    if shard.cmp_total(ratio) == 0:
        return CompressedKV(LayerCompressMode.NO_COMPRESS, 1, None, None)
    plan = shard.compressor_plan(ratio, overlap)
    counts = shard.local_counts
    tails = [min(n, plan.max_halo) for n in counts]
    x = torch.cat([kv, gate], -1)
    tails_g = all_gather_rows(x[x.shape[0] - tails[shard.rank]:], tails, shard.rank, shard.group, 0)
    # Halo rows [halo_start, row_start) sit in the tails of the ranks before this one.
    idx, base = [], 0
    for q in range(shard.world_size):
        first = shard.offsets[q + 1] - tails[q]
        for g in range(max(first, plan.halo_start), min(shard.offsets[q + 1], shard.row_start)):
            idx.append(base + g - first)
        base += tails[q]
    if len(idx) != shard.row_start - plan.halo_start:
        raise AssertionError("compressor halo: rows missing from the gathered tails")
    halo = tails_g.index_select(0, torch.tensor(idx, dtype=torch.int64, device=x.device))
    width = kv.shape[-1]
    c = width // 2 if overlap else width
    if plan.owned > 0:
        inp = torch.cat([halo, x], 0)
        out, _ = dsa_compressor(inp[:, :width], inp[:, width:], position_bias, ratio=ratio, overlap=overlap,
                                query_lengths=list(plan.segment_ends), backend=backend)
        owned = out[plan.drop:]
    else:
        owned = kv.new_zeros((0, c))
    # Keep the tails gather in this rank's graph even when no halo row is read here, so its
    # backward collective runs on every rank; on a rank that owns no entry, kv / gate /
    # position_bias also get a (zero) gradient instead of None.
    owned = tie(owned, tails_g) if plan.owned > 0 else tie(owned, tails_g, kv, gate, position_bias)
    cmp_g = all_gather_rows(owned, plan.owned_counts, shard.rank, shard.group, 0)
    return CompressedKV(mode, ratio, cmp_g, shard.cmp_ends(ratio))


def _compressor_replicated(kv, gate, position_bias, ratio, overlap, shard, mode, backend) -> CompressedKV:
    """Zigzag splits, TND and BSND: every rank compresses the whole gathered stream (an
    entry's block can straddle the runs of several ranks; the compressor is cheap next to
    attention). Still exact for the gradients: rank r's copy only receives rank r's
    attention gradient, and the gathers' backward sums the copies' input gradients over
    ranks; ``position_bias`` gets rank r's part, to be summed over ranks like every
    replicated parameter."""
    if shard.layout == "BSND":
        fits, want = kv.dim() == 3 and kv.shape[1] == 2 * shard.chunk, f"local [B, {2 * shard.chunk}, C]"
        entries, lengths = sum(n // ratio for n in shard.lengths), list(shard.lengths)
    else:
        fits, want = kv.shape[0] == shard.local_rows, f"[{shard.local_rows}, C] local rows"
        entries, lengths = shard.cmp_total(ratio), list(shard.doc_ends)
    if not fits or gate.shape != kv.shape:
        raise ValueError(f"kv, gate: expected {want} of the same shape, got {list(kv.shape)} and {list(gate.shape)}")
    if entries == 0:
        return CompressedKV(LayerCompressMode.NO_COMPRESS, 1, None, None)
    out, cmp_lengths = dsa_compressor(gather(kv, shard), gather(gate, shard), position_bias, ratio=ratio,
                                      overlap=overlap, query_lengths=lengths, layout=shard.layout, backend=backend)
    # TND: the global cumulative ends (the kernel's are those of the gathered stream, the same values).
    return CompressedKV(mode, ratio, out, cmp_lengths if shard.layout == "BSND" else shard.cmp_ends(ratio))


# -- op wrappers -------------------------------------------------------------------------------

def _outputs(outs: list, shard: Shard):
    """One call's result as it is; several (zigzag) joined along the sequence axis, tuple
    results element by element."""
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts, shard.seq_dim) for parts in zip(*outs))
    return torch.cat(outs, shard.seq_dim)


def indexer(index_query, index_key, weights, *, shard: Shard, topk: int, scale: float = 1.0, cmp_ratio: int = 1,
            return_scores: bool = False, backend: str = "auto"):
    """``dsa_indexer`` under CP: local ``index_query``/``weights``, gathered ``index_key``
    (raw, or the gathered compressed indexer keys with ``cmp_ratio > 1``). Indices are local
    to each query's document, exactly as in a single-process run."""
    shard = check_shard(shard)
    ik = shard.key_prefix(index_key, "index_key", cmp_ratio)
    q = shard.query_part
    return _outputs([dsa_indexer(q(index_query, c), shard.call_keys(ik, c, cmp_ratio), q(weights, c), topk=topk,
                                 scale=scale, cmp_ratio=cmp_ratio, query_lengths=c.query_lengths,
                                 key_lengths=c.key_lengths, layout=shard.layout, return_scores=return_scores,
                                 backend=backend)
                     for c in shard.op_calls()], shard)


def sparse_attention(query, kv, indices=None, *, shard: Shard, scale: float, d_v: Optional[int] = None,
                     window: Optional[int] = None, cmp_kv=None, cmp_indices=None, cmp_ratio: int = 1,
                     sinks=None, query_rope=None, key_rope=None, backend: str = "auto"):
    """``dsa_sparse_attention`` under CP, every mode (V3.2 sparse, dense causal, V4 sliding,
    CSA, HCA, sinks). ``query``, ``indices``, ``cmp_indices``, ``query_rope``: local;
    ``kv``, ``key_rope``: gathered raw; ``cmp_kv``: the gathered compressed stream
    (``compressor(...).compressed``). Returns ``(out, softmax_max, softmax_sum)`` of the
    local rows."""
    shard = check_shard(shard)
    kv_p = shard.key_prefix(kv, "kv")
    kr_p = shard.key_prefix(key_rope, "key_rope")
    cmp_p = None
    if cmp_kv is not None:
        if cmp_ratio < 2:
            raise ValueError(f"cmp_ratio: expected >= 2 with cmp_kv, got {cmp_ratio}")
        cmp_p = shard.key_prefix(cmp_kv, "cmp_kv", cmp_ratio)
    if shard.has_no_queries(query):
        # A rank with no query row: nothing to compute, but its gathered inputs stay in its
        # graph so that the gathers' backward collectives still run here.
        d = d_v if d_v is not None else kv.shape[-1]
        out = tie(query.new_zeros(query.shape[:-1] + (d,)), query, kv_p, cmp_p, sinks, query_rope, kr_p)
        empty = query.new_zeros(query.shape[:-1], dtype=torch.float32)
        return out, empty.fill_(float("-inf")), empty.clone().zero_()
    q = shard.query_part
    k = shard.call_keys
    return _outputs([dsa_sparse_attention(
        q(query, c), k(kv_p, c), q(indices, c), scale=scale, d_v=d_v, window=window, cmp_kv=k(cmp_p, c, cmp_ratio),
        cmp_indices=q(cmp_indices, c), cmp_ratio=cmp_ratio, sinks=sinks, query_rope=q(query_rope, c),
        key_rope=k(kr_p, c),
        query_lengths=c.query_lengths, key_lengths=c.key_lengths, layout=shard.layout, backend=backend)
        for c in shard.op_calls()], shard)


def dense_indexer_lse(index_query, index_key, head_weights, *, shard: Shard, scale: float = 1.0,
                      cmp_ratio: int = 1, backend: str = "auto"):
    """``dsa_dense_indexer_lse`` under CP: local queries and weights, gathered ``index_key``."""
    shard = check_shard(shard)
    ik = shard.key_prefix(index_key, "index_key", cmp_ratio)
    q = shard.query_part
    return _outputs([dsa_dense_indexer_lse(q(index_query, c), shard.call_keys(ik, c, cmp_ratio), q(head_weights, c),
                                           scale=scale,
                                           cmp_ratio=cmp_ratio, query_lengths=c.query_lengths,
                                           key_lengths=c.key_lengths, layout=shard.layout, backend=backend)
                     for c in shard.op_calls()], shard)


def _share(loss_sum: torch.Tensor, n_local: int, shard: Shard, average_grads: bool) -> torch.Tensor:
    n = all_reduce_count(n_local, shard.group)
    factor = shard.world_size if average_grads else 1
    return loss_sum * (factor / max(n, 1))


def kl_loss(query, kv, indices, softmax_max, softmax_sum, index_query, index_key, weights, *, shard: Shard,
            scale: float, index_scale: float = 1.0, sinks=None, cmp_ratio: int = 1, query_rope=None, key_rope=None,
            loss_coefficient: float = 1.0, grads_averaged_over_cp: bool = False, backend: str = "auto"):
    """``dsa_kl_loss`` under CP; returns this rank's **share**
    ``coefficient * sum_local KL / N_global`` (N = rows with a valid entry, all-reduced), so
    the shares sum to the single-process loss and the gradients summed over ranks equal the
    single-process gradients. A framework that *averages* gradients over the CP ranks passes
    ``grads_averaged_over_cp=True`` (the share is multiplied by W). ``kv``/``key_rope`` are the
    gathered raw keys (the attention's teacher), ``index_key`` the gathered indexer keys (raw,
    or compressed with ``cmp_ratio > 1``; then ``kv`` is the gathered compressed KV). Collective."""
    shard = check_shard(shard)
    kv_p = shard.key_prefix(kv, "kv", cmp_ratio)
    kr_p = shard.key_prefix(key_rope, "key_rope", cmp_ratio)
    ik = shard.key_prefix(index_key, "index_key", cmp_ratio)
    q = shard.query_part
    loss = None
    for c in shard.op_calls():
        k = functools.partial(shard.call_keys, call=c, ratio=cmp_ratio)
        part = dsa_kl_loss(q(query, c), k(kv_p), q(indices, c), q(softmax_max, c), q(softmax_sum, c),
                           q(index_query, c), k(ik), q(weights, c), scale=scale, index_scale=index_scale, sinks=sinks,
                           cmp_ratio=cmp_ratio, query_rope=q(query_rope, c), key_rope=k(kr_p),
                           query_lengths=c.query_lengths, key_lengths=c.key_lengths, layout=shard.layout,
                           loss_coefficient=loss_coefficient, reduction="sum", backend=backend)
        loss = part if loss is None else loss + part
    # N_local: rows with at least one valid entry (spec 4.3): an index that is >= 0 and
    # visible (< pos+1 raw, < (pos+1)//m compressed; visible entries are always in range).
    # indices: [tokens..., 1, topk] or [tokens..., topk].
    ix = indices.squeeze(-2) if indices.dim() == shard.token_dims + 2 else indices
    pos = shard.query_positions(ix.device)
    vis = pos + 1 if cmp_ratio == 1 else torch.div(pos + 1, cmp_ratio, rounding_mode="floor")
    valid = ((ix >= 0) & (ix.long() < vis[..., None])).any(-1) & shard.query_valid(ix.device)
    return _share(loss, int(valid.sum()), shard, grads_averaged_over_cp)


def dense_indexer_kl_loss(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum, indexer_lse,
                          *, shard: Shard, scale: float, index_scale: float = 1.0, query_rope=None, key_rope=None,
                          loss_coefficient: float = 1.0, grads_averaged_over_cp: bool = False,
                          backend: str = "auto"):
    """``dsa_dense_indexer_kl_loss`` under CP, returning this rank's share (see ``kl_loss``);
    N = query rows with a finite ``indexer_lse``. ``index_key``, ``key``, ``key_rope``:
    gathered. Collective."""
    shard = check_shard(shard)
    ik = shard.key_prefix(index_key, "index_key")
    k = shard.key_prefix(key, "key")
    kr = shard.key_prefix(key_rope, "key_rope")
    q = shard.query_part
    loss = None
    for c in shard.op_calls():
        ck = functools.partial(shard.call_keys, call=c)
        part = dsa_dense_indexer_kl_loss(
            q(index_query, c), ck(ik), q(head_weights, c), q(query, c), ck(k), q(softmax_max, c), q(softmax_sum, c),
            q(indexer_lse, c), scale=scale, index_scale=index_scale, query_rope=q(query_rope, c), key_rope=ck(kr),
            query_lengths=c.query_lengths, key_lengths=c.key_lengths, layout=shard.layout,
            loss_coefficient=loss_coefficient, reduction="sum", backend=backend)
        loss = part if loss is None else loss + part
    ok = torch.isfinite(indexer_lse) & shard.query_valid(indexer_lse.device)
    return _share(loss, int(ok.sum()), shard, grads_averaged_over_cp)


def loss_for_logging(share: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The single-process loss from the ranks' shares: a detached all-reduce (SUM)."""
    dist = _dist()
    t = share.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=shard.group)
    return t
