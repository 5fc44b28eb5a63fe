//! `sinkmerge generate`: decode a model's answer to a prompt, images included, exactly as
//! transformers' `generate` does (`docs/commands/generate.md`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::arch::layer_list::LayerList;
use crate::bail;
use crate::checkpoint::output::{write_file_atomic, OutputKind, Outputs};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::forward::backend::{Backend, HeadView};
use crate::forward::cache::KvCache;
use crate::forward::capture::{self, Capture, CaptureSet, Encoded, Kept, Prompt, Values};
use crate::forward::device::{BackendJob, ComputeDevice};
use crate::forward::precision::Precision;
use crate::forward::resident::Resident;
use crate::forward::vlm::IMAGE_MARKER;
use crate::forward::weights::Model;
use crate::generate::capture::Recorder;
use crate::generate::config::{GenerationConfig, Overrides, Settings};
use crate::generate::decode::{decode, decode_with, StopReason, Stops, Timings};
use crate::generate::sampling::{Sampler, StepStats};
use crate::generate::sequence::{Logits, Sequence};
use crate::report::json_text;

use super::image_prompt::{read_pixel_file, PixelData, Prompter};

/// `sinkmerge generate --help`.
pub const LONG_ABOUT: &str = "Decode MODEL's answer to a prompt with a KV cache, exactly as \
transformers' generate does (eager attention; f32 by default), images through the model's own \
vision tower. The text streams to stdout as it is decoded.\n\n\
Decoding follows the model's generation_config.json (greedy or sampling, temperature, top-k, \
top-p, min-p, repetition penalty, eos_token_id, max_new_tokens), as transformers does; each flag \
overrides its key, --do-sample and --greedy in both directions, and --json says which values \
were used and where each came from. Sampling draws from a seeded ChaCha20 stream (--seed): the \
same seed gives the same text at any thread count.\n\n\
The weights stay resident in their stored dtype, mapped from the safetensors files: bf16 and f16 \
are read directly by the matrix-vector kernels and accumulated in f32, so --precision f32 gives \
transformers' f32 results from a bf16 checkpoint without an f32 copy of the model.\n\n\
The prompt is raw text in which each <image> marks where the next --image goes, or with --chat \
the model's chat template (--template-arg KEY=VALUE passes the template a variable, its value \
read as JSON when it parses: enable_thinking=false). --batch FILE.jsonl runs one prompt a line \
with one model load and writes one JSON line each.\n\n\
--capture LIST -o FILE.safetensors keeps trace's tensors over the whole generation and writes \
them when it ends, laid out as trace's one pass over every token the model ran \
(docs/commands/generate.md, Captures).";

