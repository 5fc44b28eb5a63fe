//! `sinkmerge score`: Sink Strength S, pos0 share and strong-sink fraction of each model; with
//! `--ref`, B_gap and the margin G_base - B_gap of each model against the reference, as a
//! before/after table, JSON, and SVG plots.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::checkpoint::output::write_file_atomic;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::report::heatmap::{ColourScale, Heatmap, Panel, Scale};
use crate::report::plot::{stacked_svg, LineChart, Series};
use crate::report::{fmt_num, Table};
use crate::sink::backend::cpu::CpuBackend;
use crate::sink::backend::cuda::driver::{Driver, Timings};
use crate::sink::backend::cuda::{CudaBackend, Device as _};
use crate::sink::backend::{Backend, Precision};
use crate::sink::metrics::{mean, sample_std};
use crate::sink::metrics::{GapFrom, SinkPosition, Stat};
use crate::sink::model::DecoderSpec;
use crate::sink::prompts::{self, PromptSource};
use crate::sink::score::{
    score, BandValues, Bootstrap, Input, Observations, Scored, Scores, Settings,
};
use crate::sink::text_loss::{self, TextLoss};
use crate::sink::tokenize::TextEncoder;
use crate::{bad, bail};

/// Where `score` computes (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU.
    Cpu,
    /// The NVIDIA GPU of this index.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("`{s}` is not a device: use cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// What a GPU run reports besides the scores.
#[derive(Debug, Serialize)]
struct GpuReport {
    /// The GPU's name and index.
    device: String,
    /// Arithmetic of the forward pass (f32 GEMMs with TF32 off in both).
    precision: Precision,
    total_memory_bytes: usize,
    #[serde(flatten)]
    timings: Timings,
    /// Wall time of the whole scoring pass (set-up excluded), the --text pass included.
    score_s: f64,
}

/// `sinkmerge score --help`: what the command computes.
pub const LONG_ABOUT: &str = "Attention-sink scores of each MODEL, and with --ref the margin of each \
MODEL against the reference.\n\n\
Runs each MODEL (and REF) on the calibration prompts, layer by layer in f32 (weights upcast, eager \
attention, no cache, batch of one per prompt; only one layer's weights resident; --precision bf16 \
for the paper's bf16 path), and reports the \
attention-sink metrics of \"Text Capability Loss in Vision-Language Adaptation\" (arXiv 2609.00746):\n\n\
  S (sink_strength)   median over the window of G = log(a/(1-a)), a = the sink's attention share\n\
  pos0_trailing       the paper's position-0 measure: per prompt, mean attention on token 0 over \
the window's layers, all heads and the last --trailing-queries queries; mean over prompts, with a \
bootstrap 95% CI\n\
  pos0_share          mean attention on token 0 pooled over the window's valid queries \
(sinkmerge's own measure)\n\
  strong_sink_frac    share of observations with G > 2 (a > 0.881)\n\
  b_gap_median        with --ref: median over the window of B, the largest shift of a query's score \
gaps to the sink between REF and MODEL on the same tokens\n\
  margin              with --ref: G_base - B_gap (REF's median G minus B_gap)\n\
  text loss           with --text FILE: mean next-token cross-entropy (nats) and perplexity on the \
file, a capability proxy\n\n\
Observations are (prompt, layer, head, query) with query >= max(1, sink position). The window is the \
last --last layers. Architectures: qwen2 (Qwen2/2.5 and the Qwen-VL, LLaVA-OneVision and InternVL \
language models), qwen3 (and Qwen3-VL's), llama (and Idefics3's), mistral, olmo2, olmo3, qwen3_moe, \
olmoe; a VLM directory is scored through its language model.";

