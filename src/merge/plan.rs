//! Running a merge: open the inputs, check they fit together, plan every output tensor, then
//! stream. Each output tensor is computed from its inputs (in row blocks where the method
//! allows), encoded, handed to the sharded writer, and its input pages are released; nothing
//! is written to the destination until the whole model is complete.
//!
//! Input handling follows mergekit
//! (docs/reference/merges.md#inputs-what-happens-to-each-tensor-as-in-mergekit):
//! - The output has the tensors of the base (of the first model for `linear`, or its
//!   `base_model`), and `lm_head.weight` exactly when some input stores one; an input without it
//!   contributes its `model.embed_tokens.weight` (tied embeddings). `tie_word_embeddings` is
//!   never edited.
//! - Every input must hold every output tensor, with the same shape, except that vocabulary
//!   tensors (embeddings, lm_head) may differ in rows: task-vector methods crop larger models to
//!   the base's rows (a smaller model is an error), `linear` crops all to the common rows.
//! - Non-float tensors are copied from the base (first model), after checking that every input
//!   has the same dtype and shape.
//! - Floating-point outputs keep the base tensor's dtype unless an output dtype is given.

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use safetensors::Dtype;
use serde::Serialize;
use serde_json::Value as Json;

use super::job::{Source, TensorJob};
use super::params::{default_value, Scope, TensorValues};
use super::{MergeSpec, TensorMerger};
use crate::arch::config::{set_dtype, text_section};
use crate::arch::{family, names, TextConfig};
use crate::checkpoint::hub_cache::HubRef;
use crate::checkpoint::output::{OutputDir, OutputKind};
use crate::checkpoint::resolve::{resolve, ModelRef};
use crate::checkpoint::writer::{PlannedTensor, Progress};
use crate::checkpoint::{natural_cmp, Checkpoint, AUX_FILES};
use crate::dtype::{is_float, torch_name};
use crate::error::Result;
use crate::write::graft::{IntoVlm, ModelLayout};
use crate::write::model_card::{self, ModelCard};
use crate::{bad, bail};

const LM_HEAD: &str = "lm_head.weight";
const EMBED: &str = "model.embed_tokens.weight";

/// Where and how to write the merged model.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub dest: PathBuf,
    pub force: bool,
    pub max_shard_size: u64,
    pub progress: bool,
    /// Write a README.md model card.
    pub model_card: bool,
}

/// What a merge did, for the text and `--json` reports.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub method: &'static str,
    pub output: String,
    pub base: Option<String>,
    pub models: Vec<String>,
    pub tokenizer_from: String,
    /// Output dtype of the floating-point tensors (`mixed` when they keep differing dtypes).
    pub dtype: String,
    pub tensors: usize,
    pub merged: usize,
    pub copied: usize,
    pub bytes: u64,
    pub shards: usize,
    pub seconds: f64,
    pub warnings: Vec<String>,
}

/// An opened input model.
struct Input {
    /// As configured.
    reference: String,
    /// As recorded in `sinkmerge_config.yml`: an absolute directory or `ORG/NAME@commit`.
    recorded: String,
    ckpt: Checkpoint,
}

/// How one output tensor is produced.
enum Work {
    /// Bytes copied from an input (non-float tensors).
    Copy { input: usize, name: String },
    /// Computed by the method: index into the jobs.
    Merge(usize),
}

