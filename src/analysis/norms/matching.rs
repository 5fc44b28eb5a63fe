//! Pairing the tensors of a reference and a target checkpoint by their standard names.
//!
//! Both checkpoints' language-model tensors are mapped to standard causal-LM names
//! (`arch::names::standard_name`), so a VLM's `model.language_model.layers.3...` meets the LM's
//! `model.layers.3...`. Tensors outside the language model (vision towers, projectors) are
//! counted and left out. A side whose config ties the output head to the embeddings and stores no
//! `lm_head` is compared through its `embed_tokens` when the other side has an `lm_head`.

use std::collections::BTreeMap;

use crate::arch::config::{check_compatible, TextConfig};
use crate::arch::names::{self, Module, Param, TensorName};
use crate::arch::LayerList;
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;

/// Which layers to report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerSelection {
    /// Every layer and the top-level tensors (embeddings, final norm, output head).
    All,
    /// These layers (`--layers`).
    List(LayerList),
    /// The last `k` layers.
    Last(usize),
}

impl LayerSelection {
    /// The selected layers of a model with `layers` layers, sorted (`None`: every layer and the
    /// top-level tensors); errors for a layer outside it.
    pub fn resolve(&self, layers: usize) -> Result<Option<Vec<usize>>> {
        match self {
            LayerSelection::All => Ok(None),
            LayerSelection::Last(k) => {
                if *k == 0 {
                    bail!("--last must be at least 1");
                }
                Ok(Some((layers.saturating_sub(*k)..layers).collect()))
            }
            LayerSelection::List(list) => list.resolve(layers).map(Some),
        }
    }
}

/// One tensor present in both checkpoints.
#[derive(Debug, Clone)]
pub struct Pair {
    /// Standard name (`model.layers.3.self_attn.q_proj.weight`).
    pub name: String,
    pub parsed: TensorName,
    /// Stored names in each checkpoint.
    pub reference: String,
    pub target: String,
    /// The shape compared (for differing vocabularies, the common rows).
    pub shape: Vec<usize>,
}

/// The result of pairing: the pairs in report order, and what the user should be told.
#[derive(Debug, Clone)]
pub struct Matching {
    pub pairs: Vec<Pair>,
    pub warnings: Vec<String>,
    /// Tensors outside the language model in (reference, target).
    pub ignored: (usize, usize),
    pub num_layers: usize,
    pub reference_config: TextConfig,
}

/// Report order: embeddings, then layer by layer, then the final norm and the output head.
pub fn order_key(t: &TensorName) -> (u8, usize, Module, bool, usize) {
    let group = match (t.layer, t.module) {
        (None, Module::EmbedTokens) => 0,
        (Some(_), _) => 1,
        _ => 2,
    };
    (
        group,
        t.layer.unwrap_or(0),
        t.module,
        t.param == Param::Bias,
        t.expert.unwrap_or(0),
    )
}

/// Normalize a checkpoint's text config, naming the model in errors.
pub fn text_config(ckpt: &Checkpoint) -> Result<TextConfig> {
    TextConfig::from_model_config(&ckpt.config).map_err(|e| {
        crate::bad!(
            "{}: {e}",
            ckpt.dir.join(crate::checkpoint::CONFIG_FILE).display()
        )
    })
}

/// Standard name -> stored name of every language-model tensor; the count of the others.
fn standard_names(ckpt: &Checkpoint) -> Result<(BTreeMap<String, String>, usize)> {
    let mut map = BTreeMap::new();
    let mut ignored = 0;
    for stored in ckpt.names() {
        let Some(name) = names::standard_name(stored) else {
            ignored += 1;
            continue;
        };
        if let Some(first) = map.insert(name.clone(), stored.clone()) {
            bail!(
                "{}: tensors `{first}` and `{stored}` both map to `{name}`",
                ckpt.label
            );
        }
    }
    Ok((map, ignored))
}

/// Whether one side stores layer `layer`'s experts fused and the other one tensor per expert.
fn expert_layouts_differ(
    a: &BTreeMap<String, String>,
    b: &BTreeMap<String, String>,
    layer: Option<usize>,
) -> bool {
    let fused = |names: &BTreeMap<String, String>| {
        names.keys().filter_map(|n| names::parse(n)).any(|p| {
            p.layer == layer
                && matches!(
                    p.module,
                    Module::FusedExpertsGateUp | Module::FusedExpertsDown
                )
        })
    };
    let split = |names: &BTreeMap<String, String>| {
        names
            .keys()
            .filter_map(|n| names::parse(n))
            .any(|p| p.layer == layer && p.expert.is_some())
    };
    layer.is_some() && (fused(a) && split(b) || split(a) && fused(b))
}

const LM_HEAD: &str = "lm_head.weight";
const EMBED: &str = "model.embed_tokens.weight";

/// The stored embedding name that stands in for a tied output head missing from `names`,
/// when the other side stores an `lm_head`.
fn tied_head(
    names: &BTreeMap<String, String>,
    config: &TextConfig,
    other: &BTreeMap<String, String>,
) -> Option<String> {
    let needed = !names.contains_key(LM_HEAD) && other.contains_key(LM_HEAD);
    (needed && config.tie_word_embeddings)
        .then(|| names.get(EMBED).cloned())
        .flatten()
}

