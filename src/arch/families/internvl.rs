//! InternVL2.5 / InternVL3 / InternVL3.5 (docs/reference/vlm-layouts.md#internvl). Two layouts:
//! * OpenGVLab remote code (`internvl_chat`): a causal LM under `language_model.`, InternViT under
//!   `vision_model.`, the projector `mlp1.*`; the full `llm_config` names the class.
//!   - `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `LlamaForCausalLM`: a stock
//!     causal LM (head `language_model.lm_head`), which becomes the target. InternVL3 and
//!     InternVL3.5 Qwen models get `eos_token_id` 151645 as transformers' converter gives them
//!     ([`force_internvl3_eos`]).
//!   - `InternLM2ForCausalLM` (InternVL2.5-2B/8B/26B, InternVL3-9B): becomes `LlamaForCausalLM`
//!     as transformers' `internvl/convert_internvl_weights_to_hf.py` converts it: `tok_embeddings`,
//!     `attention.wo`, `feed_forward.w1/w3/w2`, `attention_norm`, `ffn_norm`, `output` are renamed,
//!     and the fused `attention.wqkv` is split per KV head, its rows being
//!     `[q × heads/kv_heads, k, v] × kv_heads` (`rearrange("(h gs d) z -> h gs d z")` there).
//! * transformers `-hf` conversions (`internvl`): the llava-hf layout with a `text_config`. Their 5.x
//!   config class defaults `tie_word_embeddings` to true, so 5.x saves may hold no head (tie rule).

use serde_json::{json, Map, Value};

use super::llava_onevision::{plan_llava_hf, LLAVA_HF};
use super::plan::{DropKind, ExtractPlan, PlanBuilder};
use super::prefix::{self, main_dtype, PrefixLayout};
use super::target::standalone_config;
use super::{model_type_and_arch, Family, Target};
use crate::arch::names;
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

