//! The weight source of a forward pass: a [`Model`] is an opened checkpoint with its resolved
//! [`DecoderSpec`], serving each weight by its Hugging Face standard name, checked against the
//! shape the spec expects.
//!
//! Weights are served in one of two residencies:
//!
//! - **Streamed** (every pass today: `score`, `heads`, `parity`, text loss, `trace`,
//!   `visual-sinks`): a layer's weights are decoded when its block asks for them and dropped when
//!   it returns, their mapped pages given back. A pass that declares its blocks ([`stream`]) has
//!   the next ones read and decoded on a background thread while one computes, so at most two
//!   layers' weights are resident in f32 (docs/commands/score.md, "Memory and reading ahead").
//! - **Resident for the whole decode, in the stored dtype** (`generate`, which visits every layer
//!   once per token): [`crate::forward::resident::Resident`] holds every decoder matrix as the
//!   backend keeps it ([`Model::stored_bytes`] views, mapped from the safetensors files and never
//!   copied to f32, on the CPU), without [`stream`] and without [`Model::release`], so the pages
//!   stay mapped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::model::{DecoderSpec, NormPlacement};
use crate::arch::names::standard_name;
use crate::arch::QkNorm;
use crate::checkpoint::prefetch::{self, Planned, Prefetch};
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;
use crate::{bad, bail};

/// An opened checkpoint and its decoder spec.
pub struct Model<'a> {
    pub ckpt: &'a Checkpoint,
    pub spec: DecoderSpec,
    /// Hugging Face standard name -> name as stored (VLMs prefix their language model).
    stored: HashMap<String, String>,
    /// The read-ahead of the streaming pass running now, and this model's index in it (see
    /// [`stream`]).
    prefetch: Mutex<Option<(Arc<Prefetch>, usize)>>,
}

/// The part of a layer a streaming pass runs, for reading ahead (see [`stream`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// [`State::attention`](crate::forward::decoder::State::attention); without the residual
    /// update, its scores only.
    Attention { update_residual: bool },
    /// [`State::mlp`](crate::forward::decoder::State::mlp).
    Mlp,
    /// The final norm and LM head ([`State::logits`](crate::forward::decoder::State::logits));
    /// `layer` is ignored.
    Head,
}

/// One block of one model (its index in [`stream`]'s `models`) in the order the pass runs it.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub model: usize,
    pub layer: usize,
    pub block: Block,
}

/// Read `models`' weights ahead of a pass that runs `steps` in order (docs/commands/score.md,
/// "Memory and reading ahead"): a background thread decodes the next blocks' weights while
/// the current one computes, holding at most one layer of f32 weights ahead (the largest layer
/// of the steps; less under `--max-memory`). Reading ahead ends when the returned guard drops.
/// Every value a backend gets is decoded by the same function as without it.
pub fn stream<'m, 'a>(models: &[&'m Model<'a>], steps: &[Step]) -> Streaming<'m, 'a> {
    let mut plan = Vec::new();
    let mut layer_bytes: HashMap<(usize, usize), usize> = HashMap::new();
    for (group, step) in steps.iter().enumerate() {
        let Some(model) = models.get(step.model) else {
            continue;
        };
        for name in model.block_weights(step.layer, step.block) {
            if step.block != Block::Head {
                let bytes = model.ckpt.info(&name).map_or(0, |i| i.numel() * 4);
                *layer_bytes.entry((step.model, step.layer)).or_default() += bytes;
            }
            plan.push(Planned {
                source: step.model,
                ckpt: model.ckpt,
                name,
                group,
            });
        }
    }
    let layer = layer_bytes.values().copied().max().unwrap_or(0);
    let prefetch = Arc::new(Prefetch::start(plan, prefetch::budget(layer)));
    for (i, model) in models.iter().enumerate() {
        *model.prefetch.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Arc::clone(&prefetch), i));
    }
    Streaming {
        models: models.to_vec(),
    }
}

/// Reading ahead for a pass (see [`stream`]); dropping it stops the thread and frees what was
/// read and not used.
pub struct Streaming<'m, 'a> {
    models: Vec<&'m Model<'a>>,
}

impl Drop for Streaming<'_, '_> {
    fn drop(&mut self) {
        for model in &self.models {
            model
                .prefetch
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
        }
    }
}

