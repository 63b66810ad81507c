"""dsa_kl_loss, dsa_dense_indexer_lse, dsa_dense_indexer_kl_loss (docs/ops.md 4.3, 4.4)
against the independent float64 PyTorch implementation in dsa.naive."""
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import _tolerance
import dsa
from _indices import fold_into_sequences
from dsa.naive import (naive_attention_stats, naive_dense_indexer_kl_loss, naive_dense_indexer_lse,
                       naive_kl_loss)

BACKENDS = ["reference", "cpu"]


def max_err(a, b):
    a, b = a.double(), b.double()
    same_inf = (torch.isinf(a) == torch.isinf(b)).all() and (a[torch.isinf(a)] == b[torch.isinf(b)]).all()
    assert same_inf, "infinities differ"
    assert (torch.isnan(a) == torch.isnan(b)).all(), "NaNs differ"
    f = torch.isfinite(b)
    return (a[f] - b[f]).abs().max().item() if f.any() else 0.0


def check(name, fused, naive_same_dtype, oracle):
    """docs/testing.md's rule (_tolerance.bound); the fp32 form where there is no naive peer."""
    err = max_err(fused, oracle)
    fp32 = fused.dtype == torch.float32 and naive_same_dtype is None
    finite = oracle.double()[torch.isfinite(oracle)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    limit = _tolerance.bound(fp32, scale, None if fp32 else max_err(naive_same_dtype, oracle))
    assert err <= limit, f"{name}: error {err} > {limit} (scale {scale})"


def rounded(x, dtype):
    """The inputs as the low-precision run sees them, so the fp64 oracle evaluates the same numbers."""
    return {k: (v.to(dtype).float() if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "sinks" else v)
            for k, v in x.items()}


def leaves(*ts, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in ts]


# ------------------------------------------------------------------ sparse KL

def sparse_inputs(layout="TND", ratio=1, seed=0, rope=False, T=None):
    g = torch.Generator().manual_seed(seed)
    H, D, Dr, Hi, Di, K = 3, 32, 8, 4, 24, 9
    if layout == "TND":
        ql, kl = [1, 3, 3, 11, 29], [1, 5, 9, 20, 45]  # length-0 and length-1 sequences, prefix KV
        Tq = ql[-1]
        lens_k = [b - a for a, b in zip([0] + kl[:-1], kl)]
        rows = sum(n // ratio for n in lens_k) if ratio > 1 else kl[-1]
        qs, ks = (Tq,), (rows,)
    else:
        B, Sq, Sk = 3, 9, 14
        ql, kl = [9, 4, 0], [14, 6, 0]
        rows = Sk // ratio if ratio > 1 else Sk
        qs, ks = (B, Sq), (B, rows)
    q = torch.randn(*qs, H, D, generator=g)
    kv = torch.randn(*ks, D, generator=g)
    qr = torch.randn(*qs, H, Dr, generator=g) if rope else None
    kr = torch.randn(*ks, Dr, generator=g) if rope else None
    iq = torch.randn(*qs, Hi, Di, generator=g)
    ik = torch.randn(*ks, Di, generator=g)
    w = torch.rand(*qs, Hi, generator=g) * 1.5 - 0.5
    hi = max(2, (45 if layout == "TND" else 14) // ratio)
    idx = torch.randint(-2, hi, (*qs, K), generator=g, dtype=torch.int32)
    per_q = [b - a for a, b in zip([0] + ql[:-1], ql)] if layout == "TND" else ql
    per_k = [b - a for a, b in zip([0] + kl[:-1], kl)] if layout == "TND" else kl
    fold_into_sequences(idx, per_q, [n // ratio for n in per_k], layout)
    flat = idx.reshape(-1, K)
    flat[0, :] = -1           # an empty row
    flat[2, :] = -1
    flat[2, 0] = 0            # a row with a single valid entry
    flat[4, 1] = flat[4, 0]   # a duplicate
    sinks = torch.tensor([0.0, -math.inf, 3.0])
    return dict(q=q, kv=kv, qr=qr, kr=kr, iq=iq, ik=ik, w=w, idx=idx, sinks=sinks, ql=ql, kl=kl)


def run_sparse(x, fn, dtype, backend=None, sinks=True, scale=0.2, **kw):
    q, kv, qr, kr = (None if t is None else t.to(dtype) for t in (x["q"], x["kv"], x["qr"], x["kr"]))
    stats_dtype = torch.float64
    mx, sm = naive_attention_stats(x["q"].to(stats_dtype), x["kv"].to(stats_dtype), scale=scale,
                                   indices=x["idx"], cmp_ratio=kw.get("cmp_ratio", 1),
                                   query_rope=None if x["qr"] is None else x["qr"].double(),
                                   key_rope=None if x["kr"] is None else x["kr"].double(),
                                   query_lengths=x["ql"], key_lengths=x["kl"], layout=kw.get("layout", "TND"))
    iq, ik, w = leaves(x["iq"], x["ik"], x["w"], dtype=dtype)
    args = dict(scale=scale, index_scale=0.7, sinks=x["sinks"] if sinks else None, query_rope=qr, key_rope=kr,
                query_lengths=x["ql"], key_lengths=x["kl"], **kw)
    if backend is not None:
        args["backend"] = backend
    if fn is naive_kl_loss and sinks:
        args["sinks"] = x["sinks"].to(torch.float64 if dtype == torch.float64 else torch.float32)
    st = torch.float64 if dtype == torch.float64 else torch.float32
    loss = fn(q, kv, x["idx"], mx.to(st), sm.to(st), iq, ik, w, **args)
    # Over no valid row the oracle's loss is a constant without graph: zero gradients.
    grads = torch.autograd.grad(loss, [iq, ik, w], allow_unused=True) if loss.requires_grad else (None,) * 3
    grads = [torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, (iq, ik, w))]
    return [loss.detach()] + list(grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout,ratio,rope", [("TND", 1, False), ("TND", 4, False), ("BSND", 1, True),
                                               ("BSND", 4, False), ("TND", 1, True)])
def test_sparse_matches_oracle(backend, dtype, layout, ratio, rope):
    x = rounded(sparse_inputs(layout, ratio, seed=ratio, rope=rope), dtype)
    kw = dict(cmp_ratio=ratio, layout=layout, loss_coefficient=1.3)
    oracle = run_sparse(x, naive_kl_loss, torch.float64, **kw)
    fused = run_sparse(x, dsa.dsa_kl_loss, dtype, backend=backend, **kw)
    naive = None if dtype == torch.float32 else run_sparse(x, naive_kl_loss, dtype, **kw)
    assert oracle[0].item() > 0
    for i, name in enumerate(["loss", "d_index_query", "d_index_key", "d_weights"]):
        assert fused[i].dtype == (torch.float32 if i == 0 else dtype)
        check(name, fused[i], None if naive is None else naive[i], oracle[i])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("ratio", [1, 4])
def test_sparse_indices_outside_their_sequence_are_refused(backend, ratio):
    """An index past its sequence's keys (here the first key of the next sequence in the
    packed tensor) is a ValueError naming indices, not a skipped entry."""
    x = sparse_inputs(seed=4, ratio=ratio)
    kl = x["kl"]
    held = (kl[4] - kl[3]) // ratio  # sequence 4's keys (compressed entries at ratio > 1)
    x["idx"][x["ql"][3], 1] = held
    with pytest.raises(ValueError, match=rf"^indices: row {x['ql'][3]} .*is {held}, outside"):
        run_sparse(x, dsa.dsa_kl_loss, torch.float32, backend=backend, cmp_ratio=ratio)

@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_reduction_coefficient_and_edges(backend):
    x = sparse_inputs(seed=3)
    mean = run_sparse(x, dsa.dsa_kl_loss, torch.float32, backend=backend)
    total = run_sparse(x, dsa.dsa_kl_loss, torch.float32, backend=backend, reduction="sum", loss_coefficient=2.0)
    # N = rows with a valid entry (the empty row is not counted, the single-entry row is, with KL 0).
    idx, ql, kl = x["idx"], x["ql"], x["kl"]
    n_rows = 0
    for (q0, q1), (k0, k1) in zip(zip([0] + ql[:-1], ql), zip([0] + kl[:-1], kl)):
        for i in range(q1 - q0):
            pos = (k1 - k0) - (q1 - q0) + i
            n_rows += bool(((idx[q0 + i] >= 0) & (idx[q0 + i] <= pos)).any())
    assert n_rows < idx.shape[0]
    torch.testing.assert_close(total[0], 2.0 * n_rows * mean[0], rtol=1e-5, atol=0)
    for a, b in zip(total[1:], mean[1:]):
        torch.testing.assert_close(a, 2.0 * n_rows * b, rtol=1e-4, atol=1e-6)
    # empty and single-entry rows get no gradient
    assert mean[1][0].abs().max() == 0 and mean[1][2].abs().max() == 0 and mean[3][2].abs().max() == 0
    # N = 0: loss 0, gradients 0
    none = dict(x, idx=torch.full_like(x["idx"], -1))
    out = run_sparse(none, dsa.dsa_kl_loss, torch.float32, backend=backend)
    assert out[0].item() == 0 and all(g.abs().max() == 0 for g in out[1:])
    # all-zero weights: uniform student, finite loss and gradients (dW non-zero, dQ/dK zero)
    zero_w = dict(x, w=torch.zeros_like(x["w"]))
    out = run_sparse(zero_w, dsa.dsa_kl_loss, torch.float32, backend=backend)
    ref = run_sparse(zero_w, naive_kl_loss, torch.float64)
    check("zero-weights loss", out[0], None, ref[0])
    check("zero-weights dW", out[3], None, ref[3])
    assert out[1].abs().max() == 0 and out[2].abs().max() == 0


def test_sparse_threads_deterministic():
    x = sparse_inputs(seed=5)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = run_sparse(x, dsa.dsa_kl_loss, torch.bfloat16, backend="cpu")
        torch.set_num_threads(2)
        b = run_sparse(x, dsa.dsa_kl_loss, torch.bfloat16, backend="cpu")
    finally:
        torch.set_num_threads(old)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def sparse_op_args(x):
    mx, sm = naive_attention_stats(x["q"], x["kv"], scale=0.2, indices=x["idx"], query_lengths=x["ql"],
                                   key_lengths=x["kl"])
    iq, ik, w = leaves(x["iq"], x["ik"], x["w"], dtype=torch.float32)
    return (x["q"], x["kv"], x["idx"], mx, sm, iq, ik, w, x["sinks"], None, None, 0.2, 0.7, 1,
            torch.tensor(x["ql"]), torch.tensor(x["kl"]), "TND", 1.0, "mean", "cpu")


def test_sparse_opcheck_and_compile():
    x = sparse_inputs(seed=6)
    torch.library.opcheck(torch.ops.dsa.kl_loss.default, sparse_op_args(x))
    mx, sm = naive_attention_stats(x["q"], x["kv"], scale=0.2, indices=x["idx"], query_lengths=x["ql"],
                                   key_lengths=x["kl"])

    def f(iq, ik, w):
        return dsa.dsa_kl_loss(x["q"], x["kv"], x["idx"], mx, sm, iq, ik, w, scale=0.2, index_scale=0.7,
                               query_lengths=x["ql"], key_lengths=x["kl"])

    iq, ik, w = leaves(x["iq"], x["ik"], x["w"], dtype=torch.float32)
    eager = f(iq, ik, w)
    compiled = torch.compile(f, fullgraph=True)(iq, ik, w)
    assert torch.equal(eager, compiled)
    compiled.backward()
    assert iq.grad is not None and torch.isfinite(iq.grad).all()


def test_sparse_bad_inputs():
    x = sparse_inputs(seed=7)
    mx, sm = naive_attention_stats(x["q"], x["kv"], scale=0.2, indices=x["idx"], query_lengths=x["ql"],
                                   key_lengths=x["kl"])
    base = dict(scale=0.2, query_lengths=x["ql"], key_lengths=x["kl"])
    args = [x["q"], x["kv"], x["idx"], mx.float(), sm.float(), x["iq"], x["ik"], x["w"]]

    def call(i=None, v=None, **over):
        a = list(args)
        if i is not None:
            a[i] = v
        return dsa.dsa_kl_loss(*a, **{**base, **over})

    with pytest.raises(ValueError, match="kv"):
        call(1, x["kv"][:-1])
    with pytest.raises(ValueError, match="indices"):
        call(2, x["idx"].long())
    with pytest.raises(ValueError, match="indices"):
        call(2, x["idx"][:-1])
    with pytest.raises(ValueError, match="softmax_max"):
        call(3, mx.double())
    with pytest.raises(ValueError, match="index_key"):
        call(6, x["ik"][:, :-1])
    with pytest.raises(ValueError, match="weights"):
        call(7, x["w"][:, :-1])
    with pytest.raises(ValueError, match="query_lengths"):
        call(query_lengths=[1, 3, 2, 11, 29])
    with pytest.raises(ValueError, match="key_lengths"):
        call(key_lengths=[1, 5, 9, 20, 44])
    with pytest.raises(ValueError, match="cmp_ratio"):
        call(cmp_ratio=0)
    with pytest.raises(ValueError, match="reduction"):
        call(reduction="avg")
    with pytest.raises(ValueError, match="sinks"):
        call(sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="rope"):
        call(query_rope=torch.zeros(x["q"].shape[0], 3, 4))
    with pytest.raises(ValueError, match="query_lengths|Lq"):
        call(query_lengths=[1, 3, 3, 11, 29], key_lengths=[1, 5, 9, 10, 45])


# ------------------------------------------------------------------- dense KL

def dense_inputs(layout="TND", key_heads=4, rope=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, D, Dr, Hi, Di = 4, 32, 16, 3, 24
    if layout == "TND":
        ql, kl = [0, 1, 7, 40], [0, 1, 15, 50]
        qs, ks = (ql[-1],), (kl[-1],)
    else:
        ql, kl = [11, 5], [17, 5]
        qs, ks = (2, 11), (2, 17)
    return dict(
        iq=torch.randn(*qs, Hi, Di, generator=g), ik=torch.randn(*ks, Di, generator=g),
        w=torch.rand(*qs, Hi, generator=g) - 0.3, q=torch.randn(*qs, H, D, generator=g),
        k=torch.randn(*ks, key_heads, D, generator=g),
        qr=torch.randn(*qs, H, Dr, generator=g) if rope else None,
        kr=torch.randn(*ks, key_heads, Dr, generator=g) if rope else None, ql=ql, kl=kl, layout=layout)


def run_dense(x, dtype, backend=None, scale=0.15, **kw):
    naive = backend is None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    mx, sm = naive_attention_stats(x["q"].double(), x["k"].double(), scale=scale,
                                   query_rope=None if x["qr"] is None else x["qr"].double(),
                                   key_rope=None if x["kr"] is None else x["kr"].double(),
                                   query_lengths=x["ql"], key_lengths=x["kl"], layout=x["layout"])
    st = torch.float64 if dtype == torch.float64 else torch.float32
    iq, ik, w = leaves(x["iq"], x["ik"], x["w"], dtype=dtype)
    lengths = dict(query_lengths=x["ql"], key_lengths=x["kl"], layout=x["layout"])
    if naive:
        lse = naive_dense_indexer_lse(iq, ik, w, scale=0.5, **lengths)
        loss = naive_dense_indexer_kl_loss(iq, ik, w, cast(x["q"]), cast(x["k"]), mx.to(st), sm.to(st), lse,
                                           scale=scale, index_scale=0.5, query_rope=cast(x["qr"]),
                                           key_rope=cast(x["kr"]), **lengths, **kw)
    else:
        lse = dsa.dsa_dense_indexer_lse(iq, ik, w, scale=0.5, backend=backend, **lengths)
        loss = dsa.dsa_dense_indexer_kl_loss(iq, ik, w, cast(x["q"]), cast(x["k"]), mx.float(), sm.float(), lse,
                                             scale=scale, index_scale=0.5, query_rope=cast(x["qr"]),
                                             key_rope=cast(x["kr"]), backend=backend, **lengths, **kw)
    grads = torch.autograd.grad(loss, [iq, ik, w])
    return [lse.detach(), loss.detach()] + list(grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout,key_heads,rope", [("TND", 4, True), ("TND", 1, False), ("BSND", 1, True),
                                                   ("BSND", 2, False)])
def test_dense_matches_oracle(backend, dtype, layout, key_heads, rope):
    x = rounded(dense_inputs(layout, key_heads, rope, seed=key_heads), dtype)
    oracle = run_dense(x, torch.float64, loss_coefficient=0.7)
    fused = run_dense(x, dtype, backend=backend, loss_coefficient=0.7)
    naive = None if dtype == torch.float32 else run_dense(x, dtype, loss_coefficient=0.7)
    for i, name in enumerate(["indexer_lse", "loss", "d_index_query", "d_index_key", "d_head_weights"]):
        check(name, fused[i], None if naive is None else naive[i], oracle[i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_reduction_and_coefficient(backend):
    x = dense_inputs(seed=9)
    mean = run_dense(x, torch.float32, backend=backend)
    total = run_dense(x, torch.float32, backend=backend, reduction="sum", loss_coefficient=3.0)
    n = x["ql"][-1]
    torch.testing.assert_close(total[1], 3.0 * n * mean[1], rtol=1e-5, atol=0)
    for a, b in zip(total[2:], mean[2:]):
        torch.testing.assert_close(a, 3.0 * n * b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_lse_compressed_and_empty_rows(backend):
    g = torch.Generator().manual_seed(4)
    ql = [3, 10, 30]          # sequences of 3 (shorter than the ratio), 7 and 20 tokens
    rows = 3 // 4 + 7 // 4 + 20 // 4
    iq, ik, w = torch.randn(30, 2, 16, generator=g), torch.randn(rows, 16, generator=g), torch.rand(30, 2, generator=g)
    out = dsa.dsa_dense_indexer_lse(iq, ik, w, scale=0.5, cmp_ratio=4, query_lengths=ql, backend=backend)
    ref = naive_dense_indexer_lse(iq.double(), ik.double(), w.double(), scale=0.5, cmp_ratio=4, query_lengths=ql)
    assert torch.isinf(out[:3]).all() and (out[:3] > 0).all()
    check("indexer_lse", out, None, ref)


@pytest.mark.parametrize("key", ["iq", "ik", "w"])
def test_nan_in_an_indexer_input_reaches_the_loss(key):
    """NaN in an indexer input makes both KL losses NaN on both backends, as with the
    unfused loss, and every NaN gradient of the reference is NaN on cpu
    (docs/kl_loss.md; the fused products may add a few, docs/hardening.md)."""
    x = sparse_inputs("TND", 1, seed=1)
    t = x[key].clone()
    t.view(t.shape[0], -1)[:, 0] = float("nan")  # one per query row (key row for ik): every selection meets one
    x[key] = t
    kw = dict(cmp_ratio=1, layout="TND", loss_coefficient=1.3)
    runs = {b: run_sparse(x, dsa.dsa_kl_loss, torch.float32, backend=b, **kw) for b in BACKENDS}
    xd = dense_inputs("TND", 1, rope=False)
    td = xd[key].clone()
    td.view(td.shape[0], -1)[20, 0] = float("nan")  # a single one: row 20 (key 20) is counted
    xd[key] = td
    dense = {b: run_dense(xd, torch.float32, backend=b) for b in BACKENDS}
    # The float64 oracles too (the dense one had dropped a NaN lse row as empty).
    runs["oracle"] = run_sparse(x, naive_kl_loss, torch.float64, **kw)
    dense["oracle"] = run_dense(xd, torch.float64)
    for what, got in (("sparse", runs), ("dense", dense)):
        loss = 0 if what == "sparse" else 1
        for b in BACKENDS + ["oracle"]:
            assert torch.isnan(got[b][loss]), (what, b, key)
        for ref, cpu in zip(got["reference"][loss + 1:], got["cpu"][loss + 1:]):
            assert not (torch.isnan(ref) & ~torch.isnan(cpu)).any(), (what, key)


def test_dense_opcheck_compile_and_bad_inputs():
    x = dense_inputs(seed=2)
    mx, sm = naive_attention_stats(x["q"], x["k"], scale=0.15, query_rope=x["qr"], key_rope=x["kr"],
                                   query_lengths=x["ql"], key_lengths=x["kl"])
    iq, ik, w = leaves(x["iq"], x["ik"], x["w"], dtype=torch.float32)
    ql, kl = torch.tensor(x["ql"]), torch.tensor(x["kl"])
    torch.library.opcheck(torch.ops.dsa.dense_indexer_lse.default, (iq.detach(), ik.detach(), w.detach(), 0.5, 1, ql, kl, "TND", "cpu"))
    lse = dsa.dsa_dense_indexer_lse(iq, ik, w, scale=0.5, query_lengths=x["ql"], key_lengths=x["kl"])
    torch.library.opcheck(torch.ops.dsa.dense_indexer_kl_loss.default,
                          (iq, ik, w, x["q"], x["k"], mx, sm, lse, x["qr"], x["kr"], 0.15, 0.5, ql, kl, "TND", 1.0,
                           "mean", "cpu"))

    def f(iq, ik, w):
        lse = dsa.dsa_dense_indexer_lse(iq, ik, w, scale=0.5, query_lengths=x["ql"], key_lengths=x["kl"])
        return dsa.dsa_dense_indexer_kl_loss(iq, ik, w, x["q"], x["k"], mx, sm, lse, scale=0.15, index_scale=0.5,
                                             query_rope=x["qr"], key_rope=x["kr"], query_lengths=x["ql"],
                                             key_lengths=x["kl"])

    eager = f(iq, ik, w)
    compiled = torch.compile(f, fullgraph=True)(iq, ik, w)
    assert torch.equal(eager, compiled)
    compiled.backward()
    assert ik.grad is not None and torch.isfinite(ik.grad).all()

    base = dict(scale=0.15, query_lengths=x["ql"], key_lengths=x["kl"])
    args = [iq, ik, w, x["q"], x["k"], mx, sm, lse]

    def call(i, v, **over):
        a = list(args)
        a[i] = v
        return dsa.dsa_dense_indexer_kl_loss(*a, **{**base, **over})

    with pytest.raises(ValueError, match="key"):
        call(4, torch.randn(x["k"].shape[0], 3, 32))  # Hk = 3 does not divide H = 4
    with pytest.raises(ValueError, match="indexer_lse"):
        call(7, lse[:-1])
    with pytest.raises(ValueError, match="softmax_sum"):
        call(6, sm[:, :-1])
    with pytest.raises(ValueError, match="head_weights"):
        call(2, w.double())
    with pytest.raises(ValueError, match="rope"):
        call(3, x["q"], query_rope=x["qr"])
    with pytest.raises(ValueError, match="reduction"):
        call(3, x["q"], reduction="none")
    with pytest.raises(ValueError, match="cmp_ratio"):
        dsa.dsa_dense_indexer_lse(iq, ik, w, cmp_ratio=0)


def test_dense_fused_memory_independent_of_sequence_length():
    """T = S = 16384: a [T, S] fp32 matrix is 1 GiB; the fused forward + backward
    must add far less than that (measured as peak RSS in a fresh process)."""
    script = textwrap.dedent("""
        import resource, sys, torch, dsa
        T = int(sys.argv[1]); g = torch.Generator().manual_seed(0)
        iq = torch.randn(T, 1, 16, generator=g, dtype=torch.bfloat16).requires_grad_()
        ik = torch.randn(T, 16, generator=g, dtype=torch.bfloat16).requires_grad_()
        w = torch.rand(T, 1, generator=g, dtype=torch.bfloat16).requires_grad_()
        q = torch.randn(T, 1, 16, generator=g, dtype=torch.bfloat16)
        k = torch.randn(T, 1, 16, generator=g, dtype=torch.bfloat16)
        mx = torch.full((T, 1), 4.0); sm = torch.arange(1, T + 1, dtype=torch.float32).reshape(T, 1)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        lse = dsa.dsa_dense_indexer_lse(iq, ik, w)
        loss = dsa.dsa_dense_indexer_kl_loss(iq, ik, w, q, k, mx, sm, lse, scale=0.25)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(ik.grad.float()).all()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script, "16384"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    extra = int(out.stdout.strip().splitlines()[-1])
    assert 16384 * 16384 * 4 >= 2 ** 30
    assert extra < 64 * 2 ** 20, f"extra peak memory {extra / 2**20:.1f} MiB"
