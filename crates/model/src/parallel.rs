//! Parallelism configs as users write them: `"tp=2,cp=2,dp=4,ep=16,pp=4"`.
//!
//! Sizes are counted the way Megatron-LM (training) and vLLM (inference) count them; how they
//! turn into layouts is [`super::rules`]'s job.

use reshard_core::error::Field;
use std::collections::BTreeMap;

use crate::error::ModelError;
use reshard_core::limits::MAX_MESH_RANKS;

/// Megatron-style training parallelism.
///
/// The world is `tp x cp x dp x pp` (`dp` is the dense data-parallel size). Expert layers
/// regroup the same ranks of a pipeline stage as `etp x ep x edp`, so `ep x etp` must divide
/// `tp x cp x dp`, and `edp = tp x cp x dp / (ep x etp)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Training {
    /// Tensor parallelism: ranks that split a layer's weights.
    pub tp: usize,
    /// Context parallelism: ranks that split the sequence and replicate the weights.
    pub cp: usize,
    /// Expert parallelism: ranks that split a layer's routed experts among them.
    pub ep: usize,
    /// Expert tensor parallelism. Defaults to 1, as MoE recipes of NeMo RL and Megatron-Bridge
    /// set it (Megatron-core itself would default to `tp`).
    pub etp: usize,
    /// Data parallelism of the dense layers: replicas of a stage (or FSDP ranks).
    pub dp: usize,
    /// Pipeline stages, each holding a contiguous range of layers.
    pub pp: usize,
    /// FSDP shard-group size: the data-parallel ranks of a group split every parameter along
    /// dim 0 (an extra `Shard(0)` axis); groups replicate (HSDP). `None`: no FSDP. Written
    /// `fsdp` (the whole data-parallel group) or `fsdp=N`; `fsdp=N` without `dp` or `world`
    /// means `dp=N` (FSDP over N ranks), as users of FSDP count.
    pub fsdp: Option<usize>,
}

/// vLLM-style inference parallelism. The world is `tp x pp x dp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inference {
    /// Tensor parallelism: ranks that split a layer's weights.
    pub tp: usize,
    /// Data parallelism: engine replicas, which with `ep` share out the routed experts.
    pub dp: usize,
    /// Pipeline stages, each holding a contiguous range of layers.
    pub pp: usize,
    /// vLLM's expert parallelism: the routed experts of a stage are split over all its
    /// `tp x dp` ranks, without tensor parallelism inside an expert (without it, those ranks
    /// tensor-split every expert). Written `ep` or
    /// `ep=N` with `N = tp x dp`.
    pub ep: bool,
}

const TRAIN: Field = Field::Train;
const INFER: Field = Field::Infer;

/// `key=value` pairs, values parsed as positive integers; a bare key has no value.
fn pairs(
    side: Field,
    text: &str,
    allowed: &[&str],
) -> Result<BTreeMap<String, Option<usize>>, ModelError> {
    let mut out = BTreeMap::new();
    let err = |key: &str, value: &str, reason: String| ModelError::Parallel {
        side,
        key: key.to_string(),
        value: value.to_string(),
        reason,
    };
    for item in text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
    {
        let (key, value) = match item.split_once('=') {
            Some((k, v)) => (k.trim().to_ascii_lowercase(), Some(v.trim())),
            None => (item.trim().to_ascii_lowercase(), None),
        };
        let shown = value.unwrap_or("");
        if !allowed.contains(&key.as_str()) {
            return Err(err(
                &key,
                shown,
                format!("unknown key (expected {})", allowed.join(", ")),
            ));
        }
        let number = match value {
            None => None,
            Some(v) => match v.parse::<usize>() {
                Ok(0) => return Err(err(&key, v, "must be at least 1".into())),
                Ok(n) if n >= 1 << 31 => return Err(err(&key, v, "is too large".into())),
                Ok(n) => Some(n),
                Err(_) => return Err(err(&key, v, "not a positive integer".into())),
            },
        };
        if out.insert(key.clone(), number).is_some() {
            return Err(err(&key, shown, "given twice".into()));
        }
    }
    Ok(out)
}

