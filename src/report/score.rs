//! The text, JSON and SVG reports of `sinkmerge score` (the metrics: `docs/reference/sink-metrics.md`).

use serde::Serialize;

use super::heatmap::{ColourScale, Heatmap, Panel, Scale};
use super::plot::{stacked_svg, LineChart, Series};
use super::{fmt_num, fmt_opt, short_label, Table};
use crate::error::{Error, Result};
use crate::forward::device::{ComputeDevice, GpuReport};
use crate::forward::precision::Precision;
use crate::sink::inputs::TemplateFrom;
use crate::sink::metrics::{GapFrom, SinkPosition, Stat};
use crate::sink::prompts::PromptSource;
use crate::sink::score::{BandValues, Bands, LayerReport, Scores};
use crate::sink::sweep::SweepRow;
use crate::sink::text_loss::TextLoss;

fn is_scores(g: &GapFrom) -> bool {
    *g == GapFrom::Scores
}

/// `settings` of the JSON report.
#[derive(Debug, Serialize)]
pub struct ScoreReportSettings {
    pub prompts: PromptSource,
    pub n_prompts: usize,
    pub last: usize,
    pub stat: Stat,
    pub sink_position: SinkPosition,
    /// Only when it is not `scores`, so default reports keep their keys.
    #[serde(skip_serializing_if = "is_scores")]
    pub gap_from: GapFrom,
    pub trailing_queries: usize,
    pub bootstrap: usize,
    pub bootstrap_seed: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bands: Option<Bands>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub k_sweep: Option<[usize; 2]>,
    pub chat_template: bool,
    /// Whose chat template rendered the prompts (with --chat-template).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template_from: Option<TemplateFrom>,
    pub device: ComputeDevice,
    /// Always named: the paper's figures are bf16, sinkmerge's default is f32.
    pub precision: Precision,
    pub reference: Option<String>,
}

/// The whole report: the scores, the settings that produced them, the sweep and the GPU run.
#[derive(Debug, Serialize)]
pub struct ScoreReport<'a> {
    #[serde(flatten)]
    pub scores: &'a Scores,
    pub settings: ScoreReportSettings,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep: Option<Vec<SweepRow>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuReport>,
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

/// The text report: the summary table, then every optional table, then the per-layer table.
pub fn render_text(report: &ScoreReport) -> String {
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
            fmt_opt(m.statistics.sink_strength),
            fmt_opt(m.statistics.pos0_share),
            match (m.statistics.pos0_trailing, m.statistics.pos0_trailing_ci) {
                (Some(p), Some([lo, hi])) => {
                    format!("{} [{}, {}]", fmt_num(p), fmt_num(lo), fmt_num(hi))
                }
                (p, _) => fmt_opt(p),
            },
            fmt_opt(m.statistics.strong_sink_frac),
        ];
        if with_ref {
            match (
                m.reference,
                i.checked_sub(1).and_then(|j| scores.pairs.get(j)),
            ) {
                (false, Some(p)) => row.extend([
                    fmt_opt(p.statistics.b_gap_median),
                    fmt_opt(p.statistics.margin),
                ]),
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
        header.push(format!("G {}", short_label(&m.model)));
        header.push(format!("pos0 {}", short_label(&m.model)));
    }
    let mut per_layer = Table::new(header);
    for l in 0..layers {
        let mut row = vec![l.to_string()];
        for m in &scores.models {
            let r = m.per_layer.get(l);
            row.push(fmt_opt(r.and_then(|r| r.median_g)));
            row.push(fmt_opt(r.and_then(|r| r.pos0_share)));
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
                .map(|m| format!("S {}", short_label(&m.model))),
        );
        if with_pairs {
            header.extend(
                scores
                    .pairs
                    .iter()
                    .map(|p| format!("margin {}", short_label(&p.target))),
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
            row.extend(bands.iter().map(|b| fmt_opt(b.as_ref().and_then(pick))));
            row.extend(
                (scores.pairs.iter())
                    .map(|p| fmt_opt(p.statistics.margin_bands.as_ref().and_then(pick))),
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
                fmt_opt(
                    m.statistics
                        .sink_strength_by_last
                        .as_ref()
                        .and_then(|v| v[i].sink_strength),
                )
            }));
            row.extend((scores.pairs.iter()).map(|p| {
                fmt_opt(
                    p.statistics
                        .margin_by_last
                        .as_ref()
                        .and_then(|v| v[i].margin),
                )
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
        (m, _) => fmt_opt(m),
    };
    let mut header = vec!["N".to_string(), "draws".to_string()];
    header.extend(
        scores
            .models
            .iter()
            .map(|m| format!("S {}", short_label(&m.model))),
    );
    header.extend(
        scores
            .pairs
            .iter()
            .map(|p| format!("margin {}", short_label(&p.target))),
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
            let s = short_label(&m.model);
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

/// `--plot`: per-layer median G and pos0 share of every model, stacked.
pub fn layer_plot_svg(scores: &Scores) -> Result<String> {
    stacked_svg(&layer_plot(scores)).map_err(Error::Internal)
}

/// `--heatmap`: per-head median G over the window, one panel per model.
pub fn head_heatmap_svg(scores: &Scores) -> Result<String> {
    head_heatmap(scores).to_svg().map_err(Error::Internal)
}

fn layer_plot(scores: &Scores) -> Vec<LineChart> {
    let labels = legend_labels(scores);
    let series = |f: &dyn Fn(&LayerReport) -> Option<f64>| {
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
                title: short_label(&m.model),
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
