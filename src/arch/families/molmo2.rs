//! Molmo2 (allenai/Molmo2-*, remote code; native in transformers 5.x;
//! docs/reference/vlm-layouts.md#molmo2). The language model sits under `model.transformer.` with
//! fused projections:
//! * `self_attn.att_proj` [q | k | v] is split by rows into q/k/v;
//! * `mlp.ff_proj` is split in halves, **first half `up_proj`, second half `gate_proj`** (the remote
//!   code does `x, gate = chunk(2); act(gate) * x`);
//! * `attn_out` -> `o_proj`, `ff_out` -> `down_proj`, `ln_f` -> `norm`;
//! * the norms are renamed by position: post-norm models (`norm_after`, Molmo2-O on OLMo-3) put
//!   `attn_norm` after attention (`post_attention_layernorm`) and `ff_norm` after the MLP
//!   (`post_feedforward_layernorm`); pre-norm ones (Qwen3-based) use `input_layernorm` and
//!   `post_attention_layernorm`;
//! * `wte.embedding` holds the vocabulary, `wte.new_embedding` the image tokens (dropped). A
//!   transformers 5.x re-save splits their concatenation in two equal halves, so the embedding is
//!   taken as the first `vocab_size` rows of embedding ‖ new_embedding.
//!
//! Post-norm with full-width q/k norms targets `Olmo3ForCausalLM` with explicit `layer_types`:
//! Olmo-3 applies rope scaling only to full-attention layers, so layers outside
//! `rope_scaling_layers` become sliding layers whose window (`max_position_embeddings`) never masks.
//! Pre-norm with per-head q/k norms targets `Qwen3ForCausalLM`. Pre-norm without q/k norms but with
//! q/k/v biases (`qkv_bias`, the remote config's default: a Qwen2 language model) targets
//! `Qwen2ForCausalLM`; `att_proj.bias` is split q | k | v like the weight (`attn_out` has no bias in
//! the remote code, as in Qwen2). Other combinations are refused. The Molmo2-O-7B config values
//! themselves are UNVERIFIED, hence checked.

use serde_json::{json, Map, Value};

use super::plan::{DropKind, ExtractPlan, OutTensor, Part, Piece, PlanBuilder};
use super::prefix::{self, main_dtype};
use super::target::standalone_config;
use super::{model_type_and_arch, Family, Target};
use crate::arch::names::{layer_name, Module, Param};
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Molmo2;

/// Where allenai/molmo's `Molmo` keeps its language model, in Molmo2 and MolmoE alike.
pub(super) const LM: &str = "model.transformer.";

/// The layer and the rest of the name of a tensor under `model.transformer.blocks.{i}.` (`rest`
/// being its name after [`LM`]): the block naming of allenai/molmo's `Molmo`, which Molmo2 and
/// MolmoE share.
pub(super) fn block_layer(rest: &str) -> Option<(usize, &str)> {
    rest.strip_prefix("blocks.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(i, t)| Some((i.parse::<usize>().ok()?, t)))
}

/// What a tensor under `model.vision_backbone.` is: the vision tower (`image_vit.`) or the
/// projector around it, in Molmo2 and MolmoE alike; `None` for any other tensor.
pub(super) fn vision_part(name: &str) -> Option<DropKind> {
    let rest = name.strip_prefix("model.vision_backbone.")?;
    Some(if rest.starts_with("image_vit.") {
        DropKind::Vision
    } else {
        DropKind::Projector
    })
}

/// The error for a tensor `stored` under [`LM`] that no Molmo layout has; `layouts` says which
/// were tried.
pub(super) fn unknown_tensor(ckpt: &Checkpoint, stored: &str, layouts: &str) -> crate::Error {
    crate::bad!(
        "{}: unknown tensor under the language-model prefix `{LM}`; {layouts}",
        ckpt.describe(stored)
    )
}

impl Family for Molmo2 {
    fn name(&self) -> &'static str {
        "molmo2"
    }

    fn help(&self) -> &'static str {
        "Molmo2 -> Olmo3ForCausalLM (post-norm, olmo qk-norm; partial rope via layer_types), Qwen3ForCausalLM (pre-norm, qwen3 qk-norm) or Qwen2ForCausalLM (pre-norm, qkv bias); `model.transformer.*`, att_proj (weight and bias)/ff_proj split"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        model_type == "molmo2" || arch.starts_with("Molmo2")
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        let text = Text::read(ckpt)?;
        let mut b = PlanBuilder::new(ckpt, self.name());
        let mut embedding = None;
        let mut new_embedding = None;
        for name in ckpt.names() {
            if name == "lm_head.weight" {
                b.head(name)?;
            } else if let Some(kind) = vision_part(name) {
                b.drop(name, kind)?;
            } else if let Some(rest) = name.strip_prefix(LM) {
                match rest {
                    "wte.embedding" => embedding = Some(name.as_str()),
                    "wte.new_embedding" => new_embedding = Some(name.as_str()),
                    "ln_f.weight" => b.keep(name, "model.norm.weight".into())?,
                    _ => block_tensor(&mut b, &text, name, rest)?,
                }
            } else {
                bail!(
                    "{}: not part of the molmo2 layout (language model under `{LM}`, head `lm_head.weight`, vision under `model.vision_backbone.`)",
                    ckpt.describe(name)
                );
            }
        }
        let Some(embedding) = embedding else {
            bail!(
                "{}: language-model tensor `{LM}wte.embedding` is missing",
                ckpt.label
            );
        };
        embed(&mut b, &text, embedding, new_embedding)?;
        let config = standalone_config(text.target, &text.fields, &ckpt.config, main_dtype(ckpt))?;
        b.finish(text.target, config, text.tie)
    }
}

