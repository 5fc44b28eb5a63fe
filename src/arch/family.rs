//! Which VLM family a checkpoint belongs to, from its config (and tensor names where the config
//! is ambiguous). A plain causal LM has no family.

use serde_json::Value;

/// Every supported VLM family, by the name users pass to `--family`.
pub const FAMILIES: &[&str] = &[
    "qwen2-vl",
    "qwen2.5-vl",
    "qwen3-vl",
    "qwen3-vl-moe",
    "llava-onevision",
    "llava-next",
    "internvl",
    "idefics3",
    "ovis2",
    "minicpm-v",
    "molmo2",
    "molmoe",
];

/// Detect the VLM family of a checkpoint from its `config.json` and tensor names.
pub fn detect(config: &Value, tensor_names: &[String]) -> Option<&'static str> {
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    let architecture = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or("");
    let has_prefix = |p: &str| tensor_names.iter().any(|n| n.starts_with(p));
    Some(match model_type {
        "qwen2_vl" => "qwen2-vl",
        "qwen2_5_vl" => "qwen2.5-vl",
        "qwen3_vl" => "qwen3-vl",
        "qwen3_vl_moe" => "qwen3-vl-moe",
        "llava_onevision" | "llava_qwen" => "llava-onevision",
        "llava_next" => "llava-next",
        "internvl_chat" | "internvl" => "internvl",
        "idefics3" => "idefics3",
        "ovis" | "ovis2" => "ovis2",
        "minicpmv" => "minicpm-v",
        "molmo2" => "molmo2",
        "molmo"
            if config.get("moe_num_experts").is_some()
                || has_prefix("model.transformer.blocks.0.ffn") =>
        {
            "molmoe"
        }
        _ if architecture == "LlavaQwenForCausalLM" || config.get("mm_vision_tower").is_some() => {
            "llava-onevision"
        }
        _ if architecture.starts_with("Molmo2") => "molmo2",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detects_by_model_type_and_markers() {
        assert_eq!(
            detect(&json!({"model_type": "qwen2_5_vl"}), &[]),
            Some("qwen2.5-vl")
        );
        assert_eq!(
            detect(
                &json!({"model_type": "llava", "mm_vision_tower": "siglip"}),
                &[]
            ),
            Some("llava-onevision")
        );
        assert_eq!(detect(&json!({"model_type": "qwen2"}), &[]), None);
    }
}
