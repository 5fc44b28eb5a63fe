//! Visual attention sinks (`sinkmerge visual-sinks`, `docs/reference/visual-sinks.md`): which
//! image tokens take the question's attention, how their keys line up with the text sink's, and
//! what projecting that direction out of them does, from forward passes through the "Images in"
//! pipeline ([`crate::forward::capture`]).
//!
//! - [`stats`]: one image at one layer: the question's attention, t*, ratios, sinks, token
//!   features, feature scores, the gate, contributions.
//! - [`edit`]: the key edits and their seeded controls, run through the decoder's key-edit seam.
//! - [`geometry`]: each token's region in the original image, for boxes and heatmaps.
//! - [`depth`]: the layer rules over the model's depth (peak layer, upper half, selector layers).
//! - [`aggregate`]: per-image values over a manifest.

pub mod aggregate;
pub mod depth;
pub mod edit;
pub mod geometry;
pub mod stats;

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Serialize;

use crate::error::Result;
use crate::forward::backend::Backend;
use crate::forward::backend::HeadView;
use crate::forward::capture::{self, Encoded, Prompt};
use crate::forward::decoder::{AttentionOutput, KeyStage, State};
use crate::forward::pass::{End, Hooks};
use crate::forward::weights::Model;

use edit::{EditKind, EditSetup, Editor};
use stats::{FeatureScore, Gate, LayerStats, LayerTensors, TokenStats, Top1Rates};

/// What to measure and which edit to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Sinks have `r_j ≥ ratio`.
    pub ratio: f64,
    /// Gated tokens have a centred key cosine `≥ gate`.
    pub gate: f64,
    /// The keys the cosines use and the edit acts on.
    pub keys: KeyStage,
    pub edit: EditKind,
    pub median_target: bool,
    pub controls: bool,
    pub seed: u64,
    /// The probed layers, ascending.
    pub layers: Vec<usize>,
}

/// One image of a prompt: its token positions and, with a target box, each token's membership.
#[derive(Debug, Clone)]
pub struct ImageTokens {
    pub positions: Vec<usize>,
    pub inside_box: Option<Vec<bool>>,
}

/// A prompt to measure.
pub struct Measured<'a> {
    pub prompt: Prompt<'a>,
    /// The question rows: after the last image block's end token to the end.
    pub question: Range<usize>,
    pub images: Vec<ImageTokens>,
}

/// One edited layer's before and after (`images[i].edit.layers[L]`).
#[derive(Debug, Clone, Serialize)]
pub struct EditLayer {
    pub affected: Vec<usize>,
    pub affected_share_before: f64,
    pub affected_share_after: f64,
    pub max_ratio_before: f64,
    pub max_ratio_after: f64,
    pub text_sink_share_before: f64,
    pub text_sink_share_after: f64,
}

/// The next token with and without the edit.
#[derive(Debug, Clone, Serialize)]
pub struct NextToken {
    pub top1_before: usize,
    pub top1_after: usize,
    pub top1_agree: bool,
    /// `KL(p_unedited ‖ p_edited)` in f64.
    pub kl: f64,
}

/// An edit's effect on one image (`images[i].edit`, `images[i].control`).
#[derive(Debug, Clone, Serialize)]
pub struct EditReport {
    pub kind: EditKind,
    pub median_target: bool,
    pub control: bool,
    pub layers: BTreeMap<usize, EditLayer>,
    pub next_token: NextToken,
}

