//! `sinkmerge graft`: write a language model back into its vision-language model, the inverse of
//! `extract` (docs/commands/graft.md).

use std::io::Write;

use crate::arch::families;
use crate::bad;
use crate::checkpoint::Checkpoint;
use crate::commands::args::OutputArgs;
use crate::error::Result;
use crate::units::human_bytes;
use crate::write::graft::{self, Summary};

#[derive(Debug, clap::Args)]
#[command(
    about = "Write a language model back into its VLM: the inverse of extract",
    long_about = "Write a language model (the one `sinkmerge extract` cut out of VLM, or a merge, \
repair or control of it) back into the VLM. OUT is VLM with every language-model tensor replaced \
by LM's, in VLM's own layout: its name prefixes (transformers or remote-code), fused experts \
fused back into their stored [experts, ...] tensors, transposes undone, fused q/k/v re-fused, a tied \
head written as VLM stores it. The vision tower, projector and every other tensor, config.json, \
the processor, tokenizer and chat template files are VLM's, byte for byte. It is the exact inverse \
of extract's plan: `extract VLM -o LM` then `graft --vlm VLM --lm LM` gives VLM's tensors back, \
byte for byte.\n\n\
LM must be VLM's language-model architecture with the same config (layers, widths, heads, rope, \
norms, tie). A vocabulary cropped or padded by a merge is restored to VLM's rows, the missing \
rows taken from VLM, with a warning; float tensors in another dtype are converted to VLM's \
(round to nearest even), with a warning. Anything else that differs is refused before any \
output is written. The copy streams from the mmap'd inputs with memory bounded by the writer's \
window, and OUT appears only once complete.",
    after_help = "Example:\n  sinkmerge extract Qwen/Qwen2.5-VL-7B-Instruct -o vl-lm\n  sinkmerge ties --base ref vl-lm other -o merged\n  sinkmerge graft --vlm Qwen/Qwen2.5-VL-7B-Instruct --lm merged -o merged-vl\n\n\
Every command that writes a model can do both steps in one pass: --into-vlm VLM."
)]
pub struct Args {
    /// The VLM: a directory, a Hugging Face repo id in the local cache (`ORG/NAME[@rev]`) or a paper alias
    #[arg(long, value_name = "VLM")]
    pub vlm: String,

    /// The language model to put into it (directory, repo id or alias)
    #[arg(long, value_name = "LM")]
    pub lm: String,

    #[command(flatten)]
    pub out: OutputArgs,

    /// The VLM family, instead of detecting it from config.json and the tensor names
    #[arg(long, value_name = "FAMILY", value_parser = clap::builder::PossibleValuesParser::new(families::NAMES))]
    pub family: Option<String>,

    /// Print the summary as one JSON object
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let (dest, max_shard_size) = args.out.required("graft")?;
    let vlm = Checkpoint::open_ref(&args.vlm)?;
    let lm = Checkpoint::open_ref(&args.lm)?;
    let family = match &args.family {
        Some(name) => families::by_name(name).ok_or_else(|| bad!("unknown family `{name}`"))?,
        None => families::detect_family(&vlm)?,
    };
    let opts = graft::Options {
        max_shard_size,
        force: args.out.force,
        progress: progress && !args.json,
        model_card: !args.out.no_model_card,
    };
    let summary = graft::run(&vlm, family, &lm, &dest, &opts)?;
    for w in &summary.warnings {
        eprintln!("sinkmerge: warning: {w}");
    }
    if args.json {
        super::emit(out, &crate::report::json_text(&summary)?)?;
    } else {
        super::emit(out, &render(&summary))?;
    }
    Ok(())
}

fn render(s: &Summary) -> String {
    let mut out = format!(
        "grafted {} ({}) into {} ({} family) -> {}\n",
        s.lm, s.architecture, s.vlm, s.family, s.output
    );
    out += &format!(
        "{} tensors ({}): {} from the language model, {} from the VLM; {} shard(s)\n",
        s.tensors,
        human_bytes(s.bytes),
        s.from_lm,
        s.from_vlm,
        s.shards
    );
    out += &format!("copied from the VLM: {}\n", s.files.join(", "));
    out += &format!("in {:.2} s\n", s.seconds);
    out
}
