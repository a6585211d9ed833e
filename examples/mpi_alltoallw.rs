//! The MPI baseline an HPC user would write for a reshard: one `MPI_Alltoallw` whose per-peer
//! subarray datatypes describe every overlap in place, in the source and destination shards
//! (no hand packing; OpenMPI copies between processes by cross-memory attach). It uses
//! reshard's layouts for the geometry only. BENCHMARKS.md compares it with reshard.
//!
//! ```text
//! cargo build --release --features mpi --example mpi_alltoallw
//! mpirun -n 6 target/release/examples/mpi_alltoallw 8192,8192 bf16 "mesh=4 place=S(0)" "mesh=2 place=S(1)" 10
//! ```

use std::os::raw::c_int;

use mpi::ffi;
use mpi::traits::*;
use reshard::fill::Fill;
use reshard::layout::{LayoutSpec, parse_shape};
use reshard::transport::mpi::{free_datatype, subarray};
use reshard::{DType, Plan};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: mpi_alltoallw SHAPE DTYPE SRC DST [ITERS]");
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
    let plan = Plan::new(src, dst).unwrap();
    assert!(
        plan.ranks().iter().all(|&r| r < size),
        "the layouts need more ranks"
    );
    let elem = dtype.size();
    let mine = plan.for_rank(rank);

    let src_box = plan.src().local_region(rank);
    let dst_box = plan.dst().local_region(rank);
    let mut source = vec![0u8; plan.src().local_bytes(rank).max(1) as usize];
    if let Some(b) = &src_box {
        Fill::Index.fill_region(plan.src(), b, &mut source);
    }
    let mut shard = vec![0u8; plan.dst().local_bytes(rank).max(1) as usize];

    // SAFETY: a predefined handle, valid after MPI_Init.
    let null = unsafe { ffi::RSMPI_UINT8_T };
    let mut send_counts = vec![0 as c_int; size];
    let mut recv_counts = vec![0 as c_int; size];
    let mut send_types = vec![null; size];
    let mut recv_types = vec![null; size];
    let zeros = vec![0 as c_int; size];
    for t in mine.sends.iter().chain(&mine.locals) {
        assert_eq!(send_counts[t.dst], 0, "one region per peer");
        send_counts[t.dst] = 1;
        send_types[t.dst] = subarray(src_box.as_ref().unwrap(), &t.region, elem);
    }
    for t in mine.recvs.iter().chain(&mine.locals) {
        recv_counts[t.src] = 1;
        recv_types[t.src] = subarray(dst_box.as_ref().unwrap(), &t.region, elem);
    }

    let mut times = Vec::new();
    for i in 0..iters + 2 {
        world.barrier();
        // SAFETY: plain wall clock.
        let started = unsafe { ffi::MPI_Wtime() };
        // SAFETY: every array has one entry per rank; the types describe regions inside the
        // two buffers, which outlive the call.
        unsafe {
            ffi::MPI_Alltoallw(
                source.as_ptr().cast(),
                send_counts.as_ptr(),
                zeros.as_ptr(),
                send_types.as_ptr(),
                shard.as_mut_ptr().cast(),
                recv_counts.as_ptr(),
                zeros.as_ptr(),
                recv_types.as_ptr(),
                ffi::RSMPI_COMM_WORLD,
            );
        }
        world.barrier();
        // SAFETY: plain wall clock.
        let took = unsafe { ffi::MPI_Wtime() } - started;
        if i >= 2 {
            times.push(took);
        }
    }
    let wrong = dst_box.as_ref().and_then(|b| {
        Fill::Index.check_region(
            plan.dst(),
            b,
            &shard[..plan.dst().local_bytes(rank) as usize],
        )
    });
    if let Some((offset, ..)) = wrong {
        panic!("rank {rank}: wrong byte at {offset}");
    }
    for t in send_types.into_iter().chain(recv_types) {
        if t != null {
            free_datatype(t);
        }
    }
    if rank == 0 {
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let dst_bytes = plan.dst().shard_bytes();
        println!(
            "{{\"method\": \"MPI_Alltoallw\", \"median_s\": {median}, \"gbps\": {:.3}, \"verified\": true}}",
            dst_bytes as f64 / median / 1e9
        );
    }
}