/// The Molmo2 text config, read under the remote-code names or the 5.x ones.
struct Text {
    target: Target,
    fields: Map<String, Value>,
    vocab: usize,
    q_rows: usize,
    kv_rows: usize,
    intermediate: usize,
    tie: Option<bool>,
}

impl Text {
    fn read(ckpt: &Checkpoint) -> Result<Text> {
        let Some(t) = ckpt.config.get("text_config").and_then(Value::as_object) else {
            bail!("{}: config.json has no `text_config`", ckpt.label);
        };
        let label = &ckpt.label;
        let get = |keys: &[&str]| keys.iter().find_map(|k| t.get(*k)).filter(|v| !v.is_null());
        let num = |keys: &[&str]| -> Result<usize> {
            get(keys)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    crate::bad!(
                        "{label}: text_config.{} is missing or not an integer",
                        keys[0]
                    )
                })
        };
        let hidden = num(&["hidden_size"])?;
        let heads = num(&["num_attention_heads"])?;
        let kv_heads = num(&["num_key_value_heads"]).unwrap_or(heads);
        let head_dim = num(&["head_dim"]).unwrap_or(hidden / heads.max(1));
        let layers = num(&["num_hidden_layers"])?;
        let vocab = num(&["vocab_size"])?;
        let intermediate = num(&["intermediate_size"])?;
        let max_pos = num(&["max_position_embeddings"]).unwrap_or(36864);
        let flag =
            |keys: &[&str], default: bool| get(keys).and_then(Value::as_bool).unwrap_or(default);
        // Two schemas. The remote `Molmo2TextConfig` (allenai/molmo2
        // `olmo/hf_model/configuration_molmo2.py`) defaults qkv_bias true, use_qk_norm false,
        // qk_norm_type `olmo`. The transformers 5.x class (`molmo2/configuration_molmo2.py`) spells
        // qkv_bias `attention_bias` (default false) and rope as `rope_parameters`, and always has
        // q/k norms (no use_qk_norm; qk_norm_type default `qwen3`).
        let native_5x = t.contains_key("rope_parameters")
            || ckpt
                .config
                .get("transformers_version")
                .and_then(Value::as_str)
                .is_some_and(|v| v.starts_with("5."));
        let qkv_bias = flag(&["qkv_bias", "attention_bias"], !native_5x);
        let qk_norm = flag(&["use_qk_norm"], native_5x);
        let qk_type = get(&["qk_norm_type"])
            .and_then(Value::as_str)
            .unwrap_or(if native_5x { "qwen3" } else { "olmo" });
        let norm_after = flag(&["norm_after"], false);
        let target = match (norm_after, qk_norm.then_some(qk_type), qkv_bias) {
            (true, Some("olmo"), false) => Target::Olmo3,
            (false, Some("qwen3"), false) => Target::Qwen3,
            // Qwen2-style: biases on the fused q/k/v only (attn_out has none), no q/k norm.
            (false, None, true) => Target::Qwen2,
            _ => bail!(
                "{label}: text_config has norm_after {norm_after}, use_qk_norm {qk_norm} (qk_norm_type `{qk_type}`), qkv_bias {qkv_bias}; supported: post-norm with `olmo` q/k norms and no bias (-> Olmo3), pre-norm with `qwen3` q/k norms and no bias (-> Qwen3), pre-norm without q/k norms with q/k/v biases (-> Qwen2) (docs/reference/vlm-layouts.md#molmo2)"
            ),
        };
        // Rope: remote code spells rope_theta + rope_scaling, 5.x a flat rope_parameters.
        let (theta, scaling) = match get(&["rope_parameters"]).and_then(Value::as_object) {
            Some(rp) => {
                let mut s = rp.clone();
                let theta = s.remove("rope_theta");
                let plain = s
                    .get("rope_type")
                    .and_then(Value::as_str)
                    .unwrap_or("default")
                    == "default";
                (theta, if plain { Value::Null } else { Value::Object(s) })
            }
            None => (
                get(&["rope_theta"]).cloned(),
                get(&["rope_scaling"]).cloned().unwrap_or(Value::Null),
            ),
        };
        let theta =
            theta.ok_or_else(|| crate::bad!("{label}: text_config states no rope_theta"))?;
        let scaled: Option<Vec<usize>> = match get(&["rope_scaling_layers"]) {
            Some(Value::Array(v)) => Some(
                v.iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as usize)
                    .collect(),
            ),
            _ => None,
        };
        let partial = !scaling.is_null()
            && scaled
                .as_ref()
                .is_some_and(|s| (0..layers).any(|i| !s.contains(&i)));
        let mut f = Map::new();
        f.insert("model_type".into(), json!(target.model_type()));
        for (k, v) in [
            ("hidden_size", hidden),
            ("intermediate_size", intermediate),
            ("num_hidden_layers", layers),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", head_dim),
            ("vocab_size", vocab),
            ("max_position_embeddings", max_pos),
        ] {
            f.insert(k.into(), json!(v));
        }
        f.insert(
            "hidden_act".into(),
            get(&["hidden_act"]).cloned().unwrap_or(json!("silu")),
        );
        f.insert(
            "rms_norm_eps".into(),
            get(&["layer_norm_eps", "rms_norm_eps"])
                .cloned()
                .unwrap_or(json!(1e-6)),
        );
        f.insert("rope_theta".into(), theta);
        f.insert("rope_scaling".into(), scaling);
        if target != Target::Qwen2 {
            f.insert("attention_bias".into(), json!(false));
        }
        match target {
            Target::Olmo3 => {
                let types: Vec<&str> = (0..layers)
                    .map(|i| match &scaled {
                        Some(s) if partial && !s.contains(&i) => "sliding_attention",
                        _ => "full_attention",
                    })
                    .collect();
                f.insert("layer_types".into(), json!(types));
                f.insert("sliding_window".into(), json!(max_pos));
            }
            _ if partial => bail!(
                "{label}: rope scaling on layers {scaled:?} only cannot be expressed for {}",
                target.architecture()
            ),
            _ => {
                f.insert("use_sliding_window".into(), json!(false));
            }
        }
        for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            if let Some(v) = t.get(key) {
                f.insert(key.into(), v.clone());
            }
        }
        Ok(Text {
            target,
            fields: f,
            vocab,
            q_rows: heads * head_dim,
            kv_rows: kv_heads * head_dim,
            intermediate,
            tie: prefix::tie_flag(&ckpt.config, Some("text_config"))?,
        })
    }
}