/// Everything measured about one image.
#[derive(Debug, Clone, Serialize)]
pub struct ImageReport {
    pub image_tokens: usize,
    pub question_rows: [usize; 2],
    pub layers: BTreeMap<usize, LayerStats>,
    pub peak_layer: Option<usize>,
    pub best_box_layer: Option<usize>,
    /// Table 10 for this image: each map's box top-1 rate over the probed layers of the upper
    /// half ([`depth::upper_half_start`]).
    pub upper_half: Top1Rates,
    /// Of the tokens at `r ≥ 100` at those layers, the share inside the box, the box's own
    /// counted; null without a box or such a token.
    pub in_box_share_100: Option<f64>,
    pub tokens: BTreeMap<usize, Vec<TokenStats>>,
    pub features: Option<BTreeMap<String, FeatureScore>>,
    pub gate: Option<Gate>,
    pub edit: Option<EditReport>,
    pub control: Option<EditReport>,
}

/// A prompt's images measured, and the next token's logits of each pass (for parity tests).
pub struct Measurement {
    pub images: Vec<ImageReport>,
    pub logits_unedited: Vec<f32>,
    pub logits_edited: Option<Vec<f32>>,
    pub logits_control: Option<Vec<f32>>,
}

/// Per probed layer, ascending: `(layer, t*)`.
pub type TextSinks = Vec<(usize, usize)>;

/// Per probed layer: the question's attention over every position.
type Attention = Vec<(usize, Vec<f64>)>;

