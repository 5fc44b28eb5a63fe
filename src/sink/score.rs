//! Scoring several models in one layer-streaming pass: per model S, pos0 share, strong-sink
//! fraction, per-layer and per-head statistics and the Theorem-1 ingredients; with a reference,
//! B_gap and the margin of every other model against it.
//!
//! Models run in lockstep, layer by layer, the reference first: the reference keeps one
//! layer's scores (`heads x prompts x len²` floats) for its targets' B, then drops them, so no
//! model ever holds more than one layer's weights and one layer's attention.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::metrics::{
    mean, median, mode, observe, percentile_sorted, trailing_pos0, GapFrom, HeadObservations,
    ReferenceHead, SinkPosition, Stat, STRONG_SINK_G,
};
use super::prompts::IndexStream;
use crate::arch::QkNorm;
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::backend::{Backend, HeadView};
use crate::forward::decoder::{LayerwiseHeads, QkNormStats, State};
use crate::forward::pass::{End, Lockstep};
use crate::forward::weights::Model;

/// How to score.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Settings {
    /// Window: the last `last` decoder layers (all layers if fewer).
    pub last: usize,
    pub stat: Stat,
    pub sink_position: SinkPosition,
    pub gap_from: GapFrom,
    /// The paper's position-0 probe reads the last this many queries of each prompt.
    pub trailing_queries: usize,
    /// Bootstrap of that probe's mean over prompts.
    pub bootstrap: Bootstrap,
    /// Also report S and the margin over the early, middle and late thirds of the layers.
    pub bands: bool,
    /// Also report S and the margin for every window `last` in `lo..=hi`.
    pub k_sweep: Option<(usize, usize)>,
}

/// A seeded percentile bootstrap over prompts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Bootstrap {
    pub resamples: usize,
    pub seed: u64,
}

impl Default for Settings {
    /// The paper's measurement (Sections 3.2 and 4.3): the last 10 layers, median G, column sinks,
    /// the last 8 queries for position 0 with 1000 bootstrap resamples.
    fn default() -> Settings {
        Settings {
            last: 10,
            stat: Stat::Median,
            sink_position: SinkPosition::Column,
            gap_from: GapFrom::Scores,
            trailing_queries: 8,
            bootstrap: Bootstrap {
                resamples: 1000,
                seed: 0,
            },
            bands: false,
            k_sweep: None,
        }
    }
}

/// One model to score: its checkpoint and the token ids of every prompt.
pub struct Input<'a> {
    pub label: String,
    pub ckpt: &'a Checkpoint,
    pub tokens: Vec<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerReport {
    pub layer: usize,
    /// Median of G over the layer's valid observations (null if none).
    pub median_g: Option<f64>,
    pub mean_g: Option<f64>,
    pub pos0_share: Option<f64>,
    pub n_observations: usize,
    /// Infinite G among the observations (`--gap-from probabilities` only): the mean is then
    /// undefined (null), the median stays defined.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub n_infinite_g: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gamma_q_inf: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gamma_k_inf: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub m_q: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub m_k: Option<Vec<f64>>,
    /// Per-head energy shares and `||γ_h||_∞` of layerwise QK norms (Remark 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layerwise_heads: Option<LayerwiseHeads>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeadReport {
    pub layer: usize,
    pub head: usize,
    pub median_g: Option<f64>,
    /// The most frequent sink position over prompts (and queries, per-query mode); lowest on ties.
    pub sink_position: Option<u32>,
    pub pos0_share: Option<f64>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub n_infinite_g: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn count_infinite(g: &[f64]) -> usize {
    g.iter().filter(|v| v.is_infinite()).count()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelReport {
    pub model: String,
    pub path: String,
    pub reference: bool,
    pub model_type: String,
    pub qk_norm: QkNorm,
    pub num_layers: usize,
    /// The Hub repo and resolved commit, for models from the Hugging Face cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hub: Option<crate::checkpoint::hub_cache::HubRef>,
    /// First and last layer of the window.
    pub window: [usize; 2],
    pub n_tokens: usize,
    #[serde(flatten)]
    pub statistics: ModelStatistics,
    pub per_layer: Vec<LayerReport>,
    pub per_head: Vec<HeadReport>,
    /// The loss on `score --text` (filled in by the command after scoring; absent without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<super::text_loss::TextLoss>,
}

/// One model's statistics over the window, and over the bands and windows asked for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelStatistics {
    /// S: the median (or mean, `--stat mean`) of G over the window's valid observations.
    pub sink_strength: Option<f64>,
    /// Median of G over the window (equals S under the default `--stat median`).
    pub median_g: Option<f64>,
    /// Mean of `A[q, 0]` pooled over the window's valid observations (sinkmerge's own measure).
    pub pos0_share: Option<f64>,
    /// The paper's position-0 measure (Section 4.3, Appendix C.3): per prompt, the mean of
    /// `A[q, 0]` over the window's layers, every head and the trailing queries; then the mean
    /// over prompts.
    pub pos0_trailing: Option<f64>,
    /// Percentile bootstrap 95% interval of `pos0_trailing` over prompts.
    pub pos0_trailing_ci: Option<[f64; 2]>,
    pub strong_sink_frac: Option<f64>,
    pub n_observations: usize,
    /// Infinite G in the window (`--gap-from probabilities`: saturated sinks, a = 1). The median
    /// S stays defined; a mean S is then null.
    pub n_infinite_g: usize,
    /// S over the early, middle and late thirds of the layers (`--bands thirds`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sink_strength_bands: Option<BandValues>,
    /// S for each window of the K sweep (`--k-sweep`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sink_strength_by_last: Option<Vec<SinkStrengthAt>>,
}

/// Depth bands of `--bands`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Bands {
    /// The early, middle and late thirds of the layers.
    Thirds,
}

