//! Task arithmetic (Ilharco et al. 2023): `base + lambda * sum_i w_i (x_i - base)`, optionally
//! divided by `sum_i w_i`; mergekit `task_arithmetic`
//! (docs/reference/merges.md#linear-and-task-arithmetic). The official code has no per-task
//! weights: it is `weight: 1` for every model with `normalize: false`.

use super::params::ParamSpec;
use super::task_vector::{self, Combine};
use super::{MergeMethod, Prepared, TensorJob, TensorParams};
use crate::error::Result;

pub struct TaskArithmetic;

const PARAMS: &[ParamSpec] = &[
    task_vector::WEIGHT,
    task_vector::LAMBDA,
    task_vector::normalize(
        false,
        "divide the weighted sum of task vectors by the sum of the weights (mergekit default: false)",
    ),
    task_vector::INT8_MASK,
];

impl MergeMethod for TaskArithmetic {
    fn name(&self) -> &'static str {
        "task_arithmetic"
    }

    fn summary(&self) -> &'static str {
        "base + lambda * sum_i w_i (x_i - base) (Ilharco et al. 2023; mergekit `task_arithmetic`)"
    }

    fn needs_base(&self) -> bool {
        true
    }

    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }

    fn merge(&self, job: &TensorJob, params: &TensorParams, _: &Prepared) -> Result<Vec<u8>> {
        let combine = Combine::new(params, None);
        job.produce(|block, out| {
            let base = block.base()?;
            let deltas = block.deltas_from(&base)?;
            combine.apply(&base, &deltas, out);
            Ok(())
        })
    }
}
