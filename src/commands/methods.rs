//! `sinkmerge linear | task-arithmetic | ties | dare | tsv | star`: one merge method each, with
//! mergekit's defaults. Each command builds the same [`MergeSpec`] a YAML config would, so
//! `sinkmerge merge OUT/sinkmerge_config.yml` replays it.

use std::io::Write;

use clap::ValueEnum;

use crate::commands::args::CommonArgs;
use crate::error::Result;
use crate::merge::dare::{self, Rescale};
use crate::merge::params::{ParamSpec, ParamValue, Setting, Settings};
use crate::merge::task_vector::{self, Election};
use crate::merge::ties::{self, Trim};
use crate::merge::{self, linear, star, task_arithmetic, tsv, MergeSpec, ModelEntry};

/// The models of a task-vector method.
#[derive(Debug, clap::Args)]
pub struct TaskModels {
    /// Base model the task vectors are taken from (directory, HF repo id or alias)
    #[arg(long, value_name = "MODEL")]
    pub base: String,

    /// Models whose task vectors (model - base) are merged
    #[arg(long, required = true, num_args = 1.., value_name = "MODEL")]
    pub models: Vec<String>,
}

/// Per-model weights (`--weights`).
#[derive(Debug, clap::Args)]
pub struct Weights {
    /// Comma-separated weights, one per model or one for all [default: 1 each]
    #[arg(
        long,
        value_delimiter = ',',
        allow_hyphen_values = true,
        value_name = "W,..."
    )]
    pub weights: Vec<f64>,
}

/// The scale of a task-vector method's merged task vector (`--lambda`).
#[derive(Debug, clap::Args)]
pub struct Lambda {
    /// Scale of the merged task vector
    #[arg(
        long = "lambda",
        default_value_t = 1.0,
        allow_hyphen_values = true,
        value_name = "L"
    )]
    pub lambda: f64,
}

/// The models of a weighted task-vector method (task arithmetic, TIES, DARE) and their weights.
#[derive(Debug, clap::Args)]
pub struct WeightedTaskModels {
    #[command(flatten)]
    pub models: TaskModels,
    #[command(flatten)]
    pub weights: Weights,
}

/// How task arithmetic and DARE combine the task vectors: scaled by `--lambda`, normalized only
/// on request (mergekit's default for both).
#[derive(Debug, clap::Args)]
pub struct ScaledSum {
    #[command(flatten)]
    pub lambda: Lambda,
    /// Divide the weighted sum by the sum of the weights (mergekit default: off)
    #[arg(long)]
    pub normalize: bool,
}