impl<'a> Model<'a> {
    pub fn new(ckpt: &'a Checkpoint) -> Result<Model<'a>> {
        let spec = DecoderSpec::from_model_config(&ckpt.config)
            .map_err(|e| bad!("{}: {e}", ckpt.dir.join("config.json").display()))?;
        let stored = ckpt
            .names()
            .iter()
            .filter_map(|n| standard_name(n).map(|s| (s, n.clone())))
            .collect();
        let model = Model {
            ckpt,
            spec,
            stored,
            prefetch: Mutex::new(None),
        };
        let embed = model.info("model.embed_tokens.weight")?;
        if embed.shape.len() != 2 || embed.shape[1] != model.spec.hidden_size {
            bail!(
                "{}: shape {:?}, expected [vocab, {}]",
                model.describe("model.embed_tokens.weight"),
                embed.shape,
                model.spec.hidden_size
            );
        }
        // transformers builds the embedding and the head with `vocab_size` rows and refuses a
        // checkpoint whose tensors have another count (a size mismatch on loading).
        let vocab = model.spec.vocab_size;
        for name in ["model.embed_tokens.weight", "lm_head.weight"] {
            let rows = match model.stored.get(name) {
                Some(stored) => ckpt.require(stored)?.shape.first().copied(),
                None => None,
            };
            if let Some(rows) = rows.filter(|&r| r != vocab) {
                bail!(
                    "{}: {rows} rows, but `vocab_size` in {} is {vocab}",
                    model.describe(name),
                    ckpt.dir.join("config.json").display()
                );
            }
        }
        Ok(model)
    }

    /// The stored name of the Hugging Face standard `name`, or `name` itself when it is stored
    /// under that name (the vision towers ask for their tensors as stored).
    pub fn stored_name<'n>(&'n self, name: &'n str) -> Result<&'n str> {
        if let Some(stored) = self.stored.get(name) {
            return Ok(stored);
        }
        if self.ckpt.contains(name) {
            return Ok(name);
        }
        Err(bad!(
            "{}: tensor `{name}` is missing (a {} checkpoint needs it)",
            self.ckpt.dir.display(),
            self.spec.model_type
        ))
    }

    /// Every tensor's Hugging Face standard name, sorted.
    pub fn standard_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.stored.keys().cloned().collect();
        names.sort();
        names
    }

    /// The stored header entry of the Hugging Face standard `name`.
    pub fn info(&self, name: &str) -> Result<&crate::checkpoint::TensorInfo> {
        self.ckpt.require(self.stored_name(name)?)
    }

    pub fn has(&self, name: &str) -> bool {
        self.stored.contains_key(name)
    }

    /// "file: tensor `stored name`" for messages.
    pub fn describe(&self, name: &str) -> String {
        match self.stored.get(name) {
            Some(s) => self.ckpt.describe(s),
            None => format!("{}: tensor `{name}`", self.ckpt.dir.display()),
        }
    }

    /// The stored name of `name`, checked to have the expected shape.
    fn shaped<'n>(&'n self, name: &'n str, shape: &[usize]) -> Result<&'n str> {
        let stored = self.stored_name(name)?;
        let info = self.ckpt.require(stored)?;
        if info.shape != shape {
            bail!(
                "{}: shape {:?}, expected {shape:?} from config.json",
                self.ckpt.describe(stored),
                info.shape
            );
        }
        Ok(stored)
    }

