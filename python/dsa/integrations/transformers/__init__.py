"""DeepSeek-V3.2 and DeepSeek-V4 in Hugging Face transformers on dsa's fused ops.

    from dsa.integrations.transformers import patch
    model = DeepseekV4ForCausalLM.from_pretrained(...)
    patch(model)                      # or DSA_PATCH=sas,li python train.py

``patch`` binds new ``forward`` methods to the model's own attention (and, with
``sas=False``, compressor / indexer) module instances. With ``sas=True`` it also sets
the model's ``config._attn_implementation`` to ``"dsa"``, a name it registers in
transformers' attention and mask interfaces, so that transformers builds no dense
``[B, 1, S, Sk]`` mask for this model (``_mask.py``). No transformers function or class
is monkeypatched, so another model in the same process, and this one after
``unpatch``, run exactly as before. See docs/transformers.md.
"""
from __future__ import annotations

import types
import warnings
from typing import Optional

import torch

from ._state import INDEXER_LOSSES, Options, PatchFallbackError, PatchState, env_value, options_from_env

__all__ = ["patch", "unpatch", "is_patched", "cp_batch", "DsaCache", "indexer_losses", "indexer_recall", "track_indexer_recall",
           "fallback_counts", "PatchFallbackError"]

_STATE_ATTR = "_dsa_patch_state"
_BACKENDS = ("auto", "reference", "cpu", "cuda")


def _families():
    """The (attention class, module) pairs of the model families this transformers has."""
    families = []
    try:
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m32
    except ImportError:  # pragma: no cover - transformers without V3.2
        m32 = None
    if m32 is not None:
        families.append(("v32", m32))
    try:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m4
    except ImportError:  # pragma: no cover
        m4 = None
    if m4 is not None:
        families.append(("v4", m4))
    return families


def _bind(module, fn, state, name):
    module.forward = types.MethodType(fn, module)
    module._dsa_state = state
    module._dsa_name = name


