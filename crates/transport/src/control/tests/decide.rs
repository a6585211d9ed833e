//! The two-phase decision, failure order by failure order, against the machine alone.

use super::*;

/// The messages among `actions`, and the decision if it settled.
type Decided = (Vec<(Vec<Rank>, Msg)>, Option<Result<Decision>>);

fn decided(actions: Vec<Action>) -> Decided {
    let mut sends = Vec::new();
    let mut done = None;
    for a in actions {
        match a {
            Action::Send { to, msg } => sends.push((to, msg)),
            Action::Decided(d) => {
                assert!(done.is_none(), "a decision settled twice");
                done = Some(d);
            }
            Action::Done(o) => panic!("a call other than the decision settled: {o:?}"),
        }
    }
    (sends, done)
}

const YES: Call = Call::Decide(Ok(()));

fn no(why: &str) -> Call {
    Call::Decide(Err(why.into()))
}

/// The ranks an abort names; panics on any other outcome.
fn aborted(outcome: &Option<Result<Decision>>) -> Vec<(Rank, String)> {
    match outcome {
        Some(Ok(Decision::Abort { ranks })) => ranks.clone(),
        other => panic!("expected an abort, got {other:?}"),
    }
}

fn committed(outcome: &Option<Result<Decision>>) -> bool {
    matches!(outcome, Some(Ok(Decision::Commit)))
}

/// The detail of an in-doubt outcome; panics on any other.
fn in_doubt(rank: Rank, outcome: &Option<Result<Decision>>) -> String {
    match outcome {
        Some(Err(Error::InDoubt { rank: r, detail })) if *r == rank => detail.clone(),
        other => panic!("expected rank {rank} in doubt, got {other:?}"),
    }
}

impl Net {
    /// Every rank's decision, after every living rank voted as `vote` says.
    fn decide_all(&mut self, vote: impl Fn(Rank) -> Call) {
        for r in 0..self.machines.len() {
            self.decide(r, vote(r));
        }
        self.deliver();
    }

    fn decide(&mut self, rank: Rank, vote: Call) {
        self.decisions[rank] = None;
        self.feed(rank, Event::Call(vote));
    }

    /// The living ranks never disagree: no rank commits while another aborts, and every
    /// living rank that settled says which (or that it is in doubt).
    fn consistent(&self) {
        let commits = self.decisions.iter().filter(|d| committed(d)).count();
        let aborts = self
            .decisions
            .iter()
            .filter(|d| matches!(d, Some(Ok(Decision::Abort { .. }))))
            .count();
        assert!(
            commits == 0 || aborts == 0,
            "some ranks commit, others abort: {:?}",
            self.decisions
        );
        for d in self.decisions.iter().flatten() {
            assert!(
                matches!(d, Ok(_) | Err(Error::InDoubt { .. })),
                "a decision that is neither commit, abort nor in doubt: {d:?}"
            );
        }
    }
}

#[test]
fn every_rank_prepared_commits_on_every_rank() {
    let mut net = Net::new(4);
    net.call_all(|_| Call::Agree(job("bf16")));
    net.call_all(|_| Call::Barrier);
    net.decide_all(|_| YES);
    assert!(net.decisions.iter().all(committed), "{:?}", net.decisions);
    // and the finish that follows, the decision's acknowledgement, succeeds
    net.call_all(|r| Call::Finish(Ok(json!(r))));
    assert!(net.outcomes.iter().all(|o| matches!(o, Some(Ok(_)))));
}

#[test]
fn one_member_not_prepared_aborts_every_rank_naming_it() {
    let mut net = Net::new(4);
    net.decide_all(|r| {
        if r == 2 {
            no("rank 2: 3 chunks did not arrive")
        } else {
            YES
        }
    });
    for r in 0..4 {
        assert_eq!(
            aborted(&net.decisions[r]),
            vec![(2, "rank 2: 3 chunks did not arrive".to_string())],
            "rank {r}"
        );
    }
}

#[test]
fn rank_0_not_prepared_aborts_every_rank_naming_it() {
    let mut net = Net::new(3);
    net.decide_all(|r| if r == 0 { no("checksum mismatch") } else { YES });
    for r in 0..3 {
        assert_eq!(
            aborted(&net.decisions[r]),
            vec![(0, "checksum mismatch".to_string())]
        );
    }
}

