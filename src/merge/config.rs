//! Merge configurations: the mergekit YAML subset sinkmerge reads, and `sinkmerge_config.yml`,
//! the fully resolved record it writes next to every merged model.
//!
//! Supported keys (mergekit's meaning, docs/commands/merge.md#the-yaml-format): `merge_method`,
//! `base_model`, `models[].model`, `models[].parameters`, top-level `parameters`, `dtype`,
//! `out_dtype`, `tokenizer_source` (`base` or a model; the tokenizer files are copied from it).
//! Parameter values are scalars, layer gradients or `{filter, value}` lists. `slices`, `modules`,
//! `tokenizer` (vocabulary surgery), `tokenizer_source: union` and `chat_template` are refused with
//! a clear error, as is any key sinkmerge does not know.
//!
//! sinkmerge always computes in f32; `dtype` only sets the output dtype when `out_dtype` is
//! absent (mergekit also computes in `dtype`; with `dtype: float32` both agree).

use std::path::Path;

use safetensors::Dtype;
use serde_yaml_ng::{Mapping, Value as Yaml};

use super::params::{yaml_repr, Scope, Setting, Settings};
use super::{method, method_names, MergeMethod};
use crate::dtype::{parse_float_dtype, torch_name};
use crate::error::Result;
use crate::shell::quote;
use crate::{bad, bail};

/// One input model and its per-model parameter settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelEntry {
    pub model: String,
    pub params: Settings,
}

/// A merge, as configured (before models are opened and parameters resolved per tensor).
#[derive(Clone)]
pub struct MergeSpec {
    pub method: &'static dyn MergeMethod,
    /// The base of task-vector methods; for `linear`, optionally the model whose config and
    /// tokenizer the output gets (it must also be one of `models`).
    pub base: Option<String>,
    /// The merged models: task models for task-vector methods, every input for `linear`.
    pub models: Vec<ModelEntry>,
    /// Top-level `parameters`.
    pub params: Settings,
    /// mergekit's `dtype`: the output dtype when `out_dtype` is not set.
    pub dtype: Option<Dtype>,
    pub out_dtype: Option<Dtype>,
    /// Where tokenizer files come from: `base` or a model reference. `None`: the base model,
    /// else the first model (mergekit's donor).
    pub tokenizer_source: Option<String>,
    /// `into_vlm` (a sinkmerge key): the VLM whose layout the merged language model is written
    /// into (docs/commands/graft.md#into-vlm).
    pub into_vlm: Option<String>,
}

impl std::fmt::Debug for MergeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergeSpec")
            .field("method", &self.method.name())
            .field("base", &self.base)
            .field("models", &self.models)
            .field("params", &self.params)
            .field("dtype", &self.dtype)
            .field("out_dtype", &self.out_dtype)
            .field("tokenizer_source", &self.tokenizer_source)
            .field("into_vlm", &self.into_vlm)
            .finish()
    }
}

impl PartialEq for MergeSpec {
    fn eq(&self, other: &Self) -> bool {
        self.method.name() == other.method.name()
            && self.base == other.base
            && self.models == other.models
            && self.params == other.params
            && self.dtype == other.dtype
            && self.out_dtype == other.out_dtype
            && self.tokenizer_source == other.tokenizer_source
            && self.into_vlm == other.into_vlm
    }
}

const SUPPORTED_KEYS: &[&str] = &[
    "merge_method",
    "base_model",
    "models",
    "parameters",
    "dtype",
    "out_dtype",
    "tokenizer_source",
    "into_vlm",
    "sinkmerge_version",
];

/// mergekit keys sinkmerge recognises but does not implement, with the reason.
const UNSUPPORTED_KEYS: &[(&str, &str)] = &[
    ("slices", "layer slices (frankenmerges) are not supported; list whole models under `models`"),
    ("modules", "per-module configs are not supported; list whole models under `models`"),
    ("tokenizer", "tokenizer surgery (rebuilding embeddings for a new vocabulary) is not supported; use `tokenizer_source: base` or a model to copy its tokenizer files"),
    ("chat_template", "`chat_template` is not supported; the chat template is copied with the tokenizer files from `tokenizer_source`"),
];

