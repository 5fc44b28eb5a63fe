//! MolmoE-1B (allenai/MolmoE-1B-0924, remote code only; docs/reference/vlm-layouts.md#molmoe).
//! The Hub checkpoint is allenai/molmo's `Molmo` with `OLMoEBlock`s (`olmo/model.py`; the Hub's
//! `modeling_molmoe.py` / `config_molmoe.py` are copies of that code):
//! * (a) the Hub layout, megablocks dMoE: `model.transformer.blocks.{i}.{att_proj, attn_out,
//!   q_norm, k_norm, attn_norm, ff_norm}.weight`, router `ffn.router.layer.weight` [E, H], experts
//!   `ffn.experts.mlp.{w1, v1, w2}` each [E*I, H] (megablocks `GLU`: `act(x w1^T) * (x v1^T) @ w2`),
//!   so expert e is rows [e*I, (e+1)*I) of each: gate = w1, up = v1, down = w2 rows transposed;
//! * (b) a per-expert port of the same model (not the Hub's): `blocks.{i}.attn.{att_proj,
//!   attn_out, q_norm, k_norm, attn_norm}`, `blocks.{i}.mlp.{gate, ff_norm}` and
//!   `mlp.experts.{e}.{gate,up,down}_proj`, mapped one to one.
//!
//! Common: `wte.embedding` (all `embedding_size` rows; `new_embedding` image tokens dropped),
//! `ln_f`, and the untied head `model.transformer.ff_out.weight` (`weight_tying` false).
//! `att_proj` is split [q | k | v] by rows, `attn_norm` -> `input_layernorm`, `ff_norm` ->
//! `post_attention_layernorm` (pre-norm). Target `OlmoeForCausalLM` with `norm_topk_prob: false`
//! (megablocks' router: softmax then top-k without renormalising). The flat OLMo-style Hub config
//! (`d_model`, `n_heads`, `moe_num_experts`, ...) is translated; the settings OLMoE cannot express
//! (post-norm, no q/k norm, biases, other rope/norm kinds) are refused.

use serde_json::{json, Map, Value};

use super::molmo2::{block_layer, unknown_tensor, vision_part, LM};
use super::plan::{DropKind, ExtractPlan, OutTensor, Part, Piece, PlanBuilder};
use super::prefix::{self, main_dtype};
use super::target::standalone_config;
use super::{model_type_and_arch, Family, Target};
use crate::arch::names::{layer_name, Module, Param};
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Molmoe;

const HEAD: &str = "model.transformer.ff_out.weight";

impl Family for Molmoe {
    fn name(&self) -> &'static str {
        "molmoe"
    }

    fn help(&self) -> &'static str {
        "MolmoE-1B -> OlmoeForCausalLM; Hub layout megablocks `ffn.experts.mlp.{w1,v1,w2}` (or a port's per-expert `mlp.experts.{e}.*`); head `model.transformer.ff_out`"
    }

    fn detect(&self, config: &Value, names: &[String]) -> bool {
        let (model_type, _) = model_type_and_arch(config);
        model_type == "molmo"
            && (config
                .get("moe_num_experts")
                .and_then(Value::as_u64)
                .unwrap_or(0)
                > 0
                || config.get("block_type").and_then(Value::as_str) == Some("moe")
                || names.iter().any(|n| {
                    n.starts_with("model.transformer.blocks.0.ffn.")
                        || n.starts_with("model.transformer.blocks.0.mlp.experts.")
                }))
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        let cfg = Config::read(ckpt)?;
        let mut b = PlanBuilder::new(ckpt, self.name());
        let (mut megablocks, mut hf_style) = (false, false);
        for name in ckpt.names() {
            if name == HEAD {
                b.head(name)?;
            } else if let Some(kind) = vision_part(name) {
                b.drop(name, kind)?;
            } else if let Some(rest) = name.strip_prefix(LM) {
                match rest {
                    "wte.embedding" => b.keep(name, "model.embed_tokens.weight".into())?,
                    "wte.new_embedding" => b.drop(name, DropKind::Other)?,
                    "ln_f.weight" => b.keep(name, "model.norm.weight".into())?,
                    _ => match block_tensor(&mut b, &cfg, name, rest)? {
                        Style::Megablocks => megablocks = true,
                        Style::HfStyle => hf_style = true,
                    },
                }
            } else {
                bail!(
                    "{}: not part of the molmoe layout (language model under `{LM}`, head `{HEAD}`, vision under `model.vision_backbone.`)",
                    ckpt.describe(name)
                );
            }
        }
        match (megablocks, hf_style) {
            (true, true) => bail!(
                "{}: mixes the megablocks (`ffn.*`) and HF-style (`mlp.*`) expert layouts",
                ckpt.label
            ),
            (true, false) => b.note("MolmoE Hub layout, megablocks experts"),
            (false, true) => b.note("MolmoE per-expert layout of a port (not the Hub's)"),
            (false, false) => {}
        }
        let config = standalone_config(Target::Olmoe, &cfg.fields, &ckpt.config, main_dtype(ckpt))?;
        b.finish(Target::Olmoe, config, cfg.tie)
    }
}

