"""DeepSeek-V4 (transformers ``models/deepseek_v4``) on dsa's ops.

Each function is bound to one module instance as its ``forward``. The projections,
norms, RoPE and output projection are the model's own modules called in the model's
order; only the pooling, the indexer's scoring/top-k and the attention core change.
"""
from __future__ import annotations

import torch

from ... import (dsa_compressor_append, dsa_indexer, dsa_indexer_decode, dsa_sparse_attention,
                  dsa_sparse_attention_decode)
from . import _cp, _geometry, _loss, _ops
from ...lengths import ends_from_lengths
from ._cache import DsaCache
from ._checks import cache_layer_reason, call_reason, require_paged_call
from ._mask import DsaMask, run_original

from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

_rope = M.apply_rotary_pos_emb
_CACHE_LAYERS = (M.DeepseekV4HCACache, M.DeepseekV4CSACache)
_ATTENTION_CACHE_LAYERS = (DynamicSlidingWindowLayer,)  # the two above derive from it


def _is_csa(module) -> bool:
    # The overlap follows the compressor's class: transformers lets either class take any ratio.
    return isinstance(module, (M.DeepseekV4CSACompressor, M.DeepseekV4Indexer))


def _pool_torch(module, kv, gate, overlap: bool) -> torch.Tensor:
    """The model's own stateless pooling (same operations, same order), before kv_norm."""
    batch, m, c = kv.shape[0], module.compress_rate, module.head_dim
    n = kv.shape[1] // m
    if n == 0:
        return kv.new_zeros((batch, 0, c))
    chunk_kv = kv[:, :n * m].view(batch, n, m, -1)
    chunk_gate = gate[:, :n * m].view(batch, n, m, -1) + module.position_bias
    if overlap:
        new_kv = chunk_kv.new_zeros((batch, n, 2 * m, c))
        new_gate = chunk_gate.new_full((batch, n, 2 * m, c), float("-inf"))
        new_kv[:, :, m:] = chunk_kv[..., c:]
        new_gate[:, :, m:] = chunk_gate[..., c:]
        if n > 1:
            new_kv[:, 1:, :m] = chunk_kv[:, :-1, :, :c]
            new_gate[:, 1:, :m] = chunk_gate[:, :-1, :, :c]
        chunk_kv, chunk_gate = new_kv, new_gate
    return (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2)


def _compress(module, hidden_states, ops, use_dsa: bool):
    """(compressed entries after kv_norm and RoPE, entry count, kv, gate).

    BSND gives [B, S // m, c] over whole rows, as the model pools them: entries holding
    right padding are invisible to every valid query (the ops derive visibility from the
    raw key lengths), and a cache then receives exactly the model's entries. TND gives
    [S_cmp, c] with the documents back to back; RoPE positions restart per document.
    Under CP (``ops`` a CPOps) TND gives the global stream, gathered."""
    m = module.compress_rate
    geom = ops.geom
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)
    overlap = _is_csa(module)
    if use_dsa:
        pooled = ops.compressor(geom.flat(kv), geom.flat(gate), module.position_bias.float(), m, overlap)
    else:
        if geom.layout != "BSND":
            raise AssertionError("packed calls pool with dsa_compressor")
        pooled = _pool_torch(module, kv, gate, overlap)
    count = pooled.shape[0] if geom.layout == "TND" else pooled.shape[0] * pooled.shape[1]
    if geom.layout == "TND":
        x = norm_rope(module, pooled.unsqueeze(0), ops.compressed_positions(m, pooled.shape[0], pooled.device))
        return x[0], count, kv, gate
    return norm_rope(module, pooled, ops.compressed_positions(m, pooled.shape[1], pooled.device)), count, kv, gate


