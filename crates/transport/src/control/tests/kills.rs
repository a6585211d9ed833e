//! Every rank killed at every point of the two-phase decision, against the machine alone:
//! the living ranks never disagree, and each says what it did.

use super::*;

impl Net {
    /// Kills `rank` at once: what it sent and nobody read yet is lost with it, what was on
    /// its way to it too, and its peers see its links close.
    fn sever(&mut self, rank: Rank) {
        self.killed[rank] = true;
        self.wire.retain(|&(f, t, _)| f != rank && t != rank);
        let peers: Vec<Rank> = if rank == 0 {
            (1..self.machines.len()).collect()
        } else {
            vec![0]
        };
        for p in peers {
            self.feed(
                p,
                Event::Gone {
                    peer: rank,
                    lost: Lost::Closed,
                },
            );
        }
    }
}

/// One decision in a job of `world` ranks, voting in the order `order` (rank `refuses` not
/// prepared), with `victim` killed before step `at` (a step: the next rank votes, or, once
/// all have, the next message arrives). Time then runs on until every deadline passed.
/// Whether the victim was killed, and the net.
fn trial(world: usize, order: &[Rank], refuses: Option<Rank>, victim: Rank, at: usize) -> Net {
    let mut net = Net::new(world);
    let mut votes = order.iter();
    let mut step = 0;
    loop {
        if step == at {
            net.sever(victim);
        }
        if let Some(&r) = votes.next() {
            let vote = if Some(r) == refuses {
                Call::Decide(Err(format!("rank {r}: not staged")))
            } else {
                Call::Decide(Ok(()))
            };
            net.decisions[r] = None;
            net.feed(r, Event::Call(vote));
        } else if let Some((f, t, msg)) = net.wire.pop_front() {
            if !net.killed[t] {
                net.feed(t, from(f, msg));
            }
        } else {
            break;
        }
        step += 1;
    }
    net.wait(5 * T);
    net
}

fn check(net: &Net, refuses: Option<Rank>, victim: Rank) {
    let killed = net.killed[victim];
    for r in (0..net.machines.len()).filter(|&r| !net.killed[r]) {
        match &net.decisions[r] {
            Some(Ok(_)) => {}
            Some(Err(Error::InDoubt { .. })) => assert!(
                killed && victim == 0,
                "rank {r} in doubt while rank 0 lives: {:?}",
                net.decisions
            ),
            other => panic!("living rank {r} ended with {other:?}"),
        }
    }
    let commits = net
        .decisions
        .iter()
        .filter(|d| matches!(d, Some(Ok(Decision::Commit))))
        .count();
    let aborts = net
        .decisions
        .iter()
        .filter(|d| matches!(d, Some(Ok(Decision::Abort { .. }))))
        .count();
    assert!(
        commits == 0 || aborts == 0,
        "some ranks commit, others abort: {:?}",
        net.decisions
    );
    if refuses.is_some() {
        assert_eq!(commits, 0, "a refusal, yet a commit: {:?}", net.decisions);
    }
    if !killed && refuses.is_none() {
        assert_eq!(commits, net.machines.len(), "{:?}", net.decisions);
    }
}

#[test]
fn every_kill_at_every_step_leaves_the_living_ranks_agreed() {
    let world = 3;
    let orders: [&[Rank]; 3] = [&[0, 1, 2], &[1, 2, 0], &[2, 0, 1]];
    let mut trials = 0;
    let mut outcomes = std::collections::BTreeSet::new();
    for order in orders {
        for refuses in [None, Some(0), Some(2)] {
            for victim in 0..world {
                // far enough that the last trials kill nobody
                for at in 0..16 {
                    let net = trial(world, order, refuses, victim, at);
                    check(&net, refuses, victim);
                    trials += 1;
                    for d in net.decisions.iter().flatten() {
                        outcomes.insert(match d {
                            Ok(Decision::Commit) => "commit",
                            Ok(Decision::Abort { .. }) => "abort",
                            Err(_) => "in doubt",
                        });
                    }
                }
            }
        }
    }
    assert_eq!(trials, 3 * 3 * 3 * 16);
    // the trials reach every outcome, so the checks above were put to the test
    assert_eq!(
        outcomes.into_iter().collect::<Vec<_>>(),
        vec!["abort", "commit", "in doubt"]
    );
}
