//! Decoder architectures the scorer runs, one file each, all on one small skeleton.
//!
//! Every supported architecture is a set of switches over the same pre-norm (or OLMo post-norm)
//! decoder layer: which projections carry a bias, which QK norm, clipping, which layers slide,
//! which RoPE each layer uses, dense MLP or top-k MoE. Each file turns the normalized
//! [`TextConfig`] into a [`DecoderSpec`] the way its transformers class reads its config
//! (docs/reference/forward.md#step-list-one-model-f32); [`crate::forward::decoder`] runs the spec.
//! Weight names mirror Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`, ...).

pub mod llama;
pub mod mistral;
pub mod olmo2;
pub mod olmo3;
pub mod olmoe;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_moe;

use serde::Serialize;
use serde_json::Value;

use crate::arch::config::{LayerType, Rope, RopeScaling, TextConfig};
use crate::arch::QkNorm;
use crate::bail;
use crate::error::Result;
use crate::forward::activation::Activation;
use crate::forward::precision::Bf16Style;

/// One supported architecture: the `model_type` it answers to and how it reads its config.
pub struct Architecture {
    pub model_type: &'static str,
    /// The transformers class, for messages and docs.
    pub class: &'static str,
    pub build: fn(&TextConfig) -> Result<DecoderSpec>,
}

/// Every architecture the scorer runs.
pub const ARCHITECTURES: &[Architecture] = &[
    qwen2::ARCH,
    qwen3::ARCH,
    llama::ARCH,
    mistral::ARCH,
    olmo2::ARCH,
    olmo3::ARCH,
    qwen3_moe::ARCH,
    olmoe::ARCH,
];

/// `"qwen2 (Qwen2ForCausalLM), qwen3 (...), ..."` for error messages.
pub fn supported_list() -> String {
    ARCHITECTURES
        .iter()
        .map(|a| format!("{} ({})", a.model_type, a.class))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where the RMSNorms sit around each block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NormPlacement {
    /// `x + Attn(N_in(x))`, then `x + MLP(N_post_attn(x))` (Qwen, Llama, Mistral, OLMoE).
    PreNorm,
    /// `x + N_post_attn(Attn(x))`, then `x + N_post_ff(MLP(x))` (OLMo-2, Olmo-3).
    PostNorm,
}

/// Top-k routed experts (docs/reference/forward.md#moe-routing).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub expert_intermediate_size: usize,
}

/// One layer's switches.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerSpec {
    /// Keys a query sees in a sliding-window layer (including itself); `None` = full causal.
    pub window: Option<usize>,
    pub rope: Rope,
    /// Sparse MoE block instead of the dense MLP.
    pub moe: bool,
}

/// Everything the forward pass needs to know about a model, resolved from its config.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecoderSpec {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// The MLP's activation, `ACT2FN[hidden_act]` as every supported class builds it.
    pub hidden_act: Activation,
    pub norm_placement: NormPlacement,
    /// Bias on q, k and v.
    pub qkv_bias: bool,
    /// Bias on o.
    pub o_bias: bool,
    /// Bias on the dense MLP's gate, up and down projections.
    pub mlp_bias: bool,
    pub qk_norm: QkNorm,
    /// Clamp q, k, v to `[-c, c]` after the QK norm (OLMoE).
    pub clip_qkv: Option<f32>,
    pub moe: Option<MoeSpec>,
    /// Where the bf16 path rounds inside RMSNorm and RoPE.
    pub bf16_style: Bf16Style,
    pub layers: Vec<LayerSpec>,
}

