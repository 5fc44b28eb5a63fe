//! `sinkmerge visual-sinks`: visual attention sinks of a VLM on images, the centred-key gate
//! that finds them and the key edit that moves their attention back to the text sink
//! (`docs/commands/visual-sinks.md`, `docs/reference/visual-sinks.md`).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::checkpoint::output::{write_file_atomic, OutputDir, OutputKind, Outputs};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::backend::Backend;
use crate::forward::cache::KvCache;
use crate::forward::capture;
use crate::forward::decoder::KeyEdit;
use crate::forward::device::{BackendJob, ComputeDevice};
use crate::forward::model::DecoderSpec;
use crate::forward::precision::Precision;
use crate::forward::resident::Resident;
use crate::forward::vlm::IMAGE_MARKER;
use crate::forward::weights::Model;
use crate::generate::answer;
use crate::generate::config::{GenerationConfig, Overrides, Settings as GenerationSettings};
use crate::generate::decode::{decode, Stops};
use crate::generate::sampling::Sampler;
use crate::generate::sequence::Sequence;
use crate::generate::teacher::{forced_logits, kl_per_position, mean};
use crate::image::{Grid, Processor};
use crate::report::json_text;
use crate::sink::visual::aggregate::{aggregate, Aggregate};
use crate::sink::visual::depth;
use crate::sink::visual::edit::EditKind;
use crate::sink::visual::geometry::{token_regions, TokenLayout, TokenRegion};
use crate::sink::visual::stats::Top1Rates;
use crate::sink::visual::{self, ImageReport, ImageTokens, Measured, Measurement, Settings};
use crate::{bad, bail};

use super::args::KeyEditArgs;
use super::edit_probe::{image_blocks, probe};
use super::image_prompt::{read_pixel_file, PixelData, Prompter};
use super::manifest::{self, Entry as Item};
use crate::input;

/// `sinkmerge visual-sinks --help`.
pub const LONG_ABOUT: &str = "Measure the visual attention sinks of a VLM on images: the few \
image tokens that take most of the attention a question gives the image, whose keys point the \
way of the text sink's key (\"Attention Sinks in VLMs Are Borrowed, Not Seen\", Zhang et al. \
2026). One forward pass per prompt through the model's own vision tower, on the CPU or the GPU.\n\n\
Per probed layer: the text sink t* and its share of the question's attention, the image's share, \
each image token's ratio to the uniform share (×uniform), the sinks (ratio ≥ --ratio, outside \
the target box), their share, and whether the most attended token is in the box. At the peak \
layer: the token features of the paper's Table 6 (centred and raw key cosine with the text sink, \
key, value and hidden norms, logit spread) scored by AUC, precision@k and top-1 against the \
sinks, and the centred-cosine gate's precision and recall with a threshold sweep. --edit remove \
projects the text-sink direction out of the gated tokens' keys inside the forward pass, --edit \
align gives eight random image tokens the text sink's key; --controls adds the random-direction \
or random-key control. Definitions: docs/reference/visual-sinks.md.";

/// `sinkmerge visual-sinks --help`: examples.
pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge visual-sinks Qwen/Qwen3-VL-2B-Instruct --image cat.png --question 'Where is the cat?'\n  \
sinkmerge visual-sinks VLM --image cat.png --question 'Where is the cat?' --box 40,30,200,180 --edit remove --controls --plot figs/\n  \
sinkmerge visual-sinks VLM --manifest probes.jsonl --ratio 50 --layers 8: --json > sinks.json\n  \
sinkmerge visual-sinks VLM --prompt '<image>Describe it.' --pixel-values inputs.safetensors --image cat.png --csv tokens.csv";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The VLM: a directory, HF repo id (`ORG/NAME[@rev]`) or alias
    #[arg(value_name = "VLM")]
    pub model: String,

    /// The image (PNG, JPEG or WebP); with --prompt, once per `<image>` marker
    #[arg(long, value_name = "FILE")]
    pub image: Vec<PathBuf>,

    /// The question, rendered with the model's chat template after the image
    #[arg(long, value_name = "TEXT", conflicts_with_all = ["prompt", "manifest"])]
    pub question: Option<String>,

    /// A raw prompt with an `<image>` marker per image, as `trace` takes it
    #[arg(long, value_name = "TEXT", conflicts_with = "manifest")]
    pub prompt: Option<String>,

    /// One JSON object a line: `image`, `question` or `prompt`, optional `box` and
    /// `pixel_values` (paths relative to the manifest); `-` reads standard input
    #[arg(long, value_name = "FILE.jsonl", conflicts_with_all = ["image", "pixel_values", "target_box"])]
    pub manifest: Option<PathBuf>,

    /// The target box `x0,y0,x1,y1` in the image's pixels (one image); sinks lie outside it
    #[arg(long = "box", value_name = "X0,Y0,X1,Y1", value_parser = parse_box,
          allow_hyphen_values = true)]
    pub target_box: Option<[f64; 4]>,

    /// Take the processor's output from this safetensors file (`pixel_values` with
    /// `image_grid_thw` or `num_patches`); --image then only gives the geometry
    #[arg(long, value_name = "FILE")]
    pub pixel_values: Option<PathBuf>,

    /// A visual sink takes at least this many times the uniform share of the image's attention
    #[arg(long, value_name = "X", default_value_t = 100.0, value_parser = parse_ratio, allow_hyphen_values = true)]
    pub ratio: f64,

    #[command(flatten)]
    pub key_edit: KeyEditArgs,

    /// With an edit: also generate each question's answer (greedy, the model's generation
    /// config) without and with the edit, and report their accuracy, agreement and the KL along
    /// the unedited answer (the paper's Table 2 at answer level)
    #[arg(long)]
    pub answers: bool,

    /// The expected answer of --question: free text, or one of --options (its text or letter)
    #[arg(long, value_name = "TEXT", requires = "question")]
    pub answer: Option<String>,

    /// The options of a multiple-choice --question, shown lettered below it
    /// (docs/reference/answers.md)
    #[arg(long, value_name = "TEXT", num_args = 2.., requires = "question")]
    pub options: Vec<String>,

    /// New tokens of each answer with --answers (lmms-eval's V* Bench setting)
    #[arg(long, value_name = "N", default_value_t = 16, requires = "answers",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_new_tokens: u64,

    /// Seed of the controls and of align's token choice
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,

    /// Arithmetic of the forward pass: f32, or transformers' bf16 path
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,

    /// Where to compute: cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: ComputeDevice,

    /// Print everything as JSON on stdout instead of the tables
    #[arg(long)]
    pub json: bool,

    /// Write a CSV row per image token per probed layer
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,

    /// Write the figures (per image: Figure 2, Figure 5, the ratio heatmap before and after the
    /// edit) into this directory
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,

    /// Replace a --plot directory of earlier figures (one that holds only SVG, HTML, PNG, JSON and
    /// CSV files; any other folder, the working folder and $HOME are refused)
    #[arg(long)]
    pub force: bool,
}

