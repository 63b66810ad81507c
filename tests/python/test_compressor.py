"""dsa_compressor (docs/ops.md 4.5): fused and reference backends against an
independent float64 PyTorch oracle (python/dsa/naive.py) and against the pooling
inside Hugging Face transformers' DeepSeek-V4 compressors."""
from __future__ import annotations

import pytest
import torch

import _tolerance
import dsa
from dsa import dsa_compressor
from dsa.compressor import _compressor_backward_op, _compressor_op
from dsa.layer import LayerCompressMode, compress_for_layer, layer_compress_mode
from dsa.naive import naive_compressor

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_inputs(shape, channels, ratio, dtype, seed=0, bias_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(*shape, channels, generator=g).to(dtype)
    gate = (2 * torch.randn(*shape, channels, generator=g)).to(dtype)
    bias = bias_scale * torch.randn(ratio, channels, generator=g)
    return kv, gate, bias


def run_with_grads(fn, kv, gate, bias, grad_seed=1, grad_dtype=None):
    """grad_dtype: the dtype the upstream gradient is drawn in (default kv's); the
    float64 oracle passes the op's, so it sees the same upstream values as the op."""
    grad_dtype = grad_dtype or kv.dtype
    kv, gate, bias = (t.detach().clone().requires_grad_(True) for t in (kv, gate, bias))
    out = fn(kv, gate, bias)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(grad_dtype).to(out.dtype)
    if out.requires_grad:  # the oracle's output over no entries is a constant: zero gradients
        out.backward(grad_out)
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (kv, gate, bias)]
    return [out.detach()] + grads


def assert_rule(fused, naive_same, oracle, dtype, what):
    """docs/testing.md's rule (_tolerance.bound); non-finite values must sit in the same places."""
    fused, naive_same, oracle = fused.double(), naive_same.double(), oracle.double()
    assert torch.equal(torch.isfinite(fused), torch.isfinite(oracle)), what
    finite = torch.isfinite(oracle)
    err = (fused - oracle)[finite].abs().max().item() if finite.any() else 0.0
    scale = oracle[finite].abs().max().item() if finite.any() else 0.0
    naive_err = (naive_same - oracle)[finite].abs().max().item() if finite.any() else 0.0
    limit = _tolerance.bound(dtype == torch.float32, scale, naive_err)
    assert err <= limit, f"{what}: error {err} > bound {limit}"


def check_against_oracle(kv, gate, bias, *, ratio, overlap, lengths, layout, backend):
    kwargs = dict(ratio=ratio, overlap=overlap, query_lengths=lengths, layout=layout)
    fused = run_with_grads(lambda k, g, b: dsa_compressor(k, g, b, backend=backend, **kwargs)[0], kv, gate, bias)
    naive = run_with_grads(lambda k, g, b: naive_compressor(k, g, b, **kwargs), kv, gate, bias)
    oracle = run_with_grads(lambda k, g, b: naive_compressor(k, g, b, **kwargs),
                            kv.double(), gate.double(), bias.double(), grad_dtype=kv.dtype)
    for name, f, n, o in zip(["compressed", "grad_kv", "grad_gate", "grad_position_bias"], fused, naive, oracle):
        assert f.dtype == (torch.float32 if name == "grad_position_bias" else kv.dtype)
        assert f.shape == o.shape, name
        assert_rule(f, n, o, kv.dtype, name)
    return fused


