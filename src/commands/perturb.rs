//! `sinkmerge perturb`: the random-dW control (Appendix D.4). Every attention and MLP projection
//! of REF gets Gaussian noise with the Frobenius size of TARGET's change to it.

use std::collections::BTreeMap;
use std::io::Write;

use serde_json::json;

use crate::analysis::perturb::{self, TensorReport};
use crate::arch::names;
use crate::checkpoint::output::ExtraFile;
use crate::checkpoint::Checkpoint;
use crate::commands::args::RewriteArgs;
use crate::error::Result;
use crate::report::{fmt_num, Table};
use crate::write::model_card::{self, ModelCard};
use crate::write::rewrite::{rewrite, Additions, Destination, Edit};

#[derive(Debug, clap::Args)]
#[command(
    about = "Random-dW control: add Gaussian noise matching TARGET's per-tensor drift to REF",
    long_about = "Random-dW control (arXiv 2609.00746, Appendix D.4). To every attention \
projection (q/k/v/o) and MLP projection (gate/up/down, dense or per expert) weight W of REF, add \
Gaussian noise G scaled so that the stored output's drift equals TARGET's for that tensor:\n\n  \
||OUT - W||_F / ||W||_F = ||W_TARGET - W||_F / ||W||_F\n\n\
The scale is solved on the values as stored in REF's dtype (rounding included), not just in \
expectation: the search stops when realized and target drift agree to 1e-5 relative. Only a \
target drift below the dtype's rounding resolution can end farther off (a warning then names the \
tensor when the mismatch exceeds 1e-3). Biases, norm scales, \
embeddings, the LM head, MoE routers and every other tensor are copied byte for byte, as are \
config.json and the tokenizer files.\n\n\
Tensors are matched by their standard causal-LM name, so TARGET may be a VLM (e.g. \
`model.language_model.layers.*`) while REF is its reference LLM. The noise of a tensor comes \
from a ChaCha8 stream seeded by (--seed, REF's tensor name): the output is the same bytes at any \
thread count.",
    after_help = "Example (TARGET may be the VLM itself):\n  sinkmerge perturb qwen2.5-vl:ref --match qwen2.5-vl -o random-dw/ --seed 0"
)]
pub struct Args {
    /// Reference model (directory, HF repo id or alias) whose projections get the noise
    #[arg(value_name = "REF")]
    pub reference: String,

    /// Model whose per-tensor drift from REF sets the noise size (e.g. the VLM's language model)
    #[arg(long = "match", value_name = "TARGET")]
    pub target: String,

    /// Seed of the noise
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,

    #[command(flatten)]
    pub rewrite: RewriteArgs,

    /// Print one JSON object with every tensor's target and realized drift instead of text
    #[arg(long)]
    pub json: bool,
}

/// Realized and target drift may differ by this much (relative) before a warning.
const WARN_MISMATCH: f64 = 1e-3;

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let output = args.rewrite.open("perturb")?;
    let to = output.destination();
    let reference = Checkpoint::open_ref(&args.reference)?;
    let target = Checkpoint::open_ref(&args.target)?;
    let pairing = perturb::pair(&reference, &target)?;
    for w in &pairing.warnings {
        eprintln!("sinkmerge: warning: {w}");
    }

    let bar = crate::progress::bytes(
        reference.total_bytes(),
        "perturbing",
        progress && !args.json,
    );
    let perturbed = pairing.partners.len();
    let mut card = (!args.rewrite.out.no_model_card).then(|| {
        card(
            &args,
            &reference,
            &target,
            perturbed,
            reference.names().len() - perturbed,
        )
    });
    if let (Some(c), Some(v)) = (card.as_mut(), &output.into_vlm) {
        v.mark_card(c, true);
    }
    let additions = Additions {
        files: card.iter().map(|c| c as &dyn ExtraFile).collect(),
        ..Additions::default()
    };
    let rewritten = rewrite(
        &reference,
        &Destination {
            other_inputs: &[&target.dir],
            ..to
        },
        &bar,
        &additions,
        |name, info, w| {
            let Some(other) = pairing.partners.get(name) else {
                return Ok(Edit::Copy);
            };
            let (bytes, report) = perturb::perturb_tensor(
                name,
                args.seed,
                info.dtype,
                w,
                target.require(other)?.dtype,
                target.bytes(other)?,
                &reference.describe(name),
            )?;
            Ok(match bytes {
                Some(b) => Edit::Replace(b, report),
                None => Edit::Keep(report),
            })
        },
    )?;
    let dest = rewritten.dest;

    let reports: Vec<TensorReport> = rewritten.edits.into_iter().map(|(_, r)| r).collect();
    let worst = reports
        .iter()
        .max_by(|a, b| a.mismatch.total_cmp(&b.mismatch))
        .expect("pair() refuses a model without projections, and each gets a report");
    if worst.mismatch > WARN_MISMATCH {
        eprintln!(
            "sinkmerge: warning: `{}`: realized drift {} vs target {} (relative mismatch {}); \
             the target drift is below what {}'s rounding can resolve",
            worst.tensor,
            fmt_num(worst.realized_drift),
            fmt_num(worst.target_drift),
            fmt_num(worst.mismatch),
            reference.label
        );
    }
    let max_cos = reports
        .iter()
        .map(|r| r.cosine_with_target_dw.abs())
        .fold(0.0, f64::max);
    if args.json {
        let value = json!({
            "output": dest.display().to_string(),
            "reference": reference.label,
            "reference_hub": reference.hub,
            "target": target.label,
            "target_hub": target.hub,
            "seed": args.seed,
            "perturbed": reports.len(),
            "copied": reference.names().len() - reports.len(),
            "max_mismatch": worst.mismatch,
            "max_abs_cosine": max_cos,
            "tensors": reports,
        });
        super::emit(out, &crate::report::json_text(&value)?)?;
    } else {
        super::emit(out, &summary(&reports))?;
        super::emit(
            out,
            &format!(
                "\nperturbed {} tensors, copied {} unchanged; worst drift mismatch {} ({}); \
             max |cosine(noise, target dW)| {}\n",
                reports.len(),
                reference.names().len() - reports.len(),
                fmt_num(worst.mismatch),
                worst.tensor,
                fmt_num(max_cos)
            ),
        )?;
        super::emit(out, &format!("wrote {}\n", dest.display()))?;
    }
    Ok(())
}