#[test]
fn a_member_dead_before_its_vote_aborts_the_others() {
    let mut net = Net::new(3);
    net.call_all(|_| Call::Barrier);
    net.kill(2);
    net.decide_all(|_| YES);
    for r in [0, 1] {
        assert_eq!(
            aborted(&net.decisions[r]),
            vec![(2, "exited before voting (killed?)".to_string())],
            "rank {r}"
        );
    }
}

/// Rank 0 holds the vote of a member it then loses, before it votes itself: presumed abort.
#[test]
fn a_member_dead_after_its_prepared_vote_before_the_decision_aborts() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    c.handle(t0, from(1, Msg::Prepared));
    c.handle(t0, from(2, Msg::Prepared));
    c.handle(t0, closed(2));
    let (sends, done) = decided(c.handle(t0, Event::Call(YES)));
    let ranks = aborted(&done);
    assert_eq!(ranks_of(&ranks), vec![2]);
    assert!(ranks[0].1.contains("voted prepared"), "{ranks:?}");
    assert_eq!(sends, vec![(vec![1], Msg::Abort { ranks })]);
    // the same when rank 0 took the vote before it heard of the loss
    let mut c = Coordinator::new(3, T);
    c.handle(t0, Event::Call(YES));
    c.handle(t0, from(2, Msg::Prepared));
    c.handle(t0, closed(2));
    let (_, done) = decided(c.handle(t0, from(1, Msg::Prepared)));
    assert_eq!(ranks_of(&aborted(&done)), vec![2]);
}

#[test]
fn a_member_dead_after_the_decision_changes_nothing_and_finish_names_it() {
    let mut net = Net::new(3);
    net.decide_all(|_| YES);
    net.kill(2);
    assert!(net.decisions.iter().all(committed));
    net.call_all(|r| Call::Finish(Ok(json!(r))));
    net.all_failed_naming(2, 2);
}

#[test]
fn rank_0_dead_before_deciding_leaves_prepared_members_in_doubt() {
    let mut net = Net::new(4);
    for r in 1..4 {
        let vote = if r == 3 {
            no("rank 3: staging full")
        } else {
            YES
        };
        net.decide(r, vote);
    }
    net.deliver();
    net.kill(0);
    for r in [1, 2] {
        let detail = in_doubt(r, &net.decisions[r]);
        assert!(detail.contains("peer rank 0 is gone"), "{detail}");
    }
    // the member that was not prepared knows the decision without rank 0
    assert_eq!(
        aborted(&net.decisions[3]),
        vec![(3, "rank 3: staging full".to_string())]
    );
    net.consistent();
    let text = net.decisions[1]
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("rank 1: in doubt") && text.contains("rank 0"),
        "{text}"
    );
}

/// Rank 0 decided to commit (and may apply it) but died before any link carried it.
#[test]
fn rank_0_dead_after_deciding_before_sending_leaves_members_in_doubt() {
    let mut net = Net::new(3);
    for r in 1..3 {
        net.decide(r, YES);
    }
    net.deliver();
    net.decide(0, YES);
    assert!(committed(&net.decisions[0]));
    net.wire.clear();
    net.kill(0);
    for r in [1, 2] {
        in_doubt(r, &net.decisions[r]);
    }
    net.consistent();
}

/// Rank 0 killed mid-broadcast: the member that heard the commit commits, the other is in
/// doubt, and nobody aborts.
#[test]
fn rank_0_dead_while_sending_the_decision_splits_commit_and_doubt() {
    let mut net = Net::new(3);
    for r in 1..3 {
        net.decide(r, YES);
    }
    net.deliver();
    net.decide(0, YES);
    net.wire.retain(|&(_, to, _)| to == 1);
    net.deliver();
    net.kill(0);
    assert!(committed(&net.decisions[0]) && committed(&net.decisions[1]));
    in_doubt(2, &net.decisions[2]);
    net.consistent();
    // the same with an abort: the other is in doubt, and nobody commits
    let mut net = Net::new(3);
    net.decide(1, YES);
    net.decide(2, YES);
    net.deliver();
    net.decide(0, no("rank 0: out of staging"));
    net.wire.retain(|&(_, to, _)| to == 2);
    net.deliver();
    net.kill(0);
    assert_eq!(ranks_of(&aborted(&net.decisions[2])), vec![0]);
    in_doubt(1, &net.decisions[1]);
    net.consistent();
}

