"""Property tests (hypothesis): random valid configurations of every op match the
float64 oracle within the docs/testing.md tolerance rule, forward and backward, on both
backends; random bad configurations raise ValueError naming the argument and leave
inputs (and, at the C++ boundary, the caller's outputs) untouched.

The example budget is fixed and the search derandomized (`derandomize=True`, no
example database), so CI runs the same examples every time in bounded time. The
checks themselves are the suites' own (test_sparse_attention, test_indexer,
test_kl_loss, test_compressor): these tests only widen the inputs they see.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dsa
from _indices import fold_into_sequences
from dsa import _C, dsa_compressor_append
from dsa._common import handoff
from dsa.lengths import cu_seqlens_from_ends, lengths_from_ends
from dsa.naive import naive_compressor

import _tolerance
import test_compressor
import test_compressor_append
import test_decode
import test_indexer
import test_kl_loss
import test_paged_cache
import test_sparse_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# DSA_PROPERTY_SCALE=N multiplies every budget: a longer search by hand (docs/hardening.md);
# CI runs the budgets as written.
SCALE = int(os.environ.get("DSA_PROPERTY_SCALE", "1"))


def budget(examples: int):
    """Fixed, derandomized example budget; the shapes are small, so no deadline."""
    return settings(max_examples=examples * SCALE, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def lengths(draw, max_seqs=3, max_len=40, max_prefix=12, min_seqs=1, min_tokens=0):
    """(q_lens, k_lens) per sequence: empty and one-token documents are likely,
    and a key length may exceed its query length (prefix KV, Lq <= Lk). The KL
    oracles need min_tokens=1: at T = 0 their loss is a constant without autograd graph."""
    n = draw(st.integers(min_seqs, max_seqs))
    length = st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, max_len))
    q = [draw(length) for _ in range(n)]
    if sum(q) < min_tokens:
        q[draw(st.integers(0, n - 1))] += min_tokens
    k = [lq + draw(st.one_of(st.just(0), st.integers(0, max_prefix))) for lq in q]
    return q, k


# ------------------------------------------------------------ sparse attention

@st.composite
def attention_cases(draw):
    """make_case keyword arguments for one valid call: V3.2 (explicit indices, with
    -1, out-of-range and duplicate entries; optional rope), dense causal, and V4
    (window + compressed part with ratio, optional cmp indices, sinks)."""
    layout = draw(st.sampled_from(["TND", "BSND"]))
    q_lens, k_lens = draw(lengths())
    spec = dict(layout=layout, q_lens=tuple(q_lens), k_lens=tuple(k_lens), seed=draw(st.integers(0, 2**16)),
                heads=draw(st.sampled_from([1, 2, 3, 5])), dim=draw(st.sampled_from([4, 16, 17, 32, 40])),
                dtype=draw(st.sampled_from(DTYPES)))
    family = draw(st.sampled_from(["v32", "dense", "v4"]))
    if family == "v32":
        spec.update(mode="indices", topk=draw(st.sampled_from([1, 3, 8, 20])))
        if draw(st.booleans()):
            spec["rope"] = draw(st.sampled_from([4, 8]))
    else:
        spec["mode"] = "dense"
        if draw(st.booleans()):
            spec["window"] = draw(st.integers(1, 12))
    if family == "v4":
        spec["ratio"] = draw(st.sampled_from([2, 4, 7]))
        if draw(st.booleans()):
            spec["cmp_topk"] = draw(st.integers(1, 6))
    if family != "v32" or draw(st.booleans()):
        if draw(st.booleans()):
            spec["sinks"] = draw(st.sampled_from(["random", float("-inf"), 0.0, 30.0]))
    if draw(st.booleans()):
        spec["d_v"] = draw(st.integers(1, spec["dim"]))
    return spec


@budget(24)
@given(attention_cases())
def test_sparse_attention_matches_oracle(spec):
    inputs, kw = test_sparse_attention.make_case(**spec)
    test_sparse_attention.check_against_oracle(inputs, kw)


# --------------------------------------------------------------------- indexer

@st.composite
def indexer_cases(draw):
    layout = draw(st.sampled_from(["TND", "BSND"]))
    ratio = draw(st.sampled_from([1, 1, 4, 5]))
    q_lens, k_lens = draw(lengths(max_len=50))
    if ratio > 1:
        entries = [n // ratio for n in k_lens]
    else:
        entries = k_lens
    case = test_indexer.Case(
        "property", q_lens, k_lens, heads=draw(st.sampled_from([1, 2, 3, 8])),
        dim=draw(st.sampled_from([8, 16, 33, 64])), topk=draw(st.sampled_from([1, 2, 5, 16, 70])),
        layout=layout, ratio=ratio, scale=draw(st.sampled_from([1.0, 0.3])),
        sq=max(q_lens), sk=max(entries), key_head_dim=draw(st.booleans()))
    return case, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**16))


# Found by this test: a BSND call with Sq = 0 was rejected as "dims not
# mergeable" (torch gives such a tensor stride(0) = H * D, not 0).
@example((test_indexer.Case("bsnd_empty", [0], [0], heads=1, dim=8, topk=1, layout="BSND"), torch.float32, 0))
@example((test_indexer.Case("bsnd_empty_rows", [0, 0], [3, 0], heads=2, dim=8, topk=2, layout="BSND", sk=3),
          torch.bfloat16, 1))
@budget(30)
@given(indexer_cases())
def test_indexer_matches_oracle(case_dtype_seed):
    case, dtype, seed = case_dtype_seed
    q, k, w, kwargs = test_indexer.make_inputs(case, dtype, seed=seed)
    for backend in test_indexer.BACKENDS:
        indices, scores = dsa.dsa_indexer(q, k, w, return_scores=True, backend=backend, **kwargs)
        test_indexer.check_selection(indices, scores, q, k, w, kwargs, what=f"{case}/{dtype}/{backend}")


# ----------------------------------------------------------- sparse KL loss

def _user_lengths(q_lens, k_lens, layout):
    if layout == "TND":
        return (torch.tensor(q_lens).cumsum(0).tolist(), torch.tensor(k_lens).cumsum(0).tolist())
    return list(q_lens), list(k_lens)


@st.composite
def sparse_kl_inputs(draw):
    """An input dict of the shape test_kl_loss.sparse_inputs makes, of random size."""
    layout = draw(st.sampled_from(["TND", "BSND"]))
    ratio = draw(st.sampled_from([1, 1, 4]))
    q_lens, k_lens = draw(lengths(max_len=24, min_tokens=1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    H, D, Hi, Di = draw(st.sampled_from([1, 3])), draw(st.sampled_from([8, 32])), draw(st.sampled_from([1, 4])), 16
    K = draw(st.sampled_from([1, 4, 9]))
    rope = ratio == 1 and draw(st.booleans())
    rows = [n // ratio for n in k_lens] if ratio > 1 else k_lens
    if layout == "TND":
        qs, ks = (sum(q_lens),), (sum(rows),)
    else:
        qs, ks = (len(q_lens), max(q_lens)), (len(q_lens), max(rows))
    ql, kl = _user_lengths(q_lens, k_lens, layout)
    hi = max(2, max(rows) + 2)
    return dict(q=torch.randn(*qs, H, D, generator=g), kv=torch.randn(*ks, D, generator=g),
                qr=torch.randn(*qs, H, 8, generator=g) if rope else None,
                kr=torch.randn(*ks, 8, generator=g) if rope else None,
                iq=torch.randn(*qs, Hi, Di, generator=g), ik=torch.randn(*ks, Di, generator=g),
                w=torch.rand(*qs, Hi, generator=g) * 1.5 - 0.5,
                idx=fold_into_sequences(torch.randint(-2, hi, (*qs, K), generator=g, dtype=torch.int32),
                                        q_lens, rows, layout),
                sinks=torch.randn(H, generator=g) * 2, ql=ql, kl=kl), layout, ratio


@budget(16)
@given(sparse_kl_inputs(), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_sparse_kl_loss_matches_oracle(drawn, dtype, sinks):
    x, layout, ratio = drawn
    x = test_kl_loss.rounded(x, dtype)
    kw = dict(cmp_ratio=ratio, layout=layout, loss_coefficient=0.9, sinks=sinks)
    oracle = test_kl_loss.run_sparse(x, test_kl_loss.naive_kl_loss, torch.float64, **kw)
    naive = None if dtype == torch.float32 else test_kl_loss.run_sparse(x, test_kl_loss.naive_kl_loss, dtype, **kw)
    for backend in test_kl_loss.BACKENDS:
        fused = test_kl_loss.run_sparse(x, dsa.dsa_kl_loss, dtype, backend=backend, **kw)
        for i, name in enumerate(["loss", "d_index_query", "d_index_key", "d_weights"]):
            test_kl_loss.check(f"{backend}/{name}", fused[i], None if naive is None else naive[i], oracle[i])


# ------------------------------------------------------------ dense KL loss

@st.composite
def dense_kl_inputs(draw):
    layout = draw(st.sampled_from(["TND", "BSND"]))
    q_lens, k_lens = draw(lengths(max_len=20, min_tokens=1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    H = draw(st.sampled_from([1, 2, 4]))
    Hk = draw(st.sampled_from([h for h in (1, 2, 4) if H % h == 0]))
    D, Hi, Di = draw(st.sampled_from([8, 24])), draw(st.sampled_from([1, 3])), draw(st.sampled_from([8, 16]))
    rope = draw(st.booleans())
    if layout == "TND":
        qs, ks = (sum(q_lens),), (sum(k_lens),)
    else:
        qs, ks = (len(q_lens), max(q_lens)), (len(q_lens), max(k_lens))
    ql, kl = _user_lengths(q_lens, k_lens, layout)
    return dict(iq=torch.randn(*qs, Hi, Di, generator=g), ik=torch.randn(*ks, Di, generator=g),
                w=torch.rand(*qs, Hi, generator=g) - 0.3, q=torch.randn(*qs, H, D, generator=g),
                k=torch.randn(*ks, Hk, D, generator=g),
                qr=torch.randn(*qs, H, 8, generator=g) if rope else None,
                kr=torch.randn(*ks, Hk, 8, generator=g) if rope else None, ql=ql, kl=kl, layout=layout)


@budget(12)
@given(dense_kl_inputs(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_dense_kl_loss_matches_oracle(x, dtype):
    x = test_kl_loss.rounded(x, dtype)
    oracle = test_kl_loss.run_dense(x, torch.float64, loss_coefficient=1.1)
    naive = None if dtype == torch.float32 else test_kl_loss.run_dense(x, dtype, loss_coefficient=1.1)
    for backend in test_kl_loss.BACKENDS:
        fused = test_kl_loss.run_dense(x, dtype, backend=backend, loss_coefficient=1.1)
        for i, name in enumerate(["indexer_lse", "loss", "d_index_query", "d_index_key", "d_head_weights"]):
            test_kl_loss.check(f"{backend}/{name}", fused[i], None if naive is None else naive[i], oracle[i])


# ---------------------------------------------------------------- compressor

@st.composite
def compressor_cases(draw):
    layout = draw(st.sampled_from(["TND", "BSND"]))
    ratio = draw(st.sampled_from([1, 2, 3, 4, 16]))
    overlap = draw(st.booleans())
    c = draw(st.sampled_from([3, 8, 17, 40]))
    n = draw(st.integers(1, 4))
    raw = [draw(st.one_of(st.integers(0, 2 * ratio + 1), st.integers(0, 60))) for _ in range(n)]
    if layout == "TND":
        shape, lengths_arg = (sum(raw),), torch.tensor(raw).cumsum(0).tolist()
    else:
        shape, lengths_arg = (n, max(raw)), raw
    return dict(shape=shape, channels=(2 if overlap else 1) * c, ratio=ratio, overlap=overlap,
                lengths=lengths_arg, layout=layout, dtype=draw(st.sampled_from(DTYPES)),
                seed=draw(st.integers(0, 2**16)))


@budget(24)
@given(compressor_cases())
def test_compressor_matches_oracle(case):
    kv, gate, bias = test_compressor.make_inputs(case["shape"], case["channels"], case["ratio"], case["dtype"],
                                                 seed=case["seed"])
    for backend in ("cpu", "reference"):
        test_compressor.check_against_oracle(kv, gate, bias, ratio=case["ratio"], overlap=case["overlap"],
                                             lengths=case["lengths"], layout=case["layout"], backend=backend)


# ------------------------------------------------------------- decode indexer

@st.composite
def decode_indexer_cases(draw):
    """test_decode.IndexerDecodeCase's arguments: every cache / query dtype pair, block
    sizes 1-64, 1-3 requests of ragged length (down to rows that see no compressed
    entry), next_n 1-4, index heads 1-8, odd and short key dims, cmp_ratio 1 / 4 / 5,
    top-k from 1 to more keys than a request has."""
    next_n = draw(st.integers(1, 4))
    ratio = draw(st.sampled_from([1, 1, 4, 5]))
    ctx = [draw(st.integers(next_n, 200)) for _ in range(draw(st.integers(1, 3)))]
    cache_dtype, qdtype = draw(st.sampled_from([("bf16", torch.bfloat16), ("fp8", torch.bfloat16),
                                                ("fp32", torch.float32), ("bf16", torch.float32),
                                                ("fp8", torch.float32), ("fp32", torch.bfloat16)]))
    return dict(cache_dtype=cache_dtype, qdtype=qdtype, ctx=ctx, next_n=next_n,
                heads=draw(st.sampled_from([1, 3, 8])), dim=draw(st.sampled_from([8, 33, 64, 128])),
                topk=draw(st.sampled_from([1, 5, 16, 70, 256])), block_size=draw(st.sampled_from([1, 4, 16, 64])),
                cmp_ratio=ratio, scale=draw(st.sampled_from([1.0, 0.3])), seed=draw(st.integers(0, 2**16)))


@budget(20)
@given(decode_indexer_cases())
def test_indexer_decode_matches_oracle(case):
    """Both backends' selections under docs/testing.md's top-k rule against the float64
    oracle on the keys the cache holds; the fused backend also equals dsa_indexer on
    them bit for bit (docs/serving.md)."""
    c = dict(case)
    call = test_decode.IndexerDecodeCase(torch.Generator().manual_seed(c["seed"]), c.pop("cache_dtype"),
                                         c.pop("qdtype"), c.pop("ctx"), **c)
    for backend in ("cpu", "reference"):
        got = call.call(backend=backend)
        assert got.shape == (len(case["ctx"]), case["next_n"], case["topk"]) and got.dtype == torch.int32
        for b in range(len(case["ctx"])):
            q, k, w, kwargs = call.prefill(b)
            test_indexer.check_selection(got[b], None, q, k, w, kwargs, what=f"{backend} request {b}")
            if backend == "cpu":
                assert torch.equal(got[b], dsa.dsa_indexer(q, k, w, **kwargs)), b


# -------------------------------------------------------- compressor append

@st.composite
def compressor_append_cases(draw):
    """1-3 requests of 0-60 tokens appended over random calls, each request taking
    0 to all of its remaining tokens per call (so entries complete mid-call, across
    calls and not at all), with noise rows past them; ratio 1-16, overlap, odd
    channel counts, every dtype."""
    ratio = draw(st.sampled_from([1, 2, 3, 4, 16]))
    overlap = draw(st.booleans())
    lengths = [draw(st.one_of(st.integers(0, 3 * ratio + 1), st.integers(0, 60)))
               for _ in range(draw(st.integers(1, 3)))]
    left, schedule = list(lengths), []
    while any(left) or not schedule:
        counts = [draw(st.integers(0, r)) if r else 0 for r in left]
        left = [r - k for r, k in zip(left, counts)]
        schedule.append(counts)
        if len(schedule) >= 6:  # then the rest at once
            schedule.append(left)
            break
    c = draw(st.sampled_from([3, 8, 17, 40]))
    return dict(ratio=ratio, overlap=overlap, lengths=lengths, schedule=schedule,
                channels=(2 if overlap else 1) * c, pad=draw(st.integers(0, 3)), dtype=draw(st.sampled_from(DTYPES)),
                seed=draw(st.integers(0, 2**16)))


@budget(24)
@given(compressor_append_cases())
def test_compressor_append_matches_oracle(case):
    """Both backends: each request's entries under docs/testing.md's rule against the
    float64 one-shot compressor on its whole sequence (peer: the naive compressor in
    the inputs' dtype); in fp32, dsa_compressor's entries bit for bit (docs/serving.md)."""
    ratio, overlap, lengths, dtype = case["ratio"], case["overlap"], case["lengths"], case["dtype"]
    kv, gate, bias = test_compressor.make_inputs((len(lengths), max(lengths)), case["channels"], ratio, dtype,
                                                 seed=case["seed"])
    kwargs = dict(ratio=ratio, overlap=overlap)
    for backend in ("cpu", "reference"):
        got = test_compressor_append.append_by_schedule(kv, gate, bias, case["schedule"], backend=backend,
                                                        pad=case["pad"], seed=case["seed"], **kwargs)
        for b, L in enumerate(lengths):
            assert got[b].dtype == dtype
            oracle = naive_compressor(kv[b, :L].double(), gate[b, :L].double(), bias.double(), **kwargs)
            naive = naive_compressor(kv[b, :L], gate[b, :L], bias, **kwargs)
            assert got[b].shape == oracle.shape, (backend, b)
            test_compressor.assert_rule(got[b], naive, oracle, dtype, f"{backend} request {b}")
            if dtype == torch.float32:
                want = dsa.dsa_compressor(kv[b, :L], gate[b, :L], bias, backend=backend, **kwargs)[0]
                assert torch.equal(got[b], want), (backend, b)


# ------------------------------------------------------------ decode attention

@st.composite
def decode_attention_cases(draw):
    """test_decode.AttentionDecodeCase's arguments: every mode and cache / query dtype
    pair, block sizes 4-64, 1-3 requests of ragged length, next_n 1-4, heads 1-16, rope
    on or off, d_v below the key's nope part, top-k / window / cmp top-k from 1 up;
    queries and keys scaled by 2^-120..2^60 (keys near fp32's subnormals: FP8
    groups whose scale stops at 2^-126; logits near 2^100)."""
    mode = draw(st.sampled_from(test_decode.MODES))
    cache_dtype, qdtype = draw(st.sampled_from(test_decode.ATTENTION_DTYPES))
    rope = draw(st.sampled_from([0, 16]))
    nope = draw(st.sampled_from([16, 48, 128]))
    next_n = draw(st.integers(1, 4))
    v4 = mode.startswith("v4")
    ratio = draw(st.sampled_from([2, 4])) if v4 else 1
    ctx = [draw(st.integers(max(next_n, ratio), 160)) for _ in range(draw(st.integers(1, 3)))]
    return dict(mode=mode, cache_dtype=cache_dtype, qdtype=qdtype, rope=rope, dim=nope + rope,
                d_v=draw(st.sampled_from([nope, min(nope, 16)])), heads=draw(st.sampled_from([1, 3, 16])),
                block_size=draw(st.sampled_from([4, 16, 64])), next_n=next_n, ratio=ratio, ctx=ctx,
                topk=draw(st.sampled_from([1, 7, 40])), window=draw(st.sampled_from([1, 5, 24])),
                cmp_topk=draw(st.integers(1, 12)), seed=draw(st.integers(0, 2**16)),
                q_exponent=draw(st.sampled_from([0, 0, -60, 40])),
                key_exponent=draw(st.sampled_from([0, 0, -120, -60, 60])))


@budget(20)
@given(decode_attention_cases())
def test_sparse_attention_decode_matches_oracle(case):
    """Both backends against the float64 oracle on the rows the cache holds (read back
    with dsa_cache_gather), under docs/testing.md's rule: the peer is the same
    attention in plain torch, in the dtype the op computes in."""
    c = dict(case)
    call = test_decode.AttentionDecodeCase(torch.Generator().manual_seed(c["seed"]), c.pop("mode"),
                                           c.pop("cache_dtype"), c.pop("qdtype"), c.pop("ctx"), **c)
    test_decode.check_attention_rule(call, {backend: call.call(backend=backend) for backend in ("cpu", "reference")})


# -------------------------------------------------------------- paged caches

@st.composite
def cache_write_cases(draw):
    """A paged cache of random bytes written by a few calls, as a prompt and then
    decode steps write it: random record layouts (dims 1-600, rope part 0 to all of
    it, short last FP8 scale groups), block sizes 1-64, 1-3 requests whose tokens
    land in a shuffled block table, rows skipped with -1, values of magnitudes
    2^-20..2^20 and zero rows, fp32 or bf16 values."""
    dtype = draw(st.sampled_from(["fp32", "bf16", "fp8"]))
    dim = draw(st.sampled_from([1, 7, 64, 128, 129, 300, 576]))
    rope = draw(st.sampled_from(sorted({0, min(dim, 1), min(dim, 64), dim})))
    lens = [draw(st.integers(0, 50)) for _ in range(draw(st.integers(1, 3)))]
    calls = draw(st.lists(st.integers(1, 30), min_size=1, max_size=4))
    return dict(dtype=dtype, dim=dim, rope=rope, lens=lens, calls=calls,
                block_size=draw(st.sampled_from([1, 5, 16, 64])),
                values_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                skip=draw(st.floats(0.0, 0.5)), exponent=draw(st.sampled_from([0, 0, -110, -125, -135, 100])),
                seed=draw(st.integers(0, 2**16)))


@budget(24)
@given(cache_write_cases())
def test_cache_write_and_gather_match_torch(case):
    """Both backends write the same bytes, touch no slot they were not asked to,
    and read back torch's own rounding of each written row (test_paged_cache's
    oracle) bit for bit, in fp32 and, where that is exact, in bf16."""
    g = torch.Generator().manual_seed(case["seed"])
    dtype, dim, rope, bs, lens = case["dtype"], case["dim"], case["rope"], case["block_size"], case["lens"]
    B, n = len(lens), max(lens)
    width = max(1, -(-n // bs))
    blocks = B * width + 2
    table = test_paged_cache.shuffled_table(B, width, blocks, seed=case["seed"])
    tokens = dsa.cache_token_bytes(dim, rope, dtype)
    noise = torch.randint(0, 256, (blocks, bs, tokens), generator=g, dtype=torch.uint8)
    values = test_paged_cache.values_of(B, n, dim, seed=case["seed"])
    values[:, ::7] = 0  # all-zero rows: an FP8 scale of 1
    values *= 2.0 ** case["exponent"]  # down to fp32's subnormals, up near its largest
    values = values.to(case["values_dtype"])
    # The calls' positions: a slice of each request's tokens per call, some rows -1.
    order = torch.arange(n).repeat(B, 1)
    keep = torch.rand(B, n, generator=g) >= case["skip"]
    for b, L in enumerate(lens):
        keep[b, L:] = False
    cuts = sorted({0, n} | {min(n, c) for c in torch.tensor(case["calls"]).cumsum(0).tolist()})
    caches = {}
    for backend in ("cpu", "reference"):
        cache = noise.clone()
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            pos = torch.where(keep[:, lo:hi], order[:, lo:hi], -1)
            dsa.dsa_cache_write(cache, table, pos, values[:, lo:hi], rope_dim=rope, dtype=dtype, backend=backend)
        caches[backend] = cache
    assert torch.equal(caches["cpu"], caches["reference"])
    cache = caches["cpu"]
    # No slot outside the written ones changed.
    written = torch.zeros(blocks, bs, dtype=torch.bool)
    for b in range(B):
        for p in order[b][keep[b]].tolist():
            written[table[b, p // bs], p % bs] = True
    assert torch.equal(cache[~written], noise[~written])
    # Read back: the written rows as torch rounds them.
    pos = torch.where(keep, order, -1)
    want = test_paged_cache.torch_oracle(values.float(), rope, dtype)
    want[~keep] = 0
    for backend in ("cpu", "reference"):
        back = dsa.dsa_cache_gather(cache, table, pos, dim=dim, rope_dim=rope, dtype=dtype, backend=backend)
        assert torch.equal(back, want), backend
        # In bf16: the same values rounded once (exact but for FP8 values under 2^-130,
        # which only a group whose scale stops at 2^-126 holds; docs/serving.md).
        back16 = dsa.dsa_cache_gather(cache, table, pos, dim=dim, rope_dim=rope, dtype=dtype,
                                      out_dtype=torch.bfloat16, backend=backend)
        assert torch.equal(back16, want.bfloat16()), backend
        if dtype != "fp32":
            tiny = (want != 0) & (want.abs() < 2.0 ** -130)
            assert torch.equal(back16.float()[~tiny], want[~tiny]), backend


# ------------------------------------------------------------ bad configurations

def _refused(needle, call, tensors):
    """call() raises ValueError naming `needle` and leaves every tensor among `tensors`
    as it was."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=needle):
        call()
    assert all(torch.equal(a, b) for a, b in zip(before, tensors))


