//! A rank's buffers as its program names them ([`Buf`]): those the job gives, and the scratch
//! the executor allocates; lent to a phase as the lists its steps index, each writable buffer
//! at most once.

use super::program::{Buf, LocalCopy};
use reshard_core::copy::{CopyGeometry, Place};
use reshard_core::error::{Error, Result};
use reshard_core::layout::Rank;

/// A phase's buffers: those it reads, those it writes.
pub(crate) type Lent<'b> = (Vec<&'b [u8]>, Vec<&'b mut [u8]>);

/// A rank's buffers during a run.
pub(crate) struct Buffers<'a> {
    pub src: Vec<&'a [u8]>,
    pub dst: Vec<&'a mut [u8]>,
    pub scratch: Vec<Vec<u8>>,
}

fn twice(rank: Rank, b: Buf) -> Error {
    Error::Internal {
        rank,
        detail: format!("the program names {b:?} twice, or one that does not exist"),
    }
}

impl Buffers<'_> {
    /// The phase's buffers: `src` to read, `dst` to write. A source or destination buffer the
    /// job does not give is empty (the steps' checks then name what is missing); a writable
    /// buffer named twice is an internal error.
    pub fn lend<'b>(&'b mut self, rank: Rank, src: &[Buf], dst: &[Buf]) -> Result<Lent<'b>> {
        let mut dsts: Vec<Option<&'b mut [u8]>> =
            self.dst.iter_mut().map(|b| Some(&mut **b)).collect();
        let mut scratch: Vec<Option<&'b mut [u8]>> = self
            .scratch
            .iter_mut()
            .map(|b| Some(b.as_mut_slice()))
            .collect();
        let mut take = |b: Buf| -> Result<&'b mut [u8]> {
            match b {
                // nothing there (a rank without that shard)
                Buf::Src(_) => Ok(&mut []),
                Buf::Dst(i) => match dsts.get_mut(i) {
                    None => Ok(&mut []),
                    Some(slot) => slot.take().ok_or_else(|| twice(rank, b)),
                },
                Buf::Scratch(i) => scratch
                    .get_mut(i)
                    .and_then(Option::take)
                    .ok_or_else(|| twice(rank, b)),
            }
        };
        let written = dst.iter().map(|&b| take(b)).collect::<Result<Vec<_>>>()?;
        let read = src
            .iter()
            .map(|&b| match b {
                Buf::Src(i) => Ok(self.src.get(i).copied().unwrap_or_default()),
                other => take(other).map(|b| &*b),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((read, written))
    }

    /// Runs a local copy; its bytes.
    pub fn copy(&mut self, rank: Rank, c: &LocalCopy<'_>) -> Result<u64> {
        let out_of_range = || Error::Internal {
            rank,
            detail: format!("a local copy of {} lies outside its buffers", c.region),
        };
        let (from, to) = self.pair(rank, c.from.0, c.to.0)?;
        let from = from.get(c.from.1.clone()).ok_or_else(out_of_range)?;
        let to = to.get_mut(c.to.1.clone()).ok_or_else(out_of_range)?;
        let g = CopyGeometry::converting(
            &c.region,
            Place::Within(&c.from_box),
            Place::Within(&c.to_box),
            c.elem_bytes,
            c.cast.clone(),
        );
        g.copy(from, to, 0..g.len());
        Ok(g.len() as u64)
    }

    /// Buffer `from` to read and buffer `to` to write, at once.
    fn pair(&mut self, rank: Rank, from: Buf, to: Buf) -> Result<(&[u8], &mut [u8])> {
        let (mut read, mut written) = self.lend(rank, &[from], &[to])?;
        match (read.pop(), written.pop()) {
            (Some(r), Some(w)) => Ok((r, w)),
            _ => Err(twice(rank, to)),
        }
    }
}
