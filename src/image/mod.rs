//! Images to the pixel tensors a VLM takes, exactly as transformers' PIL image processors make them
//! (docs/reference/images.md): [`decode`] reads files to RGB8, [`resize`] is PIL's bicubic filter,
//! [`qwen2_vl`] the Qwen2-VL / Qwen2.5-VL / Qwen3-VL patch flattening and [`got_ocr2`] InternVL's
//! dynamic tiling. [`Processor::from_dir`] picks one from a model's `preprocessor_config.json`.

pub mod decode;
pub mod got_ocr2;
pub mod qwen2_vl;
pub mod resize;

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::bail;
use crate::error::Result;

/// A processor's output for a batch of images, as transformers' `BatchFeature`.
#[derive(Debug, Clone, PartialEq)]
pub struct Pixels {
    /// `pixel_values`, row-major in `shape`.
    pub values: Vec<f32>,
    /// `[patches, C·T·P·P]` (Qwen) or `[tiles, 3, H, W]` (InternVL).
    pub shape: Vec<usize>,
    /// How the rows of `values` divide among the images.
    pub grid: Grid,
    /// The number of image tokens each image expands to in the prompt.
    pub tokens: Vec<usize>,
}

/// The per-image layout of [`Pixels::values`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grid {
    /// `image_grid_thw`: temporal, height and width in patches (Qwen).
    Thw(Vec<[usize; 3]>),
    /// `num_patches`: tiles per image, the thumbnail included (InternVL).
    NumPatches(Vec<usize>),
}

/// An image processor read from a model directory.
#[derive(Debug, Clone, PartialEq)]
pub enum Processor {
    Qwen2Vl(qwen2_vl::Qwen2Vl),
    GotOcr2(got_ocr2::GotOcr2),
}

impl Processor {
    /// Reads `model_dir/preprocessor_config.json` and picks the processor its
    /// `image_processor_type` names (the transformers class, with or without its `Fast`/`Pil`
    /// backend suffix, which all compute the same pixels).
    pub fn from_dir(model_dir: &Path) -> Result<Self> {
        let path = model_dir.join("preprocessor_config.json");
        let value: serde_json::Value = read_json(&path)?;
        let kind = value
            .get("image_processor_type")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        let base = kind
            .strip_suffix("Fast")
            .or_else(|| kind.strip_suffix("Pil"))
            .unwrap_or(kind);
        match base {
            "Qwen2VLImageProcessor" => Ok(Processor::Qwen2Vl(qwen2_vl::Qwen2Vl::from_config(
                from_value(&path, value)?,
                &path,
            )?)),
            "GotOcr2ImageProcessor" => {
                let mut config: got_ocr2::Config = from_value(&path, value.clone())?;
                let internvl = InternVl::read(model_dir, &value)?;
                // InternVLProcessor calls the image processor with crop_to_patches=True
                // (`images_kwargs` in transformers/models/internvl/processing_internvl.py),
                // whatever preprocessor_config.json says.
                config.crop_to_patches |= internvl.is_internvl;
                Ok(Processor::GotOcr2(got_ocr2::GotOcr2::from_config(
                    config,
                    internvl.image_seq_length,
                    &path,
                )?))
            }
            "" => bail!("{}: no image_processor_type", path.display()),
            other => bail!(
                "{}: image_processor_type {other:?} is not supported (sinkmerge has \
                 Qwen2VLImageProcessor and GotOcr2ImageProcessor)",
                path.display()
            ),
        }
    }

    /// Decodes and processes `images`, in order, into one batch.
    pub fn preprocess(&self, images: &[PathBuf]) -> Result<Pixels> {
        match self {
            Processor::Qwen2Vl(p) => p.preprocess(images),
            Processor::GotOcr2(p) => p.preprocess(images),
        }
    }
}

/// What InternVLProcessor adds around the GotOcr2 image processor.
struct InternVl {
    /// `processor_class` is `InternVLProcessor` in `processor_config.json` or
    /// `preprocessor_config.json`.
    is_internvl: bool,
    /// Tokens per tile: `image_seq_length` of `processor_config.json` (InternVLProcessor's
    /// argument), or that processor's default, 256, when the file or the field is absent.
    image_seq_length: usize,
}

impl InternVl {
    fn read(model_dir: &Path, preprocessor: &serde_json::Value) -> Result<Self> {
        #[derive(Deserialize, Default)]
        struct ProcessorConfig {
            processor_class: Option<String>,
            image_seq_length: Option<usize>,
        }
        let path = model_dir.join("processor_config.json");
        let processor: ProcessorConfig = if path.is_file() {
            read_json(&path)?
        } else {
            ProcessorConfig::default()
        };
        let class = processor
            .processor_class
            .as_deref()
            .or_else(|| preprocessor.get("processor_class").and_then(|v| v.as_str()));
        Ok(InternVl {
            is_internvl: class == Some("InternVLProcessor"),
            image_seq_length: processor.image_seq_length.unwrap_or(256),
        })
    }
}

fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let bytes = crate::input::read(path, crate::input::PROCESSOR_CONFIG)?;
    serde_json::from_slice(&bytes).map_err(|e| crate::bad!("{}: {e}", path.display()))
}

fn from_value<T: DeserializeOwned>(path: &Path, value: serde_json::Value) -> Result<T> {
    serde_json::from_value(value).map_err(|e| crate::bad!("{}: {e}", path.display()))
}

/// A mean or std given as one number for every channel or one per channel, as transformers'
/// `normalize` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum PerChannel {
    All(f64),
    Each([f64; 3]),
}

impl PerChannel {
    fn to_f32(self) -> [f32; 3] {
        match self {
            PerChannel::All(v) => [v as f32; 3],
            PerChannel::Each(v) => v.map(|x| x as f32),
        }
    }
}

/// OpenAI CLIP's mean and std, both processors' defaults (`transformers/utils/constants.py`).
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// The fields both processors read, with transformers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Common {
    #[serde(default = "yes")]
    pub do_resize: bool,
    /// PIL's resampling filter number; only 3 (bicubic), what both processors use, is supported.
    #[serde(default = "bicubic")]
    pub resample: u32,
    #[serde(default = "yes")]
    pub do_rescale: bool,
    #[serde(default = "one_over_255")]
    pub rescale_factor: f64,
    #[serde(default = "yes")]
    pub do_normalize: bool,
    #[serde(default = "clip_mean")]
    pub image_mean: PerChannel,
    #[serde(default = "clip_std")]
    pub image_std: PerChannel,
    #[serde(default = "yes")]
    pub do_convert_rgb: bool,
}

fn yes() -> bool {
    true
}
fn bicubic() -> u32 {
    3
}
fn one_over_255() -> f64 {
    1.0 / 255.0
}
fn clip_mean() -> PerChannel {
    PerChannel::Each(CLIP_MEAN)
}
fn clip_std() -> PerChannel {
    PerChannel::Each(CLIP_STD)
}

/// The arithmetic of `rescale` then `normalize` (`transformers/image_transforms.py`) on one
/// channel value: rescale multiplies in f64 and rounds to f32; normalize subtracts and divides in
/// f32 with the mean and std rounded to f32.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ToFloat {
    rescale: Option<f64>,
    normalize: Option<([f32; 3], [f32; 3])>,
}

impl ToFloat {
    fn new(common: &Common, path: &Path) -> Result<Self> {
        if common.resample != 3 {
            bail!(
                "{}: resample {} is not supported (sinkmerge resamples with PIL's bicubic, 3)",
                path.display(),
                common.resample
            );
        }
        let to_float = ToFloat {
            rescale: common.do_rescale.then_some(common.rescale_factor),
            normalize: common
                .do_normalize
                .then(|| (common.image_mean.to_f32(), common.image_std.to_f32())),
        };
        // normalize divides by the std: a zero (or one so small that a pixel's quotient leaves
        // f32) would make every pixel value NaN or Inf, which the tower reports as an overflow.
        let finite = (0..3).all(|c| [0, 255].iter().all(|&v| to_float.apply(v, c).is_finite()));
        if !finite {
            let rescaled = |r: f64| ((255.0 * r) as f32).is_finite();
            let key = match to_float.normalize {
                _ if !to_float.rescale.is_none_or(rescaled) => "rescale_factor",
                Some((mean, _)) if !mean.iter().all(|m| m.is_finite()) => "image_mean",
                _ => "image_std",
            };
            let show = |p: PerChannel| match p {
                PerChannel::All(v) => v.to_string(),
                PerChannel::Each(v) => format!("{v:?}"),
            };
            let value = match key {
                "rescale_factor" => common.rescale_factor.to_string(),
                "image_mean" => show(common.image_mean),
                _ => show(common.image_std),
            };
            bail!(
                "{}: `{key}` {value} makes pixel values NaN or Inf (normalize divides by \
                 image_std, which must be non-zero)",
                path.display()
            );
        }
        Ok(to_float)
    }

    fn apply(&self, value: u8, channel: usize) -> f32 {
        let x = match self.rescale {
            Some(scale) => (f64::from(value) * scale) as f32,
            None => f32::from(value),
        };
        match self.normalize {
            Some((mean, std)) => (x - mean[channel]) / std[channel],
            None => x,
        }
    }

    /// `image` as channel-first f32, `[3, H, W]`.
    fn planes(&self, image: &::image::RgbImage) -> Vec<f32> {
        let plane = image.width() as usize * image.height() as usize;
        let mut out = vec![0.0; 3 * plane];
        for (i, pixel) in image.pixels().enumerate() {
            for c in 0..3 {
                out[c * plane + i] = self.apply(pixel[c], c);
            }
        }
        out
    }
}
