//! The tensor-name grammar of Hugging Face causal LMs.
//!
//! `model.layers.{i}.self_attn.q_proj.weight` parses to layer `i`, module `q_proj`, param
//! `weight`. Names outside the grammar (vision towers, unknown extras) parse to `None`, so callers
//! decide whether that is an error.

use std::fmt;

/// What a tensor is, independent of its layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Module {
    EmbedTokens,
    LmHead,
    FinalNorm,
    InputLayernorm,
    PostAttentionLayernorm,
    PreFeedforwardLayernorm,
    PostFeedforwardLayernorm,
    QProj,
    KProj,
    VProj,
    OProj,
    QNorm,
    KNorm,
    GateProj,
    UpProj,
    DownProj,
    /// MoE router (`mlp.gate.weight`, [E, H]).
    Router,
    /// One expert's projection (`mlp.experts.{e}.gate_proj.weight`).
    ExpertGateProj,
    ExpertUpProj,
    ExpertDownProj,
    /// Fused expert tensors of Qwen3-VL-MoE / transformers 5.x (`mlp.experts.gate_up_proj`).
    FusedExpertsGateUp,
    FusedExpertsDown,
}

impl Module {
    /// The short name users type in `--modules` and reports print (HF's attribute name).
    pub fn short_name(self) -> &'static str {
        use Module::*;
        match self {
            EmbedTokens => "embed_tokens",
            LmHead => "lm_head",
            FinalNorm => "norm",
            InputLayernorm => "input_layernorm",
            PostAttentionLayernorm => "post_attention_layernorm",
            PreFeedforwardLayernorm => "pre_feedforward_layernorm",
            PostFeedforwardLayernorm => "post_feedforward_layernorm",
            QProj => "q_proj",
            KProj => "k_proj",
            VProj => "v_proj",
            OProj => "o_proj",
            QNorm => "q_norm",
            KNorm => "k_norm",
            GateProj => "gate_proj",
            UpProj => "up_proj",
            DownProj => "down_proj",
            Router => "router",
            ExpertGateProj => "expert_gate_proj",
            ExpertUpProj => "expert_up_proj",
            ExpertDownProj => "expert_down_proj",
            FusedExpertsGateUp => "experts_gate_up_proj",
            FusedExpertsDown => "experts_down_proj",
        }
    }

    pub const ALL: [Module; 22] = {
        use Module::*;
        [
            EmbedTokens,
            LmHead,
            FinalNorm,
            InputLayernorm,
            PostAttentionLayernorm,
            PreFeedforwardLayernorm,
            PostFeedforwardLayernorm,
            QProj,
            KProj,
            VProj,
            OProj,
            QNorm,
            KNorm,
            GateProj,
            UpProj,
            DownProj,
            Router,
            ExpertGateProj,
            ExpertUpProj,
            ExpertDownProj,
            FusedExpertsGateUp,
            FusedExpertsDown,
        ]
    };

    pub fn from_short_name(s: &str) -> Option<Module> {
        Module::ALL.into_iter().find(|m| m.short_name() == s)
    }

    /// Attention projections (q/k/v/o).
    pub fn is_attention_projection(self) -> bool {
        matches!(
            self,
            Module::QProj | Module::KProj | Module::VProj | Module::OProj
        )
    }

    /// MLP projections, dense or per expert.
    pub fn is_mlp_projection(self) -> bool {
        use Module::*;
        matches!(
            self,
            GateProj
                | UpProj
                | DownProj
                | ExpertGateProj
                | ExpertUpProj
                | ExpertDownProj
                | FusedExpertsGateUp
                | FusedExpertsDown
        )
    }

    /// RMSNorm scales (including q/k norms).
    pub fn is_norm(self) -> bool {
        use Module::*;
        matches!(
            self,
            FinalNorm
                | InputLayernorm
                | PostAttentionLayernorm
                | PreFeedforwardLayernorm
                | PostFeedforwardLayernorm
                | QNorm
                | KNorm
        )
    }

    /// Token embedding or output head: rows indexed by vocabulary.
    pub fn is_vocab(self) -> bool {
        matches!(self, Module::EmbedTokens | Module::LmHead)
    }
}

