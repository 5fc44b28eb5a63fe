//! Teacher forcing: a given continuation scored after a prompt instead of sampled
//! (`generate --teacher-force`, `docs/commands/generate.md`). Each position gets the raw
//! distribution's statistics for the forced token and, with a key edit, the KL from the
//! unedited pass: the second paper's Figure 7 is that KL along a chain of thought, with the edit
//! and its random-direction control at every step.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::bail;
use crate::error::Result;
use crate::forward::backend::{Backend, HeadView};
use crate::forward::capture::{Encoded, Prompt};
use crate::forward::decoder::KeyEdit;
use crate::forward::resident::Resident;
use crate::forward::weights::Model;
use crate::generate::sampling::{check_scores, step_stats, StepStats};
use crate::generate::sequence::{Logits, Sequence};
use crate::sink::visual;

/// A `--teacher-force` file: one of its three forms.
#[derive(Debug, Deserialize)]
struct ForcedFile {
    token_ids: Option<Vec<i64>>,
    text: Option<String>,
    generated_ids: Option<Vec<i64>>,
}

/// The continuation to score, as its file gives it.
pub enum Forced {
    Ids(Vec<i64>),
    Text(String),
}

impl Forced {
    /// Read a `--teacher-force` file: JSON `{"token_ids": [...]}`, `{"text": "..."}`, or a
    /// `generate --json` report (its `generated_ids`).
    pub fn read(path: &Path) -> Result<Forced> {
        let bytes = crate::input::read(path, crate::input::MANIFEST)?;
        let f: ForcedFile = serde_json::from_slice(&bytes).map_err(|e| {
            crate::bad!(
                "{}: not a JSON object with `token_ids`, `text` or `generated_ids`: {e}",
                path.display()
            )
        })?;
        let forced = match (f.token_ids, f.text, f.generated_ids) {
            (Some(ids), None, None) => Forced::Ids(ids),
            (None, Some(text), None) => Forced::Text(text),
            // A `generate --json` report: its `text` is the decoded `generated_ids`.
            (None, _, Some(ids)) => Forced::Ids(ids),
            _ => bail!(
                "{}: give exactly one of `token_ids` and `text` (or a `generate --json` report)",
                path.display()
            ),
        };
        if matches!(&forced, Forced::Ids(ids) if ids.is_empty())
            || matches!(&forced, Forced::Text(t) if t.is_empty())
        {
            bail!("{}: the continuation is empty", path.display());
        }
        Ok(forced)
    }

    /// The token ids, text encoded by `encode` (no special tokens), each checked against the
    /// vocabulary of `vocab` tokens; `path` names the file in the error.
    pub fn tokens(
        &self,
        encode: impl FnOnce(&str) -> Result<Vec<u32>>,
        vocab: usize,
        path: &Path,
    ) -> Result<Vec<u32>> {
        let raw: Vec<i64> = match self {
            Forced::Ids(ids) => ids.clone(),
            Forced::Text(text) => encode(text)?.into_iter().map(i64::from).collect(),
        };
        raw.iter()
            .enumerate()
            .map(|(i, &t)| {
                if t < 0 || t as u64 >= vocab as u64 {
                    bail!(
                        "{}: token {t} at position {i} is outside the model's vocabulary \
                         (0..{vocab})",
                        path.display()
                    );
                }
                Ok(t as u32)
            })
            .collect()
    }
}

/// One forced position.
#[derive(Serialize)]
pub struct Position {
    #[serde(flatten)]
    pub stats: StepStats,
    /// 1 + the number of tokens with a larger raw logit.
    pub rank: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprob_unedited: Option<f32>,
    /// `KL(p_unedited || p_edited)` in nats.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
    /// `KL(p_unedited || p_control)` in nats.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_control: Option<f64>,
}

/// The raw logits before each of `tokens` after `prompt` (its images through `encoded`), with
/// `edit` on the prompt's keys: the prefill's last row, then one pass over the tokens but the
/// last. Each row is checked finite.
#[allow(clippy::too_many_arguments)]
pub fn forced_logits<'m, 'a, B: Backend>(
    model: &'m Model<'a>,
    backend: &'m B,
    weights: &'m Resident<'a, B>,
    prompt: &Prompt,
    encoded: Option<&'m Encoded>,
    tokens: &[u32],
    edit: Option<&'m dyn KeyEdit>,
) -> Result<Vec<Vec<f32>>> {
    let capacity = prompt.ids.len() + tokens.len();
    let (mut seq, last) =
        Sequence::prefilled(model, backend, weights, prompt, encoded, capacity, edit)?;
    let vocab = last.len();
    let mut rows = vec![last];
    if tokens.len() > 1 {
        let all = seq.feed(
            &tokens[..tokens.len() - 1],
            &|_, _: &HeadView| (),
            &mut (),
            Logits::All,
        )?;
        rows.extend(all.chunks(vocab).map(<[f32]>::to_vec));
    }
    for (i, row) in rows.iter().enumerate() {
        check_scores(row, i, "the raw logits")?;
    }
    Ok(rows)
}

/// `KL(plain_i || other_i)` at every position, in nats.
pub fn kl_per_position(plain: &[Vec<f32>], other: &[Vec<f32>]) -> Vec<f64> {
    plain
        .iter()
        .zip(other)
        .map(|(p, q)| visual::next_token(p, q).kl)
        .collect()
}

/// The report of each forced token: its statistics under `rows` (the edited pass, or the plain
/// one without an edit), with the unedited log-probability from `plain` and the KLs where given.
pub fn positions(
    tokens: &[u32],
    rows: &[Vec<f32>],
    plain: &[Vec<f32>],
    kl: Option<&[f64]>,
    kl_control: Option<&[f64]>,
) -> Vec<Position> {
    tokens
        .iter()
        .zip(rows)
        .enumerate()
        .map(|(i, (&token, row))| {
            let at = row[token as usize];
            Position {
                stats: step_stats(row, token),
                rank: 1 + row.iter().filter(|&&x| x > at).count(),
                logprob_unedited: kl.map(|_| step_stats(&plain[i], token).logprob),
                kl: kl.map(|k| k[i]),
                kl_control: kl_control.map(|k| k[i]),
            }
        })
        .collect()
}

/// The mean of `values` (0 for none).
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}
