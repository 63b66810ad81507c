"""Per-rank attention work under context parallelism, contiguous against zigzag split.

    python tools/cp_balance.py [--tokens 16384] [--world 2] [--json build/cp_balance.json]

One document of ``--tokens`` tokens over ``--world`` gloo ranks (spawned processes, one
thread each). For each split (``dsa.cp.tnd_shard`` contiguous, ``dsa.cp.zigzag_tnd_shard``)
every rank runs, on its rows, the two ops whose work grows with the keys a row sees:
the lightning indexer (scores every visible key, then top-k) and the dense causal
attention of the warm-up stage, each forward + backward for the attention, forward for
the indexer. It reports each rank's visible (query, key) pairs and its measured time,
and the spread (max / min - 1) over the ranks. Causal work is what a contiguous split
leaves unbalanced: the last rank's rows see the most keys.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

SPLITS = ("contiguous", "zigzag")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, tokens, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import dsa.cp as cp

    # Index heads of DeepSeek-V3.2's size (128) at a quarter of its count (64), and a
    # small dense attention (4 heads of 192 / 128): enough work to time, small enough for
    # two cores. The split decides the work per rank, not the head sizes.
    hi, di, heads, dim, dv, topk = 16, 128, 4, 192, 128, 2048
    g = torch.Generator().manual_seed(3)
    results = {}
    # The first pass warms up (lazy initialisation, first-touch page faults); the second is timed.
    for split in ("contiguous",) + SPLITS:
        ends = [tokens]
        shard = (cp.zigzag_tnd_shard(ends) if split == "zigzag"
                 else cp.tnd_shard(ends, (rank + 1) * tokens // world - rank * tokens // world))
        rows = lambda t: cp.shard_rows(t, shard)  # noqa: E731
        iq = rows(torch.randn(tokens, hi, di, generator=g)).bfloat16()
        ik = cp.gather(rows(torch.randn(tokens, di, generator=g)).bfloat16(), shard)
        w = rows(torch.randn(tokens, hi, generator=g)).bfloat16()
        q = rows(torch.randn(tokens, heads, dim, generator=g)).bfloat16().requires_grad_()
        kv_local = rows(torch.randn(tokens, dim, generator=g)).bfloat16()
        pos = shard.positions()
        pairs = int((pos + 1).sum())  # one document: row p sees p + 1 keys
        dist.barrier()
        t0 = time.perf_counter()
        cp.indexer(iq, ik, w, shard=shard, topk=topk)
        t_indexer = time.perf_counter() - t0
        # A leaf: the backward below then runs no collective, so each rank's time is its own.
        kv = cp.gather(kv_local, shard).detach().requires_grad_()
        dist.barrier()
        t0 = time.perf_counter()
        out, _, _ = cp.sparse_attention(q, kv, None, shard=shard, scale=dim ** -0.5, d_v=dv)
        out.float().sum().backward()
        t_attention = time.perf_counter() - t0
        results[split] = {"rows": shard.local_rows, "pairs": pairs, "indexer_s": t_indexer,
                          "attention_s": t_attention}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.world < 2 or args.tokens < 2 * args.world:
        print("--world must be >= 2 and --tokens >= 2 * world", file=sys.stderr)
        return 2
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(args.world, _free_port(), args.tokens, out_dir), nprocs=args.world, join=True)
        ranks = []
        for r in range(args.world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    print(f"one document of {args.tokens} tokens over {args.world} ranks (one thread each)\n")
    print("| split | rank | rows | visible pairs | indexer fwd s | dense attention fwd+bwd s |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for split in SPLITS:
        for r, res in enumerate(ranks):
            x = res[split]
            print(f"| {split} | {r} | {x['rows']} | {x['pairs']:,} | {x['indexer_s']:.2f} | {x['attention_s']:.2f} |")
        spread = {k: max(res[split][k] for res in ranks) / max(min(res[split][k] for res in ranks), 1e-9) - 1
                  for k in ("pairs", "indexer_s", "attention_s")}
        summary[split] = spread
    print()
    for split, spread in summary.items():
        print(f"{split}: spread over ranks (max / min - 1): pairs {spread['pairs']:.1%}, "
              f"indexer {spread['indexer_s']:.1%}, attention {spread['attention_s']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "world": args.world, "ranks": ranks, "spread": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
