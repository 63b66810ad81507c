"""Shards for context parallelism: which rows a rank holds and how the ops run on them.

Notation (docs/context_parallel.md): W ranks; the packed stream of T tokens is split
contiguously, rank r holding global rows ``[o_r, E_r)``; document i spans ``[s_i, e_i)``.
Every rank runs the normal ops on its local queries against the *prefix* ``[0, E_r)`` of
the gathered key stream, keeping every document (empty segments allowed), so bottom-right
alignment (docs/ops.md section 1) supplies the causal offset and the kernels need no CP
knowledge.

Both layouts answer one interface, ``Shard``: the op calls a rank makes (query slice and
lengths), the query part and key prefix each call reads, the positions and validity of the
local queries, and the rows of a global tensor. ``dsa.cp``'s op wrappers ask only that
interface, so a new split (a ring, a head split) is a new ``Shard``, not a new branch in
every wrapper. The metadata is integer math; only ``gather`` runs a collective.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

__all__ = ["Shard", "OpCall", "TNDShard", "ZigzagTNDShard", "ZigzagShard", "CompressorPlan"]


def _check_ends(doc_ends: Sequence[int], name: str = "doc_ends") -> tuple[int, ...]:
    if isinstance(doc_ends, torch.Tensor):
        doc_ends = doc_ends.tolist()
    ends = []
    for v in doc_ends:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: lengths must be integers, got {v!r}")
        ends.append(v)
    if not ends:
        raise ValueError(f"{name}: expected at least one document, got an empty list")
    prev = 0
    for v in ends:
        if v < prev:
            raise ValueError(f"{name}: cumulative ends must be non-decreasing and >= 0, got {ends}")
        prev = v
    return tuple(ends)


@dataclass(frozen=True)
class OpCall:
    """One op call of a rank: its queries (``query_slice`` of the local sequence axis;
    None: all of them) and the cumulative (TND) or per-row (BSND) query and key lengths."""
    query_slice: Optional[slice]
    query_lengths: list[int]
    key_lengths: list[int]
    # Raw key rows this call reads, where a rank's calls read different prefixes of the
    # gathered keys (ZigzagTNDShard: the TND ops want the keys to end where the lengths
    # do); None: all of ``Shard.key_prefix``.
    key_end: Optional[int] = None


class Shard(ABC):
    """What the CP op wrappers ask of a split (implemented by ``TNDShard`` and
    ``ZigzagShard``). ``layout``: the ops' layout; ``seq_dim``: the sequence axis of a
    token tensor; ``token_dims``: how many leading axes index a token (1 TND, 2 BSND)."""
    layout: str
    seq_dim: int
    token_dims: int
    # How dsa.cp.compressor runs V4's compressor on this split: "halo" (each entry by the
    # rank holding its block's last token) or "replicated" (every rank the whole stream).
    compressor_form: str
    rank: int
    world_size: int
    group: Optional[object]

    @abstractmethod
    def op_calls(self) -> list[OpCall]:
        """The op calls this rank makes, each with its query slice and lengths."""

    @abstractmethod
    def key_rows(self, ratio: int = 1) -> tuple[int, int]:
        """(rows of the gathered key tensor, rows of it this rank's calls read) for raw
        keys (ratio 1) or compressed entries of the given ratio."""

    @abstractmethod
    def rows_of(self, x_global: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global tensor (for data loaders and tests)."""

    @abstractmethod
    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """Differentiable all-gather of a key-side tensor into natural global order."""

    @abstractmethod
    def query_positions(self, device=None) -> torch.Tensor:
        """Position in its document (TND) or row (BSND) of every local query."""

    @abstractmethod
    def query_valid(self, device=None) -> torch.Tensor:
        """Which local query rows are tokens (not BSND padding)."""

    # -- shared by every layout, built on the above ------------------------------------------
    def has_no_queries(self, query: torch.Tensor) -> bool:
        """True where this rank holds no query token at all (the op calls would be empty)."""
        return query.shape[self.seq_dim] == 0

    def query_part(self, t: Optional[torch.Tensor], call: OpCall) -> Optional[torch.Tensor]:
        """The queries of one call. A ``[:, chunk]`` slice of ``[B, 2c, ...]`` is not
        batch-mergeable for B > 1, which the ops need: one copy of the chunk (its gradient
        flows back through it)."""
        if t is None or call.query_slice is None:
            return t
        return t[:, call.query_slice].contiguous() if self.seq_dim == 1 else t[call.query_slice]

    def key_prefix(self, t: Optional[torch.Tensor], name: str, ratio: int = 1) -> Optional[torch.Tensor]:
        """The part of a gathered key tensor this rank's calls read, after checking that it
        is the gathered one (``rows_total`` along the sequence axis)."""
        if t is None:
            return None
        total, used = self.key_rows(ratio)
        if t.shape[self.seq_dim] != total:
            raise ValueError(f"{name}: expected the gathered tensor ({total} rows along dim {self.seq_dim}), "
                             f"got shape {list(t.shape)}; pass dsa.cp.gather(...) of the local rows")
        return t.narrow(self.seq_dim, 0, used)

    def call_keys(self, t: Optional[torch.Tensor], call: OpCall, ratio: int = 1) -> Optional[torch.Tensor]:
        """The rows of ``key_prefix(t)`` one call reads: raw keys (ratio 1) or compressed
        entries of ``ratio`` up to the call's ``key_end``; the prefix itself where the call
        names no end."""
        if t is None or call.key_end is None:
            return t
        rows = call.key_end if ratio == 1 else self._cmp_before(call.key_end, ratio)
        return t.narrow(self.seq_dim, 0, rows)


def check_shard(shard) -> "Shard":
    if not isinstance(shard, Shard):
        raise ValueError(f"shard: expected a TNDShard, ZigzagTNDShard or ZigzagShard (dsa.cp.tnd_shard / "
                         f"zigzag_tnd_shard / zigzag_shard), "
                         f"got {type(shard).__name__}")
    return shard


@dataclass(frozen=True)
class CompressorPlan:
    """What rank r computes of a compressor of ratio m (owner-computes rule: an entry is
    computed by the rank holding the last token of its block).

    ``halo_start``: first global row of the local compressor input; rows
    ``[halo_start, row_start)`` come from earlier ranks (at most m-1 rows, 2m-1 with overlap).
    ``segment_ends``: cumulative ends (relative to ``halo_start``) of the per-document
    segments of ``[halo_start, row_end)``; ``drop``: leading entries of the local call that
    another rank owns (the overlap's previous block, recomputed only to be discarded);
    ``owned``: entries this rank contributes; ``owned_counts``: every rank's ``owned``
    (their concatenation in rank order is the global compressed stream)."""
    ratio: int
    overlap: bool
    halo_start: int
    segment_ends: tuple[int, ...]
    drop: int
    owned: int
    owned_counts: tuple[int, ...]
    max_halo: int                 # rows of its tail every rank sends for halos


class _PackedStream:
    """What a TND split knows of the global packed stream (``doc_ends``, ``total_rows``):
    document starts, compressed-entry counts and ends, positions in documents."""
    doc_ends: tuple[int, ...]

    @property
    def doc_starts(self) -> tuple[int, ...]:
        return (0,) + self.doc_ends[:-1]

    def _cmp_before(self, row: int, ratio: int) -> int:
        """Global compressed entries whose block ends before ``row`` (i.e. the prefix count)."""
        return sum(min(max(row - s, 0), e - s) // ratio for s, e in zip(self.doc_starts, self.doc_ends))

    def cmp_total(self, ratio: int) -> int:
        _check_ratio(ratio)
        return self._cmp_before(self.doc_ends[-1], ratio)

    def cmp_ends(self, ratio: int) -> list[int]:
        """Global compressed cumulative ends (per document ``L_i // m``)."""
        _check_ratio(ratio)
        out, acc = [], 0
        for s, e in zip(self.doc_starts, self.doc_ends):
            acc += (e - s) // ratio
            out.append(acc)
        return out

    def cmp_positions(self, ratio: int, device=None) -> torch.Tensor:
        """RoPE position ``w * m`` (document coordinates) of every global compressed entry."""
        _check_ratio(ratio)
        parts = [torch.arange((e - s) // ratio, dtype=torch.int64) * ratio
                 for s, e in zip(self.doc_starts, self.doc_ends)]
        pos = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return pos if device is None else pos.to(device)

    def _doc_positions(self, start: int, end: int) -> torch.Tensor:
        """Position inside its document of every global row in ``[start, end)``."""
        pos = torch.empty(end - start, dtype=torch.int64)
        for s, e in zip(self.doc_starts, self.doc_ends):
            a, b = max(s, start), min(e, end)
            if a < b:
                pos[a - start:b - start] = torch.arange(a - s, b - s)
        return pos



@dataclass(frozen=True)
class TNDShard(_PackedStream, Shard):
    """A contiguous split of a packed TND stream over ``world_size`` ranks.

    ``doc_ends``: the global cumulative document ends (spec form, no leading 0), identical
    on every rank; ``offsets``: ``o_0 = 0 <= o_1 <= ... <= o_W = T`` (uneven and empty
    runs allowed). Build one with ``dsa.cp.tnd_shard`` (which all-gathers the local row
    counts and checks that all ranks agree) or directly for single-process use.
    """
    rank: int
    world_size: int
    doc_ends: tuple[int, ...]
    offsets: tuple[int, ...]
    group: Optional[object] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "doc_ends", _check_ends(self.doc_ends))
        offs = tuple(int(v) for v in self.offsets)
        object.__setattr__(self, "offsets", offs)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={self.world_size}, got {self.rank}")
        if len(offs) != self.world_size + 1 or offs[0] != 0 or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError(f"offsets: expected W+1 non-decreasing row offsets from 0, got {list(offs)}")
        if offs[-1] != self.doc_ends[-1]:
            raise ValueError(f"doc_ends: the last end ({self.doc_ends[-1]}) must equal the total row count "
                             f"of all ranks ({offs[-1]})")

    # -- rows ----------------------------------------------------------------------------
    @property
    def total_rows(self) -> int:
        return self.offsets[-1]

    @property
    def row_start(self) -> int:
        return self.offsets[self.rank]

    @property
    def row_end(self) -> int:
        return self.offsets[self.rank + 1]

    @property
    def local_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def local_counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.offsets, self.offsets[1:]))

    def runs_of(self, rank: int) -> list[tuple[int, int]]:
        """Global row ranges ``[a, e)`` rank ``rank`` holds (one, or none for an empty run)."""
        a, e = self.offsets[rank], self.offsets[rank + 1]
        return [(a, e)] if e > a else []

    @property
    def runs(self) -> list[tuple[int, int]]:
        return self.runs_of(self.rank)

    # -- the Shard interface -----------------------------------------------------------------
    layout = "TND"
    seq_dim = 0
    token_dims = 1
    compressor_form = "halo"

    def op_calls(self) -> list[OpCall]:
        return [OpCall(None, self.query_lengths, self.key_lengths)]

    def key_rows(self, ratio: int = 1) -> tuple[int, int]:
        if ratio == 1:
            return self.total_rows, self.kv_rows
        return self.cmp_total(ratio), self.cmp_rows(ratio)

    def rows_of(self, x_global: torch.Tensor) -> torch.Tensor:
        return x_global[self.row_start:self.row_end]

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        from .comm import all_gather_rows
        return all_gather_rows(x_local, self.local_counts, self.rank, self.group, 0)

    def query_positions(self, device=None) -> torch.Tensor:
        return self.positions(device)

    def query_valid(self, device=None) -> torch.Tensor:
        return torch.ones(self.local_rows, dtype=torch.bool, device=device)

    # -- lengths for the ops (keep-all-documents form) ------------------------------------
    @property
    def query_lengths(self) -> list[int]:
        """Cumulative ends of the local query segments: ``clamp(ends - o_r, 0, T_r)``."""
        o, t = self.row_start, self.local_rows
        return [min(max(e - o, 0), t) for e in self.doc_ends]

    @property
    def key_lengths(self) -> list[int]:
        """Cumulative ends of the prefix key segments: ``min(ends, E_r)``; the last is ``kv_rows``."""
        return [min(e, self.row_end) for e in self.doc_ends]

    @property
    def kv_rows(self) -> int:
        """Rows of the gathered raw key stream this rank's calls read (the prefix ``[0, E_r)``)."""
        return self.row_end

    def cmp_rows(self, ratio: int) -> int:
        """Rows of the gathered compressed stream this rank's calls read: ``sum_i P_i // m``."""
        _check_ratio(ratio)
        return self._cmp_before(self.row_end, ratio)

    # -- positions ------------------------------------------------------------------------
    def positions(self, device=None) -> torch.Tensor:
        """Position inside its document of every local row (int64 ``[T_r]``, for RoPE)."""
        pos = self._doc_positions(self.row_start, self.row_end)
        return pos if device is None else pos.to(device)

    # -- compressor ownership -------------------------------------------------------------
    def owned_cmp_counts(self, ratio: int) -> tuple[int, ...]:
        """Entries each rank computes: those whose block's last token it holds."""
        _check_ratio(ratio)
        return tuple(self._cmp_before(b, ratio) - self._cmp_before(a, ratio)
                     for a, b in zip(self.offsets, self.offsets[1:]))

    def compressor_plan(self, ratio: int, overlap: bool) -> CompressorPlan:
        _check_ratio(ratio)
        o, end = self.row_start, self.row_end
        halo_start, drop = o, 0
        segments: list[tuple[int, int]] = []
        for s, e in zip(self.doc_starts, self.doc_ends):
            a, b = max(s, o), min(e, end)
            if a >= b:
                continue
            if s < o:
                # The document started on an earlier rank: start the local call at the block
                # holding this rank's first owned entry (and, with overlap, the block before,
                # whose entry is recomputed only to feed the overlap and then dropped).
                w_lo = (o - s) // ratio
                if (b - s) // ratio > w_lo:
                    ov = 1 if overlap and w_lo >= 1 else 0
                    halo_start = s + (w_lo - ov) * ratio
                    drop = ov
                    a = halo_start
            segments.append((a, b))
        ends, acc = [], 0
        for a, b in segments:
            acc += b - a
            ends.append(acc)
        counts = self.owned_cmp_counts(ratio)
        # Entries of the local call must be exactly drop + owned (checked here, cheaply).
        made = sum((b - a) // ratio for a, b in segments)
        if made != drop + counts[self.rank]:
            raise AssertionError(f"compressor plan: {made} local entries, expected {drop} + {counts[self.rank]}")
        return CompressorPlan(ratio, overlap, halo_start, tuple(ends), drop, counts[self.rank], counts,
                              (2 * ratio - 1) if overlap else (ratio - 1))


@dataclass(frozen=True)
class ZigzagTNDShard(_PackedStream, Shard):
    """Causal load balance for a packed TND stream: the stream's T rows are cut into 2W
    chunks at rows ``k * T // (2W)``, and rank r holds chunks r and 2W-1-r, in that
    order (one run where they touch, rank W-1). Under causal attention a late row sees
    more keys than an early one, so a contiguous split gives the last rank most of the
    work on a long document; an early and a late chunk each even it out.

    Each run is one op call (keep-all-documents form) that reads the gathered keys up to
    the run's end; the compressor runs replicated (``compressor_form``). Build one with
    ``dsa.cp.zigzag_tnd_shard`` (collective: checks that all ranks pass the same
    ``doc_ends``) or directly; ``rows_of`` picks a rank's rows of the global stream."""
    rank: int
    world_size: int
    doc_ends: tuple[int, ...]
    group: Optional[object] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "doc_ends", _check_ends(self.doc_ends))
        w = self.world_size
        if w < 1 or not 0 <= self.rank < w:
            raise ValueError(f"rank: expected 0 <= rank < world_size={w}, got {self.rank}")
        if self.doc_ends[-1] < 2 * w:
            raise ValueError(f"doc_ends: a zigzag split of {w} ranks cuts the stream into {2 * w} chunks, "
                             f"so it needs at least {2 * w} tokens; the stream has {self.doc_ends[-1]}")

    layout = "TND"
    seq_dim = 0
    token_dims = 1
    compressor_form = "replicated"

    # -- rows ----------------------------------------------------------------------------
    @property
    def total_rows(self) -> int:
        return self.doc_ends[-1]

    def runs_of(self, rank: int) -> list[tuple[int, int]]:
        """Global row ranges ``[a, e)`` rank ``rank`` holds, in its local order."""
        t, n = self.total_rows, 2 * self.world_size
        runs = [(k * t // n, (k + 1) * t // n) for k in (rank, n - 1 - rank)]
        return [(runs[0][0], runs[1][1])] if runs[0][1] == runs[1][0] else runs

    @property
    def runs(self) -> list[tuple[int, int]]:
        return self.runs_of(self.rank)

    @property
    def local_rows(self) -> int:
        return sum(e - a for a, e in self.runs)

    @property
    def local_counts(self) -> tuple[int, ...]:
        return tuple(sum(e - a for a, e in self.runs_of(q)) for q in range(self.world_size))

    @functools.cached_property
    def _natural_index(self) -> torch.Tensor:
        """Row of the rank-major gathered tensor that holds each global row."""
        idx = torch.empty(self.total_rows, dtype=torch.int64)
        base = 0
        for q in range(self.world_size):
            for a, e in self.runs_of(q):
                idx[a:e] = torch.arange(base, base + e - a)
                base += e - a
        return idx

    # -- the Shard interface -----------------------------------------------------------------
    def op_calls(self) -> list[OpCall]:
        calls, local = [], 0
        for a, e in self.runs:
            calls.append(OpCall(slice(local, local + e - a), [min(max(d - a, 0), e - a) for d in self.doc_ends],
                                [min(d, e) for d in self.doc_ends], e))
            local += e - a
        return calls

    def key_rows(self, ratio: int = 1) -> tuple[int, int]:
        end = max(e for _, e in self.runs)
        if ratio == 1:
            return self.total_rows, end
        return self.cmp_total(ratio), self._cmp_before(end, ratio)

    def rows_of(self, x_global: torch.Tensor) -> torch.Tensor:
        return torch.cat([x_global[a:e] for a, e in self.runs])

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        from .comm import all_gather_rows
        g = all_gather_rows(x_local, self.local_counts, self.rank, self.group, 0)
        # Rank-major runs -> natural order (index_select's backward scatters the gradient back).
        return g.index_select(0, self._natural_index.to(x_local.device))

    def positions(self, device=None) -> torch.Tensor:
        """Position inside its document of every local row (int64, for RoPE)."""
        pos = torch.cat([self._doc_positions(a, e) for a, e in self.runs])
        return pos if device is None else pos.to(device)

    def query_positions(self, device=None) -> torch.Tensor:
        return self.positions(device)

    def query_valid(self, device=None) -> torch.Tensor:
        return torch.ones(self.local_rows, dtype=torch.bool, device=device)


def _check_ratio(ratio) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio: expected an integer >= 1, got {ratio!r}")


@dataclass(frozen=True)
class ZigzagCall:
    """One of a rank's two BSND calls: its query chunk and per-row lengths."""
    chunk: int                   # natural chunk index of the queries (0 .. 2W-1)
    query_slice: slice           # rows of the local [B, 2c, ...] tensor
    query_lengths: list[int]     # clamp(L_b - chunk*c, 0, c)
    key_lengths: list[int]       # min(L_b, (chunk+1)*c)


@dataclass(frozen=True)
class ZigzagShard(Shard):
    """BSND zigzag split: the sequence axis (length S, ``S % 2W == 0``) is cut into 2W chunks
    of ``c = S / 2W``; rank r holds natural chunks r and 2W-1-r, in that order, as its local
    ``[B, 2c, ...]``. Gathered key tensors are put back in natural order, so both calls take
    the whole ``[B, S, ...]`` key tensor with explicit key lengths (never None: None would
    mean the full S and push every query to the end of the row)."""
    rank: int
    world_size: int
    seq_len: int
    lengths: tuple[int, ...]     # valid length of each batch row (global)
    group: Optional[object] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        w = self.world_size
        if w < 1 or not 0 <= self.rank < w:
            raise ValueError(f"rank: expected 0 <= rank < world_size={w}, got {self.rank}")
        if self.seq_len % (2 * w):
            raise ValueError(f"seq_len: expected a multiple of 2*world_size={2 * w}, got {self.seq_len}")
        lens = tuple(int(v) for v in self.lengths)
        if not lens or any(v < 0 or v > self.seq_len for v in lens):
            raise ValueError(f"lengths: expected valid row lengths in [0, {self.seq_len}], got {list(lens)}")
        object.__setattr__(self, "lengths", lens)

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.world_size)

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.world_size - 1 - self.rank

    def rank_chunks(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.world_size - 1 - rank

    @property
    def calls(self) -> tuple[ZigzagCall, ZigzagCall]:
        c = self.chunk
        out = []
        for slot, k in enumerate(self.chunks):
            out.append(ZigzagCall(k, slice(slot * c, (slot + 1) * c),
                                  [min(max(n - k * c, 0), c) for n in self.lengths],
                                  [min(n, (k + 1) * c) for n in self.lengths]))
        return tuple(out)

    def gathered_order(self) -> list[int]:
        """Natural chunk index of each chunk of the rank-major gathered tensor."""
        return [k for r in range(self.world_size) for k in self.rank_chunks(r)]

    def local_index(self) -> torch.Tensor:
        """Natural sequence positions of the local rows (int64 ``[2c]``)."""
        c = self.chunk
        return torch.cat([torch.arange(k * c, (k + 1) * c) for k in self.chunks])

    # -- the Shard interface -----------------------------------------------------------------
    layout = "BSND"
    seq_dim = 1
    token_dims = 2
    compressor_form = "replicated"

    def op_calls(self) -> list[OpCall]:
        return [OpCall(call.query_slice, call.query_lengths, call.key_lengths) for call in self.calls]

    def key_rows(self, ratio: int = 1) -> tuple[int, int]:
        # BSND keys may be longer than their valid length: the explicit key lengths bound them.
        return self.seq_len // ratio, self.seq_len // ratio

    def rows_of(self, x_global: torch.Tensor) -> torch.Tensor:
        return x_global.index_select(1, self.local_index().to(x_global.device))

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        from .comm import all_gather_rows
        c = self.chunk
        g = all_gather_rows(x_local, [2 * c] * self.world_size, self.rank, self.group, 1)
        # Rank-major chunks -> natural order (index_select's backward scatters the gradient back).
        order = self.gathered_order()
        inverse = [0] * len(order)
        for slot, k in enumerate(order):
            inverse[k] = slot
        idx = torch.cat([torch.arange(s * c, (s + 1) * c) for s in inverse]).to(x_local.device)
        return g.index_select(1, idx)

    def query_positions(self, device=None) -> torch.Tensor:
        return self.local_index().to(device).unsqueeze(0).expand(len(self.lengths), -1)

    def query_valid(self, device=None) -> torch.Tensor:
        lens = torch.tensor(self.lengths, device=device)[:, None]
        return self.local_index().to(device)[None, :] < lens

    def has_no_queries(self, query: torch.Tensor) -> bool:
        return False  # a zigzag rank always holds its two chunks (padding rows are computed)