/// The value of `key`, `None` when absent; a bare key (no value) is an error.
fn size(
    side: Field,
    map: &BTreeMap<String, Option<usize>>,
    key: &str,
) -> Result<Option<usize>, ModelError> {
    match map.get(key) {
        None => Ok(None),
        Some(Some(n)) => Ok(Some(*n)),
        Some(None) => Err(ModelError::Parallel {
            side,
            key: key.to_string(),
            value: String::new(),
            reason: "needs a value".into(),
        }),
    }
}

/// The product of `sizes`, if the ranks it counts fit in one side ([`MAX_MESH_RANKS`]):
/// checked here, before every tensor's layout lists that many ranks.
fn world_of(side: Field, sizes: &[(&str, usize)]) -> Result<usize, ModelError> {
    sizes
        .iter()
        .try_fold(1usize, |acc, (_, n)| acc.checked_mul(*n))
        .filter(|&w| w <= MAX_MESH_RANKS)
        .ok_or_else(|| {
            let text: Vec<String> = sizes.iter().map(|(k, n)| format!("{k}={n}")).collect();
            ModelError::Parallel {
                side,
                key: "world".into(),
                value: text.join(","),
                reason: format!("more than the {MAX_MESH_RANKS} ranks a side may have"),
            }
        })
}

/// `dp` from `world=` when `dp` is not given; both given must agree.
fn data_parallel(
    side: Field,
    dp: Option<usize>,
    world: Option<usize>,
    model: usize,
    model_desc: &str,
) -> Result<usize, ModelError> {
    let Some(world) = world else {
        return Ok(dp.unwrap_or(1));
    };
    let err = |reason: String| ModelError::Parallel {
        side,
        key: "world".into(),
        value: world.to_string(),
        reason,
    };
    if !world.is_multiple_of(model) {
        let below = world / model * model;
        let fix = if below > 0 {
            format!("world={below} or world={}", below + model)
        } else {
            format!("world={model}")
        };
        return Err(err(format!(
            "not a multiple of {model_desc} = {model} (write {fix})"
        )));
    }
    let inferred = world / model;
    match dp {
        Some(dp) if dp != inferred => Err(err(format!(
            "{model_desc} x dp = {} (dp={dp}), not {world} (write dp={inferred}, or world={})",
            model * dp,
            model * dp
        ))),
        _ => Ok(inferred),
    }
}

