//! OLMoE (`OlmoeForCausalLM`, transformers `models/olmoe`): pre-norm (unlike OLMo-2), layerwise
//! RMSNorm on the whole q (`[hidden]`) and k (`[kv_heads * head_dim]`) projections, then the
//! optional `clip_qkv` clamp of q, k and v, default RoPE, and a top-k routed MoE in every layer
//! (experts of `intermediate_size`; OLMoE-1B-7B: 64 experts, top 8, no renormalization).

use super::{Architecture, DecoderSpec, MoeSpec};
use crate::arch::config::TextConfig;
use crate::arch::QkNorm;
use crate::bail;
use crate::error::Result;

pub const ARCH: Architecture = Architecture {
    model_type: "olmoe",
    class: "OlmoeForCausalLM",
    build,
};

fn build(cfg: &TextConfig) -> Result<DecoderSpec> {
    let Some(moe) = &cfg.moe else {
        bail!("config (olmoe): num_experts is missing or zero");
    };
    let mut spec = DecoderSpec {
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm: QkNorm::Layerwise,
        clip_qkv: cfg.clip_qkv.map(|c| c as f32),
        moe: Some(MoeSpec {
            num_experts: moe.num_experts,
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
            expert_intermediate_size: moe.expert_intermediate_size,
        }),
        ..DecoderSpec::base(cfg)?
    }
    .with_uniform_window(None);
    for layer in &mut spec.layers {
        layer.moe = true;
    }
    Ok(spec)
}
