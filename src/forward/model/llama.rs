//! Llama 2 / 3.x (`LlamaForCausalLM`, transformers `models/llama`): pre-norm, bias on q/k/v/o
//! when `attention_bias` and on gate/up/down when `mlp_bias`, no QK norm, no sliding window.
//! RoPE from the config: default, linear, dynamic, or llama3 scaling (Llama-3.1/3.2). Also the
//! language model of Idefics3.

use super::{Architecture, DecoderSpec};
use crate::arch::config::TextConfig;
use crate::error::Result;

pub const ARCH: Architecture = Architecture {
    model_type: "llama",
    class: "LlamaForCausalLM",
    build,
};

fn build(cfg: &TextConfig) -> Result<DecoderSpec> {
    Ok(DecoderSpec {
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        mlp_bias: cfg.mlp_bias,
        ..DecoderSpec::base(cfg)?
    }
    .with_uniform_window(None))
}
