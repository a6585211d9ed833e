//! The end of a job for `run`, `bench` and `refit --run`: every rank's report to rank 0's
//! verdict. What they measure, and how, is the library's comparison harness
//! ([`reshard::runtime::harness`]).

use reshard::Error;
use reshard::runtime::World;

use super::Failure;

/// What rank 0 hears from every rank at the end of a job.
pub struct Reports {
    /// Every rank's report, indexed by rank.
    pub ranks: Vec<serde_json::Value>,
}

impl Reports {
    /// The transport the ranks name in their reports' `transport` field.
    pub fn transport(&self) -> String {
        reshard::runtime::harness::reported_transport(&self.ranks)
    }
}

/// Ends this rank's part of a job: prints its own failure, hands its report (or the failure)
/// to rank 0's verdict ([`World::finish`]), and returns every rank's report on rank 0, `None`
/// on the others.
pub fn conclude(
    world: &World,
    outcome: Result<serde_json::Value, Error>,
) -> Result<Option<Reports>, Failure> {
    if let Err(e) = &outcome {
        eprintln!("error: {e}");
    }
    let ranks = world.finish(outcome)?;
    Ok(ranks.map(|ranks| Reports { ranks }))
}
