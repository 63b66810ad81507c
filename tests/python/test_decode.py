"""The decode operators over paged caches (dsa_indexer_decode,
dsa_sparse_attention_decode) against the prefill ops on the gathered rows, an
independent float64 torch oracle, and the reference backend: random block
tables, ragged context lengths, next_n 1-4, bf16 / FP8 / fp32 caches, V3.2 and
V4 modes, 1 and 2 threads bit for bit."""
from __future__ import annotations

import math

import pytest
import torch

import _tolerance
import dsa
from dsa import dsa_cache_gather, dsa_cache_write, dsa_indexer, dsa_indexer_decode, dsa_sparse_attention
from dsa import dsa_sparse_attention_decode, new_paged_cache


def paged(values: list[torch.Tensor], *, rope_dim: int, dtype: str, block_size: int, seed: int, ring_width=None):
    """Writes each request's rows [n_b, dim] into a fresh paged cache through a
    shuffled block table (no block shared); returns (cache, table)."""
    g = torch.Generator().manual_seed(seed)
    B, dim = len(values), values[0].shape[-1]
    width = ring_width or max(1, max(math.ceil(v.shape[0] / block_size) for v in values))
    ids = torch.randperm(B * width + 3, generator=g)[: B * width].to(torch.int32).view(B, width)
    cache = new_paged_cache(B * width + 3, dim, rope_dim=rope_dim, dtype=dtype, block_size=block_size)
    for b, v in enumerate(values):
        n = v.shape[0]
        first = max(0, n - width * block_size) if ring_width else 0
        pos = torch.arange(first, n, dtype=torch.int32).view(1, -1)
        dsa_cache_write(cache, ids[b: b + 1], pos, v[first:].unsqueeze(0), rope_dim=rope_dim, dtype=dtype,
                        ring=bool(ring_width))
    return cache, ids


def gathered(cache, table, n, *, dim, rope_dim, dtype, out_dtype, first=0, ring=False):
    pos = torch.arange(first, n, dtype=torch.int32).view(1, -1)
    return dsa_cache_gather(cache, table, pos, dim=dim, rope_dim=rope_dim, dtype=dtype, ring=ring,
                            out_dtype=out_dtype)[0]


def torch_dtype(cache_dtype, query_dtype):
    return torch.bfloat16 if query_dtype == torch.bfloat16 and cache_dtype != "fp32" else torch.float32