def patch(model: torch.nn.Module, *, sas: bool = True, li: bool = True, compressor: bool = True,
          indexer_loss: Optional[str] = None, loss_coefficient: float = 1.0, backend: str = "auto",
          strict: bool = False, cp_group=None, grads_averaged_over_cp: bool = False,
          cache_dtype: Optional[str] = None) -> torch.nn.Module:
    """Route a DeepSeek-V3.2 / V4 transformers model through dsa's ops (in place; returns it).

    - ``sas``: every layer's attention core runs in ``dsa_sparse_attention`` (V3.2 with
      ``kv_b_proj`` absorbed; V4 with window, compressed entries and sinks).
    - ``li``: the indexer's scores and top-k run in ``dsa_indexer``.
    - ``compressor``: V4's CSA/HCA pooling (attention's and indexer's) runs in ``dsa_compressor``.
    - ``indexer_loss``: ``None``; ``"sparse"`` (``dsa_kl_loss`` per layer from the attention's
      own softmax statistics); ``"dense"`` (V3.2 dense warm-up: dense attention and
      ``dsa_dense_indexer_kl_loss``). Needs ``sas=True``. The loss reaches the indexer's
      parameters through the ordinary ``loss.backward()``, scaled by ``loss_coefficient``;
      ``indexer_losses(model)`` reads each layer's value.
    - ``strict``: raise :class:`PatchFallbackError` instead of running the model's own
      forward where dsa cannot run a call exactly.
    - ``cp_group``: a ``torch.distributed`` process group to run the model context
      parallel over (docs/context_parallel.md, "Model level"): each rank calls
      ``model(**cp_batch(model, local_input_ids, doc_ends))`` on its contiguous run of the
      packed stream. Needs ``sas=True``, ``li=True`` and ``compressor=True``. Under CP a
      call dsa cannot run exactly raises :class:`PatchFallbackError` (there is no
      fallback: the model's own attention would see this rank's keys only). With
      ``output_router_logits=True`` (V4's MoE balance loss) ``out.aux_loss`` is this
      rank's share, its expert statistics summed over the group.
    - ``cache_dtype``: the storage of the :class:`DsaCache` that ``generate()`` creates for a
      patched DeepSeek-V3.2 model (``"fp32"``, ``"bf16"``, ``"fp8"``; None: the model's
      dtype). docs/serving.md, "Generation".
    - ``grads_averaged_over_cp``: the gradients will be *averaged* over the CP ranks (a
      DDP whose group includes CP); every loss share (``out.loss`` and the indexer KL) is
      then scaled by W. Default: the caller sums them.

    The environment variable ``DSA_PATCH`` overrides the flags: ``off``, ``all``, or a
    comma list of ``sas``, ``li``, ``compressor``, ``loss=sparse``, ``loss=dense``, ``strict``.
    """
    opts = options_from_env(Options(bool(sas), bool(li), bool(compressor), indexer_loss, float(loss_coefficient),
                                    backend, bool(strict), cache_dtype), env_value())
    from ...paged_cache import CACHE_DTYPES
    if opts.cache_dtype is not None and opts.cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype: expected None or one of {CACHE_DTYPES}, got {opts.cache_dtype!r}")
    if opts.indexer_loss not in INDEXER_LOSSES:
        raise ValueError(f"indexer_loss: expected None, 'sparse' or 'dense', got {opts.indexer_loss!r}")
    if opts.indexer_loss is not None and not opts.sas:
        raise ValueError("indexer_loss needs sas=True: its teacher is the patched attention's softmax statistics")
    if opts.backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {opts.backend!r}")
    if cp_group is not None:
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("cp_group: torch.distributed is not initialised (init_process_group first)")
        if not (opts.sas and opts.li and opts.compressor):
            raise ValueError("cp_group: context parallelism needs sas=True, li=True and compressor=True (the "
                             "model's own attention, indexer or pooling would see this rank's rows only); got "
                             f"sas={opts.sas}, li={opts.li}, compressor={opts.compressor}")
    elif grads_averaged_over_cp:
        raise ValueError("grads_averaged_over_cp: only with cp_group")
    if is_patched(model):
        unpatch(model)

    state = PatchState(opts, cp_group=cp_group, cp_grads_averaged=bool(grads_averaged_over_cp))
    found = 0
    for kind, mod in _families():
        attention_cls = mod.DeepseekV32Attention if kind == "v32" else mod.DeepseekV4Attention
        for name, module in model.named_modules():
            if not isinstance(module, attention_cls):
                continue
            found += 1
            if kind == "v32":
                from . import _v32
                if opts.sas:
                    _bind(module, _v32.attention_forward, state, name)
                elif opts.li:
                    _bind(module.indexer, _v32.indexer_forward, state, name + ".indexer")
            else:
                from . import _v4
                if opts.indexer_loss == "dense":
                    raise ValueError("indexer_loss='dense' is DeepSeek-V3.2's warm-up; V4 has no dense stage")
                if opts.sas:
                    _bind(module, _v4.attention_forward, state, name)
                    continue
                comp = module.compressor
                if comp is not None and opts.compressor:
                    _bind(comp, _v4.compressor_forward, state, name + ".compressor")
                if comp is not None and opts.li and isinstance(comp, mod.DeepseekV4CSACompressor):
                    _bind(comp.indexer, _v4.indexer_forward, state, name + ".compressor.indexer")
    if found == 0:
        raise ValueError(f"patch: {type(model).__name__} holds no DeepSeek-V3.2 or DeepSeek-V4 attention module")
    if opts.cache_dtype is not None:
        # Only a DsaCache stores in cache_dtype, and generate() creates one for a model
        # patched with sas and li only: elsewhere the choice would be lost.
        why = "sas=False or li=False (generate() keeps transformers' cache)" if not (opts.sas and opts.li) else None
        if why is not None:
            message = f"patch: cache_dtype={opts.cache_dtype!r} is not honoured: {why}"
            if opts.strict:
                raise ValueError(message)
            warnings.warn(message, stacklevel=2)
    if opts.sas:
        # transformers then builds no dense mask: the layers read what it would build one from.
        from . import _mask
        _mask.install(model)
    if hasattr(model, "_prepare_cache_for_generation"):
        # generate() then caches in dsa's paged caches (DsaCache) where it can.
        from ._cache import prepare_cache_for_generation
        model._prepare_cache_for_generation = types.MethodType(prepare_cache_for_generation, model)
    if cp_group is not None:
        from . import _cp
        state.cp_hooks = _cp.install_balance_loss(model, state)
    setattr(model, _STATE_ATTR, state)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: every module gets its class's forward back, every config its
    attention implementation."""
    from . import _mask
    _mask.uninstall(model)
    for module in model.modules():
        if "_dsa_state" in module.__dict__:
            module.__dict__.pop("forward", None)
            del module._dsa_state
            del module._dsa_name
    model.__dict__.pop("_prepare_cache_for_generation", None)
    if _STATE_ATTR in model.__dict__:
        for hook in model.__dict__[_STATE_ATTR].cp_hooks:
            hook.remove()
        delattr(model, _STATE_ATTR)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return _STATE_ATTR in model.__dict__


def _state(model) -> PatchState:
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        raise ValueError("model is not patched by dsa.integrations.transformers.patch")
    return state


def cp_batch(model: torch.nn.Module, input_ids: torch.Tensor, doc_ends, labels: Optional[torch.Tensor] = None,
             ignore_index: int = -100, balance: str = "contiguous") -> dict:
    """The keyword arguments of one context-parallel call: ``model(**cp_batch(...))``.

    Collective over the patch's ``cp_group`` (every rank calls it, then the model).
    ``input_ids``: this rank's rows of the packed token stream, ``[T_r]`` or ``[1, T_r]``.
    ``balance="contiguous"``: a contiguous run, in rank order (uneven runs allowed, each
    at least one token). ``balance="zigzag"``: the stream cut into 2W chunks, rank r
    holding chunks r and 2W-1-r (an early and a late one: the causal attention work
    evens out over the ranks on long documents); take them with
    ``dsa.cp.shard_rows(global_ids, dsa.cp.zigzag_tnd_shard(doc_ends, group=group))``.
    The results equal the contiguous form's.
    ``doc_ends``: the GLOBAL cumulative document ends, the same on every rank (checked).
    ``labels``: this rank's run of the labels, unshifted as for ``model(labels=...)``
    (default: ``input_ids``); they are shifted over the whole stream, as transformers
    shifts a single-process packed row (mask the first token of each document with
    ``ignore_index`` to stop a document predicting the next one).

    Returns ``input_ids``, ``position_ids`` (each row's position in its document, for
    RoPE), ``labels``, ``shift_labels``, ``num_items_in_batch`` (the global target count:
    ``out.loss`` is this rank's share of the global mean loss), ``use_cache=False`` and
    the shard. Sum the shares (``dsa.cp.loss_for_logging``) to log the loss; sum the
    parameters' gradients over the CP ranks."""
    from . import _cp

    state = _state(model)
    if state.cp_group is None:
        raise ValueError("cp_batch: the model is not patched with a cp_group (patch(model, cp_group=group))")
    return _cp.cp_batch(state, input_ids, doc_ends, labels, ignore_index, balance)


def indexer_losses(model: torch.nn.Module) -> dict:
    """Each layer's latest indexer loss (detached fp32 scalars), keyed by attention module name.
    Under context parallelism: this rank's share (sum the ranks' values for the loss)."""
    return dict(_state(model).indexer_losses)


def track_indexer_recall(model: torch.nn.Module, enabled: bool = True) -> None:
    """From the next call on, each patched V4 CSA layer measures its indexer recall@k
    (see _metrics.py: attention mass on the selection / on the attention's own top k)."""
    _state(model).track_recall = bool(enabled)


def indexer_recall(model: torch.nn.Module) -> dict:
    """Each tracked layer's latest indexer recall@k (a float, None when no row had more
    visible entries than k), keyed by attention module name."""
    return dict(_state(model).indexer_recall)


def fallback_counts(model: torch.nn.Module) -> dict:
    """How many module calls ran the model's own forward, by reason."""
    return dict(_state(model).fallbacks)


def options(model: torch.nn.Module) -> Options:
    return _state(model).options


def __getattr__(name):
    # DsaCache subclasses transformers' Cache: imported on first use, so that importing
    # this package does not import transformers.
    if name == "DsaCache":
        from ._cache import DsaCache
        return DsaCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
