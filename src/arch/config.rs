//! Normalized text-model configuration.
//!
//! `config.json` comes in two dialects: transformers 4.x (`rope_theta`, `rope_scaling`,
//! `torch_dtype`) and 5.x (`rope_parameters`, possibly nested per layer type, and `dtype`), and
//! VLMs nest the language model under `text_config` or `llm_config` (or keep it flat). Keys that
//! equal the config class default are often omitted, so each known `model_type` has its class
//! defaults (transformers 5.23) filled in before parsing. Both dialects of one model normalize to
//! the same [`TextConfig`].

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::bail;
use crate::error::Result;

/// The most layers a config may declare (docs/architecture.md#panics).
pub const MAX_LAYERS: usize = 1 << 16;

/// The language model's configuration, normalized. `Deserialize` reads back what `inspect --json`
/// printed (reproduce's inspect steps); a model's config.json goes through the checked
/// [`TextConfig::from_model_config`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    /// The text model's type after mapping VLM text types to their LM (`qwen2_5_vl_text` -> `qwen2`).
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub hidden_act: String,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    /// The tie flag as the config states it ([`tie_flag`]), else the class default.
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Attention kind of every layer.
    pub layer_types: Vec<LayerType>,
    /// Window of sliding layers (keys kept, including the query itself).
    pub sliding_window: Option<usize>,
    /// RoPE of full-attention layers.
    pub rope: Rope,
    /// RoPE of sliding-window layers (differs from `rope` for Olmo-3).
    pub rope_sliding: Rope,
    pub moe: Option<MoeConfig>,
    pub clip_qkv: Option<f64>,
    /// The dtype the config declares (`torch_dtype` or `dtype`), as a torch name.
    pub dtype: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    FullAttention,
    SlidingAttention,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    pub theta: f64,
    pub partial_rotary_factor: f64,
    pub scaling: RopeScaling,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    Default,
    Linear {
        factor: f64,
    },
    Dynamic {
        factor: f64,
        original_max_position_embeddings: Option<usize>,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    Yarn(Yarn),
    /// Multimodal RoPE of Qwen-VL: identical to `Default` on text-only input.
    Mrope {
        sections: Vec<usize>,
        interleaved: bool,
    },
    /// Any other rope type, kept by name so callers can refuse it clearly.
    Other {
        name: String,
    },
}

/// YaRN's parameters (transformers' `_compute_yarn_parameters`), checked as they are parsed:
/// every number finite, and those RoPE divides by or takes the logarithm of positive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Yarn {
    pub factor: f64,
    /// The context the model was trained for; `max_position_embeddings` when absent.
    pub original_max_position_embeddings: Option<usize>,
    /// Multiplies cos and sin; derived from `mscale` and `mscale_all_dim` when absent.
    pub attention_factor: Option<f64>,
    /// The rotations that bound the correction range: 32 and 1 when absent, as in transformers.
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// Whether the correction range is rounded out to whole dimensions (HF's default: true).
    pub truncate: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    /// Intermediate size of one expert.
    pub expert_intermediate_size: usize,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether layer `i` has a sparse MoE block (else a dense MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.num_experts > 0
            && (i + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }
}

/// A warning when the stored tensors `names` hold decoder layers beyond the `num_hidden_layers`
/// of `config` (transformers builds only the declared layers and ignores the rest, and so does
/// sinkmerge): `None` when they do not, or when the config does not parse (its error comes when
/// the model is used). `model` names the checkpoint.
pub fn undeclared_layers(model: &str, config: &Value, names: &[String]) -> Option<String> {
    let declared = TextConfig::from_model_config(config)
        .ok()?
        .num_hidden_layers;
    let held = (names.iter())
        .filter_map(|n| crate::arch::names::parse(&crate::arch::names::standard_name(n)?)?.layer)
        .max()?
        + 1;
    (held > declared).then(|| {
        let ignored = match held - declared {
            1 => format!("layer {declared} is"),
            _ => format!("layers {declared}-{} are", held - 1),
        };
        format!(
            "{model}: config.json declares num_hidden_layers {declared} but the weights hold \
             {held} layers; {ignored} ignored"
        )
    })
}

