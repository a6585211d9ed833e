//! Pipeline stages: which stages hold a parameter, vLLM's split of the decoder layers.

use super::super::params::{Heads, Param};
use super::Which;
use crate::error::ModelError;

/// What the layout rules need to know about the model besides a parameter.
#[derive(Clone, Copy, Debug)]
pub struct ModelFacts {
    /// Decoder layers, cut into pipeline stages.
    pub num_layers: u64,
    /// Attention head counts, which tensor parallelism keeps whole; `None` when unknown.
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

/// Refuses more pipeline stages than the model has layers.
pub(super) fn check_stages(pp: usize, facts: &ModelFacts, which: Which) -> Result<(), ModelError> {
    if pp as u64 > facts.num_layers {
        return Err(ModelError::Parallel {
            side: which.field(),
            key: "pp".into(),
            value: pp.to_string(),
            reason: format!("more stages than the model's {} layers", facts.num_layers),
        });
    }
    Ok(())
}