/// `sinkmerge generate --help`: examples.
pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge generate Qwen/Qwen2.5-VL-3B-Instruct --chat --prompt '<image>What is in the picture?' --image cat.png\n  \
sinkmerge generate Qwen/Qwen3-8B --chat --template-arg enable_thinking=false --prompt 'Name three primes.' --json\n  \
sinkmerge generate assets/models/tiny-qwen2/ref --prompt 'The capital of France is' --max-new-tokens 16\n  \
sinkmerge generate MODEL --batch prompts.jsonl > answers.jsonl\n  \
sinkmerge generate assets/models/tiny-qwen2/ref --prompt 'Hello' --capture attentions,keys --capture-layers 0-1 -o gen.safetensors\n\n\
Exit codes: 0 done; 2 bad input (nothing written); 3 NaN or Inf in the logits; 130 interrupted \
(SIGINT).";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model: a VLM or LLM directory, HF repo id (`ORG/NAME[@rev]`) or alias
    #[arg(value_name = "MODEL")]
    pub model: String,

    /// The prompt; each `<image>` marks where the next image goes
    #[arg(long, value_name = "TEXT", required_unless_present_any = ["batch", "prompt_ids"])]
    pub prompt: Option<String>,

    /// The prompt as token ids: a JSON list in FILE (exactly these ids, no template)
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "batch", "chat", "image", "pixel_values"])]
    pub prompt_ids: Option<PathBuf>,

    /// An image file (PNG, JPEG or WebP), once per `<image>` marker, in order
    #[arg(long, value_name = "FILE", conflicts_with = "pixel_values")]
    pub image: Vec<PathBuf>,

    /// Render the prompt with the model's chat template (images as content items)
    #[arg(long)]
    pub chat: bool,

    /// A variable for the chat template, `KEY=VALUE`; VALUE is read as JSON when it parses
    /// (`enable_thinking=false` is a boolean), else as a string
    #[arg(long = "template-arg", value_name = "KEY=VALUE")]
    pub template_arg: Vec<String>,

    /// Take `pixel_values` with `image_grid_thw` (Qwen) or `num_patches` (InternVL) from this
    /// safetensors file instead of preprocessing images
    #[arg(long, value_name = "FILE")]
    pub pixel_values: Option<PathBuf>,

    /// Tokens to generate at most (default: the model's generation_config.json, else
    /// transformers' max_length of 20)
    #[arg(long, value_name = "N")]
    pub max_new_tokens: Option<usize>,

    /// Sample, whatever generation_config.json says
    #[arg(long, conflicts_with = "greedy")]
    pub do_sample: bool,

    /// Greedy decoding, whatever generation_config.json says
    #[arg(long)]
    pub greedy: bool,

    /// Sampling temperature (> 0)
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,

    /// Keep the K most likely tokens (0: off)
    #[arg(long, value_name = "K")]
    pub top_k: Option<u64>,

    /// Keep the most likely tokens up to probability P, in (0, 1]
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,

    /// Drop tokens less likely than P times the most likely, in [0, 1]
    #[arg(long, value_name = "P")]
    pub min_p: Option<f64>,

    /// Penalise tokens already in the sequence (> 0; 1 is off)
    #[arg(long, value_name = "R")]
    pub repetition_penalty: Option<f64>,

    /// Seed of the sampler's draws
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,

    /// Stop once the generated text holds TEXT (repeatable)
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,

    /// Do not stop at the end-of-sequence tokens (benchmarks: exactly --max-new-tokens tokens)
    #[arg(long)]
    pub ignore_eos: bool,

    /// One prompt a line as JSON (`prompt`, `images`, `chat`, `template_args` and per-line
    /// `max_new_tokens`, `do_sample`, `temperature`, `top_k`, `top_p`, `min_p`,
    /// `repetition_penalty`, `seed`, `stop`); writes one JSON line each
    #[arg(long, value_name = "FILE.jsonl", conflicts_with_all = ["prompt", "image", "pixel_values"])]
    pub batch: Option<PathBuf>,

    /// Arithmetic of the forward pass: f32, or transformers' bf16 path
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,

    /// Where to compute: cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: ComputeDevice,

    /// Print one JSON document: ids, text, per-step log-probabilities, entropy and top 5,
    /// timings, the settings used and the stop reason
    #[arg(long)]
    pub json: bool,

    /// Keep `trace`'s tensors over the whole generation (prefill and every step) and write them
    /// to -o: `all`, or a comma-separated list of input_ids, position_ids, pixel_values,
    /// image_embeds, logits, attentions, keys, values, keys_pre_rope, hidden_states
    #[arg(
        long,
        value_name = "all|LIST",
        requires = "output",
        conflicts_with = "batch"
    )]
    pub capture: Option<CaptureSet>,

    /// The decoder layers whose per-layer tensors --capture keeps: `0-3,7`, `20:` (default: all)
    #[arg(long, value_name = "LIST", requires = "capture")]
    pub capture_layers: Option<LayerList>,

    /// The safetensors file --capture writes (atomically, once the generation ends)
    #[arg(short, long, value_name = "OUT.safetensors", requires = "capture")]
    pub output: Option<PathBuf>,
}

/// One prompt with its own settings (a `--batch` line, or the command line).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    #[serde(default)]
    images: Vec<PathBuf>,
    #[serde(default)]
    chat: bool,
    #[serde(default)]
    template_args: serde_json::Map<String, serde_json::Value>,
    max_new_tokens: Option<usize>,
    do_sample: Option<bool>,
    temperature: Option<f64>,
    top_k: Option<u64>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    seed: Option<u64>,
    #[serde(default)]
    stop: Vec<String>,
}

/// What `--json` prints (and each `--batch` line).
#[derive(Serialize)]
struct Report<'r> {
    model: &'r str,
    device: ComputeDevice,
    precision: Precision,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    text: String,
    stop_reason: StopReason,
    steps: Vec<StepStats>,
    timings: Timings,
    seed: u64,
    settings: Settings,
}

/// `KEY=VALUE` as the template sees it.
fn template_arg(arg: &str) -> Result<(String, serde_json::Value)> {
    let Some((key, value)) = arg.split_once('=') else {
        bail!("--template-arg `{arg}`: expected KEY=VALUE");
    };
    if key.is_empty() {
        bail!("--template-arg `{arg}`: the key is empty");
    }
    let value = serde_json::from_str(value)
        .unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
    Ok((key.to_string(), value))
}