impl TextConfig {
    /// Normalize a whole `config.json` (plain LM or VLM) to its language model's config.
    pub fn from_model_config(config: &Value) -> Result<TextConfig> {
        let (section, _) = text_section(config);
        Self::from_text_section(section, config)
    }

    /// Normalize a text section; `top` is the whole config (for top-level fallbacks).
    pub fn from_text_section(section: &Map<String, Value>, top: &Value) -> Result<TextConfig> {
        let raw_type = section
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| top.get("model_type").and_then(Value::as_str))
            .unwrap_or("")
            .to_string();
        let model_type = lm_type(&raw_type).to_string();
        let mut cfg = class_defaults(&raw_type);
        for (k, v) in section {
            if !v.is_null()
                || matches!(
                    k.as_str(),
                    "sliding_window" | "head_dim" | "num_key_value_heads" | "rope_scaling"
                )
            {
                cfg.insert(k.clone(), v.clone());
            }
        }
        // 5.x configs may spell the expert count `num_local_experts` (an attribute_map alias); it
        // must win over a class-default `num_experts`.
        if let Some(n) = section
            .get("num_local_experts")
            .filter(|_| !section.contains_key("num_experts"))
        {
            cfg.insert("num_experts".into(), n.clone());
        }
        let c = Fields {
            map: &cfg,
            model_type: &raw_type,
        };

