//! `sinkmerge fetch MODEL...`: download models into the Hugging Face cache ahead of time (the
//! files sinkmerge reads only), and say which commit each resolved to.

use std::io::Write;

use serde_json::json;

use crate::checkpoint::resolve;
use crate::error::Result;
use crate::report::Table;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Repo ids (`ORG/NAME[@revision]`) or aliases (`qwen2.5-vl`, `qwen2.5-vl:ref`)
    #[arg(required = true, value_name = "MODEL")]
    pub models: Vec<String>,

    /// Print JSON: one object per model with its repo, commit and snapshot directory
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args, out: &mut dyn Write) -> Result<()> {
    // Resolve every model first (downloading what is missing), then report: a bad name fails
    // before anything is printed.
    let mut models = Vec::with_capacity(args.models.len());
    for m in &args.models {
        let model = resolve::resolve(m)?;
        if model.hub.is_none() {
            crate::bail!("{m}: a local directory, not a Hub model; there is nothing to fetch");
        }
        models.push(model);
    }
    if args.json {
        let rows: Vec<_> = models
            .iter()
            .map(|m| {
                let hub = m.hub.as_ref().expect("checked above");
                json!({"model": m.label, "repo": hub.repo, "commit": hub.commit, "dir": m.dir})
            })
            .collect();
        super::emit(
            out,
            &format!("{}\n", serde_json::to_string_pretty(&rows).expect("JSON")),
        )?;
        return Ok(());
    }
    let mut table = Table::new(["model", "commit", "snapshot"]);
    for m in &models {
        let hub = m.hub.as_ref().expect("checked above");
        table.row([
            m.label.clone(),
            hub.commit.clone(),
            m.dir.display().to_string(),
        ]);
    }
    super::emit(out, &table.render())?;
    Ok(())
}
