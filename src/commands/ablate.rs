//! `sinkmerge ablate`: the norm-channel ablation (Appendix D.3). In every layer's listed norm
//! scales, the K entries of largest |gamma| become the tensor's mean.

use std::io::Write;

use serde_json::json;

use crate::analysis::ablate::{self, Ablation, AblationPlan, LAYER_NORMS};
use crate::arch::names::Module;
use crate::arch::LayerList;
use crate::bail;
use crate::checkpoint::output::ExtraFile;
use crate::checkpoint::Checkpoint;
use crate::commands::args::RewriteArgs;
use crate::error::Result;
use crate::report::{fmt_num, Table};
use crate::write::model_card::{self, ModelCard};
use crate::write::rewrite::{rewrite, Additions, Edit};

#[derive(Debug, clap::Args)]
#[command(
    about = "Norm-channel ablation: set the top-K |gamma| entries of norm scales to their mean",
    long_about = "Norm-channel ablation (arXiv 2609.00746, Appendix D.3). In every selected layer \
and for every listed norm-scale tensor gamma, replace the K entries of largest |gamma| by the mean \
of all of gamma's entries (the layer-wise channel mean), which removes the channels that carry \
massive activations.\n\n\
Exactly K entries are selected per tensor: entries of equal |gamma| are taken lowest index first, \
so a tie at the K-th magnitude never selects more or fewer. The mean is computed in f64 over the \
stored values before replacement and rounded once to the tensor's dtype. Everything else (other \
tensors, other entries, config.json, tokenizer files) is copied byte for byte.\n\n\
Only per-layer RMSNorm scales of the form `weight * x` are supported; Gemma's `(1 + weight)` \
norms are refused.",
    after_help = "Example:\n  sinkmerge ablate qwen3-vl:ref --norms input_layernorm,q_norm,k_norm --top-k 10 -o ablated/"
)]
pub struct Args {
    /// Model directory, HF repo id or alias
    pub model: String,

