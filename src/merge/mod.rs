//! Model merging: linear, task arithmetic, TIES, DARE, TSV-M and STAR.
//!
//! Each method is one small file behind [`Method`] and declares its parameters (name,
//! scope, type, default, meaning), as mergekit's registry does, and the typed struct it reads
//! them into once per tensor; each file follows mergekit's implementation of its method, or the
//! official TSV-M and STAR code, and says where. [`config`] reads and writes mergekit-style YAML,
//! [`params`] resolves a setting for one tensor, [`plan`] runs a merge as a stream over output
//! tensors, and [`job`] gives methods block-wise access to one tensor's inputs.
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

use crate::error::Result;
pub use config::{MergeSpec, ModelEntry};
pub use job::TensorJob;
pub use params::{ParamSpec, TensorValues};

/// What a method is, for configs and records.
#[derive(Debug)]
pub struct MethodInfo {
    /// The name in YAML (`merge_method`) and in `sinkmerge_config.yml`.
    pub name: &'static str,
    /// Whether the method works on task vectors `model - base` (and so needs `base_model`).
    pub needs_base: bool,
    /// The parameters the method takes.
    pub params: &'static [ParamSpec],
}

/// A merge method, with its parameters typed: each method reads its resolved values once into
/// its own `Params`, checking them, and merges from that.
pub trait Method: Sync {
    /// The method's parameters for one output tensor.
    type Params: Sync;
    /// Whole-model state computed before merging tensors (TIES' global trim thresholds).
    type Prepared: Default + Sync;

    fn info(&self) -> &'static MethodInfo;

    /// Type one tensor's resolved values, checking ranges and combinations, before anything is
    /// written.
    fn parse(&self, job: &TensorJob, values: &TensorValues) -> Result<Self::Params>;

    /// Whole-model pass before merging (most methods need none).
    fn prepare(&self, _jobs: &[TensorJob], _params: &[Self::Params]) -> Result<Self::Prepared> {
        Ok(Self::Prepared::default())
    }

    /// Compute one output tensor, encoded in `job.out_dtype`.
    fn merge(
        &self,
        job: &TensorJob,
        params: &Self::Params,
        prepared: &Self::Prepared,
    ) -> Result<Vec<u8>>;
}

/// A method's merge with every tensor's parameters typed and its whole-model pass done.
pub trait TensorMerger: Sync {
    /// Compute output tensor `job`, the `index`-th of the jobs it was prepared for.
    fn merge(&self, index: usize, job: &TensorJob) -> Result<Vec<u8>>;
}

/// A [`Method`] behind a uniform interface, so the registry can hold every method.
pub trait MergeMethod: Sync {
    fn info(&self) -> &'static MethodInfo;

    /// Type and check the parameters of every job (`resolve` gives a job's values), in order,
    /// then run the whole-model pass.
    fn prepare<'m>(
        &'m self,
        jobs: &[TensorJob],
        resolve: &dyn Fn(&TensorJob) -> Result<TensorValues>,
    ) -> Result<Box<dyn TensorMerger + 'm>>;

    fn name(&self) -> &'static str {
        self.info().name
    }

    fn needs_base(&self) -> bool {
        self.info().needs_base
    }

    fn params(&self) -> &'static [ParamSpec] {
        self.info().params
    }
}

/// A method with every job's parameters typed and its whole-model state.
struct TypedMerge<'m, M: Method> {
    method: &'m M,
    params: Vec<M::Params>,
    state: M::Prepared,
}

impl<M: Method> TensorMerger for TypedMerge<'_, M> {
    fn merge(&self, index: usize, job: &TensorJob) -> Result<Vec<u8>> {
        self.method.merge(job, &self.params[index], &self.state)
    }
}

