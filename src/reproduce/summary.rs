//! `summary.json`: every number the report shows, copied from the steps' own reports (so each
//! equals what the standalone command prints), under the keys docs/commands/reproduce.md
//! documents. Nothing in it depends on timing, so a resumed run's summary equals an
//! uninterrupted one's.

use std::path::Path;

use indexmap::IndexMap;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

use super::pipeline::{read_step_report, Prepared, REMOVED};
use super::plan::{self, SETTINGS};
use crate::analysis::inspect::Inspection;
use crate::analysis::norms::Metrics;
use crate::error::Result;
use crate::extract::Summary as Extraction;
use crate::generate::decode::Answer;
use crate::report::heads::HeadsReport;
use crate::report::norms::NormsJson;
use crate::report::predict::PredictJson;
use crate::sink::score::Scores;

/// The heads the report lists, most damaged first.
pub const TOP_HEADS: usize = 10;

/// Gather the summary of a finished run.
pub fn gather(prepared: &Prepared) -> Result<Value> {
    let dir = prepared.options.dir.as_path();
    let scores = scores(&|name: &str| step_report::<Scores>(prepared, name))?;
    let mut space_saved = 0u64;
    let merges: Vec<Value> = SETTINGS
        .iter()
        .filter(|s| prepared.options.merges.contains(&s.name))
        .map(|setting| {
            let name = plan::merge_step(setting.name);
            let method = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(setting.yaml)
                .ok()
                .and_then(|v| v["merge_method"].as_str().map(str::to_string));
            let (status, reason) = if setting.needs_base && prepared.options.base.is_none() {
                (
                    "skipped",
                    Some("needs --base (task vectors from a pretrained base)".to_string()),
                )
            } else if let Some((_, why)) = prepared.skipped.iter().find(|(n, _)| *n == name) {
                ("skipped", Some(why.clone()))
            } else {
                ("done", None)
            };
            let removed = std::fs::read(plan::step_dir(dir, &name).join(REMOVED))
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .and_then(|v| v["bytes"].as_u64());
            space_saved += removed.unwrap_or(0);
            json!({
                "setting": setting.name,
                "title": setting.title,
                "method": method,
                "status": status,
                "reason": reason,
                "removed_bytes": removed,
            })
        })
        .collect();

    let steps: Vec<Value> = (prepared.steps.iter())
        .map(|s| {
            let manifest = super::pipeline::read_manifest(dir, &s.name);
            json!({
                "name": s.name,
                "role": s.role,
                "status": "done",
                "command": manifest.map(|m| m.command),
            })
        })
        .chain(prepared.skipped.iter().map(|(name, why)| {
            json!({ "name": name, "status": "skipped", "reason": why, "command": null })
        }))
        .collect();

    let mut summary = json!({
        "sinkmerge_version": env!("CARGO_PKG_VERSION"),
        "models": models(prepared)?,
        "drift": step_report::<NormsJson>(prepared, "norms")?.map(|n| drift(&n)),
        "scores": scores,
        "merges": merges,
        "heads": step_report::<HeadsReport>(prepared, "heads")?.map(|h| heads(&h)),
        "predictor": step_report::<PredictJson>(prepared, "predict")?.map(|p| predictor(&p)),
        "answers": answers(prepared)?,
        "steps": steps,
        "text": prepared.text,
        "keep_models": prepared.options.keep_models,
        "space_saved_bytes": space_saved,
    });
    // A run without --answers writes the summary it wrote before the flag existed.
    if !prepared.options.answers {
        if let Some(map) = summary.as_object_mut() {
            map.shift_remove("answers");
        }
    }
    Ok(summary)
}

/// The report of step `name` as the struct its command serialised, when the run has the step.
fn step_report<T: DeserializeOwned>(prepared: &Prepared, name: &str) -> Result<Option<T>> {
    let ran = prepared.steps.iter().any(|s| s.name == name);
    ran.then(|| read_step_report(&prepared.options.dir, name))
        .transpose()
}

