//! DARE (Yu et al. 2024, "Language Models are Super Mario"): drop each task-vector entry with
//! probability `1 - density`, rescale the survivors, then combine as task arithmetic
//! (`dare_linear`) or with TIES' sign election (`dare_ties`); mergekit `dare_linear` /
//! `dare_ties` (docs/reference/merges.md#dare).
//!
//! Rescaling: `l1` (mergekit's default since PR #245) scales the survivors so the task vector
//! keeps its exact L1 norm; `inverse` divides them by `density`, as the official code does
//! (`x' = x * mask / (1 - p)`); `none` keeps them as they are.
//!
//! Masks come from a ChaCha8 stream per (seed, tensor name, model), so the same seed gives the
//! same bytes at any thread count; mergekit draws from torch's global RNG instead, so its masks
//! cannot be reproduced here (parity is tested statistically).

use super::job::{Block, Scratch, TensorJob};
use super::params::{Kind, ParamDefault, ParamSpec, Scope};
use super::sparsify;
use super::task_vector::{self, Combine};
use super::{Method, MethodInfo, TensorValues};
use crate::error::Result;

/// `dare_linear` (random drop + rescale, then task arithmetic) or `dare_ties` (then TIES' sign
/// election): one method with two registered names, as in mergekit.
pub struct Dare {
    info: &'static MethodInfo,
    ties: bool,
}

pub const DARE_LINEAR: Dare = Dare {
    info: &LINEAR_INFO,
    ties: false,
};
pub const DARE_TIES: Dare = Dare {
    info: &TIES_INFO,
    ties: true,
};

/// How the kept entries are rescaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Rescale {
    /// Match each task vector's exact L1 norm (mergekit)
    L1,
    /// Divide the kept entries by density (official DARE code)
    Inverse,
    /// Keep the kept entries as they are
    None,
}

pub const RESCALE: ParamSpec = ParamSpec {
    name: "rescale",
    scope: Scope::Global,
    kind: Kind::Choice {
        options: &["l1", "inverse", "none"],
        bools: Some(("l1", "none")),
    },
    default: ParamDefault::Choice("l1"),
    doc: "rescale the kept entries: `l1` to the task vector's exact L1 norm (mergekit, `rescale: true`), `inverse` by 1/density (official DARE code), `none` (`rescale: false`)",
};

pub const SEED: ParamSpec = ParamSpec {
    name: "seed",
    scope: Scope::Global,
    kind: Kind::Integer,
    default: ParamDefault::Integer(0),
    doc: "seed of the drop masks; each (seed, tensor, model) has its own random stream",
};

pub const NORMALIZE: ParamSpec = task_vector::normalize(
    false,
    "divide by the (agreeing) models' weight sum (mergekit default for dare_*: false)",
);

/// The parameters of both variants; `dare_ties` adds `election` before `int8_mask` (records list
/// parameters in this order).
macro_rules! dare_params {
    ($($election:expr)?) => {
        &[
            task_vector::WEIGHT,
            task_vector::DENSITY,
            task_vector::LAMBDA,
            NORMALIZE,
            RESCALE,
            SEED,
            $($election,)?
            task_vector::INT8_MASK,
        ]
    };
}

const LINEAR_INFO: MethodInfo = MethodInfo {
    name: "dare_linear",
    needs_base: true,
    params: dare_params!(),
};

const TIES_INFO: MethodInfo = MethodInfo {
    name: "dare_ties",
    needs_base: true,
    params: dare_params!(task_vector::ELECTION),
};

/// `dare_linear`'s and `dare_ties`' parameters for one tensor.
#[derive(Debug, Clone)]
pub struct DareParams {
    pub densities: Vec<f64>,
    pub seed: u64,
    pub rescale: Rescale,
    pub combine: Combine,
}

impl Method for Dare {
    type Params = DareParams;
    type Prepared = ();

    fn info(&self) -> &'static MethodInfo {
        self.info
    }

    fn parse(&self, job: &TensorJob, values: &TensorValues) -> Result<DareParams> {
        Ok(DareParams {
            densities: task_vector::densities(job, values, self.info.name)?,
            seed: values.integer(&SEED),
            rescale: values.choice(&RESCALE),
            combine: Combine::new(values, &NORMALIZE, self.ties),
        })
    }

    fn merge(&self, job: &TensorJob, params: &DareParams, _: &()) -> Result<Vec<u8>> {
        dare(job, params)
    }
}

/// One task vector's entries in one block after dropping: which survived (bits) and their
/// values, in order.
struct Dropped {
    mask: Vec<u64>,
    kept: Vec<f32>,
}