/// Pair the tensors of `reference` and `target` selected by `modules` (all when `None`) and
/// `layers`. Errors: incompatible architectures, a selected tensor missing on one side, shapes
/// that differ other than in vocabulary rows, non-float dtypes.
pub fn match_tensors(
    reference: &Checkpoint,
    target: &Checkpoint,
    modules: Option<&[Module]>,
    layers: &LayerSelection,
) -> Result<Matching> {
    let ref_config = text_config(reference)?;
    let target_config = text_config(target)?;
    check_compatible(
        &ref_config,
        &target_config,
        &format!("REF {}", reference.label),
        &format!("TARGET {}", target.label),
    )?;
    let num_layers = ref_config.num_hidden_layers;
    let range = layers.resolve(num_layers)?;

    let (mut ref_names, ref_ignored) = standard_names(reference)?;
    let (mut target_names, target_ignored) = standard_names(target)?;
    let mut warnings = Vec::new();
    let ref_stand_in = tied_head(&ref_names, &ref_config, &target_names);
    let target_stand_in = tied_head(&target_names, &target_config, &ref_names);
    for (side, stand_in, names, ckpt) in [
        ("REF", ref_stand_in, &mut ref_names, reference),
        ("TARGET", target_stand_in, &mut target_names, target),
    ] {
        if let Some(embed) = stand_in {
            warnings.push(format!(
                "{side} {} ties its output head to its embeddings (no `{LM_HEAD}` on disk): its `{embed}` stands in for `{LM_HEAD}`",
                ckpt.label
            ));
            names.insert(LM_HEAD.to_string(), embed);
        }
    }
    let selected = |name: &str| -> Option<TensorName> {
        let parsed = names::parse(name)?;
        if modules.is_some_and(|m| !m.contains(&parsed.module)) {
            return None;
        }
        match (&range, parsed.layer) {
            (None, _) => Some(parsed),
            (Some(r), Some(l)) if r.binary_search(&l).is_ok() => Some(parsed),
            _ => None,
        }
    };

    let mut missing = Vec::new();
    let mut pairs = Vec::new();
    let all: std::collections::BTreeSet<&String> =
        ref_names.keys().chain(target_names.keys()).collect();
    for name in all {
        let Some(parsed) = selected(name) else {
            continue;
        };
        match (ref_names.get(name), target_names.get(name)) {
            (Some(r), Some(t)) => {
                let shape = compared_shape(name, reference, r, target, t, &parsed, &mut warnings)?;
                pairs.push(Pair {
                    name: name.clone(),
                    parsed,
                    reference: r.clone(),
                    target: t.clone(),
                    shape,
                });
            }
            (Some(r), None) => missing.push((
                parsed,
                format!(
                    "`{name}` is in REF ({}) but not in TARGET {}",
                    reference.describe(r),
                    target.label
                ),
            )),
            (None, Some(t)) => missing.push((
                parsed,
                format!(
                    "`{name}` is in TARGET ({}) but not in REF {}",
                    target.describe(t),
                    reference.label
                ),
            )),
            (None, None) => unreachable!("name comes from one of the maps"),
        }
    }
    if let Some((parsed, first)) = missing.first() {
        let more = match missing.len() {
            1 => String::new(),
            n => format!(" (and {} more tensors)", n - 1),
        };
        let hint = if expert_layouts_differ(&ref_names, &target_names, parsed.layer) {
            "; one side stores fused expert tensors (`mlp.experts.gate_up_proj`) and the other one tensor per expert: convert the VLM with `sinkmerge extract` first"
        } else {
            "; REF and TARGET must hold the same language-model tensors"
        };
        bail!("tensor {first}{more}{hint}");
    }
    if pairs.is_empty() {
        bail!(
            "no tensors selected: REF {} and TARGET {} share no language-model tensor with the given --modules/--layers",
            reference.label,
            target.label
        );
    }
    pairs.sort_by_key(|p| order_key(&p.parsed));
    Ok(Matching {
        pairs,
        warnings,
        ignored: (ref_ignored, target_ignored),
        num_layers,
        reference_config: ref_config,
    })
}

/// The shape both tensors are compared on; errors for non-float dtypes and shape mismatches
/// other than vocabulary rows.
fn compared_shape(
    name: &str,
    reference: &Checkpoint,
    ref_stored: &str,
    target: &Checkpoint,
    target_stored: &str,
    parsed: &TensorName,
    warnings: &mut Vec<String>,
) -> Result<Vec<usize>> {
    let r = reference.require(ref_stored)?;
    let t = target.require(target_stored)?;
    for (ckpt, stored, info) in [(reference, ref_stored, r), (target, target_stored, t)] {
        if !dtype::is_float(info.dtype) {
            bail!(
                "{}: dtype {:?} is not a floating-point type",
                ckpt.describe(stored),
                info.dtype
            );
        }
    }
    if r.shape == t.shape {
        return Ok(r.shape.clone());
    }
    let vocab_rows = parsed.module.is_vocab()
        && r.shape.len() == 2
        && t.shape.len() == 2
        && r.shape[1] == t.shape[1];
    if !vocab_rows {
        bail!(
            "shape mismatch for `{name}`: {:?} in {} vs {:?} in {}",
            r.shape,
            reference.describe(ref_stored),
            t.shape,
            target.describe(target_stored)
        );
    }
    let common = r.shape[0].min(t.shape[0]);
    warnings.push(format!(
        "vocabularies differ for `{name}` ({} rows in REF, {} in TARGET): compared on the first {common} rows",
        r.shape[0],
        t.shape[0]
    ));
    Ok(vec![common, r.shape[1]])
}
