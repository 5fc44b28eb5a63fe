//! QK-norm injection (Section 5, Appendix F.3): give a Qwen2/Qwen2.5 causal LM per-head
//! QK-RMSNorm with unit scale by rewriting it as a Qwen3 checkpoint.
//!
//! Qwen3's attention is Qwen2's plus `q_norm`/`k_norm` (RMSNorm over each head's `head_dim`,
//! before RoPE). Qwen2 hard-codes a bias on q/k/v and none on o; Qwen3 has one switch,
//! `attention_bias`, for all four projections (transformers 5.23 `modeling_qwen3.py`). So the
//! output declares `attention_bias: true`, keeps the q/k/v biases, and adds an explicit zero
//! `o_proj.bias` (which leaves o_proj's output unchanged). `head_dim` is written explicitly
//! because Qwen3's class default (128) differs from Qwen2's `hidden_size / num_attention_heads`.
//! Every other config key is kept as written: the two config classes share every other field
//! and default (checked against transformers 5.23).
//!
//! The result is not the same function as the input: unit-scale RMSNorm still rescales every
//! query and key head to RMS 1, which is the intervention.

use safetensors::Dtype;
use serde_json::{json, Value};

use crate::arch::names::{self, Module, Param};
use crate::arch::{family, TextConfig};
use crate::bail;
use crate::checkpoint::writer::PlannedTensor;
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;
use crate::write::rewrite::Additions;

/// A tensor the injection adds.
#[derive(Debug, Clone, PartialEq)]
pub struct AddedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Every entry's value: 1 for the norm scales, 0 for the o_proj bias.
    pub fill: f32,
}

impl AddedTensor {
    pub fn bytes(&self) -> Result<Vec<u8>> {
        let n: usize = self.shape.iter().product();
        dtype::encode(self.dtype, &vec![self.fill; n])
    }
}

/// What the injection writes besides the original tensors.
#[derive(Debug, Clone)]
pub struct Injection {
    pub config: Value,
    pub head_dim: usize,
    pub num_layers: usize,
    pub dtype: Dtype,
    pub added: Vec<AddedTensor>,
}

impl Injection {
    /// What the rewrite writes besides the source's tensors: the Qwen3 config and the added
    /// tensors with their bytes (the rewrite places them in natural name order).
    pub fn additions(&self) -> Result<Additions<'static>> {
        let tensors = (self.added.iter())
            .map(|t| {
                let planned = PlannedTensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                };
                Ok((planned, t.bytes()?))
            })
            .collect::<Result<_>>()?;
        Ok(Additions {
            config: Some(self.config.clone()),
            tensors,
            files: Vec::new(),
        })
    }
}

