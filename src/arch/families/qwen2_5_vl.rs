//! Qwen2.5-VL (Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct; docs/reference/vlm-layouts.md#qwen25-vl):
//! the language-model layout, config schema and target of Qwen2-VL (both the legacy
//! `model.layers.*` + `visual.*` and the post-4.52 `model.language_model.*` layouts); only the
//! vision tower differs, and it is dropped.

use serde_json::Value;

use super::plan::ExtractPlan;
use super::qwen2_vl::plan_qwen_vl;
use super::{model_type_and_arch, Family};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Qwen25Vl;

impl Family for Qwen25Vl {
    fn name(&self) -> &'static str {
        "qwen2.5-vl"
    }

    fn help(&self) -> &'static str {
        "Qwen2.5-VL -> Qwen2ForCausalLM; legacy `model.layers.*` + `visual.*` or `model.language_model.*`"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        model_type == "qwen2_5_vl" || arch == "Qwen2_5_VLForConditionalGeneration"
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        plan_qwen_vl(ckpt, self.name(), "qwen2_5_vl_text")
    }
}