# Each mutation turns one valid sparse-attention call (make_case's inputs and
# keywords, indices mode, TND) into a bad one; the name the error must contain.
ATTENTION_MUTATIONS = [
    ("kv", lambda i, k: (dict(i, kv=i["kv"][:, :-1]), k)),
    ("kv", lambda i, k: (dict(i, kv=i["kv"].double()), k)),
    ("indices", lambda i, k: (i, dict(k, indices=k["indices"].long()))),
    # One row more and a rank less: taking a row away, or the first row, changes
    # nothing or fails in the test itself when the call has no tokens.
    ("indices", lambda i, k: (i, dict(k, indices=torch.cat([k["indices"], k["indices"].new_zeros(1, 3)])))),
    ("indices", lambda i, k: (i, dict(k, indices=k["indices"][:, :0]))),
    ("query", lambda i, k: (dict(i, query=i["query"].flatten(-2)), k)),
    ("scale", lambda i, k: (i, dict(k, scale=math.inf))),
    ("window", lambda i, k: (i, dict(k, window=3))),
    ("d_v", lambda i, k: (i, dict(k, d_v=i["query"].shape[-1] + 1))),
    ("sinks", lambda i, k: (dict(i, sinks=torch.zeros(i["query"].shape[-2] + 1)), k)),
    ("cmp_ratio", lambda i, k: (dict(i, cmp_kv=i["kv"][:1]), k)),
    ("key_rope", lambda i, k: (dict(i, query_rope=i["query"][..., :2]), k)),
    ("query_lengths", lambda i, k: (i, dict(k, query_lengths=k["query_lengths"][:-1] + [k["query_lengths"][-1] + 1]))),
    ("key_lengths", lambda i, k: (i, dict(k, key_lengths=k["key_lengths"][:-1] + [k["key_lengths"][-1] + 1]))),
    ("Lq must be <= Lk|query_lengths|key_lengths",
     lambda i, k: (i, dict(k, key_lengths=[0] * (len(k["key_lengths"]) - 1) + k["key_lengths"][-1:]))),
]


