"""dsa_indexer (docs/ops.md 4.1) against the float64 oracle in dsa.naive (docs/testing.md rules)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch

import _tolerance
import dsa
from dsa import dsa_indexer
from dsa.naive import naive_indexer, oracle_indexer, oracle_indexer_full_scores, sequence_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["cpu", "reference"]


@dataclass
class Case:
    name: str
    q_lens: list            # TND: per sequence; BSND: valid length per batch row
    k_lens: Optional[list]  # raw key lengths, None: not passed
    heads: int
    dim: int
    topk: int
    layout: str = "TND"
    ratio: int = 1
    scale: float = 1.0
    sq: int = 0             # BSND padded extents (sk: key rows per batch row, compressed if ratio > 1)
    sk: int = 0
    key_head_dim: bool = False
    extra: dict = field(default_factory=dict)


CASES = [
    # several sequences incl. length 0 and 1, prefix KV, tile-edge lengths, odd H and D
    Case("tnd_multi", [5, 0, 1, 63, 65], [5, 0, 1, 97, 65], heads=3, dim=65, topk=7, scale=0.5),
    # one sequence, lengths None, one head
    Case("tnd_single_h1", [97], None, heads=1, dim=32, topk=64),
    # a query chunk over its prefix KV (Lq < Lk)
    Case("tnd_prefix", [20], [120], heads=4, dim=128, topk=16),
    # topk beyond every visible count, [S, 1, D] keys
    Case("tnd_topk_big", [1, 2, 70], [1, 40, 130], heads=16, dim=128, topk=300, key_head_dim=True),
    # padded rows, an empty row, prefix KV per row
    Case("bsnd_padded", [33, 0, 17], [70, 5, 40], heads=3, dim=64, topk=16, layout="BSND", sq=33, sk=70),
    # compressed keys, a sequence shorter than the ratio
    Case("tnd_ratio4", [3, 40, 100], [3, 60, 100], heads=8, dim=128, topk=8, ratio=4),
    # ratio 128: most queries see nothing; key lengths None (= query lengths)
    Case("tnd_ratio128", [100, 300], None, heads=3, dim=32, topk=4, ratio=128),
    # BSND compressed, [B, Sk, 1, D] keys, key lengths None
    Case("bsnd_ratio4", [40, 13], None, heads=2, dim=64, topk=5, layout="BSND", ratio=4, sq=40, sk=10,
         key_head_dim=True),
]


def raw_key_lengths(case: Case) -> list:
    if case.k_lens is not None:
        return case.k_lens
    if case.ratio > 1:
        return case.q_lens
    return [case.sk] * len(case.q_lens) if case.layout == "BSND" else [sum(case.q_lens)]


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0):
    """Random inputs and the keyword arguments of the call (lengths in the layout's user form)."""
    g = torch.Generator().manual_seed(seed)
    raw = raw_key_lengths(case)
    entries = [n // case.ratio if case.ratio > 1 else n for n in raw]
    if case.layout == "TND":
        q_shape = (sum(case.q_lens), case.heads, case.dim)
        k_shape = (sum(entries), case.dim)
        w_shape = (sum(case.q_lens), case.heads)
        ends = lambda lens: torch.tensor(lens).cumsum(0).tolist()  # noqa: E731
        q_lengths = ends(case.q_lens)
        k_lengths = ends(case.k_lens) if case.k_lens is not None else None
    else:
        b = len(case.q_lens)
        q_shape = (b, case.sq, case.heads, case.dim)
        k_shape = (b, case.sk, case.dim)
        w_shape = (b, case.sq, case.heads)
        q_lengths = list(case.q_lens)
        k_lengths = list(case.k_lens) if case.k_lens is not None else None
    q = torch.randn(q_shape, generator=g).to(dtype)
    k = torch.randn(k_shape, generator=g).to(dtype)
    w = torch.randn(w_shape, generator=g).to(dtype)
    if case.key_head_dim:
        k = k.unsqueeze(-2)
    kwargs = dict(topk=case.topk, scale=case.scale, cmp_ratio=case.ratio, query_lengths=q_lengths,
                  key_lengths=k_lengths, layout=case.layout)
    return q, k, w, kwargs


def _score_kwargs(kwargs):
    return {k: v for k, v in kwargs.items() if k != "topk"}


def tolerance(q, k, w, kwargs, oracle_full) -> float:
    """docs/testing.md's rule (_tolerance.bound) over every finite score."""
    finite = [r[torch.isfinite(r)] for r in oracle_full if r.numel()]
    scale = max([float(r.abs().max()) for r in finite if r.numel()], default=0.0)
    if q.dtype == torch.float32:
        return _tolerance.bound(True, scale, None)
    naive_full = oracle_indexer_full_scores(q, k, w, dtype=q.dtype, **_score_kwargs(kwargs))
    err = 0.0
    for a, b in zip(naive_full, oracle_full):
        both = torch.isfinite(a.double()) & torch.isfinite(b)
        if both.any():
            err = max(err, float((a.double()[both] - b[both]).abs().max()))
    return _tolerance.bound(False, scale, err)


def check_selection(indices, scores, q, k, w, kwargs, *, what=""):
    """The docs/testing.md top-k rule against the fp64 oracle; `scores` may be None."""
    topk = kwargs["topk"]
    oracle_idx, _ = oracle_indexer(q, k, w, **kwargs)
    full = oracle_indexer_full_scores(q, k, w, **_score_kwargs(kwargs))
    tol = tolerance(q, k, w, kwargs, full)
    assert indices.dtype == torch.int32
    assert indices.shape == oracle_idx.shape, what
    idx = indices.reshape(-1, topk)
    ref = oracle_idx.reshape(-1, topk)
    sc = scores.reshape(-1, topk) if scores is not None else None
    if scores is not None:
        assert scores.dtype == torch.float32 and scores.shape == indices.shape
    for row, visible_scores in enumerate(full):
        visible = visible_scores.numel()
        n = min(topk, visible)
        got = idx[row]
        where = f"{what} row {row} (visible {visible})"
        assert (got[n:] == -1).all(), where
        if sc is not None:
            tail = sc[row, n:]
            assert bool((torch.isinf(tail) & (tail < 0)).all()), where
        chosen = got[:n].long()
        assert bool((chosen >= 0).all() and (chosen < visible).all()), f"{where}: {got.tolist()}"
        assert bool((chosen[1:] > chosen[:-1]).all()), f"{where}: not ascending {got.tolist()}"
        if n == 0:
            continue
        exact = visible_scores[chosen]
        if sc is not None:
            mine = sc[row, :n].double()
            assert torch.equal(torch.isnan(mine), torch.isnan(exact)), f"{where}: NaN placement"
            ok = ~torch.isnan(exact)
            err = float((mine[ok] - exact[ok]).abs().max()) if ok.any() else 0.0
            assert err <= tol, f"{where}: score error {err} > {tol}"
        if torch.equal(got, ref[row]):
            continue
        # Near-tie: every selected score >= every unselected visible score - tol; NaN lowest.
        mask = torch.ones(visible, dtype=torch.bool)
        mask[chosen] = False
        others = visible_scores[mask]
        other_numbers = others[~torch.isnan(others)]
        assert not (torch.isnan(exact).any() and other_numbers.numel()), f"{where}: NaN chosen over a number"
        if other_numbers.numel():
            lowest = float(exact[~torch.isnan(exact)].min())
            best_other = float(other_numbers.max())
            assert lowest >= best_other - tol, (
                f"{where}: selection {got.tolist()} vs oracle {ref[row].tolist()}: "
                f"{lowest} < {best_other} - {tol}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_oracle(case, dtype, backend):
    q, k, w, kwargs = make_inputs(case, dtype, seed=CASES.index(case))
    indices, scores = dsa_indexer(q, k, w, return_scores=True, backend=backend, **kwargs)
    check_selection(indices, scores, q, k, w, kwargs, what=f"{case.name}/{dtype}/{backend}")
    only_indices = dsa_indexer(q, k, w, backend=backend, **kwargs)
    assert torch.equal(only_indices, indices)


def test_bsnd_padding_rows_are_empty():
    case = CASES[4]
    q, k, w, kwargs = make_inputs(case, torch.bfloat16)
    for backend in BACKENDS:
        indices, scores = dsa_indexer(q, k, w, return_scores=True, backend=backend, **kwargs)
        for b, n in enumerate(case.q_lens):
            assert (indices[b, n:] == -1).all()
            assert torch.isneginf(scores[b, n:]).all()
            assert (indices[b, :n, 0] >= 0).all()  # every valid query sees at least one key


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_smaller_positions(backend):
    # A zero query scores 0 against every key: the first min(topk, visible) positions win.
    q = torch.zeros(50, 3, 32, dtype=torch.bfloat16)
    k = torch.randn(80, 32).to(torch.bfloat16)
    w = torch.randn(50, 3).to(torch.bfloat16)
    indices, scores = dsa_indexer(q, k, w, topk=10, query_lengths=[20, 50], key_lengths=[25, 80],
                                  return_scores=True, backend=backend)
    expect = torch.full((50, 10), -1, dtype=torch.int32)
    for row in range(50):
        visible = 25 - 20 + row + 1 if row < 20 else 55 - 30 + (row - 20) + 1
        expect[row, :min(10, visible)] = torch.arange(min(10, visible), dtype=torch.int32)
    assert torch.equal(indices, expect)
    assert (scores[indices >= 0] == 0).all()
    # Integer-valued inputs: exact scores with many ties; the oracle's rule must hold exactly.
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-1, 2, (97, 2, 16), generator=g).to(torch.float32)
    k = torch.randint(-1, 2, (97, 16), generator=g).to(torch.float32)
    w = torch.randint(0, 2, (97, 2), generator=g).to(torch.float32)
    indices, scores = dsa_indexer(q, k, w, topk=5, return_scores=True, backend=backend)
    oracle_idx, oracle_scores = oracle_indexer(q, k, w, topk=5)
    assert torch.equal(indices, oracle_idx)
    assert torch.equal(scores, oracle_scores.float())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_nan_scores_rank_last(backend, dtype):
    case = Case("nan", [10, 60], [12, 90], heads=3, dim=64, topk=9)
    q, k, w, kwargs = make_inputs(case, dtype, seed=11)
    nan_rows = list(range(1, 70, 7))
    q[nan_rows, 1, 5] = float("nan")
    k[3, 7] = float("nan")  # key 3 of the first sequence is NaN for all of its queries
    indices, scores = dsa_indexer(q, k, w, return_scores=True, backend=backend, **kwargs)
    check_selection(indices, scores, q, k, w, kwargs, what=f"nan/{dtype}/{backend}")
    for row in nan_rows:  # every score NaN: ties among NaN go to the smaller positions
        seq_row, lq, lk = (row, 10, 12) if row < 10 else (row - 10, 60, 90)
        n = min(9, lk - lq + seq_row + 1)
        assert indices[row, :n].tolist() == list(range(n))
        assert torch.isnan(scores[row, :n]).all()
    for row in range(10):  # the NaN key is chosen only when nothing else is left
        if row in nan_rows:
            continue
        visible = 12 - 10 + row + 1
        assert (3 in indices[row].tolist()) == (visible > 3 and visible <= 9)


def test_naive_peer_agrees_with_oracle():
    # The benchmark peer must compute the same op (up to its dtype's rounding).
    for case, dtype in [(CASES[0], torch.bfloat16), (CASES[4], torch.float16), (CASES[5], torch.float32)]:
        q, k, w, kwargs = make_inputs(case, dtype, seed=5)
        indices, scores = naive_indexer(q, k, w, **kwargs)
        assert scores.dtype == dtype
        check_selection(indices, scores.float(), q, k, w, kwargs, what=f"naive/{case.name}")


def test_length_forms():
    # TND ends; cmp_ratio > 1 with key lengths None: raw key lengths = query lengths.
    rows = sequence_rows(10, 2, cmp_ratio=4, query_lengths=[3, 10])
    assert [(r.q_begin, r.q_len, r.key_begin, r.key_length, r.entries) for r in rows] == [
        (0, 3, 0, 3, 0), (3, 7, 0, 7, 1)]
    rows = sequence_rows(6, 9, query_lengths=torch.tensor([2, 6]), key_lengths=[4, 9])
    assert [(r.q_begin, r.q_len, r.key_begin, r.key_length) for r in rows] == [(0, 2, 0, 4), (2, 4, 4, 5)]
    rows = sequence_rows(5, 7, layout="BSND", batch=2, query_lengths=[3, 5])
    assert [(r.q_begin, r.q_len, r.key_begin, r.key_length) for r in rows] == [(0, 3, 0, 7), (5, 5, 7, 7)]
    # The op accepts int32/int64 tensors as well as lists.
    q, k, w, kwargs = make_inputs(CASES[0], torch.float32)
    base = dsa_indexer(q, k, w, **kwargs)
    for dt in (torch.int32, torch.int64):
        other = dict(kwargs, query_lengths=torch.tensor(kwargs["query_lengths"], dtype=dt),
                     key_lengths=torch.tensor(kwargs["key_lengths"], dtype=dt))
        assert torch.equal(dsa_indexer(q, k, w, **other), base)


def test_one_and_two_threads_bit_identical():
    case = Case("threads", [3, 150, 1, 90], [3, 200, 9, 90], heads=5, dim=96, topk=20)
    saved = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, w, kwargs = make_inputs(case, dtype, seed=2)
            torch.set_num_threads(1)
            i1, s1 = dsa_indexer(q, k, w, return_scores=True, backend="cpu", **kwargs)
            torch.set_num_threads(2)
            i2, s2 = dsa_indexer(q, k, w, return_scores=True, backend="cpu", **kwargs)
            assert torch.equal(i1, i2)
            assert torch.equal(s1.view(torch.int32), s2.view(torch.int32))
    finally:
        torch.set_num_threads(saved)


# ---- every ISA path: DSA_ISA is read once per process, so one subprocess each ----

ISA_ORDER = ["portable", "avx2", "avx512", "avx512_bf16", "amx"]


def compact_isa_check() -> str:
    """Runs in a subprocess under DSA_ISA: a few cases against the oracle; returns the ISA used."""
    for case, dtype in [(CASES[0], torch.bfloat16), (CASES[5], torch.float16)]:
        q, k, w, kwargs = make_inputs(case, dtype, seed=9)
        indices, scores = dsa_indexer(q, k, w, return_scores=True, backend="cpu", **kwargs)
        check_selection(indices, scores, q, k, w, kwargs, what=f"isa/{case.name}")
    info = {b["name"]: b for b in dsa.backends()}["cpu"]
    assert info["works"], info
    return info["detail"].removeprefix("isa=")


def _start_subprocess(env_isa: Optional[str]) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("DSA_ISA", None)
    if env_isa is not None:
        env["DSA_ISA"] = env_isa
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # find dsa as this process does
    here = Path(__file__).resolve().parent
    code = ("import sys; sys.path.insert(0, %r); import test_indexer as t; print('ISA=' + t.compact_isa_check())"
            % str(here))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


_ISA_RESULTS: dict = {}


def _isa_used(runs: dict, isa: Optional[str]) -> str:
    if isa not in _ISA_RESULTS:
        out, _ = runs[isa].communicate(timeout=300)
        _ISA_RESULTS[isa] = (runs[isa].returncode, out)
    rc, out = _ISA_RESULTS[isa]
    assert rc == 0, out
    return [line for line in out.splitlines() if line.startswith("ISA=")][-1][4:]


@pytest.fixture(scope="module")
def isa_runs():
    """One subprocess per DSA_ISA value (plus one unrestricted), started together to save time."""
    procs = {isa: _start_subprocess(isa) for isa in ISA_ORDER}
    procs[None] = _start_subprocess(None)
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("isa", ISA_ORDER)
def test_every_isa_path(isa, isa_runs):
    best = _isa_used(isa_runs, None)
    used = _isa_used(isa_runs, isa)
    # DSA_ISA only lowers the ISA, never raises it beyond what the machine has.
    assert used == ISA_ORDER[min(ISA_ORDER.index(isa), ISA_ORDER.index(best))]
    # Asking for more than the CPU has is said, not silently lowered.
    out = _ISA_RESULTS[isa][1]
    assert (f"DSA_ISA={isa}: this CPU has {best} at most" in out) == (ISA_ORDER.index(isa) > ISA_ORDER.index(best))


def test_unknown_isa_is_named_and_the_best_one_runs(isa_runs):
    env = dict(os.environ, DSA_ISA="avx3", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", "import dsa; print(dsa._C.cpu_isa())"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "DSA_ISA=avx3: unknown (expected portable, avx2, avx512, avx512_bf16 or amx)" in proc.stderr
    assert proc.stdout.strip() == _isa_used(isa_runs, None)


# ---- torch integration ----

def test_opcheck():
    q, k, w, _ = make_inputs(CASES[0], torch.bfloat16)
    lengths = torch.tensor([5, 5, 6, 69, 134])
    key_lengths = torch.tensor([5, 5, 6, 103, 168])
    for with_scores in (True, False):
        torch.library.opcheck(torch.ops.dsa.indexer.default,
                              (q, k, w, 7, 0.5, 1, lengths, key_lengths, "TND", with_scores, "cpu"))
    case = CASES[4]
    q, k, w, _ = make_inputs(case, torch.float32)
    torch.library.opcheck(torch.ops.dsa.indexer.default,
                          (q, k, w, 16, 1.0, 1, torch.tensor(case.q_lens), torch.tensor(case.k_lens), "BSND",
                           True, "reference"))


def test_torch_compile_fullgraph():
    case = CASES[5]
    q, k, w, kwargs = make_inputs(case, torch.bfloat16)

    def f(q, k, w):
        return dsa_indexer(q, k, w, return_scores=True, **kwargs)

    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    i1, s1 = compiled(q, k, w)
    i2, s2 = f(q, k, w)
    assert torch.equal(i1, i2)
    assert torch.equal(s1, s2)


def test_inputs_requiring_grad_are_accepted():
    q, k, w, kwargs = make_inputs(CASES[1], torch.float32)
    q.requires_grad_(True)
    w.requires_grad_(True)
    indices = dsa_indexer(q, k, w, **kwargs)
    assert not indices.requires_grad


# ---- bad inputs ----

def _good():
    q = torch.randn(10, 2, 16)
    k = torch.randn(13, 16)
    w = torch.randn(10, 2)
    return q, k, w, dict(topk=3, query_lengths=[4, 10], key_lengths=[5, 13])


BAD = [
    ("query rank", "index_query", lambda q, k, w, a: (q.reshape(10, 32), k, w, a)),
    ("key dtype", "index_key", lambda q, k, w, a: (q, k.to(torch.bfloat16), w, a)),
    ("Di mismatch", "index_key", lambda q, k, w, a: (q, torch.randn(13, 8), w, a)),
    ("key heads", "index_key", lambda q, k, w, a: (q, torch.randn(13, 2, 16), w, a)),
    ("weights heads", "weights", lambda q, k, w, a: (q, k, torch.randn(10, 3), a)),
    ("weights int", "weights", lambda q, k, w, a: (q, k, torch.ones(10, 2, dtype=torch.int32), a)),
    ("query not a tensor", "index_query", lambda q, k, w, a: (q.tolist(), k, w, a)),
    ("topk 0", "topk", lambda q, k, w, a: (q, k, w, dict(a, topk=0))),
    ("topk -1", "topk", lambda q, k, w, a: (q, k, w, dict(a, topk=-1))),
    ("topk float", "topk", lambda q, k, w, a: (q, k, w, dict(a, topk=2.0))),
    ("topk overflowing int32", "topk: expected at most", lambda q, k, w, a: (q, k, w, dict(a, topk=2 ** 62))),
    ("key_lengths missing", "key_lengths: not given",
     lambda q, k, w, a: (q, k, w, {n: v for n, v in a.items() if n != "key_lengths"})),
    ("cmp_ratio 0", "cmp_ratio", lambda q, k, w, a: (q, k, w, dict(a, cmp_ratio=0))),
    ("scale NaN", "scale", lambda q, k, w, a: (q, k, w, dict(a, scale=float("nan")))),
    ("non-monotone", "query_lengths", lambda q, k, w, a: (q, k, w, dict(a, query_lengths=[6, 4, 10],
                                                                        key_lengths=[5, 5, 13]))),
    ("last end != T", "query_lengths", lambda q, k, w, a: (q, k, w, dict(a, query_lengths=[4, 9]))),
    ("last key end != S", "key_lengths", lambda q, k, w, a: (q, k, w, dict(a, key_lengths=[5, 12]))),
    ("Lq > Lk", "query_lengths", lambda q, k, w, a: (q, k, w, dict(a, key_lengths=[3, 13]))),
    ("key lengths count", "key_lengths", lambda q, k, w, a: (q, k, w, dict(a, key_lengths=[13]))),
    ("float lengths", "query_lengths", lambda q, k, w, a: (q, k, w, dict(a, query_lengths=[4.0, 10]))),
    ("NaN lengths", "query_lengths", lambda q, k, w, a: (q, k, w, dict(a, query_lengths=[float("nan"), 10]))),
    ("inf lengths", "key_lengths", lambda q, k, w, a: (q, k, w, dict(a, key_lengths=[5, math.inf]))),
    ("float tensor lengths", "query_lengths",
     lambda q, k, w, a: (q, k, w, dict(a, query_lengths=torch.tensor([4.0, 10.0])))),
    ("2-D tensor lengths", "key_lengths",
     lambda q, k, w, a: (q, k, w, dict(a, key_lengths=torch.tensor([[5, 13]])))),
    ("string lengths", "query_lengths", lambda q, k, w, a: (q, k, w, dict(a, query_lengths="4,10"))),
    ("compressed rows", "key_lengths", lambda q, k, w, a: (q, k, w, dict(a, cmp_ratio=4))),
    ("unknown layout", "layout", lambda q, k, w, a: (q, k, w, dict(a, layout="NTD"))),
    ("unknown backend", "backend", lambda q, k, w, a: (q, k, w, dict(a, backend="gpu"))),
    ("BSND lengths count", "query_lengths",
     lambda q, k, w, a: (q.reshape(2, 5, 2, 16), torch.randn(2, 7, 16), w.reshape(2, 5, 2),
                         dict(topk=3, layout="BSND", query_lengths=[5, 5, 5]))),
    ("BSND key lengths count", "key_lengths",
     lambda q, k, w, a: (q.reshape(2, 5, 2, 16), torch.randn(2, 7, 16), w.reshape(2, 5, 2),
                         dict(topk=3, layout="BSND", key_lengths=[7]))),
    ("BSND negative length", r"query_lengths: expected values >= 0, got -1 at position 1 of \[5, -1\]",
     lambda q, k, w, a: (q.reshape(2, 5, 2, 16), torch.randn(2, 7, 16), w.reshape(2, 5, 2),
                         dict(topk=3, layout="BSND", query_lengths=[5, -1]))),
    ("BSND row longer than Sq", "query_lengths",
     lambda q, k, w, a: (q.reshape(2, 5, 2, 16), torch.randn(2, 7, 16), w.reshape(2, 5, 2),
                         dict(topk=3, layout="BSND", query_lengths=[6, 5]))),
    ("BSND batch mismatch", "index_key",
     lambda q, k, w, a: (q.reshape(2, 5, 2, 16), torch.randn(3, 7, 16), w.reshape(2, 5, 2),
                         dict(topk=3, layout="BSND"))),
]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name,argument,mutate", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_value_error_naming_the_argument(name, argument, mutate, backend):
    q, k, w, a = mutate(*_good())
    a = dict(a)
    a.setdefault("backend", backend)
    with pytest.raises(ValueError, match=argument):
        dsa_indexer(q, k, w, **a)


def test_cuda_backend_is_a_clear_runtime_error():
    q, k, w, a = _good()
    with pytest.raises(RuntimeError, match="cuda") as info:
        dsa_indexer(q, k, w, backend="cuda", **a)
    assert not isinstance(info.value, ValueError)
    assert "backend='cpu'" in str(info.value) or "reference" in str(info.value)