/// The prompts to run: the command line's, or `--batch`'s lines (each checked before any
/// model is read).
fn lines(args: &Args) -> Result<Vec<Line>> {
    let Some(path) = &args.batch else {
        let prompt_ids = match &args.prompt_ids {
            Some(path) => {
                let bytes = crate::input::read(path, crate::input::MANIFEST)?;
                Some(serde_json::from_slice(&bytes).map_err(|e| {
                    crate::bad!("{}: not a JSON list of token ids: {e}", path.display())
                })?)
            }
            None => None,
        };
        let template_args = args
            .template_arg
            .iter()
            .map(|a| template_arg(a))
            .collect::<Result<_>>()?;
        return Ok(vec![Line {
            prompt: args.prompt.clone(),
            prompt_ids,
            images: args.image.clone(),
            chat: args.chat,
            template_args,
            ..Line::default()
        }]);
    };
    let bytes = crate::input::read(path, crate::input::MANIFEST)?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| crate::bad!("{}: not UTF-8: {e}", path.display()))?;
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(raw)
            .map_err(|e| crate::bad!("{}: line {}: {e}", path.display(), i + 1))?;
        if line.prompt.is_some() == line.prompt_ids.is_some() {
            bail!(
                "{}: line {}: give exactly one of `prompt` and `prompt_ids`",
                path.display(),
                i + 1
            );
        }
        lines.push(line);
    }
    if lines.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(lines)
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    if args.max_new_tokens == Some(0) {
        bail!("--max-new-tokens 0: nothing to generate; give at least 1");
    }
    let lines = lines(&args)?;
    for line in &lines {
        if line.max_new_tokens == Some(0) {
            bail!("`max_new_tokens` 0 in --batch: nothing to generate; give at least 1");
        }
        if let Some(prompt) = &line.prompt {
            let markers = prompt.matches(IMAGE_MARKER).count();
            let given = match &args.pixel_values {
                Some(p) => read_pixel_file(p)?.images(),
                None => line.images.len(),
            };
            if markers != given {
                bail!(
                    "the prompt has {markers} `{IMAGE_MARKER}` marker(s) but {given} image(s) \
                     were given"
                );
            }
        }
        for image in &line.images {
            crate::input::check(image, crate::input::IMAGE)?;
        }
    }
    let ckpt = Checkpoint::open_ref(&args.model)?;
    if let Some(output) = &args.output {
        let mut inputs: Vec<&Path> = vec![ckpt.dir.as_path()];
        inputs.extend(args.image.iter().map(PathBuf::as_path));
        inputs.extend(args.pixel_values.as_deref());
        inputs.extend(args.prompt_ids.as_deref());
        Outputs::new(false)
            .output("-o", Some(output), OutputKind::File)
            .inputs("input", inputs.iter().copied())
            .check()?;
    }
    let model = Model::new(&ckpt)?;
    let capture_layers = match &args.capture_layers {
        Some(list) => list.resolve(model.spec.num_layers())?,
        None => (0..model.spec.num_layers()).collect(),
    };
    let config = GenerationConfig::read(&ckpt.dir)?;
    let chat = lines.iter().any(|l| l.chat);
    let mut prompter = Prompter::new(&ckpt, &model, chat)?;
    let job = GenerateJob {
        args: &args,
        lines: &lines,
        model: &model,
        config: &config,
        prompter: &mut prompter,
        capture_layers: &capture_layers,
        out,
        progress,
    };
    args.device.run(args.precision, job)?;
    Ok(())
}

/// The job `--device` runs: every prompt over one set of held weights.
struct GenerateJob<'j> {
    args: &'j Args,
    lines: &'j [Line],
    model: &'j Model<'j>,
    config: &'j GenerationConfig,
    prompter: &'j mut Prompter,
    /// The layers `--capture` keeps.
    capture_layers: &'j [usize],
    out: &'j mut dyn Write,
    progress: bool,
}

impl BackendJob for GenerateJob<'_> {
    type Output = ();

    fn run<B: Backend>(mut self, backend: &B) -> Result<()> {
        let weights = Resident::load(backend, self.model)?;
        let bar = crate::progress::items(
            self.lines.len() as u64,
            "generate",
            self.progress && self.args.batch.is_some(),
        );
        for line in self.lines {
            self.one(backend, &weights, line)?;
            bar.inc(1);
        }
        bar.finish_and_clear();
        Ok(())
    }
}