/// Run `spec`, writing the merged model to `options.dest`. `warnings` already noted (from the
/// config) are carried into the summary.
pub fn run(spec: &MergeSpec, options: &RunOptions, mut warnings: Vec<String>) -> Result<Summary> {
    let started = Instant::now();
    let method = spec.method;
    let inputs = open_inputs(spec)?;
    let plan = plan_merge(spec, &inputs, &mut warnings)?;
    let (base, donor, tensors) = (plan.base, plan.donor, &plan.tensors);

    let tokenizer = TokenizerDonor::choose(spec, &inputs, donor)?;
    let mut config = inputs[donor].ckpt.config.clone();
    let dtype = output_dtype_name(&tensors.planned, &inputs[donor].ckpt, spec);
    if let Some(name) = &dtype {
        set_dtype(&mut config, name);
    }
    if let Some(rows) = tensors.embed_rows {
        fix_vocab_size(&mut config, rows, &mut warnings);
    }
    let vlm = IntoVlm::from_arg(spec.into_vlm.as_deref())?;
    let layout = ModelLayout::plan(vlm.as_ref(), "the merged model", &tensors.planned, &config)?;
    warnings.extend(layout.warnings().iter().cloned());
    let mut input_dirs: Vec<&Path> = inputs.iter().map(|i| i.ckpt.dir.as_path()).collect();
    input_dirs.push(&tokenizer.dir);
    input_dirs.extend(vlm.iter().map(|v| v.ckpt.dir.as_path()));
    let out = OutputDir::create(&options.dest, OutputKind::Model, &input_dirs, options.force)?;
    let origin = |i: usize| match &tensors.work[i] {
        Work::Copy { input, name } => Some(inputs[*input].ckpt.describe(name)),
        // A merged tensor's inputs were checked as it was computed (merge/job.rs).
        Work::Merge(_) => None,
    };
    let produce = |i: usize| match &tensors.work[i] {
        Work::Copy { input, name } => Ok(Cow::Borrowed(inputs[*input].ckpt.bytes(name)?)),
        Work::Merge(j) => {
            let job = &tensors.jobs[*j];
            let bytes = plan.merger.merge(*j, job)?;
            for source in job.base.iter().chain(&job.models) {
                source.ckpt.release(&source.tensor);
            }
            Ok(Cow::Owned(bytes))
        }
    };
    // Merging goes tensor by tensor; into a VLM, the bar counts the VLM's stored bytes.
    let bar = match &layout {
        ModelLayout::Own => {
            crate::progress::items(tensors.planned.len() as u64, "merging", options.progress)
        }
        ModelLayout::IntoVlm(g) => {
            crate::progress::bytes(g.total_bytes(), "merging", options.progress)
        }
    };
    let written = layout.write_tensors(
        &out,
        &tensors.planned,
        options.max_shard_size,
        (&bar, Progress::Tensors),
        origin,
        produce,
    )?;
    layout.write_files(&out, options.model_card, || {
        out.write_json("config.json", &config)?;
        for file in AUX_FILES {
            let path = tokenizer.dir.join(file);
            if path.is_file() {
                out.copy_file(&path, file)?;
            }
        }
        Ok(())
    })?;
    let record = spec.to_record(&|reference: &str| {
        inputs
            .iter()
            .find(|i| i.reference == reference)
            .map(|i| i.recorded.clone())
            .unwrap_or_else(|| match resolve(reference) {
                Ok(m) => recorded_reference(reference, &m.dir, m.hub.as_ref()),
                Err(_) => reference.to_string(),
            })
    });
    out.write_file("sinkmerge_config.yml", record.as_bytes())?;
    if options.model_card {
        let mut card = merge_card(spec, &inputs, base, donor, &tokenizer, &record);
        if let Some(v) = &vlm {
            // sinkmerge_config.yml records `into_vlm`, so the replay needs no flag.
            v.mark_card(&mut card, false);
        }
        card.write(&out)?;
    }
    let dest = out.commit()?;

    Ok(Summary {
        method: method.name(),
        output: dest.display().to_string(),
        base: base.map(|b| inputs[b].reference.clone()),
        models: plan
            .models
            .iter()
            .map(|&m| inputs[m].reference.clone())
            .collect(),
        tokenizer_from: tokenizer.reference,
        dtype: dtype.unwrap_or_else(|| "mixed".into()),
        tensors: tensors.planned.len(),
        merged: tensors.jobs.len(),
        copied: tensors.planned.len() - tensors.jobs.len(),
        bytes: written.total_bytes,
        shards: written.files.len(),
        seconds: started.elapsed().as_secs_f64(),
        warnings,
    })
}