class IndexerDecodeCase:
    """One dsa_indexer_decode call over a paged index-key cache (random block table,
    ragged context lengths) and, per request, the same rows as a dsa_indexer call on
    the keys the cache holds (`prefill(b)`)."""

    def __init__(self, g, cache_dtype, qdtype, ctx, *, next_n, heads, dim, topk, block_size, cmp_ratio, scale, seed):
        self.ctx, self.next_n, self.dim, self.cache_dtype, self.cmp_ratio = ctx, next_n, dim, cache_dtype, cmp_ratio
        keys = [torch.randn(c // cmp_ratio, dim, generator=g) for c in ctx]
        self.cache, self.table = paged(keys, rope_dim=0, dtype=cache_dtype, block_size=block_size, seed=seed)
        self.q = torch.randn(len(ctx), next_n, heads, dim, generator=g).to(qdtype)
        self.w = torch.rand(len(ctx), next_n, heads, generator=g).to(qdtype)
        self.lens = torch.tensor(ctx, dtype=torch.int32)
        self.kw = dict(topk=topk, scale=scale, cmp_ratio=cmp_ratio)
        # The dtype the op scores in: bf16 queries over bf16 / FP8 keys in bf16, else fp32.
        self.score_dtype = torch_dtype(cache_dtype, qdtype)

    def call(self, **extra):
        return dsa_indexer_decode(self.q, self.w, self.cache, self.table, self.lens, **self.kw,
                                  cache_dtype=self.cache_dtype, **extra)

    def prefill(self, b):
        """(index_query, keys, weights, keywords) of the dsa_indexer call that selects
        request b's rows from the keys the cache holds, in the op's score dtype."""
        dt, c = self.score_dtype, self.ctx[b]
        k = gathered(self.cache, self.table[b: b + 1], c // self.cmp_ratio, dim=self.dim, rope_dim=0,
                     dtype=self.cache_dtype, out_dtype=dt)
        return self.q[b].to(dt), k, self.w[b].to(dt), dict(self.kw, query_lengths=[0, self.next_n],
                                                            key_lengths=[0, c])


@pytest.mark.parametrize("cache_dtype,qdtype", [("bf16", torch.bfloat16), ("fp8", torch.bfloat16),
                                                ("fp32", torch.float32), ("bf16", torch.float32)])
@pytest.mark.parametrize("next_n", [1, 3])
@pytest.mark.parametrize("cmp_ratio", [1, 4])
def test_indexer_decode_equals_the_prefill_indexer_on_gathered_keys(cache_dtype, qdtype, next_n, cmp_ratio):
    ctx = [next_n + 5, 97, 300]
    if cmp_ratio > 1:
        ctx = [max(c, cmp_ratio * next_n + 4) for c in ctx]
    case = IndexerDecodeCase(torch.Generator().manual_seed(next_n * 10 + cmp_ratio), cache_dtype, qdtype, ctx,
                             next_n=next_n, heads=8, dim=64, topk=24, block_size=16, cmp_ratio=cmp_ratio, scale=0.3,
                             seed=1)
    got, ref = case.call(), case.call(backend="reference")
    for b in range(len(ctx)):
        q, k, w, kwargs = case.prefill(b)
        want = dsa_indexer(q, k, w, **kwargs)
        assert torch.equal(got[b], want), (b, got[b], want)
        # The reference scores in float64: the same selection up to near ties.
        for j in range(next_n):
            a, r = set(got[b, j].tolist()) - {-1}, set(ref[b, j].tolist()) - {-1}
            assert len(a ^ r) <= 2, (b, j, a ^ r)


def test_indexer_decode_splits_one_long_request_and_threads_agree():
    g = torch.Generator().manual_seed(5)
    Hi, Di, topk = 16, 128, 512
    ctx = [20000]
    keys = [torch.randn(ctx[0], Di, generator=g)]
    cache, table = paged(keys, rope_dim=0, dtype="fp8", block_size=64, seed=2)
    q = torch.randn(1, 2, Hi, Di, generator=g).bfloat16()
    w = torch.rand(1, 2, Hi, generator=g).bfloat16()
    lens = torch.tensor(ctx, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dsa_indexer_decode(q, w, cache, table, lens, topk=topk, cache_dtype="fp8")
        torch.set_num_threads(2)
        two = dsa_indexer_decode(q, w, cache, table, lens, topk=topk, cache_dtype="fp8")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    k = gathered(cache, table, ctx[0], dim=Di, rope_dim=0, dtype="fp8", out_dtype=torch.bfloat16)
    want = dsa_indexer(q[0], k, w[0], topk=topk, query_lengths=[0, 2], key_lengths=[0, ctx[0]])
    assert torch.equal(one[0], want)


def oracle_attention(q, keys, d_v, scale, sinks=None, dtype=torch.float64):
    """q [H, D], keys [n, D] -> out [H, d_v], lse [H], computed in `dtype` the way plain
    torch does: float64 is the oracle; the decode op's compute dtype, its naive peer."""
    q, keys = q.to(dtype), keys.to(dtype)
    if keys.shape[0] == 0:
        return torch.zeros(q.shape[0], d_v, dtype=dtype), torch.full((q.shape[0],), -math.inf, dtype=dtype)
    logits = scale * q @ keys.T
    m = logits.max(dim=1, keepdim=True).values
    e = torch.exp(logits - m)
    s = e.sum(dim=1, keepdim=True)
    denom = s + (torch.exp(sinks.to(dtype).view(-1, 1) - m) if sinks is not None else 0)
    return (e @ keys[:, :d_v]) / denom, (m + torch.log(s)).squeeze(1)


MODES = ["v32_sparse", "dense", "window", "v4_csa", "v4_hca"]


class AttentionDecodeCase:
    """One dsa_sparse_attention_decode call over paged caches and what it attends:
    V3.2 (indices with -1, past-the-row and repeated entries; per-request topk_lens,
    entries past them never read), dense, window, V4 CSA / HCA (a ring of raw rows,
    a compressed cache, sinks). `kw` holds the call's keywords."""

    def __init__(self, g, mode, cache_dtype, qdtype, ctx, *, next_n, heads, dim, d_v, rope, block_size, topk,
                 ratio, window, cmp_topk, seed, q_exponent=0, key_exponent=0):
        B, D, bs = len(ctx), dim, block_size
        self.ctx, self.next_n, self.dim, self.d_v, self.rope, self.cache_dtype = ctx, next_n, D, d_v, rope, cache_dtype
        self.v4 = v4 = mode.startswith("v4")
        self.ratio = ratio if v4 else 1
        self.window = window if mode == "window" or v4 else None
        self.ring_rows = ((window - 1 + bs - 1) // bs + 1 + (next_n + bs - 1) // bs) * bs if v4 else None
        kscale = 2.0 ** key_exponent  # magnitudes: queries and keys scaled by powers of two
        self.cache, self.table = paged([torch.randn(c, D, generator=g) * kscale for c in ctx], rope_dim=rope,
                                       dtype=cache_dtype, block_size=bs, seed=seed,
                                       ring_width=self.ring_rows // bs if v4 else None)
        self.q = (torch.randn(B, next_n, heads, D, generator=g) * 2.0 ** q_exponent).to(qdtype)
        self.lens = torch.tensor(ctx, dtype=torch.int64)
        self.kw = kw = dict(scale=D ** -0.5, d_v=d_v, rope_dim=rope, cache_dtype=cache_dtype)
        self.idx = self.topk_lens = self.cmp_cache = self.cmp_table = self.cmp_idx = self.sinks = None
        if mode == "v32_sparse":
            self.idx = torch.stack([torch.randint(-1, c, (next_n, topk), generator=g, dtype=torch.int32)
                                    for c in ctx])
            self.topk_lens = torch.randint(0, topk + 1, (B,), generator=g, dtype=torch.int32)
            for b in range(B):
                self.idx[b, :, int(self.topk_lens[b]):] = 10 ** 6  # past topk_lens: never read
            kw.update(indices=self.idx, topk_lens=self.topk_lens)
        if self.window is not None:
            kw.update(window=self.window, ring=v4)
        if v4:
            self.cmp_cache, self.cmp_table = paged([torch.randn(c // ratio, D, generator=g) * kscale for c in ctx],
                                                   rope_dim=rope, dtype=cache_dtype, block_size=bs, seed=seed + 1)
            self.sinks = torch.randn(heads, generator=g)
            kw.update(cmp_cache=self.cmp_cache, cmp_block_table=self.cmp_table, cmp_ratio=ratio, sinks=self.sinks)
            if mode == "v4_csa":
                self.cmp_idx = torch.stack([torch.randint(-1, c // ratio, (next_n, cmp_topk), generator=g,
                                                          dtype=torch.int32) for c in ctx])
                kw.update(cmp_indices=self.cmp_idx)

    def call(self, **extra):
        return dsa_sparse_attention_decode(self.q, self.cache, self.table, self.lens, **self.kw, **extra)

    def keys(self, b):
        """Request b's raw rows as the cache holds them (fp32; zeros before a ring's
        first held row) and its compressed rows (or None)."""
        n, D = self.ctx[b], self.dim
        first = max(0, n - self.ring_rows) if self.v4 else 0
        keys = torch.zeros(n, D)
        keys[first:] = gathered(self.cache, self.table[b: b + 1], n, dim=D, rope_dim=self.rope,
                                dtype=self.cache_dtype, out_dtype=torch.float32, first=first, ring=self.v4)
        cmp_keys = (gathered(self.cmp_cache, self.cmp_table[b: b + 1], n // self.ratio, dim=D, rope_dim=self.rope,
                             dtype=self.cache_dtype, out_dtype=torch.float32) if self.v4 else None)
        return keys, cmp_keys

    def attended(self, b, j, keys, cmp_keys):
        """The rows query row j of request b attends, in order (repeats repeated)."""
        pos = self.ctx[b] - self.next_n + j
        if self.idx is not None:
            sel = [int(i) for i in self.idx[b, j, : int(self.topk_lens[b])] if 0 <= i <= pos]
        else:
            sel = list(range(max(0, pos - self.window + 1) if self.window else 0, pos + 1))
        rows = [keys[sel]]
        if self.v4:
            visible = (pos + 1) // self.ratio
            rows.append(cmp_keys[[int(i) for i in self.cmp_idx[b, j] if 0 <= i < visible]
                                 if self.cmp_idx is not None else list(range(visible))])
        return torch.cat(rows)

    def expected(self, dtype=torch.float64):
        """(out, lse) [B, next_n, H, d_v] / [B, next_n, H] by oracle_attention in `dtype`."""
        B, H = self.q.shape[0], self.q.shape[2]
        out = torch.zeros(B, self.next_n, H, self.d_v, dtype=dtype)
        lse = torch.zeros(B, self.next_n, H, dtype=dtype)
        for b in range(B):
            keys, cmp_keys = self.keys(b)
            for j in range(self.next_n):
                out[b, j], lse[b, j] = oracle_attention(self.q[b, j].float(), self.attended(b, j, keys, cmp_keys),
                                                        self.d_v, self.kw["scale"], self.sinks, dtype)
        return out, lse


def check_attention_rule(case, results):
    """Each (out, lse) of `results` {what: (out, lse)} for `case` under docs/testing.md's
    rule against the float64 oracle on the rows the cache holds; the peer is the same
    attention in plain torch, in the dtype the op computes in."""
    want, want_lse = case.expected()
    peer = case.expected(torch_dtype(case.cache_dtype, case.q.dtype))[0]
    assert_attention_rule(want, want_lse, peer, case.q.dtype, results)


def assert_attention_rule(want, want_lse, peer, qdtype, results):
    """check_attention_rule on the float64 oracle's (out, lse) and the peer's out."""
    peer_err = (peer.to(qdtype).double() - want).abs().max().item()
    limit = _tolerance.bound(qdtype == torch.float32, want.abs().max().item(), peer_err)
    fin = torch.isfinite(want_lse)
    for what, (out, lse) in results.items():
        err = (out.double() - want).abs().max().item()
        assert err <= limit, (what, err, limit, peer_err)
        # lse is fp32 from the same rounded inputs: the fp32 rule, -inf where no key is seen.
        lse = lse.double()
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), what
        if fin.any():
            lse_err = (lse[fin] - want_lse[fin]).abs().max().item()
            assert lse_err <= _tolerance.bound(True, want_lse[fin].abs().max().item(), None), (what, lse_err)


# (cache dtype, query dtype) pairs the decode attention op runs.
ATTENTION_DTYPES = [("bf16", torch.bfloat16), ("fp8", torch.bfloat16), ("fp32", torch.float32),
                    ("fp32", torch.bfloat16)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cache_dtype,qdtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_sparse_attention_decode_against_prefill_oracle_and_reference(mode, cache_dtype, qdtype, next_n):
    g = torch.Generator().manual_seed(MODES.index(mode) * 7 + next_n)
    case = AttentionDecodeCase(g, mode, cache_dtype, qdtype, [next_n + 3, 75, 1500], next_n=next_n, heads=8, dim=96,
                               d_v=64, rope=32, block_size=16, topk=40, ratio=4, window=24, cmp_topk=12, seed=3)
    out, lse = case.call()
    ref_out, ref_lse = case.call(backend="reference")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out1, lse1 = case.call()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out1, out) and torch.equal(lse1, lse)

    check_attention_rule(case, {"cpu": (out, lse), "reference": (ref_out, ref_lse)})
    # The rule's fp32 term scales with max |out|; this test's element-wise bounds stay
    # (the tighter of the two binds).
    tol = dict(atol=2e-2, rtol=2e-2) if qdtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    want, want_lse = case.expected()
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ref_out.double(), want, **tol)
    if mode != "v32_sparse":
        return
    # The prefill op on the gathered rows (one request, its next_n rows).
    kdt = torch_dtype(cache_dtype, qdtype)
    for b, c in enumerate(case.ctx):
        if case.topk_lens[b] == 0:
            continue  # the prefill op takes no empty index lists
        keys = case.keys(b)[0]
        pre = dsa_sparse_attention(case.q[b].to(kdt), keys.to(kdt),
                                   case.idx[b, :, : int(case.topk_lens[b])].contiguous(), scale=case.kw["scale"],
                                   d_v=case.d_v, query_lengths=[0, next_n], key_lengths=[0, c])
        pre_out = pre[0] if isinstance(pre, tuple) else pre
        torch.testing.assert_close(out[b].to(kdt), pre_out, **tol)


def poison(case, where, value):
    """Puts `value` into one element of request 1's query row, of 3 of its cached raw
    rows (the newest, in every mode's reach), of 3 compressed rows, or of sink 1."""
    if where == "query":
        case.q[1, 1, 2, 7] = value
    elif where == "sink":
        case.sinks[1] = value
    else:
        cmp = where == "cmp_kv"
        keys = case.keys(1)[1 if cmp else 0]
        cache, table = (case.cmp_cache, case.cmp_table) if cmp else (case.cache, case.table)
        for p in ((0, 3, 10) if cmp else (case.ctx[1] - 1, case.ctx[1] - 5, case.ctx[1] - 30)):
            row = keys[p].clone()
            row[3] = value
            dsa_cache_write(cache, table[1:2], torch.tensor([[p]], dtype=torch.int32), row.view(1, 1, -1),
                            rope_dim=case.rope, dtype=case.cache_dtype, ring=case.v4 and not cmp)


@pytest.mark.parametrize("mode,where", [(m, w) for m in MODES for w in ("query", "kv", "cmp_kv", "sink")
                                         if m.startswith("v4") or w in ("query", "kv")])
def test_non_finite_data_lands_where_the_oracle_puts_it(mode, where):
    """NaN and +-inf in a query, cached rows or a sink: both backends put NaN and
    infinities in out and lse exactly where the float64 oracle on the cached rows
    does, the rest under docs/testing.md's rule. Found by it: an infinite key element
    against a query of the other sign (logit -inf) weighed exp(-87) on the vector
    paths, so its value made the output inf, not NaN; and a +inf sink made the fused
    head NaN where the mass all goes to the sink (outputs 0)."""
    for cache_dtype, qdtype in [("bf16", torch.bfloat16), ("fp8", torch.bfloat16), ("fp32", torch.float32)]:
        for value in (math.nan, math.inf, -math.inf):
            g = torch.Generator().manual_seed(MODES.index(mode))
            case = AttentionDecodeCase(g, mode, cache_dtype, qdtype, [5, 75, 300], next_n=2, heads=4, dim=96, d_v=64,
                                       rope=32, block_size=16, topk=40, ratio=4, window=24, cmp_topk=12, seed=3)
            poison(case, where, value)
            want, want_lse = case.expected()
            bad = ~torch.isfinite(want)
            if where == "sink" and not math.isnan(value):  # -inf: no sink; +inf: the head's outputs are 0
                assert not bad.any() and (value < 0 or not want[:, :, 1].any())
            else:
                assert bad.any(), "the case must reach an output"
            for backend in ("cpu", "reference"):
                out, lse = case.call(backend=backend)
                what = (backend, cache_dtype, value)
                for got, exp in ((out.double(), want), (lse.double(), want_lse)):
                    assert torch.equal(torch.isnan(got), torch.isnan(exp)), what
                    inf = torch.isinf(exp)
                    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], exp[inf]), what
                fin = ~bad
                torch.testing.assert_close(out.double()[fin], want[fin], atol=2e-2 if qdtype == torch.bfloat16
                                           else 2e-5, rtol=2e-2 if qdtype == torch.bfloat16 else 2e-5)


def test_sparse_attention_decode_batch_one_uses_every_thread_with_the_same_bits():
    g = torch.Generator().manual_seed(9)
    H, D, dv, topk = 16, 576, 512, 2048
    ctx = [6000]
    cache, table = paged([torch.randn(ctx[0], D, generator=g)], rope_dim=64, dtype="fp8", block_size=64, seed=5)
    q = torch.randn(1, 1, H, D, generator=g).bfloat16()
    idx = torch.randperm(ctx[0], generator=g)[:topk].sort().values.to(torch.int32).view(1, 1, topk)
    lens = torch.tensor(ctx, dtype=torch.int32)
    kw = dict(scale=D ** -0.5, d_v=dv, rope_dim=64, cache_dtype="fp8", indices=idx)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(dsa_sparse_attention_decode(q, cache, table, lens, **kw))
    finally:
        torch.set_num_threads(threads)
    for o, l in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(l, outs[0][1])
    keys = gathered(cache, table, ctx[0], dim=D, rope_dim=64, dtype="fp8", out_dtype=torch.float32)
    want, want_lse = oracle_attention(q[0, 0].float(), keys[idx[0, 0].long()], dv, D ** -0.5)
    torch.testing.assert_close(outs[0][0][0, 0].double(), want, atol=2e-2, rtol=2e-2)
    peer = oracle_attention(q[0, 0].float(), keys[idx[0, 0].long()], dv, D ** -0.5, dtype=torch.bfloat16)[0]
    assert_attention_rule(want, want_lse, peer, q.dtype, {"every thread count": (outs[0][0][0, 0], outs[0][1][0, 0])})


def test_decode_errors_name_the_argument():
    cache, table = paged([torch.randn(40, 64)], rope_dim=0, dtype="bf16", block_size=16, seed=0)
    q = torch.randn(1, 1, 4, 64).bfloat16()
    lens = torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match="context_lens"):
        dsa_sparse_attention_decode(q, cache, table, torch.tensor([49], dtype=torch.int32), scale=1.0)
    bad = table.clone()
    bad[0, 1] = 1000
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]"):
        dsa_sparse_attention_decode(q, cache, bad, lens, scale=1.0)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="no block"):
        dsa_sparse_attention_decode(q, cache, bad, lens, scale=1.0)
    with pytest.raises(ValueError, match="context_lens"):
        dsa_sparse_attention_decode(torch.randn(1, 3, 4, 64).bfloat16(), cache, table,
                                    torch.tensor([2], dtype=torch.int32), scale=1.0)
    with pytest.raises(ValueError, match="d_v"):
        dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0, d_v=65)
    for bad_scale in (math.nan, math.inf):  # found by test_properties: a NaN output, no error
        with pytest.raises(ValueError, match="scale"):
            dsa_sparse_attention_decode(q, cache, table, lens, scale=bad_scale)
        with pytest.raises(ValueError, match="scale"):
            dsa_indexer_decode(q, torch.rand(1, 1, 4).bfloat16(), cache, table, lens, topk=4, scale=bad_scale)
    # V4's compressed cache has a block table of its own, and its errors say so.
    bad = table.clone()
    bad[0, 0] = 1000
    with pytest.raises(ValueError, match=r"cmp_block_table\[0, 0\] = 1000"):
        dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0, cmp_cache=cache, cmp_block_table=bad,
                                    cmp_ratio=4)
    with pytest.raises(ValueError, match="cmp_ratio"):
        dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0, cmp_ratio=4)
    with pytest.raises(ValueError, match="window"):
        dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0, window=4,
                                    indices=torch.zeros(1, 1, 2, dtype=torch.int32))
    # A position the request does not hold (a global slot passed as a position, say).
    with pytest.raises(ValueError, match=r"indices\[0, 0, 1\] = 40"):
        dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0,
                                    indices=torch.tensor([[[3, 40]]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indices\[0, 0, 0\] = -2"):
        dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0,
                                    indices=torch.tensor([[[-2, 4]]], dtype=torch.int32))
    # Past topk_lens the entries are not read.
    dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0, indices=torch.tensor([[[3, 40]]], dtype=torch.int32),
                                topk_lens=torch.tensor([1], dtype=torch.int32))
    w = torch.rand(1, 1, 4).bfloat16()
    with pytest.raises(ValueError, match="context_lens"):
        dsa_indexer_decode(q, w, cache, table, torch.tensor([80], dtype=torch.int32), topk=4)
    with pytest.raises(ValueError, match="weights"):
        dsa_indexer_decode(q, torch.rand(1, 1, 5), cache, table, lens, topk=4)
    with pytest.raises(ValueError, match="key_cache"):
        dsa_indexer_decode(q, w, cache, table, lens, topk=4, cache_dtype="fp8")