        let hidden_size = c.usize("hidden_size")?;
        let num_attention_heads = c.usize("num_attention_heads")?;
        let num_hidden_layers = c.usize("num_hidden_layers")?;
        let num_key_value_heads = c
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        let head_dim = match c.opt_usize("head_dim")? {
            Some(d) => d,
            None => {
                if num_attention_heads == 0 || hidden_size % num_attention_heads != 0 {
                    bail!("config ({raw_type}): hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}");
                }
                hidden_size / num_attention_heads
            }
        };
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            bail!("config ({raw_type}): num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}");
        }

        let tie_word_embeddings = match stated_tie(top, Some(section))
            .map_err(|e| crate::bad!("config ({raw_type}): {e}"))?
        {
            Some(tied) => tied,
            None => c.bool("tie_word_embeddings")?.unwrap_or(false),
        };

        // No layer would score nothing and report an empty table with exit 0; per-layer tables
        // are built from the declared count before any weight is read, and the largest
        // published models have a few hundred layers.
        if !(1..=MAX_LAYERS).contains(&num_hidden_layers) {
            bail!("config ({raw_type}): num_hidden_layers {num_hidden_layers} is outside 1-{MAX_LAYERS}");
        }
        let sliding_window = sliding_window(&c, &model_type)?;
        let layer_types = layer_types(&c, &model_type, num_hidden_layers, sliding_window)?;
        let (rope, rope_sliding) = rope_pair(&c, &model_type)?;

        let moe = match c
            .opt_usize("num_experts")?
            .or(c.opt_usize("num_local_experts")?)
        {
            Some(n) if n > 0 => Some(MoeConfig {
                num_experts: n,
                num_experts_per_tok: c.usize("num_experts_per_tok")?,
                norm_topk_prob: c.bool("norm_topk_prob")?.unwrap_or(false),
                expert_intermediate_size: c
                    .opt_usize("moe_intermediate_size")?
                    .map_or_else(|| c.usize("intermediate_size"), Ok)?,
                decoder_sparse_step: c.opt_usize("decoder_sparse_step")?.unwrap_or(1),
                mlp_only_layers: match cfg.get("mlp_only_layers") {
                    Some(Value::Array(v)) => v
                        .iter()
                        .filter_map(Value::as_u64)
                        .map(|x| x as usize)
                        .collect(),
                    _ => Vec::new(),
                },
            }),
            _ => None,
        };

        let (vocab_size, intermediate_size) =
            (c.usize("vocab_size")?, c.usize("intermediate_size")?);
        let max_position_embeddings = c.opt_usize("max_position_embeddings")?.unwrap_or(2048);
        // Every weight's size (and RoPE's tables) is a product of these; a hostile or corrupt
        // config whose products overflow is refused here, before any shape arithmetic runs.
        let mut products = vec![
            [
                ("num_attention_heads", num_attention_heads),
                ("head_dim", head_dim),
                ("hidden_size", hidden_size),
            ],
            [
                ("num_key_value_heads", num_key_value_heads),
                ("head_dim", head_dim),
                ("hidden_size", hidden_size),
            ],
            [
                ("intermediate_size", intermediate_size),
                ("hidden_size", hidden_size),
                ("", 1),
            ],
            [
                ("vocab_size", vocab_size),
                ("hidden_size", hidden_size),
                ("", 1),
            ],
            [
                ("max_position_embeddings", max_position_embeddings),
                ("head_dim", head_dim),
                ("", 1),
            ],
        ];
        if let Some(m) = &moe {
            products.push([
                ("num_experts", m.num_experts),
                ("moe_intermediate_size", m.expert_intermediate_size),
                ("hidden_size", hidden_size),
            ]);
        }
        for factors in products {
            if let Some((name, _)) = factors.iter().find(|(_, f)| *f == 0) {
                bail!("config ({raw_type}): `{name}` is 0; a model needs at least one");
            }
            // Eight bytes an entry: the widest dtype any tensor is read or written in.
            let bytes = (factors.iter()).try_fold(8u64, |n, &(_, f)| n.checked_mul(f as u64));
            if bytes.is_none_or(|b| b > isize::MAX as u64) {
                let names: Vec<String> = (factors.iter())
                    .filter(|(name, _)| !name.is_empty())
                    .map(|(name, f)| format!("{name} {f}"))
                    .collect();
                bail!(
                    "config ({raw_type}): {} make a tensor larger than any machine can address",
                    names.join(" × ")
                );
            }
        }

        let dtype = section
            .get("dtype")
            .or_else(|| section.get("torch_dtype"))
            .or_else(|| top.get("dtype"))
            .or_else(|| top.get("torch_dtype"))
            .and_then(Value::as_str)
            .map(|s| s.trim_start_matches("torch.").to_string());

        let hidden_act = match c.str("hidden_act")? {
            Some(act) => act,
            None => c.str("hidden_activation")?.unwrap_or("silu"),
        };
        let (eps_key, rms_norm_eps) = match c.f64("rms_norm_eps")? {
            Some(eps) => ("rms_norm_eps", eps),
            None => ("layer_norm_eps", c.f64("layer_norm_eps")?.unwrap_or(1e-6)),
        };
        // `x · rsqrt(mean(x²) + eps)`: a negative eps takes the root of a negative number on a
        // row of small values.
        if !(rms_norm_eps.is_finite() && rms_norm_eps >= 0.0) {
            bail!("config ({raw_type}): `{eps_key}` {rms_norm_eps} must be a finite number ≥ 0");
        }
        let clip_qkv = c.f64("clip_qkv")?;
        if let Some(clip) = clip_qkv.filter(|c| !(c.is_finite() && *c > 0.0)) {
            bail!("config ({raw_type}): `clip_qkv` {clip} must be a finite number > 0");
        }

        Ok(TextConfig {
            model_type,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            hidden_act: hidden_act.to_string(),
            rms_norm_eps,
            max_position_embeddings,
            tie_word_embeddings,
            attention_bias: c.bool("attention_bias")?.unwrap_or(false),
            mlp_bias: c.bool("mlp_bias")?.unwrap_or(false),
            layer_types,
            sliding_window,
            rope,
            rope_sliding,
            moe,
            clip_qkv,
            dtype,
        })
    }

    /// RoPE used by layer `i`.
    pub fn rope_for_layer(&self, i: usize) -> &Rope {
        match self.layer_types.get(i) {
            Some(LayerType::SlidingAttention) => &self.rope_sliding,
            _ => &self.rope,
        }
    }
}

/// Record `dtype` (a torch name such as `bfloat16`) in a config, under whichever of `dtype`
/// (5.x) and `torch_dtype` (4.x) it already uses; `torch_dtype` if neither, which both read.
pub fn set_dtype(config: &mut Value, dtype: &str) {
    if let Some(map) = config.as_object_mut() {
        let mut set = false;
        for key in ["dtype", "torch_dtype"] {
            if map.contains_key(key) {
                map.insert(key.to_string(), Value::String(dtype.to_string()));
                set = true;
            }
        }
        if !set {
            map.insert("torch_dtype".to_string(), Value::String(dtype.to_string()));
        }
    }
}

