//! CRC-32C, the sum of `--checksum`: below the copy kernels, which sum while they copy, and
//! the transfer checksums, which cut a transfer's stream into summed chunks.

/// `sum` (the CRC-32C of some bytes) extended over `bytes`: the CRC-32C of both, one after
/// the other. Computed with carry-less multiplications where the CPU has them (AVX-512
/// VPCLMULQDQ, PCLMULQDQ, ARMv8 PMULL), several times faster than the CRC instruction alone.
pub fn append(sum: u32, bytes: &[u8]) -> u32 {
    let mut d =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!sum));
    d.update(bytes);
    d.finalize() as u32
}

/// The CRC-32C of a whole message (a packed stream of a region, or of several).
pub fn bytes_sum(bytes: &[u8]) -> u32 {
    append(0, bytes)
}
