//! Prompts with images as `trace` and `visual-sinks` take them (`docs/commands/trace.md`): raw
//! text whose `<image>` markers become the processor's placeholders, or the chat template's
//! rendering; images preprocessed from files, or the processor's output read from a safetensors
//! file for exact comparison with Python.

use std::path::{Path, PathBuf};

use crate::arch::config::RopeScaling;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::capture::{Images, Prompt};
use crate::forward::vision::{Pixels, Tower};
use crate::forward::vlm::{Placeholders, IMAGE_MARKER};
use crate::forward::weights::Model;
use crate::image::{Grid, Processor};
use crate::sink::tokenize::TextEncoder;
use crate::{bad, bail};

/// A processor's output: `pixel_values` in its shape, and how its rows divide among images.
pub struct PixelData {
    pub values: Vec<f32>,
    pub shape: Vec<usize>,
    pub grid: Grid,
}

impl PixelData {
    pub fn images(&self) -> usize {
        match &self.grid {
            Grid::Thw(g) => g.len(),
            Grid::NumPatches(n) => n.len(),
        }
    }

    pub fn pixels(&self) -> Pixels<'_> {
        Pixels::from_grid(&self.values, &self.grid)
    }
}

/// `pixel_values` with `image_grid_thw` (Qwen-VL) or `num_patches` (InternVL) from a
/// safetensors file, as transformers' processors return them.
pub fn read_pixel_file(path: &Path) -> Result<PixelData> {
    let bytes = crate::input::read(path, crate::input::PIXEL_VALUES)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad!("{}: not a safetensors file: {e}", path.display()))?;
    let tensor = |name: &str| {
        st.tensor(name)
            .map_err(|_| bad!("{}: tensor `{name}` is missing", path.display()))
    };
    let pv = tensor("pixel_values")?;
    let values = crate::dtype::decode(
        pv.dtype(),
        pv.data(),
        &format!("{}: tensor `pixel_values`", path.display()),
    )?;
    let ints = |name: &str| -> Result<(Vec<usize>, Vec<usize>)> {
        let t = tensor(name)?;
        if t.dtype() != safetensors::Dtype::I64 {
            bail!(
                "{}: tensor `{name}` must be int64, is {:?}",
                path.display(),
                t.dtype()
            );
        }
        let v = t
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .map(|x| {
                usize::try_from(x)
                    .map_err(|_| bad!("{}: tensor `{name}` holds {x}", path.display()))
            })
            .collect::<Result<Vec<usize>>>()?;
        Ok((v, t.shape().to_vec()))
    };
    let grid = if st.names().contains(&"image_grid_thw") {
        let (v, shape) = ints("image_grid_thw")?;
        if shape.len() != 2 || shape[1] != 3 {
            bail!(
                "{}: tensor `image_grid_thw` has shape {shape:?}, expected [images, 3]",
                path.display()
            );
        }
        Grid::Thw(v.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect())
    } else if st.names().contains(&"num_patches") {
        let (v, shape) = ints("num_patches")?;
        if shape.len() != 1 {
            bail!(
                "{}: tensor `num_patches` has shape {shape:?}, expected [images]",
                path.display()
            );
        }
        Grid::NumPatches(v)
    } else {
        bail!(
            "{}: neither `image_grid_thw` (Qwen-VL) nor `num_patches` (InternVL) is in the file",
            path.display()
        );
    };
    // Summed without wrapping: a grid of 1·4·(6+2⁶²) patches is 24 modulo 2⁶⁴, which the
    // values would match before the towers allocate from the grid itself.
    let (name, total) = match &grid {
        Grid::Thw(g) => (
            "image_grid_thw",
            g.iter().try_fold(0usize, |sum, &[t, h, w]| {
                t.checked_mul(h)?.checked_mul(w)?.checked_add(sum)
            }),
        ),
        Grid::NumPatches(n) => (
            "num_patches",
            n.iter().try_fold(0usize, |sum, &n| sum.checked_add(n)),
        ),
    };
    if total.is_none_or(|total| total > values.len()) {
        bail!(
            "{}: tensor `{name}` counts more rows than the {} values of `pixel_values` hold",
            path.display(),
            values.len()
        );
    }
    Ok(PixelData {
        values,
        shape: pv.shape().to_vec(),
        grid,
    })
}

