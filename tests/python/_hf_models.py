"""Tiny random DeepSeek-V3.2 / V4 transformers models for the integration tests.

Sizes: >= 16 indexer heads, so that ReLU zeros do not tie the top-k (with 2-4 heads,
5-21 % of the visible scores are exact-zero ties); sinks, position biases and hash-MoE tables are
randomised because the model initialises them to 0.
"""
from __future__ import annotations

import copy
import statistics

import torch


def v32_config(**overrides):
    from transformers import DeepseekV32Config
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              index_n_heads=16, index_head_dim=16, index_topk=8, n_routed_experts=4, n_group=2, topk_group=1,
              num_experts_per_tok=2, n_shared_experts=1,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              max_position_embeddings=1024, pad_token_id=0, attn_implementation="eager",
              experts_implementation="eager")
    kw.update(overrides)
    return DeepseekV32Config(**kw)


def v4_config(**overrides):
    from transformers import DeepseekV4Config
    kw = dict(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
              mlp_layer_types=["hash_moe", "moe", "moe"],
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
              q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
              index_n_heads=16, index_head_dim=16, index_topk=4,
              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3,
              max_position_embeddings=1024, pad_token_id=0, attn_implementation="eager",
              experts_implementation="eager")
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def randomise(model, seed=0):
    """Non-zero sinks / position biases / hash tables (the model starts them at 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                b.copy_(torch.randint(0, experts, b.shape, generator=g).to(b.dtype))
    return model


def build(kind, dtype=torch.float32, seed=0, **overrides):
    from transformers import DeepseekV32ForCausalLM, DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    if kind == "v32":
        model = DeepseekV32ForCausalLM(v32_config(**overrides))
    else:
        model = DeepseekV4ForCausalLM(v4_config(**overrides))
    randomise(model, seed)
    return model.to(dtype).train()


def twin(model):
    return copy.deepcopy(model)


def run(model, ids, labels=None, **kwargs):
    """Forward + backward; returns (logits, {name: grad})."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids if labels is None else labels, **kwargs)
    out.loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    return out.logits.detach(), grads, out


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_rule(what, got, naive, oracle, dtype, floor=None):
    """docs/testing.md's rule, with the unpatched model as the naive peer and the unpatched
    model in float64 as the oracle: err <= 2 * naive_err + 1e-5. For fp32 also a
    relative error <= 1e-4 -- or <= 2 * naive_err where the unpatched fp32 model itself
    is further off than that (a few tiny gradients of the hyper-connection head, whose
    fp32 error against float64 reaches 3e-4 relative in the model's own arithmetic).

    `floor`: the same tensor from the patched model on dsa's reference backend (exact
    sums, one rounding per op output). Where given, the yardstick is the larger of the
    naive and the floor error: in bf16 a few gradients (the hyper-connection mixers) are
    moved by any change in the rounding of any activation by more than the naive model's
    own error, so the exact reference fails the plain rule there on some inputs, and a
    kernel would pass or fail by luck (docs/transformers.md, "Gradients one input cannot decide")."""
    ratio, message = _rule(got, naive, oracle, dtype, floor)
    assert ratio <= 1.0, f"{what}: {message}"


def rule_ratio(got, naive, oracle, dtype, floor=None):
    """How much of check_rule's bound the error uses: <= 1 passes."""
    return _rule(got, naive, oracle, dtype, floor)[0]


def _rule(got, naive, oracle, dtype, floor):
    err, naive_err = max_err(got, oracle), max_err(naive, oracle)
    yardstick, which = naive_err, "naive"
    if floor is not None and max_err(floor, oracle) > naive_err:
        yardstick, which = max_err(floor, oracle), "reference backend"
    ratio, message = err / (2 * yardstick + 1e-5), f"err {err:.3g} > 2 * {which} {yardstick:.3g} + 1e-5"
    if dtype == torch.float32:
        scale = oracle.double().abs().max().item() if oracle.numel() else 0.0
        bound = max(1e-4 * scale, 2 * naive_err)
        relative = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
        if relative > ratio:
            ratio = relative
            message = f"rel err {err / max(scale, 1e-300):.3g} > 1e-4 (naive {naive_err / max(scale, 1e-300):.3g})"
    return ratio, message