impl<'j> GenerateJob<'j> {
    /// Generate the answer to one line and report it.
    fn one<B: Backend>(
        &mut self,
        backend: &B,
        weights: &Resident<'j, B>,
        line: &Line,
    ) -> Result<()> {
        let args = self.args;
        let model = self.model;
        let flags = Overrides {
            do_sample: line.do_sample.or(match (args.do_sample, args.greedy) {
                (true, _) => Some(true),
                (_, true) => Some(false),
                _ => None,
            }),
            temperature: line.temperature.or(args.temperature),
            top_k: line.top_k.or(args.top_k),
            top_p: line.top_p.or(args.top_p),
            min_p: line.min_p.or(args.min_p),
            repetition_penalty: line.repetition_penalty.or(args.repetition_penalty),
            max_new_tokens: line.max_new_tokens.or(args.max_new_tokens),
        };
        let settings = self
            .config
            .clone()
            .with(&flags)?
            .with_model_eos(&model.ckpt.config);
        let template_args = line.template_args.clone().into_iter().collect();
        self.prompter.set_template_args(template_args)?;
        let pixels: Option<PixelData> = match (&args.pixel_values, line.images.is_empty()) {
            (Some(path), _) => Some(
                self.prompter
                    .pixels(&[], Some((path, read_pixel_file(path)?)))?,
            ),
            (None, false) => Some(self.prompter.pixels(&line.images, None)?),
            (None, true) => None,
        };
        let ids = match (&line.prompt_ids, &line.prompt) {
            (Some(ids), _) => ids.clone(),
            (None, Some(text)) => {
                let image_tokens = match &pixels {
                    Some(p) => self.prompter.image_tokens(p)?,
                    None => Vec::new(),
                };
                self.prompter.token_ids(text, line.chat, &image_tokens)?
            }
            (None, None) => bail!("no prompt"),
        };
        let max_pos = model.spec.max_position_embeddings;
        let max_new = settings.max_new_tokens(ids.len(), Some(max_pos))?;
        let capacity = ids.len() + max_new;
        let cache_bytes = KvCache::<B::Tensor>::bytes(&model.spec, capacity);
        match &args.capture {
            None => crate::forward::memory::check(
                cache_bytes,
                &format!("a KV cache of {capacity} tokens"),
                "ask for fewer --max-new-tokens, or a shorter prompt",
            )?,
            Some(set) => crate::forward::memory::check(
                cache_bytes
                    + capture::peak_bytes(&model.spec, capacity, set, self.capture_layers.len()),
                &format!("a KV cache of {capacity} tokens and --capture over them"),
                "ask for fewer --max-new-tokens, fewer --capture-layers or fewer kinds with \
                 --capture",
            )?,
        }
        let prompt: Prompt = self.prompter.prompt(ids.clone(), pixels.as_ref())?;
        let started = Instant::now();
        let encoded = capture::encode(backend, model, &prompt)?;
        let mut seq = Sequence::new(model, backend, weights, capacity, None)?;
        let mut recorder =
            (args.capture.as_ref()).map(|set| Recorder::new(&model.spec, set, self.capture_layers));
        let logits = match &mut recorder {
            None => seq.prefill(
                &prompt,
                encoded.as_ref(),
                &|_, _: &HeadView| (),
                &mut (),
                Logits::Last,
            )?,
            Some(rec) => {
                let visit = rec.visitor();
                seq.prefill(&prompt, encoded.as_ref(), &visit, rec, Logits::Last)?
            }
        };
        let prefill_s = started.elapsed().as_secs_f64();
        let eos = if args.ignore_eos {
            Vec::new()
        } else {
            settings.eos_token_id.value.clone()
        };
        let stop_strings: Vec<String> = args.stop.iter().chain(&line.stop).cloned().collect();
        let stops = Stops {
            eos: &eos,
            strings: &stop_strings,
            max_new_tokens: max_new,
        };
        let seed = line.seed.unwrap_or(args.seed);
        let mut sampler = Sampler::new(&settings, seed);
        let stream = !args.json && args.batch.is_none();
        let prompter = &*self.prompter;
        let out = &mut *self.out;
        let text_of = |ids: &[u32]| prompter.decode(ids);
        let mut emit = |piece: &str| {
            if stream {
                write_flushed(out, piece)?;
            }
            Ok(())
        };
        let generated = match &mut recorder {
            None => decode(&mut seq, logits, &mut sampler, &stops, &text_of, &mut emit)?,
            Some(rec) => {
                let visit = rec.visitor();
                let mut step = |seq: &mut Sequence<'_, 'j, B>, token: u32| {
                    seq.feed(&[token], &visit, rec, Logits::Last)
                };
                decode_with(
                    &mut seq,
                    logits,
                    &mut sampler,
                    &stops,
                    &text_of,
                    &mut emit,
                    &mut step,
                )?
            }
        };
        if let (Some(rec), Some(path)) = (recorder, &args.output) {
            let positions = capture::positions(&prompt, encoded.as_ref())?;
            let kept = capture_tensors(rec, &prompt, encoded.as_ref(), positions, seq.ids())?;
            let mut kept = kept;
            if args
                .capture
                .as_ref()
                .is_some_and(|c| c.has(Capture::InputIds))
            {
                let ids = generated.ids.iter().map(|&i| i as i64).collect();
                kept.push(Kept {
                    name: "generated_ids".into(),
                    shape: vec![generated.ids.len()],
                    values: Values::I64(ids),
                });
            }
            let metadata = vec![
                (
                    "sinkmerge".to_string(),
                    env!("CARGO_PKG_VERSION").to_string(),
                ),
                ("model".to_string(), args.model.clone()),
                ("precision".to_string(), args.precision.to_string()),
                ("prompt_tokens".to_string(), ids.len().to_string()),
                (
                    "generated_tokens".to_string(),
                    generated.ids.len().to_string(),
                ),
                ("seed".to_string(), seed.to_string()),
            ];
            let bytes = capture::to_safetensors(&kept, metadata)?;
            write_file_atomic(path, &bytes)?;
        }
        let text = prompter.decode(&generated.ids)?;
        let decode_tokens = generated.ids.len().saturating_sub(1);
        let report = Report {
            model: &args.model,
            device: args.device,
            precision: args.precision,
            prompt_ids: ids.clone(),
            generated_ids: generated.ids,
            text,
            stop_reason: generated.stop_reason,
            steps: generated.steps,
            timings: Timings::new(prefill_s, ids.len(), generated.decode_s, decode_tokens),
            seed,
            settings,
        };
        if stream {
            write_flushed(out, "\n")
        } else if args.batch.is_some() {
            let line = serde_json::to_string(&report)
                .map_err(|e| crate::internal!("cannot serialise the report: {e}"))?;
            write_flushed(out, &format!("{line}\n"))
        } else {
            write_flushed(out, &format!("{}\n", json_text(&report)?))
        }
    }
}

