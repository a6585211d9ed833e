//! A member's side of the control protocol: tells rank 0 where it is and waits for its
//! answer while rank 0 is heard from.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

use super::{Action, Call, Decision, Event, Lost, MEMBER_PATIENCE, Msg, Step, later};

/// A member's call in progress.
#[derive(Debug)]
struct Awaiting {
    step: Step,
    /// This rank's own error, when it finishes with one, or why it is not prepared, when it
    /// votes so.
    my_error: Option<String>,
    /// The decision only: whether this rank's prepared vote went out, so that rank 0 may
    /// have decided to commit.
    prepared: bool,
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
    /// Decisions this rank gave up waiting for (rank 0 silent past its patience) whose
    /// message may still come: rank 0 answers in the order of the calls, so each decision
    /// that comes while one is owed is that one, dropped, never taken for a later call's.
    owed: u32,
    /// Whether this rank made its finish call: rank 0's link closing after it is no loss.
    finished: bool,
    /// The first rank known to be lost (from rank 0's notice, or rank 0 itself), and how.
    lost: Option<(Rank, String)>,
}

impl Member {
    /// The side of member `rank`, whose waits are bounded by `timeout`.
    pub fn new(rank: Rank, timeout: Duration) -> Member {
        Member {
            rank,
            timeout,
            inbox: VecDeque::new(),
            gone: None,
            awaiting: None,
            owed: 0,
            finished: false,
            lost: None,
        }
    }

    /// The first rank known to be lost, and how ([`super::Machine::lost`]).
    pub fn lost(&self) -> Option<&(Rank, String)> {
        self.lost.as_ref()
    }

    /// When rank 0's silence will have lasted too long for the call in progress; `None`
    /// outside a call ([`super::Machine::wakeup`]).
    pub fn wakeup(&self) -> Option<Instant> {
        self.awaiting.as_ref().map(|a| a.deadline)
    }

    fn patience(&self, now: Instant) -> Instant {
        later(now, self.timeout.saturating_mul(MEMBER_PATIENCE))
    }

    /// Feeds one event that happened at `now`; returns what to do about it
    /// ([`super::Machine::handle`]).
    pub fn handle(&mut self, now: Instant, event: Event) -> Vec<Action> {
        let mut actions = Vec::new();
        match event {
            Event::Call(call) => {
                let step = Step::of(&call);
                if self.awaiting.is_some() {
                    let error = Error::Internal {
                        rank: self.rank,
                        detail: "a control call was made while another was in progress".into(),
                    };
                    actions.push(Action::refused(step, error));
                    return actions;
                }
                let prepared = matches!(call, Call::Decide(Ok(()))) && self.gone.is_none();
                self.finished |= matches!(call, Call::Finish(_));
                let (msg, my_error) = match call {
                    Call::Agree(fingerprint) => (Msg::Agree { fingerprint }, None),
                    Call::Barrier => (Msg::Barrier, None),
                    Call::Decide(Ok(())) => (Msg::Prepared, None),
                    Call::Decide(Err(why)) => (Msg::NotPrepared { why: why.clone() }, Some(why)),
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
                    prepared,
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
            Event::Message {
                from: 0,
                msg: Msg::Lost { rank, detail },
            } => {
                self.lost.get_or_insert((rank, detail));
            }
            Event::Message { from: 0, msg } => {
                if self.owed > 0 && matches!(msg, Msg::Commit | Msg::Abort { .. }) {
                    // the late decision this rank gave up on
                    self.owed -= 1;
                } else if self.awaiting.is_some() {
                    self.answer(now, msg, &mut actions);
                } else if msg != Msg::Working {
                    self.inbox.push_back(msg);
                }
            }
            Event::Message { .. } => {}
            Event::Gone { peer: 0, lost } => {
                if !self.finished {
                    self.lost.get_or_insert((0, super::describe(&lost)));
                }
                self.gone = Some(lost);
            }
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
                if a.step == Step::Decide {
                    self.owed += 1;
                }
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

    /// Settles the call in progress with `error`, or, in the decision, with what this rank
    /// can know without rank 0 (`error` saying how rank 0 was lost).
    fn settle(&mut self, outcome: Result<Vec<serde_json::Value>>, actions: &mut Vec<Action>) {
        let Some(a) = self.awaiting.take() else {
            return;
        };
        if a.step != Step::Decide {
            actions.push(Action::Done(outcome));
            return;
        }
        let lost = match outcome {
            Ok(_) => "rank 0 gave no decision".to_string(),
            Err(e) => e.to_string(),
        };
        actions.push(Action::Decided(if a.prepared {
            // rank 0 may have decided either way: neither commit nor drop
            Err(Error::InDoubt {
                rank: self.rank,
                detail: lost,
            })
        } else {
            // rank 0 cannot have decided to commit without this rank's prepared vote
            tracing::warn!(rank = self.rank, %lost, "no decision from rank 0; this rank aborts");
            Ok(Decision::Abort {
                ranks: vec![match a.my_error {
                    Some(why) => (self.rank, why),
                    None => (0, format!("lost before this rank could vote: {lost}")),
                }],
            })
        }));
    }

    /// Takes rank 0's message `msg` as the decision this rank waits for, if it is one.
    fn decision(&mut self, msg: Msg, actions: &mut Vec<Action>) {
        let rank = self.rank;
        let Some(a) = self.awaiting.as_ref() else {
            return;
        };
        let decision = match msg {
            Msg::Commit if a.prepared => Decision::Commit,
            Msg::Commit => {
                let error = Error::Protocol {
                    rank,
                    peer: 0,
                    detail: "rank 0 decided to commit, though this rank did not vote prepared"
                        .into(),
                };
                self.settle(Err(error), actions);
                return;
            }
            Msg::Abort { ranks } => Decision::Abort { ranks },
            // rank 0 ended the job without deciding: nobody commits
            Msg::Verdict { failures } if failures.is_empty() => Decision::Abort {
                ranks: vec![(0, "ended the job without a decision".into())],
            },
            Msg::Verdict { failures } => Decision::Abort { ranks: failures },
            other => {
                let error = Error::Protocol {
                    rank,
                    peer: 0,
                    detail: format!("expected the decision, got {other:?}"),
                };
                self.settle(Err(error), actions);
                return;
            }
        };
        self.awaiting = None;
        actions.push(Action::Decided(Ok(decision)));
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
            // a "go" still owed from a barrier this rank left early is not the verdict, nor the
            // decision; a decision this rank skipped (it failed before) is not the verdict
            (Step::Decide, Msg::Go) | (Step::Finish, Msg::Go | Msg::Commit | Msg::Abort { .. }) => {
                a.deadline = deadline;
                return;
            }
            (Step::Decide, msg) => {
                self.decision(msg, actions);
                return;
            }
            (Step::Agree | Step::Barrier, Msg::Go) => Ok(Vec::new()),
            (Step::Agree, Msg::Disagree { rank, difference }) => Err(difference.into_error(rank)),
            (Step::Agree | Step::Barrier, Msg::Verdict { failures }) => {
                Err(Error::JobFailed { rank, failures })
            }
            // rank 0 decided to abort while this rank was still at a barrier
            (Step::Agree | Step::Barrier, Msg::Abort { ranks }) => Err(Error::JobFailed {
                rank,
                failures: ranks,
            }),
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
