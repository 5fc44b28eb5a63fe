//! What the task-vector methods (task arithmetic, TIES, DARE) share: their common parameters and
//! the final combination of (sparsified) task vectors, mergekit's
//! `GeneralizedTaskArithmeticMerge.merge_group`
//! (docs/reference/merges.md#methods-their-parameters-and-defaults):
//!
//! ```text
//! wd_i = w_i * d_i
//! with an election:  maj = +1 if sum_i wd_i >= 0 else -1     ("sum", TIES' mass; a tie goes to +1)
//!                    maj = +1 if sum_i sign(wd_i) >= 0 else -1 ("count")
//!                    S = sum_i wd_i [sign(wd_i) == maj],  D = sum_i w_i [sign(wd_i) == maj], D == 0 -> 1
//! without:           S = sum_i wd_i,  D = sum_i w_i,  |D| < 1e-8 -> 1
//! S /= D if normalize;  S *= lambda if lambda != 1;  out = base + S
//! ```
//!
//! The f32 operations come in mergekit's order, so results match it to rounding.

use super::params::{Default, Kind, ParamSpec, Scope, TensorParams};
use std::ops::Deref;

use super::job::Scratch;
use super::TensorJob;
use crate::bail;
use crate::error::Result;

pub const WEIGHT: ParamSpec = ParamSpec {
    name: "weight",
    scope: Scope::PerModel,
    kind: Kind::Number,
    default: Default::Required,
    doc: "coefficient of the model's task vector (required in YAML, as in mergekit; the CLI defaults to 1 each)",
};

pub const DENSITY: ParamSpec = ParamSpec {
    name: "density",
    scope: Scope::PerModel,
    kind: Kind::Number,
    default: Default::Number(1.0),
    doc: "fraction of each task vector's entries KEPT, in (0, 1]; 1 keeps all (mergekit default)",
};

pub const LAMBDA: ParamSpec = ParamSpec {
    name: "lambda",
    scope: Scope::Global,
    kind: Kind::Number,
    default: Default::Number(1.0),
    doc: "scale of the combined task vector, applied after normalization (mergekit default 1)",
};

pub const INT8_MASK: ParamSpec = ParamSpec {
    name: "int8_mask",
    scope: Scope::Global,
    kind: Kind::Bool,
    default: Default::Bool(false),
    doc: "accepted for mergekit compatibility; only changes mergekit's mask storage, never results",
};

/// `normalize` with a method's default (true for TIES, false for the others, as in mergekit).
pub const fn normalize(default: bool, doc: &'static str) -> ParamSpec {
    ParamSpec {
        name: "normalize",
        scope: Scope::Global,
        kind: Kind::Bool,
        default: Default::Bool(default),
        doc,
    }
}

pub const ELECTION: ParamSpec = ParamSpec {
    name: "election",
    scope: Scope::Global,
    kind: Kind::Choice {
        options: &["sum", "count"],
        bools: None,
    },
    default: Default::Choice("sum"),
    doc: "sign election: `sum` = sign of the summed weighted deltas (TIES' mass election, mergekit's only reachable choice); `count` = majority of signs (mergekit's ConsensusMethod.count)",
};

/// Check every model's density is in (0, 1].
pub fn check_densities(job: &TensorJob, params: &TensorParams, method: &str) -> Result<()> {
    for (i, d) in params.model_numbers("density").into_iter().enumerate() {
        if !(d > 0.0 && d <= 1.0) {
            bail!(
                "{method}: density {d} for model {} at tensor `{}` is outside (0, 1]; density is the fraction of entries kept",
                job.models[i].ckpt.label,
                job.name
            );
        }
    }
    Ok(())
}

/// How the sign of each entry is elected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Election {
    Sum,
    Count,
}

impl Election {
    pub fn from_params(params: &TensorParams) -> Election {
        match params.choice("election") {
            "count" => Election::Count,
            _ => Election::Sum,
        }
    }
}

/// The combination step, with its parameters resolved for one tensor.
#[derive(Debug, Clone)]
pub struct Combine {
    weights: Vec<f32>,
    election: Option<Election>,
    normalize: bool,
    lambda: f32,
}

impl Combine {
    pub fn new(params: &TensorParams, election: Option<Election>) -> Combine {
        Combine {
            // mergekit builds its weight tensor in the compute dtype (f32 here).
            weights: params
                .model_numbers("weight")
                .into_iter()
                .map(|w| w as f32)
                .collect(),
            election,
            normalize: params.flag("normalize"),
            lambda: params.number("lambda") as f32,
        }
    }

