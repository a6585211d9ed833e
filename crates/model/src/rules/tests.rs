//! The rules against Megatron-LM's and vLLM's rank orders and splits.

use super::*;
use crate::parallel::{Inference, Training};
use crate::params::{Heads, Param};
use reshard_core::dtype::DType;
use reshard_core::layout::{Layout, Rank};
use reshard_core::region::Region;

const FACTS: ModelFacts = ModelFacts {
    num_layers: 8,
    heads: Some(Heads {
        attention: 16,
        kv: 4,
    }),
    tied_embeddings: false,
};

fn p(name: &str, shape: &[u64]) -> Param {
    Param::new(name, shape, DType::Bf16)
}

fn kind(name: &str) -> Kind {
    Rules::default().kind(name, Which::Train)
}

fn region(l: &Layout, rank: Rank) -> Option<Region> {
    l.local_region(rank)
}

#[test]
fn default_kinds_of_named_parameters() {
    let cases = [
        ("model.embed_tokens.weight", Kind::Column),
        ("lm_head.weight", Kind::Column),
        ("model.norm.weight", Kind::Replicate),
        ("model.layers.0.input_layernorm.weight", Kind::Replicate),
        ("model.layers.0.self_attn.q_norm.weight", Kind::Replicate),
        (
            "model.layers.0.self_attn.q_a_layernorm.weight",
            Kind::Replicate,
        ),
        ("model.layers.0.self_attn.q_proj.weight", Kind::Column),
        ("model.layers.0.self_attn.q_proj.bias", Kind::Column),
        ("model.layers.0.self_attn.k_proj.weight", Kind::KvColumn),
        ("model.layers.0.self_attn.v_proj.bias", Kind::KvColumn),
        ("model.layers.0.self_attn.o_proj.weight", Kind::Row),
        ("model.layers.0.self_attn.o_proj.bias", Kind::Replicate),
        ("model.layers.0.self_attn.q_a_proj.weight", Kind::Replicate),
        ("model.layers.0.self_attn.q_b_proj.weight", Kind::Column),
        (
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
            Kind::Replicate,
        ),
        ("model.layers.0.self_attn.kv_b_proj.weight", Kind::Column),
        ("model.layers.0.mlp.gate_proj.weight", Kind::Column),
        ("model.layers.0.mlp.up_proj.weight", Kind::Column),
        ("model.layers.0.mlp.down_proj.weight", Kind::Row),
        ("model.layers.3.mlp.gate.weight", Kind::Replicate),
        (
            "model.layers.3.mlp.gate.e_score_correction_bias",
            Kind::Replicate,
        ),
        (
            "model.layers.3.mlp.shared_experts.up_proj.weight",
            Kind::Column,
        ),
        (
            "model.layers.3.mlp.shared_experts.down_proj.weight",
            Kind::Row,
        ),
        (
            "model.layers.3.mlp.experts.gate_proj.weight",
            Kind::ExpertColumn,
        ),
        (
            "model.layers.3.mlp.experts.up_proj.weight",
            Kind::ExpertColumn,
        ),
        (
            "model.layers.3.mlp.experts.down_proj.weight",
            Kind::ExpertRow,
        ),
        ("something.else", Kind::Replicate),
    ];
    for (name, want) in cases {
        assert_eq!(kind(name), want, "{name}");
    }
}

#[test]
fn stages_follow_vllm() {
    // 61 layers over 16 stages: 3 each, and 4 for the 13 stages just before the last
    let sizes: Vec<usize> = (0..16)
        .map(|s| (0..61).filter(|&l| stage_of_layer(l, 61, 16) == s).count())
        .collect();
    assert_eq!(sizes[..3], [3, 3, 4]);
    assert!(sizes[2..15].iter().all(|&n| n == 4));
    assert_eq!(sizes[15], 3);
    assert_eq!(sizes.iter().sum::<usize>(), 61);
    // contiguous and monotone
    let stages: Vec<usize> = (0..61).map(|l| stage_of_layer(l, 61, 16)).collect();
    assert!(stages.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1));
    assert_eq!(
        (0..8).map(|l| stage_of_layer(l, 8, 2)).collect::<Vec<_>>(),
        [0, 0, 0, 0, 1, 1, 1, 1]
    );
}

