"""reshard.torch.reshard_many_ on many tensors against reshard_ on one tensor of the same bytes,
side by side in one run: the per-tensor cost of a whole-model refit from Python.

Four processes over gloo: 2 training ranks holding row shards (mesh=2 place=S(0), ranks 0..2)
-> 2 inference ranks holding column shards (mesh=2 place=S(1), ranks 2..4). ``--tensors`` bf16
tensors of ``--rows`` x 1024 (2 MiB each by default) through one ``reshard_many_`` call, and one
tensor of ``tensors * rows`` x 1024 through ``reshard_``: the same bytes, the same shape of
every region (half rows). Each timing runs from a barrier to the slowest rank's end; the two
calls alternate, and the median of each one's timed repetitions is reported. Every result is
verified. A third call moves the same tensors with every region staged on the receiver (the
program before large regions were received in place), for comparison.

    python python/bench/bench_many.py [--tensors 300] [--rows 1024] [--iters 5] [--torch-copies]

``--torch-copies`` packs with batched torch copies (the path of GPU tensors) instead of the
Rust packing program.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard
import reshard.torch as rt
from reshard.transfer import bucket

COLS = 1024
SRC_SPEC, DST_SPEC = "mesh=2 place=S(0)", "mesh=2 place=S(1)"
WORLD = 4


def numbered(layout, rank, salt):
    """This rank's shard of a global bf16 tensor whose element (r, c) holds the bits
    ``(r * cols + c + salt) mod 2^16``, made without the global tensor."""
    region = layout.local_region(rank)
    if region is None:
        return None
    (r0, c0), (rows, cols) = region
    r = torch.arange(r0, r0 + rows, dtype=torch.int64).unsqueeze(1)
    c = torch.arange(c0, c0 + cols, dtype=torch.int64).unsqueeze(0)
    bits = (r * layout.shape[1] + c + salt) % 65536
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def timed(fns, iters, warmup):
    """For each of ``fns``, the median over ``iters`` of the slowest rank's time, after
    ``warmup`` runs; the calls alternate, so that the load of a shared machine falls on all
    alike."""
    times = [[] for _ in fns]
    for i in range(warmup + iters):
        for fn, out in zip(fns, times):
            dist.barrier()
            started = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                out.append(elapsed.item())
    return [statistics.median(t) for t in times]


def verified(pairs, salts, rank):
    """Whether every destination shard holds its numbering, on every rank."""
    same = True
    for (_, dst, _, dst_layout), salt in zip(pairs, salts):
        if dst is not None:
            want = numbered(dst_layout, rank, salt)
            same = same and torch.equal(dst.view(torch.int16), want.view(torch.int16))
            dst.zero_()
    ok = torch.tensor([1 if same else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def worker(rank, port, args, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    if args.torch_copies:
        rt._NATIVE = False

    def tensor(shape, salt):
        src = reshard.Layout.from_spec(SRC_SPEC, shape, "bf16")
        dst = reshard.Layout.from_spec(DST_SPEC, shape, "bf16", first_rank=2)
        shard = dst.local_shape(rank)
        mine = None if shard is None else torch.empty(shard, dtype=torch.bfloat16)
        return (numbered(src, rank, salt), mine, src, dst)

    many = {f"layers.{i}.weight": tensor((args.rows, COLS), i) for i in range(args.tensors)}
    one = tensor((args.tensors * args.rows, COLS), 0)
    # the same tensors under other names, whose program (built by this first call) stages
    # every region on the receiver: how it was before regions were received in place
    staged = {f"staged.{i}.weight": many[f"layers.{i}.weight"] for i in range(args.tensors)}
    in_place_bytes = bucket.IN_PLACE_BYTES
    bucket.IN_PLACE_BYTES = float("inf")
    rt.reshard_many_(staged)
    bucket.IN_PLACE_BYTES = in_place_bytes
    calls = [lambda: rt.reshard_many_(many), lambda: rt.reshard_many_(staged), lambda: rt.reshard_(*one)]
    results = dict(zip(("many", "staged", "one"), timed(calls, args.iters, args.warmup)))
    results["many_verified"] = verified(list(many.values()), range(args.tensors), rank)
    rt.reshard_many_(staged)
    results["staged_verified"] = verified(list(staged.values()), range(args.tensors), rank)
    results["one_verified"] = verified([one], [0], rank)
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--rows", type=int, default=1024, help="rows of 1024 bf16 per tensor")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--torch-copies", action="store_true", help="pack with torch copies")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(port, args, queue), nprocs=WORLD)
    r = queue.get()
    each = args.rows * COLS * 2
    total = each * args.tensors
    packing = "torch copies" if args.torch_copies else "Rust packing"
    print(
        f"{args.tensors} x {each / 2**20:g} MiB bf16 vs 1 x {total / 2**20:g} MiB, "
        f"{SRC_SPEC} -> {DST_SPEC} (ranks 2..4), gloo, {packing}, median of {args.iters}"
    )
    print(f"{'call':<44} {'median s':>9} {'GB/s':>6} {'vs one tensor':>14} verified")
    rows = [
        (f"reshard_many_, {args.tensors} tensors", r["many"], r["many_verified"]),
        (f"reshard_many_, {args.tensors} tensors, all staged", r["staged"], r["staged_verified"]),
        ("reshard_, one tensor", r["one"], r["one_verified"]),
    ]
    for name, seconds, ok in rows:
        print(f"{name:<44} {seconds:>9.3f} {total / seconds / 1e9:>6.2f} {seconds / r['one']:>13.2f}x {ok}")


if __name__ == "__main__":
    main()
