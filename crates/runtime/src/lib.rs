//! The runtime: joins a job from the environment and runs this process's rank(s).
//!
//! A [`World`] is what a program holds to move tensors between processes: it learns where the
//! process stands from its environment (torchrun-style `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`; `mpirun` in a build with the `mpi` feature; or, with neither, every rank as a
//! thread of this one process), owns the transports and the `auto` policy that picks them, and
//! runs a plan, a batch (a whole-model refit) or the gather+broadcast baseline for its ranks
//! with one call. The command line is a shell over it: arguments in, a report out.
//!
//! Every kind of move takes one path: the job (a plan, plain, cast or quantizing, relayed or
//! not; a batch, quantized or already quantized; the gather+broadcast baseline of either) is
//! lowered to one [`exec::Program`] per rank (plain data: its phases, their steps in schedule
//! order, the chunk size both ends cut; [`exec::lower`], [`batch::lower`]), and the one
//! executor (`exec::run_program`) runs a rank's program on a transport, or the one driver
//! (`exec::driver::run_threads`) runs every rank's as threads of this process.
//! `World::run_programs` runs this process's ranks' programs, whichever the membership; the
//! public `World::run_*` calls build the job, lower it and run it there.
//!
//! The entry points that run something are few: [`World::run`], [`World::run_quantized`],
//! [`World::run_batch`], [`World::run_batch_quantized`], [`World::run_quantized_move`],
//! [`World::run_gather_broadcast`] and [`PlanRank::run`]. The executor's thinner drivers are
//! public only with the `bench` feature, for the benchmarks and the command line's
//! measurements. The comparison harness ([`harness`]), the measured refit
//! ([`refit::RefitRun`]), refits while serving ([`rollout`]) and the serving stand-in
//! ([`serve`]) are scaffolding for benchmarks and tests: the `reshard` facade exports them
//! only with its `bench` feature.
//!
//! Options are split by when they apply: how the ranks reach each other ([`JoinOptions`]:
//! transport, timeout, staging bound, token) is fixed at [`World::join`]; how one run cuts
//! and checks its bytes ([`RunOptions`]: chunk size, checksum) is given to each run.
//!
//! ```no_run
//! use std::collections::BTreeMap;
//! use reshard_runtime::{JoinOptions, RunOptions, World};
//! use reshard_core::{DType, Plan, layout::LayoutSpec};
//! let src = LayoutSpec::parse("mesh=2 place=S(0)").unwrap().resolve(&[8, 8], DType::F32, 0).unwrap();
//! let dst = LayoutSpec::parse("mesh=2 place=S(1)").unwrap().resolve(&[8, 8], DType::F32, 0).unwrap();
//! let plan = Plan::new(src, dst).unwrap();
//! let world = World::join(JoinOptions::default()).unwrap();
//! // this process's shards only (every rank's when the ranks are threads of this process)
//! let sources: BTreeMap<_, _> = world.ranks(plan.src()).map(|r| (r, vec![0u8; plan.src().local_bytes(r) as usize])).collect();
//! let mut dests: BTreeMap<_, _> = world.ranks(plan.dst()).map(|r| (r, vec![0u8; plan.dst().local_bytes(r) as usize])).collect();
//! world.run(&plan, &sources, &mut dests, &RunOptions::default()).unwrap();
//! ```

#![warn(missing_docs)]