def _bad_attention_call(lens, dtype, which, seed):
    """A valid call's (inputs, keywords) with mutation `which` applied, and the needle."""
    q_lens, k_lens = lens
    needle, mutate = ATTENTION_MUTATIONS[which]
    if needle.startswith("Lq") and sum(q_lens[:-1]) == 0:
        q_lens[0], k_lens[0] = 1, max(k_lens[0], 1)  # needs a non-empty earlier query sequence
    inputs, kw = test_sparse_attention.make_case("indices", dtype, seed=seed, heads=2, dim=8, topk=3,
                                                 q_lens=q_lens, k_lens=k_lens)
    return (inputs, kw) + mutate(inputs, kw) + (needle,)


@budget(30)
@given(lengths(min_seqs=2, max_len=12), st.sampled_from(DTYPES),
       st.sampled_from(range(len(ATTENTION_MUTATIONS))), st.integers(0, 2**16))
def test_sparse_attention_bad_configurations(lens, dtype, which, seed):
    _, _, bad_inputs, bad_kw, needle = _bad_attention_call(lens, dtype, which, seed)
    everything = list(bad_inputs.values()) + list(bad_kw.values())
    rest = {k: v for k, v in bad_inputs.items() if k not in ("query", "kv")}
    _refused(needle, lambda: dsa.dsa_sparse_attention(bad_inputs["query"], bad_inputs["kv"], **rest, **bad_kw),
             everything)


