//! Vision-language model families: how each keeps its language model on disk, and how to cut it
//! out as a standalone Hugging Face causal LM (each family's layout as its transformers modeling
//! file, or its remote code, names the weights; docs/reference/vlm-layouts.md has the table).
//!
//! Each family is one small file implementing [`Family`]: detection from `config.json` and tensor
//! names, and an [`ExtractPlan`] mapping every stored tensor to kept-under-a-new-name, dropped (vision
//! tower, projector, other) or surgery (row splits, expert unfusing), plus the standalone config.

pub mod plan;
pub mod prefix;
pub mod target;
pub mod transpose;

mod idefics3;
mod internvl;
mod llava_next;
mod llava_onevision;
mod minicpm_v;
mod molmo2;
mod molmoe;
mod ovis2;
mod qwen2_5_vl;
mod qwen2_vl;
mod qwen3_vl;
mod qwen3_vl_moe;

use serde_json::Value;

pub use plan::{DropKind, ExtractPlan, OutTensor, Part, Piece};
pub use target::Target;

use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// One VLM family.
pub trait Family: Sync {
    /// The name users pass to `--family`.
    fn name(&self) -> &'static str;
    /// One line for `--help`: layouts accepted, target class, what is unverified.
    fn help(&self) -> &'static str;
    /// Whether a checkpoint with this config and these tensor names belongs to the family.
    fn detect(&self, config: &Value, tensor_names: &[String]) -> bool;
    /// The extraction plan for this checkpoint.
    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan>;
}

/// Every supported family, in the order detection tries them.
pub static FAMILIES: &[&dyn Family] = &[
    &qwen2_vl::Qwen2Vl,
    &qwen2_5_vl::Qwen25Vl,
    &qwen3_vl::Qwen3Vl,
    &qwen3_vl_moe::Qwen3VlMoe,
    &llava_onevision::LlavaOnevision,
    &llava_next::LlavaNext,
    &internvl::InternVl,
    &idefics3::Idefics3,
    &ovis2::Ovis2,
    &minicpm_v::MiniCpmV,
    &molmo2::Molmo2,
    &molmoe::Molmoe,
];

/// The family names, as `--family` accepts them.
pub const NAMES: &[&str] = &[
    "qwen2-vl",
    "qwen2.5-vl",
    "qwen3-vl",
    "qwen3-vl-moe",
    "llava-onevision",
    "llava-next",
    "internvl",
    "idefics3",
    "ovis2",
    "minicpm-v",
    "molmo2",
    "molmoe",
];

/// The family of a checkpoint, from its config and tensor names; `None` for a plain causal LM or
/// an unsupported model.
pub fn detect(config: &Value, tensor_names: &[String]) -> Option<&'static dyn Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.detect(config, tensor_names))
}

/// The VLM family of `ckpt`, detected from config.json and the tensor names; the error says
/// when the checkpoint looks like a plain language model already.
pub fn detect_family(ckpt: &Checkpoint) -> Result<&'static dyn Family> {
    if let Some(f) = detect(&ckpt.config, ckpt.names()) {
        return Ok(f);
    }
    let (model_type, arch) = model_type_and_arch(&ckpt.config);
    let plain = ckpt
        .names()
        .iter()
        .all(|n| crate::arch::names::parse(n).is_some());
    let hint = if plain {
        " Its tensors already have causal-LM names: it looks like a plain language model, with nothing to extract."
    } else {
        ""
    };
    bail!(
        "{}: cannot tell which VLM family this is (config.json model_type `{model_type}`, architectures `{arch}`).{hint} Supported families: {}; pass --family to choose one",
        ckpt.label,
        NAMES.join(", ")
    )
}

/// A family by its `--family` name.
pub fn by_name(name: &str) -> Option<&'static dyn Family> {
    FAMILIES.iter().copied().find(|f| f.name() == name)
}

/// `model_type` and `architectures[0]` of a config ("" when absent).
pub(crate) fn model_type_and_arch(config: &Value) -> (&str, &str) {
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    let arch = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or("");
    (model_type, arch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_match_the_registry() {
        let names: Vec<&str> = FAMILIES.iter().map(|f| f.name()).collect();
        assert_eq!(names, NAMES);
        for n in NAMES {
            assert_eq!(by_name(n).map(|f| f.name()), Some(*n));
        }
    }

    #[test]
    fn detects_by_model_type_and_markers() {
        let name = |c: serde_json::Value, n: &[&str]| {
            let n: Vec<String> = n.iter().map(|s| s.to_string()).collect();
            detect(&c, &n).map(|f| f.name())
        };
        assert_eq!(
            name(json!({"model_type": "qwen2_5_vl"}), &[]),
            Some("qwen2.5-vl")
        );
        assert_eq!(
            name(
                json!({"model_type": "llava", "mm_vision_tower": "siglip"}),
                &[]
            ),
            Some("llava-onevision")
        );
        assert_eq!(
            name(json!({"model_type": "molmo", "moe_num_experts": 64}), &[]),
            Some("molmoe")
        );
        assert_eq!(name(json!({"model_type": "qwen2"}), &[]), None);
    }
}