/// One tensor under `model.transformer.blocks.{i}.`.
fn block_tensor(b: &mut PlanBuilder, text: &Text, stored: &str, rest: &str) -> Result<()> {
    let ckpt = b.ckpt();
    let unknown = || unknown_tensor(ckpt, stored, "the molmo2 layout may have changed");
    let (layer, tail) = block_layer(rest).ok_or_else(unknown)?;
    let post_norm = text.target == Target::Olmo3;
    let name = |m: Module| layer_name(layer, m, Param::Weight);
    match tail {
        "self_attn.att_proj.weight" | "self_attn.att_proj.bias" => {
            let param = if tail.ends_with("bias") {
                Param::Bias
            } else {
                Param::Weight
            };
            let (q, kv) = (text.q_rows, text.kv_rows);
            b.split_rows(
                stored,
                &[
                    (q, layer_name(layer, Module::QProj, param)),
                    (kv, layer_name(layer, Module::KProj, param)),
                    (kv, layer_name(layer, Module::VProj, param)),
                ],
            )
        }
        "self_attn.attn_out.weight" => b.keep(stored, name(Module::OProj)),
        "self_attn.q_norm.weight" => b.keep(stored, name(Module::QNorm)),
        "self_attn.k_norm.weight" => b.keep(stored, name(Module::KNorm)),
        "attn_norm.weight" if post_norm => b.keep(stored, name(Module::PostAttentionLayernorm)),
        "attn_norm.weight" => b.keep(stored, name(Module::InputLayernorm)),
        "ff_norm.weight" if post_norm => b.keep(stored, name(Module::PostFeedforwardLayernorm)),
        "ff_norm.weight" => b.keep(stored, name(Module::PostAttentionLayernorm)),
        "mlp.ff_proj.weight" => {
            let i = text.intermediate;
            b.split_rows(
                stored,
                &[(i, name(Module::UpProj)), (i, name(Module::GateProj))],
            )
        }
        "mlp.ff_out.weight" => b.keep(stored, name(Module::DownProj)),
        _ => Err(unknown()),
    }
}