# The same through the C++ boundary with caller-owned outputs: validation ends
# before the first write, so a sentinel fill survives every rejected call.
@budget(20)
@given(lengths(min_seqs=2, max_len=12), st.sampled_from(range(len(ATTENTION_MUTATIONS))), st.integers(0, 2**16))
def test_sparse_attention_bad_configurations_leave_outputs_untouched(lens, which, seed):
    inputs, _, i, k, needle = _bad_attention_call(lens, torch.float32, which, seed)
    query = inputs["query"]
    out = torch.full((*query.shape[:-1], k.get("d_v", query.shape[-1])), 7.0)
    mx, sm = torch.full(query.shape[:-1], 7.0), torch.full(query.shape[:-1], 7.0)
    with pytest.raises(ValueError, match=needle):
        _C.sparse_attention_fwd(
            i["query"], i["kv"], k.get("indices"), i.get("cmp_kv"), None, i.get("sinks"), i.get("query_rope"),
            i.get("key_rope"), out, mx, sm, float(k["scale"]), int(k.get("d_v", 0)), int(k.get("window", 0)),
            int(k.get("cmp_ratio", 1)), cu_seqlens_from_ends(k["query_lengths"]),
            cu_seqlens_from_ends(k["key_lengths"]), "TND", "cpu", 1)
    assert (out == 7).all() and (mx == 7).all() and (sm == 7).all()