    /// `out = base + combine(deltas)` element-wise; `deltas[i]` are the (sparsified) task vectors.
    /// Written as loops over whole blocks (models outer, elements inner) so they vectorize; each
    /// element still sees mergekit's operations in mergekit's order.
    pub fn apply<D: Deref<Target = [f32]>>(&self, base: &[f32], deltas: &[D], out: &mut [f32]) {
        let w = &self.weights;
        let n = out.len();
        let mut mixed = Scratch::zeroed(n);
        let mut divisor = Scratch::zeroed(n);
        match self.election {
            None => {
                for (d, &wi) in deltas.iter().zip(w) {
                    for (m, &x) in mixed.iter_mut().zip(d.iter()) {
                        *m += x * wi;
                    }
                }
                let sum = w.iter().fold(0f32, |s, &x| s + x);
                divisor.fill(if sum.abs() < 1e-8 { 1.0 } else { sum });
            }
            Some(election) => {
                // The elected sign: +1 where the vote is >= 0.
                let mut vote = Scratch::zeroed(n);
                for (d, &wi) in deltas.iter().zip(w) {
                    match election {
                        Election::Sum => {
                            for (v, &x) in vote.iter_mut().zip(d.iter()) {
                                *v += x * wi;
                            }
                        }
                        Election::Count => {
                            for (v, &x) in vote.iter_mut().zip(d.iter()) {
                                *v += sign(x * wi);
                            }
                        }
                    }
                }
                for (d, &wi) in deltas.iter().zip(w) {
                    for (((m, dv), &v), &x) in mixed
                        .iter_mut()
                        .zip(divisor.iter_mut())
                        .zip(vote.iter())
                        .zip(d.iter())
                    {
                        let wd = x * wi;
                        // sign(wd) == elected sign; zero (and NaN) never agrees.
                        let agrees = if v >= 0.0 { wd > 0.0 } else { wd < 0.0 };
                        *m += if agrees { wd } else { 0.0 };
                        *dv += if agrees { wi } else { 0.0 };
                    }
                }
                for dv in divisor.iter_mut() {
                    *dv = if *dv == 0.0 { 1.0 } else { *dv };
                }
            }
        }
        let (normalize, lambda) = (self.normalize, self.lambda);
        for (((o, &b), &m), &dv) in out
            .iter_mut()
            .zip(base)
            .zip(mixed.iter())
            .zip(divisor.iter())
        {
            let mut m = m;
            if normalize {
                m /= dv;
            }
            if lambda != 1.0 {
                m *= lambda;
            }
            *o = b + m;
        }
    }
}

/// torch.sign: -1, 0 or +1.
fn sign(x: f32) -> f32 {
    (x > 0.0) as i32 as f32 - (x < 0.0) as i32 as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge::params::Value;
    use std::collections::BTreeMap;

    fn params(weights: &[f64], normalize: bool, lambda: f64) -> TensorParams {
        TensorParams {
            global: BTreeMap::from([
                ("normalize", Value::Bool(normalize)),
                ("lambda", Value::Number(lambda)),
                ("election", Value::Choice("sum".into())),
            ]),
            models: weights
                .iter()
                .map(|&w| BTreeMap::from([("weight", Value::Number(w))]))
                .collect(),
        }
    }

    #[test]
    fn sum_election_keeps_agreeing_entries_and_averages_by_weight() {
        let p = params(&[1.0, 1.0, 1.0], true, 1.0);
        let c = Combine::new(&p, Some(Election::Sum));
        let base = [10.0, 10.0, 10.0, 10.0];
        let deltas = vec![
            vec![1.0, -3.0, 0.0, 1.0],
            vec![2.0, 1.0, 0.0, -1.0],
            vec![-1.0, 1.0, 0.0, 0.0],
        ];
        let mut out = [0f32; 4];
        c.apply(&base, &deltas, &mut out);
        // Entry 0: sum 2 > 0 -> keep 1, 2 -> mean 1.5. Entry 1: sum -1 -> keep -3 only.
        // Entry 2: all zero -> divisor 0 -> 1, S = 0. Entry 3: sum 0 -> +1 wins -> keep 1.
        assert_eq!(out, [11.5, 7.0, 10.0, 11.0]);
        let count = Combine::new(&p, Some(Election::Count));
        count.apply(&base, &deltas, &mut out);
        // Entry 1: signs -,+,+ -> majority + -> mean of 1, 1.
        assert_eq!(out[1], 11.0);
    }

    #[test]
    fn plain_sum_scales_by_lambda_after_normalizing() {
        let p = params(&[0.5, 1.5], true, 2.0);
        let c = Combine::new(&p, None);
        let mut out = [0f32; 1];
        c.apply(&[1.0], &[vec![2.0], vec![-2.0]], &mut out);
        // (0.5*2 - 1.5*2) / 2 * 2 = -2.
        assert_eq!(out, [-1.0]);
    }
}
