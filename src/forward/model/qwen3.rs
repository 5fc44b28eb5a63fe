//! Qwen3 (`Qwen3ForCausalLM`, transformers `models/qwen3`): Qwen2's layer with per-head RMSNorm
//! on q and k (weights `[head_dim]`, applied before RoPE), an explicit `head_dim` (128 by
//! default, not `hidden/heads`), and bias on q/k/v/o only when `attention_bias` is true (the
//! `inject-qknorm` output has it). Also the language model of Qwen3-VL.

use super::{Architecture, DecoderSpec};
use crate::arch::config::TextConfig;
use crate::arch::QkNorm;
use crate::error::Result;

pub const ARCH: Architecture = Architecture {
    model_type: "qwen3",
    class: "Qwen3ForCausalLM",
    build,
};

fn build(cfg: &TextConfig) -> Result<DecoderSpec> {
    Ok(DecoderSpec {
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm: QkNorm::PerHead,
        ..DecoderSpec::base(cfg)?
    })
}
