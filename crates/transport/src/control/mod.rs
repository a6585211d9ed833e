//! The control protocol of a job of processes, as a state machine without I/O or clocks.
//!
//! After rendezvous every member (rank 1 and up) holds one control link to rank 0, the
//! coordinator; the protocol runs over these links alone. A rank's code makes four calls:
//! [`Call::Agree`] once, then any sequence of [`Call::Barrier`] and [`Call::Decide`] (one
//! decision for each version the job stages: see *Two-phase decision* below), the same on
//! every rank, then [`Call::Finish`] once. Each call is one exchange:
//!
//! | call | a member sends | rank 0 answers every member, once it has heard all of them |
//! |---|---|---|
//! | agree | [`Msg::Agree`] (its job's fingerprint) | [`Msg::Go`], [`Msg::Disagree`] (the first rank whose job differs) or [`Msg::Verdict`] |
//! | barrier | [`Msg::Barrier`] | [`Msg::Go`] or [`Msg::Verdict`] (the ranks that failed) |
//! | decide | [`Msg::Prepared`], or [`Msg::NotPrepared`] (why) | [`Msg::Commit`] (every rank was prepared) or [`Msg::Abort`] (the ranks that were not, and why) |
//! | finish | [`Msg::Status`] (its report, or its error) | [`Msg::Verdict`] (empty when all went well) |
//!
//! A member that fails between two calls skips the barriers (and the decisions) and goes
//! straight to finish: rank 0, at its barrier, takes that member's [`Msg::Status`] for its
//! failure and tells every member at once, so nobody waits for a rank that will never come.
//!
//! **Deadlines.** Rank 0 gives all members together two timeouts from the moment it makes
//! its own call ([`Coordinator`]): a member that is alive gets there within a timeout of
//! noticing a failure, and noticing may itself take a timeout. A member that stays silent
//! past that counts as failed, and so does one whose link closes. A member waits for rank 0's
//! answer until rank 0 has been silent for four timeouts ([`MEMBER_PATIENCE`]): rank 0's
//! own part may end a timeout after a failure, then it waits up to two for the others.
//!
//! **Heartbeats.** Rank 0 may reach a call long after its members: its own share of the data
//! (a large local copy) can take longer than any timeout. So while a member waits on it,
//! rank 0 sends that member [`Msg::Working`] every timeout ([`Coordinator::wakeup`] says
//! when); a member's patience counts rank 0's silence, not rank 0's work. A rank 0 that dies
//! or stops (SIGSTOP) stops beating, and its members give up four timeouts later.
//!
//! **Two-phase decision.** A job that stages a new version beside the one it serves commits
//! it on every rank or on none, by the two-phase commit of the literature with rank 0 as
//! coordinator and presumed abort. Phase one: every rank votes ([`Call::Decide`]): prepared
//! when it holds its whole next version, staged and checked, not prepared (and why)
//! otherwise. Phase two: once rank 0 has every vote, or has given up on a member, it decides
//! [`Decision::Commit`] if every rank, itself included, voted prepared, and
//! [`Decision::Abort`] otherwise, naming every rank that was not prepared and why. It writes
//! the decision to every member's link before its own call returns it, so rank 0 applies a
//! commit only once every link that still stands carries it (a link that takes nothing
//! within a timeout is dropped, its member lost).
//!
//! *Several decisions.* A job that refits version after version makes one decision for
//! each, one at a time, with barriers between them or not. Each is its own exchange, and
//! independent of the others: an abort ends that version only, and the job goes on to its
//! next call. A rank lost on the way is a different matter: it is named by the next
//! decision's abort (it cannot vote) and by the next barrier's or the finish's verdict, so
//! the job fails there. No message names its decision; the calls' order does. Every rank
//! makes the same calls in the same order (one that fails skips the rest and goes to
//! finish), each member's messages reach rank 0 in the order it sent them, and rank 0
//! answers in the order of its calls. So rank 0 drops the vote of a decision it settled
//! without it (it gave up at the deadline) when that vote comes late, and a member drops
//! the decision it gave up waiting for; neither is taken for a later call. A member still
//! waiting at a decision that rank 0 skipped (it failed before, after any number of earlier
//! decisions) hears rank 0's verdict as an abort.
//!
//! - *Presumed abort.* A member lost or silent (two timeouts) before its vote counts as not
//!   prepared, and so does one lost after voting prepared but before rank 0 decided: what
//!   it staged is gone with it, so the new version would not be whole.
//! - *A member that cannot be prepared* (it voted not prepared, or its link to rank 0 was
//!   gone before it could vote) knows the decision is abort and aborts on its own, even if
//!   rank 0 is lost before the decision comes.
//! - *In doubt.* A member that voted prepared waits for the decision; if it loses rank 0
//!   first (the link closed, stalled or broken, or rank 0 silent past [`MEMBER_PATIENCE`]
//!   despite heartbeats), it cannot tell whether rank 0 decided, nor what: it returns
//!   [`reshard_core::error::Error::InDoubt`], and must neither commit nor drop its staging.
//!   A stopped rank 0 that resumes may well commit.
//!
//! What holds when a rank dies after the decision:
//!
//! - *The decision is final once rank 0 makes it.* A member that hears commit commits even if
//!   rank 0 dies right after; one that hears abort aborts. No rank commits while another
//!   aborts, whichever rank dies when.
//! - *Rank 0 dies while sending the decision* (some links carry it, others not): the members
//!   that heard it apply it, the others are in doubt. The living ranks never disagree: after
//!   a commit the ranks that heard it serve the new version and those in doubt hold it
//!   staged; after an abort every living rank serves the old one.
//! - *Rank 0 dies after sending it:* every member applies it; their finish then fails naming
//!   rank 0, which does not undo what they applied.
//! - *A member dies after the decision:* what it applied is gone with it; the others are
//!   unaffected, and rank 0's verdict at finish names it (it exited without reporting).
//! - *Resolving doubt* takes a later job (the termination protocol of two-phase commit): an
//!   in-doubt rank commits its staging if any rank applied the commit, and drops it if any
//!   rank aborted (it heard abort, or knew it was not prepared). If no rank knows (rank 0 is
//!   gone and every other rank is in doubt), no living rank applied a commit, and dropping
//!   the staging everywhere is consistent.
//!
//! There is no round of acknowledgements before rank 0 reports its decision: it would tell
//! rank 0 which members heard it, but could change nothing (a member that heard commit may
//! already have applied it). The finish that follows is that acknowledgement, at no extra
//! cost: every rank reports what it applied, and rank 0's verdict names every rank that did
//! not report. Nor would a third phase help: its termination needs the members to reach one
//! another, and they reach rank 0 alone. So a member's window of doubt is the one two-phase
//! commit leaves: from its prepared vote to the one message that carries the decision.
//!
//! Both sides are fed [`Event`]s (the rank's own call, a message, a lost link, the passing
//! of time) with the current instant, and answer with [`Action`]s: messages to send and,
//! when the call is settled, its outcome. A driver carries out what the machine says: over
//! tcp, `driver`'s thread polls the control links that `super::group` opened; under
//! `mpirun`, the MPI job feeds it MPI's blocking receives (with no deadlines: `mpirun` ends a
//! job whose rank dies, so nobody is left in doubt). The tests replay failure orders against
//! the machine alone.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use reshard_core::agreement::{Difference, Fingerprint};
use reshard_core::error::Result;
use reshard_core::layout::Rank;