/// The remote layout around an InternLM2 language model (`InternLM2ForCausalLM`: `model.*`, head
/// `output`).
static INTERNLM2: PrefixLayout = PrefixLayout {
    lm: &[("language_model.model.", "model.")],
    heads: &["language_model.output.weight"],
    drop: &[
        ("vision_model.", DropKind::Vision),
        ("mlp1.", DropKind::Projector),
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
        "InternVL2.5/3/3.5 -> llm_config's class (Qwen2/Qwen3/Qwen3Moe/Llama; InternLM2 -> Llama with wqkv split per KV head); remote `language_model.*` + `llm_config`, or -hf `text_config`; InternVL3/3.5 Qwen eos forced to <|im_end|> as transformers does"
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
            return plan_llava_hf(ckpt, self.name(), &LLAVA_HF, &TARGETS);
        };
        let class = llm
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("");
        if class.starts_with("InternLM") {
            return plan_internlm2(ckpt, self.name(), llm, class);
        }
        if ckpt.names().iter().any(|n| n.contains(".attention.wqkv.")) {
            bail!(
                "{}: fused `attention.wqkv` tensors (an InternLM2 language model), but llm_config.architectures names `{class}`",
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
        let tie = prefix::tie_flag(&ckpt.config, key)?;
        let mut plan = prefix::plan(ckpt, self.name(), &REMOTE, target, &fields, tie)?;
        plan.notes.extend(eos_note);
        Ok(plan)
    }
}

/// InternLM2 names (after `model.layers.{i}.`) and their Llama names, as transformers'
/// `internvl/convert_internvl_weights_to_hf.py` (`ORIGINAL_TO_CONVERTED_KEY_MAPPING_TEXT_LLAMA`)
/// renames them; `attention.wqkv` is split separately.
const INTERNLM2_RENAMES: [(&str, &str); 6] = [
    ("attention.wo.", "self_attn.o_proj."),
    ("feed_forward.w1.", "mlp.gate_proj."),
    ("feed_forward.w3.", "mlp.up_proj."),
    ("feed_forward.w2.", "mlp.down_proj."),
    ("attention_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
];

/// The Llama name of an InternLM2 tensor under `model.` (the `wqkv` split aside).
fn internlm2_standard(internlm2: &str) -> String {
    if internlm2 == "model.tok_embeddings.weight" {
        return "model.embed_tokens.weight".into();
    }
    let Some(rest) = internlm2.strip_prefix("model.layers.") else {
        return internlm2.to_string();
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return internlm2.to_string();
    };
    for (from, to) in INTERNLM2_RENAMES {
        if let Some(param) = tail.strip_prefix(from) {
            return format!("model.layers.{layer}.{to}{param}");
        }
    }
    internlm2.to_string()
}

/// The InternLM2 name of a Llama tensor under `model.`, for messages about a missing tensor.
fn internlm2_stored(standard: &str) -> String {
    if standard == "model.embed_tokens.weight" {
        return "language_model.model.tok_embeddings.weight".into();
    }
    let mut name = standard.to_string();
    for (from, to) in INTERNLM2_RENAMES {
        name = name.replace(&format!(".{to}"), &format!(".{from}"));
    }
    for x in ["q", "k", "v"] {
        name = name.replace(&format!(".self_attn.{x}_proj."), ".attention.wqkv.");
    }
    format!("language_model.{name}")
}

/// An InternLM2 language model (`llm_config` of `InternLM2ForCausalLM`) as `LlamaForCausalLM`, the
/// way transformers' InternVL converter turns it into a `LlamaConfig` and Llama weights.
fn plan_internlm2(
    ckpt: &Checkpoint,
    family: &'static str,
    llm: &Value,
    class: &str,
) -> Result<ExtractPlan> {
    let label = &ckpt.label;
    let Some(llm) = llm.as_object() else {
        bail!("{label}: llm_config is not an object");
    };
    let num = |k: &str| -> Result<usize> {
        llm.get(k)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| crate::bad!("{label}: llm_config.{k} is missing or not an integer"))
    };
    // `bias` puts a bias on wqkv and wo; the converter drops the key, so its LlamaConfig would not
    // hold them.
    if llm.get("bias").and_then(Value::as_bool) == Some(true) {
        bail!("{label}: llm_config.bias is true (biases on wqkv and wo); the InternLM2 -> Llama conversion supports bias-free models only");
    }
    let (hidden, heads) = (num("hidden_size")?, num("num_attention_heads")?);
    let kv_heads = num("num_key_value_heads").unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || hidden % heads != 0 {
        bail!("{label}: llm_config has hidden_size {hidden}, {heads} attention heads and {kv_heads} KV heads; InternLM2's grouped wqkv needs heads divisible by KV heads and hidden_size by heads");
    }
    let head_dim = hidden / heads;
    let groups = heads / kv_heads;
    // The converter builds `LlamaConfig(**llm_config)` minus its UNNECESSARY_CONFIG_KEYS.
    let mut fields = llm.clone();
    for k in [
        "architectures",
        "auto_map",
        "_name_or_path",
        "bias",
        "attn_implementation",
    ] {
        fields.remove(k);
    }
    fields.insert("model_type".into(), json!("llama"));
    fields.insert("head_dim".into(), json!(head_dim));
    fields.insert("attention_bias".into(), json!(false));
    fields.insert("mlp_bias".into(), json!(false));
    let mut b = PlanBuilder::new(ckpt, family);
    prefix::route_all(&mut b, &INTERNLM2, |b, stored, standard| {
        if standard.ends_with(".rotary_emb.inv_freq") {
            return Ok(false); // a non-persistent buffer; route_all drops it
        }
        let standard = internlm2_standard(standard);
        let Some(layer) = standard
            .strip_prefix("model.layers.")
            .and_then(|r| r.strip_suffix(".attention.wqkv.weight"))
        else {
            if names::parse(&standard).is_none() {
                bail!(
                    "{}: unknown tensor in the InternLM2 language model (it would be `{standard}`, which LlamaForCausalLM does not have)",
                    b.ckpt().describe(stored)
                );
            }
            b.keep(stored, standard)?;
            return Ok(true);
        };
        let name = |x: &str| format!("model.layers.{layer}.self_attn.{x}_proj.weight");
        b.split_grouped_rows(
            stored,
            kv_heads,
            &[
                (groups * head_dim, name("q")),
                (head_dim, name("k")),
                (head_dim, name("v")),
            ],
        )?;
        Ok(true)
    })?;
    b.set_stored_hint(|standard: &str| Some(internlm2_stored(standard)));
    b.note(format!(
        "{class} -> LlamaForCausalLM as transformers' InternVL converter does: attention.wqkv split per KV head ({kv_heads} KV heads, each [{groups} q heads, k, v])"
    ));
    let config = standalone_config(Target::Llama, &fields, &ckpt.config, main_dtype(ckpt))?;
    b.finish(
        Target::Llama,
        config,
        prefix::tie_flag(&ckpt.config, Some("llm_config"))?,
    )
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
    use crate::arch::families::plan::Piece;

    /// The element ranges of `source` that the plan reads, per output tensor.
    fn ranges_of(plan: &ExtractPlan, source: &str) -> Vec<(String, Vec<(usize, usize)>)> {
        plan.outputs
            .iter()
            .filter(|t| t.parts.iter().any(|p| p.source == source))
            .map(|t| {
                let r = t
                    .parts
                    .iter()
                    .map(|p| match p.piece {
                        Piece::Range { start, len } => (start, len),
                        ref other => panic!("{}: {other:?}", t.name),
                    })
                    .collect();
                (t.name.clone(), r)
            })
            .collect()
    }

    #[test]
    fn internlm2_wqkv_is_split_per_kv_head_and_covered_exactly_once() {
        // 4 heads, 2 KV heads, head_dim 4, hidden 16: per KV head [q q k v] × 4 rows × 16.
        let dir = std::path::Path::new("tests/fixtures/families/internvl-internlm2");
        let ckpt = Checkpoint::open_dir(dir, "internvl-internlm2").unwrap();
        let plan = InternVl.plan(&ckpt).unwrap();
        assert_eq!(plan.target, Target::Llama);
        let wqkv = "language_model.model.layers.1.attention.wqkv.weight";
        let got = ranges_of(&plan, wqkv);
        let row = 16;
        let block = |r: usize, n: usize| (r * row, n * row);
        let want = [
            ("q", vec![block(0, 8), block(16, 8)]),
            ("k", vec![block(8, 4), block(24, 4)]),
            ("v", vec![block(12, 4), block(28, 4)]),
        ];
        assert_eq!(got.len(), 3, "{got:?}");
        for ((name, ranges), (x, want)) in got.iter().zip(want) {
            assert_eq!(name, &format!("model.layers.1.self_attn.{x}_proj.weight"));
            assert_eq!(ranges, &want, "{name}");
        }
        // Every element of wqkv exactly once: the plan inverts.
        let mut all: Vec<(usize, usize)> = got.into_iter().flat_map(|(_, r)| r).collect();
        all.sort();
        let mut next = 0;
        for (start, len) in all {
            assert_eq!(start, next);
            next += len;
        }
        assert_eq!(next, ckpt.require(wqkv).unwrap().numel());
        // The other InternLM2 names become Llama's, the head is kept.
        for name in [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "lm_head.weight",
        ] {
            assert!(plan.outputs.iter().any(|t| t.name == name), "{name}");
        }
        assert_eq!(
            internlm2_stored("model.layers.3.self_attn.k_proj.weight"),
            "language_model.model.layers.3.attention.wqkv.weight"
        );
        assert_eq!(
            internlm2_stored("model.layers.3.mlp.up_proj.weight"),
            "language_model.model.layers.3.feed_forward.w3.weight"
        );
    }

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