/// Check that two models share an architecture closely enough to be compared or merged:
/// same model type, layer count, widths and head layout. Vocabulary size may differ (callers
/// handle embeddings). `a` and `b` name the models in the error.
pub fn check_compatible(a: &TextConfig, b: &TextConfig, a_name: &str, b_name: &str) -> Result<()> {
    let fields: [(&str, String, String); 7] = [
        ("model_type", a.model_type.clone(), b.model_type.clone()),
        (
            "num_hidden_layers",
            a.num_hidden_layers.to_string(),
            b.num_hidden_layers.to_string(),
        ),
        (
            "hidden_size",
            a.hidden_size.to_string(),
            b.hidden_size.to_string(),
        ),
        (
            "intermediate_size",
            a.intermediate_size.to_string(),
            b.intermediate_size.to_string(),
        ),
        (
            "num_attention_heads",
            a.num_attention_heads.to_string(),
            b.num_attention_heads.to_string(),
        ),
        (
            "num_key_value_heads",
            a.num_key_value_heads.to_string(),
            b.num_key_value_heads.to_string(),
        ),
        ("head_dim", a.head_dim.to_string(), b.head_dim.to_string()),
    ];
    for (key, x, y) in fields {
        if x != y {
            bail!("{a_name} and {b_name} have different architectures: {key} is {x} vs {y}");
        }
    }
    Ok(())
}

/// Where the language model's config lives: `text_config`, `llm_config`, or the top level.
/// Returns the section and its key (`None` for flat configs).
pub fn text_section(config: &Value) -> (&Map<String, Value>, Option<&'static str>) {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    for key in ["text_config", "llm_config"] {
        if let Some(section) = config.get(key).and_then(Value::as_object) {
            return (section, Some(key));
        }
    }
    (
        config
            .as_object()
            .unwrap_or_else(|| EMPTY.get_or_init(Map::new)),
        None,
    )
}

/// The tie flag a config states for its language model (docs/reference/vlm-layouts.md#tied-embeddings),
/// the one rule of every command: transformers 4.x ties on the text config's
/// `tie_word_embeddings`, 5.x on the top-level one (a composite model's own config), each
/// falling back to the other; a config is read the way the version that wrote it reads it
/// (`transformers_version`), defaulting to 4.x, which wrote the Hub configs. `None` when neither
/// states it; a flag that is not a boolean is an error.
pub fn tie_flag(config: &Value, section_key: Option<&str>) -> Result<Option<bool>> {
    let section = section_key
        .and_then(|k| config.get(k))
        .and_then(Value::as_object);
    stated_tie(config, section)
}

/// [`tie_flag`] with the text section given (the top level itself for a flat config).
fn stated_tie(top: &Value, section: Option<&Map<String, Value>>) -> Result<Option<bool>> {
    let flag = |v: Option<&Value>| -> Result<Option<bool>> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => bail!("`tie_word_embeddings` must be true or false, got {v}"),
        }
    };
    let text = flag(section.and_then(|s| s.get("tie_word_embeddings")))?;
    let top_level = flag(top.get("tie_word_embeddings"))?;
    let written_by_5x = (top.get("transformers_version").and_then(Value::as_str))
        .is_some_and(|v| v.starts_with("5."));
    Ok(if written_by_5x {
        top_level.or(text)
    } else {
        text.or(top_level)
    })
}

/// Map a (possibly VLM) text model type to the causal-LM type with the same math.
pub fn lm_type(model_type: &str) -> &str {
    match model_type {
        "qwen2_vl" | "qwen2_vl_text" | "qwen2_5_vl" | "qwen2_5_vl_text" | "llava_qwen" => "qwen2",
        "qwen3_vl" | "qwen3_vl_text" | "minicpmv" => "qwen3",
        "qwen3_vl_moe" | "qwen3_vl_moe_text" => "qwen3_moe",
        other => other,
    }
}