/// Which layout a tensor belongs to.
enum Style {
    Megablocks,
    HfStyle,
}

/// The flat OLMo-style config, translated to OLMoE fields.
struct Config {
    fields: Map<String, Value>,
    q_rows: usize,
    kv_rows: usize,
    experts: usize,
    inter: usize,
    hidden: usize,
    tie: Option<bool>,
}

impl Config {
    fn read(ckpt: &Checkpoint) -> Result<Config> {
        let c = &ckpt.config;
        let label = &ckpt.label;
        let get = |k: &str| c.get(k).filter(|v| !v.is_null());
        let num = |k: &str| -> Result<usize> {
            get(k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    crate::bad!("{label}: config.json `{k}` is missing or not an integer")
                })
        };
        let want = |k: &str, ok: &dyn Fn(&Value) -> bool, what: &str| -> Result<()> {
            match get(k) {
                Some(v) if !ok(v) => bail!("{label}: config.json `{k}` is {v}; OLMoE needs {what}"),
                _ => Ok(()),
            }
        };
        want("block_type", &|v| v == "moe", "\"moe\"")?;
        want("norm_after", &|v| v == false, "false (pre-norm)")?;
        want("attention_layer_norm", &|v| v == true, "true (q/k norms)")?;
        want("layer_norm_type", &|v| v == "rms", "\"rms\"")?;
        want("rope_impl", &|v| v == "llama", "\"llama\" (rotate-half)")?;
        want("include_bias", &|v| v == false, "false")?;
        want("qkv_bias", &|v| v == false, "false")?;
        want("moe_shared_expert", &|v| v == false, "false")?;
        let hidden = num("d_model")?;
        let heads = num("n_heads")?;
        let kv_heads = num("n_kv_heads").unwrap_or(heads);
        if let Some(hd) = get("head_dim").and_then(Value::as_u64) {
            if (hd as usize).checked_mul(heads) != Some(hidden) {
                bail!("{label}: config.json head_dim {hd} differs from d_model / n_heads; OLMoE cannot express it");
            }
        }
        let head_dim = hidden / heads.max(1);
        let experts = num("moe_num_experts")?;
        let mlp_hidden = match get("mlp_hidden_size").and_then(Value::as_u64) {
            Some(h) => h as f64,
            None => {
                get("mlp_ratio").and_then(Value::as_f64).ok_or_else(|| {
                    crate::bad!("{label}: config.json states neither mlp_hidden_size nor mlp_ratio")
                })? * hidden as f64
            }
        };
        // SwiGLU: the MLP's hidden size covers gate and up, so one expert is half of it.
        let inter = (mlp_hidden / 2.0) as usize;
        let vocab = num("embedding_size").or_else(|_| num("vocab_size"))?;
        let mut f = Map::new();
        f.insert("model_type".into(), json!("olmoe"));
        for (k, v) in [
            ("hidden_size", hidden),
            ("intermediate_size", inter),
            ("num_hidden_layers", num("n_layers")?),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("vocab_size", vocab),
            (
                "max_position_embeddings",
                num("max_position_embeddings").or_else(|_| num("max_sequence_length"))?,
            ),
            ("num_experts", experts),
            ("num_experts_per_tok", num("moe_top_k")?),
        ] {
            f.insert(k.into(), json!(v));
        }
        f.insert(
            "rms_norm_eps".into(),
            get("layer_norm_eps").cloned().unwrap_or(json!(1e-5)),
        );
        f.insert(
            "rope_theta".into(),
            get("rope_theta").cloned().unwrap_or(json!(10000.0)),
        );
        f.insert("rope_scaling".into(), Value::Null);
        f.insert("norm_topk_prob".into(), json!(false));
        f.insert(
            "clip_qkv".into(),
            c.get("clip_qkv").cloned().unwrap_or(Value::Null),
        );
        f.insert("attention_bias".into(), json!(false));
        f.insert("hidden_act".into(), json!("silu"));
        for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            if let Some(v) = c.get(key) {
                f.insert(key.into(), v.clone());
            }
        }
        Ok(Config {
            fields: f,
            q_rows: heads * head_dim,
            kv_rows: kv_heads * head_dim,
            experts,
            inter,
            hidden,
            tie: match c.get("weight_tying").and_then(Value::as_bool) {
                Some(tied) => Some(tied),
                None => prefix::tie_flag(c, None)?,
            },
        })
    }
}