impl MergeSpec {
    /// Read a YAML merge config; warnings (ignored settings) are returned beside it.
    pub fn from_yaml_file(path: &Path) -> Result<(MergeSpec, Vec<String>)> {
        let text = crate::checkpoint::read_text(path)?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// Parse YAML text; `origin` names it in errors.
    pub fn from_yaml(text: &str, origin: &str) -> Result<(MergeSpec, Vec<String>)> {
        let doc: Yaml =
            serde_yaml_ng::from_str(text).map_err(|e| bad!("{origin}: not valid YAML: {e}"))?;
        let Yaml::Mapping(top) = doc else {
            bail!("{origin}: expected a mapping with `merge_method` and `models` at the top level");
        };
        if top.get("method").and_then(Yaml::as_str) == Some("repair_heads") {
            bail!("{origin}: {}", repair_heads_recipe(&top));
        }
        let mut warnings = Vec::new();
        for (key, _) in &top {
            let Some(k) = key.as_str() else {
                bail!("{origin}: top-level key {} is not a string", yaml_repr(key));
            };
            if let Some((_, why)) = UNSUPPORTED_KEYS.iter().find(|(name, _)| *name == k) {
                bail!("{origin}: `{k}`: {why}");
            }
            if !SUPPORTED_KEYS.contains(&k) {
                bail!(
                    "{origin}: unknown key `{k}`; supported keys: {}",
                    SUPPORTED_KEYS.join(", ")
                );
            }
        }
        let get = |k: &str| top.get(k);
        let text_of = |k: &str| -> Result<Option<String>> {
            match get(k) {
                None | Some(Yaml::Null) => Ok(None),
                Some(Yaml::String(s)) if !s.trim().is_empty() => Ok(Some(s.trim().to_string())),
                Some(other) => bail!("{origin}: `{k}` must be a string, not {}", yaml_repr(other)),
            }
        };

        let method_name =
            text_of("merge_method")?.ok_or_else(|| bad!("{origin}: `merge_method` is missing"))?;
        let method = method(&method_name).ok_or_else(|| {
            bad!(
                "{origin}: merge_method `{method_name}` is not supported; sinkmerge implements: {}",
                method_names().join(", ")
            )
        })?;
        let ctx = format!("{origin} ({method_name})");

        if let Some(v) = text_of("sinkmerge_version")? {
            let running = env!("CARGO_PKG_VERSION");
            if v != running {
                warnings.push(format!(
                    "{origin} was written by sinkmerge {v}; this is sinkmerge {running}"
                ));
            }
        }

        let base = text_of("base_model")?;
        let params = parse_settings(method, get("parameters"), Scope::Global, &ctx, "parameters")?;

        let Some(Yaml::Sequence(items)) = get("models") else {
            bail!("{origin}: `models` must be a list of {{model: ..., parameters: ...}} entries");
        };
        let mut entries = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            entries.push(parse_model_entry(
                method,
                item,
                &format!("{ctx}: models[{i}]"),
            )?);
        }

        let dtype_of = |k: &str| -> Result<Option<Dtype>> {
            text_of(k)?
                .map(|s| {
                    parse_float_dtype(&s).ok_or_else(|| {
                        bad!("{origin}: `{k}: {s}` is not a float dtype (float32, bfloat16, float16)")
                    })
                })
                .transpose()
        };
        let tokenizer_source = text_of("tokenizer_source")?;
        if tokenizer_source.as_deref() == Some("union") {
            bail!(
                "{origin}: `tokenizer_source: union` builds a new vocabulary (tokenizer surgery), which sinkmerge does not support; use `base` or a model"
            );
        }
        let mut spec = MergeSpec::new(
            method,
            base,
            entries,
            params,
            dtype_of("dtype")?,
            dtype_of("out_dtype")?,
            tokenizer_source,
            &mut warnings,
        )
        .map_err(|e| bad!("{origin}: {e}"))?;
        spec.into_vlm = text_of("into_vlm")?;
        Ok((spec, warnings))
    }

