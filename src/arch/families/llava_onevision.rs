//! LLaVA-OneVision (docs/reference/vlm-layouts.md#llava-onevision). Two layouts of a Qwen2 language
//! model:
//! * lmms-lab originals (`LlavaQwenForCausalLM`, flat Qwen2 config plus `mm_*` keys): the language
//!   model under `model.` beside `model.vision_tower.*`, `model.mm_projector.*` and
//!   `model.image_newline`; `lm_head` may be absent (tied). The class forces `rope_scaling = None`.
//!   The Hub `model_type` (`llava` or `llava_qwen`) is UNVERIFIED, so detection also accepts the
//!   architecture name and `mm_vision_tower`.
//! * llava-hf conversions (`text_config` of type qwen2): `language_model.model.*` (or
//!   `model.language_model.*`), head `language_model.lm_head` (or `lm_head`), `vision_tower.*`,
//!   `multi_modal_projector.*`, `image_newline`. The resized vocabulary is kept.

use serde_json::Value;

use super::plan::{DropKind, ExtractPlan};
use super::prefix::{self, PrefixLayout};
use super::{model_type_and_arch, Family, Target};
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct LlavaOnevision;

static LMMS: PrefixLayout = PrefixLayout {
    lm: &[("model.", "model.")],
    heads: &["lm_head.weight"],
    drop: &[
        ("model.vision_tower.", DropKind::Vision),
        ("model.vision_resampler.", DropKind::Projector),
        ("model.mm_projector.", DropKind::Projector),
        ("model.image_newline", DropKind::Other),
    ],
};

/// The llava-hf layout, shared with LLaVA-NeXT and InternVL-hf
/// (docs/reference/vlm-layouts.md#llava-onevision, layout b).
pub static LLAVA_HF: PrefixLayout = PrefixLayout {
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
        ("image_newline", DropKind::Other),
        ("model.image_newline", DropKind::Other),
    ],
};

/// Plan a llava-hf-style checkpoint (text model under `text_config`), choosing the target from the
/// text model type among `allowed`.
pub fn plan_llava_hf(
    ckpt: &Checkpoint,
    family: &'static str,
    layout: &'static PrefixLayout,
    allowed: &[Target],
) -> Result<ExtractPlan> {
    let (fields, key) = prefix::text_fields(&ckpt.config, None);
    if key != Some("text_config") {
        bail!(
            "{}: a {family} checkpoint in the Hugging Face layout needs a `text_config` in config.json",
            ckpt.label
        );
    }
    let text_type = fields
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    let target = Target::from_model_type(text_type)
        .filter(|t| allowed.contains(t))
        .ok_or_else(|| {
            crate::bad!(
                "{}: {family} with a `{text_type}` language model is not supported (supported: {})",
                ckpt.label,
                allowed
                    .iter()
                    .map(|t| t.model_type())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
    let tie = prefix::tie_flag(&ckpt.config, key)?;
    prefix::plan(ckpt, family, layout, target, &fields, tie)
}

impl Family for LlavaOnevision {
    fn name(&self) -> &'static str {
        "llava-onevision"
    }

    fn help(&self) -> &'static str {
        "LLaVA-OneVision -> Qwen2ForCausalLM; lmms-lab `model.*` + `model.mm_projector.*` (Hub model_type UNVERIFIED) or llava-hf `language_model.*`"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        matches!(model_type, "llava_onevision" | "llava_qwen")
            || arch == "LlavaQwenForCausalLM"
            || (model_type == "llava" && config.get("mm_vision_tower").is_some())
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        if ckpt.config.get("text_config").is_some() {
            return plan_llava_hf(ckpt, self.name(), &LLAVA_HF, &[Target::Qwen2]);
        }
        let (mut fields, key) = prefix::text_fields(&ckpt.config, Some("qwen2"));
        // LlavaQwenForCausalLM.__init__ sets config.rope_scaling = None.
        fields.insert("rope_scaling".into(), Value::Null);
        let tie = prefix::tie_flag(&ckpt.config, key)?;
        prefix::plan(ckpt, self.name(), &LMMS, Target::Qwen2, &fields, tie)
    }
}