/// The inputs, opened: the base first for task-vector methods, then the models.
fn open_inputs(spec: &MergeSpec) -> Result<Vec<Input>> {
    let base = spec
        .method
        .needs_base()
        .then(|| spec.base.as_deref().expect("checked by MergeSpec::new"));
    base.into_iter()
        .chain(spec.models.iter().map(|e| e.model.as_str()))
        .map(open)
        .collect()
}

/// A merge planned from its opened inputs: who plays which part, every output tensor, and the
/// method ready to compute them.
struct MergePlan<'a> {
    /// The input task vectors are taken from (`Some(0)` for task-vector methods).
    base: Option<usize>,
    /// The merged models' inputs (every input but the base).
    models: Vec<usize>,
    /// The input whose config (and whose tensor list) the output gets.
    donor: usize,
    tensors: TensorPlan<'a>,
    merger: Box<dyn TensorMerger + 'a>,
}

/// Plan a merge from opened inputs (reading configs and tensor headers, no tensor data, writing
/// nothing): check the configs fit, plan every output tensor, and type and check the method's
/// parameters for each.
fn plan_merge<'a>(
    spec: &'a MergeSpec,
    inputs: &'a [Input],
    warnings: &mut Vec<String>,
) -> Result<MergePlan<'a>> {
    let method = spec.method;
    let base = method.needs_base().then_some(0);
    let models: Vec<usize> = (base.map_or(0, |_| 1)..inputs.len()).collect();
    let donor = match (&base, &spec.base) {
        (Some(b), _) => *b,
        (None, Some(b)) => {
            models[spec
                .models
                .iter()
                .position(|e| &e.model == b)
                .expect("checked")]
        }
        (None, None) => models[0],
    };

    let donor_config = TextConfig::from_model_config(&inputs[donor].ckpt.config).map_err(|e| {
        bad!(
            "{}: {e}",
            inputs[donor].ckpt.dir.join("config.json").display()
        )
    })?;
    for (i, input) in inputs.iter().enumerate() {
        if i == donor {
            continue;
        }
        let config = TextConfig::from_model_config(&input.ckpt.config)
            .map_err(|e| bad!("{}: {e}", input.ckpt.dir.join("config.json").display()))?;
        crate::arch::config::check_compatible(
            &donor_config,
            &config,
            &inputs[donor].ckpt.label,
            &input.ckpt.label,
        )?;
    }

    let tensors = plan_tensors(inputs, donor, base, &models, spec, warnings)?;
    let layers = donor_config.num_hidden_layers;
    let merger = method.prepare(&tensors.jobs, &|job| {
        resolve_values(spec, &job.name, layers)
    })?;
    Ok(MergePlan {
        base,
        models,
        donor,
        tensors,
        merger,
    })
}

/// Where the tokenizer files come from: `tokenizer_source`, else the donor (base or first model).
struct TokenizerDonor {
    reference: String,
    /// The donor when it is none of the inputs.
    outside: Option<ModelRef>,
    dir: PathBuf,
}

impl TokenizerDonor {
    fn choose(spec: &MergeSpec, inputs: &[Input], donor: usize) -> Result<TokenizerDonor> {
        let reference = match spec.tokenizer_source.as_deref() {
            None | Some("base") => inputs[donor].reference.clone(),
            Some(other) => other.to_string(),
        };
        Ok(match inputs.iter().find(|i| i.reference == reference) {
            Some(input) => TokenizerDonor {
                dir: input.ckpt.dir.clone(),
                outside: None,
                reference,
            },
            None => {
                let model = resolve(&reference)?;
                TokenizerDonor {
                    dir: model.dir.clone(),
                    outside: Some(model),
                    reference,
                }
            }
        })
    }
}

