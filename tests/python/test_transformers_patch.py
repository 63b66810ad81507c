"""The patch's contract beyond parity: bit-for-bit when off or undone, fallbacks that are
counted / warned / strict, DSA_PATCH, import isolation, caches."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

from _hf_models import build, check_model, check_rule, run, three

from dsa.integrations import transformers as dsa_hf
from dsa.integrations.transformers import (PatchFallbackError, fallback_counts, indexer_losses, patch,
                                           unpatch)


def _ids(batch, seq, seed=1):
    return torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _same_bits(a, b):
    assert torch.equal(a[0], b[0]), "logits differ"
    for n in a[1]:
        if a[1][n] is None:
            assert b[1][n] is None, n
        else:
            assert torch.equal(a[1][n], b[1][n]), n


@pytest.mark.parametrize("kind", ["v4", "v32"])
def test_off_unpatch_and_twin_are_bit_for_bit(kind):
    model = build(kind)
    ids = _ids(2, 40)
    reference = run(model, ids, use_cache=False)
    off = patch(copy.deepcopy(model), sas=False, li=False, compressor=False)
    _same_bits(run(off, ids, use_cache=False), reference)
    patched = patch(copy.deepcopy(model))
    patched_run = run(patched, ids, use_cache=False)
    assert not torch.equal(patched_run[0], reference[0])  # the patch does run
    _same_bits(run(copy.deepcopy(patched), ids, use_cache=False), patched_run)  # a copy stays patched
    # Another model of the same class in the same process is untouched by the patched one.
    _same_bits(run(model, ids, use_cache=False), reference)
    unpatch(patched)
    assert not any("forward" in m.__dict__ for m in patched.modules())
    _same_bits(run(patched, ids, use_cache=False), reference)


def test_no_transformers_function_or_class_is_changed():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m32
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m4
    before = {k: v for mod in (m32, m4) for k, v in vars(mod).items()}
    methods = {c: dict(vars(c)) for c in (m32.DeepseekV32Attention, m32.DeepseekV32Indexer, m4.DeepseekV4Attention,
                                          m4.DeepseekV4CSACompressor, m4.DeepseekV4HCACompressor,
                                          m4.DeepseekV4Indexer)}
    interfaces = [dict(i._global_mapping) for i in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS)]
    model = build("v4")
    patch(model, sas=False)  # binds compressor and indexer instances too
    patch(build("v32"), sas=False)
    assert model.config._attn_implementation == "eager"  # sas=False: the model's own attention and masks
    v32 = build("v32")
    other = build("v32")
    patch(v32)
    # sas=True: the model (only it) reads the "dsa" implementation, whose mask transformers never builds.
    assert v32.config._attn_implementation == "dsa" and other.config._attn_implementation == "eager"
    assert {k: v for mod in (m32, m4) for k, v in vars(mod).items()} == before
    assert {c: dict(vars(c)) for c in methods} == methods
    # The two interfaces gained the one "dsa" key each and nothing else changed.
    for mapping, old in zip((ALL_ATTENTION_FUNCTIONS._global_mapping, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping),
                            interfaces):
        assert {k: v for k, v in mapping.items() if k != "dsa"} == {k: v for k, v in old.items() if k != "dsa"}
        assert "dsa" in mapping
    unpatch(v32)
    assert v32.config._attn_implementation == "eager"
    assert not any("_dsa_original_attn_implementation" in m.__dict__ for m in v32.modules())
    # Nothing of the patch is saved with the config.
    assert "dsa" not in patch(v32).config.to_json_string(use_diff=False)


def test_import_dsa_does_not_import_transformers():
    code = ("import sys, dsa, dsa.integrations, dsa.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'imported'; print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("value, expected", [
    ("off", (False, False, False, None)), ("sas,li", (True, True, False, None)), ("all", (True, True, True, None)),
    ("sas,loss=sparse", (True, False, False, "sparse")), ("compressor", (False, False, True, None))])
def test_dsa_patch_environment(monkeypatch, value, expected):
    monkeypatch.setenv("DSA_PATCH", value)
    model = patch(build("v4"))
    o = dsa_hf.options(model)
    assert (o.sas, o.li, o.compressor, o.indexer_loss) == expected
    bound = sum("forward" in m.__dict__ for m in model.modules())
    assert (bound == 0) == (value == "off")


def test_dsa_patch_environment_rejects_unknown(monkeypatch):
    monkeypatch.setenv("DSA_PATCH", "sas,flash")
    with pytest.raises(ValueError, match="flash"):
        patch(build("v4"))


def test_bad_arguments():
    with pytest.raises(ValueError, match="sas"):
        patch(build("v32"), sas=False, indexer_loss="sparse")
    with pytest.raises(ValueError, match="warm-up"):
        patch(build("v4"), indexer_loss="dense")
    with pytest.raises(ValueError, match="indexer_loss"):
        patch(build("v32"), indexer_loss="kl")
    with pytest.raises(ValueError, match="no DeepSeek"):
        patch(torch.nn.Linear(2, 2))


# ---- fallbacks -------------------------------------------------------------------------

def _fallback_case(kind, reason_part, call, build_kwargs=None, model_setup=None):
    model = build(kind, **(build_kwargs or {}))
    if model_setup:
        model_setup(model)
    ids = call.pop("input_ids")
    reference = run(model, ids, **call)
    patched = patch(copy.deepcopy(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(patched, ids, **call)
        run(patched, ids, **call)
    _same_bits(got, reference)
    counts = fallback_counts(patched)
    assert len(counts) == 1 and reason_part in next(iter(counts)), counts
    layers = model.config.num_hidden_layers
    assert next(iter(counts.values())) == 2 * layers  # every layer, both calls
    assert sum(reason_part in str(w.message) for w in caught) == 1  # warned once
    strict = patch(copy.deepcopy(model), strict=True)
    with pytest.raises(PatchFallbackError, match=reason_part.split()[0]):
        run(strict, ids, **call)


@pytest.mark.parametrize("kind", ["v4", "v32"])
def test_fallback_output_attentions(kind):
    _fallback_case(kind, "output_attentions", dict(input_ids=_ids(2, 20), use_cache=False, output_attentions=True))


@pytest.mark.parametrize("kind", ["v4", "v32"])
def test_fallback_attention_dropout_in_training(kind):
    # Dropout consumes RNG: both runs start from the same seed.
    model = build(kind, attention_dropout=0.1)
    ids = _ids(2, 20)
    torch.manual_seed(5)
    reference = run(model, ids, use_cache=False)
    patched = patch(copy.deepcopy(model))
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match="attention_dropout") as caught:
        _same_bits(run(patched, ids, use_cache=False), reference)
    # The warning points at the user's call (here the suite's helper), not into torch.
    assert [w.filename for w in caught if "attention_dropout" in str(w.message)] == [run.__code__.co_filename]
    assert list(fallback_counts(patched)) == ["attention_dropout > 0 in training"]
    patched.eval()
    with torch.no_grad():
        patched(input_ids=ids, use_cache=False)
    assert sum(fallback_counts(patched).values()) == model.config.num_hidden_layers  # eval runs patched


@pytest.mark.parametrize("kind", ["v4", "v32"])
def test_fallback_left_padding(kind):
    ids = _ids(2, 24)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    _fallback_case(kind, "left padding", dict(input_ids=ids, attention_mask=mask, use_cache=False,
                                              labels=ids.masked_fill(mask == 0, -100)))


def test_fallback_v32_kv_b_proj_not_a_plain_linear():
    # Absorption reads kv_b_proj.weight; an adapter (LoRA-style) around it would be bypassed.
    class Adapted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 1.5

    def setup(model):
        for layer in model.model.layers:
            old = layer.self_attn.kv_b_proj
            new = Adapted(old.in_features, old.out_features, bias=False)
            new.weight = old.weight
            layer.self_attn.kv_b_proj = new
    _fallback_case("v32", "kv_b_proj", dict(input_ids=_ids(2, 20), use_cache=False), model_setup=setup)


def test_fallback_v4_cache_holding_tokens_and_empty_cache_patched():
    """A first call with an empty cache runs patched and fills the cache as the model
    would; the next call (the cache holds tokens) runs the model's own forward."""
    from transformers import DynamicCache
    model = build("v4").eval()
    patched = patch(copy.deepcopy(model))
    oracle = copy.deepcopy(model).double()
    ids = _ids(1, 37)
    caches = {}
    outs = {}
    with torch.no_grad():
        for name, m in (("naive", model), ("patched", patched), ("oracle", oracle)):
            cache = DynamicCache(config=m.config)
            first = m(input_ids=ids[:, :33], past_key_values=cache, use_cache=True).logits
            rest = [m(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(33, 37)]
            outs[name] = torch.cat([first] + rest, dim=1)
            caches[name] = cache
    check_rule("prefill + decode logits", outs["patched"], outs["naive"], outs["oracle"], torch.float32)
    counts = fallback_counts(patched)
    assert counts == {"a DeepSeek-V4 cache that already holds tokens": 4 * 3}, counts
    for layer_p, layer_n in zip(caches["patched"].layers, caches["naive"].layers):
        check_rule("cache keys", layer_p.keys, layer_n.keys, layer_n.keys, torch.float32)
        for name in getattr(layer_n, "compressed_kv", {}):
            check_rule(f"compressed {name}", layer_p.compressed_kv[name], layer_n.compressed_kv[name],
                       layer_n.compressed_kv[name], torch.float32)
            assert layer_p.entry_count[name] == layer_n.entry_count[name]


def test_v32_cache_prefill_chunk_decode_patched():
    from transformers import DynamicCache
    model = build("v32").eval()
    patched = patch(copy.deepcopy(model))
    oracle = copy.deepcopy(model).double()
    ids = _ids(2, 40)
    outs = {}
    with torch.no_grad():
        for name, m in (("naive", model), ("patched", patched), ("oracle", oracle)):
            cache = DynamicCache(config=m.config)
            parts = [m(input_ids=ids[:, :30], past_key_values=cache, use_cache=True).logits,
                     m(input_ids=ids[:, 30:36], past_key_values=cache, use_cache=True).logits]
            parts += [m(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(36, 40)]
            outs[name] = torch.cat(parts, dim=1)
    check_rule("prefill + chunk + decode logits", outs["patched"], outs["naive"], outs["oracle"], torch.float32)
    assert fallback_counts(patched) == {}


def test_v4_generate_runs_patched_and_a_transformers_cache_falls_back():
    from transformers import DynamicCache
    model = build("v4").eval()
    patched = patch(copy.deepcopy(model))
    ids = _ids(1, 20)
    a = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(patched.generate(ids, max_new_tokens=5, do_sample=False), a)  # through a DsaCache
    assert fallback_counts(patched) == {}
    # A caller's transformers cache: the prompt runs patched and fills it as the model
    # would; the decode steps on that cache run the model's own attention, counted.
    with pytest.warns(UserWarning, match="holds tokens"):
        b = patched.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(a, b)
    assert fallback_counts(patched) == {"a DeepSeek-V4 cache that already holds tokens": 4 * 3}


def test_v32_generate_runs_patched():
    model = build("v32").eval()
    patched = patch(copy.deepcopy(model))
    ids = _ids(1, 12)
    a = model.generate(ids, max_new_tokens=6, do_sample=False)
    b = patched.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)
    assert fallback_counts(patched) == {}


# ---- indexer loss --------------------------------------------------------------------------

def _indexer_params(model):
    return [n for n, _ in model.named_parameters() if ".indexer." in n]


@pytest.mark.parametrize("kind", ["v4", "v32"])
def test_indexer_gets_gradient_only_with_indexer_loss(kind):
    model = build(kind)
    ids = _ids(2, 40)
    plain = run(patch(copy.deepcopy(model)), ids, use_cache=False)
    with_loss_model = patch(copy.deepcopy(model), indexer_loss="sparse")
    with_loss = run(with_loss_model, ids, use_cache=False)
    names = _indexer_params(model)
    assert names
    assert all(plain[1][n] is None for n in names)
    assert all(with_loss[1][n] is not None and bool(with_loss[1][n].abs().sum() > 0) for n in names), \
        [n for n in names if with_loss[1][n] is None or with_loss[1][n].abs().sum() == 0]
    # The loss changes nothing else: same logits, same gradients elsewhere (bits).
    assert torch.equal(plain[0], with_loss[0])
    for n in plain[1]:
        if n not in names:
            assert torch.equal(plain[1][n], with_loss[1][n]), n
    losses = indexer_losses(with_loss_model)
    expected_layers = 1 if kind == "v4" else model.config.num_hidden_layers  # V4: the CSA layer only
    assert len(losses) == expected_layers and all(float(v) > 0 for v in losses.values())
    # loss_coefficient scales the indexer's gradient (and the reported value).
    doubled_model = patch(copy.deepcopy(model), indexer_loss="sparse", loss_coefficient=2.0)
    doubled = run(doubled_model, ids, use_cache=False)
    for n in names:
        torch.testing.assert_close(doubled[1][n], 2 * with_loss[1][n], rtol=1e-5, atol=0)
    for k, v in indexer_losses(doubled_model).items():
        torch.testing.assert_close(v, 2 * losses[k], rtol=1e-6, atol=0)


@pytest.mark.parametrize("loss, topk", [("sparse", 8), ("dense", 64)])
def test_v32_indexer_loss_against_the_model_probabilities(loss, topk):
    """The KL's value from first principles: teacher = the unpatched model's own attention
    probabilities (output_attentions) on the selected keys, summed over heads and
    normalised; student = softmax of the model's own indexer scores over the same keys.
    With top-k >= S the model's sparse attention is dense: the dense warm-up's oracle."""
    import torch.nn.functional as F
    model = build("v32", index_topk=topk).double()
    model.config._experts_implementation = "eager"
    ids = _ids(2, 40)
    probs, scores = {}, {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        ix = layer.self_attn.indexer

        def grab(mod, args, kwargs, out, i=i):
            h, q_resid, (cos, sin), mask = args[0], args[1], args[2], args[3]
            from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
            b, s = h.shape[:2]
            q = mod.wq_b(q_resid).view(b, s, mod.n_heads, mod.head_dim)
            q_rot, q_pass = q.split([mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], -1)
            k = mod.k_norm(mod.wk(h)).unsqueeze(2)
            k_rot, k_pass = k.split([mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], -1)
            q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1).squeeze(2)
            sc = F.relu(torch.einsum("bshd,btd->bsht", q, k)) * mod.softmax_scale
            w = mod.weights_proj(h) * mod.n_heads ** -0.5
            scores[i] = (torch.einsum("bsh,bsht->bst", w, sc), out)
        hooks.append(ix.register_forward_hook(grab, with_kwargs=True))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_attentions=True)
    for h in hooks:
        h.remove()
    expected = {}
    for i, attn in enumerate(out.attentions):
        sc, topk = scores[i]
        b, s, t = sc.shape
        selected = torch.zeros(b, s, t, dtype=torch.bool).scatter(-1, topk.long(), True)
        selected &= torch.ones(s, t, dtype=torch.bool).tril()
        p = attn.sum(1) * selected
        p = p / p.sum(-1, keepdim=True)
        student = torch.log_softmax(sc.masked_fill(~selected, float("-inf")), -1)
        kl = torch.where(p > 0, p * (torch.log(p) - student), torch.zeros_like(p)).sum(-1)
        expected[f"model.layers.{i}.self_attn"] = kl.mean()
    patched = patch(copy.deepcopy(model).float(), indexer_loss=loss)
    run(patched, ids, use_cache=False)
    got = indexer_losses(patched)
    assert set(got) == set(expected)
    for k in got:
        assert abs(float(got[k]) - float(expected[k])) <= 1e-4 * abs(float(expected[k])) + 1e-6, (k, got[k], expected[k])


