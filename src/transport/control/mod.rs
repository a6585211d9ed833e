//! The control protocol of a job of processes, as a state machine without I/O or clocks.
//!
//! After rendezvous every member (rank 1 and up) holds one control link to rank 0, the
//! coordinator; the protocol runs over these links alone. A rank's code makes three calls,
//! in this order: [`Call::Agree`] once, [`Call::Barrier`] any number of times, and
//! [`Call::Finish`] once. Each call is one exchange:
//!
//! | call | a member sends | rank 0 answers every member, once it has heard all of them |
//! |---|---|---|
//! | agree | [`Msg::Agree`] (its job's fingerprint) | [`Msg::Go`], [`Msg::Disagree`] (the first rank whose job differs) or [`Msg::Verdict`] |
//! | barrier | [`Msg::Barrier`] | [`Msg::Go`] or [`Msg::Verdict`] (the ranks that failed) |
//! | finish | [`Msg::Status`] (its report, or its error) | [`Msg::Verdict`] (empty when all went well) |
//!
//! A member that fails between two calls skips the barriers and goes straight to finish:
//! rank 0, at its barrier, takes that member's [`Msg::Status`] for its failure and tells
//! every member at once, so nobody waits for a rank that will never come.
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
//! Both sides are fed [`Event`]s (the rank's own call, a message, a lost link, the passing
//! of time) with the current instant, and answer with [`Action`]s: messages to send and,
//! when the call is settled, its outcome. A driver (`super::group`) polls the sockets,
//! feeds the machine and carries out what it says; the tests replay failure orders against
//! the machine alone.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::agreement::{Difference, Fingerprint};
use crate::error::{Error, Result};
use crate::layout::Rank;

pub(crate) mod driver;
#[cfg(test)]
mod tests;

/// How many timeouts of rank 0's silence a waiting member bears before it gives up.
pub const MEMBER_PATIENCE: u32 = 4;

/// How many timeouts rank 0 gives its members, all together, to make the call it makes.
pub const COORDINATOR_PATIENCE: u32 = 2;

/// `d` after `now`, or a century after it where `d` is longer than a clock can count: a
/// library caller may pass any timeout, and none may make the protocol panic.
pub(crate) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// Control messages after rendezvous.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// A member's description of the job it is about to run, right after rendezvous.
    Agree { fingerprint: Fingerprint },
    /// Rank 0's answer when a rank's job differs from its own.
    Disagree { rank: Rank, difference: Difference },
    /// A member has reached a barrier.
    Barrier,
    /// Rank 0's all-clear: every rank reached the agreement or the barrier.
    Go,
    /// A member's outcome: its report, or its error.
    Status {
        error: Option<String>,
        report: serde_json::Value,
    },
    /// Rank 0's decision for the job: the ranks that failed, and why (none: success).
    Verdict { failures: Vec<(Rank, String)> },
    /// Rank 0 is alive and on its way to answer.
    Working,
}

/// A rank's own call into the protocol.
#[derive(Clone, Debug)]
pub enum Call {
    /// Compare this rank's job with every other rank's, before any byte moves.
    Agree(Fingerprint),
    /// Wait until every rank got here.
    Barrier,
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
    Message { from: Rank, msg: Msg },
    /// The link to `peer` is gone; nothing more comes from it.
    Gone { peer: Rank, lost: Lost },
    /// Time passed (the driver woke at [`Machine::wakeup`]).
    Tick,
}

/// What the driver must do, in order.
#[derive(Debug)]
pub enum Action {
    /// Send `msg` to each of `to`.
    Send { to: Vec<Rank>, msg: Msg },
    /// The call is settled: every rank's report on rank 0 after finish (indexed by rank),
    /// nothing otherwise, or the error that every rank returns alike.
    Done(Result<Vec<serde_json::Value>>),
}

/// One rank's side of the protocol: rank 0 coordinates, the others are members.
#[derive(Debug)]
pub enum Machine {
    Coordinator(Coordinator),
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
}

/// Which call a rank is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Agree,
    Barrier,
    Finish,
}

impl Step {
    fn of(call: &Call) -> Step {
        match call {
            Call::Agree(_) => Step::Agree,
            Call::Barrier => Step::Barrier,
            Call::Finish(_) => Step::Finish,
        }
    }

    /// What the rank waits for, as error messages say it.
    fn what(self) -> &'static str {
        match self {
            Step::Agree => "the plan agreement",
            Step::Barrier => "the barrier",
            Step::Finish => "the verdict",
        }
    }
}

/// What rank 0 learned of one member in the current call.
#[derive(Clone, Debug)]
enum Heard {
    /// Nothing yet.
    Pending,
    /// Agreement: the member's job.
    Job(Fingerprint),
    /// Barrier: it got there. Finish: its report (`Null` for a member still at a barrier
    /// this rank failed before; the verdict answers it).
    Fine(serde_json::Value),
    /// It failed, or was lost: why.
    Failed(String),
}