/// `sinkmerge score --help`: examples.
pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge score --ref assets/models/tiny-qwen3/ref assets/models/tiny-qwen3/vl\n  \
sinkmerge score qwen2.5-vl:ref --n 50 --seed 1 --json\n  \
sinkmerge score --ref REF VLM_LM MERGED --plot layers.svg --heatmap heads.svg";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Models to score: directories, HF repo ids (`ORG/NAME[@rev]`) or aliases
    #[arg(required = true, value_name = "MODEL")]
    pub models: Vec<String>,

    /// Reference LLM: also report each MODEL's B_gap and margin against it (the same token ids
    /// are fed to both, so they must share a tokenizer)
    #[arg(long = "ref", value_name = "REF")]
    pub reference: Option<String>,

    /// Prompt file, one prompt per line (blank lines skipped) [default: the 15 built-in prompts]
    #[arg(long, value_name = "FILE", conflicts_with = "n")]
    pub prompts: Option<PathBuf>,

    /// Draw N prompts from the built-in pool of 100 instead (kept apart from the 15 defaults, as
    /// the paper's N-sweep pool is, Appendix D.1; `--n 100` takes the whole pool)
    #[arg(long, value_name = "N")]
    pub n: Option<usize>,

    /// Seed of the --n draw (SplitMix64, docs/reference/sink-metrics.md; the same N and seed give
    /// the same prompts everywhere)
    #[arg(long, value_name = "SEED", default_value_t = 0, requires = "n")]
    pub seed: u64,

    /// Window: the last K decoder layers (all layers if the model has fewer). Paper: 10
    #[arg(long, value_name = "K", default_value_t = 10)]
    pub last: usize,

    /// Statistic of G that S reports: median (the paper's S, Section 3.2) or mean (Appendix E.4).
    /// G_base, B_gap and the margin are always medians
    #[arg(long, value_enum, default_value_t = Stat::Median)]
    pub stat: Stat,

    /// Sink position: `column` = the key with the largest attention column mass per
    /// (prompt, layer, head), lowest index on ties (project default,
    /// docs/reference/sink-metrics.md#observations);
    /// `per-query` = each query's most-attended key
    #[arg(long, value_enum, default_value_t = SinkPosition::Column)]
    pub sink_position: SinkPosition,

    /// What G is computed from: `scores` (log-odds from the scores with a stable log-sum-exp;
    /// never infinite) or `probabilities` (log(a/(1-a)) from the stored attention weights, as a
    /// probe on transformers' `output_attentions` computes it; under --precision bf16 every
    /// a > 1 - 2^-9 rounds to 1 and gives G = +inf, which the reports count as n_infinite_g)
    #[arg(long, value_enum, value_name = "FROM", default_value_t = GapFrom::Scores)]
    pub gap_from: GapFrom,

    /// The paper's position-0 measure (`pos0_trailing`, Section 4.3 and Appendix C.3; its 0.70,
    /// 0.50, 0.25 and 5e-5 figures are this measure): per prompt, the mean of `A[q,0]` over the
    /// window's layers, every head and the last T queries; then the mean over prompts.
    /// `pos0_share` stays sinkmerge's own measure, pooled over the window's valid queries
    #[arg(long, value_name = "T", default_value = "8", value_parser = at_least_one,
          allow_negative_numbers = true)]
    pub trailing_queries: usize,

    /// Bootstrap resamples over prompts for `pos0_trailing_ci`, the percentile 95% interval
    #[arg(long, value_name = "B", default_value = "1000", value_parser = at_least_one,
          allow_negative_numbers = true)]
    pub bootstrap: usize,

    /// Seed of the bootstrap (SplitMix64)
    #[arg(long, value_name = "SEED", default_value_t = 0)]
    pub bootstrap_seed: u64,

    /// Also report S (and with --ref the margin) over depth bands: `thirds` = the early, middle
    /// and late thirds of the layers (Appendix E.4, Table 13), split as numpy.array_split
    #[arg(long, value_enum, value_name = "BANDS")]
    pub bands: Option<Bands>,

    /// Also report S (and the margin) for every window of the last K layers, K = LO..=HI
    /// (Appendix E.4 sweeps 3-20), from the same forward passes
    #[arg(long, value_name = "LO-HI", value_parser = parse_k_sweep)]
    pub k_sweep: Option<(usize, usize)>,

    /// The paper's N-sweep (Appendix D.1, Table 9): for each N, draw N prompts from the pool with
    /// seeds 0..SEEDS and report the mean and sample standard deviation of S (and the margin)
    /// over the draws. Each distinct prompt runs once
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', conflicts_with_all = ["prompts", "n"])]
    pub sweep: Option<Vec<usize>>,

    /// Draws per N of --sweep
    #[arg(long, value_name = "SEEDS", default_value = "3", value_parser = at_least_one,
          requires = "sweep")]
    pub seeds: usize,

    /// Render each prompt with the tokenizer's chat template as one user message with the
    /// generation prompt (default: raw prompt text with the tokenizer's special tokens)
    #[arg(long)]
    pub chat_template: bool,

    /// Whose chat template renders the prompts: `ref` = the reference's, for every model (the
    /// default with --ref: B needs the same token ids, and a VLM's template may differ, e.g. in
    /// its default system prompt), or `own` = each model its own (the default without --ref)
    #[arg(long, value_enum, value_name = "WHOSE", requires = "chat_template")]
    pub template_from: Option<TemplateFrom>,

    /// Print one JSON object: models, pairs, settings
    #[arg(long)]
    pub json: bool,

    /// Write an SVG of per-layer median G and pos0 share of every model
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Write an SVG heatmap of per-head median G over the window, one panel per model
    #[arg(long, value_name = "FILE.svg")]
    pub heatmap: Option<PathBuf>,

    /// Arithmetic of the forward pass: f32 (parity with transformers' f32 eager path), or bf16
    /// (transformers' bf16 eager path, the paper's setting, Appendix B: bf16 weights and
    /// activations, each GEMM, norm, product and residual add rounded to bf16, softmax in f32 on
    /// the rounded scores, probabilities rounded). Metrics use the rounded scores
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,

    /// Where to compute: `cpu`, or `cuda` / `cuda:N` for the NVIDIA GPU of index N (f32 GEMMs
    /// with TF32 off; needs libcuda, libnvrtc and libcublas at run time; weights stream
    /// through, so any model size fits)
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: Device,

    /// Also report each model's mean next-token cross-entropy (nats) and perplexity on this text
    /// file, a capability proxy beside S: the whole file tokenized with the model's tokenizer
    /// (special tokens added, never a chat template), scored in consecutive windows of
    /// --text-window tokens as transformers' `model(input_ids=w, labels=w)` scores them
    /// (docs/reference/sink-metrics.md, "Text loss and perplexity"); assets/text/sample.txt is a
    /// bundled sample
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,

    /// Tokens per window of --text, each scored as its own sequence [default: 1024, capped at
    /// the model's max_position_embeddings]
    #[arg(long, value_name = "N", requires = "text")]
    pub text_window: Option<usize>,
}

