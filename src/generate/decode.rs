//! The decode loop (`docs/commands/generate.md`): after a prefill, choose a token from the
//! logits, stop or run it as the next step, as transformers' `generate` does. Text streams out
//! as it is decoded; each step reports its token's log-probability, the entropy and the top five
//! of the raw distribution.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::sampling::{Sampler, StepStats};
use super::sequence::Sequence;
use crate::checkpoint::output::check_cancelled;
use crate::error::Result;
use crate::forward::backend::Backend;

/// One answer of `generate --json` (or an element of `--batch --json`'s array) as a reader takes
/// it back: `reproduce --answers` reads its steps' reports into these. The fields it needs of the
/// command's report; the others are left out.
#[derive(Debug, Clone, Deserialize)]
pub struct Answer {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub text: String,
    pub stop_reason: StopReason,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An end-of-sequence token (kept as the last generated id).
    Eos,
    /// `--max-new-tokens` tokens were generated.
    MaxNewTokens,
    /// The text came to hold a `--stop` string.
    Stop,
}

/// When to stop.
pub struct Stops<'s> {
    pub eos: &'s [u32],
    pub strings: &'s [String],
    pub max_new_tokens: usize,
}

/// Where the time went.
#[derive(Debug, Clone, Serialize)]
pub struct Timings {
    /// The prompt's pass (images through the tower included) up to the first token's logits.
    pub prefill_s: f64,
    pub prefill_tokens: usize,
    pub prefill_tokens_per_s: f64,
    /// The decode steps: every generated token after the first.
    pub decode_s: f64,
    pub decode_tokens: usize,
    pub decode_tokens_per_s: f64,
}

impl Timings {
    pub fn new(prefill_s: f64, prefill_tokens: usize, decode_s: f64, decode_tokens: usize) -> Self {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        Timings {
            prefill_s,
            prefill_tokens,
            prefill_tokens_per_s: rate(prefill_tokens, prefill_s),
            decode_s,
            decode_tokens,
            decode_tokens_per_s: rate(decode_tokens, decode_s),
        }
    }
}

/// A finished generation.
pub struct Generated {
    pub ids: Vec<u32>,
    pub steps: Vec<StepStats>,
    pub stop_reason: StopReason,
    /// Seconds of the decode steps.
    pub decode_s: f64,
}

/// Decode after a prefill whose next-token `logits` are given: `sampler` chooses each token,
/// `text` turns the tokens so far into their text (for `--stop` and for streaming), and `emit`
/// receives each new piece of text as soon as it is whole.
pub fn decode<B: Backend>(
    seq: &mut Sequence<'_, '_, B>,
    logits: Vec<f32>,
    sampler: &mut Sampler,
    stops: &Stops,
    text: &dyn Fn(&[u32]) -> Result<String>,
    emit: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Generated> {
    decode_with(
        seq,
        logits,
        sampler,
        stops,
        text,
        emit,
        &mut |seq, token| seq.step(token),
    )
}

/// One decode step: run `token` after the sequence and return the next token's logits.
pub type StepFn<'s, 'm, 'a, B> = dyn FnMut(&mut Sequence<'m, 'a, B>, u32) -> Result<Vec<f32>> + 's;

/// [`decode`], each step run by `step(seq, token)`, which returns the next token's logits
/// (`generate --capture` runs it with a visitor and hooks that keep the step's activations).
pub fn decode_with<'m, 'a, B: Backend>(
    seq: &mut Sequence<'m, 'a, B>,
    mut logits: Vec<f32>,
    sampler: &mut Sampler,
    stops: &Stops,
    text: &dyn Fn(&[u32]) -> Result<String>,
    emit: &mut dyn FnMut(&str) -> Result<()>,
    step: &mut StepFn<'_, 'm, 'a, B>,
) -> Result<Generated> {
    let started = Instant::now();
    let mut ids = Vec::new();
    let mut steps = Vec::new();
    let mut shown = String::new();
    let stop_reason = loop {
        check_cancelled()?;
        let stats = sampler.step(&logits, seq.ids(), ids.len())?;
        let token = stats.token_id;
        ids.push(token);
        steps.push(stats);
        let now = text(&ids)?;
        // A token that ends inside a character decodes to U+FFFD until the next completes it.
        if !now.ends_with('\u{FFFD}') && now.len() > shown.len() && now.starts_with(&shown) {
            emit(&now[shown.len()..])?;
            shown = now.clone();
        }
        if stops.eos.contains(&token) {
            break StopReason::Eos;
        }
        if stops.strings.iter().any(|s| now.contains(s.as_str())) {
            break StopReason::Stop;
        }
        if ids.len() == stops.max_new_tokens {
            break StopReason::MaxNewTokens;
        }
        logits = step(seq, token)?;
    };
    let now = text(&ids)?;
    if now.len() > shown.len() && now.starts_with(&shown) {
        emit(&now[shown.len()..])?;
    }
    Ok(Generated {
        ids,
        steps,
        stop_reason,
        decode_s: started.elapsed().as_secs_f64(),
    })
}
