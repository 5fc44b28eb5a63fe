//! Model architecture knowledge: the tensor-name grammar, config normalization, the tensors each
//! causal-LM class loads, VLM families (detection and extraction plans) and the QK-norm class.

pub mod config;
pub mod families;
pub mod family;
pub mod layer_list;
pub mod layout;
pub mod names;

use serde::{Deserialize, Serialize};

pub use config::TextConfig;
pub use layer_list::LayerList;
pub use names::{Module, Param, TensorName};

/// How an architecture normalizes queries and keys before RoPE (the paper's central switch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QkNorm {
    /// RMSNorm over each head's `head_dim` (Qwen3, Qwen3-MoE, Gemma-3).
    PerHead,
    /// RMSNorm over the whole projection `num_heads * head_dim` (OLMo-2/3, OLMoE).
    Layerwise,
    None,
}

impl QkNorm {
    pub fn as_str(self) -> &'static str {
        match self {
            QkNorm::PerHead => "per-head",
            QkNorm::Layerwise => "layerwise",
            QkNorm::None => "none",
        }
    }

    /// Classify from the length of a layer's q_norm weight (None when there is none) and the
    /// text config. A q_norm of `head_dim` entries is per-head; one covering all heads is layerwise.
    pub fn classify(q_norm_len: Option<usize>, config: Option<&TextConfig>) -> QkNorm {
        let Some(len) = q_norm_len else {
            return QkNorm::None;
        };
        match config {
            Some(c) if len == c.head_dim && c.num_attention_heads > 1 => QkNorm::PerHead,
            Some(c) if len == c.head_dim => {
                if matches!(c.model_type.as_str(), "olmo2" | "olmo3" | "olmoe") {
                    QkNorm::Layerwise
                } else {
                    QkNorm::PerHead
                }
            }
            Some(_) => QkNorm::Layerwise,
            // Without a usable config: per-head norms are short (head_dim <= 256).
            None if len <= 256 => QkNorm::PerHead,
            None => QkNorm::Layerwise,
        }
    }
}