/// Declares one of the executor's drivers that the benchmarks and the command line's
/// measurements call directly: public with the `bench` feature, crate-private without it, so
/// that the library's own entry points are [`World`]'s and [`PlanRank::run`].
macro_rules! bench_pub {
    ($(#[$attr:meta])* fn $($rest:tt)*) => {
        $(#[$attr])*
        #[cfg(feature = "bench")]
        pub fn $($rest)*

        $(#[$attr])*
        #[cfg(not(feature = "bench"))]
        #[allow(dead_code)]
        pub(crate) fn $($rest)*
    };
}

/// Re-exports drivers declared with `bench_pub!`: publicly with the `bench` feature, to the
/// crate without it.
macro_rules! bench_use {
    ($($path:tt)*) => {
        #[cfg(feature = "bench")]
        pub use $($path)*;
        #[cfg(not(feature = "bench"))]
        #[allow(unused_imports)]
        pub(crate) use $($path)*;
    };
}

pub mod batch;
mod connect;
pub mod exec;
pub mod harness;
mod prepared;
pub mod refit;
pub mod rollout;
mod run;
pub mod serve;

use reshard_core::error::Field;
use std::str::FromStr;
use std::time::Duration;

use crate::exec::ExecOptions;
use reshard_core::agreement::Fingerprint;
use reshard_core::error::{Error, Result};
use reshard_core::layout::{Layout, Rank};
use reshard_core::topology::HostMap;
use reshard_transport::Job;
pub use reshard_transport::control::Decision;
use reshard_transport::group::{Group, GroupEnv};

pub use connect::{AnyTransport, Destination, Links};
pub use prepared::PlanRank;

/// Which transport moves the bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportKind {
    /// Every rank a thread of this process; receivers copy straight from the senders' shards.
    Local,
    /// Processes and hosts over TCP.
    Tcp,
    /// Processes on one host: senders write straight into the receivers' shards in shared
    /// memory (or through shared-memory rings); notices over TCP, or over MPI under mpirun.
    Shm,
    /// The site's MPI for every peer, under mpirun (needs the `mpi` feature).
    Mpi,
    /// The best transport for where the ranks are: local in one process; between processes,
    /// shm for peers on the same host and tcp for the others, or, under mpirun with the `mpi`
    /// feature and no `MASTER_PORT` set, mpi for the others.
    #[default]
    Auto,
}

impl TransportKind {
    /// Every kind, in the order the help lists them.
    pub const ALL: [TransportKind; 5] = [
        TransportKind::Local,
        TransportKind::Tcp,
        TransportKind::Shm,
        TransportKind::Mpi,
        TransportKind::Auto,
    ];

    /// Its name, as `--transport` takes it.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Local => "local",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Mpi => "mpi",
            TransportKind::Auto => "auto",
        }
    }
}

impl FromStr for TransportKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<TransportKind> {
        TransportKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| Error::InvalidOption {
                field: Field::Transport,
                value: s.into(),
                reason: "expected local, tcp, shm, mpi or auto".into(),
            })
    }
}

/// How the ranks reach each other: fixed when the process joins the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinOptions {
    /// Which transport carries each peer.
    pub transport: TransportKind,
    /// How long a rank waits for a peer before failing.
    pub timeout: Duration,
    /// Bound on the staging memory of one rank (shared-memory rings, receive buffers).
    pub staging_bytes: usize,
    /// The job's shared secret; `None` takes `RESHARD_TOKEN` from the environment.
    pub token: Option<String>,
}

impl Default for JoinOptions {
    fn default() -> Self {
        let exec = ExecOptions::default();
        JoinOptions {
            transport: TransportKind::Auto,
            timeout: exec.timeout,
            staging_bytes: exec.staging_bytes,
            token: None,
        }
    }
}

/// How one run cuts and checks its bytes: given to every run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunOptions {
    /// Largest chunk a transfer is cut into (a transport may move whole transfers instead).
    pub chunk_bytes: usize,
    /// Whether every chunk is summed (CRC-32C) by its sender and checked by its receiver.
    pub checksum: bool,
    /// One refit of a delta refit: only what changed since the version each destination
    /// holds moves ([`exec::delta`]).
    pub delta: Option<exec::delta::DeltaRefit>,
    /// A staged refit: the destinations given are shadows of the live shards, to be
    /// committed or aborted later ([`exec::stage`]).
    pub stage: Option<exec::delta::StageRefit>,
}

impl Default for RunOptions {
    fn default() -> Self {
        let exec = ExecOptions::default();
        RunOptions {
            chunk_bytes: exec.chunk_bytes,
            checksum: exec.checksum,
            delta: None,
            stage: None,
        }
    }
}

/// How this process takes part in the job.
enum Membership {
    /// Every rank a thread of this process.
    Threads,
    /// One rank of a job that met at `MASTER_ADDR:MASTER_PORT` (boxed: a group is large,
    /// and a world is moved around by value).
    Group(Box<Group>),
    /// One rank of an MPI job.
    #[cfg(feature = "mpi")]
    Mpi(reshard_transport::mpi::MpiJob),
}

/// This process's place in a job, and the transports it opens to its peers.
pub struct World {
    options: JoinOptions,
    membership: Membership,
}

impl World {
    /// Joins the job this process's environment describes (see the module documentation):
    /// waits for every rank to arrive, within `options.timeout`.
    pub fn join(options: JoinOptions) -> Result<World> {
        Self::join_env(GroupEnv::from_env()?, options)
    }

