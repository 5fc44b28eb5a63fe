//! `generate --capture` (`docs/commands/generate.md`, "Captures"): `trace`'s tensors over a whole
//! generation. The prefill and every decode step run with a [`Recorder`] as their hooks; at the
//! end it lays the rows out exactly as `trace` would for one forward pass over every token the
//! model ran (the prompt and each generated token but the last, which is chosen and never fed).

use crate::error::Result;
use crate::forward::backend::{Backend, HeadView};
use crate::forward::capture::{heads_first, Capture, CaptureSet, Kept, Values};
use crate::forward::decoder::{AttentionOutput, State};
use crate::forward::model::DecoderSpec;
use crate::forward::pass::Hooks;
use crate::internal;

/// One pass's attention of one layer: the position of its row 0, its rows, the keys they span,
/// and the probabilities `[heads, rows, keys]`.
struct Rows {
    offset: usize,
    rows: usize,
    keys: usize,
    probs: Vec<f32>,
}

/// What the prefill and each step keep, appended pass by pass.
pub struct Recorder {
    capture: CaptureSet,
    /// Whether each decoder layer is one of `--capture-layers`, and whether its attention is kept.
    chosen: Vec<bool>,
    keep_probs: Vec<bool>,
    wants_kv: bool,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    hidden: usize,
    attentions: Vec<Vec<Rows>>,
    /// `hidden_states.L` for L in `0..=layers`, `[tokens, hidden]` so far.
    hidden_states: Vec<Vec<f32>>,
    /// Per layer: keys before RoPE, keys, values, `[tokens, kv_heads · head_dim]` so far.
    kv: Vec<[Vec<f32>; 3]>,
    logits: Vec<f32>,
    /// The running pass's first position and rows.
    offset: usize,
    rows: usize,
    /// Tokens run so far.
    tokens: usize,
}

impl Recorder {
    /// Keep what `capture` names, per-layer kinds for `layers` (decoder layer indices).
    pub fn new(spec: &DecoderSpec, capture: &CaptureSet, layers: &[usize]) -> Recorder {
        let n = spec.num_layers();
        let mut chosen = vec![false; n];
        for &l in layers {
            chosen[l] = true;
        }
        let keep_probs = (chosen.iter())
            .map(|&c| c && capture.has(Capture::Attentions))
            .collect();
        let wants_kv = [Capture::Keys, Capture::Values, Capture::KeysPreRope]
            .iter()
            .any(|&c| capture.has(c));
        Recorder {
            capture: capture.clone(),
            chosen,
            keep_probs,
            wants_kv,
            heads: spec.num_heads,
            kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            hidden: spec.hidden_size,
            attentions: (0..n).map(|_| Vec::new()).collect(),
            hidden_states: vec![Vec::new(); n + 1],
            kv: (0..n).map(|_| Default::default()).collect(),
            logits: Vec::new(),
            offset: 0,
            rows: 0,
            tokens: 0,
        }
    }

    /// The visitor to run every pass with: each kept layer's probabilities, nothing elsewhere.
    pub fn visitor(&self) -> impl Fn(usize, &HeadView) -> Vec<f32> + Sync {
        let keep = self.keep_probs.clone();
        move |layer, h| {
            if keep[layer] {
                h.probs.to_vec()
            } else {
                Vec::new()
            }
        }
    }

    /// Whether `hidden_states.{l}` is kept: the input or the output of a chosen layer.
    fn hidden_wanted(&self, l: usize) -> bool {
        self.capture.has(Capture::HiddenStates)
            && (self.chosen.get(l).copied().unwrap_or(false) || (l > 0 && self.chosen[l - 1]))
    }

    /// What is kept.
    pub fn capture(&self) -> &CaptureSet {
        &self.capture
    }

