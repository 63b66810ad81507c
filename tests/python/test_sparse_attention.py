"""dsa_sparse_attention against an independent float64 PyTorch oracle (docs/testing.md rule).

For every output, statistic and gradient:
``max|x - oracle64| <= 2 * max|naive_same_dtype - oracle64| + 1e-5``; fp32 inputs:
relative error <= 1e-4. Both the fused ("cpu") and the "reference" backend are checked.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

import _tolerance
import dsa
from _indices import fold_into_sequences
from dsa.naive import naive_sparse_attention, oracle_sparse_attention

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_case(mode, dtype, layout="TND", seed=0, heads=3, dim=40, d_v=None, rope=0, topk=9,
              window=None, ratio=1, cmp_topk=0, sinks=None, q_lens=(5, 0, 1, 23), k_lens=(9, 3, 1, 40)):
    g = torch.Generator().manual_seed(seed)
    tnd = layout == "TND"
    batch = len(q_lens)
    sq, sk = max(q_lens), max(k_lens)
    qlead = (sum(q_lens),) if tnd else (batch, sq)
    klead = (sum(k_lens),) if tnd else (batch, sk)
    clead = (sum(k // ratio for k in k_lens),) if tnd else (batch, sk // ratio)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    kw = dict(scale=1.0 / math.sqrt(dim + rope), layout=layout)
    inputs = dict(query=rnd(*qlead, heads, dim), kv=rnd(*klead, dim))
    if mode == "indices":
        kw["indices"] = fold_into_sequences(
            torch.randint(-2, sk + 2, (*qlead, topk), generator=g, dtype=torch.int32), q_lens, k_lens, layout)
    if window is not None:
        kw["window"] = window
    if d_v is not None:
        kw["d_v"] = d_v
    if rope:
        inputs["query_rope"] = rnd(*qlead, heads, rope)
        inputs["key_rope"] = rnd(*klead, rope)
    if ratio > 1:
        inputs["cmp_kv"] = rnd(*clead, dim)
        kw["cmp_ratio"] = ratio
        if cmp_topk:
            kw["cmp_indices"] = fold_into_sequences(
                torch.randint(-1, sk // ratio + 2, (*qlead, cmp_topk), generator=g, dtype=torch.int32),
                q_lens, [k // ratio for k in k_lens], layout)
    if sinks is not None:
        inputs["sinks"] = (torch.randn(heads, generator=g) if sinks == "random"
                           else torch.full((heads,), float(sinks)))
    if tnd:
        kw["query_lengths"] = list(torch.tensor(q_lens).cumsum(0).tolist())
        kw["key_lengths"] = list(torch.tensor(k_lens).cumsum(0).tolist())
    else:
        kw["query_lengths"] = list(q_lens)
        kw["key_lengths"] = list(k_lens)
    return inputs, kw


DIFFERENTIABLE = ("query", "kv", "query_rope", "key_rope", "cmp_kv", "sinks")


def upstream_gradient(shape, dtype, grad_seed=1):
    """The random dO of a backward check, drawn in the inputs' dtype: the op, the naive
    peer and the float64 oracle see the same values (unrounded digits on the oracle's
    side once set a bf16 d_sinks off by exactly the rounding of dO)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(grad_seed)).to(dtype)


def run(fn, inputs, kw, grad_seed=1, unreached_grad_is_zero=False, grad_dtype=None, extra_loss=None):
    """Forward + backward; returns {name: tensor} for outputs, stats and every gradient.
    With unreached_grad_is_zero (for the oracles: autograd leaves .grad None on an
    input the output never reached, e.g. a cmp_kv with no entries or T = 0) such a
    gradient is zeros; the fused op must return it. The upstream gradient is drawn
    in grad_dtype (default: the query's dtype); extra_loss(out, max, sum, leaves, dO)
    adds a term to what is differentiated."""
    leaves = {k: v.detach().clone().requires_grad_(k in DIFFERENTIABLE) for k, v in inputs.items()}
    args = dict(kw)
    query, kv = leaves.pop("query"), leaves.pop("kv")
    out, mx, sm = fn(query, kv, **leaves, **args)
    g = upstream_gradient(out.shape, grad_dtype or query.dtype, grad_seed).to(out.dtype)
    loss = (out * g).sum()
    if extra_loss is not None:
        loss = loss + extra_loss(out, mx, sm, leaves, g)
    loss.backward()
    def grad(t):
        return torch.zeros_like(t) if t.grad is None and unreached_grad_is_zero else t.grad

    res = {"out": out.detach(), "softmax_max": mx.detach(), "softmax_sum": sm.detach(),
           "d_query": grad(query), "d_kv": grad(kv)}
    for k, v in leaves.items():
        res["d_" + k] = grad(v) if k in DIFFERENTIABLE else v.grad
    return res


