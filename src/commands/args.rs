//! The flag groups and value parsers several commands share: where a model is written
//! (`OutputArgs`), `--into-vlm`, both for a command that rewrites one model (`RewriteArgs`), and
//! the checks of counts and lists.

use std::path::PathBuf;

use crate::bail;
use crate::checkpoint::output::{OutputKind, Outputs};
use crate::error::Result;
use crate::forward::decoder::KeyStage;
use crate::sink::visual::edit::EditKind;
use crate::sink::visual::Settings as VisualSettings;
use crate::write::graft::IntoVlm;
use crate::write::rewrite::Destination;

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

/// The flags of a command that rewrites one model: where it goes, and `--into-vlm`.
#[derive(Debug, Clone, clap::Args)]
pub struct RewriteArgs {
    #[command(flatten)]
    pub out: OutputArgs,

    #[command(flatten)]
    pub vlm: IntoVlmArgs,
}

impl RewriteArgs {
    /// The output checked (required by `command`), then `--into-vlm`'s VLM opened: where every
    /// rewriting command starts, before it opens its inputs.
    pub fn open(&self, command: &str) -> Result<Rewrite<'_>> {
        let to = self.out.destination(command)?;
        let into_vlm = IntoVlm::from_arg(self.vlm.into_vlm.as_deref())?;
        Ok(Rewrite { to, into_vlm })
    }
}

/// Where a rewrite goes, and the VLM it is written into (`--into-vlm`).
pub struct Rewrite<'a> {
    to: Destination<'a>,
    pub into_vlm: Option<IntoVlm>,
}

impl Rewrite<'_> {
    /// The destination, in the layout of `--into-vlm`'s VLM when one is given.
    pub fn destination(&self) -> Destination<'_> {
        Destination {
            into_vlm: self.into_vlm.as_ref(),
            ..self.to
        }
    }
}

impl OutputArgs {
    /// The output directory (required by `command`) and the shard size in bytes.
    pub fn required(&self, command: &str) -> crate::error::Result<(PathBuf, u64)> {
        let to = self.destination(command)?;
        Ok((to.dir.to_path_buf(), to.max_shard_size))
    }

    /// Where a rewrite of one checkpoint goes (required by `command`), with no other inputs.
    pub fn destination(&self, command: &str) -> crate::error::Result<Destination<'_>> {
        let dir = (self.output.as_deref())
            .ok_or_else(|| crate::bad!("{command} needs an output directory: -o OUT"))?;
        Outputs::new(self.force)
            .output("-o", Some(dir), OutputKind::Model)
            .check_before_inputs()?;
        Ok(Destination {
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

/// Flags every merge command shares (`merge` and the one-method commands).
#[derive(Debug, clap::Args)]
pub struct CommonArgs {
    #[command(flatten)]
    pub output: OutputArgs,

    /// Output dtype of floating-point tensors: float32, bfloat16 or float16 [default: each base
    /// tensor's own dtype]. All arithmetic is float32 whatever this says.
    #[arg(long, value_name = "DTYPE")]
    pub out_dtype: Option<String>,

    /// Copy the tokenizer, chat template and generation config from MODEL [default: the first
    /// of --models]
    #[arg(long, value_name = "MODEL")]
    pub tokenizer_from: Option<String>,

    #[command(flatten)]
    pub vlm: IntoVlmArgs,

    /// Print a JSON summary on stdout instead of text
    #[arg(long)]
    pub json: bool,
}

/// The key edit of `visual-sinks` and `generate` (`docs/commands/visual-sinks.md`): the layers
/// probed and edited, the gate, the keys it reads and edits, the edit and its control.
#[derive(Debug, Clone, clap::Args)]
pub struct KeyEditArgs {
    /// The decoder layers to probe and edit: `0-3,7`, `20:` (default: all)
    #[arg(long, value_name = "LIST")]
    pub layers: Option<crate::arch::layer_list::LayerList>,

    /// The gate: image tokens whose centred key cosine with the text sink is at least this
    #[arg(long, value_name = "COS", default_value_t = 0.5, value_parser = parse_gate, allow_hyphen_values = true)]
    pub gate: f64,

    /// The keys the cosines use and the edit acts on: before or after RoPE
    #[arg(long, value_enum, default_value_t = KeysArg::PreRope)]
    pub keys: KeysArg,

    /// The key edit: remove (project the text-sink direction out of the gated image tokens'
    /// keys) or align (give eight random image tokens the text sink's key)
    #[arg(long, value_enum, default_value_t = EditKind::None)]
    pub edit: EditKind,

    /// `remove`: move the text-sink component to the image tokens' median instead of to zero
    #[arg(long)]
    pub median_target: bool,

    /// Also run the edit's control: a random direction (remove) or a random key (align)
    #[arg(long)]
    pub controls: bool,
}

impl KeyEditArgs {
    /// The combinations refused before anything is read.
    pub fn check(&self) -> Result<()> {
        if self.controls && self.edit == EditKind::None {
            bail!("--controls needs an edit (--edit remove or --edit align)");
        }
        if self.median_target && self.edit != EditKind::Remove {
            bail!("--median-target applies to --edit remove");
        }
        Ok(())
    }

    /// The measurement's settings, with `--layers` resolved for a model of `num_layers`.
    pub fn settings(&self, ratio: f64, seed: u64, num_layers: usize) -> Result<VisualSettings> {
        Ok(VisualSettings {
            ratio,
            gate: self.gate,
            keys: self.keys.stage(),
            edit: self.edit,
            median_target: self.median_target,
            controls: self.controls,
            seed,
            layers: match &self.layers {
                Some(list) => list.resolve(num_layers)?,
                None => (0..num_layers).collect(),
            },
        })
    }
}

/// `--keys`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeysArg {
    PreRope,
    PostRope,
}

impl KeysArg {
    pub fn stage(self) -> KeyStage {
        match self {
            KeysArg::PreRope => KeyStage::PreRope,
            KeysArg::PostRope => KeyStage::PostRope,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KeysArg::PreRope => "pre-rope",
            KeysArg::PostRope => "post-rope",
        }
    }
}

/// `--gate`: a cosine in [-1, 1].
pub fn parse_gate(s: &str) -> std::result::Result<f64, String> {
    let g: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if !(-1.0..=1.0).contains(&g) {
        return Err(format!("{s} is outside [-1, 1]"));
    }
    Ok(g)
}
