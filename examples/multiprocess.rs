//! Reshards a tensor across processes with the library's runtime: every process fills its
//! source shard, joins the job its environment describes, runs its part of the plan and checks
//! the destination shard it received; rank 0 prints one line for the job.
//!
//! The tensor is 96x80 f32 elements, in row shards over every rank of the job, moved to column
//! shards over the same ranks. Start one process per rank with torchrun-style variables:
//!
//! ```text
//! cargo build --example multiprocess
//! for r in 0 1 2; do
//!   RANK=$r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//!     target/debug/examples/multiprocess tcp &
//! done; wait
//! ```
//!
//! or under `mpirun -n 3 target/debug/examples/multiprocess` in a build with `--features mpi`.
//! The argument names the transport (`auto` by default: shared memory between processes of one
//! host). Started alone, with no job variables, it runs every rank as a thread of itself.

use std::collections::BTreeMap;

use reshard::fill::Fill;
use reshard::layout::LayoutSpec;
use reshard::runtime::{JoinOptions, RunOptions, World};
use reshard::{DType, Error, Plan, Side};

fn main() {
    match run(std::env::args().nth(1).as_deref().unwrap_or("auto")) {
        Ok(Some(line)) => println!("{line}"),
        Ok(None) => {}
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

/// Runs this process's part of the job over `transport`; the job's line on rank 0 (or when
/// the ranks are threads of this process), `None` on the other ranks.
pub fn run(transport: &str) -> Result<Option<String>, Error> {
    let world = World::join(JoinOptions {
        transport: transport.parse()?,
        ..JoinOptions::default()
    })?;
    // as many ranks as the job has (four threads when alone)
    let size = world.job().map_or(4, |job| job.world());
    let shape = [96, 80];
    let layout = |side: Side, place: &str| {
        LayoutSpec::parse(&format!("mesh={size} place={place}"))
            .and_then(|spec| spec.resolve(&shape, DType::F32, 0))
            .map_err(|source| Error::Layout { side, source })
    };
    let plan = Plan::new(layout(Side::Src, "S(0)")?, layout(Side::Dst, "S(1)")?)?;

    // this process's shards: its own, or every rank's when the ranks are threads
    let fill = Fill::Hash { seed: 7 };
    let mut sources = BTreeMap::new();
    for rank in world.ranks(plan.src()) {
        if let Some(shard) = fill.shard(plan.src(), rank)? {
            sources.insert(rank, shard);
        }
    }
    let mut destinations: BTreeMap<_, _> = world
        .ranks(plan.dst())
        .map(|rank| (rank, vec![0u8; plan.dst().local_bytes(rank) as usize]))
        .collect();

    let outcome = world
        .run(&plan, &sources, &mut destinations, &RunOptions::default())
        .and_then(|stats| {
            for (&rank, shard) in &destinations {
                if let Some(region) = plan.dst().local_region(rank) {
                    fill.verify_region(plan.dst(), &region, shard, (rank, 0))?;
                }
            }
            Ok(serde_json::json!({ "bytes_received": stats.bytes_remote() }))
        });
    // rank 0 hears every rank's outcome; a failure anywhere fails every rank
    let Some(reports) = world.finish(outcome)? else {
        return Ok(None);
    };
    let received: u64 = reports
        .iter()
        .map(|r| r["bytes_received"].as_u64().unwrap_or(0))
        .sum();
    Ok(Some(format!(
        "resharded {}x{} f32 from row to column shards over {size} ranks ({}): {received} bytes \
         between ranks, every destination shard verified",
        shape[0],
        shape[1],
        match world.rank() {
            Some(_) => "one process each",
            None => "threads of one process",
        }
    )))
}
