//! The standalone causal-LM config an extraction writes (docs/reference/vlm-layouts.md#configs).
//!
//! Every architectural field is written explicitly, because VLM text configs are diffs against
//! their own class defaults, which differ from the target class's (Qwen2VLTextConfig vs Qwen2Config
//! eps and theta, Qwen3VLMoeTextConfig vs Qwen3MoeConfig `norm_topk_prob`). Rope is written in the
//! 4.x spelling (`rope_theta`, `rope_scaling`), which transformers 4.x and 5.x both read; multimodal
//! rope becomes `rope_scaling: null` (it equals plain rope on text). Vision and processor keys are
//! never copied: the config is built field by field, not filtered.

use serde_json::{json, Map, Value};

use crate::arch::config::{LayerType, RopeScaling, TextConfig};
use crate::bail;
use crate::error::Result;

/// The causal-LM classes extraction targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Llama,
    Mistral,
    Olmo3,
    Olmoe,
}

impl Target {
    pub fn architecture(self) -> &'static str {
        match self {
            Target::Qwen2 => "Qwen2ForCausalLM",
            Target::Qwen3 => "Qwen3ForCausalLM",
            Target::Qwen3Moe => "Qwen3MoeForCausalLM",
            Target::Llama => "LlamaForCausalLM",
            Target::Mistral => "MistralForCausalLM",
            Target::Olmo3 => "Olmo3ForCausalLM",
            Target::Olmoe => "OlmoeForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Target::Qwen2 => "qwen2",
            Target::Qwen3 => "qwen3",
            Target::Qwen3Moe => "qwen3_moe",
            Target::Llama => "llama",
            Target::Mistral => "mistral",
            Target::Olmo3 => "olmo3",
            Target::Olmoe => "olmoe",
        }
    }

    const ALL: [Target; 7] = [
        Target::Qwen2,
        Target::Qwen3,
        Target::Qwen3Moe,
        Target::Llama,
        Target::Mistral,
        Target::Olmo3,
        Target::Olmoe,
    ];

    /// The target for a language model's `model_type` (after mapping VLM text types).
    pub fn from_model_type(model_type: &str) -> Option<Target> {
        let lm = crate::arch::config::lm_type(model_type);
        Target::ALL.into_iter().find(|t| t.model_type() == lm)
    }

    /// The target for a `*ForCausalLM` class name (InternVL's `llm_config.architectures`).
    pub fn from_architecture(architecture: &str) -> Option<Target> {
        Target::ALL
            .into_iter()
            .find(|t| t.architecture() == architecture)
    }
}

