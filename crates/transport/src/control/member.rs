//! A member's side of the control protocol: tells rank 0 where it is and waits for its
//! answer while rank 0 is heard from.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

use super::{Action, Call, Event, Lost, MEMBER_PATIENCE, Msg, Step, later};

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
