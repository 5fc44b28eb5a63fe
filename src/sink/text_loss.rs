//! A capability proxy beside the sink metrics: a model's mean next-token cross-entropy (nats) and
//! perplexity on a text file, as transformers' `model(input_ids=w, labels=w).loss` gives them
//! window by window (`docs/reference/sink-metrics.md`, "Text loss and perplexity").
//!
//! The whole file is tokenized as `AutoTokenizer(...)(text)` does by default (the tokenizer's
//! special tokens added, never a chat template), cut into consecutive non-overlapping windows of
//! `window` tokens, and each window runs as its own sequence through the same full forward as
//! the parity traces ([`to_logits`]), so every [`Backend`] computes it. Logits row `t` of a window
//! predicts its token `t + 1`, as `ForCausalLMLoss` (transformers/loss/loss_utils.py) shifts the
//! labels; a final window of one token predicts nothing and is dropped. The loss is the sum of
//! the token losses over the number of predicted tokens.

use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::tokenize::TextEncoder;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::forward::backend::Backend;
use crate::forward::backend::HeadView;
use crate::forward::model::DecoderSpec;
use crate::forward::pass::to_logits;
use crate::forward::weights::Model;
use crate::{bad, bail};

/// Tokens per window when `--text-window` is not given (capped at the model's context).
pub const DEFAULT_WINDOW: usize = 1024;

/// Logit values one forward pass may hold (2^26 f32, 256 MiB): windows are packed into one pass
/// under it, and a window whose logits alone exceed it runs alone.
const LOGITS_BUDGET: usize = 1 << 26;

/// One model's loss on the text: `models[i].text` of the JSON report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextLoss {
    /// The text file as given.
    pub file: String,
    /// Mean next-token cross-entropy in nats over every predicted token.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Tokens predicted: the file's tokens less one per window.
    pub tokens_predicted: usize,
    /// Windows scored.
    pub windows: usize,
    /// Tokens per window (the last may be shorter).
    pub window: usize,
}

/// The text of `path`: it must be readable UTF-8 with something besides whitespace.
pub fn read_text(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::read(path, e))?;
    if text.trim().is_empty() {
        bail!(
            "{}: the text file is empty; --text needs prose to measure the loss on",
            path.display()
        );
    }
    Ok(text)
}

/// The token ids of `text` (read from `path`) with `ckpt`'s own tokenizer, special tokens added
/// as transformers adds them by default; at least two, so one is predicted.
pub fn encode(ckpt: &Checkpoint, text: &str, path: &Path) -> Result<Vec<u32>> {
    let ids = TextEncoder::load(&ckpt.dir, false)?.encode(text)?;
    if ids.len() < 2 {
        bail!(
            "{}: encodes to {} token(s) with the tokenizer of {}; the loss needs at least 2 \
             (one to predict)",
            path.display(),
            ids.len(),
            ckpt.label
        );
    }
    Ok(ids)
}

/// Tokens per window for `spec`: `requested`, which must be at least 2 and within the context
/// (unless dynamic NTK RoPE extends it), or [`DEFAULT_WINDOW`] capped at the context.
pub fn window_for(spec: &DecoderSpec, requested: Option<usize>, model: &str) -> Result<usize> {
    let context = spec.max_position_embeddings;
    match requested {
        Some(w) if w < 2 => bail!(
            "--text-window {w}: a window needs at least 2 tokens (the first predicts the second)"
        ),
        Some(w) if w > context && !spec.extends_context() => bail!(
            "--text-window {w}: longer than {model}'s max_position_embeddings = {context}; \
             give at most {context}"
        ),
        Some(w) => Ok(w),
        None if spec.extends_context() => Ok(DEFAULT_WINDOW),
        None => Ok(DEFAULT_WINDOW.min(context)),
    }
}

/// Consecutive non-overlapping windows of `window` tokens; a last window of one token predicts
/// nothing and is left out.
pub fn windows(ids: &[u32], window: usize) -> Vec<&[u32]> {
    ids.chunks(window).filter(|w| w.len() >= 2).collect()
}

/// The loss of `ids` (from [`encode`]) in windows of `window` tokens on `backend`; `tick(n)`
/// after each forward pass of `n` windows (for a progress bar).
pub fn text_loss<B: Backend>(
    backend: &B,
    ckpt: &Checkpoint,
    ids: &[u32],
    window: usize,
    file: &str,
    tick: &dyn Fn(usize),
) -> Result<TextLoss> {
    let model = Model::new(ckpt)?;
    let all = windows(ids, window);
    let mut nll = 0f64;
    let mut predicted = 0usize;
    for batch in batches(&all, model.spec.vocab_size) {
        let prompts: Vec<Vec<u32>> = batch.iter().map(|w| w.to_vec()).collect();
        let out = to_logits(backend, &model, &prompts, &|_: &HeadView| ())?;
        let mut row = 0;
        for w in batch {
            if let Some(&t) = w.iter().find(|&&t| t as usize >= out.vocab) {
                bail!(
                    "{}: token id {t} of {file} is outside the LM head's {} rows",
                    ckpt.label,
                    out.vocab
                );
            }
            let logits = &out.logits[row * out.vocab..(row + w.len()) * out.vocab];
            nll += window_nll(logits, out.vocab, w);
            predicted += w.len() - 1;
            row += w.len();
        }
        tick(batch.len());
    }
    if !nll.is_finite() {
        return Err(crate::non_finite!(
            "{}: the loss on {file} is not finite (a logit row holds NaN or Inf)",
            ckpt.label
        ));
    }
    let loss = nll / predicted as f64;
    Ok(TextLoss {
        file: file.to_string(),
        loss,
        perplexity: loss.exp(),
        tokens_predicted: predicted,
        windows: all.len(),
        window,
    })
}

