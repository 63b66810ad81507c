"""What a call's mask and positions say about its sequences, in the ops' length terms.

A patched model's attention gets a :class:`._mask.DsaMask` (what transformers would
build the dense mask from: the 2-D padding mask, sizes, the mask function) and the
position ids; a caller may still pass its own dense ``[B, 1, S, Sk]`` mask. The patch
runs a call only if the mask is exactly the one dsa's length rule implies (causal,
optionally a sliding window, right padding, or block-diagonal documents of a packed
row); anything else is a reason to run the model's own forward. Checking the mask
instead of trusting it keeps a custom mask from silently changing the answer. The
DsaMask is read in O(B * T); a dense mask is compared element by element (its size
is the caller's choice).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ._mask import DsaMask, describe, function_reason


@dataclass
class Geometry:
    layout: str              # "BSND" (rows, right padded) or "TND" (packed documents)
    batch: int
    seq: int
    past: int                # raw keys before this call's queries (a cache's content)
    query_lengths: list      # BSND: valid queries per row; TND: cumulative document ends
    key_lengths: list        # same convention, raw keys
    doc_lengths: list        # BSND: valid tokens per row; TND: tokens per document
    doc_starts: Optional[torch.Tensor] = None  # TND: per token, its document's first row position

    @property
    def padded(self) -> bool:
        return self.layout == "BSND" and any(n != self.seq for n in self.doc_lengths)

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> the layout's token tensor (contiguous: the ops merge B and S)."""
        return (x.reshape(self.batch * x.shape[1], *x.shape[2:]) if self.layout == "TND" else x).contiguous()

    def unflat(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(self.batch, self.seq, *y.shape[1:]) if self.layout == "TND" else y

    def compressed_positions(self, ratio: int, rows: int, device) -> torch.Tensor:
        """RoPE positions of the compressed entries: block starts, restarting per document."""
        if self.layout == "BSND":
            return (torch.arange(rows, device=device) * ratio).unsqueeze(0).expand(self.batch, -1)
        parts = [torch.arange(n // ratio, device=device) * ratio for n in self.doc_lengths]
        return torch.cat(parts).unsqueeze(0)


def _documents(position_ids: torch.Tensor, batch: int, seq: int, valid_lengths: list) -> Union[list, str]:
    """Per row, the document lengths the position ids describe (restarts at 0)."""
    pid = position_ids.expand(batch, seq) if position_ids.shape[0] == 1 else position_ids
    rows = []
    for b in range(batch):
        n = valid_lengths[b]
        p = pid[b, :n]
        if n == 0:
            rows.append([])
            continue
        starts = torch.nonzero(p == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            return "position_ids that do not start at 0"
        bounds = starts + [n]
        docs = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        local = torch.cat([torch.arange(d, device=p.device) for d in docs])
        if not torch.equal(p, local.to(p.dtype)):
            return "position_ids that are not 0, 1, 2, ... per document"
        rows.append(docs)
    return rows


def _visibility(batch, seq, keys, past, window, docs_per_row, device) -> torch.Tensor:
    """The [B, S, Sk] mask dsa's rule gives: causal (bottom-right), window, documents."""
    i = torch.arange(seq, device=device).view(1, seq, 1) + past
    j = torch.arange(keys, device=device).view(1, 1, keys)
    vis = j <= i
    if window is not None:
        vis = vis & (j > i - window)
    vis = vis.expand(batch, seq, keys).clone()
    if docs_per_row is not None:
        for b, docs in enumerate(docs_per_row):
            doc_id = torch.repeat_interleave(torch.arange(len(docs), device=device), torch.tensor(docs, device=device))
            if doc_id.numel() < keys:
                doc_id = torch.cat([doc_id, doc_id.new_full((keys - doc_id.numel(),), -1)])
            vis[b] &= doc_id[past:past + seq].view(seq, 1) == doc_id.view(1, keys)
    return vis


def _dense_lengths(mask, batch, seq, past):
    """From a dense [B, (1,) S, Sk] mask: (allowed [B, S, Sk] bool, valid [B, S] bool: the
    query token is not padding), or a reason."""
    if not isinstance(mask, torch.Tensor):
        return "a non-tensor attention mask"
    m = mask[:, 0] if mask.dim() == 4 else mask
    if m.dim() != 3 or m.shape[-2] != seq or m.shape[-1] != past + seq:
        return "an attention mask of unexpected shape"
    m = m.expand(batch, -1, -1)
    if m.dtype == torch.bool:
        allowed = m
    else:
        allowed = m == 0
        blocked = (m == float("-inf")) | (m <= torch.finfo(m.dtype).min)
        if not bool((allowed | blocked).all()):
            return "an additive attention mask with values other than 0 and -inf"
    valid = allowed.diagonal(offset=past, dim1=-2, dim2=-1)  # [B, S]: the query token is not padding
    return allowed, valid


def _prefix_lengths(valid: torch.Tensor, seq: int):
    """Valid-query counts per row, or a reason when the valid queries are not a prefix."""
    lengths = valid.sum(-1)
    prefix = torch.arange(seq, device=valid.device).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(valid, prefix):
        return "left padding or a padding mask that is not a prefix"
    return [int(n) for n in lengths.tolist()]


def _call_documents(position_ids, kwargs, batch, seq, past, lengths):
    """Per row, the documents of a packed call (None: one sequence per row), or a reason.
    From ``cu_seq_lens_q/k`` where given, else from position ids restarting at 0."""
    docs_per_row = None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not torch.equal(cu_k.cpu(), cu.cpu()):
            return "cu_seq_lens_k different from cu_seq_lens_q"
        ends = [int(e) for e in cu.tolist()][1:]
        if past or ends[-1] != batch * seq or any(n != seq for n in lengths):
            return "cu_seq_lens that do not cover the unpadded rows"
        docs_per_row = []
        start = 0
        for b in range(batch):
            row_end = (b + 1) * seq
            row = [e for e in ends if start < e <= row_end]
            if not row or row[-1] != row_end:
                return "cu_seq_lens with a document crossing rows"
            docs_per_row.append([e - s for s, e in zip([b * seq] + row[:-1], row)])
            start = row_end
    elif position_ids is not None and past == 0:
        if position_ids.shape[-1] != seq:
            return "position_ids of unexpected shape"
        docs = _documents(position_ids, batch, seq, lengths)
        if isinstance(docs, str):
            return docs
        if any(len(d) > 1 for d in docs):
            docs_per_row = docs
    elif position_ids is not None:
        pid = position_ids.expand(batch, seq)
        expect = torch.arange(past, past + seq, device=pid.device).unsqueeze(0)
        prefix = torch.arange(seq, device=pid.device).unsqueeze(0) < torch.tensor(lengths, device=pid.device).unsqueeze(1)
        if not bool(((pid == expect) | ~prefix).all()):
            return "position_ids that do not follow the cache"
    if docs_per_row is not None and any(n != seq for n in lengths):
        return "packed rows with padding"
    return docs_per_row


def _geometry(batch, seq, past, lengths, docs_per_row, device) -> Geometry:
    if docs_per_row is None:
        return Geometry("BSND", batch, seq, past, lengths, [n + past for n in lengths], lengths)
    flat_docs = [d for row in docs_per_row for d in row]
    ends, acc = [], 0
    for d in flat_docs:
        acc += d
        ends.append(acc)
    starts = []
    for row in docs_per_row:
        s = 0
        for d in row:
            starts += [s] * d
            s += d
    return Geometry("TND", batch, seq, 0, ends, list(ends), flat_docs,
                    torch.tensor(starts, device=device).view(batch, seq))


def analyse(mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], kwargs: dict, batch: int,
            seq: int, past: int, window: Optional[int]) -> Union[Geometry, str]:
    """The call's Geometry, or the reason (a string) why dsa cannot run it exactly.

    ``mask``: the :class:`._mask.DsaMask` of a patched model (read in O(B * Sk)), or a
    dense mask tensor (a caller's own 4-D mask, or an unregistered implementation's),
    compared element by element with the visibility dsa's rule gives."""
    if mask is None:
        return "no attention mask"
    if isinstance(mask, DsaMask):
        return analyse_compact(mask, position_ids, kwargs, batch, seq, past, window)
    dense = _dense_lengths(mask, batch, seq, past)
    if isinstance(dense, str):
        return dense
    allowed, valid = dense
    lengths = _prefix_lengths(valid, seq)
    if isinstance(lengths, str):
        return lengths
    docs_per_row = _call_documents(position_ids, kwargs, batch, seq, past, lengths)
    if isinstance(docs_per_row, str):
        return docs_per_row
    keys, device = allowed.shape[-1], allowed.device
    expected = _visibility(batch, seq, keys, past, window, docs_per_row, device)
    key_valid = torch.arange(keys, device=device).unsqueeze(0) < (torch.tensor(lengths, device=device) + past).unsqueeze(1)
    expected &= key_valid.unsqueeze(1)
    rows = (torch.arange(seq, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)).unsqueeze(-1)
    if bool(((allowed != expected) & rows).any()):
        ok = False
        if docs_per_row is not None:
            # A packed row whose mask is plain causal: transformers builds that mask when a cache
            # exists (it skips its packed-sequence detection) and then lets documents see each
            # other; the documents the position ids describe are what the caller packed.
            plain = _visibility(batch, seq, keys, past, window, None, device)
            ok = not bool((allowed != plain).any())
        if not ok:
            return "an attention mask dsa cannot express"
    return _geometry(batch, seq, past, lengths, docs_per_row, device)


def _offset(v) -> int:
    return int(v.item()) if isinstance(v, torch.Tensor) else int(v or 0)


def analyse_compact(mask, position_ids, kwargs, batch, seq, past, window) -> Union[Geometry, str]:
    """:func:`analyse` on what transformers would build the dense mask from, in O(B * Sk).

    The dense mask is causal(i, j) [and window] [and same document] and pad[b, j]; it
    is dsa's rule exactly when the mask function is one of those (``_mask.describe``),
    the sizes are this call's, and on every row the padding mask holds the cache (all
    true) and then a prefix of the row's queries: that prefix is the row's length (the
    diagonal the dense analysis reads), and no key a valid query sees is padding."""
    kw = mask.kwargs
    reason = function_reason(mask, window)
    if reason is not None:
        return reason
    if (kw.get("batch_size") != batch or kw.get("q_length") != seq or kw.get("kv_length") != past + seq
            or _offset(kw.get("kv_offset")) != 0 or _offset(kw.get("q_offset")) != past):
        return "an attention mask of unexpected shape"
    pad = mask.attention_mask
    if pad is None:
        lengths = [seq] * batch
    else:
        if not isinstance(pad, torch.Tensor) or pad.dim() != 2 or pad.shape[-1] != past + seq or pad.shape[0] not in (1, batch):
            return "an attention mask of unexpected shape"
        pad = pad.to(torch.bool).expand(batch, -1)
        lengths = _prefix_lengths(pad[:, past:], seq)
        if isinstance(lengths, str):
            return lengths
        if past and not bool(pad[:, :past][torch.tensor(lengths, device=pad.device) > 0].all()):
            return "an attention mask dsa cannot express (padding inside the cache)"
    docs_per_row = _call_documents(position_ids, kwargs, batch, seq, past, lengths)
    if isinstance(docs_per_row, str):
        return docs_per_row
    if describe(kw["mask_function"])[2] and kwargs.get("cu_seq_lens_q") is not None:
        # transformers masks the documents of the position ids; cu_seq_lens must be the same ones.
        own = _documents(position_ids, batch, seq, lengths)
        if own != docs_per_row:
            return "an attention mask dsa cannot express (cu_seq_lens other than the position ids' documents)"
    device = position_ids.device if position_ids is not None else (pad.device if pad is not None else "cpu")
    return _geometry(batch, seq, past, lengths, docs_per_row, device)


def _ref(t):
    return None if t is None else weakref.ref(t)


def _same(ref, t):
    return (ref is None and t is None) or (ref is not None and t is not None and ref() is t)


def cached_analyse(state, mask, position_ids, kwargs, batch, seq, past, window):
    """analyse() once per mask: every layer of a forward (and a checkpointed layer's
    recomputation) gets the same mask object. Weak references: an old mask is freed
    as usual, and a freed one never matches a new tensor."""
    cu = kwargs.get("cu_seq_lens_q")
    key = (batch, seq, past, window)
    for entry in state.geometry_cache:
        if entry[3] == key and _same(entry[0], mask) and _same(entry[1], position_ids) and _same(entry[2], cu):
            return entry[4]
    geom = analyse(mask, position_ids, kwargs, batch, seq, past, window)
    state.geometry_cache.insert(0, (_ref(mask), _ref(position_ids), _ref(cu), key, geom))
    del state.geometry_cache[4:]
    return geom
