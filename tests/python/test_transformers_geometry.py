"""The O(B * T) geometry of a patched call (``analyse_compact`` on the DsaMask that
transformers hands a model patched with the "dsa" implementation) against the dense,
element-by-element analysis of the mask the model's own implementation builds from the
same arguments, on every kind of call the other tests run: plain, right padding, packed
rows (position ids, cu_seq_lens), the default cache, V3.2's chunked prefill and decode,
V4's window, and the calls that fall back."""
from __future__ import annotations

import warnings

import pytest
import torch

from _hf_models import build

from dsa.integrations.transformers import _geometry, _mask, fallback_counts, patch


@pytest.fixture
def compared(monkeypatch):
    """Every compact analysis is checked against the dense one; yields the list of
    (kind of result) per call."""
    seen = []
    compact = _geometry.analyse_compact

    def both(mask, position_ids, kwargs, batch, seq, past, window):
        got = compact(mask, position_ids, kwargs, batch, seq, past, window)
        dense = mask.dense(mask.kwargs["config"].dsa_test_original)
        want = _geometry.analyse(dense, position_ids, kwargs, batch, seq, past, window)
        if isinstance(want, str):
            assert got == want  # the same reason, so fallback_counts reads the same
        else:
            assert not isinstance(got, str), (want, got)
            for field in ("layout", "batch", "seq", "past", "query_lengths", "key_lengths", "doc_lengths"):
                assert getattr(got, field) == getattr(want, field), field
            assert (got.doc_starts is None) == (want.doc_starts is None)
            if want.doc_starts is not None:
                assert torch.equal(got.doc_starts, want.doc_starts)
        seen.append(got if isinstance(got, str) else got.layout)
        return got

    monkeypatch.setattr(_geometry, "analyse_compact", both)
    return seen


