//! `sinkmerge predict`: how well Sink Strength predicts the text-capability change on a panel
//! of VLM / reference-LLM pairs, and what it predicts for a new backbone.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::analysis::predict::{self, Analysis, MarginCorrelation, Panel, Query};
use crate::checkpoint::output::{check_report_file, write_file_atomic};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::report::plot::Scatter;
use crate::report::{fmt_num, Table};
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
    #[arg(long = "s", value_name = "VALUE", allow_negative_numbers = true)]
    pub s: Option<f64>,

    /// Reference LLM (directory, HF-cache repo id or alias) to place on the panel: its S is
    /// measured as `sinkmerge score MODEL` does with every default (15 built-in prompts, last 10
    /// layers, median), then used as --s
    #[arg(long, value_name = "MODEL", conflicts_with = "s")]
    pub model: Option<String>,

    /// With --s or --model: "similar S" means |S_panel - S| <= this
    #[arg(long, value_name = "WIDTH", default_value_t = 0.25)]
    pub similar_within: f64,

    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,

    /// Also write the scatter of S against delta with the fit line and pair labels (the paper's
    /// Figure 3) as SVG
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

pub fn run(args: Args, progress: bool) -> Result<()> {
    // Every argument and the panel are checked before the scorer runs: it takes minutes.
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
    if let Some(path) = &args.plot {
        let inputs: Vec<&Path> = model.iter().map(|m| m.dir.as_path()).collect();
        check_report_file(path, &inputs)?;
    }

    let measured = (model.as_ref())
        .map(|ckpt| default_sink_strength(ckpt, progress && !args.json))
        .transpose()?;
    let query =
        (args.s.or(measured)).map(|s| predict::query(&points, &analysis, s, args.similar_within));

    if let Some(path) = &args.plot {
        let chart = Scatter {
            title: format!(
                "Sink strength vs {task_name} ({} pairs, Spearman {:.3})",
                analysis.n, analysis.spearman
            ),
            x_label: "Sink Strength S of the reference LLM".into(),
            y_label: format!("{task_name} (VLM - LLM, points)"),
            points: points
                .iter()
                .map(|p| (p.sink_strength, p.delta, p.pair.clone()))
                .collect(),
            line: Some((analysis.intercept, analysis.slope)),
        };
        let svg = chart.to_svg().map_err(Error::Write)?;
        write_file_atomic(path, svg.as_bytes())?;
    }

    if args.json {
        let mut out = json!({
            "panel": panel.source,
            "task": task_name,
            "pairs": points.iter().map(|p| &p.pair).collect::<Vec<_>>(),
            "skipped": skipped,
        });
        let map = out.as_object_mut().expect("object");
        if let serde_json::Value::Object(a) = serde_json::to_value(&analysis).expect("JSON") {
            map.extend(a);
        }
        map.insert(
            "margin_correlation".into(),
            serde_json::to_value(&margin).expect("JSON"),
        );
        if let Some(q) = &query {
            map.insert("query".into(), serde_json::to_value(q).expect("JSON"));
        }
        if let (Some(model), Some(s)) = (&args.model, measured) {
            map.insert(
                "measured".into(),
                json!({"model": model, "sink_strength": s, "prompts": "default", "last": 10, "stat": "median"}),
            );
        }
        println!("{}", serde_json::to_string_pretty(&out).expect("JSON"));
    } else {
        if let (Some(model), Some(s)) = (&args.model, measured) {
            println!(
                "measured      S = {s:.4} for {model} (sinkmerge score defaults: 15 built-in prompts, last 10 layers, median)"
            );
        }
        print!(
            "{}",
            render(
                &panel.source,
                &task_name,
                &analysis,
                &skipped,
                margin.as_ref(),
                query.as_ref()
            )
        );
        if let Some(path) = &args.plot {
            println!("plot          {}", path.display());
        }
    }
    Ok(())
}

fn render(
    source: &str,
    task: &str,
    a: &Analysis,
    skipped: &[String],
    margin: Option<&MarginCorrelation>,
    query: Option<&Query>,
) -> String {
    let mut s = format!(
        "panel         {source}\ntask          {task}, {} pairs\n",
        a.n
    );
    if !skipped.is_empty() {
        s += &format!("left out      {} (no {task} value)\n", skipped.join(", "));
    }
    let mut t = Table::new(["pair", "S", "observed", "held-out", "|error|", "constant"]);
    for h in &a.held_out {
        t.row([
            h.pair.clone(),
            format!("{:.2}", h.sink_strength),
            format!("{:.2}", h.observed),
            format!("{:.2}", h.predicted),
            format!("{:.2}", (h.observed - h.predicted).abs()),
            format!("{:.2}", h.constant),
        ]);
    }
    s += "\n";
    s += &t.render();
    s += &format!(
        "\nSpearman rho  {:.3}   (average ranks on ties)\n\
         Pearson r     {:.3}\n\
         fit           {task} = {} + {} * S   (least squares, all pairs)\n\
         LOO MAE       {:.2}   (each pair predicted by the line fitted to the others)\n\
         constant MAE  {:.2}   (each pair predicted by the mean of the others)\n",
        a.spearman,
        a.pearson,
        fmt_num(a.intercept),
        fmt_num(a.slope),
        a.loo_mae,
        a.constant_mae
    );
    if let Some(m) = margin {
        s += &format!(
            "margin rho    {:.3}   (Spearman, margin G_base - B_gap vs {task}, {} pairs; Pearson r {:.3})\n",
            m.spearman, m.n, m.pearson
        );
        if !m.skipped.is_empty() {
            s += &format!("no margin     {}\n", m.skipped.join(", "));
        }
    }
    if let Some(q) = query {
        s += &format!(
            "\nnew backbone  S = {}\npredicted     {task} = {:.2}   (full-panel fit)\n",
            fmt_num(q.sink_strength),
            q.predicted
        );
        match q.similar_range {
            Some((lo, hi)) => {
                let names: Vec<String> = q
                    .similar
                    .iter()
                    .map(|p| format!("{} {:.1}", p.pair, p.delta))
                    .collect();
                s += &format!(
                    "similar S     {:.2} to {:.2} observed over {} pair(s) with |S - {}| <= {}: {}\n",
                    lo,
                    hi,
                    q.similar.len(),
                    fmt_num(q.sink_strength),
                    q.similar_within,
                    names.join(", ")
                );
            }
            None => {
                s += &format!(
                    "similar S     no panel pair within |S - {}| <= {} (--similar-within)\n",
                    fmt_num(q.sink_strength),
                    q.similar_within
                )
            }
        }
        let tie = if q.tied > 0 {
            format!(", tied with {} panel pair(s)", q.tied)
        } else {
            String::new()
        };
        s += &format!(
            "rank          {} of {} by S (1 = strongest sink{tie})\n",
            q.rank, q.of
        );
    }
    s
}