/// Check that `ckpt` is a Qwen2-family causal LM without QK norms and plan its conversion.
pub fn plan(ckpt: &Checkpoint) -> Result<Injection> {
    let label = &ckpt.label;
    if let Some(f) = family::detect(&ckpt.config, ckpt.names()) {
        bail!(
            "{label}: is a vision-language model (family {f}); inject-qknorm takes a Qwen2/Qwen2.5 \
             causal LM: extract its language model first (`sinkmerge extract`)"
        );
    }
    let model_type = ckpt
        .config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    match model_type {
        "qwen2" => {}
        "qwen3" | "qwen3_moe" => bail!(
            "{label}: model_type `{model_type}` already has per-head QK norm; inject-qknorm \
             converts Qwen2/Qwen2.5 models"
        ),
        other => bail!(
            "{label}: inject-qknorm converts Qwen2/Qwen2.5 models (model_type `qwen2`), not \
             model_type `{other}`"
        ),
    }
    if let Some(n) = ckpt.names().iter().find(|n| {
        names::parse(n).is_some_and(|p| matches!(p.module, Module::QNorm | Module::KNorm))
    }) {
        bail!("{}: the model already has QK norms", ckpt.describe(n));
    }
    let config = TextConfig::from_model_config(&ckpt.config)
        .map_err(|e| crate::bad!("{}: {e}", ckpt.dir.join("config.json").display()))?;
    let dtype = ckpt
        .main_float_dtype()
        .ok_or_else(|| crate::bad!("{label}: has no floating-point tensors"))?;

    let (h, hd) = (config.hidden_size, config.head_dim);
    let (nq, nkv) = (
        config.num_attention_heads * hd,
        config.num_key_value_heads * hd,
    );
    let mut added = Vec::new();
    for layer in 0..config.num_hidden_layers {
        let expect = |module, param, shape: Vec<usize>| -> Result<()> {
            let name = names::layer_name(layer, module, param);
            let info = ckpt.require(&name)?;
            if info.shape != shape {
                bail!(
                    "{}: shape {:?}, expected {shape:?} from config.json (head_dim {hd})",
                    ckpt.describe(&name),
                    info.shape
                );
            }
            Ok(())
        };
        expect(Module::QProj, Param::Weight, vec![nq, h])?;
        expect(Module::KProj, Param::Weight, vec![nkv, h])?;
        expect(Module::VProj, Param::Weight, vec![nkv, h])?;
        expect(Module::OProj, Param::Weight, vec![h, nq])?;
        expect(Module::QProj, Param::Bias, vec![nq])?;
        expect(Module::KProj, Param::Bias, vec![nkv])?;
        expect(Module::VProj, Param::Bias, vec![nkv])?;
        let o_bias = names::layer_name(layer, Module::OProj, Param::Bias);
        if ckpt.contains(&o_bias) {
            bail!(
                "{}: Qwen2 has no o_proj bias; this checkpoint is not a standard Qwen2",
                ckpt.describe(&o_bias)
            );
        }
        for (module, fill, len) in [
            (Module::QNorm, 1.0, hd),
            (Module::KNorm, 1.0, hd),
            (Module::OProj, 0.0, h),
        ] {
            let param = if module == Module::OProj {
                Param::Bias
            } else {
                Param::Weight
            };
            added.push(AddedTensor {
                name: names::layer_name(layer, module, param),
                dtype,
                shape: vec![len],
                fill,
            });
        }
    }
    Ok(Injection {
        config: qwen3_config(&ckpt.config, hd),
        head_dim: hd,
        num_layers: config.num_hidden_layers,
        dtype,
        added,
    })
}

/// The Qwen2 config rewritten for `Qwen3ForCausalLM` (see the module docs for why each key).
pub fn qwen3_config(qwen2: &Value, head_dim: usize) -> Value {
    let mut c = qwen2.clone();
    let map = c
        .as_object_mut()
        .expect("Checkpoint::open_dir refuses a config.json that is not an object");
    map.insert("architectures".into(), json!(["Qwen3ForCausalLM"]));
    map.insert("model_type".into(), json!("qwen3"));
    map.insert("attention_bias".into(), json!(true));
    map.insert("head_dim".into(), json!(head_dim));
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_keeps_every_other_key() {
        let q2 = json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
            "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0},
            "sliding_window": 131072, "use_sliding_window": false, "tie_word_embeddings": true,
            "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"
        });
        let q3 = qwen3_config(&q2, 16);
        assert_eq!(q3["architectures"], json!(["Qwen3ForCausalLM"]));
        assert_eq!(q3["model_type"], "qwen3");
        assert_eq!(q3["attention_bias"], true);
        assert_eq!(q3["head_dim"], 16);
        for key in [
            "hidden_size",
            "rope_theta",
            "rope_scaling",
            "sliding_window",
            "use_sliding_window",
            "tie_word_embeddings",
            "rms_norm_eps",
            "torch_dtype",
        ] {
            assert_eq!(q3[key], q2[key], "{key}");
        }
    }

    #[test]
    fn added_tensors_are_ones_and_zeros_in_the_dtype() {
        let t = AddedTensor {
            name: "x".into(),
            dtype: Dtype::BF16,
            shape: vec![3],
            fill: 1.0,
        };
        assert_eq!(t.bytes().unwrap(), [0x80, 0x3f, 0x80, 0x3f, 0x80, 0x3f]);
        let z = AddedTensor { fill: 0.0, ..t };
        assert_eq!(z.bytes().unwrap(), [0; 6]);
    }
}