/// Weighted average of models: sum_i w_i x_i / sum_i w_i (mergekit `linear`).
///
/// The weights are normalized to sum to 1 unless --no-normalize. Embeddings and lm_head of
/// differing vocabularies are cropped to the rows all models share; any other shape mismatch
/// is an error. The output's config is the first model's.
#[derive(Debug, clap::Args)]
pub struct LinearArgs {
    /// Models to average (directories, HF repo ids or aliases)
    #[arg(long, required = true, num_args = 1.., value_name = "MODEL")]
    pub models: Vec<String>,
    #[command(flatten)]
    pub weights: Weights,
    /// Use the weights as given instead of dividing by their sum
    #[arg(long)]
    pub no_normalize: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Task arithmetic: base + lambda * sum_i w_i (model_i - base) (mergekit `task_arithmetic`).
///
/// The official code (Ilharco et al. 2023) has no per-model weights: leave --weights at 1.
/// Larger vocabularies are cropped to the base's; the output's config is the base's.
#[derive(Debug, clap::Args)]
pub struct TaskArithmeticArgs {
    #[command(flatten)]
    pub inputs: WeightedTaskModels,
    #[command(flatten)]
    pub combine: ScaledSum,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// TIES-Merging: trim, elect sign, disjoint mean (mergekit `ties`).
///
/// Each task vector keeps its max(1, int(density * numel)) largest magnitudes per tensor
/// (ties at the threshold: lowest index first); weights are applied, each entry's sign is
/// elected, and the agreeing entries are averaged by their weights (--no-normalize sums them).
/// Paper setting: --density 0.2 --lambda 1.
#[derive(Debug, clap::Args)]
pub struct TiesArgs {
    #[command(flatten)]
    pub inputs: WeightedTaskModels,
    /// Fraction of each task vector's entries kept, in (0, 1]; comma-separated per model
    #[arg(
        long,
        required = true,
        value_delimiter = ',',
        allow_hyphen_values = true,
        value_name = "D,..."
    )]
    pub density: Vec<f64>,
    #[command(flatten)]
    pub lambda: Lambda,
    /// Where the top-k threshold is taken
    #[arg(long, value_enum, default_value = "local")]
    pub trim: Trim,
    /// How each entry's sign is elected
    #[arg(long, value_enum, default_value = "sum")]
    pub election: Election,
    /// Sum the agreeing entries instead of averaging them
    #[arg(long)]
    pub no_normalize: bool,
    /// Scale each trimmed task vector back to its original L1 norm (mergekit `rescale: true`)
    #[arg(long)]
    pub rescale: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Consensus {
    /// Task arithmetic on the dropped task vectors (mergekit `dare_linear`)
    None,
    /// TIES sign election on the dropped task vectors (mergekit `dare_ties`)
    Ties,
}

/// DARE: drop task-vector entries at random and rescale (mergekit `dare_linear` / `dare_ties`).
///
/// Each entry is kept with probability --density (= 1 - --drop-rate), from a random stream
/// seeded by (--seed, tensor name, model), so results are identical at any thread count.
/// Paper setting: --drop-rate 0.9 --lambda 1.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("keep").required(true).args(["density", "drop_rate"]))]
// `--normalize` here also covers dare_ties, whose divisor is the agreeing models' weight sum.
#[command(mut_arg("normalize", |arg| arg.help("Divide by the (agreeing) models' weight sum (mergekit default: off)")))]
pub struct DareArgs {
    #[command(flatten)]
    pub inputs: WeightedTaskModels,
    /// Probability of keeping an entry, in (0, 1]; comma-separated per model
    #[arg(
        long,
        value_delimiter = ',',
        allow_hyphen_values = true,
        value_name = "D,..."
    )]
    pub density: Vec<f64>,
    /// Probability of dropping an entry (the paper's p; density = 1 - p); comma-separated
    #[arg(
        long,
        value_delimiter = ',',
        allow_hyphen_values = true,
        value_name = "P,..."
    )]
    pub drop_rate: Vec<f64>,
    /// How the dropped task vectors are combined
    #[arg(long, value_enum, default_value = "none")]
    pub consensus: Consensus,
    /// How the kept entries are rescaled
    #[arg(long, value_enum, default_value = "l1")]
    pub rescale: Rescale,
    /// Seed of the drop masks
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,
    #[command(flatten)]
    pub combine: ScaledSum,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// TSV-Merge: task singular vectors (Gargiulo et al. 2025, official TSVM code).
