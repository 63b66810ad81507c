"""dsa's cache for transformers: a patched model's KV cache in dsa's paged caches.

:class:`DsaCache` is a ``transformers.Cache`` whose layers hold ``dsa.paged_cache``
streams instead of tensors grown by ``torch.cat``: for DeepSeek-V3.2, per layer, the
absorbed-MLA latent (512 + 64 RoPE values per token) and the indexer keys (128), each
request owning blocks through a block table. It tracks every request's own token
count, so padded batches (left or right) cache only their real tokens, each at its
true position: the patched attention compacts a call's valid rows, writes them with
``dsa_cache_write`` and runs the ops on the request's cached rows (docs/serving.md,
"Generation").

``generate()`` on a patched model creates one by itself (``patch`` replaces the
model's ``_prepare_cache_for_generation`` on the instance; ``unpatch`` restores it);
a caller may pass one as ``past_key_values``. Only the patched attention reads or
writes it: a layer call dsa cannot run raises instead of falling back (the model's
own attention cannot read a paged cache). The storage dtype (``cache_dtype``) defaults
to the model's dtype: fp32 for an fp32 model (exact, so greedy generation repeats the
unpatched model's tokens), bf16 for a bf16 model; ``"fp8"`` stores FP8 e4m3.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...decode import new_compressor_state
from ...paged_cache import (CACHE_DTYPES, DEFAULT_BLOCK_SIZE, dsa_cache_gather, dsa_cache_write,
                            new_paged_cache)

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class PagedStream:
    """One paged cache with its block table: blocks are handed out as requests grow,
    and the cache tensor grows (doubling) only when a generate() did not size it."""

    def __init__(self, dim: int, rope_dim: int, cache_dtype: str, block_size: int, batch: int,
                 capacity_tokens: int = 0, ring_tokens: int = 0):
        self.dim, self.rope_dim, self.cache_dtype, self.block_size = dim, rope_dim, cache_dtype, block_size
        # A ring (ring_tokens > 0: V4's window) keeps a fixed row of columns per request,
        # reused cyclically, enough that the last ring_tokens positions are always held.
        self.ring_columns = math.ceil(ring_tokens / block_size) + 1 if ring_tokens > 0 else 0
        blocks = batch * (self.ring_columns or math.ceil(capacity_tokens / block_size))
        self.cache = new_paged_cache(blocks, dim, rope_dim=rope_dim, dtype=cache_dtype, block_size=block_size)
        self.table = torch.full((batch, 0), -1, dtype=torch.int32)
        self.filled = [0] * batch  # leading columns of each request's row that hold a block
        self.used_blocks = 0

    @property
    def ring(self) -> bool:
        return self.ring_columns > 0

    def held_from(self, length: int) -> int:
        """The first position a request of ``length`` tokens still holds (a ring drops older ones)."""
        return max(0, length - (self.ring_columns - 1) * self.block_size) if self.ring else 0

    def reserve(self, lengths: list) -> None:
        """Blocks for the first ``lengths[b]`` tokens of every request. Only columns past
        a request's filled ones are visited: a decode step costs O(1) here, not a walk
        over the request's whole table (which, in Python, cost ~10 ms a step at 64K)."""
        if self.ring:
            lengths = [min(n, self.ring_columns * self.block_size) for n in lengths]
        cols = max([math.ceil(n / self.block_size) for n in lengths] + [0])
        if cols > self.table.shape[1]:
            pad = torch.full((self.table.shape[0], cols - self.table.shape[1]), -1, dtype=torch.int32)
            self.table = torch.cat([self.table, pad], dim=1)
        missing = []
        for b, n in enumerate(lengths):
            missing += [(b, c) for c in range(self.filled[b], math.ceil(n / self.block_size))]
        if not missing:
            return
        need = self.used_blocks + len(missing)
        if need > self.cache.shape[0]:
            grown = new_paged_cache(max(need, 2 * self.cache.shape[0]), self.dim, rope_dim=self.rope_dim,
                                    dtype=self.cache_dtype, block_size=self.block_size)
            grown[: self.cache.shape[0]] = self.cache
            self.cache = grown
        for b, c in missing:
            self.table[b, c] = self.used_blocks
            self.used_blocks += 1
            self.filled[b] = c + 1

    def write(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """``values [B, n, dim]`` at ``positions [B, n]`` (-1: skipped). A ring keeps only
        the positions it still holds after the call, so no slot is written twice."""
        if self.ring:
            ends = positions.max(dim=1, keepdim=True).values + 1
            held = (ends - (self.ring_columns - 1) * self.block_size).clamp(min=0)
            positions = torch.where(positions >= held, positions, torch.full_like(positions, -1))
        dsa_cache_write(self.cache, self.table, positions, values, rope_dim=self.rope_dim, dtype=self.cache_dtype,
                        ring=self.ring)

    def gather(self, lengths: list, out_dtype: torch.dtype) -> torch.Tensor:
        """The first ``lengths[b]`` tokens of every request, packed back to back ([sum, dim])."""
        longest = max(lengths + [0])
        pos = torch.arange(longest).unsqueeze(0).expand(len(lengths), -1).clone()
        pos[pos >= torch.tensor(lengths).unsqueeze(1)] = -1
        # Read back in fp32 (exact for every storage dtype) where the model's dtype is
        # neither fp32 nor bf16 (fp16 models), then cast as the model's own cache would.
        read_dtype = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
        rows = dsa_cache_gather(self.cache, self.table, pos, dim=self.dim, rope_dim=self.rope_dim,
                                dtype=self.cache_dtype, out_dtype=read_dtype)
        return rows[pos >= 0].to(out_dtype)

    @property
    def nbytes(self) -> int:
        return self.used_blocks * self.cache.shape[1] * self.cache.shape[2]


class _DsaLayer(CacheLayerMixin):
    """What every DsaCache layer shares: each request's real token count, the padded
    width transformers counts, and refusals of what a paged cache cannot do."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "DsaCache"):
        super().__init__()
        self.owner = owner
        self.lengths: list = []   # real tokens cached per request
        self.columns = 0          # padded width seen so far (what transformers counts)

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        pass

    def storage_dtype(self, dtype: torch.dtype) -> str:
        return self.owner.cache_dtype or _DTYPE_NAMES.get(dtype, "fp32")

    def update(self, *args, **kwargs):
        raise RuntimeError("DsaCache: only dsa's patched attention writes this cache (the model's own attention "
                           "cannot read paged caches); the model is no longer patched, or this layer fell back")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def streams(self) -> list:
        return []

    def reset(self) -> None:
        self.lengths, self.columns, self.is_initialized = [], 0, False

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the requests at ``indices`` (their block-table rows and lengths)."""
        if not self.is_initialized:
            return
        keep = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        for stream in self.streams():
            stream.table = stream.table[keep].contiguous()
            stream.filled = [stream.filled[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        return keep

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("DsaCache does not copy requests (two requests would write one block); "
                                  "generate() on a patched model uses transformers' cache where it expands a batch")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("DsaCache does not reorder requests (beam search): generate() on a patched "
                                  "model uses it for greedy and sampling, the default cache for beams")

    @property
    def nbytes(self) -> int:
        return sum(stream.nbytes for stream in self.streams())


class DsaV32Layer(_DsaLayer):
    """One DeepSeek-V3.2 layer: the latent KV and the indexer keys of every request."""

    def __init__(self, owner: "DsaCache"):
        super().__init__(owner)
        self.latent: Optional[PagedStream] = None
        self.index_keys: Optional[PagedStream] = None

    def start(self, batch: int, latent_dim: int, rope_dim: int, index_dim: int, dtype: torch.dtype) -> None:
        o = self.owner
        cache_dtype = self.storage_dtype(dtype)
        self.latent = PagedStream(latent_dim, rope_dim, cache_dtype, o.block_size, batch, o.capacity_tokens)
        self.index_keys = PagedStream(index_dim, 0, cache_dtype, o.block_size, batch, o.capacity_tokens)
        self.lengths = [0] * batch
        self.is_initialized = True

    def streams(self) -> list:
        return [s for s in (self.latent, self.index_keys) if s is not None]

    def reset(self) -> None:
        self.latent = self.index_keys = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last ``-tokens_to_remove`` tokens of every request (assisted and
        prompt-lookup decoding reject draft tokens this way). Those columns are rows
        every request cached (generated tokens), so each request loses as many; their
        blocks stay and are overwritten by the next rows."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop: expected a negative count of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > min(self.lengths) or n > self.columns:
            raise ValueError(f"crop: cannot remove {n} tokens from requests holding {self.lengths}")
        self.lengths = [length - n for length in self.lengths]
        self.columns -= n


class Compressor:
    """A V4 compressor's serving state: its dsa_compressor_append state (the tokens its
    next entries pool) and the paged cache of the entries it emitted (after kv_norm
    and RoPE)."""

    def __init__(self, module, overlap: bool, cache_dtype: str, rope_dim: int, block_size: int, batch: int,
                 capacity_tokens: int):
        self.ratio, self.overlap = module.compress_rate, overlap
        channels = module.kv_proj.out_features
        self.state_kv, self.state_gate = new_compressor_state(batch, self.ratio, channels, overlap=overlap)
        self.entries = PagedStream(module.head_dim, rope_dim, cache_dtype, block_size, batch,
                                   math.ceil(capacity_tokens / self.ratio))

    def select(self, keep: list) -> None:
        self.state_kv, self.state_gate = self.state_kv[keep].contiguous(), self.state_gate[keep].contiguous()


class DsaV4Layer(_DsaLayer):
    """One DeepSeek-V4 layer: the window ring of raw keys (the last ``sliding_window``
    tokens and a decode call's rows), and on a compressed layer its compressor's state
    and entries, and (CSA) the indexer's compressor state and compressed keys."""

    def __init__(self, owner: "DsaCache"):
        super().__init__(owner)
        self.window: Optional[PagedStream] = None
        self.compressor: Optional[Compressor] = None
        self.indexer: Optional[Compressor] = None

    def start(self, batch: int, attention, rope_dim: int, dtype: torch.dtype, ring_tokens: int) -> None:
        from ._v4 import _is_csa  # the overlap follows the compressor's class, as the patch decides it
        o = self.owner
        cache_dtype = self.storage_dtype(dtype)
        self.window = PagedStream(attention.head_dim, rope_dim, cache_dtype, o.block_size, batch,
                                  ring_tokens=ring_tokens)
        comp = attention.compressor
        if comp is not None:
            self.compressor = Compressor(comp, _is_csa(comp), cache_dtype, rope_dim, o.block_size, batch,
                                         o.capacity_tokens)
            if _is_csa(comp):
                ix = comp.indexer
                self.indexer = Compressor(ix, True, cache_dtype, 0, o.block_size, batch, o.capacity_tokens)
        self.lengths = [0] * batch
        self.is_initialized = True

    def streams(self) -> list:
        parts = [self.window] + [c.entries for c in (self.compressor, self.indexer) if c is not None]
        return [s for s in parts if s is not None]

    def reset(self) -> None:
        self.window = self.compressor = self.indexer = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("DsaCache: a DeepSeek-V4 layer cannot drop tokens (its compressor state has "
                                  "already pooled them; transformers itself runs no assisted decoding on V4)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        keep = super().batch_select_indices(indices)
        if keep is not None:
            for c in (self.compressor, self.indexer):
                if c is not None:
                    c.select(keep)


class DsaCache(Cache):
    """A patched DeepSeek model's cache in dsa's paged caches (see the module doc).

    ``cache_dtype``: "fp32", "bf16" or "fp8"; None: the model's dtype. ``block_size``:
    tokens per block. ``capacity_tokens``: tokens per request to allocate up front
    (generate() passes its maximum length; 0 grows on demand)."""

    def __init__(self, config, *, cache_dtype: Optional[str] = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 capacity_tokens: int = 0):
        if cache_dtype is not None and cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype: expected one of {CACHE_DTYPES} or None, got {cache_dtype!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected an integer >= 1 (tokens per block), got {block_size!r}")
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 0:
            raise ValueError(f"capacity_tokens: expected an integer >= 0, got {capacity_tokens!r}")
        model_type = getattr(config, "model_type", None)
        if model_type not in _LAYER_KINDS:
            raise ValueError(f"DsaCache: DeepSeek-V3.2 or DeepSeek-V4 models only, got model_type {model_type!r}")
        self.cache_dtype, self.block_size, self.capacity_tokens = cache_dtype, int(block_size), int(capacity_tokens)
        super().__init__(layers=[_LAYER_KINDS[model_type](self) for _ in range(config.num_hidden_layers)])

    def bytes_per_token(self) -> float:
        """Cache bytes per cached token, all layers (blocks partly filled included)."""
        tokens = sum(self.layers[0].lengths) if self.layers and self.layers[0].lengths else 0
        return sum(layer.nbytes for layer in self.layers) / max(tokens, 1)


_LAYER_KINDS = {"deepseek_v32": DsaV32Layer, "deepseek_v4": DsaV4Layer}


def prepare_cache_for_generation(model, generation_config, model_kwargs, generation_mode, batch_size,
                                 max_cache_length):
    """generate()'s cache set-up on a patched V3.2 or V4 model (bound to the instance by
    patch): a DsaCache sized for ``max_cache_length`` tokens per request, where generate()
    would build its default dynamic cache and the patch runs every layer call. Otherwise
    (the caller's own cache, use_cache=False, a cache_implementation, beam search,
    output_attentions) the model's own set-up, unchanged."""
    opts = model._dsa_patch_state.options
    default = (model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False
               or generation_config.cache_implementation is not None
               or max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) > 1
               or generation_config.output_attentions)
    if default or not (opts.sas and opts.li) or getattr(model.config, "model_type", None) not in _LAYER_KINDS:
        return type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, generation_mode,
                                                         batch_size, max_cache_length)
    model_kwargs["past_key_values"] = DsaCache(model.config.get_text_config(decoder=True),
                                               cache_dtype=opts.cache_dtype, capacity_tokens=max_cache_length)
