//! Model merging: linear, task arithmetic, TIES, DARE, TSV-M and STAR.
//!
//! Each method is one small file behind [`MergeMethod`] and declares its parameters (name,
//! scope, type, default, meaning), as mergekit's registry does; each file follows mergekit's
//! implementation of its method, or the official TSV-M and STAR code, and says where. [`config`] reads and writes mergekit-style YAML,
//! [`plan`] runs a merge as a stream over output tensors, and [`job`] gives methods block-wise
//! access to one tensor's inputs.
//!
//! All arithmetic is f32 (inputs upcast); outputs are encoded in the requested dtype.

pub mod config;
pub mod dare;
pub mod job;
pub mod linear;
pub mod params;
pub mod plan;
pub mod sparsify;
pub mod star;
pub mod task_arithmetic;
pub mod task_vector;
pub mod ties;
pub mod tsv;

use std::any::Any;

use crate::error::Result;
pub use config::{MergeSpec, ModelEntry};
pub use job::TensorJob;
pub use params::{ParamSpec, TensorParams};

/// Whole-model state a method computes before merging tensors (TIES' global trim thresholds).
pub type Prepared = Option<Box<dyn Any + Send + Sync>>;

/// A merge method.
pub trait MergeMethod: Sync {
    /// The name in YAML (`merge_method`) and in `sinkmerge_config.yml`.
    fn name(&self) -> &'static str;

    /// One line: what it computes and the reference it follows.
    fn summary(&self) -> &'static str;

    /// Whether the method works on task vectors `model - base` (and so needs `base_model`).
    fn needs_base(&self) -> bool;

    /// The parameters the method takes.
    fn params(&self) -> &'static [ParamSpec];

    /// Check one tensor's resolved parameters (ranges, combinations) before anything is written.
    fn check(&self, _job: &TensorJob, _params: &TensorParams) -> Result<()> {
        Ok(())
    }

    /// Whole-model pass before merging (most methods need none).
    fn prepare(&self, _jobs: &[TensorJob], _params: &[TensorParams]) -> Result<Prepared> {
        Ok(None)
    }

    /// Compute one output tensor, encoded in `job.out_dtype`.
    fn merge(&self, job: &TensorJob, params: &TensorParams, prepared: &Prepared)
        -> Result<Vec<u8>>;
}

/// Every method, in the order `--help` and the docs list them.
pub static METHODS: &[&dyn MergeMethod] = &[
    &linear::Linear,
    &task_arithmetic::TaskArithmetic,
    &ties::Ties,
    &dare::DARE_LINEAR,
    &dare::DARE_TIES,
    &tsv::Tsv,
    &star::Star,
];

/// Look a method up by its YAML name.
pub fn method(name: &str) -> Option<&'static dyn MergeMethod> {
    METHODS.iter().copied().find(|m| m.name() == name)
}

/// The names of every method, for messages.
pub fn method_names() -> Vec<&'static str> {
    METHODS.iter().map(|m| m.name()).collect()
}
