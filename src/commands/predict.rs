//! `sinkmerge predict`: how well Sink Strength predicts the text-capability change on a panel
//! of VLM / reference-LLM pairs, and what it predicts for a new backbone.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::analysis::predict::{self, Panel};
use crate::checkpoint::output::{write_file_atomic, Outputs};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::report::predict::{json_report, render_text, scatter_svg, PredictReport};
use crate::sink::pass::default_sink_strength;

#[derive(Debug, clap::Args)]
#[command(
    about = "Rank and predict text-capability loss from Sink Strength over a panel of pairs",
    long_about = "Rank and predict text-capability loss from Sink Strength over a panel of VLM / \
reference-LLM pairs (arXiv 2609.00746, Sections 3.2-3.3 and Appendix E).\n\n\
Prints Spearman's rho between S and the task delta (average ranks on ties, as scipy), Pearson's r, \
the least-squares line delta = a + b*S, every pair's leave-one-pair-out held-out prediction, their \
mean absolute error (LOO MAE), and the LOO error of a constant baseline that predicts the mean of \
the other pairs. A panel with a `margin` column (G_base - B_gap per pair, as `sinkmerge score \
--ref` reports it) also gets Spearman's rho and Pearson's r of margin against the delta \
(Section 3.4). With --s VALUE (or --model MODEL, which runs the scorer to get S), also places a \
new backbone on the panel.",
    after_help = "Examples:\n  \
sinkmerge predict                                  # the paper's 17 pairs, IFEval\n  \
sinkmerge predict --panel paper-9 --task gsm8k     # Table 12, one task\n  \
sinkmerge predict --panel paper-6                  # Table 10's six headline pairs\n  \
sinkmerge predict --s 1.9 --plot figure3.svg       # place a backbone with S = 1.9\n  \
sinkmerge predict --model Qwen/Qwen3-8B            # measure its S first, then place it"
)]
pub struct Args {
    /// Panel: a built-in name (paper-17 = Table 11, paper-9 = Table 12, paper-6 = Table 10) or a
    /// CSV file with `pair`, `sink_strength`, one or more `delta_*` columns and optionally
    /// `margin` (G_base - B_gap per pair: then the margin-vs-delta correlation is reported too)
    #[arg(long, value_name = "CSV|NAME", default_value = predict::DEFAULT_PANEL)]
    pub panel: String,

    /// Task column: `ifeval` or `delta_ifeval` [default: delta_ifeval if the panel has it, else
    /// its first delta_* column]. Pairs with an empty cell for the task are left out and listed
    #[arg(long, value_name = "TASK")]
    pub task: Option<String>,

    /// Use only these pairs (comma-separated, case-insensitive), e.g. the six headline pairs
    #[arg(long, value_name = "A,B,...", value_delimiter = ',')]
    pub pairs: Vec<String>,

    /// Sink strength of a new backbone: print its predicted delta (full-panel fit), the observed
    /// deltas of panel backbones with similar S, and the rank it would take
    #[arg(long = "s", value_name = "VALUE", allow_hyphen_values = true)]
    pub s: Option<f64>,

    /// Reference LLM (directory, HF-cache repo id or alias) to place on the panel: its S is
    /// measured as `sinkmerge score MODEL` does with every default (15 built-in prompts, last 10
    /// layers, median), then used as --s
    #[arg(long, value_name = "MODEL", conflicts_with = "s")]
    pub model: Option<String>,

    /// With --s or --model: "similar S" means |S_panel - S| <= this
    #[arg(
        long,
        value_name = "WIDTH",
        default_value_t = 0.25,
        allow_hyphen_values = true
    )]
    pub similar_within: f64,

    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,

    /// Also write the scatter of S against delta with the fit line and pair labels (the paper's
    /// Figure 3) as SVG
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    // Every argument and the panel are checked before the scorer runs: it takes minutes.
    let panel_file = Path::new(&args.panel);
    let plot = Outputs::new(false)
        .files([("--plot", args.plot.as_deref())])
        .inputs("--panel", panel_file.is_file().then_some(panel_file));
    plot.check_before_inputs()?;
    if let Some(s) = args.s {
        if !s.is_finite() {
            crate::bail!("--s must be a finite number, got {s}");
        }
    }
    if !(args.similar_within >= 0.0 && args.similar_within.is_finite()) {
        crate::bail!(
            "--similar-within must be a finite number >= 0, got {}",
            args.similar_within
        );
    }
    let mut panel = Panel::load(&args.panel)?;
    if !args.pairs.is_empty() {
        panel.select(&args.pairs)?;
    }
    let task = panel.task_index(args.task.as_deref())?;
    let task_name = panel.tasks[task].clone();
    let (points, skipped) = panel.points(task);
    let analysis = predict::analyze(&points)
        .map_err(|e| crate::bad!("{} ({task_name}): {e}", panel.source))?;
    let margin = predict::margin_correlation(&panel, task)
        .map_err(|e| crate::bad!("{} ({task_name}): {e}", panel.source))?;
    let model = args
        .model
        .as_deref()
        .map(Checkpoint::open_ref)
        .transpose()?;
    plot.inputs("input", model.iter().map(|m| m.dir.as_path()))
        .check()?;

    let measured = (model.as_ref())
        .map(|ckpt| default_sink_strength(ckpt, progress && !args.json))
        .transpose()?;
    let query =
        (args.s.or(measured)).map(|s| predict::query(&points, &analysis, s, args.similar_within));

    let report = PredictReport {
        panel: &panel.source,
        task: &task_name,
        points: &points,
        skipped: &skipped,
        analysis: &analysis,
        margin: margin.as_ref(),
        query: query.as_ref(),
        measured: (args.model.as_deref()).zip(measured),
        plot: args.plot.as_deref(),
    };
    // Render every artefact before writing any.
    let svg = args
        .plot
        .as_ref()
        .map(|_| scatter_svg(&report))
        .transpose()?;
    let rendered = if args.json {
        crate::report::json_text(&json_report(&report))?
    } else {
        render_text(&report)
    };
    if let (Some(path), Some(svg)) = (&args.plot, svg) {
        write_file_atomic(path, svg.as_bytes())?;
    }
    super::emit(out, &rendered)?;
    Ok(())
}