/// A model's prompt machinery: its tower, the placeholder form its processor writes, its
/// tokenizer (and chat template) and image processor.
pub struct Prompter {
    pub tower: Option<Tower>,
    pub placeholders: Option<Placeholders>,
    encoder: TextEncoder,
    dir: PathBuf,
    model_type: String,
    has_vision_config: bool,
    mrope_merge: Option<usize>,
    /// The model's `max_position_embeddings`: no prompt is longer.
    max_positions: usize,
}

impl Prompter {
    /// Read `ckpt`'s tower, tokenizer and, with `chat`, its chat template.
    pub fn new(ckpt: &Checkpoint, model: &Model, chat: bool) -> Result<Prompter> {
        let tower = Tower::from_config(&ckpt.config)?;
        let placeholders = match &tower {
            Some(Tower::InternVl(_)) => Some(Placeholders::InternVl),
            Some(_) => Some(Placeholders::Qwen),
            None => None,
        };
        let mrope_merge = match &model.spec.layers[0].rope.scaling {
            RopeScaling::Mrope { .. } => Some(
                ckpt.config
                    .pointer("/vision_config/spatial_merge_size")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(2) as usize,
            ),
            _ => None,
        };
        Ok(Prompter {
            tower,
            placeholders,
            encoder: TextEncoder::load(&ckpt.dir, chat)?,
            dir: ckpt.dir.clone(),
            model_type: ckpt
                .config
                .get("model_type")
                .and_then(|v| v.as_str())
                .unwrap_or("?")
                .to_string(),
            has_vision_config: ckpt.config.get("vision_config").is_some(),
            mrope_merge,
            max_positions: model.spec.max_position_embeddings,
        })
    }

    /// The error for images given to a model without a tower sinkmerge runs.
    pub fn require_tower(&self) -> Result<&Tower> {
        if let Some(t) = &self.tower {
            return Ok(t);
        }
        if self.has_vision_config {
            bail!(
                "{}: the vision tower of model_type `{}` is not supported; sinkmerge runs \
                 Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE) and InternVL",
                self.dir.display(),
                self.model_type
            );
        }
        bail!(
            "{}: the model has no vision tower (model_type `{}`); give the prompt without \
             images",
            self.dir.display(),
            self.model_type
        );
    }

    /// The processor's output for `images` (decoded and preprocessed), or that of `file`, read
    /// from its path: checked as the processor's own would be, its shape the one the tower reads
    /// and its values finite (a NaN would surface deep in the tower as an overflow).
    pub fn pixels(
        &self,
        images: &[PathBuf],
        file: Option<(&Path, PixelData)>,
    ) -> Result<PixelData> {
        let tower = self.require_tower()?;
        let Some((path, p)) = file else {
            let processor = Processor::from_dir(&self.dir)?;
            self.check_processor(tower, &processor)?;
            let p = processor.preprocess(images)?;
            return Ok(PixelData {
                values: p.values,
                shape: p.shape,
                grid: p.grid,
            });
        };
        let row = tower.pixel_row_shape();
        if p.shape.len() != row.len() + 1 || p.shape[1..] != row[..] {
            let expected: Vec<String> = row.iter().map(usize::to_string).collect();
            bail!(
                "{}: tensor `pixel_values` has shape {:?}, but the model's vision tower reads \
                 [rows, {}]",
                path.display(),
                p.shape,
                expected.join(", ")
            );
        }
        if let Some(i) = p.values.iter().position(|v| !v.is_finite()) {
            bail!(
                "{}: tensor `pixel_values` holds {} at flat index {i}",
                path.display(),
                p.values[i]
            );
        }
        Ok(p)
    }