#[test]
fn rank_0_dead_after_sending_the_decision_every_member_applies_it() {
    let mut net = Net::new(3);
    net.decide_all(|_| YES);
    net.kill(0);
    assert!(net.decisions.iter().all(committed));
    // their finish fails naming rank 0; what they applied stands
    for r in 1..3 {
        net.call(r, Call::Finish(Ok(json!(r))));
    }
    net.all_failed_naming(0, 0);
}

/// The decision never arrives while the link stands (rank 0 stopped): a prepared member is
/// in doubt after four timeouts of silence, not before.
#[test]
fn a_lost_decision_leaves_a_prepared_member_in_doubt_after_four_timeouts() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    let (sends, _) = decided(m.handle(t0, Event::Call(YES)));
    assert_eq!(sends, vec![(vec![0], Msg::Prepared)]);
    assert_eq!(m.wakeup(), Some(t0 + 4 * T));
    let (_, done) = decided(m.handle(t0 + 4 * T - Duration::from_millis(1), Event::Tick));
    assert!(done.is_none(), "gave up before four timeouts");
    let (_, done) = decided(m.handle(t0 + 4 * T, Event::Tick));
    let detail = in_doubt(1, &done);
    assert!(
        detail.contains("timed out") && detail.contains("the decision"),
        "{detail}"
    );
    // the decision that comes late is not taken for the finish's verdict
    m.handle(t0 + 5 * T, from(0, Msg::Commit));
    let (_, done) = split(m.handle(t0 + 5 * T, Event::Call(Call::Finish(Ok(json!(1))))));
    assert!(done.is_none());
    let (_, done) = split(m.handle(t0 + 5 * T, from(0, Msg::Verdict { failures: vec![] })));
    assert!(matches!(done, Some(Ok(_))));
}

/// Rank 0 stopped (SIGSTOP) over the whole network: the prepared members are in doubt.
#[test]
fn rank_0_stopped_before_deciding_leaves_every_prepared_member_in_doubt() {
    let mut net = Net::new(3);
    net.stopped[0] = true;
    for r in 1..3 {
        net.decide(r, YES);
    }
    net.wait(4 * T - T / 4);
    assert!(net.decisions.iter().all(Option::is_none));
    net.wait(T / 4);
    for r in 1..3 {
        in_doubt(r, &net.decisions[r]);
    }
}

/// Rank 0's own part is long: its heartbeats keep the prepared members waiting for it.
#[test]
fn a_long_part_on_rank_0_keeps_prepared_members_waiting() {
    let mut net = Net::new(3);
    for r in 1..3 {
        net.decide(r, YES);
    }
    net.deliver();
    net.wait(20 * T);
    assert!(net.decisions.iter().all(Option::is_none));
    net.decide(0, YES);
    net.deliver();
    assert!(net.decisions.iter().all(committed), "{:?}", net.decisions);
}

#[test]
fn a_vote_that_never_arrives_aborts_after_two_timeouts() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(3, T);
    c.handle(t0, from(1, Msg::Prepared));
    c.handle(t0, Event::Call(YES));
    let (_, done) = decided(c.handle(t0 + 2 * T - Duration::from_millis(1), Event::Tick));
    assert!(done.is_none(), "gave up before two timeouts");
    let (sends, done) = decided(c.handle(t0 + 2 * T, Event::Tick));
    let ranks = aborted(&done);
    assert_eq!(ranks_of(&ranks), vec![2]);
    assert!(ranks[0].1.contains("its vote did not arrive"), "{ranks:?}");
    assert_eq!(sends.last(), Some(&(vec![1, 2], Msg::Abort { ranks })));
    // the vote that comes after the decision changes nothing
    let (sends, done) = decided(c.handle(t0 + 3 * T, from(2, Msg::Prepared)));
    assert!(sends.is_empty() && done.is_none());
}