mod coordinator;
pub mod driver;
mod member;
#[cfg(test)]
mod tests;

pub use coordinator::Coordinator;
pub use member::Member;

/// How many timeouts of rank 0's silence a waiting member bears before it gives up.
pub const MEMBER_PATIENCE: u32 = 4;

/// How many timeouts rank 0 gives its members, all together, to make the call it makes.
pub const COORDINATOR_PATIENCE: u32 = 2;

/// `d` after `now`, or a century after it where `d` is longer than a clock can count: a
/// library caller may pass any timeout, and none may make the protocol panic.
pub fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// Control messages after rendezvous.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// A member's description of the job it is about to run, right after rendezvous.
    Agree {
        /// What the member is about to run.
        fingerprint: Fingerprint,
    },
    /// Rank 0's answer when a rank's job differs from its own.
    Disagree {
        /// The first rank whose job differs.
        rank: Rank,
        /// How its job differs from rank 0's.
        difference: Difference,
    },
    /// A member has reached a barrier.
    Barrier,
    /// Rank 0's all-clear: every rank reached the agreement or the barrier.
    Go,
    /// A member's outcome: its report, or its error.
    Status {
        /// Why the member's part failed; `None` when it went well.
        error: Option<String>,
        /// The member's report; null when it failed.
        report: serde_json::Value,
    },
    /// Rank 0's decision for the job: the ranks that failed, and why (none: success).
    Verdict {
        /// Each failed rank with its error, in rank order.
        failures: Vec<(Rank, String)>,
    },
    /// Rank 0 is alive and on its way to answer.
    Working,
    /// A member's vote: it holds its whole next version, staged and checked.
    Prepared,
    /// A member's vote: it does not, and why.
    NotPrepared {
        /// Why it is not prepared.
        why: String,
    },
    /// Rank 0's decision: every rank was prepared, every rank commits.
    Commit,
    /// Rank 0's decision: the ranks that were not prepared, and why; every rank aborts.
    Abort {
        /// Each rank that was not prepared with its reason, in rank order.
        ranks: Vec<(Rank, String)>,
    },
    /// Rank 0's notice, between calls or during one: a member's link closed before it
    /// reported, so it is lost. The other members learn it at once, and may stop waiting
    /// for it elsewhere (a data link, a peer's connection) instead of for their timeout.
    Lost {
        /// The lost member.
        rank: Rank,
        /// How its link was lost ([`Lost`]), in words.
        detail: String,
    },
}

