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
//! | `*.mlp.experts.down_proj.weight`, `*.mlp.experts.down_proj` (transformers 5) | `expert-row` |
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
//!
//! # Where each part lives
//!
//! This file holds the kinds and the rule table; `stages.rs` the pipeline split, `axes.rs`
//! the mesh axes every layout is built from, `megatron.rs` the training side and `vllm.rs`
//! the inference side.

use reshard_core::error::Field;
use std::fmt;
use std::str::FromStr;

use globset::{Glob, GlobMatcher};

use crate::error::ModelError;

mod axes;
mod megatron;
mod pipeline;
#[cfg(test)]
mod tests;
mod vllm;

pub use megatron::train_layout;
pub use pipeline::{ModelFacts, stage_of_layer, stages_of};
pub use vllm::{infer_engines, infer_layout};

/// How a parameter is split, independently of the parallelism sizes (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Every rank of the stage holds all of it.
    Replicate,
    /// TP splits dim 0 (output features, vocabulary).
    Column,
    /// TP splits dim 1 (input features).
    Row,
    /// [`Kind::Column`] by whole key/value heads: with more TP ranks than heads, each head
    /// is replicated on `tp / heads` neighbouring ranks (as vLLM does).
    KvColumn,
    /// Stacked experts `[E, out, in]`: EP splits dim 0, expert TP dim 1.
    ExpertColumn,
    /// Stacked experts `[E, out, in]`: EP splits dim 0, expert TP dim 2.
    ExpertRow,
}

impl Kind {
    /// Every kind, in the order error messages list them.
    pub const ALL: [Kind; 6] = [
        Kind::Replicate,
        Kind::Column,
        Kind::Row,
        Kind::KvColumn,
        Kind::ExpertColumn,
        Kind::ExpertRow,
    ];

    /// The name an override writes (`kv-column`).
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
    /// The training side (Megatron-LM).
    Train,
    /// The inference side (vLLM).
    Infer,
}

impl Which {
    fn field(self) -> Field {
        match self {
            Which::Train => Field::Train,
            Which::Infer => Field::Infer,
        }
    }
}

/// The default rules, in order (first match wins). The module docs explain each.
pub const DEFAULT_RULES: [(&str, Kind); 20] = [
    ("*.mlp.experts.gate_proj.weight", Kind::ExpertColumn),
    ("*.mlp.experts.up_proj.weight", Kind::ExpertColumn),
    ("*.mlp.experts.down_proj.weight", Kind::ExpertRow),
    ("*.mlp.experts.down_proj", Kind::ExpertRow),
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
    /// use reshard_model::{Kind, Rules, Which};
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
    /// use reshard_model::{Kind, Rules, Which};
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
