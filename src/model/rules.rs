//! The layout rules: how every parameter is laid out in training (Megatron-LM) and in
//! inference (vLLM). This is the one place they are written down.
//!
//! # Kinds
//!
//! A rule maps a parameter name (a glob, `*` matching anything, dots included) to a [`Kind`],
//! which says *how* a parameter is split, whatever the parallelism sizes:
//!
//! | kind            | dense tensor `[out, in]`, `[n]`            | written     |
//! |-----------------|--------------------------------------------|-------------|
//! | `replicate`     | every rank of the stage holds all of it    | `replicate` |
//! | `column`        | TP splits dim 0 (output features, vocab)   | `column`    |
//! | `row`           | TP splits dim 1 (input features)           | `row`       |
//! | `kv-column`     | `column`, but by whole key/value heads: with more TP ranks than heads, each head is replicated on `tp / heads` neighbouring ranks (as vLLM does) | `kv-column` |
//! | `expert-column` | stacked experts `[E, out, in]`: EP splits dim 0, expert TP dim 1 | `expert-column` |
//! | `expert-row`    | stacked experts `[E, out, in]`: EP splits dim 0, expert TP dim 2 | `expert-row` |
//!
//! # Default rules (first match wins)
//!
//! | parameter                                                        | kind            |
//! |------------------------------------------------------------------|-----------------|
//! | `*.mlp.experts.gate_proj.weight`, `*.mlp.experts.up_proj.weight` | `expert-column` |
//! | `*.mlp.experts.down_proj.weight`                                 | `expert-row`    |
//! | `*embed_tokens.weight` (vocab-parallel embedding), `lm_head.weight` | `column`     |
//! | `*norm.weight` (layer norms, `q_norm`/`k_norm`, MLA's `q_a_layernorm`/`kv_a_layernorm`, final norm) | `replicate` |
//! | `*.self_attn.q_proj.*`, `*.self_attn.q_b_proj.weight`, `*.self_attn.kv_b_proj.weight` | `column` |
//! | `*.self_attn.k_proj.*`, `*.self_attn.v_proj.*`                   | `kv-column`     |
//! | `*.self_attn.q_a_proj.weight`, `*.self_attn.kv_a_proj_with_mqa.weight` (MLA down-projections, duplicated on every TP rank) | `replicate` |
//! | `*.self_attn.o_proj.weight`                                      | `row`           |
//! | `*.mlp.gate.*` (router weight, `e_score_correction_bias`)        | `replicate`     |
//! | `*.gate_proj.weight`, `*.up_proj.weight` (dense and shared-expert MLPs) | `column` |
//! | `*.down_proj.weight`                                             | `row`           |
//! | anything else (biases of row-parallel layers included)           | `replicate`     |
//!
//! Overrides ([`Rules::with_override`], `--override '[train:|infer:]GLOB=KIND'`) are tried
//! before the defaults, in the order given, on both sides or on the one named.
//!
//! # Training (Megatron-LM): `tp, cp, ep, etp, dp, pp`, FSDP
//!
//! - Ranks `0 .. tp x cp x dp x pp`, tp fastest, then cp, dp, pp: rank
//!   `t + tp x (c + cp x (d + dp x s))` for stage `s`. Expert layers regroup a stage's ranks as
//!   `etp` fastest, then `ep`, then `edp`.
//! - TP applies the kind; CP holds full weights (it splits activations only): replication.
//!   DP replicates. Experts: EP splits dim 0, ETP splits dim 1 or 2, EDP replicates.
//! - FSDP (`fsdp=N`): inside each group of N data-parallel ranks, every parameter (experts:
//!   every expert-data-parallel group) is further split along dim 0, *after* TP/EP (FSDP
//!   shards the tensor-parallel shard, as FSDP2 with TP does); the groups replicate (HSDP).
//!
//! # Inference (vLLM): `tp, dp, pp`, `ep`
//!
//! - Ranks right after the training ranks (or from 0 with `--colocated`), tp fastest, then pp,
//!   then dp (vLLM's `(dp, pp, tp)` rank grid): rank `base + t + tp x (s + pp x d)`.
//! - TP applies the kind; DP replicates. Expert layers form one group of all `tp x dp` ranks
//!   of a stage, in the order `d x tp + t` (vLLM flattens TP across DP for MoE layers): without
//!   `ep`, that group tensor-splits dim 1 or 2 of every expert; with `ep`, it splits the
//!   experts (dim 0), with no TP inside an expert. Either is one `torch.chunk` split.
//!
//! # Pipeline stages (both sides)
//!
//! Decoder layers are cut into `pp` contiguous blocks of `L / pp` layers; the `L mod pp` extra
//! layers go to the stages just before the last (vLLM's rule). The embedding sits on the first
//! stage; the final norm and `lm_head` on the last. With tied embeddings and `pp > 1`, the
//! embedding is held by the first and the last stage. A stage's layouts list only that stage's
//! ranks: ranks outside it hold nothing.
//!
//! Shards follow `torch.chunk` (vocabularies are not padded to a multiple of TP).

