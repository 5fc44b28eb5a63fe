//! The norm-channel ablation of Appendix D.3: in a norm-scale vector gamma, replace the K
//! entries of largest |gamma| by the mean of all of gamma's entries (the layer-wise channel
//! mean), removing the channels that carry massive activations while keeping the scale's level.
//!
//! Selection is by |gamma| descending; entries of equal magnitude are taken lowest index first,
//! so exactly K entries are chosen even when several tie at the K-th magnitude. The mean is taken
//! in f64 over the stored values before any replacement and rounded once to the tensor's dtype.

use std::collections::{BTreeSet, HashMap, HashSet};

use safetensors::Dtype;
use serde::Serialize;
use serde_json::Value;

use crate::arch::names::{self, Module, Param};
use crate::arch::{LayerList, QkNorm, TextConfig};
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;
use crate::{bad, bail};

/// The per-layer norm scales `--norms` accepts.
pub const LAYER_NORMS: [Module; 6] = [
    Module::InputLayernorm,
    Module::PostAttentionLayernorm,
    Module::PreFeedforwardLayernorm,
    Module::PostFeedforwardLayernorm,
    Module::QNorm,
    Module::KNorm,
];

/// Which tensors an ablation rewrites.
#[derive(Debug, Clone)]
pub struct AblationPlan {
    /// The stored names of the norm tensors to ablate.
    pub targets: HashSet<String>,
    /// The selected layers, sorted.
    pub layers: Vec<usize>,
    pub num_layers: usize,
    /// What the user should be told about the input (a check that could not be made).
    pub warnings: Vec<String>,
}

/// Choose the `norms` tensors of `layers` (all when `None`) in `model`. Refuses Gemma's
/// `(1 + weight)` scales, norms the architecture lacks, a layer missing one, non-float dtypes and
/// tensors of fewer than `top_k` entries.
pub fn plan(
    model: &Checkpoint,
    norms: &[Module],
    top_k: usize,
    layers: Option<&LayerList>,
) -> Result<AblationPlan> {
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
    let mut warnings = Vec::new();
    let text = match TextConfig::from_model_config(&model.config) {
        Ok(c) => Some(c),
        Err(e) => {
            warnings.push(format!(
                "{}: config.json does not normalize ({e}); the layers are counted from the tensor \
                 names",
                model.label
            ));
            None
        }
    };

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
    let layers = match layers {
        Some(list) => list.resolve(num_layers)?,
        None => (0..num_layers).collect(),
    };

    let mut targets = HashSet::new();
    for &module in norms {
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
            if info.numel() < top_k {
                bail!(
                    "{}: has {} entries, fewer than --top-k {}",
                    model.describe(name),
                    info.numel(),
                    top_k
                );
            }
            targets.insert(name.to_string());
        }
    }
    Ok(AblationPlan {
        targets,
        layers,
        num_layers,
        warnings,
    })
}

/// Ablate one stored norm tensor `name` (`what` names it in errors): its new bytes, same dtype
/// and length, and the report. Refuses NaN and Inf entries.
pub fn ablate_stored(
    name: &str,
    stored: Dtype,
    bytes: &[u8],
    k: usize,
    what: &str,
) -> Result<(Vec<u8>, Ablation)> {
    let mut values = dtype::decode(stored, bytes, what)?;
    if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
        return Err(crate::non_finite!("{what}: entry {bad} is {}", values[bad]));
    }
    let round = |x: f32| {
        let enc = dtype::encode(stored, &[x]).expect("decode above accepted the dtype: a float");
        dtype::decode(stored, &enc, "").expect("one value just encoded in this dtype")[0]
    };
    let a = ablate(name, &mut values, k, round);
    Ok((dtype::encode(stored, &values)?, a))
}

/// The indices of the `k` entries of largest magnitude, ties broken by lowest index, in
/// selection order. `k` must not exceed `values.len()`; values must not be NaN.
pub fn top_k_by_magnitude(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    // Stable sort: equal magnitudes keep ascending index order.
    order.sort_by(|&a, &b| values[b].abs().total_cmp(&values[a].abs()));
    order.truncate(k);
    order
}

/// The outcome for one norm tensor.
#[derive(Debug, Clone, Serialize)]
pub struct Ablation {
    pub tensor: String,
    /// The channel mean written into the selected entries (after rounding to the dtype).
    pub mean: f32,
    /// Selected channels, largest |gamma| first.
    pub channels: Vec<usize>,
    /// Their values before ablation.
    pub replaced: Vec<f32>,
    /// How many stored values actually changed (K unless a selected value already equalled the
    /// rounded mean).
    pub changed: usize,
}

/// Ablate `values` (decoded f32 of the stored tensor) in place. `round` maps an f32 to the
/// nearest value of the storage dtype.
pub fn ablate(tensor: &str, values: &mut [f32], k: usize, round: impl Fn(f32) -> f32) -> Ablation {
    let mean = round((values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64) as f32);
    let channels = top_k_by_magnitude(values, k);
    let replaced: Vec<f32> = channels.iter().map(|&i| values[i]).collect();
    let mut changed = 0;
    for &i in &channels {
        if values[i].to_bits() != mean.to_bits() {
            changed += 1;
        }
        values[i] = mean;
    }
    Ablation {
        tensor: tensor.to_string(),
        mean,
        channels,
        replaced,
        changed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_at_the_kth_magnitude_take_the_lowest_index() {
        let v = [0.5, -3.0, 2.0, 2.0, -2.0, 1.0];
        assert_eq!(top_k_by_magnitude(&v, 1), vec![1]);
        assert_eq!(top_k_by_magnitude(&v, 2), vec![1, 2]);
        assert_eq!(top_k_by_magnitude(&v, 3), vec![1, 2, 3]);
        assert_eq!(top_k_by_magnitude(&v, 4), vec![1, 2, 3, 4]);
    }

    #[test]
    fn exactly_k_entries_become_the_mean() {
        let mut v = vec![1.0f32, 9.0, -8.0, 1.5, 0.5, 2.0];
        let before = v.clone();
        let a = ablate("t", &mut v, 2, |x| x);
        let mean = before.iter().map(|&x| x as f64).sum::<f64>() / 6.0;
        assert_eq!(a.mean, mean as f32);
        assert_eq!(a.channels, vec![1, 2]);
        assert_eq!(a.replaced, vec![9.0, -8.0]);
        assert_eq!(a.changed, 2);
        let differing: Vec<usize> = (0..6).filter(|&i| v[i] != before[i]).collect();
        assert_eq!(differing, vec![1, 2]);
        assert!(differing.iter().all(|&i| v[i] == a.mean));
    }

    #[test]
    fn constant_scales_report_no_change() {
        let mut v = vec![1.0f32; 8];
        let a = ablate("t", &mut v, 3, |x| x);
        assert_eq!((a.changed, a.channels), (0, vec![0, 1, 2]));
    }
}