/// One value per third of the layers (Appendix E.4, Table 13).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BandValues {
    pub early: Option<f64>,
    pub middle: Option<f64>,
    pub late: Option<f64>,
}

impl BandValues {
    /// `value` over each third of `layers` layers ([`thirds`]).
    fn of(layers: usize, value: impl Fn(Range<usize>) -> Option<f64>) -> BandValues {
        let [early, middle, late] = thirds(layers).map(value);
        BandValues {
            early,
            middle,
            late,
        }
    }
}

/// `at(last, window)` for every window of the last `last` layers, `last` in `lo..=hi` (all
/// layers once `last` reaches them).
fn by_last<T>(
    (lo, hi): (usize, usize),
    layers: usize,
    at: impl Fn(usize, Range<usize>) -> T,
) -> Vec<T> {
    (lo..=hi)
        .map(|last| at(last, layers.saturating_sub(last)..layers))
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SinkStrengthAt {
    pub last: usize,
    pub sink_strength: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MarginAt {
    pub last: usize,
    pub margin: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PairReport {
    #[serde(rename = "ref")]
    pub reference: String,
    pub target: String,
    #[serde(flatten)]
    pub statistics: PairStatistics,
}

/// A target against the reference over the window, and over the bands and windows asked for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PairStatistics {
    /// Median G of the reference over the window.
    pub g_base_median: Option<f64>,
    /// Median B of the target against the reference over the window.
    pub b_gap_median: Option<f64>,
    /// `g_base_median - b_gap_median` (Table 5's marginal proxy).
    pub margin: Option<f64>,
    pub n_observations: usize,
    /// The margin over each third of the layers (`--bands thirds`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub margin_bands: Option<BandValues>,
    /// The margin for each window of the K sweep (`--k-sweep`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub margin_by_last: Option<Vec<MarginAt>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Scores {
    pub models: Vec<ModelReport>,
    pub pairs: Vec<PairReport>,
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// What one layer of one model observed, per prompt (so that any subset of prompts and layers
/// can be summarised later without another forward pass).
#[derive(Debug, Clone, Default)]
struct LayerObservations {
    /// G of each prompt and head, queries in order.
    g: Vec<Vec<Vec<f64>>>,
    /// B of each prompt and head against the reference, in the same order (empty where not
    /// computed).
    b: Vec<Vec<Vec<f64>>>,
    /// Σ A[q, 0] over the trailing queries of every head, and their count, per prompt.
    trailing: Vec<(f64, usize)>,
}

/// Observations of one model, accumulated layer by layer; the scorer feeds it from the forward
/// pass, and anything else that has attention scores can feed it too.
pub struct ModelObservations {
    window_start: usize,
    window_pos0: Vec<f64>,
    per_layer: Vec<LayerReport>,
    per_head: Vec<HeadReport>,
    layers: Vec<LayerObservations>,
}

impl ModelObservations {
    /// For a model of `num_layers` layers scored with `settings`.
    pub fn new(num_layers: usize, settings: &Settings) -> ModelObservations {
        ModelObservations {
            window_start: num_layers.saturating_sub(settings.last),
            window_pos0: Vec::new(),
            per_layer: Vec::new(),
            per_head: Vec::new(),
            layers: Vec::new(),
        }
    }

    /// Whether `layer` is in the window.
    pub fn in_window(&self, layer: usize) -> bool {
        layer >= self.window_start
    }

    /// Add the next layer: each head's result in prompt-major order (`prompt * heads + head`).
    pub fn add_layer(
        &mut self,
        layer: usize,
        heads: usize,
        results: Vec<HeadResult>,
        qk: Option<QkNormStats>,
    ) {
        let prompts = results.len() / heads.max(1);
        let mut observed = LayerObservations {
            g: vec![Vec::with_capacity(heads); prompts],
            b: vec![Vec::with_capacity(heads); prompts],
            trailing: vec![(0.0, 0); prompts],
        };
        // results are prompt-major: head h of prompt p is at p * heads + h.
        for (i, r) in results.iter().enumerate() {
            let p = i / heads;
            observed.g[p].push(r.obs.g.clone());
            observed.b[p].push(r.b.clone().unwrap_or_default());
            observed.trailing[p].0 += r.trailing.0;
            observed.trailing[p].1 += r.trailing.1;
        }
        let obs: Vec<&HeadObservations> = results.iter().map(|r| &r.obs).collect();
        let mut g: Vec<f64> = observed.g.iter().flatten().flatten().copied().collect();
        let pos0: Vec<f64> = obs.iter().flat_map(|o| o.pos0.iter().copied()).collect();
        if layer >= self.window_start {
            for head in 0..heads {
                let of_head = obs.iter().skip(head).step_by(heads);
                let mut hg: Vec<f64> = of_head.clone().flat_map(|o| o.g.iter().copied()).collect();
                let hp: Vec<f64> = of_head
                    .clone()
                    .flat_map(|o| o.pos0.iter().copied())
                    .collect();
                let sinks: Vec<u32> = of_head.flat_map(|o| o.sinks.iter().copied()).collect();
                self.per_head.push(HeadReport {
                    layer,
                    head,
                    n_infinite_g: count_infinite(&hg),
                    median_g: finite(median(&mut hg)),
                    sink_position: mode(&sinks),
                    pos0_share: finite(mean(&hp)),
                });
            }
            self.window_pos0.extend_from_slice(&pos0);
        }
        let n = g.len();
        let (gamma_q_inf, gamma_k_inf, m_q, m_k, layerwise_heads) = match qk {
            Some(s) => (
                Some(s.gamma_q_inf),
                Some(s.gamma_k_inf),
                Some(s.m_q),
                Some(s.m_k),
                s.layerwise,
            ),
            None => (None, None, None, None, None),
        };
        self.per_layer.push(LayerReport {
            layer,
            mean_g: finite(mean(&g)),
            median_g: finite(median(&mut g)),
            pos0_share: finite(mean(&pos0)),
            n_observations: n,
            n_infinite_g: count_infinite(&g),
            gamma_q_inf,
            gamma_k_inf,
            m_q,
            m_k,
            layerwise_heads,
        });
        self.layers.push(observed);
    }

    /// G over `layers`, of every prompt or of `prompts`, layer-major then prompt order.
    fn g(&self, layers: Range<usize>, prompts: Option<&[usize]>) -> Vec<f64> {
        gather(&self.layers, layers, prompts, |l| &l.g)
    }

    /// B over `layers`, as [`ModelObservations::g`].
    fn b(&self, layers: Range<usize>, prompts: Option<&[usize]>) -> Vec<f64> {
        gather(&self.layers, layers, prompts, |l| &l.b)
    }

    /// The window's layers.
    fn window(&self) -> Range<usize> {
        self.window_start..self.layers.len()
    }

    /// S (under `stat`) over `layers`, of every prompt or of `prompts`.
    fn sink_strength_over(
        &self,
        stat: Stat,
        layers: Range<usize>,
        prompts: Option<&[usize]>,
    ) -> Option<f64> {
        finite(statistic(stat, &mut self.g(layers, prompts)))
    }

    /// This model (a target, holding B) against `reference` over `layers`: the reference's
    /// median G, the median B, and the number of B observations.
    fn gap_medians(
        &self,
        reference: &ModelObservations,
        layers: Range<usize>,
        prompts: Option<&[usize]>,
    ) -> (f64, f64, usize) {
        let g_base = median(&mut reference.g(layers.clone(), prompts));
        let mut b = self.b(layers, prompts);
        let n = b.len();
        (g_base, median(&mut b), n)
    }

    /// The paper's position-0 value of each prompt with at least one trailing query, over the
    /// window (`None` for prompts of one token).
    fn trailing_per_prompt(&self) -> Vec<f64> {
        let Some(first) = self.layers.get(self.window_start) else {
            return Vec::new();
        };
        (0..first.trailing.len())
            .filter_map(|p| {
                let (sum, n) = self.layers[self.window_start..]
                    .iter()
                    .fold((0.0, 0), |(s, n), l| {
                        (s + l.trailing[p].0, n + l.trailing[p].1)
                    });
                (n > 0).then(|| sum / n as f64)
            })
            .collect()
    }
}

/// The values of `field` over `range`, every head, of every prompt or of `prompts`: layer-major,
/// then prompt, head and query order.
fn gather(
    layers: &[LayerObservations],
    range: Range<usize>,
    prompts: Option<&[usize]>,
    field: impl Fn(&LayerObservations) -> &Vec<Vec<Vec<f64>>>,
) -> Vec<f64> {
    let mut out = Vec::new();
    for layer in &layers[range] {
        let per_prompt = field(layer);
        let mut add = |p: usize| per_prompt[p].iter().for_each(|v| out.extend_from_slice(v));
        match prompts {
            None => (0..per_prompt.len()).for_each(&mut add),
            Some(ps) => ps.iter().copied().for_each(&mut add),
        }
    }
    out
}

/// The values of `field` of one head of one layer, over every prompt.
fn gather_head(
    layer: &LayerObservations,
    head: usize,
    field: impl Fn(&LayerObservations) -> &Vec<Vec<Vec<f64>>>,
) -> Vec<f64> {
    field(layer)
        .iter()
        .flat_map(|per_head| per_head.get(head).into_iter().flatten().copied())
        .collect()
}

/// The layer ranges of the early, middle and late thirds of `n` layers, split as
/// `numpy.array_split(range(n), 3)`: the first `n % 3` thirds take one layer more.
pub fn thirds(n: usize) -> [Range<usize>; 3] {
    let size = |i: usize| n / 3 + usize::from(i < n % 3);
    let (a, b) = (size(0), size(0) + size(1));
    [0..a, a..b, b..n]
}

/// S of `g` under `stat`.
fn statistic(stat: Stat, g: &mut [f64]) -> f64 {
    match stat {
        Stat::Median => median(g),
        Stat::Mean => mean(g),
    }
}

/// The percentile bootstrap 95% interval of the mean of `values` (numpy's linear percentiles of
/// the resample means; resample indices from [`IndexStream`]).
pub fn bootstrap_ci(values: &[f64], bootstrap: Bootstrap) -> Option<[f64; 2]> {
    if values.is_empty() || bootstrap.resamples == 0 {
        return None;
    }
    let mut stream = IndexStream::new(bootstrap.seed);
    let n = values.len();
    let mut means: Vec<f64> = (0..bootstrap.resamples)
        .map(|_| (0..n).map(|_| values[stream.index(n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_unstable_by(f64::total_cmp);
    Some([
        percentile_sorted(&means, 2.5),
        percentile_sorted(&means, 97.5),
    ])
}

/// Everything a scoring pass observed, kept so that subsets of its prompts (the N-sweep's
/// draws) can be summarised without running the models again.
pub struct Observations {
    models: Vec<ModelObservations>,
    reference: Option<usize>,
    stat: Stat,
}

/// S of every model and the margin of every pair over one subset of the prompts.
#[derive(Debug, Clone, PartialEq)]
pub struct SubsetScores {
    pub sink_strength: Vec<Option<f64>>,
    pub margin: Vec<Option<f64>>,
}

impl Observations {
    /// The observations of each model; with `reference = Some(i)`, model i is the reference of
    /// the others, whose B it holds.
    pub fn new(
        models: Vec<ModelObservations>,
        reference: Option<usize>,
        stat: Stat,
    ) -> Observations {
        Observations {
            models,
            reference,
            stat,
        }
    }

    /// S and margins over the window, on the prompts of index `prompts` only.
    pub fn subset(&self, prompts: &[usize]) -> SubsetScores {
        let sink_strength = (self.models.iter())
            .map(|a| a.sink_strength_over(self.stat, a.window(), Some(prompts)))
            .collect();
        let margin = match self.reference {
            None => Vec::new(),
            Some(r) => (self.models.iter().enumerate())
                .filter(|&(i, _)| i != r)
                .map(|(_, a)| {
                    let (g_base, b, _) = a.gap_medians(&self.models[r], a.window(), Some(prompts));
                    finite(g_base - b)
                })
                .collect(),
        };
        SubsetScores {
            sink_strength,
            margin,
        }
    }
}

/// One head of a target against the same head of the reference, over the window: the per-head
/// view of [`PairStatistics`]. Pooling every head's observations gives the pair's own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadPairStatistics {
    pub layer: usize,
    pub head: usize,
    /// Median G of the reference's head.
    pub g_base_median: Option<f64>,
    /// Median G of the target's head.
    pub g_target_median: Option<f64>,
    /// `g_target_median - g_base_median`: negative where the head's sink weakened.
    pub delta_g: Option<f64>,
    /// Median B of the target's head against the reference's.
    pub b_gap_median: Option<f64>,
    /// `g_base_median - b_gap_median`, the head's own margin.
    pub margin: Option<f64>,
    /// Mean `A[q, 0]` over the reference head's valid observations.
    pub pos0_before: Option<f64>,
    /// The same for the target's head.
    pub pos0_after: Option<f64>,
    /// G observations of the target's head: the key earlier reports had, kept as
    /// `n_observations_target`.
    pub n_observations: usize,
    /// G observations of the reference's head (as `score` reports each model's).
    pub n_observations_base: usize,
    /// G observations of the target's head.
    pub n_observations_target: usize,
}

impl Observations {
    /// Every head of the window of model `target` against the reference, layer-major.
    ///
    /// # Panics
    /// Without a reference, or when `target` is the reference.
    pub fn head_pairs(&self, target: usize) -> Vec<HeadPairStatistics> {
        let r = self.reference.expect("head pairs need a reference");
        assert_ne!(r, target, "the reference is not its own target");
        let (base, model) = (&self.models[r], &self.models[target]);
        let pos0 = |m: &ModelObservations, layer: usize, head: usize| {
            (m.per_head.iter())
                .find(|h| h.layer == layer && h.head == head)
                .and_then(|h| h.pos0_share)
        };
        let mut out = Vec::new();
        for layer in model.window() {
            let heads = model.layers[layer].g.first().map_or(0, Vec::len);
            for head in 0..heads {
                let mut g_base = gather_head(&base.layers[layer], head, |l| &l.g);
                let g_base_len = g_base.len();
                let mut g = gather_head(&model.layers[layer], head, |l| &l.g);
                let mut b = gather_head(&model.layers[layer], head, |l| &l.b);
                let (g_base, g_target) = (finite(median(&mut g_base)), finite(median(&mut g)));
                let b_gap = finite(median(&mut b));
                out.push(HeadPairStatistics {
                    layer,
                    head,
                    g_base_median: g_base,
                    g_target_median: g_target,
                    delta_g: g_target.zip(g_base).map(|(t, b)| t - b),
                    b_gap_median: b_gap,
                    margin: g_base.zip(b_gap).and_then(|(g, b)| finite(g - b)),
                    pos0_before: pos0(base, layer, head),
                    pos0_after: pos0(model, layer, head),
                    n_observations: g.len(),
                    n_observations_base: g_base_len,
                    n_observations_target: g.len(),
                });
            }
        }
        out
    }
}

/// What a scoring pass returns: the reports, and the observations behind them.
pub struct Scored {
    pub scores: Scores,
    pub observations: Observations,
}

/// B compares scores position by position: every target must run the reference's token ids
/// through the same layer and head layout.
fn check_pairable(inputs: &[Input], models: &[Model], r: usize) -> Result<()> {
    let (rs, rl) = (&models[r].spec, &inputs[r].label);
    for (i, (input, model)) in inputs.iter().zip(models).enumerate() {
        if i == r {
            continue;
        }
        let s = &model.spec;
        // B compares scores head by head and query by query: the layouts must match (the model
        // types need not: a Qwen2 reference and its QK-norm-injected Qwen3 copy compare fine).
        let layout = |s: &crate::forward::model::DecoderSpec| {
            (s.num_layers(), s.num_heads, s.num_kv_heads, s.head_dim)
        };
        if layout(s) != layout(rs) {
            bail!(
                "{} ({}: {} layers, {} heads of {}) cannot be compared with the reference {rl} \
                 ({}: {} layers, {} heads of {}): B needs the same layers and heads",
                input.label,
                s.model_type,
                s.num_layers(),
                s.num_heads,
                s.head_dim,
                rs.model_type,
                rs.num_layers(),
                rs.num_heads,
                rs.head_dim
            );
        }
        let windows = |s: &crate::forward::model::DecoderSpec| {
            s.layers.iter().map(|l| l.window).collect::<Vec<_>>()
        };
        if windows(s) != windows(rs) {
            bail!(
                "{} and the reference {rl} use different sliding windows; B needs the same masks",
                input.label
            );
        }
        if input.tokens != inputs[r].tokens {
            bail!(
                "{} and the reference {rl} were given different token ids; B compares the same tokens",
                input.label
            );
        }
    }
    Ok(())
}

/// What the scorer keeps of one head of one prompt in one layer.
pub struct HeadResult {
    obs: HeadObservations,
    reference: Option<ReferenceHead>,
    b: Option<Vec<f64>>,
    trailing: (f64, usize),
}

impl HeadResult {
    /// Observe one head: G and pos0 always; what a reference keeps for B when `keep_reference`;
    /// B against `against`, the same head of the reference; the position-0 probe when
    /// `in_window`.
    pub fn observe(
        view: &HeadView,
        settings: &Settings,
        keep_reference: bool,
        against: Option<&ReferenceHead>,
        in_window: bool,
    ) -> HeadResult {
        let obs = observe(view, settings.sink_position, settings.gap_from);
        HeadResult {
            reference: keep_reference.then(|| ReferenceHead::new(view, &obs)),
            b: against.map(|r| r.gap_perturbation(view)),
            trailing: if in_window {
                trailing_pos0(view, settings.trailing_queries)
            } else {
                (0.0, 0)
            },
            obs,
        }
    }

    /// What a reference head keeps for its targets' B (taken once).
    pub fn take_reference(&mut self) -> Option<ReferenceHead> {
        self.reference.take()
    }
}

/// The first layer whose B (and reference scores) a model's reports need: the window's, or
/// earlier for the bands and the K sweep.
fn first_b_layer(num_layers: usize, settings: &Settings) -> usize {
    let mut first = num_layers.saturating_sub(settings.last);
    if let Some((_, hi)) = settings.k_sweep {
        first = first.min(num_layers.saturating_sub(hi));
    }
    if settings.bands {
        first = 0;
    }
    first
}

/// Score `inputs` on `backend`; with `reference = Some(i)`, `inputs[i]` is the reference and every
/// other model is paired with it (they must share its token ids). `on_layer` is called after each
/// model finishes each layer (for progress).
pub fn score<B: Backend>(
    backend: &B,
    inputs: &[Input],
    reference: Option<usize>,
    settings: Settings,
    on_layer: &dyn Fn(),
) -> Result<Scored> {
    let models: Vec<Model> = inputs
        .iter()
        .map(|i| Model::new(i.ckpt))
        .collect::<Result<_>>()?;
    if let Some(r) = reference {
        check_pairable(inputs, &models, r)?;
    }
    let states: Vec<State<B>> = models
        .iter()
        .zip(inputs)
        .map(|(m, i)| State::new(m, backend, &i.tokens))
        .collect::<Result<_>>()?;
    let mut accs: Vec<ModelObservations> = models
        .iter()
        .map(|m| ModelObservations::new(m.spec.num_layers(), &settings))
        .collect();
    // The reference runs first in every layer, so its scores are there for the targets.
    let mut order: Vec<usize> = (0..inputs.len()).collect();
    if let Some(r) = reference {
        order.retain(|&i| i != r);
        order.insert(0, r);
    }
    // Nothing after the last layer's attention scores can change any attention.
    let mut lockstep = Lockstep::new(states, order, End::Scores);
    // The reference's heads of the layer running now, for its targets' B.
    let mut ref_heads: Option<Vec<ReferenceHead>> = None;
    lockstep.run(|mi, layer, pass| {
        let spec = &models[mi].spec;
        let with_b = layer >= first_b_layer(spec.num_layers(), &settings);
        let in_window = accs[mi].in_window(layer);
        let is_ref = reference == Some(mi);
        // The reference runs first in its layer: its previous layer's heads go before it runs,
        // so only one layer of them is ever held.
        if is_ref {
            ref_heads = None;
        }
        let keep_ref = is_ref && with_b && inputs.len() > 1;
        let against = (!is_ref && with_b).then_some(ref_heads.as_ref()).flatten();
        let heads = spec.num_heads;
        let visit = |view: &HeadView| {
            let r = against.map(|r| &r[view.prompt * heads + view.head]);
            HeadResult::observe(view, &settings, keep_ref, r, in_window)
        };
        let mut out = pass.layer(&visit, &mut ())?;
        if keep_ref {
            ref_heads = Some(
                (out.heads.iter_mut())
                    .filter_map(HeadResult::take_reference)
                    .collect(),
            );
        }
        accs[mi].add_layer(layer, heads, out.heads, out.qk_norm);
        on_layer();
        Ok(())
    })?;

    let reports = (inputs.iter().zip(&accs).enumerate())
        .map(|(mi, (input, acc))| {
            model_report(input, &models[mi], acc, reference == Some(mi), &settings)
        })
        .collect();
    let pairs = match reference {
        None => Vec::new(),
        Some(r) => (inputs.iter().zip(&accs).enumerate())
            .filter(|&(mi, _)| mi != r)
            .map(|(_, (input, acc))| PairReport {
                reference: inputs[r].label.clone(),
                target: input.label.clone(),
                statistics: acc.against(&accs[r], &settings),
            })
            .collect(),
    };
    Ok(Scored {
        scores: Scores {
            models: reports,
            pairs,
        },
        observations: Observations {
            models: accs,
            reference,
            stat: settings.stat,
        },
    })
}

impl ModelObservations {
    /// The model's statistics over the window, and over the bands and windows `settings` asks
    /// for.
    pub fn statistics(&self, settings: &Settings) -> ModelStatistics {
        let layers = self.layers.len();
        let mut g = self.g(self.window(), None);
        let n = g.len();
        let strong = g.iter().filter(|&&v| v > STRONG_SINK_G).count();
        let mean_g = mean(&g);
        let median_g = median(&mut g);
        let s = match settings.stat {
            Stat::Median => median_g,
            Stat::Mean => mean_g,
        };
        let trailing = self.trailing_per_prompt();
        let s_over = |range: Range<usize>| self.sink_strength_over(settings.stat, range, None);
        ModelStatistics {
            sink_strength: finite(s),
            median_g: finite(median_g),
            pos0_share: finite(mean(&self.window_pos0)),
            pos0_trailing: finite(mean(&trailing)),
            pos0_trailing_ci: bootstrap_ci(&trailing, settings.bootstrap),
            strong_sink_frac: (n > 0).then(|| strong as f64 / n as f64),
            n_observations: n,
            n_infinite_g: count_infinite(&g),
            sink_strength_bands: settings.bands.then(|| BandValues::of(layers, s_over)),
            sink_strength_by_last: settings.k_sweep.map(|k| {
                by_last(k, layers, |last, window| SinkStrengthAt {
                    last,
                    sink_strength: s_over(window),
                })
            }),
        }
    }

    /// This model (a target, holding B) against `reference`.
    pub fn against(&self, reference: &ModelObservations, settings: &Settings) -> PairStatistics {
        let layers = self.layers.len();
        let margin_over = |range: Range<usize>| {
            let (g_base, b, _) = self.gap_medians(reference, range, None);
            finite(g_base - b)
        };
        let (g_base, b_med, nb) = self.gap_medians(reference, self.window(), None);
        PairStatistics {
            g_base_median: finite(g_base),
            b_gap_median: finite(b_med),
            margin: finite(g_base - b_med),
            n_observations: nb,
            margin_bands: settings.bands.then(|| BandValues::of(layers, margin_over)),
            margin_by_last: settings.k_sweep.map(|k| {
                by_last(k, layers, |last, window| MarginAt {
                    last,
                    margin: margin_over(window),
                })
            }),
        }
    }
}

fn model_report(
    input: &Input,
    model: &Model,
    acc: &ModelObservations,
    is_reference: bool,
    settings: &Settings,
) -> ModelReport {
    let spec = &model.spec;
    ModelReport {
        model: input.label.clone(),
        path: input.ckpt.dir.display().to_string(),
        reference: is_reference,
        model_type: spec.model_type.clone(),
        qk_norm: spec.qk_norm,
        num_layers: spec.num_layers(),
        hub: input.ckpt.hub.clone(),
        window: [acc.window_start, spec.num_layers().saturating_sub(1)],
        n_tokens: input.tokens.iter().map(Vec::len).sum(),
        statistics: acc.statistics(settings),
        per_layer: acc.per_layer.clone(),
        per_head: acc.per_head.clone(),
        text: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_heads_observations_pooled_give_s_and_the_margin_exactly() {
        use crate::forward::backend::cpu::CpuBackend;
        let assets = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/models");
        let open = |m: &str| Checkpoint::open_dir(&assets.join(m), m).unwrap();
        let ckpts = [open("tiny-qwen3/ref"), open("tiny-qwen3/vl")];
        let prompts = crate::sink::prompts::default_prompts();
        let inputs: Vec<Input> = (ckpts.iter())
            .map(|c| crate::sink::inputs::prompt_input(c, &prompts, None).unwrap())
            .collect();
        let settings = Settings {
            last: 4,
            ..Settings::default()
        };
        let scored = score(&CpuBackend::default(), &inputs, Some(0), settings, &|| {}).unwrap();
        let obs = &scored.observations;
        let pooled = |m: usize, field: fn(&LayerObservations) -> &Vec<Vec<Vec<f64>>>| {
            let model = &obs.models[m];
            let mut all = Vec::new();
            for layer in model.window() {
                let heads = model.layers[layer].g[0].len();
                for head in 0..heads {
                    all.extend(gather_head(&model.layers[layer], head, field));
                }
            }
            all
        };
        for m in 0..2 {
            let s = scored.scores.models[m].statistics.sink_strength;
            assert_eq!(finite(median(&mut pooled(m, |l| &l.g))), s);
        }
        let pair = &scored.scores.pairs[0].statistics;
        assert_eq!(finite(median(&mut pooled(1, |l| &l.b))), pair.b_gap_median);
        let heads = obs.head_pairs(1);
        assert_eq!(heads.len(), 4 * 4);
        let n: usize = heads.iter().map(|h| h.n_observations).sum();
        assert_eq!(n, scored.scores.models[1].statistics.n_observations);
    }

    #[test]
    fn thirds_split_as_numpy_array_split() {
        assert_eq!(thirds(28), [0..10, 10..19, 19..28]);
        assert_eq!(thirds(6), [0..2, 2..4, 4..6]);
        assert_eq!(thirds(2), [0..1, 1..2, 2..2]);
    }

    #[test]
    fn bootstrap_intervals_are_seeded_and_bracket_the_mean() {
        let v = [0.1, 0.5, 0.2, 0.9, 0.4];
        let b = Bootstrap {
            resamples: 200,
            seed: 3,
        };
        let ci = bootstrap_ci(&v, b).unwrap();
        assert_eq!(Some(ci), bootstrap_ci(&v, b));
        assert_ne!(Some(ci), bootstrap_ci(&v, Bootstrap { seed: 4, ..b }));
        let m = mean(&v);
        assert!(ci[0] < m && m < ci[1], "{ci:?} around {m}");
        assert_eq!(bootstrap_ci(&[], b), None);
    }
}
