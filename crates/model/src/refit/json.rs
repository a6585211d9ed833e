//! The refit JSON of the design notes (`reshard refit --json`).

use serde::Serialize;

use super::{Refit, RefitTotals};

/// The `reshard` part of the refit JSON.
#[derive(Clone, Debug, Serialize)]
pub struct RefitReshardJson {
    /// Bytes that cross between ranks ([`RefitTotals::bytes_remote`]).
    pub bytes_remote: u64,
    /// Bytes copied inside a rank ([`RefitTotals::bytes_local`]).
    pub bytes_local: u64,
    /// Transfers between ranks ([`RefitTotals::messages`]).
    pub messages: u64,
    /// The most bytes one rank sends.
    pub max_rank_send_bytes: u64,
    /// The most bytes one rank receives.
    pub max_rank_recv_bytes: u64,
    /// Quantized refits only: scale bytes sent between ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_bytes: Option<u64>,
    /// Quantized refits only: partial amax bytes exchanged between source ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub amax_bytes: Option<u64>,
}

/// The `quant` part of the refit JSON: the scheme, the fp8 dtype and how many weights.
#[derive(Clone, Debug, Serialize)]
pub struct RefitQuantJson {
    /// The quantization scheme, as the core writes it (`block:128x128`).
    pub scheme: String,
    /// The fp8 dtype (`fp8e4m3`).
    pub dtype: String,
    /// Weights quantized.
    pub tensors: usize,
}

/// The `gather_broadcast` part of the refit JSON.
#[derive(Clone, Debug, Serialize)]
pub struct RefitGatherBroadcastJson {
    /// What gather+broadcast moves ([`RefitTotals::gather_broadcast_bytes`]).
    pub bytes: u64,
    /// 2x the weights, as NVIDIA counts it ([`RefitTotals::logical_payload_bytes`]).
    pub logical_payload_bytes: u64,
}

/// The refit JSON of the design notes (`reshard refit --json`). `simulation` is filled by the
/// cluster cost model when asked for, and left out otherwise.
#[derive(Clone, Debug, Serialize)]
pub struct RefitJson {
    /// The model's name.
    pub model: String,
    /// Tensors refitted.
    pub tensors: usize,
    /// Elements in all the weights.
    pub params: u64,
    /// Bytes of all the weights, in `train_dtype`.
    pub weight_bytes: u64,
    /// Ranks on the training side.
    pub train_ranks: usize,
    /// Ranks on the inference side.
    pub infer_ranks: usize,
    /// The dtype training holds the weights in ([`Refit::train_dtype`]; `mixed` if they
    /// differ): `weight_bytes` and gather+broadcast's bytes are counted in it.
    pub train_dtype: String,
    /// The dtype inference receives the weights it does not quantize in
    /// ([`Refit::infer_dtype`]): reshard's bytes are wire bytes, counted in it (and in fp8
    /// for the quantized ones).
    pub infer_dtype: String,
    /// Wall-clock time spent planning, in seconds.
    pub plan_seconds: f64,
    /// What reshard's plan moves.
    pub reshard: RefitReshardJson,
    /// What gather+broadcast would move instead, for comparison.
    pub gather_broadcast: RefitGatherBroadcastJson,
    /// Into an fp8 engine only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quant: Option<RefitQuantJson>,
    /// The cluster cost model's estimate, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulation: Option<serde_json::Value>,
}

impl RefitJson {
    /// The JSON of `refit` with its `totals`, without a simulation.
    pub fn of(refit: &Refit, totals: &RefitTotals) -> RefitJson {
        let quantized = refit.quant.is_some();
        RefitJson {
            model: refit.model.clone(),
            tensors: totals.tensors,
            params: totals.params,
            weight_bytes: totals.weight_bytes,
            train_ranks: refit.train_ranks,
            infer_ranks: refit.infer_ranks,
            train_dtype: dtype_name(refit.train_dtype()),
            infer_dtype: dtype_name(refit.infer_dtype()),
            plan_seconds: totals.plan_seconds,
            reshard: RefitReshardJson {
                bytes_remote: totals.bytes_remote,
                bytes_local: totals.bytes_local,
                messages: totals.messages,
                max_rank_send_bytes: totals.max_rank_send_bytes,
                max_rank_recv_bytes: totals.max_rank_recv_bytes,
                scale_bytes: quantized.then_some(totals.scale_bytes),
                amax_bytes: quantized.then_some(totals.amax_bytes),
            },
            gather_broadcast: RefitGatherBroadcastJson {
                bytes: totals.gather_broadcast_bytes,
                logical_payload_bytes: totals.logical_payload_bytes,
            },
            quant: refit.quant.as_ref().map(|q| RefitQuantJson {
                scheme: q.spec.scheme().to_string(),
                dtype: q.spec.fp8.to_string(),
                tensors: q.tensors(),
            }),
            simulation: None,
        }
    }
}

/// A side's dtype in the refit JSON: `mixed` when its tensors differ.
fn dtype_name(dtype: Option<reshard_core::DType>) -> String {
    dtype.map_or_else(|| "mixed".into(), |d| d.to_string())
}
