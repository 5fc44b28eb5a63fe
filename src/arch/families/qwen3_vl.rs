//! Qwen3-VL dense (Qwen/Qwen3-VL-{2B,4B,8B,32B}; docs/reference/vlm-layouts.md#qwen3-vl): a Qwen3
//! language model (per-head q_norm/k_norm kept) under `model.language_model.`, vision and deepstack
//! mergers under `model.visual.`. Target `Qwen3ForCausalLM`; interleaved mrope is plain rope on
//! text.

use serde_json::Value;

use super::plan::{DropKind, ExtractPlan};
use super::prefix::{self, PrefixLayout};
use super::{model_type_and_arch, Family, Target};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Qwen3Vl;

/// Shared with Qwen3-VL-MoE (docs/reference/vlm-layouts.md#qwen3-vl-moe: same prefixes).
pub static LAYOUT: PrefixLayout = PrefixLayout {
    lm: &[("model.language_model.", "model.")],
    heads: &["lm_head.weight"],
    drop: &[
        ("model.visual.merger.", DropKind::Projector),
        ("model.visual.deepstack_merger_list.", DropKind::Projector),
        ("model.visual.", DropKind::Vision),
    ],
};

impl Family for Qwen3Vl {
    fn name(&self) -> &'static str {
        "qwen3-vl"
    }

    fn help(&self) -> &'static str {
        "Qwen3-VL (dense) -> Qwen3ForCausalLM; `model.language_model.*` + `model.visual.*`"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        model_type == "qwen3_vl" || arch == "Qwen3VLForConditionalGeneration"
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        let (fields, key) = prefix::text_fields(&ckpt.config, None);
        let tie = prefix::tie_flag(&ckpt.config, key)?;
        prefix::plan(ckpt, self.name(), &LAYOUT, Target::Qwen3, &fields, tie)
    }
}
