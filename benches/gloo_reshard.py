"""PyTorch's own point-to-point reshard over gloo, the baseline of BENCHMARKS.md.

Six processes; the source ranks hold torch.chunk row or column shards of an 8192x8192 bf16
tensor, the destination ranks receive theirs. Every overlap moves with
torch.distributed.batch_isend_irecv: packed by .contiguous() on the sender, copied into place
on the receiver, as a PyTorch user writes it. Prints the median over the timed repetitions.

    python3 benches/gloo_reshard.py --src 4 --src-dim 0 --dst 2 --dst-dim 1
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 8192


def chunk(n, k, i):
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def box(parts, dim, i):
    b = [(0, N), (0, N)]
    b[dim] = chunk(N, parts, i)
    return b


def filled(b):
    rows = torch.arange(b[0][0], b[0][1], dtype=torch.int64)[:, None]
    cols = torch.arange(b[1][0], b[1][1], dtype=torch.int64)[None, :]
    return ((rows * N + cols) % 65536).to(torch.int32).to(torch.int16).view(torch.bfloat16)


def overlap(a, b):
    lo = [max(a[d][0], b[d][0]) for d in range(2)]
    hi = [min(a[d][1], b[d][1]) for d in range(2)]
    return None if any(h <= l for l, h in zip(lo, hi)) else list(zip(lo, hi))


def local(region, holder):
    return tuple(slice(r[0] - h[0], r[1] - h[0]) for r, h in zip(region, holder))


def worker(rank, args, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    world = args.src + args.dst
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    src_boxes = [box(args.src, args.src_dim, i) for i in range(args.src)]
    dst_boxes = [box(args.dst, args.dst_dim, i) for i in range(args.dst)]
    mine_src = src_boxes[rank] if rank < args.src else None
    mine_dst = dst_boxes[rank - args.src] if rank >= args.src else None
    source = filled(mine_src) if mine_src else None
    shard = (
        torch.empty((mine_dst[0][1] - mine_dst[0][0], mine_dst[1][1] - mine_dst[1][0]), dtype=torch.bfloat16)
        if mine_dst
        else None
    )
    times = []
    for it in range(args.warmup + args.iters):
        dist.barrier()
        started = time.perf_counter()
        ops, unpack = [], []
        if mine_src:
            for j, d in enumerate(dst_boxes):
                r = overlap(mine_src, d)
                if r:
                    ops.append(dist.P2POp(dist.isend, source[local(r, mine_src)].contiguous(), args.src + j))
        if mine_dst:
            for i, s in enumerate(src_boxes):
                r = overlap(s, mine_dst)
                if r:
                    buf = torch.empty((r[0][1] - r[0][0], r[1][1] - r[1][0]), dtype=torch.bfloat16)
                    ops.append(dist.P2POp(dist.irecv, buf, i))
                    unpack.append((r, buf))
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        for r, buf in unpack:
            shard[local(r, mine_dst)].copy_(buf)
        dist.barrier()
        if it >= args.warmup:
            times.append(time.perf_counter() - started)
    if mine_dst:
        assert torch.equal(shard.view(torch.int16), filled(mine_dst).view(torch.int16)), "wrong result"
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--src", type=int, default=4)
    p.add_argument("--src-dim", type=int, default=0)
    p.add_argument("--dst", type=int, default=2)
    p.add_argument("--dst-dim", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, args.port, out)) for r in range(args.src + args.dst)]
    for pr in procs:
        pr.start()
    median = out.get()
    for pr in procs:
        pr.join()
        assert pr.exitcode == 0
    print(f'{{"method": "gloo batch_isend_irecv", "median_s": {median}, "gbps": {N * N * 2 / median / 1e9:.3f}}}')


if __name__ == "__main__":
    main()