def run_oracle(inputs, kw, returned_out=None):
    """run() on the float64 oracle, on float64 leaves: its gradients are not rounded
    back to the inputs' dtype (a bf16 leaf would round them; an fp16 d_kv on a rounding
    tie once failed the rule by one ulp of the oracle's own rounding).

    With returned_out (an op's `out`), the gradients are those of the backward the
    contract defines (docs/ops.md 4.2, docs/testing.md): its row term
    delta = dO . out is taken from the output the op returned, as every flash-style
    backward takes it, and in bf16 / fp16 that output is rounded. Moving delta by
    e = dO . (returned_out - out) moves each logit's gradient by -e * P and the sink's
    by -e * p_sink: the gradient of -sum e * lse, added here exactly in float64. What
    is left between the op and this target is the op's own arithmetic."""
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}

    def row_term_on_returned_out(out, mx, sm, leaves, g):
        e = (g * (returned_out.double() - out.detach())).sum(-1)
        has_keys = torch.isfinite(mx)
        shift = torch.where(has_keys, mx.double(), torch.zeros_like(mx, dtype=torch.float64))
        denom = torch.where(has_keys, sm.double(), torch.ones_like(shift))
        if "sinks" in leaves:
            denom = denom + torch.exp(leaves["sinks"] - shift)
        lse = shift + torch.log(denom)
        return -(torch.where(has_keys, e, torch.zeros_like(e)) * lse).sum()

    oracle = functools.partial(oracle_sparse_attention, differentiable_stats=returned_out is not None)
    return run(oracle, wide, kw, unreached_grad_is_zero=True, grad_dtype=inputs["query"].dtype,
               extra_loss=None if returned_out is None else row_term_on_returned_out)


def fused(backend):
    return lambda q, kv, **kw: dsa.dsa_sparse_attention(q, kv, backend=backend, **kw)


def check_against_oracle(inputs, kw, backends=("cpu", "reference")):
    dtype = inputs["query"].dtype
    oracle = run_oracle(inputs, kw)
    naive = run(naive_sparse_attention, inputs, kw, unreached_grad_is_zero=True)
    for backend in backends:
        got = run(fused(backend), inputs, kw)
        on_returned_out = run_oracle(inputs, kw, returned_out=got["out"])
        assert got.keys() == oracle.keys()
        for name, exact in oracle.items():
            x = got[name]
            # Outputs and statistics against the exact answer; gradients against the
            # exact backward of the output the op returned (run_oracle).
            want = on_returned_out[name] if name.startswith("d_") else exact
            assert x is not None, (backend, name)
            assert x.shape == want.shape, (backend, name)
            assert x.dtype == (torch.float32 if name.startswith("softmax") or name == "d_sinks" else dtype), name
            x, w, n = x.double(), want.double(), naive[name].double()
            # +-inf and NaN in the same places.
            assert torch.equal(torch.isinf(x), torch.isinf(w)), (backend, name)
            assert torch.equal(x[torch.isinf(x)], w[torch.isinf(w)]), (backend, name)
            assert not torch.isnan(x).any(), (backend, name)
            fin = torch.isfinite(w)
            err = (x - w)[fin].abs().max().item() if fin.any() else 0.0
            scale = w[fin].abs().max().item() if fin.any() else 0.0
            ref_err = (n - exact.double())[fin].abs().max().item() if fin.any() else 0.0
            assert err <= _tolerance.bound(dtype == torch.float32, scale, ref_err), (backend, name, err, scale, ref_err)
    return oracle


