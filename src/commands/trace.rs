//! `sinkmerge trace`: one forward pass of a prompt, with its images through the model's own
//! vision tower, and the chosen activations written to a safetensors file under transformers'
//! names (`docs/commands/trace.md`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::arch::layer_list::LayerList;
use crate::bail;
use crate::checkpoint::output::{write_file_atomic, OutputKind, Outputs};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::backend::Backend;
use crate::forward::capture::{self, CaptureSet, Kept, Prompt, Values};
use crate::forward::device::{BackendJob, ComputeDevice};
use crate::forward::precision::Precision;
use crate::forward::vlm::IMAGE_MARKER;
use crate::forward::weights::Model;
use crate::report::json_text;

use super::image_prompt::{read_pixel_file, Prompter};

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

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let started = Instant::now();
    // Everything checkable before opening the model: the markers against the images, files.
    let markers = args.prompt.matches(IMAGE_MARKER).count();
    let pixel_file = args
        .pixel_values
        .as_deref()
        .map(|path| read_pixel_file(path).map(|p| (path, p)))
        .transpose()?;
    let images = match &pixel_file {
        Some((_, p)) => p.images(),
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
        crate::input::check(image, crate::input::IMAGE)?;
    }
    let ckpt = Checkpoint::open_ref(&args.model)?;
    let mut inputs: Vec<&Path> = vec![ckpt.dir.as_path()];
    inputs.extend(args.image.iter().map(PathBuf::as_path));
    inputs.extend(args.pixel_values.as_deref());
    Outputs::new(false)
        .output("-o", Some(&args.output), OutputKind::File)
        .inputs("input", inputs.iter().copied())
        .check()?;
    let model = Model::new(&ckpt)?;
    let layers = match &args.layers {
        Some(list) => list.resolve(model.spec.num_layers())?,
        None => (0..model.spec.num_layers()).collect(),
    };
    let prompter = Prompter::new(&ckpt, &model, args.chat)?;
    let pixels = if images > 0 {
        Some(prompter.pixels(&args.image, pixel_file)?)
    } else {
        None
    };
    let image_tokens = match &pixels {
        Some(p) => prompter.image_tokens(p)?,
        None => Vec::new(),
    };
    let ids = prompter.token_ids(&args.prompt, args.chat, &image_tokens)?;
    crate::forward::memory::check(
        capture::peak_bytes(&model.spec, ids.len(), &args.capture, layers.len()),
        &format!("tracing {} tokens", ids.len()),
        "keep fewer layers with --layers, or fewer kinds with --capture",
    )?;
    let prompt = prompter.prompt(ids, pixels.as_ref())?;
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
        super::emit(out, &format!("{}\n", json_text(&summary)?))?;
    } else {
        super::emit(
            out,
            &format!(
                "{}: {} tokens, {} image(s) ({} image tokens), {} tensors, {} bytes -> {}\n",
                summary.model,
                summary.tokens,
                summary.images,
                summary.image_tokens.iter().sum::<usize>(),
                summary.tensors.len(),
                summary.bytes,
                summary.output
            ),
        )?;
    }
    Ok(())
}
