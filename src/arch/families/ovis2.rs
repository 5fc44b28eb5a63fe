//! Ovis2 (AIDC-AI/Ovis2-*; docs/reference/vlm-layouts.md#ovis2), a Qwen2 language model in two
//! layouts:
//! * remote code (`ovis`): `llm.model.*`, head `llm.lm_head`, the AIMv2 visual tokenizer
//!   `visual_tokenizer.*` (its `head.*` is the projector) and the visual embedding table `vte`;
//!   the full `llm_config` holds the text config.
//! * transformers `-hf` conversions (`ovis2`): `model.language_model.*`, `lm_head`,
//!   `model.vision_tower.*`, `model.visual_embeddings_table`. The 5.x config class defaults
//!   `tie_word_embeddings` to true, so 5.x saves hold no head (tie rule).

use serde_json::Value;

use super::plan::{DropKind, ExtractPlan};
use super::prefix::{self, PrefixLayout};
use super::{model_type_and_arch, Family, Target};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Ovis2;

static REMOTE: PrefixLayout = PrefixLayout {
    lm: &[("llm.model.", "model.")],
    heads: &["llm.lm_head.weight"],
    drop: &[
        ("visual_tokenizer.head.", DropKind::Projector),
        ("visual_tokenizer.", DropKind::Vision),
        ("vte.", DropKind::Projector),
    ],
};

static HF: PrefixLayout = PrefixLayout {
    lm: &[("model.language_model.", "model.")],
    heads: &["lm_head.weight"],
    drop: &[
        ("model.vision_tower.head_", DropKind::Projector),
        ("model.vision_tower.", DropKind::Vision),
        ("model.visual_embeddings_table.", DropKind::Projector),
    ],
};

impl Family for Ovis2 {
    fn name(&self) -> &'static str {
        "ovis2"
    }

    fn help(&self) -> &'static str {
        "Ovis2 -> Qwen2ForCausalLM; remote `llm.*` + `visual_tokenizer.*` + `vte`, or -hf `model.language_model.*`"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        matches!(model_type, "ovis" | "ovis2")
            || matches!(arch, "Ovis" | "Ovis2ForConditionalGeneration")
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        let layout = if ckpt.config.get("llm_config").is_some() {
            &REMOTE
        } else {
            &HF
        };
        let (fields, key) = prefix::text_fields(&ckpt.config, None);
        let tie = prefix::tie_flag(&ckpt.config, key)?;
        prefix::plan(ckpt, self.name(), layout, Target::Qwen2, &fields, tie)
    }
}
