//! `sinkmerge norms`: how far TARGET's weights moved from REF's, per tensor and per module type,
//! optionally against a second pair (`--vs`), as a table, JSON, CSV and an SVG plot.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::analysis::norms::{self, DriftReport, LayerSelection, Metric, RatioSeries, Report, Row};
use crate::arch::{LayerList, Module};
use crate::bail;
use crate::checkpoint::{output, Checkpoint};
use crate::error::Result;
use crate::report::plot::{LineChart, Series};
use crate::report::{fmt_num, Table};

#[derive(Debug, clap::Args)]
#[command(
    about = "Weight drift between two checkpoints: operator/Frobenius norms, stable rank, ratios",
    long_about = "Weight drift dW = TARGET - REF, tensor by tensor: for matrices the Frobenius norm \
`fro`, the operator norm `op` (largest singular value), the stable rank fro²/op², and both \
relative to REF (`rel_fro`, `rel_op`); for vectors (norm scales, biases) `l2`, `linf`, \
`rel_l2` and `ref_linf` = ||REF||_inf (the ||γ||_inf of the paper's Theorem 1). MoE experts \
get a row each and one aggregate row per layer (the experts as one block-diagonal map: \
fro = root sum of squares, op = max). Then median and max per module type over all selected \
layers and over the last-K window; with --vs, the same for a second pair and the per-layer ratio \
pair1/pair2 with its window median (the paper's 4.44x on q_proj, Section 3.1).\n\n\
Tensors are matched by their standard language-model names, so a VLM (any supported layout) \
compares with its reference LLM directly; vision tensors are ignored. Differing vocabulary \
rows (embed_tokens, lm_head) are compared on the common rows with a warning; a tied output \
head with no `lm_head` on disk is compared through its embeddings; every other shape mismatch \
or missing tensor is an error.\n\n\
The operator norm is computed by Lanczos with full reorthogonalization, certified to relative \
accuracy --tol by the residual bound of its Ritz value. Tensors stream one at a time straight \
from the mmap'd files (no f32 copy of any tensor); memory stays at the Lanczos vectors and a few \
row buffers.",
    after_help = "Examples:\n  sinkmerge norms qwen2.5-vl:ref ./qwen2.5-vl-lm --last 10 --modules q_proj,k_proj\n  \
sinkmerge norms BASE VLM_LM --vs BASE TEXT_FT --plot drift.svg --json > drift.json"
)]
pub struct Args {
    /// Reference model: directory, HF repo id (`ORG/NAME[@rev]`) or alias
    pub reference: String,
    /// Target model of the same architecture (a VLM is compared through its language model)
    pub target: String,

    /// A second pair REF2 TARGET2: report it too, and the per-layer ratio pair1/pair2
    #[arg(long, num_args = 2, value_names = ["REF2", "TARGET2"])]
    pub vs: Option<Vec<String>>,

    /// Module types to report, comma-separated (default: all). Names: embed_tokens, lm_head,
    /// norm, input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
    /// post_feedforward_layernorm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, gate_proj,
    /// up_proj, down_proj, router, expert_gate_proj, expert_up_proj, expert_down_proj,
    /// experts_gate_up_proj, experts_down_proj. A projection's bias comes with it.
    #[arg(long, value_delimiter = ',', value_name = "LIST", value_parser = parse_module)]
    pub modules: Option<Vec<Module>>,

    /// Layers to report: `0-3,7` (0-based, inclusive ranges) or `18:28` (a half-open slice, as
    /// in Python; `18:` and `:4` are open-ended). Top-level tensors (embeddings, final norm,
    /// lm_head) are reported only without --layers/--last
    #[arg(long, value_name = "LIST", conflicts_with = "last")]
    pub layers: Option<LayerList>,

    /// Report only the last K layers
    #[arg(long, value_name = "K")]
    pub last: Option<usize>,

    /// Summary window: the model's last K layers (the paper's late-layer window)
    #[arg(long, value_name = "K", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub window: u64,

    /// Print one JSON object {"rows": [...], "summary": {...}, ...} instead of tables
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,

    /// Also write every row to FILE as CSV (atomically)
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,

