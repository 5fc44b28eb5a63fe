//! Task arithmetic (Ilharco et al. 2023): `base + lambda * sum_i w_i (x_i - base)`, optionally
//! divided by `sum_i w_i`; mergekit `task_arithmetic`
//! (docs/reference/merges.md#linear-and-task-arithmetic). The official code has no per-task
//! weights: it is `weight: 1` for every model with `normalize: false`.

use super::params::ParamSpec;
use super::task_vector::{self, Combine};
use super::{Method, MethodInfo, TensorJob, TensorValues};
use crate::error::Result;

/// base + lambda * sum_i w_i (x_i - base) (Ilharco et al. 2023; mergekit `task_arithmetic`).
pub struct TaskArithmetic;

pub const NORMALIZE: ParamSpec = task_vector::normalize(
    false,
    "divide the weighted sum of task vectors by the sum of the weights (mergekit default: false)",
);

const INFO: MethodInfo = MethodInfo {
    name: "task_arithmetic",
    needs_base: true,
    params: &[
        task_vector::WEIGHT,
        task_vector::LAMBDA,
        NORMALIZE,
        task_vector::INT8_MASK,
    ],
};

impl Method for TaskArithmetic {
    type Params = Combine;
    type Prepared = ();

    fn info(&self) -> &'static MethodInfo {
        &INFO
    }

    fn parse(&self, _: &TensorJob, values: &TensorValues) -> Result<Combine> {
        Ok(Combine::new(values, &NORMALIZE, false))
    }

    fn merge(&self, job: &TensorJob, combine: &Combine, _: &()) -> Result<Vec<u8>> {
        job.produce(|block, out| {
            let base = block.base()?;
            let deltas = block.deltas_from(&base)?;
            combine.apply(&base, &deltas, out);
            Ok(())
        })
    }
}