use std::fmt;
use std::str::FromStr;

use globset::{Glob, GlobMatcher};

use crate::layout::{Layout, Mesh, Placement, Rank};

use super::error::ModelError;
use super::parallel::{Inference, Training};
use super::params::{Heads, Param};

/// How a parameter is split, independently of the parallelism sizes (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Replicate,
    Column,
    Row,
    KvColumn,
    ExpertColumn,
    ExpertRow,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::Replicate,
        Kind::Column,
        Kind::Row,
        Kind::KvColumn,
        Kind::ExpertColumn,
        Kind::ExpertRow,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Kind::Replicate => "replicate",
            Kind::Column => "column",
            Kind::Row => "row",
            Kind::KvColumn => "kv-column",
            Kind::ExpertColumn => "expert-column",
            Kind::ExpertRow => "expert-row",
        }
    }

    fn is_expert(self) -> bool {
        matches!(self, Kind::ExpertColumn | Kind::ExpertRow)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Kind {
    type Err = String;

    fn from_str(s: &str) -> Result<Kind, String> {
        let key = s.trim().to_ascii_lowercase().replace('_', "-");
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == key)
            .ok_or_else(|| {
                let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown kind `{s}` (expected {})", names.join(", "))
            })
    }
}

/// Which side of a refit a rule applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Which {
    Train,
    Infer,
}

impl Which {
    fn flag(self) -> &'static str {
        match self {
            Which::Train => "--train",
            Which::Infer => "--infer",
        }
    }
}

/// The default rules, in order (first match wins). The module docs explain each.
pub const DEFAULT_RULES: [(&str, Kind); 19] = [
    ("*.mlp.experts.gate_proj.weight", Kind::ExpertColumn),
    ("*.mlp.experts.up_proj.weight", Kind::ExpertColumn),
    ("*.mlp.experts.down_proj.weight", Kind::ExpertRow),
    ("*embed_tokens.weight", Kind::Column),
    ("lm_head.weight", Kind::Column),
    ("*norm.weight", Kind::Replicate),
    ("*.self_attn.q_proj.*", Kind::Column),
    ("*.self_attn.q_b_proj.weight", Kind::Column),
    ("*.self_attn.kv_b_proj.weight", Kind::Column),
    ("*.self_attn.k_proj.*", Kind::KvColumn),
    ("*.self_attn.v_proj.*", Kind::KvColumn),
    ("*.self_attn.q_a_proj.weight", Kind::Replicate),
    ("*.self_attn.kv_a_proj_with_mqa.weight", Kind::Replicate),
    ("*.self_attn.o_proj.weight", Kind::Row),
    ("*.mlp.gate.*", Kind::Replicate),
    ("*.gate_proj.weight", Kind::Column),
    ("*.up_proj.weight", Kind::Column),
    ("*.down_proj.weight", Kind::Row),
    ("*", Kind::Replicate),
];

#[derive(Clone, Debug)]
struct Rule {
    pattern: String,
    matcher: GlobMatcher,
    kind: Kind,
    only: Option<Which>,
}

/// The rules in force: overrides first, then [`DEFAULT_RULES`].
#[derive(Clone, Debug)]
pub struct Rules {
    overrides: Vec<Rule>,
    defaults: Vec<Rule>,
}

impl Default for Rules {
    fn default() -> Rules {
        let defaults = DEFAULT_RULES
            .iter()
            .map(|&(pattern, kind)| Rule {
                pattern: pattern.to_string(),
                matcher: Glob::new(pattern)
                    .expect("default rules are valid globs")
                    .compile_matcher(),
                kind,
                only: None,
            })
            .collect();
        Rules {
            overrides: Vec::new(),
            defaults,
        }
    }
}

