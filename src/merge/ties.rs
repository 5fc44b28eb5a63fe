//! TIES-Merging (Yadav et al. 2023): trim each task vector to its largest magnitudes, elect a
//! sign per entry, and average the entries that agree with it; mergekit `ties`
//! (docs/reference/merges.md#ties).
//!
//! Defaults follow mergekit: per-tensor ("local") trim keeping `max(1, int(density * numel))`
//! entries, weights applied before the "sum" election (a tie goes to +1), the divisor being the
//! agreeing models' weight sum, `normalize: true`. `trim: global` follows the official code
//! instead: one threshold per task over the whole model, keeping every entry `>= kthvalue`.
//! The official code's fallback for a zero elected sign (the global majority sign) is not
//! offered: mergekit's +1 is used in both modes.

use super::params::{Kind, ParamDefault, ParamSpec, Scope};
use super::sparsify::{self, Cut};
use super::task_vector::{self, Combine};
use super::{Method, MethodInfo, TensorJob, TensorValues};
use crate::bail;
use crate::error::Result;

/// Trim to top-k magnitudes, elect signs, disjoint mean (Yadav et al. 2023; mergekit `ties`).
pub struct Ties;

/// Where the top-k threshold is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Trim {
    /// Per tensor: keep the top-k magnitudes of each tensor (mergekit)
    Local,
    /// Whole model: one threshold per task vector, ties at it kept (official TIES code)
    Global,
}

pub const TRIM: ParamSpec = ParamSpec {
    name: "trim",
    scope: Scope::Global,
    kind: Kind::Choice {
        options: &["local", "global"],
        bools: None,
    },
    default: ParamDefault::Choice("local"),
    doc: "`local`: keep the top-k magnitudes of each tensor (mergekit); `global`: one threshold per task vector over the whole model, ties at it kept (official TIES code)",
};

pub const NORMALIZE: ParamSpec = task_vector::normalize(
    true,
    "divide by the summed weights of the models that agree with the elected sign, the \"disjoint mean\" (mergekit default: true)",
);

pub const RESCALE: ParamSpec = ParamSpec {
    name: "rescale",
    scope: Scope::Global,
    kind: Kind::Bool,
    default: ParamDefault::Bool(false),
    doc: "scale each trimmed task vector back to its L1 norm before trimming (mergekit default: false)",
};

const INFO: MethodInfo = MethodInfo {
    name: "ties",
    needs_base: true,
    params: &[
        task_vector::WEIGHT,
        task_vector::DENSITY,
        task_vector::LAMBDA,
        NORMALIZE,
        RESCALE,
        TRIM,
        task_vector::ELECTION,
        task_vector::INT8_MASK,
    ],
};

/// `ties`' parameters for one tensor.
#[derive(Debug, Clone)]
pub struct TiesParams {
    pub densities: Vec<f64>,
    pub rescale: bool,
    pub trim: Trim,
    pub combine: Combine,
}

/// The cuts of a global trim, one per task, shared by every tensor.
#[derive(Default)]
pub struct GlobalCuts(Option<Vec<Cut>>);

impl Method for Ties {
    type Params = TiesParams;
    type Prepared = GlobalCuts;

    fn info(&self) -> &'static MethodInfo {
        &INFO
    }

    fn parse(&self, job: &TensorJob, values: &TensorValues) -> Result<TiesParams> {
        Ok(TiesParams {
            densities: task_vector::densities(job, values, INFO.name)?,
            rescale: values.flag(&RESCALE),
            trim: values.choice(&TRIM),
            combine: Combine::new(values, &NORMALIZE, true),
        })
    }

    fn prepare(&self, jobs: &[TensorJob], params: &[TiesParams]) -> Result<GlobalCuts> {
        let Some(first) = params.first() else {
            return Ok(GlobalCuts(None));
        };
        if first.trim != Trim::Global {
            return Ok(GlobalCuts(None));
        }
        // One threshold per task needs one density per task.
        let densities = &first.densities;
        for (job, p) in jobs.iter().zip(params) {
            let d = &p.densities;
            if d != densities {
                bail!(
                    "ties: trim: global needs one density per model for the whole model, but tensor `{}` gets {d:?} and `{}` gets {densities:?}",
                    job.name,
                    jobs[0].name
                );
            }
        }
        Ok(GlobalCuts(Some(sparsify::global_cuts(jobs, densities)?)))
    }

    fn merge(&self, job: &TensorJob, params: &TiesParams, global: &GlobalCuts) -> Result<Vec<u8>> {
        let cuts = match &global.0 {
            Some(cuts) => cuts.clone(),
            None => sparsify::top_k_cuts(job, &params.densities)?,
        };
        let factors = rescale_factors(job, &cuts, params.rescale)?;
        job.produce(|block, out| {
            let base = block.base()?;
            let mut deltas = block.deltas_from(&base)?;
            for ((d, cut), &f) in deltas.iter_mut().zip(&cuts).zip(&factors) {
                cut.apply(d, block.start());
                if f != 1.0 {
                    d.iter_mut().for_each(|x| *x *= f);
                }
            }
            params.combine.apply(&base, &deltas, out);
            Ok(())
        })
    }
}

/// mergekit's L1 rescale factor per task (1 where nothing was cut or rescale is off).
fn rescale_factors(job: &TensorJob, cuts: &[Cut], rescale: bool) -> Result<Vec<f32>> {
    cuts.iter()
        .enumerate()
        .map(|(i, cut)| {
            if !rescale || *cut == Cut::KeepAll {
                return Ok(1.0);
            }
            let (before, after) = sparsify::l1_before_after(job, i, cut)?;
            Ok(sparsify::l1_factor(before, after))
        })
        .collect()
}