/// The outcome of the two-phase decision, the same on every rank that learns it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Every rank voted prepared: each applies its staged version.
    Commit,
    /// Some rank was not prepared (or was lost before the decision): each drops its staging
    /// and keeps the version it serves.
    Abort {
        /// The ranks that were not prepared, and why, in rank order.
        ranks: Vec<(Rank, String)>,
    },
}

impl Decision {
    /// Whether every rank applies its staged version.
    pub fn is_commit(&self) -> bool {
        matches!(self, Decision::Commit)
    }
}

impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Decision::Commit => f.write_str("commit"),
            Decision::Abort { ranks } => {
                let why: Vec<String> = ranks
                    .iter()
                    .map(|(r, e)| format!("rank {r}: {e}"))
                    .collect();
                write!(f, "abort ({})", why.join("; "))
            }
        }
    }
}

/// A rank's own call into the protocol.
#[derive(Clone, Debug)]
pub enum Call {
    /// Compare this rank's job with every other rank's, before any byte moves.
    Agree(Fingerprint),
    /// Wait until every rank got here.
    Barrier,
    /// This rank's vote: `Ok` when it holds its whole next version, staged and checked, or
    /// why not.
    Decide(std::result::Result<(), String>),
    /// This rank's part is over: its report, or its error.
    Finish(std::result::Result<serde_json::Value, String>),
}

/// How a control link was lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lost {
    /// The other side closed it (exited, or was killed).
    Closed,
    /// The other side stopped reading: a message could not be written within the timeout.
    Stalled,
    /// It sent something that is not a control message; what the driver found.
    Broken(String),
}

/// What happens to a rank's side of the protocol.
#[derive(Clone, Debug)]
pub enum Event {
    /// The rank makes a call.
    Call(Call),
    /// A message arrived from rank `from`.
    Message {
        /// The sending rank.
        from: Rank,
        /// What it sent.
        msg: Msg,
    },
    /// The link to `peer` is gone; nothing more comes from it.
    Gone {
        /// The rank at the other end of the link.
        peer: Rank,
        /// How the link was lost.
        lost: Lost,
    },
    /// Time passed (the driver woke at [`Machine::wakeup`]).
    Tick,
}

/// What the driver must do, in order.
#[derive(Debug)]
pub enum Action {
    /// Send `msg` to each of `to`.
    Send {
        /// The ranks to send to.
        to: Vec<Rank>,
        /// The message, the same to each.
        msg: Msg,
    },
    /// The call is settled: every rank's report on rank 0 after finish (indexed by rank),
    /// nothing otherwise, or the error that every rank returns alike.
    Done(Result<Vec<serde_json::Value>>),
    /// The decision is settled: rank 0's decision, or the abort a member that was not
    /// prepared knows on its own, or [`reshard_core::error::Error::InDoubt`].
    Decided(Result<Decision>),
}