def test_v32_dense_warmup_parity_and_frozen_main_model():
    """Dense warm-up: dense causal attention, so against the unpatched model whose top-k
    covers every key; the indexer trains, alone when the main model is frozen."""
    model = build("v32", index_topk=64)
    ids = _ids(2, 40)
    patched, naive, oracle = three(model, torch.float32, dict(indexer_loss="dense"))
    for m in patched.modules():  # the patch must not read the model's top-k in this stage
        if hasattr(m, "index_topk"):
            m.index_topk = 4
    res = [run(m, ids, use_cache=False) for m in (patched, naive, oracle)]
    names = _indexer_params(model)
    indexer_grads = {n: res[0][1][n] for n in names}
    for n in names:
        assert res[0][1][n] is not None and bool(res[0][1][n].abs().sum() > 0), n
        res[0][1][n] = None  # the unpatched model gives the indexer no gradient
    check_model(res[0], res[1], res[2], torch.float32)
    frozen = patch(copy.deepcopy(model), indexer_loss="dense")
    for n, p in frozen.named_parameters():
        p.requires_grad_(n in names)
    grads = run(frozen, ids, use_cache=False)[1]
    assert all(grads[n] is not None for n in names) and all(grads[n] is None for n in grads if n not in names)
    for n in names:  # the KL's gradient does not depend on the main model being trainable
        assert torch.equal(grads[n], indexer_grads[n]), n