def _ids(batch, seq, seed=0):
    return torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _run(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            return model(**kwargs)


def _packed_positions(rows):
    return torch.cat([torch.cat([torch.arange(n) for n in docs]).unsqueeze(0) for docs in rows])


@pytest.mark.parametrize("kind, impl", [("v32", "eager"), ("v32", "sdpa"), ("v4", "eager")])
def test_compact_geometry_equals_dense_analysis(compared, kind, impl):
    model = patch(build(kind, attn_implementation=impl))
    model.config.dsa_test_original = impl  # what the compared dense analysis builds its mask with
    ids = _ids(2, 40)
    right = torch.ones(2, 40, dtype=torch.long)
    right[1, 29:] = 0
    for use_cache in (False, True):
        _run(model, input_ids=ids, use_cache=use_cache)                         # plain rows (V4: window 8 < 40)
        _run(model, input_ids=ids, attention_mask=right, use_cache=use_cache)   # right padding
        rows = [[13, 20, 7], [40]]
        _run(model, input_ids=ids, position_ids=_packed_positions(rows), use_cache=use_cache)  # packed rows
    assert "TND" in compared and "BSND" in compared
    # Packed through cu_seq_lens (one row, as DataCollatorWithFlattening gives them).
    flat = ids.reshape(1, -1)
    rows = [[13, 20, 7, 40]]
    cu = torch.tensor([0, 13, 33, 40, 80], dtype=torch.int32)
    _run(model, input_ids=flat, position_ids=_packed_positions(rows), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
         max_length_q=40, max_length_k=40, use_cache=False)
    assert compared[-1] == "TND"
    # Fallbacks: left padding, a hole in the padding, positions not 0.. per document.
    left = torch.ones(2, 40, dtype=torch.long)
    left[1, :5] = 0
    hole = torch.ones(2, 40, dtype=torch.long)
    hole[0, 10:12] = 0
    before = len(compared)
    _run(model, input_ids=ids, attention_mask=left, use_cache=False)
    _run(model, input_ids=ids, attention_mask=hole, use_cache=False)
    _run(model, input_ids=ids, position_ids=torch.arange(3, 43).unsqueeze(0).expand(2, -1), use_cache=False)
    _run(model, input_ids=ids[:1], position_ids=torch.cat([torch.arange(20), torch.arange(25, 45)]).unsqueeze(0),
         use_cache=False)
    reasons = compared[before:]
    assert len(reasons) >= 4 and all(isinstance(r, str) for r in reasons), reasons
    assert sum(fallback_counts(model).values()) > 0


def test_compact_geometry_with_a_growing_cache(compared):
    """V3.2 prefill, a second chunk and decode steps (past > 0), with and without padding."""
    from transformers import DynamicCache
    model = patch(build("v32"))
    model.config.dsa_test_original = "eager"
    ids = _ids(2, 40)
    for pad in (None, torch.ones(2, 30, dtype=torch.long)):
        cache = DynamicCache(config=model.config)
        mask = None if pad is None else pad
        _run(model, input_ids=ids[:, :30], attention_mask=mask, past_key_values=cache, use_cache=True)
        for start, stop in ((30, 36), (36, 37), (37, 38)):
            if pad is not None:
                mask = torch.cat([mask, torch.ones(2, stop - start, dtype=torch.long)], dim=1)
            _run(model, input_ids=ids[:, start:stop], attention_mask=mask, past_key_values=cache, use_cache=True)
    assert compared.count("BSND") == 8
    assert fallback_counts(model) == {}


def test_compact_geometry_refuses_what_it_cannot_read():
    """A caller's or_mask / and_mask function, a window other than the layer's, sizes other than
    the call's: reasons, never a geometry (each would change the answer)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    model = patch(build("v4"))
    config = model.config
    emb = torch.zeros(1, 16, 8)
    pos = torch.arange(16).unsqueeze(0)
    plain = create_sliding_window_causal_mask(config=config, inputs_embeds=emb, attention_mask=None,
                                              past_key_values=None, position_ids=pos)
    assert isinstance(plain, _mask.DsaMask)
    assert not isinstance(_geometry.analyse(plain, pos, {}, 1, 16, 0, config.sliding_window), str)
    assert isinstance(_geometry.analyse(plain, pos, {}, 1, 16, 0, config.sliding_window + 1), str)
    assert isinstance(_geometry.analyse(plain, pos, {}, 1, 15, 0, config.sliding_window), str)
    assert isinstance(_geometry.analyse(plain, pos, {}, 2, 16, 0, config.sliding_window), str)
    causal = create_causal_mask(config=config, inputs_embeds=emb, attention_mask=None, past_key_values=None,
                                position_ids=pos)
    assert not isinstance(_geometry.analyse(causal, pos, {}, 1, 16, 0, None), str)
    assert isinstance(_geometry.analyse(causal, pos, {}, 1, 16, 0, config.sliding_window), str)
    for extra in (dict(or_mask_function=lambda b, h, q, k: k == 0), dict(and_mask_function=lambda b, h, q, k: k >= 0)):
        custom = create_causal_mask(config=config, inputs_embeds=emb, attention_mask=None, past_key_values=None,
                                    position_ids=pos, **extra)
        assert isinstance(custom, _mask.DsaMask)
        assert "custom mask function" in _geometry.analyse(custom, pos, {}, 1, 16, 0, None)


def test_the_registered_attention_function_runs_the_original():
    """'dsa' in AttentionInterface: a module of a patched model that reaches it (none of the
    DeepSeek attentions does) gets the original implementation on the dense mask, bit for
    bit; a module of no patched model gets a clear error."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m4
    model = patch(build("v4"))
    attn = model.model.layers[0].self_attn
    emb = torch.zeros(1, 16, 8)
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=emb, attention_mask=None,
                                             past_key_values=None, position_ids=torch.arange(16).unsqueeze(0))
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, n, 16, 32, generator=g) for n in (4, 1))
    got = _mask.dsa_attention(attn, q, k, k, mask, scaling=0.2)
    want = m4.eager_attention_forward(attn, q, k, k, mask.dense("eager"), scaling=0.2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="not part of a model patched"):
        _mask.dsa_attention(build("v4").model.layers[0].self_attn, q, k, k, mask, scaling=0.2)