TND_CASES = [
    # ratio, overlap, c, lengths: shorter than the ratio, exactly m, 2m-1, several sequences
    (4, True, 40, [0, 1, 3, 4, 7, 8, 9, 33, 66]),
    (128, False, 24, [127, 128, 255, 300]),
    (3, True, 17, [2, 3, 5, 6, 20]),
    (2, False, 65, [1, 4, 9]),
]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio,overlap,c,lengths", TND_CASES)
def test_tnd_matches_oracle(backend, dtype, ratio, overlap, c, lengths):
    ends = torch.tensor(lengths).cumsum(0).tolist()
    kv, gate, bias = make_inputs((ends[-1],), (2 if overlap else 1) * c, ratio, dtype)
    fused = check_against_oracle(kv, gate, bias, ratio=ratio, overlap=overlap, lengths=ends,
                                 layout="TND", backend=backend)
    # Tail tokens (and the unused [:c] half of each last block) get exactly zero gradient.
    begin = 0
    for end in ends:
        n = (end - begin) // ratio
        assert torch.all(fused[1][begin + n * ratio:end] == 0)
        assert torch.all(fused[2][begin + n * ratio:end] == 0)
        if overlap and n:
            assert torch.all(fused[1][begin + (n - 1) * ratio:begin + n * ratio, :c] == 0)
        begin = end


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap", [(4, True), (5, False)])
def test_bsnd_padding(backend, dtype, ratio, overlap):
    kv, gate, bias = make_inputs((3, 19), (2 if overlap else 1) * 12, ratio, dtype)
    lengths = [19, 5, 2]
    fused = check_against_oracle(kv, gate, bias, ratio=ratio, overlap=overlap, lengths=lengths,
                                 layout="BSND", backend=backend)
    out, counts = dsa_compressor(kv, gate, bias, ratio=ratio, overlap=overlap, query_lengths=lengths,
                                 layout="BSND", backend=backend)
    assert counts == [n // ratio for n in lengths]
    assert out.shape == (3, 19 // ratio, 12)
    for b, n in enumerate(lengths):
        assert torch.all(out[b, n // ratio:] == 0)
        assert torch.all(fused[1][b, (n // ratio) * ratio:] == 0)
    # Full rows (lengths None) and a lengths tensor give the tensor form back.
    _, counts_t = dsa_compressor(kv, gate, bias, ratio=ratio, overlap=overlap,
                                 query_lengths=torch.tensor(lengths, dtype=torch.int32), layout="BSND")
    assert counts_t.dtype == torch.int64 and counts_t.tolist() == counts


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_minus_inf_and_large_bias(backend):
    ratio, c = 4, 20
    kv, gate, bias = make_inputs((40,), 2 * c, ratio, torch.bfloat16, bias_scale=30.0)
    bias[1:3, 5] = float("-inf")  # some slots excluded
    bias[:, 7] = float("-inf")    # previous-block half of channel 7: entry 0 then has no finite logit
    bias[:, c + 7] = float("-inf")  # ... and the own half too: channel 7 pools nothing anywhere
    bias[0, 9] = 1e4              # one slot dominates
    fused = check_against_oracle(kv, gate, bias, ratio=ratio, overlap=True, lengths=[17, 40],
                                 layout="TND", backend=backend)
    assert torch.all(fused[0][:, 7] == 0)
    assert torch.all(fused[3][:, 7] == 0) and torch.all(fused[3][:, c + 7] == 0)
    assert torch.isfinite(fused[0]).all() and torch.isfinite(fused[2]).all()


def test_thread_count_does_not_change_bits():
    kv, gate, bias = make_inputs((5000,), 2 * 96, 4, torch.bfloat16)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(run_with_grads(
                lambda k, g, b: dsa_compressor(k, g, b, ratio=4, query_lengths=[3000, 5000])[0], kv, gate, bias))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_opcheck_and_compile():
    kv, gate, bias = make_inputs((37,), 2 * 8, 4, torch.float32)
    lengths = torch.tensor([9, 37])
    rows = 9 // 4 + 28 // 4
    for save_stats in (False, True):
        torch.library.opcheck(_compressor_op, (kv.requires_grad_(), gate.requires_grad_(), bias.requires_grad_(),
                                               4, True, lengths, rows, "TND", "auto", save_stats))
    kv2, gate2, bias2 = make_inputs((2, 20), 6, 5, torch.bfloat16)
    torch.library.opcheck(_compressor_op, (kv2, gate2, bias2, 5, False, None, 8, "BSND", "cpu", True))
    grad = torch.randn(rows, 8)
    _, stats = _compressor_op(kv.detach(), gate.detach(), bias.detach(), 4, True, lengths, rows, "TND", "cpu", True)
    for saved in (torch.empty(0), stats):
        torch.library.opcheck(_compressor_backward_op, (grad, kv.detach(), gate.detach(), bias.detach(), saved, 4,
                                                        True, lengths, "TND", "auto"))

    # Ratio 4 with overlap recomputes in the backward; ratio 16 starts from saved statistics.
    for ratio, channels in ((4, 16), (16, 8)):
        kv, gate, bias = make_inputs((37,), channels, ratio, torch.float32)

        def f(k, g, b):
            out, counts = dsa_compressor(k, g, b, ratio=ratio, query_lengths=[9, 37])
            return out.square().sum()

        compiled = torch.compile(f, fullgraph=True, backend="inductor")
        eager = run_with_grads(lambda k, g, b: f(k, g, b).reshape(1), kv, gate, bias)
        traced = run_with_grads(lambda k, g, b: compiled(k, g, b).reshape(1), kv, gate, bias)
        for a, b in zip(eager, traced):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_backward_gets_no_zero_filled_statistics_gradient(path):
    # HCA-like: many slots, so the forward saves statistics for the backward.
    kv, gate, bias = make_inputs((64,), 8, 16, torch.float32)
    args = (kv.requires_grad_(), gate.requires_grad_(), bias.requires_grad_())
    if path == "eager":
        call = lambda: dsa_compressor(*args, ratio=16, query_lengths=[64])[0]  # noqa: E731
    else:  # the torch.library op, as torch.compile and functorch call it
        call = lambda: _compressor_op(*args, 16, False, torch.tensor([64]), 4, "TND", "cpu", True)[0]  # noqa: E731
    out = call()
    seed = torch.ones_like(out)
    with torch.profiler.profile() as prof:
        grads = torch.autograd.grad(out, args, seed)
    filled = [e.key for e in prof.key_averages() if e.key in ("aten::zeros", "aten::zero_", "aten::fill_")]
    assert filled == [], filled
    ref_args = tuple(a.detach().clone().requires_grad_() for a in args)
    ref_out = dsa_compressor(*ref_args, ratio=16, query_lengths=[64], backend="reference")[0]
    expected = torch.autograd.grad(ref_out, ref_args, torch.ones_like(ref_out))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tensor_lengths_trace_under_compile():
    # Tensor lengths: the TND row count becomes an unbacked size, BSND needs none;
    # no graph break either way, and the same values and gradients as eager.
    kv, gate, bias = make_inputs((37,), 16, 4, torch.float32)
    ends = torch.tensor([9, 37])
    torch.library.opcheck(_compressor_op, (kv.requires_grad_(), gate.requires_grad_(), bias.requires_grad_(),
                                           4, True, ends, -1, "TND", "auto", False))
    kv2, gate2, bias2 = make_inputs((2, 40), 8, 16, torch.float32)
    rows = torch.tensor([40, 17])
    for layout, args, lengths in (("TND", (kv, gate, bias), ends), ("BSND", (kv2, gate2, bias2), rows)):
        ratio = bias.shape[0] if layout == "TND" else 16

        def f(k, g, b, n):
            out, counts = dsa_compressor(k, g, b, ratio=ratio, query_lengths=n, layout=layout)
            return out.square().sum() + counts.sum()

        compiled = torch.compile(f, fullgraph=True, backend="inductor", dynamic=False)
        eager = run_with_grads(lambda k, g, b: f(k, g, b, lengths).reshape(1), *args)
        traced = run_with_grads(lambda k, g, b: compiled(k, g, b, lengths).reshape(1), *args)
        for a, b in zip(eager, traced):
            torch.testing.assert_close(a, b)
        _, counts = dsa_compressor(*args, ratio=ratio, query_lengths=lengths, layout=layout)
        expected = [9 // 4, 9 // 4 + 28 // 4] if layout == "TND" else [40 // 16, 17 // 16]
        assert counts.dtype == torch.int64 and counts.tolist() == expected


def test_bad_inputs():
    kv, gate, bias = make_inputs((16,), 8, 4, torch.float32)
    with pytest.raises(ValueError, match="ratio"):
        dsa_compressor(kv, gate, bias, ratio=0)
    with pytest.raises(ValueError, match="position_bias"):
        dsa_compressor(kv, gate, bias[:3], ratio=4)
    with pytest.raises(ValueError, match="position_bias"):
        dsa_compressor(kv, gate, torch.randn(4, 4), ratio=4)
    with pytest.raises(ValueError, match="position_bias"):
        dsa_compressor(kv, gate, bias.bfloat16(), ratio=4)
    with pytest.raises(ValueError, match="query_lengths"):
        dsa_compressor(kv, gate, bias, ratio=4, query_lengths=[8, 15])
    with pytest.raises(ValueError, match="query_lengths"):
        dsa_compressor(kv, gate, bias, ratio=4, query_lengths=[9, 8, 16])
    for bad in ([9, 8, 16], [8, 15], [-4, 16]):  # the same errors from tensor lengths
        with pytest.raises(ValueError, match="query_lengths"):
            dsa_compressor(kv, gate, bias, ratio=4, query_lengths=torch.tensor(bad))
    with pytest.raises(ValueError, match="query_lengths"):
        dsa_compressor(kv.reshape(2, 8, 8), gate.reshape(2, 8, 8), bias, ratio=4, query_lengths=[9, 3],
                       layout="BSND")
    with pytest.raises(ValueError, match="kv"):
        dsa_compressor(kv[:, :7], gate[:, :7], bias[:, :7], ratio=4)  # overlap needs an even C
    with pytest.raises(ValueError, match="gate"):
        dsa_compressor(kv, gate.bfloat16(), bias, ratio=4)
    with pytest.raises(ValueError, match="gate"):
        dsa_compressor(kv, gate[:8], bias, ratio=4)
    with pytest.raises(ValueError, match="overlap"):
        dsa_compressor(kv, gate, bias, ratio=4, overlap=1)
    with pytest.raises(ValueError, match="kv"):
        dsa_compressor(kv.reshape(1, 16, 8), gate, bias, ratio=4)


# ---- agreement with Hugging Face transformers' DeepSeek-V4 compressors ----

def _transformers_pooling(kind, c, ratio, dtype):
    """The real compressor class, reduced to its pooling: kv_proj / gate_proj pick
    the kv and gate halves of the input, RMSNorm and RoPE become identities and
    the CSA indexer is stubbed out (spec: the op stops before norm and rope)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates["compressed_sparse_attention" if kind == "csa" else "heavily_compressed_attention"] = ratio
    coff = 2 if kind == "csa" else 1
    config = DeepseekV4Config(hidden_size=2 * coff * c, head_dim=c, num_attention_heads=2, index_head_dim=8,
                              index_n_heads=2, q_lora_rank=16, compress_rates=rates)
    cls = modeling.DeepseekV4CSACompressor if kind == "csa" else modeling.DeepseekV4HCACompressor
    module = cls(config)
    eye = torch.eye(coff * c)
    with torch.no_grad():
        module.kv_proj.weight.copy_(torch.cat([eye, torch.zeros_like(eye)], dim=1))
        module.gate_proj.weight.copy_(torch.cat([torch.zeros_like(eye), eye], dim=1))
    module.kv_norm = torch.nn.Identity()
    if kind == "csa":
        module.indexer = _NoIndexer()
    return module.to(dtype)


class _NoIndexer(torch.nn.Module):
    def forward(self, hidden, *args):
        return torch.zeros(hidden.shape[0], hidden.shape[1], 1, dtype=torch.long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,ratio,c,length", [("csa", 4, 24, 37), ("hca", 128, 16, 300)])
def test_matches_transformers(monkeypatch, dtype, kind, ratio, c, length):
    coff = 2 if kind == "csa" else 1
    kv, gate, bias = make_inputs((2, length), coff * c, ratio, dtype, seed=3)
    bias = bias.to(dtype).float()  # representable in the module's dtype

    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", lambda x, cos, sin, *args, **kwargs: x)

    def grads_through(module_dtype):
        module = _transformers_pooling(kind, c, ratio, module_dtype)
        with torch.no_grad():
            module.position_bias.copy_(bias)
        k = kv.to(module_dtype).detach().requires_grad_(True)
        g = gate.to(module_dtype).detach().requires_grad_(True)
        positions = torch.arange(length).unsqueeze(0).expand(2, -1)
        out = module(torch.cat([k, g], dim=-1), None, positions, None, 0)[0].squeeze(1)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(module_dtype)
        out.backward(grad_out)
        return [out.detach(), k.grad, g.grad, module.position_bias.grad.float()]

    oracle = grads_through(torch.float64)
    same = grads_through(dtype)
    fused = run_with_grads(lambda k, g, b: dsa_compressor(k, g, b, ratio=ratio, overlap=kind == "csa",
                                                          layout="BSND")[0], kv, gate, bias, grad_seed=5)
    for name, f, n, o in zip(["compressed", "grad_kv", "grad_gate", "grad_position_bias"], fused, same, oracle):
        assert f.shape == o.shape, name
        assert_rule(f, n, o, dtype, f"{name} vs transformers")


# ---- the model-layer helper ----

def test_layer_compress_mode():
    assert layer_compress_mode(0) is LayerCompressMode.NO_COMPRESS
    assert layer_compress_mode(1) is LayerCompressMode.NO_COMPRESS
    assert layer_compress_mode(4) is LayerCompressMode.INDEXER
    assert layer_compress_mode(128) is LayerCompressMode.COMPRESSOR_ONLY
    assert layer_compress_mode(2) is LayerCompressMode.COMPRESSOR_ONLY
    with pytest.raises(ValueError):
        layer_compress_mode(4.0)


@pytest.mark.parametrize("ratio,mode", [(4, LayerCompressMode.INDEXER), (128, LayerCompressMode.COMPRESSOR_ONLY)])
def test_layer_gradients_reach_the_compressor(ratio, mode):
    coff = 2 if ratio == 4 else 1
    kv, gate, bias = (t.requires_grad_(True) for t in make_inputs((300,), coff * 8, ratio, torch.float32))
    result = compress_for_layer(kv, gate, bias, ratio=ratio, query_lengths=[200, 300])
    assert result.mode is mode and result.ratio == ratio
    assert result.compressed.requires_grad
    result.compressed.square().sum().backward()
    for t in (kv, gate, bias):
        assert t.grad is not None and t.grad.abs().sum() > 0


def test_layer_without_entries_behaves_as_ratio_one():
    kv, gate, bias = make_inputs((100,), 8, 128, torch.float32)
    result = compress_for_layer(kv, gate, bias, ratio=128, query_lengths=[60, 100])
    assert result.mode is LayerCompressMode.NO_COMPRESS and result.ratio == 1 and result.compressed is None
    kv, gate, bias = make_inputs((2, 3), 16, 4, torch.float32)
    result = compress_for_layer(kv, gate, bias, ratio=4, layout="BSND")
    assert result.mode is LayerCompressMode.NO_COMPRESS
    assert compress_for_layer(kv, gate, bias, ratio=1, layout="BSND").mode is LayerCompressMode.NO_COMPRESS