impl Args {
    /// What to measure, with `--layers` resolved for a model of `num_layers`.
    fn settings(&self, num_layers: usize) -> Result<Settings> {
        self.key_edit.settings(self.ratio, self.seed, num_layers)
    }
}

fn parse_box(s: &str) -> std::result::Result<[f64; 4], String> {
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>().map_err(|e| format!("`{x}`: {e}")))
        .collect::<std::result::Result<_, _>>()?;
    <[f64; 4]>::try_from(v).map_err(|_| "expected four numbers x0,y0,x1,y1".to_string())
}

fn parse_ratio(s: &str) -> std::result::Result<f64, String> {
    let r: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if !(r.is_finite() && r > 0.0) {
        return Err(format!("{s} is not a positive number"));
    }
    Ok(r)
}

/// The items of the command line or the manifest, checked without the model: images exist,
/// markers match, boxes lie in their image.
fn items(args: &Args) -> Result<Vec<Item>> {
    let items = match (&args.manifest, &args.question, &args.prompt) {
        (Some(m), _, _) => manifest::read(m)?,
        (None, Some(q), None) => vec![Item {
            origin: "--question".into(),
            images: args.image.clone(),
            text: q.clone(),
            chat: true,
            target_box: args.target_box,
            pixel_values: args.pixel_values.clone(),
            answer: args.answer.clone(),
            options: args.options.clone(),
        }],
        (None, None, Some(p)) => vec![Item {
            origin: "--prompt".into(),
            images: args.image.clone(),
            text: p.clone(),
            chat: false,
            target_box: args.target_box,
            pixel_values: args.pixel_values.clone(),
            answer: None,
            options: Vec::new(),
        }],
        _ => bail!("give --question, --prompt or --manifest"),
    };
    for item in &items {
        let o = &item.origin;
        if item.images.is_empty() {
            bail!("{o}: no image was given (--image FILE)");
        }
        for image in &item.images {
            input::check(image, input::IMAGE).map_err(|e| e.context(o))?;
        }
        if let Some(p) = &item.pixel_values {
            input::check(p, input::PIXEL_VALUES).map_err(|e| e.context(o))?;
        }
        if item.chat {
            if item.images.len() != 1 {
                bail!(
                    "{o}: a question takes one image, {} were given",
                    item.images.len()
                );
            }
        } else {
            let markers = item.text.matches(IMAGE_MARKER).count();
            if markers != item.images.len() {
                bail!(
                    "{o}: the prompt has {markers} `{IMAGE_MARKER}` marker(s) but {} image(s) \
                     were given",
                    item.images.len()
                );
            }
        }
        if !item.options.is_empty() {
            if !item.chat {
                bail!("{o}: options belong to a `question`, not a raw `prompt`");
            }
            answer::check_options(&item.options, o)?;
        }
        if let Some(a) = &item.answer {
            answer::expected(a, &item.options, o)?;
        }
        if let Some(b) = item.target_box {
            if item.images.len() != 1 {
                bail!("{o}: a box needs exactly one image");
            }
            let (w, h) = image_size(&item.images[0])?;
            let inside = b.iter().all(|v| v.is_finite())
                && 0.0 <= b[0]
                && b[0] < b[2]
                && b[2] <= w as f64
                && 0.0 <= b[1]
                && b[1] < b[3]
                && b[3] <= h as f64;
            if !inside {
                bail!(
                    "{o}: the box {b:?} is not inside the {w}x{h} image {} (0 ≤ x0 < x1 ≤ \
                     width, 0 ≤ y0 < y1 ≤ height)",
                    item.images[0].display()
                );
            }
        }
    }
    Ok(items)
}

/// The image's size as transformers' `load_image` sees it (after the EXIF transpose).
fn image_size(path: &Path) -> Result<(u32, u32)> {
    Ok(crate::image::decode::load_rgb(path, true)?.dimensions())
}

/// One item ready to run: its token ids, image token positions and geometry. Its pixels are
/// held apart, by its own pass only, so that a manifest holds one line's pixels at a time.
struct Prepared {
    item: Item,
    ids: Vec<u32>,
    question: std::ops::Range<usize>,
    images: Vec<ImageTokens>,
    regions: Vec<Vec<TokenRegion>>,
}

