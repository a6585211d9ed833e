//! A rank's progress through its receives, kept apart from any I/O.
//!
//! The executor feeds [`Progress`] what the transport reports (a chunk or a whole transfer
//! landed, a transfer failed its checksum, the receiving side failed) and asks it what is
//! still due and, at the end, given what its sending side counted ([`Sent`]), for the rank's
//! outcome: its counts, or every failure with the exact report of what did not arrive
//! ([`Error::NotArrived`]). Holding no sockets, threads or clocks, it can replay any order of
//! events deterministically in its tests.

use std::collections::BTreeMap;

use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

/// One transfer a rank waits for: who sends it, its bytes on the wire and how many chunks
/// the transport cuts it into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Due {
    /// The sending rank.
    pub from: Rank,
    /// Bytes on the wire.
    pub bytes: u64,
    /// Chunks the transport cuts it into.
    pub chunks: u64,
}

/// Where one transfer stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// No chunk has landed.
    Waiting,
    /// Some chunks landed, in any order: which ones, and how many.
    Partial { landed: Vec<bool>, count: u64 },
    /// Every chunk landed.
    Landed,
}

/// What did not arrive at a rank: the transfers (indices into its receives, in order) and,
/// by sender, how many of them and their bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Missing {
    /// The transfers that did not arrive, as indices into the rank's receives, in order.
    pub transfers: Vec<usize>,
    /// By sender: how many of those transfers, and their bytes.
    pub by_peer: BTreeMap<Rank, (usize, u64)>,
}

impl Missing {
    /// The report as the error a rank returns, or `None` when everything arrived.
    pub fn into_error(self, rank: Rank) -> Option<Error> {
        if self.transfers.is_empty() {
            return None;
        }
        Some(Error::NotArrived {
            rank,
            transfers: self.transfers.len(),
            bytes: self.by_peer.values().map(|&(_, bytes)| bytes).sum(),
            from: self.by_peer.keys().copied().collect(),
        })
    }
}

/// What a rank's sending side handed to its transport, counted as it goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// Bytes of the transfers whose last chunk went.
    pub bytes: u64,
    /// Chunks handed over.
    pub chunks: u64,
}

impl Sent {
    /// One more chunk went to the transport.
    pub fn chunk_sent(&mut self) {
        self.chunks += 1;
    }

    /// The last chunk of a transfer of `bytes` went to the transport.
    pub fn transfer_sent(&mut self, bytes: u64) {
        self.bytes += bytes;
    }
}

/// What a rank moved, once it has completed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    /// Bytes of the transfers that landed.
    pub bytes_received: u64,
    /// Chunks of the transfers that landed.
    pub chunks_received: u64,
    /// Bytes its sending side handed to the transport.
    pub bytes_sent: u64,
    /// Chunks its sending side handed to the transport.
    pub chunks_sent: u64,
}

/// A rank's receives and how far each one got; see the module's documentation.
#[derive(Debug)]
pub struct Progress {
    rank: Rank,
    due: Vec<Due>,
    state: Vec<State>,
    /// What failed on the receiving side, in the order it was reported.
    failures: Vec<Error>,
}

impl Progress {
    /// A rank that waits for `due`, in its schedule order, nothing landed yet.
    pub fn new(rank: Rank, due: Vec<Due>) -> Progress {
        let state = vec![State::Waiting; due.len()];
        Progress {
            rank,
            due,
            state,
            failures: Vec::new(),
        }
    }

    /// The transfer `transfer`, or the error naming a transport that reported one the rank
    /// never asked for.
    fn due(&self, transfer: usize) -> Result<&Due> {
        self.due.get(transfer).ok_or_else(|| Error::Internal {
            rank: self.rank,
            detail: format!(
                "the transport reported transfer {transfer} landed, of {} expected",
                self.due.len()
            ),
        })
    }

    fn duplicate(&self, transfer: usize, what: &str) -> Error {
        Error::Protocol {
            rank: self.rank,
            peer: self.due[transfer].from,
            detail: format!("{what} of transfer {transfer} landed twice"),
        }
    }

    /// Chunk `chunk` of `transfer` landed. Chunks may land in any order; one that landed
    /// before, or one past the transfer's end, is refused and changes nothing.
    pub fn chunk_landed(&mut self, transfer: usize, chunk: u64) -> Result<()> {
        let due = self.due(transfer)?;
        let (from, chunks) = (due.from, due.chunks);
        if chunk >= chunks {
            return Err(Error::Protocol {
                rank: self.rank,
                peer: from,
                detail: format!(
                    "chunk {chunk} of transfer {transfer} landed, which has {chunks} chunks"
                ),
            });
        }
        let state = &mut self.state[transfer];
        match state {
            State::Landed => return Err(self.duplicate(transfer, &format!("chunk {chunk}"))),
            State::Waiting => {
                let mut landed = vec![false; chunks as usize];
                landed[chunk as usize] = true;
                *state = State::Partial { landed, count: 1 };
            }
            State::Partial { landed, count } => {
                if landed[chunk as usize] {
                    return Err(self.duplicate(transfer, &format!("chunk {chunk}")));
                }
                landed[chunk as usize] = true;
                *count += 1;
            }
        }
        if matches!(&self.state[transfer], State::Partial { count, .. } if *count == chunks) {
            self.state[transfer] = State::Landed;
        }
        Ok(())
    }