/// Rank 0's call in progress.
#[derive(Debug)]
struct Collecting {
    step: Step,
    /// Rank 0's own job (agreement) or outcome (finish).
    mine: Call,
    deadline: Instant,
    heard: Vec<Heard>,
    /// Members still [`Heard::Pending`].
    pending: usize,
}

/// Rank 0's side: hears every member, decides for all, and keeps waiting members informed.
#[derive(Debug)]
pub struct Coordinator {
    world: usize,
    timeout: Duration,
    /// What each member sent that no call of rank 0 has taken yet, oldest first.
    inbox: Vec<VecDeque<Msg>>,
    /// Members whose link is gone, and how.
    gone: Vec<Option<Lost>>,
    /// Members that sent a message and wait for rank 0's answer.
    waiting: Vec<bool>,
    collecting: Option<Collecting>,
    /// When waiting members are next told that rank 0 is working.
    next_beat: Option<Instant>,
}

impl Coordinator {
    pub fn new(world: usize, timeout: Duration) -> Coordinator {
        Coordinator {
            world,
            timeout,
            inbox: vec![VecDeque::new(); world],
            gone: vec![None; world],
            waiting: vec![false; world],
            collecting: None,
            next_beat: None,
        }
    }

    pub fn wakeup(&self) -> Option<Instant> {
        let deadline = self.collecting.as_ref().map(|c| c.deadline);
        match (deadline, self.next_beat) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Members whose link still stands.
    fn alive(&self) -> Vec<Rank> {
        (1..self.world)
            .filter(|&r| self.gone[r].is_none())
            .collect()
    }

    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut actions = Vec::new();
        match event {
            Event::Call(call) => {
                if self.collecting.is_some() {
                    actions.push(Action::Done(Err(Error::Internal {
                        rank: 0,
                        detail: "a control call was made while another was in progress".into(),
                    })));
                    return actions;
                }
                let heard = vec![Heard::Pending; self.world];
                self.collecting = Some(Collecting {
                    step: Step::of(&call),
                    mine: call,
                    deadline: later(now, self.timeout.saturating_mul(COORDINATOR_PATIENCE)),
                    heard,
                    pending: self.world - 1,
                });
                for r in 1..self.world {
                    self.take(r);
                }
            }
            Event::Message { from, msg } => {
                // members have no reason to send heartbeats: one is dropped, not answered
                let member = (1..self.world).contains(&from) && self.gone[from].is_none();
                if member && msg != Msg::Working {
                    self.waiting[from] = true;
                    if self.next_beat.is_none() {
                        self.next_beat = Some(later(now, self.timeout));
                    }
                    self.inbox[from].push_back(msg);
                    self.take(from);
                }
            }
            Event::Gone { peer, lost } => {
                if (1..self.world).contains(&peer) && self.gone[peer].is_none() {
                    self.gone[peer] = Some(lost);
                    self.waiting[peer] = false;
                    self.take(peer);
                }
            }
            Event::Tick => {}
        }
        self.expire(now);
        if self.collecting.as_ref().is_some_and(|c| c.pending == 0) {
            self.decide(&mut actions);
        }
        self.beat(now, &mut actions);
        actions
    }

    /// Takes what member `r` sent (or its loss) into the call in progress, if it has nothing
    /// from `r` yet.
    fn take(&mut self, r: Rank) {
        let Some(c) = self.collecting.as_mut() else {
            return;
        };
        if !matches!(c.heard[r], Heard::Pending) {
            return;
        }
        let heard = if let Some(msg) = self.inbox[r].pop_front() {
            match (c.step, msg) {
                (Step::Agree, Msg::Agree { fingerprint }) => Heard::Job(fingerprint),
                (Step::Barrier, Msg::Barrier) => Heard::Fine(serde_json::Value::Null),
                (
                    Step::Finish,
                    Msg::Status {
                        error: None,
                        report,
                    },
                ) => Heard::Fine(report),
                // still waiting at the barrier this rank failed before: it hears the verdict
                (Step::Finish, Msg::Barrier) => Heard::Fine(serde_json::Value::Null),
                (step, Msg::Status { error, .. }) => Heard::Failed(error.unwrap_or_else(|| {
                    match step {
                        Step::Agree => "reported before the plan agreement",
                        _ => "reported before the barrier",
                    }
                    .into()
                })),
                (Step::Agree, other) => Heard::Failed(format!("sent {other:?} instead of its job")),
                (Step::Barrier, other) => Heard::Failed(format!("sent {other:?} at the barrier")),
                (Step::Finish, other) => {
                    Heard::Failed(format!("sent {other:?} instead of a report"))
                }
            }
        } else if let Some(lost) = &self.gone[r] {
            Heard::Failed(match (lost, c.step) {
                (Lost::Closed, Step::Finish) => "exited without reporting (killed?)".into(),
                (Lost::Closed, _) => "exited (killed?)".into(),
                (Lost::Stalled, _) => {
                    format!("stopped reading its control link during {}", c.step.what())
                }
                (Lost::Broken(detail), _) => detail.clone(),
            })
        } else {
            return;
        };
        c.heard[r] = heard;
        c.pending -= 1;
    }