    /// Assemble and check a spec: the base's place among the models, duplicates, counts.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        method: &'static dyn MergeMethod,
        base: Option<String>,
        entries: Vec<ModelEntry>,
        params: Settings,
        dtype: Option<Dtype>,
        out_dtype: Option<Dtype>,
        tokenizer_source: Option<String>,
        warnings: &mut Vec<String>,
    ) -> Result<MergeSpec> {
        let name = method.name();
        for (i, e) in entries.iter().enumerate() {
            if entries[..i].iter().any(|p| p.model == e.model) {
                bail!("model `{}` is listed twice", e.model);
            }
        }
        let models = if method.needs_base() {
            let Some(b) = &base else {
                bail!("{name} works on task vectors and needs `base_model` (--base)");
            };
            let mut models = Vec::with_capacity(entries.len());
            for e in entries {
                if &e.model == b {
                    if !e.params.is_empty() {
                        warnings.push(format!(
                            "the base model `{b}` is also listed with parameters; {name} gives the base no per-model parameters, so they are ignored"
                        ));
                    }
                } else {
                    models.push(e);
                }
            }
            if models.is_empty() {
                bail!("{name} needs at least one model besides the base `{b}`");
            }
            models
        } else {
            if let Some(b) = &base {
                if !entries.iter().any(|e| &e.model == b) {
                    bail!(
                        "{name} has no base; `base_model` (`{b}`) only picks the config donor and must also be listed under `models` with a weight"
                    );
                }
            }
            if entries.is_empty() {
                bail!("{name} needs at least one model");
            }
            entries
        };
        Ok(MergeSpec {
            method,
            base,
            models,
            params,
            dtype,
            out_dtype,
            tokenizer_source,
            into_vlm: None,
        })
    }

    /// The resolved record written as `sinkmerge_config.yml`. `reference` maps each model
    /// reference to the exact one recorded (absolute directory or `ORG/NAME@commit`); defaults
    /// are filled in so the file states every parameter.
    pub fn to_record(&self, reference: &dyn Fn(&str) -> String) -> String {
        let mut top = Mapping::new();
        top.insert("merge_method".into(), self.method.name().into());
        if let Some(b) = &self.base {
            top.insert("base_model".into(), reference(b).into());
        }
        let mut models = Vec::new();
        if self.method.needs_base() {
            if let Some(b) = &self.base {
                let mut m = Mapping::new();
                m.insert("model".into(), reference(b).into());
                models.push(Yaml::Mapping(m));
            }
        }
        for e in &self.models {
            let mut m = Mapping::new();
            m.insert("model".into(), reference(&e.model).into());
            // In the method's declared order; defaults for what neither the model nor the
            // top-level parameters set.
            let mut p = Mapping::new();
            for spec in self
                .method
                .params()
                .iter()
                .filter(|p| p.scope == Scope::PerModel)
            {
                if let Some(setting) = e.params.get(spec.name) {
                    p.insert(spec.name.into(), setting.to_yaml());
                } else if !self.params.contains_key(spec.name) {
                    if let Some(v) = super::params::default_value(spec) {
                        p.insert(spec.name.into(), Setting::Scalar(v).to_yaml());
                    }
                }
            }
            if !p.is_empty() {
                m.insert("parameters".into(), Yaml::Mapping(p));
            }
            models.push(Yaml::Mapping(m));
        }
        top.insert("models".into(), Yaml::Sequence(models));
        let mut params = Mapping::new();
        for spec in self.method.params() {
            if let Some(setting) = self.params.get(spec.name) {
                params.insert(spec.name.into(), setting.to_yaml());
            } else if spec.scope == Scope::Global {
                if let Some(v) = super::params::default_value(spec) {
                    params.insert(spec.name.into(), Setting::Scalar(v).to_yaml());
                }
            }
        }
        top.insert("parameters".into(), Yaml::Mapping(params));
        for (key, dt) in [("dtype", self.dtype), ("out_dtype", self.out_dtype)] {
            if let Some(name) = dt.and_then(torch_name) {
                top.insert(key.into(), name.into());
            }
        }
        if let Some(t) = &self.tokenizer_source {
            let t = if t == "base" { t.clone() } else { reference(t) };
            top.insert("tokenizer_source".into(), t.into());
        }
        if let Some(v) = &self.into_vlm {
            top.insert("into_vlm".into(), reference(v).into());
        }
        top.insert("sinkmerge_version".into(), env!("CARGO_PKG_VERSION").into());
        let body = serde_yaml_ng::to_string(&Yaml::Mapping(top)).expect("YAML values serialize");
        format!(
            "# Written by sinkmerge {}: the fully resolved merge that produced this model.\n# Replay it with: sinkmerge merge sinkmerge_config.yml -o OUT\n{body}",
            env!("CARGO_PKG_VERSION")
        )
    }
}

