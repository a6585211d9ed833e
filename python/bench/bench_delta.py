"""A delta refit (reshard.torch.DeltaSession) against a dense one (reshard_many_), over gloo,
at several change densities: bytes on the wire and time per refit.

Four processes: 2 training ranks hold f32 master weights in row shards (mesh=2 place=S(0),
ranks 0..2), 2 inference ranks bf16 buffers in column shards (mesh=2 place=S(1), ranks 2..4);
the wire carries bf16. ``--tensors`` tensors of ``--rows`` x 1024. Every version changes a
share ``density`` of the elements by one bf16 ulp (through the f32 masters); each timed
refit runs from a barrier to the slowest rank's end, dense and delta alternating on the same
version, and the median over ``--iters`` versions is reported. Every destination shard is
compared with the dense result after each delta refit.

    python python/bench/bench_delta.py [--tensors 16] [--rows 1024] [--iters 5] [--densities 0.01,0.1,1]
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

COLS = 1024
WORLD = 4


def slowest(started: float) -> float:
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def total(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def worker(rank, port, args, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    shape = (args.rows, COLS)
    src = reshard.Layout(shape, "f32", mesh=2, ranks=[0, 1], placements=["S(0)"])
    dst = reshard.Layout(shape, "bf16", mesh=2, ranks=[2, 3], placements=["S(1)"])
    gen = torch.Generator().manual_seed(rank)
    names = [f"layers.{i}.weight" for i in range(args.tensors)]
    masters = {n: torch.randn(src.local_shape(rank), generator=gen) for n in names} if rank < 2 else {}
    shard = dst.local_shape(rank)
    dense_out = {n: torch.empty(shard, dtype=torch.bfloat16) for n in names} if rank >= 2 else {}
    delta_out = {n: torch.empty(shard, dtype=torch.bfloat16) for n in names} if rank >= 2 else {}

    def pairs(outs):
        return {n: (masters.get(n), outs.get(n), src, dst) for n in names}

    results = {}
    for density in args.densities:
        session = rt.DeltaSession()
        rt.reshard_many_(pairs(dense_out))
        session.refit(pairs(delta_out))  # the first refit is dense
        dense_times, delta_times, sent, dense_bytes, exact = [], [], 0, 0, True
        for _ in range(args.iters):
            for m in masters.values():
                chosen = torch.rand(m.shape, generator=gen) < density
                wire = m.to(torch.bfloat16)
                wire.view(torch.int16)[chosen] += 1
                m.copy_(wire.to(torch.float32))
            dist.barrier()
            started = time.perf_counter()
            rt.reshard_many_(pairs(dense_out))
            dense_times.append(slowest(started))
            dist.barrier()
            started = time.perf_counter()
            report = session.refit(pairs(delta_out))
            delta_times.append(slowest(started))
            sent += total(report.bytes_sent)
            dense_bytes += total(report.bytes_dense)
            for n in delta_out:
                exact = exact and torch.equal(delta_out[n].view(torch.int16), dense_out[n].view(torch.int16))
        ok = torch.tensor([int(exact)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        results[density] = dict(
            dense=statistics.median(dense_times),
            delta=statistics.median(delta_times),
            sent=sent / args.iters,
            dense_bytes=dense_bytes / args.iters,
            exact=bool(ok.item()),
            base=total(session.base_bytes),
        )
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1024, help="rows of 1024 elements per tensor")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--densities", default="0.01,0.1,1", help="shares of changed elements, by commas")
    args = parser.parse_args()
    args.densities = [float(d) for d in args.densities.split(",")]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(port, args, queue), nprocs=WORLD)
    results = queue.get()
    wire = args.tensors * args.rows * COLS * 2
    print(
        f"{args.tensors} x {args.rows}x{COLS} f32 masters (S(0), ranks 0..2) -> bf16 (S(1), ranks 2..4), "
        f"{wire / 2**20:g} MiB of bf16 a refit, gloo, median of {args.iters} versions"
    )
    print(
        f"{'density':>8} {'dense s':>8} {'delta s':>8} {'delta/dense':>11} {'MiB sent':>9} "
        f"{'of dense':>9} {'base MiB':>9} exact"
    )
    for density, r in results.items():
        print(
            f"{density:>8g} {r['dense']:>8.3f} {r['delta']:>8.3f} {r['delta'] / r['dense']:>10.2f}x "
            f"{r['sent'] / 2**20:>9.2f} {r['sent'] / r['dense_bytes']:>8.1%} "
            f"{r['base'] / 2**20:>9.1f} {r['exact']}"
        )


if __name__ == "__main__":
    main()
