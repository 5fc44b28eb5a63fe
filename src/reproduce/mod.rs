//! `sinkmerge reproduce`: the paper's analysis of a VLM-LLM pair (or a panel of pairs) as a
//! resumable pipeline of the existing commands (docs/commands/reproduce.md).
//!
//! - [`plan`]: the steps, each an existing command's command line;
//! - [`hash`]: the inputs' identities (Hub commits or content hashes) that manifests record;
//! - [`pipeline`]: the checks before any step, manifests, resuming, the local executor, which
//!   runs each step with the caller's [`pipeline::StepRunner`];
//! - [`slurm`]: the Slurm executor, one `sbatch` job per step;
//! - [`summary`]: `summary.json`, every number the report shows, gathered from the steps' own
//!   reports;
//! - [`html`]: `report.html`, one self-contained file;
//! - [`panel`]: many pairs from a CSV, and the panel's report;
//! - [`status`]: `--status DIR`, every step's state.

pub mod hash;
pub mod html;
pub mod lock;
pub mod panel;
pub mod pipeline;
pub mod plan;
pub mod slurm;
pub mod status;
pub mod summary;

use std::path::Path;

use crate::bail;
use crate::error::Result;
use pipeline::{Prepared, StepRunner};

/// Run the prepared plan here, each step with `runner`, then write `summary.json` and
/// `report.html`; returns the summary.
pub fn run(prepared: &mut Prepared, runner: &dyn StepRunner) -> Result<serde_json::Value> {
    pipeline::execute(prepared, runner)?;
    report(prepared)
}

/// Write `summary.json` and `report.html` of a pair whose steps are all done.
pub fn report(prepared: &mut Prepared) -> Result<serde_json::Value> {
    pipeline::begin(prepared)?;
    // --force asks to redo steps, not to report without them: what counts is what is finished.
    let done = pipeline::finished_steps(prepared, &[]);
    if let Some(step) = prepared.steps.iter().find(|s| !done.contains(&s.name)) {
        bail!(
            "{}: step {} is not done; the report needs every step",
            prepared.options.dir.display(),
            step.name
        );
    }
    let dir = prepared.options.dir.clone();
    let summary = summary::gather(prepared)?;
    // The page is rendered before either file is written, so a failure leaves the old pair.
    let html = html::render(&summary, &dir)?;
    summary::write(&dir, &summary)?;
    html::write(&dir, &html)?;
    Ok(summary)
}

/// `DIR/panel.json`: the panel's pairs, so `--status DIR` finds them.
pub const PANEL: &str = "panel.json";

/// Record a panel's pairs in its directory.
pub fn write_panel(dir: &Path, pairs: &[panel::Pair]) -> Result<()> {
    let names: Vec<&str> = pairs.iter().map(|p| p.name.as_str()).collect();
    let text = crate::report::json_text(&serde_json::json!({ "pairs": names }))?;
    std::fs::create_dir_all(dir).map_err(|e| crate::error::Error::write(dir, e))?;
    crate::checkpoint::output::write_file_atomic(&dir.join(PANEL), text.as_bytes())
}

/// Write the panel's `summary.json` and `report.html` from its pairs' summaries.
pub fn panel_report(pairs: &[panel::Pair], dir: &Path) -> Result<serde_json::Value> {
    let summary = panel::gather(pairs, dir)?;
    let html = panel::render(&summary)?;
    summary::write(dir, &summary)?;
    html::write(dir, &html)?;
    Ok(summary)
}

/// A panel's DIR, checked as a pair's is (each pair checks what it writes under DIR/NAME): no
/// symlink on the way to a file the panel writes or to a pair's folder.
pub fn check_panel_dir(dir: &Path, pairs: &[panel::Pair]) -> Result<()> {
    let files = [
        PANEL,
        "summary.json",
        "report.html",
        pipeline::SLURM_REPORT_JOB,
        lock::LOCK,
    ]
    .map(|name| dir.join(name));
    let folders = pairs.iter().map(|p| dir.join(&p.name));
    let paths: Vec<std::path::PathBuf> = files.into_iter().chain(folders).collect();
    pipeline::refuse_links(dir, paths.iter().map(|p| p.as_path()))
}

/// The pairs of a panel directory, from its `panel.json`.
pub fn panel_names(dir: &Path) -> Result<Option<Vec<String>>> {
    let path = dir.join(PANEL);
    if !path.is_file() {
        return Ok(None);
    }
    let value = crate::checkpoint::read_json(&path)?;
    Ok(Some(
        (value["pairs"].as_array().into_iter().flatten())
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect(),
    ))
}