/// What to say about a `repair-heads` recipe (OUT/sinkmerge_config.yml of `sinkmerge
/// repair-heads`) given to `merge`: what it is, and the command that replays it from its own
/// fields, as the model card's replay command does.
fn repair_heads_recipe(top: &Mapping) -> String {
    let text = |k: &str| match top.get(k) {
        Some(Yaml::String(s)) => s.clone(),
        Some(Yaml::Number(n)) => n.to_string(),
        Some(Yaml::Sequence(items)) => (items.iter())
            .filter_map(|v| match v {
                Yaml::String(s) => Some(s.clone()),
                Yaml::Number(n) => Some(n.to_string()),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join(","),
        _ => k.to_ascii_uppercase(),
    };
    let into_vlm = match top.get("into_vlm") {
        Some(Yaml::String(v)) => format!(" --into-vlm {}", quote(v)),
        _ => String::new(),
    };
    format!(
        "this is a repair-heads recipe (`method: repair_heads`), not a merge config; replay it \
         with `sinkmerge repair-heads --ref {} {} --heads {} --modules {} --lambda {}{into_vlm} -o OUT`",
        quote(&text("reference")),
        quote(&text("target")),
        quote(&text("heads")),
        quote(&text("modules")),
        quote(&text("lambda")),
    )
}

fn parse_settings(
    method: &dyn MergeMethod,
    value: Option<&Yaml>,
    place: Scope,
    ctx: &str,
    what: &str,
) -> Result<Settings> {
    let mut out = Settings::new();
    let map = match value {
        None | Some(Yaml::Null) => return Ok(out),
        Some(Yaml::Mapping(m)) => m,
        Some(other) => bail!(
            "{ctx}: `{what}` must be a mapping, not {}",
            yaml_repr(other)
        ),
    };
    for (k, v) in map {
        let Some(name) = k.as_str() else {
            bail!("{ctx}: `{what}` key {} is not a string", yaml_repr(k));
        };
        let Some(spec) = method.params().iter().find(|p| p.name == name) else {
            bail!(
                "{ctx}: unknown parameter `{name}` in `{what}`; {} takes: {}",
                method.name(),
                method
                    .params()
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        if place == Scope::PerModel && spec.scope == Scope::Global {
            bail!(
                "{ctx}: `{name}` is a global parameter of {}; set it under the top-level `parameters`",
                method.name()
            );
        }
        if spec.kind == super::params::Kind::Integer && !matches!(v, Yaml::Number(_)) {
            bail!("{ctx}: `{name}` must be a single non-negative integer");
        }
        out.insert(name.to_string(), Setting::from_yaml(spec, v, ctx)?);
    }
    Ok(out)
}

fn parse_model_entry(method: &dyn MergeMethod, item: &Yaml, ctx: &str) -> Result<ModelEntry> {
    let Yaml::Mapping(map) = item else {
        bail!(
            "{ctx}: expected {{model: ..., parameters: ...}}, not {}",
            yaml_repr(item)
        );
    };
    let mut model = None;
    let mut params = Settings::new();
    for (k, v) in map {
        match k.as_str() {
            Some("model") => match v {
                Yaml::String(s) if !s.trim().is_empty() => model = Some(s.trim().to_string()),
                other => bail!(
                    "{ctx}: `model` must be a model reference, not {}",
                    yaml_repr(other)
                ),
            },
            Some("parameters") => {
                params = parse_settings(method, Some(v), Scope::PerModel, ctx, "parameters")?
            }
            Some("layer_range") => {
                bail!("{ctx}: `layer_range` (slices) is not supported; models are merged whole")
            }
            _ => bail!(
                "{ctx}: unknown key {} (expected `model` and `parameters`)",
                yaml_repr(k)
            ),
        }
    }
    let model = model.ok_or_else(|| bad!("{ctx}: `model` is missing"))?;
    Ok(ModelEntry { model, params })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<(MergeSpec, Vec<String>)> {
        MergeSpec::from_yaml(text, "cfg.yaml")
    }

    #[test]
    fn a_repair_heads_recipe_is_named_with_its_replay_command() {
        let recipe = "method: repair_heads\nreference: ref\ntarget: vl\nselection: top:2\n\
                      candidate_layers: [4, 5]\nheads:\n- '4.1'\n- '5.0'\nmodules:\n- q\n- k\n\
                      lambda: 0.5\n";
        let err = parse(recipe).unwrap_err().to_string();
        assert!(
            err.starts_with("cfg.yaml: this is a repair-heads recipe"),
            "{err}"
        );
        assert!(
            err.contains(
                "`sinkmerge repair-heads --ref ref vl --heads 4.1,5.0 --modules q,k --lambda 0.5 -o OUT`"
            ),
            "{err}"
        );
    }

    #[test]
    fn reads_mergekits_ties_example() {
        let (spec, warnings) = parse(
            "models:
  - model: psmathur/orca_mini_v3_13b
    parameters:
      density: [1, 0.7, 0.1] # density gradient
      weight: 1.0
  - model: garage-bAInd/Platypus2-13B
    parameters:
      density: 0.5
      weight: [0, 0.3, 0.7, 1] # weight gradient
  - model: WizardLM/WizardMath-13B-V1.0
    parameters:
      density: 0.33
      weight:
        - filter: mlp
          value: 0.5
        - value: 0
merge_method: ties
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  normalize: true
  int8_mask: true
dtype: float16
",
        )
        .unwrap();
        assert!(warnings.is_empty());
        assert_eq!(spec.method.name(), "ties");
        assert_eq!(spec.models.len(), 3);
        assert_eq!(spec.dtype, Some(Dtype::F16));
        assert_eq!(
            spec.models[1].params["weight"],
            Setting::Gradient(vec![0.0, 0.3, 0.7, 1.0])
        );
    }

    #[test]
    fn the_base_listed_among_models_is_the_base() {
        let (spec, _) = parse(
            "merge_method: dare_ties
base_model: B
models:
  - model: B
  - model: M1
    parameters: {density: 0.5, weight: 0.5}
parameters: {normalize: false, int8_mask: true}
",
        )
        .unwrap();
        assert_eq!(spec.base.as_deref(), Some("B"));
        assert_eq!(spec.models.len(), 1);
    }

    #[test]
    fn refuses_what_it_does_not_implement() {
        let cases = [
            ("merge_method: slerp\nmodels: [{model: a}]\n", "not supported"),
            ("merge_method: linear\nslices: []\n", "layer slices"),
            ("merge_method: linear\nmodels: [{model: a}]\ntokenizer: {source: union}\n", "tokenizer surgery"),
            ("merge_method: linear\nmodels: [{model: a}]\ntokenizer_source: union\n", "tokenizer surgery"),
            ("merge_method: linear\nmodels: [{model: a}]\nfoo: 1\n", "unknown key `foo`"),
            ("merge_method: ties\nbase_model: b\nmodels: [{model: a, parameters: {dens: 1}}]\n", "unknown parameter `dens`"),
            ("merge_method: ties\nbase_model: b\nmodels: [{model: a, parameters: {lambda: 1}}]\n", "global parameter"),
            ("merge_method: ties\nmodels: [{model: a}]\n", "needs `base_model`"),
            ("merge_method: linear\nbase_model: c\nmodels: [{model: a}]\n", "must also be listed"),
            ("merge_method: linear\nmodels: [{model: a}, {model: a}]\n", "listed twice"),
            ("merge_method: linear\nmodels: [{model: a}]\ndtype: int8\n", "not a float dtype"),
            ("merge_method: dare_linear\nbase_model: b\nmodels: [{model: a}]\nparameters: {seed: [1, 2]}\n", "single non-negative integer"),
            ("merge_method: ties\nbase_model: b\nmodels: [{model: a, layer_range: [0, 2]}]\n", "layer_range"),
        ];
        for (text, expected) in cases {
            let err = parse(text)
                .err()
                .unwrap_or_else(|| panic!("accepted: {text}"));
            assert!(err.to_string().contains(expected), "{text}: {err}");
            assert!(err.to_string().starts_with("cfg.yaml"), "{err}");
        }
    }

    #[test]
    fn the_record_reads_back_to_the_same_spec() {
        let (spec, _) = parse(
            "merge_method: ties
base_model: B
models:
  - model: M1
    parameters: {weight: [0.2, 0.8], density: {filter: mlp, value: 0.3}}
  - model: M2
    parameters: {weight: 1}
parameters: {lambda: 1.5, trim: global}
out_dtype: bf16
",
        )
        .unwrap();
        let record = spec.to_record(&|r: &str| format!("/abs/{r}"));
        let (back, warnings) = MergeSpec::from_yaml(&record, "record").unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(back.base.as_deref(), Some("/abs/B"));
        assert_eq!(
            back.models[0].params["weight"],
            spec.models[0].params["weight"]
        );
        // Defaults are written out: density for M2, every global parameter.
        assert_eq!(
            back.models[1].params["density"],
            Setting::Scalar(super::super::params::ParamValue::Number(1.0))
        );
        for p in [
            "lambda",
            "normalize",
            "rescale",
            "trim",
            "election",
            "int8_mask",
        ] {
            assert!(back.params.contains_key(p), "{p} missing from\n{record}");
        }
        // Reading the record and recording again is a fixed point.
        assert_eq!(back.to_record(&|r: &str| r.to_string()), record);
    }
}