///
/// Each 2-D task vector keeps its top floor(min(m,n)/T) singular triplets; the concatenated
/// singular vectors are replaced by their orthogonal polar factors; 1-D tensors (and, unless
/// --svd-embeddings, embed_tokens and lm_head) are averaged; alpha scales everything.
/// Paper setting: --alpha 1.
#[derive(Debug, clap::Args)]
pub struct TsvArgs {
    #[command(flatten)]
    pub models: TaskModels,
    /// Scale of the merged task vector
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    pub alpha: f64,
    /// Also decompose embed_tokens and lm_head, as the official code does
    #[arg(long)]
    pub svd_embeddings: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// STAR: spectral truncation and rescale, then average (Lee et al. 2025, official code).
///
/// Each 2-D task vector keeps the fewest leading singular components that hold --eta percent of
/// its nuclear norm, rescaled to the full nuclear norm; the results are averaged (1/T). 1-D
/// tensors (and, unless --svd-embeddings, embed_tokens and lm_head) are averaged.
/// Paper setting: --eta 40.
#[derive(Debug, clap::Args)]
pub struct StarArgs {
    #[command(flatten)]
    pub models: TaskModels,
    /// Percent of each task vector's nuclear norm kept, in (0, 100]
    #[arg(long, default_value_t = 40.0, allow_hyphen_values = true)]
    pub eta: f64,
    /// Also decompose embed_tokens and lm_head
    #[arg(long)]
    pub svd_embeddings: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// A top-level setting of `spec`.
fn set(spec: &ParamSpec, value: ParamValue) -> (String, Setting) {
    (spec.name.to_string(), Setting::Scalar(value))
}

/// A choice flag as its parameter value: the flag's enum names are the spec's options.
fn choice(value: impl ValueEnum) -> ParamValue {
    let name = value.to_possible_value().expect("no variant is skipped");
    ParamValue::Choice(name.get_name().to_string())
}

/// Per-model values from a comma list: one for all, or one per model.
fn per_model(
    flag: &str,
    values: &[f64],
    models: usize,
    default: Option<f64>,
) -> Result<Vec<Option<f64>>> {
    // clap parses `nan` and `inf` as numbers; a weight of either would only surface as an
    // overflow in the merged tensors (the YAML path refuses them, merge/params.rs).
    if let Some(v) = values.iter().find(|v| !v.is_finite()) {
        crate::bail!("--{flag}: {v} is not a finite number");
    }
    match values.len() {
        0 => Ok(vec![default; models]),
        1 => Ok(vec![Some(values[0]); models]),
        n if n == models => Ok(values.iter().map(|&v| Some(v)).collect()),
        n => {
            crate::bail!("--{flag} has {n} values for {models} models; give one, or one per model")
        }
    }
}

/// Model entries with their per-model parameters.
fn entries(models: &[String], columns: &[(&ParamSpec, Vec<Option<f64>>)]) -> Vec<ModelEntry> {
    models
        .iter()
        .enumerate()
        .map(|(i, m)| ModelEntry {
            model: m.clone(),
            params: columns
                .iter()
                .filter_map(|(spec, values)| {
                    values[i].map(|v| {
                        (
                            spec.name.to_string(),
                            Setting::Scalar(ParamValue::Number(v)),
                        )
                    })
                })
                .collect(),
        })
        .collect()
}

/// The entries of a task-vector command: `--weights` (1 each by default) and, for the
/// sparsifying methods, `density`.
fn task_entries(
    inputs: &WeightedTaskModels,
    density: Option<(&str, Vec<f64>)>,
) -> Result<Vec<ModelEntry>> {
    let models = &inputs.models;
    let n = models.models.len();
    let mut columns = vec![(
        &task_vector::WEIGHT,
        per_model("weights", &inputs.weights.weights, n, Some(1.0))?,
    )];
    if let Some((flag, values)) = density {
        columns.push((&task_vector::DENSITY, per_model(flag, &values, n, None)?));
    }
    Ok(entries(&models.models, &columns))
}

/// Resolves one command's merge (the method, its inputs and parameters, the common flags) into a
/// spec and runs it, as `sinkmerge merge` runs a YAML file.
fn merge_with(
    method: &str,
    base: Option<String>,
    entries: Vec<ModelEntry>,
    params: Settings,
    common: &CommonArgs,
    progress: bool,
    out: &mut dyn Write,
) -> Result<()> {
    // As for --weights: clap parses `nan` and `inf` as numbers, which the YAML path refuses.
    for (name, setting) in &params {
        if let Setting::Scalar(ParamValue::Number(x)) = setting {
            if !x.is_finite() {
                crate::bail!("--{}: {x} is not a finite number", name.replace('_', "-"));
            }
        }
    }
    let mut warnings = Vec::new();
    let method = merge::method(method).expect("registered");
    let tokenizer = common
        .tokenizer_from
        .clone()
        .or_else(|| entries.first().map(|e| e.model.clone()));
    let mut spec = MergeSpec::new(
        method,
        base,
        entries,
        params,
        None,
        super::merge::out_dtype(common.out_dtype.as_deref())?,
        tokenizer,
        &mut warnings,
    )?;
    spec.into_vlm = common.vlm.into_vlm.clone();
    super::merge::execute(&spec, common, progress, warnings, out)
}

pub fn run_linear(args: LinearArgs, progress: bool, out: &mut dyn Write) -> Result<()> {
    let weights = per_model(
        "weights",
        &args.weights.weights,
        args.models.len(),
        Some(1.0),
    )?;
    let params = Settings::from([set(
        &linear::NORMALIZE,
        ParamValue::Bool(!args.no_normalize),
    )]);
    merge_with(
        "linear",
        None,
        entries(&args.models, &[(&linear::WEIGHT, weights)]),
        params,
        &args.common,
        progress,
        out,
    )
}

pub fn run_task_arithmetic(
    args: TaskArithmeticArgs,
    progress: bool,
    out: &mut dyn Write,
) -> Result<()> {
    let params = Settings::from([
        set(
            &task_vector::LAMBDA,
            ParamValue::Number(args.combine.lambda.lambda),
        ),
        set(
            &task_arithmetic::NORMALIZE,
            ParamValue::Bool(args.combine.normalize),
        ),
    ]);
    merge_with(
        "task_arithmetic",
        Some(args.inputs.models.base.clone()),
        task_entries(&args.inputs, None)?,
        params,
        &args.common,
        progress,
        out,
    )
}

pub fn run_ties(args: TiesArgs, progress: bool, out: &mut dyn Write) -> Result<()> {
    let params = Settings::from([
        set(&task_vector::LAMBDA, ParamValue::Number(args.lambda.lambda)),
        set(&ties::NORMALIZE, ParamValue::Bool(!args.no_normalize)),
        set(&ties::RESCALE, ParamValue::Bool(args.rescale)),
        set(&ties::TRIM, choice(args.trim)),
        set(&task_vector::ELECTION, choice(args.election)),
    ]);
    merge_with(
        "ties",
        Some(args.inputs.models.base.clone()),
        task_entries(&args.inputs, Some(("density", args.density)))?,
        params,
        &args.common,
        progress,
        out,
    )
}

pub fn run_dare(args: DareArgs, progress: bool, out: &mut dyn Write) -> Result<()> {
    let density = if args.drop_rate.is_empty() {
        ("density", args.density)
    } else {
        // 1 - 0.9 is 0.09999999999999998 in binary; round to 15 significant digits so the
        // density is the decimal the user meant (and the record reads 0.1).
        let kept = args
            .drop_rate
            .iter()
            .map(|p| {
                format!("{:.15e}", 1.0 - p)
                    .parse()
                    .expect("formatted float")
            })
            .collect();
        ("drop-rate", kept)
    };
    // dare offers no --election: dare_ties elects with the default, `sum` (as mergekit does).
    let params = Settings::from([
        set(
            &task_vector::LAMBDA,
            ParamValue::Number(args.combine.lambda.lambda),
        ),
        set(&dare::NORMALIZE, ParamValue::Bool(args.combine.normalize)),
        set(&dare::RESCALE, choice(args.rescale)),
        set(&dare::SEED, ParamValue::Integer(args.seed)),
    ]);
    let method = match args.consensus {
        Consensus::None => "dare_linear",
        Consensus::Ties => "dare_ties",
    };
    merge_with(
        method,
        Some(args.inputs.models.base.clone()),
        task_entries(&args.inputs, Some(density))?,
        params,
        &args.common,
        progress,
        out,
    )
}

/// The spectral methods (TSV, STAR): one scale-like parameter and `svd_embeddings`.
fn run_spectral(
    method: &str,
    (spec, value): (&ParamSpec, f64),
    svd_embeddings: bool,
    models: TaskModels,
    common: &CommonArgs,
    progress: bool,
    out: &mut dyn Write,
) -> Result<()> {
    let params = Settings::from([
        set(spec, ParamValue::Number(value)),
        set(&tsv::SVD_EMBEDDINGS, ParamValue::Bool(svd_embeddings)),
    ]);
    merge_with(
        method,
        Some(models.base),
        entries(&models.models, &[]),
        params,
        common,
        progress,
        out,
    )
}

pub fn run_tsv(args: TsvArgs, progress: bool, out: &mut dyn Write) -> Result<()> {
    let scale = (&tsv::ALPHA, args.alpha);
    run_spectral(
        "tsv",
        scale,
        args.svd_embeddings,
        args.models,
        &args.common,
        progress,
        out,
    )
}

pub fn run_star(args: StarArgs, progress: bool, out: &mut dyn Write) -> Result<()> {
    let scale = (&star::ETA, args.eta);
    run_spectral(
        "star",
        scale,
        args.svd_embeddings,
        args.models,
        &args.common,
        progress,
        out,
    )
}

#[cfg(test)]
mod tests {
    use clap::{Args, Command};

