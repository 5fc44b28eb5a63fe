//! `report.html`: one self-contained page (inline CSS and SVG, no script, no external asset)
//! rendered from `summary.json` alone, plus the heads step's own heatmap. Every number cell
//! names the summary key it shows (`data-key`, a JSON pointer), so a test can check the page
//! against the summary.

use std::path::Path;

use minijinja::{context, Environment, Value as Jinja};
use serde_json::Value;

use super::plan;
use crate::error::{Error, Result};
use crate::report::fmt_num;
use crate::report::plot::{stacked_bars_svg, stacked_svg, BarChart, LineChart, Scatter, Series};
use crate::units::human_bytes;

const TEMPLATE: &str = include_str!("report.html.j2");
/// The style both pages share.
const CSS: &str = include_str!("report.css");

/// A template environment holding the page `name` and the shared style.
pub fn environment(name: &'static str, template: &'static str) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    env.add_template("report.css", CSS)
        .and_then(|()| env.add_template(name, template))
        .map_err(|e| crate::internal!("report template {name}: {e}"))?;
    Ok(env)
}

/// How a number is written, as the text reports write it.
#[derive(Clone, Copy)]
enum Format {
    /// Fixed decimals.
    Fixed(usize),
    /// Fixed decimals with a sign (a Δ).
    Signed(usize),
    /// 4 significant digits, scientific when tiny or huge ([`fmt_num`]).
    Compact,
    /// A whole number.
    Integer,
}

