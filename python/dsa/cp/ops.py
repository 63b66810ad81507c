"""Context-parallel wrappers of the dsa ops (docs/context_parallel.md).

Query-side tensors are passed local; key-side tensors (raw KV, key rope, indexer keys,
compressed KV) are passed *gathered* (``dsa.cp.gather``), so one gather feeds the indexer,
the attention and the KL loss. Each wrapper calls the normal op on the prefix view the
shard names, with the shard's lengths.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Union

import torch

from ..compressor import dsa_compressor
from ..dense_indexer import dsa_dense_indexer_kl_loss, dsa_dense_indexer_lse
from ..indexer import dsa_indexer
from ..kl_loss import dsa_kl_loss
from ..layer import CompressedKV, LayerCompressMode, layer_compress_mode
from ..sparse_attention import dsa_sparse_attention
from .comm import _dist, all_gather_rows, all_reduce_count, comm_device, tie
from .shard import TNDShard, ZigzagShard, _check_ends

Shard = Union[TNDShard, ZigzagShard]

__all__ = ["tnd_shard", "zigzag_shard", "shard_rows", "gather", "compressor", "indexer", "sparse_attention",
           "dense_indexer_lse", "kl_loss", "dense_indexer_kl_loss", "loss_for_logging"]


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
    dist = _dist()
    rank, world = _rank_world(group)
    mine = torch.tensor([local_rows, len(ends), _fingerprint(ends)], dtype=torch.int64, device=comm_device(group))
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    table = torch.stack(parts).cpu().tolist()
    if any(row[1:] != table[0][1:] for row in table):
        bad = [q for q, row in enumerate(table) if row[1:] != table[0][1:]]
        raise ValueError(f"doc_ends: ranks {bad} passed global document ends that differ from rank 0's "
                         "(every rank must pass the same global lengths)")
    offsets = [0]
    for row in table:
        offsets.append(offsets[-1] + row[0])
    return TNDShard(rank, world, ends, tuple(offsets), group)


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
    dist = _dist()
    rank, world = _rank_world(group)
    mine = torch.tensor([seq_len, len(lens), _fingerprint(lens)], dtype=torch.int64, device=comm_device(group))
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    table = torch.stack(parts).cpu().tolist()
    if any(row != table[0] for row in table):
        bad = [q for q, row in enumerate(table) if row != table[0]]
        raise ValueError(f"lengths: ranks {bad} passed seq_len or row lengths that differ from rank 0's "
                         "(every rank must pass the same global lengths)")
    return ZigzagShard(rank, world, seq_len, tuple(lens), group)


def shard_rows(x_global: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This rank's rows of a global tensor (TND: dim 0; BSND: dim 1, zigzag order). For data
    loaders and tests."""
    if isinstance(shard, TNDShard):
        return x_global[shard.row_start:shard.row_end]
    return x_global.index_select(1, shard.local_index().to(x_global.device))