def test_fallback_static_cache():
    from transformers import StaticCache
    model = build("v32").eval()
    patched = patch(copy.deepcopy(model))
    ids = _ids(1, 10)
    with torch.no_grad():
        ref = model(input_ids=ids, past_key_values=StaticCache(config=model.config, max_cache_len=32)).logits
        with pytest.warns(UserWarning, match="cache layer"):
            got = patched(input_ids=ids, past_key_values=StaticCache(config=model.config, max_cache_len=32)).logits
    assert torch.equal(ref, got)
    assert sum(fallback_counts(patched).values()) == model.config.num_hidden_layers


def test_v32_li_only_cache_decode_patched():
    from transformers import DynamicCache
    model = build("v32").eval()
    patched = patch(copy.deepcopy(model), sas=False, li=True)
    oracle = copy.deepcopy(model).double()
    ids = _ids(2, 36)
    outs = {}
    with torch.no_grad():
        for name, m in (("naive", model), ("patched", patched), ("oracle", oracle)):
            cache = DynamicCache(config=m.config)
            parts = [m(input_ids=ids[:, :32], past_key_values=cache, use_cache=True).logits]
            parts += [m(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(32, 36)]
            outs[name] = torch.cat(parts, dim=1)
    check_rule("li-only prefill + decode logits", outs["patched"], outs["naive"], outs["oracle"], torch.float32)
    assert fallback_counts(patched) == {}


def test_v4_sparse_indexer_loss_against_the_model_probabilities():
    """V4 CSA: teacher = the unpatched model's attention probabilities (output_attentions;
    their normaliser holds the window, every visible compressed entry and the sink) on the
    indexer's compressed picks, summed over heads and normalised; student = softmax of the
    model's own indexer scores over the same picks; mean over rows with a pick."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m4
    model = build("v4").double()
    ids = _ids(2, 40)
    seen = {}
    csa = [i for i, l in enumerate(model.model.layers) if isinstance(l.self_attn.compressor, m4.DeepseekV4CSACompressor)]
    hooks = []
    for i in csa:
        ix = model.model.layers[i].self_attn.compressor.indexer
        hooks.append(ix.scorer.register_forward_hook(lambda mod, a, out, i=i: seen.__setitem__(("scores", i), out)))
        hooks.append(ix.register_forward_hook(lambda mod, a, out, i=i: seen.__setitem__(("picks", i), out)))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_attentions=True)
    for h in hooks:
        h.remove()
    expected = {}
    seq = ids.shape[1]
    for i in csa:
        scores, picks = seen[("scores", i)], seen[("picks", i)]
        n = scores.shape[-1]
        valid = picks >= 0
        selected = torch.zeros(*picks.shape[:2], n + 1, dtype=torch.bool)
        selected.scatter_(-1, torch.where(valid, picks, n).long(), True)
        selected = selected[..., :n]
        p = out.attentions[i][..., seq:].sum(1) * selected
        rows = selected.any(-1)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
        student = torch.log_softmax(scores.masked_fill(~selected, float("-inf")), -1)
        kl = torch.where(p > 0, p * (torch.log(p) - student), torch.zeros_like(p)).sum(-1)
        expected[f"model.layers.{i}.self_attn"] = kl[rows].mean()
    patched = patch(copy.deepcopy(model).float(), indexer_loss="sparse")
    run(patched, ids, use_cache=False)
    got = indexer_losses(patched)
    assert set(got) == set(expected) and expected
    for k in got:
        assert abs(float(got[k]) - float(expected[k])) <= 1e-4 * abs(float(expected[k])) + 1e-6, (k, got[k], expected[k])
