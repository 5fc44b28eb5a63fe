//! Linear (weighted average) merge, as mergekit 0.1.5 `linear` computes it: `sum_i w_i x_i`,
//! divided by `sum_i w_i` when `normalize` (docs/reference/merges.md#linear-and-task-arithmetic).
//! There is no base. mergekit divides by a zero weight sum without a guard; sinkmerge refuses it
//! instead.

use super::params::{Default, Kind, ParamSpec, Scope};
use super::{MergeMethod, Prepared, TensorJob, TensorParams};
use crate::bail;
use crate::error::Result;

pub struct Linear;

const PARAMS: &[ParamSpec] = &[
    ParamSpec {
        name: "weight",
        scope: Scope::PerModel,
        kind: Kind::Number,
        default: Default::Required,
        doc: "coefficient of the model (required in YAML, as in mergekit; the CLI defaults to 1 each)",
    },
    ParamSpec {
        name: "normalize",
        scope: Scope::Global,
        kind: Kind::Bool,
        default: Default::Bool(true),
        doc: "divide by the sum of the weights (mergekit default: true)",
    },
];

/// Weights in f32 (as mergekit makes its weight tensor) and their f32 sum.
fn weights(params: &TensorParams) -> (Vec<f32>, f32) {
    let w: Vec<f32> = params
        .model_numbers("weight")
        .into_iter()
        .map(|x| x as f32)
        .collect();
    let sum = w.iter().fold(0f32, |s, &x| s + x);
    (w, sum)
}

impl MergeMethod for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn summary(&self) -> &'static str {
        "weighted average sum_i w_i x_i / sum_i w_i (model soups, Wortsman et al. 2022; mergekit `linear`)"
    }

    fn needs_base(&self) -> bool {
        false
    }

    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }

    fn check(&self, job: &TensorJob, params: &TensorParams) -> Result<()> {
        let (w, sum) = weights(params);
        if params.flag("normalize") && sum == 0.0 {
            bail!(
                "linear: the weights {w:?} of tensor `{}` sum to 0, so normalizing would divide by zero; set normalize: false (--no-normalize) or change the weights",
                job.name
            );
        }
        Ok(())
    }

    fn merge(&self, job: &TensorJob, params: &TensorParams, _: &Prepared) -> Result<Vec<u8>> {
        let (w, sum) = weights(params);
        let normalize = params.flag("normalize");
        job.produce(|block, out| {
            out.fill(0.0);
            for (i, &wi) in w.iter().enumerate() {
                let x = block.model(i)?;
                for (o, v) in out.iter_mut().zip(x.iter()) {
                    *o += v * wi;
                }
            }
            if normalize {
                for o in out.iter_mut() {
                    *o /= sum;
                }
            }
            Ok(())
        })
    }
}