    /// Members still silent at the deadline count as failed.
    fn expire(&mut self, now: Instant) {
        let timeout = self.timeout;
        let Some(c) = self.collecting.as_mut().filter(|c| now >= c.deadline) else {
            return;
        };
        for (peer, h) in c.heard.iter_mut().enumerate().skip(1) {
            if matches!(h, Heard::Pending) {
                let waited = timeout.saturating_mul(COORDINATOR_PATIENCE);
                *h = Heard::Failed(
                    Error::Timeout {
                        rank: 0,
                        peer,
                        waited,
                        detail: format!("{} did not complete", c.step.what()),
                    }
                    .to_string(),
                );
                c.pending -= 1;
            }
        }
    }

    /// Tells waiting members that rank 0 is alive, once a timeout.
    fn beat(&mut self, now: Instant, actions: &mut Vec<Action>) {
        let Some(at) = self.next_beat.filter(|&at| now >= at) else {
            return;
        };
        let to: Vec<Rank> = (1..self.world)
            .filter(|&r| self.waiting[r] && self.gone[r].is_none())
            .collect();
        if to.is_empty() {
            self.next_beat = None;
            return;
        }
        actions.push(Action::Send {
            to,
            msg: Msg::Working,
        });
        // from the beat that was due, not from a late wake: beats keep their pace
        let mut next = later(at, self.timeout);
        if next <= now {
            next = later(now, self.timeout);
        }
        self.next_beat = Some(next);
    }

    /// Every member is heard from (or given up on): answers them all and settles the call.
    fn decide(&mut self, actions: &mut Vec<Action>) {
        let Some(c) = self.collecting.take() else {
            return;
        };
        let to = self.alive();
        for &r in &to {
            self.waiting[r] = false;
        }
        if !self.waiting.iter().any(|&w| w) {
            self.next_beat = None;
        }
        let mut failures = Vec::new();
        let mut reports = vec![serde_json::Value::Null; self.world];
        let mut jobs = Vec::new();
        if let Call::Finish(mine) = c.mine.clone() {
            match mine {
                Ok(r) => reports[0] = r,
                Err(e) => failures.push((0, e)),
            }
        }
        for (r, h) in c.heard.into_iter().enumerate().skip(1) {
            match h {
                Heard::Job(f) => jobs.push((r, f)),
                Heard::Fine(report) => reports[r] = report,
                Heard::Failed(why) => failures.push((r, why)),
                Heard::Pending => {}
            }
        }
        if let Call::Agree(mine) = &c.mine {
            let first = Fingerprint::first_disagreement(mine, jobs.iter().map(|(r, f)| (*r, f)));
            if let Some((rank, difference)) = first {
                actions.push(Action::Send {
                    to,
                    msg: Msg::Disagree {
                        rank,
                        difference: difference.clone(),
                    },
                });
                actions.push(Action::Done(Err(difference.into_error(rank))));
                return;
            }
        }
        let failed = !failures.is_empty();
        let answer = if failed || c.step == Step::Finish {
            Msg::Verdict {
                failures: failures.clone(),
            }
        } else {
            Msg::Go
        };
        actions.push(Action::Send { to, msg: answer });
        actions.push(Action::Done(if failed {
            Err(Error::JobFailed { rank: 0, failures })
        } else if c.step == Step::Finish {
            Ok(reports)
        } else {
            Ok(Vec::new())
        }));
    }
}

/// A member's call in progress.
#[derive(Debug)]
struct Awaiting {
    step: Step,
    /// This rank's own error, when it finishes with one.
    my_error: Option<String>,
    /// When rank 0's silence has lasted too long.
    deadline: Instant,
}

/// A member's side: tells rank 0 where it is and waits for its answer.
#[derive(Debug)]
pub struct Member {
    rank: Rank,
    timeout: Duration,
    /// What rank 0 sent while this rank was in no call, oldest first (a late answer to a
    /// barrier this rank gave up on, a verdict that came before this rank's report).
    inbox: VecDeque<Msg>,
    gone: Option<Lost>,
    awaiting: Option<Awaiting>,
}

impl Member {
    pub fn new(rank: Rank, timeout: Duration) -> Member {
        Member {
            rank,
            timeout,
            inbox: VecDeque::new(),
            gone: None,
            awaiting: None,
        }
    }