/// Whose chat template `--template-from` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TemplateFrom {
    /// The reference's template, for every model.
    Ref,
    /// Each model's own template.
    Own,
}

/// Depth bands of `--bands`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Bands {
    /// The early, middle and late thirds of the layers.
    Thirds,
}

fn is_scores(g: &GapFrom) -> bool {
    *g == GapFrom::Scores
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<i64>() {
        Ok(n) if n >= 1 => Ok(n as usize),
        Ok(n) => Err(format!(
            "{n} is not allowed: give a whole number of at least 1"
        )),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// `LO-HI` with 1 <= LO <= HI.
fn parse_k_sweep(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("`{s}`: give the range as LO-HI with 1 <= LO <= HI, e.g. 3-20");
    let (lo, hi) = s.split_once('-').ok_or_else(bad)?;
    let (lo, hi): (usize, usize) = (
        lo.trim().parse().map_err(|_| bad())?,
        hi.trim().parse().map_err(|_| bad())?,
    );
    if lo == 0 || lo > hi {
        return Err(bad());
    }
    Ok((lo, hi))
}

/// `settings` of the JSON report.
#[derive(Debug, Serialize)]
struct ReportSettings {
    prompts: PromptSource,
    n_prompts: usize,
    last: usize,
    stat: Stat,
    sink_position: SinkPosition,
    /// Only when it is not `scores`, so default reports keep their keys.
    #[serde(skip_serializing_if = "is_scores")]
    gap_from: GapFrom,
    trailing_queries: usize,
    bootstrap: usize,
    bootstrap_seed: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    bands: Option<Bands>,
    #[serde(skip_serializing_if = "Option::is_none")]
    k_sweep: Option<[usize; 2]>,
    chat_template: bool,
    /// Whose chat template rendered the prompts (with --chat-template).
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template_from: Option<TemplateFrom>,
    device: Device,
    /// Always named: the paper's figures are bf16, sinkmerge's default is f32.
    precision: Precision,
    reference: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    #[serde(flatten)]
    scores: &'a Scores,
    settings: ReportSettings,
    #[serde(skip_serializing_if = "Option::is_none")]
    sweep: Option<Vec<SweepRow>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<GpuReport>,
}

/// One N of `--sweep`: every draw, and the mean and sample standard deviation over draws.
#[derive(Debug, Serialize)]
struct SweepRow {
    n: usize,
    draws: Vec<SweepDraw>,
    /// Per model, in `models` order.
    sink_strength_mean: Vec<Option<f64>>,
    sink_strength_std: Vec<Option<f64>>,
    /// Per pair, in `pairs` order.
    margin_mean: Vec<Option<f64>>,
    margin_std: Vec<Option<f64>>,
}

#[derive(Debug, Serialize)]
struct SweepDraw {
    seed: u64,
    /// Indices into the built-in pool.
    prompts: Vec<usize>,
    sink_strength: Vec<Option<f64>>,
    margin: Vec<Option<f64>>,
}

pub fn run(args: Args, progress: bool) -> Result<()> {
    if args.last == 0 {
        bail!("--last must be at least 1");
    }
    let pool_len = prompts::pool().len();
    // Every draw of the sweep, as (n, seed, pool indices).
    let draws: Vec<(usize, u64, Vec<usize>)> = match &args.sweep {
        None => Vec::new(),
        Some(ns) => {
            let mut draws = Vec::new();
            for &n in ns {
                for seed in 0..args.seeds as u64 {
                    let picked = prompts::draw_indices(n, seed, pool_len)
                        .map_err(|_| bad!("--sweep {n}: the built-in pool holds {pool_len} prompts; choose sizes from 1 to {pool_len}"))?;
                    draws.push((n, seed, picked));
                }
            }
            draws
        }
    };
    // The sweep scores each distinct prompt once: the union of its draws, in pool order.
    let union: Vec<usize> = {
        let mut all: Vec<usize> = draws.iter().flat_map(|d| d.2.iter().copied()).collect();
        all.sort_unstable();
        all.dedup();
        all
    };
    let (prompts, source) = match &args.sweep {
        Some(n) => {
            let pool = prompts::pool();
            (
                union.iter().map(|&i| pool[i].clone()).collect(),
                PromptSource::Sweep {
                    n: n.clone(),
                    seeds: args.seeds,
                },
            )
        }
        None => prompts::choose(args.prompts.as_deref(), args.n, args.seed)?,
    };

    // The reference comes first.
    let mut refs: Vec<&str> = Vec::new();
    if let Some(r) = &args.reference {
        refs.push(r);
    }
    refs.extend(args.models.iter().map(String::as_str));
    let ckpts: Vec<Checkpoint> = refs
        .iter()
        .map(|r| Checkpoint::open_ref(r))
        .collect::<Result<_>>()?;
    for out in [&args.plot, &args.heatmap].into_iter().flatten() {
        refuse_inside_inputs(out, &ckpts)?;
    }
    // With --ref, every model renders with the reference's template unless told otherwise: B
    // compares the same token ids, and a VLM's template often differs (a default system prompt).
    let template_from = match (args.chat_template, args.template_from) {
        (false, _) => None,
        (true, Some(from)) => Some(from),
        (true, None) if args.reference.is_some() => Some(TemplateFrom::Ref),
        (true, None) => Some(TemplateFrom::Own),
    };
    if template_from == Some(TemplateFrom::Ref) && args.reference.is_none() {
        bail!("--template-from ref needs --ref: there is no reference whose template to use");
    }
    let template_of = |i: usize| match template_from {
        None => None,
        Some(TemplateFrom::Own) => Some(ckpts[i].dir.as_path()),
        Some(TemplateFrom::Ref) => Some(ckpts[0].dir.as_path()),
    };
    let mut inputs = Vec::with_capacity(ckpts.len());
    for (i, ckpt) in ckpts.iter().enumerate() {
        inputs.push(Input {
            label: ckpt.label.clone(),
            ckpt,
            tokens: tokenize(ckpt, &prompts, template_of(i))?,
        });
    }
    let reference = args.reference.as_ref().map(|_| 0);
    if reference.is_some() {
        for input in &inputs[1..] {
            same_tokens(&inputs[0], input, template_from)?;
        }
    }
    // Every model's text ids and window, checked before the long passes start.
    let text = match &args.text {
        None => None,
        Some(path) => Some(TextPass::new(path, &ckpts, args.text_window)?),
    };

    let settings = Settings {
        last: args.last,
        stat: args.stat,
        sink_position: args.sink_position,
        gap_from: args.gap_from,
        trailing_queries: args.trailing_queries,
        bootstrap: Bootstrap {
            resamples: args.bootstrap,
            seed: args.bootstrap_seed,
        },
        bands: args.bands.is_some(),
        k_sweep: args.k_sweep,
    };
    let show = progress && !args.json;
    let text = text.as_ref();
    let (
        (
            Scored {
                mut scores,
                observations,
            },
            losses,
        ),
        gpu,
    ) = match args.device {
        Device::Cpu => {
            let backend = CpuBackend::new(args.precision);
            let scored = score_with_progress(&backend, &inputs, reference, settings, show)?;
            ((scored, text_losses(&backend, text, show)?), None)
        }
        Device::Cuda(ordinal) => {
            let backend = CudaBackend::new(Driver::open(ordinal)?, args.precision);
            let started = Instant::now();
            let scored = score_with_progress(&backend, &inputs, reference, settings, show)?;
            let scored = (scored, text_losses(&backend, text, show)?);
            let driver = backend.device();
            let gpu = GpuReport {
                device: driver.describe(),
                precision: args.precision,
                total_memory_bytes: driver.total_memory()?,
                timings: driver.timings(),
                score_s: started.elapsed().as_secs_f64(),
            };
            (scored, Some(gpu))
        }
    };
    let sweep = args
        .sweep
        .as_ref()
        .map(|ns| sweep_rows(ns, &draws, &union, &observations));
    for (m, loss) in scores.models.iter_mut().zip(losses.into_iter().flatten()) {
        m.text = Some(loss);
    }

    let report = Report {
        scores: &scores,
        settings: ReportSettings {
            prompts: source,
            n_prompts: prompts.len(),
            last: args.last,
            stat: args.stat,
            sink_position: args.sink_position,
            gap_from: args.gap_from,
            trailing_queries: args.trailing_queries,
            bootstrap: args.bootstrap,
            bootstrap_seed: args.bootstrap_seed,
            bands: args.bands,
            k_sweep: args.k_sweep.map(|(lo, hi)| [lo, hi]),
            chat_template: args.chat_template,
            chat_template_from: template_from,
            device: args.device,
            precision: args.precision,
            reference: args.reference.clone(),
        },
        sweep,
        gpu,
    };
    if let Some(path) = &args.plot {
        let svg = stacked_svg(&layer_plot(&scores)).map_err(Error::BadInput)?;
        write_file_atomic(path, svg.as_bytes())?;
    }
    if let Some(path) = &args.heatmap {
        let svg = head_heatmap(&scores).to_svg().map_err(Error::BadInput)?;
        write_file_atomic(path, svg.as_bytes())?;
    }
    if args.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| Error::Write(format!("JSON report: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", render_text(&report));
    }
    Ok(())
}

/// The sweep's table: each draw's S and margins from the one pass over the union of the draws.
fn sweep_rows(
    ns: &[usize],
    draws: &[(usize, u64, Vec<usize>)],
    union: &[usize],
    observations: &Observations,
) -> Vec<SweepRow> {
    let summarize = |values: Vec<Vec<Option<f64>>>, columns: usize| {
        let column = |j: usize| -> Vec<f64> { values.iter().filter_map(|v| v[j]).collect() };
        let complete = |j: usize| column(j).len() == values.len();
        (
            (0..columns)
                .map(|j| complete(j).then(|| mean(&column(j))))
                .collect::<Vec<_>>(),
            (0..columns)
                .map(|j| complete(j).then(|| sample_std(&column(j))).flatten())
                .collect::<Vec<_>>(),
        )
    };
    let mut seen: Vec<usize> = Vec::new();
    let mut rows = Vec::new();
    for &n in ns {
        if seen.contains(&n) {
            continue;
        }
        seen.push(n);
        let draws: Vec<SweepDraw> = (draws.iter())
            .filter(|d| d.0 == n)
            .map(|(_, seed, picked)| {
                let at: Vec<usize> = (picked.iter())
                    .map(|i| union.binary_search(i).expect("the union holds every draw"))
                    .collect();
                let sub = observations.subset(&at);
                SweepDraw {
                    seed: *seed,
                    prompts: picked.clone(),
                    sink_strength: sub.sink_strength,
                    margin: sub.margin,
                }
            })
            .collect();
        let models = draws.first().map_or(0, |d| d.sink_strength.len());
        let pairs = draws.first().map_or(0, |d| d.margin.len());
        let (sink_strength_mean, sink_strength_std) = summarize(
            draws.iter().map(|d| d.sink_strength.clone()).collect(),
            models,
        );
        let (margin_mean, margin_std) =
            summarize(draws.iter().map(|d| d.margin.clone()).collect(), pairs);
        rows.push(SweepRow {
            n,
            draws,
            sink_strength_mean,
            sink_strength_std,
            margin_mean,
            margin_std,
        });
    }
    rows
}

/// The scorer with a progress bar over the layers of every model.
fn score_with_progress<B: Backend>(
    backend: &B,
    inputs: &[Input],
    reference: Option<usize>,
    settings: Settings,
    show: bool,
) -> Result<Scored> {
    let layers: u64 = (inputs.iter())
        .map(|i| {
            DecoderSpec::from_model_config(&i.ckpt.config).map_or(0, |s| s.num_layers() as u64)
        })
        .sum();
    let bar = crate::progress::items(layers, "layers", show);
    let scores = score(backend, inputs, reference, settings, &|| bar.inc(1))?;
    bar.finish_and_clear();
    Ok(scores)
}

/// `--text`: the file, and every model's token ids of it and window (in `models` order).
struct TextPass<'a> {
    file: String,
    models: Vec<(&'a Checkpoint, Vec<u32>, usize)>,
}

impl<'a> TextPass<'a> {
    /// Read `path` and encode it for each of `ckpts`: every bad input is found before scoring.
    fn new(path: &Path, ckpts: &'a [Checkpoint], window: Option<usize>) -> Result<TextPass<'a>> {
        let text = text_loss::read_text(path)?;
        let models = (ckpts.iter())
            .map(|ckpt| {
                let spec = DecoderSpec::from_model_config(&ckpt.config)
                    .map_err(|e| bad!("{}: {e}", ckpt.dir.join("config.json").display()))?;
                Ok((
                    ckpt,
                    text_loss::encode(ckpt, &text, path)?,
                    text_loss::window_for(&spec, window, &ckpt.label)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(TextPass {
            file: path.display().to_string(),
            models,
        })
    }
}

/// Each model's loss on the `--text` file, with a progress bar over the windows of every model;
/// `None` without `--text`.
fn text_losses<B: Backend>(
    backend: &B,
    text: Option<&TextPass>,
    show: bool,
) -> Result<Option<Vec<TextLoss>>> {
    let Some(text) = text else {
        return Ok(None);
    };
    let total: usize = (text.models.iter())
        .map(|(_, ids, window)| text_loss::windows(ids, *window).len())
        .sum();
    let bar = crate::progress::items(total as u64, "text", show);
    let losses = (text.models.iter())
        .map(|(ckpt, ids, window)| {
            text_loss::text_loss(backend, ckpt, ids, *window, &text.file, &|n| {
                bar.inc(n as u64)
            })
        })
        .collect::<Result<Vec<_>>>()?;
    bar.finish_and_clear();
    Ok(Some(losses))
}

/// S of one model as `sinkmerge score MODEL` reports it with every default (the 15 built-in
/// prompts, raw text, last 10 layers, median, column sinks): what `predict --model` places.
pub fn default_sink_strength(reference: &str, progress: bool) -> Result<f64> {
    let ckpt = Checkpoint::open_ref(reference)?;
    let input = Input {
        label: ckpt.label.clone(),
        ckpt: &ckpt,
        tokens: tokenize(&ckpt, &prompts::default_prompts(), None)?,
    };
    let scored = score_with_progress(
        &CpuBackend::default(),
        &[input],
        None,
        Settings::default(),
        progress,
    )?;
    let scores = scored.scores;
    scores.models[0].statistics.sink_strength.ok_or_else(|| {
        bad!(
            "{}: no valid observation in the last 10 layers, so S is undefined",
            ckpt.label
        )
    })
}

/// One model to score: its label and its token ids of `prompts` (see [`tokenize`]).
pub(crate) fn input<'a>(
    ckpt: &'a Checkpoint,
    prompts: &[String],
    template: Option<&Path>,
) -> Result<Input<'a>> {
    Ok(Input {
        label: ckpt.label.clone(),
        ckpt,
        tokens: tokenize(ckpt, prompts, template)?,
    })
}

/// Token ids of every prompt for one model, checked against its context length.
/// With `template = Some(dir)`, prompts are rendered with the chat template of the model in `dir`.
pub(crate) fn tokenize(
    ckpt: &Checkpoint,
    prompts: &[String],
    template: Option<&Path>,
) -> Result<Vec<Vec<u32>>> {
    let config = ckpt.dir.join("config.json");
    let spec = DecoderSpec::from_model_config(&ckpt.config)
        .map_err(|e| bad!("{}: {e}", config.display()))?;
    let encoder = TextEncoder::with_template_of(&ckpt.dir, template)?;
    let extends = spec.extends_context();
    let mut all = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.iter().enumerate() {
        let ids = encoder.encode(prompt)?;
        if ids.is_empty() {
            bail!(
                "{}: prompt {} encodes to no tokens",
                ckpt.dir.join("tokenizer.json").display(),
                i + 1
            );
        }
        if ids.len() > spec.max_position_embeddings && !extends {
            bail!(
                "{}: prompt {} is {} tokens, longer than max_position_embeddings = {} in {}; \
                 shorten it or leave it out",
                ckpt.label,
                i + 1,
                ids.len(),
                spec.max_position_embeddings,
                config.display()
            );
        }
        all.push(ids);
    }
    Ok(all)
}

/// B compares the reference and a model on the same token ids: their tokenizers must agree.
pub(crate) fn same_tokens(
    reference: &Input,
    model: &Input,
    template: Option<TemplateFrom>,
) -> Result<()> {
    for (i, (a, b)) in reference.tokens.iter().zip(&model.tokens).enumerate() {
        if a != b {
            let at = a
                .iter()
                .zip(b)
                .position(|(x, y)| x != y)
                .unwrap_or(a.len().min(b.len()));
            let show = |v: &[u32]| v.get(at).map_or("end".to_string(), |x| x.to_string());
            let why = if template == Some(TemplateFrom::Own) {
                "each model rendered the prompts with its own chat template; drop \
                 --template-from own (or give --template-from ref) to render every model with \
                 the reference's"
            } else {
                "the models have different vocabularies"
            };
            bail!(
                "{}: it gives other token ids than the reference {} (prompt {}, token {}: {} vs \
                 {}); {why}, and B needs the same tokens in both",
                model.label,
                reference.label,
                i + 1,
                at,
                show(b),
                show(a)
            );
        }
    }
    Ok(())
}

/// Plots are new files: never inside an input model's directory.
pub(crate) fn refuse_inside_inputs(out: &Path, ckpts: &[Checkpoint]) -> Result<()> {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Ok(parent) = parent.canonicalize() else {
        return Ok(());
    };
    for ckpt in ckpts {
        if let Ok(dir) = ckpt.dir.canonicalize() {
            if parent.starts_with(&dir) {
                bail!(
                    "{}: refusing to write inside the input model directory {}",
                    out.display(),
                    dir.display()
                );
            }
        }
    }
    Ok(())
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".to_string(), fmt_num)
}

/// "last 10 layers (18-27)", or "all 6 layers" when every model has no more than `--last`.
fn window_text(scores: &Scores, last: usize) -> String {
    let mut ranges: Vec<String> = (scores.models.iter())
        .map(|m| format!("{}-{}", m.window[0], m.window[1]))
        .collect();
    ranges.dedup();
    let whole = scores.models.iter().all(|m| m.num_layers <= last);
    match scores.models.first() {
        Some(m) if whole && ranges.len() == 1 => format!("all {} layers", m.num_layers),
        _ => format!("last {last} layers ({})", ranges.join(", ")),
    }
}

fn render_text(report: &Report) -> String {
    let scores = report.scores;
    let s = &report.settings;
    let mut out = String::new();
    let source = match &s.prompts {
        PromptSource::Default => "the built-in default set".to_string(),
        PromptSource::Pool { n, seed } => format!("{n} drawn from the built-in pool, seed {seed}"),
        PromptSource::File { path } => path.clone(),
        PromptSource::Sweep { n, seeds } => format!(
            "the union of the sweep's draws from the built-in pool: N = {}, {seeds} seeds each",
            n.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    out.push_str(&format!(
        "{} prompts ({source}){}; window: {}; S = {} G{}; sink position: {}; {} forward pass\n\n",
        s.n_prompts,
        match s.chat_template_from {
            Some(TemplateFrom::Ref) => ", the reference's chat template for every model",
            Some(TemplateFrom::Own) => ", each model's own chat template",
            None => "",
        },
        window_text(scores, s.last),
        match s.stat {
            Stat::Median => "median",
            Stat::Mean => "mean",
        },
        match s.gap_from {
            GapFrom::Scores => "",
            GapFrom::Probabilities => " (G from the attention probabilities)",
        },
        match s.sink_position {
            SinkPosition::Column => "column mass",
            SinkPosition::PerQuery => "per query",
        },
        s.precision,
    ));
    let with_ref = !scores.pairs.is_empty() || s.reference.is_some();
    let mut header = vec![
        "model",
        "S",
        "pos0_share",
        "pos0_trailing [95% CI]",
        "strong_sink_frac",
    ];
    if with_ref {
        header.extend(["b_gap_median", "margin"]);
    }
    header.push("observations");
    let mut table = Table::new(header);
    // With a reference, it is model 0 and model i pairs as pairs[i - 1].
    for (i, m) in scores.models.iter().enumerate() {
        let mut row = vec![
            if m.reference {
                format!("{} (ref)", m.model)
            } else {
                m.model.clone()
            },
            opt(m.statistics.sink_strength),
            opt(m.statistics.pos0_share),
            match (m.statistics.pos0_trailing, m.statistics.pos0_trailing_ci) {
                (Some(p), Some([lo, hi])) => {
                    format!("{} [{}, {}]", fmt_num(p), fmt_num(lo), fmt_num(hi))
                }
                (p, _) => opt(p),
            },
            opt(m.statistics.strong_sink_frac),
        ];
        if with_ref {
            match (
                m.reference,
                i.checked_sub(1).and_then(|j| scores.pairs.get(j)),
            ) {
                (false, Some(p)) => {
                    row.extend([opt(p.statistics.b_gap_median), opt(p.statistics.margin)])
                }
                _ => row.extend(["-".to_string(), "-".to_string()]),
            }
        }
        row.push(m.statistics.n_observations.to_string());
        table.row(row);
    }
    out.push_str(&table.render());
    out.push_str(&format!(
        "pos0_share: mean A[q,0] over the window's valid queries; pos0_trailing: the paper's \
         measure (last {} queries, mean per prompt, {} bootstrap resamples over prompts)\n",
        s.trailing_queries, s.bootstrap
    ));
    for m in &scores.models {
        if let Some(hub) = &m.hub {
            out.push_str(&format!(
                "{}: {} at commit {}\n",
                m.model, hub.repo, hub.commit
            ));
        }
    }
    for m in scores
        .models
        .iter()
        .filter(|m| m.statistics.n_infinite_g > 0)
    {
        out.push_str(&format!(
            "{}: {} of {} G are infinite (saturated sinks: a = 1 in the stored probabilities); \
             medians count them, means are undefined\n",
            m.model, m.statistics.n_infinite_g, m.statistics.n_observations
        ));
    }
    out.push_str(&text_table(scores));
    out.push_str(&band_tables(scores));
    if let Some(rows) = &report.sweep {
        out.push_str(&sweep_table(scores, rows));
    }

    // Per-layer median G, one column per model.
    let layers = scores
        .models
        .iter()
        .map(|m| m.num_layers)
        .max()
        .unwrap_or(0);
    let mut header = vec!["layer".to_string()];
    for m in &scores.models {
        header.push(format!("G {}", short(&m.model)));
        header.push(format!("pos0 {}", short(&m.model)));
    }
    let mut per_layer = Table::new(header);
    for l in 0..layers {
        let mut row = vec![l.to_string()];
        for m in &scores.models {
            let r = m.per_layer.get(l);
            row.push(opt(r.and_then(|r| r.median_g)));
            row.push(opt(r.and_then(|r| r.pos0_share)));
        }
        per_layer.row(row);
    }
    out.push_str("\nper layer (median G, pos0 share):\n");
    out.push_str(&per_layer.render());
    if let Some(g) = &report.gpu {
        let t = &g.timings;
        out.push_str(&format!(
            "\n{} ({}): scoring {:.2} s (load {:.2} s, compute {:.2} s, copy back {:.2} s), \
             set-up {:.2} s, peak GPU memory {:.2} GiB of {:.0}\n",
            g.device,
            g.precision,
            g.score_s,
            t.load_s,
            t.compute_s,
            t.copy_back_s,
            t.init_s,
            t.peak_memory_bytes as f64 / (1u64 << 30) as f64,
            g.total_memory_bytes as f64 / (1u64 << 30) as f64,
        ));
    }
    out
}

/// `--text`: each model's loss, perplexity and predicted tokens; nothing without it.
fn text_table(scores: &Scores) -> String {
    let losses: Vec<(&str, &TextLoss)> = (scores.models.iter())
        .filter_map(|m| m.text.as_ref().map(|t| (m.model.as_str(), t)))
        .collect();
    let Some((_, first)) = losses.first() else {
        return String::new();
    };
    let mut sizes: Vec<String> = losses.iter().map(|(_, t)| t.window.to_string()).collect();
    sizes.dedup();
    let mut table = Table::new(vec!["model", "loss", "perplexity", "tokens"]);
    for (model, t) in &losses {
        table.row(vec![
            model.to_string(),
            fmt_num(t.loss),
            fmt_num(t.perplexity),
            t.tokens_predicted.to_string(),
        ]);
    }
    format!(
        "\ntext loss on {} (mean next-token cross-entropy in nats, windows of {} tokens):\n{}",
        first.file,
        sizes.join(" / "),
        table.render()
    )
}

/// `--bands` and `--k-sweep`: S per model, then each pair's margin, by band or window.
fn band_tables(scores: &Scores) -> String {
    let mut out = String::new();
    let labels = |with_pairs: bool| {
        let mut header = vec!["".to_string()];
        header.extend(
            scores
                .models
                .iter()
                .map(|m| format!("S {}", short(&m.model))),
        );
        if with_pairs {
            header.extend(
                scores
                    .pairs
                    .iter()
                    .map(|p| format!("margin {}", short(&p.target))),
            );
        }
        header
    };
    let bands: Vec<_> = scores
        .models
        .iter()
        .map(|m| m.statistics.sink_strength_bands)
        .collect();
    if bands.iter().all(Option::is_some) && !bands.is_empty() {
        let mut table = Table::new(labels(true));
        for (name, pick) in [
            (
                "early third",
                (|b: &BandValues| b.early) as fn(&BandValues) -> Option<f64>,
            ),
            ("middle third", |b| b.middle),
            ("late third", |b| b.late),
        ] {
            let mut row = vec![name.to_string()];
            row.extend(bands.iter().map(|b| opt(b.as_ref().and_then(pick))));
            row.extend(
                (scores.pairs.iter())
                    .map(|p| opt(p.statistics.margin_bands.as_ref().and_then(pick))),
            );
            table.row(row);
        }
        out.push_str("\nby depth band (S, margin):\n");
        out.push_str(&table.render());
    }
    if let Some(first) = scores
        .models
        .first()
        .and_then(|m| m.statistics.sink_strength_by_last.as_ref())
    {
        let mut header = labels(true);
        header[0] = "last K".to_string();
        let mut table = Table::new(header);
        for (i, at) in first.iter().enumerate() {
            let mut row = vec![at.last.to_string()];
            row.extend(scores.models.iter().map(|m| {
                opt(m
                    .statistics
                    .sink_strength_by_last
                    .as_ref()
                    .and_then(|v| v[i].sink_strength))
            }));
            row.extend((scores.pairs.iter()).map(|p| {
                opt(p
                    .statistics
                    .margin_by_last
                    .as_ref()
                    .and_then(|v| v[i].margin))
            }));
            table.row(row);
        }
        out.push_str("\nby window (S, margin over the last K layers):\n");
        out.push_str(&table.render());
    }
    out
}

/// `--sweep`: mean ± sample standard deviation of S and the margin per N.
fn sweep_table(scores: &Scores, rows: &[SweepRow]) -> String {
    let pm = |m: Option<f64>, s: Option<f64>| match (m, s) {
        (Some(m), Some(s)) => format!("{} ± {}", fmt_num(m), fmt_num(s)),
        (m, _) => opt(m),
    };
    let mut header = vec!["N".to_string(), "draws".to_string()];
    header.extend(
        scores
            .models
            .iter()
            .map(|m| format!("S {}", short(&m.model))),
    );
    header.extend(
        scores
            .pairs
            .iter()
            .map(|p| format!("margin {}", short(&p.target))),
    );
    let mut table = Table::new(header);
    for r in rows {
        let mut row = vec![r.n.to_string(), r.draws.len().to_string()];
        row.extend(
            (0..r.sink_strength_mean.len())
                .map(|j| pm(r.sink_strength_mean[j], r.sink_strength_std[j])),
        );
        row.extend((0..r.margin_mean.len()).map(|j| pm(r.margin_mean[j], r.margin_std[j])));
        table.row(row);
    }
    format!(
        "\nN-sweep (mean ± sample std over the draws; one pass over {} distinct prompts):\n{}",
        (rows.iter())
            .flat_map(|r| r.draws.iter().flat_map(|d| d.prompts.iter()))
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        table.render()
    )
}

/// Legend entries, one per model: the short label the per-layer table's headers show, with
/// " (ref)" for the reference as the summary table marks it, and " #i" (the model's position,
/// from 1) where two entries would still be the same.
fn legend_labels(scores: &Scores) -> Vec<String> {
    let names: Vec<String> = (scores.models.iter())
        .map(|m| {
            let s = short(&m.model);
            if m.reference {
                format!("{s} (ref)")
            } else {
                s
            }
        })
        .collect();
    (names.iter().enumerate())
        .map(|(i, n)| {
            if names.iter().filter(|o| *o == n).count() > 1 {
                format!("{n} #{}", i + 1)
            } else {
                n.clone()
            }
        })
        .collect()
}

/// The last path component of a model label, for column headers.
pub(crate) fn short(label: &str) -> String {
    let trimmed = label.trim_end_matches('/');
    let parts: Vec<&str> = trimmed.rsplitn(3, '/').collect();
    match parts.as_slice() {
        [last, parent, ..] if last.len() <= 4 => format!("{parent}/{last}"),
        [last, ..] => last.to_string(),
        [] => label.to_string(),
    }
}

fn layer_plot(scores: &Scores) -> Vec<LineChart> {
    let labels = legend_labels(scores);
    let series = |f: &dyn Fn(&crate::sink::score::LayerReport) -> Option<f64>| {
        scores
            .models
            .iter()
            .zip(&labels)
            .map(|(m, label)| Series {
                label: label.clone(),
                points: m
                    .per_layer
                    .iter()
                    .filter_map(|l| f(l).map(|v| (l.layer as f64, v)))
                    .collect(),
            })
            .collect()
    };
    vec![
        LineChart {
            title: "Median sink gap G per layer".into(),
            x_label: "layer".into(),
            y_label: "median G = log(a / (1 - a))".into(),
            series: series(&|l| l.median_g),
        },
        LineChart {
            title: "Attention share of token 0 per layer".into(),
            x_label: "layer".into(),
            y_label: "pos0 share".into(),
            series: series(&|l| l.pos0_share),
        },
    ]
}

fn head_heatmap(scores: &Scores) -> Heatmap {
    let panels = scores
        .models
        .iter()
        .map(|m| {
            let mut layers: Vec<usize> = m.per_head.iter().map(|h| h.layer).collect();
            layers.dedup();
            let heads = m.per_head.iter().map(|h| h.head + 1).max().unwrap_or(0);
            let values = layers
                .iter()
                .map(|&l| {
                    (0..heads)
                        .map(|h| {
                            m.per_head
                                .iter()
                                .find(|x| x.layer == l && x.head == h)
                                .and_then(|x| x.median_g)
                        })
                        .collect()
                })
                .collect();
            Panel {
                title: short(&m.model),
                row_labels: layers.iter().map(|l| l.to_string()).collect(),
                values,
                ..Panel::default()
            }
        })
        .collect();
    Heatmap {
        title: "Per-head median sink gap G over the window".into(),
        x_label: "head".into(),
        y_label: "layer".into(),
        scale: Scale::Shared(ColourScale::sequential("median G")),
        panels,
    }
}