/// Run the passes `settings` asks for on `m` and measure its images. `progress` hears each
/// stage.
pub fn measure<B: Backend>(
    backend: &B,
    model: &Model,
    m: &Measured,
    settings: &Settings,
    mut progress: impl FnMut(&str),
) -> Result<Measurement> {
    let spec = &model.spec;
    let seq = m.prompt.ids.len();
    let mut is_image = vec![false; seq];
    for image in &m.images {
        for &j in &image.positions {
            is_image[j] = true;
        }
    }
    progress("vision tower");
    let encoded = capture::encode(backend, model, &m.prompt)?;
    let encoded = encoded.as_ref();

    // The unedited pass: every statistic, layer by layer.
    let mut reports: Vec<ImageReport> = m
        .images
        .iter()
        .map(|image| ImageReport {
            image_tokens: image.positions.len(),
            question_rows: [m.question.start, m.question.end],
            layers: BTreeMap::new(),
            peak_layer: None,
            best_box_layer: None,
            upper_half: Top1Rates::each(|_| None),
            in_box_share_100: None,
            tokens: BTreeMap::new(),
            features: None,
            gate: None,
            edit: None,
            control: None,
        })
        .collect();
    let mut unedited: Attention = Vec::new();
    let logits_unedited = run_pass(
        backend,
        model,
        m,
        encoded,
        settings,
        None,
        true,
        &mut progress,
        |layer, probs, scores, kv, hidden| {
            let a = stats::question_attention(probs, seq);
            let (keys_pre_rope, keys_post_rope, values) = kv;
            let t = LayerTensors {
                probs,
                scores,
                keys: match settings.keys {
                    KeyStage::PreRope => keys_pre_rope,
                    KeyStage::PostRope => keys_post_rope,
                },
                keys_pre_rope,
                values,
                hidden,
                num_kv_heads: spec.num_kv_heads,
                head_dim: spec.head_dim,
            };
            for (image, report) in m.images.iter().zip(&mut reports) {
                let (layer_stats, tokens) = stats::layer_stats(
                    &t,
                    &a,
                    &is_image,
                    &image.positions,
                    image.inside_box.as_deref(),
                    settings.ratio,
                    settings.gate,
                );
                report.layers.insert(layer, layer_stats);
                report.tokens.insert(layer, tokens);
            }
            unedited.push((layer, a));
        },
    )?;
    let first_counted = depth::first_counted_layer(spec.num_layers());
    for report in &mut reports {
        report.peak_layer = peak_layer(&report.layers, first_counted);
        report.best_box_layer = report
            .layers
            .iter()
            .find(|(_, s)| s.top1_in_box == Some(true))
            .map(|(&l, _)| l);
        if let Some(peak) = report.peak_layer {
            let tokens = &report.tokens[&peak];
            let sinks: Vec<bool> = tokens.iter().map(|t| t.sink).collect();
            report.features = Some(
                stats::FEATURES
                    .iter()
                    .map(|(name, f)| {
                        let values: Vec<f64> = tokens.iter().map(f).collect();
                        (name.to_string(), stats::score_feature(&values, &sinks))
                    })
                    .collect(),
            );
            report.gate = Some(stats::gate(tokens, settings.gate));
        }
    }

    let mut measurement = Measurement {
        images: Vec::new(),
        logits_unedited,
        logits_edited: None,
        logits_control: None,
    };
    if settings.edit != EditKind::None {
        // t* of the unedited pass is the same for every image: a and the non-image positions are.
        let sinks = text_sink_positions(&unedited, &is_image);
        let positions: Vec<Vec<usize>> = m.images.iter().map(|i| i.positions.clone()).collect();
        let mut edit_gated = None;
        for control in [false, true] {
            if control && !settings.controls {
                break;
            }
            let gated = if control { edit_gated.take() } else { None };
            let editor = editor(settings, spec, sinks.clone(), &positions, control, gated);
            let mut edited: Attention = Vec::new();
            progress(if control {
                "control pass"
            } else {
                "edited pass"
            });
            let logits = run_pass(
                backend,
                model,
                m,
                encoded,
                settings,
                Some(&editor),
                false,
                &mut progress,
                |layer, probs, _, _, _| edited.push((layer, stats::question_attention(probs, seq))),
            )?;
            let affected = editor.affected();
            if !control {
                edit_gated = Some(affected.clone());
            }
            let next_token = next_token(&measurement.logits_unedited, &logits);
            for (ii, (image, report)) in m.images.iter().zip(&mut reports).enumerate() {
                let layers = unedited
                    .iter()
                    .zip(&edited)
                    .enumerate()
                    .map(|(li, ((layer, before), (_, after)))| {
                        let t = sinks[li].1;
                        let touched = affected[ii][li].clone();
                        if !control {
                            for token in report.tokens.get_mut(layer).into_iter().flatten() {
                                token.attention_edited = Some(after[token.position]);
                            }
                            let image_after: Vec<f64> =
                                image.positions.iter().map(|&j| after[j]).collect();
                            if let Some(s) = report.layers.get_mut(layer) {
                                s.top1_in_box_edited = stats::top1_in_box(
                                    &image_after,
                                    image.inside_box.as_deref(),
                                    |_| true,
                                );
                            }
                        }
                        // The affected tokens' share of A_img and the largest ratio, in a pass.
                        let shares = |a: &[f64]| {
                            let (r, total) = stats::ratios(a, &image.positions);
                            let part: f64 = touched.iter().map(|&j| a[j]).sum();
                            let share = if total > 0.0 { part / total } else { 0.0 };
                            (share, r.into_iter().fold(f64::NEG_INFINITY, f64::max))
                        };
                        let (share_before, max_before) = shares(before);
                        let (share_after, max_after) = shares(after);
                        let row = EditLayer {
                            affected_share_before: share_before,
                            affected_share_after: share_after,
                            max_ratio_before: max_before,
                            max_ratio_after: max_after,
                            text_sink_share_before: before[t],
                            text_sink_share_after: after[t],
                            affected: touched,
                        };
                        (*layer, row)
                    })
                    .collect();
                let edit = EditReport {
                    kind: settings.edit,
                    median_target: settings.median_target,
                    control,
                    layers,
                    next_token: next_token.clone(),
                };
                if control {
                    report.control = Some(edit);
                } else {
                    report.edit = Some(edit);
                }
            }
            if control {
                measurement.logits_control = Some(logits);
            } else {
                measurement.logits_edited = Some(logits);
            }
        }
    }
    let upper = depth::upper_half_start(spec.num_layers());
    for report in &mut reports {
        upper_half(report, upper);
    }
    measurement.images = reports;
    Ok(measurement)
}

