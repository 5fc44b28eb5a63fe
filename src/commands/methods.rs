//! `sinkmerge linear | task-arithmetic | ties | dare | tsv | star`: one merge method each, with
//! mergekit's defaults. Each command builds the same [`MergeSpec`] a YAML config would, so
//! `sinkmerge merge OUT/sinkmerge_config.yml` replays it.

use clap::ValueEnum;

use crate::cli::OutputArgs;
use crate::error::Result;
use crate::merge::params::{Setting, Settings, Value};
use crate::merge::{self, MergeSpec, ModelEntry};

/// Flags every merge command shares.
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

    /// Print a JSON summary on stdout instead of text
    #[arg(long)]
    pub json: bool,
}

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
        allow_negative_numbers = true,
        value_name = "W,..."
    )]
    pub weights: Vec<f64>,
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
    pub models: TaskModels,
    #[command(flatten)]
    pub weights: Weights,
    /// Scale of the summed task vectors
    #[arg(
        long = "lambda",
        default_value_t = 1.0,
        allow_negative_numbers = true,
        value_name = "L"
    )]
    pub lambda: f64,
    /// Divide the weighted sum by the sum of the weights (mergekit default: off)
    #[arg(long)]
    pub normalize: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Trim {
    /// Per tensor: keep the top-k magnitudes of each tensor (mergekit)
    Local,
    /// Whole model: one threshold per task vector, ties at it kept (official TIES code)
    Global,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ElectionArg {
    /// Sign of the summed weighted deltas (TIES' "mass" election; mergekit)
    Sum,
    /// Majority of the signs (mergekit's ConsensusMethod.count)
    Count,
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
    pub models: TaskModels,
    #[command(flatten)]
    pub weights: Weights,
    /// Fraction of each task vector's entries kept, in (0, 1]; comma-separated per model
    #[arg(
        long,
        required = true,
        value_delimiter = ',',
        allow_negative_numbers = true,
        value_name = "D,..."
    )]
    pub density: Vec<f64>,
    /// Scale of the merged task vector
    #[arg(
        long = "lambda",
        default_value_t = 1.0,
        allow_negative_numbers = true,
        value_name = "L"
    )]
    pub lambda: f64,
    /// Where the top-k threshold is taken
    #[arg(long, value_enum, default_value = "local")]
    pub trim: Trim,
    /// How each entry's sign is elected
    #[arg(long, value_enum, default_value = "sum")]
    pub election: ElectionArg,
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

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Rescale {
    /// Match each task vector's exact L1 norm (mergekit)
    L1,
    /// Divide the kept entries by density (official DARE code)
    Inverse,
    /// Keep the kept entries as they are
    None,
}

/// DARE: drop task-vector entries at random and rescale (mergekit `dare_linear` / `dare_ties`).
///
/// Each entry is kept with probability --density (= 1 - --drop-rate), from a random stream
/// seeded by (--seed, tensor name, model), so results are identical at any thread count.
/// Paper setting: --drop-rate 0.9 --lambda 1.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("keep").required(true).args(["density", "drop_rate"]))]
pub struct DareArgs {
    #[command(flatten)]
    pub models: TaskModels,
    #[command(flatten)]
    pub weights: Weights,
    /// Probability of keeping an entry, in (0, 1]; comma-separated per model
    #[arg(
        long,
        value_delimiter = ',',
        allow_negative_numbers = true,
        value_name = "D,..."
    )]
    pub density: Vec<f64>,
    /// Probability of dropping an entry (the paper's p; density = 1 - p); comma-separated
    #[arg(
        long,
        value_delimiter = ',',
        allow_negative_numbers = true,
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
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Scale of the merged task vector
    #[arg(
        long = "lambda",
        default_value_t = 1.0,
        allow_negative_numbers = true,
        value_name = "L"
    )]
    pub lambda: f64,
    /// Divide by the (agreeing) models' weight sum (mergekit default: off)
    #[arg(long)]
    pub normalize: bool,
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
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
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
    #[arg(long, default_value_t = 40.0, allow_negative_numbers = true)]
    pub eta: f64,
    /// Also decompose embed_tokens and lm_head
    #[arg(long)]
    pub svd_embeddings: bool,
    #[command(flatten)]
    pub common: CommonArgs,
}

fn num(x: f64) -> Setting {
    Setting::Scalar(Value::Number(x))
}

fn flag(b: bool) -> Setting {
    Setting::Scalar(Value::Bool(b))
}

fn choice(s: &str) -> Setting {
    Setting::Scalar(Value::Choice(s.to_string()))
}

/// Per-model values from a comma list: one for all, or one per model.
fn per_model(
    name: &str,
    values: &[f64],
    models: usize,
    default: Option<f64>,
) -> Result<Vec<Option<f64>>> {
    match values.len() {
        0 => Ok(vec![default; models]),
        1 => Ok(vec![Some(values[0]); models]),
        n if n == models => Ok(values.iter().map(|&v| Some(v)).collect()),
        n => {
            crate::bail!("--{name} has {n} values for {models} models; give one, or one per model")
        }
    }
}

