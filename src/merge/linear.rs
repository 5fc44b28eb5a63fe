//! Linear (weighted average) merge, as mergekit 0.1.5 `linear` computes it: `sum_i w_i x_i`,
//! divided by `sum_i w_i` when `normalize` (docs/reference/merges.md#linear-and-task-arithmetic).
//! There is no base. mergekit divides by a zero weight sum without a guard; sinkmerge refuses it
//! instead.

use super::params::{Kind, ParamDefault, ParamSpec, Scope};
use super::{Method, MethodInfo, TensorJob, TensorValues};
use crate::bail;
use crate::error::Result;

/// Weighted average sum_i w_i x_i / sum_i w_i (model soups, Wortsman et al. 2022; mergekit
/// `linear`).
pub struct Linear;

pub const WEIGHT: ParamSpec = ParamSpec {
    name: "weight",
    scope: Scope::PerModel,
    kind: Kind::Number,
    default: ParamDefault::Required,
    doc: "coefficient of the model (required in YAML, as in mergekit; the CLI defaults to 1 each)",
};

pub const NORMALIZE: ParamSpec = ParamSpec {
    name: "normalize",
    scope: Scope::Global,
    kind: Kind::Bool,
    default: ParamDefault::Bool(true),
    doc: "divide by the sum of the weights (mergekit default: true)",
};

const INFO: MethodInfo = MethodInfo {
    name: "linear",
    needs_base: false,
    params: &[WEIGHT, NORMALIZE],
};

/// `linear`'s parameters for one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearParams {
    /// In f32, as mergekit makes its weight tensor.
    pub weights: Vec<f32>,
    /// `Some(sum of the weights, in f32)` when normalizing.
    pub divisor: Option<f32>,
}

impl Method for Linear {
    type Params = LinearParams;
    type Prepared = ();

    fn info(&self) -> &'static MethodInfo {
        &INFO
    }

    fn parse(&self, job: &TensorJob, values: &TensorValues) -> Result<LinearParams> {
        let weights: Vec<f32> = values
            .model_numbers(&WEIGHT)
            .into_iter()
            .map(|x| x as f32)
            .collect();
        let sum = weights.iter().fold(0f32, |s, &x| s + x);
        let normalize = values.flag(&NORMALIZE);
        if normalize && sum == 0.0 {
            bail!(
                "linear: the weights {weights:?} of tensor `{}` sum to 0, so normalizing would divide by zero; set normalize: false (--no-normalize) or change the weights",
                job.name
            );
        }
        Ok(LinearParams {
            weights,
            divisor: normalize.then_some(sum),
        })
    }

    fn merge(&self, job: &TensorJob, params: &LinearParams, _: &()) -> Result<Vec<u8>> {
        job.produce(|block, out| {
            out.fill(0.0);
            for (i, &wi) in params.weights.iter().enumerate() {
                let x = block.model(i)?;
                for (o, v) in out.iter_mut().zip(x.iter()) {
                    *o += v * wi;
                }
            }
            if let Some(sum) = params.divisor {
                for o in out.iter_mut() {
                    *o /= sum;
                }
            }
            Ok(())
        })
    }
}