/// The model card of a merge: every input (and a tokenizer donor that is none of them), the
/// resolved record, and `sinkmerge merge sinkmerge_config.yml` as the replay.
fn merge_card(
    spec: &MergeSpec,
    inputs: &[Input],
    base: Option<usize>,
    donor: usize,
    tokenizer: &TokenizerDonor,
    record: &str,
) -> ModelCard {
    let method = spec.method.name();
    let mut card_inputs: Vec<model_card::Input> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let role = if Some(i) == base { "base" } else { "model" };
            model_card::Input::new(role, true, &input.ckpt)
        })
        .collect();
    let tokenizer_name = match &tokenizer.outside {
        Some(model) => {
            let donor = model_card::Input {
                role: "tokenizer",
                parent: false,
                dir: model.dir.clone(),
                hub: model.hub.clone(),
            };
            let name = donor.name();
            card_inputs.push(donor);
            name
        }
        None => {
            let i = inputs
                .iter()
                .position(|i| i.reference == tokenizer.reference)
                .expect("the tokenizer donor is an input");
            card_inputs[i].name()
        }
    };
    let models = card_inputs
        .iter()
        .filter(|i| i.role == "model")
        .map(|i| format!("`{}`", i.name()))
        .collect::<Vec<_>>()
        .join(", ");
    let on_base = match base {
        Some(b) => format!(" as task vectors from the base `{}`", card_inputs[b].name()),
        None => String::new(),
    };
    let description = format!(
        "A merge of {models}{on_base} by `{method}`, made with sinkmerge. The tokenizer, chat \
         template and generation config are `{tokenizer_name}`'s; config.json is `{}`'s.",
        card_inputs[donor].name()
    );
    let mut recipe = vec![("method", format!("`{method}`"))];
    if let Some(b) = base {
        recipe.push(("base", format!("`{}`", card_inputs[b].name())));
    }
    recipe.push(("tokenizer from", format!("`{tokenizer_name}`")));
    ModelCard {
        kind: model_card::Kind::Merge(method),
        description,
        recipe,
        config_yaml: Some(record.to_string()),
        inputs: card_inputs,
        replay: ["sinkmerge", "merge", "sinkmerge_config.yml", "-o", "OUT"]
            .map(String::from)
            .to_vec(),
    }
}

fn open(reference: &str) -> Result<Input> {
    let ckpt = Checkpoint::open_ref(reference)?;
    Ok(Input {
        reference: reference.to_string(),
        recorded: recorded_reference(reference, &ckpt.dir, ckpt.hub.as_ref()),
        ckpt,
    })
}

/// The exact form of a model reference for the record: a Hub model becomes `ORG/NAME@commit`
/// of its snapshot, a directory its absolute path.
fn recorded_reference(reference: &str, dir: &Path, hub: Option<&HubRef>) -> String {
    match hub {
        Some(hub) => format!("{}@{}", hub.repo, hub.commit),
        None => std::fs::canonicalize(dir)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| reference.to_string()),
    }
}

/// Every output tensor: its dtype and shape, and how it is produced.
struct TensorPlan<'a> {
    planned: Vec<PlannedTensor>,
    work: Vec<Work>,
    jobs: Vec<TensorJob<'a>>,
    /// Rows of the output embedding when they differ from the donor config's `vocab_size`.
    embed_rows: Option<usize>,
}

/// The stored tensor that input `ckpt` contributes for output tensor `name`.
fn source_name(ckpt: &Checkpoint, name: &str) -> Option<String> {
    if ckpt.contains(name) {
        Some(name.to_string())
    } else if name == LM_HEAD && ckpt.contains(EMBED) {
        Some(EMBED.to_string())
    } else {
        None
    }
}

fn is_vocab(name: &str) -> bool {
    names::standard_name(name)
        .and_then(|s| names::parse(&s))
        .is_some_and(|n| n.module.is_vocab())
}

