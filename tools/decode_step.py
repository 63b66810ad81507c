"""One decode step of a small DeepSeek-V3.2 (issue 46's model: 2 layers, hidden 512,
16 heads, latent 512 + 64, 64 index heads x 128, index_topk 2048, bf16, batch 1,
``patch(strict=True)``) after a prompt of each context length: median of 8 steps, per
configuration: unpatched (transformers' cache), patched over transformers' cache,
patched over dsa's DsaCache as it ran before the decode ops (gather + prefill ops), and
patched over DsaCache on the decode ops (bf16, fp8).

    python tools/decode_step.py [--contexts 1k,4k,16k] [--steps 8] [--json build/decode_step.json]

``--dtype fp32``: the same model in fp32, with DsaCache fp32 / bf16 / fp8 (on CPUs whose
torch has no native bf16 matmul, AVX2-only ones, a bf16 prefill runs on an emulation
and the unpatched and transformers'-cache columns take hours; fp32 is what runs there).

``--arch v4``: the same for a small DeepSeek-V4 (3 layers: sliding, CSA, HCA; hidden 512,
16 heads of 512 with 64 RoPE dims, window 128, CSA every 4 tokens with 64 index heads x
128 and index_topk 512, HCA every 128, bf16): unpatched (transformers' V4 cache, its
prompt in 2048-token chunks: one eager call over 32K tokens would need tens of GiB of
scores) against the patched model over a DsaCache (bf16, fp8; with ``--dtype fp32`` the
model in fp32 and a DsaCache fp32 / bf16 / fp8, as for V3.2).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from dsa._child import parse_token_counts  # noqa: E402
from dsa.integrations.transformers import DsaCache, fallback_counts, patch  # noqa: E402


def model(max_tokens: int, dtype: torch.dtype = torch.bfloat16):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
    cfg = DeepseekV32Config(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=16,
                            num_key_value_heads=16, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
                            index_topk=2048, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                            max_position_embeddings=max(4096, max_tokens), torch_dtype=dtype)
    torch.manual_seed(0)
    return DeepseekV32ForCausalLM(cfg).to(dtype).eval()


def step_ms(m, ids, cache, steps: int) -> float:
    """Median ms of `steps` greedy decode steps after the prompt `ids` (one call)."""
    with torch.no_grad():
        out = m(ids, past_key_values=cache, use_cache=True)
    return _steps(m, out, out.past_key_values, steps)


def synthetic_cache(m, ctx: int, cache_dtype: str) -> DsaCache:
    """A DsaCache holding ``ctx`` random tokens per layer, written with dsa_cache_write
    instead of a prefill (a step's cost does not depend on what the rows hold; a 64K
    prefill of this model takes minutes, mostly its indexer's T^2 scores)."""
    cfg = m.config
    cache = DsaCache(cfg, cache_dtype=cache_dtype, capacity_tokens=ctx + 64)
    g = torch.Generator().manual_seed(ctx)
    latent, rope, index = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim
    pos = torch.arange(ctx).view(1, -1)
    dtype = m.dtype  # the model's: fp32 or bf16 rows, stored as the cache's dtype says
    for layer in cache.layers:
        layer.start(1, latent, rope, index, dtype)
        for stream, dim in ((layer.latent, latent), (layer.index_keys, index)):
            stream.reserve([ctx])
            for lo in range(0, ctx, 8192):  # in chunks: the fp32 rows of 64K tokens are 150 MB
                hi = min(ctx, lo + 8192)
                stream.write(pos[:, lo:hi], torch.randn(1, hi - lo, dim, generator=g).to(dtype))
        layer.lengths, layer.columns = [ctx], ctx
    return cache


def synthetic_step_ms(m, ctx: int, cache_dtype: str, steps: int) -> float:
    cache = synthetic_cache(m, ctx, cache_dtype)
    tok = torch.ones(1, 1, dtype=torch.long)
    times = []
    with torch.no_grad():
        for _ in range(steps + 1):
            t = time.perf_counter()
            out = m(tok, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
            tok = out.logits[:, -1:].argmax(-1)
    return 1e3 * statistics.median(times[1:])


class _GatherPath:
    """The DsaCache step as it ran before the decode ops (every cached row gathered,
    then the prefill ops): the patch's decode branch switched off for the block."""

    def __enter__(self):
        from dsa.integrations.transformers import _v32
        self.saved, _v32.DECODE_MAX_ROWS = _v32.DECODE_MAX_ROWS, 0

    def __exit__(self, *exc):
        from dsa.integrations.transformers import _v32
        _v32.DECODE_MAX_ROWS = self.saved


def model_v4(max_tokens: int, dtype: torch.dtype = torch.bfloat16):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    cfg = DeepseekV4Config(vocab_size=1024, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=3,
                           layer_types=["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"],
                           mlp_layer_types=["moe", "moe", "moe"],
                           compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                           num_attention_heads=16, num_key_value_heads=1, head_dim=512, partial_rotary_factor=0.125,
                           q_lora_rank=256, o_groups=4, o_lora_rank=256, sliding_window=128, index_n_heads=64,
                           index_head_dim=128, index_topk=512, n_routed_experts=4, num_experts_per_tok=2,
                           n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3,
                           max_position_embeddings=max(4096, max_tokens), attn_implementation="eager")
    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # the model starts sinks and position biases at 0
        for name, p in m.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape).to(p.dtype))
    return m


