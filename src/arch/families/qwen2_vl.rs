//! Qwen2-VL (Qwen/Qwen2-VL-{2B,7B,72B}-Instruct; docs/reference/vlm-layouts.md#qwen2-vl): a Qwen2
//! language model under `model.` next to `visual.` (Hub, and what `save_pretrained` writes), or
//! under `model.language_model.` next to `model.visual.` (checkpoints saved from transformers >=
//! 4.52 memory). The Hub config is flat; 5.x saves a nested `text_config`. Target
//! `Qwen2ForCausalLM`; mrope is plain rope on text and becomes `rope_scaling: null`. No surgery.

use serde_json::Value;

use super::plan::{DropKind, ExtractPlan};
use super::prefix::{self, PrefixLayout};
use super::{model_type_and_arch, Family, Target};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Qwen2Vl;

/// Shared with Qwen2.5-VL, whose language-model layout is identical
/// (docs/reference/vlm-layouts.md#qwen25-vl).
pub static LAYOUT: PrefixLayout = PrefixLayout {
    lm: &[("model.language_model.", "model."), ("model.", "model.")],
    heads: &["lm_head.weight"],
    drop: &[
        ("visual.merger.", DropKind::Projector),
        ("visual.", DropKind::Vision),
        ("model.visual.merger.", DropKind::Projector),
        ("model.visual.", DropKind::Vision),
    ],
};

/// Plan a Qwen2-VL-layout checkpoint whose text config class is `text_type`.
pub fn plan_qwen_vl(
    ckpt: &Checkpoint,
    family: &'static str,
    text_type: &str,
) -> Result<ExtractPlan> {
    let (mut fields, key) = prefix::text_fields(&ckpt.config, None);
    if key.is_none() {
        // Flat Hub config: the VLM builds its text config from these keys with the text class's defaults.
        fields.insert("model_type".into(), Value::String(text_type.into()));
    }
    let tie = prefix::tie_flag(&ckpt.config, key)?;
    prefix::plan(ckpt, family, &LAYOUT, Target::Qwen2, &fields, tie)
}

impl Family for Qwen2Vl {
    fn name(&self) -> &'static str {
        "qwen2-vl"
    }

    fn help(&self) -> &'static str {
        "Qwen2-VL -> Qwen2ForCausalLM; `model.*` + `visual.*` (Hub) or `model.language_model.*`; flat or nested config"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        model_type == "qwen2_vl" || arch == "Qwen2VLForConditionalGeneration"
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        plan_qwen_vl(ckpt, self.name(), "qwen2_vl_text")
    }
}
