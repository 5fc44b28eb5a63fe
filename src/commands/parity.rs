//! `sinkmerge parity`: the GPU scorer against the CPU scorer on the same models and token ids,
//! for checking a GPU installation (and what `benches/gpu_check.sh` runs first).

use std::io::Write;

use serde::Serialize;

use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::forward::backend::cuda::driver::Driver;
use crate::forward::backend::cuda::{CudaBackend, Device as _};
use crate::forward::device::ComputeDevice;
use crate::forward::precision::Precision;
use crate::report::{json_text, Table};
use crate::sink::parity::{self, Parity};

/// `sinkmerge parity --help`.
pub const LONG_ABOUT: &str =
    "Run each MODEL (and REF) through the GPU scorer and the CPU scorer on \
the same token ids and compare: the largest difference of any attention probability and of any \
logit of a full forward pass, and S (every layer as the window), with --ref also G_base, B_gap and \
the margin. Tolerances (absolute), f32: probabilities 1e-5, logits 1e-4, metrics 1e-4; bf16: \
2^-8, 2^-4 and 0.02 (one bf16 step: a GEMM summed in another order may round the other way). \
A MODEL with a vision tower also runs it on both backends on a bundled \
image through its own processor: image_embeds within 1e-4 relative (bf16: 2^-4). Exits 0 when \
every difference is within them and 1 when one is not.\n\n\
Token ids: the 15 built-in prompts through the tokenizer (REF's for every model with --ref) when \
every model has a tokenizer.json; otherwise four fixed pseudo-random prompts of 7, 16, 33 and 60 \
tokens.";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Models to compare: directories, HF repo ids (`ORG/NAME[@rev]`) or aliases
    #[arg(required = true, value_name = "MODEL")]
    pub models: Vec<String>,

    /// Reference LLM: also compare G_base, B_gap and the margin of each MODEL against it
    #[arg(long = "ref", value_name = "REF")]
    pub reference: Option<String>,

    /// The GPU to check: `cuda` or `cuda:N`
    #[arg(long, value_name = "DEVICE", default_value = "cuda")]
    pub device: ComputeDevice,

    /// Arithmetic of both sides: f32, or transformers' bf16 path (bf16 tolerances apply)
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,

    /// Print one JSON object: traces, metrics, holds
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report<'a> {
    device: String,
    tokens: &'static str,
    #[serde(flatten)]
    parity: &'a Parity,
    holds: bool,
}

pub fn run(args: Args, out: &mut dyn Write) -> Result<()> {
    let ComputeDevice::Cuda(ordinal) = args.device else {
        bail!("--device cpu: parity compares a GPU with the CPU; give --device cuda or cuda:N");
    };
    let mut refs: Vec<&str> = args.reference.iter().map(String::as_str).collect();
    refs.extend(args.models.iter().map(String::as_str));
    let ckpts: Vec<Checkpoint> = refs
        .iter()
        .map(|r| Checkpoint::open_ref(r))
        .collect::<Result<_>>()?;
    let (tokens, source) = parity::parity_tokens(&ckpts, args.reference.is_some())?;
    let backend = CudaBackend::new(Driver::open(ordinal)?, args.precision);
    let inputs: Vec<&Checkpoint> = ckpts.iter().collect();
    let parity = parity::check(&backend, &inputs, &tokens, args.reference.is_some())?;
    let holds = parity.holds();
    let report = Report {
        device: backend.device().describe(),
        tokens: source,
        parity: &parity,
        holds,
    };
    if args.json {
        super::emit(out, &json_text(&report)?)?;
    } else {
        super::emit(out, &render_text(&report))?;
    }
    if !holds {
        let t = &parity.tolerances;
        return Err(Error::Internal(format!(
            "{}: GPU and CPU differ beyond the {} tolerances (probabilities {:e}, logits {:e}, \
             metrics {:e}, image embeddings {:e} relative)",
            report.device, parity.precision, t.probs, t.logits, t.metrics, t.image_embeds
        )));
    }
    Ok(())
}

fn render_text(report: &Report) -> String {
    let mut out = format!(
        "{} against the CPU; tokens: {}\n\n",
        report.device, report.tokens
    );
    let mut traces = Table::new(["model", "max |dP|", "max |dlogit|"]);
    for t in &report.parity.traces {
        traces.row([
            t.model.clone(),
            format!("{:.2e}", t.max_prob_diff),
            format!("{:.2e}", t.max_logit_diff),
        ]);
    }
    out.push_str(&traces.render());
    if !report.parity.towers.is_empty() {
        let mut towers = Table::new(["vision tower", "image tokens", "max |d| / max"]);
        for t in &report.parity.towers {
            towers.row([
                t.model.clone(),
                t.image_tokens.to_string(),
                format!("{:.2e}", t.max_relative_diff),
            ]);
        }
        out.push('\n');
        out.push_str(&towers.render());
    }
    let mut metrics = Table::new(["metric", "cpu", "gpu", "|diff|"]);
    let show = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.6}"));
    for m in &report.parity.metrics {
        metrics.row([
            m.metric.clone(),
            show(m.cpu),
            show(m.other),
            format!("{:.2e}", m.diff()),
        ]);
    }
    out.push('\n');
    out.push_str(&metrics.render());
    out.push_str(if report.holds {
        "\nparity holds\n"
    } else {
        "\nparity FAILS\n"
    });
    out
}
