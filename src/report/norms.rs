//! The reports of `sinkmerge norms`: text tables, the JSON object, the CSV rows and the SVG
//! plot of a [`Report`] (`docs/commands/norms.md`).

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::plot::{LineChart, Series};
use super::{fmt_num, fmt_opt, Table};
use crate::analysis::norms::{self, DriftReport, MedianMax, Metric, RatioSeries, Report, Row};
use crate::bail;
use crate::checkpoint::hub_cache::HubRef;
use crate::error::Result;

fn shape_str(shape: &[usize]) -> String {
    shape
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join("x")
}

fn window_label(report: &Report) -> String {
    let w = &report.window;
    match w.len() {
        0 => "window empty".into(),
        1 => format!("last 1: layer {}", w.start),
        n => format!("last {n}: layers {}-{}", w.start, w.end - 1),
    }
}

/// The text report: each pair's tables and summary, then the ratios of `--vs`.
pub fn render_text(report: &Report, tol: f64) -> String {
    let mut s = String::new();
    s += &render_pair(report, &report.pair, "", tol);
    if let Some((second, ratios)) = &report.vs {
        s += "\n";
        s += &render_pair(report, second, "--vs ", tol);
        s += &format!(
            "\nratio pair1/pair2 per module (window {}; every metric in --json)\n",
            window_label(report)
        );
        s += &render_ratios(ratios);
    }
    s
}

fn render_pair(report: &Report, pair: &DriftReport, prefix: &str, tol: f64) -> String {
    let note = |h: &Option<crate::checkpoint::hub_cache::HubRef>| {
        crate::checkpoint::resolve::commit_note(h.as_ref())
    };
    let mut s = format!(
        "{prefix}REF     {}{}\n{prefix}TARGET  {}{}\n",
        pair.reference,
        note(&pair.hub.0),
        pair.target,
        note(&pair.hub.1)
    );
    s += &format!(
        "layers {}, summary window {}, op norms certified to {tol:e}\n",
        report.num_layers,
        window_label(report)
    );
    if pair.ignored != (0, 0) {
        s += &format!(
            "ignored (outside the language model): {} tensors in REF, {} in TARGET\n",
            pair.ignored.0, pair.ignored.1
        );
    }
    let shown: Vec<&Row> = pair.rows.iter().filter(|r| r.expert.is_none()).collect();
    let layer = |r: &Row| r.layer.map_or_else(|| "-".to_string(), |l| l.to_string());
    let mut matrices = Table::new([
        "layer",
        "module",
        "shape",
        "fro",
        "op",
        "stable_rank",
        "rel_fro",
        "rel_op",
    ]);
    let mut vectors = Table::new([
        "layer", "module", "shape", "l2", "linf", "rel_l2", "ref_linf",
    ]);
    for row in shown {
        let lead = [layer(row), row.module.clone(), shape_str(&row.shape)];
        match &row.metrics {
            norms::Metrics::Matrix(m) => matrices.row(lead.into_iter().chain([
                fmt_num(m.fro),
                fmt_num(m.op),
                fmt_opt(m.stable_rank),
                fmt_opt(m.rel_fro),
                fmt_opt(m.rel_op),
            ])),
            norms::Metrics::Vector(v) => vectors.row(lead.into_iter().chain([
                fmt_num(v.l2),
                fmt_num(v.linf),
                fmt_opt(v.rel_l2),
                fmt_num(v.ref_linf),
            ])),
        }
    }
    if !matrices.is_empty() {
        s += "\nmatrices: dW = TARGET - REF\n";
        s += &matrices.render();
    }
    if !vectors.is_empty() {
        s += "\nvectors: d = TARGET - REF\n";
        s += &vectors.render();
    }
    if pair.rows.iter().any(|r| r.expert.is_some()) {
        s += "(one row per expert in --json and --csv; the table shows each layer's aggregate)\n";
    }
    if !pair.summary.modules.is_empty() {
        let n = report.window.len();
        s += "\nsummary per module type over layers\n";
        let mut t = Table::new([
            "module".to_string(),
            "metric".to_string(),
            "median".to_string(),
            "max".to_string(),
            format!("median last {n}"),
            format!("max last {n}"),
        ]);
        for m in &pair.summary.modules {
            for (i, (metric, all, win)) in m.stats.iter().enumerate() {
                t.row([
                    if i == 0 {
                        m.module.clone()
                    } else {
                        String::new()
                    },
                    metric.name().to_string(),
                    fmt_opt(all.median),
                    fmt_opt(all.max),
                    fmt_opt(win.median),
                    fmt_opt(win.max),
                ]);
            }
        }
        s += &t.render();
    }
    s
}