/// Table 10 for one image from its layers `L ≥ first` (the upper half): the top-1 rates, and
/// the share of the tokens at ≥ 100× uniform that lie in the box, over every such layer's
/// tokens together.
fn upper_half(report: &mut ImageReport, first: usize) {
    let rows: Vec<&LayerStats> = report.layers.range(first..).map(|(_, s)| s).collect();
    report.upper_half = Top1Rates::of(&rows);
    report.in_box_share_100 =
        stats::in_box_share_100(report.tokens.range(first..).flat_map(|(_, t)| t));
}

/// Per probed layer, the text sink t* of the question's attention `a` (the same for every
/// image: `a` and the non-image positions are).
fn text_sink_positions(attention: &Attention, is_image: &[bool]) -> Vec<(usize, usize)> {
    attention
        .iter()
        .map(|(l, a)| (*l, stats::text_sink(a, is_image).expect("question rows")))
        .collect()
}

/// The probe of a prompt that an edit needs, without the statistics: one unedited pass over
/// `m` (its images encoded in `encoded`) at `settings.layers`, giving each probed layer's text
/// sink t*, as [`measure`] finds it. Returns `(layer, t*)` ascending and the pass's next-token
/// logits.
pub fn text_sinks<B: Backend>(
    backend: &B,
    model: &Model,
    m: &Measured,
    encoded: Option<&Encoded>,
    settings: &Settings,
) -> Result<(TextSinks, Vec<f32>)> {
    let seq = m.prompt.ids.len();
    let mut is_image = vec![false; seq];
    for image in &m.images {
        for &j in &image.positions {
            is_image[j] = true;
        }
    }
    let mut attention: Attention = Vec::new();
    let logits = run_pass(
        backend,
        model,
        m,
        encoded,
        settings,
        None,
        false,
        &mut |_: &str| {},
        |layer, probs, _, _, _| attention.push((layer, stats::question_attention(probs, seq))),
    )?;
    Ok((text_sink_positions(&attention, &is_image), logits))
}

/// The editor of `settings`' edit (`control`: its control) at the probed layers `sinks`
/// (`(layer, t*)`, from the unedited pass) over the images' token `positions`; the remove
/// control edits the rows the edit `gated` (per image, per probed layer).
pub fn editor(
    settings: &Settings,
    spec: &crate::forward::model::DecoderSpec,
    sinks: Vec<(usize, usize)>,
    positions: &[Vec<usize>],
    control: bool,
    gated: Option<Vec<Vec<Vec<usize>>>>,
) -> Editor {
    Editor::new(EditSetup {
        kind: settings.edit,
        control,
        median_target: settings.median_target,
        stage: settings.keys,
        gate: settings.gate,
        seed: settings.seed,
        num_kv_heads: spec.num_kv_heads,
        head_dim: spec.head_dim,
        layers: sinks,
        images: positions,
        gated,
    })
}

/// The layer `L ≥ first_counted` with the largest sink share among those with a sink, ties to
/// the lowest.
fn peak_layer(layers: &BTreeMap<usize, LayerStats>, first_counted: usize) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (&l, s) in layers.range(first_counted..) {
        if s.sink_count > 0 && best.is_none_or(|(_, share)| s.sink_share > share) {
            best = Some((l, s.sink_share));
        }
    }
    best.map(|(l, _)| l)
}

/// Top-1 agreement and `KL(p ‖ q)` of two logit vectors, in f64.
pub fn next_token(before: &[f32], after: &[f32]) -> NextToken {
    let log_softmax = |l: &[f32]| -> Vec<f64> {
        let max = l.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let lse = max + l.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        l.iter().map(|&v| v as f64 - lse).collect()
    };
    let (p, q) = (log_softmax(before), log_softmax(after));
    let kl = p
        .iter()
        .zip(&q)
        .map(|(&lp, &lq)| lp.exp() * (lp - lq))
        .sum();
    let top = |l: &[f64]| stats::argmax(l).unwrap_or(0);
    let (top1_before, top1_after) = (top(&p), top(&q));
    NextToken {
        top1_before,
        top1_after,
        top1_agree: top1_before == top1_after,
        kl,
    }
}

