//! Gather+broadcast as an HPC user writes it with MPI's own collectives: `MPI_Allgatherv` of
//! the source shards inside one source replica, `MPI_Bcast` of the whole tensor from the
//! replica's first rank to every destination rank that lacks it, then each destination copies
//! its box out. It checks that `reshard bench`'s gather+broadcast baseline is as good as what
//! users run today (BENCHMARKS.md). The replica's shards must be contiguous blocks of rows
//! (the source shards dim 0 only), which is what `MPI_Allgatherv` can gather in place.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_gather_bcast
//! mpirun -n 8 target/release/examples/mpi_gather_bcast 8192,8192 bf16 "mesh=4 place=S(0)" "mesh=4 place=S(1)" 10
//! ```

use std::os::raw::c_int;

use mpi::ffi;
use mpi::traits::*;
use reshard::exec::baseline::keep_slice;
use reshard::fill::Fill;
use reshard::layout::{LayoutSpec, parse_shape};
use reshard::plan::GatherBroadcast;
use reshard::{DType, Placement, Region};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: mpi_gather_bcast SHAPE DTYPE SRC DST [ITERS]");
        std::process::exit(2);
    }
    let universe = mpi::initialize().expect("MPI initializes");
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let shape = parse_shape(&args[1]).expect("shape");
    let dtype: DType = args[2].parse().expect("dtype");
    let iters: usize = args.get(5).map_or(10, |s| s.parse().expect("iters"));
    let src = LayoutSpec::parse(&args[3])
        .unwrap()
        .resolve(&shape, dtype, 0)
        .unwrap();
    let first = src.mesh().ranks().iter().max().map_or(0, |&r| r + 1);
    let dst = LayoutSpec::parse(&args[4])
        .unwrap()
        .resolve(&shape, dtype, first)
        .unwrap();
    assert!(
        src.placements()
            .iter()
            .all(|p| matches!(p, Placement::Replicate | Placement::Shard(0))),
        "the source may shard dim 0 only"
    );
    let gb = GatherBroadcast::new(&src, &dst).unwrap();
    assert!(
        gb.ranks().iter().all(|&r| r < size),
        "the layouts need more ranks"
    );
    let total = dst.total_bytes() as usize;
    let whole = Region::full(&shape);
    let row_bytes = total / shape[0].max(1) as usize;

    let src_box = src.local_region(rank);
    let dst_box = dst.local_region(rank);
    let mut source = vec![0u8; src.local_bytes(rank) as usize];
    if let Some(b) = &src_box {
        Fill::Index.fill_region(&src, b, &mut source);
    }
    let mut shard = vec![0u8; dst.local_bytes(rank) as usize];
    let mut full = vec![0u8; if gb.needs_full_buffer(rank) { total } else { 0 }];

    // The gathering replica and the broadcast group (its first rank, then the receivers).
    let members: Vec<usize> = gb
        .gather
        .as_ref()
        .map(|g| g.dst().mesh().ranks().to_vec())
        .unwrap_or_default();
    let receivers: Vec<usize> = gb
        .broadcast
        .as_ref()
        .map(|b| b.dst().mesh().ranks().to_vec())
        .unwrap_or_default();
    let root = gb.holders[0];
    let gather_comm = split(&world, members.contains(&rank), rank);
    let in_bcast = rank == root || receivers.contains(&rank);
    // the root first, so that it is rank 0 of the broadcast group
    let bcast_comm = split(&world, in_bcast, if rank == root { 0 } else { rank + 1 });
    // what each member contributes to the gather: its rows, in member order
    let (counts, displs): (Vec<c_int>, Vec<c_int>) = members
        .iter()
        .map(|&m| {
            let b = src.local_region(m).unwrap();
            (
                c_int::try_from(b.volume() as usize * dtype.size()).expect("fits MPI's int"),
                c_int::try_from(b.offset[0] as usize * row_bytes).expect("fits MPI's int"),
            )
        })
        .unzip();
    let keeps_all = gb.keeps_all(rank) && gb.gets_tensor(rank);

    let mut times = Vec::new();
    for i in 0..iters + 2 {
        shard.fill(0xA5);
        world.barrier();
        // SAFETY: plain wall clock.
        let started = unsafe { ffi::MPI_Wtime() };
        let tensor: &mut Vec<u8> = if keeps_all { &mut shard } else { &mut full };
        if let Some(comm) = gather_comm {
            // SAFETY: counts and displacements describe the members' row blocks inside the
            // full buffer; the buffers outlive the call.
            unsafe {
                ffi::MPI_Allgatherv(
                    source.as_ptr().cast(),
                    c_int::try_from(source.len()).expect("fits MPI's int"),
                    ffi::RSMPI_UINT8_T,
                    tensor.as_mut_ptr().cast(),
                    counts.as_ptr(),
                    displs.as_ptr(),
                    ffi::RSMPI_UINT8_T,
                    comm,
                );
            }
        }
        if let Some(comm) = bcast_comm {
            let buf: *mut u8 = if rank == root && gb.gather.is_none() {
                source.as_mut_ptr()
            } else {
                tensor.as_mut_ptr()
            };
            // SAFETY: every member of the group passes a buffer of the whole tensor.
            unsafe {
                ffi::MPI_Bcast(
                    buf.cast(),
                    c_int::try_from(total).expect("fits MPI's int"),
                    ffi::RSMPI_UINT8_T,
                    0,
                    comm,
                );
            }
        }
        if let (Some(b), false) = (&dst_box, keeps_all) {
            let from: &[u8] = if gb.needs_full_buffer(rank) {
                &full
            } else {
                &source
            };
            keep_slice(from, &whole, b, &mut shard, dtype.size(), None);
        }
        world.barrier();
        // SAFETY: plain wall clock.
        let took = unsafe { ffi::MPI_Wtime() } - started;
        if i >= 2 {
            times.push(took);
        }
    }
    if let Some((offset, ..)) = dst_box
        .as_ref()
        .and_then(|b| Fill::Index.check_region(&dst, b, &shard))
    {
        panic!("rank {rank}: wrong byte at {offset}");
    }
    if rank == 0 {
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!(
            "{{\"method\": \"MPI_Allgatherv+MPI_Bcast\", \"median_s\": {median}, \"gbps\": {:.3}, \"verified\": true}}",
            dst.shard_bytes() as f64 / median / 1e9
        );
    }
}

/// A communicator of the ranks with `inside`, ordered by `key`; `None` on the others.
fn split(
    world: &mpi::topology::SimpleCommunicator,
    inside: bool,
    key: usize,
) -> Option<ffi::MPI_Comm> {
    let mut comm = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
    // SAFETY: every rank of the world calls it; the undefined colour yields MPI_COMM_NULL.
    unsafe {
        ffi::MPI_Comm_split(
            world.as_raw(),
            if inside { 1 } else { ffi::RSMPI_UNDEFINED },
            key as c_int,
            comm.as_mut_ptr(),
        );
        let comm = comm.assume_init();
        (comm != ffi::RSMPI_COMM_NULL).then_some(comm)
    }
}