/// Read `item`'s pixels, tokenize it, find its image blocks and question rows, and place its
/// tokens.
fn prepare(
    item: Item,
    prompter: &Prompter,
    processor: &Processor,
    merge: usize,
) -> Result<(Prepared, PixelData)> {
    let o = item.origin.clone();
    let file = item
        .pixel_values
        .as_deref()
        .map(|path| read_pixel_file(path).map(|p| (path, p)))
        .transpose()?;
    let pixels = prompter.pixels(&item.images, file)?;
    if pixels.images() != item.images.len() {
        bail!(
            "{o}: the pixel values hold {} image(s) but {} image file(s) were given",
            pixels.images(),
            item.images.len()
        );
    }
    let counts = prompter.image_tokens(&pixels)?;
    let text = if item.chat {
        format!(
            "{IMAGE_MARKER}{}",
            answer::question_text(&item.text, &item.options)
        )
    } else {
        item.text.clone()
    };
    let ids = prompter.token_ids(&text, item.chat, &counts)?;
    let (blocks, question) = image_blocks(prompter, &ids, &counts, &o)?;
    let mut images = Vec::new();
    let mut regions = Vec::new();
    for (i, (&n, positions)) in counts.iter().zip(blocks).enumerate() {
        let (w, h) = image_size(&item.images[i])?;
        let layout = match (&pixels.grid, processor) {
            (Grid::Thw(g), _) => TokenLayout::Patches { grid: g[i], merge },
            (Grid::NumPatches(tiles), Processor::GotOcr2(p)) => {
                let (columns, rows) = p.tile_grid(w as usize, h as usize);
                let side = ((n / tiles[i]) as f64).sqrt().round() as usize;
                TokenLayout::Tiles {
                    columns,
                    rows,
                    tiles: tiles[i],
                    side,
                }
            }
            (Grid::NumPatches(_), _) => bail!("{o}: tiles need InternVL's processor"),
        };
        let r = token_regions(layout, w as usize, h as usize, n)
            .map_err(|e| bad!("{o}: {}: {e}", item.images[i].display()))?;
        let inside_box = item
            .target_box
            .map(|b| r.iter().map(|t| t.centre_in(&b)).collect());
        images.push(ImageTokens {
            positions,
            inside_box,
        });
        regions.push(r);
    }
    Ok((
        Prepared {
            item,
            ids,
            question,
            images,
            regions,
        },
        pixels,
    ))
}

/// The job `--device` runs: every prompt in turn, each prepared (its pixels read) just before
/// its passes.
struct Job<'a> {
    model: &'a Model<'a>,
    prompter: &'a Prompter,
    processor: &'a Processor,
    merge: usize,
    items: Vec<Item>,
    settings: &'a Settings,
    answers: Option<AnswerSettings<'a>>,
    progress: bool,
}

/// What `--answers` runs with besides the measurement's settings.
struct AnswerSettings<'a> {
    key_edit: &'a KeyEditArgs,
    seed: u64,
    /// Greedy, the model's generation config otherwise (`docs/commands/generate.md`).
    generation: GenerationSettings,
}

/// One generated answer.
#[derive(Serialize)]
struct AnswerRun {
    text: String,
    generated_ids: Vec<u32>,
    /// The answer read from the text (`docs/reference/answers.md`): an option's letter, or the
    /// normalised text; null when nothing is read.
    answer: Option<String>,
    /// Whether it is the expected answer; null without one.
    correct: Option<bool>,
}

/// `--answers`: one prompt's answer without and with the edit.
#[derive(Serialize)]
struct Answers {
    /// The expected answer, normalised as the read answers are.
    expected: Option<String>,
    before: AnswerRun,
    after: AnswerRun,
    /// Whether the two read answers are the same (when neither is read: the same text).
    agree: bool,
    /// `KL(p_unedited ‖ p_edited)` in nats before each token of the unedited answer, that
    /// answer forced under the edit.
    kl: Vec<f64>,
    mean_kl: f64,
}

/// `--answers` over every prompt that has them.
#[derive(Serialize)]
struct AnswersAggregate {
    prompts: usize,
    /// Prompts with an expected answer: the accuracies' denominator.
    with_answer: usize,
    accuracy_before: Option<f64>,
    accuracy_after: Option<f64>,
    agreement: f64,
    mean_kl: f64,
}

impl AnswersAggregate {
    fn of(all: &[&Answers]) -> Option<AnswersAggregate> {
        if all.is_empty() {
            return None;
        }
        let n = all.len() as f64;
        let scored: Vec<&&Answers> = all.iter().filter(|a| a.expected.is_some()).collect();
        let accuracy = |run: fn(&Answers) -> &AnswerRun| {
            (!scored.is_empty()).then(|| {
                let right = scored
                    .iter()
                    .filter(|a| run(a).correct == Some(true))
                    .count();
                right as f64 / scored.len() as f64
            })
        };
        Some(AnswersAggregate {
            prompts: all.len(),
            with_answer: scored.len(),
            accuracy_before: accuracy(|a| &a.before),
            accuracy_after: accuracy(|a| &a.after),
            agreement: all.iter().filter(|a| a.agree).count() as f64 / n,
            mean_kl: all.iter().map(|a| a.mean_kl).sum::<f64>() / n,
        })
    }
}

