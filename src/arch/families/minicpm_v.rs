//! MiniCPM-V-4.5 (openbmb/MiniCPM-V-4_5, remote `MiniCPMV`;
//! docs/reference/vlm-layouts.md#minicpm-v): a stock Qwen3ForCausalLM under `llm.` beside the
//! SigLIP-NaViT `vpm.*` and the `resampler.*`. The config is flat (MiniCPMVConfig subclasses the
//! Qwen3 config), so the Qwen3 fields are read at the top level and every other key is left behind.
//! UNVERIFIED: the complete list of extra config keys, and whether the tokenizer config names a
//! remote tokenizer class (if it does, it is rewritten to the stock `Qwen2TokenizerFast`).

use serde_json::Value;

use super::plan::{DropKind, ExtractPlan};
use super::prefix::{self, PrefixLayout};
use super::{model_type_and_arch, Family, Target};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct MiniCpmV;

static LAYOUT: PrefixLayout = PrefixLayout {
    lm: &[("llm.model.", "model.")],
    heads: &["llm.lm_head.weight"],
    drop: &[
        ("vpm.", DropKind::Vision),
        ("resampler.", DropKind::Projector),
    ],
};

impl Family for MiniCpmV {
    fn name(&self) -> &'static str {
        "minicpm-v"
    }

    fn help(&self) -> &'static str {
        "MiniCPM-V-4.5 -> Qwen3ForCausalLM; `llm.*` + `vpm.*` + `resampler.*`, flat config (extra keys and tokenizer UNVERIFIED)"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        model_type == "minicpmv" || arch == "MiniCPMV"
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        let (fields, key) = prefix::text_fields(&ckpt.config, Some("qwen3"));
        let tie = prefix::tie_flag(&ckpt.config, key)?;
        prefix::plan(ckpt, self.name(), &LAYOUT, Target::Qwen3, &fields, tie)
    }
}
