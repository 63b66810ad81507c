"""Benchmark cases of the decode operators over paged caches (docs/serving.md).

DeepSeek-V3.2 shapes: the sparse decode attention reads top-2048 latent rows
(576 values, d_v 512) per request for H query heads; the decode indexer scores
every cached index key (128 values) with 64 heads. Each row is compared with
its binding bound on the machine at hand (``ceiling="binding"``): its FLOPs at the
compute ceiling or its bytes at copy bandwidth, whichever takes longer. The attention
at H = 128 is a [128 x 576].[576 x 2048] product per request (242 FLOP per bf16
record byte: compute); at H = 16 a sixteenth of that work over the same bytes; the
indexer does 2 * 64 * 128 FLOPs per 132-byte FP8 key. ``compressor_append`` is
DeepSeek-V4's compressor in a decode step: one new token per request that completes
an entry, pooled from the fp32 state (memory-bound: the state rows it reads).

Peers: ``naive`` gathers the selected rows (dsa_cache_gather) and runs torch's
softmax attention / score + topk; ``gather_prefill`` is the path a DsaCache decode
step took before the decode ops: every cached row of the request read back, then
the prefill op.
"""
from __future__ import annotations

import torch

from dsa import (dsa_cache_gather, dsa_compressor_append, dsa_indexer, dsa_indexer_decode, dsa_sparse_attention,
                 dsa_sparse_attention_decode)
from dsa.decode import new_compressor_state
from dsa.bench.case import FUSED, NAIVE, Case
from dsa.paged_cache import DEFAULT_BLOCK_SIZE, cache_token_bytes, huge_page_zeros

TODAY = "gather_prefill"
BS = DEFAULT_BLOCK_SIZE


def _finite_bf16_bytes(n: int, g: torch.Generator) -> torch.Tensor:
    """n random bf16 values of magnitude < 2 (exponent's top bit cleared: never inf or NaN), as bytes."""
    bits = torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int32, generator=g) & 0xBFFF
    return bits.to(torch.int16).view(torch.uint8)


