//! Scoring several models in one layer-streaming pass: per model S, pos0 share, strong-sink
//! fraction, per-layer and per-head statistics and the Theorem-1 ingredients; with a reference,
//! B_gap and the margin of every other model against it.
//!
//! Models run in lockstep, layer by layer, the reference first: the reference keeps one
//! layer's scores (`heads x prompts x len²` floats) for its targets' B, then drops them, so no
//! model ever holds more than one layer's weights and one layer's attention.

use serde::Serialize;

use super::backend::Backend;
use super::forward::{HeadView, Model, QkNormStats, State};
use super::metrics::{
    mean, median, mode, observe, HeadObservations, ReferenceHead, SinkPosition, Stat, STRONG_SINK_G,
};
use crate::arch::QkNorm;
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// How to score.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Settings {
    /// Window: the last `last` decoder layers (all layers if fewer).
    pub last: usize,
    pub stat: Stat,
    pub sink_position: SinkPosition,
}

/// One model to score: its checkpoint and the token ids of every prompt.
pub struct Input<'a> {
    pub label: String,
    pub ckpt: &'a Checkpoint,
    pub tokens: Vec<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LayerReport {
    pub layer: usize,
    /// Median of G over the layer's valid observations (null if none).
    pub median_g: Option<f64>,
    pub mean_g: Option<f64>,
    pub pos0_share: Option<f64>,
    pub n_observations: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gamma_q_inf: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gamma_k_inf: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub m_q: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub m_k: Option<Vec<f64>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HeadReport {
    pub layer: usize,
    pub head: usize,
    pub median_g: Option<f64>,
    /// The most frequent sink position over prompts (and queries, per-query mode); lowest on ties.
    pub sink_position: Option<u32>,
    pub pos0_share: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    pub model: String,
    pub path: String,
    pub reference: bool,
    pub model_type: String,
    pub qk_norm: QkNorm,
    pub num_layers: usize,
    /// First and last layer of the window.
    pub window: [usize; 2],
    /// S: the median (or mean, `--stat mean`) of G over the window's valid observations.
    pub sink_strength: Option<f64>,
    /// Median of G over the window (equals S under the default `--stat median`).
    pub median_g: Option<f64>,
    pub pos0_share: Option<f64>,
    pub strong_sink_frac: Option<f64>,
    pub n_observations: usize,
    pub n_tokens: usize,
    pub per_layer: Vec<LayerReport>,
    pub per_head: Vec<HeadReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PairReport {
    #[serde(rename = "ref")]
    pub reference: String,
    pub target: String,
    /// Median G of the reference over the window.
    pub g_base_median: Option<f64>,
    /// Median B of the target against the reference over the window.
    pub b_gap_median: Option<f64>,
    /// `g_base_median - b_gap_median` (Table 5's marginal proxy).
    pub margin: Option<f64>,
    pub n_observations: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Scores {
    pub models: Vec<ModelReport>,
    pub pairs: Vec<PairReport>,
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// Observations of one model, accumulated layer by layer.
struct Accumulator {
    window_start: usize,
    window_g: Vec<f64>,
    window_pos0: Vec<f64>,
    per_layer: Vec<LayerReport>,
    per_head: Vec<HeadReport>,
    b: Vec<f64>,
}

impl Accumulator {
    fn new(window_start: usize) -> Accumulator {
        Accumulator {
            window_start,
            window_g: Vec::new(),
            window_pos0: Vec::new(),
            per_layer: Vec::new(),
            per_head: Vec::new(),
            b: Vec::new(),
        }
    }

    fn add_layer(
        &mut self,
        layer: usize,
        heads: usize,
        obs: &[HeadObservations],
        qk: Option<QkNormStats>,
    ) {
        let mut g: Vec<f64> = obs.iter().flat_map(|o| o.g.iter().copied()).collect();
        let pos0: Vec<f64> = obs.iter().flat_map(|o| o.pos0.iter().copied()).collect();
        let in_window = layer >= self.window_start;
        if in_window {
            for head in 0..heads {
                // obs is prompt-major: head h of prompt p is at p * heads + h.
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
                    median_g: finite(median(&mut hg)),
                    sink_position: mode(&sinks),
                    pos0_share: finite(mean(&hp)),
                });
            }
            self.window_g.extend_from_slice(&g);
            self.window_pos0.extend_from_slice(&pos0);
        }
        let n = g.len();
        let (gamma_q_inf, gamma_k_inf, m_q, m_k) = match qk {
            Some(s) => (
                Some(s.gamma_q_inf),
                Some(s.gamma_k_inf),
                Some(s.m_q),
                Some(s.m_k),
            ),
            None => (None, None, None, None),
        };
        self.per_layer.push(LayerReport {
            layer,
            mean_g: finite(mean(&g)),
            median_g: finite(median(&mut g)),
            pos0_share: finite(mean(&pos0)),
            n_observations: n,
            gamma_q_inf,
            gamma_k_inf,
            m_q,
            m_k,
        });
    }
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
        let layout = |s: &crate::sink::model::DecoderSpec| {
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
        let windows = |s: &crate::sink::model::DecoderSpec| {
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

/// What the visitor returns for each head.
struct HeadResult {
    obs: HeadObservations,
    reference: Option<ReferenceHead>,
    b: Option<Vec<f64>>,
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
) -> Result<Scores> {
    let models: Vec<Model> = inputs
        .iter()
        .map(|i| Model::new(i.ckpt))
        .collect::<Result<_>>()?;
    if let Some(r) = reference {
        check_pairable(inputs, &models, r)?;
    }
    let mut states: Vec<State<B>> = models
        .iter()
        .zip(inputs)
        .map(|(m, i)| State::new(m, backend, &i.tokens))
        .collect::<Result<_>>()?;
    let mut accs: Vec<Accumulator> = models
        .iter()
        .map(|m| Accumulator::new(m.spec.num_layers().saturating_sub(settings.last)))
        .collect();
    // The reference runs first in every layer, so its scores are there for the targets.
    let mut order: Vec<usize> = (0..inputs.len()).collect();
    if let Some(r) = reference {
        order.retain(|&i| i != r);
        order.insert(0, r);
    }
    let max_layers = models
        .iter()
        .map(|m| m.spec.num_layers())
        .max()
        .unwrap_or(0);
    for layer in 0..max_layers {
        let mut ref_heads: Option<Vec<ReferenceHead>> = None;
        for &mi in &order {
            let spec = &models[mi].spec;
            if layer >= spec.num_layers() {
                continue;
            }
            let in_window = layer >= accs[mi].window_start;
            let is_ref = reference == Some(mi);
            let keep_ref = is_ref && in_window && inputs.len() > 1;
            let against = (!is_ref && in_window)
                .then_some(ref_heads.as_ref())
                .flatten();
            let heads = spec.num_heads;
            let visit = |view: &HeadView| {
                let obs = observe(view, settings.sink_position);
                HeadResult {
                    reference: keep_ref.then(|| ReferenceHead::new(view, &obs)),
                    b: against.map(|r| r[view.prompt * heads + view.head].gap_perturbation(view)),
                    obs,
                }
            };
            let last = layer + 1 == spec.num_layers();
            let out = states[mi].attention(layer, &visit, !last)?;
            let mut obs = Vec::with_capacity(out.heads.len());
            let mut refs = Vec::new();
            for r in out.heads {
                if let Some(b) = r.b {
                    accs[mi].b.extend(b);
                }
                if let Some(rh) = r.reference {
                    refs.push(rh);
                }
                obs.push(r.obs);
            }
            if keep_ref {
                ref_heads = Some(refs);
            }
            accs[mi].add_layer(layer, heads, &obs, out.qk_norm);
            // Nothing after the last layer's attention scores can change any attention.
            if !last {
                states[mi].mlp(layer)?;
            }
            on_layer();
        }
    }

    let mut reports = Vec::with_capacity(inputs.len());
    let mut pairs = Vec::new();
    let ref_median = reference.map(|r| median(&mut accs[r].window_g.clone()));
    for (mi, (input, acc)) in inputs.iter().zip(accs).enumerate() {
        let spec = &models[mi].spec;
        let mut g = acc.window_g;
        let n = g.len();
        let strong = g.iter().filter(|&&v| v > STRONG_SINK_G).count();
        let mean_g = mean(&g);
        let median_g = median(&mut g);
        let s = match settings.stat {
            Stat::Median => median_g,
            Stat::Mean => mean_g,
        };
        if let (Some(r), Some(g_base)) = (reference, ref_median) {
            if r != mi {
                let mut b = acc.b;
                let nb = b.len();
                let b_med = median(&mut b);
                pairs.push(PairReport {
                    reference: inputs[r].label.clone(),
                    target: input.label.clone(),
                    g_base_median: finite(g_base),
                    b_gap_median: finite(b_med),
                    margin: finite(g_base - b_med),
                    n_observations: nb,
                });
            }
        }
        reports.push(ModelReport {
            model: input.label.clone(),
            path: input.ckpt.dir.display().to_string(),
            reference: reference == Some(mi),
            model_type: spec.model_type.clone(),
            qk_norm: spec.qk_norm,
            num_layers: spec.num_layers(),
            window: [acc.window_start, spec.num_layers().saturating_sub(1)],
            sink_strength: finite(s),
            median_g: finite(median_g),
            pos0_share: finite(mean(&acc.window_pos0)),
            strong_sink_frac: (n > 0).then(|| strong as f64 / n as f64),
            n_observations: n,
            n_tokens: input.tokens.iter().map(Vec::len).sum(),
            per_layer: acc.per_layer,
            per_head: acc.per_head,
        });
    }
    Ok(Scores {
        models: reports,
        pairs,
    })
}