fn render_ratios(ratios: &[RatioSeries]) -> String {
    let mut t = Table::new([
        "module",
        "metric",
        "median window",
        "max window",
        "median all",
        // Layers with a ratio: a layer where pair 2 did not move has none.
        "layers",
    ]);
    let mut last_module = "";
    // The headline ratios; --json has every metric.
    let shown = [Metric::Op, Metric::Fro, Metric::L2];
    for r in ratios.iter().filter(|r| shown.contains(&r.metric)) {
        t.row([
            if r.module != last_module {
                r.module.clone()
            } else {
                String::new()
            },
            r.metric.name().to_string(),
            fmt_opt(r.window.median),
            fmt_opt(r.window.max),
            fmt_opt(r.all.median),
            r.all.count.to_string(),
        ]);
        last_module = &r.module;
    }
    t.render()
}

/// The `--json` object: the first pair's rows and summary, the window, and `--vs`'s pair and
/// ratios (docs/commands/norms.md). `reproduce` reads its norms step back into it.
#[derive(Debug, Serialize, Deserialize)]
pub struct NormsJson {
    #[serde(flatten)]
    pub pair: PairJson,
    pub num_layers: usize,
    pub window: WindowJson,
    pub tol: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs: Option<VsJson>,
    pub warnings: Vec<String>,
}

/// One REF/TARGET pair's rows and per-module summary.
#[derive(Debug, Serialize, Deserialize)]
pub struct PairJson {
    pub reference: String,
    pub target: String,
    /// The resolved commits of Hub models (absent for directories).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_hub: Option<HubRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_hub: Option<HubRef>,
    pub ignored: Ignored,
    pub rows: Vec<Row>,
    /// Per module type, in the rows' order: per metric over all layers and over the window.
    pub summary: IndexMap<String, ModuleStats>,
}

/// Tensors outside the language model, in REF and TARGET.
#[derive(Debug, Serialize, Deserialize)]
pub struct Ignored {
    pub reference: usize,
    pub target: usize,
}

/// One module type's statistics by metric name.
#[derive(Debug, Serialize, Deserialize)]
pub struct ModuleStats {
    pub all: IndexMap<String, MedianMax>,
    pub window: IndexMap<String, MedianMax>,
}

/// The summary window: the model's last K layers.
#[derive(Debug, Serialize, Deserialize)]
pub struct WindowJson {
    pub size: usize,
    pub layers: Vec<usize>,
}

/// `--vs`: the second pair, and the ratios pair1/pair2 by module and metric.
#[derive(Debug, Serialize, Deserialize)]
pub struct VsJson {
    #[serde(flatten)]
    pub pair: PairJson,
    pub ratio: IndexMap<String, IndexMap<String, RatioJson>>,
}

/// One module's and metric's ratio pair1/pair2 per layer (null where pair 2's value is 0), with
/// its median and max over all layers and over the window.
#[derive(Debug, Serialize, Deserialize)]
pub struct RatioJson {
    pub layers: Vec<usize>,
    pub values: Vec<Option<f64>>,
    pub median: Option<f64>,
    pub max: Option<f64>,
    pub median_window: Option<f64>,
    pub max_window: Option<f64>,
}

fn pair_json(pair: &DriftReport) -> PairJson {
    let stats = |m: &norms::summary::ModuleSummary, window: bool| {
        (m.stats.iter())
            .map(|(metric, a, w)| (metric.name().to_string(), if window { *w } else { *a }))
            .collect()
    };
    PairJson {
        reference: pair.reference.clone(),
        target: pair.target.clone(),
        reference_hub: pair.hub.0.clone(),
        target_hub: pair.hub.1.clone(),
        ignored: Ignored {
            reference: pair.ignored.0,
            target: pair.ignored.1,
        },
        rows: pair.rows.clone(),
        summary: (pair.summary.modules.iter())
            .map(|m| {
                let (all, window) = (stats(m, false), stats(m, true));
                (m.module.clone(), ModuleStats { all, window })
            })
            .collect(),
    }
}

