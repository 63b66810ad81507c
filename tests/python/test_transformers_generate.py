"""generate() on a patched DeepSeek-V3.2 through dsa's paged cache (DsaCache): the
same tokens as the unpatched model in fp32, batch 1 and padded batches."""
import copy
import warnings

import pytest
import torch

from _hf_models import build
from dsa.integrations.transformers import DsaCache, PatchFallbackError, fallback_counts, patch, unpatch


def _ids(batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, seq), generator=g)


def _padded(batch_lengths, seq, side, seed=1):
    ids = _ids(len(batch_lengths), seq, seed)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(batch_lengths):
        if side == "left":
            mask[b, seq - n:] = 1
        else:
            mask[b, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


@pytest.fixture(scope="module")
def v32():
    return build("v32").eval()


def test_batch_one_generates_the_unpatched_tokens_through_a_dsa_cache(v32):
    patched = patch(copy.deepcopy(v32), strict=True)
    ids = _ids(1, 12)
    want = v32.generate(ids, max_new_tokens=10, do_sample=False)
    out = patched.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    cache = out.past_key_values
    assert isinstance(cache, DsaCache)
    # 12 prompt tokens and 9 fed-back ones are cached (the last token is never fed).
    assert all(layer.lengths == [21] for layer in cache.layers)
    assert cache.layers[0].latent.cache_dtype == "fp32"  # the model's dtype: exact
    assert fallback_counts(patched) == {}


def test_left_padded_batches_generate_the_unpatched_tokens(v32):
    patched = patch(copy.deepcopy(v32), strict=True)
    ids, mask = _padded([6, 10, 3], 10, "left")
    want = v32.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    out = patched.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False,
                           return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    # Each request caches its own real tokens only, at its own positions.
    assert out.past_key_values.layers[0].lengths == [6 + 8, 10 + 8, 3 + 8]


def test_right_padded_prompts_cache_their_real_tokens(v32):
    # transformers warns that right padding gives wrong generations (the first new token
    # comes from a padding position); dsa runs it and caches only the real tokens.
    patched = patch(copy.deepcopy(v32), strict=True)
    ids, mask = _padded([6, 10, 3], 10, "right")
    out = patched.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                           return_dict_in_generate=True)
    assert out.sequences.shape == (3, 15)
    assert out.past_key_values.layers[0].lengths == [6 + 4, 10 + 4, 3 + 4]
    assert fallback_counts(patched) == {}


def test_requests_that_finish_early(v32):
    ids, mask = _padded([7, 12], 12, "left", seed=3)
    free = v32.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    # End-of-sequence: a token the first request generates early, so it stops and pads.
    eos = int(free[0, 12 + 2])
    want = v32.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    patched = patch(copy.deepcopy(v32), strict=True)
    got = patched.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8"])
def test_low_precision_caches_run_and_stay_close(v32, cache_dtype):
    # 8 prompt tokens, index_topk 8: every key is selected, so the deviation is the
    # storage rounding's alone (a top-k that flips on a near tie would swamp it).
    ids = _ids(2, 8, seed=4)
    exact = patch(copy.deepcopy(v32), strict=True)
    low = patch(copy.deepcopy(v32), strict=True, cache_dtype=cache_dtype)
    kw = dict(max_new_tokens=1, do_sample=False, return_dict_in_generate=True, output_logits=True)
    a = exact.generate(ids, **kw)
    b = low.generate(ids, **kw)
    assert b.past_key_values.layers[0].latent.cache_dtype == cache_dtype
    # The first logits read the prompt back from the low-precision cache.
    dev = (a.logits[0] - b.logits[0]).abs().max().item()
    scale = a.logits[0].abs().max().item()
    # Measured: bf16 8e-4, fp8 8.5e-3 of the largest logit.
    assert 0 < dev < (0.005 if cache_dtype == "bf16" else 0.05) * scale