fn models(prepared: &Prepared) -> Result<Value> {
    let identity = |input: &str| {
        (prepared.identities.values().flatten())
            .find(|id| id.input == input)
            .map(|id| json!({ "kind": id.kind, "value": id.value }))
    };
    let inspected = |name: &str| -> Result<Value> {
        Ok(
            step_report::<Inspection>(prepared, name)?.map_or(Value::Null, |r| {
                json!({
                    "architecture": r.architecture,
                    "model_type": r.model_type,
                    "family": r.family,
                    "parameters": r.num_parameters,
                    "bytes": r.total_bytes,
                    "layers": r.num_layers,
                    "dtypes": r.dtypes,
                })
            }),
        )
    };
    let o = &prepared.options;
    let extract = step_report::<Extraction>(prepared, "extract")?;
    Ok(json!({
        "ref": { "input": o.reference, "identity": identity(&o.reference), "inspect": inspected("inspect-ref")? },
        "vlm": { "input": o.vlm, "identity": identity(&o.vlm), "family": prepared.models.family, "inspect": inspected("inspect-vlm")? },
        "vlm_lm": {
            // As the plan names it (relative where DIR is), not the absolute path extract prints.
            "path": prepared.steps.iter().find_map(|s| s.model.as_ref().filter(|_| s.name == "extract")),
            "architecture": extract.as_ref().map(|e| &e.architecture),
            "tensors": extract.as_ref().map(|e| e.tensors_written),
            "bytes": extract.as_ref().map(|e| e.bytes_written),
        },
        "base": (o.base.as_ref().zip(prepared.models.base.as_ref())).map(|(b, ckpt)| json!({
            "input": b,
            "identity": identity(b),
            "architecture": ckpt.config["architectures"][0],
        })),
    }))
}

/// One layer of the drift: by module, each projection's operator norm and stable rank of ΔW,
/// and each norm scale's relative change.
#[derive(Serialize)]
struct DriftLayer {
    layer: usize,
    op: IndexMap<String, f64>,
    stable_rank: IndexMap<String, Option<f64>>,
    gamma_rel_l2: IndexMap<String, Option<f64>>,
}

/// Per layer: each projection's operator norm and stable rank of ΔW, and each norm scale's
/// relative change (the γ drift); with the command's own medians and maxima.
fn drift(norms: &NormsJson) -> Value {
    let mut modules: Vec<&str> = Vec::new();
    let mut gammas: Vec<&str> = Vec::new();
    let mut layers: Vec<DriftLayer> = Vec::new();
    for row in &norms.pair.rows {
        let Some(layer) = row.layer else { continue };
        while layers.len() <= layer {
            layers.push(DriftLayer {
                layer: layers.len(),
                op: IndexMap::new(),
                stable_rank: IndexMap::new(),
                gamma_rel_l2: IndexMap::new(),
            });
        }
        let entry = &mut layers[layer];
        let module = row.module.as_str();
        match &row.metrics {
            Metrics::Matrix(m) => {
                if !modules.contains(&module) {
                    modules.push(module);
                }
                entry.op.insert(module.into(), m.op);
                entry.stable_rank.insert(module.into(), m.stable_rank);
            }
            Metrics::Vector(v) => {
                if !gammas.contains(&module) {
                    gammas.push(module);
                }
                entry.gamma_rel_l2.insert(module.into(), v.rel_l2);
            }
        }
    }
    let summary: IndexMap<&str, _> = (norms.pair.summary.iter())
        .map(|(module, s)| (module.as_str(), &s.all))
        .collect();
    json!({
        "modules": modules,
        "gamma_modules": gammas,
        "layers": layers,
        "summary": summary,
    })
}

