//! Command-line definitions. Each subcommand's arguments live beside its implementation in
//! `commands/`, so one file tells the whole story of a command; this file holds the top level
//! and the argument groups several commands share.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::bail;
use crate::checkpoint::output::{OutputKind, Outputs};
use crate::commands;
use crate::error::Result;

#[derive(Debug, Parser)]
#[command(
    name = "sinkmerge",
    version,
    about = "Weight-space analysis and merging of LLM and VLM checkpoints",
    long_about = "Weight-space analysis and merging of LLM and vision-language checkpoints, after \
\"Text Capability Loss in Vision-Language Adaptation: An Attention-Sink Diagnosis\" (arXiv 2609.00746).\n\n\
MODEL arguments accept a directory, a Hugging Face repo id (ORG/NAME[@revision]) or one of the \
paper's aliases (`qwen2.5-vl` is the VLM, `qwen2.5-vl:ref` its reference LLM; see `sinkmerge aliases`). \
Repo ids are looked up in the local HF cache ($HF_HUB_CACHE, else $HF_HOME/hub, else \
~/.cache/huggingface/hub); one missing from it is downloaded there from the Hub (config, tokenizer \
and safetensors files only), honouring HF_ENDPOINT, HF_TOKEN (or the token file) and \
HF_HUB_OFFLINE=1, and HF_HUB_DOWNLOAD_TIMEOUT (seconds a silent Hub is waited for; default 10); \
a body slower than SINKMERGE_HUB_MIN_SPEED bytes a second (default 1024) over \
SINKMERGE_HUB_SPEED_TIME seconds (default 30) is stopped. --no-download never downloads.\n\n\
Exit codes, the same in every command: 0 success; 1 a failure while writing, or an internal \
error (a device error, a decomposition that did not converge on finite values); 2 bad input or \
usage; 3 NaN or Inf values, stored in an input (`inspect --check` lists them) or produced by the \
arithmetic (activations or merged values overflowing f32); 130, 143 or 129 stopped by SIGINT, \
SIGTERM or SIGHUP, with the output in progress removed and the destination as it was.",
    after_help = "Run `sinkmerge <COMMAND> --help` for each command's options."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Worker threads, 1 to 1024 (default: all cores, or RAYON_NUM_THREADS). Results do not
    /// depend on it
    #[arg(long, global = true, value_name = "N", value_parser = whole_number(1, MAX_THREADS),
          allow_negative_numbers = true)]
    pub threads: Option<usize>,

    /// Never draw progress bars (they are already hidden when output is not a terminal).
    #[arg(long, short, global = true)]
    pub quiet: bool,

    /// Never download: a repo id missing from the Hugging Face cache is an error (as with
    /// HF_HUB_OFFLINE=1)
    #[arg(long, global = true)]
    pub no_download: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Summarize a checkpoint: architecture, family, dtypes, parameters, layers, QK-norm class
    Inspect(commands::inspect::Args),
    /// List the paper's model aliases and whether each is in the local Hugging Face cache
    Aliases(commands::aliases::Args),
    /// Download models into the Hugging Face cache ahead of time (what sinkmerge reads only)
    Fetch(commands::fetch::Args),
    /// Cut the language model out of a VLM as a standalone causal LM (every supported family)
    Extract(commands::extract::Args),
    Graft(commands::graft::Args),
    // The controls' help texts (about and long_about) live on their Args.
    Predict(commands::predict::Args),
    Perturb(commands::perturb::Args),
    Ablate(commands::ablate::Args),
    InjectQknorm(commands::inject_qknorm::Args),
    /// Attention-sink scores: Sink Strength S, pos0 share; with --ref, B_gap and the margin
    #[command(long_about = commands::score::LONG_ABOUT, after_help = commands::score::AFTER_HELP)]
    Score(commands::score::Args),
    /// Per-head diagnosis: each head's sink before and after, joined to its weight drift
    #[command(long_about = commands::heads::LONG_ABOUT, after_help = commands::heads::AFTER_HELP)]
    Heads(commands::heads::Args),
    /// Head-selective repair: move chosen heads' weight slices toward the reference
    #[command(long_about = commands::repair_heads::LONG_ABOUT, after_help = commands::repair_heads::AFTER_HELP)]
    RepairHeads(commands::repair_heads::Args),
    /// Check the GPU scorer against the CPU scorer: probabilities, logits, S, B_gap, margin
    #[command(long_about = commands::parity::LONG_ABOUT)]
    Parity(commands::parity::Args),
    /// One forward pass of a prompt with images; the activations to a safetensors file
    #[command(long_about = commands::trace::LONG_ABOUT, after_help = commands::trace::AFTER_HELP)]
    Trace(commands::trace::Args),
    /// Visual attention sinks of a VLM on images: the gate, the features, the key edit
    #[command(long_about = commands::visual_sinks::LONG_ABOUT, after_help = commands::visual_sinks::AFTER_HELP)]
    VisualSinks(commands::visual_sinks::Args),
    // About and long help live with the arguments in commands/norms.rs.
    Norms(commands::norms::Args),
    Linear(commands::methods::LinearArgs),
    TaskArithmetic(commands::methods::TaskArithmeticArgs),
    Ties(commands::methods::TiesArgs),
    Dare(commands::methods::DareArgs),
    Tsv(commands::methods::TsvArgs),
    Star(commands::methods::StarArgs),
    Merge(commands::merge::Args),
    /// The paper's whole analysis of one VLM-LLM pair (or a panel of pairs), resumable, with an
    /// HTML report
    #[command(long_about = commands::reproduce::LONG_ABOUT, after_help = commands::reproduce::AFTER_HELP)]
    Reproduce(commands::reproduce::Args),
}