    /// [`World::join`] with the rendezvous given rather than read (`None`: no rendezvous of
    /// our own, so the ranks are threads of this process, or MPI's under mpirun).
    pub fn join_env(env: Option<GroupEnv>, options: JoinOptions) -> Result<World> {
        let kind = options.transport;
        let membership = match env {
            env if in_mpi_job(kind, env.as_ref()) => mpi_membership()?,
            None if matches!(kind, TransportKind::Local | TransportKind::Auto) => {
                Membership::Threads
            }
            Some(env) if kind == TransportKind::Local => {
                return Err(Error::InvalidOption {
                    field: Field::Transport,
                    value: "local".into(),
                    reason: format!(
                        "local runs every rank as a thread of one process, but this is rank {} \
                         of {} processes; use tcp, shm or auto",
                        env.rank, env.world
                    ),
                });
            }
            None => return Err(not_in_a_job(kind)),
            Some(mut env) => {
                if let Some(token) = &options.token {
                    reshard_transport::group::check_token(token)?;
                    env.token = token.clone();
                }
                Membership::Group(Box::new(Group::join(env, options.timeout)?))
            }
        };
        Ok(World {
            options,
            membership,
        })
    }

    /// The options the world was joined with.
    pub fn options(&self) -> &JoinOptions {
        &self.options
    }

    /// The job's control plane (barrier, agreement, verdict); `None` when the ranks are
    /// threads of this process.
    pub fn job(&self) -> Option<&dyn Job> {
        match &self.membership {
            Membership::Threads => None,
            Membership::Group(g) => Some(&**g),
            #[cfg(feature = "mpi")]
            Membership::Mpi(j) => Some(j),
        }
    }

    /// Which host every rank of the job runs on, as the ranks told each other when they
    /// joined (`launch --hosts` places them on emulated hosts; otherwise the host names
    /// decide); `None` when the ranks are threads of this process (one host).
    pub fn hosts(&self) -> Option<&HostMap> {
        match &self.membership {
            Membership::Threads => None,
            Membership::Group(g) => Some(g.hosts()),
            #[cfg(feature = "mpi")]
            Membership::Mpi(j) => Some(j.hosts()),
        }
    }

    /// This process's rank; `None` when it runs every rank.
    pub fn rank(&self) -> Option<Rank> {
        self.job().map(Job::rank)
    }

    /// Whether this process runs `rank`.
    pub fn runs(&self, rank: Rank) -> bool {
        self.rank().is_none_or(|r| r == rank)
    }

    /// The ranks of `layout` this process runs: all of them, or its own if the layout has it.
    pub fn ranks<'a>(&'a self, layout: &'a Layout) -> impl Iterator<Item = Rank> + 'a {
        layout
            .mesh()
            .ranks()
            .iter()
            .copied()
            .filter(move |&r| self.runs(r))
    }

    /// The executor's options for a run with `run`'s.
    pub fn exec_options(&self, run: &RunOptions) -> ExecOptions {
        ExecOptions {
            chunk_bytes: run.chunk_bytes,
            staging_bytes: self.options.staging_bytes,
            timeout: self.options.timeout,
            checksum: run.checksum,
            delta: run.delta.clone(),
            stage: run.stage.clone(),
        }
    }

    /// The plan agreement ([`Job::agree`]) once this rank's own checks (`ready`) are done:
    /// its fingerprint, or its refusal (`command` names what refused), so that every rank
    /// fails at once naming it instead of waiting for it until the timeout. A rank that
    /// refused returns its own error. Between threads there is nothing to agree.
    pub fn agree(
        &self,
        command: &str,
        ready: Result<()>,
        fingerprint: impl FnOnce() -> Fingerprint,
    ) -> Result<()> {
        let Some(job) = self.job() else {
            return ready;
        };
        match ready {
            Ok(()) => job.agree(&fingerprint()),
            Err(e) => {
                let _ = job.agree(&Fingerprint::refusal(command, &e));
                Err(e)
            }
        }
    }

    /// Waits until every rank of the job has called it (nothing to wait for between
    /// threads); fails on every rank if one failed before.
    pub fn barrier(&self) -> Result<()> {
        self.job().map_or(Ok(()), Job::barrier)
    }

    /// The job's two-phase decision on a staged version ([`Job::decide`]): `prepared` is this
    /// process's vote (`Ok` when its ranks hold their whole next version, staged and checked).
    /// Between threads the vote is the decision: one process runs every rank, and a run that
    /// failed on any rank staged nothing anywhere.
    pub fn decide(&self, prepared: std::result::Result<(), String>) -> Result<Decision> {
        match self.job() {
            Some(job) => job.decide(prepared),
            None => Ok(match prepared {
                Ok(()) => Decision::Commit,
                Err(why) => Decision::Abort {
                    ranks: vec![(0, why)],
                },
            }),
        }
    }

