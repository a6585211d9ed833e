//! Fused parameters: one local buffer holding the shards of several tensors back to back.
//!
//! vLLM loads `q_proj`, `k_proj`, `v_proj` into one `qkv_proj` buffer, `gate_proj` and
//! `up_proj` into `gate_up_proj`, and the experts' `gate_proj` and `up_proj` into `w13`
//! (`[E, 2 x I, H]`); Megatron-LM holds `gate_proj` and `up_proj` as `linear_fc1`. Each member
//! keeps its own layout; a rank's fused buffer is the concatenation, along `dim`, of the
//! members' local shards, in member order. So a refit plans every member as its own tensor and
//! an executor writes a member's boxes at the member's offset inside the fused buffer, in
//! place, with no temporary full tensor. This module only describes and checks the groups.

use std::collections::HashMap;

use reshard_core::layout::{Layout, Rank};

use crate::error::ModelError;

/// A buffer made of several tensors (indices into a refit's tensor list) concatenated along
/// `dim`, on every rank that holds them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fused {
    /// The buffer's parameter name, as its framework names it
    /// (`model.layers.0.mlp.gate_up_proj.weight`).
    pub name: String,
    /// The dimension the members are concatenated along.
    pub dim: usize,
    /// The members, as indices into the tensor list, in buffer order.
    pub members: Vec<usize>,
}

