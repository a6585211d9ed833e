//! Failure orders replayed against the control protocol, without processes, sockets or
//! sleeps: time is an instant the test moves.

use std::collections::VecDeque;

use serde_json::{Value, json};

use super::*;
use reshard_core::error::Error;

mod decide;
mod kills;
mod links;

/// The job's timeout.
const T: Duration = Duration::from_secs(1);

fn job(dtype: &str) -> Fingerprint {
    Fingerprint::new("run").with("--dtype", dtype)
}

fn from(rank: Rank, msg: Msg) -> Event {
    Event::Message { from: rank, msg }
}

fn closed(peer: Rank) -> Event {
    Event::Gone {
        peer,
        lost: Lost::Closed,
    }
}

fn status(report: Value) -> Msg {
    Msg::Status {
        error: None,
        report,
    }
}

fn failed_status(error: &str) -> Msg {
    Msg::Status {
        error: Some(error.into()),
        report: Value::Null,
    }
}

/// The messages among `actions`, and the outcome if the call settled.
type Split = (Vec<(Vec<Rank>, Msg)>, Option<Result<Vec<Value>>>);

fn split(actions: Vec<Action>) -> Split {
    let mut sends = Vec::new();
    let mut done = None;
    for a in actions {
        match a {
            Action::Send { to, msg } => sends.push((to, msg)),
            Action::Done(outcome) => {
                assert!(done.is_none(), "a call settled twice");
                done = Some(outcome);
            }
            Action::Decided(d) => panic!("a decision settled where none was asked for: {d:?}"),
        }
    }
    (sends, done)
}

/// The failures a settled call names; panics on any other outcome.
fn failures(outcome: Option<Result<Vec<Value>>>) -> Vec<(Rank, String)> {
    match outcome {
        Some(Err(Error::JobFailed { failures, .. })) => failures,
        other => panic!("expected the job to fail, got {other:?}"),
    }
}

fn ranks_of(failures: &[(Rank, String)]) -> Vec<Rank> {
    failures.iter().map(|(r, _)| *r).collect()
}

#[test]
fn rank_0_answers_go_once_every_member_reached_the_barrier() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    // member 1 gets there before rank 0, member 2 after
    assert!(c.handle(t0, from(1, Msg::Barrier)).is_empty());
    let (sends, done) = split(c.handle(t0, Event::Call(Call::Barrier)));
    assert!(sends.is_empty() && done.is_none());
    let (sends, done) = split(c.handle(t0 + T, from(2, Msg::Barrier)));
    assert_eq!(sends, vec![(vec![1, 2], Msg::Go)]);
    assert!(matches!(done, Some(Ok(v)) if v.is_empty()));
    assert_eq!(c.wakeup(), None, "nothing is due after the call");
}

#[test]
fn a_member_dead_before_the_barrier_fails_it_on_every_rank() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    c.handle(t0, closed(2));
    c.handle(t0, from(1, Msg::Barrier));
    let (sends, done) = split(c.handle(t0, Event::Call(Call::Barrier)));
    let f = failures(done);
    assert_eq!(f, vec![(2, "exited (killed?)".to_string())]);
    // the verdict goes to the living only
    assert_eq!(sends, vec![(vec![1], Msg::Verdict { failures: f })]);
    // and member 1 fails with it, naming rank 2
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(Call::Barrier));
    let (_, done) = split(m.handle(t0, from(0, sends[0].1.clone())));
    assert_eq!(ranks_of(&failures(done)), vec![2]);
}

#[test]
fn a_member_dead_after_the_barrier_fails_the_finish() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    c.handle(t0, from(1, Msg::Barrier));
    c.handle(t0, from(2, Msg::Barrier));
    let (_, done) = split(c.handle(t0, Event::Call(Call::Barrier)));
    assert!(matches!(done, Some(Ok(_))));
    c.handle(t0 + T, closed(2));
    c.handle(t0 + T, from(1, status(json!({"rank": 1}))));
    let (sends, done) = split(c.handle(t0 + T, Event::Call(Call::Finish(Ok(json!(0))))));
    let f = failures(done);
    assert_eq!(
        f,
        vec![(2, "exited without reporting (killed?)".to_string())]
    );
    assert_eq!(sends, vec![(vec![1], Msg::Verdict { failures: f })]);
}

