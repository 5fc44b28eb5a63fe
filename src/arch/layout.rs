//! The tensors a Hugging Face causal LM loads, by name and shape, derived from its normalized
//! config: what an extracted (or merged) model must contain, nothing more. Follows the modules of
//! transformers' `*ForCausalLM` classes (docs/reference/forward.md#tensor-names).

use crate::arch::config::TextConfig;
use crate::bail;
use crate::error::Result;

/// Every tensor `model_type`'s `*ForCausalLM` loads for this config, in the order `save_pretrained`
/// writes them (embedding, layers, final norm, head).
pub fn expected_tensors(c: &TextConfig) -> Result<Vec<(String, Vec<usize>)>> {
    let kind = Kind::of(&c.model_type)?;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, h],
    )];
    for i in 0..c.num_hidden_layers {
        let mut add =
            |name: &str, shape: Vec<usize>| out.push((format!("model.layers.{i}.{name}"), shape));
        if kind.pre_norm() {
            add("input_layernorm.weight", vec![h]);
        }
        for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            add(&format!("self_attn.{proj}.weight"), vec![rows, h]);
            if kind == Kind::Qwen2 || (c.attention_bias && kind != Kind::Mistral) {
                add(&format!("self_attn.{proj}.bias"), vec![rows]);
            }
        }
        add("self_attn.o_proj.weight", vec![h, q]);
        if c.attention_bias && !matches!(kind, Kind::Qwen2 | Kind::Mistral) {
            add("self_attn.o_proj.bias", vec![h]);
        }
        match kind {
            Kind::Qwen3 | Kind::Qwen3Moe => {
                add("self_attn.q_norm.weight", vec![hd]);
                add("self_attn.k_norm.weight", vec![hd]);
            }
            Kind::Olmo2 | Kind::Olmoe => {
                add("self_attn.q_norm.weight", vec![q]);
                add("self_attn.k_norm.weight", vec![kv]);
            }
            Kind::Qwen2 | Kind::Llama | Kind::Mistral => {}
        }
        add("post_attention_layernorm.weight", vec![h]);
        let moe = c.moe.as_ref().filter(|m| match kind {
            Kind::Qwen3Moe => m.is_moe_layer(i),
            Kind::Olmoe => true,
            _ => false,
        });
        match moe {
            Some(m) => {
                let e_i = m.expert_intermediate_size;
                add("mlp.gate.weight", vec![m.num_experts, h]);
                for e in 0..m.num_experts {
                    add(&format!("mlp.experts.{e}.gate_proj.weight"), vec![e_i, h]);
                    add(&format!("mlp.experts.{e}.up_proj.weight"), vec![e_i, h]);
                    add(&format!("mlp.experts.{e}.down_proj.weight"), vec![h, e_i]);
                }
            }
            None => {
                let inter = c.intermediate_size;
                for (proj, shape) in [
                    ("gate_proj", vec![inter, h]),
                    ("up_proj", vec![inter, h]),
                    ("down_proj", vec![h, inter]),
                ] {
                    let bias = shape[0];
                    add(&format!("mlp.{proj}.weight"), shape);
                    if c.mlp_bias && kind == Kind::Llama {
                        add(&format!("mlp.{proj}.bias"), vec![bias]);
                    }
                }
            }
        }
        if kind == Kind::Olmo2 {
            add("post_feedforward_layernorm.weight", vec![h]);
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
    }
    Ok(out)
}

/// Architectures by the module differences that matter for tensor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// q/k/v always biased, o never (Qwen2Attention ignores `attention_bias`).
    Qwen2,
    /// Per-head q/k norms of `head_dim`.
    Qwen3,
    Qwen3Moe,
    Llama,
    /// No biases at all.
    Mistral,
    /// OLMo-2 and Olmo-3: post-norm, full-width q/k norms.
    Olmo2,
    /// Pre-norm, full-width q/k norms, every layer MoE.
    Olmoe,
}

impl Kind {
    fn of(model_type: &str) -> Result<Kind> {
        Ok(match model_type {
            "qwen2" => Kind::Qwen2,
            "qwen3" => Kind::Qwen3,
            "qwen3_moe" => Kind::Qwen3Moe,
            "llama" => Kind::Llama,
            "mistral" => Kind::Mistral,
            "olmo2" | "olmo3" => Kind::Olmo2,
            "olmoe" => Kind::Olmoe,
            other => bail!(
                "no tensor layout known for model_type `{other}` (known: qwen2, qwen3, qwen3_moe, llama, mistral, olmo2, olmo3, olmoe)"
            ),
        })
    }

    fn pre_norm(self) -> bool {
        self != Kind::Olmo2
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(v: serde_json::Value) -> TextConfig {
        TextConfig::from_model_config(&v).unwrap()
    }

    #[test]
    fn qwen2_has_qkv_biases_and_olmo3_is_post_norm() {
        let base = json!({"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
                          "tie_word_embeddings": true});
        let mut q = base.clone();
        q["model_type"] = json!("qwen2");
        let names: Vec<String> = expected_tensors(&cfg(q))
            .unwrap()
            .into_iter()
            .map(|x| x.0)
            .collect();
        assert!(names.contains(&"model.layers.0.self_attn.k_proj.bias".to_string()));
        assert!(!names
            .iter()
            .any(|n| n.contains("o_proj.bias") || n == "lm_head.weight"));
        let mut o = base;
        o["model_type"] = json!("olmo3");
        o["tie_word_embeddings"] = json!(false);
        let t = expected_tensors(&cfg(o)).unwrap();
        assert!(t
            .iter()
            .any(|(n, s)| n == "model.layers.0.self_attn.k_norm.weight" && s == &vec![8]));
        assert!(t
            .iter()
            .any(|(n, _)| n == "model.layers.0.post_feedforward_layernorm.weight"));
        assert!(!t.iter().any(|(n, _)| n.contains("input_layernorm")));
        assert_eq!(t.last().unwrap().0, "lm_head.weight");
    }

    #[test]
    fn qwen3_moe_layers_follow_mlp_only_layers() {
        let c = cfg(
            json!({"model_type": "qwen3_moe", "hidden_size": 16, "intermediate_size": 32,
                           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                           "head_dim": 8, "vocab_size": 10, "num_experts": 3, "num_experts_per_tok": 1,
                           "moe_intermediate_size": 4, "mlp_only_layers": [1]}),
        );
        let t = expected_tensors(&c).unwrap();
        assert!(t.iter().any(
            |(n, s)| n == "model.layers.0.mlp.experts.2.down_proj.weight" && s == &vec![16, 4]
        ));
        assert!(t
            .iter()
            .any(|(n, s)| n == "model.layers.1.mlp.down_proj.weight" && s == &vec![16, 32]));
        assert!(t
            .iter()
            .any(|(n, s)| n == "model.layers.0.self_attn.q_norm.weight" && s == &vec![8]));
    }
}