#[test]
fn megatron_dense_rank_order() {
    // tp=2, cp=2, dp=2, pp=2: stage 1 holds ranks 8..16, tp fastest
    let t = Training::parse("tp=2,cp=2,dp=2,pp=2").unwrap();
    let o = p("model.layers.7.self_attn.o_proj.weight", &[64, 64]);
    let l = train_layout(&o, Kind::Row, &t, &FACTS).unwrap();
    let mut ranks = l.mesh().ranks().to_vec();
    ranks.sort_unstable();
    assert_eq!(ranks, (8..16).collect::<Vec<_>>());
    for r in 8..16 {
        let half = (r % 2) as u64 * 32; // the tp coordinate alone decides the column half
        assert_eq!(
            region(&l, r),
            Some(Region::from_ranges(&[0..64, half..half + 32]))
        );
    }
    assert_eq!(region(&l, 3), None, "stage 0 holds nothing of layer 7");
    // embedding: vocab-parallel on stage 0; lm_head and final norm on the last stage
    let e = train_layout(
        &p("model.embed_tokens.weight", &[100, 8]),
        Kind::Column,
        &t,
        &FACTS,
    )
    .unwrap();
    assert_eq!(region(&e, 1), Some(Region::from_ranges(&[50..100, 0..8])));
    assert_eq!(region(&e, 8), None);
    let n = train_layout(&p("model.norm.weight", &[8]), Kind::Replicate, &t, &FACTS).unwrap();
    assert_eq!(n.mesh().size(), 8);
    assert!(n.mesh().contains(15) && !n.mesh().contains(7));
}

#[test]
fn megatron_experts() {
    // tp=2, dp=4 (8 ranks per stage), ep=4, etp=2, edp=1: expert shard (e, t) on rank 2e + t
    let t = Training::parse("tp=2,dp=4,ep=4,etp=2").unwrap();
    let up = p("model.layers.0.mlp.experts.up_proj.weight", &[8, 16, 32]);
    let l = train_layout(&up, Kind::ExpertColumn, &t, &FACTS).unwrap();
    assert_eq!(l.replication(), 1);
    assert_eq!(
        region(&l, 5),
        Some(Region::from_ranges(&[4..6, 8..16, 0..32]))
    );
    let down = p("model.layers.0.mlp.experts.down_proj.weight", &[8, 32, 16]);
    let l = train_layout(&down, Kind::ExpertRow, &t, &FACTS).unwrap();
    assert_eq!(
        region(&l, 6),
        Some(Region::from_ranges(&[6..8, 0..32, 0..8]))
    );
    // ep=2, etp=1 over 8 ranks: edp=4, expert half = (rank / 1) % 2
    let t = Training::parse("tp=2,dp=4,ep=2").unwrap();
    let l = train_layout(&up, Kind::ExpertColumn, &t, &FACTS).unwrap();
    assert_eq!(l.replication(), 4);
    assert_eq!(
        region(&l, 3),
        Some(Region::from_ranges(&[4..8, 0..16, 0..32]))
    );
    assert_eq!(l.holders(&[1, 0, 0]), vec![1, 3, 5, 7]);
}

#[test]
fn fsdp_splits_the_tensor_parallel_shard() {
    // tp=2, dp=4, fsdp=2: ranks t + 2d; d = 2g + f (groups g replicate, f shards dim 0)
    let t = Training::parse("tp=2,dp=4,fsdp=2").unwrap();
    let q = p("model.layers.0.self_attn.q_proj.weight", &[16, 4]);
    let l = train_layout(&q, Kind::Column, &t, &FACTS).unwrap();
    // rank 3: t=1, d=1 (g=0, f=1): TP half 8..16, then its second FSDP half 12..16
    assert_eq!(region(&l, 3), Some(Region::from_ranges(&[12..16, 0..4])));
    // rank 7: t=1, d=3 (g=1, f=1): the same box, the other replica group
    assert_eq!(region(&l, 7), region(&l, 3));
    let n = train_layout(
        &p("model.layers.0.input_layernorm.weight", &[10]),
        Kind::Replicate,
        &t,
        &FACTS,
    )
    .unwrap();
    assert_eq!(
        region(&n, 2),
        Some(Region {
            offset: vec![5],
            extent: vec![5]
        })
    );
    assert_eq!(
        region(&n, 5),
        Some(Region {
            offset: vec![0],
            extent: vec![5]
        })
    );
}

#[test]
fn vllm_layouts() {
    // tp=2, pp=2, dp=2 from base 16: rank = 16 + t + 2 (s + 2 d)
    let i = Inference::parse("tp=2,pp=2,dp=2").unwrap();
    let q = p("model.layers.6.self_attn.q_proj.weight", &[16, 4]);
    let l = infer_layout(&q, Kind::Column, &i, &FACTS, 16).unwrap();
    let mut ranks = l.mesh().ranks().to_vec();
    ranks.sort_unstable();
    assert_eq!(ranks, [18, 19, 22, 23]);
    assert_eq!(region(&l, 23), Some(Region::from_ranges(&[8..16, 0..4])));
    // tp=8 over 4 kv heads of 4 rows: each head on two neighbouring ranks
    let i = Inference::parse("tp=8").unwrap();
    let k = p("model.layers.0.self_attn.k_proj.weight", &[16, 4]);
    let l = infer_layout(&k, Kind::KvColumn, &i, &FACTS, 0).unwrap();
    let rows: Vec<u64> = (0..8).map(|r| region(&l, r).unwrap().offset[0]).collect();
    assert_eq!(rows, [0, 0, 4, 4, 8, 8, 12, 12]);
    let err = infer_layout(
        &k,
        Kind::KvColumn,
        &Inference::parse("tp=3").unwrap(),
        &FACTS,
        0,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "infer: `tp=3`: model.layers.0.self_attn.k_proj.weight: tp must divide or be a multiple of the 4 key/value heads"
    );
}