    /// Every chunk of `transfer` landed at once (transports report whole transfers). Refused
    /// when any chunk of it had landed already.
    pub fn transfer_landed(&mut self, transfer: usize) -> Result<()> {
        self.due(transfer)?;
        match self.state[transfer] {
            State::Waiting => {
                self.state[transfer] = State::Landed;
                Ok(())
            }
            _ => Err(self.duplicate(transfer, "a chunk")),
        }
    }

    /// `transfer` landed but its bytes differ from what was sent (its checksum failed): it
    /// counts as not arrived.
    pub fn corrupt(&mut self, transfer: usize) -> Result<()> {
        self.due(transfer)?;
        self.state[transfer] = State::Waiting;
        Ok(())
    }

    /// The receiving side failed (a peer gone, a timeout, a protocol error): what has not
    /// landed will not, and the outcome reports it.
    pub fn failed(&mut self, error: Error) {
        self.failures.push(error);
    }

    /// Whether every transfer has landed.
    pub fn is_complete(&self) -> bool {
        self.state.iter().all(|s| *s == State::Landed)
    }

    /// What is due next from `peer`, which sends its transfers in order: the first of them not
    /// wholly landed and its first chunk still missing; `None` when all of them landed.
    pub fn next_from(&self, peer: Rank) -> Option<(usize, u64)> {
        self.due
            .iter()
            .zip(&self.state)
            .enumerate()
            .find_map(|(i, (d, s))| match s {
                _ if d.from != peer => None,
                State::Landed => None,
                State::Waiting => Some((i, 0)),
                State::Partial { landed, .. } => {
                    landed.iter().position(|&l| !l).map(|k| (i, k as u64))
                }
            })
    }

    /// Exactly what has not landed (partly landed transfers included), by sender.
    pub fn missing(&self) -> Missing {
        let mut missing = Missing::default();
        for (i, (d, s)) in self.due.iter().zip(&self.state).enumerate() {
            if *s != State::Landed {
                missing.transfers.push(i);
                let peer = missing.by_peer.entry(d.from).or_default();
                peer.0 += 1;
                peer.1 += d.bytes;
            }
        }
        missing
    }