    /// Checks that the job has a process for every rank up to `highest`.
    pub fn check_size(&self, highest: Rank) -> Result<()> {
        match self.job() {
            Some(job) => check_world(highest, job.world()),
            None => Ok(()),
        }
    }

    /// Opens this rank's links to `links`' peers, over the transport the join options and
    /// the `auto` policy choose. `layouts` are every tensor the links will move (MPI derives
    /// its datatypes from them); `destination` is this rank's shared-memory destination, if
    /// same-host senders may write into it. Every rank of the job must call it at the same
    /// point; the ranks of this process (threads) have nothing to open.
    pub fn connect<'l>(
        &self,
        links: &Links,
        layouts: impl IntoIterator<Item = &'l Layout>,
        destination: Destination<'_>,
    ) -> Result<AnyTransport<'_>> {
        match &self.membership {
            Membership::Threads => Err(Error::InvalidOption {
                field: Field::Transport,
                value: self.options.transport.name().into(),
                reason: "the ranks are threads of this process: they share its memory and open \
                         no links"
                    .into(),
            }),
            Membership::Group(group) => {
                let _ = layouts.into_iter();
                connect::connect(group, links, destination, &self.options)
            }
            #[cfg(feature = "mpi")]
            Membership::Mpi(job) => {
                connect::connect_mpi(job, layouts, links, destination, &self.options)
            }
        }
    }

    /// Ends this rank's part of a job: hands its report (or its failure) to rank 0's verdict.
    /// Returns every rank's report (indexed by rank) on rank 0, `None` on the others, and
    /// [`Error::JobFailed`] on every rank when one failed. Between threads there is no one to
    /// tell: the outcome comes back as the only report.
    pub fn finish(
        &self,
        outcome: Result<serde_json::Value>,
    ) -> Result<Option<Vec<serde_json::Value>>> {
        let Some(job) = self.job() else {
            return outcome.map(|report| Some(vec![report]));
        };
        if let Err(e @ Error::JobFailed { .. }) = outcome {
            // the verdict is already out: rank 0 told everyone at the barrier
            return Err(e);
        }
        let ranks = job.finish(outcome.map_err(|e| e.to_string()))?;
        Ok((job.rank() == 0).then_some(ranks))
    }
}

/// Checks that the job has a process for every rank the layouts use (`highest`).
pub fn check_world(highest: Rank, world: usize) -> Result<()> {
    if highest >= world {
        return Err(Error::Env {
            var: "WORLD_SIZE",
            value: world.to_string(),
            reason: format!(
                "the layouts use ranks up to {highest}, so the job needs at least {} processes",
                highest + 1
            ),
        });
    }
    Ok(())
}

/// Whether this process was started by OpenMPI's or another PMI launcher.
pub fn under_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Whether this process runs as a rank of an MPI job for `kind`: always for `mpi`, and for
/// `auto` and `shm` when `mpirun` started it (in a build with MPI) and no rendezvous of our
/// own (`env`) is set.
pub fn in_mpi_job(kind: TransportKind, env: Option<&GroupEnv>) -> bool {
    kind == TransportKind::Mpi
        || (env.is_none()
            && cfg!(feature = "mpi")
            && under_mpirun()
            && matches!(kind, TransportKind::Auto | TransportKind::Shm))
}

#[cfg(feature = "mpi")]
fn mpi_membership() -> Result<Membership> {
    Ok(Membership::Mpi(reshard_transport::mpi::MpiJob::init()?))
}

#[cfg(not(feature = "mpi"))]
fn mpi_membership() -> Result<Membership> {
    Err(Error::InvalidOption {
        field: Field::Transport,
        value: "mpi".into(),
        reason: "this reshard was built without MPI; build it with `cargo build --release --features mpi` \
                 (needs an MPI library such as Debian's libopenmpi-dev, and libclang-dev)"
            .into(),
    })
}

/// The error for a multi-process transport started as a lone process.
fn not_in_a_job(kind: TransportKind) -> Error {
    Error::InvalidOption {
        field: Field::Transport,
        value: kind.name().into(),
        reason: "it runs one rank per process: start it with `reshard launch --nproc N -- \
                 run ...`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (also \
                 under mpirun, with -x)"
            .into(),
    }
}

#[cfg(test)]
mod tests;