INDEXER_MUTATIONS = [
    ("index_query", lambda q, k, w, a: (q.flatten(-2), k, w, a)),
    ("index_key", lambda q, k, w, a: (q, k.double(), w, a)),
    ("index_key", lambda q, k, w, a: (q, k[:, :-1], w, a)),
    ("weights", lambda q, k, w, a: (q, k, w[:, :-1], a)),
    ("weights", lambda q, k, w, a: (q, k, w.int(), a)),
    ("topk", lambda q, k, w, a: (q, k, w, dict(a, topk=0))),
    ("cmp_ratio", lambda q, k, w, a: (q, k, w, dict(a, cmp_ratio=0))),
    ("scale", lambda q, k, w, a: (q, k, w, dict(a, scale=math.nan))),
    ("query_lengths", lambda q, k, w, a: (q, k, w, dict(a, query_lengths=a["query_lengths"][::-1] + [q.shape[0] + 1]))),
    ("key_lengths", lambda q, k, w, a: (q, k, w, dict(a, key_lengths=a["key_lengths"][:-1] + [k.shape[0] + 1]))),
]


@budget(24)
@given(lengths(min_seqs=2, max_len=12), st.sampled_from(range(len(INDEXER_MUTATIONS))), st.integers(0, 2**16))
def test_indexer_bad_configurations_leave_outputs_untouched(lens, which, seed):
    q_lens, k_lens = lens
    case = test_indexer.Case("bad", q_lens, k_lens, heads=2, dim=8, topk=3)
    q, k, w, kwargs = test_indexer.make_inputs(case, torch.float32, seed=seed)
    needle, mutate = INDEXER_MUTATIONS[which]
    q2, k2, w2, a = mutate(q, k, w, kwargs)
    _refused(needle, lambda: dsa.dsa_indexer(q2, k2, w2, **a), [q2, k2, w2])
    if isinstance(a["topk"], int) and a["topk"] > 0:  # a topk <= 0 has no output tensor to make
        indices = torch.full((q.shape[0], a["topk"]), 7, dtype=torch.int32)
        scores = torch.full((q.shape[0], a["topk"]), 7.0)
        with pytest.raises(ValueError, match=needle):
            _C.indexer_topk(q2, k2, w2, indices, scores, a["topk"], float(a["scale"]), a["cmp_ratio"],
                            cu_seqlens_from_ends(a["query_lengths"]), cu_seqlens_from_ends(a["key_lengths"]),
                            "TND", "cpu", 1)
        assert (indices == 7).all() and (scores == 7).all()