impl Rules {
    /// Adds an override, tried before the defaults and after earlier overrides.
    ///
    /// ```
    /// use reshard::model::{Kind, Rules, Which};
    /// let rules = Rules::default().with_override("*.o_proj.weight", Kind::Replicate, Some(Which::Infer)).unwrap();
    /// assert_eq!(rules.kind("model.layers.0.self_attn.o_proj.weight", Which::Infer), Kind::Replicate);
    /// assert_eq!(rules.kind("model.layers.0.self_attn.o_proj.weight", Which::Train), Kind::Row);
    /// ```
    pub fn with_override(
        mut self,
        pattern: &str,
        kind: Kind,
        only: Option<Which>,
    ) -> Result<Rules, ModelError> {
        let matcher = Glob::new(pattern)
            .map_err(|e| ModelError::Override {
                value: pattern.to_string(),
                reason: e.kind().to_string(),
            })?
            .compile_matcher();
        self.overrides.push(Rule {
            pattern: pattern.to_string(),
            matcher,
            kind,
            only,
        });
        Ok(self)
    }

    /// Adds an override written `[train:|infer:]GLOB=KIND`, as `--override` takes it.
    ///
    /// ```
    /// use reshard::model::{Kind, Rules, Which};
    /// let rules = Rules::default().with_override_text("train:*.mlp.gate.weight=column").unwrap();
    /// assert_eq!(rules.kind("model.layers.3.mlp.gate.weight", Which::Train), Kind::Column);
    /// assert!(Rules::default().with_override_text("*.weight=diagonal").is_err());
    /// ```
    pub fn with_override_text(self, text: &str) -> Result<Rules, ModelError> {
        let err = |reason: String| ModelError::Override {
            value: text.to_string(),
            reason,
        };
        let (only, rest) = if let Some(rest) = text.strip_prefix("train:") {
            (Some(Which::Train), rest)
        } else if let Some(rest) = text.strip_prefix("infer:") {
            (Some(Which::Infer), rest)
        } else {
            (None, text)
        };
        let (pattern, kind) = rest
            .rsplit_once('=')
            .ok_or_else(|| err("expected [train:|infer:]GLOB=KIND".into()))?;
        let kind: Kind = kind.parse().map_err(err)?;
        if pattern.trim().is_empty() {
            return Err(err("the pattern is empty".into()));
        }
        self.with_override(pattern.trim(), kind, only)
            .map_err(|e| match e {
                ModelError::Override { reason, .. } => err(reason),
                other => other,
            })
    }

    /// The kind of parameter `name` on side `which`.
    pub fn kind(&self, name: &str, which: Which) -> Kind {
        self.rule(name, which).map_or(Kind::Replicate, |r| r.kind)
    }

    /// The pattern that decides `name` on side `which` (for explanations).
    pub fn pattern(&self, name: &str, which: Which) -> Option<&str> {
        self.rule(name, which).map(|r| r.pattern.as_str())
    }

    fn rule(&self, name: &str, which: Which) -> Option<&Rule> {
        self.overrides
            .iter()
            .filter(|r| r.only.is_none_or(|w| w == which))
            .chain(&self.defaults)
            .find(|r| r.matcher.is_match(name))
    }
}

/// What the layout rules need to know about the model besides a parameter.
#[derive(Clone, Copy, Debug)]
pub struct ModelFacts {
    pub num_layers: u64,
    pub heads: Option<Heads>,
    /// The input embedding doubles as the output projection (no `lm_head`).
    pub tied_embeddings: bool,
}

/// The pipeline stages that hold `param`: its layer's stage; the embedding on the first (and,
/// tied, also the last); everything else outside the decoder layers on the last.
pub fn stages_of(param: &Param, facts: &ModelFacts, pp: usize) -> Vec<usize> {
    match param.layer() {
        Some(layer) => vec![stage_of_layer(layer, facts.num_layers, pp)],
        None if param.name.contains("embed_tokens") => {
            if facts.tied_embeddings && pp > 1 {
                vec![0, pp - 1]
            } else {
                vec![0]
            }
        }
        None => vec![pp - 1],
    }
}

/// vLLM's split: `L / pp` layers per stage, one more for the `L mod pp` stages before the last.
pub fn stage_of_layer(layer: u64, layers: u64, pp: usize) -> usize {
    let pp64 = pp as u64;
    let (base, extra) = (layers / pp64, layers % pp64);
    let mut start = 0;
    for s in 0..pp64 {
        let longer = s + 1 + extra >= pp64 && s + 1 < pp64;
        start += base + u64::from(longer);
        if layer < start {
            return s as usize;
        }
    }
    pp - 1
}

/// One mesh axis: its size, the rank distance between neighbours along it, its placement.
/// An axis may also run over two strides (`inner` ranks at `stride`, then the next block of
/// `inner` at `outer_stride`), for a split over ranks that are not evenly spaced, like vLLM's
/// expert parallelism across pipeline stages.
#[derive(Clone, Copy, Debug)]
struct Axis {
    size: usize,
    stride: usize,
    inner: usize,
    outer_stride: usize,
    place: Placement,
}