/// `embed_tokens` = the first `vocab_size` rows of `wte.embedding` ‖ `wte.new_embedding`.
fn embed(
    b: &mut PlanBuilder,
    text: &Text,
    embedding: &str,
    new_embedding: Option<&str>,
) -> Result<()> {
    let ckpt = b.ckpt();
    let e = ckpt.require(embedding)?;
    // Headers may hold any rank; `rows` below checks the ranges against the real size.
    let e_rows = e.shape.first().copied().unwrap_or(0);
    let (width, dtype) = (e.numel() / e_rows.max(1), e.dtype);
    if e_rows >= text.vocab {
        if let Some(n) = new_embedding {
            b.drop(n, DropKind::Other)?;
        }
        return b.rows(embedding, 0, text.vocab, "model.embed_tokens.weight".into());
    }
    let Some(n) = new_embedding else {
        bail!(
            "{}: has {e_rows} rows for vocab_size {} and there is no `{LM}wte.new_embedding` to complete it",
            ckpt.describe(embedding),
            text.vocab
        );
    };
    let n_rows = ckpt.require(n)?.shape.first().copied().unwrap_or(0);
    let missing = text.vocab - e_rows;
    if n_rows < missing {
        bail!(
            "{}: {e_rows} + {n_rows} rows with new_embedding, fewer than vocab_size {}",
            ckpt.describe(embedding),
            text.vocab
        );
    }
    b.note(format!(
        "`{LM}wte.embedding` has {e_rows} rows for vocab_size {} (a transformers 5.x re-save splits embedding and new_embedding in equal halves): embed_tokens is the first {} rows of embedding ‖ new_embedding",
        text.vocab, text.vocab
    ));
    b.push(
        embedding,
        OutTensor {
            name: "model.embed_tokens.weight".into(),
            dtype,
            shape: vec![text.vocab, width],
            parts: vec![
                Part {
                    source: embedding.to_string(),
                    piece: Piece::Range {
                        start: 0,
                        len: e_rows * width,
                    },
                },
                Part {
                    source: n.to_string(),
                    piece: Piece::Range {
                        start: 0,
                        len: missing * width,
                    },
                },
            ],
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_qwen2_language_model_splits_the_qkv_bias_like_the_weight() {
        let dir = std::path::Path::new("tests/fixtures/families/molmo2-qwen2");
        let ckpt = Checkpoint::open_dir(dir, "molmo2-qwen2").unwrap();
        let plan = Molmo2.plan(&ckpt).unwrap();
        assert_eq!(plan.target, Target::Qwen2);
        // hidden 16, 2 heads, 1 KV head, head_dim 8: att_proj.bias is [16 | 8 | 8].
        let bias = "model.transformer.blocks.0.self_attn.att_proj.bias";
        let mut got: Vec<(String, Vec<usize>, Vec<Piece>)> = plan
            .outputs
            .iter()
            .filter(|t| t.parts.iter().any(|p| p.source == bias))
            .map(|t| {
                let pieces = t.parts.iter().map(|p| p.piece.clone()).collect();
                (t.name.clone(), t.shape.clone(), pieces)
            })
            .collect();
        got.sort_by_key(|(_, _, p)| match p[0] {
            Piece::Range { start, .. } => start,
            _ => usize::MAX,
        });
        let want = [("q", 0, 16), ("k", 16, 8), ("v", 24, 8)];
        assert_eq!(got.len(), 3);
        for ((name, shape, pieces), (x, start, len)) in got.iter().zip(want) {
            assert_eq!(name, &format!("model.layers.0.self_attn.{x}_proj.bias"));
            assert_eq!(shape, &vec![len]);
            assert_eq!(pieces, &vec![Piece::Range { start, len }]);
        }
        assert!(plan.outputs.iter().all(|t| !t.name.contains("_norm.")));
        assert_eq!(plan.config["architectures"][0], "Qwen2ForCausalLM");
    }
}