/// `p`'s answer generated greedily without and with `a`'s edit, and the KL along the unedited
/// answer. The edit's text sinks come from one unedited pass, as `generate --edit` finds them.
#[allow(clippy::too_many_arguments)]
fn answers<'a, B: Backend>(
    backend: &B,
    model: &Model<'a>,
    weights: &Resident<'a, B>,
    prompter: &Prompter,
    p: &Prepared,
    pixels: &PixelData,
    a: &AnswerSettings,
) -> Result<Answers> {
    let prompt = prompter.prompt(p.ids.clone(), Some(pixels))?;
    let encoded = capture::encode(backend, model, &prompt)?;
    let encoded = encoded.as_ref();
    let (vs, sinks, positions) = probe(
        a.key_edit,
        a.seed,
        model,
        prompter,
        backend,
        encoded,
        Some(pixels),
        &p.ids,
    )?;
    let editor = visual::editor(&vs, &model.spec, sinks, &positions, false, None);
    let max_position = model.spec.max_position_embeddings;
    let max_new = (a.generation).max_new_tokens(p.ids.len(), Some(max_position))?;
    let capacity = p.ids.len() + max_new;
    crate::forward::memory::check(
        KvCache::<B::Tensor>::bytes(&model.spec, capacity),
        &format!("{}: a KV cache of {capacity} tokens", p.item.origin),
        "ask for fewer --max-new-tokens",
    )?;
    let eos = a.generation.eos_token_id.value.clone();
    let stops = Stops {
        eos: &eos,
        strings: &[],
        max_new_tokens: max_new,
    };
    let generate = |edit: Option<&dyn KeyEdit>| -> Result<Vec<u32>> {
        let (mut seq, logits) =
            Sequence::prefilled(model, backend, weights, &prompt, encoded, capacity, edit)?;
        let mut sampler = Sampler::new(&a.generation, 0);
        let text = |ids: &[u32]| prompter.decode(ids);
        let generated = decode(&mut seq, logits, &mut sampler, &stops, &text, &mut |_| {
            Ok(())
        })?;
        Ok(generated.ids)
    };
    let before_ids = generate(None)?;
    let after_ids = generate(Some(&editor))?;
    let plain = forced_logits(model, backend, weights, &prompt, encoded, &before_ids, None)?;
    let edited = forced_logits(
        model,
        backend,
        weights,
        &prompt,
        encoded,
        &before_ids,
        Some(&editor),
    )?;
    let kl = kl_per_position(&plain, &edited);
    let item = &p.item;
    let expected = (item.answer.as_deref())
        .map(|x| answer::expected(x, &item.options, &item.origin))
        .transpose()?;
    let run_of = |ids: Vec<u32>| -> Result<AnswerRun> {
        let text = prompter.decode(&ids)?;
        let read = answer::read(&text, &item.options);
        Ok(AnswerRun {
            correct: expected.as_ref().map(|e| read.as_ref() == Some(e)),
            answer: read,
            text,
            generated_ids: ids,
        })
    };
    let (before, after) = (run_of(before_ids)?, run_of(after_ids)?);
    let agree =
        before.answer == after.answer && (before.answer.is_some() || before.text == after.text);
    Ok(Answers {
        expected,
        mean_kl: mean(&kl),
        kl,
        before,
        after,
        agree,
    })
}

/// One prompt's results: its preparation, measurement and, with `--answers`, its answers.
type PromptResult = (Prepared, Measurement, Option<Answers>);

impl BackendJob for Job<'_> {
    type Output = Vec<PromptResult>;

    fn run<B: Backend>(self, backend: &B) -> Result<Vec<PromptResult>> {
        let passes = 1 + match (self.settings.edit, self.settings.controls) {
            (EditKind::None, _) => 0,
            (_, false) => 1,
            (_, true) => 2,
        };
        let steps = self.items.len() * (passes * (self.model.spec.num_layers() + 1) + 1);
        let bar = crate::progress::items(steps as u64, "visual-sinks", self.progress);
        // Held for every answer's decode steps; mapped, not copied, on the CPU.
        let weights = match self.answers {
            Some(_) => Some(Resident::load(backend, self.model)?),
            None => None,
        };
        let mut out = Vec::new();
        for item in self.items {
            let (p, pixels) = prepare(item, self.prompter, self.processor, self.merge)?;
            check_memory(&self.model.spec, &p)?;
            let measured = Measured {
                prompt: self.prompter.prompt(p.ids.clone(), Some(&pixels))?,
                question: p.question.clone(),
                images: p.images.clone(),
            };
            let m = visual::measure(backend, self.model, &measured, self.settings, |stage| {
                bar.set_message(stage.to_string());
                bar.inc(1);
            })?;
            let answered = match (&self.answers, &weights) {
                (Some(a), Some(w)) => Some(answers(
                    backend,
                    self.model,
                    w,
                    self.prompter,
                    &p,
                    &pixels,
                    a,
                )?),
                _ => None,
            };
            out.push((p, m, answered));
        }
        bar.finish_and_clear();
        Ok(out)
    }
}

/// Refuse `p` when its passes need more memory than is free: one layer's attention in flight
/// and the question's rows of every head's scores and probabilities.
fn check_memory(spec: &DecoderSpec, p: &Prepared) -> Result<()> {
    let seq = p.ids.len();
    let rows = 2.0 * spec.num_heads as f64 * 4.0 * (p.question.len() * seq) as f64;
    crate::forward::memory::check(
        crate::forward::memory::attention_scratch(spec, seq) + rows,
        &format!("{}: a forward pass over {seq} tokens", p.item.origin),
        "use a shorter prompt or smaller images",
    )
}

/// One image in the JSON report.
#[derive(Serialize)]
struct ImageOut<'r> {
    prompt: usize,
    image_index: usize,
    image: String,
    #[serde(rename = "box")]
    target_box: Option<[f64; 4]>,
    #[serde(flatten)]
    report: &'r ImageReport,
    /// With `--answers`: its prompt's (every image of a prompt carries the same).
    #[serde(skip_serializing_if = "Option::is_none")]
    answers: Option<&'r Answers>,
}