def test_a_ring_refuses_positions_it_no_longer_holds():
    bs, width = 8, 2
    cache, table = paged([torch.randn(40, 32)], rope_dim=0, dtype="bf16", block_size=bs, seed=0, ring_width=width)
    q = torch.randn(1, 1, 2, 32).bfloat16()
    lens = torch.tensor([40], dtype=torch.int32)
    dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0, window=9, ring=True)
    with pytest.raises(ValueError, match="ring block_table"):
        dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0, window=30, ring=True)
    with pytest.raises(ValueError, match="left the ring"):
        dsa_sparse_attention_decode(q, cache, table, lens, scale=1.0, ring=True,
                                    indices=torch.tensor([[[3, 39]]], dtype=torch.int32))


def test_decode_ops_pass_opcheck_and_compile_to_the_eager_bits():
    """Eager calls skip torch.library's dispatch (dsa.decode._eager); the custom ops stay
    what traced and compiled code runs: opcheck passes, and torch.compile(fullgraph)
    gives the eager call's bits."""
    from dsa.decode import _indexer_decode_op, _sparse_attention_decode_op
    from dsa.paged_cache import _cache_write_op
    g = torch.Generator().manual_seed(5)
    ctx, Hi, Di, H, D, rope = [40, 70], 4, 64, 16, 96, 32
    keys = [torch.randn(c, Di, generator=g) for c in ctx]
    rows = [torch.randn(c, D, generator=g) for c in ctx]
    kcache, ktable = paged(keys, rope_dim=0, dtype="bf16", block_size=16, seed=2)
    cache, table = paged(rows, rope_dim=rope, dtype="fp8", block_size=16, seed=3)
    iq = torch.randn(2, 1, Hi, Di, generator=g).bfloat16()
    iw = torch.rand(2, 1, Hi, generator=g).bfloat16()
    q = torch.randn(2, 1, H, D, generator=g).bfloat16()
    lens = torch.tensor(ctx, dtype=torch.int32)
    torch.library.opcheck(_indexer_decode_op, (iq, iw, kcache, ktable, lens, 8, 0.3, 1, "bf16", "cpu"))
    idx = dsa_indexer_decode(iq, iw, kcache, ktable, lens, topk=8, scale=0.3)
    torch.library.opcheck(_sparse_attention_decode_op, (q, cache, table, lens, idx, None, None, None, None, None,
                                                        0.1, 64, 0, 1, rope, "fp8", False, "fp8", "cpu"))
    scratch = cache.clone()
    torch.library.opcheck(_cache_write_op, (scratch, table, torch.tensor([[3], [5]]), torch.randn(2, 1, D).bfloat16(),
                                            rope, "fp8", False, "cpu"))

    def step(iq, iw, q):
        i = dsa_indexer_decode(iq, iw, kcache, ktable, lens, topk=8, scale=0.3)
        return dsa_sparse_attention_decode(q, cache, table, lens, scale=0.1, d_v=64, indices=i, rope_dim=rope,
                                           cache_dtype="fp8")

    eager = step(iq, iw, q)
    compiled = torch.compile(step, fullgraph=True)(iq, iw, q)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_model_parameters_take_the_eager_path():
    """A model's parameters (V4's sinks and position_bias) are plain tensors to the eager
    check, and under no_grad (generate) a requires_grad flag does not send a decode call
    through torch.library; with autograd recording it still does (torch's behaviour)."""
    from dsa._common import plain_eager
    from dsa.decode import _eager
    p, t = torch.nn.Parameter(torch.zeros(3)), torch.zeros(3)
    assert plain_eager(p, t, None)
    assert not _eager(p, t)
    with torch.no_grad():
        assert _eager(p, t)
    with torch.device("meta"):
        assert not plain_eager(torch.nn.Parameter(torch.zeros(3)))


def test_eager_calls_are_named_in_a_profile():
    """An eager call (no torch.library dispatch) is still the op's named range in a
    torch.profiler trace, as a custom-op call is: dsa-train's per-op time reads them."""
    from torch.profiler import profile
    from dsa.decode import dsa_compressor_append, new_compressor_state
    kv, gate, bias = torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.nn.Parameter(torch.randn(4, 8))
    state = new_compressor_state(1, 4, 8, overlap=True)
    with torch.no_grad(), profile() as prof:
        dsa_compressor_append(kv, gate, bias, *state, torch.tensor([3]), ratio=4)
    names = [e.name for e in prof.events()]
    assert "dsa::compressor_append" in names, names