/// One row per scored model: the reference, the VLM-LM and each merge, with Δ against the
/// VLM-LM.
fn scores(report: &dyn Fn(&str) -> Result<Option<Scores>>) -> Result<Vec<Value>> {
    let mut rows = Vec::new();
    let mut models: Vec<(String, String)> = vec![
        ("ref".into(), "reference LLM".into()),
        ("vlm_lm".into(), "VLM's language model".into()),
    ];
    for setting in &SETTINGS {
        models.push((setting.name.into(), setting.title.into()));
    }
    for (model, title) in models {
        let step = plan::score_step(&model.replace('_', "-"));
        let Some(r) = report(&step)? else { continue };
        // The reference is scored alone; every other model against it, as the second model.
        let (index, pair) = if model == "ref" {
            (0, None)
        } else {
            (1, r.pairs.first().map(|p| &p.statistics))
        };
        let m = r.models.get(index).ok_or_else(|| {
            crate::bad!(
                "step {step}: its report has {} model(s), not {}",
                r.models.len(),
                index + 1
            )
        })?;
        let s = &m.statistics;
        let per_layer: Vec<Value> = (m.per_layer.iter())
            .map(
                |l| json!({ "layer": l.layer, "median_g": l.median_g, "pos0_share": l.pos0_share }),
            )
            .collect();
        rows.push(json!({
            "model": model,
            "title": title,
            "step": step,
            "path": m.path,
            "sink_strength": s.sink_strength,
            "margin": pair.and_then(|p| p.margin),
            "b_gap_median": pair.and_then(|p| p.b_gap_median),
            "g_base_median": pair.and_then(|p| p.g_base_median),
            "pos0_share": s.pos0_share,
            "pos0_trailing": s.pos0_trailing,
            "pos0_trailing_ci": s.pos0_trailing_ci,
            "strong_sink_frac": s.strong_sink_frac,
            "sink_strength_bands": s.sink_strength_bands,
            "margin_bands": pair.and_then(|p| p.margin_bands),
            "text_loss": m.text.as_ref().map(|t| t.loss),
            "perplexity": m.text.as_ref().map(|t| t.perplexity),
            "per_layer": per_layer,
        }));
    }
    let baseline = rows.iter().find(|r| r["model"] == "vlm_lm").cloned();
    for row in &mut rows {
        let delta = |key: &str| match (&baseline, row[key].as_f64()) {
            (Some(b), Some(x)) => b[key].as_f64().map(|y| json!(x - y)).unwrap_or(Value::Null),
            _ => Value::Null,
        };
        let d = json!({
            "sink_strength": delta("sink_strength"),
            "margin": delta("margin"),
            "pos0_trailing": delta("pos0_trailing"),
            "perplexity": delta("perplexity"),
        });
        row["delta_vs_vlm_lm"] = d;
    }
    Ok(rows)
}

/// `--answers`: the models that answered (in the plan's order: the reference, the VLM-LM, each
/// merge), and per prompt each one's greedy answer and why it stopped; `null` without it.
fn answers(prepared: &Prepared) -> Result<Value> {
    if !prepared.options.answers {
        return Ok(Value::Null);
    }
    let mut models: Vec<(String, String)> = vec![
        ("ref".into(), "reference LLM".into()),
        ("vlm_lm".into(), "VLM's language model".into()),
    ];
    for setting in &SETTINGS {
        models.push((setting.name.into(), setting.title.into()));
    }
    let prompts = plan::answer_prompts();
    let mut columns = Vec::new();
    let mut rows: Vec<Vec<Value>> = vec![Vec::new(); prompts.len()];
    for (model, title) in models {
        let step = plan::answers_step(&model.replace('_', "-"));
        let Some(report) = step_report::<Vec<Answer>>(prepared, &step)? else {
            continue;
        };
        if report.len() != prompts.len() {
            crate::bail!(
                "step {step}: its report has {} answer(s), not one per prompt ({})",
                report.len(),
                prompts.len()
            );
        }
        for (row, a) in rows.iter_mut().zip(report) {
            row.push(json!({ "model": model, "text": a.text, "stop_reason": a.stop_reason }));
        }
        columns.push(json!({ "model": model, "title": title, "step": step }));
    }
    let prompts: Vec<Value> = (prompts.into_iter().zip(rows))
        .map(|(prompt, answers)| json!({ "prompt": prompt, "answers": answers }))
        .collect();
    Ok(json!({
        "max_new_tokens": plan::ANSWER_TOKENS,
        "models": columns,
        "prompts": prompts,
    }))
}

