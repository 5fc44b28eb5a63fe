//! DARE (Yu et al. 2024, "Language Models are Super Mario"): drop each task-vector entry with
//! probability `1 - density`, rescale the survivors, then combine as task arithmetic
//! (`dare_linear`) or with TIES' sign election (`dare_ties`); mergekit `dare_linear` /
//! `dare_ties` (merging.md §1.4).
//!
//! Rescaling: `l1` (mergekit's default since PR #245) scales the survivors so the task vector
//! keeps its exact L1 norm; `inverse` divides them by `density`, as the official code does
//! (`x' = x * mask / (1 - p)`); `none` keeps them as they are.
//!
//! Masks come from a ChaCha8 stream per (seed, tensor name, model), so the same seed gives the
//! same bytes at any thread count; mergekit draws from torch's global RNG instead, so its masks
//! cannot be reproduced here (parity is tested statistically).

use super::job::{Block, TensorJob};
use super::params::{Default, Kind, ParamSpec, Scope};
use super::sparsify::{self, bit};
use super::task_vector::{self, Combine, Election};
use super::{MergeMethod, Prepared, TensorParams};
use crate::error::Result;

pub struct DareLinear;
pub struct DareTies;

pub const RESCALE: ParamSpec = ParamSpec {
    name: "rescale",
    scope: Scope::Global,
    kind: Kind::Choice {
        options: &["l1", "inverse", "none"],
        bools: Some(("l1", "none")),
    },
    default: Default::Choice("l1"),
    doc: "rescale the kept entries: `l1` to the task vector's exact L1 norm (mergekit, `rescale: true`), `inverse` by 1/density (official DARE code), `none` (`rescale: false`)",
};

pub const SEED: ParamSpec = ParamSpec {
    name: "seed",
    scope: Scope::Global,
    kind: Kind::Integer,
    default: Default::Integer(0),
    doc: "seed of the drop masks; each (seed, tensor, model) has its own random stream",
};

const fn dare_normalize() -> ParamSpec {
    task_vector::normalize(
        false,
        "divide by the (agreeing) models' weight sum (mergekit default for dare_*: false)",
    )
}

const LINEAR_PARAMS: &[ParamSpec] = &[
    task_vector::WEIGHT,
    task_vector::DENSITY,
    task_vector::LAMBDA,
    dare_normalize(),
    RESCALE,
    SEED,
    task_vector::INT8_MASK,
];

const TIES_PARAMS: &[ParamSpec] = &[
    task_vector::WEIGHT,
    task_vector::DENSITY,
    task_vector::LAMBDA,
    dare_normalize(),
    RESCALE,
    SEED,
    task_vector::ELECTION,
    task_vector::INT8_MASK,
];

impl MergeMethod for DareLinear {
    fn name(&self) -> &'static str {
        "dare_linear"
    }

    fn summary(&self) -> &'static str {
        "random drop + rescale, then task arithmetic (Yu et al. 2024; mergekit `dare_linear`)"
    }

    fn needs_base(&self) -> bool {
        true
    }

    fn params(&self) -> &'static [ParamSpec] {
        LINEAR_PARAMS
    }

    fn check(&self, job: &TensorJob, params: &TensorParams) -> Result<()> {
        task_vector::check_densities(job, params, self.name())
    }

    fn merge(&self, job: &TensorJob, params: &TensorParams, _: &Prepared) -> Result<Vec<u8>> {
        dare(job, params, None)
    }
}

impl MergeMethod for DareTies {
    fn name(&self) -> &'static str {
        "dare_ties"
    }

    fn summary(&self) -> &'static str {
        "random drop + rescale, then TIES sign election (Yu et al. 2024; mergekit `dare_ties`)"
    }

    fn needs_base(&self) -> bool {
        true
    }

    fn params(&self) -> &'static [ParamSpec] {
        TIES_PARAMS
    }

    fn check(&self, job: &TensorJob, params: &TensorParams) -> Result<()> {
        task_vector::check_densities(job, params, self.name())
    }

    fn merge(&self, job: &TensorJob, params: &TensorParams, _: &Prepared) -> Result<Vec<u8>> {
        dare(job, params, Some(Election::from_params(params)))
    }
}

/// One block's masks (`None` for a model that keeps everything).
type BlockMasks = Vec<Option<Vec<u64>>>;

fn dare(job: &TensorJob, params: &TensorParams, election: Option<Election>) -> Result<Vec<u8>> {
    let densities = params.model_numbers("density");
    let seed = params.integer("seed");
    let rescale = params.choice("rescale").to_string();
    let masks_of = |block: &Block| -> BlockMasks {
        densities
            .iter()
            .enumerate()
            .map(|(i, &d)| {
                (d < 1.0)
                    .then(|| sparsify::bernoulli_mask(seed, &job.name, i, block.range.clone(), d))
            })
            .collect()
    };

    // The L1 rescale needs each whole task vector's norms before and after dropping, so the
    // masks are drawn once, kept as bits, and reused for the output.
    let (stored, factors): (Option<Vec<BlockMasks>>, Vec<f32>) = match rescale.as_str() {
        "l1" => {
            let per_block = job.map_blocks(|block| {
                let masks = masks_of(block);
                let base = block.base()?;
                let mut sums = Vec::with_capacity(masks.len());
                for (i, mask) in masks.iter().enumerate() {
                    let Some(mask) = mask else {
                        sums.push((0.0, 0.0));
                        continue;
                    };
                    let d = block.delta_from(i, &base)?;
                    let (mut before, mut after) = (0f64, 0f64);
                    for (j, &x) in d.iter().enumerate() {
                        before += x.abs() as f64;
                        if bit(mask, j) {
                            after += x.abs() as f64;
                        }
                    }
                    sums.push((before, after));
                }
                Ok((masks, sums))
            })?;
            let factors = (0..densities.len())
                .map(|i| {
                    let (before, after) = per_block
                        .iter()
                        .fold((0f64, 0f64), |(a, b), (_, s)| (a + s[i].0, b + s[i].1));
                    sparsify::l1_factor(before, after)
                })
                .collect();
            (
                Some(per_block.into_iter().map(|(m, _)| m).collect()),
                factors,
            )
        }
        _ => (None, vec![1.0; densities.len()]),
    };
    let inverse = rescale == "inverse";
    let block_starts: Vec<usize> = job.blocks().iter().map(|r| r.start).collect();
    let combine = Combine::new(params, election);

    job.produce(|block, out| {
        let drawn;
        let masks = match &stored {
            Some(all) => &all[block_starts.partition_point(|&s| s < block.start())],
            None => {
                drawn = masks_of(block);
                &drawn
            }
        };
        let base = block.base()?;
        let mut deltas = block.deltas_from(&base)?;
        for (i, d) in deltas.iter_mut().enumerate() {
            let Some(mask) = &masks[i] else { continue };
            let density = densities[i] as f32;
            let factor = factors[i];
            for (j, x) in d.iter_mut().enumerate() {
                if !bit(mask, j) {
                    *x = 0.0;
                } else if inverse {
                    *x /= density;
                } else if factor != 1.0 {
                    *x *= factor;
                }
            }
        }
        combine.apply(&base, &deltas, out);
        Ok(())
    })
}
