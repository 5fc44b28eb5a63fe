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

use super::params::{Default, Kind, ParamSpec, Scope};
use super::sparsify::{self, Cut};
use super::task_vector::{self, Combine, Election};
use super::{MergeMethod, Prepared, TensorJob, TensorParams};
use crate::bail;
use crate::error::Result;

pub struct Ties;

pub const TRIM: ParamSpec = ParamSpec {
    name: "trim",
    scope: Scope::Global,
    kind: Kind::Choice {
        options: &["local", "global"],
        bools: None,
    },
    default: Default::Choice("local"),
    doc: "`local`: keep the top-k magnitudes of each tensor (mergekit); `global`: one threshold per task vector over the whole model, ties at it kept (official TIES code)",
};

const PARAMS: &[ParamSpec] = &[
    task_vector::WEIGHT,
    task_vector::DENSITY,
    task_vector::LAMBDA,
    task_vector::normalize(
        true,
        "divide by the summed weights of the models that agree with the elected sign, the \"disjoint mean\" (mergekit default: true)",
    ),
    ParamSpec {
        name: "rescale",
        scope: Scope::Global,
        kind: Kind::Bool,
        default: Default::Bool(false),
        doc: "scale each trimmed task vector back to its L1 norm before trimming (mergekit default: false)",
    },
    TRIM,
    task_vector::ELECTION,
    task_vector::INT8_MASK,
];

/// The cuts of a global trim, one per task, shared by every tensor.
struct GlobalCuts(Vec<Cut>);

impl MergeMethod for Ties {
    fn name(&self) -> &'static str {
        "ties"
    }

    fn summary(&self) -> &'static str {
        "trim to top-k magnitudes, elect signs, disjoint mean (Yadav et al. 2023; mergekit `ties`)"
    }

    fn needs_base(&self) -> bool {
        true
    }

    fn params(&self) -> &'static [ParamSpec] {
        PARAMS
    }

    fn check(&self, job: &TensorJob, params: &TensorParams) -> Result<()> {
        task_vector::check_densities(job, params, self.name())
    }

    fn prepare(&self, jobs: &[TensorJob], params: &[TensorParams]) -> Result<Prepared> {
        let Some(first) = params.first() else {
            return Ok(None);
        };
        if first.choice("trim") != "global" {
            return Ok(None);
        }
        // One threshold per task needs one density per task.
        let densities = first.model_numbers("density");
        for (job, p) in jobs.iter().zip(params) {
            let d = p.model_numbers("density");
            if d != densities {
                bail!(
                    "ties: trim: global needs one density per model for the whole model, but tensor `{}` gets {d:?} and `{}` gets {densities:?}",
                    job.name,
                    jobs[0].name
                );
            }
        }
        let cuts = sparsify::global_cuts(jobs, &densities)?;
        Ok(Some(Box::new(GlobalCuts(cuts))))
    }

    fn merge(
        &self,
        job: &TensorJob,
        params: &TensorParams,
        prepared: &Prepared,
    ) -> Result<Vec<u8>> {
        let cuts = match prepared
            .as_ref()
            .and_then(|p| p.downcast_ref::<GlobalCuts>())
        {
            Some(GlobalCuts(cuts)) => cuts.clone(),
            None => sparsify::top_k_cuts(job, &params.model_numbers("density"))?,
        };
        let factors = rescale_factors(job, &cuts, params.flag("rescale"))?;
        let combine = Combine::new(params, Some(Election::from_params(params)));
        job.produce(|block, out| {
            let base = block.base()?;
            let mut deltas = block.deltas_from(&base)?;
            for ((d, cut), &f) in deltas.iter_mut().zip(&cuts).zip(&factors) {
                cut.apply(d, block.start());
                if f != 1.0 {
                    d.iter_mut().for_each(|x| *x *= f);
                }
            }
            combine.apply(&base, &deltas, out);
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