COMPRESSOR_MUTATIONS = [
    ("ratio", lambda kv, g, b, a: (kv, g, b, dict(a, ratio=0))),
    ("position_bias", lambda kv, g, b, a: (kv, g, b[:-1], a)),
    ("position_bias", lambda kv, g, b, a: (kv, g, b.double(), a)),
    # One row more (one fewer would be no change at all when kv is empty).
    ("gate", lambda kv, g, b, a: (kv, torch.cat([g, g.new_zeros(1, g.shape[1])]), b, a)),
    ("gate", lambda kv, g, b, a: (kv, g.double(), b, a)),
    ("query_lengths",
     lambda kv, g, b, a: (kv, g, b, dict(a, query_lengths=a["query_lengths"][:-1] + [kv.shape[0] + 1]))),
    ("kv", lambda kv, g, b, a: (kv[:, :-1], g[:, :-1], b[:, :-1], dict(a, overlap=True))),
]


@budget(16)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=3), st.sampled_from(range(len(COMPRESSOR_MUTATIONS))),
       st.integers(0, 2**16))
def test_compressor_bad_configurations(raw, which, seed):
    ratio = 4
    ends = torch.tensor(raw).cumsum(0).tolist()
    kv, gate, bias = test_compressor.make_inputs((ends[-1],), 8, ratio, torch.float32, seed=seed)
    needle, mutate = COMPRESSOR_MUTATIONS[which]
    kv2, g2, b2, a = mutate(kv, gate, bias, dict(ratio=ratio, overlap=True, query_lengths=ends))
    _refused(needle, lambda: dsa.dsa_compressor(kv2, g2, b2, **a), [kv2, g2, b2])


def _with(a, name, at, value):
    """a copy of call arguments `a` whose tensor `name` has `value` at index `at`."""
    t = a[name].clone()
    t[at] = value
    return dict(a, **{name: t})


