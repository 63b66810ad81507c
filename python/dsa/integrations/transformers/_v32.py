"""DeepSeek-V3.2 (transformers ``models/deepseek_v32``) on dsa's ops.

transformers runs V3.2's MLA non-absorbed: ``kv_b_proj`` expands the 512-dim latent
into per-head keys and values. dsa's sparse attention works on the shared latent,
so the patch absorbs ``kv_b_proj`` on the fly: the query's no-RoPE part goes to the
latent through W_UK, and the latent output comes back to per-head values through
W_UV (both products read views of ``kv_b_proj.weight``, so it gets its gradient).
"""
from __future__ import annotations

import torch

from . import _cp, _geometry, _loss, _ops
from ...lengths import ends_from_lengths
from ._cache import DsaCache
from ._checks import cache_layer_reason, call_reason, require_paged_call
from ._mask import DsaMask, for_original, original_of, run_original
from ... import dsa_indexer, dsa_indexer_decode, dsa_sparse_attention, dsa_sparse_attention_decode

from transformers.cache_utils import DynamicIndexedLayer
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as M

_CACHE_LAYERS = (DynamicIndexedLayer,)
# A DsaCache call of at most this many rows per request, all valid, runs the decode
# ops (a decode step, multi-token or speculative verification); longer calls the
# prefill ops, whose tiles pay off over many rows.
DECODE_MAX_ROWS = 16


def _absorb_reason(linear):
    """Absorption reads kv_b_proj.weight instead of calling the module: only right for a
    plain Linear (a LoRA wrapper, a quantised layer or a hook would be bypassed)."""
    if type(linear) is not torch.nn.Linear or linear.bias is not None:
        return f"a kv_b_proj of type {type(linear).__name__} (absorption needs a plain nn.Linear weight)"
    if linear._forward_hooks or linear._forward_pre_hooks:
        return "hooks on kv_b_proj (absorption does not call the module)"
    return None


