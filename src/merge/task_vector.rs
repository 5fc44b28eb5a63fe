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

use super::params::{Kind, ParamDefault, ParamSpec, Scope, TensorValues};
use std::ops::Deref;

use super::job::Scratch;
use super::TensorJob;
use crate::bail;
use crate::error::Result;

pub const WEIGHT: ParamSpec = ParamSpec {
    name: "weight",
    scope: Scope::PerModel,
    kind: Kind::Number,
    default: ParamDefault::Required,
    doc: "coefficient of the model's task vector (required in YAML, as in mergekit; the CLI defaults to 1 each)",
};

pub const DENSITY: ParamSpec = ParamSpec {
    name: "density",
    scope: Scope::PerModel,
    kind: Kind::Number,
    default: ParamDefault::Number(1.0),
    doc: "fraction of each task vector's entries KEPT, in (0, 1]; 1 keeps all (mergekit default)",
};

pub const LAMBDA: ParamSpec = ParamSpec {
    name: "lambda",
    scope: Scope::Global,
    kind: Kind::Number,
    default: ParamDefault::Number(1.0),
    doc: "scale of the combined task vector, applied after normalization (mergekit default 1)",
};

pub const INT8_MASK: ParamSpec = ParamSpec {
    name: "int8_mask",
    scope: Scope::Global,
    kind: Kind::Bool,
    default: ParamDefault::Bool(false),
    doc: "accepted for mergekit compatibility; only changes mergekit's mask storage, never results",
};

/// `normalize` with a method's default (true for TIES, false for the others, as in mergekit).
pub const fn normalize(default: bool, doc: &'static str) -> ParamSpec {
    ParamSpec {
        name: "normalize",
        scope: Scope::Global,
        kind: Kind::Bool,
        default: ParamDefault::Bool(default),
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
    default: ParamDefault::Choice("sum"),
    doc: "sign election: `sum` = sign of the summed weighted deltas (TIES' mass election, mergekit's only reachable choice); `count` = majority of signs (mergekit's ConsensusMethod.count)",
};

/// Every model's density, checked to be in (0, 1].
pub fn densities(job: &TensorJob, values: &TensorValues, method: &str) -> Result<Vec<f64>> {
    let densities = values.model_numbers(&DENSITY);
    for (i, &d) in densities.iter().enumerate() {
        if !(d > 0.0 && d <= 1.0) {
            bail!(
                "{method}: density {d} for model {} at tensor `{}` is outside (0, 1]; density is the fraction of entries kept",
                job.models[i].ckpt.label,
                job.name
            );
        }
    }
    Ok(densities)
}

/// How the sign of each entry is elected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Election {
    /// Sign of the summed weighted deltas (TIES' "mass" election; mergekit)
    Sum,
    /// Majority of the signs (mergekit's ConsensusMethod.count)
    Count,
}

/// The combination step, with its parameters resolved for one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Combine {
    weights: Vec<f32>,
    election: Option<Election>,
    normalize: bool,
    lambda: f32,
}

impl Combine {
    /// The combination from `weight`, `lambda`, the method's own `normalize` spec and, for the
    /// methods that elect, `election`.
    pub fn new(values: &TensorValues, normalize: &ParamSpec, elect: bool) -> Combine {
        Combine {
            // mergekit builds its weight tensor in the compute dtype (f32 here).
            weights: values
                .model_numbers(&WEIGHT)
                .into_iter()
                .map(|w| w as f32)
                .collect(),
            election: elect.then(|| values.choice(&ELECTION)),
            normalize: values.flag(normalize),
            lambda: values.number(&LAMBDA) as f32,
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
    use crate::merge::params::ParamValue;
    use std::collections::BTreeMap;

    const NORMALIZE: ParamSpec = normalize(false, "");

    fn values(weights: &[f64], normalize: bool, lambda: f64, election: &str) -> TensorValues {
        TensorValues {
            global: BTreeMap::from([
                ("normalize", ParamValue::Bool(normalize)),
                ("lambda", ParamValue::Number(lambda)),
                ("election", ParamValue::Choice(election.into())),
            ]),
            models: weights
                .iter()
                .map(|&w| BTreeMap::from([("weight", ParamValue::Number(w))]))
                .collect(),
        }
    }

    #[test]
    fn sum_election_keeps_agreeing_entries_and_averages_by_weight() {
        let c = Combine::new(&values(&[1.0; 3], true, 1.0, "sum"), &NORMALIZE, true);
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
        let count = Combine::new(&values(&[1.0; 3], true, 1.0, "count"), &NORMALIZE, true);
        count.apply(&base, &deltas, &mut out);
        // Entry 1: signs -,+,+ -> majority + -> mean of 1, 1.
        assert_eq!(out[1], 11.0);
    }

    #[test]
    fn plain_sum_scales_by_lambda_after_normalizing() {
        let c = Combine::new(&values(&[0.5, 1.5], true, 2.0, "sum"), &NORMALIZE, false);
        let mut out = [0f32; 1];
        c.apply(&[1.0], &[vec![2.0], vec![-2.0]], &mut out);
        // (0.5*2 - 1.5*2) / 2 * 2 = -2.
        assert_eq!(out, [-1.0]);
    }
}