fn plan_tensors<'a>(
    inputs: &'a [Input],
    donor: usize,
    base: Option<usize>,
    models: &[usize],
    spec: &MergeSpec,
    warnings: &mut Vec<String>,
) -> Result<TensorPlan<'a>> {
    let d = &inputs[donor].ckpt;
    let mut names: Vec<String> = d.names().to_vec();
    if !d.contains(LM_HEAD) && inputs.iter().any(|i| i.ckpt.contains(LM_HEAD)) {
        names.push(LM_HEAD.to_string());
        names.sort_by(|a, b| natural_cmp(a, b));
        if TextConfig::from_model_config(&d.config).is_ok_and(|c| c.tie_word_embeddings) {
            warnings.push(format!(
                "an input stores lm_head.weight, so the output does too (as in mergekit), but {}'s config says tie_word_embeddings: true, so transformers will tie lm_head to the merged embedding and ignore it",
                d.label
            ));
        }
    }
    let known: HashSet<&str> = names.iter().map(String::as_str).collect();
    for (i, input) in inputs.iter().enumerate() {
        if let Some(extra) = input
            .ckpt
            .names()
            .iter()
            .find(|n| !known.contains(n.as_str()))
        {
            bail!(
                "{} has tensor `{extra}` that {} ({}) lacks; merged models must have the same tensors{}",
                input.ckpt.describe(extra),
                d.label,
                if base == Some(donor) { "the base" } else { "the first model" },
                if i == donor { "" } else { vlm_hint(&input.ckpt) }
            );
        }
    }

    let out_dtype = spec.out_dtype.or(spec.dtype);
    let mergeable: Vec<usize> = base.into_iter().chain(models.iter().copied()).collect();
    let mut planned = Vec::with_capacity(names.len());
    let mut work = Vec::with_capacity(names.len());
    let mut jobs = Vec::new();
    let mut embed_rows = None;
    for name in &names {
        let mut sources = Vec::with_capacity(mergeable.len());
        for &i in &mergeable {
            let ckpt = &inputs[i].ckpt;
            let Some(stored) = source_name(ckpt, name) else {
                bail!(
                    "{}: tensor `{name}` is missing; every merged model needs it{}",
                    ckpt.label,
                    vlm_hint(ckpt)
                );
            };
            let info = ckpt.info(&stored).expect("listed");
            sources.push((i, stored, info));
        }
        let (_, _, reference) = &sources[mergeable.iter().position(|&i| i == donor).unwrap_or(0)];
        if !is_float(reference.dtype) {
            for (i, stored, info) in &sources {
                if info.dtype != reference.dtype || info.shape != reference.shape {
                    bail!(
                        "{}: non-float tensor is {:?} {:?}, but {:?} {:?} in {}; it cannot be merged or copied",
                        inputs[*i].ckpt.describe(stored),
                        info.dtype,
                        info.shape,
                        reference.dtype,
                        reference.shape,
                        d.label
                    );
                }
            }
            planned.push(PlannedTensor {
                name: name.clone(),
                dtype: reference.dtype,
                shape: reference.shape.clone(),
            });
            work.push(Work::Copy {
                input: donor,
                name: source_name(d, name).expect("donor has it"),
            });
            continue;
        }
        let shape = output_shape(name, &sources, inputs, base, donor, warnings)?;
        if name == EMBED {
            let configured = TextConfig::from_model_config(&d.config).map(|c| c.vocab_size);
            let Some(&rows) = shape.first() else {
                bail!("{}: `{name}` has shape [], not [vocab, hidden]", d.label);
            };
            if configured.is_ok_and(|v| v != rows) {
                embed_rows = Some(rows);
            }
        }
        let dtype = out_dtype.unwrap_or(reference.dtype);
        let mut srcs = Vec::with_capacity(sources.len());
        for (i, stored, info) in &sources {
            if !is_float(info.dtype) {
                bail!(
                    "{}: dtype {:?} is not floating point, but `{name}` is {:?} in {}",
                    inputs[*i].ckpt.describe(stored),
                    info.dtype,
                    reference.dtype,
                    d.label
                );
            }
            srcs.push(Source {
                ckpt: &inputs[*i].ckpt,
                tensor: stored.clone(),
                dtype: info.dtype,
            });
        }
        let base_source = base.map(|_| srcs.remove(0));
        planned.push(PlannedTensor {
            name: name.clone(),
            dtype,
            shape: shape.clone(),
        });
        work.push(Work::Merge(jobs.len()));
        jobs.push(TensorJob {
            name: name.clone(),
            shape,
            out_dtype: dtype,
            base: base_source,
            models: srcs,
        });
    }
    Ok(TensorPlan {
        planned,
        work,
        jobs,
        embed_rows,
    })
}