def step_ms_chunked(m, ids, cache, steps: int, chunk: int = 2048) -> float:
    """step_ms with the prompt fed in chunks (the unpatched V4's prefill)."""
    with torch.no_grad():
        for lo in range(0, ids.shape[1], chunk):
            out = m(ids[:, lo:lo + chunk], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    return _steps(m, out, cache, steps)


def _steps(m, out, cache, steps: int) -> float:
    tok = out.logits[:, -1:].argmax(-1)
    times = []
    with torch.no_grad():
        for _ in range(steps):
            t = time.perf_counter()
            out = m(tok, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
            tok = out.logits[:, -1:].argmax(-1)
    return 1e3 * statistics.median(times)


def main_v4(args) -> int:
    from transformers import DynamicCache
    contexts = parse_token_counts(args.contexts)
    base = model_v4(max(contexts) + args.steps + 1, torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    patched = patch(copy.deepcopy(base), strict=True)
    cache_dtypes = ("fp32", "bf16", "fp8") if args.dtype == "fp32" else ("bf16", "fp8")
    rows = []
    print("| context | unpatched (transformers' V4 cache) | "
          + " | ".join(f"DsaCache {dt}" for dt in cache_dtypes) + " |")
    print("|---" * (2 + len(cache_dtypes)) + "|")
    for ctx in contexts:
        ids = torch.randint(1, 1024, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        r = {"context": ctx}
        r["unpatched"] = (step_ms_chunked(base, ids, DynamicCache(config=base.config), args.steps)
                          if ctx <= args.unpatched_max else None)
        for dt in cache_dtypes:
            r[f"dsa_cache_{dt}"] = step_ms(patched, ids, DsaCache(patched.config, cache_dtype=dt), args.steps)
        rows.append(r)
        cell = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
        cells = " | ".join(cell(r[f"dsa_cache_{dt}"]) for dt in cache_dtypes)
        print(f"| {ctx} | {cell(r['unpatched'])} | {cells} |", flush=True)
    assert fallback_counts(patched) == {}, fallback_counts(patched)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"arch": "v4", "dtype": args.dtype, "threads": torch.get_num_threads(),
                                           "rows": rows}, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1k,4k,16k,64k")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--unpatched-max", type=int, default=4096, help="longest context for the unpatched model")
    ap.add_argument("--synthetic-from", type=int, default=32768,
                    help="from this context on, DsaCache rows are written at random instead of prefilled, "
                         "and only the DsaCache configurations run")
    ap.add_argument("--json", default="build/decode_step.json")
    ap.add_argument("--arch", choices=("v32", "v4"), default="v32")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the model's dtype")
    args = ap.parse_args(argv)
    if args.arch == "v4":
        return main_v4(args)
    contexts = parse_token_counts(args.contexts)
    base = model(max(contexts) + args.steps + 1, torch.float32 if args.dtype == "fp32" else torch.bfloat16)
    patched = patch(copy.deepcopy(base), strict=True)
    # DsaCache dtypes: the model's own first (the gather path's too), then the smaller ones.
    cache_dtypes = ("fp32", "bf16", "fp8") if args.dtype == "fp32" else ("bf16", "fp8")
    rows = []
    print(f"| context | unpatched | patched, transformers' cache | DsaCache {cache_dtypes[0]}, gather + prefill ops "
          "(before) | " + " | ".join(f"DsaCache {dt}" for dt in cache_dtypes) + " |")
    print("|---" * (4 + len(cache_dtypes)) + "|")
    for ctx in contexts:
        ids = torch.randint(1, 1024, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        from transformers import DynamicCache
        r = {"context": ctx, "synthetic": ctx >= args.synthetic_from}
        if r["synthetic"]:
            r["unpatched"] = r["patched_transformers_cache"] = None
            for dt in cache_dtypes:
                r[f"dsa_cache_{dt}"] = synthetic_step_ms(patched, ctx, dt, args.steps)
            with _GatherPath():
                r["dsa_cache_gather"] = synthetic_step_ms(patched, ctx, cache_dtypes[0], args.steps)
        else:
            with _GatherPath():
                r["dsa_cache_gather"] = step_ms(patched, ids, DsaCache(patched.config, cache_dtype=cache_dtypes[0]),
                                                args.steps)
            r["unpatched"] = (step_ms(base, ids, DynamicCache(config=base.config), args.steps)
                              if ctx <= args.unpatched_max else None)
            r["patched_transformers_cache"] = step_ms(patched, ids, DynamicCache(config=base.config), args.steps)
            for dt in cache_dtypes:
                r[f"dsa_cache_{dt}"] = step_ms(patched, ids, DsaCache(patched.config, cache_dtype=dt), args.steps)
        rows.append(r)
        cell = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
        cells = [r["unpatched"], r["patched_transformers_cache"], r["dsa_cache_gather"]]
        cells += [r[f"dsa_cache_{dt}"] for dt in cache_dtypes]
        print(f"| {ctx}{' (rows written, no prefill)' if r['synthetic'] else ''} | "
              + " | ".join(cell(v) for v in cells) + " |", flush=True)
    assert fallback_counts(patched) == {}, fallback_counts(patched)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows},
                                          indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