    /// Norm scales to ablate, comma-separated
    #[arg(
        long,
        required = true,
        value_delimiter = ',',
        value_name = "NORM,...",
        value_parser = clap::builder::PossibleValuesParser::new(LAYER_NORMS.map(Module::short_name))
    )]
    pub norms: Vec<String>,

    /// Entries replaced per tensor (largest |gamma| first)
    #[arg(
        long,
        default_value_t = 10,
        value_name = "K",
        allow_negative_numbers = true
    )]
    pub top_k: usize,

    /// Layers to ablate: `0-3,7` (0-based, inclusive ranges) or `20:28` (a half-open slice; `20:`
    /// and `:4` are open-ended) [default: all]
    #[arg(long, value_name = "LIST")]
    pub layers: Option<LayerList>,

    #[command(flatten)]
    pub rewrite: RewriteArgs,

    /// Print one JSON object with every ablated tensor's channels and mean instead of text
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let output = args.rewrite.open("ablate")?;
    let to = output.destination();
    if args.top_k == 0 {
        bail!("--top-k must be at least 1");
    }
    crate::commands::args::refuse_repeats("--norms", &args.norms, String::clone)?;
    let model = Checkpoint::open_ref(&args.model)?;
    let norms: Vec<Module> = args
        .norms
        .iter()
        .map(|n| Module::from_short_name(n).expect("validated by clap"))
        .collect();
    let plan = ablate::plan(&model, &norms, args.top_k, args.layers.as_ref())?;
    for w in &plan.warnings {
        eprintln!("sinkmerge: warning: {w}");
    }

    let bar = crate::progress::bytes(model.total_bytes(), "ablating", progress && !args.json);
    let mut card = (!args.rewrite.out.no_model_card).then(|| card(&args, &model, &plan));
    if let (Some(c), Some(v)) = (card.as_mut(), &output.into_vlm) {
        v.mark_card(c, true);
    }
    let additions = Additions {
        files: card.iter().map(|c| c as &dyn ExtraFile).collect(),
        ..Additions::default()
    };
    let rewritten = rewrite(&model, &to, &bar, &additions, |name, info, bytes| {
        if !plan.targets.contains(name) {
            return Ok(Edit::Copy);
        }
        let (bytes, a) =
            ablate::ablate_stored(name, info.dtype, bytes, args.top_k, &model.describe(name))?;
        Ok(Edit::Replace(bytes, a))
    })?;
    let dest = rewritten.dest;

    let ablations: Vec<Ablation> = rewritten.edits.into_iter().map(|(_, a)| a).collect();
    let unchanged: Vec<&Ablation> = ablations
        .iter()
        .filter(|a| a.changed != a.channels.len())
        .collect();
    if let Some(a) = unchanged.first() {
        eprintln!(
            "sinkmerge: warning: in {} tensor(s) some selected entries already equalled the mean \
             (first `{}`: {} of {} changed)",
            unchanged.len(),
            a.tensor,
            a.changed,
            a.channels.len()
        );
    }
    if args.json {
        let value = json!({
            "output": dest.display().to_string(),
            "model": model.label,
            "model_hub": model.hub,
            "top_k": args.top_k,
            "norms": args.norms,
            "layers": plan.layers,
            "tensors": ablations,
        });
        super::emit(out, &crate::report::json_text(&value)?)?;
    } else {
        let mut t = Table::new([
            "tensor",
            "mean",
            "max |gamma| before",
            "channels",
            "changed",
        ]);
        for a in &ablations {
            let shown: Vec<String> = a.channels.iter().take(6).map(|c| c.to_string()).collect();
            let more = if a.channels.len() > 6 { ",..." } else { "" };
            t.row([
                a.tensor.clone(),
                fmt_num(a.mean as f64),
                fmt_num(a.replaced.first().map_or(0.0, |v| v.abs() as f64)),
                format!("{}{more}", shown.join(",")),
                a.changed.to_string(),
            ]);
        }
        super::emit(out, &t.render())?;
        super::emit(
            out,
            &format!(
                "\nablated {} tensors (top {} |gamma| -> mean); wrote {}\n",
                ablations.len(),
                args.top_k,
                dest.display()
            ),
        )?;
    }
    Ok(())
}

/// The model card: the ablation's settings and the command that repeats it.
fn card(args: &Args, model: &Checkpoint, plan: &AblationPlan) -> ModelCard {
    let input = model_card::Input::new("model", true, model);
    let description = format!(
        "`{}` with its norm channels ablated, a control of arXiv 2609.00746 (Appendix D.3): in \
         every selected layer and listed norm scale gamma, the {} entries of largest |gamma| are \
         replaced by the mean of gamma's entries. Every other tensor, config.json and the \
         tokenizer files are the input's, byte for byte.",
        input.name(),
        args.top_k
    );
    let shown_layers = if plan.layers.len() == plan.num_layers {
        format!("all {}", plan.num_layers)
    } else {
        args.layers
            .as_ref()
            .map_or("", LayerList::as_str)
            .to_string()
    };
    let recipe = vec![
        ("norms", args.norms.join(", ")),
        ("top-k", args.top_k.to_string()),
        ("layers", shown_layers),
        ("tensors ablated", plan.targets.len().to_string()),
    ];
    let mut replay = vec![
        "sinkmerge".to_string(),
        "ablate".to_string(),
        input.reference(),
        "--norms".to_string(),
        args.norms.join(","),
        "--top-k".to_string(),
        args.top_k.to_string(),
    ];
    if let Some(spec) = &args.layers {
        replay.extend(["--layers".to_string(), spec.as_str().to_string()]);
    }
    replay.extend(["-o".to_string(), "OUT".to_string()]);
    ModelCard {
        kind: model_card::Kind::Ablation,
        description,
        recipe,
        config_yaml: None,
        inputs: vec![input],
        replay,
    }
}