/// One `<td>` holding the number at `pointer` in the summary.
fn cell(summary: &Value, pointer: &str, format: Format) -> Jinja {
    let value = summary.pointer(pointer).unwrap_or(&Value::Null);
    let text = match (value.as_f64(), format) {
        (None, _) => "–".to_string(),
        (Some(x), Format::Fixed(d)) => format!("{x:.d$}"),
        (Some(x), Format::Signed(d)) => format!("{x:+.d$}"),
        (Some(x), Format::Compact) => fmt_num(x),
        (Some(x), Format::Integer) => format!("{}", x as i64),
    };
    let class = match (value.as_f64(), format) {
        (Some(x), Format::Signed(_)) if x < 0.0 => " class=\"neg\"",
        (Some(x), Format::Signed(_)) if x > 0.0 => " class=\"pos\"",
        _ => "",
    };
    Jinja::from_safe_string(format!(
        "<td data-key=\"{}\"{class}>{text}</td>",
        escape(pointer)
    ))
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An SVG for inline use: the XML prolog (if any) dropped; plotters writes a viewBox, so CSS
/// scales it to the page's width.
fn inline_svg(svg: &str) -> Jinja {
    let start = svg.find("<svg").unwrap_or(0);
    Jinja::from_safe_string(svg[start..].to_string())
}

fn plot_err(e: String) -> Error {
    Error::Internal(format!("report: {e}"))
}

/// Render the report of a run whose summary is `summary`.
pub fn render(summary: &Value, dir: &Path) -> Result<String> {
    let s = summary;
    let str_at = |p: &str| {
        s.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };

    let identity = |p: &str| match s.pointer(p) {
        Some(id) if id["kind"] == "hub" => format!("commit {}", id["value"].as_str().unwrap_or("")),
        Some(id) if id.is_object() => format!("xxh3-128 {}", id["value"].as_str().unwrap_or("")),
        _ => "–".into(),
    };
    let mut models = vec![
        context! {
            role => "reference LLM",
            input => str_at("/models/ref/input"),
            identity => identity("/models/ref/identity"),
            architecture => str_at("/models/ref/inspect/architecture"),
            parameters => cell(s, "/models/ref/inspect/parameters", Format::Integer),
            layers => cell(s, "/models/ref/inspect/layers", Format::Integer),
        },
        context! {
            role => "VLM",
            input => str_at("/models/vlm/input"),
            identity => identity("/models/vlm/identity"),
            architecture => format!("{} (family {})", str_at("/models/vlm/inspect/architecture"), str_at("/models/vlm/family")),
            parameters => cell(s, "/models/vlm/inspect/parameters", Format::Integer),
            layers => cell(s, "/models/vlm/inspect/layers", Format::Integer),
        },
        context! {
            role => "VLM's language model",
            input => str_at("/models/vlm_lm/path"),
            identity => "extracted by the extract step",
            architecture => str_at("/models/vlm_lm/architecture"),
            parameters => Jinja::from_safe_string("<td>–</td>".into()),
            layers => cell(s, "/models/vlm/inspect/layers", Format::Integer),
        },
    ];
    if s["models"]["base"].is_object() {
        models.push(context! {
            role => "base LLM",
            input => str_at("/models/base/input"),
            identity => identity("/models/base/identity"),
            architecture => str_at("/models/base/architecture"),
            parameters => Jinja::from_safe_string("<td>–</td>".into()),
            layers => Jinja::from_safe_string("<td>–</td>".into()),
        });
    }

    let drift = (s["drift"].is_object()).then(|| drift(s)).transpose()?;
    let scores = s["scores"].as_array().cloned().unwrap_or_default();
    let score_rows: Vec<Jinja> = (scores.iter().enumerate())
        .map(|(i, r)| {
            let p = |k: &str| format!("/scores/{i}/{k}");
            let cells = vec![
                cell(s, &p("sink_strength"), Format::Fixed(3)),
                cell(s, &p("delta_vs_vlm_lm/sink_strength"), Format::Signed(3)),
                cell(s, &p("margin"), Format::Fixed(3)),
                cell(s, &p("delta_vs_vlm_lm/margin"), Format::Signed(3)),
                cell(s, &p("pos0_trailing"), Format::Fixed(4)),
                cell(s, &p("pos0_trailing_ci/0"), Format::Fixed(4)),
                cell(s, &p("pos0_trailing_ci/1"), Format::Fixed(4)),
                cell(s, &p("delta_vs_vlm_lm/pos0_trailing"), Format::Signed(4)),
                cell(s, &p("perplexity"), Format::Fixed(2)),
                cell(s, &p("delta_vs_vlm_lm/perplexity"), Format::Signed(2)),
                cell(s, &p("sink_strength_bands/early"), Format::Fixed(3)),
                cell(s, &p("sink_strength_bands/middle"), Format::Fixed(3)),
                cell(s, &p("sink_strength_bands/late"), Format::Fixed(3)),
            ];
            context! { model => r["model"].as_str(), title => r["title"].as_str(), cells => cells }
        })
        .collect();
    let merge_notes: Vec<String> = (s["merges"].as_array().into_iter().flatten())
        .filter(|m| m["status"] == "skipped")
        .map(|m| {
            format!(
                "{} ({}): skipped, {}.",
                m["setting"].as_str().unwrap_or(""),
                m["title"].as_str().unwrap_or(""),
                m["reason"].as_str().unwrap_or("")
            )
        })
        .chain(s["models"]["base"].is_null().then(|| {
            "Without --base, the task-vector settings take the reference as the base and the \
             VLM's language model as the only task model; task arithmetic and TSV then return \
             the VLM-LM itself (merge-configs/README.md)."
                .to_string()
        }))
        .collect();
    let labels: Vec<String> = scores
        .iter()
        .map(|r| r["model"].as_str().unwrap_or("").to_string())
        .collect();
    let bars = (!scores.is_empty())
        .then(|| {
            let chart = |key: &str, title: &str, y_label: &str| BarChart {
                title: title.into(),
                y_label: y_label.into(),
                bars: (labels.iter().zip(&scores))
                    .map(|(l, r)| (l.clone(), r[key].as_f64()))
                    .collect(),
            };
            stacked_bars_svg(&[
                chart("sink_strength", "Sink Strength S", "S"),
                chart(
                    "margin",
                    "Margin G_base - B_gap against the reference",
                    "margin",
                ),
                chart("perplexity", "Perplexity on the text", "perplexity"),
            ])
            .map(|svg| inline_svg(&svg))
        })
        .transpose()
        .map_err(plot_err)?;
    let curves = (!scores.is_empty())
        .then(|| {
            let series = |key: &str| -> Vec<Series> {
                (labels.iter().zip(&scores))
                    .map(|(l, r)| Series {
                        label: l.clone(),
                        points: (r["per_layer"].as_array().into_iter().flatten())
                            .filter_map(|x| Some((x["layer"].as_f64()?, x[key].as_f64()?)))
                            .collect(),
                    })
                    .collect()
            };
            stacked_svg(&[
                LineChart {
                    title: "Median sink gap G per layer".into(),
                    x_label: "layer".into(),
                    y_label: "median G = log(a / (1 - a))".into(),
                    series: series("median_g"),
                },
                LineChart {
                    title: "Attention share of token 0 per layer".into(),
                    x_label: "layer".into(),
                    y_label: "pos0 share".into(),
                    series: series("pos0_share"),
                },
            ])
            .map(|svg| inline_svg(&svg))
        })
        .transpose()
        .map_err(plot_err)?;

    let heads = (s["heads"].is_object())
        .then(|| -> Result<Jinja> {
            let path = plan::step_dir(dir, "heads").join("heatmap.svg");
            let svg =
                std::fs::read_to_string(&path).map_err(|source| Error::Read { path, source })?;
            let top: Vec<Vec<Jinja>> = (0..s["heads"]["top"].as_array().map_or(0, Vec::len))
                .map(|i| {
                    let p = |k: &str| format!("/heads/top/{i}/{k}");
                    vec![
                        cell(s, &p("rank"), Format::Integer),
                        cell(s, &p("layer"), Format::Integer),
                        cell(s, &p("head"), Format::Integer),
                        cell(s, &p("delta_g"), Format::Signed(3)),
                        cell(s, &p("g_base_median"), Format::Fixed(3)),
                        cell(s, &p("g_target_median"), Format::Fixed(3)),
                        cell(s, &p("margin"), Format::Fixed(3)),
                        cell(s, &p("pos0_before"), Format::Fixed(4)),
                        cell(s, &p("pos0_after"), Format::Fixed(4)),
                        cell(s, &p("q_rel_op"), Format::Fixed(3)),
                        cell(s, &p("k_rel_op"), Format::Fixed(3)),
                    ]
                })
                .collect();
            Ok(context! {
                figure => inline_svg(&svg),
                top => top,
                n_heads => s["heads"]["n_heads"].as_u64(),
                rank_by => s["heads"]["rank_by"].as_str(),
            })
        })
        .transpose()?;

    let predictor = (s["predictor"].is_object())
        .then(|| -> Result<Jinja> {
            let p = &s["predictor"];
            let scatter = Scatter {
                title: format!(
                    "Sink strength vs {} ({} pairs)",
                    p["task"].as_str().unwrap_or(""),
                    p["n"]
                ),
                x_label: "Sink Strength S of the reference LLM".into(),
                y_label: format!("{} (VLM - LLM, points)", p["task"].as_str().unwrap_or("")),
                points: (p["points"].as_array().into_iter().flatten())
                    .filter_map(|x| {
                        Some((
                            x["sink_strength"].as_f64()?,
                            x["observed"].as_f64()?,
                            x["pair"].as_str()?.to_string(),
                        ))
                    })
                    .collect(),
                line: Some((
                    p["intercept"].as_f64().unwrap_or(0.0),
                    p["slope"].as_f64().unwrap_or(0.0),
                )),
                highlight: match (p["sink_strength"].as_f64(), p["predicted"].as_f64()) {
                    (Some(x), Some(y)) => Some((x, y, "this pair (predicted)".into())),
                    _ => None,
                },
            };
            let svg = scatter.to_svg().map_err(plot_err)?;
            let k = |key: &str| format!("/predictor/{key}");
            Ok(context! {
                panel => p["panel"].as_str(),
                task => p["task"].as_str(),
                figure => inline_svg(&svg),
                cells => vec![
                    cell(s, &k("sink_strength"), Format::Fixed(3)),
                    cell(s, &k("predicted"), Format::Signed(2)),
                    cell(s, &k("rank"), Format::Integer),
                    cell(s, &k("of"), Format::Integer),
                    cell(s, &k("spearman"), Format::Fixed(3)),
                    cell(s, &k("pearson"), Format::Fixed(3)),
                    cell(s, &k("slope"), Format::Fixed(3)),
                    cell(s, &k("intercept"), Format::Fixed(3)),
                    cell(s, &k("loo_mae"), Format::Fixed(3)),
                ],
            })
        })
        .transpose()?;

    let steps: Vec<Jinja> = (s["steps"].as_array().into_iter().flatten())
        .map(|st| {
            let status = match st["reason"].as_str() {
                Some(why) => format!("skipped ({why})"),
                None => st["status"].as_str().unwrap_or("").to_string(),
            };
            context! {
                name => st["name"].as_str(),
                status => status,
                command => st["command"].as_str().unwrap_or("–"),
            }
        })
        .collect();
    let saved = s["space_saved_bytes"].as_u64().unwrap_or(0);
    let space_note = if s["keep_models"] == true {
        "The merged models are kept under models/ (--keep-models).".to_string()
    } else {
        format!(
            "Each merged model was deleted once scored, saving {} of disk; --keep-models keeps them.",
            human_bytes(saved)
        )
    };
    let title = format!(
        "{} against {}",
        str_at("/models/vlm/input"),
        str_at("/models/ref/input")
    );
    let text = str_at("/text");

    // Plain strings: the template escapes them (an .html template autoescapes).
    let answers = s["answers"].is_object().then(|| {
        let a = &s["answers"];
        let text = |v: &Value| v.as_str().unwrap_or("–").to_string();
        let models: Vec<Jinja> = (a["models"].as_array().into_iter().flatten())
            .map(|m| context! { title => text(&m["title"]) })
            .collect();
        let rows: Vec<Jinja> = (a["prompts"].as_array().into_iter().flatten().enumerate())
            .map(|(i, p)| {
                let cells: Vec<Jinja> = (p["answers"].as_array().into_iter().flatten())
                    .enumerate()
                    .map(|(j, x)| {
                        context! {
                            // A pointer of digits and fixed names: nothing to escape.
                            key => Jinja::from_safe_string(format!(
                                "/answers/prompts/{i}/answers/{j}/text"
                            )),
                            text => text(&x["text"]),
                            stop_reason => text(&x["stop_reason"]),
                        }
                    })
                    .collect();
                context! { prompt => text(&p["prompt"]), answers => cells }
            })
            .collect();
        context! {
            max_new_tokens => a["max_new_tokens"].as_u64(),
            models => models,
            rows => rows,
        }
    });

    let env = environment("report.html", TEMPLATE)?;
    env.get_template("report.html")
        .and_then(|t| {
            t.render(context! {
                title => title,
                version => s["sinkmerge_version"].as_str(),
                models => models,
                drift => drift,
                scores => score_rows,
                merge_notes => merge_notes,
                bars => bars,
                space_note => space_note,
                curves => curves,
                heads => heads,
                predictor => predictor,
                answers => answers,
                steps => steps,
                text => text,
            })
        })
        .map_err(|e| crate::internal!("report template: {e}"))
}

/// The drift section: the plots of operator norm and stable rank per layer, and the command's
/// medians and maxima per module.
fn drift(s: &Value) -> Result<Jinja> {
    let d = &s["drift"];
    let names = |key: &str| -> Vec<String> {
        (d[key].as_array().into_iter().flatten())
            .filter_map(|m| m.as_str().map(str::to_string))
            .collect()
    };
    let modules = names("modules");
    let gammas = names("gamma_modules");
    let layers = d["layers"].as_array().cloned().unwrap_or_default();
    let series = |key: &str| -> Vec<Series> {
        (modules.iter())
            .map(|m| Series {
                label: m.clone(),
                points: (layers.iter())
                    .filter_map(|l| Some((l["layer"].as_f64()?, l[key][m].as_f64()?)))
                    .collect(),
            })
            .collect()
    };
    let svg = stacked_svg(&[
        LineChart {
            title: "Operator norm of ΔW per layer".into(),
            x_label: "layer".into(),
            y_label: "||ΔW||_2".into(),
            series: series("op"),
        },
        LineChart {
            title: "Stable rank of ΔW per layer".into(),
            x_label: "layer".into(),
            y_label: "||ΔW||_F^2 / ||ΔW||_2^2".into(),
            series: series("stable_rank"),
        },
    ])
    .map_err(plot_err)?;
    let rows: Vec<Jinja> = (modules.iter())
        .map(|m| {
            let p = |k: &str| format!("/drift/summary/{m}/{k}");
            context! {
                module => m,
                cells => vec![
                    cell(s, &p("op/median"), Format::Compact),
                    cell(s, &p("op/max"), Format::Compact),
                    cell(s, &p("stable_rank/median"), Format::Compact),
                    cell(s, &p("stable_rank/max"), Format::Compact),
                    cell(s, &p("rel_op/median"), Format::Compact),
                    cell(s, &p("rel_fro/median"), Format::Compact),
                ],
            }
        })
        .collect();
    let gamma_rows: Vec<Jinja> = (gammas.iter())
        .map(|m| {
            let p = |k: &str| format!("/drift/summary/{m}/{k}");
            context! {
                module => m,
                cells => vec![
                    cell(s, &p("rel_l2/median"), Format::Compact),
                    cell(s, &p("rel_l2/max"), Format::Compact),
                    cell(s, &p("l2/median"), Format::Compact),
                    cell(s, &p("linf/max"), Format::Compact),
                ],
            }
        })
        .collect();
    Ok(context! {
        figure => inline_svg(&svg),
        rows => rows,
        gamma_rows => gamma_rows,
    })
}

/// Write `report.html` into `dir`.
pub fn write(dir: &Path, html: &str) -> Result<()> {
    crate::checkpoint::output::write_file_atomic(&dir.join("report.html"), html.as_bytes())
}