/// Model entries with their per-model parameters.
fn entries(models: &[String], columns: &[(&str, Vec<Option<f64>>)]) -> Vec<ModelEntry> {
    models
        .iter()
        .enumerate()
        .map(|(i, m)| ModelEntry {
            model: m.clone(),
            params: columns
                .iter()
                .filter_map(|(name, values)| values[i].map(|v| (name.to_string(), num(v))))
                .collect(),
        })
        .collect()
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
) -> Result<()> {
    let mut warnings = Vec::new();
    let method = merge::method(method).expect("registered");
    let tokenizer = common
        .tokenizer_from
        .clone()
        .or_else(|| entries.first().map(|e| e.model.clone()));
    let spec = MergeSpec::new(
        method,
        base,
        entries,
        params,
        None,
        super::merge::out_dtype(common.out_dtype.as_deref())?,
        tokenizer,
        &mut warnings,
    )?;
    super::merge::execute(&spec, common, progress, warnings)
}

pub fn run_linear(args: LinearArgs, progress: bool) -> Result<()> {
    let n = args.models.len();
    let weights = per_model("weights", &args.weights.weights, n, Some(1.0))?;
    let params = Settings::from([("normalize".to_string(), flag(!args.no_normalize))]);
    merge_with(
        "linear",
        None,
        entries(&args.models, &[("weight", weights)]),
        params,
        &args.common,
        progress,
    )
}

pub fn run_task_arithmetic(args: TaskArithmeticArgs, progress: bool) -> Result<()> {
    let n = args.models.models.len();
    let weights = per_model("weights", &args.weights.weights, n, Some(1.0))?;
    let params = Settings::from([
        ("lambda".to_string(), num(args.lambda)),
        ("normalize".to_string(), flag(args.normalize)),
    ]);
    merge_with(
        "task_arithmetic",
        Some(args.models.base),
        entries(&args.models.models, &[("weight", weights)]),
        params,
        &args.common,
        progress,
    )
}

pub fn run_ties(args: TiesArgs, progress: bool) -> Result<()> {
    let n = args.models.models.len();
    let weights = per_model("weights", &args.weights.weights, n, Some(1.0))?;
    let density = per_model("density", &args.density, n, None)?;
    let trim = match args.trim {
        Trim::Local => "local",
        Trim::Global => "global",
    };
    let params = Settings::from([
        ("lambda".to_string(), num(args.lambda)),
        ("normalize".to_string(), flag(!args.no_normalize)),
        ("rescale".to_string(), flag(args.rescale)),
        ("trim".to_string(), choice(trim)),
        ("election".to_string(), choice(election(args.election))),
    ]);
    merge_with(
        "ties",
        Some(args.models.base),
        entries(
            &args.models.models,
            &[("weight", weights), ("density", density)],
        ),
        params,
        &args.common,
        progress,
    )
}

fn election(e: ElectionArg) -> &'static str {
    match e {
        ElectionArg::Sum => "sum",
        ElectionArg::Count => "count",
    }
}

pub fn run_dare(args: DareArgs, progress: bool) -> Result<()> {
    let n = args.models.models.len();
    let weights = per_model("weights", &args.weights.weights, n, Some(1.0))?;
    let density = if args.drop_rate.is_empty() {
        per_model("density", &args.density, n, None)?
    } else {
        // 1 - 0.9 is 0.09999999999999998 in binary; round to 15 significant digits so the
        // density is the decimal the user meant (and the record reads 0.1).
        let drop: Vec<f64> = args
            .drop_rate
            .iter()
            .map(|p| {
                format!("{:.15e}", 1.0 - p)
                    .parse()
                    .expect("formatted float")
            })
            .collect();
        per_model("drop-rate", &drop, n, None)?
    };
    let rescale = match args.rescale {
        Rescale::L1 => "l1",
        Rescale::Inverse => "inverse",
        Rescale::None => "none",
    };
    let mut params = Settings::from([
        ("lambda".to_string(), num(args.lambda)),
        ("normalize".to_string(), flag(args.normalize)),
        ("rescale".to_string(), choice(rescale)),
        (
            "seed".to_string(),
            Setting::Scalar(Value::Integer(args.seed)),
        ),
    ]);
    let method = match args.consensus {
        Consensus::None => "dare_linear",
        Consensus::Ties => {
            params.insert("election".to_string(), choice("sum"));
            "dare_ties"
        }
    };
    merge_with(
        method,
        Some(args.models.base),
        entries(
            &args.models.models,
            &[("weight", weights), ("density", density)],
        ),
        params,
        &args.common,
        progress,
    )
}

pub fn run_tsv(args: TsvArgs, progress: bool) -> Result<()> {
    let params = Settings::from([
        ("alpha".to_string(), num(args.alpha)),
        ("svd_embeddings".to_string(), flag(args.svd_embeddings)),
    ]);
    merge_with(
        "tsv",
        Some(args.models.base),
        entries(&args.models.models, &[]),
        params,
        &args.common,
        progress,
    )
}

pub fn run_star(args: StarArgs, progress: bool) -> Result<()> {
    let params = Settings::from([
        ("eta".to_string(), num(args.eta)),
        ("svd_embeddings".to_string(), flag(args.svd_embeddings)),
    ]);
    merge_with(
        "star",
        Some(args.models.base),
        entries(&args.models.models, &[]),
        params,
        &args.common,
        progress,
    )
}