#[test]
fn vllm_experts() {
    let up = p("model.layers.0.mlp.experts.up_proj.weight", &[8, 16, 32]);
    // no EP: TP flattened across DP splits every expert's intermediate dim
    let i = Inference::parse("tp=2,dp=2").unwrap();
    let l = infer_layout(&up, Kind::ExpertColumn, &i, &FACTS, 0).unwrap();
    assert_eq!(
        region(&l, 3),
        Some(Region::from_ranges(&[0..8, 12..16, 0..32]))
    );
    assert_eq!(l.replication(), 1);
    // pipeline stages in between: stage 0's ranks are 0, 1 (d=0) and 4, 5 (d=1)
    let i = Inference::parse("tp=2,dp=2,pp=2").unwrap();
    let l = infer_layout(&up, Kind::ExpertColumn, &i, &FACTS, 0).unwrap();
    let rows: Vec<u64> = [0, 1, 4, 5]
        .iter()
        .map(|&r| region(&l, r).unwrap().offset[1])
        .collect();
    assert_eq!(rows, [0, 4, 8, 12]);
    // EP over tp x dp = 4 ranks: experts split in rank order d x tp + t
    let i = Inference::parse("tp=2,dp=2,ep").unwrap();
    let l = infer_layout(&up, Kind::ExpertColumn, &i, &FACTS, 0).unwrap();
    let firsts: Vec<u64> = (0..4).map(|r| region(&l, r).unwrap().offset[0]).collect();
    assert_eq!(firsts, [0, 2, 4, 6]);
    assert_eq!(region(&l, 2).unwrap().extent, [2, 16, 32]);
    // an expert kind on a 2-D tensor is an error naming it
    let err = infer_layout(&p("x.weight", &[4, 4]), Kind::ExpertRow, &i, &FACTS, 0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor x.weight: infer: kind expert-row needs a stacked [E, out, in] tensor, this one is 2-D"
    );
}

#[test]
fn tied_embeddings_live_on_the_first_and_last_stage() {
    let facts = ModelFacts {
        tied_embeddings: true,
        ..FACTS
    };
    let i = Inference::parse("tp=2,pp=4").unwrap();
    let e = infer_layout(
        &p("model.embed_tokens.weight", &[10, 4]),
        Kind::Column,
        &i,
        &facts,
        0,
    )
    .unwrap();
    let mut ranks = e.mesh().ranks().to_vec();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 6, 7]);
    assert_eq!(region(&e, 7), region(&e, 1));
    let err = infer_layout(
        &p("model.norm.weight", &[4]),
        Kind::Replicate,
        &Inference::parse("pp=9").unwrap(),
        &facts,
        0,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "infer: `pp=9`: more stages than the model's 8 layers"
    );
}

#[test]
fn overrides_come_first() {
    let rules = Rules::default()
        .with_override_text("*.experts.*=replicate")
        .unwrap()
        .with_override_text("infer:lm_head.weight=row")
        .unwrap();
    assert_eq!(
        rules.kind("model.layers.1.mlp.experts.up_proj.weight", Which::Train),
        Kind::Replicate
    );
    assert_eq!(rules.kind("lm_head.weight", Which::Infer), Kind::Row);
    assert_eq!(rules.kind("lm_head.weight", Which::Train), Kind::Column);
    assert_eq!(
        rules.pattern("lm_head.weight", Which::Infer),
        Some("lm_head.weight")
    );
    let err = Rules::default()
        .with_override_text("a[=row")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("overrides: `a[=row`: "), "{err}");
    let err = Rules::default()
        .with_override_text("*.weight")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "overrides: `*.weight`: expected [train:|infer:]GLOB=KIND"
    );
    let err = Rules::default()
        .with_override_text("*=sideways")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "overrides: `*=sideways`: unknown kind `sideways` (expected replicate, column, row, kv-column, expert-column, expert-row)"
    );
}

use proptest::prelude::*;
use reshard_core::layout::chunk;

