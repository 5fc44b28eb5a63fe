//! `sinkmerge score`: Sink Strength S, pos0 share and strong-sink fraction of each model; with
//! `--ref`, B_gap and the margin G_base - B_gap of each model against the reference, as a
//! before/after table, JSON, and SVG plots.

use std::io::Write;
use std::path::PathBuf;

use super::scoring_args::ScoringArgs;
use crate::checkpoint::output::{write_file_atomic, Outputs};
use crate::checkpoint::Checkpoint;
use crate::commands::args::whole_number;
use crate::error::Result;
use crate::report::json_text;
use crate::report::score::{
    head_heatmap_svg, layer_plot_svg, render_text, ScoreReport, ScoreReportSettings,
};
use crate::sink::inputs::{scoring_inputs, TemplateFrom};
use crate::sink::metrics::{GapFrom, SinkPosition, Stat};
use crate::sink::pass::ScorePass;
use crate::sink::score::{Bands, Bootstrap, Scored, Settings};
use crate::sink::sweep::Sweep;
use crate::sink::text_loss::TextPass;

/// `sinkmerge score --help`: what the command computes.
pub const LONG_ABOUT: &str = "Attention-sink scores of each MODEL, and with --ref the margin of each \
MODEL against the reference.\n\n\
Runs each MODEL (and REF) on the calibration prompts, layer by layer in f32 (weights upcast, eager \
attention, no cache, batch of one per prompt; the next layer read and decoded while one computes, so two layers' \
weights resident at most, less under --max-memory; --precision bf16 \
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

    #[command(flatten)]
    pub scoring: ScoringArgs,

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

    /// Bootstrap resamples over prompts for `pos0_trailing_ci`, the percentile 95% interval,
    /// 100 to 1000000
    #[arg(long, value_name = "B", default_value = "1000",
          value_parser = whole_number(MIN_BOOTSTRAP, MAX_BOOTSTRAP), allow_negative_numbers = true)]
    pub bootstrap: usize,

    /// Seed of the bootstrap (SplitMix64)
    #[arg(
        long,
        value_name = "SEED",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub bootstrap_seed: u64,

    /// Also report S (and with --ref the margin) over depth bands: `thirds` = the early, middle
    /// and late thirds of the layers (Appendix E.4, Table 13), split as numpy.array_split
    #[arg(long, value_enum, value_name = "BANDS")]
    pub bands: Option<Bands>,

    /// Also report S (and the margin) for every window of the last K layers, K = LO..=HI
    /// (Appendix E.4 sweeps 3-20; HI at most 1024), from the same forward passes. A K beyond a
    /// model's layers is the whole model
    #[arg(long, value_name = "LO-HI", value_parser = parse_k_sweep, allow_hyphen_values = true)]
    pub k_sweep: Option<(usize, usize)>,

    /// The paper's N-sweep (Appendix D.1, Table 9): for each N, draw N prompts from the pool with
    /// seeds 0..SEEDS and report the mean and sample standard deviation of S (and the margin)
    /// over the draws. Each distinct prompt runs once; each N once
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', conflicts_with_all = ["prompts", "n"],
          allow_hyphen_values = true)]
    pub sweep: Option<Vec<usize>>,

    /// Draws per N of --sweep, 1 to 1000
    #[arg(long, value_name = "SEEDS", default_value = "3",
          value_parser = whole_number(1, MAX_SEEDS), requires = "sweep",
          allow_negative_numbers = true)]
    pub seeds: usize,

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
    #[arg(
        long,
        value_name = "N",
        requires = "text",
        allow_negative_numbers = true
    )]
    pub text_window: Option<usize>,
}