    /// Decode a tensor of the expected shape to f32 and release its mapped pages.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let stored = self.shaped(name, shape)?;
        if let Some(values) = self.read_ahead().and_then(|(p, i)| p.take(i, stored)) {
            return Ok(values);
        }
        let values = self.ckpt.read_tensor(stored)?.data;
        self.ckpt.release(stored);
        Ok(values)
    }

    /// The stored dtype and bytes of a tensor of the expected shape, for backends that decode
    /// on their device; [`Model::release`] gives its mapped pages back.
    pub fn stored_bytes(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(safetensors::Dtype, &'a [u8])> {
        let stored = self.shaped(name, shape)?;
        let dtype = self.ckpt.require(stored)?.dtype;
        if !dtype::is_float(dtype) {
            bail!(
                "{}: dtype {dtype:?} cannot be read as floating point",
                self.ckpt.describe(stored)
            );
        }
        if let Some((prefetch, i)) = self.read_ahead() {
            prefetch.take_resident(i, stored);
        }
        Ok((dtype, self.ckpt.bytes(stored)?))
    }

    /// The read-ahead of the pass running now, if any.
    pub(super) fn read_ahead(&self) -> Option<(Arc<Prefetch>, usize)> {
        let guard = self.prefetch.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().map(|(p, i)| (Arc::clone(p), *i))
    }

    /// Stored names of the weights `block` of `layer` asks for, in the order it asks (missing
    /// ones left out: the block reports them).
    fn block_weights(&self, layer: usize, block: Block) -> Vec<String> {
        let spec = &self.spec;
        let p = Self::layer_prefix(layer);
        let pre = spec.norm_placement == NormPlacement::PreNorm;
        let mut names: Vec<String> = Vec::new();
        let mut add = |when: bool, name: &str| {
            if when {
                names.push(name.to_string());
            }
        };
        match block {
            Block::Attention { update_residual } => {
                let a = format!("{p}.self_attn");
                let (bias, norm) = (spec.qkv_bias, spec.qk_norm != QkNorm::None);
                add(pre, &format!("{p}.input_layernorm.weight"));
                add(true, &format!("{a}.q_proj.weight"));
                add(true, &format!("{a}.k_proj.weight"));
                add(update_residual, &format!("{a}.v_proj.weight"));
                add(update_residual && bias, &format!("{a}.v_proj.bias"));
                add(bias, &format!("{a}.q_proj.bias"));
                add(bias, &format!("{a}.k_proj.bias"));
                add(norm, &format!("{a}.q_norm.weight"));
                add(norm, &format!("{a}.k_norm.weight"));
                add(update_residual, &format!("{a}.o_proj.weight"));
                add(update_residual && spec.o_bias, &format!("{a}.o_proj.bias"));
                add(
                    update_residual && !pre,
                    &format!("{p}.post_attention_layernorm.weight"),
                );
            }
            Block::Mlp => {
                add(pre, &format!("{p}.post_attention_layernorm.weight"));
                if spec.moe.is_some() && spec.layers[layer].moe {
                    add(true, &format!("{p}.mlp.gate.weight"));
                    // Per-expert tensors in expert order, or the fused ones as
                    // `State::fused_experts` reads them.
                    let experts = spec.moe.as_ref().map_or(0, |m| m.num_experts);
                    for e in 0..experts {
                        for proj in ["gate_proj", "up_proj", "down_proj"] {
                            add(true, &format!("{p}.mlp.experts.{e}.{proj}.weight"));
                        }
                    }
                    for fused in ["gate_up_proj", "down_proj"] {
                        let suffix = format!("layers.{layer}.mlp.experts.{fused}");
                        let stored = self.ckpt.names().iter().find(|n| n.ends_with(&suffix));
                        if let Some(n) = stored {
                            add(true, n);
                        }
                    }
                } else {
                    for proj in ["gate_proj", "up_proj", "down_proj"] {
                        add(true, &format!("{p}.mlp.{proj}.weight"));
                        add(spec.mlp_bias, &format!("{p}.mlp.{proj}.bias"));
                    }
                }
                add(!pre, &format!("{p}.post_feedforward_layernorm.weight"));
            }
            Block::Head => {
                add(true, "model.norm.weight");
                if !spec.tie_word_embeddings && self.has("lm_head.weight") {
                    add(true, "lm_head.weight");
                } else if spec.tie_word_embeddings {
                    add(true, "model.embed_tokens.weight");
                }
            }
        }
        names
            .into_iter()
            .filter_map(|n| {
                let stored = self.stored.get(&n).cloned().unwrap_or(n);
                self.ckpt.contains(&stored).then_some(stored)
            })
            .collect()
    }

    /// Release the mapped pages of `name` (see [`Model::stored_bytes`]).
    pub fn release(&self, name: &str) {
        if let Ok(stored) = self.stored_name(name) {
            self.ckpt.release(stored);
        }
    }

    /// `model.layers.{layer}`, the prefix of every tensor of a decoder layer.
    pub fn layer_prefix(layer: usize) -> String {
        format!("model.layers.{layer}")
    }

    /// Names of every tensor of `layer` (for locating non-finite weights).
    fn layer_tensors(&self, layer: usize) -> Vec<String> {
        let prefix = format!("{}.", Self::layer_prefix(layer));
        let mut names: Vec<String> = self
            .stored
            .keys()
            .filter(|n| n.starts_with(&prefix))
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// The first tensor of `layer` holding NaN or Inf, as "file: tensor `x`".
    pub fn non_finite_tensor(&self, layer: usize) -> Option<String> {
        self.layer_tensors(layer).into_iter().find_map(|name| {
            let info = self.info(&name).ok()?;
            let bytes = self.ckpt.bytes(self.stored_name(&name).ok()?).ok()?;
            let (nan, inf) = dtype::count_non_finite(info.dtype, bytes);
            (nan + inf > 0).then(|| self.describe(&name))
        })
    }
}
