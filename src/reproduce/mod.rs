//! `sinkmerge reproduce`: the paper's analysis of a VLM-LLM pair as a resumable pipeline of the
//! existing commands (docs/commands/reproduce.md).
//!
//! - [`plan`]: the steps, each an existing command's command line;
//! - [`hash`]: the inputs' identities (Hub commits or content hashes) that manifests record;
//! - [`pipeline`]: running the steps: checks before any step, manifests, resuming;
//! - [`summary`]: `summary.json`, every number the report shows, gathered from the steps' own
//!   reports;
//! - [`html`]: `report.html`, one self-contained file.

pub mod hash;
pub mod html;
pub mod pipeline;
pub mod plan;
pub mod summary;

use crate::error::Result;
use pipeline::Prepared;

/// Run the prepared plan, then write `summary.json` and `report.html`; returns the summary.
pub fn run(prepared: &mut Prepared) -> Result<serde_json::Value> {
    pipeline::execute(prepared)?;
    let dir = prepared.options.dir.clone();
    let summary = summary::gather(prepared)?;
    // The page is rendered before either file is written, so a failure leaves the old pair.
    let html = html::render(&summary, &dir)?;
    summary::write(&dir, &summary)?;
    html::write(&dir, &html)?;
    Ok(summary)
}
