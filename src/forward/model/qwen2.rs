//! Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`, transformers `models/qwen2`): pre-norm, q/k/v projections
//! with bias (hard-coded; the config's `attention_bias` is ignored), o without, no QK norm,
//! default RoPE (θ = 1e6 on the released models). Layers `i >= max_window_layers` slide only when
//! `use_sliding_window` is true (`layer_types` wins when present); Qwen2.5 ships it false.
//! Also the language model of Qwen2-VL / Qwen2.5-VL / LLaVA-OneVision / InternVL, whose
//! multimodal RoPE equals the default one on text.

use super::{Architecture, DecoderSpec};
use crate::arch::config::TextConfig;
use crate::error::Result;

pub const ARCH: Architecture = Architecture {
    model_type: "qwen2",
    class: "Qwen2ForCausalLM",
    build,
};

fn build(cfg: &TextConfig) -> Result<DecoderSpec> {
    Ok(DecoderSpec {
        qkv_bias: true,
        ..DecoderSpec::base(cfg)?
    })
}
