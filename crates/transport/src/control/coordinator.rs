//! Rank 0's side of the control protocol: hears every member, decides for all, and tells
//! waiting members it is still at work.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use reshard_core::agreement::Fingerprint;
use reshard_core::error::Error;
use reshard_core::layout::Rank;

use super::{Action, COORDINATOR_PATIENCE, Call, Decision, Event, Lost, Msg, Step, later};

/// Why a member that voted prepared and was lost before the decision is not prepared.
const PREPARED_THEN_LOST: &str = "voted prepared, then was lost before the decision (killed?)";

/// What rank 0 learned of one member in the current call.
#[derive(Clone, Debug)]
enum Heard {
    /// Nothing yet.
    Pending,
    /// Agreement: the member's job.
    Job(Fingerprint),
    /// Barrier: it got there. Decision: it voted prepared. Finish: its report (`Null` for a
    /// member still at a barrier or a decision this rank failed before; the verdict answers
    /// it).
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
    /// Per member, the votes of decisions already settled without them (rank 0 gave up
    /// waiting at the deadline) that may still come: each is dropped when it does, so that
    /// a late vote is never taken for a later decision's, nor for a barrier or a report.
    late: Vec<u32>,
    /// Members that reported (their finish): their link closing after it is no loss.
    reported: Vec<bool>,
    /// The first member lost before it reported, and how.
    lost: Option<(Rank, String)>,
}

impl Coordinator {
    /// Rank 0's side of a job of `world` ranks whose waits are bounded by `timeout`.
    pub fn new(world: usize, timeout: Duration) -> Coordinator {
        Coordinator {
            world,
            timeout,
            inbox: vec![VecDeque::new(); world],
            gone: vec![None; world],
            waiting: vec![false; world],
            collecting: None,
            next_beat: None,
            late: vec![0; world],
            reported: vec![false; world],
            lost: None,
        }
    }

    /// The first member lost before it reported, and how ([`super::Machine::lost`]).
    pub fn lost(&self) -> Option<&(Rank, String)> {
        self.lost.as_ref()
    }

    /// When the driver must feed a tick at the latest: the call's deadline or the next
    /// heartbeat to waiting members, whichever comes first ([`super::Machine::wakeup`]).
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

