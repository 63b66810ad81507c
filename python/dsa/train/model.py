"""The DeepSeek-V4 language model the training job trains: transformers' own
``DeepseekV4ForCausalLM`` from a config, random init (no download).

The shape is V4's, scaled down so a 2-core CPU trains it: one shared 512-wide
KV head (K = V), a sliding window of 128 on every layer, CSA layers (ratio 4,
overlapping pooling, a lightning indexer choosing the top 512 compressed
entries) and HCA layers (ratio 128), attention sinks, the grouped output
projection, mHC residual streams and a small MoE. Layers cycle through
``LAYER_PATTERN``.
"""
from __future__ import annotations

import torch

from .data import VOCAB

LAYER_PATTERN = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention")
SHORT = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA", "heavily_compressed_attention": "HCA"}


def v4_config(layers: int, hidden: int, heads: int, head_dim: int, seq_len: int, index_topk: int,
              dtype: torch.dtype):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=hidden, moe_intermediate_size=hidden, num_hidden_layers=layers,
        layer_types=[LAYER_PATTERN[i % len(LAYER_PATTERN)] for i in range(layers)],
        mlp_layer_types=["moe"] * layers,  # hash MoE would need a trained tid2eid table
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim, partial_rotary_factor=64 / head_dim,
        q_lora_rank=hidden // 2, o_groups=2, o_lora_rank=hidden // 4, sliding_window=128,
        index_n_heads=16, index_head_dim=64, index_topk=index_topk,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3,
        max_position_embeddings=max(4096, seq_len), pad_token_id=0, attn_implementation="eager",
        torch_dtype=dtype, use_cache=False)


def build_model(config, seed: int, dtype: torch.dtype):
    """A fresh model with the given seed; sinks and position biases get random values
    (transformers initialises them to zero, which would hide their code paths)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    return model.to(dtype).train()


def layer_types(model) -> list[str]:
    return [SHORT[t] for t in model.config.layer_types]


def v32_config(layers: int, tokens: int, dtype: torch.dtype):
    """A small DeepSeek-V3.2: the real MLA widths (512-dim latent + 64 RoPE, 128 + 64 query
    dims, 128 value dims), 8 heads, a 16-head indexer picking 512 keys."""
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_n_heads=16, index_head_dim=64, index_topk=512, n_routed_experts=4, n_group=2, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=max(4096, tokens), pad_token_id=0,
        attn_implementation="eager", torch_dtype=dtype, use_cache=False)


def build_small(kind: str, layers: int, tokens: int, dtype: torch.dtype, seed: int = 0):
    """The small V4 of the training job (hidden 256, 8 heads x 128, top-512 CSA) or the
    small V3.2 above, random init, for ``tokens`` positions."""
    if kind == "v4":
        config = v4_config(layers=layers, hidden=256, heads=8, head_dim=128, seq_len=tokens, index_topk=512,
                           dtype=dtype)
        return build_model(config, seed=seed, dtype=dtype)
    from transformers import DeepseekV32ForCausalLM
    torch.manual_seed(seed)
    return DeepseekV32ForCausalLM(v32_config(layers, tokens, dtype)).to(dtype).train()
