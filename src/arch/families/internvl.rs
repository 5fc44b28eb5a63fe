//! InternVL3 / InternVL3.5 (docs/reference/vlm-layouts.md#internvl). Two layouts:
//! * OpenGVLab remote code (`internvl_chat`): a stock causal LM under `language_model.` (head
//!   `language_model.lm_head`), InternViT under `vision_model.`, the projector `mlp1.*`; the full
//!   `llm_config` names the class (`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`,
//!   `LlamaForCausalLM`), which becomes the target. InternLM2-style language models (`wqkv`, UNVERIFIED
//!   for InternVL3-9B) are refused. InternVL3 and InternVL3.5 Qwen models get `eos_token_id` 151645
//!   as transformers' converter gives them ([`force_internvl3_eos`]).
//! * transformers `-hf` conversions (`internvl`): the llava-hf layout with a `text_config`. Their 5.x
//!   config class defaults `tie_word_embeddings` to true, so 5.x saves may hold no head (tie rule).

use serde_json::{json, Map, Value};

use super::llava_onevision::plan_llava_hf;
use super::plan::{DropKind, ExtractPlan};
use super::prefix::{self, PrefixLayout};
use super::{model_type_and_arch, Family, Target};
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct InternVl;

static REMOTE: PrefixLayout = PrefixLayout {
    lm: &[("language_model.model.", "model.")],
    heads: &["language_model.lm_head.weight"],
    drop: &[
        ("vision_model.", DropKind::Vision),
        ("mlp1.", DropKind::Projector),
    ],
};

static HF: PrefixLayout = PrefixLayout {
    lm: &[
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
    ],
    heads: &["language_model.lm_head.weight", "lm_head.weight"],
    drop: &[
        ("vision_tower.", DropKind::Vision),
        ("model.vision_tower.", DropKind::Vision),
        ("multi_modal_projector.", DropKind::Projector),
        ("model.multi_modal_projector.", DropKind::Projector),
    ],
};

const TARGETS: [Target; 4] = [
    Target::Qwen2,
    Target::Qwen3,
    Target::Qwen3Moe,
    Target::Llama,
];

impl Family for InternVl {
    fn name(&self) -> &'static str {
        "internvl"
    }

    fn help(&self) -> &'static str {
        "InternVL3/3.5 -> llm_config's class (Qwen2/Qwen3/Qwen3Moe/Llama); remote `language_model.*` + `llm_config`, or -hf `text_config`; InternVL3/3.5 Qwen eos forced to <|im_end|> as transformers does; InternLM2 refused"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        matches!(model_type, "internvl_chat" | "internvl")
            || matches!(
                arch,
                "InternVLChatModel" | "InternVLForConditionalGeneration"
            )
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        let Some(llm) = ckpt.config.get("llm_config") else {
            return plan_llava_hf(ckpt, self.name(), &HF, &TARGETS);
        };
        let class = llm
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("");
        if ckpt.names().iter().any(|n| n.contains(".attention.wqkv."))
            || class.starts_with("InternLM")
        {
            bail!(
                "{}: an InternLM2-style language model (`{class}`, fused `wqkv`); its grouped q/k/v split is UNVERIFIED and not supported",
                ckpt.label
            );
        }
        let target = Target::from_architecture(class)
            .filter(|t| TARGETS.contains(t))
            .ok_or_else(|| {
                crate::bad!(
                    "{}: llm_config.architectures names `{class}`; supported: {}",
                    ckpt.label,
                    TARGETS.map(|t| t.architecture()).join(", ")
                )
            })?;
        let (mut fields, key) = prefix::text_fields(&ckpt.config, None);
        let mut names = vec![ckpt.label.clone()];
        // The directory's own name and, in the HF cache, the repo's (`models--ORG--NAME`), not
        // every folder above it.
        for (i, part) in ckpt.dir.components().rev().take(3).enumerate() {
            let part = part.as_os_str().to_string_lossy();
            if i == 0 || part.starts_with("models--") {
                names.push(part.into_owned());
            }
        }
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let eos_note = force_internvl3_eos(&mut fields, &names, target);
        let tie = prefix::tie_flag(&ckpt.config, key);
        let mut plan = prefix::plan(ckpt, self.name(), &REMOTE, target, &fields, tie)?;
        plan.notes.extend(eos_note);
        Ok(plan)
    }
}

