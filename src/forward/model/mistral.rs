//! Mistral (`MistralForCausalLM`, transformers `models/mistral`): Llama's layer without any bias,
//! and one `sliding_window` for every layer when it is not null (v0.1: 4096; v0.2+: null; the
//! class default when the key is absent is 4096). `layer_types` is ignored, as transformers does.

use super::{Architecture, DecoderSpec};
use crate::arch::config::TextConfig;
use crate::error::Result;

pub const ARCH: Architecture = Architecture {
    model_type: "mistral",
    class: "MistralForCausalLM",
    build,
};

fn build(cfg: &TextConfig) -> Result<DecoderSpec> {
    Ok(DecoderSpec::base(cfg)?.with_uniform_window(cfg.sliding_window))
}
