//! InternVL3 / InternVL3.5, extraction.md 2.7. Two layouts:
//! * OpenGVLab remote code (`internvl_chat`): a stock causal LM under `language_model.` (head
//!   `language_model.lm_head`), InternViT under `vision_model.`, the projector `mlp1.*`; the full
//!   `llm_config` names the class (`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`,
//!   `LlamaForCausalLM`), which becomes the target. InternLM2-style language models (`wqkv`, UNVERIFIED
//!   for InternVL3-9B) are refused.
//! * transformers `-hf` conversions (`internvl`): the llava-hf layout with a `text_config`. Their 5.x
//!   config class defaults `tie_word_embeddings` to true, so 5.x saves may hold no head (tie rule).

use serde_json::Value;

use super::llava_onevision::plan_llava_hf;
use super::plan::{DropKind, Plan};
use super::prefix::{self, PrefixLayout};
use super::{model_type_and_arch, Family, Target};
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct InternVl;

static REMOTE: PrefixLayout = PrefixLayout {
    lm: &[("language_model.model.", "model.")],
    heads: &["language_model.lm_head.weight"],
    drop: &[
        ("vision_model.", DropKind::Vision),
        ("mlp1.", DropKind::Projector),
    ],
};

static HF: PrefixLayout = PrefixLayout {
    lm: &[
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
    ],
    heads: &["language_model.lm_head.weight", "lm_head.weight"],
    drop: &[
        ("vision_tower.", DropKind::Vision),
        ("model.vision_tower.", DropKind::Vision),
        ("multi_modal_projector.", DropKind::Projector),
        ("model.multi_modal_projector.", DropKind::Projector),
    ],
};

const TARGETS: [Target; 4] = [
    Target::Qwen2,
    Target::Qwen3,
    Target::Qwen3Moe,
    Target::Llama,
];

impl Family for InternVl {
    fn name(&self) -> &'static str {
        "internvl"
    }

    fn help(&self) -> &'static str {
        "InternVL3/3.5 -> llm_config's class (Qwen2/Qwen3/Qwen3Moe/Llama); remote `language_model.*` + `llm_config`, or -hf `text_config`; InternLM2 refused"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        matches!(model_type, "internvl_chat" | "internvl")
            || matches!(
                arch,
                "InternVLChatModel" | "InternVLForConditionalGeneration"
            )
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<Plan> {
        let Some(llm) = ckpt.config.get("llm_config") else {
            return plan_llava_hf(ckpt, self.name(), &HF, &TARGETS);
        };
        let class = llm
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("");
        if ckpt.names().iter().any(|n| n.contains(".attention.wqkv."))
            || class.starts_with("InternLM")
        {
            bail!(
                "{}: an InternLM2-style language model (`{class}`, fused `wqkv`); its grouped q/k/v split is UNVERIFIED and not supported",
                ckpt.label
            );
        }
        let target = Target::from_architecture(class)
            .filter(|t| TARGETS.contains(t))
            .ok_or_else(|| {
                crate::bad!(
                    "{}: llm_config.architectures names `{class}`; supported: {}",
                    ckpt.label,
                    TARGETS.map(|t| t.architecture()).join(", ")
                )
            })?;
        let (fields, key) = prefix::text_fields(&ckpt.config, None);
        let tie = prefix::tie_flag(&ckpt.config, key);
        prefix::plan(ckpt, self.name(), &REMOTE, target, &fields, tie)
    }
}
