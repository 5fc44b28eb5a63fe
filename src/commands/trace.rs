//! `sinkmerge trace`: one forward pass of a prompt, with its images through the model's own
//! vision tower, and the chosen activations written to a safetensors file under transformers'
//! names (`docs/commands/trace.md`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::arch::config::RopeScaling;
use crate::arch::layer_list::LayerList;
use crate::checkpoint::output::{check_report_file, write_file_atomic};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::backend::{Backend, Precision};
use crate::forward::capture::{self, CaptureSet, Images, Kept, Prompt, Values};
use crate::forward::decoder::Model;
use crate::forward::device::{BackendJob, ComputeDevice};
use crate::forward::vision::{Pixels, Tower};
use crate::forward::vlm::{Placeholders, IMAGE_MARKER};
use crate::image::{Grid, Processor};
use crate::report::json_text;
use crate::sink::tokenize::TextEncoder;
use crate::{bad, bail};

/// `sinkmerge trace --help`.
pub const LONG_ABOUT: &str = "Run MODEL once on a prompt, with images through the model's own \
vision tower, and write the activations to a safetensors file under transformers' names: \
input_ids, position_ids, pixel_values with image_grid_thw or num_patches, image_embeds, logits, \
and per layer attentions.L, keys.L, values.L, keys_pre_rope.L and hidden_states.L (the tensors of \
transformers' output_attentions, output_hidden_states and KV cache, batch dimension dropped; \
docs/commands/trace.md).\n\n\
The prompt is raw text in which each <image> marks where the next --image goes; the marker \
becomes the processor's placeholder and is expanded to the image's tokens, as the model's \
processor does. With --chat the model's chat template renders one user message whose content is \
the images and the text between the markers. Images are decoded (PNG, JPEG, WebP) and \
preprocessed as transformers' PIL image processors do; --pixel-values takes the processor's \
output from a safetensors file instead, for exact comparison with Python.\n\n\
Vision towers: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE), InternVL (transformers and \
remote-code layouts). MODEL may also be a plain LLM (then without images).";

/// `sinkmerge trace --help`: examples.
pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge trace Qwen/Qwen2.5-VL-3B-Instruct --chat --prompt '<image>What is this?' --image cat.png -o cat.safetensors\n  \
sinkmerge trace VLM --prompt '<image>Describe it.' --pixel-values inputs.safetensors --capture attentions,logits --layers 20: -o out.safetensors\n  \
sinkmerge trace assets/models/tiny-qwen2/ref --prompt 'The capital of France is' -o text.safetensors --json";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model: a VLM or LLM directory, HF repo id (`ORG/NAME[@rev]`) or alias
    #[arg(value_name = "MODEL")]
    pub model: String,

    /// The prompt; each `<image>` marks where the next image goes
    #[arg(long, value_name = "TEXT")]
    pub prompt: String,

    /// An image file (PNG, JPEG or WebP), once per `<image>` marker, in order
    #[arg(long, value_name = "FILE", conflicts_with = "pixel_values")]
    pub image: Vec<PathBuf>,

    /// Render the prompt with the model's chat template (images as content items)
    #[arg(long)]
    pub chat: bool,

    /// Take `pixel_values` with `image_grid_thw` (Qwen) or `num_patches` (InternVL) from this
    /// safetensors file instead of preprocessing images
    #[arg(long, value_name = "FILE")]
    pub pixel_values: Option<PathBuf>,

    /// What to keep: `all`, or a comma-separated list of input_ids, position_ids, pixel_values,
    /// image_embeds, logits, attentions, keys, values, keys_pre_rope, hidden_states
    #[arg(long, value_name = "all|LIST", default_value = "all")]
    pub capture: CaptureSet,

    /// The decoder layers whose per-layer tensors are kept: `0-3,7`, `20:` (default: all)
    #[arg(long, value_name = "LIST")]
    pub layers: Option<LayerList>,

    /// Arithmetic of the forward pass: f32, or transformers' bf16 path
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,

    /// Where to compute: cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: ComputeDevice,

    /// The safetensors file to write (atomically; replaces an earlier one)
    #[arg(short, long, value_name = "OUT.safetensors")]
    pub output: PathBuf,

    /// Print a JSON summary (the tensors written, their shapes, the token counts) on stdout
    #[arg(long)]
    pub json: bool,
}