def random_cache(tokens: int, dim: int, rope: int, dtype: str, g: torch.Generator) -> torch.Tensor:
    """A paged cache of ``tokens`` valid random records, written as bytes (a cache_write
    of 2 Mi tokens would dominate the set-up)."""
    blocks = -(-tokens // BS)
    tb = cache_token_bytes(dim, rope, dtype)
    cache = huge_page_zeros((blocks * BS, tb))  # allocated as new_paged_cache allocates it
    if dtype == "bf16":
        cache.view(-1).copy_(_finite_bf16_bytes(blocks * BS * dim, g))
    else:  # fp8: codes of either sign below NaN, scale 2^-4, bf16 RoPE
        nq = dim - rope
        codes = torch.randint(0, 0x7F, (blocks * BS, nq), dtype=torch.uint8, generator=g)
        cache[:, :nq] = codes | (torch.randint(0, 2, codes.shape, dtype=torch.uint8, generator=g) << 7)
        groups = -(-nq // 128)
        cache[:, nq: nq + 4 * groups] = torch.full((blocks * BS, groups), 2.0 ** -4).view(torch.uint8)
        if rope:
            cache[:, nq + 4 * groups:] = _finite_bf16_bytes(blocks * BS * rope, g).view(blocks * BS, -1)
    return cache.view(blocks, BS, tb)


def _padded(ctx: int) -> int:
    """Tokens of a request's whole blocks (the cache rows _tables hands it)."""
    return -(-ctx // BS) * BS


def _tables(B: int, ctx: int) -> torch.Tensor:
    width = -(-ctx // BS)
    return torch.arange(B * width, dtype=torch.int32).view(B, width)  # distinct blocks per request


def attention_case(H: int, ctx: int, B: int, cache_dtype: str, topk: int = 2048, quick: bool = False) -> Case:
    D, rope, dv = 576, 64, 512

    def setup():
        g = torch.Generator().manual_seed(7)
        idx = torch.stack([torch.randperm(ctx, generator=g)[:topk].sort().values for _ in range(B)])
        return {"q": torch.randn(B, 1, H, D, generator=g).bfloat16(),
                "cache": random_cache(B * _padded(ctx), D, rope, cache_dtype, g), "table": _tables(B, ctx),
                "lens": torch.full((B,), ctx, dtype=torch.int32), "idx": idx.to(torch.int32).view(B, 1, topk)}

    def fused(x):
        return dsa_sparse_attention_decode(x["q"], x["cache"], x["table"], x["lens"], scale=D ** -0.5, d_v=dv,
                                           indices=x["idx"], rope_dim=rope, cache_dtype=cache_dtype)

    def naive(x):
        rows = dsa_cache_gather(x["cache"], x["table"], x["idx"][:, 0], dim=D, rope_dim=rope, dtype=cache_dtype,
                                out_dtype=x["q"].dtype)  # [B, topk, D]; fp32 for the fp32 peer
        p = torch.softmax((x["q"][:, 0] @ rows.transpose(1, 2)).float() * D ** -0.5, dim=-1)
        return p.to(rows.dtype) @ rows[..., :dv]

    def today(x):
        outs = []
        for b in range(B):
            pos = torch.arange(ctx, dtype=torch.int32).view(1, -1)
            kv = dsa_cache_gather(x["cache"], x["table"][b: b + 1], pos, dim=D, rope_dim=rope, dtype=cache_dtype,
                                  out_dtype=torch.bfloat16)[0]
            outs.append(dsa_sparse_attention(x["q"][b], kv, x["idx"][b], scale=D ** -0.5, d_v=dv,
                                             query_lengths=[0, 1], key_lengths=[0, ctx])[0])
        return outs

    impls = {FUSED: fused, NAIVE: naive, TODAY: today}
    skip = {}
    if B * ctx > 32768 * 2:
        del impls[TODAY]
        skip[TODAY] = "reads every cached row of every request (B x context rows per step): small cases only"
    record = cache_token_bytes(D, rope, cache_dtype)
    return Case(name=f"sparse_attention_decode/{cache_dtype}/H{H}/ctx{ctx // 1024}K/B{B}/K{topk}",
                setup=setup, impls=impls, skip=skip, flops=2.0 * B * H * topk * (D + dv),
                bytes_moved=float(B * topk * record), ceiling="binding", dtype="bf16", quick=quick,
                note=f"{2 * H * (D + dv) / record:.0f} FLOP per byte of {record}-byte records")


def indexer_case(ctx: int, B: int, next_n: int, cache_dtype: str = "fp8", Hi: int = 64, Di: int = 128,
                 topk: int = 2048, quick: bool = False) -> Case:
    def setup():
        g = torch.Generator().manual_seed(8)
        return {"q": torch.randn(B, next_n, Hi, Di, generator=g).bfloat16(),
                "w": (torch.randn(B, next_n, Hi, generator=g) * Hi ** -0.5).bfloat16(),
                "cache": random_cache(B * _padded(ctx), Di, 0, cache_dtype, g), "table": _tables(B, ctx),
                "lens": torch.full((B,), ctx, dtype=torch.int32)}

    def fused(x):
        return dsa_indexer_decode(x["q"], x["w"], x["cache"], x["table"], x["lens"], topk=topk,
                                  scale=Di ** -0.5, cache_dtype=cache_dtype)

    def gathered(x, b):  # in the queries' dtype: fp32 for the fp32 peer
        pos = torch.arange(ctx, dtype=torch.int32).view(1, -1)
        return dsa_cache_gather(x["cache"], x["table"][b: b + 1], pos, dim=Di, dtype=cache_dtype,
                                out_dtype=x["q"].dtype)[0]

    def naive(x):
        out = []
        for b in range(B):
            k = gathered(x, b)
            s = (torch.relu(torch.einsum("nhd,sd->nhs", x["q"][b], k).float()) * x["w"][b].float()[..., None]).sum(1)
            causal = torch.arange(ctx) > (ctx - next_n + torch.arange(next_n))[:, None]
            out.append(s.masked_fill(causal, float("-inf")).topk(topk, dim=-1).indices)
        return out

    def today(x):
        return [dsa_indexer(x["q"][b], gathered(x, b), x["w"][b], topk=topk, scale=Di ** -0.5,
                            query_lengths=[0, next_n], key_lengths=[0, ctx]) for b in range(B)]

    impls = {FUSED: fused, NAIVE: naive, TODAY: today}
    return Case(name=f"indexer_decode/{cache_dtype}/Hi{Hi}/ctx{ctx // 1024}K/B{B}/n{next_n}",
                setup=setup, impls=impls, flops=2.0 * B * next_n * Hi * Di * ctx,
                bytes_moved=float(B * ctx * cache_token_bytes(Di, 0, cache_dtype)), ceiling="binding",
                dtype="bf16", quick=quick,
                note=f"{2 * next_n * Hi * Di / cache_token_bytes(Di, 0, cache_dtype):.0f} FLOP per key byte")


def v4_attention_case(kind: str, ctx: int, B: int, cache_dtype: str, H: int = 64, topk: int = 512) -> Case:
    """DeepSeek-V4's decode attention: the 128-token window from its ring, the compressed
    entries (CSA: the top-``topk`` of the ctx / 4; HCA: all ctx / 128 visible) and sinks."""
    D, rope, window = 512, 64, 128
    m = 4 if kind == "csa" else 128
    entries = ctx // m
    ring_cols = -(-(window + 16) // BS) + 1
    cmp_keys = min(topk, entries) if kind == "csa" else entries

    def setup():
        g = torch.Generator().manual_seed(10)
        win_table = torch.arange(B * ring_cols, dtype=torch.int32).view(B, ring_cols)
        x = {"q": torch.randn(B, 1, H, D, generator=g).bfloat16(),
             "win": random_cache(B * ring_cols * BS, D, rope, cache_dtype, g), "win_table": win_table,
             "cmp": random_cache(B * _padded(entries), D, rope, cache_dtype, g), "cmp_table": _tables(B, entries),
             "lens": torch.full((B,), ctx, dtype=torch.int32), "sinks": torch.randn(H, generator=g)}
        if kind == "csa":
            x["idx"] = torch.stack([torch.randperm(entries, generator=g)[:topk].sort().values
                                    for _ in range(B)]).to(torch.int32).view(B, 1, topk)
        return x

    def fused(x):
        return dsa_sparse_attention_decode(x["q"], x["win"], x["win_table"], x["lens"], scale=D ** -0.5,
                                           window=window, rope_dim=rope, cache_dtype=cache_dtype, ring=True,
                                           cmp_cache=x["cmp"], cmp_block_table=x["cmp_table"],
                                           cmp_indices=x.get("idx"), cmp_ratio=m, sinks=x["sinks"])

    def naive(x):  # gather the window and the entries, then the model's eager softmax with a sink column
        pos = torch.arange(ctx - window, ctx, dtype=torch.int32).expand(B, -1)
        win = dsa_cache_gather(x["win"], x["win_table"], pos, dim=D, rope_dim=rope, dtype=cache_dtype, ring=True,
                               out_dtype=x["q"].dtype)  # fp32 for the fp32 peer
        cpos = x["idx"][:, 0] if kind == "csa" else torch.arange(entries, dtype=torch.int32).expand(B, -1)
        cmp = dsa_cache_gather(x["cmp"], x["cmp_table"], cpos, dim=D, rope_dim=rope, dtype=cache_dtype,
                               out_dtype=x["q"].dtype)
        kv = torch.cat([win, cmp], dim=1)  # [B, keys, D]
        logits = (x["q"][:, 0] @ kv.transpose(1, 2)).float() * D ** -0.5  # [B, H, keys]
        logits = torch.cat([logits, x["sinks"].view(1, H, 1).expand(B, H, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., :-1]
        return p.to(kv.dtype) @ kv

    keys = window + cmp_keys
    record = cache_token_bytes(D, rope, cache_dtype)
    return Case(name=f"sparse_attention_decode/v4-{kind}/{cache_dtype}/H{H}/ctx{ctx // 1024}K/B{B}",
                setup=setup, impls={FUSED: fused, NAIVE: naive}, flops=2.0 * B * H * keys * (D + D),
                bytes_moved=float(B * keys * record), ceiling="binding", dtype="bf16",
                note=f"{window} window keys + {cmp_keys} compressed entries per row, {2 * H * 2 * D / record:.0f} "
                     f"FLOP per record byte")


def compressor_append_case(kind: str, B: int, quick: bool = False) -> Case:
    """One decode step of a V4 compressor: every request holds k * m - 1 tokens and
    appends the one that completes its next entry (the step that pools)."""
    m, overlap, c = {"csa": (4, True, 512), "hca": (128, False, 512), "csa-index": (4, True, 128)}[kind]
    C = (2 if overlap else 1) * c
    slots = (2 if overlap else 1) * m
    held = 64 * m - 1

    def setup():
        g = torch.Generator().manual_seed(9)
        skv, sgate = new_compressor_state(B, m, C, overlap=overlap)
        skv.copy_(torch.randn(skv.shape, generator=g))
        sgate.copy_(torch.randn(sgate.shape, generator=g))
        return {"kv": torch.randn(B, 1, C, generator=g).bfloat16(), "gate": torch.randn(B, 1, C, generator=g).bfloat16(),
                "bias": torch.randn(m, C, generator=g), "skv": skv, "sgate": sgate,
                "lens": torch.full((B,), held, dtype=torch.int32)}

    def fused(x):
        return dsa_compressor_append(x["kv"], x["gate"], x["bias"], x["skv"], x["sgate"], x["lens"], ratio=m,
                                     overlap=overlap)

    ring = torch.arange(held + 1 - slots, held + 1) % slots  # the entry's tokens' ring rows, oldest first

    def naive(x):  # the model's own eager pooling over a state kept as torch tensors
        x["skv"][:, held % slots] = x["kv"][:, 0].float()
        x["sgate"][:, held % slots] = x["gate"][:, 0].float()
        kv, gate = x["skv"][:, ring], x["sgate"][:, ring] + (x["bias"].repeat(2, 1) if overlap else x["bias"])
        if overlap:  # block w-1 on [0, c), block w on [c, 2c)
            kv = torch.cat([kv[:, :m, :c], kv[:, m:, c:]], 1)
            gate = torch.cat([gate[:, :m, :c], gate[:, m:, c:]], 1)
        return (kv * gate.softmax(1)).sum(1).to(x["kv"].dtype)

    return Case(name=f"compressor_append/{kind}-r{m}/bf16/B{B}/c{c}", setup=setup,
                impls={FUSED: fused, NAIVE: naive}, bytes_moved=float(B * (slots * c * 8 + C * 8)),
                ceiling="copy_bw", dtype="bf16", quick=quick,
                note=f"{slots} fp32 slots of kv and gate per output channel read from the state")


CASES = (
    [attention_case(128, 32768, 1, "bf16", quick=True), attention_case(16, 32768, 1, "bf16", quick=True)]
    + [attention_case(H, ctx, B, c) for c in ("bf16", "fp8") for H in (128, 16) for ctx in (32768, 131072)
       for B in (1, 16) if not (c == "bf16" and ctx == 32768 and B == 1)]
    + [indexer_case(32768, 1, 1, quick=True)]
    + [indexer_case(ctx, B, n) for ctx in (32768, 131072) for B in (1, 16) for n in (1, 2)
       if not (ctx == 32768 and B == 1 and n == 1)]
    + [v4_attention_case(kind, ctx, B, c) for kind in ("csa", "hca") for c in ("bf16", "fp8")
       for ctx in (32768, 131072) for B in (1, 16)]
    + [compressor_append_case(kind, B) for kind in ("csa", "hca", "csa-index") for B in (1, 16)]
)
