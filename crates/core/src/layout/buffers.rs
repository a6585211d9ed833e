//! Whether a set of local buffers fits a layout: one buffer per rank of the mesh, each exactly
//! its shard's size. Lives with the layout (not with the executor) so that everything that
//! holds shards by rank (running a plan, verifying a fill) checks them the same way without
//! depending on the executor.

use std::collections::BTreeMap;

use super::{Layout, Rank};
use crate::error::{Dims, Error, Result, Side};

impl Layout {
    /// Checks that every rank of this layout has a buffer of exactly its shard's size, and no
    /// other rank has one. `side` names the layout in the error.
    pub fn check_buffers(&self, side: Side, buffers: &BTreeMap<Rank, Vec<u8>>) -> Result<()> {
        for (position, &rank) in self.mesh().ranks().iter().enumerate() {
            let region = self.region_at(position);
            let expected = region.volume() * self.dtype().size() as u64;
            let got = buffers
                .get(&rank)
                .ok_or(Error::MissingBuffer { side, rank })?
                .len() as u64;
            if got != expected {
                return Err(Error::BufferSize {
                    side,
                    rank,
                    extent: Dims(region.extent),
                    expected,
                    got,
                });
            }
        }
        if let Some(&rank) = buffers.keys().find(|&&r| !self.mesh().contains(r)) {
            return Err(Error::UnexpectedBuffer { side, rank });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::layout::LayoutSpec;

    fn layout() -> Layout {
        // Two ranks (3 and 4), each holding a 2x4 bf16 row shard: 16 bytes.
        LayoutSpec::parse("mesh=2 ranks=3,4 place=S(0)")
            .unwrap()
            .resolve(&[4, 4], DType::Bf16, 0)
            .unwrap()
    }

    #[test]
    fn buffers_of_the_shard_size_pass() {
        let buffers = BTreeMap::from([(3, vec![0; 16]), (4, vec![0; 16])]);
        assert!(layout().check_buffers(Side::Dst, &buffers).is_ok());
    }

    #[test]
    fn a_missing_buffer_names_side_and_rank() {
        let buffers = BTreeMap::from([(3, vec![0; 16])]);
        let err = layout().check_buffers(Side::Src, &buffers).unwrap_err();
        assert_eq!(err.to_string(), "src: no local buffer given for rank 4");
    }

    #[test]
    fn a_short_buffer_names_its_size_and_the_shard() {
        let buffers = BTreeMap::from([(3, vec![0; 16]), (4, vec![0; 15])]);
        let err = layout().check_buffers(Side::Dst, &buffers).unwrap_err();
        assert_eq!(
            err.to_string(),
            "dst: rank 4's buffer has 15 bytes, but its shard 2x4 needs 16"
        );
    }

    #[test]
    fn a_buffer_for_a_rank_outside_the_mesh_is_refused() {
        let buffers = BTreeMap::from([(3, vec![0; 16]), (4, vec![0; 16]), (7, vec![])]);
        let err = layout().check_buffers(Side::Dst, &buffers).unwrap_err();
        assert_eq!(
            err.to_string(),
            "dst: rank 7 is not part of this layout, yet a buffer was given for it"
        );
    }
}