    /// The processor's geometry against the tower's: transformers' processor expands each image
    /// to the tokens its own patch and merge sizes give, while the model's tower makes those of
    /// `vision_config`, and the two must agree.
    fn check_processor(&self, tower: &Tower, processor: &Processor) -> Result<()> {
        let stated: Vec<(&str, usize)> = match processor {
            Processor::Qwen2Vl(p) => vec![
                ("patch_size", p.config.patch_size),
                ("temporal_patch_size", p.config.temporal_patch_size),
                ("merge_size", p.config.merge_size),
            ],
            Processor::GotOcr2(p) => vec![
                ("size.height", p.config.size.height),
                ("size.width", p.config.size.width),
            ],
        };
        for (key, vision_key, tower_value) in tower.processor_geometry() {
            let Some(&(_, value)) = stated.iter().find(|(k, _)| *k == key) else {
                continue;
            };
            if value != tower_value {
                bail!(
                    "{}: `{key}` {value} differs from `vision_config.{vision_key}` {tower_value} \
                     of {}; the processor and the vision tower would disagree on each image's \
                     patches",
                    self.dir.join("preprocessor_config.json").display(),
                    self.dir.join("config.json").display()
                );
            }
        }
        Ok(())
    }

    /// How many tokens each image of `pixels` becomes.
    pub fn image_tokens(&self, pixels: &PixelData) -> Result<Vec<usize>> {
        self.require_tower()?.tokens_per_image(&pixels.pixels())
    }

    /// The token ids of `prompt` (raw, with `<image>` markers; or rendered by the chat template
    /// with `chat`), each image expanded to its `image_tokens`.
    pub fn token_ids(&self, prompt: &str, chat: bool, image_tokens: &[usize]) -> Result<Vec<u32>> {
        let max = self.max_positions;
        // Before the placeholders are expanded into text of that many tokens.
        let images = (image_tokens.iter()).try_fold(0usize, |sum, &n| sum.checked_add(n));
        if images.is_none_or(|n| n > max) {
            bail!(
                "the images give {} image tokens, more than the model's max_position_embeddings \
                 {max} ({})",
                images.map_or("over 2⁶⁴".into(), |n| n.to_string()),
                self.dir.join("config.json").display()
            );
        }
        let text = match (self.placeholders, chat) {
            (Some(_), true) => self.encoder.render_with_images(prompt, IMAGE_MARKER)?,
            (Some(ph), false) => ph.raw_prompt(prompt),
            (None, true) => self.encoder.render(prompt)?,
            (None, false) => prompt.to_string(),
        };
        let text = match self.placeholders {
            Some(ph) if !image_tokens.is_empty() => ph.expand(&text, image_tokens)?,
            _ => text,
        };
        let ids = self.encoder.encode_text(&text, !chat)?;
        if ids.is_empty() {
            bail!("the prompt has no tokens");
        }
        if ids.len() > max {
            bail!(
                "the prompt has {} tokens, more than the model's max_position_embeddings {max} ({})",
                ids.len(),
                self.dir.join("config.json").display()
            );
        }
        Ok(ids)
    }

    /// The chat template's extra variables (see [`TextEncoder::set_template_args`]).
    pub fn set_template_args(&mut self, args: Vec<(String, serde_json::Value)>) -> Result<()> {
        self.encoder.set_template_args(args)
    }

    /// The token ids of plain `text`, without special tokens (a continuation to score).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.encoder.encode_text(text, false)
    }

    /// The text of generated `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.encoder.decode(ids)
    }

    /// The id of `token`, which the tokenizer must have.
    pub fn token(&self, token: &str) -> Result<u32> {
        self.encoder.token_id(token).ok_or_else(|| {
            bad!(
                "{}: the tokenizer has no `{token}` token",
                self.dir.join("tokenizer.json").display()
            )
        })
    }

    /// The prompt `ids` with `pixels`' images (none for a text-only prompt).
    pub fn prompt<'p>(
        &'p self,
        ids: Vec<u32>,
        pixels: Option<&'p PixelData>,
    ) -> Result<Prompt<'p>> {
        let images = match (pixels, self.placeholders) {
            (Some(p), Some(ph)) if p.images() > 0 => Some(Images {
                tower: self.require_tower()?,
                pixels: p.pixels(),
                pixel_shape: p.shape.clone(),
                image_token: self.token(ph.image_token())?,
            }),
            _ => None,
        };
        Ok(Prompt {
            ids,
            images,
            mrope_merge: self.mrope_merge,
        })
    }
}