/// One tensor under `model.transformer.blocks.{i}.`.
fn block_tensor(b: &mut PlanBuilder, cfg: &Config, stored: &str, rest: &str) -> Result<Style> {
    let ckpt = b.ckpt();
    let unknown = || unknown_tensor(ckpt, stored, "neither MolmoE layout has it");
    let (layer, tail) = block_layer(rest).ok_or_else(unknown)?;
    let name = |m: Module| layer_name(layer, m, Param::Weight);
    let expert =
        |e: usize, proj: &str| format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight");
    let (style, attn) = match tail.strip_prefix("attn.") {
        Some(t) => (Style::HfStyle, t),
        None => (Style::Megablocks, tail),
    };
    match attn {
        "att_proj.weight" => {
            let (q, kv) = (cfg.q_rows, cfg.kv_rows);
            let pieces = [
                (q, name(Module::QProj)),
                (kv, name(Module::KProj)),
                (kv, name(Module::VProj)),
            ];
            b.split_rows(stored, &pieces)?;
            return Ok(style);
        }
        "attn_out.weight" => return b.keep(stored, name(Module::OProj)).map(|_| style),
        "q_norm.weight" => return b.keep(stored, name(Module::QNorm)).map(|_| style),
        "k_norm.weight" => return b.keep(stored, name(Module::KNorm)).map(|_| style),
        "attn_norm.weight" => return b.keep(stored, name(Module::InputLayernorm)).map(|_| style),
        _ => {}
    }
    let (e_count, i, h) = (cfg.experts, cfg.inter, cfg.hidden);
    match tail {
        "ff_norm.weight" => b
            .keep(stored, name(Module::PostAttentionLayernorm))
            .map(|_| Style::Megablocks),
        "mlp.ff_norm.weight" => b
            .keep(stored, name(Module::PostAttentionLayernorm))
            .map(|_| Style::HfStyle),
        "ffn.router.layer.weight" => b
            .keep(stored, name(Module::Router))
            .map(|_| Style::Megablocks),
        "mlp.gate.weight" => b.keep(stored, name(Module::Router)).map(|_| Style::HfStyle),
        "ffn.experts.mlp.w1" | "ffn.experts.mlp.v1" | "ffn.experts.mlp.w2" => {
            let info = ckpt.require(stored)?;
            if info.shape != [e_count * i, h] {
                bail!(
                    "{}: shape {:?}, expected [experts * expert_size, d_model] = [{}, {h}] (expert size {i} from the config's MLP width)",
                    ckpt.describe(stored),
                    info.shape,
                    e_count * i
                );
            }
            let dtype = info.dtype;
            for e in 0..e_count {
                match &tail[tail.len() - 2..] {
                    "w1" => b.rows(stored, e * i, i, expert(e, "gate_proj"))?,
                    "v1" => b.rows(stored, e * i, i, expert(e, "up_proj"))?,
                    _ => b.push(
                        stored,
                        OutTensor {
                            name: expert(e, "down_proj"),
                            dtype,
                            shape: vec![h, i],
                            parts: vec![Part {
                                source: stored.to_string(),
                                piece: Piece::Transposed {
                                    start: e * i * h,
                                    rows: i,
                                    stride: h,
                                    col: 0,
                                    cols: h,
                                },
                            }],
                        },
                    )?,
                }
            }
            Ok(Style::Megablocks)
        }
        _ => {
            let (e, proj) = tail
                .strip_prefix("mlp.experts.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(e, p)| Some((e.parse::<usize>().ok()?, p)))
                .ok_or_else(unknown)?;
            match proj {
                "gate_proj.weight" | "up_proj.weight" | "down_proj.weight" => {
                    b.keep(stored, expert(e, &proj[..proj.len() - ".weight".len()]))?;
                    Ok(Style::HfStyle)
                }
                _ => Err(unknown()),
            }
        }
    }
}