    /// The rank's outcome, given how its sending side ended (its bytes and chunks sent): the
    /// counts when nothing failed; otherwise every failure, the receiving side's first, then
    /// exactly what did not arrive (when the receiving side failed), then the sending side's.
    pub fn outcome(self, sent: Result<Sent>) -> Result<Moved> {
        let rank = self.rank;
        let missing = self.missing();
        let mut failures = self.failures;
        if !failures.is_empty() {
            failures.extend(missing.into_error(rank));
        }
        let sent = sent.unwrap_or_else(|e| {
            failures.push(e);
            Sent::default()
        });
        if !failures.is_empty() {
            return Err(if failures.len() == 1 {
                failures.remove(0)
            } else {
                Error::Incomplete { failures }
            });
        }
        // counts what landed: a transport returns only once everything due has landed
        let landed = || {
            self.due
                .iter()
                .zip(&self.state)
                .filter(|(_, s)| **s == State::Landed)
                .map(|(d, _)| d)
        };
        Ok(Moved {
            bytes_received: landed().map(|d| d.bytes).sum(),
            chunks_received: landed().map(|d| d.chunks).sum(),
            bytes_sent: sent.bytes,
            chunks_sent: sent.chunks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn due(from: Rank, bytes: u64, chunks: u64) -> Due {
        Due {
            from,
            bytes,
            chunks,
        }
    }

    /// Rank 5 waits for two transfers from rank 1 and one from rank 2.
    fn three() -> Progress {
        Progress::new(5, vec![due(1, 100, 3), due(2, 40, 1), due(1, 64, 2)])
    }

    #[test]
    fn chunks_landing_out_of_order_complete_a_transfer() {
        let mut p = three();
        assert_eq!(p.next_from(1), Some((0, 0)));
        p.chunk_landed(0, 2).unwrap();
        p.chunk_landed(0, 0).unwrap();
        assert_eq!(p.next_from(1), Some((0, 1)));
        p.chunk_landed(0, 1).unwrap();
        assert_eq!(p.next_from(1), Some((2, 0)));
        p.chunk_landed(2, 1).unwrap();
        p.transfer_landed(1).unwrap();
        assert!(!p.is_complete());
        p.chunk_landed(2, 0).unwrap();
        assert!(p.is_complete());
        assert_eq!(p.next_from(1), None);
        assert_eq!(p.missing(), Missing::default());
        let moved = {
            let mut sent = Sent::default();
            for _ in 0..2 {
                sent.chunk_sent();
            }
            sent.transfer_sent(7);
            p.outcome(Ok(sent)).unwrap()
        };
        assert_eq!(
            moved,
            Moved {
                bytes_received: 204,
                chunks_received: 6,
                bytes_sent: 7,
                chunks_sent: 2,
            }
        );
    }

    #[test]
    fn duplicates_are_refused_and_change_nothing() {
        let mut p = three();
        p.chunk_landed(0, 1).unwrap();
        let e = p.chunk_landed(0, 1).unwrap_err();
        assert!(
            matches!(&e, Error::Protocol { rank: 5, peer: 1, detail } if detail.contains("chunk 1 of transfer 0 landed twice")),
            "{e}"
        );
        assert!(p.transfer_landed(0).is_err());
        p.transfer_landed(1).unwrap();
        assert!(matches!(
            p.transfer_landed(1).unwrap_err(),
            Error::Protocol { peer: 2, .. }
        ));
        assert!(matches!(
            p.chunk_landed(1, 0).unwrap_err(),
            Error::Protocol { peer: 2, .. }
        ));
        // transfer 0 still misses chunks 0 and 2
        assert_eq!(p.next_from(1), Some((0, 0)));
        assert_eq!(p.missing().transfers, vec![0, 2]);
    }

    #[test]
    fn events_for_transfers_or_chunks_that_do_not_exist_are_refused() {
        let mut p = three();
        assert!(matches!(
            p.chunk_landed(1, 1).unwrap_err(),
            Error::Protocol { peer: 2, .. }
        ));
        assert!(matches!(
            p.transfer_landed(3).unwrap_err(),
            Error::Internal { rank: 5, .. }
        ));
        assert!(p.chunk_landed(9, 0).is_err());
        assert!(p.corrupt(3).is_err());
        assert_eq!(p.missing().transfers, vec![0, 1, 2]);
    }

    #[test]
    fn a_peer_failing_midway_reports_exactly_what_did_not_arrive() {
        let mut p = three();
        p.transfer_landed(1).unwrap();
        p.chunk_landed(0, 0).unwrap();
        p.failed(Error::PeerGone {
            rank: 5,
            peer: 1,
            detail: "connection reset".into(),
        });
        let missing = p.missing();
        assert_eq!(missing.transfers, vec![0, 2]);
        assert_eq!(missing.by_peer, BTreeMap::from([(1, (2, 164))]));
        let Err(Error::Incomplete { failures }) = p.outcome(Ok(Sent::default())) else {
            panic!("the failure and the report");
        };
        assert!(matches!(failures[0], Error::PeerGone { peer: 1, .. }));
        assert!(matches!(
            &failures[1],
            Error::NotArrived { rank: 5, transfers: 2, bytes: 164, from } if from == &[1]
        ));
        assert_eq!(failures.len(), 2);
    }

    #[test]
    fn a_failure_before_anything_landed_names_every_sender() {
        let mut p = three();
        p.failed(Error::Internal {
            rank: 5,
            detail: "timed out".into(),
        });
        let Err(Error::Incomplete { failures }) = p.outcome(Err(Error::Internal {
            rank: 5,
            detail: "send failed".into(),
        })) else {
            panic!("three failures");
        };
        assert_eq!(failures.len(), 3);
        assert!(matches!(&failures[0], Error::Internal { detail, .. } if detail == "timed out"));
        assert!(matches!(
            &failures[1],
            Error::NotArrived { transfers: 3, bytes: 204, from, .. } if from == &[1, 2]
        ));
        assert!(matches!(&failures[2], Error::Internal { detail, .. } if detail == "send failed"));
    }

    #[test]
    fn a_corrupt_transfer_counts_as_not_arrived() {
        let mut p = three();
        for t in 0..3 {
            p.transfer_landed(t).unwrap();
        }
        p.corrupt(1).unwrap();
        p.failed(Error::Internal {
            rank: 5,
            detail: "checksum".into(),
        });
        assert_eq!(p.missing().transfers, vec![1]);
        let Err(Error::Incomplete { failures }) = p.outcome(Ok(Sent::default())) else {
            panic!("the checksum failure and the report");
        };
        assert!(matches!(
            &failures[1],
            Error::NotArrived { transfers: 1, bytes: 40, from, .. } if from == &[2]
        ));
    }

    #[test]
    fn a_lone_send_failure_is_the_outcome_without_a_report() {
        let mut p = three();
        for t in 0..3 {
            p.transfer_landed(t).unwrap();
        }
        let e = p
            .outcome(Err(Error::PeerGone {
                rank: 5,
                peer: 7,
                detail: "closed".into(),
            }))
            .unwrap_err();
        assert!(matches!(e, Error::PeerGone { peer: 7, .. }));
    }

    #[test]
    fn a_rank_that_waits_for_nothing_is_complete() {
        let p = Progress::new(0, Vec::new());
        assert!(p.is_complete());
        assert_eq!(p.next_from(1), None);
        assert_eq!(
            p.outcome(Ok(Sent {
                bytes: 3,
                chunks: 1
            }))
            .unwrap()
            .bytes_sent,
            3
        );
    }
}