    use super::*;
    use crate::merge::params::{Kind, ParamDefault};

    /// Parameters no subcommand has a flag for (method, or `*` for all), and why.
    const WITHOUT_FLAG: &[(&str, &str, &str)] = &[
        (
            "*",
            "int8_mask",
            "it only changes mergekit's mask storage, never results",
        ),
        (
            "dare_ties",
            "election",
            "dare elects with the default, as mergekit does",
        ),
    ];

    /// Parameters whose flag has no clap default, and what stands instead.
    const WITHOUT_FLAG_DEFAULT: &[(&str, &str)] = &[
        ("weight", "YAML requires it; the commands give each model 1"),
        (
            "density",
            "ties and dare ask for --density (or --drop-rate), as the papers set it",
        ),
    ];

    fn commands() -> Vec<(Command, &'static [&'static str])> {
        let mut commands = vec![
            (
                LinearArgs::augment_args(Command::new("linear")),
                &["linear"][..],
            ),
            (
                TaskArithmeticArgs::augment_args(Command::new("task-arithmetic")),
                &["task_arithmetic"],
            ),
            (TiesArgs::augment_args(Command::new("ties")), &["ties"]),
            (
                DareArgs::augment_args(Command::new("dare")),
                &["dare_linear", "dare_ties"],
            ),
            (TsvArgs::augment_args(Command::new("tsv")), &["tsv"]),
            (StarArgs::augment_args(Command::new("star")), &["star"]),
        ];
        commands.iter_mut().for_each(|(c, _)| c.build());
        commands
    }

