use super::view::{base_of, dense, dense_holder, strided_copy};

#[test]
fn dense_holders_of_views() {
    // contiguous
    let h = dense_holder(&[4, 6], &[6, 1]).unwrap();
    assert_eq!(h.extent, vec![4, 6]);
    // a slice of columns of a 4x10 array
    let h = dense_holder(&[4, 3], &[10, 1]).unwrap();
    assert_eq!(h.extent, vec![4, 10]);
    // a middle dim of size 1 takes any stride
    let h = dense_holder(&[2, 1, 5], &[20, 999, 1]).unwrap();
    assert_eq!(h.extent, vec![2, 1, 20]);
    // transposed, broadcast, innermost not contiguous
    assert!(dense_holder(&[3, 4], &[1, 3]).is_none());
    assert!(dense_holder(&[3, 4], &[0, 1]).is_none());
    assert!(dense_holder(&[3, 4], &[8, 2]).is_none());
    // rows overlapping their outer stride
    assert!(dense_holder(&[3, 4], &[2, 1]).is_none());
    // empty and scalar
    assert_eq!(dense_holder(&[0, 4], &[4, 1]).unwrap().extent, vec![0, 4]);
    assert_eq!(dense_holder(&[], &[]).unwrap().extent, Vec::<u64>::new());
}

#[test]
fn strided_walk_copies_a_transposed_box() {
    // a 3x4 array of u16 stored transposed (strides 1, 3); copy its box [1..3, 1..4]
    let elem = 2;
    let value = |r: u64, c: u64| (r * 10 + c) as u16;
    let mut stored = vec![0u8; 12 * elem];
    for r in 0..3 {
        for c in 0..4 {
            let at = (r + c * 3) as usize * elem;
            stored[at..at + elem].copy_from_slice(&value(r, c).to_le_bytes());
        }
    }
    let strides = [1, 3];
    let extent = [2, 3];
    let mut out = vec![0u8; 6 * elem];
    strided_copy(
        (&stored, base_of(&[1, 1], &strides), &strides),
        (&mut out, 0, &dense(&extent)),
        &extent,
        elem,
    );
    let got: Vec<u16> = out
        .chunks(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    assert_eq!(got, vec![11, 12, 13, 21, 22, 23]);
}
