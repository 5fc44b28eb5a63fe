//! Idefics3 (HuggingFaceM4/Idefics3-8B-Llama3; docs/reference/vlm-layouts.md#idefics3): a Llama
//! language model under `model.text_model.`, SigLIP under `model.vision_model.`, the connector
//! under `model.connector.`; `text_config` of type llama, Llama-3.1 rope scaling kept as is. No
//! surgery.

use serde_json::Value;

use super::plan::{DropKind, ExtractPlan};
use super::prefix::{self, PrefixLayout};
use super::{model_type_and_arch, Family, Target};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Idefics3;

static LAYOUT: PrefixLayout = PrefixLayout {
    lm: &[("model.text_model.", "model.")],
    heads: &["lm_head.weight"],
    drop: &[
        ("model.vision_model.", DropKind::Vision),
        ("model.connector.", DropKind::Projector),
    ],
};

impl Family for Idefics3 {
    fn name(&self) -> &'static str {
        "idefics3"
    }

    fn help(&self) -> &'static str {
        "Idefics3 -> LlamaForCausalLM; `model.text_model.*`"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        model_type == "idefics3" || arch == "Idefics3ForConditionalGeneration"
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        let (fields, key) = prefix::text_fields(&ckpt.config, None);
        let tie = prefix::tie_flag(&ckpt.config, key)?;
        prefix::plan(ckpt, self.name(), &LAYOUT, Target::Llama, &fields, tie)
    }
}