/// The heads: the pair's layer-by-head grid lives in the heads step's own SVG; here the most
/// damaged heads, in the command's ranking.
fn heads(h: &HeadsReport) -> Value {
    let all = &h.diagnosis.heads;
    let top: Vec<Value> = (h.ranking.iter())
        .filter_map(|&i| all.get(i))
        .take(TOP_HEADS)
        .enumerate()
        .map(|(rank, head)| {
            let s = &head.sink;
            json!({
                "rank": rank + 1,
                "layer": s.layer,
                "head": s.head,
                "delta_g": s.delta_g,
                "g_base_median": s.g_base_median,
                "g_target_median": s.g_target_median,
                "margin": s.margin,
                "pos0_before": s.pos0_before,
                "pos0_after": s.pos0_after,
                "q_rel_op": head.drift.q.rel_op,
                "k_rel_op": head.drift.k.rel_op,
            })
        })
        .collect();
    json!({
        "rank_by": h.settings.rank_by,
        "n_heads": all.len(),
        "pair": h.diagnosis.pair,
        "top": top,
    })
}

/// Where the pair falls on the predictor's panel.
fn predictor(p: &PredictJson) -> Value {
    let a = &p.analysis;
    let panel: Vec<Value> = (a.held_out.iter())
        .map(
            |x| json!({ "pair": x.pair, "sink_strength": x.sink_strength, "observed": x.observed }),
        )
        .collect();
    let query = p.query.as_ref();
    json!({
        "panel": p.panel,
        "task": p.task,
        "n": a.n,
        "spearman": a.spearman,
        "pearson": a.pearson,
        "intercept": a.intercept,
        "slope": a.slope,
        "loo_mae": a.loo_mae,
        "sink_strength": query.map(|q| q.sink_strength),
        "predicted": query.map(|q| q.predicted),
        "rank": query.map(|q| q.rank),
        "of": query.map(|q| q.of),
        "points": panel,
    })
}

/// Write `summary.json` into `dir`.
pub fn write(dir: &Path, summary: &Value) -> Result<()> {
    crate::checkpoint::output::write_file_atomic(
        &dir.join("summary.json"),
        crate::report::json_text(summary)?.as_bytes(),
    )
}

/// The text the command prints: the scores table and where the report is.
pub fn text(summary: &Value, dir: &Path) -> String {
    use crate::report::{fmt_opt, Table};
    let mut t = Table::new(["model", "S", "ΔS", "margin", "pos0_trailing", "perplexity"]);
    for r in summary["scores"].as_array().into_iter().flatten() {
        let f = |v: &Value| fmt_opt(v.as_f64());
        t.row([
            r["model"].as_str().unwrap_or("").to_string(),
            f(&r["sink_strength"]),
            f(&r["delta_vs_vlm_lm"]["sink_strength"]),
            f(&r["margin"]),
            f(&r["pos0_trailing"]),
            f(&r["perplexity"]),
        ]);
    }
    let mut out = t.render();
    for m in summary["merges"].as_array().into_iter().flatten() {
        if m["status"] == "skipped" {
            out += &format!(
                "{}: skipped, {}\n",
                m["setting"].as_str().unwrap_or(""),
                m["reason"].as_str().unwrap_or("")
            );
        }
    }
    out += &format!(
        "report: {}\nsummary: {}\n",
        dir.join("report.html").display(),
        dir.join("summary.json").display()
    );
    out
}
