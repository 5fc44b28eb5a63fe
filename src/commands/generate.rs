//! `sinkmerge generate`: decode a model's answer to a prompt, images included, exactly as
//! transformers' `generate` does (`docs/commands/generate.md`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::arch::layer_list::LayerList;
use crate::bail;
use crate::checkpoint::output::{write_file_atomic, OutputKind, Outputs};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::forward::backend::{Backend, HeadView};
use crate::forward::cache::KvCache;
use crate::forward::capture::{self, Capture, CaptureSet, Encoded, Kept, Prompt, Values};
use crate::forward::decoder::KeyEdit;
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
use crate::generate::teacher::{forced_logits, kl_per_position, mean, positions, Forced, Position};
use crate::report::json_text;
use crate::sink::visual;
use crate::sink::visual::edit::{EditKind, Editor};

use super::args::KeyEditArgs;
use super::edit_probe::probe;
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
--edit remove|align applies visual-sinks' key edit to the prompt's image keys (gated on the \
prompt as visual-sinks gates it; the cache carries the edited keys into every step); \
--teacher-force FILE scores a given continuation instead, with the per-position KL against the \
unedited pass when an edit is given (--plot draws it).\n\n\
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
    /// timings, the settings used and the stop reason (with --batch: one JSON array of them,
    /// printed once every line is answered)
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
    /// The visual-sinks key edit on the prompt's image keys (`--edit remove|align`, `--gate`,
    /// `--keys`, `--layers`, `--median-target`, `--controls`): gated on the prompt as
    /// visual-sinks gates it, applied in the prefill, carried by the cache into every step
    #[command(flatten)]
    pub key_edit: KeyEditArgs,

    /// Seed of the edit's control draws (and of align's token choice), as visual-sinks' --seed
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub edit_seed: u64,

    /// Score this continuation instead of generating: JSON `{"token_ids": [...]}`,
    /// `{"text": "..."}` (tokenized without special tokens) or an earlier `generate --json`
    /// (its `generated_ids`); per position the forced token's log-probability, rank, entropy
    /// and top 5, and with --edit the KL(unedited || edited) per position
    #[arg(long, value_name = "FILE", conflicts_with = "batch")]
    pub teacher_force: Option<PathBuf>,

    /// With --teacher-force and --edit: write the per-position KL curve (edit, and control with
    /// --controls) to this SVG file
    #[arg(long, value_name = "FILE.svg", requires = "teacher_force")]
    pub plot: Option<PathBuf>,
}

/// What `--teacher-force --json` prints.
#[derive(Serialize)]
struct ForcedReport<'r> {
    model: &'r str,
    device: ComputeDevice,
    precision: Precision,
    teacher_force: String,
    prompt_ids: Vec<u32>,
    token_ids: Vec<u32>,
    positions: Vec<Position>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mean_kl: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mean_kl_control: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    edit: Option<EditOut>,
}

/// The edit as `--json` reports it: its settings and what the gate chose on the prompt.
#[derive(Serialize, Clone)]
struct EditOut {
    edit: EditKind,
    gate: f64,
    keys: &'static str,
    median_target: bool,
    controls: bool,
    edit_seed: u64,
    layers: Vec<usize>,
    /// Per probed layer, the unedited prompt's text sink t*.
    text_sink_positions: BTreeMap<usize, usize>,
    /// Per probed layer, the prompt rows whose keys were edited (every KV head of each).
    edited_rows: BTreeMap<usize, Vec<usize>>,
    edited_kv_heads: Vec<usize>,
    /// The control's rows, with --controls.
    #[serde(skip_serializing_if = "Option::is_none")]
    control_edited_rows: Option<BTreeMap<usize, Vec<usize>>>,
}

/// The rows `editor` edited, per probed layer, over every image.
fn edited_rows(editor: &Editor) -> BTreeMap<usize, Vec<usize>> {
    let affected = editor.affected_now();
    editor
        .layers()
        .iter()
        .enumerate()
        .map(|(li, &(layer, _))| {
            let mut rows: Vec<usize> = affected.iter().flat_map(|a| a[li].clone()).collect();
            rows.sort_unstable();
            rows.dedup();
            (layer, rows)
        })
        .collect()
}

