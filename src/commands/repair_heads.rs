//! `sinkmerge repair-heads`: restore chosen heads' slices of the attention projections toward
//! the reference, everything else byte for byte (`docs/commands/repair-heads.md`).

use std::io::Write;
use std::path::PathBuf;

use serde::Serialize;
use serde_json::json;

use crate::analysis::heads::{check_same_geometry, Layers, RankBy};
use crate::analysis::repair_heads::{self, Selection, TensorRepair};
use crate::arch::LayerList;
use crate::bail;
use crate::checkpoint::output::{ExtraFile, NamedFile};
use crate::checkpoint::output::{OutputKind, Outputs};
use crate::checkpoint::Checkpoint;
use crate::commands::args::RewriteArgs;
use crate::error::Result;
use crate::forward::weights::Model;
use crate::report::Table;
use crate::sink::prompts::{self, PromptSource};
use crate::write::model_card::{self, ModelCard};
use crate::write::rewrite::{rewrite, Additions, Destination, Edit};

pub const LONG_ABOUT: &str = "Head-selective repair: in TARGET, move the chosen heads' slices of the \
chosen attention projections toward REF, W = (1 - lambda) W_target + lambda W_ref (f32 arithmetic, \
rounded once to the stored dtype; at lambda 1 the slices are REF's bytes). A head's slices are its \
rows of q_proj, its KV head's rows of k_proj and v_proj (repaired once when several chosen heads \
share a KV head), and its columns of o_proj; the q, k and v biases' rows go with their weights. \
Every other byte of TARGET (other tensors and entries, config.json, tokenizer files) is copied \
unchanged, and the selection is recorded in OUT/sinkmerge_config.yml.\n\n\
--heads top:K ranks the heads of the chosen layers as `sinkmerge heads` does (one scoring pass over \
REF and TARGET); random:K draws K of the same heads with --seed, the matched control; LAYER.HEAD,... \
names them.";

pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge repair-heads --ref assets/models/tiny-qwen3/ref assets/models/tiny-qwen3/vl --heads top:2 -o repaired/\n  \
sinkmerge repair-heads --ref REF VLM_LM --heads random:4 --seed 1 --modules q,k,v,o -o control/\n  \
sinkmerge repair-heads --ref REF VLM_LM --heads 20.3,21.0 --lambda 0.5 -o half/";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The reference the slices move toward
    #[arg(long = "ref", value_name = "REF", required = true)]
    pub reference: String,

    /// The model to repair (REF's geometry)
    #[arg(value_name = "TARGET")]
    pub target: String,

    /// `top:K`, `random:K`, or `LAYER.HEAD,...` (0-based)
    #[arg(long, value_name = "SELECTION", required = true)]
    pub heads: Selection,

    /// Seed of `random:K` [default: 0]
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub seed: Option<u64>,

    /// Projections whose head slices move, comma-separated, from q, k, v, o
    #[arg(long, value_name = "LIST", default_value = "q,k")]
    pub modules: String,

    /// How far the slices move toward REF, in [0, 1]
    #[arg(
        long,
        value_name = "LAMBDA",
        default_value_t = 1.0,
        allow_hyphen_values = true
    )]
    pub lambda: f64,

    /// Candidates of top:K and random:K: the heads of the last K layers [default: 10]
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    pub last: Option<usize>,

    /// Candidates of top:K and random:K: the heads of these layers instead (`0-3,7` or `20:28`)
    #[arg(long, value_name = "LIST", conflicts_with = "last")]
    pub layers: Option<LayerList>,

    /// What ranks heads for top:K [default: delta-g]
    #[arg(long, value_enum)]
    pub rank_by: Option<RankBy>,

    /// top:K: prompt file, one prompt per line [default: the 15 built-in prompts]
    #[arg(long, value_name = "FILE", conflicts_with = "n")]
    pub prompts: Option<PathBuf>,

    /// top:K: draw N prompts from the built-in pool instead
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub n: Option<usize>,

    /// top:K: seed of the --n draw
    #[arg(
        long,
        value_name = "SEED",
        default_value_t = 0,
        requires = "n",
        allow_negative_numbers = true
    )]
    pub prompt_seed: u64,

    #[command(flatten)]
    pub rewrite: RewriteArgs,

    /// Print one JSON object: the heads, modules and every repaired tensor
    #[arg(long)]
    pub json: bool,
}

