"""generate() on a patched DeepSeek-V4 through dsa's paged cache (DsaCache): the window
ring, dsa_compressor_append's states and the compressed-entry caches. In fp32 the
tokens are the unpatched model's; the prompt runs the prefill ops and every later
step the decode ops.

The tiny model (tests/python/_hf_models.py) has a window of 8, CSA every 4 tokens and
HCA every 8: prompts plus new tokens here run past 2 x 8, so window, CSA and HCA
entries are all emitted during decode."""
import copy

import pytest
import torch

import dsa
from _hf_models import build
from dsa.integrations.transformers import DsaCache, PatchFallbackError, fallback_counts, patch
from dsa.integrations.transformers._cache import DsaV4Layer


def _ids(batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, seq), generator=g)


@pytest.fixture(scope="module")
def v4():
    return build("v4").eval()


def _count_calls(monkeypatch, module, names):
    calls = {name: 0 for name in names}
    for name in names:
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_batch_one_generates_the_unpatched_tokens(v4, monkeypatch):
    from dsa.integrations.transformers import _v4
    patched = patch(copy.deepcopy(v4), strict=True)
    ids = _ids(1, 13)
    want = v4.generate(ids, max_new_tokens=30, do_sample=False)
    calls = _count_calls(monkeypatch, _v4, ["dsa_sparse_attention", "dsa_sparse_attention_decode",
                                            "dsa_indexer", "dsa_indexer_decode"])
    out = patched.generate(ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert fallback_counts(patched) == {}
    cache = out.past_key_values
    assert isinstance(cache, DsaCache) and all(isinstance(layer, DsaV4Layer) for layer in cache.layers)
    # 13 prompt tokens and 29 fed-back ones are cached (the last token is never fed).
    assert all(layer.lengths == [42] for layer in cache.layers)
    # The prompt on the prefill ops (3 layers, the CSA one with its indexer), then 29
    # decode steps on the decode ops.
    assert calls == {"dsa_sparse_attention": 3, "dsa_indexer": 1, "dsa_sparse_attention_decode": 3 * 29,
                     "dsa_indexer_decode": 29}
    layers = {type(layer.compressor).__name__ if layer.compressor else None for layer in cache.layers}
    assert layers == {None, "Compressor"}
    # The window ring stays O(window): a fixed row of blocks per request.
    assert cache.layers[0].window.used_blocks <= cache.layers[0].window.ring_columns


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_small_blocks_wrap_the_window_ring_and_the_tokens_stay(v4, block_size):
    # 42 tokens through a ring of ceil((8 + 16) / block_size) + 1 columns: it wraps.
    patched = patch(copy.deepcopy(v4), strict=True)
    ids = _ids(2, 13, seed=4)
    want = v4.generate(ids, max_new_tokens=30, do_sample=False)
    cache = DsaCache(patched.config, block_size=block_size)
    out = patched.generate(ids, max_new_tokens=30, do_sample=False, past_key_values=cache)
    assert torch.equal(out, want)
    window = cache.layers[0].window
    assert window.ring_columns * block_size < 42 and window.used_blocks == 2 * window.ring_columns


def test_left_padded_batch_with_an_early_eos_generates_each_prompts_own_tokens(v4):
    # The unpatched model pools and windows over its padded rows (its compressor counts
    # padding as tokens), so a padded batch there is not each prompt's own generation.
    # dsa caches each request's real tokens at its own positions: its tokens are the
    # unpatched model's on each prompt alone.
    patched = patch(copy.deepcopy(v4), strict=True)
    lengths, seq, new = [9, 14, 5], 14, 20
    prompts = [_ids(1, n, seed=10 + b) for b, n in enumerate(lengths)]
    alone = [v4.generate(p, max_new_tokens=new, do_sample=False)[0, p.shape[1]:] for p in prompts]
    eos = int(alone[0][6])  # the first request stops early on this token
    alone = [v4.generate(p, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)[0, p.shape[1]:]
             for p in prompts]
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, seq - p.shape[1]:] = p[0]
        mask[b, seq - p.shape[1]:] = 1
    out = patched.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)
    assert fallback_counts(patched) == {}
    for b in range(len(lengths)):
        got = out[b, seq:]
        assert torch.equal(got[:alone[b].shape[0]], alone[b]), f"request {b}"
        assert not got[alone[b].shape[0]:].any()  # padding after its end
    assert alone[0].shape[0] < new  # the EOS did end one request early