def _index_tensors(ix, hidden_states, q_resid, position_embeddings, past_key_values, with_grad: bool,
                   update_cache: bool):
    """The indexer's query [B,S,Hi,Di], keys [B,Sk,Di] (cache included) and fp32 head
    weights, as the model computes them. With the indexer loss they come from detached
    inputs with grad on (the KL trains the indexer only); keys already in the cache
    enter as constants."""
    h = hidden_states.detach() if with_grad else hidden_states
    qr = q_resid.detach() if with_grad else q_resid
    batch, seq = h.shape[:2]
    cos, sin = position_embeddings
    with torch.enable_grad() if with_grad else torch.no_grad():
        q = ix.wq_b(qr).view(batch, seq, ix.n_heads, ix.head_dim)
        q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
        k = ix.k_norm(ix.wk(h)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = M.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        weights = ix.weights_proj(h.to(ix.weights_proj.weight.dtype)).float() * (ix.n_heads ** -0.5)
    if past_key_values is not None:
        if update_cache:
            full = past_key_values.update_indexer(k.detach(), ix.layer_idx)
        else:
            full = past_key_values.layers[ix.layer_idx].indexer_keys
        past = full.shape[1] - seq
        k = torch.cat([full[:, :past], k], dim=1) if past > 0 else k
    return q, k, weights


def _select(ix, q, k, weights, ops):
    """Top-k of the indexer; ``k`` is already in the ops' form (flat, gathered under CP)."""
    return ops.indexer(ops.geom.flat(q), k, ops.geom.flat(weights), topk=ix.index_topk, scale=ix.softmax_scale)


def _projections(self, hidden_states, position_embeddings):
    """The model's own projections, norms and RoPE, in its order (same bits as its forward):
    q_resid, q_pass / q_rot [B, H, S, *], k_pass [B, 1, S, rank], k_rot [B, 1, S, rope]."""
    batch, seq = hidden_states.shape[:2]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(batch, seq, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pass = self.kv_a_layernorm(kv_pass).view(batch, 1, seq, self.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, seq, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = M.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    return q_resid, q_pass, q_rot, k_pass, k_rot


def _absorbed_query(self, q_pass, q_rot):
    """The query on the shared latent, [B, S, H, rank + rope] (W_UK absorbed), and W_UV."""
    heads, nope, dv, rank = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
    w = self.kv_b_proj.weight.view(heads, nope + dv, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    return torch.cat([torch.einsum("bhsd,hdr->bshr", q_pass, w_uk), q_rot.transpose(1, 2)], dim=-1), w_uv


def _value_up(out, w_uv):
    """[B, S, H, rank] latent outputs to [B, S, H, dv] through W_UV [H, dv, rank] (a view
    of kv_b_proj.weight, so its gradient reaches the module). As W_UV . out^T per head:
    the einsum "bshr,hvr->bshv" transposed the strided W_UV first, ~0.6 ms of a 16-head
    decode step's ~1 ms layer on a Zen 4 core; this form reads it as it lies (0.14 ms)."""
    b, s, h, rank = out.shape
    cols = out.permute(2, 3, 0, 1).reshape(h, rank, b * s)
    return torch.bmm(w_uv, cols).view(h, -1, b, s).permute(2, 3, 0, 1)


def attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                      position_ids=None, **kwargs):
    if isinstance(past_key_values, DsaCache):
        return _paged_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs)
    st = self._dsa_state
    opts = st.options
    batch, seq = hidden_states.shape[:2]

    def packed_with_model_indexer(geom):
        if geom.layout == "TND" and past_key_values is not None and not opts.li and opts.indexer_loss != "dense":
            # With a cache the model builds a plain causal mask for packed rows, and its own
            # indexer then spends picks on other documents.
            return "packed rows with a cache and the model's own indexer (li=False)"
        return None

    ops = _ops.layer_ops(
        self, hidden_states, attention_mask, position_ids, past_key_values, kwargs, window=None,
        reason=lambda: (call_reason(self, kwargs) or _absorb_reason(self.kv_b_proj)
                        or cache_layer_reason(past_key_values, self.layer_idx, _CACHE_LAYERS, allow_tokens=True)),
        geometry_reason=packed_with_model_indexer, cp_refusal=_absorb_reason(self.kv_b_proj),
        past=lambda: past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0)
    if ops is None:
        return run_original(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                            position_ids, **kwargs)
    geom = ops.geom

    q_resid, q_pass, q_rot, k_pass, k_rot = _projections(self, hidden_states, position_embeddings)
    if past_key_values is not None:
        k_pass, k_rot = past_key_values.update(k_pass, k_rot, self.layer_idx)
    heads, dv, rank = self.num_heads, self.v_head_dim, self.kv_lora_rank
    query, w_uv = _absorbed_query(self, q_pass, q_rot)
    kv = torch.cat([k_pass[:, 0], k_rot[:, 0]], dim=-1)  # [B, Sk, rank + rope]: keys; values = first `rank`

    ix = self.indexer
    loss_kind = opts.indexer_loss if torch.is_grad_enabled() else None
    iq = ik = iw = None
    indices = None
    # Key side in the ops' form, gathered once under CP: the attention and the KL read kv,
    # the indexer and the KL read ik.
    kv = ops.keys(geom.flat(kv))
    if opts.indexer_loss != "dense" and not opts.li:
        # The model's own indexer (it appends this call's keys to the cache itself).
        dense_mask = for_original(attention_mask, original_of(self))  # the model's indexer reads [B, S, Sk]
        indices = ix(hidden_states, q_resid, position_embeddings, dense_mask[:, 0], position_ids,
                     past_key_values=past_key_values)
        if geom.layout == "TND":
            # Row positions -> positions in the query's document (other documents fall out as < 0
            # or as invisible).
            indices = indices - geom.doc_starts.unsqueeze(-1).to(indices.dtype)
        indices = geom.flat(indices)
        if loss_kind is not None:
            iq, ik, iw = _index_tensors(ix, hidden_states, q_resid, position_embeddings, past_key_values, True,
                                        update_cache=False)
            ik = ops.keys(geom.flat(ik))
    else:
        iq, ik, iw = _index_tensors(ix, hidden_states, q_resid, position_embeddings, past_key_values,
                                    loss_kind is not None, update_cache=True)
        ik = ops.keys(geom.flat(ik))
        if opts.indexer_loss != "dense":
            indices = _select(ix, iq, ik, iw, ops)

    # Dense warm-up (indices=None): dense causal attention on the latent.
    out, smax, ssum = ops.attention(geom.flat(query), kv, indices, scale=self.scaling, d_v=rank)
    if loss_kind == "sparse":
        kl = ops.kl(geom.flat(query).detach(), kv.detach(), indices, smax, ssum, geom.flat(iq), ik, geom.flat(iw),
                    scale=self.scaling, index_scale=ix.softmax_scale, loss_coefficient=opts.loss_coefficient)
    elif loss_kind == "dense":
        lse = ops.dense_lse(geom.flat(iq), ik, geom.flat(iw), scale=ix.softmax_scale)
        kl = ops.dense_kl(geom.flat(iq), ik, geom.flat(iw), geom.flat(query), kv.unsqueeze(-2), smax, ssum, lse,
                          scale=self.scaling, index_scale=ix.softmax_scale, loss_coefficient=opts.loss_coefficient)
    if loss_kind is not None:
        st.indexer_losses[self._dsa_name] = kl.detach()
        out = _loss.attach(out, kl)
    out = _value_up(geom.unflat(out), w_uv)
    return self.o_proj(out.reshape(batch, seq, heads * dv)), None


def _paged_forward(self, hidden_states, position_embeddings, attention_mask, cache, kwargs):
    """A call on a DsaCache: this call's valid rows (the 2-D padding mask's ones) are
    appended to each request's paged latent and indexer-key streams at the request's own
    positions, then attend to the request's cached rows. Rows of padding get zeros (the
    model ignores them)."""
    st = self._dsa_state
    require_paged_call(self, st, kwargs, attention_mask, None, _absorb_reason(self.kv_b_proj))
    batch, seq = hidden_states.shape[:2]
    layer = cache.layers[self.layer_idx]
    ix = self.indexer
    q_resid, q_pass, q_rot, k_pass, k_rot = _projections(self, hidden_states, position_embeddings)
    query, w_uv = _absorbed_query(self, q_pass, q_rot)
    kv = torch.cat([k_pass[:, 0], k_rot[:, 0]], dim=-1)
    iq, ik, iw = _index_tensors(ix, hidden_states, q_resid, position_embeddings, None, False, False)
    if not layer.is_initialized:
        layer.start(batch, kv.shape[-1], self.qk_rope_head_dim, ik.shape[-1], kv.dtype)

    mask2d = attention_mask.attention_mask if isinstance(attention_mask, DsaMask) else None
    valid = (mask2d[:, -seq:].to(torch.bool) if mask2d is not None
             else torch.ones(batch, seq, dtype=torch.bool, device=hidden_states.device))
    counts = valid.sum(1).tolist()
    start = torch.tensor(layer.lengths, dtype=torch.int64).unsqueeze(1)
    positions = torch.where(valid, start + valid.cumsum(1) - 1, torch.full_like(start, -1))
    lengths = [n + c for n, c in zip(layer.lengths, counts)]
    for stream, rows in ((layer.latent, kv), (layer.index_keys, ik)):
        stream.reserve(lengths)
        stream.write(positions, rows)
    layer.lengths, layer.columns = lengths, layer.columns + seq

    if seq <= DECODE_MAX_ROWS and all(c == seq for c in counts):
        # Decode (and short verify or chunk calls): every request's `seq` rows are the
        # last of its context; the decode ops read the caches in place, so the step
        # reads the top-k latent rows and the index keys, nothing else of the context.
        lens = torch.tensor(lengths, dtype=torch.int32)
        indices = dsa_indexer_decode(iq, iw, layer.index_keys.cache, layer.index_keys.table, lens,
                                     topk=ix.index_topk, scale=ix.softmax_scale,
                                     cache_dtype=layer.index_keys.cache_dtype, backend=st.options.backend)
        out, _ = dsa_sparse_attention_decode(query.contiguous(), layer.latent.cache, layer.latent.table, lens,
                                             scale=self.scaling, d_v=self.kv_lora_rank, indices=indices,
                                             rope_dim=self.qk_rope_head_dim, cache_dtype=layer.latent.cache_dtype,
                                             backend=st.options.backend)
        out = _value_up(out, w_uv)
        return self.o_proj(out.reshape(batch, seq, self.num_heads * self.v_head_dim)), None

    # Prefill, chunks and ragged calls: each request's cached rows, back to back (its
    # valid queries are its last rows), through the prefill ops.
    keys = layer.latent.gather(lengths, kv.dtype)
    index_keys = layer.index_keys.gather(lengths, ik.dtype)
    spans = dict(query_lengths=ends_from_lengths(counts), key_lengths=ends_from_lengths(lengths), layout="TND",
                 backend=st.options.backend)
    indices = dsa_indexer(iq[valid], index_keys, iw[valid], topk=ix.index_topk, scale=ix.softmax_scale, **spans)
    out, _, _ = dsa_sparse_attention(query[valid], keys, indices, scale=self.scaling, d_v=self.kv_lora_rank,
                                     **spans)
    full = out.new_zeros(batch, seq, *out.shape[1:])
    full[valid] = out
    out = _value_up(full, w_uv)
    return self.o_proj(out.reshape(batch, seq, self.num_heads * self.v_head_dim)), None


def indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                    past_key_values=None):
    """li=True, sas=False: dsa's top-k handed to the model's own attention, which folds it into its mask."""
    st = self._dsa_state
    batch, seq = hidden_states.shape[:2]
    keys = attention_mask.shape[-1] if isinstance(attention_mask, torch.Tensor) else seq
    reason = cache_layer_reason(past_key_values, self.layer_idx, _CACHE_LAYERS, allow_tokens=True)
    geom = None
    if reason is None:
        geom = _geometry.cached_analyse(st, attention_mask, position_ids, {}, batch, seq, keys - seq, None)
        if isinstance(geom, str):
            reason = geom
    if reason is not None:
        st.fallback(reason)
        return run_original(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                         past_key_values=past_key_values)
    q, k, w = _index_tensors(self, hidden_states, q_resid, position_embeddings, past_key_values, False, True)
    ops = _ops.Local(geom, st.options.backend)
    idx = _select(self, q, geom.flat(k), w, ops)
    idx = geom.unflat(idx)[..., :min(self.index_topk, keys)]
    own = torch.arange(seq, device=idx.device, dtype=idx.dtype).view(1, seq, 1) + (keys - seq)
    if geom.layout == "TND":
        idx = torch.where(idx >= 0, idx + geom.doc_starts.unsqueeze(-1).to(idx.dtype), idx)
    # The model scatters these into a mask and fails on -1. A -1 means every visible key
    # is already picked, so the query's own position changes nothing.
    return torch.where(idx < 0, own, idx)