/// A file's tensors for `--pixel-values`.
struct PixelFile {
    values: Vec<f32>,
    shape: Vec<usize>,
    grid: Grid,
}

fn read_pixel_file(path: &Path) -> Result<PixelFile> {
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
    Ok(PixelFile {
        values,
        shape: pv.shape().to_vec(),
        grid,
    })
}

/// The job `--device` runs.
struct TraceJob<'a> {
    model: &'a Model<'a>,
    prompt: Prompt<'a>,
    capture: &'a CaptureSet,
    layers: Vec<usize>,
    progress: bool,
}

impl BackendJob for TraceJob<'_> {
    type Output = Vec<Kept>;

    fn run<B: Backend>(self, backend: &B) -> Result<Vec<Kept>> {
        let bar = crate::progress::items(
            self.model.spec.num_layers() as u64 + 2,
            "trace",
            self.progress,
        );
        let kept = capture::run(
            backend,
            self.model,
            &self.prompt,
            self.capture,
            &self.layers,
            |stage| {
                bar.set_message(stage.to_string());
                bar.inc(1);
            },
        );
        bar.finish_and_clear();
        kept
    }
}

#[derive(Serialize)]
struct TensorSummary {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
}

#[derive(Serialize)]
struct Summary {
    model: String,
    output: String,
    device: ComputeDevice,
    precision: Precision,
    tokens: usize,
    images: usize,
    image_tokens: Vec<usize>,
    bytes: usize,
    seconds: f64,
    tensors: Vec<TensorSummary>,
}