impl Training {
    /// Parses `tp=, cp=, ep=, etp=, dp=, pp=, fsdp[=N], world=`; absent sizes are 1, but
    /// `fsdp=N` without `dp` or `world` is FSDP over N data-parallel ranks.
    ///
    /// ```
    /// use reshard_model::Training;
    /// let t = Training::parse("tp=2,cp=2,ep=16,pp=4,world=64").unwrap();
    /// assert_eq!((t.dp, t.world(), t.edp()), (4, 64, 1));
    /// assert_eq!(Training::parse("fsdp=4").unwrap().world(), 4);
    /// let err = Training::parse("tp=2,dp=4,ep=3").unwrap_err();
    /// assert_eq!(err.to_string(), "train: `ep=3`: ep x etp = 3 must divide tp x cp x dp = 8 (write tp=2,ep=3,dp=12)");
    /// ```
    pub fn parse(text: &str) -> Result<Training, ModelError> {
        let map = pairs(
            TRAIN,
            text,
            &["tp", "cp", "ep", "etp", "dp", "pp", "fsdp", "world"],
        )?;
        let get = |k| size(TRAIN, &map, k).map(|v| v.unwrap_or(1));
        let (tp, cp, ep, etp, pp) = (get("tp")?, get("cp")?, get("ep")?, get("etp")?, get("pp")?);
        world_of(
            TRAIN,
            &[("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep), ("etp", etp)],
        )?;
        let given_dp = size(TRAIN, &map, "dp")?;
        let world = size(TRAIN, &map, "world")?;
        // `fsdp=4` alone is FSDP over 4 ranks: the data-parallel ranks it shards over are
        // the ones it names, when neither dp nor world says otherwise
        let fsdp_n = map.get("fsdp").copied().flatten();
        let given_dp = match (given_dp, world, fsdp_n) {
            (None, None, Some(n)) => Some(n),
            _ => given_dp,
        };
        let dp = data_parallel(TRAIN, given_dp, world, tp * cp * pp, "tp x cp x pp")?;
        world_of(TRAIN, &[("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)])?;
        let fsdp = match map.get("fsdp") {
            None => None,
            Some(None) => Some(dp),
            Some(Some(n)) => Some(*n),
        };
        let t = Training {
            tp,
            cp,
            ep,
            etp,
            dp,
            pp,
            fsdp,
        };
        t.validate()?;
        Ok(t)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let err = |key: &str, value: usize, reason: String| ModelError::Parallel {
            side: TRAIN,
            key: key.into(),
            value: value.to_string(),
            reason,
        };
        let dense = self.tp * self.cp * self.dp;
        if !dense.is_multiple_of(self.ep * self.etp) {
            let (key, value) = if self.ep > 1 {
                ("ep", self.ep)
            } else {
                ("etp", self.etp)
            };
            return Err(err(
                key,
                value,
                format!(
                    "ep x etp = {} must divide tp x cp x dp = {dense} (write {})",
                    self.ep * self.etp,
                    self.with_dp_text(self.dp_for_experts())
                ),
            ));
        }
        if let Some(f) = self.fsdp {
            if f > self.dp {
                return Err(err(
                    "fsdp",
                    f,
                    format!(
                        "is more than dp = {}: FSDP shards over data-parallel ranks (write {}, or fsdp alone to shard over all {} of them)",
                        self.dp,
                        self.with_dp_text(self.dp_for(f)),
                        self.dp
                    ),
                ));
            }
            if !self.dp.is_multiple_of(f) {
                return Err(err(
                    "fsdp",
                    f,
                    format!(
                        "must divide dp = {} (write {}, or fsdp={})",
                        self.dp,
                        self.with_dp_text(lcm(self.dp, self.dp_for(f))),
                        gcd(f, self.dp)
                    ),
                ));
            }
            if !self.edp().is_multiple_of(f) {
                return Err(err(
                    "fsdp",
                    f,
                    format!(
                        "must divide the expert data-parallel size {} = tp x cp x dp / (ep x etp) (write {}, or fsdp={})",
                        self.edp(),
                        self.with_dp_text(self.dp_for(f)),
                        gcd(f, self.edp())
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The smallest dp that `fsdp=f` shards evenly, dense and expert layers alike: a
    /// multiple of `f` whose expert data-parallel size is one too.
    fn dp_for(&self, f: usize) -> usize {
        let experts = self.ep * self.etp;
        // edp = tp cp dp / experts must be a multiple of f: dp a multiple of
        // f experts / gcd(f experts, tp cp)
        let dense = self.tp * self.cp;
        let need = (f * experts) / gcd(f * experts, dense);
        lcm(f, need)
    }

    /// The smallest multiple of dp whose stage the expert ranks (`ep x etp`) divide, and
    /// that `fsdp`, if given, shards evenly.
    fn dp_for_experts(&self) -> usize {
        let experts = self.ep * self.etp;
        let dense = self.tp * self.cp;
        let dp = lcm(self.dp, experts / gcd(experts, dense));
        match self.fsdp {
            Some(f) => lcm(dp, self.dp_for(f)),
            None => dp,
        }
    }

    /// These sizes with `dp` instead, written as `--train` takes them.
    fn with_dp_text(&self, dp: usize) -> String {
        let mut out = Vec::new();
        for (key, n) in [
            ("tp", self.tp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("etp", self.etp),
        ] {
            if n > 1 {
                out.push(format!("{key}={n}"));
            }
        }
        out.push(format!("dp={dp}"));
        if self.pp > 1 {
            out.push(format!("pp={}", self.pp));
        }
        if let Some(f) = self.fsdp {
            out.push(format!("fsdp={f}"));
        }
        out.join(",")
    }

    /// Ranks in the whole training job.
    pub fn world(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// Ranks of one pipeline stage.
    pub fn stage_size(&self) -> usize {
        self.tp * self.cp * self.dp
    }

    /// Expert data-parallel size: how many times each expert shard is held in a stage.
    pub fn edp(&self) -> usize {
        self.stage_size() / (self.ep * self.etp)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

impl Inference {
    /// Parses `tp=, dp=, pp=, ep[=N], world=`; absent sizes are 1.
    ///
    /// ```
    /// use reshard_model::Inference;
    /// let i = Inference::parse("tp=8,ep,world=64").unwrap();
    /// assert_eq!((i.tp, i.dp, i.ep, i.world()), (8, 8, true, 64));
    /// assert!(Inference::parse("tp=8,dp=2,ep=8").is_err()); // vLLM's EP spans tp x dp = 16
    /// ```
    pub fn parse(text: &str) -> Result<Inference, ModelError> {
        let map = pairs(INFER, text, &["tp", "dp", "pp", "ep", "world"])?;
        let get = |k| size(INFER, &map, k).map(|v| v.unwrap_or(1));
        let (tp, pp) = (get("tp")?, get("pp")?);
        world_of(INFER, &[("tp", tp), ("pp", pp)])?;
        let dp = data_parallel(
            INFER,
            size(INFER, &map, "dp")?,
            size(INFER, &map, "world")?,
            tp * pp,
            "tp x pp",
        )?;
        world_of(INFER, &[("tp", tp), ("pp", pp), ("dp", dp)])?;
        let ep = match map.get("ep") {
            None | Some(Some(1)) => false,
            Some(None) => true,
            Some(Some(n)) if *n == tp * dp => true,
            Some(Some(n)) => {
                return Err(ModelError::Parallel {
                    side: INFER,
                    key: "ep".into(),
                    value: n.to_string(),
                    reason: format!(
                        "vLLM's expert parallelism spans tp x dp = {} ranks (write `ep` or ep={})",
                        tp * dp,
                        tp * dp
                    ),
                });
            }
        };
        Ok(Inference { tp, dp, pp, ep })
    }

    /// Ranks on the whole inference side, `tp x pp x dp`.
    pub fn world(&self) -> usize {
        self.tp * self.pp * self.dp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_sizes() {
        let t = Training::parse("tp=2,cp=2,dp=4,ep=16,pp=4").unwrap();
        assert_eq!(t.world(), 64);
        assert_eq!((t.ep, t.etp, t.edp()), (16, 1, 1));
        let t = Training::parse("ep=16 pp=16 dp=16").unwrap();
        assert_eq!((t.world(), t.stage_size(), t.edp()), (256, 16, 1));
        let t = Training::parse("tp=2,dp=8,fsdp").unwrap();
        assert_eq!(t.fsdp, Some(8));
        let t = Training::parse("tp=2,dp=8,ep=4,etp=2,fsdp=2").unwrap();
        assert_eq!((t.edp(), t.fsdp), (2, Some(2)));
        assert_eq!(Training::parse("").unwrap().world(), 1);
    }

    #[test]
    fn fsdp_alone_is_fsdp_over_that_many_ranks() {
        let t = Training::parse("fsdp=4").unwrap();
        assert_eq!((t.dp, t.fsdp, t.world()), (4, Some(4), 4));
        let t = Training::parse("tp=2,fsdp=4").unwrap();
        assert_eq!((t.dp, t.world()), (4, 8));
        // dp or world, when given, still say how many data-parallel ranks there are
        assert_eq!(Training::parse("dp=8,fsdp=4").unwrap().dp, 8);
        assert_eq!(Training::parse("tp=2,fsdp=2,world=8").unwrap().dp, 4);
        let refused = [
            (
                "dp=2,fsdp=4",
                "train: `fsdp=4`: is more than dp = 2: FSDP shards over data-parallel ranks (write dp=4,fsdp=4, or fsdp alone to shard over all 2 of them)",
            ),
            (
                "fsdp=4,ep=4",
                "train: `fsdp=4`: must divide the expert data-parallel size 1 = tp x cp x dp / (ep x etp) (write ep=4,dp=16,fsdp=4, or fsdp=1)",
            ),
            (
                "tp=2,dp=4,ep=4,fsdp=4",
                "train: `fsdp=4`: must divide the expert data-parallel size 2 = tp x cp x dp / (ep x etp) (write tp=2,ep=4,dp=8,fsdp=4, or fsdp=2)",
            ),
        ];
        for (text, want) in refused {
            assert_eq!(
                Training::parse(text).unwrap_err().to_string(),
                want,
                "{text}"
            );
            // what the message says to write parses
            let fix = want
                .split("(write ")
                .nth(1)
                .unwrap()
                .split(", or")
                .next()
                .unwrap();
            Training::parse(fix).unwrap();
        }
    }

    #[test]
    fn vllm_sizes() {
        let i = Inference::parse("tp=32,dp=8").unwrap();
        assert_eq!((i.world(), i.ep), (256, false));
        let i = Inference::parse("tp=4,pp=2,ep=4").unwrap();
        assert!(i.ep);
        assert_eq!(Inference::parse("tp=4,world=32,pp=2").unwrap().dp, 4);
    }

    #[test]
    fn errors_name_the_key_and_value() {
        let cases = [
            (
                Training::parse("tp=2,sp=2").unwrap_err(),
                "train: `sp=2`: unknown key (expected tp, cp, ep, etp, dp, pp, fsdp, world)",
            ),
            (
                Training::parse("tp=0").unwrap_err(),
                "train: `tp=0`: must be at least 1",
            ),
            (
                Training::parse("tp=two").unwrap_err(),
                "train: `tp=two`: not a positive integer",
            ),
            (
                Training::parse("tp=2,tp=4").unwrap_err(),
                "train: `tp=4`: given twice",
            ),
            (
                Training::parse("tp=2,pp").unwrap_err(),
                "train: `pp=`: needs a value",
            ),
            (
                Training::parse("tp=4,world=10").unwrap_err(),
                "train: `world=10`: not a multiple of tp x cp x pp = 4 (write world=8 or world=12)",
            ),
            (
                Training::parse("tp=4,dp=2,world=16").unwrap_err(),
                "train: `world=16`: tp x cp x pp x dp = 8 (dp=2), not 16 (write dp=4, or world=8)",
            ),
            (
                Training::parse("dp=4,etp=8").unwrap_err(),
                "train: `etp=8`: ep x etp = 8 must divide tp x cp x dp = 4 (write etp=8,dp=8)",
            ),
            (
                Training::parse("dp=6,fsdp=4").unwrap_err(),
                "train: `fsdp=4`: must divide dp = 6 (write dp=12,fsdp=4, or fsdp=2)",
            ),
            (
                Training::parse("tp=65536,dp=65536").unwrap_err(),
                "train: `world=tp=65536,cp=1,dp=65536,pp=1`: more than the 16777216 ranks a side may have",
            ),
            (
                // refused before each of a model's tensors lists twenty million ranks
                Inference::parse("dp=20000000").unwrap_err(),
                "infer: `world=tp=1,pp=1,dp=20000000`: more than the 16777216 ranks a side may have",
            ),
            (
                Inference::parse("tp=8,cp=2").unwrap_err(),
                "infer: `cp=2`: unknown key (expected tp, dp, pp, ep, world)",
            ),
            (
                Inference::parse("tp=8,dp=2,ep=8").unwrap_err(),
                "infer: `ep=8`: vLLM's expert parallelism spans tp x dp = 16 ranks (write `ep` or ep=16)",
            ),
        ];
        for (err, text) in cases {
            assert_eq!(err.to_string(), text);
            // what a training refusal says to write parses
            if let Some(fix) = text
                .strip_prefix("train: ")
                .and_then(|t| t.split("(write ").nth(1))
            {
                let fix = fix.split([',', ' ', ')']).collect::<Vec<_>>();
                let fix = fix
                    .iter()
                    .take_while(|w| w.contains('='))
                    .copied()
                    .collect::<Vec<_>>();
                let fix = fix.join(",");
                Training::parse(&fix).unwrap_or_else(|e| panic!("{text}: {fix}: {e}"));
            }
        }
    }
}