def _no_bytes(cache):
    """A cache tensor whose records are one byte short (a contiguous one)."""
    return cache[..., :-1].contiguous()


# Each mutation turns a valid dsa_sparse_attention_decode call (a small
# test_decode.AttentionDecodeCase, arguments by name) into a bad one: (the text
# the error must contain, the modes it applies to, the mutation).
_ALL, _V32, _V4, _PAGED = test_decode.MODES, ["v32_sparse"], ["v4_csa", "v4_hca"], ["dense", "window"]
DECODE_ATTENTION_MUTATIONS = [
    ("scale", _ALL, lambda a, c: dict(a, scale=math.nan)),
    ("d_v", _ALL, lambda a, c: dict(a, d_v=c.dim + 1)),
    ("query", _ALL, lambda a, c: dict(a, query=a["query"][0])),
    ("kv_cache", _ALL, lambda a, c: dict(a, kv_cache=_no_bytes(a["kv_cache"]))),
    (r"context_lens\[0\]", _ALL, lambda a, c: _with(a, "context_lens", 0, c.next_n - 1)),
    ("context_lens", _ALL, lambda a, c: dict(a, context_lens=a["context_lens"][:-1])),
    # Column 0 holds position 0, which every dense row reads (a window row may not).
    (r"block_table\[0, 0\]", ["dense"], lambda a, c: _with(a, "block_table", (0, 0), a["kv_cache"].shape[0])),
    ("no block", ["dense"], lambda a, c: _with(a, "block_table", (0, 0), -1)),
    ("context_lens", _PAGED,
     lambda a, c: _with(a, "context_lens", 0, a["block_table"].shape[1] * a["kv_cache"].shape[1] + 1)),
    (r"indices\[0, 0, 0\]", _V32, lambda a, c: _with(_with(a, "indices", (0, 0, 0), c.ctx[0]), "topk_lens", 0, 1)),
    ("indices", _V32, lambda a, c: dict(a, indices=a["indices"].long())),
    ("topk_lens", _V32, lambda a, c: _with(a, "topk_lens", 0, a["indices"].shape[-1] + 1)),
    ("window", _V32, lambda a, c: dict(a, window=2)),
    ("sinks", _V4, lambda a, c: dict(a, sinks=torch.zeros(a["query"].shape[2] + 1))),
    ("cmp_ratio", _V4, lambda a, c: dict(a, cmp_ratio=1)),
    ("cmp_cache", _V4, lambda a, c: dict(a, cmp_cache=_no_bytes(a["cmp_cache"]))),
    # Every column a request's compressed entries use is read (HCA: all of them; CSA: cmp index 0 below).
    (r"cmp_block_table\[0, 0\]", _V4,
     lambda a, c: _with(_with(a, "cmp_indices", (0, c.next_n - 1, 0), 0) if a.get("cmp_indices") is not None else a,
                        "cmp_block_table", (0, 0), a["cmp_cache"].shape[0])),
    (r"cmp_indices\[0, 0, 0\]", ["v4_csa"], lambda a, c: _with(a, "cmp_indices", (0, 0, 0), -2)),
]


@st.composite
def bad_decode_attention_calls(draw):
    which = draw(st.sampled_from(range(len(DECODE_ATTENTION_MUTATIONS))))
    mode = draw(st.sampled_from(DECODE_ATTENTION_MUTATIONS[which][1]))
    cache_dtype, qdtype = draw(st.sampled_from(test_decode.ATTENTION_DTYPES))
    next_n = draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([2, 4]))
    # Request 0 holds a full compressed entry and a cmp_block_table column 0 (V4).
    ctx = [draw(st.integers(max(next_n, ratio), 40)) for _ in range(draw(st.integers(1, 3)))]
    case = test_decode.AttentionDecodeCase(
        torch.Generator().manual_seed(draw(st.integers(0, 2**16))), mode, cache_dtype, qdtype, ctx, next_n=next_n,
        heads=draw(st.sampled_from([1, 3])), dim=24, d_v=16, rope=8, block_size=draw(st.sampled_from([1, 4, 16])),
        topk=5, ratio=ratio, window=4, cmp_topk=3, seed=draw(st.integers(0, 2**16)))
    return case, which


@budget(30)
@given(bad_decode_attention_calls())
def test_sparse_attention_decode_bad_configurations(drawn):
    """ValueError naming the argument; every input unchanged; called through _C with
    sentinel-filled outputs, the caller's outputs unwritten."""
    case, which = drawn
    needle, _, mutate = DECODE_ATTENTION_MUTATIONS[which]
    a = mutate(dict(query=case.q, kv_cache=case.cache, block_table=case.table, context_lens=case.lens, **case.kw),
               case)
    _refused(needle, lambda: dsa.dsa_sparse_attention_decode(**a), a.values())
    q = a["query"]
    if q.dim() != 4 or not math.isfinite(a["scale"]) or a.get("cmp_ratio", 1) < 1:
        return  # refused in Python: no output shape to make
    out = torch.full((*q.shape[:3], a.get("d_v") or q.shape[3]), 7.0).to(q.dtype)
    lse = torch.full(q.shape[:3], 7.0)
    with pytest.raises(ValueError, match=needle):
        _C.sparse_attention_decode(*handoff(q, a["kv_cache"], a["block_table"], a["context_lens"], a.get("indices"),
                                            a.get("topk_lens"), a.get("cmp_cache"), a.get("cmp_block_table"),
                                            a.get("cmp_indices"), a.get("sinks"), out, lse),
                                   float(a["scale"]), int(a.get("d_v", 0)), int(a.get("window", 0)),
                                   int(a.get("cmp_ratio", 1)), int(a.get("rope_dim", 0)), a["cache_dtype"],
                                   bool(a.get("ring", False)), a["cache_dtype"], "cpu", 1)
    assert (out == 7).all() and (lse == 7).all()