def test_a_caller_cache_and_chunked_prefill(v32):
    patched = patch(copy.deepcopy(v32), strict=True)
    ids = _ids(1, 20, seed=5)
    want = v32(ids, use_cache=False).logits
    cache = DsaCache(patched.config, block_size=4)  # grows on demand, blocks of 4 tokens
    first = patched(ids[:, :13], past_key_values=cache, use_cache=True).logits
    second = patched(ids[:, 13:], past_key_values=cache, use_cache=True).logits
    got = torch.cat([first, second], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cache.layers[0].lengths == [20] and cache.get_seq_length() == 20
    out = patched.generate(_ids(1, 8, seed=6), past_key_values=DsaCache(patched.config), max_new_tokens=3,
                           do_sample=False)
    assert torch.equal(out, v32.generate(_ids(1, 8, seed=6), max_new_tokens=3, do_sample=False))


def test_unpatch_restores_the_default_cache(v32):
    model = patch(copy.deepcopy(v32), strict=True)
    unpatch(model)
    out = model.generate(_ids(1, 6), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert not isinstance(out.past_key_values, DsaCache)
    assert "_prepare_cache_for_generation" not in model.__dict__


def test_calls_a_dsa_cache_cannot_run_raise(v32):
    patched = patch(copy.deepcopy(v32), li=False)
    with pytest.raises(PatchFallbackError, match="li=False"):
        patched(_ids(1, 6), past_key_values=DsaCache(patched.config), use_cache=True)
    patched = patch(copy.deepcopy(v32))
    mask4d = torch.zeros(1, 1, 6, 6)
    with pytest.raises(PatchFallbackError, match="4-D attention mask"):
        patched(_ids(1, 6), attention_mask=mask4d, past_key_values=DsaCache(patched.config), use_cache=True)
    with pytest.raises(ValueError, match="cache_dtype"):
        DsaCache(patched.config, cache_dtype="int4")
    with pytest.raises(ValueError, match="cache_dtype"):
        patch(copy.deepcopy(v32), cache_dtype="fp16")
    # Beam search keeps transformers' own cache (a DsaCache does not reorder requests).
    out = patched.generate(_ids(1, 6), max_new_tokens=2, num_beams=2, do_sample=False, return_dict_in_generate=True)
    assert not isinstance(out.past_key_values, DsaCache)


def test_decode_steps_read_the_caches_in_place(v32, monkeypatch):
    # After the prompt, every step runs the decode ops on the paged caches: nothing of
    # the context is gathered back (the prefill path's dsa_cache_gather).
    from dsa.integrations.transformers import _cache
    gathered = []
    real = _cache.PagedStream.gather
    monkeypatch.setattr(_cache.PagedStream, "gather", lambda self, lengths, dtype: (gathered.append(sum(lengths)),
                                                                                   real(self, lengths, dtype))[1])
    patched = patch(copy.deepcopy(v32), strict=True)
    ids = _ids(1, 20, seed=7)  # a prompt over the decode ops' row limit: the prefill ops
    out = patched.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, v32.generate(ids, max_new_tokens=6, do_sample=False))
    layers = v32.config.num_hidden_layers
    assert gathered == [20] * (2 * layers)  # the prompt's two streams per layer, then no gather


def test_prompt_lookup_decoding_crops_the_dsa_cache(v32):
    patched = patch(copy.deepcopy(v32), strict=True)
    ids = torch.cat([_ids(1, 6, seed=8)] * 3, dim=1)  # repeats: prompt lookup finds drafts
    want = v32.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    out = patched.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3,
                           return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert torch.equal(want, v32.generate(ids, max_new_tokens=12, do_sample=False))
    assert isinstance(out.past_key_values, DsaCache)


def test_dsa_cache_select_and_crop():
    cfg = build("v32").config
    cache = DsaCache(cfg)
    with pytest.raises(ValueError, match="crop"):
        cache.layers[0].crop(3)
    with pytest.raises(ValueError, match="block_size"):
        DsaCache(cfg, block_size=0)
    with pytest.raises(NotImplementedError, match="copy requests"):
        cache.layers[0].batch_repeat_interleave(2)


def test_fp16_models_generate(v32):
    half = copy.deepcopy(v32).half()
    patched = patch(copy.deepcopy(half), strict=True)
    ids = _ids(2, 9, seed=9)
    out = patched.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 13)
    assert out.past_key_values.layers[0].latent.cache_dtype == "fp32"  # fp16 storage is not offered


def test_a_cache_dtype_no_cache_honours_warns_or_raises(v32):
    with pytest.warns(UserWarning, match="cache_dtype='fp8' is not honoured"):
        patch(copy.deepcopy(v32), li=False, cache_dtype="fp8")
    with pytest.raises(ValueError, match="cache_dtype='fp8' is not honoured"):
        patch(copy.deepcopy(v32), li=False, cache_dtype="fp8", strict=True)
    v4 = build("v4")
    with pytest.warns(UserWarning, match="sas=False or li=False"):
        patch(copy.deepcopy(v4), sas=False, cache_dtype="bf16")
    with warnings.catch_warnings():  # DeepSeek-V4 generates through a DsaCache now: honoured
        warnings.simplefilter("error")
        patch(v4, cache_dtype="bf16")