fn arb_training() -> impl Strategy<Value = Training> {
    (
        1usize..=4,
        1usize..=2,
        1usize..=4,
        1usize..=4,
        1usize..=4,
        1usize..=2,
        0usize..=2,
    )
        .prop_filter_map("consistent sizes", |(tp, cp, dp, pp, ep, etp, fsdp)| {
            let fsdp = match fsdp {
                0 => String::new(),
                1 => ",fsdp".into(),
                _ => ",fsdp=2".into(),
            };
            Training::parse(&format!(
                "tp={tp},cp={cp},dp={dp},pp={pp},ep={ep},etp={etp}{fsdp}"
            ))
            .ok()
        })
}

fn arb_inference() -> impl Strategy<Value = Inference> {
    (1usize..=4, 1usize..=3, 1usize..=4, any::<bool>()).prop_map(|(tp, dp, pp, ep)| Inference {
        tp,
        dp,
        pp,
        ep,
    })
}

/// Nested chunking of `0..n` by `(parts, index)` pairs, outermost first.
fn nested(n: u64, cuts: &[(usize, usize)]) -> std::ops::Range<u64> {
    cuts.iter().fold(0..n, |r, &(parts, i)| {
        let c = chunk(r.end - r.start, parts as u64, i as u64);
        r.start + c.start..r.start + c.end
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Every training rank holds what Megatron's rank formula says: `t + tp (c + cp (d +
    /// dp s))` for dense layers, `et + etp (e + ep (ed + edp s))` for experts.
    #[test]
    fn megatron_rank_formula(t in arb_training(), layer in 0u64..8) {
        let facts = ModelFacts { num_layers: 8, heads: None, tied_embeddings: false };
        let stage = stage_of_layer(layer, 8, t.pp);
        let q = p(&format!("model.layers.{layer}.self_attn.q_proj.weight"), &[23, 5]);
        let dense = train_layout(&q, Kind::Column, &t, &facts).unwrap();
        let up = p(&format!("model.layers.{layer}.mlp.experts.up_proj.weight"), &[7, 11, 5]);
        let experts = train_layout(&up, Kind::ExpertColumn, &t, &facts).unwrap();
        let fsdp = t.fsdp.unwrap_or(1);
        for r in 0..t.world() {
            let (tp_i, c_i, d_i, s) = (r % t.tp, r / t.tp % t.cp, r / (t.tp * t.cp) % t.dp, r / t.stage_size());
            prop_assert_eq!(dense.mesh().contains(r), s == stage);
            prop_assert_eq!(experts.mesh().contains(r), s == stage);
            if s != stage {
                continue;
            }
            let _ = c_i; // CP replicates
            let rows = nested(23, &[(t.tp, tp_i), (fsdp, d_i % fsdp)]);
            prop_assert_eq!(dense.local_region(r), Some(Region::from_ranges(&[rows, 0..5])));
            let local = r % t.stage_size();
            let (et, e, ed) = (local % t.etp, local / t.etp % t.ep, local / (t.etp * t.ep));
            let first = nested(7, &[(t.ep, e), (fsdp, ed % fsdp)]);
            let inner = nested(11, &[(t.etp, et)]);
            prop_assert_eq!(experts.local_region(r), Some(Region::from_ranges(&[first, inner, 0..5])));
        }
    }

    /// Every inference rank holds what vLLM's rank grid says: `base + t + tp (s + pp d)`;
    /// expert layers split over the flattened group `d tp + t`.
    #[test]
    fn vllm_rank_formula(i in arb_inference(), layer in 0u64..8, base in 0usize..5) {
        let facts = ModelFacts { num_layers: 8, heads: None, tied_embeddings: false };
        let stage = stage_of_layer(layer, 8, i.pp);
        let o = p(&format!("model.layers.{layer}.self_attn.o_proj.weight"), &[5, 23]);
        let dense = infer_layout(&o, Kind::Row, &i, &facts, base).unwrap();
        let down = p(&format!("model.layers.{layer}.mlp.experts.down_proj.weight"), &[13, 5, 11]);
        let experts = infer_layout(&down, Kind::ExpertRow, &i, &facts, base).unwrap();
        prop_assert!(!dense.mesh().contains(base + i.world()));
        for r in base..base + i.world() {
            let x = r - base;
            let (t, s, d) = (x % i.tp, x / i.tp % i.pp, x / (i.tp * i.pp));
            prop_assert_eq!(dense.mesh().contains(r), s == stage);
            if s != stage {
                continue;
            }
            let cols = nested(23, &[(i.tp, t)]);
            prop_assert_eq!(dense.local_region(r), Some(Region::from_ranges(&[0..5, cols])));
            let group = (i.tp * i.dp, d * i.tp + t);
            let want = if i.ep {
                Region::from_ranges(&[nested(13, &[group]), 0..5, 0..11])
            } else {
                Region::from_ranges(&[0..13, 0..5, nested(11, &[group])])
            };
            prop_assert_eq!(experts.local_region(r), Some(want));
        }
    }
}