impl<M: Method> MergeMethod for M {
    fn info(&self) -> &'static MethodInfo {
        Method::info(self)
    }

    fn prepare<'m>(
        &'m self,
        jobs: &[TensorJob],
        resolve: &dyn Fn(&TensorJob) -> Result<TensorValues>,
    ) -> Result<Box<dyn TensorMerger + 'm>> {
        let params = jobs
            .iter()
            .map(|job| self.parse(job, &resolve(job)?))
            .collect::<Result<Vec<_>>>()?;
        let state = Method::prepare(self, jobs, &params)?;
        Ok(Box::new(TypedMerge {
            method: self,
            params,
            state,
        }))
    }
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use clap::ValueEnum;
    use safetensors::Dtype;

    use super::params::{default_value, Kind, ParamValue, Scope};
    use super::*;

    /// A job with no sources: enough to type parameters that pass their checks.
    fn job(name: &str, shape: Vec<usize>) -> TensorJob<'static> {
        TensorJob {
            name: name.to_string(),
            shape,
            out_dtype: Dtype::F32,
            base: None,
            models: Vec::new(),
        }
    }

    /// Every parameter at its default, `weight` 1, for two models.
    fn defaults(method: &dyn MergeMethod) -> TensorValues {
        let mut values = TensorValues {
            global: BTreeMap::new(),
            models: vec![BTreeMap::new(); 2],
        };
        for spec in method.params() {
            let value = default_value(spec).unwrap_or(ParamValue::Number(1.0));
            match spec.scope {
                Scope::Global => {
                    values.global.insert(spec.name, value);
                }
                Scope::PerModel => values.models.iter_mut().for_each(|m| {
                    m.insert(spec.name, value.clone());
                }),
            }
        }
        values
    }

    #[test]
    fn every_method_types_its_declared_parameters() {
        // A method reading a spec it does not declare would panic here.
        let jobs = [job("model.layers.0.mlp.up_proj.weight", vec![4, 4])];
        for method in METHODS {
            let values = defaults(*method);
            let merger = method.prepare(&jobs, &|_| Ok(values.clone()));
            assert!(merger.is_ok(), "{}", method.name());
        }
    }

    fn options_of<T: ValueEnum>() -> Vec<String> {
        T::value_variants()
            .iter()
            .map(|v| v.to_possible_value().unwrap().get_name().to_string())
            .collect()
    }

    #[test]
    fn choice_enums_have_exactly_the_declared_options() {
        let declared = |spec: &ParamSpec| match spec.kind {
            Kind::Choice { options, .. } => options.to_vec(),
            _ => panic!("{} is not a choice", spec.name),
        };
        assert_eq!(options_of::<ties::Trim>(), declared(&ties::TRIM));
        assert_eq!(
            options_of::<task_vector::Election>(),
            declared(&task_vector::ELECTION)
        );
        assert_eq!(options_of::<dare::Rescale>(), declared(&dare::RESCALE));
    }

    #[test]
    fn a_config_is_typed_per_tensor() {
        let (spec, _) = MergeSpec::from_yaml(
            "merge_method: ties
base_model: B
models:
  - model: M1
    parameters: {weight: 0.5, density: [0.2, 0.6]}
  - model: M2
    parameters: {weight: 1, density: {filter: mlp, value: 0.3}}
parameters: {lambda: 1.5, trim: global, election: count, rescale: true}
",
            "cfg.yaml",
        )
        .unwrap();
        let name = "model.layers.2.mlp.up_proj.weight";
        // Layer 2 of 5: t = 0.5, halfway along M1's density gradient.
        let values = plan::resolve_values(&spec, name, 5).unwrap();
        let params = ties::Ties.parse(&job(name, vec![4, 4]), &values).unwrap();
        assert_eq!(params.densities, [0.4, 0.3]);
        assert_eq!(params.trim, ties::Trim::Global);
        assert!(params.rescale);
        // The election is `count`: elected by `sum`, the same values combine differently.
        let combine =
            |values: &TensorValues| task_vector::Combine::new(values, &ties::NORMALIZE, true);
        assert_eq!(params.combine, combine(&values));
        let mut by_sum = values.clone();
        by_sum
            .global
            .insert("election", ParamValue::Choice("sum".into()));
        assert_ne!(params.combine, combine(&by_sum));
    }

    #[test]
    fn out_of_range_values_are_refused_with_the_parameter_and_tensor() {
        let name = "model.layers.0.self_attn.q_proj.weight";
        let mut values = defaults(&star::Star);
        values.global.insert("eta", ParamValue::Number(150.0));
        let err = star::Star
            .parse(&job(name, vec![4, 4]), &values)
            .unwrap_err()
            .to_string();
        assert!(err.contains("star: eta 150") && err.contains(name), "{err}");
        let mut values = defaults(&linear::Linear);
        values.models[1].insert("weight", ParamValue::Number(-1.0));
        let err = linear::Linear
            .parse(&job(name, vec![4, 4]), &values)
            .unwrap_err()
            .to_string();
        assert!(err.contains("sum to 0") && err.contains(name), "{err}");
    }
}