/// What OUT/sinkmerge_config.yml records.
#[derive(Serialize)]
struct Recipe {
    method: &'static str,
    reference: String,
    target: String,
    selection: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rank_by: Option<RankBy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompts: Option<PromptSource>,
    candidate_layers: Vec<usize>,
    heads: Vec<String>,
    modules: Vec<&'static str>,
    lambda: f64,
    /// `--into-vlm`: the VLM whose layout the output is written in.
    #[serde(skip_serializing_if = "Option::is_none")]
    into_vlm: Option<String>,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let output = args.rewrite.open("repair-heads")?;
    let to = output.destination();
    if !(0.0..=1.0).contains(&args.lambda) {
        bail!("--lambda {} is outside [0, 1]", args.lambda);
    }
    let last = args.last.unwrap_or(10);
    if last == 0 {
        bail!("--last must be at least 1");
    }
    let outputs = Outputs::new(to.force)
        .output("-o", Some(to.dir), OutputKind::Model)
        .inputs("--prompts", args.prompts.as_deref());
    outputs.check_before_inputs()?;
    let (seed, rank_by) = (
        args.seed.unwrap_or(0),
        args.rank_by.unwrap_or(RankBy::DeltaG),
    );
    let modules = repair_heads::parse_modules(&args.modules)?;
    let ckpts = [
        Checkpoint::open_ref(&args.reference)?,
        Checkpoint::open_ref(&args.target)?,
    ];
    super::scoring_args::warn_undeclared_layers(&ckpts);
    // Before `top:K`'s scoring pass, so a taken OUT does not fail only when it is written.
    outputs
        .inputs("input", ckpts.iter().map(|c| c.dir.as_path()))
        .check()?;
    let (ref_model, target_model) = (Model::new(&ckpts[0])?, Model::new(&ckpts[1])?);
    check_same_geometry(&ref_model, &target_model)?;
    let spec = &ref_model.spec;
    let layers = match &args.layers {
        Some(list) => Layers::List(list.resolve(spec.num_layers())?),
        None => Layers::Last(last),
    };
    let candidate_layers = layers.of(spec.num_layers());
    // After the layers are checked against the model, so a list outside it is named as such.
    check_mode_flags(&args)?;
    let candidates: Vec<(usize, usize)> = (candidate_layers.iter())
        .flat_map(|&l| (0..spec.num_heads).map(move |h| (l, h)))
        .collect();
    repair_heads::check_selection(&args.heads, spec, candidates.len())?;
    let show = progress && !args.json;

    let mut prompt_source = None;
    let chosen = match &args.heads {
        Selection::List(list) => {
            let mut list = list.clone();
            list.sort_unstable();
            list
        }
        Selection::Random(k) => repair_heads::draw_heads(&candidates, *k, seed),
        Selection::Top(k) => {
            let (prompts, source) =
                prompts::choose(args.prompts.as_deref(), args.n, args.prompt_seed)?;
            prompt_source = Some(source);
            repair_heads::top_heads(
                &ckpts,
                &prompts,
                &candidate_layers,
                spec.num_layers(),
                rank_by,
                *k,
                show,
            )?
        }
    };

    let plan = repair_heads::plan(spec, &chosen, &modules);
    let stored = repair_heads::by_stored_name(&target_model, &plan)?;
    let lambda = args.lambda as f32;
    let recipe = Recipe {
        method: "repair_heads",
        reference: model_card::Input::new("reference", true, &ckpts[0]).reference(),
        target: model_card::Input::new("target", true, &ckpts[1]).reference(),
        selection: args.heads.to_string(),
        seed: matches!(args.heads, Selection::Random(_)).then_some(seed),
        rank_by: matches!(args.heads, Selection::Top(_)).then_some(rank_by),
        prompts: prompt_source,
        candidate_layers,
        heads: chosen.iter().map(|(l, h)| format!("{l}.{h}")).collect(),
        modules: modules.iter().map(|m| m.short_name()).collect(),
        lambda: args.lambda,
        into_vlm: (output.into_vlm.as_ref()).map(|v| v.card_input().reference()),
    };
    let yaml = serde_yaml_ng::to_string(&recipe).expect("the recipe serializes");
    let mut card = (!args.rewrite.out.no_model_card).then(|| card(&args, &ckpts, &recipe, &yaml));
    if let (Some(c), Some(v)) = (card.as_mut(), &output.into_vlm) {
        v.mark_card(c, true);
    }
    let config = NamedFile {
        name: "sinkmerge_config.yml",
        bytes: yaml.into_bytes(),
    };
    let mut files: Vec<&dyn ExtraFile> = vec![&config];
    files.extend(card.iter().map(|c| c as &dyn ExtraFile));
    let additions = Additions {
        files,
        ..Additions::default()
    };
    let bar = crate::progress::bytes(ckpts[1].total_bytes(), "repairing", show);
    let rewritten = rewrite(
        &ckpts[1],
        &Destination {
            other_inputs: &[ckpts[0].dir.as_path()],
            ..to
        },
        &bar,
        &additions,
        |name, info, bytes| -> Result<Edit<TensorRepair>> {
            let Some(planned) = stored.get(name) else {
                return Ok(Edit::Copy);
            };
            let what = ckpts[1].describe(name);
            let (out, report) =
                repair_heads::repair_stored(&ref_model, planned, name, info, bytes, lambda, &what)?;
            Ok(Edit::Replace(out, report))
        },
    )?;
    let dest = rewritten.dest;
    let repairs: Vec<TensorRepair> = rewritten.edits.into_iter().map(|(_, r)| r).collect();