impl Dropped {
    fn new(d: &[f32], mask: Vec<u64>) -> Dropped {
        let count: u32 = mask.iter().map(|w| w.count_ones()).sum();
        let mut kept = Vec::with_capacity(count as usize);
        for (c, &w) in mask.iter().enumerate() {
            let mut bits = w;
            while bits != 0 {
                kept.push(d[c * 64 + bits.trailing_zeros() as usize]);
                bits &= bits - 1;
            }
        }
        Dropped { mask, kept }
    }

    /// The sparsified task vector: `rescale(survivor)`, zeros elsewhere.
    fn expand(&self, n: usize, rescale: impl Fn(f32) -> f32) -> Scratch {
        let mut d = Scratch::zeroed(n);
        let mut values = self.kept.iter();
        for (c, &w) in self.mask.iter().enumerate() {
            let mut bits = w;
            while bits != 0 {
                let x = values.next().expect("one value per set bit");
                d[c * 64 + bits.trailing_zeros() as usize] = rescale(*x);
                bits &= bits - 1;
            }
        }
        d
    }
}

/// Sum of |x| in f64, from f32 partial sums of 16 lanes over 64-entry chunks: a fixed order
/// (deterministic) that vectorizes.
fn abs_sum(d: &[f32]) -> f64 {
    d.chunks(64)
        .map(|chunk| {
            let mut lanes = [0f32; 16];
            let groups = chunk.chunks_exact(16);
            let tail: f32 = groups.remainder().iter().map(|x| x.abs()).sum();
            for g in groups {
                for (l, x) in lanes.iter_mut().zip(g) {
                    *l += x.abs();
                }
            }
            lanes.iter().map(|&l| l as f64).sum::<f64>() + tail as f64
        })
        .sum()
}

fn dare(job: &TensorJob, params: &DareParams) -> Result<Vec<u8>> {
    let DareParams {
        densities,
        seed,
        rescale,
        combine,
    } = params;
    let seed = *seed;
    let mask_of = |i: usize, block: &Block| -> Option<Vec<u64>> {
        let d = densities[i];
        (d < 1.0).then(|| sparsify::bernoulli_mask(seed, &job.name, i, block.range.clone(), d))
    };

    if *rescale != Rescale::L1 {
        // Rescaling by a constant (1/density or 1): one pass, masks drawn as blocks are made.
        let inverse = *rescale == Rescale::Inverse;
        return job.produce(|block, out| {
            let base = block.base()?;
            let mut deltas = block.deltas_from(&base)?;
            for (i, d) in deltas.iter_mut().enumerate() {
                let Some(mask) = mask_of(i, block) else {
                    continue;
                };
                let density = densities[i] as f32;
                let kept = Dropped::new(d, mask);
                // The official code divides (x / (1 - p)); so does this, for the same rounding.
                *d = if inverse {
                    kept.expand(block.len(), |x| x / density)
                } else {
                    kept.expand(block.len(), |x| x)
                };
            }
            combine.apply(&base, &deltas, out);
            Ok(())
        });
    }

    // The L1 rescale needs each whole task vector's norm before and after dropping: a first pass
    // draws the masks, sums the norms and keeps the survivors (a `density` fraction), a second
    // makes the output from them and the base.
    let per_block = job.map_blocks(|block| {
        let base = block.base()?;
        let mut dropped = Vec::with_capacity(densities.len());
        let mut sums = Vec::with_capacity(densities.len());
        for i in 0..densities.len() {
            match mask_of(i, block) {
                Some(mask) => {
                    let d = block.delta_from(i, &base)?;
                    let kept = Dropped::new(&d, mask);
                    sums.push((abs_sum(&d), abs_sum(&kept.kept)));
                    dropped.push(Some(kept));
                }
                None => {
                    sums.push((0.0, 0.0));
                    dropped.push(None);
                }
            }
        }
        Ok((dropped, sums))
    })?;
    let factors: Vec<f32> = (0..densities.len())
        .map(|i| {
            let (before, after) = per_block
                .iter()
                .fold((0f64, 0f64), |(a, b), (_, s)| (a + s[i].0, b + s[i].1));
            sparsify::l1_factor(before, after)
        })
        .collect();
    let block_starts: Vec<usize> = job.blocks().iter().map(|r| r.start).collect();
    job.produce(|block, out| {
        let (dropped, _) = &per_block[block_starts.partition_point(|&s| s < block.start())];
        let base = block.base()?;
        let deltas = dropped
            .iter()
            .enumerate()
            .map(|(i, kept)| match kept {
                Some(kept) => Ok(kept.expand(block.len(), |x| x * factors[i])),
                None => block.delta_from(i, &base),
            })
            .collect::<Result<Vec<_>>>()?;
        combine.apply(&base, &deltas, out);
        Ok(())
    })
}
