//! `sinkmerge reproduce`: the paper's whole analysis of one VLM-LLM pair, as a resumable
//! pipeline of the other commands, with `summary.json` and a self-contained `report.html`.

use std::path::PathBuf;

use crate::bail;
use crate::error::Result;
use crate::forward::device::ComputeDevice;
use crate::reproduce::plan::setting_names;
use crate::reproduce::{self, pipeline};

/// `sinkmerge reproduce --help`: what the command runs.
pub const LONG_ABOUT: &str = "The paper's whole analysis of one VLM and the LLM it came from \
(arXiv 2609.00746), each step an existing sinkmerge command, with summary.json and a \
self-contained report.html.\n\n\
Steps, in the order they run: inspect of both models; extract of the VLM's language model \
(VLM-LM); norms of REF -> VLM-LM (per-layer drift, stable ranks, the norm-scale drift); score of \
REF and of VLM-LM against REF (S, the margin, pos0_trailing with its CI, the thirds, perplexity on \
--text); heads of REF -> VLM-LM; predict (where REF's S places the pair on the paper's panel); then \
each of the paper's merge settings (merge-configs/) followed by its score. TIES and DARE need \
--base (task vectors from the pretrained base); without it they are skipped and the report says \
so.\n\n\
Each step writes under DIR/steps/NAME/: the command's own --json report (report.json) and, last, a \
manifest (the command line, the sinkmerge version, the inputs' Hub commits or content hashes, the \
keys of the steps it read). A rerun reuses every step whose manifest matches, redoes the ones whose \
inputs changed and everything downstream of them, and resumes a killed run at its first unfinished \
step. Merged models are deleted once scored unless --keep-models.\n\n\
Every check that needs no step comes first, with exit 2: the models open, the VLM's language model \
has REF's architecture (and BASE's), DIR is not inside an input, and DIR's filesystem holds the \
plan.";

/// `sinkmerge reproduce --help`: examples.
pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge reproduce --ref assets/models/tiny-qwen3/ref --vlm assets/models/tiny-qwen3/vlm -o repro\n  \
sinkmerge reproduce --ref qwen3-vl:ref --vlm qwen3-vl --base Qwen/Qwen3-8B-Base -o qwen3-vl-repro --device cuda\n  \
sinkmerge reproduce --ref REF --vlm VLM -o DIR --merges average,tsv --skip heads --dry-run";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The reference LLM the VLM was adapted from: a directory, an HF repo id or an alias
    #[arg(long = "ref", value_name = "REF")]
    pub reference: String,

    /// The VLM
    #[arg(long, value_name = "VLM")]
    pub vlm: String,

    /// The pretrained base both descend from: the task-vector settings (task arithmetic, TSV,
    /// STAR, TIES, DARE) take their task vectors from it, as in the paper; without it TIES and
    /// DARE are skipped and the others use REF as the base
    #[arg(long, value_name = "BASE")]
    pub base: Option<String>,

    /// The run's directory: steps/, models/, summary.json, report.html
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    pub output: PathBuf,

    /// Where the scoring steps compute: `cpu`, `cuda` or `cuda:N`
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,

    /// The merge settings to run, comma-separated [default: all seven], or `none`
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub merges: Option<Vec<String>>,

    /// Do not run this step (or `merges`, every merge), nor the steps that need it; repeatable
    #[arg(long, value_name = "STEP")]
    pub skip: Vec<String>,

    /// Redo this step (or `merges`) even if its manifest matches; repeatable
    #[arg(long, value_name = "STEP")]
    pub force: Vec<String>,

    /// Print the plan (steps, commands, disk space, a time estimate) and run nothing
    #[arg(long)]
    pub dry_run: bool,

    /// Keep the merged models under DIR/models/ instead of deleting each once it is scored
    #[arg(long)]
    pub keep_models: bool,

    /// The text of the perplexity column [default: the bundled sample, assets/text/sample.txt]
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,

    /// Print summary.json instead of the text summary (with --dry-run: the plan as JSON)
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args, progress: bool) -> Result<()> {
    args.device
        .parse::<ComputeDevice>()
        .map_err(|e| crate::bad!("--device {}: {e}", args.device))?;
    let merges = merges(args.merges.as_deref())?;
    let options = pipeline::Options {
        reference: args.reference,
        vlm: args.vlm,
        base: args.base,
        dir: args.output,
        text: args.text,
        device: args.device,
        merges,
        skip: args.skip,
        force: args.force,
        keep_models: args.keep_models,
        progress: progress && !args.json,
    };
    let mut prepared = pipeline::prepare(options)?;
    if args.dry_run {
        super::emit(&if args.json {
            crate::report::json_text(&pipeline::plan_json(&prepared))?
        } else {
            pipeline::plan_text(&prepared)
        });
        return Ok(());
    }
    let summary = reproduce::run(&mut prepared)?;
    super::emit(&if args.json {
        crate::report::json_text(&summary)?
    } else {
        reproduce::summary::text(&summary, &prepared.options.dir)
    });
    Ok(())
}

/// `--merges`: setting names, checked, in the paper's order.
fn merges(list: Option<&[String]>) -> Result<Vec<&'static str>> {
    let all = setting_names();
    let Some(list) = list else {
        return Ok(all);
    };
    if list.len() == 1 && list[0] == "none" {
        return Ok(vec![]);
    }
    for name in list {
        if !all.contains(&name.as_str()) {
            bail!(
                "--merges: unknown setting `{name}`; the settings: {}, or none",
                all.join(", ")
            );
        }
    }
    Ok(all
        .into_iter()
        .filter(|s| list.iter().any(|l| l == s))
        .collect())
}
