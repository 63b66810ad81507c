"""Tiny random DeepSeek-V3.2 / V4 transformers models for the integration tests.

Sizes follow /work/shared/research/transformers_deepseek.md 1.3: >= 16 indexer heads so
that ReLU zeros do not tie the top-k; sinks, position biases and hash-MoE tables are
randomised because the model initialises them to 0.
"""
from __future__ import annotations

import copy

import torch


def v32_config(**overrides):
    from transformers import DeepseekV32Config
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              index_n_heads=16, index_head_dim=16, index_topk=8, n_routed_experts=4, n_group=2, topk_group=1,
              num_experts_per_tok=2, n_shared_experts=1,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              max_position_embeddings=1024, pad_token_id=0, attn_implementation="eager")
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
              max_position_embeddings=1024, pad_token_id=0, attn_implementation="eager")
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