def test_chunked_prefill_equals_one_forward(v4):
    patched = patch(copy.deepcopy(v4), strict=True)
    ids = _ids(1, 40, seed=3)
    with torch.no_grad():
        whole = v4(ids).logits
        cache = DsaCache(patched.config)
        first = patched(ids[:, :13], past_key_values=cache, use_cache=True).logits
        second = patched(ids[:, 13:], past_key_values=cache, use_cache=True).logits  # 27 rows: sliced by 16
        third = patched(ids[:, 40:], past_key_values=cache, use_cache=True) if False else None
    got = torch.cat([first, second], dim=1)
    assert torch.allclose(got, whole, rtol=1e-4, atol=1e-5), (got - whole).abs().max()
    assert cache.layers[1].lengths == [40]
    assert fallback_counts(patched) == {}
    del third


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8"])
def test_low_precision_caches_run_and_their_logit_deviation_is_small(v4, cache_dtype):
    # Measured deviation of the next-token logits against the exact (fp32) cache,
    # relative to the largest logit: documented in docs/serving.md.
    ids = _ids(1, 21, seed=5)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
    exact = patch(copy.deepcopy(v4), strict=True).generate(ids, **kw)
    low = patch(copy.deepcopy(v4), strict=True, cache_dtype=cache_dtype).generate(ids, **kw)
    assert low.past_key_values.layers[2].compressor.entries.cache_dtype == cache_dtype
    # The first new token's logits come from the prompt (prefill ops, nothing cached
    # read back); the second from a decode step reading the low-precision cache.
    second_exact, second_low = exact.logits[1], low.logits[1]
    deviation = float((second_low - second_exact).abs().max() / second_exact.abs().max())
    assert 0.0 < deviation < {"bf16": 0.02, "fp8": 0.1}[cache_dtype], deviation


def test_v4_dsa_cache_arguments_and_modes(v4):
    cache = DsaCache(v4.config, cache_dtype="fp8")
    assert len(cache.layers) == v4.config.num_hidden_layers
    with pytest.raises(ValueError, match="block_size"):
        DsaCache(v4.config, block_size=0)
    patched = patch(copy.deepcopy(v4), strict=True)
    out = patched.generate(_ids(1, 6), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(NotImplementedError, match="cannot drop tokens"):
        out.past_key_values.crop(-1)
    # A later call with padding rows cannot continue a V4 cache on the decode ops.
    cache = DsaCache(patched.config)
    with torch.no_grad():
        patched(_ids(2, 5), past_key_values=cache, use_cache=True)
        with pytest.raises(PatchFallbackError, match="padding"):
            patched(_ids(2, 2), attention_mask=torch.tensor([[1] * 5 + [0, 1], [1] * 7]), past_key_values=cache,
                    use_cache=True)


def test_compressor_state_follows_batch_selection(v4):
    patched = patch(copy.deepcopy(v4), strict=True)
    cache = DsaCache(patched.config)
    with torch.no_grad():
        patched(_ids(3, 11, seed=2), past_key_values=cache, use_cache=True)
    layer = cache.layers[1]
    before = layer.compressor.state_kv[2].clone()
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.compressor.state_kv[0], before)
    assert layer.lengths == [11, 11] and layer.indexer.state_kv.shape[0] == 2
    assert dsa.dsa_compressor_append is not None


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_prompts_cache_each_requests_real_tokens(v4, side):
    # The prompt's valid rows give each prompt's own logits (the unpatched model on it
    # alone), whichever side the padding is on, and the cache holds only real tokens.
    patched = patch(copy.deepcopy(v4), strict=True)
    lengths, seq = [11, 17, 6], 17
    prompts = [_ids(1, n, seed=20 + b) for b, n in enumerate(lengths)]
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        cols = slice(seq - p.shape[1], seq) if side == "left" else slice(0, p.shape[1])
        ids[b, cols], mask[b, cols] = p[0], 1
    cache = DsaCache(patched.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each request's own positions, as generate() gives them
    with torch.no_grad():
        logits = patched(ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True).logits
        for b, p in enumerate(prompts):
            alone = v4(p).logits[0]
            assert torch.allclose(logits[b][mask[b].bool()], alone, rtol=1e-4, atol=1e-5), b
    assert all(layer.lengths == lengths for layer in cache.layers)
    assert fallback_counts(patched) == {}