    if args.json {
        let value = json!({
            "output": dest.display().to_string(),
            "reference": ckpts[0].label,
            "target": ckpts[1].label,
            "selection": recipe.selection,
            "heads": recipe.heads,
            "modules": recipe.modules,
            "lambda": args.lambda,
            "tensors": repairs,
        });
        super::emit(out, &crate::report::json_text(&value)?)?;
    } else {
        let mut t = Table::new(["tensor", "entries", "changed"]);
        for r in &repairs {
            t.row([
                r.tensor.clone(),
                r.entries.to_string(),
                r.changed.to_string(),
            ]);
        }
        super::emit(out, &t.render())?;
        super::emit(
            out,
            &format!(
                "\nrepaired heads {} ({}; modules {}; lambda {}) toward {}; wrote {}\n",
                recipe.heads.join(","),
                recipe.selection,
                recipe.modules.join(","),
                args.lambda,
                ckpts[0].label,
                dest.display()
            ),
        )?;
    }
    Ok(())
}

/// Refuse a flag that does nothing with the `--heads` given, as `score` refuses `--seed` without
/// `--n`: the user meant something by it, and ignoring it would hide that it had no effect.
fn check_mode_flags(args: &Args) -> Result<()> {
    let (top, random) = match args.heads {
        Selection::Top(_) => (true, false),
        Selection::Random(_) => (false, true),
        Selection::List(_) => (false, false),
    };
    let given = [
        ("--seed", args.seed.is_some(), random, "random:K"),
        ("--n", args.n.is_some(), top, "top:K"),
        ("--prompts", args.prompts.is_some(), top, "top:K"),
        ("--rank-by", args.rank_by.is_some(), top, "top:K"),
        (
            "--last",
            args.last.is_some(),
            top || random,
            "top:K and random:K",
        ),
        (
            "--layers",
            args.layers.is_some(),
            top || random,
            "top:K and random:K",
        ),
    ];
    for (flag, set, applies, mode) in given {
        if set && !applies {
            bail!(
                "{flag} applies to --heads {mode} only; with --heads {} it would do nothing",
                args.heads
            );
        }
    }
    Ok(())
}

/// The model card: what moved, the recipe, and the command that repeats it.
fn card(args: &Args, ckpts: &[Checkpoint; 2], recipe: &Recipe, yaml: &str) -> ModelCard {
    let reference = model_card::Input::new("reference", true, &ckpts[0]);
    let target = model_card::Input::new("target", true, &ckpts[1]);
    let description = format!(
        "`{}` with the attention heads {} moved toward `{}` (W = (1 - {l}) W_target + {l} W_ref on \
         their {} slices), a head-selective repair after arXiv 2609.00746. Every other tensor, \
         entry, config.json and the tokenizer files are the target's, byte for byte.",
        target.name(),
        recipe.heads.join(", "),
        reference.name(),
        recipe.modules.join(", "),
        l = args.lambda,
    );
    let mut replay = vec![
        "sinkmerge".to_string(),
        "repair-heads".to_string(),
        "--ref".to_string(),
        reference.reference(),
        target.reference(),
        "--heads".to_string(),
        // The resolved heads replay exactly, whatever ranked or drew them.
        recipe.heads.join(","),
        "--modules".to_string(),
        recipe.modules.join(","),
        "--lambda".to_string(),
        args.lambda.to_string(),
    ];
    replay.extend(["-o".to_string(), "OUT".to_string()]);
    ModelCard {
        kind: model_card::Kind::HeadRepair,
        description,
        recipe: vec![
            ("selection", recipe.selection.clone()),
            ("heads", recipe.heads.join(", ")),
            ("modules", recipe.modules.join(", ")),
            ("lambda", args.lambda.to_string()),
        ],
        config_yaml: Some(yaml.to_string()),
        inputs: vec![reference, target],
        replay,
    }
}
