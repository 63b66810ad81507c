"""Cases for the real gloo runs of dsa.cp (run inside spawned processes by test_cp_gloo.py).

Every rank builds the same global inputs from a seeded generator, runs the single-process
ops on them (the reference), then the dsa.cp path on its shard, and compares: local
outputs and local-row gradients (key-side gradients arrive through the gathers'
backward), replicated parameters' gradients summed over ranks, KL shares summed over
ranks. fp32 throughout: the tolerance is the quality rule's fp32 relative error 1e-4.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import dsa
import dsa.cp as cp
from dsa.layer import LayerCompressMode, compress_for_layer

# Per world size: TND configurations (global document ends, rank row offsets).
CONFIGS = {
    2: {
        # uneven split; 1-token and empty documents; the last document over both ranks,
        # the boundary 19 off its block edge (a CSA block [17, 21) straddles the ranks)
        "straddle": ([5, 12, 13, 13, 40], [0, 19, 40]),
        # rank 0's prefix has no compressed entry at ratio 4; rank 1's has
        "nocmp": ([3, 4, 40], [0, 5, 40]),
    },
    4: {
        # document [3, 50) over every rank; rank 2 holds 2 rows, so rank 3's CSA halo comes
        # from ranks 1 and 2; boundaries on (11, 27) and off (25) block edges
        "straddle": ([2, 3, 3, 50, 64], [0, 11, 25, 27, 64]),
        "nocmp": ([3, 4, 64], [0, 3, 5, 20, 64]),
        # a rank with no row at all
        "empty": ([7, 30, 64], [0, 10, 10, 30, 64]),
    },
}
# Long documents for m = 128 (HCA): entries straddling rank boundaries, halos of up to 127 rows.
LONG = {2: ([130, 300, 384], [0, 200, 384]), 4: ([130, 300, 300, 520], [0, 100, 200, 260, 520])}


def _config(world, cfg):
    return LONG[world] if cfg == "long" else CONFIGS[world][cfg]


def _tnd_shard(ends, offsets, rank, balance):
    """The TND shard of a case: the config's contiguous runs, or the zigzag split of the
    same stream (chunks r and 2W-1-r of 2W; the configs' offsets are then unused)."""
    if balance == "zigzag":
        return cp.zigzag_tnd_shard(ends)
    return cp.tnd_shard(ends, offsets[rank + 1] - offsets[rank])


ZIGZAG = {2: (12, [12, 7, 2]), 4: (24, [24, 13, 5])}   # (S, row lengths): ends inside chunks, padded chunks


class Checker:
    def __init__(self, rank):
        self.rank = rank
        self.errors = []

    def close(self, name, got, want):
        if got is None or want is None:
            if not (got is None and want is None):
                self.errors.append(f"{name}: got {'None' if got is None else 'a tensor'}, want "
                                   f"{'None' if want is None else 'a tensor'}")
            return
        if got.shape != want.shape:
            self.errors.append(f"{name}: shape {list(got.shape)} != {list(want.shape)}")
            return
        g, w = got.double(), want.double()
        if want.dtype in (torch.int32, torch.int64, torch.bool):
            if not torch.equal(g, w):
                self.errors.append(f"{name}: integer tensors differ")
            return
        fin = torch.isfinite(w)
        if not torch.equal(fin, torch.isfinite(g)) or not torch.equal(g[~fin], w[~fin]):
            self.errors.append(f"{name}: non-finite values in different places")
            return
        if fin.sum() == 0:
            return
        err = (g[fin] - w[fin]).abs().max().item()
        ref = w[fin].abs().max().item()
        # fp32 rule: relative error <= 1e-4 (an all-zero reference must be matched exactly)
        if err > 1e-4 * ref or (ref == 0 and err != 0):
            self.errors.append(f"{name}: max abs err {err:.3e} > 1e-4 * max|ref| ({ref:.3e})")

    def zero(self, name, t):
        if t is None:
            self.errors.append(f"{name}: gradient missing (None)")
        elif torch.count_nonzero(t) != 0:
            self.errors.append(f"{name}: expected an all-zero gradient")

    def true(self, name, cond):
        if not cond:
            self.errors.append(name)


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _summed(t):
    """A replicated parameter's gradient summed over the CP ranks."""
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


# -- V3.2 ----------------------------------------------------------------------------------------

def case_v32_sparse(chk, world, rank, cfg, coefficient, balance="contiguous"):
    ends, offsets = CONFIGS[world][cfg]
    T, H, D, Dv, Dr, Hi, Di, K = ends[-1], 4, 40, 32, 8, 2, 16, 6
    r = _gen(11)
    g_q, g_kv, g_qr, g_kr = r(T, H, D), r(T, D), r(T, H, Dr), r(T, Dr)
    g_iq, g_ik, g_w, g_up = r(T, Hi, Di), r(T, Di), r(T, Hi), r(T, H, Dv)
    scale = D ** -0.5
    # reference
    q, kv, qr, kr, iq, ik, w = map(_leaf, (g_q, g_kv, g_qr, g_kr, g_iq, g_ik, g_w))
    idx = dsa.dsa_indexer(iq, ik, w, topk=K, query_lengths=ends, key_lengths=ends)
    out, mx, sm = dsa.dsa_sparse_attention(q, kv, idx, scale=scale, d_v=Dv, query_rope=qr, key_rope=kr,
                                           query_lengths=ends, key_lengths=ends)
    kl = dsa.dsa_kl_loss(q, kv, idx, mx, sm, iq, ik, w, scale=scale, query_rope=qr, key_rope=kr,
                         query_lengths=ends, key_lengths=ends, loss_coefficient=coefficient)
    ((out * g_up).sum() + kl).backward()
    # CP
    shard = _tnd_shard(ends, offsets, rank, balance)
    loc = lambda t: _leaf(cp.shard_rows(t, shard))  # noqa: E731
    q_l, kv_l, qr_l, kr_l, iq_l, ik_l, w_l = map(loc, (g_q, g_kv, g_qr, g_kr, g_iq, g_ik, g_w))
    kv_g, kr_g, ik_g = cp.gather(kv_l, shard), cp.gather(kr_l, shard), cp.gather(ik_l, shard)
    idx_l = cp.indexer(iq_l, ik_g, w_l, shard=shard, topk=K)
    out_l, mx_l, sm_l = cp.sparse_attention(q_l, kv_g, idx_l, shard=shard, scale=scale, d_v=Dv, query_rope=qr_l,
                                            key_rope=kr_g)
    share = cp.kl_loss(q_l, kv_g, idx_l, mx_l, sm_l, iq_l, ik_g, w_l, shard=shard, scale=scale, query_rope=qr_l,
                       key_rope=kr_g, loss_coefficient=coefficient)
    ((out_l * cp.shard_rows(g_up, shard)).sum() + share).backward()
    rows = lambda t: cp.shard_rows(t, shard)  # noqa: E731
    chk.close("indices", idx_l, rows(idx))
    for n, a, b in (("out", out_l, out), ("softmax_max", mx_l, mx), ("softmax_sum", sm_l, sm)):
        chk.close(n, a, rows(b))
    chk.close("kl (sum of shares)", cp.loss_for_logging(share, shard), kl.detach())
    with torch.no_grad():
        scaled = cp.kl_loss(q_l, kv_g, idx_l, mx_l, sm_l, iq_l, ik_g, w_l, shard=shard, scale=scale, query_rope=qr_l,
                            key_rope=kr_g, loss_coefficient=coefficient, grads_averaged_over_cp=True)
    chk.close("kl shares with grads_averaged_over_cp sum to W * loss", cp.loss_for_logging(scaled, shard),
              world * kl.detach())
    for n, a, b in (("d_query", q_l, q), ("d_kv", kv_l, kv), ("d_query_rope", qr_l, qr), ("d_key_rope", kr_l, kr),
                    ("d_index_query", iq_l, iq), ("d_index_key", ik_l, ik), ("d_weights", w_l, w)):
        chk.close(n, a.grad, rows(b.grad))
    if coefficient == 0:
        for n, t in (("d_index_query", iq_l), ("d_index_key", ik_l), ("d_weights", w_l)):
            chk.zero(n + " (coefficient 0)", t.grad)
        chk.true("kl share is 0 with coefficient 0", float(share) == 0.0)


def case_v32_sparse_bf16(chk, world, rank):
    """bf16 sparse attention under CP against the fp64 oracle with the quality rule
    ``max|cp - oracle64| <= 2 * max|naive_bf16 - oracle64| + 1e-5`` (outputs and gradients;
    the key-side gradients are summed over ranks in fp32 by the gather's backward)."""
    from dsa.naive import naive_sparse_attention, oracle_sparse_attention
    ends, offsets = CONFIGS[world]["straddle"]
    T, H, D, Dv, Dr, Hi, Di, K = ends[-1], 4, 40, 32, 8, 2, 16, 6
    r = _gen(21)
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    g_q, g_kv, g_qr, g_kr, g_up = bf(r(T, H, D)), bf(r(T, D)), bf(r(T, H, Dr)), bf(r(T, Dr)), bf(r(T, H, Dv))
    idx = dsa.dsa_indexer(r(T, Hi, Di), r(T, Di), r(T, Hi), topk=K, query_lengths=ends, key_lengths=ends)
    scale = D ** -0.5
    lens = dict(query_lengths=ends, key_lengths=ends)

    def ref(fn, dtype):
        ts = [t.detach().to(dtype).requires_grad_(True) for t in (g_q, g_kv, g_qr, g_kr)]
        out = fn(ts[0], ts[1], idx, scale=scale, d_v=Dv, query_rope=ts[2], key_rope=ts[3], **lens)[0]
        (out * g_up.to(dtype)).sum().backward()
        return [out.detach()] + [t.grad for t in ts]

    oracle = ref(oracle_sparse_attention, torch.float64)
    naive = ref(naive_sparse_attention, torch.bfloat16)
    shard = cp.tnd_shard(ends, offsets[rank + 1] - offsets[rank])
    rows = lambda t: cp.shard_rows(t, shard)  # noqa: E731
    q_l, kv_l, qr_l, kr_l = (_leaf(rows(t)) for t in (g_q, g_kv, g_qr, g_kr))
    out_l = cp.sparse_attention(q_l, cp.gather(kv_l, shard), rows(idx), shard=shard, scale=scale, d_v=Dv,
                                query_rope=qr_l, key_rope=cp.gather(kr_l, shard))[0]
    (out_l * rows(g_up)).sum().backward()
    got = [out_l.detach(), q_l.grad, kv_l.grad, qr_l.grad, kr_l.grad]
    for n, a, o, nv in zip(("out", "d_query", "d_kv", "d_query_rope", "d_key_rope"), got, oracle, naive):
        o, nv = rows(o), rows(nv).double()
        chk.true(f"{n}: dtype {a.dtype}", a.dtype == torch.bfloat16)
        err = (a.double() - o).abs().max().item()
        bound = 2 * (nv - o).abs().max().item() + 1e-5
        chk.true(f"{n}: bf16 error {err:.3e} > bound {bound:.3e}", err <= bound)


def case_v32_dense(chk, world, rank, cfg, balance="contiguous"):
    ends, offsets = CONFIGS[world][cfg]
    T, H, D, Dv, Dr, Hi, Di = ends[-1], 4, 40, 32, 8, 2, 16
    r = _gen(12)
    g_q, g_kv, g_qr, g_kr = r(T, H, D), r(T, D), r(T, H, Dr), r(T, Dr)
    g_iq, g_ik, g_w, g_up = r(T, Hi, Di), r(T, Di), r(T, Hi), r(T, H, Dv)
    scale = D ** -0.5

    def run(q, kv, qr, kr, iq, ik, w, up, shard):
        if shard is None:
            lens = dict(query_lengths=ends, key_lengths=ends)
            out, mx, sm = dsa.dsa_sparse_attention(q, kv, None, scale=scale, d_v=Dv, query_rope=qr, key_rope=kr,
                                                   **lens)
            lse = dsa.dsa_dense_indexer_lse(iq, ik, w, **lens)
            kl = dsa.dsa_dense_indexer_kl_loss(iq, ik, w, q, kv.unsqueeze(1), mx, sm, lse, scale=scale,
                                               query_rope=qr, key_rope=kr.unsqueeze(1), loss_coefficient=0.5, **lens)
        else:
            out, mx, sm = cp.sparse_attention(q, kv, None, shard=shard, scale=scale, d_v=Dv, query_rope=qr,
                                              key_rope=kr)
            lse = cp.dense_indexer_lse(iq, ik, w, shard=shard)
            kl = cp.dense_indexer_kl_loss(iq, ik, w, q, kv.unsqueeze(1), mx, sm, lse, shard=shard, scale=scale,
                                          query_rope=qr, key_rope=kr.unsqueeze(1), loss_coefficient=0.5)
        ((out * up).sum() + kl).backward()
        return out, mx, sm, lse, kl

    ref_t = list(map(_leaf, (g_q, g_kv, g_qr, g_kr, g_iq, g_ik, g_w)))
    ref = run(*ref_t, g_up, None)
    shard = _tnd_shard(ends, offsets, rank, balance)
    rows = lambda t: cp.shard_rows(t, shard)  # noqa: E731
    loc = [_leaf(rows(t)) for t in (g_q, g_kv, g_qr, g_kr, g_iq, g_ik, g_w)]
    q_l, kv_l, qr_l, kr_l, iq_l, ik_l, w_l = loc
    got = run(q_l, cp.gather(kv_l, shard), qr_l, cp.gather(kr_l, shard), iq_l, cp.gather(ik_l, shard), w_l,
              rows(g_up), shard)
    for n, a, b in zip(("out", "softmax_max", "softmax_sum", "indexer_lse"), got[:4], ref[:4]):
        chk.close(n, a, rows(b))
    chk.close("dense kl (sum of shares)", cp.loss_for_logging(got[4], shard), ref[4].detach())
    for n, a, b in zip(("d_query", "d_kv", "d_query_rope", "d_key_rope", "d_index_query", "d_index_key",
                        "d_weights"), loc, ref_t):
        chk.close(n, a.grad, rows(b.grad))


# -- V4 -----------------------------------------------------------------------------------------

def case_v4(chk, world, rank, cfg, ratio, use_indexer, balance="contiguous"):
    """V4 layer: sliding window + compressed part (CSA: compressor with overlap + indexer's
    own compressor + top-k + KL; HCA: every visible entry), with sinks."""
    ends, offsets = _config(world, cfg)
    T, H, D, Hi, Di, window, K = ends[-1], 4, 32, 2, 16, 8, 3
    overlap = ratio == 4
    coff = 2 if overlap else 1
    r = _gen(13 + ratio)
    g_q, g_kv, g_up = r(T, H, D), r(T, D), r(T, H, D)
    g_ckv, g_cg, g_cb = r(T, coff * D), r(T, coff * D), r(ratio, coff * D, s=0.5)
    g_ikv, g_ig, g_ib = r(T, coff * Di), r(T, coff * Di), r(ratio, coff * Di, s=0.5)
    g_iq, g_w, g_sinks = r(T, Hi, Di), r(T, Hi), r(H)
    scale = D ** -0.5

    def run(q, kv, ckv, cg, cb, ikv, ig, ib, iq, w, sinks, up, shard):
        if shard is None:
            lens = dict(query_lengths=ends, key_lengths=ends)
            comp = compress_for_layer(ckv, cg, cb, ratio=ratio, query_lengths=ends)
        else:
            comp = cp.compressor(ckv, cg, cb, ratio=ratio, shard=shard)
        results = {"mode": comp.mode}
        if comp.mode is LayerCompressMode.NO_COMPRESS:
            if shard is None:
                out, mx, sm = dsa.dsa_sparse_attention(q, kv, None, scale=scale, window=window, sinks=sinks, **lens)
            else:
                out, mx, sm = cp.sparse_attention(q, kv, None, shard=shard, scale=scale, window=window, sinks=sinks)
            loss = (out * up).sum()
        else:
            results["compressed"] = comp.compressed
            cidx, kl = None, 0
            if use_indexer:
                if shard is None:
                    icomp, _ = dsa.dsa_compressor(ikv, ig, ib, ratio=ratio, query_lengths=ends)
                    cidx = dsa.dsa_indexer(iq, icomp, w, topk=K, cmp_ratio=ratio, **lens)
                else:
                    icomp = cp.compressor(ikv, ig, ib, ratio=ratio, shard=shard).compressed
                    cidx = cp.indexer(iq, icomp, w, shard=shard, topk=K, cmp_ratio=ratio)
                results["cmp_indices"] = cidx
                # dense indexer LSE over the compressed keys (cmp_ratio > 1)
                results["cmp_lse"] = (dsa.dsa_dense_indexer_lse(iq, icomp, w, cmp_ratio=ratio, **lens) if shard is None
                                      else cp.dense_indexer_lse(iq, icomp, w, shard=shard, cmp_ratio=ratio))
            if shard is None:
                out, mx, sm = dsa.dsa_sparse_attention(q, kv, None, scale=scale, window=window, cmp_kv=comp.compressed,
                                                       cmp_indices=cidx, cmp_ratio=ratio, sinks=sinks, **lens)
                if use_indexer:
                    kl = dsa.dsa_kl_loss(q, comp.compressed, cidx, mx, sm, iq, icomp, w, scale=scale, sinks=sinks,
                                         cmp_ratio=ratio, **lens)
            else:
                out, mx, sm = cp.sparse_attention(q, kv, None, shard=shard, scale=scale, window=window,
                                                  cmp_kv=comp.compressed, cmp_indices=cidx, cmp_ratio=ratio,
                                                  sinks=sinks)
                if use_indexer:
                    kl = cp.kl_loss(q, comp.compressed, cidx, mx, sm, iq, icomp, w, shard=shard, scale=scale,
                                    sinks=sinks, cmp_ratio=ratio)
            results["kl"] = kl
            loss = (out * up).sum() + kl
        loss.backward()
        results.update(out=out, softmax_max=mx, softmax_sum=sm)
        return results

    names = ("q", "kv", "ckv", "cg", "cb", "ikv", "ig", "ib", "iq", "w", "sinks")
    glob = (g_q, g_kv, g_ckv, g_cg, g_cb, g_ikv, g_ig, g_ib, g_iq, g_w, g_sinks)
    ref_t = dict(zip(names, map(_leaf, glob)))
    ref = run(*ref_t.values(), g_up, None)
    shard = _tnd_shard(ends, offsets, rank, balance)
    rows = lambda t: cp.shard_rows(t, shard)  # noqa: E731
    replicated = ("cb", "ib", "sinks")
    loc = {n: _leaf(t if n in replicated else rows(t)) for n, t in zip(names, glob)}
    args = dict(loc)
    args["kv"] = cp.gather(loc["kv"], shard)
    got = run(*args.values(), rows(g_up), shard)
    chk.true(f"mode {got['mode']} != {ref['mode']}", got["mode"] is ref["mode"])
    for n in ("out", "softmax_max", "softmax_sum", "cmp_indices", "cmp_lse"):
        if n in ref:
            chk.close(n, got[n], rows(ref[n]))
    if "compressed" in ref:
        chk.close("compressed (gathered global stream)", got["compressed"].detach(), ref["compressed"].detach())
    if use_indexer and "kl" in ref:
        chk.close("kl (sum of shares)", cp.loss_for_logging(got["kl"], shard), ref["kl"].detach())
    for n in names:
        want = ref_t[n].grad
        if ref["mode"] is LayerCompressMode.NO_COMPRESS and n not in ("q", "kv", "sinks"):
            continue
        if not use_indexer and n in ("ikv", "ig", "ib", "iq", "w"):
            continue
        if n in replicated:
            chk.close(f"d_{n} (summed over ranks)", None if loc[n].grad is None else _summed(loc[n].grad), want)
        else:
            chk.close(f"d_{n}", loc[n].grad, rows(want))
    return ref


def case_v4_fallback(chk, world, rank):
    """Every document shorter than the ratio: the ratio-1 fallback, decided from global counts."""
    ends, offsets = CONFIGS[world]["straddle"]
    shard = cp.tnd_shard(ends, offsets[rank + 1] - offsets[rank])
    x = torch.randn(shard.local_rows, 16, requires_grad=True)
    comp = cp.compressor(x, x, torch.zeros(128, 16), ratio=128, shard=shard)
    ref = compress_for_layer(torch.randn(ends[-1], 16), torch.randn(ends[-1], 16), torch.zeros(128, 16), ratio=128,
                             query_lengths=ends)
    chk.true("ratio 128 on short documents: both NO_COMPRESS", comp.mode is ref.mode is LayerCompressMode.NO_COMPRESS
             and comp.ratio == 1 and comp.compressed is None)


# -- BSND zigzag ----------------------------------------------------------------------------------

def case_zigzag(chk, world, rank):
    S, lens = ZIGZAG[world]
    B, H, D, Dv, Hi, Di, K = len(lens), 4, 40, 32, 2, 16, 5
    r = _gen(17)
    g_q, g_kv, g_iq, g_ik, g_w, g_up = r(B, S, H, D), r(B, S, D), r(B, S, Hi, Di), r(B, S, Di), r(B, S, Hi), r(B, S, H, Dv)
    scale = D ** -0.5
    # padded rows carry no upstream gradient in either run
    valid = (torch.arange(S)[None, :] < torch.tensor(lens)[:, None])[..., None, None]
    g_up = g_up * valid
    lensd = dict(query_lengths=lens, key_lengths=lens, layout="BSND")
    q, kv, iq, ik, w = map(_leaf, (g_q, g_kv, g_iq, g_ik, g_w))
    idx = dsa.dsa_indexer(iq, ik, w, topk=K, **lensd)
    out, mx, sm = dsa.dsa_sparse_attention(q, kv, idx, scale=scale, d_v=Dv, **lensd)
    kl = dsa.dsa_kl_loss(q, kv, idx, mx, sm, iq, ik, w, scale=scale, loss_coefficient=0.3, **lensd)
    ((out * g_up).sum() + kl).backward()
    shard = cp.zigzag_shard(S, lens)
    rows = lambda t: cp.shard_rows(t, shard)  # noqa: E731
    q_l, kv_l, iq_l, ik_l, w_l = (_leaf(rows(t)) for t in (g_q, g_kv, g_iq, g_ik, g_w))
    kv_g, ik_g = cp.gather(kv_l, shard), cp.gather(ik_l, shard)
    chk.close("zigzag gather restores natural order", kv_g.detach(), g_kv)
    idx_l = cp.indexer(iq_l, ik_g, w_l, shard=shard, topk=K)
    out_l, mx_l, sm_l = cp.sparse_attention(q_l, kv_g, idx_l, shard=shard, scale=scale, d_v=Dv)
    share = cp.kl_loss(q_l, kv_g, idx_l, mx_l, sm_l, iq_l, ik_g, w_l, shard=shard, scale=scale, loss_coefficient=0.3)
    ((out_l * rows(g_up)).sum() + share).backward()
    chk.close("indices", idx_l, rows(idx))
    for n, a, b in (("out", out_l, out), ("softmax_max", mx_l, mx), ("softmax_sum", sm_l, sm)):
        chk.close(n, a, rows(b))
    chk.close("kl (sum of shares)", cp.loss_for_logging(share, shard), kl.detach())
    for n, a, b in (("d_query", q_l, q), ("d_kv", kv_l, kv), ("d_index_query", iq_l, iq), ("d_index_key", ik_l, ik),
                    ("d_weights", w_l, w)):
        chk.close(n, a.grad, rows(b.grad))


def case_zigzag_v4(chk, world, rank, ratio, use_indexer):
    """BSND zigzag V4: sliding window + compressed part with sinks (CSA: indexer on the
    indexer's own compressed keys, KL on the compressed selection; HCA: every entry)."""
    S, lens = ZIGZAG[world]
    B, H, D, Hi, Di, window, K = len(lens), 4, 32, 2, 16, 4, 2
    overlap = ratio == 4
    coff = 2 if overlap else 1
    r = _gen(23 + ratio)
    glob = dict(q=r(B, S, H, D), kv=r(B, S, D), ckv=r(B, S, coff * D), cg=r(B, S, coff * D),
                cb=r(ratio, coff * D, s=0.5), ikv=r(B, S, coff * Di), ig=r(B, S, coff * Di),
                ib=r(ratio, coff * Di, s=0.5), iq=r(B, S, Hi, Di), w=r(B, S, Hi), sinks=r(H))
    valid = (torch.arange(S)[None, :] < torch.tensor(lens)[:, None])[..., None, None]
    g_up = r(B, S, H, D) * valid
    scale = D ** -0.5
    replicated = ("cb", "ib", "sinks")

    def run(t, up, shard):
        if shard is None:
            lensd = dict(query_lengths=lens, key_lengths=lens, layout="BSND")
            comp = compress_for_layer(t["ckv"], t["cg"], t["cb"], ratio=ratio, query_lengths=lens, layout="BSND")
            icomp = dsa.dsa_compressor(t["ikv"], t["ig"], t["ib"], ratio=ratio, query_lengths=lens,
                                       layout="BSND")[0] if use_indexer else None
            ind = lambda *a, **k: dsa.dsa_indexer(*a, **k, **lensd)  # noqa: E731
            att = lambda *a, **k: dsa.dsa_sparse_attention(*a, **k, **lensd)  # noqa: E731
            kl_fn = lambda *a, **k: dsa.dsa_kl_loss(*a, **k, **lensd)  # noqa: E731
            kv = t["kv"]
        else:
            comp = cp.compressor(t["ckv"], t["cg"], t["cb"], ratio=ratio, shard=shard)
            icomp = cp.compressor(t["ikv"], t["ig"], t["ib"], ratio=ratio, shard=shard).compressed if use_indexer else None
            ind = lambda *a, **k: cp.indexer(*a, **k, shard=shard)  # noqa: E731
            att = lambda *a, **k: cp.sparse_attention(*a, **k, shard=shard)  # noqa: E731
            kl_fn = lambda *a, **k: cp.kl_loss(*a, **k, shard=shard)  # noqa: E731
            kv = cp.gather(t["kv"], shard)
        res = {"mode": comp.mode, "compressed": comp.compressed}
        cidx = ind(t["iq"], icomp, t["w"], topk=K, cmp_ratio=ratio) if use_indexer else None
        out, mx, sm = att(t["q"], kv, None, scale=scale, window=window, cmp_kv=comp.compressed, cmp_indices=cidx,
                          cmp_ratio=ratio, sinks=t["sinks"])
        kl = kl_fn(t["q"], comp.compressed, cidx, mx, sm, t["iq"], icomp, t["w"], scale=scale, sinks=t["sinks"],
                   cmp_ratio=ratio) if use_indexer else 0
        ((out * up).sum() + kl).backward()
        res.update(out=out, softmax_max=mx, softmax_sum=sm, cmp_indices=cidx, kl=kl)
        return res

    ref_t = {n: _leaf(v) for n, v in glob.items()}
    ref = run(ref_t, g_up, None)
    shard = cp.zigzag_shard(S, lens)
    rows = lambda t: cp.shard_rows(t, shard)  # noqa: E731
    loc = {n: _leaf(v if n in replicated else rows(v)) for n, v in glob.items()}
    got = run(loc, rows(g_up), shard)
    chk.true("mode", got["mode"] is ref["mode"] is not LayerCompressMode.NO_COMPRESS)
    chk.close("compressed", got["compressed"].detach(), ref["compressed"].detach())
    for n in ("out", "softmax_max", "softmax_sum") + (("cmp_indices",) if use_indexer else ()):
        chk.close(n, got[n], rows(ref[n]))
    if use_indexer:
        chk.close("kl (sum of shares)", cp.loss_for_logging(got["kl"], shard), ref["kl"].detach())
    for n in glob:
        if not use_indexer and n in ("ikv", "ig", "ib", "iq", "w"):
            continue
        want = ref_t[n].grad
        if n in replicated:
            chk.close(f"d_{n} (summed over ranks)", None if loc[n].grad is None else _summed(loc[n].grad), want)
        else:
            chk.close(f"d_{n}", loc[n].grad, rows(want))


def case_zigzag_dense(chk, world, rank):
    """BSND zigzag dense warm-up: dense causal attention, dense indexer LSE and dense KL."""
    S, lens = ZIGZAG[world]
    B, H, D, Hi, Di = len(lens), 4, 32, 2, 16
    r = _gen(19)
    g_q, g_kv, g_iq, g_ik, g_w, g_up = r(B, S, H, D), r(B, S, D), r(B, S, Hi, Di), r(B, S, Di), r(B, S, Hi), r(B, S, H, D)
    valid = (torch.arange(S)[None, :] < torch.tensor(lens)[:, None])[..., None, None]
    g_up = g_up * valid
    scale = D ** -0.5
    lensd = dict(query_lengths=lens, key_lengths=lens, layout="BSND")
    q, kv, iq, ik, w = map(_leaf, (g_q, g_kv, g_iq, g_ik, g_w))
    out, mx, sm = dsa.dsa_sparse_attention(q, kv, None, scale=scale, **lensd)
    lse = dsa.dsa_dense_indexer_lse(iq, ik, w, **lensd)
    kl = dsa.dsa_dense_indexer_kl_loss(iq, ik, w, q, kv.unsqueeze(2), mx, sm, lse, scale=scale, **lensd)
    ((out * g_up).sum() + kl).backward()
    shard = cp.zigzag_shard(S, lens)
    rows = lambda t: cp.shard_rows(t, shard)  # noqa: E731
    q_l, kv_l, iq_l, ik_l, w_l = (_leaf(rows(t)) for t in (g_q, g_kv, g_iq, g_ik, g_w))
    kv_g, ik_g = cp.gather(kv_l, shard), cp.gather(ik_l, shard)
    out_l, mx_l, sm_l = cp.sparse_attention(q_l, kv_g, None, shard=shard, scale=scale)
    lse_l = cp.dense_indexer_lse(iq_l, ik_g, w_l, shard=shard)
    share = cp.dense_indexer_kl_loss(iq_l, ik_g, w_l, q_l, kv_g.unsqueeze(2), mx_l, sm_l, lse_l, shard=shard,
                                     scale=scale)
    ((out_l * rows(g_up)).sum() + share).backward()
    for n, a, b in (("out", out_l, out), ("softmax_max", mx_l, mx), ("softmax_sum", sm_l, sm),
                    ("indexer_lse", lse_l, lse)):
        chk.close(n, a, rows(b))
    chk.close("dense kl (sum of shares)", cp.loss_for_logging(share, shard), kl.detach())
    for n, a, b in (("d_query", q_l, q), ("d_kv", kv_l, kv), ("d_index_query", iq_l, iq), ("d_index_key", ik_l, ik),
                    ("d_weights", w_l, w)):
        chk.close(n, a.grad, rows(b.grad))


def case_mismatch(chk, world, rank):
    """Ranks passing different global lengths: a clear error on every rank."""
    ends = [4, 8 * world] if rank != world - 1 else [5, 8 * world]
    try:
        cp.tnd_shard(ends, 8)
    except ValueError as e:
        chk.true(f"error names doc_ends: {e}", "doc_ends" in str(e))
    else:
        chk.errors.append("tnd_shard accepted ranks with different doc_ends")
    try:
        cp.zigzag_shard(8 * world, [8 * world, rank])
    except ValueError as e:
        chk.true(f"error names lengths: {e}", "lengths" in str(e))
    else:
        chk.errors.append("zigzag_shard accepted ranks with different lengths")


def cases(world):
    """(name, function) for one world size; the names are the pytest ids."""
    out = []
    for cfg in CONFIGS[world]:
        out.append((f"v32_sparse_{cfg}", lambda c, w, r, cfg=cfg: case_v32_sparse(c, w, r, cfg, 0.7)))
        out.append((f"v32_dense_{cfg}", lambda c, w, r, cfg=cfg: case_v32_dense(c, w, r, cfg)))
        out.append((f"v4_csa_{cfg}", lambda c, w, r, cfg=cfg: case_v4(c, w, r, cfg, 4, True)))
        out.append((f"v4_hca8_{cfg}", lambda c, w, r, cfg=cfg: case_v4(c, w, r, cfg, 8, False)))
    out.append(("v32_sparse_bf16", case_v32_sparse_bf16))
    out.append(("v32_kl_coefficient0", lambda c, w, r: case_v32_sparse(c, w, r, "straddle", 0.0)))
    out.append(("v4_hca128_long", lambda c, w, r: case_v4(c, w, r, "long", 128, False)))
    out.append(("v4_sliding_fallback_ratio128", lambda c, w, r: case_v4(c, w, r, "straddle", 128, False)))
    out.append(("v4_fallback_decided_globally", case_v4_fallback))
    out.append(("tnd_zigzag_v32_sparse", lambda c, w, r: case_v32_sparse(c, w, r, "straddle", 0.7, "zigzag")))
    out.append(("tnd_zigzag_v32_dense", lambda c, w, r: case_v32_dense(c, w, r, "straddle", "zigzag")))
    out.append(("tnd_zigzag_v4_csa", lambda c, w, r: case_v4(c, w, r, "straddle", 4, True, "zigzag")))
    out.append(("tnd_zigzag_v4_hca8", lambda c, w, r: case_v4(c, w, r, "straddle", 8, False, "zigzag")))
    out.append(("bsnd_zigzag", case_zigzag))
    out.append(("bsnd_zigzag_dense", case_zigzag_dense))
    out.append(("bsnd_zigzag_v4_csa", lambda c, w, r: case_zigzag_v4(c, w, r, 4, True)))
    out.append(("bsnd_zigzag_v4_hca8", lambda c, w, r: case_zigzag_v4(c, w, r, 8, False)))
    out.append(("mismatched_lengths", case_mismatch))
    return out
