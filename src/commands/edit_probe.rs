//! What a key edit needs to know of a prompt before it runs, shared by `generate --edit` and
//! `visual-sinks --answers`: the prompt's image blocks and question rows, and each probed layer's
//! text sink from one unedited pass (`docs/reference/visual-sinks.md`, "The key edit").

use crate::error::Result;
use crate::forward::backend::Backend;
use crate::forward::capture::Encoded;
use crate::forward::vlm::{image_rows, Placeholders};
use crate::forward::weights::Model;
use crate::sink::visual::{self, ImageTokens, Measured};
use crate::{bad, bail};

use super::args::KeyEditArgs;
use super::image_prompt::{PixelData, Prompter};

/// The image blocks of a prompt's `ids` (one per image, `counts[i]` tokens each) and its
/// question rows: after the last image block's end token to the end (`o` names the prompt).
pub fn image_blocks(
    prompter: &Prompter,
    ids: &[u32],
    counts: &[usize],
    o: &str,
) -> Result<(Vec<Vec<usize>>, std::ops::Range<usize>)> {
    let placeholders = prompter.placeholders.expect("a tower has placeholders");
    let image_token = prompter.token(placeholders.image_token())?;
    let end = prompter.token(match placeholders {
        Placeholders::Qwen => "<|vision_end|>",
        Placeholders::InternVl => "</img>",
    })?;
    let rows: Vec<usize> = image_rows(ids, image_token)
        .into_iter()
        .map(|r| r as usize)
        .collect();
    let last = *rows
        .last()
        .ok_or_else(|| bad!("{o}: the prompt has no image tokens"))?;
    let block_end = ids[last..]
        .iter()
        .position(|&t| t == end)
        .map(|p| last + p)
        .ok_or_else(|| bad!("{o}: the last image block has no end token"))?;
    let question = block_end + 1..ids.len();
    if question.is_empty() {
        bail!("{o}: the prompt has no tokens after the image, so there is no question to measure");
    }
    let mut blocks = Vec::new();
    let mut start = 0;
    for &n in counts {
        let block = rows
            .get(start..start + n)
            .ok_or_else(|| bad!("{o}: the prompt has fewer image tokens than its images"))?;
        blocks.push(block.to_vec());
        start += n;
    }
    Ok((blocks, question))
}

/// The probe an edit needs on the prompt `ids` (with `pixels`, encoded in `encoded`): its image
/// blocks and question rows as visual-sinks finds them, and each probed layer's text sink from
/// one unedited pass. Returns the settings, `(layer, t*)` and each image's token positions.
#[allow(clippy::too_many_arguments)]
pub fn probe<B: Backend>(
    key_edit: &KeyEditArgs,
    edit_seed: u64,
    model: &Model,
    prompter: &Prompter,
    backend: &B,
    encoded: Option<&Encoded>,
    pixels: Option<&PixelData>,
    ids: &[u32],
) -> Result<Probe> {
    let Some(pixels) = pixels else {
        bail!("--edit edits the keys of the prompt's image tokens: give an image (--image or --pixel-values)");
    };
    let counts = prompter.image_tokens(pixels)?;
    let (positions, question) = image_blocks(prompter, ids, &counts, "the prompt")?;
    // The ratio defines sinks, which the edit does not use: visual-sinks' default.
    let vs = key_edit.settings(100.0, edit_seed, model.spec.num_layers())?;
    let measured = Measured {
        prompt: prompter.prompt(ids.to_vec(), Some(pixels))?,
        question,
        images: (positions.iter())
            .map(|p| ImageTokens {
                positions: p.clone(),
                inside_box: None,
            })
            .collect(),
    };
    let (sinks, _) = visual::text_sinks(backend, model, &measured, encoded, &vs)?;
    Ok((vs, sinks, positions))
}

/// What [`probe`] finds: the settings, `(layer, t*)` and each image's token positions.
pub type Probe = (visual::Settings, visual::TextSinks, Vec<Vec<usize>>);
