//! `sinkmerge heads`: which heads lost their sink, and whether they are the heads whose weights
//! moved most (`docs/commands/heads.md`).

use std::borrow::Cow;
use std::io::Write;
use std::path::PathBuf;

use super::scoring_args::ScoringArgs;
use crate::analysis::heads::{self, diagnose, Diagnosis, Layers, RankBy};
use crate::checkpoint::output::{write_file_atomic, Outputs};
use crate::checkpoint::Checkpoint;
use crate::commands::args::whole_number;
use crate::error::Result;
use crate::forward::backend::Backend;
use crate::forward::device::BackendJob;
use crate::forward::model::DecoderSpec;
use crate::report::heads::{
    heatmap_svg, render_csv, render_text, HeadsReport, HeadsReportSettings,
};
use crate::report::json_text;
use crate::sink::inputs::{check_same_tokens, prompt_input};
use crate::sink::score::{Input, Settings};

pub const LONG_ABOUT: &str = "Per-head diagnosis of a reference LLM and its VL-adapted (or merged) \
copy: for every head of the chosen layers, its sink before and after and how far its weights moved, \
from one scoring pass over both models.\n\n\
Per head (layer L, query head h, KV head h / (heads / KV heads)):\n  \
g_base_median, g_target_median  median sink gap G of REF's and TARGET's head\n  \
delta_g                         g_target_median - g_base_median (negative: the sink weakened)\n  \
b_gap_median, margin            median B of TARGET's head against REF's; g_base_median - b_gap_median\n  \
pos0_before, pos0_after         mean A[q, 0] over the head's valid observations\n  \
drift q, k, v, o                dW = TARGET - REF on head h's rows of q_proj, its KV head's rows of \
k_proj and v_proj, and its columns of o_proj: fro, op (largest singular value), and both relative \
to REF's slice\n  \
drift q_norm, k_norm            l2, linf and relative l2 of the QK-norm scale acting on the head\n\n\
Across heads: Spearman's rho of delta_g and of the margin with each drift measure, with a seeded \
two-sided permutation p-value. G, B and the observations are those of `sinkmerge score` (see its \
--help); pooling every head's observations gives score's S and margin.";

pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge heads assets/models/tiny-qwen3/ref assets/models/tiny-qwen3/vl\n  \
sinkmerge heads qwen2.5-vl:ref qwen2.5-vl:lm --last 10 --top 20 --csv heads.csv --heatmap heads.svg\n  \
sinkmerge heads REF TARGET --layers 20-27 --rank-by margin --json";

