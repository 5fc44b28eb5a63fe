//! Olmo-3 (`Olmo3ForCausalLM`, transformers `models/olmo3`): OLMo-2's post-norm layer with
//! sliding-window layers from `layer_types` (default: 3 of every 4 slide, window 4096), and RoPE
//! per layer type: the configured rope (YaRN on the released 7B/32B) on full-attention layers only,
//! plain default RoPE with the same θ on sliding layers (transformers 5.23, OLMo-core; see
//! docs/reference/forward.md#olmo-3-rope-per-layer-type for the version trap).

use super::{Architecture, DecoderSpec, NormPlacement};
use crate::arch::config::TextConfig;
use crate::arch::QkNorm;
use crate::error::Result;
use crate::forward::precision::Bf16Style;

pub const ARCH: Architecture = Architecture {
    model_type: "olmo3",
    class: "Olmo3ForCausalLM",
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
    })
}