#[test]
fn every_report_reaches_rank_0_and_the_verdict_every_member() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    c.handle(t0, Event::Call(Call::Finish(Ok(json!("zero")))));
    c.handle(t0, from(2, status(json!("two"))));
    let (sends, done) = split(c.handle(t0, from(1, status(json!("one")))));
    assert_eq!(sends, vec![(vec![1, 2], Msg::Verdict { failures: vec![] })]);
    assert_eq!(
        done.unwrap().unwrap(),
        vec![json!("zero"), json!("one"), json!("two")]
    );
    let mut m = Member::new(2, T);
    let (sends, _) = split(m.handle(t0, Event::Call(Call::Finish(Ok(json!("two"))))));
    assert_eq!(sends, vec![(vec![0], status(json!("two")))]);
    let (_, done) = split(m.handle(t0, from(0, Msg::Verdict { failures: vec![] })));
    assert!(matches!(done, Some(Ok(v)) if v.is_empty()));
}

#[test]
fn one_members_error_fails_the_members_that_succeeded() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(4, T);
    c.handle(t0, from(1, status(json!(1))));
    c.handle(
        t0,
        from(2, failed_status("rank 2: 3 transfers did not arrive")),
    );
    c.handle(t0, from(3, status(json!(3))));
    let (sends, done) = split(c.handle(t0, Event::Call(Call::Finish(Ok(json!(0))))));
    let f = failures(done);
    assert_eq!(
        f,
        vec![(2, "rank 2: 3 transfers did not arrive".to_string())]
    );
    let verdict = sends[0].1.clone();
    for rank in [1, 3] {
        let mut m = Member::new(rank, T);
        m.handle(t0, Event::Call(Call::Finish(Ok(json!(rank)))));
        let (_, done) = split(m.handle(t0, from(0, verdict.clone())));
        assert_eq!(ranks_of(&failures(done)), vec![2], "rank {rank}");
    }
}

#[test]
fn a_member_that_failed_never_reports_success() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(Call::Finish(Err("my own error".into()))));
    let (_, done) = split(m.handle(t0, from(0, Msg::Verdict { failures: vec![] })));
    assert_eq!(failures(done), vec![(1, "my own error".to_string())]);
}

#[test]
fn a_member_that_failed_before_the_barrier_is_named_at_it() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    // member 2 skips the barrier and reports its failure straight away
    c.handle(t0, from(2, failed_status("rank 2: peer rank 1 is gone")));
    c.handle(t0, from(1, Msg::Barrier));
    let (sends, done) = split(c.handle(t0, Event::Call(Call::Barrier)));
    assert_eq!(
        failures(done),
        vec![(2, "rank 2: peer rank 1 is gone".to_string())]
    );
    assert!(matches!(&sends[0], (to, Msg::Verdict { .. }) if to == &vec![1, 2]));
}

#[test]
fn a_member_at_a_barrier_rank_0_failed_before_hears_the_verdict() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(2, T);
    c.handle(t0, from(1, Msg::Barrier));
    let (sends, done) = split(c.handle(t0, Event::Call(Call::Finish(Err("boom".into())))));
    assert_eq!(failures(done), vec![(0, "boom".to_string())]);
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(Call::Barrier));
    let (_, done) = split(m.handle(t0, from(0, sends[0].1.clone())));
    assert_eq!(failures(done), vec![(0, "boom".to_string())]);
}

#[test]
fn silent_members_share_one_deadline_of_two_timeouts() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(4, T);
    c.handle(t0, from(2, Msg::Barrier));
    c.handle(t0, Event::Call(Call::Barrier));
    assert_eq!(c.wakeup(), Some(t0 + T), "the first heartbeat is due first");
    let just_before = t0 + 2 * T - Duration::from_millis(1);
    let (_, done) = split(c.handle(just_before, Event::Tick));
    assert!(done.is_none(), "gave up before two timeouts");
    let (sends, done) = split(c.handle(t0 + 2 * T, Event::Tick));
    let f = failures(done);
    assert_eq!(ranks_of(&f), vec![1, 3], "both silent members, at once");
    assert!(
        f[0].1.contains("timed out") && f[0].1.contains("the barrier"),
        "{f:?}"
    );
    assert!(matches!(sends.last(), Some((to, Msg::Verdict { .. })) if to == &vec![1, 2, 3]));
}