/// A member whose vote comes after rank 0 gave up on it finds the abort waiting.
#[test]
fn a_late_voter_finds_the_abort_waiting() {
    let t0 = Instant::now();
    let mut m = Member::new(2, T);
    let abort = Msg::Abort {
        ranks: vec![(2, "timed out".into())],
    };
    m.handle(t0, from(0, abort));
    let (sends, done) = decided(m.handle(t0, Event::Call(YES)));
    assert_eq!(sends, vec![(vec![0], Msg::Prepared)]);
    assert_eq!(ranks_of(&aborted(&done)), vec![2]);
}

#[test]
fn a_member_that_lost_rank_0_before_voting_aborts_without_sending() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, closed(0));
    let (sends, done) = decided(m.handle(t0, Event::Call(YES)));
    assert!(sends.is_empty());
    let ranks = aborted(&done);
    assert_eq!(ranks_of(&ranks), vec![0]);
    assert!(
        ranks[0].1.contains("before this rank could vote"),
        "{ranks:?}"
    );
}

#[test]
fn a_stalled_link_after_a_prepared_vote_leaves_the_member_in_doubt() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(YES));
    let lost = Lost::Stalled;
    let (_, done) = decided(m.handle(t0, Event::Gone { peer: 0, lost }));
    assert!(in_doubt(1, &done).contains("stopped reading"));
}

#[test]
fn duplicate_and_unexpected_messages_are_named_not_obeyed() {
    let t0 = Instant::now();
    // a duplicate vote: the second is no report at finish
    let mut c = Coordinator::new(2, T);
    c.handle(t0, from(1, Msg::Prepared));
    c.handle(t0, from(1, Msg::Prepared));
    let (_, done) = decided(c.handle(t0, Event::Call(YES)));
    assert!(committed(&done));
    c.handle(t0, from(1, status(json!(1))));
    let (_, done) = split(c.handle(t0, Event::Call(Call::Finish(Ok(json!(0))))));
    let f = failures(done);
    assert!(f[0].1.contains("Prepared"), "{f:?}");
    // a duplicate decision: the second is not the verdict
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(YES));
    let (_, done) = decided(m.handle(t0, from(0, Msg::Commit)));
    assert!(committed(&done));
    m.handle(t0, from(0, Msg::Commit));
    let (_, done) = split(m.handle(t0, Event::Call(Call::Finish(Ok(json!(1))))));
    assert!(done.is_none(), "a duplicate decision settled the finish");
    // a member that sends something other than a vote is not prepared
    let mut c = Coordinator::new(2, T);
    c.handle(t0, Event::Call(YES));
    let (_, done) = decided(c.handle(t0, from(1, Msg::Commit)));
    let ranks = aborted(&done);
    assert!(ranks[0].1.contains("instead of its vote"), "{ranks:?}");
    // rank 0 sending something other than a decision leaves a prepared member in doubt
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(YES));
    let (_, done) = decided(m.handle(t0, from(0, Msg::Barrier)));
    assert!(in_doubt(1, &done).contains("expected the decision"));
    // and one that was not prepared aborts, whatever rank 0 says, a commit included
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(no("not staged")));
    let (_, done) = decided(m.handle(t0, from(0, Msg::Commit)));
    assert_eq!(aborted(&done), vec![(1, "not staged".to_string())]);
    // a stale go from an abandoned barrier is not the decision
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(YES));
    let (_, done) = decided(m.handle(t0, from(0, Msg::Go)));
    assert!(done.is_none());
}

/// Decisions come one at a time, each its own exchange: a second is no refusal.
#[test]
fn a_second_decision_in_one_job_is_its_own_exchange() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(1, T);
    let (_, done) = decided(c.handle(t0, Event::Call(YES)));
    assert!(committed(&done), "a job of one rank decides alone");
    let (_, done) = decided(c.handle(t0, Event::Call(no("not staged"))));
    assert_eq!(aborted(&done), vec![(0, "not staged".to_string())]);
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(YES));
    m.handle(t0, from(0, Msg::Commit));
    let (sends, done) = decided(m.handle(t0, Event::Call(YES)));
    assert_eq!(sends, vec![(vec![0], Msg::Prepared)]);
    assert!(
        done.is_none(),
        "the second decision settled before rank 0 made it"
    );
    let abort = Msg::Abort {
        ranks: vec![(0, "not staged".into())],
    };
    let (_, done) = decided(m.handle(t0, from(0, abort)));
    assert_eq!(ranks_of(&aborted(&done)), vec![0]);
}