/// Windows grouped into forward passes whose logits stay under [`LOGITS_BUDGET`] (at least one
/// window each), so a small vocabulary packs many windows and a large one runs them one by one.
fn batches<'w>(all: &'w [&'w [u32]], vocab: usize) -> Vec<&'w [&'w [u32]]> {
    let mut out = Vec::new();
    let (mut start, mut rows) = (0, 0);
    for (i, w) in all.iter().enumerate() {
        if i > start && (rows + w.len()) * vocab > LOGITS_BUDGET {
            out.push(&all[start..i]);
            (start, rows) = (i, 0);
        }
        rows += w.len();
    }
    if start < all.len() {
        out.push(&all[start..]);
    }
    out
}

/// Sum over `t < len - 1` of `-log softmax(logits[t])[ids[t + 1]]`, each row's log-sum-exp in
/// f64 after subtracting its max. Rows run in parallel; their sum is taken in order, so the result
/// does not depend on the thread count.
fn window_nll(logits: &[f32], vocab: usize, ids: &[u32]) -> f64 {
    let losses: Vec<f64> = logits
        .par_chunks(vocab)
        .zip(&ids[1..])
        .map(|(row, &next)| {
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            max + sum.ln() - row[next as usize] as f64
        })
        .collect();
    losses.iter().sum()
}

/// `--text`: the file, and every model's token ids of it and window (in `models` order).
pub struct TextPass<'a> {
    file: String,
    models: Vec<(&'a Checkpoint, Vec<u32>, usize)>,
}

impl<'a> TextPass<'a> {
    /// Read `path` and encode it for each of `ckpts`: every bad input is found before scoring.
    pub fn new(
        path: &Path,
        ckpts: &'a [Checkpoint],
        window: Option<usize>,
    ) -> Result<TextPass<'a>> {
        let text = read_text(path)?;
        let models = (ckpts.iter())
            .map(|ckpt| {
                let spec = DecoderSpec::from_model_config(&ckpt.config)
                    .map_err(|e| bad!("{}: {e}", ckpt.dir.join("config.json").display()))?;
                Ok((
                    ckpt,
                    encode(ckpt, &text, path)?,
                    window_for(&spec, window, &ckpt.label)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(TextPass {
            file: path.display().to_string(),
            models,
        })
    }

    /// Each model's loss on the file, with a progress bar over the windows of every model.
    pub fn losses<B: Backend>(&self, backend: &B, show: bool) -> Result<Vec<TextLoss>> {
        let total: usize = (self.models.iter())
            .map(|(_, ids, window)| windows(ids, *window).len())
            .sum();
        let bar = crate::progress::items(total as u64, "text", show);
        let losses = (self.models.iter())
            .map(|(ckpt, ids, window)| {
                text_loss(backend, ckpt, ids, *window, &self.file, &|n| {
                    bar.inc(n as u64)
                })
            })
            .collect::<Result<Vec<_>>>()?;
        bar.finish_and_clear();
        Ok(losses)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_consecutive_and_a_lone_last_token_is_dropped() {
        let ids: Vec<u32> = (0..10).collect();
        let lens = |w| windows(&ids, w).iter().map(|x| x.len()).collect::<Vec<_>>();
        assert_eq!(lens(4), [4, 4, 2]);
        assert_eq!(lens(3), [3, 3, 3]);
        assert_eq!(lens(10), [10]);
        assert_eq!(lens(64), [10]);
        assert_eq!(windows(&ids, 3).concat(), &ids[..9]);
    }

    #[test]
    fn batches_keep_the_logits_under_the_budget() {
        let ids: Vec<u32> = (0..1000).collect();
        let all = windows(&ids, 100);
        let lens = |vocab| {
            batches(&all, vocab)
                .iter()
                .map(|b| b.len())
                .collect::<Vec<_>>()
        };
        assert_eq!(lens(2048), [10]);
        assert_eq!(lens(LOGITS_BUDGET / 250), [2, 2, 2, 2, 2]);
        assert_eq!(lens(LOGITS_BUDGET), [1; 10]);
    }

    #[test]
    fn the_loss_of_uniform_logits_is_log_vocab() {
        let (vocab, ids) = (7, [3u32, 1, 6, 0]);
        let nll = window_nll(&vec![0.5; 4 * vocab], vocab, &ids);
        assert!((nll / 3.0 - (vocab as f64).ln()).abs() < 1e-12);
        // A row certain of the next token costs nothing; the last row predicts nothing.
        let mut logits = vec![0f32; 2 * vocab];
        logits[ids[1] as usize] = 200.0;
        logits[vocab + 5] = f32::NAN;
        assert!(window_nll(&logits, vocab, &ids[..2]).abs() < 1e-12);
    }
}