/// The `--json` object of `report`.
pub fn json_report(report: &Report, tol: f64) -> NormsJson {
    NormsJson {
        pair: pair_json(&report.pair),
        num_layers: report.num_layers,
        window: WindowJson {
            size: report.window.len(),
            layers: report.window.clone().collect(),
        },
        tol,
        vs: report.vs.as_ref().map(|(second, ratios)| {
            let mut ratio: IndexMap<String, IndexMap<String, RatioJson>> = IndexMap::new();
            for r in ratios {
                ratio.entry(r.module.clone()).or_default().insert(
                    r.metric.name().to_string(),
                    RatioJson {
                        layers: r.per_layer.iter().map(|p| p.0).collect(),
                        values: r.per_layer.iter().map(|p| p.1).collect(),
                        median: r.all.median,
                        max: r.all.max,
                        median_window: r.window.median,
                        max_window: r.window.max,
                    },
                );
            }
            VsJson {
                pair: pair_json(second),
                ratio,
            }
        }),
        warnings: report.warnings.clone(),
    }
}

const CSV_METRICS: [&str; 11] = [
    "fro",
    "op",
    "stable_rank",
    "rel_fro",
    "rel_op",
    "ref_fro",
    "ref_op",
    "l2",
    "linf",
    "rel_l2",
    "ref_linf",
];

/// The `--csv` file: every row of both pairs, one metric a column (empty where it does not
/// apply).
pub fn render_csv(report: &Report) -> String {
    let mut s = String::from("pair,tensor,layer,module,expert,experts,shape");
    for m in CSV_METRICS {
        s += ",";
        s += m;
    }
    s += "\n";
    let pairs = std::iter::once(&report.pair).chain(report.vs.iter().map(|v| &v.0));
    for (i, pair) in pairs.enumerate() {
        for row in &pair.rows {
            let value = serde_json::to_value(row).expect("row serializes");
            let cell = |k: &str| match &value[k] {
                Value::Null => String::new(),
                Value::Number(n) => n.to_string(),
                Value::String(x) => x.clone(),
                other => other.to_string(),
            };
            let mut fields = vec![
                (i + 1).to_string(),
                row.tensor.clone(),
                cell("layer"),
                row.module.clone(),
                cell("expert"),
                cell("experts"),
                shape_str(&row.shape),
            ];
            fields.extend(CSV_METRICS.iter().map(|k| cell(k)));
            s += &fields.join(",");
            s += "\n";
        }
    }
    s
}

/// The `--plot` SVG: `metric` per layer, one line per module type (with `--vs`, the ratio
/// pair1/pair2); bad input when no module has per-layer values of `metric`.
pub fn plot_svg(report: &Report, metric: Metric) -> Result<String> {
    let kind = if metric.is_matrix() {
        "matrix"
    } else {
        "vector"
    };
    let series: Vec<Series> = match &report.vs {
        Some((_, ratios)) => ratios
            .iter()
            .filter(|r| r.metric == metric)
            .map(|r| Series {
                label: r.module.clone(),
                points: r
                    .per_layer
                    .iter()
                    .filter_map(|&(l, v)| Some((l as f64, v?)))
                    .collect(),
            })
            .collect(),
        None => norms::summary::layer_modules(&report.pair.rows)
            .into_iter()
            .map(|module| Series {
                points: norms::summary::per_layer(&report.pair.rows, &module, metric)
                    .into_iter()
                    .map(|(l, v)| (l as f64, v))
                    .collect(),
                label: module,
            })
            .filter(|s| !s.points.is_empty())
            .collect(),
    };
    if series.is_empty() {
        bail!(
            "--plot: no {kind} module with per-layer values for --plot-metric {}",
            metric.name()
        );
    }
    let short = |label: &str| {
        label
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(label)
            .to_string()
    };
    let (first, name) = (&report.pair, metric.name());
    let (title, y_label) = match &report.vs {
        Some((second, _)) => (
            format!(
                "{name} ratio per layer: ({} - {}) / ({} - {})",
                short(&first.target),
                short(&first.reference),
                short(&second.target),
                short(&second.reference)
            ),
            format!("{name} ratio pair1/pair2"),
        ),
        None => (
            format!(
                "{name} of {} - {} per layer",
                short(&first.target),
                short(&first.reference)
            ),
            name.to_string(),
        ),
    };
    LineChart {
        title,
        x_label: "layer".into(),
        y_label,
        series,
    }
    .to_svg()
    .map_err(|e| crate::internal!("--plot: {e}"))
}
