//! `sinkmerge ablate`: the norm-channel ablation (Appendix D.3). In every layer's listed norm
//! scales, the K entries of largest |gamma| become the tensor's mean.

use std::collections::{BTreeSet, HashMap, HashSet};

use serde_json::{json, Value};

use crate::analysis::ablate::{self, Ablation, LAYER_NORMS};
use crate::arch::names::{self, Module, Param};
use crate::arch::{LayerList, QkNorm, TextConfig};
use crate::checkpoint::rewrite::{rewrite, Additions, Edit};
use crate::checkpoint::{dtype, Checkpoint};
use crate::cli::OutputArgs;
use crate::error::Result;
use crate::report::model_card::{self, ModelCard};
use crate::report::{fmt_num, Table};
use crate::{bad, bail};

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
    #[arg(long, default_value_t = 10, value_name = "K")]
    pub top_k: usize,

    /// Layers to ablate: `0-3,7` (0-based, inclusive ranges) or `20:28` (a half-open slice; `20:`
    /// and `:4` are open-ended) [default: all]
    #[arg(long, value_name = "LIST")]
    pub layers: Option<LayerList>,

    #[command(flatten)]
    pub out: OutputArgs,

    /// Print one JSON object with every ablated tensor's channels and mean instead of text
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args, progress: bool) -> Result<()> {
    let to = args.out.destination("ablate")?;
    if args.top_k == 0 {
        bail!("--top-k must be at least 1");
    }
    let model = Checkpoint::open_ref(&args.model)?;
    let model_type = crate::arch::config::text_section(&model.config)
        .0
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if model_type.starts_with("gemma") {
        bail!(
            "{}: model_type `{model_type}` stores norm scales as offsets (1 + weight); ablate \
             supports plain RMSNorm scales only",
            model.label
        );
    }
    let text = TextConfig::from_model_config(&model.config).ok();
    let norms: Vec<Module> = args
        .norms
        .iter()
        .map(|n| Module::from_short_name(n).expect("validated by clap"))
        .collect();

    // Every per-layer norm tensor of the model: (layer, module) -> stored name.
    let mut present: HashMap<(usize, Module), &String> = HashMap::new();
    for name in model.names() {
        if let Some(p) = names::standard_name(name).as_deref().and_then(names::parse) {
            if let (Some(layer), Param::Weight) = (p.layer, p.param) {
                if LAYER_NORMS.contains(&p.module) {
                    present.insert((layer, p.module), name);
                }
            }
        }
    }
    let all_layers: BTreeSet<usize> = present.keys().map(|&(l, _)| l).collect();
    let num_layers = text
        .as_ref()
        .map(|c| c.num_hidden_layers)
        .unwrap_or_else(|| all_layers.last().map_or(0, |l| l + 1));
    let layers = match &args.layers {
        Some(spec) => spec.resolve(num_layers)?,
        None => (0..num_layers).collect(),
    };

    let mut targets: HashSet<&str> = HashSet::new();
    for &module in &norms {
        if !present.keys().any(|&(_, m)| m == module) {
            let has: Vec<&str> = LAYER_NORMS
                .iter()
                .filter(|m| present.keys().any(|&(_, p)| p == **m))
                .map(|m| m.short_name())
                .collect();
            let qk = if matches!(module, Module::QNorm | Module::KNorm) {
                let q_len = present
                    .iter()
                    .find(|((_, m), _)| *m == Module::QNorm)
                    .and_then(|(_, n)| model.info(n).map(|i| i.numel()));
                format!(
                    " (QK-norm class: {})",
                    QkNorm::classify(q_len, text.as_ref()).as_str()
                )
            } else {
                String::new()
            };
            bail!(
                "{}: the architecture has no `{}` tensors{qk}; its per-layer norms are: {}",
                model.label,
                module.short_name(),
                has.join(", ")
            );
        }
        for &layer in &layers {
            let name = present.get(&(layer, module)).ok_or_else(|| {
                bad!(
                    "{}: tensor `{}` is missing (other layers have it)",
                    model.label,
                    names::layer_name(layer, module, Param::Weight)
                )
            })?;
            let info = model.require(name)?;
            if !dtype::is_float(info.dtype) {
                bail!(
                    "{}: dtype {:?} is not floating point",
                    model.describe(name),
                    info.dtype
                );
            }
            if info.numel() < args.top_k {
                bail!(
                    "{}: has {} entries, fewer than --top-k {}",
                    model.describe(name),
                    info.numel(),
                    args.top_k
                );
            }
            targets.insert(name.as_str());
        }
    }

    let bar = crate::progress::bytes(model.total_bytes(), "ablating", progress && !args.json);
    let rewritten = rewrite(
        &model,
        &to,
        &bar,
        &Additions::default(),
        |name, info, bytes| {
            if !targets.contains(name) {
                return Ok(Edit::Copy);
            }
            let what = model.describe(name);
            let mut values = dtype::decode(info.dtype, bytes, &what)?;
            if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
                bail!("{what}: entry {bad} is {}", values[bad]);
            }
            let round = |x: f32| {
                let enc = dtype::encode(info.dtype, &[x]).expect("float dtype");
                dtype::decode(info.dtype, &enc, "").expect("float dtype")[0]
            };
            let a = ablate::ablate(name, &mut values, args.top_k, round);
            Ok(Edit::Replace(dtype::encode(info.dtype, &values)?, a))
        },
    )?;
    if !args.out.no_model_card {
        card(&args, &model, &layers, num_layers, targets.len()).write(&rewritten.out)?;
    }
    let dest = rewritten.out.commit()?;

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
            "layers": layers,
            "tensors": ablations,
        });
        println!("{}", serde_json::to_string_pretty(&value).expect("JSON"));
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
        print!("{}", t.render());
        println!(
            "\nablated {} tensors (top {} |gamma| -> mean); wrote {}",
            ablations.len(),
            args.top_k,
            dest.display()
        );
    }
    Ok(())
}

/// The model card: the ablation's settings and the command that repeats it.
fn card(
    args: &Args,
    model: &Checkpoint,
    layers: &[usize],
    num_layers: usize,
    tensors: usize,
) -> ModelCard {
    let input = model_card::Input::new("model", true, model);
    let description = format!(
        "`{}` with its norm channels ablated, a control of arXiv 2609.00746 (Appendix D.3): in \
         every selected layer and listed norm scale gamma, the {} entries of largest |gamma| are \
         replaced by the mean of gamma's entries. Every other tensor, config.json and the \
         tokenizer files are the input's, byte for byte.",
        input.name(),
        args.top_k
    );
    let shown_layers = if layers.len() == num_layers {
        format!("all {num_layers}")
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
        ("tensors ablated", tensors.to_string()),
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