def norm_rope(module, pooled: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model's kv_norm and RoPE of pooled entries [B, n, c] at RoPE positions [B, n]."""
    x = module.kv_norm(pooled)
    cos, sin = module.rotary_emb(x, position_ids=positions, layer_type=module.rope_layer_type)
    return _rope(x.unsqueeze(1), cos, sin).squeeze(1)


def _fill_cache(cache_layer, name, module, kv, gate, compressed):
    """Writes what the model's own compressor would write into an empty cache layer,
    through the same cache methods, so that a later call (run by the model) continues it."""
    m = module.compress_rate
    chunk_kv, chunk_gate, _ = cache_layer.store_compression_weights(name, kv, gate)
    if chunk_kv.shape[1] > 0 and _is_csa(module):
        b, n = chunk_kv.shape[0], chunk_kv.shape[1] // m
        cache_layer.update_overlap_state(name, chunk_kv.view(b, n, m, -1),
                                         chunk_gate.view(b, n, m, -1) + module.position_bias, module.head_dim)
    cache_layer.update_compressor_states(name, compressed)


def index_tensors(ix, hidden_states, q_residual, position_ids, compress, with_grad: bool):
    """The indexer's query, compressed keys and head weights, as the model computes them;
    ``compress(module, hidden_states)`` pools the keys (single process or CP). With the
    indexer loss they are rebuilt from detached inputs with grad on: the KL trains the
    indexer and nothing else."""
    h = hidden_states.detach() if with_grad else hidden_states
    qr = q_residual.detach() if with_grad else q_residual
    with torch.enable_grad() if with_grad else torch.no_grad():
        keys, count, kv, gate = compress(ix, h)
        b, s = h.shape[:2]
        cos_q, sin_q = ix.rotary_emb(h, position_ids=position_ids, layer_type=ix.rope_layer_type)
        q = ix.q_b_proj(qr).view(b, s, -1, ix.head_dim).transpose(1, 2)
        q = _rope(q, cos_q, sin_q).transpose(1, 2)
        weights = ix.scorer.weights_proj(h).float() * ix.scorer.weights_scaling
    return q, keys, weights, count, kv, gate


def _select(ix, q, keys, weights, ops):
    return ops.indexer(ops.geom.flat(q), keys, ops.geom.flat(weights), topk=ix.index_topk,
                       scale=ix.scorer.softmax_scale, cmp_ratio=ix.compress_rate)


def attention_forward(self, hidden_states, position_embeddings, position_ids, attention_mask,
                      past_key_values=None, **kwargs):
    st = self._dsa_state
    if isinstance(past_key_values, DsaCache):
        return _paged_forward(self, hidden_states, position_embeddings, position_ids, attention_mask,
                              past_key_values, kwargs)
    opts = st.options
    batch, seq = hidden_states.shape[:2]
    comp = self.compressor

    def compressed_layer_reason(geom):
        if comp is not None and geom.layout == "TND" and not (opts.compressor and (opts.li or not _is_csa(comp))):
            return "packed rows on a compressed layer without compressor=True (and li=True on CSA layers)"
        return None

    ops = _ops.layer_ops(
        self, hidden_states, attention_mask, position_ids, past_key_values, kwargs, window=self.sliding_window,
        reason=lambda: (call_reason(self, kwargs)
                        or cache_layer_reason(past_key_values, self.layer_idx, _ATTENTION_CACHE_LAYERS)),
        geometry_reason=compressed_layer_reason)
    if ops is None:
        return run_original(self, hidden_states, position_embeddings, position_ids, attention_mask,
                            past_key_values, **kwargs)
    geom = ops.geom
    compress = lambda module, h: _compress(module, h, ops, opts.compressor)  # noqa: E731

    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_residual).view(batch, seq, -1, self.head_dim).transpose(1, 2)
    q = _rope(self.q_b_norm(q), cos, sin)
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(batch, seq, -1, self.head_dim).transpose(1, 2)
    kv = _rope(kv, cos, sin)
    cache_layer = None
    if past_key_values is not None:
        kv = past_key_values.update(kv, kv, self.layer_idx)[0]
        cache_layer = past_key_values.layers[self.layer_idx]
        if geom.layout == "TND":
            # Compressed entries of packed documents have no meaning for a later call.
            cache_layer._dsa_packed = True
    q, kv = q.transpose(1, 2), kv[:, 0]

    cmp_kv = cmp_idx = None
    ratio = 1
    kl_inputs = None
    if comp is not None:
        csa = _is_csa(comp)
        entries, count, ckv, cgate = compress(comp, hidden_states)
        if cache_layer is not None and geom.layout == "BSND":
            _fill_cache(cache_layer, "compressor", comp, ckv, cgate, entries)
        if csa:
            ix = comp.indexer
            with_grad = opts.indexer_loss == "sparse" and torch.is_grad_enabled()
            if opts.li or with_grad:
                iq, ik, iw, icount, ikv, igate = index_tensors(ix, hidden_states, q_residual, position_ids,
                                                               compress, with_grad)
                kl_inputs = (iq, ik, iw)
            if opts.li:
                if cache_layer is not None and geom.layout == "BSND":
                    _fill_cache(cache_layer, "indexer", ix, ikv, igate, ik)
                if icount > 0:
                    cmp_idx = _select(ix, iq, ik, iw, ops)
            else:
                cmp_idx = ix(hidden_states, q_residual, position_ids, past_key_values, self.layer_idx)
                cmp_idx = geom.flat(cmp_idx.to(torch.int32)) if cmp_idx.shape[-1] > 0 else None
        if count > 0 and (not csa or cmp_idx is not None):
            cmp_kv, ratio = entries, comp.compress_rate

    sinks = self.sinks.float()
    # The compressed entries are already in the ops' form (gathered under CP); the raw
    # keys are gathered here, once.
    out, smax, ssum = ops.attention(
        geom.flat(q), ops.keys(geom.flat(kv)), None, scale=self.scaling, window=self.sliding_window, cmp_kv=cmp_kv,
        cmp_indices=cmp_idx if cmp_kv is not None else None, cmp_ratio=ratio, sinks=sinks)
    if kl_inputs is not None and cmp_kv is not None and opts.indexer_loss == "sparse" and torch.is_grad_enabled():
        iq, ik, iw = kl_inputs
        kl = ops.kl(geom.flat(q).detach(), cmp_kv.detach(), cmp_idx, smax, ssum, geom.flat(iq), ik,
                    geom.flat(iw), scale=self.scaling, index_scale=comp.indexer.scorer.softmax_scale,
                    sinks=sinks.detach(), cmp_ratio=ratio, loss_coefficient=opts.loss_coefficient)
        st.indexer_losses[self._dsa_name] = kl.detach()
        out = _loss.attach(out, kl)
    if st.track_recall and cmp_idx is not None and cmp_kv is not None:
        st.indexer_recall[self._dsa_name] = ops.recall(geom.flat(q), cmp_kv, cmp_idx, self.scaling, ratio)
    out = geom.unflat(out)
    out = _rope(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = self.o_a_proj(out.reshape(batch, seq, self.config.o_groups, -1)).flatten(2)
    return self.o_b_proj(grouped), None


# ---- generation on a DsaCache ----

# A DsaCache call of at most this many rows per request, all valid, on a cache that
# already holds tokens, runs the decode ops; the window ring holds this many rows
# beyond the sliding window.
DECODE_MAX_ROWS = 16


def _append_entries(module, state, hidden_states, valid, counts, starts, backend):
    """The compressor ``module``'s entries that this call's rows complete, through its
    serving ``state`` (``_cache.Compressor``): pooled by dsa_compressor_append from the
    valid rows of each request (``valid [B, S]``, ``counts[b]`` of them, moved to the
    front of the row in order), then the model's kv_norm and RoPE at positions
    ``w * m``, then written to the entry cache at their entry numbers. Returns the entry
    count of every request afterwards."""
    batch, seq = hidden_states.shape[:2]
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)
    n = max(counts + [0])
    if any(c < seq for c in counts):  # padding (left or right): each request's valid rows first
        packed = [kv.new_zeros(batch, n, kv.shape[-1]), gate.new_zeros(batch, n, gate.shape[-1])]
        for b in range(batch):
            for dst, src in zip(packed, (kv, gate)):
                dst[b, :counts[b]] = src[b][valid[b]]
        kv, gate = packed
    m = state.ratio
    lens = torch.tensor(starts, dtype=torch.int64)
    pooled = dsa_compressor_append(kv.contiguous(), gate.contiguous(), module.position_bias.float(), state.state_kv,
                                   state.state_gate, lens, ratio=m, overlap=state.overlap,
                                   new_lens=torch.tensor(counts, dtype=torch.int64), backend=backend)
    first = lens // m
    totals = [(s + c) // m for s, c in zip(starts, counts)]
    entry = first.unsqueeze(1) + torch.arange(pooled.shape[1]).unsqueeze(0)  # [B, E] entry numbers
    live = entry < torch.tensor(totals).unsqueeze(1)
    if bool(live.any()):
        entries = norm_rope(module, pooled, entry * m)
        state.entries.reserve(totals)
        state.entries.write(torch.where(live, entry, torch.full_like(entry, -1)), entries)
    return totals


def _paged_forward(self, hidden_states, position_embeddings, position_ids, attention_mask, cache, kwargs):
    """A call on a DsaCache: each request's valid rows (the 2-D padding mask's ones)
    join its window ring and its compressors at the request's own positions. The first
    call (the prompt; padded batches included) runs the prefill ops on its rows, one
    sequence per request; a later call of at most DECODE_MAX_ROWS rows per request runs
    the decode ops on the caches in place, and a longer one (chunked prefill) runs them
    DECODE_MAX_ROWS rows at a time."""
    st = self._dsa_state
    require_paged_call(self, st, kwargs, attention_mask, self.sliding_window)
    batch, seq = hidden_states.shape[:2]
    layer = cache.layers[self.layer_idx]
    mask2d = attention_mask.attention_mask if isinstance(attention_mask, DsaMask) else None
    valid = (mask2d[:, -seq:].to(torch.bool) if mask2d is not None
             else torch.ones(batch, seq, dtype=torch.bool, device=hidden_states.device))
    counts = valid.sum(1).tolist()
    continuing = layer.is_initialized and any(layer.lengths)
    if continuing and not all(c == seq for c in counts):
        raise _cp.PatchFallbackError("dsa patch: a DsaCache call that continues a DeepSeek-V4 cache with padding "
                                     "rows: the decode ops take every row of a request")
    if continuing and seq > DECODE_MAX_ROWS:
        # Chunked prefill: the decode ops, a slice of rows at a time.
        outs = []
        for lo in range(0, seq, DECODE_MAX_ROWS):
            hi = min(seq, lo + DECODE_MAX_ROWS)
            emb = {k: (cos[:, lo:hi], sin[:, lo:hi]) for k, (cos, sin) in position_embeddings.items()}
            outs.append(_paged_forward(self, hidden_states[:, lo:hi], emb, position_ids[:, lo:hi], None, cache,
                                       kwargs)[0])
        return torch.cat(outs, dim=1), None

    backend = st.options.backend
    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_residual).view(batch, seq, -1, self.head_dim).transpose(1, 2)
    q = _rope(self.q_b_norm(q), cos, sin).transpose(1, 2)  # [B, S, H, D]
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(batch, seq, 1, self.head_dim).transpose(1, 2)
    kv = _rope(kv, cos, sin)[:, 0]  # [B, S, D]
    rope_dim = 2 * cos.shape[-1]
    if not layer.is_initialized:
        layer.start(batch, self, rope_dim, kv.dtype, self.sliding_window + DECODE_MAX_ROWS)
    starts = list(layer.lengths)
    decode = continuing  # every row valid, at most DECODE_MAX_ROWS of them (checked above)
    start_t = torch.tensor(starts, dtype=torch.int64).unsqueeze(1)
    positions = torch.where(valid, start_t + valid.cumsum(1) - 1, torch.full_like(start_t, -1))
    lengths = [s + c for s, c in zip(starts, counts)]
    layer.window.reserve(lengths)
    layer.window.write(positions, kv)

    comp = self.compressor
    csa = comp is not None and _is_csa(comp)
    entries = _append_entries(comp, layer.compressor, hidden_states, valid, counts, starts, backend) if comp else None
    if csa:
        ix = comp.indexer
        index_entries = _append_entries(ix, layer.indexer, hidden_states, valid, counts, starts, backend)
        cos_q, sin_q = ix.rotary_emb(hidden_states, position_ids=position_ids, layer_type=ix.rope_layer_type)
        iq = ix.q_b_proj(q_residual).view(batch, seq, -1, ix.head_dim).transpose(1, 2)
        iq = _rope(iq, cos_q, sin_q).transpose(1, 2)  # [B, S, Hi, Di]
        iw = ix.scorer.weights_proj(hidden_states).float() * ix.scorer.weights_scaling
    layer.lengths, layer.columns = lengths, layer.columns + seq
    sinks = self.sinks.float()
    has_entries = entries is not None and max(entries) > 0

    if decode:
        lens = torch.tensor(lengths, dtype=torch.int32)
        extra = {}
        if has_entries:
            cmp = layer.compressor.entries
            extra = dict(cmp_cache=cmp.cache, cmp_block_table=cmp.table, cmp_ratio=comp.compress_rate,
                         cmp_cache_dtype=cmp.cache_dtype)
            if csa:
                keys = layer.indexer.entries
                extra["cmp_indices"] = dsa_indexer_decode(iq.contiguous(), iw, keys.cache, keys.table, lens,
                                                          topk=ix.index_topk, scale=ix.scorer.softmax_scale,
                                                          cmp_ratio=ix.compress_rate, cache_dtype=keys.cache_dtype,
                                                          backend=backend)
        win = layer.window
        out, _ = dsa_sparse_attention_decode(q.contiguous(), win.cache, win.table, lens, scale=self.scaling,
                                             window=self.sliding_window, rope_dim=rope_dim,
                                             cache_dtype=win.cache_dtype, ring=True, sinks=sinks,
                                             backend=backend, **extra)
    else:
        # The prompt: this call's valid rows, one sequence per request, on the prefill ops.
        ends = ends_from_lengths(counts)
        spans = dict(query_lengths=ends, key_lengths=ends, layout="TND", backend=backend)
        extra = {}
        if has_entries:
            cmp_kv = layer.compressor.entries.gather(entries, kv.dtype)
            cmp_idx = None
            if csa:
                index_keys = layer.indexer.entries.gather(index_entries, iq.dtype)
                cmp_idx = dsa_indexer(iq[valid], index_keys, iw[valid], topk=ix.index_topk,
                                      scale=ix.scorer.softmax_scale, cmp_ratio=ix.compress_rate, **spans)
            extra = dict(cmp_kv=cmp_kv, cmp_indices=cmp_idx, cmp_ratio=comp.compress_rate)
        flat, _, _ = dsa_sparse_attention(q[valid], kv[valid], None, scale=self.scaling, window=self.sliding_window,
                                          sinks=sinks, **extra, **spans)
        out = flat.new_zeros(batch, seq, *flat.shape[1:])
        out[valid] = flat
    out = _rope(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = self.o_a_proj(out.reshape(batch, seq, self.config.o_groups, -1)).flatten(2)
    return self.o_b_proj(grouped), None


# ---- sas=False: the model's attention runs, with its compressor and indexer on dsa ----

def _module_reason(self, position_ids, past_key_values, layer_idx, seq):
    reason = cache_layer_reason(past_key_values, layer_idx, _CACHE_LAYERS)
    if reason is None and position_ids is not None:
        expect = torch.arange(seq, device=position_ids.device)
        if not bool((position_ids == expect).all()):
            # The model measures compressed visibility with position_ids, dsa with the
            # row index: they agree only for rows that are one sequence from 0.
            reason = "position_ids other than 0..S-1 (packed rows need sas=True)"
    return reason


def _row_geometry(hidden_states):
    batch, seq = hidden_states.shape[:2]
    return _geometry.Geometry("BSND", batch, seq, 0, [seq] * batch, [seq] * batch, [seq] * batch)


def compressor_forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
    st = self._dsa_state
    reason = _module_reason(self, position_ids, past_key_values, layer_idx, hidden_states.shape[1])
    if reason is not None:
        st.fallback(reason)
        return run_original(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx)
    ops = _ops.Local(_row_geometry(hidden_states), st.options.backend)
    entries, count, kv, gate = _compress(self, hidden_states, ops, True)
    if past_key_values is not None:
        _fill_cache(past_key_values.layers[layer_idx], "compressor", self, kv, gate, entries)
    compressed_kv = entries.unsqueeze(1)
    batch, seq = hidden_states.shape[:2]
    n = compressed_kv.shape[2]
    if _is_csa(self):
        # The model's own block bias from the (patched or original) indexer's picks.
        top_k = self.indexer(hidden_states, q_residual, position_ids, past_key_values, layer_idx)
        valid = top_k >= 0
        safe = torch.where(valid, top_k, torch.full_like(top_k, n))
        bias = compressed_kv.new_full((batch, 1, seq, n + 1), float("-inf"))
        bias.scatter_(-1, safe.unsqueeze(1).long(), 0.0)
        return compressed_kv, bias[..., :n]
    if position_ids.shape[1] == 1 or n == 0:
        return compressed_kv, None
    threshold = (position_ids + 1) // self.compress_rate
    bias = compressed_kv.new_zeros((batch, 1, seq, n))
    bias = bias.masked_fill(torch.arange(n, device=bias.device).view(1, 1, 1, -1)
                            >= threshold.unsqueeze(1).unsqueeze(-1), float("-inf"))
    return compressed_kv, bias


def indexer_forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
    st = self._dsa_state
    opts = st.options
    reason = _module_reason(self, position_ids, past_key_values, layer_idx, hidden_states.shape[1])
    if reason is not None:
        st.fallback(reason)
        return run_original(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx)
    ops = _ops.Local(_row_geometry(hidden_states), opts.backend)
    q, keys, weights, count, kv, gate = index_tensors(self, hidden_states, q_residual, position_ids,
                                                      lambda module, h: _compress(module, h, ops, True), False)
    if past_key_values is not None:
        _fill_cache(past_key_values.layers[layer_idx], "indexer", self, kv, gate, keys)
    width = min(self.index_topk, keys.shape[1])
    if width == 0:
        return torch.empty((*hidden_states.shape[:2], 0), dtype=torch.long, device=hidden_states.device)
    return _select(self, q, keys, weights, ops)[..., :width].long()