    /// Feeds one event that happened at `now`; returns what to do about it
    /// ([`super::Machine::handle`]).
    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut actions = Vec::new();
        match event {
            Event::Call(call) => {
                let step = Step::of(&call);
                if self.collecting.is_some() {
                    let error = Error::Internal {
                        rank: 0,
                        detail: "a control call was made while another was in progress".into(),
                    };
                    actions.push(Action::refused(step, error));
                    return actions;
                }
                let heard = vec![Heard::Pending; self.world];
                self.collecting = Some(Collecting {
                    step,
                    mine: call,
                    deadline: later(now, self.timeout.saturating_mul(COORDINATOR_PATIENCE)),
                    heard,
                    pending: self.world.saturating_sub(1),
                });
                for r in 1..self.world {
                    self.take(r);
                }
            }
            Event::Message { from, msg } => {
                // members have no reason to send heartbeats: one is dropped, not answered
                let member = (1..self.world).contains(&from) && self.gone[from].is_none();
                // a member's messages come in the order of its calls: a vote while one is late
                // is that late vote, for a decision already settled without it
                let stale = member
                    && matches!(msg, Msg::Prepared | Msg::NotPrepared { .. })
                    && self.late[from] > 0;
                if stale {
                    self.late[from] -= 1;
                } else if member && msg != Msg::Working {
                    if matches!(msg, Msg::Status { .. }) {
                        self.reported[from] = true;
                    }
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
                    if !self.reported[peer] {
                        let detail = super::describe(&lost);
                        let others: Vec<Rank> =
                            self.alive().into_iter().filter(|&r| r != peer).collect();
                        if !others.is_empty() {
                            actions.push(Action::Send {
                                to: others,
                                msg: Msg::Lost {
                                    rank: peer,
                                    detail: detail.clone(),
                                },
                            });
                        }
                        self.lost.get_or_insert((peer, detail));
                    }
                    self.gone[peer] = Some(lost);
                    self.waiting[peer] = false;
                    self.take(peer);
                    self.forfeit(peer);
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
        let skipped = match self.inbox[r].front() {
            // a member that failed went straight to finish: its report is its vote, and stays
            // for rank 0's finish, which answers it
            Some(Msg::Status { error, .. }) if c.step == Step::Decide => Some(
                error
                    .clone()
                    .unwrap_or_else(|| "reported before voting".into()),
            ),
            _ => None,
        };
        let heard = if let Some(why) = skipped {
            Heard::Failed(why)
        } else if let Some(msg) = self.inbox[r].pop_front() {
            match (c.step, msg) {
                (Step::Agree, Msg::Agree { fingerprint }) => Heard::Job(fingerprint),
                (Step::Barrier, Msg::Barrier) => Heard::Fine(serde_json::Value::Null),
                // a prepared member already lost: what it staged is gone with it
                (Step::Decide, Msg::Prepared) if self.gone[r].is_some() => {
                    Heard::Failed(PREPARED_THEN_LOST.into())
                }
                (Step::Decide, Msg::Prepared) => Heard::Fine(serde_json::Value::Null),
                (_, Msg::NotPrepared { why }) => Heard::Failed(why),
                (Step::Decide, Msg::Barrier) => {
                    Heard::Failed("was still at a barrier, so not prepared".into())
                }
                (
                    Step::Finish,
                    Msg::Status {
                        error: None,
                        report,
                    },
                ) => Heard::Fine(report),
                // still waiting at the barrier this rank failed before: it hears the verdict
                (Step::Finish, Msg::Barrier) => Heard::Fine(serde_json::Value::Null),
                // still waiting for a decision this rank skipped (it failed before, whichever
                // decisions it made earlier): the same. A rank 0 that reports success made
                // every decision of the job, so there it is a vote for none.
                (Step::Finish, Msg::Prepared) if matches!(c.mine, Call::Finish(Err(_))) => {
                    Heard::Fine(serde_json::Value::Null)
                }
                (step, Msg::Status { error, .. }) => Heard::Failed(error.unwrap_or_else(|| {
                    match step {
                        Step::Agree => "reported before the plan agreement",
                        _ => "reported before the barrier",
                    }
                    .into()
                })),
                (Step::Agree, other) => Heard::Failed(format!("sent {other:?} instead of its job")),
                (Step::Barrier, other) => Heard::Failed(format!("sent {other:?} at the barrier")),
                (Step::Decide, other) => {
                    Heard::Failed(format!("sent {other:?} instead of its vote"))
                }
                (Step::Finish, other) => {
                    Heard::Failed(format!("sent {other:?} instead of a report"))
                }
            }
        } else if let Some(lost) = &self.gone[r] {
            Heard::Failed(match (lost, c.step) {
                (Lost::Closed, Step::Finish) => "exited without reporting (killed?)".into(),
                (Lost::Closed, Step::Decide) => "exited before voting (killed?)".into(),
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

    /// A member lost after its prepared vote was taken, before the decision: not prepared
    /// after all (presumed abort).
    fn forfeit(&mut self, r: Rank) {
        if let Some(c) = self.collecting.as_mut().filter(|c| c.step == Step::Decide)
            && matches!(c.heard[r], Heard::Fine(_))
        {
            c.heard[r] = Heard::Failed(PREPARED_THEN_LOST.into());
        }
    }

    /// Members still silent at the deadline count as failed.
    fn expire(&mut self, now: Instant) {
        let timeout = self.timeout;
        let Some(c) = self.collecting.as_mut().filter(|c| now >= c.deadline) else {
            return;
        };
        for (peer, h) in c.heard.iter_mut().enumerate().skip(1) {
            if matches!(h, Heard::Pending) {
                if c.step == Step::Decide {
                    // its vote may still come, after the decision that went without it
                    self.late[peer] += 1;
                }
                let waited = timeout.saturating_mul(COORDINATOR_PATIENCE);
                *h = Heard::Failed(
                    Error::Timeout {
                        rank: 0,
                        peer,
                        waited,
                        detail: match c.step {
                            Step::Decide => "its vote did not arrive".into(),
                            step => format!("{} did not complete", step.what()),
                        },
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
        match c.mine.clone() {
            Call::Finish(Ok(r)) => reports[0] = r,
            Call::Finish(Err(e)) | Call::Decide(Err(e)) => failures.push((0, e)),
            _ => {}
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
        if c.step == Step::Decide {
            let (msg, decision) = if failures.is_empty() {
                (Msg::Commit, Decision::Commit)
            } else {
                (
                    Msg::Abort {
                        ranks: failures.clone(),
                    },
                    Decision::Abort { ranks: failures },
                )
            };
            // every living member's link carries the decision before this rank may apply it
            actions.push(Action::Send { to, msg });
            actions.push(Action::Decided(Ok(decision)));
            return;
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
