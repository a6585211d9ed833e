//! What every variant of `reshard bench` measures: its methods, one case's result, and the
//! per-rank reports rank 0 combines. The variants ([`super::driver`], [`super::quant`],
//! [`super::prequant`]) each describe their methods to the harness
//! ([`reshard::runtime::harness`]) and hand back a [`CaseResult`].

use reshard::runtime::harness::{Comparison, Measured};

/// The methods a bench compares; a case runs two or three of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Method {
    /// The reshard (with `--quant`, quantizing in flight; of an already-quantized source,
    /// the values and the scales in one exchange).
    Reshard,
    /// Gather+broadcast (with `--quant`, then quantized on the receivers).
    GatherBroadcast,
    /// With `--quant`: the reshard in the source's dtype, then quantized on the receivers.
    ReshardThenQuantize,
    /// Of an already-quantized source: the values' reshard alone.
    ValuesOnly,
}

impl Method {
    /// The method's key in the per-rank reports and in the JSON.
    pub(super) fn key(self) -> &'static str {
        match self {
            Method::Reshard => "reshard",
            Method::GatherBroadcast => "gather_broadcast",
            Method::ReshardThenQuantize => "reshard_then_quantize",
            Method::ValuesOnly => "values_only",
        }
    }
}

/// One case's outcome on one run: every method measured.
#[derive(Clone, Debug, Default)]
pub(super) struct CaseResult {
    pub(super) reshard: Measured,
    pub(super) gather_broadcast: Measured,
    /// With `--quant`: the reshard in the source's dtype, then quantized on the receivers
    /// (`gather_broadcast` then quantizes on the receivers too).
    pub(super) reshard_then_quantize: Option<Measured>,
    /// With an already-quantized source: the reshard of the values alone (`reshard` and
    /// `gather_broadcast` then move the values and the scales).
    pub(super) values_only: Option<Measured>,
    /// Whether every repetition of every method was checked, each check covering every
    /// destination byte (on every rank); a mismatch fails the bench before this.
    pub(super) verified: bool,
}

impl CaseResult {
    /// The result of the harness's comparison on this process.
    pub(super) fn of(found: &Comparison<Method>) -> CaseResult {
        let has = |m: Method| found.measured.iter().any(|(k, _)| *k == m);
        let optional = |m: Method| has(m).then(|| found.of(m));
        CaseResult {
            reshard: found.of(Method::Reshard),
            gather_broadcast: found.of(Method::GatherBroadcast),
            reshard_then_quantize: optional(Method::ReshardThenQuantize),
            values_only: optional(Method::ValuesOnly),
            verified: found.verified,
        }
    }

    /// This rank's report for rank 0: every method's measurements under its key.
    pub(super) fn rank_report(found: &Comparison<Method>) -> serde_json::Value {
        let mut report = serde_json::json!({ "verified": found.verified });
        for (m, measured) in &found.measured {
            report[m.key()] = measured.report();
        }
        report
    }

    /// The job's result from every rank's [`CaseResult::rank_report`] of one case.
    pub(super) fn combine(per_rank: &[&serde_json::Value]) -> CaseResult {
        let has = |m: Method| per_rank.first().is_some_and(|r| r.get(m.key()).is_some());
        let method = |m: Method| {
            let reports: Vec<&serde_json::Value> = per_rank.iter().map(|r| &r[m.key()]).collect();
            Measured::combine(&reports)
        };
        let optional = |m: Method| has(m).then(|| method(m));
        CaseResult {
            reshard: method(Method::Reshard),
            gather_broadcast: method(Method::GatherBroadcast),
            reshard_then_quantize: optional(Method::ReshardThenQuantize),
            values_only: optional(Method::ValuesOnly),
            verified: !per_rank.is_empty()
                && per_rank
                    .iter()
                    .all(|r| r["verified"].as_bool() == Some(true)),
        }
    }
}

/// A pattern no fill produces everywhere: a destination that is not written fails to verify.
#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The job is verified only when every rank's report says so; a report that leaves the
    /// field out, or a job of no ranks, is not.
    #[test]
    fn a_case_is_verified_only_if_every_rank_checked() {
        let rank = |verified: serde_json::Value| json!({ "verified": verified, "reshard": { "times": [1.0] }, "gather_broadcast": { "times": [2.0] } });
        let (yes, no, absent) = (rank(json!(true)), rank(json!(false)), json!({}));
        assert!(CaseResult::combine(&[&yes, &yes]).verified);
        assert!(!CaseResult::combine(&[&yes, &no]).verified);
        assert!(!CaseResult::combine(&[&yes, &absent]).verified);
        assert!(!CaseResult::combine(&[]).verified);
        let both = CaseResult::combine(&[&yes, &yes]);
        assert_eq!(both.gather_broadcast.times, [2.0]);
        assert!(both.values_only.is_none() && both.reshard_then_quantize.is_none());
    }
}
