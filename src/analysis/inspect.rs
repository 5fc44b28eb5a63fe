//! What a checkpoint is: its architecture, family, dtypes, parameters, layers, the tensors of
//! its language model by module and of everything else by name prefix, its QK-norm class, and
//! on request which tensors hold NaN or Inf.

use std::collections::BTreeMap;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::arch::{family, names, QkNorm, TextConfig};
use crate::checkpoint::Checkpoint;
use crate::dtype;

/// Everything `inspect` reports.
#[derive(Debug, Serialize, Deserialize)]
pub struct Inspection {
    pub model: String,
    pub path: String,
    /// The Hub repo and resolved commit, for models from the Hugging Face cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hub: Option<crate::checkpoint::hub_cache::HubRef>,
    pub architecture: Option<String>,
    pub model_type: Option<String>,
    pub family: Option<String>,
    pub num_parameters: u64,
    pub num_tensors: usize,
    pub total_bytes: u64,
    pub num_layers: Option<usize>,
    pub qk_norm: QkNorm,
    pub dtypes: BTreeMap<String, usize>,
    pub shards: usize,
    pub tie_word_embeddings: Option<bool>,
    pub lm_head_on_disk: bool,
    pub text_config: Option<TextConfig>,
    /// Why the text config could not be normalized, if it could not.
    pub text_config_error: Option<String>,
    pub modules: Vec<ModuleSummary>,
    /// Tensors outside the language model (vision tower, projector, ...), by name prefix.
    pub other: Vec<OtherSummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub non_finite: Option<Vec<NonFinite>>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ModuleSummary {
    pub module: String,
    pub count: usize,
    pub shapes: Vec<Vec<usize>>,
    pub dtypes: Vec<String>,
    pub parameters: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct OtherSummary {
    pub prefix: String,
    pub tensors: usize,
    pub parameters: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct NonFinite {
    pub tensor: String,
    pub file: String,
    pub nan: u64,
    pub inf: u64,
}

impl Inspection {
    pub fn of(ckpt: &Checkpoint) -> Inspection {
        let config = &ckpt.config;
        let str_of = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
        let (text_config, text_config_error) = match TextConfig::from_model_config(config) {
            Ok(c) => (Some(c), None),
            Err(e) => (None, Some(e.to_string())),
        };

        let mut modules: BTreeMap<String, ModuleSummary> = BTreeMap::new();
        let mut other: BTreeMap<String, OtherSummary> = BTreeMap::new();
        let mut layers = std::collections::BTreeSet::new();
        let mut q_norm: Option<(usize, usize)> = None;
        let mut lm_head_on_disk = false;
        for name in ckpt.names() {
            let info = ckpt.info(name).expect("listed");
            let parsed = names::standard_name(name).and_then(|s| names::parse(&s));
            let Some(p) = parsed else {
                let prefix = other_prefix(name);
                let entry = other.entry(prefix.clone()).or_insert(OtherSummary {
                    prefix,
                    tensors: 0,
                    parameters: 0,
                });
                entry.tensors += 1;
                entry.parameters += info.numel() as u64;
                // Remote-code layouts (Molmo) name q_norm differently; still classify QK norm.
                if name.ends_with(".q_norm.weight") && q_norm.is_none() {
                    q_norm = Some((usize::MAX, info.numel()));
                }
                continue;
            };
            if let Some(l) = p.layer {
                layers.insert(l);
            }
            if p.module == names::Module::LmHead {
                lm_head_on_disk = true;
            }
            if p.module == names::Module::QNorm {
                let layer = p.layer.unwrap_or(0);
                if q_norm.is_none_or(|(l, _)| layer < l) {
                    q_norm = Some((layer, info.numel()));
                }
            }
            let key = format!(
                "{}.{}",
                p.module.short_name(),
                if p.param == names::Param::Bias {
                    "bias"
                } else {
                    "weight"
                }
            );
            let entry = modules.entry(key.clone()).or_insert(ModuleSummary {
                module: key,
                count: 0,
                shapes: Vec::new(),
                dtypes: Vec::new(),
                parameters: 0,
            });
            entry.count += 1;
            entry.parameters += info.numel() as u64;
            if !entry.shapes.contains(&info.shape) {
                entry.shapes.push(info.shape.clone());
            }
            let d = format!("{:?}", info.dtype);
            if !entry.dtypes.contains(&d) {
                entry.dtypes.push(d);
            }
        }
        let mut modules: Vec<ModuleSummary> = modules.into_values().collect();
        modules.sort_by_key(|m| {
            names::Module::from_short_name(m.module.split('.').next().unwrap_or(""))
                .map(|x| x as usize)
                .unwrap_or(usize::MAX)
        });

        let (section, _) = crate::arch::config::text_section(config);
        let tie_word_embeddings = section
            .get("tie_word_embeddings")
            .or_else(|| config.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
            .or(text_config.as_ref().map(|c| c.tie_word_embeddings));
        let num_layers = text_config
            .as_ref()
            .map(|c| c.num_hidden_layers)
            .or_else(|| {
                ["num_hidden_layers", "n_layers", "num_layers"]
                    .iter()
                    .find_map(|k| section.get(*k).and_then(Value::as_u64).map(|n| n as usize))
            })
            .or((!layers.is_empty()).then_some(layers.len()));

        Inspection {
            model: ckpt.label.clone(),
            path: ckpt.dir.display().to_string(),
            hub: ckpt.hub.clone(),
            architecture: str_of(config.get("architectures").and_then(|a| a.get(0))),
            model_type: str_of(config.get("model_type")),
            family: family::detect(config, ckpt.names()).map(str::to_string),
            num_parameters: ckpt.num_parameters(),
            num_tensors: ckpt.names().len(),
            total_bytes: ckpt.total_bytes(),
            num_layers,
            qk_norm: QkNorm::classify(q_norm.map(|(_, n)| n), text_config.as_ref()),
            dtypes: ckpt.dtype_counts(),
            shards: ckpt.shards.len(),
            tie_word_embeddings,
            lm_head_on_disk,
            text_config,
            text_config_error,
            modules,
            other: other.into_values().collect(),
            non_finite: None,
        }
    }
}

/// Scan every floating-point tensor for NaN/Inf (in parallel over tensors).
pub fn scan_non_finite(ckpt: &Checkpoint, bar: &indicatif::ProgressBar) -> Vec<NonFinite> {
    let mut found: Vec<NonFinite> = ckpt
        .names()
        .par_iter()
        .filter_map(|name| {
            let info = ckpt.info(name).expect("listed");
            let bytes = ckpt.bytes(name).expect("listed");
            let (nan, inf) = dtype::count_non_finite(info.dtype, bytes);
            bar.inc(bytes.len() as u64);
            (nan + inf > 0).then(|| NonFinite {
                tensor: name.clone(),
                file: ckpt
                    .shard_of(name)
                    .map(|s| s.file_name())
                    .unwrap_or_default(),
                nan,
                inf,
            })
        })
        .collect();
    found.sort_by(|a, b| crate::checkpoint::natural_cmp(&a.tensor, &b.tensor));
    found
}

/// The first one or two name components of a tensor outside the language model.
fn other_prefix(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    let keep = if parts.len() > 2 && parts[0] == "model" {
        2
    } else {
        1
    };
    parts[..keep.min(parts.len().saturating_sub(1)).max(1)].join(".")
}