impl Fused {
    /// Checks that the members (`layouts`, in member order) can share one local buffer: the
    /// same dtype and number of dims, the same ranks, and on every rank the same ranges along
    /// every dim but `dim`.
    ///
    /// ```
    /// use reshard_core::{DType, Layout, Mesh, Placement};
    /// use reshard_model::Fused;
    /// let tp2 = |rows: u64| Layout::new(vec![rows, 8], DType::Bf16,
    ///     Mesh::new(vec![2], vec![0, 1]).unwrap(), vec![Placement::Shard(0)]).unwrap();
    /// let (gate, up) = (tp2(6), tp2(6));
    /// let fused = Fused { name: "mlp.gate_up_proj.weight".into(), dim: 0, members: vec![0, 1] };
    /// fused.validate(&[&gate, &up]).unwrap();
    /// // rank 1's buffer: its 3 rows of gate, then its 3 rows of up
    /// assert_eq!(fused.local_offsets(&[&gate, &up], 1), Some(vec![0, 3]));
    /// ```
    pub fn validate(&self, layouts: &[&Layout]) -> Result<(), ModelError> {
        let err = |reason: String| ModelError::Fused {
            name: self.name.clone(),
            reason,
        };
        let Some(first) = layouts.first() else {
            return Err(err("has no members".into()));
        };
        if layouts.len() != self.members.len() {
            return Err(err(format!(
                "{} members but {} layouts given",
                self.members.len(),
                layouts.len()
            )));
        }
        if self.dim >= first.ndim() {
            return Err(err(format!(
                "dim {} is out of range for {}-D members",
                self.dim,
                first.ndim()
            )));
        }
        let mut ranks = first.mesh().ranks().to_vec();
        ranks.sort_unstable();
        for (m, l) in layouts.iter().enumerate().skip(1) {
            if l.dtype() != first.dtype() {
                return Err(err(format!(
                    "member {m} is {}, member 0 is {}",
                    l.dtype(),
                    first.dtype()
                )));
            }
            if l.ndim() != first.ndim() {
                return Err(err(format!(
                    "member {m} has {} dims, member 0 has {}",
                    l.ndim(),
                    first.ndim()
                )));
            }
            let mut theirs = l.mesh().ranks().to_vec();
            theirs.sort_unstable();
            if theirs != ranks {
                return Err(err(format!(
                    "member {m} lives on other ranks than member 0"
                )));
            }
        }
        // members on the same mesh, split the same way along the shared dims, agree on
        // every rank without looking at each (the common case: gate and up, q and k and v)
        let same_split = |l: &Layout| {
            l.mesh() == first.mesh()
                && (0..first.ndim()).filter(|&d| d != self.dim).all(|d| {
                    l.shape()[d] == first.shape()[d]
                        && l.dim_pieces(d) == first.dim_pieces(d)
                        && shard_axes(l, d) == shard_axes(first, d)
                })
        };
        if layouts.iter().skip(1).all(|l| same_split(l)) {
            return Ok(());
        }
        for &rank in &ranks {
            let boxes: Vec<_> = layouts
                .iter()
                .map(|l| l.local_region(rank).expect("same ranks"))
                .collect();
            for (m, b) in boxes.iter().enumerate().skip(1) {
                for d in (0..first.ndim()).filter(|&d| d != self.dim) {
                    if b.range(d) != boxes[0].range(d) {
                        return Err(err(format!(
                            "on rank {rank}, member {m} holds {:?} of dim {d}, member 0 holds {:?}",
                            b.range(d),
                            boxes[0].range(d)
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Where each member's local shard starts inside `rank`'s fused buffer, in elements along
    /// `dim`; `None` if the rank holds none of it.
    pub fn local_offsets(&self, layouts: &[&Layout], rank: Rank) -> Option<Vec<u64>> {
        let mut at = 0;
        layouts
            .iter()
            .map(|l| {
                let start = at;
                at += l.local_region(rank)?.extent[self.dim];
                Some(start)
            })
            .collect()
    }
}

/// The mesh axes that shard tensor dim `dim`, in mesh order.
fn shard_axes(l: &Layout, dim: usize) -> Vec<usize> {
    l.placements()
        .iter()
        .enumerate()
        .filter(|(_, p)| **p == reshard_core::layout::Placement::Shard(dim))
        .map(|(a, _)| a)
        .collect()
}

/// One way of fusing: member name suffixes (sharing a prefix), the fused suffix, the dim.
struct Recipe {
    members: &'static [&'static str],
    fused: &'static str,
    dim: usize,
}

const VLLM: [Recipe; 5] = [
    Recipe {
        members: &[
            ".mlp.experts.gate_proj.weight",
            ".mlp.experts.up_proj.weight",
        ],
        fused: ".mlp.experts.w13_weight",
        dim: 1,
    },
    Recipe {
        members: &[
            ".self_attn.q_proj.weight",
            ".self_attn.k_proj.weight",
            ".self_attn.v_proj.weight",
        ],
        fused: ".self_attn.qkv_proj.weight",
        dim: 0,
    },
    Recipe {
        members: &[
            ".self_attn.q_proj.bias",
            ".self_attn.k_proj.bias",
            ".self_attn.v_proj.bias",
        ],
        fused: ".self_attn.qkv_proj.bias",
        dim: 0,
    },
    Recipe {
        members: &[
            ".self_attn.q_a_proj.weight",
            ".self_attn.kv_a_proj_with_mqa.weight",
        ],
        fused: ".self_attn.fused_qkv_a_proj.weight",
        dim: 0,
    },
    Recipe {
        members: &[".gate_proj.weight", ".up_proj.weight"],
        fused: ".gate_up_proj.weight",
        dim: 0,
    },
];

const MEGATRON: [Recipe; 2] = [
    Recipe {
        members: &[
            ".mlp.experts.gate_proj.weight",
            ".mlp.experts.up_proj.weight",
        ],
        fused: ".mlp.experts.linear_fc1.weight",
        dim: 1,
    },
    Recipe {
        members: &[".gate_proj.weight", ".up_proj.weight"],
        fused: ".linear_fc1.weight",
        dim: 0,
    },
];

/// The training side of a model that transformers 5 names (`transformers_version` >= 5):
/// its stacked experts hold gate and up in one `mlp.experts.gate_up_proj` parameter
/// (`[E, 2 x I, H]`), a rank's shard being its gate shard then its up shard; dense MLPs as
/// Megatron-LM fuses them.
const TRANSFORMERS_5: [Recipe; 2] = [
    Recipe {
        members: &[
            ".mlp.experts.gate_proj.weight",
            ".mlp.experts.up_proj.weight",
        ],
        fused: ".mlp.experts.gate_up_proj",
        dim: 1,
    },
    Recipe {
        members: &[".gate_proj.weight", ".up_proj.weight"],
        fused: ".linear_fc1.weight",
        dim: 0,
    },
];

/// The training side's fused buffers of a transformers 5 model among `names`: the experts'
/// `gate_up_proj` instead of Megatron-LM's `linear_fc1`.
///
/// ```
/// use reshard_model::transformers5_fused;
/// let names = ["m.layers.0.mlp.experts.gate_proj.weight", "m.layers.0.mlp.experts.up_proj.weight"];
/// assert_eq!(transformers5_fused(&names)[0].name, "m.layers.0.mlp.experts.gate_up_proj");
/// ```
pub fn transformers5_fused(names: &[&str]) -> Vec<Fused> {
    fuse(names, &TRANSFORMERS_5)
}

/// vLLM's fused buffers among `names` (the inference side of a refit).
///
/// ```
/// use reshard_model::vllm_fused;
/// let names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
///              "model.layers.0.mlp.down_proj.weight"];
/// let fused = vllm_fused(&names);
/// assert_eq!(fused[0].name, "model.layers.0.mlp.gate_up_proj.weight");
/// assert_eq!(fused[0].members, [0, 1]);
/// ```
pub fn vllm_fused(names: &[&str]) -> Vec<Fused> {
    fuse(names, &VLLM)
}

/// Megatron-LM's fused buffers among `names` (the training side): `linear_fc1` = [gate; up].
/// Megatron's `linear_qkv` interleaves q, k and v per query group, which is not a
/// concatenation of whole shards, so attention stays unfused here.
pub fn megatron_fused(names: &[&str]) -> Vec<Fused> {
    fuse(names, &MEGATRON)
}

fn fuse(names: &[&str], recipes: &[Recipe]) -> Vec<Fused> {
    let index: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut taken = vec![false; names.len()];
    let mut out = Vec::new();
    for recipe in recipes {
        for (i, name) in names.iter().enumerate() {
            let Some(prefix) = name.strip_suffix(recipe.members[0]) else {
                continue;
            };
            if taken[i] {
                continue;
            }
            let members: Option<Vec<usize>> = recipe
                .members
                .iter()
                .map(|m| index.get(format!("{prefix}{m}").as_str()).copied())
                .collect();
            let Some(members) = members else { continue };
            if members.iter().any(|&m| taken[m]) {
                continue;
            }
            members.iter().for_each(|&m| taken[m] = true);
            out.push(Fused {
                name: format!("{prefix}{}", recipe.fused),
                dim: recipe.dim,
                members,
            });
        }
    }
    out.sort_by_key(|f| f.members[0]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::dtype::DType;
    use reshard_core::layout::{Mesh, Placement};

    fn layout(shape: &[u64], ranks: &[Rank], place: Placement) -> Layout {
        Layout::new(
            shape.to_vec(),
            DType::Bf16,
            Mesh::new(vec![ranks.len()], ranks.to_vec()).unwrap(),
            vec![place],
        )
        .unwrap()
    }

    #[test]
    fn recipes_find_vllm_and_megatron_groups() {
        let names = [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.mlp.experts.gate_proj.weight",
            "model.layers.0.mlp.experts.up_proj.weight",
            "model.layers.0.mlp.shared_experts.gate_proj.weight",
            "model.layers.0.mlp.shared_experts.up_proj.weight",
            "model.layers.1.self_attn.q_a_proj.weight",
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.1.mlp.gate_proj.weight",
        ];
        let got: Vec<(String, usize, Vec<usize>)> = vllm_fused(&names)
            .into_iter()
            .map(|f| (f.name, f.dim, f.members))
            .collect();
        let want = [
            ("model.layers.0.self_attn.qkv_proj.weight", 0, vec![0, 1, 2]),
            ("model.layers.0.mlp.experts.w13_weight", 1, vec![3, 4]),
            (
                "model.layers.0.mlp.shared_experts.gate_up_proj.weight",
                0,
                vec![5, 6],
            ),
            (
                "model.layers.1.self_attn.fused_qkv_a_proj.weight",
                0,
                vec![7, 8],
            ),
        ];
        let want: Vec<(String, usize, Vec<usize>)> = want
            .into_iter()
            .map(|(n, d, m)| (n.to_string(), d, m))
            .collect();
        // a lone gate_proj (no up_proj) is not fused
        assert_eq!(got, want);
        let megatron = megatron_fused(&names);
        assert_eq!(megatron.len(), 2);
        assert_eq!(
            megatron[0].name,
            "model.layers.0.mlp.experts.linear_fc1.weight"
        );
        assert_eq!(
            megatron[1].name,
            "model.layers.0.mlp.shared_experts.linear_fc1.weight"
        );
    }

    #[test]
    fn validation_names_what_disagrees() {
        let f = Fused {
            name: "qkv".into(),
            dim: 0,
            members: vec![0, 1],
        };
        let q = layout(&[8, 4], &[0, 1], Placement::Shard(0));
        // k split along the other dim: rank 0's columns differ
        let k_cols = layout(&[8, 4], &[0, 1], Placement::Shard(1));
        assert_eq!(
            f.validate(&[&q, &k_cols]).unwrap_err().to_string(),
            "fused parameter qkv: on rank 0, member 1 holds 0..2 of dim 1, member 0 holds 0..4"
        );
        let k_far = layout(&[8, 4], &[2, 3], Placement::Shard(0));
        assert_eq!(
            f.validate(&[&q, &k_far]).unwrap_err().to_string(),
            "fused parameter qkv: member 1 lives on other ranks than member 0"
        );
        let k_f32 = Layout::new(
            vec![8, 4],
            DType::F32,
            Mesh::new(vec![2], vec![0, 1]).unwrap(),
            vec![Placement::Shard(0)],
        )
        .unwrap();
        assert_eq!(
            f.validate(&[&q, &k_f32]).unwrap_err().to_string(),
            "fused parameter qkv: member 1 is f32, member 0 is bf16"
        );
        // uneven members are fine along the fused dim
        let k = layout(&[2, 4], &[0, 1], Placement::Shard(0));
        f.validate(&[&q, &k]).unwrap();
        assert_eq!(f.local_offsets(&[&q, &k], 1), Some(vec![0, 4]));
        assert_eq!(f.local_offsets(&[&q, &k], 5), None);
    }
}
