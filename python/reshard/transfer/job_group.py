"""A process group across two jobs (a trainer's and an inference engine's), beside each
process's own default group, which stays as it was.

``torch.distributed`` makes groups only out of its default group's ranks, and a trainer and a
served engine are separate worlds. :func:`job_group` makes the job's group from a store that
both sides reach and registers it with ``torch.distributed``, so that its collectives and
point-to-point calls take it like any other group.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def job_group(store, rank: int, world: int, backend: str, name: str, timeout: datetime.timedelta):
    """The job's process group, beside this process's own default group (a trainer's world,
    a rollout worker's): registered with torch.distributed so that its collectives and
    point-to-point calls take it, this process's default-group rank standing for its rank in
    the job (the other ranks get stand-in numbers above the default world's, which only this
    process's bookkeeping sees). A process without a default group gets a world of its own,
    of one rank."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        # a process of its own (a one-rank trainer): a world of one, so that the job's group
        # is made the same way in every process, beside it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    me, base = dist.get_rank(), dist.get_world_size()
    stand_in = [base + i for i in range(world)]
    stand_in[rank] = me
    options = {}
    if "nccl" in backend and dist.is_nccl_available():
        nccl = dist.ProcessGroupNCCL.Options()
        nccl.is_high_priority_stream = False
        if hasattr(nccl, "lazy_init"):  # made on its own, never split from the default group's
            nccl.lazy_init = True
        options = {"backend_options": nccl}
    make = c10d._new_process_group_helper
    try:
        pg, _ = make(world, rank, stand_in, backend, store, name, timeout=timeout, **options)
    except TypeError:  # torch before backend_options
        options = {"pg_options": options["backend_options"]} if options else {}
        pg, _ = make(world, rank, stand_in, backend, store, name, timeout=timeout, **options)
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(stand_in)}
    return pg


def store_of(addr: str, port: int, is_master: bool, timeout: datetime.timedelta):
    """The job's rendezvous store: opened by the process that is its master (``port`` 0: the
    system picks one), reached by the others."""
    if is_master:
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timeout)
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)
