"""The "dsa" attention implementation as transformers sees it: a mask that is never built.

With ``sas=True`` the patch sets the model's ``config._attn_implementation`` to ``"dsa"``
and registers that name in transformers' ``AttentionMaskInterface`` and
``AttentionInterface`` (adding a key, as flash-attention implementations do; nothing
else in transformers changes). ``create_causal_mask`` / ``create_sliding_window_causal_mask``
then call :func:`dsa_mask`, which returns a :class:`DsaMask`: the arguments transformers
would have built the dense ``[B, 1, S, Sk]`` mask from (the 2-D padding mask, sizes,
offsets, the mask function), O(B * Sk) in memory. The patched attention derives its
geometry from them in O(B * T) (``_geometry.analyse_compact``).

Where a call falls back to the model's own forward, :meth:`DsaMask.dense` builds the
mask the original implementation would have built, from the same arguments, and the
forward runs with ``_attn_implementation`` switched back for its duration
(:func:`original_implementation`), so the fallback is the model's own computation bit
for bit. That path alone pays the T x S mask, as the unpatched model does.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

NAME = "dsa"
# The implementation a module's config had before patch(), kept on the module.
ORIGINAL_ATTR = "_dsa_original_attn_implementation"


class DsaMask:
    """What transformers hands the mask interface, kept instead of the mask it would build."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs
        self._dense = {}

    @property
    def attention_mask(self) -> Optional[torch.Tensor]:
        """The 2-D padding mask [B, Sk] (bool, True = a real token), or None."""
        return self.kwargs.get("attention_mask")

    def contiguous(self):  # generate() calls .contiguous() on the masks it prepares
        return self

    def dense(self, implementation: str):
        """The mask ``implementation``'s own mask function builds from the same arguments
        (cached: every falling-back layer of a forward shares it)."""
        if implementation not in self._dense:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
            fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(implementation)
            # An implementation without a mask function gets no mask, as create_causal_mask gives it.
            self._dense[implementation] = None if fn is None else fn(**self.kwargs)
        return self._dense[implementation]


def dsa_mask(**kwargs) -> DsaMask:
    """The mask function registered as "dsa" (called by transformers' create_*_mask)."""
    return DsaMask(kwargs)


def dsa_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function registered as "dsa". A patched DeepSeek attention never calls
    it (its forward runs the ops; a fallback switches the implementation back first). Any
    other module of a patched model that reads the shared config runs the model's original
    implementation."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    original = original_of(module)
    if original is None:
        raise RuntimeError(f"dsa attention: {type(module).__name__} reached the 'dsa' attention implementation "
                           "but is not part of a model patched by dsa.integrations.transformers.patch")
    attention_mask = for_original(attention_mask, original)
    import sys
    # "eager" is each modeling file's own function, as the module's forward would pick it.
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(original, eager)
    if fn is None:
        raise RuntimeError(f"dsa attention: no {original!r} attention function for {type(module).__name__}")
    return fn(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Adds the "dsa" keys to transformers' two interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    AttentionMaskInterface.register(NAME, dsa_mask)
    AttentionInterface.register(NAME, dsa_attention)


def _modules_with_config(model):
    from transformers import PretrainedConfig
    for m in model.modules():
        if isinstance(getattr(m, "config", None), PretrainedConfig):
            yield m


def install(model) -> None:
    """Every config the model's modules read switches to "dsa"; each such module keeps its
    config's original implementation as an attribute (a module attribute, not a config
    field: it is deep-copied with the model and never saved into config.json)."""
    register()
    originals = {}
    modules = list(_modules_with_config(model))
    for m in modules:
        c = m.config
        originals.setdefault(id(c), m.__dict__.get(ORIGINAL_ATTR, c._attn_implementation_internal))
        m.__dict__[ORIGINAL_ATTR] = originals[id(c)]
    for m in modules:
        m.config._attn_implementation_internal = NAME


def uninstall(model) -> None:
    for m in _modules_with_config(model):
        if ORIGINAL_ATTR in m.__dict__:
            m.config._attn_implementation_internal = m.__dict__.pop(ORIGINAL_ATTR)


def original_of(module) -> Optional[str]:
    """The implementation ``module``'s config had before patch(), or None (not patched with sas=True)."""
    return module.__dict__.get(ORIGINAL_ATTR)


@contextlib.contextmanager
def original_implementation(module):
    """The model's own implementation on ``module``'s config for the duration (a fallback call)."""
    original, config = original_of(module), getattr(module, "config", None)
    if original is None or config is None or config._attn_implementation_internal != NAME:
        yield
        return
    config._attn_implementation_internal = original
    try:
        yield
    finally:
        config._attn_implementation_internal = NAME


def for_original(mask, original: Optional[str]):
    """The mask a fallback hands the model's own forward: a DsaMask made dense as the
    ``original`` implementation builds it; a dict of masks (generate) entry by entry."""
    if isinstance(mask, DsaMask):
        return mask.dense(original)
    if isinstance(mask, dict) and any(isinstance(v, DsaMask) for v in mask.values()):
        return {k: for_original(v, original) for k, v in mask.items()}
    return mask


def run_original(module, *args, **kwargs):
    """The module's class forward on the call, as the unpatched model runs it: dense masks
    and the original attention implementation."""
    original = original_of(module)
    if original is None:  # not a model patched with sas=True
        return type(module).forward(module, *args, **kwargs)
    args = [for_original(a, original) for a in args]
    kwargs = {k: for_original(v, original) for k, v in kwargs.items()}
    with original_implementation(module):
        return type(module).forward(module, *args, **kwargs)


# ---- what the mask function says -----------------------------------------------------

def function_reason(mask: DsaMask, window: Optional[int]) -> Optional[str]:
    """Why the mask function of ``mask`` is not dsa's rule for a layer with ``window``
    (None when it is: transformers' causal function, or its sliding window of exactly
    that width, packed or not)."""
    shape = describe(mask.kwargs.get("mask_function"))
    if shape is None or mask.kwargs.get("use_vmap"):
        return "an attention mask dsa cannot express (a custom mask function)"
    if shape[1] != window:
        return "an attention mask dsa cannot express (its sliding window is not the layer's)"
    return None


def _cells(fn) -> dict:
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__)}


def _is(fn, qualname: str) -> bool:
    return getattr(fn, "__qualname__", None) == qualname and getattr(fn, "__module__", "") == "transformers.masking_utils"


def describe(fn):
    """The mask transformers' mask function expresses, in dsa's terms: ``("causal", None)``,
    ``("causal", window)``, each possibly ``packed`` (documents from position ids), or
    None for anything else (a caller's or_mask/and_mask, block overlays: a fallback).
    Read from the function's composition (transformers builds it from these pieces), so
    that no [S, Sk] evaluation is needed."""
    from transformers.masking_utils import causal_mask_function
    if fn is causal_mask_function:
        return ("causal", None, False)
    if _is(fn, "and_masks.<locals>.and_mask"):
        parts = _cells(fn).get("mask_functions", ())
        if (len(parts) == 2 and _is(parts[0], "sliding_window_overlay.<locals>.inner_mask")
                and parts[1] is causal_mask_function):
            window = _cells(parts[0]).get("sliding_window")
            return ("causal", int(window), False) if isinstance(window, int) else None
        if (len(parts) == 2 and _is(parts[0], "packed_sequence_mask_function.<locals>.inner_mask")
                and _is(parts[1], "remap_positions_for_packed_sequence.<locals>.inner_mask")):
            inner = describe(_cells(parts[1]).get("mask_function"))
            return None if inner is None or inner[2] else (inner[0], inner[1], True)
    return None
