"""dsa.cp shard metadata against a brute-force token labelling (no processes)."""
import random

import pytest
import torch

import dsa.cp as cp
from dsa.cp.shard import TNDShard, ZigzagShard, ZigzagTNDShard


def _random_case(rng, world, ratio):
    """Document lengths with empty and 1-token documents, a document over every rank, and
    boundaries on and off block edges; offsets even or uneven (0-row ranks included)."""
    docs = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        if kind < 0.15:
            docs.append(0)
        elif kind < 0.3:
            docs.append(1)
        elif kind < 0.5:
            docs.append(ratio * rng.randint(1, 3))          # block-aligned length
        else:
            docs.append(rng.randint(2, 3 * ratio + 5))
    if rng.random() < 0.4:
        docs.insert(rng.randrange(len(docs) + 1), world * ratio * 2 + rng.randint(0, ratio))  # spans every rank
    total = sum(docs)
    if total == 0:
        docs.append(ratio + 1)
        total = sum(docs)
    mode = rng.random()
    if mode < 0.3 and total % world == 0:
        cuts = [total // world * r for r in range(1, world)]
    elif mode < 0.5:
        # cuts on block edges of the stream
        cuts = sorted(min(total, ratio * rng.randint(0, total // ratio + 1)) for _ in range(world - 1))
    else:
        cuts = sorted(rng.randint(0, total) for _ in range(world - 1))
    ends, acc = [], 0
    for n in docs:
        acc += n
        ends.append(acc)
    return ends, [0] + cuts + [total]


def _labels(ends):
    doc, pos, start = [], [], 0
    for i, e in enumerate(ends):
        doc += [i] * (e - start)
        pos += list(range(e - start))
        start = e
    return doc, pos


def _entries(ends, ratio):
    """Global compressed entries (doc, w, first row, last row) in global order."""
    out, start = [], 0
    for i, e in enumerate(ends):
        for w in range((e - start) // ratio):
            out.append((i, w, start + w * ratio, start + (w + 1) * ratio - 1))
        start = e
    return out


def _check_shard(ends, offsets, ratio):
    world = len(offsets) - 1
    doc, pos = _labels(ends)
    entries = _entries(ends, ratio)
    owned_all = []
    for r in range(world):
        s = TNDShard(r, world, ends, offsets)
        o, e = offsets[r], offsets[r + 1]
        nd = len(ends)
        q = [sum(1 for t in range(o, e) if doc[t] == i) for i in range(nd)]
        p = [sum(1 for t in range(0, e) if doc[t] == i) for i in range(nd)]
        cum = lambda xs: [sum(xs[:k + 1]) for k in range(len(xs))]  # noqa: E731
        assert s.query_lengths == cum(q)
        assert s.key_lengths == cum(p)
        assert s.kv_rows == e and s.local_rows == e - o
        assert [t for a, b in s.runs for t in range(a, b)] == list(range(o, e))
        assert s.positions().tolist() == pos[o:e]
        # bottom-right alignment reproduces each local query's document position
        starts_q = [0] + cum(q)[:-1]
        for i in range(nd):
            for k in range(q[i]):
                assert p[i] - q[i] + k == pos[o + starts_q[i] + k]
        # prefix compressed rows: entries whose block ends before E_r; per document P_i // m
        assert s.cmp_rows(ratio) == sum(1 for en in entries if en[3] < e) == sum(n // ratio for n in p)
        assert s.cmp_total(ratio) == len(entries)
        assert s.cmp_ends(ratio)[-1] == len(entries)
        assert s.cmp_positions(ratio).tolist() == [w * ratio for (_, w, _, _) in entries]
        owned = [en for en in entries if o <= en[3] < e]
        assert s.owned_cmp_counts(ratio)[r] == len(owned)
        owned_all += owned
        for overlap in ((True, False) if ratio == 4 else (False, True)):
            plan = s.compressor_plan(ratio, overlap)
            assert plan.owned == len(owned)
            halo = o - plan.halo_start
            assert 0 <= halo <= (2 * ratio - 1 if overlap else ratio - 1)
            # halo rows lie in the last max_halo rows of earlier ranks
            for g in range(plan.halo_start, o):
                q_rank = max(k for k in range(world) if offsets[k] <= g and offsets[k] < offsets[k + 1])
                assert q_rank < r and offsets[q_rank + 1] - g <= plan.max_halo
            # blocks the local call forms, per segment, after dropping `drop`
            made, a = [], plan.halo_start
            prev = 0
            for end in plan.segment_ends:
                seg_start, seg_end = plan.halo_start + prev, plan.halo_start + end
                assert len({doc[t] for t in range(seg_start, seg_end)}) <= 1  # one document per segment
                for k in range((seg_end - seg_start) // ratio):
                    first = seg_start + k * ratio
                    made.append((doc[first], pos[first] // ratio, first, first + ratio - 1, k))
                prev = end
            assert plan.halo_start + (plan.segment_ends[-1] if plan.segment_ends else 0) == (e if e > o else plan.halo_start)
            kept = made[plan.drop:]
            assert [m[:4] for m in kept] == owned
            if overlap:
                # every owned entry with a previous block has it inside its segment (not the
                # first of its segment), so the overlap half is computed from real rows
                for m in kept:
                    assert (m[1] == 0) == (m[4] == 0)
    assert owned_all == entries  # rank-order concatenation == global order


@pytest.mark.parametrize("ratio", [4, 8, 128])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_tnd_shard_brute_force(world, ratio):
    rng = random.Random(1000 * world + ratio)
    for _ in range(70 if ratio < 128 else 25):
        ends, offsets = _random_case(rng, world, ratio)
        _check_shard(ends, offsets, ratio)


def _check_zigzag_tnd(ends, world, ratio):
    """Every rank's runs, op calls and positions against the token labelling: the runs of
    all ranks partition the stream into chunks k*T//2W; each call's lengths put every
    local query at its document position (bottom-right alignment over the call's key
    prefix); the gather's natural index undoes the rank-major order."""
    doc, pos = _labels(ends)
    total, nd = ends[-1], len(ends)
    bounds = [k * total // (2 * world) for k in range(2 * world + 1)]
    seen, rank_major = [], []
    for r in range(world):
        s = ZigzagTNDShard(r, world, ends)
        chunks = [(bounds[k], bounds[k + 1]) for k in (r, 2 * world - 1 - r)]
        rows = [t for a, e in chunks for t in range(a, e)]
        assert [t for a, e in s.runs for t in range(a, e)] == rows
        assert s.local_rows == len(rows) == s.local_counts[r]
        assert s.rows_of(torch.arange(total)).tolist() == rows
        assert s.positions().tolist() == [pos[t] for t in rows]
        seen += rows
        rank_major += rows
        local = 0
        for call, (a, e) in zip(s.op_calls(), s.runs):
            assert call.query_slice == slice(local, local + e - a) and call.key_end == e
            q = [sum(1 for t in range(a, e) if doc[t] == i) for i in range(nd)]
            p = [sum(1 for t in range(0, e) if doc[t] == i) for i in range(nd)]
            cum = lambda xs: [sum(xs[:k + 1]) for k in range(len(xs))]  # noqa: E731
            assert call.query_lengths == cum(q) and call.key_lengths == cum(p)
            starts_q = [0] + cum(q)[:-1]
            for i in range(nd):
                for k in range(q[i]):
                    assert p[i] - q[i] + k == pos[a + starts_q[i] + k]
            # the compressed prefix the call reads: entries whose block ends before e
            assert s.call_keys(torch.zeros(s.cmp_total(ratio), 1), call, ratio).shape[0] == sum(
                1 for en in _entries(ends, ratio) if en[3] < e)
            assert s.call_keys(torch.zeros(total, 1), call).shape[0] == e
            local += e - a
        assert s.key_rows(1) == (total, max(e for _, e in s.runs))
    assert sorted(seen) == list(range(total))
    gathered = torch.tensor(rank_major)
    assert gathered.index_select(0, ZigzagTNDShard(0, world, ends)._natural_index).tolist() == list(range(total))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_tnd_brute_force(world):
    rng = random.Random(77 + world)
    checked = 0
    while checked < 60:
        ends, _ = _random_case(rng, world, 4)
        if ends[-1] < 2 * world:
            continue
        _check_zigzag_tnd(ends, world, rng.choice([4, 8, 128]))
        checked += 1
    # rank W-1's two chunks touch: one run
    assert ZigzagTNDShard(1, 2, [40]).runs == [(10, 30)] and ZigzagTNDShard(0, 2, [40]).runs == [(0, 10), (30, 40)]


def test_worked_example():
    s1 = TNDShard(1, 2, [5, 12, 16], [0, 8, 16])
    assert s1.query_lengths == [0, 4, 8] and s1.key_lengths == [5, 12, 16] and s1.cmp_rows(4) == 3
    s0 = TNDShard(0, 2, [5, 12, 16], [0, 8, 16])
    assert s0.query_lengths == [5, 8, 8] and s0.key_lengths == [5, 8, 8] and s0.cmp_rows(4) == 1
    p = TNDShard(1, 2, [300, 800, 1024], [0, 512, 1024]).compressor_plan(128, False)
    assert (p.halo_start, p.segment_ends, p.owned, p.owned_counts) == (428, (372, 596), 3, (3, 3))


def test_edge_cases():
    # a rank with no rows, and one holding only an empty document's end
    s = TNDShard(1, 3, [0, 4, 4, 9], [0, 4, 4, 9])
    assert s.local_rows == 0 and s.query_lengths == [0, 0, 0, 0] and s.key_lengths == [0, 4, 4, 4]
    _check_shard([0, 4, 4, 9], [0, 4, 4, 9], 4)
    _check_shard([1, 2, 3], [0, 1, 2, 3], 4)       # 1-token documents, no compressed entry
    _check_shard([40], [0, 3, 5, 40], 4)           # tiny shards: halos from several ranks


def test_zigzag_tnd_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="at least 4 tokens"):
        ZigzagTNDShard(0, 2, [3])
    with pytest.raises(ValueError, match="rank"):
        ZigzagTNDShard(2, 2, [8])
    with pytest.raises(ValueError, match="doc_ends"):
        ZigzagTNDShard(0, 2, [8, 5])


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="doc_ends"):
        TNDShard(0, 2, [5, 12], [0, 8, 16])
    with pytest.raises(ValueError, match="offsets"):
        TNDShard(0, 2, [16], [0, 9, 8, 16])
    with pytest.raises(ValueError, match="doc_ends"):
        TNDShard(0, 2, [5, 3, 16], [0, 8, 16])
    with pytest.raises(ValueError, match="rank"):
        TNDShard(2, 2, [16], [0, 8, 16])
    with pytest.raises(ValueError, match="ring_degree"):
        cp.tnd_shard([16], 8, ring_degree=2)
    with pytest.raises(ValueError, match="ring_degree"):
        cp.zigzag_shard(16, [16], ring_degree=4)
    with pytest.raises(ValueError, match="seq_len"):
        ZigzagShard(0, 2, 18, (18,))
    with pytest.raises(ValueError, match="lengths"):
        ZigzagShard(0, 2, 16, (17,))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_brute_force(world):
    rng = random.Random(world)
    for _ in range(30):
        c = rng.randint(1, 5)
        S = 2 * world * c
        lens = [rng.randint(0, S) for _ in range(rng.randint(1, 3))]
        seen = []
        for r in range(world):
            z = ZigzagShard(r, world, S, tuple(lens))
            local = z.local_index().tolist()
            seen += local
            for call in z.calls:
                rows = local[call.query_slice]
                assert rows == list(range(call.chunk * c, (call.chunk + 1) * c))
                for b, L in enumerate(lens):
                    lq = sum(1 for t in rows if t < L)
                    lk = sum(1 for t in range(S) if t < L and t < (call.chunk + 1) * c)
                    assert call.query_lengths[b] == lq and call.key_lengths[b] == lk
                    if lq:
                        assert lk - lq == call.chunk * c   # bottom-right = chunk start
        assert sorted(seen) == list(range(S))
        # the gathered (rank-major) chunk order, read through gathered_order, is natural
        order = ZigzagShard(0, world, S, tuple(lens)).gathered_order()
        assert sorted(order) == list(range(2 * world)) and order == [k for r in range(world) for k in (r, 2 * world - 1 - r)]


def test_wrappers_reject_local_key_tensors():
    # Checked before any collective, so no process group is needed: a key-side tensor that
    # is not the gathered stream (the "local KV passed as the prefix" mistake) is an error.
    shard = TNDShard(0, 2, [5, 16], [0, 8, 16])
    q, kv_local = torch.randn(8, 2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="kv: expected the gathered tensor"):
        cp.sparse_attention(q, kv_local, None, shard=shard, scale=0.25)
    with pytest.raises(ValueError, match="index_key: expected the gathered tensor"):
        cp.indexer(torch.randn(8, 2, 4), torch.randn(8, 4), torch.randn(8, 2), shard=shard, topk=2)
    with pytest.raises(ValueError, match="cmp_kv: expected the gathered tensor"):
        cp.sparse_attention(q, torch.randn(16, 16), None, shard=shard, scale=0.25, window=4,
                            cmp_kv=torch.randn(2, 16), cmp_ratio=4)
