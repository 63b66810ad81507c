"""dsa_compressor_append (docs/serving.md): DeepSeek-V4's compressor fed a few
tokens at a time. Appending a prompt at once, in chunks or token by token gives
dsa_compressor's entries on the whole sequence (fp32: bit for bit), held to the
quality rule against the float64 oracle (python/dsa/naive.py) in bf16 / fp16; the
torch op passes opcheck and compiles; bad arguments raise naming them."""
from __future__ import annotations

import pytest
import torch

from dsa import dsa_compressor, dsa_compressor_append
from dsa.decode import _compressor_append_op, compressor_state_rows, new_compressor_state
from dsa.naive import naive_compressor

from test_compressor import assert_rule, make_inputs

MODES = [  # ratio, overlap, c
    (4, True, 24),     # CSA
    (128, False, 16),  # HCA
    (8, True, 9),
    (3, False, 33),
]


def append_by_schedule(kv, gate, bias, schedule, *, ratio, overlap, backend="auto", pad=0, seed=0):
    """kv, gate [B, T, C]; schedule: one list per call of how many of its next rows
    each request appends (`new_lens`). A call's kv holds each request's rows at its
    front, then `pad` more rows of noise the op must not read. Returns each request's
    entries [appended // ratio, c]."""
    B, T, C = kv.shape
    g = torch.Generator().manual_seed(seed)
    state_kv, state_gate = new_compressor_state(B, ratio, C, overlap=overlap)
    state_kv.fill_(3.0)  # a fresh request's state may hold anything
    done = torch.zeros(B, dtype=torch.int64)
    out = [[] for _ in range(B)]
    for counts in schedule:
        new_lens = torch.tensor(counts, dtype=torch.int64)
        n = int(new_lens.max()) + pad
        call_kv = torch.randn(B, n, C, generator=g).to(kv.dtype)
        call_gate = torch.randn(B, n, C, generator=g).to(kv.dtype)
        for b, k in enumerate(counts):
            call_kv[b, :k] = kv[b, int(done[b]): int(done[b]) + k]
            call_gate[b, :k] = gate[b, int(done[b]): int(done[b]) + k]
        entries = dsa_compressor_append(call_kv, call_gate, bias, state_kv, state_gate, done, ratio=ratio,
                                        overlap=overlap, new_lens=new_lens, backend=backend)
        assert entries.shape == (B, -(-n // ratio), C // 2 if overlap else C)
        for b in range(B):
            count = (int(done[b]) + counts[b]) // ratio - int(done[b]) // ratio
            out[b].append(entries[b, :count])
            assert not entries[b, count:].any(), "rows past a request's entries are zero"
        done += new_lens
    return [torch.cat(o) for o in out]


def append_in_chunks(kv, gate, bias, lengths, *, ratio, overlap, chunk, backend="auto"):
    """Request b's first lengths[b] rows appended `chunk` tokens per call."""
    T = kv.shape[1]
    schedule = [[max(0, min(chunk, L - start)) for L in lengths] for start in range(0, T, chunk)]
    return append_by_schedule(kv, gate, bias, schedule, ratio=ratio, overlap=overlap, backend=backend,
                              pad=0)


@pytest.mark.parametrize("ratio,overlap,c", MODES)
@pytest.mark.parametrize("chunk", [1, 5, 10_000])
def test_fp32_append_equals_the_one_shot_compressor_bit_for_bit(ratio, overlap, c, chunk):
    lengths = [0, 1, 2 * ratio - 1, 3 * ratio + 2, 4 * ratio]
    C = (2 if overlap else 1) * c
    kv, gate, bias = make_inputs((len(lengths), max(lengths)), C, ratio, torch.float32, seed=ratio + chunk)
    got = append_in_chunks(kv, gate, bias, lengths, ratio=ratio, overlap=overlap, chunk=chunk)
    for b, L in enumerate(lengths):
        want = dsa_compressor(kv[b, :L], gate[b, :L], bias, ratio=ratio, overlap=overlap)[0]
        assert torch.equal(got[b], want), f"request {b}"
        oracle = naive_compressor(kv[b, :L].double(), gate[b, :L].double(), bias.double(), ratio=ratio,
                                  overlap=overlap)
        assert_rule(got[b], want, oracle, torch.float32, f"request {b}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ratio,overlap,c", MODES[:2])
def test_low_precision_append_meets_the_rule(dtype, ratio, overlap, c):
    lengths = [2 * ratio + 1, 3 * ratio]
    C = (2 if overlap else 1) * c
    kv, gate, bias = make_inputs((len(lengths), max(lengths)), C, ratio, dtype, seed=4)
    for backend in ("cpu", "reference"):
        got = append_in_chunks(kv, gate, bias, lengths, ratio=ratio, overlap=overlap, chunk=3, backend=backend)
        for b, L in enumerate(lengths):
            kwargs = dict(ratio=ratio, overlap=overlap)
            naive = naive_compressor(kv[b, :L], gate[b, :L], bias, **kwargs)
            oracle = naive_compressor(kv[b, :L].double(), gate[b, :L].double(), bias.double(), **kwargs)
            assert got[b].dtype == dtype
            assert_rule(got[b], naive, oracle, dtype, f"{backend} request {b}")


def test_state_rows_and_fresh_state():
    assert compressor_state_rows(4, True) == 8 and compressor_state_rows(128, False) == 128
    skv, sgate = new_compressor_state(3, 4, 1024, overlap=True)
    assert skv.shape == sgate.shape == (3, 8, 1024) and skv.dtype == torch.float32


def test_opcheck_and_compile():
    kv, gate, bias = make_inputs((2, 6), 16, 4, torch.float32, seed=1)
    skv, sgate = new_compressor_state(2, 4, 16, overlap=True)
    lengths = torch.tensor([3, 0], dtype=torch.int32)
    torch.library.opcheck(_compressor_append_op, (kv, gate, bias, skv, sgate, lengths, None, 4, True, "auto"))

    def step(kv, gate, skv, sgate):
        return dsa_compressor_append(kv, gate, bias, skv, sgate, lengths, ratio=4)

    eager_state = (skv.clone(), sgate.clone())
    want = step(kv, gate, *eager_state)
    compiled_state = (skv.clone(), sgate.clone())
    got = torch.compile(step, fullgraph=True)(kv, gate, *compiled_state)
    assert torch.equal(got, want)
    assert torch.equal(compiled_state[0], eager_state[0]) and torch.equal(compiled_state[1], eager_state[1])


def test_bad_arguments_name_themselves():
    kv, gate, bias = make_inputs((2, 3), 16, 4, torch.float32)
    skv, sgate = new_compressor_state(2, 4, 16, overlap=True)
    lengths = torch.tensor([0, 5])

    def call(**over):
        args = dict(kv=kv, gate=gate, position_bias=bias, state_kv=skv, state_gate=sgate, lengths=lengths)
        kwargs = dict(ratio=4)
        for k, v in over.items():
            (args if k in args else kwargs)[k] = v
        return dsa_compressor_append(**args, **kwargs)

    call()
    for over, needle in [
        (dict(ratio=0), "ratio"),
        (dict(state_kv=skv[:, :4]), "state_kv"),
        (dict(state_gate=sgate.double()), "state_gate"),
        (dict(lengths=torch.tensor([0, -2])), "lengths"),
        (dict(lengths=torch.tensor([0])), "lengths"),
        (dict(new_lens=torch.tensor([4, 0])), "new_lens"),
        (dict(gate=gate[:, :2]), "gate"),
        (dict(kv=kv[0]), "kv"),
        (dict(position_bias=bias[:2]), "position_bias"),
    ]:
        with pytest.raises(ValueError, match=needle):
            call(**over)