    /// Write an SVG plot: one line per module type, --plot-metric against layer index (with
    /// --vs, the ratio pair1/pair2 of that metric)
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Metric plotted by --plot; matrix metrics plot matrices, vector metrics (l2, linf,
    /// rel-l2, ref-linf) plot norm scales and biases
    #[arg(long, value_enum, default_value_t = Metric::Op, value_name = "METRIC")]
    pub plot_metric: Metric,

    /// Relative accuracy of each operator norm, certified by the Lanczos residual bound
    /// (1e-7 to 0.1; f32 arithmetic limits it near 1e-7)
    #[arg(long, value_name = "TOL", default_value_t = 1e-6, value_parser = parse_tol)]
    pub tol: f64,
}

fn parse_module(s: &str) -> std::result::Result<Module, String> {
    Module::from_short_name(s.trim()).ok_or_else(|| {
        let names: Vec<&str> = Module::ALL.iter().map(|m| m.short_name()).collect();
        format!("unknown module `{s}`; known: {}", names.join(", "))
    })
}

fn parse_tol(s: &str) -> std::result::Result<f64, String> {
    let tol: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !(1e-7..=0.1).contains(&tol) {
        return Err(format!("{tol:e} is outside 1e-7..=0.1"));
    }
    Ok(tol)
}

pub fn run(args: Args, progress: bool) -> Result<()> {
    let reference = Checkpoint::open_ref(&args.reference)?;
    let target = Checkpoint::open_ref(&args.target)?;
    let vs = match &args.vs {
        Some(v) => Some((Checkpoint::open_ref(&v[0])?, Checkpoint::open_ref(&v[1])?)),
        None => None,
    };
    let mut inputs: Vec<&Path> = vec![&reference.dir, &target.dir];
    if let Some((r, t)) = &vs {
        inputs.extend([r.dir.as_path(), t.dir.as_path()]);
    }
    for path in args.csv.iter().chain(&args.plot) {
        output::check_report_file(path, &inputs)?;
    }
    if args.csv.is_some() && args.csv == args.plot {
        bail!("--csv and --plot name the same file");
    }

    let options = norms::Options {
        modules: args.modules.clone(),
        layers: match (args.layers, args.last) {
            (Some(l), _) => LayerSelection::List(l),
            (None, Some(k)) => LayerSelection::Last(k),
            (None, None) => LayerSelection::All,
        },
        window: args.window as usize,
        tol: args.tol,
    };
    let report = norms::run(
        &reference,
        &target,
        vs.as_ref().map(|(r, t)| (r, t)),
        &options,
        progress && !args.json,
    )?;

    // Build every output before writing any, so a failure leaves nothing behind.
    let svg = match &args.plot {
        Some(_) => Some(plot(&report, args.plot_metric)?),
        None => None,
    };
    let csv = args.csv.as_ref().map(|_| csv(&report));
    if let (Some(path), Some(svg)) = (&args.plot, svg) {
        output::write_file_atomic(path, svg.as_bytes())?;
    }
    if let (Some(path), Some(csv)) = (&args.csv, csv) {
        output::write_file_atomic(path, csv.as_bytes())?;
    }
    if args.json {
        let value = to_json(&report, args.tol);
        println!("{}", serde_json::to_string_pretty(&value).expect("JSON"));
    } else {
        print!("{}", render(&report, args.tol));
    }
    for w in &report.warnings {
        eprintln!("sinkmerge: warning: {w}");
    }
    Ok(())
}

fn opt_num(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_string(), fmt_num)
}

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

fn render(report: &Report, tol: f64) -> String {
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
    let note = |h: &Option<crate::checkpoint::resolve::HubRef>| {
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
        match &row.metrics {
            norms::Metrics::Matrix(m) => matrices.row([
                layer(row),
                row.module.clone(),
                shape_str(&row.shape),
                fmt_num(m.fro),
                fmt_num(m.op),
                opt_num(m.stable_rank),
                opt_num(m.rel_fro),
                opt_num(m.rel_op),
            ]),
            norms::Metrics::Vector(v) => vectors.row([
                layer(row),
                row.module.clone(),
                shape_str(&row.shape),
                fmt_num(v.l2),
                fmt_num(v.linf),
                opt_num(v.rel_l2),
                fmt_num(v.ref_linf),
            ]),
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
                    opt_num(all.median),
                    opt_num(all.max),
                    opt_num(win.median),
                    opt_num(win.max),
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
            opt_num(r.window.median),
            opt_num(r.window.max),
            opt_num(r.all.median),
            r.all.count.to_string(),
        ]);
        last_module = &r.module;
    }
    t.render()
}

fn stat_json(s: &norms::MedianMax) -> Value {
    json!({"median": s.median, "max": s.max, "count": s.count})
}

fn summary_json(pair: &DriftReport) -> Value {
    let mut modules = Map::new();
    for m in &pair.summary.modules {
        let (mut all, mut win) = (Map::new(), Map::new());
        for (metric, a, w) in &m.stats {
            all.insert(metric.name().into(), stat_json(a));
            win.insert(metric.name().into(), stat_json(w));
        }
        modules.insert(m.module.clone(), json!({"all": all, "window": win}));
    }
    Value::Object(modules)
}

fn pair_json(pair: &DriftReport) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("reference".into(), json!(pair.reference));
    out.insert("target".into(), json!(pair.target));
    // The resolved commits of Hub models (absent for directories).
    for (key, hub) in [("reference_hub", &pair.hub.0), ("target_hub", &pair.hub.1)] {
        if let Some(h) = hub {
            out.insert(key.into(), json!(h));
        }
    }
    out.insert(
        "ignored".into(),
        json!({"reference": pair.ignored.0, "target": pair.ignored.1}),
    );
    out.insert(
        "rows".into(),
        serde_json::to_value(&pair.rows).expect("rows serialize"),
    );
    out.insert("summary".into(), summary_json(pair));
    out
}

fn to_json(report: &Report, tol: f64) -> Value {
    let mut out = pair_json(&report.pair);
    out.insert("num_layers".into(), json!(report.num_layers));
    out.insert(
        "window".into(),
        json!({"size": report.window.len(), "layers": report.window.clone().collect::<Vec<_>>()}),
    );
    out.insert("tol".into(), json!(tol));
    if let Some((second, ratios)) = &report.vs {
        let mut vs = pair_json(second);
        let mut by_module = Map::new();
        for r in ratios {
            let entry = by_module
                .entry(r.module.clone())
                .or_insert_with(|| Value::Object(Map::new()));
            entry[r.metric.name()] = json!({
                "layers": r.per_layer.iter().map(|p| p.0).collect::<Vec<_>>(),
                "values": r.per_layer.iter().map(|p| p.1).collect::<Vec<_>>(),
                "median": r.all.median,
                "max": r.all.max,
                "median_window": r.window.median,
                "max_window": r.window.max,
            });
        }
        vs.insert("ratio".into(), Value::Object(by_module));
        out.insert("vs".into(), Value::Object(vs));
    }
    out.insert("warnings".into(), json!(report.warnings));
    Value::Object(out)
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

fn csv(report: &Report) -> String {
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

fn plot(report: &Report, metric: Metric) -> Result<String> {
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