MODES = {
    "v32_indices_rope": dict(mode="indices", dim=48, rope=16, d_v=32, topk=11),
    "v32_indices_shared": dict(mode="indices", heads=16, dim=72, d_v=64, topk=64,
                               q_lens=(63, 2), k_lens=(97, 2)),
    "dense_causal_prefix": dict(mode="dense", heads=2, dim=33, q_lens=(7, 2, 65, 1), k_lens=(7, 9, 97, 1)),
    "window_sinks": dict(mode="dense", heads=4, dim=32, window=9, sinks="random",
                         q_lens=(70, 1, 0), k_lens=(70, 5, 3)),
    "window_hca": dict(mode="dense", heads=3, dim=24, window=6, ratio=4, sinks="random",
                       q_lens=(45, 3, 2), k_lens=(45, 3, 20)),
    "window_hca_128": dict(mode="dense", heads=2, dim=16, window=8, ratio=128, sinks="random",
                           q_lens=(300, 5), k_lens=(300, 100)),
    "window_csa": dict(mode="dense", heads=5, dim=32, window=8, ratio=4, cmp_topk=7, sinks="random",
                       q_lens=(40, 12), k_lens=(50, 12)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name", list(MODES))
def test_modes_tnd(name, dtype):
    inputs, kw = make_case(dtype=dtype, **MODES[name])
    check_against_oracle(inputs, kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("name", ["v32_indices_rope", "window_csa", "window_hca", "dense_causal_prefix"])
def test_modes_bsnd_padded(name, dtype):
    spec = dict(MODES[name])
    spec["q_lens"], spec["k_lens"] = (6, 0, 3), (10, 4, 9)
    inputs, kw = make_case(dtype=dtype, layout="BSND", **spec)
    check_against_oracle(inputs, kw)


@pytest.mark.parametrize("where", ["query", "kv"])
@pytest.mark.parametrize("name", ["v32_indices_rope", "dense_causal_prefix", "window_csa"])
def test_nan_reaches_what_it_reaches_in_the_reference(name, where):
    """One NaN in the data: the fused op's outputs, statistics and gradients are NaN
    exactly where the reference backend's are (docs/hardening.md, "Non-finite data"),
    and a NaN query makes its head's output NaN, not zeros."""
    inputs, kw = make_case(dtype=torch.bfloat16, **MODES[name])
    flat = inputs[where].view(-1)
    flat[flat.numel() // 3] = float("nan")
    got, ref = run(fused("cpu"), inputs, kw), run(fused("reference"), inputs, kw)
    assert torch.isnan(ref["out"]).any()
    for key, want in ref.items():
        if want is None:
            continue
        assert torch.equal(torch.isnan(got[key]), torch.isnan(want)), (name, where, key)


@pytest.mark.parametrize("sink", [float("-inf"), 0.0, 40.0, float("inf")])
def test_sink_extremes(sink):
    inputs, kw = make_case("dense", torch.bfloat16, heads=2, dim=16, window=5, sinks=sink,
                           q_lens=(12,), k_lens=(12,))
    check_against_oracle(inputs, kw)


def test_a_nan_sink_makes_its_head_nan():
    """A NaN sink joins its head's denominator: the head's outputs are NaN on both
    backends and in the float64 oracle, which had replaced a NaN denominator by 1."""
    inputs, kw = make_case("dense", torch.float32, heads=2, dim=16, window=5, sinks=0.5, q_lens=(12,), k_lens=(12,))
    inputs["sinks"][1] = float("nan")
    oracle = run_oracle(inputs, kw)["out"]
    assert torch.isnan(oracle[:, 1]).all() and not torch.isnan(oracle[:, 0]).any()
    for backend in ("cpu", "reference"):
        assert torch.equal(torch.isnan(run(fused(backend), inputs, kw)["out"]), torch.isnan(oracle)), backend

def test_empty_rows_and_special_indices():
    inputs, kw = make_case("indices", torch.float32, heads=2, dim=8, topk=4, q_lens=(5,), k_lens=(7,))
    idx = torch.tensor([[-1, -1, -1, -1],     # all invalid -> empty row
                        [-1, 6, 4, 5],         # all past the row's position (3): skipped
                        [0, 0, 0, 2],          # duplicates count each time
                        [5, 5, -1, 6],         # pos 5: key 5 twice, key 6 not yet
                        [6, 6, 6, 6]], dtype=torch.int32)
    kw["indices"] = idx
    kw["sinks"] = None
    oracle = check_against_oracle(inputs, kw)
    got = run(fused("cpu"), inputs, kw)
    assert torch.all(got["softmax_max"][:2] == float("-inf"))
    assert torch.all(got["softmax_sum"][:2] == 0)
    assert torch.all(got["out"][:2] == 0) and torch.all(got["d_query"][:2] == 0)
    assert torch.allclose(got["softmax_sum"][4], torch.full((2,), 4.0))
    assert oracle["softmax_sum"][4].tolist() == [4.0, 4.0]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_indices_outside_their_sequence_are_refused(backend):
    """A position the sequence does not hold (a global row, a bad slot) is a ValueError
    naming the argument, never skipped in silence (docs/ops.md section 2). The backward's
    own check is tested in C++ (autograd refuses indices changed after the forward)."""
    inputs, kw = make_case("indices", torch.float32, heads=2, dim=8, topk=4, q_lens=(3, 2), k_lens=(4, 6),
                           window=None, ratio=2, cmp_topk=2)
    kw["backend"] = backend
    for name, row, bad, what in [("indices", 3, 6, "is 6, outside the sequence's 6 keys"),  # a packed row of seq 0
                                 ("indices", 0, -2, "is -2, outside"),
                                 ("cmp_indices", 4, 3, "is 3, outside the sequence's 3 compressed entries")]:
        args = dict(kw)
        args[name] = kw[name].clone()
        args[name][row, 1] = bad
        with pytest.raises(ValueError, match=rf"^{name}: row {row} .*{what}"):
            dsa.dsa_sparse_attention(**inputs, **args)


def test_v32_shapes_small_tokens():
    """DeepSeek-V3.2 widths (576 = 512 + 64, d_v 512) on a few tokens: both forms agree."""
    g = torch.Generator().manual_seed(3)
    T, S, H = 3, 37, 4
    q = torch.randn(T, H, 576, generator=g).bfloat16()
    kv = torch.randn(S, 576, generator=g).bfloat16()
    idx = torch.randint(-1, S, (T, 16), generator=g, dtype=torch.int32)
    a = dsa.dsa_sparse_attention(q, kv, idx, scale=0.05, d_v=512, key_lengths=[S])
    b = dsa.dsa_sparse_attention(q[..., :512], kv[:, :512], idx, scale=0.05, query_rope=q[..., 512:],
                                 key_rope=kv[:, 512:], key_lengths=[S])
    for x, y in zip(a, b):
        assert torch.allclose(x.float(), y.float(), atol=1e-2, rtol=1e-2)
    inputs = dict(query=q, kv=kv)
    check_against_oracle(inputs, dict(indices=idx, scale=0.05, d_v=512, key_lengths=[S]), backends=("cpu",))


def test_deterministic_across_threads():
    inputs, kw = make_case("indices", torch.bfloat16, heads=4, dim=32, topk=30, q_lens=(50,), k_lens=(64,))
    prev = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(run(fused("cpu"), inputs, kw))
    finally:
        torch.set_num_threads(prev)
    for other in results[1:]:
        for name, x in results[0].items():
            assert torch.equal(x, other[name]), name


def _op_args(inputs, kw):
    return (inputs["query"], inputs["kv"], kw.get("indices"), inputs.get("cmp_kv"), kw.get("cmp_indices"),
            inputs.get("sinks"), inputs.get("query_rope"), inputs.get("key_rope"),
            torch.tensor(kw["query_lengths"]), torch.tensor(kw["key_lengths"]), kw["scale"],
            kw.get("d_v", 0), kw.get("window", 0), kw.get("cmp_ratio", 1), kw["layout"], "cpu")


@pytest.mark.parametrize("name", ["v32_indices_rope", "window_csa"])
def test_opcheck(name):
    spec = dict(MODES[name])
    spec["q_lens"], spec["k_lens"] = (4, 3), (6, 9)
    inputs, kw = make_case(dtype=torch.float32, **spec)
    args = _op_args({k: v.requires_grad_(k in DIFFERENTIABLE) for k, v in inputs.items()}, kw)
    torch.library.opcheck(torch.ops.dsa.sparse_attention_fwd.default, args)
    out, mx, sm = torch.ops.dsa.sparse_attention_fwd(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    bwd_args = (torch.randn_like(out), out, mx, sm) + tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.dsa.sparse_attention_bwd.default, bwd_args)


def test_torch_compile_fullgraph():
    inputs, kw = make_case("dense", torch.float32, heads=2, dim=16, window=4, ratio=4, cmp_topk=3,
                           sinks="random", q_lens=(13,), k_lens=(17,))
    kw["query_lengths"] = torch.tensor(kw["query_lengths"])
    kw["key_lengths"] = torch.tensor(kw["key_lengths"])

    def step(query, kv, cmp_kv, sinks):
        out, mx, sm = dsa.dsa_sparse_attention(query, kv, cmp_kv=cmp_kv, sinks=sinks, **kw)
        return out.square().sum() + mx.nan_to_num(neginf=0).sum()

    leaves = [inputs[k].clone().requires_grad_() for k in ("query", "kv", "cmp_kv", "sinks")]
    loss = torch.compile(step, fullgraph=True)(*leaves)
    loss.backward()
    eager = [inputs[k].clone().requires_grad_() for k in ("query", "kv", "cmp_kv", "sinks")]
    step(*eager).backward()
    for a, b in zip(leaves, eager):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_meta_tensor_beside_real_ones_is_named():
    """A weight not loaded yet (meta) beside real tensors is a ValueError naming it: torch
    would otherwise route the call to the fake kernel, whose outputs hold no result. An
    all-meta call propagates shapes (the fake kernels)."""
    q, kv, idx = torch.randn(4, 2, 8), torch.randn(6, 8), torch.zeros(4, 3, dtype=torch.int32)
    meta = torch.empty(6, 8, device="meta")
    with pytest.raises(ValueError, match=r"^kv: a meta tensor .* beside query on cpu"):
        dsa.dsa_sparse_attention(q, meta, idx, scale=1.0)
    with pytest.raises(ValueError, match=r"^index_key: a meta tensor"):
        dsa.dsa_indexer(q, meta, torch.randn(4, 2), topk=2)
    cache = dsa.new_paged_cache(2, 8, dtype="bf16", block_size=4)
    with pytest.raises(ValueError, match=r"^positions: a meta tensor"):
        dsa.dsa_cache_gather(cache, torch.zeros(1, 1, dtype=torch.int32),
                             torch.empty(1, 2, dtype=torch.int64, device="meta"), dim=8)
    out, mx, _ = dsa.dsa_sparse_attention(q.to("meta"), meta, idx.to("meta"), scale=1.0)
    assert out.device.type == "meta" and tuple(out.shape) == (4, 2, 8) and mx.device.type == "meta"


def test_bad_inputs():
    q = torch.randn(4, 2, 8)
    kv = torch.randn(6, 8)
    idx = torch.zeros(4, 3, dtype=torch.int32)
    f = dsa.dsa_sparse_attention
    cases = [
        (lambda: f(q, torch.randn(6, 7), idx, scale=1.0), "kv"),
        (lambda: f(q, kv.bfloat16(), idx, scale=1.0), "kv"),
        (lambda: f(q, kv, idx.long(), scale=1.0), "indices"),
        (lambda: f(q, kv, idx[:3], scale=1.0), "indices"),
        (lambda: f(q[0], kv, idx, scale=1.0), "query"),
        (lambda: f(q, kv, idx, scale=float("nan")), "scale"),
        (lambda: f(q, kv, scale=1.0, window=0), "window"),
        (lambda: f(q, kv, idx, scale=1.0, window=4), "window"),
        (lambda: f(q, kv, scale=1.0, d_v=9), "d_v"),
        (lambda: f(q, kv, scale=1.0, cmp_ratio=4), "cmp_ratio"),
        (lambda: f(q, kv, scale=1.0, cmp_kv=torch.randn(1, 8)), "cmp_ratio"),
        (lambda: f(q, kv, scale=1.0, cmp_ratio=0, cmp_kv=torch.randn(1, 8)), "cmp_ratio"),
        (lambda: f(q, kv, scale=1.0, cmp_ratio=4, cmp_kv=torch.randn(3, 8)), "key_lengths"),
        (lambda: f(q, kv, scale=1.0, sinks=torch.zeros(3)), "sinks"),
        (lambda: f(q, kv, scale=1.0, sinks=torch.zeros(2, dtype=torch.float64)), "sinks"),
        (lambda: f(q, kv, scale=1.0, query_rope=torch.randn(4, 2, 4)), "key_rope"),
        (lambda: f(q, kv, scale=1.0, query_lengths=[5], key_lengths=[6]), "query_lengths"),
        (lambda: f(q, kv, scale=1.0, query_lengths=[3, 4], key_lengths=[2, 6]), "Lq must be <= Lk"),
        (lambda: f(q, kv, scale=1.0, key_lengths=[7]), "key_lengths"),
        (lambda: f(q, kv, scale=1.0, query_lengths=[float("nan")]), "query_lengths"),
        (lambda: f(q, kv, scale=1.0, layout="NTD"), "layout"),
        (lambda: f(q, kv, scale=1.0, backend="gpu"), "backend"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle):
            call()


def test_backward_gets_no_zero_filled_statistics_gradients():
    torch.manual_seed(0)
    q = torch.randn(6, 4, 40, requires_grad=True)
    kv = torch.randn(6, 40, requires_grad=True)
    out, _, _ = dsa.dsa_sparse_attention(q, kv, scale=0.2, d_v=32)
    seed = torch.randn_like(out)
    with torch.profiler.profile() as prof:
        got = torch.autograd.grad(out, (q, kv), seed)
    filled = [e.key for e in prof.key_averages() if e.key in ("aten::zeros", "aten::zero_", "aten::fill_")]
    assert filled == [], filled
    q2, kv2 = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    ref = dsa.dsa_sparse_attention(q2, kv2, scale=0.2, d_v=32, backend="reference")[0]
    want = torch.autograd.grad(ref, (q2, kv2), seed)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