#[test]
fn a_report_that_comes_late_but_in_time_counts() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(2, T);
    c.handle(t0, Event::Call(Call::Finish(Ok(json!(0)))));
    let (_, done) = split(c.handle(t0 + T, Event::Tick));
    assert!(done.is_none());
    let late = t0 + 2 * T - Duration::from_millis(1);
    let (_, done) = split(c.handle(late, from(1, status(json!(1)))));
    assert_eq!(done.unwrap().unwrap(), vec![json!(0), json!(1)]);
}

#[test]
fn a_report_after_the_deadline_is_a_failure_and_then_ignored() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(2, T);
    c.handle(t0, Event::Call(Call::Finish(Ok(json!(0)))));
    let (_, done) = split(c.handle(t0 + 2 * T, Event::Tick));
    assert_eq!(ranks_of(&failures(done)), vec![1]);
    let (sends, done) = split(c.handle(t0 + 3 * T, from(1, status(json!(1)))));
    assert!(done.is_none());
    assert!(sends.is_empty());
}

#[test]
fn a_disagreement_at_the_agreement_reaches_every_member() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    c.handle(
        t0,
        from(
            1,
            Msg::Agree {
                fingerprint: job("bf16"),
            },
        ),
    );
    c.handle(
        t0,
        from(
            2,
            Msg::Agree {
                fingerprint: job("f32"),
            },
        ),
    );
    let (sends, done) = split(c.handle(t0, Event::Call(Call::Agree(job("bf16")))));
    match done {
        Some(Err(Error::Disagreement {
            rank,
            field,
            ours,
            theirs,
        })) => {
            assert_eq!((rank, field.as_str()), (2, "--dtype"));
            assert_eq!((ours.as_str(), theirs.as_str()), ("bf16", "f32"));
        }
        other => panic!("expected a disagreement, got {other:?}"),
    }
    let answer = match &sends[..] {
        [(to, m @ Msg::Disagree { rank: 2, .. })] if to == &vec![1, 2] => m.clone(),
        other => panic!("expected one disagreement for both members, got {other:?}"),
    };
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(Call::Agree(job("bf16"))));
    let (_, done) = split(m.handle(t0, from(0, answer)));
    assert!(matches!(
        done,
        Some(Err(Error::Disagreement { rank: 2, .. }))
    ));
}

#[test]
fn the_agreement_goes_on_when_every_job_matches() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(2, T);
    c.handle(t0, Event::Call(Call::Agree(job("bf16"))));
    let (sends, done) = split(c.handle(
        t0,
        from(
            1,
            Msg::Agree {
                fingerprint: job("bf16"),
            },
        ),
    ));
    assert_eq!(sends, vec![(vec![1], Msg::Go)]);
    assert!(matches!(done, Some(Ok(_))));
}

#[test]
fn rank_0_gone_while_a_member_waits_is_named() {
    let t0 = Instant::now();
    let mut m = Member::new(3, T);
    m.handle(t0, Event::Call(Call::Barrier));
    let (_, done) = split(m.handle(t0, closed(0)));
    assert!(
        matches!(
            done,
            Some(Err(Error::PeerGone {
                rank: 3,
                peer: 0,
                ..
            }))
        ),
        "{done:?}"
    );
}

#[test]
fn rank_0_gone_between_calls_fails_the_next_call_at_once() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, closed(0));
    let (sends, done) = split(m.handle(t0, Event::Call(Call::Finish(Ok(json!(1))))));
    assert!(sends.is_empty(), "nothing is sent on a closed link");
    assert!(matches!(done, Some(Err(Error::PeerGone { peer: 0, .. }))));
}

#[test]
fn a_lost_verdict_times_out_after_four_timeouts_of_silence() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(Call::Finish(Ok(json!(1)))));
    assert_eq!(m.wakeup(), Some(t0 + 4 * T));
    let (_, done) = split(m.handle(t0 + 4 * T - Duration::from_millis(1), Event::Tick));
    assert!(done.is_none());
    let (_, done) = split(m.handle(t0 + 4 * T, Event::Tick));
    match done {
        Some(Err(Error::Timeout {
            rank: 1,
            peer: 0,
            waited,
            detail,
        })) => {
            assert_eq!(waited, 4 * T);
            assert!(detail.contains("the verdict"), "{detail}");
        }
        other => panic!("expected a timeout naming rank 0, got {other:?}"),
    }
}

