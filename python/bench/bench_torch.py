"""reshard.torch.reshard_ against a hand-written gather+broadcast with torch.distributed and
against the native reshard transports, on the same layouts and the same machine.

Six processes; an 8192x8192 bf16 tensor (128 MiB); 4 x Shard(0) on ranks 0..4 -> 2 x Shard(1)
on ranks 4..6. Each torch timing runs from a barrier to the slowest rank's end; the median of
the timed repetitions is reported, with GB/s of destination data. Results are verified.

    python python/bench/bench_torch.py [--iters 5] [--reshard target/release/reshard]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard
import reshard.torch as rt

SHAPE = (8192, 8192)
SRC_SPEC, DST_SPEC = "mesh=4 place=S(0)", "mesh=2 place=S(1)"
WORLD = 6


def numbered(shape):
    n = shape[0] * shape[1]
    return (
        (torch.arange(n, dtype=torch.int64) % 65536)
        .to(torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        .reshape(shape)
    )


def timed(fn, iters, warmup):
    """Median over ``iters`` of the slowest rank's time for ``fn``, after ``warmup`` runs."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        started = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    return statistics.median(times)


def worker(rank, port, iters, warmup, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    src = reshard.Layout.from_spec(SRC_SPEC, SHAPE, "bf16")
    dst = reshard.Layout.from_spec(DST_SPEC, SHAPE, "bf16", first_rank=4)
    full = numbered(SHAPE)
    mine = rt.local_tensor(src, rank, full)
    mine = None if mine is None else mine.clone()
    want = rt.local_tensor(dst, rank, full)
    shard = None if want is None else torch.empty(want.shape, dtype=torch.bfloat16)
    del full

    def run_reshard():
        rt.reshard_(mine, shard, src, dst)

    # gather+broadcast: all-gather the rows among the training ranks, broadcast the whole
    # tensor from rank 0 to the inference ranks, which keep their columns
    train = dist.new_group([0, 1, 2, 3])
    fanout = dist.new_group([0, 4, 5])
    whole = torch.empty(SHAPE, dtype=torch.bfloat16)

    def run_gather_broadcast():
        if rank < 4:
            dist.all_gather(list(whole.chunk(4, dim=0)), mine, group=train)
        if rank in (0, 4, 5):
            dist.broadcast(whole, src=0, group=fanout)
        if shard is not None:
            offset, extent = dst.local_region(rank)
            shard.copy_(whole[:, offset[1] : offset[1] + extent[1]])

    results = {}
    for name, fn in [("reshard_", run_reshard), ("gather_broadcast", run_gather_broadcast)]:
        results[name] = timed(fn, iters, warmup)
        # bit patterns, not values: the numbering holds NaNs as bf16
        same = shard is None or torch.equal(shard.view(torch.int16), want.view(torch.int16))
        ok = torch.tensor([1 if same else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        results[name + "_verified"] = bool(ok.item())
        if shard is not None:
            shard.zero_()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def native(binary, transport, iters, warmup):
    args = [
        binary,
        "launch",
        "--nproc",
        str(WORLD),
        "--",
        "run",
        "--shape",
        "8192,8192",
        "--dtype",
        "bf16",
        "--src",
        SRC_SPEC,
        "--dst",
        DST_SPEC,
        "--transport",
        transport,
        "--verify",
        "--json",
        "--iters",
        str(iters),
        "--warmup",
        str(warmup),
    ]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reshard", default="target/release/reshard", help="the reshard binary")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(port, args.iters, args.warmup, queue), nprocs=WORLD)
    results = queue.get()
    rows = [
        ("reshard.torch.reshard_ (gloo)", results["reshard_"], results["reshard__verified"]),
        ("gather+broadcast (gloo)", results["gather_broadcast"], results["gather_broadcast_verified"]),
    ]
    for transport in ("tcp", "shm"):
        rows.append(
            (
                f"reshard CLI --transport {transport}",
                native(args.reshard, transport, args.iters, args.warmup),
                True,
            )
        )
    dst_bytes = SHAPE[0] * SHAPE[1] * 2
    base = results["reshard_"]
    print(f"8192x8192 bf16, {SRC_SPEC} -> {DST_SPEC}, 6 processes, median of {args.iters}")
    print(f"{'method':<34} {'median ms':>10} {'GB/s':>7} {'speed vs reshard_':>18} verified")
    for name, seconds, verified in rows:
        gbps = dst_bytes / seconds / 1e9
        print(f"{name:<34} {seconds * 1e3:>10.1f} {gbps:>7.2f} {base / seconds:>17.2f}x {verified}")


if __name__ == "__main__":
    main()