impl fmt::Display for Module {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Param {
    Weight,
    Bias,
}

/// A parsed tensor name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorName {
    pub layer: Option<usize>,
    pub module: Module,
    pub expert: Option<usize>,
    pub param: Param,
}

/// Parse a standard causal-LM tensor name (`model.` prefix, `lm_head` at top level).
pub fn parse(name: &str) -> Option<TensorName> {
    let (stem, param) = if let Some(s) = name.strip_suffix(".weight") {
        (s, Param::Weight)
    } else if let Some(s) = name.strip_suffix(".bias") {
        (s, Param::Bias)
    } else {
        // Fused expert tensors carry no `.weight` suffix.
        let (layer, rest) = split_layer(name.strip_prefix("model.layers.")?)?;
        let module = match rest {
            "mlp.experts.gate_up_proj" => Module::FusedExpertsGateUp,
            "mlp.experts.down_proj" => Module::FusedExpertsDown,
            _ => return None,
        };
        return Some(TensorName {
            layer: Some(layer),
            module,
            expert: None,
            param: Param::Weight,
        });
    };
    let top = |module| {
        Some(TensorName {
            layer: None,
            module,
            expert: None,
            param,
        })
    };
    match stem {
        "model.embed_tokens" => return top(Module::EmbedTokens),
        "lm_head" => return top(Module::LmHead),
        "model.norm" => return top(Module::FinalNorm),
        _ => {}
    }
    let (layer, rest) = split_layer(stem.strip_prefix("model.layers.")?)?;
    if let Some(expert_rest) = rest.strip_prefix("mlp.experts.") {
        let (expert, proj) = split_layer(expert_rest)?;
        let module = match proj {
            "gate_proj" => Module::ExpertGateProj,
            "up_proj" => Module::ExpertUpProj,
            "down_proj" => Module::ExpertDownProj,
            _ => return None,
        };
        return Some(TensorName {
            layer: Some(layer),
            module,
            expert: Some(expert),
            param,
        });
    }
    let module = match rest {
        "self_attn.q_proj" => Module::QProj,
        "self_attn.k_proj" => Module::KProj,
        "self_attn.v_proj" => Module::VProj,
        "self_attn.o_proj" => Module::OProj,
        "self_attn.q_norm" => Module::QNorm,
        "self_attn.k_norm" => Module::KNorm,
        "mlp.gate_proj" => Module::GateProj,
        "mlp.up_proj" => Module::UpProj,
        "mlp.down_proj" => Module::DownProj,
        "mlp.gate" => Module::Router,
        "input_layernorm" => Module::InputLayernorm,
        "post_attention_layernorm" => Module::PostAttentionLayernorm,
        "pre_feedforward_layernorm" => Module::PreFeedforwardLayernorm,
        "post_feedforward_layernorm" => Module::PostFeedforwardLayernorm,
        _ => return None,
    };
    Some(TensorName {
        layer: Some(layer),
        module,
        expert: None,
        param,
    })
}

/// Build the standard name for a layer tensor.
pub fn layer_name(layer: usize, module: Module, param: Param) -> String {
    let path = match module {
        Module::QProj
        | Module::KProj
        | Module::VProj
        | Module::OProj
        | Module::QNorm
        | Module::KNorm => {
            format!("self_attn.{}", module.short_name())
        }
        Module::GateProj | Module::UpProj | Module::DownProj => {
            format!("mlp.{}", module.short_name())
        }
        Module::Router => "mlp.gate".to_string(),
        _ => module.short_name().to_string(),
    };
    let suffix = match param {
        Param::Weight => "weight",
        Param::Bias => "bias",
    };
    format!("model.layers.{layer}.{path}.{suffix}")
}