#[test]
fn a_verdict_that_came_before_the_report_and_a_closed_link_still_counts() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    // rank 0 failed at once, told everyone and exited, while this rank was still moving data
    m.handle(
        t0,
        from(
            0,
            Msg::Verdict {
                failures: vec![(0, "boom".into())],
            },
        ),
    );
    m.handle(t0, closed(0));
    let (_, done) = split(m.handle(t0 + T, Event::Call(Call::Finish(Ok(json!(1))))));
    assert_eq!(failures(done), vec![(0, "boom".to_string())]);
}

#[test]
fn a_go_owed_from_an_abandoned_barrier_is_not_the_verdict() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(Call::Barrier));
    let (_, done) = split(m.handle(t0 + 4 * T, Event::Tick));
    assert!(matches!(done, Some(Err(Error::Timeout { .. }))));
    // the go arrives late, between calls, then the verdict after this rank's report
    m.handle(t0 + 5 * T, from(0, Msg::Go));
    let (_, done) = split(m.handle(t0 + 5 * T, Event::Call(Call::Finish(Err("late".into())))));
    assert!(done.is_none(), "the late go settled the finish");
    let verdict = Msg::Verdict {
        failures: vec![(1, "late".into())],
    };
    let (_, done) = split(m.handle(t0 + 5 * T, from(0, verdict)));
    assert_eq!(ranks_of(&failures(done)), vec![1]);
}

#[test]
fn unexpected_messages_are_named_not_obeyed() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(Call::Barrier));
    let (_, done) = split(m.handle(t0, from(0, Msg::Barrier)));
    assert!(matches!(
        done,
        Some(Err(Error::Protocol {
            rank: 1,
            peer: 0,
            ..
        }))
    ));
    // a member that sends rank 0 something out of place fails the call, named
    let mut c = Coordinator::new(2, T);
    c.handle(t0, from(1, Msg::Go));
    let (_, done) = split(c.handle(t0, Event::Call(Call::Barrier)));
    let f = failures(done);
    assert_eq!(ranks_of(&f), vec![1]);
    assert!(f[0].1.contains("Go"), "{f:?}");
    // and one whose link breaks is named with what broke
    let mut c = Coordinator::new(2, T);
    c.handle(t0, Event::Call(Call::Barrier));
    let lost = Lost::Broken("sent a malformed control message: bad magic".into());
    let (_, done) = split(c.handle(t0, Event::Gone { peer: 1, lost }));
    assert!(failures(done)[0].1.contains("bad magic"));
}

#[test]
fn rank_0_beats_for_waiting_members_only_while_they_wait() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    assert_eq!(c.wakeup(), None, "nobody waits: nothing is due");
    c.handle(t0, from(2, status(json!(2))));
    assert_eq!(c.wakeup(), Some(t0 + T));
    let (sends, _) = split(c.handle(t0 + T, Event::Tick));
    assert_eq!(sends, vec![(vec![2], Msg::Working)]);
    assert_eq!(c.wakeup(), Some(t0 + 2 * T));
    // a late wake keeps the pace rather than drifting
    let (sends, _) = split(c.handle(t0 + 2 * T + T / 2, Event::Tick));
    assert_eq!(sends, vec![(vec![2], Msg::Working)]);
    assert_eq!(c.wakeup(), Some(t0 + 3 * T));
    c.handle(t0 + 3 * T, from(1, status(json!(1))));
    c.handle(t0 + 3 * T, Event::Call(Call::Finish(Ok(json!(0)))));
    assert_eq!(c.wakeup(), None, "answered: nobody waits");
}

/// A whole job of machines over a simulated network: messages arrive in the order they were
/// sent, a killed rank's links close, a stopped rank neither hears, speaks nor wakes.
struct Net {
    now: Instant,
    machines: Vec<Machine>,
    /// In flight: (from, to, message).
    wire: VecDeque<(Rank, Rank, Msg)>,
    killed: Vec<bool>,
    stopped: Vec<bool>,
    outcomes: Vec<Option<Result<Vec<Value>>>>,
    /// What each rank's decision settled to.
    decisions: Vec<Option<Result<Decision>>>,
}

impl Net {
    fn new(world: usize) -> Net {
        Net {
            now: Instant::now(),
            machines: (0..world).map(|r| Machine::new(r, world, T)).collect(),
            wire: VecDeque::new(),
            killed: vec![false; world],
            stopped: vec![false; world],
            outcomes: (0..world).map(|_| None).collect(),
            decisions: (0..world).map(|_| None).collect(),
        }
    }