#[test]
fn three_decisions_in_a_row_all_commit_with_barriers_between() {
    let mut net = Net::new(4);
    net.call_all(|_| Call::Agree(job("bf16")));
    for version in 0..3 {
        net.call_all(|_| Call::Barrier);
        assert!(
            net.outcomes.iter().all(|o| matches!(o, Some(Ok(_)))),
            "barrier before version {version}: {:?}",
            net.outcomes
        );
        net.decide_all(|_| YES);
        assert!(
            net.decisions.iter().all(committed),
            "version {version}: {:?}",
            net.decisions
        );
    }
    net.call_all(|r| Call::Finish(Ok(json!(r))));
    let reports = net.outcomes[0].take().unwrap().unwrap();
    assert_eq!(reports, vec![json!(0), json!(1), json!(2), json!(3)]);
    assert!(net.outcomes.iter().flatten().all(Result::is_ok));
}

/// An abort ends that version only: the next decision is as its votes say, and the job
/// succeeds.
#[test]
fn commit_then_abort_then_commit_each_as_the_votes_say() {
    let mut net = Net::new(3);
    net.call_all(|_| Call::Agree(job("bf16")));
    net.decide_all(|_| YES);
    assert!(net.decisions.iter().all(committed), "{:?}", net.decisions);
    net.decide_all(|r| {
        if r == 1 {
            no("rank 1: 2 chunks did not arrive")
        } else {
            YES
        }
    });
    for r in 0..3 {
        assert_eq!(
            aborted(&net.decisions[r]),
            vec![(1, "rank 1: 2 chunks did not arrive".to_string())],
            "rank {r}"
        );
    }
    // no barrier between: the next decision follows at once
    net.decide_all(|_| YES);
    assert!(net.decisions.iter().all(committed), "{:?}", net.decisions);
    net.call_all(|_| Call::Barrier);
    assert!(net.outcomes.iter().all(|o| matches!(o, Some(Ok(_)))));
    net.call_all(|r| Call::Finish(Ok(json!(r))));
    assert!(net.outcomes.iter().all(|o| matches!(o, Some(Ok(_)))));
}

#[test]
fn a_member_dead_between_two_decisions_aborts_the_second_and_fails_the_finish() {
    let mut net = Net::new(3);
    net.decide_all(|_| YES);
    assert!(net.decisions.iter().all(committed));
    net.kill(2);
    net.decisions[2] = None;
    net.decide_all(|_| YES);
    for r in [0, 1] {
        assert_eq!(
            aborted(&net.decisions[r]),
            vec![(2, "exited before voting (killed?)".to_string())],
            "rank {r}"
        );
    }
    assert!(net.decisions[2].is_none());
    net.consistent();
    net.call_all(|r| Call::Finish(Ok(json!(r))));
    net.all_failed_naming(2, 2);
    assert_eq!(
        failures(net.outcomes[0].take()),
        vec![(2, "exited without reporting (killed?)".to_string())]
    );
}