impl Action {
    /// A call of `step` refused with `error`, settled as that call settles.
    fn refused(step: Step, error: reshard_core::error::Error) -> Action {
        match step {
            Step::Decide => Action::Decided(Err(error)),
            _ => Action::Done(Err(error)),
        }
    }
}

/// A settled call, as a driver hands it to the rank's code.
#[derive(Debug)]
pub enum Settled {
    /// [`Action::Done`].
    Done(Result<Vec<serde_json::Value>>),
    /// [`Action::Decided`].
    Decided(Result<Decision>),
}

impl Settled {
    /// What the call that is not a decision settled to; `rank`'s internal error otherwise.
    pub fn done(self, rank: Rank) -> Result<Vec<serde_json::Value>> {
        match self {
            Settled::Done(outcome) => outcome,
            Settled::Decided(_) => Err(mismatch(rank)),
        }
    }

    /// What the decision settled to; `rank`'s internal error otherwise.
    pub fn decided(self, rank: Rank) -> Result<Decision> {
        match self {
            Settled::Decided(outcome) => outcome,
            Settled::Done(_) => Err(mismatch(rank)),
        }
    }
}

fn mismatch(rank: Rank) -> reshard_core::error::Error {
    reshard_core::error::Error::Internal {
        rank,
        detail: "the control protocol settled a call other than the one made".into(),
    }
}

/// One rank's side of the protocol: rank 0 coordinates, the others are members.
#[derive(Debug)]
pub enum Machine {
    /// Rank 0's side.
    Coordinator(Coordinator),
    /// The side of any other rank.
    Member(Member),
}

impl Machine {
    /// The side of `rank` in a job of `world` ranks whose waits are bounded by `timeout`.
    pub fn new(rank: Rank, world: usize, timeout: Duration) -> Machine {
        if rank == 0 {
            Machine::Coordinator(Coordinator::new(world, timeout))
        } else {
            Machine::Member(Member::new(rank, timeout))
        }
    }

    /// Feeds one event that happened at `now`; returns what to do about it.
    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        match self {
            Machine::Coordinator(c) => c.handle(now, event),
            Machine::Member(m) => m.handle(now, event),
        }
    }

    /// When the driver must feed [`Event::Tick`] at the latest (a deadline, a heartbeat);
    /// `None` while nothing is due, however long that lasts.
    pub fn wakeup(&self) -> Option<Instant> {
        match self {
            Machine::Coordinator(c) => c.wakeup(),
            Machine::Member(m) => m.wakeup(),
        }
    }

    /// The first rank this rank knows to be lost (its link closed before it reported: killed,
    /// or exited early), and how: rank 0 sees its members' links, a member hears of them
    /// from rank 0 ([`Msg::Lost`]) and sees its own link to rank 0.
    pub fn lost(&self) -> Option<&(Rank, String)> {
        match self {
            Machine::Coordinator(c) => c.lost(),
            Machine::Member(m) => m.lost(),
        }
    }
}

/// How a lost link reads in a notice.
fn describe(lost: &Lost) -> String {
    match lost {
        Lost::Closed => {
            "its control link closed before it reported (killed, or exited early)".into()
        }
        Lost::Stalled => "it stopped reading its control link (stopped, or overloaded)".into(),
        Lost::Broken(detail) => format!("its control link broke: {detail}"),
    }
}

/// Which call a rank is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Agree,
    Barrier,
    Decide,
    Finish,
}

impl Step {
    fn of(call: &Call) -> Step {
        match call {
            Call::Agree(_) => Step::Agree,
            Call::Barrier => Step::Barrier,
            Call::Decide(_) => Step::Decide,
            Call::Finish(_) => Step::Finish,
        }
    }

    /// What the rank waits for, as error messages say it.
    fn what(self) -> &'static str {
        match self {
            Step::Agree => "the plan agreement",
            Step::Barrier => "the barrier",
            Step::Decide => "the decision",
            Step::Finish => "the verdict",
        }
    }
}
