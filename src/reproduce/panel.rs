//! `--panel PAIRS.csv`: the pipeline for every pair into `DIR/NAME/`, then a panel report: the
//! pairs' S against their drift and margin, and the predictor's fit when the CSV has a `delta`
//! column (docs/commands/reproduce.md, "Panels").

use std::collections::BTreeSet;
use std::path::Path;

use minijinja::{context, Value as Jinja};
use serde_json::{json, Value};

use crate::analysis::predict::{self, number, split_csv, Point};
use crate::error::Result;
use crate::report::plot::Scatter;
use crate::{bad, bail};

/// The longest pair name: it is a folder name, and the writer's temporary names beside it
/// (`.NAME.sinkmerge-partial-PID-…`) must stay within the file system's 255 bytes.
pub const MAX_NAME: usize = 100;

/// One row of the panel CSV.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub name: String,
    pub reference: String,
    pub vlm: String,
    pub base: Option<String>,
    /// The observed task change, for the predictor's fit.
    pub delta: Option<f64>,
}

/// Read the panel: a header with `name`, `ref`, `vlm` and optionally `base` and `delta`; one
/// pair per line. Names become folder names, so they are plain and unique.
pub fn load(path: &Path) -> Result<Vec<Pair>> {
    let bytes = crate::input::read(path, crate::input::PANEL)?;
    let source = path.display().to_string();
    let text = String::from_utf8(bytes).map_err(|_| bad!("{source}: the panel is not UTF-8"))?;
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.trim().is_empty());
    let (header_line, header) = lines.next().ok_or_else(|| bad!("{source}: empty panel"))?;
    let header: Vec<String> = split_csv(header, &source, header_line)?
        .into_iter()
        .map(|h| h.trim().to_lowercase())
        .collect();
    for (i, h) in header.iter().enumerate() {
        if header[..i].contains(h) {
            bail!("{source}:{header_line}: the header names the column `{h}` twice");
        }
    }
    let column = |name: &str| header.iter().position(|h| h == name);
    let (Some(name_col), Some(ref_col), Some(vlm_col)) =
        (column("name"), column("ref"), column("vlm"))
    else {
        bail!("{source}: the header needs the columns name, ref and vlm (and optionally base, delta); it has {}", header.join(", "));
    };
    let (base_col, delta_col) = (column("base"), column("delta"));
    let mut pairs = Vec::new();
    let mut names = BTreeSet::new();
    for (line, text) in lines {
        let cells = split_csv(text, &source, line)?;
        if cells.len() != header.len() {
            bail!(
                "{source}:{line}: {} cells for {} columns",
                cells.len(),
                header.len()
            );
        }
        let cell = |i: usize| cells[i].trim().to_string();
        let name = cell(name_col);
        if name.is_empty()
            || name.starts_with('.')
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            bail!("{source}:{line}: the name `{name}` is also a folder name: use letters, digits, `-`, `_` and `.`");
        }
        if name.len() > MAX_NAME {
            bail!(
                "{source}:{line}: the name `{name}` is {} bytes, longer than the {MAX_NAME} a pair's \
                 folder name may be",
                name.len()
            );
        }
        if [
            super::PANEL,
            "summary.json",
            "report.html",
            super::pipeline::SLURM_REPORT_JOB,
        ]
        .contains(&name.as_str())
            || name.starts_with("slurm-")
        {
            bail!("{source}:{line}: the name `{name}` is a file the panel writes in its directory; choose another");
        }
        if !names.insert(name.clone()) {
            bail!("{source}:{line}: the name `{name}` appears twice");
        }
        let (reference, vlm) = (cell(ref_col), cell(vlm_col));
        if reference.is_empty() || vlm.is_empty() {
            bail!("{source}:{line}: pair {name} needs both ref and vlm");
        }
        pairs.push(Pair {
            name,
            reference,
            vlm,
            base: base_col.map(cell).filter(|b| !b.is_empty()),
            delta: match delta_col {
                Some(i) => number(&cells[i], &source, line, "delta")?,
                None => None,
            },
        });
    }
    if pairs.is_empty() {
        bail!("{source}: no pairs");
    }
    Ok(pairs)
}

/// The panel's summary from each pair's `summary.json`.
pub fn gather(pairs: &[Pair], dir: &Path) -> Result<Value> {
    let mut rows = Vec::new();
    let mut points = Vec::new();
    for pair in pairs {
        let path = dir.join(&pair.name).join("summary.json");
        let summary = crate::checkpoint::read_json(&path)?;
        let score = |model: &str, key: &str| {
            (summary["scores"].as_array().into_iter().flatten())
                .find(|r| r["model"] == model)
                .map_or(Value::Null, |r| r[key].clone())
        };
        let s = score("ref", "sink_strength");
        if let (Some(x), Some(delta)) = (s.as_f64(), pair.delta) {
            points.push(Point {
                pair: pair.name.clone(),
                sink_strength: x,
                delta,
            });
        }
        rows.push(json!({
            "name": pair.name,
            "ref": pair.reference,
            "vlm": pair.vlm,
            "base": pair.base,
            "sink_strength": s,
            "margin": score("vlm_lm", "margin"),
            "drift": drift(&summary),
            "delta": pair.delta,
            "report": format!("{}/report.html", pair.name),
        }));
    }
    let fit = if points.len() >= 3 {
        match predict::analyze(&points) {
            Ok(a) => json!({
                "n": a.n, "spearman": a.spearman, "pearson": a.pearson,
                "intercept": a.intercept, "slope": a.slope, "loo_mae": a.loo_mae,
            }),
            Err(e) => json!({ "error": e.to_string() }),
        }
    } else if points.is_empty() {
        Value::Null
    } else {
        json!({ "error": format!("the fit needs at least 3 pairs with a delta, the panel has {}", points.len()) })
    };
    Ok(json!({
        "sinkmerge_version": env!("CARGO_PKG_VERSION"),
        "pairs": rows,
        "fit": fit,
    }))
}

