//! A VLM prompt as the family's processor builds it (`docs/reference/vision.md`, "Prompts"):
//! the `<image>` markers of a raw prompt in the processor's placeholder form, each placeholder
//! expanded to its image's token count, and the M-RoPE positions of transformers'
//! `get_rope_index`.

use crate::bail;
use crate::error::Result;

/// The marker of a raw prompt: where the next image goes.
pub const IMAGE_MARKER: &str = "<image>";

/// How a family writes an image into the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholders {
    /// Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `<|vision_start|><|image_pad|><|vision_end|>`, the pad
    /// repeated once per image token (`Qwen2VLProcessor`).
    Qwen,
    /// InternVL: `<IMG_CONTEXT>`, expanded to `<img>` + `<IMG_CONTEXT>`×n + `</img>`
    /// (`InternVLProcessor`, whose placeholder is the tokenizer's `context_image_token`).
    InternVl,
}

impl Placeholders {
    /// What one image is in the text before expansion: what a raw prompt's marker becomes, and
    /// what the chat template writes for an image item.
    pub fn placeholder(self) -> &'static str {
        match self {
            Placeholders::Qwen => "<|vision_start|><|image_pad|><|vision_end|>",
            Placeholders::InternVl => "<IMG_CONTEXT>",
        }
    }

    /// The token that stands for each image token, and whose rows the tower's output replaces.
    pub fn image_token(self) -> &'static str {
        match self {
            Placeholders::Qwen => "<|image_pad|>",
            Placeholders::InternVl => "<IMG_CONTEXT>",
        }
    }

    /// The processor's expansion of one image of `tokens` image tokens.
    fn expansion(self, tokens: usize) -> String {
        let pad = self.image_token().repeat(tokens);
        match self {
            Placeholders::Qwen => pad,
            Placeholders::InternVl => format!("<img>{pad}</img>"),
        }
    }

    /// A raw prompt with its `<image>` markers in placeholder form.
    pub fn raw_prompt(self, prompt: &str) -> String {
        prompt.replace(IMAGE_MARKER, self.placeholder())
    }

    /// Expand, in order, each image token of `text` (the placeholder form) to its image's
    /// `tokens`, as the processor does. There must be exactly one per image.
    pub fn expand(self, text: &str, tokens: &[usize]) -> Result<String> {
        let pad = self.image_token();
        let found = text.matches(pad).count();
        if found != tokens.len() {
            bail!(
                "the prompt has {found} image placeholder(s) ({pad}) but {} image(s) were given",
                tokens.len()
            );
        }
        let mut out = String::with_capacity(text.len() + tokens.iter().sum::<usize>() * pad.len());
        let mut parts = text.split(pad);
        out.push_str(parts.next().unwrap_or_default());
        for (part, &n) in parts.zip(tokens) {
            out.push_str(&self.expansion(n));
            out.push_str(part);
        }
        Ok(out)
    }
}

/// The rows of `ids` holding `image_token`, in order.
pub fn image_rows(ids: &[u32], image_token: u32) -> Vec<u32> {
    ids.iter()
        .enumerate()
        .filter(|(_, &id)| id == image_token)
        .map(|(i, _)| i as u32)
        .collect()
}

/// transformers' `get_rope_index` for a prompt with images and no video (`modeling_qwen2_vl.py`,
/// the same in Qwen2.5-VL and Qwen3-VL): text tokens advance all three axes together; each run
/// of image tokens takes the next `grid_thw`, and its tokens get (t, h, w) over the merged grid
/// (`h / merge`, `w / merge`) offset by the current position; the text after it continues from
/// the current position plus `max(h, w) / merge`. Still images have no time spacing.
pub fn mrope_positions(
    ids: &[u32],
    image_token: u32,
    grids: &[[usize; 3]],
    merge: usize,
) -> Result<[Vec<i64>; 3]> {
    let mut axes: [Vec<i64>; 3] = std::array::from_fn(|_| Vec::with_capacity(ids.len()));
    let mut grids = grids.iter();
    let mut current = 0i64;
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token {
            for axis in &mut axes {
                axis.push(current);
            }
            current += 1;
            i += 1;
            continue;
        }
        let run = ids[i..].iter().take_while(|&&id| id == image_token).count();
        let Some(&[t, h, w]) = grids.next() else {
            bail!("the prompt has more runs of image tokens than images");
        };
        let (h, w) = (h / merge, w / merge);
        if run != t * h * w {
            bail!(
                "a run of {run} image tokens at position {i} does not match its image's grid \
                 ({t}×{h}×{w} merged patches)"
            );
        }
        for ti in 0..t {
            for hi in 0..h {
                for wi in 0..w {
                    axes[0].push(current + ti as i64);
                    axes[1].push(current + hi as i64);
                    axes[2].push(current + wi as i64);
                }
            }
        }
        current += h.max(w) as i64;
        i += run;
    }
    if grids.next().is_some() {
        bail!("the prompt has fewer runs of image tokens than images");
    }
    Ok(axes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_expand_per_image_and_count_their_images() {
        let q = Placeholders::Qwen;
        let text = q.raw_prompt("a<image>b<image>");
        assert_eq!(
            q.expand(&text, &[2, 1]).unwrap(),
            "a<|vision_start|><|image_pad|><|image_pad|><|vision_end|>b\
             <|vision_start|><|image_pad|><|vision_end|>"
        );
        assert!(q.expand(&text, &[2]).is_err());
        let i = Placeholders::InternVl;
        assert_eq!(
            i.expand(&i.raw_prompt("<image>x"), &[2]).unwrap(),
            "<img><IMG_CONTEXT><IMG_CONTEXT></img>x"
        );
    }

    #[test]
    fn rope_index_of_text_image_text() {
        // Two text tokens, a 1×4×6 grid merged by 2 (2×3 tokens), one text token.
        let ids = [5, 6, 9, 9, 9, 9, 9, 9, 7];
        let [t, h, w] = mrope_positions(&ids, 9, &[[1, 4, 6]], 2).unwrap();
        assert_eq!(t, [0, 1, 2, 2, 2, 2, 2, 2, 5]);
        assert_eq!(h, [0, 1, 2, 2, 2, 3, 3, 3, 5]);
        assert_eq!(w, [0, 1, 2, 3, 4, 2, 3, 4, 5]);
        assert!(mrope_positions(&ids, 9, &[[1, 4, 4]], 2).is_err());
        assert!(mrope_positions(&ids, 9, &[], 2).is_err());
    }
}