def check_model(patched_run, naive_run, oracle_run, dtype, positions=None, indexer_trains=False, floor_run=None):
    """Logits (optionally only at `positions`, a bool [B, S] mask) and every parameter's
    gradient. With `indexer_trains` (an indexer loss on) the indexer's parameters, which
    the model never trains, must get non-zero gradients instead. `floor_run` (bf16: the
    patch on the reference backend, see `check_rule`) applies to the gradients only; the
    logits, and the floor run's own logits, keep the plain rule."""
    (lp, gp), (ln, gn), (lo, go) = patched_run[:2], naive_run[:2], oracle_run[:2]
    if positions is not None:
        lp, ln, lo = lp[positions], ln[positions], lo[positions]
    check_rule("logits", lp, ln, lo, dtype)
    floor = None
    if floor_run is not None:
        lf, floor = floor_run[:2]
        check_rule("reference backend logits", lf[positions] if positions is not None else lf, ln, lo, dtype)
    check_grads(gp, gn, go, dtype, indexer_trains, floor)


def compared_grads(gp, gn, go, indexer_trains=False):
    """The names of the gradients the rule compares, after checking which parameters get
    one (and, with `indexer_trains`, that the indexer's get non-zero ones)."""
    names = []
    for name in go:
        if indexer_trains and ".indexer." in name:
            assert go[name] is None and gp[name] is not None and bool(gp[name].abs().sum() > 0), name
            continue
        if go[name] is None or gn[name] is None:
            assert gp[name] is None and gn[name] is None, f"{name}: gradient presence differs"
            continue
        assert gp[name] is not None, f"{name}: no gradient through the patch"
        names.append(name)
    return names


def check_grads(gp, gn, go, dtype, indexer_trains=False, floor=None):
    for name in compared_grads(gp, gn, go, indexer_trains):
        check_rule(f"grad {name}", gp[name], gn[name], go[name], dtype, None if floor is None else floor[name])


def worst_grad(gp, gn, go, dtype, floor=None):
    """(rule_ratio, name) of the gradient nearest its bound (or furthest past it)."""
    return max((rule_ratio(gp[n], gn[n], go[n], dtype, None if floor is None else floor[n]), n)
               for n in compared_grads(gp, gn, go))


def check_median_over_seeds(worst, seeds):
    """The rule for gradients that one input cannot decide (the V4 hyper-connection
    mixers, docs/transformers.md "Gradients one input cannot decide"): the median over
    the seeds of each seed's worst ratio (`worst_grad`) must be <= 1."""
    median = statistics.median(ratio for ratio, _ in worst)
    assert median <= 1.0, (f"median over seeds {tuple(seeds)} of the worst gradient's share of its bound is "
                           f"{median:.2f}: " + ", ".join(f"{ratio:.2f} ({name})" for ratio, name in worst))


def three(model, dtype, patch_kwargs=None):
    """(patched, naive, oracle): the same weights, patched in `dtype`, unpatched in
    `dtype`, unpatched in float64."""
    from dsa.integrations.transformers import patch
    naive = copy.deepcopy(model).to(dtype)
    oracle = copy.deepcopy(model).to(torch.float64)
    patched = patch(copy.deepcopy(model).to(dtype), **(patch_kwargs or {}))
    return patched, naive, oracle


def floor_model(model, dtype, patch_kwargs=None):
    """bf16: the patched model on dsa's reference backend, whose run is `check_model`'s
    `floor_run`; None for other dtypes (their rule needs no floor)."""
    if dtype != torch.bfloat16:
        return None
    from dsa.integrations.transformers import patch
    return patch(copy.deepcopy(model).to(dtype), **dict(patch_kwargs or {}, backend="reference"))