/// The fewest `--bootstrap` resamples: the percentile interval's ends are the 2.5th and 97.5th
/// percentiles of the resampled means, so each tail needs a few resamples of its own (2.5 at
/// 100); with one resample the "interval" is a single resampled mean, which need not contain the
/// estimate. Efron and Tibshirani (An Introduction to the Bootstrap, 1993) advise about 1000 for
/// percentile intervals, the default.
pub const MIN_BOOTSTRAP: usize = 100;
/// The most `--bootstrap` resamples: 8 MB of resampled means, and a Monte Carlo error of the
/// interval's ends far below the sampling error of any prompt set the pool offers.
pub const MAX_BOOTSTRAP: usize = 1_000_000;
/// The most `--seeds` draws per N: the paper draws 3 (Appendix D.1); every draw is summarized
/// from the one pass, and 1000 already resolves the standard deviation to about 2%.
pub const MAX_SEEDS: usize = 1000;
/// The largest HI of `--k-sweep`: the sweep has a row per K, and a K beyond the model's layers
/// repeats the whole-model row (as the paper's 3-20 sweep does on the 6-layer test models), so
/// the cap only bounds that repetition; it is far above the depth of any model sinkmerge scores.
pub const MAX_K_SWEEP: usize = 1024;

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<i64>() {
        Ok(n) if n >= 1 => Ok(n as usize),
        Ok(n) => Err(format!(
            "{n} is not allowed: give a whole number of at least 1"
        )),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// `LO-HI` with 1 <= LO <= HI <= [`MAX_K_SWEEP`].
fn parse_k_sweep(s: &str) -> Result<(usize, usize), String> {
    let bad =
        || format!("`{s}`: give the range as LO-HI with 1 <= LO <= HI <= {MAX_K_SWEEP}, e.g. 3-20");
    let (lo, hi) = s.split_once('-').ok_or_else(bad)?;
    let (lo, hi): (usize, usize) = (
        lo.trim().parse().map_err(|_| bad())?,
        hi.trim().parse().map_err(|_| bad())?,
    );
    if lo == 0 || lo > hi || hi > MAX_K_SWEEP {
        return Err(bad());
    }
    Ok((lo, hi))
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    args.scoring.validate()?;
    let reports = Outputs::new(false)
        .files([
            ("--plot", args.plot.as_deref()),
            ("--heatmap", args.heatmap.as_deref()),
        ])
        .inputs("--prompts", args.scoring.prompts.as_deref())
        .inputs("--text", args.text.as_deref());
    reports.check_before_inputs()?;
    let with_reference = args.reference.is_some();
    let template_from = TemplateFrom::choose(
        args.scoring.chat_template,
        args.template_from,
        with_reference,
    )?;
    let sweep = (args.sweep.as_deref())
        .map(|sizes| Sweep::draw(sizes, args.seeds))
        .transpose()?;
    let (prompts, source) = match &sweep {
        Some(sweep) => sweep.prompts(),
        None => args.scoring.prompt_set()?,
    };

    // The reference comes first.
    let ckpts: Vec<Checkpoint> = (args.reference.iter().chain(&args.models))
        .map(|r| Checkpoint::open_ref(r))
        .collect::<Result<_>>()?;
    super::scoring_args::warn_undeclared_layers(&ckpts);
    reports
        .inputs("input", ckpts.iter().map(|c| c.dir.as_path()))
        .check()?;
    let inputs = scoring_inputs(&ckpts, &prompts, template_from, with_reference)?;
    // Every model's text ids and window, checked before the long passes start.
    let text = (args.text.as_deref())
        .map(|path| TextPass::new(path, &ckpts, args.text_window))
        .transpose()?;

    let pass = ScorePass {
        inputs: &inputs,
        reference: with_reference.then_some(0),
        settings: Settings {
            last: args.scoring.last,
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
        },
        text: text.as_ref(),
        show: progress && !args.json,
    };
    let (
        (
            Scored {
                mut scores,
                observations,
            },
            losses,
        ),
        gpu,
    ) = args.scoring.device.run(args.scoring.precision, pass)?;
    let sweep = sweep.map(|sweep| sweep.rows(&observations));
    for (m, loss) in scores.models.iter_mut().zip(losses.into_iter().flatten()) {
        m.text = Some(loss);
    }
    let report = ScoreReport {
        scores: &scores,
        settings: ScoreReportSettings {
            prompts: source,
            n_prompts: prompts.len(),
            last: args.scoring.last,
            stat: args.stat,
            sink_position: args.sink_position,
            gap_from: args.gap_from,
            trailing_queries: args.trailing_queries,
            bootstrap: args.bootstrap,
            bootstrap_seed: args.bootstrap_seed,
            bands: args.bands,
            k_sweep: args.k_sweep.map(|(lo, hi)| [lo, hi]),
            chat_template: args.scoring.chat_template,
            chat_template_from: template_from,
            device: args.scoring.device,
            precision: args.scoring.precision,
            reference: args.reference.clone(),
        },
        sweep,
        gpu,
    };

    // Render every artefact before writing any, so a failure leaves nothing behind.
    let plot = (args.plot.as_ref())
        .map(|_| layer_plot_svg(&scores))
        .transpose()?;
    let heatmap = (args.heatmap.as_ref())
        .map(|_| head_heatmap_svg(&scores))
        .transpose()?;
    let rendered = if args.json {
        json_text(&report)?
    } else {
        render_text(&report)
    };
    for (path, svg) in [(&args.plot, plot), (&args.heatmap, heatmap)] {
        if let (Some(path), Some(svg)) = (path, svg) {
            write_file_atomic(path, svg.as_bytes())?;
        }
    }
    super::emit(out, &rendered)?;
    Ok(())
}