pub fn run(args: Args, progress: bool) -> Result<()> {
    let started = Instant::now();
    // Everything checkable before opening the model: the markers against the images, files.
    let markers = args.prompt.matches(IMAGE_MARKER).count();
    let pixel_file = args
        .pixel_values
        .as_deref()
        .map(read_pixel_file)
        .transpose()?;
    let images = match &pixel_file {
        Some(p) => match &p.grid {
            Grid::Thw(g) => g.len(),
            Grid::NumPatches(n) => n.len(),
        },
        None => args.image.len(),
    };
    if markers != images {
        let given = match &args.pixel_values {
            Some(p) => format!("{} has {images} image(s)", p.display()),
            None => format!("{images} --image file(s) were given"),
        };
        bail!("the prompt has {markers} `{IMAGE_MARKER}` marker(s) but {given}");
    }
    for image in &args.image {
        if !image.is_file() {
            bail!("{}: no such image file", image.display());
        }
    }
    let ckpt = Checkpoint::open_ref(&args.model)?;
    let mut inputs: Vec<&Path> = vec![ckpt.dir.as_path()];
    inputs.extend(args.image.iter().map(PathBuf::as_path));
    inputs.extend(args.pixel_values.as_deref());
    check_report_file(&args.output, &inputs)?;
    let model = Model::new(&ckpt)?;
    let layers = match &args.layers {
        Some(list) => list.resolve(model.spec.num_layers())?,
        None => (0..model.spec.num_layers()).collect(),
    };

    let tower = Tower::from_config(&ckpt.config)?;
    let placeholders = match &tower {
        Some(Tower::InternVl(_)) => Some(Placeholders::InternVl),
        Some(_) => Some(Placeholders::Qwen),
        None => None,
    };
    if images > 0 && tower.is_none() {
        let model_type = ckpt.config.get("model_type").and_then(|v| v.as_str());
        if ckpt.config.get("vision_config").is_some() {
            bail!(
                "{}: the vision tower of model_type `{}` is not supported; trace runs Qwen2-VL, \
                 Qwen2.5-VL, Qwen3-VL (dense and MoE) and InternVL",
                ckpt.dir.display(),
                model_type.unwrap_or("?")
            );
        }
        bail!(
            "{}: the model has no vision tower (model_type `{}`); give the prompt without \
             images",
            ckpt.dir.display(),
            model_type.unwrap_or("?")
        );
    }

    // Pixels, and the tokens each image becomes.
    let pixels = match (pixel_file, images) {
        (_, 0) => None,
        (Some(p), _) => Some((p.values, p.shape, p.grid)),
        (None, _) => {
            let processor = Processor::from_dir(&ckpt.dir)?;
            let p = processor.preprocess(&args.image)?;
            Some((p.values, p.shape, p.grid))
        }
    };
    let image_pixels = pixels.as_ref().map(|(values, _, grid)| match grid {
        Grid::Thw(g) => Pixels::Patches {
            values,
            grid_thw: g,
        },
        Grid::NumPatches(n) => Pixels::Tiles {
            values,
            num_patches: n,
        },
    });
    let image_tokens = match (&tower, &image_pixels) {
        (Some(t), Some(p)) => t.tokens_per_image(p)?,
        _ => Vec::new(),
    };

    // The text, as the processor builds it, and its token ids.
    let encoder = TextEncoder::load(&ckpt.dir, args.chat)?;
    let text = match (placeholders, args.chat) {
        (Some(_), true) => encoder.render_with_images(&args.prompt, IMAGE_MARKER)?,
        (Some(ph), false) => ph.raw_prompt(&args.prompt),
        (None, true) => encoder.render(&args.prompt)?,
        (None, false) => args.prompt.clone(),
    };
    let text = match placeholders {
        Some(ph) if images > 0 => ph.expand(&text, &image_tokens)?,
        _ => text,
    };
    let ids = encoder.encode_text(&text, !args.chat)?;
    if ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    let image_token = match placeholders {
        Some(ph) if images > 0 => Some(encoder.token_id(ph.image_token()).ok_or_else(|| {
            bad!(
                "{}: the tokenizer has no `{}` token",
                ckpt.dir.join("tokenizer.json").display(),
                ph.image_token()
            )
        })?),
        _ => None,
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
    let prompt = Prompt {
        ids,
        images: match (&tower, image_pixels, image_token, &pixels) {
            (Some(tower), Some(pixels), Some(image_token), Some((_, shape, _))) => Some(Images {
                tower,
                pixels,
                pixel_shape: shape.clone(),
                image_token,
            }),
            _ => None,
        },
        mrope_merge,
    };
    let tokens = prompt.ids.len();
    let job = TraceJob {
        model: &model,
        prompt,
        capture: &args.capture,
        layers,
        progress,
    };
    let (kept, _gpu) = args.device.run(args.precision, job)?;
    let metadata = vec![
        (
            "sinkmerge".to_string(),
            env!("CARGO_PKG_VERSION").to_string(),
        ),
        ("model".to_string(), args.model.clone()),
        ("prompt".to_string(), args.prompt.clone()),
        ("precision".to_string(), args.precision.to_string()),
    ];
    let bytes = capture::to_safetensors(&kept, metadata)?;
    write_file_atomic(&args.output, &bytes)?;

    let summary = Summary {
        model: args.model.clone(),
        output: args.output.display().to_string(),
        device: args.device,
        precision: args.precision,
        tokens,
        images,
        image_tokens,
        bytes: bytes.len(),
        seconds: started.elapsed().as_secs_f64(),
        tensors: kept
            .iter()
            .map(|k| TensorSummary {
                name: k.name.clone(),
                dtype: match k.values {
                    Values::F32(_) => "F32",
                    Values::I64(_) => "I64",
                },
                shape: k.shape.clone(),
            })
            .collect(),
    };
    if args.json {
        println!("{}", json_text(&summary)?);
    } else {
        println!(
            "{}: {} tokens, {} image(s) ({} image tokens), {} tensors, {} bytes -> {}",
            summary.model,
            summary.tokens,
            summary.images,
            summary.image_tokens.iter().sum::<usize>(),
            summary.tensors.len(),
            summary.bytes,
            summary.output
        );
    }
    Ok(())
}