    fn feed(&mut self, rank: Rank, event: Event) {
        if self.killed[rank] || self.stopped[rank] {
            return;
        }
        for action in self.machines[rank].handle(self.now, event) {
            match action {
                Action::Send { to, msg } => {
                    for t in to {
                        self.wire.push_back((rank, t, msg.clone()));
                    }
                }
                Action::Done(outcome) => {
                    assert!(self.outcomes[rank].is_none(), "rank {rank} settled twice");
                    self.outcomes[rank] = Some(outcome);
                }
                Action::Decided(d) => {
                    assert!(self.decisions[rank].is_none(), "rank {rank} decided twice");
                    self.decisions[rank] = Some(d);
                }
            }
        }
    }

    /// Every living rank makes `call` (its outcome is taken first), then the network settles.
    fn call_all(&mut self, call: impl Fn(Rank) -> Call) {
        for r in 0..self.machines.len() {
            self.call(r, call(r));
        }
        self.deliver();
    }

    /// Rank `rank` makes `call` (its previous outcome is taken first).
    fn call(&mut self, rank: Rank, call: Call) {
        self.outcomes[rank] = None;
        self.feed(rank, Event::Call(call));
    }

    fn deliver(&mut self) {
        while let Some((f, t, msg)) = self.wire.pop_front() {
            if self.killed[t] || self.stopped[t] || self.stopped[f] {
                continue;
            }
            self.feed(t, from(f, msg));
        }
    }

    fn kill(&mut self, rank: Rank) {
        self.killed[rank] = true;
        let peers: Vec<Rank> = if rank == 0 {
            (1..self.machines.len()).collect()
        } else {
            vec![0]
        };
        for p in peers {
            let peer = rank;
            self.feed(
                p,
                Event::Gone {
                    peer,
                    lost: Lost::Closed,
                },
            );
        }
        self.deliver();
    }

    /// Moves time on by `d`, in steps of a quarter timeout, waking every rank at each.
    fn wait(&mut self, d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.now = (self.now + T / 4).min(end);
            for r in 0..self.machines.len() {
                self.feed(r, Event::Tick);
            }
            self.deliver();
        }
    }

    fn settled(&self, rank: Rank) -> bool {
        self.outcomes[rank].is_some()
    }

    /// Every rank but `except` failed, naming rank `named`.
    fn all_failed_naming(&self, named: Rank, except: Rank) {
        for (r, o) in self
            .outcomes
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != except)
        {
            match o {
                Some(Err(e)) => assert!(
                    e.to_string().contains(&format!("rank {named}")),
                    "rank {r}: {e}"
                ),
                other => panic!("rank {r}: expected a failure naming rank {named}, got {other:?}"),
            }
        }
    }
}

#[test]
fn a_whole_job_agrees_passes_barriers_and_reports() {
    let mut net = Net::new(4);
    net.call_all(|_| Call::Agree(job("bf16")));
    net.call_all(|_| Call::Barrier);
    net.call_all(|_| Call::Barrier);
    assert!(net.outcomes.iter().all(|o| matches!(o, Some(Ok(_)))));
    net.call_all(|r| Call::Finish(Ok(json!(r))));
    let reports = net.outcomes[0].take().unwrap().unwrap();
    assert_eq!(reports, vec![json!(0), json!(1), json!(2), json!(3)]);
    for r in 1..4 {
        assert!(
            matches!(&net.outcomes[r], Some(Ok(v)) if v.is_empty()),
            "rank {r}"
        );
    }
}

#[test]
fn a_member_killed_in_its_data_phase_fails_every_other_rank() {
    let mut net = Net::new(4);
    net.call_all(|_| Call::Barrier);
    net.kill(2);
    net.call_all(|r| {
        Call::Finish(if r == 1 {
            Err("rank 1: peer rank 2 is gone".into())
        } else {
            Ok(json!(r))
        })
    });
    net.all_failed_naming(2, 2);
}

#[test]
fn rank_0_killed_in_its_data_phase_fails_every_member() {
    let mut net = Net::new(3);
    net.call_all(|_| Call::Barrier);
    for r in 1..3 {
        net.call(r, Call::Finish(Ok(json!(r))));
    }
    net.deliver();
    net.kill(0);
    net.all_failed_naming(0, 0);
}

#[test]
fn rank_0_stopped_fails_every_member_after_four_timeouts() {
    let mut net = Net::new(3);
    net.call_all(|_| Call::Barrier);
    net.stopped[0] = true;
    for r in 1..3 {
        net.call(r, Call::Finish(Ok(json!(r))));
    }
    net.wait(4 * T - T / 4);
    assert!(
        !net.settled(1) && !net.settled(2),
        "gave up before four timeouts"
    );
    net.wait(T / 4);
    net.all_failed_naming(0, 0);
}

