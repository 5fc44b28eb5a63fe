//! The command line's top level: the global flags and the subcommand. Each subcommand's
//! arguments live beside its implementation in `commands/`, so one file tells the whole story of
//! a command; the flag groups several commands share are in `commands/args.rs`.

use clap::Parser;

use crate::commands::args::{whole_number, MAX_THREADS};
use crate::commands::{Command, Globals};

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

impl Cli {
    /// The settings every command shares.
    pub fn globals(&self) -> Globals {
        Globals {
            threads: self.threads,
            quiet: self.quiet,
            no_download: self.no_download,
        }
    }
}