/// Rank 0 fails after the first decision and goes to finish while its members vote prepared
/// in the second: its verdict reaches them at the decision, which they take for an abort
/// naming it (rank 0 is not lost: it says it made no decision). Nobody commits.
#[test]
fn rank_0_that_failed_after_a_decision_aborts_its_members_next_one() {
    let mut net = Net::new(3);
    net.decide_all(|_| YES);
    assert!(net.decisions.iter().all(committed));
    for r in 1..3 {
        net.decide(r, YES);
    }
    // rank 0 makes no second decision: the first's is all it holds
    net.decisions[0] = None;
    net.call(0, Call::Finish(Err("rank 0: out of memory".into())));
    net.deliver();
    for r in 1..3 {
        assert_eq!(
            aborted(&net.decisions[r]),
            vec![(0, "rank 0: out of memory".to_string())],
            "rank {r}"
        );
    }
    net.consistent();
    // rank 0's verdict names its own failure alone: the members waiting were not at fault
    assert_eq!(
        failures(net.outcomes[0].take()),
        vec![(0, "rank 0: out of memory".to_string())]
    );
    // the same when the members' votes reach rank 0 only after its finish began, and one
    // of them votes not prepared
    let mut net = Net::new(3);
    net.decide_all(|_| YES);
    // rank 0 makes no second decision: the first's is all it holds
    net.decisions[0] = None;
    net.call(0, Call::Finish(Err("rank 0: out of memory".into())));
    net.decide(1, YES);
    net.decide(2, no("rank 2: staging full"));
    net.deliver();
    for r in 1..3 {
        assert!(
            !committed(&net.decisions[r]) && ranks_of(&aborted(&net.decisions[r])).contains(&0),
            "rank {r}: {:?}",
            net.decisions[r]
        );
    }
    net.consistent();
}

/// Rank 0 gave up on a vote at the deadline; the vote that comes after is that decision's,
/// not the next one's: the next decision waits for the member's next vote.
#[test]
fn a_late_vote_is_not_taken_for_the_next_decision() {
    let t0 = Instant::now();
    let mut c = Coordinator::new(2, T);
    c.handle(t0, Event::Call(YES));
    let (_, done) = decided(c.handle(t0 + 2 * T, Event::Tick));
    assert_eq!(ranks_of(&aborted(&done)), vec![1]);
    // the member was slow, found the abort waiting, and votes in the next decision
    c.handle(t0 + 3 * T, from(1, Msg::Prepared));
    let (_, done) = decided(c.handle(t0 + 3 * T, Event::Call(YES)));
    assert!(
        done.is_none(),
        "the late vote was taken for the next decision"
    );
    let (sends, done) = decided(c.handle(
        t0 + 3 * T,
        from(
            1,
            Msg::NotPrepared {
                why: "rank 1: stale shard".into(),
            },
        ),
    ));
    assert_eq!(aborted(&done), vec![(1, "rank 1: stale shard".to_string())]);
    assert!(matches!(sends.last(), Some((to, Msg::Abort { .. })) if to == &vec![1]));
    // nor for a barrier, after a decision that went without it
    let mut c = Coordinator::new(2, T);
    c.handle(t0, Event::Call(YES));
    c.handle(t0 + 2 * T, Event::Tick);
    c.handle(t0 + 3 * T, from(1, Msg::Prepared));
    c.handle(t0 + 3 * T, from(1, Msg::Barrier));
    let (_, done) = split(c.handle(t0 + 3 * T, Event::Call(Call::Barrier)));
    assert!(matches!(done, Some(Ok(_))), "{done:?}");
}

/// A member gave up on a decision (rank 0 silent past its patience); the decision that
/// comes after is that one's, not the next one's.
#[test]
fn a_late_decision_is_not_taken_for_the_next_one() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(YES));
    let (_, done) = decided(m.handle(t0 + 4 * T, Event::Tick));
    in_doubt(1, &done);
    m.handle(t0 + 5 * T, Event::Call(YES));
    // rank 0 resumes: first the decision this rank gave up on, then the next one's
    let (_, done) = decided(m.handle(t0 + 5 * T, from(0, Msg::Commit)));
    assert!(
        done.is_none(),
        "the late commit was taken for the next decision"
    );
    let abort = Msg::Abort {
        ranks: vec![(1, "voted prepared, then was lost".into())],
    };
    let (_, done) = decided(m.handle(t0 + 5 * T, from(0, abort)));
    assert_eq!(ranks_of(&aborted(&done)), vec![1]);
    // and a late abort is no failure of the barrier that follows
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(no("not staged")));
    let (_, done) = decided(m.handle(t0 + 4 * T, Event::Tick));
    assert_eq!(aborted(&done), vec![(1, "not staged".to_string())]);
    m.handle(t0 + 5 * T, Event::Call(Call::Barrier));
    let abort = Msg::Abort {
        ranks: vec![(1, "not staged".into())],
    };
    let (_, done) = split(m.handle(t0 + 5 * T, from(0, abort)));
    assert!(done.is_none(), "the late abort failed the barrier");
    let (_, done) = split(m.handle(t0 + 5 * T, from(0, Msg::Go)));
    assert!(matches!(done, Some(Ok(_))));
}