    #[test]
    fn every_parameter_has_a_flag_with_its_specs_default() {
        for (command, methods) in commands() {
            for &name in methods {
                for spec in merge::method(name).unwrap().params() {
                    let context = format!("{} ({name}) `{}`", command.get_name(), spec.name);
                    if WITHOUT_FLAG
                        .iter()
                        .any(|&(m, p, _)| (m == name || m == "*") && p == spec.name)
                    {
                        continue;
                    }
                    let id = match spec.name {
                        "weight" => "weights".to_string(),
                        other => other.to_string(),
                    };
                    let find = |id: &str| command.get_arguments().find(|a| a.get_id() == id);
                    let (arg, negated) = match find(&id) {
                        Some(arg) => (arg, false),
                        None => (
                            find(&format!("no_{id}"))
                                .unwrap_or_else(|| panic!("{context}: no flag")),
                            true,
                        ),
                    };
                    let default: Vec<String> = arg
                        .get_default_values()
                        .iter()
                        .map(|v| v.to_string_lossy().into_owned())
                        .collect();
                    match (spec.default, default.as_slice()) {
                        (ParamDefault::Number(x), [d]) => {
                            assert_eq!(d.parse::<f64>().unwrap(), x, "{context}")
                        }
                        (ParamDefault::Bool(b), [d]) => {
                            assert_eq!(d.parse::<bool>().unwrap() != negated, b, "{context}")
                        }
                        (ParamDefault::Choice(c), [d]) => assert_eq!(d, c, "{context}"),
                        (ParamDefault::Integer(n), [d]) => {
                            assert_eq!(d.parse::<u64>().unwrap(), n, "{context}")
                        }
                        (_, []) => assert!(
                            WITHOUT_FLAG_DEFAULT.iter().any(|&(p, _)| p == spec.name),
                            "{context}: the flag has no default"
                        ),
                        other => panic!("{context}: {other:?}"),
                    }
                    if let Kind::Choice { options, .. } = spec.kind {
                        let values: Vec<String> = arg
                            .get_possible_values()
                            .iter()
                            .map(|v| v.get_name().to_string())
                            .collect();
                        assert_eq!(values, options, "{context}");
                    }
                }
            }
        }
    }
}