    pub fn wakeup(&self) -> Option<Instant> {
        self.awaiting.as_ref().map(|a| a.deadline)
    }

    fn patience(&self, now: Instant) -> Instant {
        later(now, self.timeout.saturating_mul(MEMBER_PATIENCE))
    }

    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut actions = Vec::new();
        match event {
            Event::Call(call) => {
                if self.awaiting.is_some() {
                    actions.push(Action::Done(Err(Error::Internal {
                        rank: self.rank,
                        detail: "a control call was made while another was in progress".into(),
                    })));
                    return actions;
                }
                let step = Step::of(&call);
                let (msg, my_error) = match call {
                    Call::Agree(fingerprint) => (Msg::Agree { fingerprint }, None),
                    Call::Barrier => (Msg::Barrier, None),
                    Call::Finish(Ok(report)) => (
                        Msg::Status {
                            error: None,
                            report,
                        },
                        None,
                    ),
                    Call::Finish(Err(e)) => (
                        Msg::Status {
                            error: Some(e.clone()),
                            report: serde_json::Value::Null,
                        },
                        Some(e),
                    ),
                };
                if self.gone.is_none() {
                    actions.push(Action::Send { to: vec![0], msg });
                }
                self.awaiting = Some(Awaiting {
                    step,
                    my_error,
                    deadline: self.patience(now),
                });
                // what came while this rank was busy may already settle the call
                while self.awaiting.is_some() {
                    let Some(msg) = self.inbox.pop_front() else {
                        break;
                    };
                    self.answer(now, msg, &mut actions);
                }
            }
            Event::Message { from: 0, msg } => {
                if self.awaiting.is_some() {
                    self.answer(now, msg, &mut actions);
                } else if msg != Msg::Working {
                    self.inbox.push_back(msg);
                }
            }
            Event::Message { .. } => {}
            Event::Gone { peer: 0, lost } => self.gone = Some(lost),
            Event::Gone { .. } => {}
            Event::Tick => {}
        }
        if let Some(a) = &self.awaiting {
            let (rank, what) = (self.rank, a.step.what());
            if let Some(lost) = &self.gone {
                let error = match lost {
                    Lost::Closed => Error::PeerGone {
                        rank,
                        peer: 0,
                        detail: format!("connection closed during {what}"),
                    },
                    Lost::Stalled => Error::Timeout {
                        rank,
                        peer: 0,
                        waited: self.timeout,
                        detail: format!("rank 0 stopped reading during {what}"),
                    },
                    Lost::Broken(detail) => Error::Protocol {
                        rank,
                        peer: 0,
                        detail: format!("{what}: {detail}"),
                    },
                };
                self.settle(Err(error), &mut actions);
            } else if now >= a.deadline {
                let error = Error::Timeout {
                    rank,
                    peer: 0,
                    waited: self.timeout.saturating_mul(MEMBER_PATIENCE),
                    detail: format!("{what} did not complete"),
                };
                self.settle(Err(error), &mut actions);
            }
        }
        actions
    }

    fn settle(&mut self, outcome: Result<Vec<serde_json::Value>>, actions: &mut Vec<Action>) {
        self.awaiting = None;
        actions.push(Action::Done(outcome));
    }

    /// Takes rank 0's message `msg` as the answer to the call in progress, if it is one.
    fn answer(&mut self, now: Instant, msg: Msg, actions: &mut Vec<Action>) {
        let rank = self.rank;
        let deadline = self.patience(now);
        let Some(a) = self.awaiting.as_mut() else {
            return;
        };
        let outcome = match (a.step, msg) {
            // rank 0 is alive: its silence starts over
            (_, Msg::Working) => {
                a.deadline = deadline;
                return;
            }
            // a "go" still owed from a barrier this rank left early is not the verdict
            (Step::Finish, Msg::Go) => {
                a.deadline = deadline;
                return;
            }
            (Step::Agree | Step::Barrier, Msg::Go) => Ok(Vec::new()),
            (Step::Agree, Msg::Disagree { rank, difference }) => Err(difference.into_error(rank)),
            (Step::Agree | Step::Barrier, Msg::Verdict { failures }) => {
                Err(Error::JobFailed { rank, failures })
            }
            (Step::Finish, Msg::Verdict { failures }) => match (failures.is_empty(), &a.my_error) {
                (true, None) => Ok(Vec::new()),
                // whatever rank 0 says, a rank that failed never reports success
                (true, Some(e)) => Err(Error::JobFailed {
                    rank,
                    failures: vec![(rank, e.clone())],
                }),
                (false, _) => Err(Error::JobFailed { rank, failures }),
            },
            (step, other) => Err(Error::Protocol {
                rank,
                peer: 0,
                detail: format!("expected the answer to {}, got {other:?}", step.what()),
            }),
        };
        self.settle(outcome, actions);
    }
}