/// A member that failed in its data phase skips the decision and reports: rank 0 takes its
/// report for a vote not to commit, and its finish is answered by the verdict.
#[test]
fn a_member_that_skipped_to_finish_is_not_prepared() {
    let mut net = Net::new(3);
    net.call(2, Call::Finish(Err("rank 2: peer rank 1 is gone".into())));
    net.decide(1, no("rank 1: peer rank 2 is gone"));
    net.decide(0, YES);
    net.deliver();
    assert_eq!(ranks_of(&aborted(&net.decisions[0])), vec![1, 2]);
    assert!(net.outcomes[2].is_none(), "the abort settled the finish");
    net.call(0, Call::Finish(Ok(json!(0))));
    net.call(1, Call::Finish(Err("rank 1: peer rank 2 is gone".into())));
    net.deliver();
    assert_eq!(ranks_of(&failures(net.outcomes[2].take())), vec![1, 2]);
}

/// Rank 0 failed and went straight to finish: a member waiting for the decision aborts.
#[test]
fn rank_0_that_skipped_the_decision_aborts_its_members() {
    let mut net = Net::new(2);
    net.decide(1, YES);
    // rank 0 makes no second decision: the first's is all it holds
    net.decisions[0] = None;
    net.call(0, Call::Finish(Err("rank 0: out of memory".into())));
    net.deliver();
    assert_eq!(
        aborted(&net.decisions[1]),
        vec![(0, "rank 0: out of memory".to_string())]
    );
}

/// A member still at a barrier when rank 0 aborts fails the barrier, naming why.
#[test]
fn a_member_at_a_barrier_hears_the_abort_as_a_failure() {
    let t0 = Instant::now();
    let mut m = Member::new(1, T);
    m.handle(t0, Event::Call(Call::Barrier));
    let abort = Msg::Abort {
        ranks: vec![(0, "boom".into())],
    };
    let (_, done) = split(m.handle(t0, from(0, abort)));
    assert_eq!(failures(done), vec![(0, "boom".to_string())]);
}

/// The decision to one member is lost on the wire while rank 0 lives: that member is in
/// doubt after four timeouts, the others commit, and the finish names the rank in doubt.
#[test]
fn a_decision_lost_on_the_wire_leaves_one_member_in_doubt() {
    let mut net = Net::new(3);
    for r in 1..3 {
        net.decide(r, YES);
    }
    net.deliver();
    net.decide(0, YES);
    net.wire.retain(|&(_, to, _)| to != 2);
    net.deliver();
    assert!(committed(&net.decisions[0]) && committed(&net.decisions[1]));
    assert!(net.decisions[2].is_none());
    net.wait(4 * T);
    let doubt = match &net.decisions[2] {
        Some(Err(e @ Error::InDoubt { rank: 2, .. })) => e.to_string(),
        other => panic!("expected rank 2 in doubt, got {other:?}"),
    };
    net.consistent();
    net.call_all(|r| {
        Call::Finish(if r == 2 {
            Err(doubt.clone())
        } else {
            Ok(json!(r))
        })
    });
    for r in 0..3 {
        assert_eq!(
            ranks_of(&failures(net.outcomes[r].take())),
            vec![2],
            "rank {r}"
        );
    }
}

/// A member's vote is lost on the wire: rank 0 gives up on it after two timeouts, and the
/// member, still waiting, hears the abort that names it.
#[test]
fn a_vote_lost_on_the_wire_aborts_every_rank() {
    let mut net = Net::new(3);
    net.decide(2, YES);
    net.wire.clear();
    net.decide(1, YES);
    net.decide(0, YES);
    net.deliver();
    assert!(net.decisions.iter().all(Option::is_none));
    net.wait(2 * T);
    for r in 0..3 {
        let ranks = aborted(&net.decisions[r]);
        assert_eq!(ranks_of(&ranks), vec![2], "rank {r}");
        assert!(ranks[0].1.contains("its vote did not arrive"), "{ranks:?}");
    }
}
