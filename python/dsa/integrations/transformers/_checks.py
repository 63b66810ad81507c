"""Reasons a call cannot run on dsa exactly (each becomes a counted fallback)."""
from __future__ import annotations

try:  # where transformers records per-layer outputs (output_attentions and friends)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - older transformers
    _active_collector = None


def call_reason(module, kwargs):
    if kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False):
        return "output_attentions (dsa does not form attention probabilities)"
    if _active_collector is not None:
        collected = _active_collector.get()
        if collected is not None and "attentions" in collected:
            return "output_attentions (dsa does not form attention probabilities)"
    if module.training and module.attention_dropout > 0:
        return "attention_dropout > 0 in training"
    return None


def cache_layer_reason(past_key_values, layer_idx, layer_types, allow_tokens=False):
    if past_key_values is None:
        return None
    layers = getattr(past_key_values, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return "a cache without per-layer entries"
    layer = layers[layer_idx]
    if not isinstance(layer, layer_types):
        return f"a {type(layer).__name__} cache layer (static or not dynamic)"
    if not allow_tokens and layer.get_seq_length() > 0:
        if getattr(layer, "_dsa_packed", False):
            raise RuntimeError("dsa patch: this cache was written by a packed call (documents back to back in "
                               "a row); neither the model nor dsa can continue it. Use use_cache=False for "
                               "packed training, or a fresh cache.")
        return "a DeepSeek-V4 cache that already holds tokens"
    return None


def require_paged_call(module, st, kwargs, attention_mask, window, model_reason=None) -> None:
    """Raises PatchFallbackError naming why a call on a DsaCache cannot run: there is no
    fallback, the model's own attention cannot read dsa's paged caches. ``window``: the
    layer's sliding window (None: causal); ``model_reason``: the caller's own check."""
    import torch

    from . import _mask
    from ._cp import PatchFallbackError
    opts = st.options
    reason = None
    if not opts.li:
        reason = "li=False (the model's own indexer would read a cache of its own)"
    elif opts.indexer_loss is not None and torch.is_grad_enabled():
        reason = "an indexer loss (a DsaCache serves inference)"
    else:
        reason = call_reason(module, kwargs) or model_reason
    if reason is None and attention_mask is not None:
        if not isinstance(attention_mask, _mask.DsaMask):
            reason = "a 4-D attention mask"
        else:
            reason = _mask.function_reason(attention_mask, window)
            shape = _mask.describe(attention_mask.kwargs.get("mask_function"))
            if reason is None and shape is not None and shape[2]:
                reason = "packed documents (position ids restarting in a row)"
    if reason is None and any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k")):
        reason = "packed documents (cu_seq_lens)"
    if reason is not None:
        raise PatchFallbackError(f"dsa patch: a DsaCache call with {reason}: the model's own attention cannot "
                                 "read dsa's paged cache (generate with use_cache=False, or pass a transformers "
                                 "cache)")