/// The output shape of a float tensor, checking every input's shape against it.
fn output_shape(
    name: &str,
    sources: &[(usize, String, &crate::checkpoint::TensorInfo)],
    inputs: &[Input],
    base: Option<usize>,
    donor: usize,
    warnings: &mut Vec<String>,
) -> Result<Vec<usize>> {
    let reference = sources
        .iter()
        .find(|(i, _, _)| *i == donor)
        .map(|(_, _, info)| info.shape.clone())
        .expect("donor is an input");
    let vocab = is_vocab(name) && sources.iter().all(|(_, _, info)| info.shape.len() == 2);
    let same_cols = sources
        .iter()
        .all(|(_, _, info)| info.shape.get(1) == reference.get(1));
    let rows = match base {
        // Used for vocabulary matrices only, which are 2-D.
        Some(_) => reference.first().copied().unwrap_or(0),
        None => sources
            .iter()
            .map(|(_, _, info)| info.shape.first().copied().unwrap_or(0))
            .min()
            .unwrap_or(0),
    };
    let mut shape = reference.clone();
    if vocab && same_cols {
        shape[0] = rows;
    }
    for (i, stored, info) in sources {
        if info.shape == shape {
            continue;
        }
        let label = &inputs[*i].ckpt.label;
        if vocab && same_cols && info.shape[0] > rows {
            warnings.push(format!(
                "{label}: `{stored}` has {} rows; using the first {rows} ({})",
                info.shape[0],
                if base.is_some() {
                    "task-vector methods crop to the base's vocabulary, as mergekit does"
                } else {
                    "linear crops to the rows all models share, as mergekit does"
                }
            ));
            continue;
        }
        if vocab && same_cols {
            bail!(
                "{}: has {} rows, fewer than the base's {rows}; task vectors need every model's vocabulary to cover the base's (use the smaller model as base, or linear)",
                inputs[*i].ckpt.describe(stored),
                info.shape[0]
            );
        }
        bail!(
            "{}: shape {:?} does not match {:?} in {}",
            inputs[*i].ckpt.describe(stored),
            info.shape,
            reference,
            inputs[donor].ckpt.label
        );
    }
    Ok(shape)
}

fn vlm_hint(ckpt: &Checkpoint) -> &'static str {
    if family::detect(&ckpt.config, ckpt.names()).is_some() {
        " (it is a vision-language model: extract its language model first with `sinkmerge extract`)"
    } else {
        ""
    }
}

/// Resolve every parameter of the method for tensor `name`: per-model settings, then the
/// top-level `parameters`, then the default. `t` is the layer's position in [0, 1] (0 for
/// tensors outside the layers), as mergekit computes it.
pub fn resolve_values(spec: &MergeSpec, name: &str, layers: usize) -> Result<TensorValues> {
    let layer = names::standard_name(name)
        .and_then(|s| names::parse(&s))
        .and_then(|n| n.layer);
    let t = match layer {
        None => 0.0,
        Some(_) if layers <= 1 => 1.0,
        Some(l) => l as f64 / (layers - 1) as f64,
    };
    let mut out = TensorValues {
        global: Default::default(),
        models: vec![Default::default(); spec.models.len()],
    };
    for p in spec.method.params() {
        let top = spec.params.get(p.name).and_then(|s| s.resolve(name, t));
        match p.scope {
            Scope::Global => {
                let value = top.or_else(|| default_value(p)).ok_or_else(|| {
                    bad!("{}: parameter `{}` is required", spec.method.name(), p.name)
                })?;
                out.global.insert(p.name, value);
            }
            Scope::PerModel => {
                for (i, entry) in spec.models.iter().enumerate() {
                    let value = entry
                        .params
                        .get(p.name)
                        .and_then(|s| s.resolve(name, t))
                        .or_else(|| top.clone())
                        .or_else(|| default_value(p))
                        .ok_or_else(|| {
                            bad!(
                                "{}: model `{}` needs parameter `{}` for tensor `{name}` (set it under its `parameters` or the top-level ones)",
                                spec.method.name(),
                                entry.model,
                                p.name
                            )
                        })?;
                    out.models[i].insert(p.name, value);
                }
            }
        }
    }
    Ok(out)
}