/// Class defaults of transformers 5.23 for keys that configs commonly omit.
fn class_defaults(model_type: &str) -> Map<String, Value> {
    let common_qwen = json!({
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 28,
    });
    let mut d = match model_type {
        "qwen2" => common_qwen,
        "qwen3" => merge(
            common_qwen,
            json!({ "head_dim": 128, "attention_bias": false }),
        ),
        "qwen3_moe" => json!({
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
            "use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 28,
            "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": false,
        }),
        "qwen2_vl_text" | "qwen2_5_vl_text" => json!({
            "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
            "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "use_sliding_window": false,
            "sliding_window": 4096, "max_window_layers": 80, "rope_theta": 1_000_000.0,
        }),
        "qwen3_vl_text" => json!({
            "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "head_dim": 128, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
            "attention_bias": false, "rope_theta": 5_000_000.0,
        }),
        "qwen3_vl_moe_text" => json!({
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
            "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
            "attention_bias": false, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
            "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": true,
            "rope_theta": 5_000_000.0,
        }),
        "llama" => json!({
            "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false,
        }),
        "mistral" => json!({
            "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
            "sliding_window": 4096,
        }),
        "olmo2" => json!({
            "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "attention_bias": false,
        }),
        "olmo3" => json!({
            "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "attention_bias": false,
            "sliding_window": 4096, "rope_theta": 500_000.0,
        }),
        "olmoe" => json!({
            "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
            "num_hidden_layers": 16, "num_attention_heads": 16, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "attention_bias": false,
            "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": false,
        }),
        _ => json!({}),
    };
    d.as_object_mut().map(std::mem::take).unwrap_or_default()
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

/// Typed access to config fields with errors that name the key.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    model_type: &'a str,
}

impl Fields<'_> {
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n as usize)),
                None => bail!(
                    "config ({}): `{key}` must be a non-negative integer, got {v}",
                    self.model_type
                ),
            },
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        match self.opt_usize(key)? {
            Some(n) => Ok(n),
            None => bail!("config ({}): `{key}` is missing", self.model_type),
        }
    }
    /// `key` read by `read`, `None` when absent or null; a value of another type is an error
    /// that says what `key` must be, not a silent default.
    fn typed<'v, T>(
        &'v self,
        key: &str,
        read: fn(&'v Value) -> Option<T>,
        must: &str,
    ) -> Result<Option<T>> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match read(v) {
                Some(x) => Ok(Some(x)),
                None => bail!(
                    "config ({}): `{key}` must be {must}, got {v}",
                    self.model_type
                ),
            },
        }
    }
    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, Value::as_f64, "a number")
    }
    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, Value::as_bool, "true or false")
    }
    fn str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, Value::as_str, "a string")
    }
}

fn sliding_window(c: &Fields, model_type: &str) -> Result<Option<usize>> {
    let window = c.opt_usize("sliding_window")?;
    Ok(match model_type {
        // Qwen configs carry a window even when it is off (`use_sliding_window: false`).
        "qwen2" | "qwen3" | "qwen3_moe" => {
            let on = c.bool("use_sliding_window")?.unwrap_or(false);
            window.filter(|_| on)
        }
        _ => window,
    })
}

fn layer_types(
    c: &Fields,
    model_type: &str,
    layers: usize,
    window: Option<usize>,
) -> Result<Vec<LayerType>> {
    if let Some(Value::Array(types)) = c.map.get("layer_types") {
        if types.len() != layers {
            bail!(
                "config ({model_type}): layer_types has {} entries for {layers} layers",
                types.len()
            );
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(LayerType::FullAttention),
                Some("sliding_attention") => Ok(LayerType::SlidingAttention),
                _ => bail!("config ({model_type}): unknown layer type {t} in layer_types"),
            })
            .collect();
    }
    let max_window_layers = c.opt_usize("max_window_layers")?.unwrap_or(0);
    Ok((0..layers)
        .map(|i| {
            let slides = match model_type {
                "qwen2" | "qwen3" | "qwen3_moe" => window.is_some() && i >= max_window_layers,
                "mistral" => window.is_some(),
                "olmo3" => (i + 1) % 4 != 0,
                _ => false,
            };
            if slides {
                LayerType::SlidingAttention
            } else {
                LayerType::FullAttention
            }
        })
        .collect())
}