# The same for dsa_indexer_decode (a small test_decode.IndexerDecodeCase; block
# table column 0 is always read, every key of a request being scored).
DECODE_INDEXER_MUTATIONS = [
    ("scale", lambda a, c: dict(a, scale=math.inf)),
    ("topk", lambda a, c: dict(a, topk=0)),
    ("cmp_ratio", lambda a, c: dict(a, cmp_ratio=0)),
    ("index_query", lambda a, c: dict(a, index_query=a["index_query"][0])),
    ("weights", lambda a, c: dict(a, weights=a["weights"][..., :-1])),
    ("weights", lambda a, c: dict(a, weights=a["weights"].int())),
    ("key_cache", lambda a, c: dict(a, key_cache=_no_bytes(a["key_cache"]))),
    ("block_table", lambda a, c: dict(a, block_table=a["block_table"].long())),
    (r"block_table\[0, 0\]", lambda a, c: _with(a, "block_table", (0, 0), a["key_cache"].shape[0])),
    ("context_lens", lambda a, c: _with(a, "context_lens", 0,
                                        (a["block_table"].shape[1] * a["key_cache"].shape[1] + 1) * c.cmp_ratio)),
    (r"context_lens\[0\]", lambda a, c: _with(a, "context_lens", 0, c.next_n - 1)),
]


@budget(24)
@given(st.sampled_from(range(len(DECODE_INDEXER_MUTATIONS))), st.sampled_from(["bf16", "fp8", "fp32"]),
       st.integers(1, 3), st.sampled_from([1, 4]), st.lists(st.integers(4, 40), min_size=1, max_size=3),
       st.integers(0, 2**16))
def test_indexer_decode_bad_configurations(which, cache_dtype, next_n, cmp_ratio, ctx, seed):
    ctx = [max(c, next_n * cmp_ratio) for c in ctx]  # request 0 holds at least one key
    case = test_decode.IndexerDecodeCase(torch.Generator().manual_seed(seed), cache_dtype, torch.bfloat16, ctx,
                                         next_n=next_n, heads=2, dim=24, topk=5, block_size=4, cmp_ratio=cmp_ratio,
                                         scale=0.5, seed=seed)
    needle, mutate = DECODE_INDEXER_MUTATIONS[which]
    a = mutate(dict(index_query=case.q, weights=case.w, key_cache=case.cache, block_table=case.table,
                    context_lens=case.lens, cache_dtype=cache_dtype, **case.kw), case)
    _refused(needle, lambda: dsa.dsa_indexer_decode(**a), a.values())
    q = a["index_query"]
    if q.dim() != 4 or not math.isfinite(a["scale"]) or a["topk"] < 1 or a["cmp_ratio"] < 1:
        return  # refused in Python: no output shape to make
    indices = torch.full((*q.shape[:2], a["topk"]), 7, dtype=torch.int32)
    with pytest.raises(ValueError, match=needle):
        _C.indexer_decode(*handoff(q, a["weights"], a["key_cache"], a["block_table"], a["context_lens"], indices),
                          a["topk"], float(a["scale"]), a["cmp_ratio"], cache_dtype, "cpu", 1)
    assert (indices == 7).all()


# dsa_compressor_append: a rejected call leaves the caller's state as it was (the
# op updates it in place), whichever argument was wrong.
COMPRESSOR_APPEND_MUTATIONS = [
    ("ratio", lambda a: dict(a, ratio=0)),
    ("state_kv", lambda a: dict(a, state_kv=a["state_kv"][:, :-1])),
    ("state_gate", lambda a: dict(a, state_gate=a["state_gate"].double())),
    ("state_gate", lambda a: dict(a, state_gate=a["state_kv"])),
    ("lengths", lambda a: _with(a, "lengths", 0, -1)),
    ("lengths", lambda a: dict(a, lengths=a["lengths"][:-1])),
    ("new_lens", lambda a: dict(a, new_lens=torch.full_like(a["lengths"], a["kv"].shape[1] + 1))),
    ("gate", lambda a: dict(a, gate=a["gate"][:, :, :-1])),
    ("kv", lambda a: dict(a, kv=a["kv"][0])),
    ("position_bias", lambda a: dict(a, position_bias=a["position_bias"][:-1])),
]


@budget(20)
@given(st.sampled_from(range(len(COMPRESSOR_APPEND_MUTATIONS))), st.sampled_from([(4, True), (3, False)]),
       st.lists(st.integers(0, 20), min_size=1, max_size=3), st.integers(1, 5), st.integers(0, 2**16))
def test_compressor_append_bad_configurations_leave_the_state(which, mode, held, n, seed):
    ratio, overlap = mode
    C = 2 * 6 if overlap else 6
    kv, gate, bias = test_compressor.make_inputs((len(held), n), C, ratio, torch.float32, seed=seed)
    state_kv, state_gate = (torch.randn(len(held), (2 if overlap else 1) * ratio, C,
                                        generator=torch.Generator().manual_seed(seed + i)) for i in range(2))
    needle, mutate = COMPRESSOR_APPEND_MUTATIONS[which]
    a = mutate(dict(kv=kv, gate=gate, position_bias=bias, state_kv=state_kv, state_gate=state_gate,
                    lengths=torch.tensor(held), ratio=ratio, overlap=overlap))
    _refused(needle, lambda: dsa_compressor_append(**a), a.values())


def test_decreasing_ends_are_an_error_naming_them():
    assert lengths_from_ends([3, 3, 7]) == [3, 0, 4]
    with pytest.raises(ValueError, match="ends: expected non-decreasing"):
        lengths_from_ends([3, 2])