/// A pair's drift in one number: the mean over the projections of the median relative
/// operator-norm change ‖ΔW‖₂/‖W‖₂ across layers.
fn drift(summary: &Value) -> Value {
    let modules = summary["drift"]["modules"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let values: Vec<f64> = (modules.iter())
        .filter_map(|m| summary["drift"]["summary"][m.as_str()?]["rel_op"]["median"].as_f64())
        .collect();
    if values.is_empty() {
        Value::Null
    } else {
        json!(values.iter().sum::<f64>() / values.len() as f64)
    }
}

const TEMPLATE: &str = include_str!("panel.html.j2");

/// The panel's page.
pub fn render(summary: &Value) -> Result<String> {
    let pairs = summary["pairs"].as_array().cloned().unwrap_or_default();
    let scatter = |key: &str, label: &str, line: Option<(f64, f64)>| -> Result<Jinja> {
        let chart = Scatter {
            title: format!("Sink Strength S against {label}"),
            x_label: "Sink Strength S of the reference LLM".into(),
            y_label: label.into(),
            points: (pairs.iter())
                .filter_map(|p| {
                    Some((
                        p["sink_strength"].as_f64()?,
                        p[key].as_f64()?,
                        p["name"].as_str()?.to_string(),
                    ))
                })
                .collect(),
            line,
            highlight: None,
        };
        let svg = chart
            .to_svg()
            .map_err(|e| crate::internal!("panel report: {e}"))?;
        let start = svg.find("<svg").unwrap_or(0);
        Ok(Jinja::from_safe_string(svg[start..].to_string()))
    };
    let fit = &summary["fit"];
    let line = fit["slope"]
        .as_f64()
        .zip(fit["intercept"].as_f64())
        .map(|(b, a)| (a, b));
    let figures = vec![
        scatter("drift", "drift (mean relative ‖ΔW‖₂)", None)?,
        scatter("margin", "margin G_base − B_gap", None)?,
    ];
    let delta_figure = (pairs.iter().any(|p| p["delta"].is_number()))
        .then(|| scatter("delta", "observed delta", line))
        .transpose()?;
    let rows: Vec<Jinja> = (pairs.iter().enumerate())
        .map(|(i, p)| {
            let cell = |key: &str, decimals: usize| {
                let text = p[key]
                    .as_f64()
                    .map_or("–".to_string(), |x| format!("{x:.decimals$}"));
                Jinja::from_safe_string(format!(
                    "<td data-key=\"/pairs/{i}/{key}\">{text}</td>"
                ))
            };
            context! {
                name => p["name"].as_str(),
                report => p["report"].as_str(),
                cells => vec![cell("sink_strength", 3), cell("margin", 3), cell("drift", 4), cell("delta", 2)],
            }
        })
        .collect();
    let fit_cells: Vec<Jinja> = [
        ("n", 0),
        ("spearman", 3),
        ("pearson", 3),
        ("slope", 3),
        ("intercept", 3),
        ("loo_mae", 3),
    ]
    .into_iter()
    .map(|(key, decimals)| {
        let text = fit[key]
            .as_f64()
            .map_or("–".to_string(), |x| format!("{x:.decimals$}"));
        Jinja::from_safe_string(format!("<td data-key=\"/fit/{key}\">{text}</td>"))
    })
    .collect();
    let env = super::html::environment("panel.html", TEMPLATE)?;
    env.get_template("panel.html")
        .and_then(|t| {
            t.render(context! {
                rows => rows,
                figures => figures,
                delta_figure => delta_figure,
                fit => Jinja::from(minijinja::value::Serde(fit)),
                fit_cells => fit_cells,
                version => summary["sinkmerge_version"].as_str(),
            })
        })
        .map_err(|e| crate::internal!("panel template: {e}"))
}

/// The text the command prints for a panel: one row per pair.
pub fn text(summary: &Value, dir: &Path) -> String {
    use crate::report::{fmt_opt, Table};
    let mut t = Table::new(["pair", "S", "margin", "drift", "delta"]);
    for p in summary["pairs"].as_array().into_iter().flatten() {
        let f = |key: &str| fmt_opt(p[key].as_f64());
        t.row([
            p["name"].as_str().unwrap_or("").to_string(),
            f("sink_strength"),
            f("margin"),
            f("drift"),
            f("delta"),
        ]);
    }
    let mut out = t.render();
    if let Some(e) = summary["fit"]["error"].as_str() {
        out += &format!("fit: {e}\n");
    } else if let Some(rho) = summary["fit"]["spearman"].as_f64() {
        out += &format!(
            "fit: Spearman {rho:.3} over {} pairs\n",
            summary["fit"]["n"]
        );
    }
    out += &format!(
        "report: {}\nsummary: {}\n",
        dir.join("report.html").display(),
        dir.join("summary.json").display()
    );
    out
}
