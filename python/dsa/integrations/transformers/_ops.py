"""The op calls of a patched attention layer, single process or context parallel.

The layer code (``_v32.py``, ``_v4.py``) is written once against this interface:
``keys`` turns a key-side tensor (flat, this call's rows) into what the ops read,
and every op call gets its lengths from here. :class:`Local` runs the ops on the
call's own rows with the geometry's lengths; ``_cp.CPOps`` gathers the key side over
the CP group and calls the ``dsa.cp`` wrappers with the shard. ``layer_ops`` is the one
place a call is routed to either, or to the model's own forward."""
from __future__ import annotations

from typing import Callable, Optional

from ... import (dsa_compressor, dsa_dense_indexer_kl_loss, dsa_dense_indexer_lse, dsa_indexer, dsa_kl_loss,
                 dsa_sparse_attention)
from . import _cp, _geometry, _metrics


def layer_ops(module, hidden_states, attention_mask, position_ids, past_key_values, kwargs, *,
              window: Optional[int], reason: Callable[[], Optional[str]],
              geometry_reason: Optional[Callable] = None, cp_refusal: Optional[str] = None,
              past: Callable[[], int] = lambda: 0):
    """The ops an attention call runs on: ``_cp.CPOps`` when the call carries a CP shard,
    :class:`Local` when dsa computes it exactly, None when the model's own forward must run
    it (counted and warned as a fallback here; the caller runs the original).

    ``reason()``: why this model's layer cannot take the call (checked before the mask is
    analysed); ``geometry_reason(geom)``: why it cannot take the analysed geometry;
    ``cp_refusal``: why the layer cannot run under CP, where there is no fallback (raised);
    ``past()``: keys already cached before this call."""
    st = module._dsa_state
    batch, seq = hidden_states.shape[:2]
    shard = _cp.call_shard(module, st, kwargs, past_key_values, attention_mask, position_ids, batch, seq, window)
    if shard is not None:
        if cp_refusal:
            raise _cp.PatchFallbackError(f"dsa patch under context parallelism: {cp_refusal}")
        return _cp.CPOps(shard, st.options.backend, st.cp_grads_averaged)
    why = reason()
    if why is None:
        geom = _geometry.cached_analyse(st, attention_mask, position_ids, kwargs, batch, seq, past(), window)
        why = geom if isinstance(geom, str) else (geometry_reason(geom) if geometry_reason else None)
    if why is not None:
        st.fallback(why)
        return None
    return Local(geom, st.options.backend)


class Local:
    def __init__(self, geom, backend: str):
        self.geom, self.backend = geom, backend
        self._lengths = dict(query_lengths=geom.query_lengths, key_lengths=geom.key_lengths, layout=geom.layout,
                             backend=backend)

    def keys(self, t):
        return t

    def indexer(self, q, k, w, **kw):
        return dsa_indexer(q, k, w, **kw, **self._lengths)

    def attention(self, q, kv, indices, **kw):
        return dsa_sparse_attention(q, kv, indices, **kw, **self._lengths)

    def kl(self, *args, **kw):
        return dsa_kl_loss(*args, **kw, **self._lengths)

    def dense_lse(self, *args, **kw):
        return dsa_dense_indexer_lse(*args, **kw, **self._lengths)

    def dense_kl(self, *args, **kw):
        return dsa_dense_indexer_kl_loss(*args, **kw, **self._lengths)

    def compressor(self, kv, gate, position_bias, ratio: int, overlap: bool):
        """Pooled entries before kv_norm: TND [S_cmp, c] (documents back to back), BSND
        [B, S // m, c]."""
        packed = self.geom.layout == "TND"
        pooled, _ = dsa_compressor(kv, gate, position_bias, ratio=ratio, overlap=overlap,
                                   query_lengths=self.geom.key_lengths if packed else None, layout=self.geom.layout,
                                   backend=self.backend)
        return pooled

    def compressed_positions(self, ratio: int, rows: int, device):
        return self.geom.compressed_positions(ratio, rows, device)

    def recall(self, q, cmp_kv, cmp_idx, scale: float, ratio: int):
        """The indexer's recall@k on this call's rows (_metrics.py)."""
        return _metrics.recall_at_k(q, cmp_kv, cmp_idx, scale, ratio, self.geom)