/// The keys before and after RoPE and the values of one layer, `[seq, kv · head_dim]` each.
type LayerKv<'k> = (&'k [f32], &'k [f32], &'k [f32]);

/// One forward pass over every layer; at each probed layer `visit` gets the question rows'
/// probabilities and scores per head, and with `keep` the keys, values and the layer's input.
/// Returns the next token's logits.
#[allow(clippy::too_many_arguments)]
fn run_pass<B: Backend>(
    backend: &B,
    model: &Model,
    m: &Measured,
    encoded: Option<&Encoded>,
    settings: &Settings,
    editor: Option<&Editor>,
    keep: bool,
    progress: &mut impl FnMut(&str),
    visit: impl FnMut(usize, &[Vec<f32>], &[Vec<f32>], LayerKv, &[f32]),
) -> Result<Vec<f32>> {
    let num_layers = model.spec.num_layers();
    let mut probed = vec![false; num_layers];
    for &l in &settings.layers {
        probed[l] = true;
    }
    // The next block's weights are read and decoded while this one computes.
    let mut pass = capture::start(backend, model, &m.prompt, encoded, End::Logits)?;
    if let Some(e) = editor {
        pass.state_mut().set_key_edit(e);
    }
    if keep {
        pass.state_mut().capture_kv(probed.clone());
    }
    let q = m.question.clone();
    let rows = |layer: usize, h: &HeadView| -> (Vec<f32>, Vec<f32>) {
        if !probed[layer] {
            return (Vec::new(), Vec::new());
        }
        let span = q.start * h.len..q.end * h.len;
        let scores = if keep {
            h.scores[span.clone()].to_vec()
        } else {
            Vec::new()
        };
        (h.probs[span].to_vec(), scores)
    };
    let mut probe = Probe {
        probed: &probed,
        keep,
        hidden: Vec::new(),
        progress,
        visit,
    };
    pass.run(&rows, &mut probe)?;
    pass.state().last_logits()
}

/// What [`run_pass`] does around each layer: the layer's input before it runs, and at a probed
/// layer, its question rows, keys and values to the visitor once it ran.
struct Probe<'p, P, V> {
    probed: &'p [bool],
    keep: bool,
    /// The probed layer's input (with `keep`).
    hidden: Vec<f32>,
    progress: P,
    visit: V,
}

type QuestionRows = (Vec<f32>, Vec<f32>);

impl<B, P, V> Hooks<B, QuestionRows> for Probe<'_, P, V>
where
    B: Backend,
    P: FnMut(&str),
    V: FnMut(usize, &[Vec<f32>], &[Vec<f32>], LayerKv, &[f32]),
{
    fn before(&mut self, layer: usize, state: &State<'_, '_, B>) -> Result<()> {
        (self.progress)(&format!("layer {layer}"));
        self.hidden = if self.probed[layer] && self.keep {
            state.hidden()?
        } else {
            Vec::new()
        };
        Ok(())
    }

    fn after(
        &mut self,
        layer: usize,
        out: &mut AttentionOutput<QuestionRows>,
        state: &mut State<'_, '_, B>,
    ) -> Result<()> {
        if self.probed[layer] {
            let (probs, scores): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
                std::mem::take(&mut out.heads).into_iter().unzip();
            let kv = state.take_kv().pop();
            let empty: &[f32] = &[];
            let kv = kv.as_ref().map_or((empty, empty, empty), |kv| {
                (&kv.keys_pre_rope[..], &kv.keys[..], &kv.values[..])
            });
            (self.visit)(layer, &probs, &scores, kv, &self.hidden);
        }
        Ok(())
    }
}