impl Axis {
    fn new(size: usize, stride: usize, place: Placement) -> Axis {
        Axis {
            size,
            stride,
            inner: size,
            outer_stride: 0,
            place,
        }
    }

    /// `outer x inner` positions: `inner` ranks at `stride`, blocks of them at `outer_stride`.
    fn blocks(
        outer: usize,
        outer_stride: usize,
        inner: usize,
        stride: usize,
        place: Placement,
    ) -> Axis {
        Axis {
            size: outer * inner,
            stride,
            inner,
            outer_stride,
            place,
        }
    }

    /// The rank distance of coordinate `c` from coordinate 0.
    fn offset(&self, c: usize) -> usize {
        (c / self.inner) * self.outer_stride + (c % self.inner) * self.stride
    }

    /// The largest distance between neighbours: what orders axes slowest first.
    fn span(&self) -> usize {
        self.stride.max(self.outer_stride)
    }
}

/// The layout over `axes` (for axes sharding the same dim, list order = nesting order), ranks
/// `base + sum(offset of each coord)`. Size-1 axes are dropped; a single rank gets a one-axis
/// replicated mesh.
fn build(param: &Param, base: Rank, axes: &[Axis], which: Which) -> Result<Layout, ModelError> {
    let mut axes: Vec<Axis> = axes.iter().copied().filter(|a| a.size > 1).collect();
    // Slowest axes first, so that ranks read in row-major order where possible (`ranks=0..8`),
    // but never swapping two axes that shard the same dim: their order is the nesting order.
    for end in (1..axes.len()).rev() {
        for i in 0..end {
            let (a, b) = (axes[i], axes[i + 1]);
            let same_dim =
                matches!((a.place, b.place), (Placement::Shard(x), Placement::Shard(y)) if x == y);
            if a.span() < b.span() && !same_dim {
                axes.swap(i, i + 1);
            }
        }
    }
    let axes = if axes.is_empty() {
        vec![Axis::new(1, 1, Placement::Replicate)]
    } else {
        axes
    };
    let dims: Vec<usize> = axes.iter().map(|a| a.size).collect();
    let count: usize = dims.iter().product();
    let mut ranks = Vec::with_capacity(count);
    for mut position in 0..count {
        let mut rank = base;
        for a in axes.iter().rev() {
            rank += a.offset(position % a.size);
            position /= a.size;
        }
        ranks.push(rank);
    }
    let err = |source| ModelError::Layout {
        tensor: param.name.clone(),
        side: which.flag(),
        source,
    };
    let mesh = Mesh::new(dims, ranks).map_err(err)?;
    let placements = axes.iter().map(|a| a.place).collect();
    Layout::new(param.shape.clone(), param.dtype, mesh, placements).map_err(err)
}

/// The tensor-parallel axes of a dense (non-expert) parameter of `kind`, TP ranks at stride 1.
fn tp_axes(
    param: &Param,
    kind: Kind,
    tp: usize,
    facts: &ModelFacts,
    which: Which,
) -> Result<Vec<Axis>, ModelError> {
    let shard = |dim: usize| Placement::Shard(dim);
    Ok(match kind {
        Kind::Replicate | Kind::ExpertColumn | Kind::ExpertRow => {
            vec![Axis::new(tp, 1, Placement::Replicate)]
        }
        Kind::Column => vec![Axis::new(tp, 1, shard(0))],
        Kind::Row => vec![Axis::new(tp, 1, shard(1))],
        Kind::KvColumn => {
            let Some(kv) = facts.heads.map(|h| h.kv as usize) else {
                return Ok(vec![Axis::new(tp, 1, shard(0))]);
            };
            if kv.is_multiple_of(tp) {
                vec![Axis::new(tp, 1, shard(0))]
            } else if tp.is_multiple_of(kv) {
                let copies = tp / kv;
                vec![
                    Axis::new(kv, copies, shard(0)),
                    Axis::new(copies, 1, Placement::Replicate),
                ]
            } else {
                return Err(ModelError::Parallel {
                    side: which.flag(),
                    key: "tp".into(),
                    value: tp.to_string(),
                    reason: format!(
                        "{}: tp must divide or be a multiple of the {kv} key/value heads",
                        param.name
                    ),
                });
            }
        }
    })
}