#[derive(Serialize)]
struct Report<'r> {
    model: String,
    device: ComputeDevice,
    precision: Precision,
    ratio: f64,
    gate: f64,
    keys: &'static str,
    edit: EditKind,
    median_target: bool,
    controls: bool,
    seed: u64,
    layers: &'r [usize],
    images: Vec<ImageOut<'r>>,
    aggregate: Aggregate,
    /// With `--answers`: over the prompts.
    #[serde(skip_serializing_if = "Option::is_none")]
    answers: Option<AnswersAggregate>,
    /// The language model's depth, for the layer rules of the text and the figures.
    #[serde(skip)]
    num_layers: usize,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    // Everything checkable before the model is opened.
    args.key_edit.check()?;
    if args.answers && args.key_edit.edit == EditKind::None {
        bail!("--answers compares the answers without and with an edit: give --edit remove or --edit align");
    }
    let outputs = Outputs::new(args.force)
        .output("--csv", args.csv.as_deref(), OutputKind::File)
        .output("--plot", args.plot.as_deref(), OutputKind::Figures);
    outputs.check_before_inputs()?;
    let items = items(&args)?;
    let ckpt = Checkpoint::open_ref(&args.model)?;
    let mut input_paths: Vec<PathBuf> = vec![ckpt.dir.clone()];
    input_paths.extend(items.iter().flat_map(|i| i.images.iter().cloned()));
    input_paths.extend(items.iter().filter_map(|i| i.pixel_values.clone()));
    input_paths.extend(args.manifest.clone());
    let inputs: Vec<&Path> = input_paths.iter().map(PathBuf::as_path).collect();
    outputs.inputs("input", inputs.iter().copied()).check()?;
    let model = Model::new(&ckpt)?;
    let prompter = Prompter::new(&ckpt, &model, items.iter().any(|i| i.chat))?;
    prompter.require_tower()?;
    let processor = Processor::from_dir(&ckpt.dir)?;
    let merge = ckpt
        .config
        .pointer("/vision_config/spatial_merge_size")
        .and_then(|v| v.as_u64())
        .unwrap_or(2) as usize;
    let settings = args.settings(model.spec.num_layers())?;
    let answer_settings = if args.answers {
        let greedy = Overrides {
            do_sample: Some(false),
            max_new_tokens: Some(args.max_new_tokens as usize),
            ..Overrides::default()
        };
        Some(AnswerSettings {
            key_edit: &args.key_edit,
            seed: args.seed,
            generation: GenerationConfig::read(&ckpt.dir)?
                .with(&greedy)?
                .with_model_eos(&ckpt.config),
        })
    } else {
        None
    };
    let job = Job {
        model: &model,
        prompter: &prompter,
        processor: &processor,
        merge,
        items,
        settings: &settings,
        answers: answer_settings,
        progress,
    };
    let (measured, _gpu) = args.device.run(args.precision, job)?;
    let mut prepared = Vec::new();
    let mut measurements = Vec::new();
    let mut answered = Vec::new();
    for (p, m, a) in measured {
        prepared.push(p);
        measurements.push(m);
        answered.push(a);
    }

    let mut images = Vec::new();
    for (pi, (p, m)) in prepared.iter().zip(&measurements).enumerate() {
        for (ii, report) in m.images.iter().enumerate() {
            images.push(ImageOut {
                prompt: pi,
                image_index: ii,
                image: p.item.images[ii].display().to_string(),
                target_box: p.item.target_box,
                report,
                answers: answered[pi].as_ref(),
            });
        }
    }
    let all: Vec<&ImageReport> = images.iter().map(|i| i.report).collect();
    let report = Report {
        model: args.model.clone(),
        device: args.device,
        precision: args.precision,
        ratio: args.ratio,
        gate: args.key_edit.gate,
        keys: args.key_edit.keys.name(),
        edit: args.key_edit.edit,
        median_target: args.key_edit.median_target,
        controls: args.key_edit.controls,
        seed: args.seed,
        layers: &settings.layers,
        images,
        aggregate: aggregate(&all, model.spec.num_layers()),
        answers: AnswersAggregate::of(&answered.iter().flatten().collect::<Vec<_>>()),
        num_layers: model.spec.num_layers(),
    };

    // Outputs: each complete or absent.
    if let Some(csv) = &args.csv {
        write_file_atomic(csv, render_csv(&report).as_bytes())?;
    }
    if let Some(dir) = &args.plot {
        let figures_dir = OutputDir::create(dir, OutputKind::Figures, &inputs, args.force)?;
        for (name, svg) in figures(&report, &prepared)? {
            figures_dir.write_file(&name, svg.as_bytes())?;
        }
        figures_dir.commit()?;
    }
    if args.json {
        super::emit(out, &format!("{}\n", json_text(&report)?))?;
    } else {
        super::emit(out, &render_text(&report))?;
    }
    Ok(())
}

fn fmt(x: f64) -> String {
    crate::report::fmt_num(x)
}

fn fmt_opt(x: Option<f64>) -> String {
    x.map_or("-".into(), fmt)
}

fn fmt_bool(b: Option<bool>) -> String {
    b.map_or("-".into(), |b| b.to_string())
}

/// Table 10's columns on one line.
fn table10(rates: &Top1Rates, in_box_share_100: Option<f64>) -> String {
    format!(
        "raw {}, masked ≥100× {}, masked ≥10× {}, edited {}; share of the ≥100× tokens in the box {}",
        fmt_opt(rates.top1_in_box),
        fmt_opt(rates.top1_in_box_masked_100),
        fmt_opt(rates.top1_in_box_masked_10),
        fmt_opt(rates.top1_in_box_edited),
        fmt_opt(in_box_share_100)
    )
}

