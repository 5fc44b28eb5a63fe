//! `sinkmerge merge CONFIG.yaml`: run a mergekit-style YAML config (or a `sinkmerge_config.yml`
//! record), and the reporting every merge command shares.

use std::io::Write;
use std::path::PathBuf;

use safetensors::Dtype;

use super::args::CommonArgs;
use crate::bad;
use crate::dtype::parse_float_dtype;
use crate::error::Result;
use crate::merge::plan::{self, RunOptions, Summary};
use crate::merge::MergeSpec;
use crate::units::human_bytes;

/// Run a merge described by a mergekit-style YAML config.
///
/// Supported: merge_method (linear, task_arithmetic, ties, dare_linear, dare_ties, tsv, star),
/// base_model, models[].model, models[].parameters, parameters, dtype, out_dtype and
/// tokenizer_source (base or a model). Parameter values may be scalars, layer gradients (lists,
/// interpolated over layers) or [{filter, value}] lists. slices, modules, tokenizer surgery and
/// unknown keys are errors. A model's sinkmerge_config.yml replays the merge that made it.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The YAML config
    #[arg(value_name = "CONFIG.yaml")]
    pub config: PathBuf,
    #[command(flatten)]
    pub common: CommonArgs,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let (mut spec, warnings) = MergeSpec::from_yaml_file(&args.config)?;
    if let Some(dtype) = out_dtype(args.common.out_dtype.as_deref())? {
        spec.out_dtype = Some(dtype);
    }
    if let Some(t) = &args.common.tokenizer_from {
        spec.tokenizer_source = Some(t.clone());
    }
    if let Some(v) = &args.common.vlm.into_vlm {
        spec.into_vlm = Some(v.clone());
    }
    execute(&spec, &args.common, progress, warnings, out)
}

/// Parse `--out-dtype`.
pub fn out_dtype(text: Option<&str>) -> Result<Option<Dtype>> {
    text.map(|t| {
        parse_float_dtype(t)
            .ok_or_else(|| bad!("--out-dtype {t}: expected float32, bfloat16 or float16"))
    })
    .transpose()
}

/// Run `spec` with the shared output flags and report the result.
pub fn execute(
    spec: &MergeSpec,
    common: &CommonArgs,
    progress: bool,
    warnings: Vec<String>,
    out: &mut dyn Write,
) -> Result<()> {
    let (dest, max_shard_size) = common.output.required(spec.method.name())?;
    let options = RunOptions {
        dest,
        force: common.output.force,
        max_shard_size,
        progress: progress && !common.json,
        model_card: !common.output.no_model_card,
    };
    let summary = plan::run(spec, &options, warnings)?;
    for w in &summary.warnings {
        eprintln!("sinkmerge: warning: {w}");
    }
    if common.json {
        super::emit(out, &crate::report::json_text(&summary)?)?;
    } else {
        super::emit(out, &text_report(&summary))?;
    }
    Ok(())
}

fn text_report(s: &Summary) -> String {
    let mut out = format!(
        "{}: {} tensors ({} merged, {} copied), {} {} in {} shard{}, written to {} in {:.1} s\n",
        s.method,
        s.tensors,
        s.merged,
        s.copied,
        human_bytes(s.bytes),
        s.dtype,
        s.shards,
        if s.shards == 1 { "" } else { "s" },
        s.output,
        s.seconds
    );
    if let Some(b) = &s.base {
        out.push_str(&format!("  base:      {b}\n"));
    }
    out.push_str(&format!("  models:    {}\n", s.models.join(", ")));
    out.push_str(&format!("  tokenizer: {}\n", s.tokenizer_from));
    out.push_str("  recorded:  sinkmerge_config.yml (replay with `sinkmerge merge`)\n");
    out
}
