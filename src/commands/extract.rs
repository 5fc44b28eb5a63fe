//! `sinkmerge extract`: cut the language model out of a vision-language model as a standalone
//! Hugging Face causal LM (the paper's first step, Appendix B.2).

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::arch::families;
use crate::bad;
use crate::checkpoint::output::{OutputKind, Outputs};
use crate::checkpoint::resolve::{self, ModelRef};
use crate::checkpoint::Checkpoint;
use crate::commands::args::OutputArgs;
use crate::error::Result;
use crate::extract::{self, Summary};
use crate::report::Table;
use crate::units::human_bytes;

#[derive(Debug, clap::Args)]
#[command(
    long_about = "Cut the language model out of a vision-language model (VLM) as a standalone Hugging Face \
causal LM that AutoModelForCausalLM loads and whose text-only logits equal the VLM's.\n\n\
The output gets the language-model tensors under standard *ForCausalLM names (bytes copied verbatim, \
dtype kept; row splits and expert unfusing only where the family needs them), a config.json for the \
target class with every architectural field written explicitly (text fields lifted out of \
text_config/llm_config, multimodal rope dropped, vision keys dropped, tie_word_embeddings decided from \
the config flag and whether lm_head is on disk), generation_config.json, the tokenizer files and the \
chat template (a processor chat_template.json becomes chat_template.jinja), and a README.md model card (unless --no-model-card). \
Vision tower, projector and other non-language tensors are dropped. The copy streams from the mmap'd \
source: memory stays bounded whatever the model size. The output is written beside its destination \
and renamed into place only once complete and verified.",
    after_long_help = families_help()
)]
pub struct Args {
    /// The VLM: a directory, a Hugging Face repo id in the local cache (`ORG/NAME[@rev]`) or a paper alias (`sinkmerge aliases`)
    pub source: String,

    #[command(flatten)]
    pub out: OutputArgs,

    /// The VLM family, instead of detecting it from config.json and the tensor names
    #[arg(long, value_name = "FAMILY", value_parser = clap::builder::PossibleValuesParser::new(families::NAMES))]
    pub family: Option<String>,

    /// Skip the verification (reopening the output and comparing every tensor with its source by hash)
    #[arg(long)]
    pub no_verify: bool,

    /// Print the summary as one JSON object
    #[arg(long)]
    pub json: bool,
}

fn families_help() -> String {
    let mut s = String::from(
        "OUT defaults to ./<alias-or-directory-name>-lm (for a repo id, its NAME).\n\nFamilies (--family):\n",
    );
    for f in families::FAMILIES {
        s += &format!("  {}\n      {}\n", f.name(), f.help());
    }
    s += "\nUNVERIFIED layouts are implemented from the family's published modeling code, without a \
checkpoint to compare against; check such an \
extraction against the VLM (docs/commands/extract.md#checking-an-extraction-against-the-vlm; \
tools/check_extract.py).";
    s
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    // The default output lies in the working directory; a given one is checked before any work,
    // against the VLM too when it is a folder (a Hub id is resolved, and maybe fetched, later).
    if let Some(dest) = &args.out.output {
        let local = Path::new(&args.source);
        Outputs::new(args.out.force)
            .output("-o", Some(dest), OutputKind::Model)
            .inputs("input", local.exists().then_some(local))
            .check_before_inputs()?;
    }
    let model = resolve::resolve(&args.source)?;
    let mut ckpt = Checkpoint::open_dir(&model.dir, &model.label)?;
    ckpt.hub = model.hub.clone();
    let family = match &args.family {
        Some(name) => families::by_name(name).ok_or_else(|| bad!("unknown family `{name}`"))?,
        None => families::detect_family(&ckpt)?,
    };
    let plan = family.plan(&ckpt)?;
    let dest = args
        .out
        .output
        .clone()
        .unwrap_or_else(|| default_output(&args.source, &model));
    let opts = extract::Options {
        max_shard_size: args.out.max_shard_size()?,
        force: args.out.force,
        verify: !args.no_verify,
        progress: progress && !args.json,
        model_card: !args.out.no_model_card,
    };
    let summary = extract::run(&ckpt, &plan, &dest, &opts)?;
    if args.json {
        super::emit(out, &crate::report::json_text(&summary)?)?;
    } else {
        super::emit(out, &render(&summary))?;
    }
    Ok(())
}

/// `./<alias>-lm`, `./<directory name>-lm` or `./<repo NAME>-lm`.
fn default_output(reference: &str, model: &ModelRef) -> PathBuf {
    let base = match &model.alias {
        Some(alias) => alias.clone(),
        None if Path::new(reference).exists() => {
            let path =
                std::fs::canonicalize(reference).unwrap_or_else(|_| PathBuf::from(reference));
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        }
        None => {
            let repo = reference.split('@').next().unwrap_or(reference);
            repo.rsplit('/').next().unwrap_or(repo).to_string()
        }
    };
    PathBuf::from(".").join(format!("{base}-lm"))
}

fn render(s: &Summary) -> String {
    let mut out = format!(
        "extracted {}{} ({} family) -> {} as {}\n",
        s.source,
        crate::checkpoint::resolve::commit_note(s.source_hub.as_ref()),
        s.family,
        s.output,
        s.architecture
    );
    let mut t = Table::new(["", "tensors", "bytes"]);
    t.row([
        "written".to_string(),
        s.tensors_written.to_string(),
        human_bytes(s.bytes_written),
    ]);
    for (kind, c) in &s.dropped {
        t.row([
            format!("dropped: {}", kind.as_str()),
            c.tensors.to_string(),
            human_bytes(c.bytes),
        ]);
    }
    out += &t.render();
    out += &format!(
        "{} source tensors kept, {} output tensors by surgery; {} shard(s); tie_word_embeddings {}\n",
        s.tensors_kept, s.tensors_from_surgery, s.shards, s.tie_word_embeddings
    );
    out += &format!("chat template: {}\n", s.chat_template);
    for n in &s.notes {
        out += &format!("note: {n}\n");
    }
    out += &format!(
        "{} in {:.2} s\n",
        if s.verified {
            "verified (every tensor against its source, shapes against the new config)"
        } else {
            "not verified (--no-verify)"
        },
        s.seconds
    );
    out
}