/// The text report: a table per image over the probed layers, and a summary at its peak.
fn render_text(r: &Report) -> String {
    use crate::report::Table;
    let mut out = String::new();
    for image in &r.images {
        let rep = image.report;
        out.push_str(&format!(
            "prompt {} image {} ({}): {} image tokens, question rows {}..{}\n",
            image.prompt,
            image.image_index,
            image.image,
            rep.image_tokens,
            rep.question_rows[0],
            rep.question_rows[1]
        ));
        // With a box, the top-1 of the masked and edited maps too (Table 10).
        let boxed = image.target_box.is_some();
        let mut header = vec![
            "layer",
            "t*",
            "t* share",
            "in-image",
            "max r",
            "sinks",
            "mean r",
            "sink share",
            "top1 in box",
        ];
        if boxed {
            header.extend(["masked ≥100×", "masked ≥10×", "edited"]);
        }
        let mut t = Table::new(header);
        for (l, s) in &rep.layers {
            let mut row = vec![
                l.to_string(),
                s.text_sink_position.to_string(),
                fmt(s.text_sink_share),
                fmt(s.in_image_share),
                fmt(s.max_ratio),
                s.sink_count.to_string(),
                fmt_opt(s.sink_mean_ratio),
                fmt(s.sink_share),
                fmt_bool(s.top1_in_box),
            ];
            if boxed {
                row.extend(
                    [
                        s.top1_in_box_masked_100,
                        s.top1_in_box_masked_10,
                        s.top1_in_box_edited,
                    ]
                    .map(fmt_bool),
                );
            }
            t.row(row);
        }
        out.push_str(&t.render());
        if boxed {
            out.push_str(&format!(
                "top-1 in the box over the upper half (layers ≥ {}): {}\n",
                depth::upper_half_start(r.num_layers),
                table10(&rep.upper_half, rep.in_box_share_100)
            ));
        }
        match rep.peak_layer {
            None => out.push_str(&format!(
                "no layer past the first quarter has a token at {}× uniform or more\n\n",
                fmt(r.ratio)
            )),
            Some(peak) => {
                let s = &rep.layers[&peak];
                out.push_str(&format!(
                    "peak layer {peak}: {} sinks take {} of the image's attention; text sink at \
                     {} takes {}\n",
                    s.sink_count,
                    fmt(s.sink_share),
                    s.text_sink_position,
                    fmt(s.text_sink_share)
                ));
                let mut f = Table::new(["feature", "AUC", "precision@k", "top-1"]);
                for (name, score) in rep.features.iter().flatten() {
                    f.row([
                        name.clone(),
                        fmt_opt(score.auc),
                        fmt_opt(score.precision_at_k),
                        score.top1.map_or("-".into(), |b| b.to_string()),
                    ]);
                }
                out.push_str(&f.render());
                if let Some(g) = &rep.gate {
                    out.push_str(&format!(
                        "gate centred cos ≥ {}: precision {}, recall {}\n",
                        fmt(g.threshold),
                        fmt_opt(g.precision),
                        fmt_opt(g.recall)
                    ));
                }
                for e in [&rep.edit, &rep.control].into_iter().flatten() {
                    if let Some(row) = e.layers.get(&peak) {
                        out.push_str(&format!(
                            "{}{}: {} tokens edited at the peak; their share {} -> {}, max r {} \
                             -> {}, text sink {} -> {}; next token agrees: {}, KL {}\n",
                            serde_json::to_value(e.kind)
                                .ok()
                                .and_then(|v| v.as_str().map(String::from))
                                .unwrap_or_default(),
                            if e.control { " (control)" } else { "" },
                            row.affected.len(),
                            fmt(row.affected_share_before),
                            fmt(row.affected_share_after),
                            fmt(row.max_ratio_before),
                            fmt(row.max_ratio_after),
                            fmt(row.text_sink_share_before),
                            fmt(row.text_sink_share_after),
                            e.next_token.top1_agree,
                            fmt(e.next_token.kl)
                        ));
                    }
                }
            }
        }
        out.push('\n');
    }
    let mut shown = std::collections::BTreeSet::new();
    for image in &r.images {
        let Some(a) = image.answers.filter(|_| shown.insert(image.prompt)) else {
            continue;
        };
        let run = |x: &AnswerRun| {
            let verdict = match x.correct {
                Some(true) => " (correct)",
                Some(false) => " (wrong)",
                None => "",
            };
            format!("{}{verdict}", x.answer.as_deref().unwrap_or("unread"))
        };
        out.push_str(&format!(
            "prompt {} answers: unedited {}, edited {}, {}, mean KL {}\n",
            image.prompt,
            run(&a.before),
            run(&a.after),
            if a.agree { "agree" } else { "differ" },
            fmt(a.mean_kl)
        ));
    }
    if let Some(a) = &r.answers {
        out.push_str(&format!(
            "answers over {} prompts ({} with an expected answer): accuracy {} -> {}, agreement {}, mean KL {}\n",
            a.prompts,
            a.with_answer,
            fmt_opt(a.accuracy_before),
            fmt_opt(a.accuracy_after),
            fmt(a.agreement),
            fmt(a.mean_kl)
        ));
    }
    if r.images.len() > 1 {
        let a = &r.aggregate;
        out.push_str(&format!("over {} images:\n", a.images));
        let mut t = Table::new([
            "value at each image's peak",
            "mean",
            "median",
            "std",
            "min",
            "max",
            "n",
        ]);
        for (name, s) in &a.at_peak {
            t.row([
                name.clone(),
                fmt(s.mean),
                fmt(s.median),
                fmt(s.std),
                fmt(s.min),
                fmt(s.max),
                s.n.to_string(),
            ]);
        }
        out.push_str(&t.render());
        let boxed = r.images.iter().filter(|i| i.target_box.is_some()).count();
        if boxed > 0 {
            let t10 = &a.top1_in_box;
            out.push_str(&format!(
                "Table 10 over the {boxed} images with a box (layers ≥ {}): {}\n",
                depth::upper_half_start(r.num_layers),
                table10(&t10.upper_half, t10.in_box_share_100)
            ));
        }
    }
    out
}

/// One CSV row per image token per probed layer.
fn render_csv(r: &Report) -> String {
    let mut out = String::from(
        "prompt,image,layer,position,inside_box,attention,ratio,centered_cos,raw_cos,key_norm,\
         value_norm,hidden_norm,logit_std,sink,gated,attention_edited\n",
    );
    let opt = |x: Option<f64>| x.map_or(String::new(), |v| v.to_string());
    for image in &r.images {
        for (l, tokens) in &image.report.tokens {
            for t in tokens {
                out.push_str(&format!(
                    "{},{},{l},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                    image.prompt,
                    image.image_index,
                    t.position,
                    t.inside_box.map_or(String::new(), |b| b.to_string()),
                    t.attention,
                    t.ratio,
                    t.centered_cos,
                    t.raw_cos,
                    t.key_norm,
                    t.value_norm,
                    t.hidden_norm,
                    t.logit_std,
                    t.sink,
                    t.gated,
                    opt(t.attention_edited),
                ));
            }
        }
    }
    out
}