/// RoPE for full and sliding layers from either dialect.
fn rope_pair(c: &Fields, model_type: &str) -> Result<(Rope, Rope)> {
    let default_theta = if model_type == "olmo3" {
        500_000.0
    } else {
        10_000.0
    };
    let theta = c.f64("rope_theta")?.unwrap_or(default_theta);
    let partial = c.f64("partial_rotary_factor")?.unwrap_or(1.0);
    // Unscaled RoPE from the top-level keys, checked as a stated one is.
    let default = || parse_rope(&Map::new(), theta, partial, model_type);
    if let Some(params) = c.map.get("rope_parameters").and_then(Value::as_object) {
        let nested =
            params.contains_key("full_attention") || params.contains_key("sliding_attention");
        if nested {
            let full = params.get("full_attention").and_then(Value::as_object);
            let sliding = params.get("sliding_attention").and_then(Value::as_object);
            let parse = |m: Option<&Map<String, Value>>| match m {
                Some(m) => parse_rope(m, theta, partial, model_type),
                None => default(),
            };
            return Ok((parse(full)?, parse(sliding)?));
        }
        let rope = parse_rope(params, theta, partial, model_type)?;
        return Ok((rope.clone(), rope));
    }
    let full = match c.map.get("rope_scaling") {
        Some(Value::Object(scaling)) => parse_rope(scaling, theta, partial, model_type)?,
        Some(Value::Null) | None => default()?,
        Some(other) => {
            bail!("config ({model_type}): rope_scaling must be an object or null, got {other}")
        }
    };
    // Olmo-3 applies the configured scaling to full-attention layers only.
    let sliding = if model_type == "olmo3" {
        default()?
    } else {
        full.clone()
    };
    Ok((full, sliding))
}