/// Where and how a command writes a model directory.
#[derive(Debug, Clone, clap::Args)]
pub struct OutputArgs {
    /// Output model directory (written atomically: complete or absent)
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,

    /// Replace OUT if it is an earlier model folder (one that holds only a model's files; any other
    /// folder, the working folder and $HOME are refused)
    #[arg(long)]
    pub force: bool,

    /// Largest safetensors shard, in bytes with optional k/M/G suffix (decimal) or Ki/Mi/Gi
    #[arg(long, value_name = "SIZE", default_value = "5G")]
    pub max_shard_size: String,

    /// Write no README.md model card into OUT. By default OUT gets one in the Hugging Face Hub's
    /// format: YAML metadata (base_model: the inputs that are Hub repos; tags; library_name), what
    /// the model is, the recipe, every input (repo and commit, or path) and the command that
    /// replays it
    #[arg(long)]
    pub no_model_card: bool,
}

/// `--into-vlm`: every command that writes a language model can write it straight into a VLM.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct IntoVlmArgs {
    /// Write the model straight into VLM's own layout, in one pass (as `sinkmerge graft --vlm VLM`
    /// of the output would): VLM's vision tower, projector, config, processor and tokenizer
    /// files with this model as its language model. VLM is the model this one was extracted from
    #[arg(long, value_name = "VLM")]
    pub into_vlm: Option<String>,
}

impl OutputArgs {
    /// The output directory (required by `command`) and the shard size in bytes.
    pub fn required(&self, command: &str) -> crate::error::Result<(PathBuf, u64)> {
        let to = self.destination(command)?;
        Ok((to.dir.to_path_buf(), to.max_shard_size))
    }

    /// Where a rewrite of one checkpoint goes (required by `command`), with no other inputs.
    pub fn destination(
        &self,
        command: &str,
    ) -> crate::error::Result<crate::checkpoint::rewrite::Destination<'_>> {
        let dir = (self.output.as_deref())
            .ok_or_else(|| crate::bad!("{command} needs an output directory: -o OUT"))?;
        Outputs::new(self.force)
            .output("-o", Some(dir), OutputKind::Model)
            .check_before_inputs()?;
        Ok(crate::checkpoint::rewrite::Destination {
            dir,
            other_inputs: &[],
            force: self.force,
            max_shard_size: self.max_shard_size()?,
            into_vlm: None,
        })
    }

    /// `--max-shard-size` in bytes; a bad value is an error naming the flag.
    pub fn max_shard_size(&self) -> Result<u64> {
        crate::checkpoint::writer::parse_size(&self.max_shard_size)
            .map_err(|e| e.context("--max-shard-size"))
    }
}

/// Refuse a comma-separated flag that names one item twice (`--modules q_proj,q_proj`): the
/// repeat would be ignored, or counted twice, without a word.
pub fn refuse_repeats<T: PartialEq>(
    flag: &str,
    items: &[T],
    name: impl Fn(&T) -> String,
) -> Result<()> {
    for (i, item) in items.iter().enumerate() {
        if items[..i].contains(item) {
            bail!("{flag}: `{}` is listed twice", name(item));
        }
    }
    Ok(())
}

/// The most worker threads `--threads` takes. Every pool is CPU-bound, so threads beyond the
/// cores only add switching; 1024 is above the core count of any single machine sinkmerge runs
/// on, and a typo such as `--threads 100000` is refused instead of spawning that many.
pub const MAX_THREADS: usize = 1024;

/// A clap value parser for a whole number from `min` to `max`, for counts that size allocations
/// or loops: a value outside is refused when the command line is read (exit 2), with the bounds
/// in the message. `1e6` is read as the whole number it is, and says "too large" when it is.
pub fn whole_number(
    min: usize,
    max: usize,
) -> impl Fn(&str) -> std::result::Result<usize, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let t = s.trim();
        let value = match t.parse::<i128>() {
            Ok(n) => n as f64,
            Err(_) => match t.parse::<f64>() {
                Ok(x) if x.is_finite() && x.fract() == 0.0 => x,
                _ => return Err(format!("`{s}` is not a whole number")),
            },
        };
        if value < min as f64 {
            Err(format!(
                "{s} is too small: give a whole number of at least {min} and at most {max}"
            ))
        } else if value > max as f64 {
            Err(format!("{s} is too large: the maximum is {max}"))
        } else {
            Ok(value as usize)
        }
    }
}
