//! MPI datatypes that describe a region in place in a rank's shard.

use std::os::raw::c_int;

use mpi::ffi;

use reshard_core::region::Region;

/// Transfers up to this size move whole, as one message of a derived datatype; larger ones
/// (beyond what MPI's int counts and sizes safely describe) move in packed chunks.
pub(super) const WHOLE_TRANSFER_LIMIT: usize = 1 << 30;

/// Whether subarray datatypes can describe the regions of a tensor of `shape`: they count in
/// C ints, so every dim, in bytes for the innermost, must fit.
pub(super) fn fits_datatypes(shape: &[u64], elem_bytes: usize) -> bool {
    shape.iter().enumerate().all(|(d, &n)| {
        let n = if d + 1 == shape.len() {
            n.saturating_mul(elem_bytes as u64)
        } else {
            n
        };
        n <= c_int::MAX as u64
    })
}

/// A committed MPI datatype for `region` inside the dense row-major buffer of `holder`
/// (elements of `elem` bytes, counted as bytes). Free it with [`free_datatype`].
///
/// Panics if a dimension exceeds `i32`: callers keep to `WHOLE_TRANSFER_LIMIT`.
pub fn subarray(holder: &Region, region: &Region, elem: usize) -> ffi::MPI_Datatype {
    let int = |v: u64| c_int::try_from(v).expect("dimension within MPI's int range");
    let (mut sizes, mut subsizes, mut starts): (Vec<c_int>, Vec<c_int>, Vec<c_int>) = (
        holder.extent.iter().map(|&e| int(e)).collect(),
        region.extent.iter().map(|&e| int(e)).collect(),
        (0..holder.ndim())
            .map(|d| int(region.offset[d] - holder.offset[d]))
            .collect(),
    );
    if holder.ndim() == 0 {
        (sizes, subsizes, starts) = (vec![1], vec![1], vec![0]);
    }
    let n = sizes.len();
    let e = elem as c_int;
    // the innermost dim counted in bytes
    sizes[n - 1] *= e;
    subsizes[n - 1] *= e;
    starts[n - 1] *= e;
    let mut t = std::mem::MaybeUninit::<ffi::MPI_Datatype>::uninit();
    // SAFETY: the arrays hold `n` entries each and outlive the calls; MPI writes the new type.
    unsafe {
        ffi::MPI_Type_create_subarray(
            n as c_int,
            sizes.as_ptr(),
            subsizes.as_ptr(),
            starts.as_ptr(),
            ffi::MPI_ORDER_C as c_int,
            ffi::RSMPI_UINT8_T,
            t.as_mut_ptr(),
        );
        let mut t = t.assume_init();
        ffi::MPI_Type_commit(&mut t);
        t
    }
}

/// Frees a datatype made by [`subarray`].
pub fn free_datatype(mut t: ffi::MPI_Datatype) {
    // SAFETY: a type this module committed, freed once.
    unsafe { ffi::MPI_Type_free(&mut t) };
}