/// The figures `--plot` writes, by file name: per image, Figure 2 at its peak layer (the last
/// probed layer without a peak), Figure 5 over the probed layers, and the ×uniform heatmap at
/// that layer, before and (with an edit) after; with a box, Figure 8 ([`top1_figure`]).
fn figures(r: &Report, prepared: &[Prepared]) -> Result<Vec<(String, String)>> {
    use crate::report::visual_sinks::{
        angle_svg, depth_svg, ratio_heatmap_svg, AnglePoint, Region,
    };
    let plot = |e: String| crate::internal!("{e}");
    let mut out: Vec<(String, String)> = top1_figure(r)?.into_iter().collect();
    for image in &r.images {
        let rep = image.report;
        let Some(layer) = rep.peak_layer.or_else(|| rep.layers.keys().last().copied()) else {
            continue;
        };
        let name = if r.images.len() == 1 {
            "image0".to_string()
        } else {
            format!("prompt{}_image{}", image.prompt, image.image_index)
        };
        let tokens = &rep.tokens[&layer];
        let title = format!("{} layer {layer}", image.image);
        let points: Vec<AnglePoint> = tokens
            .iter()
            .map(|t| AnglePoint {
                centered_cos: t.centered_cos,
                ratio: t.ratio,
                sink: t.sink,
                gated: t.gated,
            })
            .collect();
        out.push((
            format!("{name}_angles.svg"),
            angle_svg(&title, &points, r.ratio, r.gate).map_err(plot)?,
        ));
        let depth: Vec<(usize, f64, f64)> = rep
            .layers
            .iter()
            .map(|(&l, s)| (l, s.sink_share, s.text_sink_share))
            .collect();
        out.push((
            format!("{name}_depth.svg"),
            depth_svg(&image.image, &depth, rep.peak_layer).map_err(plot)?,
        ));
        let p = &prepared[image.prompt];
        let picture = crate::image::decode::load_rgb(&p.item.images[image.image_index], true)?;
        let regions = &p.regions[image.image_index];
        // One scale for before and after: from 1/10 of uniform to 10× past the threshold.
        let range = (-1.0, (r.ratio.max(10.0)).log10() + 1.0);
        let heatmap = |ratios: &[f64], sinks: &[bool], suffix: &str| -> Result<(String, String)> {
            // InternVL's thumbnail tokens lie under the tiles; a heatmap shows the tiles.
            let tiles_only = regions.iter().any(|t| !t.thumbnail);
            let cells: Vec<Region> = regions
                .iter()
                .zip(ratios.iter().zip(sinks))
                .filter(|(t, _)| !(tiles_only && t.thumbnail))
                .map(|(t, (&ratio, &sink))| Region {
                    x0: t.rect[0],
                    y0: t.rect[1],
                    x1: t.rect[2],
                    y1: t.rect[3],
                    ratio,
                    sink,
                })
                .collect();
            let svg = ratio_heatmap_svg(
                &format!("{title}{suffix}"),
                &picture,
                &cells,
                range,
                image.target_box,
            )
            .map_err(plot)?;
            Ok((
                format!("{name}_heatmap{}.svg", suffix.replace(", ", "_")),
                svg,
            ))
        };
        let ratios: Vec<f64> = tokens.iter().map(|t| t.ratio).collect();
        let sinks: Vec<bool> = tokens.iter().map(|t| t.sink).collect();
        out.push(heatmap(&ratios, &sinks, "")?);
        if tokens.iter().all(|t| t.attention_edited.is_some()) {
            let after: Vec<f64> = tokens
                .iter()
                .map(|t| t.attention_edited.unwrap_or(0.0))
                .collect();
            let total: f64 = after.iter().sum();
            let n = after.len() as f64;
            let ratios: Vec<f64> = after
                .iter()
                .map(|a| if total > 0.0 { a / (total / n) } else { 0.0 })
                .collect();
            let sinks: Vec<bool> = tokens
                .iter()
                .zip(&ratios)
                .map(|(t, &ratio)| ratio >= r.ratio && t.inside_box != Some(true))
                .collect();
            out.push(heatmap(&ratios, &sinks, ", edited")?);
        }
    }
    Ok(out)
}

