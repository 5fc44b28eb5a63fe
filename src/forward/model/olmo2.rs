//! OLMo-2 (`Olmo2ForCausalLM`, transformers `models/olmo2`): post-norm (no `input_layernorm`;
//! `post_attention_layernorm` on the attention output and `post_feedforward_layernorm` on the
//! MLP output, each before the residual add), layerwise RMSNorm on the whole q and k projections
//! (`[heads * head_dim]`, `[kv_heads * head_dim]`), bias on q/k/v/o when `attention_bias`,
//! no sliding window. In f32 its RMSNorm rounding and f32 cos/sin equal the Llama-style ones.

use super::{Architecture, DecoderSpec, NormPlacement};
use crate::arch::config::TextConfig;
use crate::arch::QkNorm;
use crate::error::Result;
use crate::forward::precision::Bf16Style;

pub const ARCH: Architecture = Architecture {
    model_type: "olmo2",
    class: "Olmo2ForCausalLM",
    build,
};

fn build(cfg: &TextConfig) -> Result<DecoderSpec> {
    Ok(DecoderSpec {
        norm_placement: NormPlacement::PostNorm,
        bf16_style: Bf16Style::Olmo,
        qk_norm: QkNorm::Layerwise,
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        ..DecoderSpec::base(cfg)?
    }
    .with_uniform_window(None))
}