/// A generation with an edit's control (`--controls`), as `--json` reports it.
#[derive(Serialize)]
struct ControlOut {
    generated_ids: Vec<u32>,
    text: String,
    stop_reason: StopReason,
    steps: Vec<StepStats>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    edit: Option<EditOut>,
    #[serde(skip_serializing_if = "Option::is_none")]
    control: Option<ControlOut>,
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
    args.key_edit.check()?;
    let editing = args.key_edit.edit != EditKind::None;
    if editing && args.batch.is_some() {
        bail!("--edit runs on one prompt: it does not combine with --batch");
    }
    if args.plot.is_some() && !editing {
        bail!("--plot draws the edit's KL per position: it needs --edit");
    }
    let forced = args
        .teacher_force
        .as_deref()
        .map(Forced::read)
        .transpose()?;
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
    if args.output.is_some() || args.plot.is_some() {
        let mut inputs: Vec<&Path> = vec![ckpt.dir.as_path()];
        inputs.extend(args.image.iter().map(PathBuf::as_path));
        inputs.extend(args.pixel_values.as_deref());
        inputs.extend(args.prompt_ids.as_deref());
        inputs.extend(args.teacher_force.as_deref());
        Outputs::new(false)
            .output("-o", args.output.as_deref(), OutputKind::File)
            .output("--plot", args.plot.as_deref(), OutputKind::File)
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
        forced: forced.as_ref(),
        out,
        progress,
        answers: Vec::new(),
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
    forced: Option<&'j Forced>,
    out: &'j mut dyn Write,
    progress: bool,
    /// `--batch` with `--json`: each line's report, printed together as one JSON array.
    answers: Vec<serde_json::Value>,
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
        if self.args.batch.is_some() && self.args.json {
            write_flushed(self.out, &json_text(&self.answers)?)?;
        }
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
        let probe = match args.key_edit.edit {
            EditKind::None => None,
            _ => Some(probe(
                &args.key_edit,
                args.edit_seed,
                model,
                self.prompter,
                backend,
                encoded.as_ref(),
                pixels.as_ref(),
                &ids,
            )?),
        };
        let editor = probe.as_ref().map(|(vs, sinks, positions)| {
            visual::editor(vs, &model.spec, sinks.clone(), positions, false, None)
        });
        // The control edits the rows the edit gated: built once the edit's prefill ran.
        let control_of = |editor: &Editor| -> Option<Editor> {
            let (vs, sinks, positions) = probe.as_ref()?;
            args.key_edit.controls.then(|| {
                let gated = Some(editor.affected_now());
                visual::editor(vs, &model.spec, sinks.clone(), positions, true, gated)
            })
        };
        let edit_out = |editor: &Editor, control: Option<&Editor>| EditOut {
            edit: args.key_edit.edit,
            gate: args.key_edit.gate,
            keys: args.key_edit.keys.name(),
            median_target: args.key_edit.median_target,
            controls: args.key_edit.controls,
            edit_seed: args.edit_seed,
            layers: editor.layers().iter().map(|&(l, _)| l).collect(),
            text_sink_positions: editor.layers().iter().copied().collect(),
            edited_rows: edited_rows(editor),
            edited_kv_heads: (0..model.spec.num_kv_heads).collect(),
            control_edited_rows: control.map(edited_rows),
        };
        let edit_dyn = editor.as_ref().map(|e| e as &dyn KeyEdit);
        let encoded = encoded.as_ref();

        if let Some(forced) = self.forced {
            let path = args
                .teacher_force
                .as_deref()
                .unwrap_or(std::path::Path::new("-"));
            let tokens = forced.tokens(
                |text| self.prompter.encode_plain(text),
                model.spec.vocab_size,
                path,
            )?;
            let plain = forced_logits(model, backend, weights, &prompt, encoded, &tokens, None)?;
            let mut report = ForcedReport {
                model: &args.model,
                device: args.device,
                precision: args.precision,
                teacher_force: path.display().to_string(),
                prompt_ids: ids.clone(),
                token_ids: tokens.clone(),
                positions: Vec::new(),
                mean_kl: None,
                mean_kl_control: None,
                edit: None,
            };
            let (main, kl, kl_control) = match &editor {
                None => (plain.clone(), None, None),
                Some(editor) => {
                    let edited = forced_logits(
                        model, backend, weights, &prompt, encoded, &tokens, edit_dyn,
                    )?;
                    let control = control_of(editor);
                    let kl_control = match &control {
                        Some(c) => {
                            let rows = forced_logits(
                                model,
                                backend,
                                weights,
                                &prompt,
                                encoded,
                                &tokens,
                                Some(c),
                            )?;
                            Some(kl_per_position(&plain, &rows))
                        }
                        None => None,
                    };
                    report.edit = Some(edit_out(editor, control.as_ref()));
                    let kl = kl_per_position(&plain, &edited);
                    (edited, Some(kl), kl_control)
                }
            };
            report.mean_kl = kl.as_deref().map(mean);
            report.mean_kl_control = kl_control.as_deref().map(mean);
            report.positions =
                positions(&tokens, &main, &plain, kl.as_deref(), kl_control.as_deref());
            if let Some(svg_path) = &args.plot {
                let curve = |label: &str, k: &[f64]| crate::report::plot::Series {
                    label: label.to_string(),
                    points: k.iter().enumerate().map(|(i, &v)| (i as f64, v)).collect(),
                };
                let mut series = Vec::new();
                if let Some(k) = &kl {
                    series.push(curve("key edit", k));
                }
                if let Some(k) = &kl_control {
                    series.push(curve("control", k));
                }
                let chart = crate::report::plot::LineChart {
                    title: format!("KL(unedited || edited) per position, {}", args.model),
                    x_label: "position in the continuation".into(),
                    y_label: "KL (nats)".into(),
                    series,
                };
                let svg = chart.to_svg().map_err(|e| crate::internal!("{e}"))?;
                crate::checkpoint::output::write_file_atomic(svg_path, svg.as_bytes())?;
            }
            let text = if args.json {
                format!("{}\n", json_text(&report)?)
            } else {
                render_forced(&report)
            };
            return write_flushed(self.out, &text);
        }

        let mut seq = Sequence::new(model, backend, weights, capacity, edit_dyn)?;
        let mut recorder =
            (args.capture.as_ref()).map(|set| Recorder::new(&model.spec, set, self.capture_layers));
        let logits = match &mut recorder {
            None => seq.prefill(
                &prompt,
                encoded,
                &|_, _: &HeadView| (),
                &mut (),
                Logits::Last,
            )?,
            Some(rec) => {
                let visit = rec.visitor();
                seq.prefill(&prompt, encoded, &visit, rec, Logits::Last)?
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
            let positions = capture::positions(&prompt, encoded)?;
            let kept = capture_tensors(rec, &prompt, encoded, positions, seq.ids())?;
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
        drop(seq);
        let text = prompter.decode(&generated.ids)?;
        let decode_tokens = generated.ids.len().saturating_sub(1);
        let mut control_out = None;
        let mut edit_report = None;
        if let Some(editor) = &editor {
            let control = control_of(editor);
            if let Some(c) = &control {
                let (mut seq, logits) = Sequence::prefilled(
                    model,
                    backend,
                    weights,
                    &prompt,
                    encoded,
                    capacity,
                    Some(c),
                )?;
                let mut sampler = Sampler::new(&settings, seed);
                let g = decode(
                    &mut seq,
                    logits,
                    &mut sampler,
                    &stops,
                    &|ids: &[u32]| prompter.decode(ids),
                    &mut |_: &str| Ok(()),
                )?;
                control_out = Some(ControlOut {
                    text: prompter.decode(&g.ids)?,
                    generated_ids: g.ids,
                    stop_reason: g.stop_reason,
                    steps: g.steps,
                });
            }
            edit_report = Some(edit_out(editor, control.as_ref()));
        }
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
            edit: edit_report,
            control: control_out,
        };
        if stream {
            write_flushed(out, "\n")
        } else if let (Some(_), true) = (&args.batch, args.json) {
            let value = serde_json::to_value(&report)
                .map_err(|e| crate::internal!("cannot serialise the report: {e}"))?;
            self.answers.push(value);
            Ok(())
        } else if args.batch.is_some() {
            let line = serde_json::to_string(&report)
                .map_err(|e| crate::internal!("cannot serialise the report: {e}"))?;
            write_flushed(out, &format!("{line}\n"))
        } else {
            write_flushed(out, &format!("{}\n", json_text(&report)?))
        }
    }
}

/// The `--teacher-force` text report: a row per position.
fn render_forced(r: &ForcedReport) -> String {
    use crate::report::{fmt_num, fmt_opt, Table};
    let mut t = Table::new([
        "position",
        "token",
        "logprob",
        "rank",
        "entropy",
        "kl",
        "kl control",
    ]);
    for (i, p) in r.positions.iter().enumerate() {
        t.row([
            i.to_string(),
            p.stats.token_id.to_string(),
            fmt_num(p.stats.logprob as f64),
            p.rank.to_string(),
            fmt_num(p.stats.entropy as f64),
            fmt_opt(p.kl),
            fmt_opt(p.kl_control),
        ]);
    }
    let mut out = t.render();
    if let Some(k) = r.mean_kl {
        out.push_str(&format!("mean KL(unedited || edited): {}\n", fmt_num(k)));
    }
    if let Some(k) = r.mean_kl_control {
        out.push_str(&format!("mean KL(unedited || control): {}\n", fmt_num(k)));
    }
    out
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