/// The dtype recorded in the output config: the one every float tensor has, else the donor's.
fn output_dtype_name(
    planned: &[PlannedTensor],
    donor: &Checkpoint,
    spec: &MergeSpec,
) -> Option<String> {
    let chosen = spec.out_dtype.or(spec.dtype);
    let float: Vec<Dtype> = planned
        .iter()
        .map(|t| t.dtype)
        .filter(|&d| is_float(d))
        .collect();
    let uniform = float
        .first()
        .filter(|&&f| float.iter().all(|&d| d == f))
        .copied();
    chosen
        .or(uniform)
        .or_else(|| donor.main_float_dtype())
        .and_then(torch_name)
        .map(str::to_string)
}

/// Set `vocab_size` (in the text section) to the output embedding's rows.
fn fix_vocab_size(config: &mut Json, rows: usize, warnings: &mut Vec<String>) {
    let key = text_section(config).1;
    let section = match key {
        Some(k) => config.get_mut(k),
        None => Some(&mut *config),
    };
    if let Some(Json::Object(map)) = section {
        let old = map.get("vocab_size").cloned();
        map.insert("vocab_size".into(), Json::from(rows));
        warnings.push(format!(
            "the merged embedding has {rows} rows, so the output config's vocab_size ({}) is set to {rows}",
            old.map(|v| v.to_string()).unwrap_or_else(|| "unset".into())
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::super::params::{ParamValue, Setting};
    use super::*;

    fn ties_fixture() -> MergeSpec {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/merge/configs/ties.yml");
        let text = std::fs::read_to_string(path).unwrap();
        // The fixture names its models relative to the repository root.
        let text = text.replace("tests/", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/"));
        MergeSpec::from_yaml(&text, "ties.yml").unwrap().0
    }

    #[test]
    fn planning_assigns_parts_and_plans_every_output_tensor() {
        let spec = ties_fixture();
        let inputs = open_inputs(&spec).unwrap();
        let mut warnings = Vec::new();
        let plan = plan_merge(&spec, &inputs, &mut warnings).unwrap();
        assert_eq!((plan.base, plan.donor), (Some(0), 0));
        assert_eq!(plan.models, [1, 2, 3]);
        // The base's tensors, and lm_head because a task model stores one.
        let names: Vec<&str> = plan
            .tensors
            .planned
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names.len(), inputs[0].ckpt.names().len() + 1);
        assert!(names.contains(&LM_HEAD));
        // Every tensor is float, so every one is merged.
        assert_eq!(plan.tensors.jobs.len(), names.len());
    }

    #[test]
    fn planning_refuses_a_bad_parameter_naming_model_and_tensor() {
        let mut spec = ties_fixture();
        spec.models[1]
            .params
            .insert("density".into(), Setting::Scalar(ParamValue::Number(0.0)));
        let inputs = open_inputs(&spec).unwrap();
        let err = plan_merge(&spec, &inputs, &mut Vec::new())
            .err()
            .expect("density 0 is refused")
            .to_string();
        assert!(
            err.contains("ties: density 0 for model") && err.contains("task_b"),
            "{err}"
        );
    }
}
