//! Prompts with images as `trace` and `visual-sinks` take them (`docs/commands/trace.md`): raw
//! text whose `<image>` markers become the processor's placeholders, or the chat template's
//! rendering; images preprocessed from files, or the processor's output read from a safetensors
//! file for exact comparison with Python.

use std::path::{Path, PathBuf};

use crate::arch::config::RopeScaling;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::capture::{Images, Prompt};
use crate::forward::decoder::Model;
use crate::forward::vision::{Pixels, Tower};
use crate::forward::vlm::{Placeholders, IMAGE_MARKER};
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
    let bytes = std::fs::read(path).map_err(|e| bad!("{}: {e}", path.display()))?;
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

    /// The processor's output for `images` (decoded and preprocessed), or `file`'s.
    pub fn pixels(&self, images: &[PathBuf], file: Option<PixelData>) -> Result<PixelData> {
        self.require_tower()?;
        match file {
            Some(p) => Ok(p),
            None => {
                let p = Processor::from_dir(&self.dir)?.preprocess(images)?;
                Ok(PixelData {
                    values: p.values,
                    shape: p.shape,
                    grid: p.grid,
                })
            }
        }
    }

    /// How many tokens each image of `pixels` becomes.
    pub fn image_tokens(&self, pixels: &PixelData) -> Result<Vec<usize>> {
        self.require_tower()?.tokens_per_image(&pixels.pixels())
    }

    /// The token ids of `prompt` (raw, with `<image>` markers; or rendered by the chat template
    /// with `chat`), each image expanded to its `image_tokens`.
    pub fn token_ids(&self, prompt: &str, chat: bool, image_tokens: &[usize]) -> Result<Vec<u32>> {
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
        Ok(ids)
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
