//! The text, JSON and SVG reports of `sinkmerge predict`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::plot::Scatter;
use super::{fmt_num, Table};
use crate::analysis::predict::{Analysis, MarginCorrelation, Point, Query};
use crate::error::{Error, Result};

/// What `predict` found, as its reports show it.
pub struct PredictReport<'a> {
    /// Where the panel came from.
    pub panel: &'a str,
    pub task: &'a str,
    /// The pairs with a value for the task.
    pub points: &'a [Point],
    /// The pairs without one.
    pub skipped: &'a [String],
    pub analysis: &'a Analysis,
    pub margin: Option<&'a MarginCorrelation>,
    /// The new backbone (`--s` or `--model`).
    pub query: Option<&'a Query>,
    /// `--model` and the S measured for it.
    pub measured: Option<(&'a str, f64)>,
    /// Where `--plot` writes the scatter.
    pub plot: Option<&'a Path>,
}

/// `--plot`: S against the task delta, with the fit line and pair labels (the paper's Figure 3).
pub fn scatter_svg(r: &PredictReport) -> Result<String> {
    let chart = Scatter {
        title: format!(
            "Sink strength vs {} ({} pairs, Spearman {:.3})",
            r.task, r.analysis.n, r.analysis.spearman
        ),
        x_label: "Sink Strength S of the reference LLM".into(),
        y_label: format!("{} (VLM - LLM, points)", r.task),
        points: (r.points.iter())
            .map(|p| (p.sink_strength, p.delta, p.pair.clone()))
            .collect(),
        line: Some((r.analysis.intercept, r.analysis.slope)),
        highlight: None,
    };
    chart.to_svg().map_err(Error::Internal)
}

/// `--json`: one object, the analysis's fields flattened into it. `reproduce` reads its predict
/// step back into it.
#[derive(Debug, Serialize, Deserialize)]
pub struct PredictJson {
    pub panel: String,
    pub task: String,
    pub pairs: Vec<String>,
    pub skipped: Vec<String>,
    #[serde(flatten)]
    pub analysis: Analysis,
    pub margin_correlation: Option<MarginCorrelation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query: Option<Query>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured: Option<Measured>,
}

/// `--model`'s S, and the `score` defaults it was measured with.
#[derive(Debug, Serialize, Deserialize)]
pub struct Measured {
    pub model: String,
    pub sink_strength: f64,
    pub prompts: String,
    pub last: usize,
    pub stat: String,
}

/// The `--json` object of `r`.
pub fn json_report(r: &PredictReport) -> PredictJson {
    PredictJson {
        panel: r.panel.to_string(),
        task: r.task.to_string(),
        pairs: r.points.iter().map(|p| p.pair.clone()).collect(),
        skipped: r.skipped.to_vec(),
        analysis: r.analysis.clone(),
        margin_correlation: r.margin.cloned(),
        query: r.query.cloned(),
        measured: r.measured.map(|(model, s)| Measured {
            model: model.to_string(),
            sink_strength: s,
            prompts: "default".into(),
            last: 10,
            stat: "median".into(),
        }),
    }
}

/// The text report: the measured S, the panel's summary, and where the plot went.
pub fn render_text(r: &PredictReport) -> String {
    let mut out = String::new();
    if let Some((model, s)) = r.measured {
        out += &format!(
            "measured      S = {s:.4} for {model} (sinkmerge score defaults: 15 built-in prompts, last 10 layers, median)\n"
        );
    }
    out += &render_summary(r.panel, r.task, r.analysis, r.skipped, r.margin, r.query);
    if let Some(path) = r.plot {
        out += &format!("plot          {}\n", path.display());
    }
    out
}

/// The panel's summary table and fit; what a new backbone would get.
fn render_summary(
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
