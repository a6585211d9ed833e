use super::*;

fn sizes(n: u64, k: u64) -> Vec<u64> {
    (0..k)
        .map(|i| {
            let r = chunk(n, k, i);
            r.end - r.start
        })
        .collect()
}

/// Local sizes DTensor reports for `distribute_tensor` of a 1-D tensor.
#[test]
fn chunk_matches_dtensor() {
    assert_eq!(sizes(10, 4), [3, 3, 3, 1]);
    assert_eq!(sizes(3, 4), [1, 1, 1, 0]);
    assert_eq!(sizes(5, 4), [2, 2, 1, 0]);
    assert_eq!(sizes(7, 3), [3, 3, 1]);
    assert_eq!(sizes(8, 3), [3, 3, 2]);
    assert_eq!(sizes(0, 2), [0, 0]);
    assert_eq!(sizes(1, 3), [1, 0, 0]);
    assert_eq!(sizes(8, 2), [4, 4]);
    // Empty shards sit at the end of the dim, as DTensor's offsets put them.
    assert_eq!(chunk(5, 4, 3), 5..5);
    assert_eq!(chunk(1, 3, 2), 1..1);
}

/// `[Shard(0), Shard(0)]` on a 2x2 mesh: 10 -> 5,5 -> (3,2),(3,2), as DTensor.
#[test]
fn nested_chunking_in_mesh_axis_order() {
    assert_eq!(nested_chunks(10, &[2, 2]), vec![0..3, 3..5, 5..8, 8..10]);
    // 7 over 2 then 3: (4 -> 2,2,0), (3 -> 1,1,1)
    assert_eq!(
        nested_chunks(7, &[2, 3]),
        vec![0..2, 2..4, 4..4, 4..5, 5..6, 6..7]
    );
    let mesh = Mesh::new(vec![2, 2], vec![0, 1, 2, 3]).unwrap();
    let l = Layout::new(
        vec![10],
        DType::F32,
        mesh,
        vec![Placement::Shard(0), Placement::Shard(0)],
    )
    .unwrap();
    let got: Vec<Region> = (0..4).map(|r| l.local_region(r).unwrap()).collect();
    assert_eq!(
        got[1],
        Region {
            offset: vec![3],
            extent: vec![2]
        }
    );
    assert_eq!(
        got[2],
        Region {
            offset: vec![5],
            extent: vec![3]
        }
    );
}

#[test]
fn holders_enumerate_replicas() {
    // DP2 x TP2 [R, S(0)] on ranks 10..14: box 1 is held by mesh (0,1) and (1,1).
    let mesh = Mesh::new(vec![2, 2], (10..14).collect()).unwrap();
    let l = Layout::new(
        vec![8, 4],
        DType::Bf16,
        mesh,
        vec![Placement::Replicate, Placement::Shard(0)],
    )
    .unwrap();
    assert_eq!(l.holders(&[1, 0]), vec![11, 13]);
    assert_eq!(l.replication(), 2);
    assert_eq!(l.local_region(13), Some(Region::from_ranges(&[4..8, 0..4])));
    assert_eq!(l.local_region(3), None);
}

#[test]
fn replica_numbers_and_holding() {
    // DP2 x TP2 [R, S(0)] on ranks 10..14: position 3 is (1, 1), replica 1, shard 1
    let mesh = Mesh::new(vec![2, 2], (10..14).collect()).unwrap();
    let l = Layout::new(
        vec![8, 4],
        DType::Bf16,
        mesh,
        vec![Placement::Replicate, Placement::Shard(0)],
    )
    .unwrap();
    assert_eq!((l.replica_index(3), l.shard_position(3)), (1, 1));
    assert_eq!((l.replica_index(1), l.shard_position(1)), (0, 1));
    assert_eq!((l.replica_index(2), l.shard_position(2)), (1, 0));
    for index in [[0, 0], [1, 0]] {
        for rank in 8..16 {
            assert_eq!(l.holds(rank, &index), l.holders(&index).contains(&rank));
        }
    }
}

#[test]
fn mesh_errors_name_the_value() {
    assert_eq!(
        Mesh::new(vec![2, 2], vec![0, 1, 2])
            .unwrap_err()
            .to_string(),
        "mesh 2x2 has 4 positions but ranks lists 3"
    );
    assert_eq!(
        Mesh::new(vec![2], vec![3, 3]).unwrap_err().to_string(),
        "rank 3 appears more than once in ranks"
    );
    assert_eq!(
        Mesh::new(vec![2, 0], vec![]).unwrap_err().to_string(),
        "mesh axis 1 has size 0 (mesh 2x0)"
    );
}

#[test]
fn meshes_beyond_the_rank_limit_are_refused() {
    let err = Mesh::new(vec![4096, 4097], vec![]).unwrap_err().to_string();
    assert_eq!(
        err,
        "mesh 4096x4097 has 16781312 positions, more than the 16777216 ranks a side may have"
    );
    let err = Mesh::new(vec![1 << 40, 1 << 40], vec![])
        .unwrap_err()
        .to_string();
    assert!(err.contains("has more than 2^64 positions"), "{err}");
}

#[test]
fn shard_dim_out_of_range() {
    let mesh = Mesh::new(vec![2], vec![0, 1]).unwrap();
    let err = Layout::new(vec![8, 8], DType::Bf16, mesh, vec![Placement::Shard(2)]);
    assert_eq!(
        err.unwrap_err().to_string(),
        "Shard(2) is out of range for a 2-D tensor (dims 0..2)"
    );
}

#[test]
fn huge_shapes_do_not_overflow() {
    // DeepSeek-V3's stacked experts: 256 x 7168 x 2048, over 2^32 elements.
    let mesh = Mesh::new(vec![16], (0..16).collect()).unwrap();
    let l = Layout::new(
        vec![256, 7168, 2048],
        DType::Bf16,
        mesh,
        vec![Placement::Shard(0)],
    )
    .unwrap();
    assert_eq!(l.total_bytes(), 256 * 7168 * 2048 * 2);
    assert_eq!(l.local_bytes(15), 16 * 7168 * 2048 * 2);
    let mesh = Mesh::new(vec![1], vec![0]).unwrap();
    let err = Layout::new(
        vec![1 << 40, 1 << 30],
        DType::F32,
        mesh,
        vec![Placement::Replicate],
    );
    assert!(matches!(err, Err(LayoutError::ShapeTooLarge { .. })));
}