impl DecoderSpec {
    /// The plain pre-norm decoder of `cfg`: no biases, no QK norm, dense MLP, the config's
    /// sliding layers (`layer_types` with `sliding_window`) and per-layer-type RoPE.
    /// Architecture files start from this and flip their switches. A `hidden_act` that
    /// transformers' `ACT2FN` does not define without learned parameters is an error.
    pub fn base(cfg: &TextConfig) -> Result<DecoderSpec> {
        let Some(hidden_act) = Activation::from_hf(&cfg.hidden_act) else {
            bail!(
                "config ({}): `hidden_act` \"{}\" is not an activation sinkmerge runs \
                 (transformers' ACT2FN without learned parameters: {})",
                cfg.model_type,
                cfg.hidden_act,
                Activation::NAMES
            );
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| LayerSpec {
                window: match cfg.layer_types.get(i) {
                    Some(LayerType::SlidingAttention) => cfg.sliding_window,
                    _ => None,
                },
                rope: cfg.rope_for_layer(i).clone(),
                moe: false,
            })
            .collect();
        Ok(DecoderSpec {
            model_type: cfg.model_type.clone(),
            vocab_size: cfg.vocab_size,
            hidden_size: cfg.hidden_size,
            intermediate_size: cfg.intermediate_size,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            rms_norm_eps: cfg.rms_norm_eps as f32,
            max_position_embeddings: cfg.max_position_embeddings,
            tie_word_embeddings: cfg.tie_word_embeddings,
            hidden_act,
            norm_placement: NormPlacement::PreNorm,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: QkNorm::None,
            clip_qkv: None,
            moe: None,
            bf16_style: Bf16Style::Llama,
            layers,
        })
    }

    /// Every layer slides with `window` (or none slides when it is `None`).
    pub fn with_uniform_window(mut self, window: Option<usize>) -> DecoderSpec {
        for layer in &mut self.layers {
            layer.window = window;
        }
        self
    }

    /// Resolve the spec of a whole `config.json` (plain LM or VLM).
    pub fn from_model_config(config: &Value) -> Result<DecoderSpec> {
        let cfg = TextConfig::from_model_config(config)?;
        let Some(arch) = ARCHITECTURES
            .iter()
            .find(|a| a.model_type == cfg.model_type)
        else {
            let shown = if cfg.model_type.is_empty() {
                "no model_type".to_string()
            } else {
                format!("model_type `{}`", cfg.model_type)
            };
            bail!(
                "{shown} is not supported by the scorer; supported architectures: {}",
                supported_list()
            );
        };
        let spec = (arch.build)(&cfg)?;
        spec.check()?;
        Ok(spec)
    }

    fn check(&self) -> Result<()> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            bail!(
                "config ({}): head_dim {} must be even for RoPE",
                self.model_type,
                self.head_dim
            );
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            bail!(
                "config ({}): {} attention heads are not a multiple of {} key/value heads",
                self.model_type,
                self.num_heads,
                self.num_kv_heads
            );
        }
        // Checked here rather than when the tables are built, so that the error names the
        // config (crate::forward::rope supports the rope types and whole-head rotation only).
        for rope in self.layers.iter().map(|l| &l.rope) {
            if let RopeScaling::Other { name } = &rope.scaling {
                bail!(
                    "config ({}): rope type `{name}` is not supported (supported: default, \
                     linear, dynamic, llama3, yarn, mrope)",
                    self.model_type
                );
            }
            if rope.partial_rotary_factor != 1.0 {
                bail!(
                    "config ({}): partial_rotary_factor {} is not supported (the scorer's \
                     architectures rotate the whole head)",
                    self.model_type,
                    rope.partial_rotary_factor
                );
            }
        }
        if let Some(w) = self.layers.iter().find_map(|l| l.window.filter(|&w| w < 1)) {
            bail!(
                "config ({}): sliding_window {w} is too small",
                self.model_type
            );
        }
        Ok(())
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Whether sequences may run past `max_position_embeddings`: dynamic NTK RoPE exists to do
    /// so (it rescales for the sequence's length); every other rope does not.
    pub fn extends_context(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.rope.scaling, RopeScaling::Dynamic { .. }))
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unsupported_architecture_lists_the_supported_ones() {
        let err = DecoderSpec::from_model_config(&json!({
            "model_type": "gpt2", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "vocab_size": 10
        }))
        .unwrap_err()
        .to_string();
        assert!(err.contains("`gpt2`"), "{err}");
        for a in ARCHITECTURES {
            assert!(err.contains(a.model_type), "{err}");
        }
    }
}
