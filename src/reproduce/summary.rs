//! `summary.json`: every number the report shows, copied from the steps' own reports (so each
//! equals what the standalone command prints), under the keys docs/commands/reproduce.md
//! documents. Nothing in it depends on timing, so a resumed run's summary equals an
//! uninterrupted one's.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::pipeline::{read_report, read_step_report, Prepared, REMOVED};
use super::plan::{self, SETTINGS};
use crate::error::Result;
use crate::report::heads::HeadsReport;
use crate::sink::score::Scores;

/// The heads the report lists, most damaged first.
pub const TOP_HEADS: usize = 10;

/// Gather the summary of a finished run.
pub fn gather(prepared: &Prepared) -> Result<Value> {
    let dir = prepared.options.dir.as_path();
    let ran = |name: &str| prepared.steps.iter().any(|s| s.name == name);
    let report = |name: &str| -> Result<Option<Value>> {
        if ran(name) {
            read_report(dir, name).map(Some)
        } else {
            Ok(None)
        }
    };

    let scores = scores(&|name: &str| {
        ran(name)
            .then(|| read_step_report::<Scores>(dir, name))
            .transpose()
    })?;
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

    Ok(json!({
        "sinkmerge_version": env!("CARGO_PKG_VERSION"),
        "models": models(prepared, &report)?,
        "drift": report("norms")?.map(|n| drift(&n)),
        "scores": scores,
        "merges": merges,
        "heads": ran("heads")
            .then(|| read_step_report::<HeadsReport>(dir, "heads"))
            .transpose()?
            .map(|h| heads(&h)),
        "predictor": report("predict")?.map(|p| predictor(&p)),
        "steps": steps,
        "text": prepared.text,
        "keep_models": prepared.options.keep_models,
        "space_saved_bytes": space_saved,
    }))
}

type ReportOf<'a> = dyn Fn(&str) -> Result<Option<Value>> + 'a;

fn models(prepared: &Prepared, report: &ReportOf) -> Result<Value> {
    let identity = |input: &str| {
        (prepared.identities.values().flatten())
            .find(|id| id.input == input)
            .map(|id| json!({ "kind": id.kind, "value": id.value }))
    };
    let inspected = |name: &str| -> Result<Value> {
        Ok(report(name)?.map_or(Value::Null, |r| {
            json!({
                "architecture": r["architecture"],
                "model_type": r["model_type"],
                "family": r["family"],
                "parameters": r["num_parameters"],
                "bytes": r["total_bytes"],
                "layers": r["num_layers"],
                "dtypes": r["dtypes"],
            })
        }))
    };
    let o = &prepared.options;
    let extract = report("extract")?.unwrap_or(Value::Null);
    Ok(json!({
        "ref": { "input": o.reference, "identity": identity(&o.reference), "inspect": inspected("inspect-ref")? },
        "vlm": { "input": o.vlm, "identity": identity(&o.vlm), "family": prepared.models.family, "inspect": inspected("inspect-vlm")? },
        "vlm_lm": {
            // As the plan names it (relative where DIR is), not the absolute path extract prints.
            "path": prepared.steps.iter().find_map(|s| s.model.as_ref().filter(|_| s.name == "extract")),
            "architecture": extract["architecture"],
            "tensors": extract["tensors_written"],
            "bytes": extract["bytes_written"],
        },
        "base": (o.base.as_ref().zip(prepared.models.base.as_ref())).map(|(b, ckpt)| json!({
            "input": b,
            "identity": identity(b),
            "architecture": ckpt.config["architectures"][0],
        })),
    }))
}

/// Per layer: each projection's operator norm and stable rank of ΔW, and each norm scale's
/// relative change (the γ drift); with the command's own medians and maxima.
fn drift(norms: &Value) -> Value {
    let rows = norms["rows"].as_array().cloned().unwrap_or_default();
    let mut modules: Vec<String> = Vec::new();
    let mut gammas: Vec<String> = Vec::new();
    let mut layers: Vec<Map<String, Value>> = Vec::new();
    for row in &rows {
        let (Some(layer), Some(module)) = (row["layer"].as_u64(), row["module"].as_str()) else {
            continue;
        };
        let layer = layer as usize;
        while layers.len() <= layer {
            let mut m = Map::new();
            m.insert("layer".into(), json!(layers.len()));
            for key in ["op", "stable_rank", "gamma_rel_l2"] {
                m.insert(key.into(), json!({}));
            }
            layers.push(m);
        }
        let entry = &mut layers[layer];
        if row.get("op").is_some() {
            if !modules.iter().any(|m| m == module) {
                modules.push(module.into());
            }
            entry["op"][module] = row["op"].clone();
            entry["stable_rank"][module] = row["stable_rank"].clone();
        } else if row.get("rel_l2").is_some() {
            if !gammas.iter().any(|m| m == module) {
                gammas.push(module.into());
            }
            entry["gamma_rel_l2"][module] = row["rel_l2"].clone();
        }
    }
    let summary: Map<String, Value> = (norms["summary"].as_object().into_iter().flatten())
        .map(|(module, s)| (module.clone(), s["all"].clone()))
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
fn predictor(p: &Value) -> Value {
    let panel: Vec<Value> = (p["held_out"].as_array().into_iter().flatten())
        .map(|x| json!({ "pair": x["pair"], "sink_strength": x["sink_strength"], "observed": x["observed"] }))
        .collect();
    json!({
        "panel": p["panel"],
        "task": p["task"],
        "n": p["n"],
        "spearman": p["spearman"],
        "pearson": p["pearson"],
        "intercept": p["intercept"],
        "slope": p["slope"],
        "loo_mae": p["loo_mae"],
        "sink_strength": p["query"]["sink_strength"],
        "predicted": p["query"]["predicted"],
        "rank": p["query"]["rank"],
        "of": p["query"]["of"],
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
