//! The two-phase decision through the control threads, over real loopback links.

use std::net::{TcpListener, TcpStream};

use super::super::driver::ControlLinks;
use super::*;

/// Rank 0's and its members' control threads in a job of `world` ranks, over loopback.
fn job_of(world: usize, timeout: Duration) -> Vec<ControlLinks> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut at_root: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut members = Vec::new();
    for (r, slot) in at_root.iter_mut().enumerate().skip(1) {
        // one at a time, so that the accepted link is rank `r`'s
        let member = TcpStream::connect(addr).unwrap();
        let (root_end, _) = listener.accept().unwrap();
        *slot = Some(root_end);
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        streams[0] = Some(member);
        members.push(ControlLinks::start(r, world, timeout, streams).unwrap());
    }
    let mut links = vec![ControlLinks::start(0, world, timeout, at_root).unwrap()];
    links.extend(members);
    links
}

/// Every rank of `links` votes as `vote` says, each on a thread; their decisions by rank.
fn decide_all(
    links: &[ControlLinks],
    vote: impl Fn(Rank) -> std::result::Result<(), String> + Sync,
) -> Vec<Result<Decision>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = links
            .iter()
            .enumerate()
            .map(|(r, l)| {
                let vote = &vote;
                s.spawn(move || l.decide(vote(r)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

const LONG: Duration = Duration::from_secs(600);

#[test]
fn every_rank_prepared_commits_over_tcp_and_finishes() {
    let links = job_of(3, LONG);
    let decisions = decide_all(&links, |_| Ok(()));
    for (r, d) in decisions.iter().enumerate() {
        assert!(matches!(d, Ok(Decision::Commit)), "rank {r}: {d:?}");
    }
    let reports = std::thread::scope(|s| {
        let members: Vec<_> = links[1..]
            .iter()
            .enumerate()
            .map(|(i, l)| s.spawn(move || l.call(Call::Finish(Ok(json!(i + 1))))))
            .collect();
        let reports = links[0].call(Call::Finish(Ok(json!(0)))).unwrap();
        for m in members {
            assert!(m.join().unwrap().unwrap().is_empty());
        }
        reports
    });
    assert_eq!(reports, vec![json!(0), json!(1), json!(2)]);
}

#[test]
fn a_member_not_prepared_aborts_every_rank_over_tcp() {
    let links = job_of(3, LONG);
    let decisions = decide_all(&links, |r| {
        if r == 1 {
            Err("rank 1: 2 chunks did not arrive".into())
        } else {
            Ok(())
        }
    });
    for (r, d) in decisions.into_iter().enumerate() {
        match d {
            Ok(Decision::Abort { ranks }) => assert_eq!(
                ranks,
                vec![(1, "rank 1: 2 chunks did not arrive".to_string())],
                "rank {r}"
            ),
            other => panic!("rank {r}: expected an abort, got {other:?}"),
        }
    }
}

/// A member whose process is gone before it votes: the others abort at once, naming it.
#[test]
fn a_member_that_disappears_before_voting_aborts_the_others() {
    let mut links = job_of(3, LONG);
    drop(links.pop());
    let decisions = decide_all(&links, |_| Ok(()));
    for (r, d) in decisions.into_iter().enumerate() {
        match d {
            Ok(Decision::Abort { ranks }) => {
                assert_eq!(ranks_of(&ranks), vec![2], "rank {r}");
                assert!(ranks[0].1.contains("exited before voting"), "{ranks:?}");
            }
            other => panic!("rank {r}: expected an abort, got {other:?}"),
        }
    }
}

/// A member connected but silent: rank 0 gives up on its vote after two timeouts, and the
/// decision is abort on every rank that hears it.
#[test]
fn a_silent_member_is_presumed_not_prepared() {
    let links = job_of(3, Duration::from_millis(200));
    let decisions = std::thread::scope(|s| {
        let one = s.spawn(|| links[1].decide(Ok(())));
        let zero = links[0].decide(Ok(()));
        (zero, one.join().unwrap())
    });
    for (r, d) in [(0, decisions.0), (1, decisions.1)] {
        match d {
            Ok(Decision::Abort { ranks }) => {
                assert_eq!(ranks_of(&ranks), vec![2], "rank {r}");
                assert!(ranks[0].1.contains("its vote did not arrive"), "{ranks:?}");
            }
            other => panic!("rank {r}: expected an abort, got {other:?}"),
        }
    }
}

/// The members' control threads in a job of `world` ranks, and rank 0's ends of their links,
/// for a test to play rank 0 by hand.
fn members_of(world: usize) -> (Vec<TcpStream>, Vec<ControlLinks>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut ends = Vec::new();
    let mut members = Vec::new();
    for r in 1..world {
        let member = TcpStream::connect(addr).unwrap();
        let (root_end, _) = listener.accept().unwrap();
        // a member that never writes fails the test rather than hanging it
        root_end
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        ends.push(root_end);
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        streams[0] = Some(member);
        members.push(ControlLinks::start(r, world, LONG, streams).unwrap());
    }
    (ends, members)
}

/// Rank 0's process is gone after a member's prepared vote reached it: the member is in
/// doubt, naming rank 0's loss; one that voted not prepared aborts.
#[test]
fn rank_0_that_disappears_leaves_a_prepared_member_in_doubt_over_tcp() {
    let (mut ends, members) = members_of(3);
    std::thread::scope(|s| {
        let prepared = s.spawn(|| members[0].decide(Ok(())));
        let refusing = s.spawn(|| members[1].decide(Err("rank 2: staging full".into())));
        let vote: Msg = crate::frame::read_control(&mut ends[0]).unwrap();
        assert_eq!(vote, Msg::Prepared);
        let vote: Msg = crate::frame::read_control(&mut ends[1]).unwrap();
        assert!(matches!(vote, Msg::NotPrepared { .. }), "{vote:?}");
        drop(ends);
        match prepared.join().unwrap() {
            Err(Error::InDoubt { rank: 1, detail }) => {
                assert!(detail.contains("peer rank 0 is gone"), "{detail}");
            }
            other => panic!("expected rank 1 in doubt, got {other:?}"),
        }
        match refusing.join().unwrap() {
            Ok(Decision::Abort { ranks }) => assert_eq!(ranks_of(&ranks), vec![2]),
            other => panic!("expected rank 2 to abort, got {other:?}"),
        }
    });
}

/// Rank 0 dies after writing its commit to one link and before the other: the member that
/// heard it commits, the other is in doubt; neither aborts.
#[test]
fn rank_0_that_dies_mid_broadcast_splits_commit_and_doubt_over_tcp() {
    let (mut ends, members) = members_of(3);
    std::thread::scope(|s| {
        let votes: Vec<_> = members
            .iter()
            .map(|m| s.spawn(move || m.decide(Ok(()))))
            .collect();
        for end in &mut ends {
            let vote: Msg = crate::frame::read_control(end).unwrap();
            assert_eq!(vote, Msg::Prepared);
        }
        crate::frame::write_control(&mut ends[0], &Msg::Commit).unwrap();
        drop(ends);
        let mut votes = votes.into_iter().map(|h| h.join().unwrap());
        assert!(matches!(votes.next(), Some(Ok(Decision::Commit))));
        assert!(matches!(
            votes.next(),
            Some(Err(Error::InDoubt { rank: 2, .. }))
        ));
    });
}