/// The most `--permutations`: a permutation p-value resolves steps of 1/(N+1), 1e-6 here, finer
/// than a Bonferroni correction over the heads of any model needs; each permutation costs a
/// pass over every head for every correlation, so the cap bounds the run time.
pub const MAX_PERMUTATIONS: usize = 1_000_000;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Reference LLM: directory, HF repo id (`ORG/NAME[@rev]`) or alias
    #[arg(value_name = "REF")]
    pub reference: String,

    /// The adapted (or merged) model, with REF's geometry and tokenizer
    #[arg(value_name = "TARGET")]
    pub target: String,

    #[command(flatten)]
    pub scoring: ScoringArgs,

    /// These layers instead of the last K: `0-3,7` (inclusive ranges) or `20:28` (a slice)
    #[arg(long, value_name = "LIST", conflicts_with = "last")]
    pub layers: Option<crate::arch::LayerList>,

    /// Heads shown in the text table, most damaged first
    #[arg(
        long,
        value_name = "N",
        default_value_t = 20,
        allow_negative_numbers = true
    )]
    pub top: usize,

    /// What ranks damaged heads
    #[arg(long, value_enum, default_value_t = RankBy::DeltaG)]
    pub rank_by: RankBy,

    /// Permutations of each correlation's p-value (0: none), at most 1000000
    #[arg(long, value_name = "N", default_value_t = 10_000,
          value_parser = whole_number(0, MAX_PERMUTATIONS), allow_negative_numbers = true)]
    pub permutations: usize,

    /// Seed of the permutations
    #[arg(
        long,
        value_name = "SEED",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub permutation_seed: u64,

    /// Print one JSON object: heads, correlations, pair, settings
    #[arg(long)]
    pub json: bool,

    /// Write every head's row as CSV
    #[arg(long, value_name = "FILE.csv")]
    pub csv: Option<PathBuf>,

    /// Write an SVG of layer-by-head grids side by side: ΔG, the margin, and the relative
    /// spectral drift of q and k, each with its own colour scale
    #[arg(long, value_name = "FILE.svg")]
    pub heatmap: Option<PathBuf>,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    args.scoring.validate()?;
    let reports = Outputs::new(false)
        .files([
            ("--csv", args.csv.as_deref()),
            ("--heatmap", args.heatmap.as_deref()),
        ])
        .inputs("--prompts", args.scoring.prompts.as_deref());
    reports.check_before_inputs()?;
    let (prompts, source) = args.scoring.prompt_set()?;
    let ckpts = [
        Checkpoint::open_ref(&args.reference)?,
        Checkpoint::open_ref(&args.target)?,
    ];
    super::scoring_args::warn_undeclared_layers(&ckpts);
    reports
        .inputs("input", ckpts.iter().map(|c| c.dir.as_path()))
        .check()?;
    let spec = DecoderSpec::from_model_config(&ckpts[0].config)
        .map_err(|e| crate::bad!("{}: {e}", ckpts[0].dir.join("config.json").display()))?;
    let num_layers = spec.num_layers();
    let layers = match &args.layers {
        Some(list) => Layers::List(list.resolve(num_layers)?),
        None => Layers::Last(args.scoring.last),
    };
    let template = args.scoring.chat_template.then_some(ckpts[0].dir.as_path());
    let pair = [
        prompt_input(&ckpts[0], &prompts, template)?,
        prompt_input(&ckpts[1], &prompts, template)?,
    ];
    check_same_tokens(&pair[0], &pair[1], None)?;

    let job = Diagnose {
        pair: &pair,
        layers: &layers,
        num_layers,
        show: progress && !args.json,
    };
    let (diagnosis, _gpu) = args.scoring.device.run(args.scoring.precision, job)?;
    let report = HeadsReport {
        ranking: heads::rank(diagnosis.heads.iter().map(|h| &h.sink), args.rank_by),
        correlations: heads::correlations(
            &diagnosis.heads,
            args.permutations,
            args.permutation_seed,
        ),
        settings: HeadsReportSettings {
            reference: ckpts[0].label.clone(),
            target: ckpts[1].label.clone(),
            prompts: source,
            n_prompts: prompts.len(),
            layers: layers.of(num_layers),
            rank_by: args.rank_by,
            permutations: args.permutations,
            permutation_seed: args.permutation_seed,
            chat_template: args.scoring.chat_template,
            precision: args.scoring.precision,
            device: args.scoring.device,
        },
        diagnosis: Cow::Borrowed(&diagnosis),
    };

    // Render every artefact before writing any.
    let csv = args.csv.as_ref().map(|_| render_csv(&diagnosis.heads));
    let svg = (args.heatmap.as_ref())
        .map(|_| heatmap_svg(&diagnosis, &report.settings))
        .transpose()?;
    let rendered = if args.json {
        json_text(&report)?
    } else {
        render_text(&report, args.top)
    };
    if let (Some(path), Some(csv)) = (&args.csv, csv) {
        write_file_atomic(path, csv.as_bytes())?;
    }
    if let (Some(path), Some(svg)) = (&args.heatmap, svg) {
        write_file_atomic(path, svg.as_bytes())?;
    }
    super::emit(out, &rendered)?;
    Ok(())
}

/// The diagnosis of one pair, with a progress bar over both models' layers.
struct Diagnose<'a> {
    pair: &'a [Input<'a>; 2],
    layers: &'a Layers,
    num_layers: usize,
    show: bool,
}

impl BackendJob for Diagnose<'_> {
    type Output = Diagnosis;

    fn run<B: Backend>(self, backend: &B) -> Result<Diagnosis> {
        let bar = crate::progress::items(2 * self.num_layers as u64, "layers", self.show);
        let diagnosis = diagnose(
            backend,
            self.pair,
            self.layers,
            Settings::default(),
            &|| bar.inc(1),
        )?;
        bar.finish_and_clear();
        Ok(diagnosis)
    }
}
