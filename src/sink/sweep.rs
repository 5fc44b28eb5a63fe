//! The paper's N-sweep (Appendix D.1, Table 9): for each N, draws of N prompts from the built-in
//! pool with seeds 0..SEEDS, scored in one pass over the union of the draws; each draw's S and
//! margins come from that pass's observations.

use serde::Serialize;

use super::metrics::{mean, sample_std};
use super::prompts::{self, PromptSource};
use super::score::Observations;
use crate::error::Result;
use crate::{bad, bail};

/// Every draw of a sweep, and the prompts that cover them all.
pub struct Sweep {
    /// The sizes as given, each once.
    sizes: Vec<usize>,
    /// Draws per size.
    seeds: usize,
    /// Each draw as (N, seed, indices into the pool).
    draws: Vec<(usize, u64, Vec<usize>)>,
    /// The union of the draws, in pool order: each distinct prompt is scored once.
    union: Vec<usize>,
}

impl Sweep {
    /// Draw `seeds` prompt sets of each size in `sizes`; a size the pool cannot hold, or a size
    /// given twice, is bad input.
    pub fn draw(sizes: &[usize], seeds: usize) -> Result<Sweep> {
        let pool_len = prompts::pool().len();
        // A size given twice would count its draws twice in the mean and the std.
        if let Some(n) =
            (sizes.iter().enumerate()).find_map(|(i, n)| sizes[..i].contains(n).then_some(n))
        {
            bail!("--sweep: {n} is listed twice; give each N once");
        }
        let mut draws = Vec::new();
        for &n in sizes {
            for seed in 0..seeds as u64 {
                let picked = prompts::draw_indices(n, seed, pool_len).map_err(|_| {
                    bad!(
                        "--sweep {n}: the built-in pool holds {pool_len} prompts; choose sizes \
                         from 1 to {pool_len}"
                    )
                })?;
                draws.push((n, seed, picked));
            }
        }
        let mut union: Vec<usize> = draws.iter().flat_map(|d| d.2.iter().copied()).collect();
        union.sort_unstable();
        union.dedup();
        Ok(Sweep {
            sizes: sizes.to_vec(),
            seeds,
            draws,
            union,
        })
    }

    /// The prompts to score (the union of the draws) and how the report names them.
    pub fn prompts(&self) -> (Vec<String>, PromptSource) {
        let pool = prompts::pool();
        (
            self.union.iter().map(|&i| pool[i].clone()).collect(),
            PromptSource::Sweep {
                n: self.sizes.clone(),
                seeds: self.seeds,
            },
        )
    }

    /// The sweep's table: each draw's S and margins from the one pass over the union.
    pub fn rows(&self, observations: &Observations) -> Vec<SweepRow> {
        let summarize = |values: Vec<Vec<Option<f64>>>, columns: usize| {
            let column = |j: usize| -> Vec<f64> { values.iter().filter_map(|v| v[j]).collect() };
            let complete = |j: usize| column(j).len() == values.len();
            (
                (0..columns)
                    .map(|j| complete(j).then(|| mean(&column(j))))
                    .collect::<Vec<_>>(),
                (0..columns)
                    .map(|j| complete(j).then(|| sample_std(&column(j))).flatten())
                    .collect::<Vec<_>>(),
            )
        };
        let mut seen: Vec<usize> = Vec::new();
        let mut rows = Vec::new();
        for &n in &self.sizes {
            if seen.contains(&n) {
                continue;
            }
            seen.push(n);
            let draws: Vec<SweepDraw> = (self.draws.iter())
                .filter(|d| d.0 == n)
                .map(|(_, seed, picked)| {
                    let at: Vec<usize> = (picked.iter())
                        .map(|i| (self.union.binary_search(i)).expect("the union holds every draw"))
                        .collect();
                    let sub = observations.subset(&at);
                    SweepDraw {
                        seed: *seed,
                        prompts: picked.clone(),
                        sink_strength: sub.sink_strength,
                        margin: sub.margin,
                    }
                })
                .collect();
            let models = draws.first().map_or(0, |d| d.sink_strength.len());
            let pairs = draws.first().map_or(0, |d| d.margin.len());
            let (sink_strength_mean, sink_strength_std) = summarize(
                draws.iter().map(|d| d.sink_strength.clone()).collect(),
                models,
            );
            let (margin_mean, margin_std) =
                summarize(draws.iter().map(|d| d.margin.clone()).collect(), pairs);
            rows.push(SweepRow {
                n,
                draws,
                sink_strength_mean,
                sink_strength_std,
                margin_mean,
                margin_std,
            });
        }
        rows
    }
}

/// One N of `--sweep`: every draw, and the mean and sample standard deviation over draws.
#[derive(Debug, Serialize)]
pub struct SweepRow {
    pub n: usize,
    pub draws: Vec<SweepDraw>,
    /// Per model, in `models` order.
    pub sink_strength_mean: Vec<Option<f64>>,
    pub sink_strength_std: Vec<Option<f64>>,
    /// Per pair, in `pairs` order.
    pub margin_mean: Vec<Option<f64>>,
    pub margin_std: Vec<Option<f64>>,
}

/// One draw of a sweep and its S per model and margin per pair.
#[derive(Debug, Serialize)]
pub struct SweepDraw {
    pub seed: u64,
    /// Indices into the built-in pool.
    pub prompts: Vec<usize>,
    pub sink_strength: Vec<Option<f64>>,
    pub margin: Vec<Option<f64>>,
}