/// The model card. Only REF is a `base_model`: the weights are its own plus noise, and TARGET
/// sets only the noise's size.
fn card(
    args: &Args,
    reference: &Checkpoint,
    target: &Checkpoint,
    perturbed: usize,
    copied: usize,
) -> ModelCard {
    let r = model_card::Input::new("reference", true, reference);
    let t = model_card::Input::new("drift target", false, target);
    let description = format!(
        "`{}` with random noise in place of a learned change, the random-dW control of arXiv \
         2609.00746 (Appendix D.4): every attention and MLP projection W gets Gaussian noise \
         scaled so that its drift ||OUT - W||_F / ||W||_F equals `{}`'s for that tensor. Every \
         other tensor, config.json and the tokenizer files are the reference's, byte for byte.",
        r.name(),
        t.name()
    );
    let recipe = vec![
        ("seed", args.seed.to_string()),
        (
            "noise",
            "Gaussian, ChaCha8 stream per (seed, tensor name)".to_string(),
        ),
        ("tensors perturbed", perturbed.to_string()),
        ("tensors copied", copied.to_string()),
    ];
    let replay = vec![
        "sinkmerge".to_string(),
        "perturb".to_string(),
        r.reference(),
        "--match".to_string(),
        t.reference(),
        "--seed".to_string(),
        args.seed.to_string(),
        "-o".to_string(),
        "OUT".to_string(),
    ];
    ModelCard {
        kind: model_card::Kind::Perturbation,
        description,
        recipe,
        config_yaml: None,
        inputs: vec![r, t],
        replay,
    }
}

/// Per projection kind: tensor count, median target drift, worst mismatch and cosine.
fn summary(reports: &[TensorReport]) -> String {
    let mut by_module: BTreeMap<String, Vec<&TensorReport>> = BTreeMap::new();
    for r in reports {
        let key = names::standard_name(&r.tensor)
            .as_deref()
            .and_then(names::parse)
            .map_or_else(|| "other".to_string(), |p| p.module.short_name().into());
        by_module.entry(key).or_default().push(r);
    }
    let mut t = Table::new([
        "module",
        "tensors",
        "median drift",
        "max mismatch",
        "max |cos|",
    ]);
    for (module, rs) in by_module {
        let mut drifts: Vec<f64> = rs.iter().map(|r| r.target_drift).collect();
        drifts.sort_by(f64::total_cmp);
        let n = drifts.len();
        let median = if n % 2 == 1 {
            drifts[n / 2]
        } else {
            (drifts[n / 2 - 1] + drifts[n / 2]) / 2.0
        };
        let mismatch = rs.iter().map(|r| r.mismatch).fold(0.0, f64::max);
        let cos = rs
            .iter()
            .map(|r| r.cosine_with_target_dw.abs())
            .fold(0.0, f64::max);
        t.row([
            module,
            rs.len().to_string(),
            fmt_num(median),
            fmt_num(mismatch),
            fmt_num(cos),
        ]);
    }
    t.render()
}