/// Figure 8 when an image has a box: the box top-1 of each map per probed layer, with the
/// re-look's selector layers marked. One image: its own 0/1 per layer (`image0_top1.svg`);
/// several: the share of the images with a box (`top1.svg`). Maps without a value (the edited
/// one without `--edit`) are left out.
fn top1_figure(r: &Report) -> Result<Option<(String, String)>> {
    if r.images.iter().all(|i| i.target_box.is_none()) {
        return Ok(None);
    }
    let (name, title, rates): (&str, String, Vec<(usize, Top1Rates)>) = match &r.images[..] {
        [image] => (
            "image0_top1.svg",
            format!("{}: top-1 in the box", image.image),
            (image.report.layers.iter())
                .map(|(&l, s)| (l, Top1Rates::of(&[s])))
                .collect(),
        ),
        _ => (
            "top1.svg",
            "share of the images whose top-1 is in the box".to_string(),
            (r.aggregate.top1_in_box.layers.iter())
                .map(|(&l, rates)| (l, rates.clone()))
                .collect(),
        ),
    };
    let column = |label, value: fn(&Top1Rates) -> Option<f64>| -> (&str, Vec<(usize, f64)>) {
        let points = (rates.iter())
            .filter_map(|(l, t)| value(t).map(|v| (*l, v)))
            .collect();
        (label, points)
    };
    let series: Vec<(&str, Vec<(usize, f64)>)> = [
        column("raw", |t| t.top1_in_box),
        column("masked ≥100×", |t| t.top1_in_box_masked_100),
        column("masked ≥10×", |t| t.top1_in_box_masked_10),
        column("edited", |t| t.top1_in_box_edited),
    ]
    .into_iter()
    .filter(|(_, points)| !points.is_empty())
    .collect();
    let svg = crate::report::visual_sinks::top1_svg(
        &title,
        &series,
        r.num_layers,
        depth::first_counted_layer(r.num_layers),
        &depth::selector_layers(r.num_layers),
    )
    .map_err(|e| crate::internal!("{e}"))?;
    Ok(Some((name.to_string(), svg)))
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use serde_json::Value;

    use super::*;
    use crate::forward::backend::cpu::CpuBackend;
    use crate::forward::backend::cuda::host::HostDevice;
    use crate::forward::backend::cuda::CudaBackend;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        args: Args,
    }

    /// A golden case of tests/fixtures/visual_sinks/ with its reference output.
    fn case(name: &str) -> (Args, Value) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let cases: Value = serde_json::from_slice(
            &std::fs::read(root.join("tests/fixtures/visual_sinks/cases.json")).unwrap(),
        )
        .unwrap();
        let case = cases["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        let rooted = |s: &str| {
            let p = root.join(s);
            if p.exists() {
                p.display().to_string()
            } else {
                s.to_string()
            }
        };
        let mut argv = vec![
            "visual-sinks".to_string(),
            rooted(case["model"].as_str().unwrap()),
        ];
        argv.extend(
            case["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| rooted(a.as_str().unwrap())),
        );
        let golden: Value = serde_json::from_slice(
            &std::fs::read(root.join(case["golden"].as_str().unwrap())).unwrap(),
        )
        .unwrap();
        (Command::parse_from(argv).args, golden)
    }

    fn measure_on<B: Backend>(backend: &B, args: &Args) -> Vec<Measurement> {
        let items = items(args).unwrap();
        let ckpt = Checkpoint::open_ref(&args.model).unwrap();
        let model = Model::new(&ckpt).unwrap();
        let prompter = Prompter::new(&ckpt, &model, true).unwrap();
        let processor = Processor::from_dir(&ckpt.dir).unwrap();
        let settings = args.settings(model.spec.num_layers()).unwrap();
        let job = Job {
            model: &model,
            prompter: &prompter,
            processor: &processor,
            merge: 2,
            items,
            settings: &settings,
            answers: None,
            progress: false,
        };
        job.run(backend)
            .unwrap()
            .into_iter()
            .map(|(_, m, _)| m)
            .collect()
    }

    fn max_diff(a: &[f32], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y).abs()))
    }

    /// The edited forward equals transformers with the same edit applied by a hook
    /// (tools/visual_sinks_ref.py): next-token logits within 1e-4, unedited, edited and the
    /// control (the attention within 1e-5 is the integration test's `attention_edited`).
    #[test]
    fn edited_logits_match_the_hooked_transformers_forward() {
        for name in [
            "qwen3_vl_question_box",
            "internvl_question_box",
            "qwen3_vl_post_rope_median",
        ] {
            let (args, golden) = case(name);
            let m = &measure_on(&CpuBackend::new(Precision::F32), &args)[0];
            let floats = |v: &Value| -> Vec<f64> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            };
            let image = &golden["images"][0];
            let pairs = [
                (
                    &m.logits_unedited,
                    &image["edit"]["next_token"]["logits_before"],
                ),
                (
                    m.logits_edited.as_ref().unwrap(),
                    &image["edit"]["next_token"]["logits_after"],
                ),
                (
                    m.logits_control.as_ref().unwrap(),
                    &image["control"]["next_token"]["logits_after"],
                ),
            ];
            for (got, want) in pairs {
                let want = floats(want);
                assert_eq!(got.len(), want.len(), "{name}");
                let d = max_diff(got, &want);
                assert!(d <= 1e-4, "{name}: logits differ by {d:.2e}");
            }
        }
    }

    /// The CUDA backend's code path (the host stand-in) gives the CPU's statistics.
    #[test]
    fn the_gpu_code_path_gives_the_cpu_statistics() {
        for name in ["qwen3_vl_question_box", "internvl_two_images"] {
            let (args, _) = case(name);
            let cpu = measure_on(&CpuBackend::new(Precision::F32), &args);
            let gpu = measure_on(
                &CudaBackend::new(HostDevice::default(), Precision::F32),
                &args,
            );
            let json = |m: &[Measurement]| {
                let images: Vec<&ImageReport> = m.iter().flat_map(|m| &m.images).collect();
                serde_json::to_value(images).unwrap()
            };
            let (c, g) = (json(&cpu), json(&gpu));
            let mut errors = Vec::new();
            close(&g, &c, "", &mut errors);
            assert!(errors.is_empty(), "{name}: {errors:#?}");
        }
    }

    fn close(got: &Value, want: &Value, path: &str, errors: &mut Vec<String>) {
        match (got, want) {
            (Value::Object(g), Value::Object(w)) => {
                for (k, v) in w {
                    close(&g[k], v, &format!("{path}.{k}"), errors);
                }
            }
            (Value::Array(g), Value::Array(w)) if g.len() == w.len() => {
                for (i, (g, w)) in g.iter().zip(w).enumerate() {
                    close(g, w, &format!("{path}[{i}]"), errors);
                }
            }
            (Value::Number(g), Value::Number(w)) => {
                let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
                if (g - w).abs() > 1e-5 * w.abs().max(1.0) {
                    errors.push(format!("{path}: {g} against {w}"));
                }
            }
            _ if got == want => {}
            _ => errors.push(format!("{path}: {got} against {want}")),
        }
    }
}