/// Build the standalone config for `target` from the language model's fields. `fields` holds the
/// text config in Hugging Face causal-LM naming, with `model_type` naming the class whose defaults
/// fill omitted keys (a VLM text type such as `qwen2_vl_text` where the VLM's defaults differ);
/// `top` is the whole VLM config (token ids and dtype may sit there); `dtype` is used when no
/// config states one. `tie_word_embeddings` is left for the tie rule to set.
pub fn standalone_config(
    target: Target,
    fields: &Map<String, Value>,
    top: &Value,
    dtype: Option<&str>,
) -> Result<Value> {
    let c = TextConfig::from_text_section(fields, top)?;
    if c.model_type != target.model_type() {
        return Err(crate::internal!(
            "internal: a `{}` text config cannot become {}",
            c.model_type,
            target.architecture()
        ));
    }
    let mut out = Map::new();
    let mut put = |k: &str, v: Value| {
        out.insert(k.to_string(), v);
    };
    put("architectures", json!([target.architecture()]));
    put("model_type", json!(target.model_type()));
    put("vocab_size", json!(c.vocab_size));
    put("hidden_size", json!(c.hidden_size));
    put(
        "intermediate_size",
        json!(match (&c.moe, target) {
            (Some(m), Target::Olmoe) => m.expert_intermediate_size,
            _ => c.intermediate_size,
        }),
    );
    put("num_hidden_layers", json!(c.num_hidden_layers));
    put("num_attention_heads", json!(c.num_attention_heads));
    put("num_key_value_heads", json!(c.num_key_value_heads));
    if target == Target::Olmoe {
        if c.head_dim * c.num_attention_heads != c.hidden_size {
            bail!(
                "OLMoE derives head_dim from hidden_size / num_attention_heads ({}), but the source has head_dim {}",
                c.hidden_size / c.num_attention_heads.max(1),
                c.head_dim
            );
        }
    } else {
        put("head_dim", json!(c.head_dim));
    }
    put("hidden_act", json!(c.hidden_act));
    put("rms_norm_eps", json!(c.rms_norm_eps));
    put("max_position_embeddings", json!(c.max_position_embeddings));
    put("rope_theta", json!(c.rope.theta));
    let scaling = rope_scaling(fields, &c)?;
    put("rope_scaling", scaling.clone());
    match target {
        Target::Qwen2 | Target::Qwen3 | Target::Qwen3Moe => {
            let sliding = fields
                .get("use_sliding_window")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            put("use_sliding_window", json!(sliding));
            put("sliding_window", json!(c.sliding_window));
            put(
                "max_window_layers",
                fields
                    .get("max_window_layers")
                    .cloned()
                    .unwrap_or(json!(c.num_hidden_layers)),
            );
        }
        Target::Mistral => put("sliding_window", json!(c.sliding_window)),
        Target::Olmo3 => {
            let types: Vec<&str> = c
                .layer_types
                .iter()
                .map(|t| match t {
                    LayerType::FullAttention => "full_attention",
                    LayerType::SlidingAttention => "sliding_attention",
                })
                .collect();
            put("layer_types", json!(types));
            put("sliding_window", json!(c.sliding_window));
            // Also the nested 5.x form: a legacy `rope_theta` other than 500000 reaches only the
            // full-attention layers in transformers 5.x
            // (docs/reference/forward.md#olmo-3-rope-per-layer-type).
            let mut full = scaling
                .as_object()
                .cloned()
                .unwrap_or_else(|| Map::from_iter([("rope_type".to_string(), json!("default"))]));
            full.insert("rope_theta".into(), json!(c.rope.theta));
            put(
                "rope_parameters",
                json!({"full_attention": full,
                       "sliding_attention": {"rope_type": "default", "rope_theta": c.rope.theta}}),
            );
        }
        Target::Llama | Target::Olmoe => {}
    }
    if matches!(
        target,
        Target::Qwen3 | Target::Qwen3Moe | Target::Llama | Target::Olmo3 | Target::Olmoe
    ) {
        put("attention_bias", json!(c.attention_bias));
    }
    if target == Target::Llama {
        put("mlp_bias", json!(c.mlp_bias));
    }
    match (&c.moe, target) {
        (Some(m), Target::Qwen3Moe) => {
            put("num_experts", json!(m.num_experts));
            put("num_experts_per_tok", json!(m.num_experts_per_tok));
            put("moe_intermediate_size", json!(m.expert_intermediate_size));
            put("norm_topk_prob", json!(m.norm_topk_prob));
            put("decoder_sparse_step", json!(m.decoder_sparse_step));
            put("mlp_only_layers", json!(m.mlp_only_layers));
        }
        (Some(m), Target::Olmoe) => {
            put("num_experts", json!(m.num_experts));
            put("num_experts_per_tok", json!(m.num_experts_per_tok));
            put("norm_topk_prob", json!(m.norm_topk_prob));
            put("clip_qkv", json!(c.clip_qkv));
        }
        (None, Target::Qwen3Moe | Target::Olmoe) => {
            bail!(
                "{} needs a mixture-of-experts config (num_experts)",
                target.architecture()
            )
        }
        (Some(_), _) => bail!(
            "the language model has experts, which {} cannot hold",
            target.architecture()
        ),
        (None, _) => {}
    }
    put("tie_word_embeddings", json!(c.tie_word_embeddings));
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = fields.get(key).or_else(|| top.get(key)) {
            put(key, v.clone());
        }
    }
    if let Some(d) = c.dtype.as_deref().or(dtype) {
        put("torch_dtype", json!(d));
    }
    Ok(Value::Object(out))
}

/// The non-multimodal rope scaling as the source states it, without `rope_theta` (written on its
/// own); `null` for plain and multimodal rope.
fn rope_scaling(fields: &Map<String, Value>, c: &TextConfig) -> Result<Value> {
    if matches!(
        c.rope.scaling,
        RopeScaling::Default | RopeScaling::Mrope { .. }
    ) {
        return Ok(Value::Null);
    }
    let raw = match (fields.get("rope_scaling"), fields.get("rope_parameters")) {
        (Some(Value::Object(m)), _) => m,
        (_, Some(Value::Object(m))) if !m.contains_key("full_attention") => m,
        _ => bail!(
            "config ({}): rope scaling {:?} is not stated as a flat object",
            c.model_type,
            c.rope.scaling
        ),
    };
    let mut scaling = raw.clone();
    for key in ["rope_theta", "mrope_section", "mrope_interleaved"] {
        scaling.remove(key);
    }
    Ok(Value::Object(scaling))
}
