"""The runtime's per-rank program as the torch executor takes it (``reshard.rank_program``):
on random layouts (uneven shards, several shard axes, overlapping rank sets) and several
tensors at once, both ends of every message agree on it region by region (what the sender
packs where is what the receiver unpacks from there), the regions are the plan's transfers,
aligned and apart inside their message, and every destination shard is tiled exactly once."""

import random

import reshard
from conftest import random_mesh, random_placements, random_shape


def volume(dims):
    n = 1
    for d in dims:
        n *= d
    return n


def random_pair(rng):
    shape = random_shape(rng, max_dim=11)
    dtype = rng.choice(["u8", "bf16", "f32", "f64"])
    smesh, dmesh = random_mesh(rng), random_mesh(rng)
    src = reshard.Layout(shape, dtype, smesh, None, random_placements(rng, len(smesh), len(shape)))
    n = volume(dmesh)
    ranks = rng.sample(range(n + len(src.ranks)), n)  # disjoint, overlapping or colocated
    dst = reshard.Layout(shape, dtype, dmesh, ranks, random_placements(rng, len(dmesh), len(shape)))
    return src, dst


def test_both_ends_of_every_message_agree_and_tile_each_destination():
    rng = random.Random(28)
    for _ in range(120):
        pairs = [random_pair(rng) for _ in range(rng.randint(1, 4))]
        ranks = sorted({r for s, d in pairs for r in (*s.ranks, *d.ranks)})
        programs = {r: reshard.rank_program(pairs, r) for r in ranks}
        for r, (sends, recvs, _) in programs.items():
            for peer, nbytes, pieces in sends:
                theirs = {p: (n, ps) for p, n, ps in programs[peer][1]}
                # the receiver's message from r, region by region, at the same bytes
                assert theirs[r][0] == nbytes
                mine = [(j, ext, off, at, n) for j, _, ext, off, at, n in pieces]
                other = [(j, ext, off, at, n) for j, _, ext, off, at, n in theirs[r][1]]
                assert mine == other, (r, peer)
            for peer, nbytes, pieces in recvs:
                assert any(p == r for p, _, _ in programs[peer][0]), (r, peer)
                end = 0
                for j, local, extent, offset, at, n in pieces:
                    assert at % 16 == 0 and at >= end
                    elem = pairs[j][1].elem_bytes
                    assert n == volume(extent) * elem
                    end = at + n
                    box = pairs[j][1].local_region(r)
                    assert [o - b for o, b in zip(offset, box[0])] == list(local)
                assert end == nbytes
        # every destination shard tiled exactly once, by messages and local copies together
        for j, (_, dst) in enumerate(pairs):
            for r in dst.ranks:
                box = dst.local_region(r)
                if box is None or volume(box[1]) == 0:
                    continue
                seen = {}
                _, recvs, locals_ = programs[r]
                regions = [(local, ext) for _, _, ps in recvs for (t, local, ext, _, _, _) in ps if t == j]
                regions += [(d_at, ext) for t, _, d_at, ext in locals_ if t == j]
                for local, ext in regions:
                    for idx in _cells(local, ext):
                        seen[idx] = seen.get(idx, 0) + 1
                assert len(seen) == volume(box[1]) and set(seen.values()) == {1}, (j, r)
        # and the regions are the plan's transfers
        for j, (src, dst) in enumerate(pairs):
            plan = reshard.plan(src, dst)
            want = sorted((t.src, t.dst, tuple(t.offset), tuple(t.extent)) for t in plan.transfers)
            got = []
            for r, (sends, _, locals_) in programs.items():
                for peer, _, ps in sends:
                    got += [(r, peer, tuple(off), tuple(ext)) for t, _, ext, off, _, _ in ps if t == j]
                box = src.local_region(r)
                for t, s_at, _, ext in locals_:
                    if t == j:
                        off = tuple(a + b for a, b in zip(s_at, box[0]))
                        got.append((r, r, off, tuple(ext)))
            assert sorted(got) == want, j


def _cells(offset, extent):
    cells = [()]
    for o, n in zip(offset, extent):
        cells = [c + (i,) for c in cells for i in range(o, o + n)]
    return cells


def test_quantized_messages_agree_on_both_ends_and_are_the_plans_transfers():
    # a reshard into fp8 runs the runtime's program too (QuantPacking: its amax phase, then
    # values and scales by peer): what a sender packs where is what its receiver unpacks
    from test_quant import random_cases

    cases = random_cases(29, 60, 4)
    assert len(cases) >= 20
    for _, _, _, scheme, src, dst, _ in cases:
        ranks = sorted(set(src.ranks) | set(dst.ranks))
        packs = {r: reshard._core.QuantPacking(src, dst, r, scheme) for r in ranks}
        got = []
        for r, p in packs.items():
            for peer, nbytes, values, scales in p.messages("sends"):
                theirs = {m[0]: m[1:] for m in packs[peer].messages("recvs")}
                assert theirs[r] == (nbytes, values, scales), (scheme, r, peer)
                got += [(s, d, tuple(off), tuple(ext)) for _, s, d, off, ext in values]
            for _, _, values, _ in p.messages("local"):
                got += [(s, d, tuple(off), tuple(ext)) for _, s, d, off, ext in values]
            # the partial amax: one exchange each way per peer that shares a block
            for peer, offset, extent in p.amax_blocks:
                assert (r, offset, extent) in packs[peer].amax_blocks, (scheme, r, peer)
            # every scale of a destination's scale shard arrives exactly once
            if p.scale_shape is not None:
                seen = {}
                for which in ("recvs", "local"):
                    for _, _, _, scales in p.messages(which):
                        for _, offset, extent in scales:
                            for cell in _cells(offset, extent):
                                seen[cell] = seen.get(cell, 0) + 1
                assert set(seen) == set(_cells(p.scale_offset, p.scale_shape)), (scheme, r)
                assert set(seen.values()) <= {1}, (scheme, r)
        # the values move as a plain reshard into the same layout in the source's dtype would
        same = reshard.Layout(dst.shape, src.dtype, dst.mesh, dst.ranks, dst.placements)
        transfers = reshard.plan(src, same).transfers
        want = sorted((t.src, t.dst, tuple(t.offset), tuple(t.extent)) for t in transfers)
        assert sorted(got) == want, scheme