def gather(x_local: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Differentiable all-gather of a key-side tensor into natural global order; its backward
    sums the gradient over ranks and returns each rank the part of its own rows."""
    if isinstance(shard, TNDShard):
        return all_gather_rows(x_local, shard.local_counts, shard.rank, shard.group, 0)
    c2 = 2 * shard.chunk
    g = all_gather_rows(x_local, [c2] * shard.world_size, shard.rank, shard.group, 1)
    # Rank-major chunks -> natural order (index_select's backward scatters the gradient back).
    order = shard.gathered_order()
    inverse = [0] * len(order)
    for slot, k in enumerate(order):
        inverse[k] = slot
    c = shard.chunk
    idx = torch.cat([torch.arange(s * c, (s + 1) * c) for s in inverse]).to(x_local.device)
    return g.index_select(1, idx)


def _check_gathered(t: Optional[torch.Tensor], rows: int, name: str, dim: int = 0) -> None:
    if t is not None and t.shape[dim] != rows:
        raise ValueError(f"{name}: expected the gathered tensor ({rows} rows along dim {dim}), "
                         f"got shape {list(t.shape)}; pass dsa.cp.gather(...) of the local rows")


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
    ``[B, S // m, c]`` compressed tensor in natural order (see ``_compressor_zigzag``).
    Collective: every rank must call it."""
    mode = layer_compress_mode(ratio)
    if mode is LayerCompressMode.NO_COMPRESS:
        return CompressedKV(mode, 1, None, None)
    if overlap is None:
        overlap = mode is LayerCompressMode.INDEXER
    if isinstance(shard, ZigzagShard):
        return _compressor_zigzag(kv, gate, position_bias, ratio, overlap, shard, mode, backend)
    if not isinstance(shard, TNDShard):
        raise ValueError(f"shard: expected a TNDShard or ZigzagShard, got {type(shard).__name__}")
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


def _compressor_zigzag(kv, gate, position_bias, ratio, overlap, shard, mode, backend) -> CompressedKV:
    """BSND zigzag: every rank compresses the whole gathered [B, S] stream (replicated
    compute; the compressor is cheap next to attention). Still exact for the gradients:
    rank r's copy only receives rank r's attention gradient, and the gathers' backward
    sums the copies' input gradients over ranks; ``position_bias`` gets rank r's part, to
    be summed over ranks like every replicated parameter."""
    if kv.dim() != 3 or kv.shape[1] != 2 * shard.chunk or gate.shape != kv.shape:
        raise ValueError(f"kv, gate: expected local [B, {2 * shard.chunk}, C] of the same shape, "
                         f"got {list(kv.shape)} and {list(gate.shape)}")
    if sum(n // ratio for n in shard.lengths) == 0:
        return CompressedKV(LayerCompressMode.NO_COMPRESS, 1, None, None)
    kv_g, gate_g = gather(kv, shard), gather(gate, shard)
    out, lengths = dsa_compressor(kv_g, gate_g, position_bias, ratio=ratio, overlap=overlap,
                                  query_lengths=list(shard.lengths), layout="BSND", backend=backend)
    return CompressedKV(mode, ratio, out, lengths)


# -- op wrappers -------------------------------------------------------------------------------

def _calls(shard: Shard):
    if isinstance(shard, TNDShard):
        return [(slice(None), shard.query_lengths, shard.key_lengths)]
    return [(call.query_slice, call.query_lengths, call.key_lengths) for call in shard.calls]


def _q(t: Optional[torch.Tensor], sl: slice, shard: Shard) -> Optional[torch.Tensor]:
    if t is None or isinstance(shard, TNDShard):
        return t
    # The ops need batch-mergeable rows, which a [:, chunk] slice of [B, 2c, ...] is not
    # (for B > 1): one copy of the query-side chunk (its gradient flows back through it).
    return t[:, sl].contiguous()


def _layout(shard: Shard) -> str:
    return "TND" if isinstance(shard, TNDShard) else "BSND"


def _key_prefix(t: Optional[torch.Tensor], shard: Shard, name: str, rows_total: int, rows_used: int):
    """TND: the prefix view [0, rows_used) of a gathered tensor. BSND: the whole tensor (BSND
    keys may be longer than their valid length; the explicit key lengths bound them)."""
    if t is None:
        return None
    _check_gathered(t, rows_total, name, 0 if isinstance(shard, TNDShard) else 1)
    return t[:rows_used] if isinstance(shard, TNDShard) else t


def _key_rows(shard: Shard, ratio: int = 1) -> tuple[int, int]:
    if isinstance(shard, TNDShard):
        if ratio == 1:
            return shard.total_rows, shard.kv_rows
        return shard.cmp_total(ratio), shard.cmp_rows(ratio)
    return shard.seq_len // ratio, shard.seq_len // ratio


def indexer(index_query, index_key, weights, *, shard: Shard, topk: int, scale: float = 1.0, cmp_ratio: int = 1,
            return_scores: bool = False, backend: str = "auto"):
    """``dsa_indexer`` under CP: local ``index_query``/``weights``, gathered ``index_key``
    (raw, or the gathered compressed indexer keys with ``cmp_ratio > 1``). Indices are local
    to each query's document, exactly as in a single-process run."""
    total, used = _key_rows(shard, cmp_ratio)
    ik = _key_prefix(index_key, shard, "index_key", total, used)
    outs = []
    for sl, ql, kl in _calls(shard):
        outs.append(dsa_indexer(_q(index_query, sl, shard), ik, _q(weights, sl, shard), topk=topk, scale=scale,
                                cmp_ratio=cmp_ratio, query_lengths=ql, key_lengths=kl, layout=_layout(shard),
                                return_scores=return_scores, backend=backend))
    if len(outs) == 1:
        return outs[0]
    if return_scores:
        return torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)
    return torch.cat(outs, 1)


def sparse_attention(query, kv, indices=None, *, shard: Shard, scale: float, d_v: Optional[int] = None,
                     window: Optional[int] = None, cmp_kv=None, cmp_indices=None, cmp_ratio: int = 1,
                     sinks=None, query_rope=None, key_rope=None, backend: str = "auto"):
    """``dsa_sparse_attention`` under CP, every mode (V3.2 sparse, dense causal, V4 sliding,
    CSA, HCA, sinks). ``query``, ``indices``, ``cmp_indices``, ``query_rope``: local;
    ``kv``, ``key_rope``: gathered raw; ``cmp_kv``: the gathered compressed stream
    (``compressor(...).compressed``). Returns ``(out, softmax_max, softmax_sum)`` of the
    local rows."""
    total, used = _key_rows(shard)
    kv_p = _key_prefix(kv, shard, "kv", total, used)
    kr_p = _key_prefix(key_rope, shard, "key_rope", total, used)
    cmp_p = None
    if cmp_kv is not None:
        if cmp_ratio < 2:
            raise ValueError(f"cmp_ratio: expected >= 2 with cmp_kv, got {cmp_ratio}")
        ctotal, cused = _key_rows(shard, cmp_ratio)
        cmp_p = _key_prefix(cmp_kv, shard, "cmp_kv", ctotal, cused)
    if isinstance(shard, TNDShard) and query.shape[0] == 0:
        # A rank with no query row: nothing to compute, but its gathered inputs stay in its
        # graph so that the gathers' backward collectives still run here.
        d = d_v if d_v is not None else kv.shape[-1]
        out = tie(query.new_zeros(query.shape[:-1] + (d,)), query, kv_p, cmp_p, sinks, query_rope, kr_p)
        empty = query.new_zeros(query.shape[:-1], dtype=torch.float32)
        return out, empty.fill_(float("-inf")), empty.clone().zero_()
    outs = []
    for sl, ql, kl in _calls(shard):
        outs.append(dsa_sparse_attention(
            _q(query, sl, shard), kv_p, _q(indices, sl, shard), scale=scale, d_v=d_v, window=window, cmp_kv=cmp_p,
            cmp_indices=_q(cmp_indices, sl, shard), cmp_ratio=cmp_ratio, sinks=sinks,
            query_rope=_q(query_rope, sl, shard), key_rope=kr_p, query_lengths=ql, key_lengths=kl,
            layout=_layout(shard), backend=backend))
    if len(outs) == 1:
        return outs[0]
    return tuple(torch.cat([o[i] for o in outs], 1) for i in range(3))


def dense_indexer_lse(index_query, index_key, head_weights, *, shard: Shard, scale: float = 1.0,
                      cmp_ratio: int = 1, backend: str = "auto"):
    """``dsa_dense_indexer_lse`` under CP: local queries and weights, gathered ``index_key``."""
    total, used = _key_rows(shard, cmp_ratio)
    ik = _key_prefix(index_key, shard, "index_key", total, used)
    outs = [dsa_dense_indexer_lse(_q(index_query, sl, shard), ik, _q(head_weights, sl, shard), scale=scale,
                                  cmp_ratio=cmp_ratio, query_lengths=ql, key_lengths=kl, layout=_layout(shard),
                                  backend=backend)
            for sl, ql, kl in _calls(shard)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def _query_positions(shard: Shard, device) -> torch.Tensor:
    """Position in its document (TND) or row (BSND, local ``[B, 2c]``) of every local query."""
    if isinstance(shard, TNDShard):
        return shard.positions(device)
    return shard.local_index().to(device).unsqueeze(0).expand(len(shard.lengths), -1)


def _query_valid(shard: Shard, device) -> torch.Tensor:
    if isinstance(shard, TNDShard):
        return torch.ones(shard.local_rows, dtype=torch.bool, device=device)
    lens = torch.tensor(shard.lengths, device=device)[:, None]
    return shard.local_index().to(device)[None, :] < lens


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
    total, used = _key_rows(shard, cmp_ratio)
    kv_p = _key_prefix(kv, shard, "kv", total, used)
    kr_p = _key_prefix(key_rope, shard, "key_rope", total, used)
    ik = _key_prefix(index_key, shard, "index_key", total, used)
    loss = None
    for sl, ql, kl in _calls(shard):
        part = dsa_kl_loss(_q(query, sl, shard), kv_p, _q(indices, sl, shard), _q(softmax_max, sl, shard),
                           _q(softmax_sum, sl, shard), _q(index_query, sl, shard), ik, _q(weights, sl, shard),
                           scale=scale, index_scale=index_scale, sinks=sinks, cmp_ratio=cmp_ratio,
                           query_rope=_q(query_rope, sl, shard), key_rope=kr_p, query_lengths=ql, key_lengths=kl,
                           layout=_layout(shard), loss_coefficient=loss_coefficient, reduction="sum",
                           backend=backend)
        loss = part if loss is None else loss + part
    # N_local: rows with at least one valid entry (spec 4.3): an index that is >= 0 and
    # visible (< pos+1 raw, < (pos+1)//m compressed; visible entries are always in range).
    ix = indices.squeeze(-2) if indices.dim() == (3 if isinstance(shard, TNDShard) else 4) else indices
    pos = _query_positions(shard, ix.device)
    vis = pos + 1 if cmp_ratio == 1 else torch.div(pos + 1, cmp_ratio, rounding_mode="floor")
    valid = ((ix >= 0) & (ix.long() < vis[..., None])).any(-1) & _query_valid(shard, ix.device)
    return _share(loss, int(valid.sum()), shard, grads_averaged_over_cp)


def dense_indexer_kl_loss(index_query, index_key, head_weights, query, key, softmax_max, softmax_sum, indexer_lse,
                          *, shard: Shard, scale: float, index_scale: float = 1.0, query_rope=None, key_rope=None,
                          loss_coefficient: float = 1.0, grads_averaged_over_cp: bool = False,
                          backend: str = "auto"):
    """``dsa_dense_indexer_kl_loss`` under CP, returning this rank's share (see ``kl_loss``);
    N = query rows with a finite ``indexer_lse``. ``index_key``, ``key``, ``key_rope``:
    gathered. Collective."""
    total, used = _key_rows(shard)
    ik = _key_prefix(index_key, shard, "index_key", total, used)
    k = _key_prefix(key, shard, "key", total, used)
    kr = _key_prefix(key_rope, shard, "key_rope", total, used)
    loss = None
    for sl, ql, kl in _calls(shard):
        part = dsa_dense_indexer_kl_loss(
            _q(index_query, sl, shard), ik, _q(head_weights, sl, shard), _q(query, sl, shard), k,
            _q(softmax_max, sl, shard), _q(softmax_sum, sl, shard), _q(indexer_lse, sl, shard), scale=scale,
            index_scale=index_scale, query_rope=_q(query_rope, sl, shard), key_rope=kr, query_lengths=ql,
            key_lengths=kl, layout=_layout(shard), loss_coefficient=loss_coefficient, reduction="sum",
            backend=backend)
        loss = part if loss is None else loss + part
    ok = torch.isfinite(indexer_lse) & _query_valid(shard, indexer_lse.device)
    return _share(loss, int(ok.sum()), shard, grads_averaged_over_cp)


def loss_for_logging(share: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The single-process loss from the ranks' shares: a detached all-reduce (SUM)."""
    dist = _dist()
    t = share.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=shard.group)
    return t
