//! `reproduce --status DIR`: every step of a run (or of each pair of a panel) as done, queued,
//! running, failed, skipped or not run, with its Slurm job and log.

use std::path::Path;

use serde_json::{json, Value};

use super::pipeline::{read_manifest, PLAN};
use super::pipeline::{SLURM_JOB, SLURM_REPORT_JOB};
use super::plan::step_dir;
use super::slurm::{alive, job_state, log_of, read_job, waits_forever};
use crate::bad;
use crate::error::Result;
use crate::report::Table;

/// The state of every step under `dir`.
pub fn collect(dir: &Path) -> Result<Value> {
    let pairs: Vec<(Option<String>, std::path::PathBuf)> = match super::panel_names(dir)? {
        Some(names) => names
            .into_iter()
            .map(|n| (Some(n.clone()), dir.join(n)))
            .collect(),
        None => vec![(None, dir.to_path_buf())],
    };
    let mut out = Vec::new();
    for (name, pair_dir) in pairs {
        let plan_path = pair_dir.join(PLAN);
        let plan: Value = match std::fs::read(&plan_path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|e| bad!("{}: {e}", plan_path.display()))?
            }
            Err(_) if name.is_some() => json!({ "steps": [] }),
            Err(_) => {
                return Err(bad!(
                    "{}: no run here (no {PLAN}); give the -o DIR of a reproduce run",
                    dir.display()
                ))
            }
        };
        let mut steps = Vec::new();
        for step in plan["steps"].as_array().into_iter().flatten() {
            let step_name = step["name"].as_str().unwrap_or_default();
            let folder = step_dir(&pair_dir, step_name);
            let done = read_manifest(&pair_dir, step_name).is_some_and(|m| m.key == step["key"]);
            let job = read_job(&folder.join(SLURM_JOB)).filter(|j| j.key == step["key"]);
            let state = job.as_ref().and_then(|j| job_state(&j.job));
            let status = match (&state, done) {
                (_, true) => "done",
                (Some(s), _) if s.state == "PENDING" && !waits_forever(s) => "queued",
                (Some(s), _) if alive(s) => "running",
                (_, false) if job.is_some() => "failed",
                _ => "not run",
            };
            let log = job.as_ref().and_then(|j| log_of(&folder, &j.job));
            steps.push(json!({
                "name": step_name,
                "status": status,
                "job": job.map(|j| j.job),
                "slurm_state": state.map(|s| format!("{} ({})", s.state, s.reason)),
                "log": log,
            }));
        }
        for skipped in plan["skipped"].as_array().into_iter().flatten() {
            steps.push(json!({
                "name": skipped["name"],
                "status": "skipped",
                "job": null,
                "slurm_state": null,
                "log": null,
                "reason": skipped["reason"],
            }));
        }
        out.push(json!({
            "pair": name,
            "dir": pair_dir,
            "steps": steps,
            "report": pair_dir.join("report.html").is_file(),
            "report_job": report_job(&pair_dir),
        }));
    }
    Ok(json!({
        "pairs": out,
        "report": dir.join("report.html").is_file(),
        "report_job": if super::panel_names(dir)?.is_some() { report_job(dir) } else { Value::Null },
    }))
}

/// The job that writes a report (a pair's or the panel's): its id and whether it is queued,
/// running, or finished (done or not: the report file tells).
fn report_job(dir: &Path) -> Value {
    let Some(job) = read_job(&dir.join(SLURM_REPORT_JOB)) else {
        return Value::Null;
    };
    let status = match job_state(&job.job) {
        Some(s) if s.state == "PENDING" && !waits_forever(&s) => "queued",
        Some(s) if alive(&s) => "running",
        _ => "finished",
    };
    json!({ "job": job.job, "status": status })
}

/// The state as a table per pair.
pub fn text(status: &Value) -> String {
    let mut out = String::new();
    for pair in status["pairs"].as_array().into_iter().flatten() {
        if let Some(name) = pair["pair"].as_str() {
            out += &format!("pair {name} ({})\n", pair["dir"].as_str().unwrap_or(""));
        }
        let mut t = Table::new(["step", "status", "job", "log"]);
        for s in pair["steps"].as_array().into_iter().flatten() {
            let dash = |v: &Value| v.as_str().unwrap_or("-").to_string();
            t.row([
                dash(&s["name"]),
                dash(&s["status"]),
                dash(&s["job"]),
                dash(&s["log"]),
            ]);
        }
        out += &t.render();
        out += &format!(
            "report: {}\n\n",
            if pair["report"] == true {
                "written"
            } else {
                "not yet"
            }
        );
    }
    out
}
