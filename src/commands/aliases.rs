//! `sinkmerge aliases`: the paper's model pairs and whether each model is in the local HF cache.

use std::io::Write;

use serde_json::json;

use crate::checkpoint::resolve::{self, PAPER_PAIRS};
use crate::error::Result;
use crate::report::Table;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args, out: &mut dyn Write) -> Result<()> {
    // The cache only: listing aliases never downloads. The commit names what is cached.
    let cached = |repo: &str| {
        resolve::find_cached(repo, None)
            .ok()
            .and_then(|m| m.hub)
            .map(|h| h.commit)
    };
    if args.json {
        let rows: Vec<_> = PAPER_PAIRS
            .iter()
            .map(|p| {
                let (vlm, reference) = (cached(p.vlm), cached(p.reference));
                json!({
                    "alias": p.alias, "vlm": p.vlm, "reference": p.reference, "family": p.family,
                    "qk_norm": p.qk_norm, "vlm_cached": vlm.is_some(), "reference_cached": reference.is_some(),
                    "vlm_commit": vlm, "reference_commit": reference,
                })
            })
            .collect();
        super::emit(out, &crate::report::json_text(&rows)?)?;
        return Ok(());
    }
    let mark = |c: Option<String>| match c {
        Some(commit) => format!("cached @{}", &commit[..commit.len().min(10)]),
        None => "-".to_string(),
    };
    let mut table = Table::new([
        "alias",
        "VLM",
        "",
        "reference LLM (ALIAS:ref)",
        "",
        "family",
        "QK norm",
    ]);
    for p in PAPER_PAIRS {
        table.row([
            p.alias.to_string(),
            p.vlm.to_string(),
            mark(cached(p.vlm)),
            p.reference.to_string(),
            mark(cached(p.reference)),
            p.family.to_string(),
            p.qk_norm.to_string(),
        ]);
    }
    super::emit(out, &table.render())?;
    super::emit(
        out,
        &format!("\nHF cache: {}\n", resolve::hub_cache_dir().display()),
    )?;
    Ok(())
}