/// Split `"12.rest"` into `(12, "rest")`.
fn split_layer(s: &str) -> Option<(usize, &str)> {
    let (num, rest) = s.split_once('.')?;
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((num.parse().ok()?, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_standard_names() {
        let p = parse("model.layers.12.self_attn.q_proj.bias").unwrap();
        assert_eq!(
            (p.layer, p.module, p.param),
            (Some(12), Module::QProj, Param::Bias)
        );
        assert_eq!(
            parse("model.embed_tokens.weight").unwrap().module,
            Module::EmbedTokens
        );
        assert_eq!(parse("lm_head.weight").unwrap().module, Module::LmHead);
        assert_eq!(
            parse("model.norm.weight").unwrap().module,
            Module::FinalNorm
        );
        assert_eq!(
            parse("model.layers.0.self_attn.k_norm.weight")
                .unwrap()
                .module,
            Module::KNorm
        );
        assert_eq!(
            parse("model.layers.3.post_feedforward_layernorm.weight")
                .unwrap()
                .module,
            Module::PostFeedforwardLayernorm
        );
        let e = parse("model.layers.1.mlp.experts.17.down_proj.weight").unwrap();
        assert_eq!((e.module, e.expert), (Module::ExpertDownProj, Some(17)));
        assert_eq!(
            parse("model.layers.1.mlp.gate.weight").unwrap().module,
            Module::Router
        );
        assert_eq!(
            parse("model.layers.1.mlp.experts.gate_up_proj")
                .unwrap()
                .module,
            Module::FusedExpertsGateUp
        );
        assert!(parse("visual.blocks.0.attn.qkv.weight").is_none());
        assert!(parse("model.layers.x.self_attn.q_proj.weight").is_none());
    }

    #[test]
    fn names_round_trip() {
        for m in [
            Module::QProj,
            Module::KNorm,
            Module::DownProj,
            Module::Router,
            Module::InputLayernorm,
        ] {
            let n = layer_name(4, m, Param::Weight);
            let p = parse(&n).unwrap();
            assert_eq!((p.layer, p.module), (Some(4), m), "{n}");
            assert_eq!(Module::from_short_name(m.short_name()), Some(m));
        }
    }
}

/// Prefixes under which VLMs keep their language model, with the standard prefix each maps to.
/// Order matters: longer, more specific prefixes first.
const LM_PREFIXES: &[(&str, &str)] = &[
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),
    ("llm.model.", "model."),
    ("llm.lm_head.", "lm_head."),
];

/// The standard causal-LM name of a stored tensor, for the common VLM layouts that only prefix
/// the language model (`model.language_model.layers.0...` -> `model.layers.0...`). Names already
/// standard pass through; anything else (vision towers, projectors) gives `None`.
pub fn standard_name(stored: &str) -> Option<String> {
    for (from, to) in LM_PREFIXES {
        if let Some(rest) = stored.strip_prefix(from) {
            let name = format!("{to}{rest}");
            return parse(&name).map(|_| name);
        }
    }
    parse(stored).map(|_| stored.to_string())
}

#[cfg(test)]
mod prefix_tests {
    use super::*;

    #[test]
    fn vlm_prefixes_map_to_standard_names() {
        assert_eq!(
            standard_name("model.language_model.layers.0.mlp.up_proj.weight").as_deref(),
            Some("model.layers.0.mlp.up_proj.weight")
        );
        assert_eq!(
            standard_name("language_model.lm_head.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(
            standard_name("model.text_model.norm.weight").as_deref(),
            Some("model.norm.weight")
        );
        assert_eq!(standard_name("visual.blocks.0.norm1.weight"), None);
        assert_eq!(
            standard_name("model.layers.1.self_attn.q_proj.weight").as_deref(),
            Some("model.layers.1.self_attn.q_proj.weight")
        );
    }
}
