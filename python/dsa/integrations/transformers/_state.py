"""Patch options, the per-model patch state, and the fallback rule."""
from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

INDEXER_LOSSES = (None, "sparse", "dense")
_ENV_FLAGS = ("sas", "li", "compressor")


class PatchFallbackError(RuntimeError):
    """Raised with ``strict=True`` where the patch cannot run a call exactly."""


@dataclass
class Options:
    sas: bool = True
    li: bool = True
    compressor: bool = True
    indexer_loss: Optional[str] = None
    loss_coefficient: float = 1.0
    backend: str = "auto"
    strict: bool = False
    cache_dtype: Optional[str] = None  # DsaCache storage: None = the model's dtype


def options_from_env(opts: Options, value: Optional[str]) -> Options:
    """``DSA_PATCH`` overrides the keyword flags so that a training script switches
    without code changes: ``off``; ``all``; or a comma list of ``sas``, ``li``,
    ``compressor``, ``loss=sparse|dense``, ``strict`` (listed flags on, the others off)."""
    if value is None or value.strip() == "":
        return opts
    tokens = [t.strip().lower() for t in value.split(",") if t.strip()]
    if tokens == ["off"] or tokens == ["0"] or tokens == ["none"]:
        return Options(False, False, False, None, opts.loss_coefficient, opts.backend, opts.strict, opts.cache_dtype)
    new = Options(False, False, False, None, opts.loss_coefficient, opts.backend, False, opts.cache_dtype)
    for t in tokens:
        if t == "all":
            new.sas = new.li = new.compressor = True
        elif t in _ENV_FLAGS:
            setattr(new, t, True)
        elif t.startswith("loss=") or t.startswith("indexer_loss="):
            kind = t.split("=", 1)[1]
            if kind not in ("sparse", "dense"):
                raise ValueError(f"DSA_PATCH: indexer loss must be 'sparse' or 'dense', got {kind!r}")
            new.indexer_loss = kind
        elif t == "strict":
            new.strict = True
        else:
            raise ValueError(f"DSA_PATCH: unknown entry {t!r}; expected off, all, sas, li, compressor, "
                             f"loss=sparse, loss=dense or strict (comma separated)")
    return new


@dataclass
class PatchState:
    """Shared by every patched module of one model."""
    options: Options
    fallbacks: Counter = field(default_factory=Counter)
    warned: set = field(default_factory=set)
    indexer_losses: dict = field(default_factory=dict)
    track_recall: bool = False  # measure indexer recall@k on each call (track_indexer_recall)
    indexer_recall: dict = field(default_factory=dict)
    # (mask tensor, position_ids tensor, extra key, geometry) of the last call: every
    # layer of a forward sees the same mask object, so it is analysed once.
    geometry_cache: list = field(default_factory=list)
    cp_group: Optional[object] = None    # patch(cp_group=...): the context-parallel process group
    cp_grads_averaged: bool = False      # patch(grads_averaged_over_cp=...): the loss shares are scaled by W
    cp_mask_checked: Optional[tuple] = None  # (weakref to the last mask found right, window)
    cp_hooks: list = field(default_factory=list)  # the model's hooks of _cp.install_balance_loss

    def fallback(self, reason: str) -> None:
        """Counts a call that runs the model's own forward; warns once per reason."""
        if self.options.strict:
            raise PatchFallbackError(f"dsa patch cannot run this call exactly: {reason} "
                                     f"(strict=True; pass strict=False to run the model's own forward)")
        self.fallbacks[reason] += 1
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"dsa patch: running the model's own forward for calls with {reason}",
                          stacklevel=_caller_stacklevel())


def _library_dirs() -> tuple:
    import torch
    import transformers
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, transformers)) + (
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,)


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside torch, transformers and dsa: a fallback
    warning then names the user's line (the model call), not torch's module.py."""
    skip = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def env_value() -> Optional[str]:
    return os.environ.get("DSA_PATCH")