fn parse_rope(m: &Map<String, Value>, theta: f64, partial: f64, model_type: &str) -> Result<Rope> {
    // Every number RoPE reads must be finite, and those it divides by, takes the logarithm or
    // the power of must be positive: transformers computes NaN or Inf tables from anything else.
    let f = |k: &str| -> Result<Option<f64>> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64().filter(|x| x.is_finite()) {
                Some(x) => Ok(Some(x)),
                None => bail!("config ({model_type}): rope `{k}` must be a finite number, got {v}"),
            },
        }
    };
    let positive = |k: &str| -> Result<Option<f64>> {
        match f(k)? {
            Some(x) if x <= 0.0 => bail!("config ({model_type}): rope `{k}` {x} must be > 0"),
            x => Ok(x),
        }
    };
    let u = |k: &str| -> Result<Option<usize>> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64().filter(|&x| x > 0) {
                Some(x) => Ok(Some(x as usize)),
                None => {
                    bail!("config ({model_type}): rope `{k}` must be a positive integer, got {v}")
                }
            },
        }
    };
    let kind = match m.get("rope_type").or_else(|| m.get("type")) {
        None | Some(Value::Null) => "default",
        Some(v) => v.as_str().ok_or_else(|| {
            crate::bad!("config ({model_type}): `rope_type` must be a string, got {v}")
        })?,
    };
    let need = |k: &str| {
        positive(k)?
            .ok_or_else(|| crate::bad!("config ({model_type}): {kind} rope scaling lacks `{k}`"))
    };
    let scaling = if let Some(Value::Array(sections)) = m.get("mrope_section") {
        RopeScaling::Mrope {
            sections: sections
                .iter()
                .filter_map(Value::as_u64)
                .map(|x| x as usize)
                .collect(),
            interleaved: m
                .get("mrope_interleaved")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        }
    } else {
        match kind {
            "default" => RopeScaling::Default,
            "mrope" => RopeScaling::Mrope { sections: Vec::new(), interleaved: false },
            "linear" => RopeScaling::Linear { factor: need("factor")? },
            "dynamic" => RopeScaling::Dynamic {
                factor: need("factor")?,
                original_max_position_embeddings: u("original_max_position_embeddings")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: u("original_max_position_embeddings")?.ok_or_else(|| {
                    crate::bad!("config ({model_type}): llama3 rope scaling lacks `original_max_position_embeddings`")
                })?,
            },
            "yarn" => RopeScaling::Yarn(Yarn {
                factor: need("factor")?,
                original_max_position_embeddings: u("original_max_position_embeddings")?,
                attention_factor: positive("attention_factor")?,
                beta_fast: positive("beta_fast")?.unwrap_or(32.0),
                beta_slow: positive("beta_slow")?.unwrap_or(1.0),
                mscale: f("mscale")?,
                mscale_all_dim: f("mscale_all_dim")?,
                truncate: m.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            }),
            other => RopeScaling::Other { name: other.to_string() },
        }
    };
    let theta = f("rope_theta")?.unwrap_or(theta);
    if !(theta.is_finite() && theta > 0.0) {
        bail!("config ({model_type}): `rope_theta` {theta} must be a finite number > 0");
    }
    let partial_rotary_factor = f("partial_rotary_factor")?.unwrap_or(partial);
    if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
        bail!("config ({model_type}): `partial_rotary_factor` {partial_rotary_factor} must be in (0, 1]");
    }
    Ok(Rope {
        theta,
        partial_rotary_factor,
        scaling,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_x_and_five_x_dialects_agree() {
        let v4 = json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": true,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        });
        let v5 = json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "rms_norm_eps": 1e-5,
            "dtype": "bfloat16", "tie_word_embeddings": true,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        });
        let a = TextConfig::from_model_config(&v4).unwrap();
        assert_eq!(a, TextConfig::from_model_config(&v5).unwrap());
        assert_eq!(a.head_dim, 16);
        assert!(matches!(a.rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }

    #[test]
    fn olmo3_scaling_applies_to_full_layers_only() {
        let v4 = json!({
            "model_type": "olmo3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "vocab_size": 300, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                             "attention_factor": 1.2}
        });
        let c = TextConfig::from_model_config(&v4).unwrap();
        assert_eq!(c.layer_types[3], LayerType::FullAttention);
        assert_eq!(c.layer_types[0], LayerType::SlidingAttention);
        assert!(matches!(c.rope_for_layer(3).scaling, RopeScaling::Yarn(_)));
        assert_eq!(c.rope_for_layer(0).scaling, RopeScaling::Default);
        assert_eq!(c.sliding_window, Some(4096));
    }

    #[test]
    fn vlm_text_config_is_found_and_mapped() {
        let vlm = json!({
            "model_type": "qwen3_vl", "tie_word_embeddings": false,
            "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 32, "vocab_size": 300,
                            "rope_scaling": {"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": true}}
        });
        let c = TextConfig::from_model_config(&vlm).unwrap();
        assert_eq!(c.model_type, "qwen3");
        assert_eq!(c.head_dim, 32);
        assert_eq!(c.rope.theta, 5_000_000.0);
        assert!(matches!(
            c.rope.scaling,
            RopeScaling::Mrope {
                interleaved: true,
                ..
            }
        ));
    }

    #[test]
    fn no_layers_is_refused_and_undeclared_layers_are_named() {
        let config = |layers: usize| {
            json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": layers, "num_attention_heads": 4, "vocab_size": 300})
        };
        let err = TextConfig::from_model_config(&config(0)).unwrap_err();
        assert!(
            err.to_string()
                .contains("num_hidden_layers 0 is outside 1-65536"),
            "{err}"
        );
        let names: Vec<String> = (0..3)
            .map(|l| format!("model.language_model.layers.{l}.mlp.up_proj.weight"))
            .chain(["model.language_model.embed_tokens.weight".to_string()])
            .collect();
        let warning = undeclared_layers("m", &config(2), &names).unwrap();
        assert!(warning.contains("num_hidden_layers 2"), "{warning}");
        assert!(
            warning.contains("hold 3 layers; layer 2 is ignored"),
            "{warning}"
        );
        assert_eq!(undeclared_layers("m", &config(3), &names), None);
    }

    #[test]
    fn tie_flag_follows_the_writing_version() {
        let c4 =
            json!({"tie_word_embeddings": false, "text_config": {"tie_word_embeddings": true}});
        assert_eq!(tie_flag(&c4, Some("text_config")).unwrap(), Some(true));
        let mut c5 = c4.clone();
        c5["transformers_version"] = json!("5.23.0");
        assert_eq!(tie_flag(&c5, Some("text_config")).unwrap(), Some(false));
        assert_eq!(tie_flag(&json!({}), None).unwrap(), None);
        let yes = json!({"text_config": {"tie_word_embeddings": "yes"}});
        let err = tie_flag(&yes, Some("text_config")).unwrap_err().to_string();
        assert!(
            err.contains("`tie_word_embeddings` must be true or false"),
            "{err}"
        );
    }

    #[test]
    fn missing_required_key_names_it() {
        let err = TextConfig::from_model_config(&json!({"model_type": "weird"})).unwrap_err();
        assert!(err.to_string().contains("hidden_size"), "{err}");
    }
}
