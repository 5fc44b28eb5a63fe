//! LLaVA-NeXT (llava-hf/llava-v1.6-*-hf; docs/reference/vlm-layouts.md#llava-next): the llava-hf
//! layout of LLaVA-OneVision around a Mistral (v1.6-mistral), Llama (vicuna, llama3) or Qwen2
//! language model, chosen from `text_config.model_type`. The resized vocabulary (32064 with
//! `<image>` and `<pad>`) is kept. No surgery.

use serde_json::Value;

use super::llava_onevision::{plan_llava_hf, LLAVA_HF};
use super::plan::ExtractPlan;
use super::{model_type_and_arch, Family, Target};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct LlavaNext;

impl Family for LlavaNext {
    fn name(&self) -> &'static str {
        "llava-next"
    }

    fn help(&self) -> &'static str {
        "LLaVA-NeXT -> MistralForCausalLM (or Llama/Qwen2 by text_config); llava-hf `language_model.*` or `model.language_model.*`"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        model_type == "llava_next" || arch == "LlavaNextForConditionalGeneration"
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        plan_llava_hf(
            ckpt,
            self.name(),
            &LLAVA_HF,
            &[Target::Mistral, Target::Llama, Target::Qwen2],
        )
    }
}