fn expert_dim(param: &Param, kind: Kind, which: Which) -> Result<usize, ModelError> {
    if param.shape.len() != 3 {
        return Err(ModelError::KindShape {
            tensor: param.name.clone(),
            side: which.flag(),
            kind: kind.name(),
            ndim: param.shape.len(),
        });
    }
    Ok(if kind == Kind::ExpertColumn { 1 } else { 2 })
}

/// An axis holding every stage in `stages` (one or two), placed as a replication.
fn stage_axis(stages: &[usize], stage_stride: usize) -> Vec<Axis> {
    match stages {
        [first, .., last] if last > first => vec![Axis::new(
            2,
            (last - first) * stage_stride,
            Placement::Replicate,
        )],
        _ => Vec::new(),
    }
}

/// The training layout of `param` (Megatron-LM; see the module docs).
pub fn train_layout(
    param: &Param,
    kind: Kind,
    t: &Training,
    facts: &ModelFacts,
) -> Result<Layout, ModelError> {
    let which = Which::Train;
    check_stages(t.pp, facts, which)?;
    let stages = stages_of(param, facts, t.pp);
    let stage = t.stage_size();
    let mut axes = stage_axis(&stages, stage);
    // data-parallel axes: `dp` ranks at `stride`, FSDP splitting dim 0 inside groups of f
    let data = |dp: usize, stride: usize| match t.fsdp {
        Some(f) => vec![
            Axis::new(dp / f, stride * f, Placement::Replicate),
            Axis::new(f, stride, Placement::Shard(0)),
        ],
        None => vec![Axis::new(dp, stride, Placement::Replicate)],
    };
    if kind.is_expert() {
        let dim = expert_dim(param, kind, which)?;
        axes.push(Axis::new(t.ep, t.etp, Placement::Shard(0)));
        axes.push(Axis::new(t.etp, 1, Placement::Shard(dim)));
        axes.extend(data(t.edp(), t.etp * t.ep));
    } else {
        axes.extend(tp_axes(param, kind, t.tp, facts, which)?);
        axes.push(Axis::new(t.cp, t.tp, Placement::Replicate));
        axes.extend(data(t.dp, t.tp * t.cp));
    }
    build(param, stages[0] * stage, &axes, which)
}

/// The inference layout of `param` (vLLM; see the module docs), ranks from `base`.
pub fn infer_layout(
    param: &Param,
    kind: Kind,
    i: &Inference,
    facts: &ModelFacts,
    base: Rank,
) -> Result<Layout, ModelError> {
    let which = Which::Infer;
    check_stages(i.pp, facts, which)?;
    let stages = stages_of(param, facts, i.pp);
    let mut axes = stage_axis(&stages, i.tp);
    let dp_stride = i.tp * i.pp;
    if kind.is_expert() {
        let dim = expert_dim(param, kind, which)?;
        // one split over the stage's tp x dp ranks, in the order d x tp + t
        let split = if i.ep { 0 } else { dim };
        axes.push(Axis::blocks(
            i.dp,
            dp_stride,
            i.tp,
            1,
            Placement::Shard(split),
        ));
    } else {
        axes.extend(tp_axes(param, kind, i.tp, facts, which)?);
        axes.push(Axis::new(i.dp, dp_stride, Placement::Replicate));
    }
    build(param, base + stages[0] * i.tp, &axes, which)
}

fn check_stages(pp: usize, facts: &ModelFacts, which: Which) -> Result<(), ModelError> {
    if pp as u64 > facts.num_layers {
        return Err(ModelError::Parallel {
            side: which.flag(),
            key: "pp".into(),
            value: pp.to_string(),
            reason: format!("more stages than the model's {} layers", facts.num_layers),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::region::Region;

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
            "--infer: `tp=3`: model.layers.0.self_attn.k_proj.weight: tp must divide or be a multiple of the 4 key/value heads"
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
        let err =
            infer_layout(&p("x.weight", &[4, 4]), Kind::ExpertRow, &i, &FACTS, 0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "tensor x.weight: --infer: kind expert-row needs a stacked [E, out, in] tensor, this one is 2-D"
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
            "--infer: `pp=9`: more stages than the model's 8 layers"
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
        assert!(err.starts_with("--override: `a[=row`: "), "{err}");
        let err = Rules::default()
            .with_override_text("*.weight")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "--override: `*.weight`: expected [train:|infer:]GLOB=KIND"
        );
        let err = Rules::default()
            .with_override_text("*=sideways")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "--override: `*=sideways`: unknown kind `sideways` (expected replicate, column, row, kv-column, expert-column, expert-row)"
        );
    }

    use crate::layout::chunk;
    use proptest::prelude::*;

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
}