    /// Tokens run so far: the rows of every tensor [`Recorder::finish`] lays out.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The per-layer tensors and the logits, as `trace` writes them for one pass over the
    /// tokens run: `attentions.L [heads, T, T]` (zero above the diagonal), `keys.L`, `values.L`,
    /// `keys_pre_rope.L [kv_heads, T, head_dim]`, `hidden_states.L [T, hidden]`,
    /// `logits [T, vocab]`.
    pub fn finish(self) -> Result<Vec<Kept>> {
        let t = self.tokens;
        let (nh, nkv, hd, hidden) = (self.heads, self.kv_heads, self.head_dim, self.hidden);
        let num_layers = self.chosen.len();
        let f32 = |name: String, shape: Vec<usize>, values: Vec<f32>| Kept {
            name,
            shape,
            values: Values::F32(values),
        };
        let mut kept = Vec::new();
        for (l, hs) in self.hidden_states.into_iter().enumerate() {
            if l <= num_layers && !hs.is_empty() {
                if hs.len() != t * hidden {
                    return Err(internal!("hidden_states.{l}: {} values", hs.len()));
                }
                kept.push(f32(format!("hidden_states.{l}"), vec![t, hidden], hs));
            }
        }
        for (l, passes) in self.attentions.into_iter().enumerate() {
            if !self.keep_probs[l] {
                continue;
            }
            let mut m = vec![0f32; nh * t * t];
            for p in passes {
                for h in 0..nh {
                    for q in 0..p.rows {
                        let src = (h * p.rows + q) * p.keys;
                        let dst = (h * t + p.offset + q) * t;
                        m[dst..dst + p.keys].copy_from_slice(&p.probs[src..src + p.keys]);
                    }
                }
            }
            kept.push(f32(format!("attentions.{l}"), vec![nh, t, t], m));
        }
        for (l, [pre, keys, values]) in self.kv.into_iter().enumerate() {
            for (c, rows) in [
                (Capture::KeysPreRope, pre),
                (Capture::Keys, keys),
                (Capture::Values, values),
            ] {
                if self.chosen[l] && self.capture.has(c) {
                    if rows.len() != t * nkv * hd {
                        return Err(internal!("{}.{l}: {} values", c.name(), rows.len()));
                    }
                    let values = heads_first(&rows, t, nkv, hd);
                    kept.push(f32(format!("{}.{l}", c.name()), vec![nkv, t, hd], values));
                }
            }
        }
        if self.capture.has(Capture::Logits) {
            let vocab = self.logits.len() / t.max(1);
            kept.push(f32("logits".into(), vec![t, vocab], self.logits));
        }
        Ok(kept)
    }
}

impl<B: Backend> Hooks<B, Vec<f32>> for Recorder {
    fn begin(&mut self, state: &mut State<'_, '_, B>) -> Result<()> {
        self.offset = state.offset();
        self.rows = state.rows();
        if self.offset != self.tokens {
            return Err(internal!(
                "a pass at position {} after {} recorded tokens",
                self.offset,
                self.tokens
            ));
        }
        if self.wants_kv {
            state.capture_kv(self.chosen.clone());
        }
        Ok(())
    }

    fn before(&mut self, layer: usize, state: &State<'_, '_, B>) -> Result<()> {
        if layer == 0 && self.hidden_wanted(0) {
            self.hidden_states[0].extend(state.hidden()?);
        }
        Ok(())
    }

    fn after(
        &mut self,
        layer: usize,
        out: &mut AttentionOutput<Vec<f32>>,
        state: &mut State<'_, '_, B>,
    ) -> Result<()> {
        if self.keep_probs[layer] {
            let keys = self.offset + self.rows;
            let probs = std::mem::take(&mut out.heads).concat();
            if probs.len() != self.heads * self.rows * keys {
                return Err(internal!("attentions.{layer}: {} values", probs.len()));
            }
            self.attentions[layer].push(Rows {
                offset: self.offset,
                rows: self.rows,
                keys,
                probs,
            });
        }
        if layer + 1 < self.chosen.len() && self.hidden_wanted(layer + 1) {
            self.hidden_states[layer + 1].extend(state.hidden()?);
        }
        Ok(())
    }

    fn end(&mut self, state: &mut State<'_, '_, B>) -> Result<()> {
        for kv in state.take_kv() {
            let [pre, keys, values] = &mut self.kv[kv.layer];
            pre.extend(kv.keys_pre_rope);
            keys.extend(kv.keys);
            values.extend(kv.values);
        }
        let num_layers = self.chosen.len();
        let want_last = self.hidden_wanted(num_layers);
        if want_last || self.capture.has(Capture::Logits) {
            let (normed, logits) = state.final_hidden_and_logits()?;
            if want_last {
                self.hidden_states[num_layers].extend(normed);
            }
            if self.capture.has(Capture::Logits) {
                self.logits.extend(logits);
            }
        }
        self.tokens += self.rows;
        Ok(())
    }
}