/// Rank 0's own part outlasts the members' patience (a large local copy): its heartbeats keep
/// them waiting, and the job succeeds on every rank. Without them the members gave up after
/// four timeouts while rank 0 went on to report success.
#[test]
fn a_long_data_phase_on_rank_0_keeps_its_members_waiting() {
    let mut net = Net::new(3);
    net.call_all(|_| Call::Barrier);
    for r in 1..3 {
        net.call(r, Call::Finish(Ok(json!(r))));
    }
    net.deliver();
    net.wait(20 * T);
    assert!(!net.settled(1) && !net.settled(2));
    net.call(0, Call::Finish(Ok(json!(0))));
    net.deliver();
    assert!(
        net.outcomes.iter().all(|o| matches!(o, Some(Ok(_)))),
        "{:?}",
        net.outcomes
    );
}

/// A barrier rank 0 reaches late (its previous repetition's data phase was long) is waited for.
#[test]
fn a_barrier_rank_0_reaches_late_is_waited_for() {
    let mut net = Net::new(2);
    net.call(1, Call::Barrier);
    net.deliver();
    net.wait(10 * T);
    assert!(!net.settled(1));
    net.call(0, Call::Barrier);
    net.deliver();
    assert!(net.outcomes.iter().all(|o| matches!(o, Some(Ok(_)))));
}

/// A library caller may pass any timeout: the longest one does not overflow the clock.
#[test]
fn the_longest_timeout_does_not_overflow() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(2, Duration::MAX);
    c.handle(t0, from(1, Msg::Barrier));
    let (_, done) = split(c.handle(t0, Event::Call(Call::Barrier)));
    assert!(matches!(done, Some(Ok(_))));
    c.handle(t0, Event::Call(Call::Finish(Ok(json!(0)))));
    assert!(c.wakeup().is_some_and(|w| w > t0));
    let mut m = Member::new(1, Duration::MAX);
    m.handle(t0, Event::Call(Call::Barrier));
    assert!(m.wakeup().is_some_and(|w| w > t0));
}

/// A member whose link closes before it reported is lost: rank 0 knows at once, between
/// calls, and tells every other member; one that reported (its finish) is not.
#[test]
fn rank_0_tells_the_members_at_once_of_a_member_lost_before_it_reported() {
    let t0 = Instant::now();
    let mut root = Coordinator::new(4, T);
    assert!(root.lost().is_none());
    // rank 3 finishes, then its link closes: no loss
    let (sends, _) = split(root.handle(t0, from(3, status(json!(null)))));
    assert!(sends.is_empty());
    let (sends, _) = split(root.handle(t0, closed(3)));
    assert!(sends.is_empty() && root.lost().is_none());
    // rank 2 is killed between two calls: ranks 1 hears it (rank 3 is gone)
    let (sends, _) = split(root.handle(t0, closed(2)));
    let (rank, detail) = root.lost().cloned().unwrap();
    assert_eq!(rank, 2);
    assert!(detail.contains("closed before it reported"), "{detail}");
    assert_eq!(sends, vec![(vec![1], Msg::Lost { rank: 2, detail })]);
}

/// A member learns of a lost rank from rank 0's notice, in a call or not, and of rank 0
/// itself when its link closes before this rank finished; never after.
#[test]
fn a_member_knows_the_lost_rank_from_rank_0_or_from_rank_0s_link() {
    let t0 = Instant::now();
    let mut member = Member::new(1, T);
    let notice = Msg::Lost {
        rank: 3,
        detail: "killed".into(),
    };
    assert!(member.handle(t0, from(0, notice)).is_empty());
    assert_eq!(member.lost(), Some(&(3, "killed".to_string())));
    // the first loss stays the one named
    member.handle(t0, closed(0));
    assert_eq!(member.lost().map(|l| l.0), Some(3));

    let mut member = Member::new(1, T);
    member.handle(t0, closed(0));
    assert_eq!(member.lost().map(|l| l.0), Some(0));

    let mut member = Member::new(1, T);
    member.handle(t0, Event::Call(Call::Finish(Ok(json!(null)))));
    member.handle(t0, closed(0));
    assert!(
        member.lost().is_none(),
        "rank 0 exits after the finish: no loss"
    );
}
