//! Qwen3-MoE (`Qwen3MoeForCausalLM`, transformers `models/qwen3_moe`): Qwen3's attention
//! (per-head QK norm, explicit `head_dim`) with a top-k routed MoE in layer `i` when
//! `i ∉ mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0` (else a dense MLP of
//! `intermediate_size`); experts of `moe_intermediate_size`, router weights renormalized when
//! `norm_topk_prob`. With `use_sliding_window`, every layer slides.

use super::{Architecture, DecoderSpec, MoeSpec};
use crate::arch::config::TextConfig;
use crate::arch::QkNorm;
use crate::bail;
use crate::error::Result;

pub const ARCH: Architecture = Architecture {
    model_type: "qwen3_moe",
    class: "Qwen3MoeForCausalLM",
    build,
};

fn build(cfg: &TextConfig) -> Result<DecoderSpec> {
    let Some(moe) = &cfg.moe else {
        bail!("config (qwen3_moe): num_experts is missing or zero");
    };
    let mut spec = DecoderSpec {
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm: QkNorm::PerHead,
        moe: Some(MoeSpec {
            num_experts: moe.num_experts,
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
            expert_intermediate_size: moe.expert_intermediate_size,
        }),
        ..DecoderSpec::base(cfg)?
    }
    .with_uniform_window(cfg.sliding_window);
    for (i, layer) in spec.layers.iter_mut().enumerate() {
        layer.moe = moe.is_moe_layer(i);
    }
    Ok(spec)
}
