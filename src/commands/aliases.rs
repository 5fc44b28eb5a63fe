//! `sinkmerge aliases`: the paper's model pairs and whether each model is in the local HF cache.

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

pub fn run(args: Args) -> Result<()> {
    let cached = |repo: &str| resolve::resolve(repo).is_ok();
    if args.json {
        let rows: Vec<_> = PAPER_PAIRS
            .iter()
            .map(|p| {
                json!({
                    "alias": p.alias, "vlm": p.vlm, "reference": p.reference, "family": p.family,
                    "qk_norm": p.qk_norm, "vlm_cached": cached(p.vlm), "reference_cached": cached(p.reference),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows).expect("JSON"));
        return Ok(());
    }
    let mark = |b: bool| if b { "cached" } else { "-" };
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
            p.alias,
            p.vlm,
            mark(cached(p.vlm)),
            p.reference,
            mark(cached(p.reference)),
            p.family,
            p.qk_norm,
        ]);
    }
    print!("{}", table.render());
    println!("\nHF cache: {}", resolve::hub_cache_dir().display());
    Ok(())
}