/// `<|im_end|>` in the Qwen2 tokenizer.
const INTERNVL3_EOS: u64 = 151645;

/// transformers' InternVL converter (`convert_internvl_weights_to_hf.py`, "Force correct eos_token_id
/// for InternVL3 and InternVL3.5") sets `eos_token_id` 151645 on the Qwen2, Qwen3 and Qwen3-MoE
/// language models of InternVL3 and InternVL3.5: InternVL3's `llm_config` names 151643
/// (`<|endoftext|>`), which ends no chat turn, so generation would run past the answer. The
/// converter decides by the repo name, and so does this, from how the model was named and the
/// directory's (and HF cache repo's) name (`names`). Returns the note to tell the user, if it
/// changed anything.
fn force_internvl3_eos(
    fields: &mut Map<String, Value>,
    names: &[&str],
    target: Target,
) -> Option<String> {
    let internvl3 = names
        .iter()
        .any(|n| n.to_ascii_lowercase().contains("internvl3"));
    let vocab = fields
        .get("vocab_size")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let qwen = matches!(target, Target::Qwen2 | Target::Qwen3 | Target::Qwen3Moe);
    if !qwen || !internvl3 || vocab <= INTERNVL3_EOS {
        return None;
    }
    let old = fields.get("eos_token_id").cloned().unwrap_or(Value::Null);
    if old == json!(INTERNVL3_EOS) {
        return None;
    }
    fields.insert("eos_token_id".into(), json!(INTERNVL3_EOS));
    Some(format!(
        "eos_token_id {old} -> {INTERNVL3_EOS} (<|im_end|>), as transformers' InternVL converter sets it for InternVL3 and InternVL3.5"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(eos: u64, vocab: u64) -> Map<String, Value> {
        let Value::Object(m) = json!({ "eos_token_id": eos, "vocab_size": vocab }) else {
            unreachable!()
        };
        m
    }

    #[test]
    fn internvl3_qwen_models_get_the_chat_eos() {
        let mut f = fields(151643, 151674);
        let note = force_internvl3_eos(
            &mut f,
            &["internvl3 (OpenGVLab/InternVL3-8B)"],
            Target::Qwen2,
        );
        assert!(note.unwrap().contains("151643 -> 151645"));
        assert_eq!(f["eos_token_id"], json!(151645));
        // Already right, or found by the directory: nothing to say, or the same change.
        assert_eq!(
            force_internvl3_eos(&mut f, &["x", "/m/InternVL3-2B"], Target::Qwen2),
            None
        );
        let mut f = fields(151643, 151674);
        assert!(force_internvl3_eos(&mut f, &["x", "/m/InternVL3-2B"], Target::Qwen2).is_some());
        // InternVL3.5 (Qwen3) too.
        let mut f = fields(151643, 151936);
        let names = ["OpenGVLab/InternVL3_5-8B"];
        assert!(force_internvl3_eos(&mut f, &names, Target::Qwen3).is_some());
        // Not InternVL3, not a Qwen (InternVL3-9B is Llama-like), or a vocabulary without it.
        for (names, target, vocab) in [
            (
                ["OpenGVLab/InternVL2_5-4B-MPO", "/m/a"],
                Target::Qwen2,
                151674,
            ),
            (["OpenGVLab/InternVL3-9B", "/m/b"], Target::Llama, 151936),
            (["tiny-internvl3", "/m/c"], Target::Qwen2, 512),
        ] {
            let mut f = fields(151643, vocab);
            assert_eq!(
                force_internvl3_eos(&mut f, &names, target),
                None,
                "{names:?}"
            );
            assert_eq!(f["eos_token_id"], json!(151643));
        }
    }
}