/// Write `text` and flush it: streamed text shows as it is decoded.
fn write_flushed(out: &mut dyn Write, text: &str) -> Result<()> {
    super::emit(out, text)?;
    out.flush()
        .map_err(|e| Error::Write(format!("cannot write the report: {e}")))
}

/// Everything `--capture` writes but `generated_ids`: the recorder's per-layer tensors and
/// logits, and the inputs over the `tokens` run (`input_ids`, `position_ids`: the prompt's, then
/// one position a generated token) and the prompt's images, as `trace` names them.
fn capture_tensors(
    rec: Recorder,
    prompt: &Prompt,
    encoded: Option<&Encoded>,
    positions: Option<[Vec<i64>; 3]>,
    tokens: &[u32],
) -> Result<Vec<Kept>> {
    let set = rec.capture().clone();
    let t = rec.tokens();
    if t != tokens.len() {
        bail!("--capture recorded {t} tokens of {}", tokens.len());
    }
    let mut kept = Vec::new();
    if set.has(Capture::InputIds) {
        kept.push(Kept {
            name: "input_ids".into(),
            shape: vec![t],
            values: Values::I64(tokens.iter().map(|&i| i as i64).collect()),
        });
    }
    kept.extend(capture::image_tensors(prompt, encoded, &set));
    if set.has(Capture::PositionIds) {
        kept.push(match positions {
            Some(p) => {
                // M-RoPE: each generated token one past the last position on every axis.
                let next = p.iter().flatten().max().map_or(0, |&v| v + 1);
                let extra = (t - prompt.ids.len()) as i64;
                let axes: Vec<i64> = (0..3)
                    .flat_map(|a| p[a].iter().copied().chain(next..next + extra))
                    .collect();
                Kept {
                    name: "position_ids".into(),
                    shape: vec![3, t],
                    values: Values::I64(axes),
                }
            }
            None => Kept {
                name: "position_ids".into(),
                shape: vec![t],
                values: Values::I64((0..t as i64).collect()),
            },
        });
    }
    kept.extend(rec.finish()?);
    Ok(kept)
}
