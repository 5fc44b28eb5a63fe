//! The layer-streaming decoder forward pass (f32, eager attention, no cache, batch of one per
//! prompt), following transformers' eager path step by step (forward.md §5).
//!
//! A [`Model`] is an opened checkpoint with its resolved [`DecoderSpec`]. A [`State`] holds the
//! hidden states of every prompt, packed as one `[tokens, hidden]` matrix so the projections run
//! as one large GEMM. Layers are streamed: [`State::attention`] decodes the layer's attention
//! weights, computes every prompt's and head's scores and probabilities, hands each head to a
//! visitor (the metric accumulators, or a probability dump for tests) and drops the weights;
//! [`State::mlp`] does the same for the feed-forward block. Only the current layer's weights are
//! ever resident in f32.

use std::collections::HashMap;
use std::ops::Range;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

use super::kernels::{add_assign, rms_norm, rms_norm_rows, silu_mul, Linear};
use super::model::{DecoderSpec, LayerSpec, NormPlacement};
use super::rope::{frequencies, RopeTable};
use crate::arch::config::RopeScaling;
use crate::arch::names::standard_name;
use crate::arch::QkNorm;
use crate::checkpoint::{dtype, Checkpoint};
use crate::error::Result;
use crate::{bad, bail};

/// An opened checkpoint and its decoder spec.
pub struct Model<'a> {
    pub ckpt: &'a Checkpoint,
    pub spec: DecoderSpec,
    /// Hugging Face standard name -> name as stored (VLMs prefix their language model).
    stored: HashMap<String, String>,
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
        let model = Model { ckpt, spec, stored };
        let embed = model.info("model.embed_tokens.weight")?;
        if embed.shape.len() != 2 || embed.shape[1] != model.spec.hidden_size {
            bail!(
                "{}: shape {:?}, expected [vocab, {}]",
                model.describe("model.embed_tokens.weight"),
                embed.shape,
                model.spec.hidden_size
            );
        }
        Ok(model)
    }

    fn stored_name(&self, name: &str) -> Result<&str> {
        self.stored.get(name).map(String::as_str).ok_or_else(|| {
            bad!(
                "{}: tensor `{name}` is missing (a {} checkpoint needs it)",
                self.ckpt.dir.display(),
                self.spec.model_type
            )
        })
    }

    fn info(&self, name: &str) -> Result<&crate::checkpoint::TensorInfo> {
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

    /// Decode a tensor of the expected shape to f32 and release its mapped pages.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let stored = self.stored_name(name)?;
        let info = self.ckpt.require(stored)?;
        if info.shape != shape {
            bail!(
                "{}: shape {:?}, expected {shape:?} from config.json",
                self.ckpt.describe(stored),
                info.shape
            );
        }
        let values = self.ckpt.read_tensor(stored)?.data;
        self.ckpt.release(stored);
        Ok(values)
    }

    /// A linear layer `{prefix}.weight` `[out, in]` with `{prefix}.bias` `[out]` if `bias`.
    pub fn linear(&self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        Ok(Linear {
            weight: self.tensor(&format!("{prefix}.weight"), &[out, inp])?,
            out_features: out,
            in_features: inp,
            bias: if bias {
                Some(self.tensor(&format!("{prefix}.bias"), &[out])?)
            } else {
                None
            },
        })
    }

    fn layer_prefix(layer: usize) -> String {
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
    fn non_finite_tensor(&self, layer: usize) -> Option<String> {
        self.layer_tensors(layer).into_iter().find_map(|name| {
            let info = self.info(&name).ok()?;
            let bytes = self.ckpt.bytes(self.stored_name(&name).ok()?).ok()?;
            let (nan, inf) = dtype::count_non_finite(info.dtype, bytes);
            (nan + inf > 0).then(|| self.describe(&name))
        })
    }
}

/// One head of one prompt, as a visitor sees it.
pub struct HeadView<'a> {
    pub prompt: usize,
    pub head: usize,
    /// Tokens in the prompt.
    pub len: usize,
    /// `[len, len]` row-major attention scores after scaling, before the mask (`scores[q*len+p]`
    /// is meaningful for the keys query `q` sees: `first_key(q) <= p <= q`).
    pub scores: &'a [f32],
    /// `[len, len]` softmax probabilities, exactly 0 for masked keys.
    pub probs: &'a [f32],
    /// Sliding window of this layer (keys a query sees, itself included), if any.
    pub window: Option<usize>,
}

impl HeadView<'_> {
    /// The first key query `q` sees.
    #[inline]
    pub fn first_key(&self, q: usize) -> usize {
        first_key(q, self.window)
    }
}

#[inline]
fn first_key(q: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (q + 1).saturating_sub(w))
}

/// Theorem-1 ingredients of one layer with QK norms (sink-metrics.md; paper Appendix A.3).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct QkNormStats {
    /// max |γ| of the q_norm and k_norm scales.
    pub gamma_q_inf: f64,
    pub gamma_k_inf: f64,
    /// Per normalization group (each query head for per-head norms; one group, the whole
    /// projection, for layerwise norms): min over every calibration token i of
    /// `RMS(W x_i) / ||x_i||_2`, where `x_i` is the token's input to the projection (the
    /// `input_layernorm` output for pre-norm models, the residual stream for OLMo-2/3) and `W`
    /// the group's rows of the projection weight, without bias.
    pub m_q: Vec<f64>,
    /// The same for the key projection (groups: key/value heads, or one).
    pub m_k: Vec<f64>,
}

/// What [`State::attention`] returns: each visited head's result, in prompt-major order
/// (`index = prompt * num_heads + head`), and the QK-norm statistics where the model has them.
pub struct AttentionOutput<R> {
    pub heads: Vec<R>,
    pub qk_norm: Option<QkNormStats>,
}

/// Every prompt's hidden states for one model, between layers.
pub struct State<'m, 'a> {
    model: &'m Model<'a>,
    /// Row range of each prompt in `x`.
    prompts: Vec<Range<usize>>,
    /// `[tokens, hidden]`.
    x: Vec<f32>,
    /// RoPE tables built so far, keyed by (rope, the sequence length that matters for it).
    ropes: Vec<(LayerRopeKey, RopeTable)>,
}

#[derive(Debug, Clone, PartialEq)]
struct LayerRopeKey {
    rope: crate::arch::config::Rope,
    /// Sequence length for dynamic NTK scaling; 0 for the others.
    seq_len: usize,
}

impl<'m, 'a> State<'m, 'a> {
    /// Embed `prompts` (token ids). Every id must index the embedding matrix.
    pub fn new(model: &'m Model<'a>, prompts: &[Vec<u32>]) -> Result<State<'m, 'a>> {
        let hidden = model.spec.hidden_size;
        let name = "model.embed_tokens.weight";
        let stored = model.stored_name(name)?;
        let info = model.ckpt.require(stored)?;
        let rows = info.shape[0];
        let size = dtype::byte_size(info.dtype);
        let bytes = model.ckpt.bytes(stored)?;
        let total: usize = prompts.iter().map(Vec::len).sum();
        let mut x = vec![0f32; total * hidden];
        let mut ranges = Vec::with_capacity(prompts.len());
        let mut row = 0;
        for (p, ids) in prompts.iter().enumerate() {
            if ids.is_empty() {
                bail!("prompt {} has no tokens", p + 1);
            }
            ranges.push(row..row + ids.len());
            for &id in ids {
                let id = id as usize;
                if id >= rows {
                    bail!(
                        "{}: token id {id} (prompt {}) is outside the embedding's {rows} rows; \
                         the tokenizer does not belong to this model",
                        model.ckpt.describe(stored),
                        p + 1
                    );
                }
                dtype::decode_into(
                    info.dtype,
                    &bytes[id * hidden * size..(id + 1) * hidden * size],
                    &mut x[row * hidden..(row + 1) * hidden],
                    &model.ckpt.describe(stored),
                )?;
                row += 1;
            }
        }
        model.ckpt.release(stored);
        Ok(State {
            model,
            prompts: ranges,
            x,
            ropes: Vec::new(),
        })
    }

    fn rope_index(&mut self, layer: &LayerSpec, len: usize) -> Result<usize> {
        let spec = &self.model.spec;
        let seq_len = match layer.rope.scaling {
            RopeScaling::Dynamic { .. } => len.max(spec.max_position_embeddings),
            _ => 0,
        };
        let key = LayerRopeKey {
            rope: layer.rope.clone(),
            seq_len,
        };
        if let Some(i) = self.ropes.iter().position(|(k, _)| *k == key) {
            return Ok(i);
        }
        let max_len = self.prompts.iter().map(|r| r.len()).max().unwrap_or(0);
        let freq = frequencies(
            &layer.rope,
            spec.head_dim,
            spec.max_position_embeddings,
            len,
        )?;
        self.ropes.push((key, RopeTable::new(&freq, max_len)));
        Ok(self.ropes.len() - 1)
    }

    /// Run layer `layer`'s attention block: every prompt's and head's scores and probabilities go
    /// to `visit` (in parallel; results come back in prompt-major order), then, if
    /// `update_residual`, the values, output projection and residual update (the last layer of a
    /// scoring pass skips them: nothing downstream reads them). The layer's attention weights
    /// are dropped on return.
    pub fn attention<R: Send>(
        &mut self,
        layer: usize,
        visit: &(dyn Fn(&HeadView) -> R + Sync),
        update_residual: bool,
    ) -> Result<AttentionOutput<R>> {
        let model = self.model;
        let spec = &model.spec;
        let lspec = &spec.layers[layer];
        let (hidden, nh, nkv, hd) = (
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        );
        let (qd, kd) = (nh * hd, nkv * hd);
        let n = self.x.len() / hidden;
        let eps = spec.rms_norm_eps;
        let p = Model::layer_prefix(layer);

        // Attention input: the normalized residual (pre-norm) or the residual itself (OLMo-2/3).
        let normed;
        let input: &[f32] = match spec.norm_placement {
            NormPlacement::PreNorm => {
                let w = model.tensor(&format!("{p}.input_layernorm.weight"), &[hidden])?;
                normed = rms_norm(&self.x, hidden, &w, eps);
                &normed
            }
            NormPlacement::PostNorm => &self.x,
        };

        let mut q_proj =
            model.linear(&format!("{p}.self_attn.q_proj"), qd, hidden, spec.qkv_bias)?;
        let mut q = q_proj.forward_no_bias(input, n);
        let q_bias = q_proj.bias.take();
        drop(q_proj);
        let mut k_proj =
            model.linear(&format!("{p}.self_attn.k_proj"), kd, hidden, spec.qkv_bias)?;
        let mut k = k_proj.forward_no_bias(input, n);
        let k_bias = k_proj.bias.take();
        drop(k_proj);
        let mut v = if update_residual {
            let v_proj =
                model.linear(&format!("{p}.self_attn.v_proj"), kd, hidden, spec.qkv_bias)?;
            v_proj.forward(input, n)
        } else {
            Vec::new()
        };

        let (q_norm_len, k_norm_len) = match spec.qk_norm {
            QkNorm::PerHead => (hd, hd),
            QkNorm::Layerwise => (qd, kd),
            QkNorm::None => (0, 0),
        };
        // The Theorem-1 ratios use the projections before their bias is added.
        let qk_stats = if spec.qk_norm != QkNorm::None {
            let input_norms: Vec<f64> = input
                .par_chunks(hidden)
                .map(|r| r.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt())
                .collect();
            Some((
                min_rms_ratio(&q, qd, q_norm_len, &input_norms),
                min_rms_ratio(&k, kd, k_norm_len, &input_norms),
            ))
        } else {
            None
        };
        add_bias_opt(&mut q, &q_bias);
        add_bias_opt(&mut k, &k_bias);
        let qk_stats = match qk_stats {
            Some((m_q, m_k)) => {
                let wq = model.tensor(&format!("{p}.self_attn.q_norm.weight"), &[q_norm_len])?;
                let wk = model.tensor(&format!("{p}.self_attn.k_norm.weight"), &[k_norm_len])?;
                rms_norm_rows(&mut q, q_norm_len, &wq, eps);
                rms_norm_rows(&mut k, k_norm_len, &wk, eps);
                Some(QkNormStats {
                    gamma_q_inf: wq.iter().fold(0f64, |m, &v| m.max(v.abs() as f64)),
                    gamma_k_inf: wk.iter().fold(0f64, |m, &v| m.max(v.abs() as f64)),
                    m_q,
                    m_k,
                })
            }
            None => None,
        };
        if let Some(c) = spec.clip_qkv {
            for buf in [&mut q, &mut k, &mut v] {
                buf.par_iter_mut().for_each(|x| *x = x.clamp(-c, c));
            }
        }

        // RoPE, per prompt (dynamic scaling depends on the prompt's length).
        for pi in 0..self.prompts.len() {
            let range = self.prompts[pi].clone();
            let table = self.rope_index(lspec, range.len())?;
            let table = &self.ropes[table].1;
            let rows = range.start..range.end;
            q[rows.start * qd..rows.end * qd]
                .par_chunks_mut(qd)
                .enumerate()
                .for_each(|(t, row)| row.chunks_mut(hd).for_each(|h| table.apply(h, t)));
            k[rows.start * kd..rows.end * kd]
                .par_chunks_mut(kd)
                .enumerate()
                .for_each(|(t, row)| row.chunks_mut(hd).for_each(|h| table.apply(h, t)));
        }

        if !(q.par_iter().all(|x| x.is_finite()) && k.par_iter().all(|x| x.is_finite())) {
            return Err(self.non_finite_error(layer, "query/key projections"));
        }
        let scale = (hd as f32).powf(-0.5);
        let group = spec.group();
        let window = lspec.window;
        let tasks: Vec<(usize, usize)> = (0..self.prompts.len())
            .flat_map(|pi| (0..nh).map(move |h| (pi, h)))
            .collect();
        let prompts = &self.prompts;
        let results: Vec<(R, Vec<f32>)> = tasks
            .par_iter()
            .map(|&(pi, h)| {
                let range = &prompts[pi];
                let (off, len) = (range.start, range.len());
                let g = h / group;
                let view = |buf, width, head| head_view(buf, off, len, width, head * hd, hd);
                attend_head(
                    view(&q, qd, h),
                    view(&k, kd, g),
                    update_residual.then(|| view(&v, kd, g)),
                    scale,
                    window,
                    (pi, h),
                    visit,
                )
            })
            .collect();
        drop((q, k, v));
        if !update_residual {
            return Ok(AttentionOutput {
                heads: results.into_iter().map(|(out, _)| out).collect(),
                qk_norm: qk_stats,
            });
        }

        let mut ctx = vec![0f32; n * qd];
        let mut heads = Vec::with_capacity(results.len());
        for (&(pi, h), (out, block)) in tasks.iter().zip(results) {
            let off = self.prompts[pi].start;
            for (t, row) in block.chunks_exact(hd).enumerate() {
                let dst = (off + t) * qd + h * hd;
                ctx[dst..dst + hd].copy_from_slice(row);
            }
            heads.push(out);
        }
        let o_proj = model.linear(&format!("{p}.self_attn.o_proj"), hidden, qd, spec.o_bias)?;
        let mut o = o_proj.forward(&ctx, n);
        drop((o_proj, ctx));
        if spec.norm_placement == NormPlacement::PostNorm {
            let w = model.tensor(&format!("{p}.post_attention_layernorm.weight"), &[hidden])?;
            rms_norm_rows(&mut o, hidden, &w, eps);
        }
        add_assign(&mut self.x, &o);
        self.check_finite(layer, "attention")?;
        Ok(AttentionOutput {
            heads,
            qk_norm: qk_stats,
        })
    }

    /// Run layer `layer`'s feed-forward block (dense MLP or MoE) and its residual update.
    pub fn mlp(&mut self, layer: usize) -> Result<()> {
        let model = self.model;
        let spec = &model.spec;
        let hidden = spec.hidden_size;
        let n = self.x.len() / hidden;
        let eps = spec.rms_norm_eps;
        let p = Model::layer_prefix(layer);
        let mut y = match spec.norm_placement {
            NormPlacement::PreNorm => {
                let w = model.tensor(&format!("{p}.post_attention_layernorm.weight"), &[hidden])?;
                let h = rms_norm(&self.x, hidden, &w, eps);
                self.feed_forward(layer, &h, n)?
            }
            NormPlacement::PostNorm => self.feed_forward(layer, &self.x, n)?,
        };
        if spec.norm_placement == NormPlacement::PostNorm {
            let w = model.tensor(&format!("{p}.post_feedforward_layernorm.weight"), &[hidden])?;
            rms_norm_rows(&mut y, hidden, &w, eps);
        }
        add_assign(&mut self.x, &y);
        self.check_finite(layer, "MLP")
    }

    fn feed_forward(&self, layer: usize, h: &[f32], n: usize) -> Result<Vec<f32>> {
        let spec = &self.model.spec;
        let p = Model::layer_prefix(layer);
        match &spec.moe {
            Some(moe) if spec.layers[layer].moe => self.moe(&p, moe, h, n),
            _ => dense_mlp(
                self.model,
                &format!("{p}.mlp"),
                spec.hidden_size,
                spec.intermediate_size,
                spec.mlp_bias,
                h,
                n,
            ),
        }
    }

    /// Top-k routed experts (forward.md §1.10): f32 softmax over router logits, top k,
    /// optional renormalization, experts visited in ascending index and summed per token.
    fn moe(&self, p: &str, moe: &super::model::MoeSpec, h: &[f32], n: usize) -> Result<Vec<f32>> {
        let model = self.model;
        let hidden = model.spec.hidden_size;
        let e = moe.num_experts;
        let router = model.linear(&format!("{p}.mlp.gate"), e, hidden, false)?;
        let logits = router.forward(h, n);
        drop(router);
        // Per token: the chosen experts and their weights.
        let routes: Vec<Vec<(usize, f32)>> = logits
            .par_chunks(e)
            .map(|row| route(row, moe.top_k, moe.norm_topk_prob))
            .collect();
        let mut out = vec![0f32; n * hidden];
        for expert in 0..e {
            let tokens: Vec<(usize, f32)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, r)| r.iter().find(|(x, _)| *x == expert).map(|&(_, w)| (t, w)))
                .collect();
            if tokens.is_empty() {
                continue;
            }
            let mut gathered = Vec::with_capacity(tokens.len() * hidden);
            for &(t, _) in &tokens {
                gathered.extend_from_slice(&h[t * hidden..(t + 1) * hidden]);
            }
            let y = dense_mlp(
                model,
                &format!("{p}.mlp.experts.{expert}"),
                hidden,
                moe.expert_intermediate_size,
                false,
                &gathered,
                tokens.len(),
            )?;
            for (&(t, w), row) in tokens.iter().zip(y.chunks_exact(hidden)) {
                for (o, &v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(row) {
                    *o += v * w;
                }
            }
        }
        Ok(out)
    }

    /// Final norm and LM head: logits `[tokens, vocab]` (for parity checks; the scorer never
    /// needs them).
    pub fn logits(&self) -> Result<Vec<f32>> {
        let model = self.model;
        let spec = &model.spec;
        let hidden = spec.hidden_size;
        let n = self.x.len() / hidden;
        let w = model.tensor("model.norm.weight", &[hidden])?;
        let h = rms_norm(&self.x, hidden, &w, spec.rms_norm_eps);
        let head = if !spec.tie_word_embeddings && model.has("lm_head.weight") {
            "lm_head.weight"
        } else if spec.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            bail!(
                "{}: tensor `lm_head.weight` is missing and tie_word_embeddings is false",
                model.ckpt.dir.display()
            );
        };
        let rows = model.info(head)?.shape[0];
        let lm = Linear {
            weight: model.tensor(head, &[rows, hidden])?,
            out_features: rows,
            in_features: hidden,
            bias: None,
        };
        Ok(lm.forward(&h, n))
    }

    fn check_finite(&self, layer: usize, block: &str) -> Result<()> {
        if self.x.par_iter().all(|v| v.is_finite()) {
            return Ok(());
        }
        Err(self.non_finite_error(layer, &format!("{block} block")))
    }

    fn non_finite_error(&self, layer: usize, what: &str) -> crate::error::Error {
        let culprit = self
            .model
            .non_finite_tensor(layer)
            .map(|t| format!("{t} holds NaN or Inf"))
            .unwrap_or_else(|| {
                "no weight of the layer holds NaN/Inf, so activations overflowed f32".into()
            });
        bad!(
            "{}: values became NaN/Inf in layer {layer}'s {what}: {culprit}",
            self.model.ckpt.dir.display()
        )
    }
}

/// Rows `off..off+len`, columns `col..col+hd` of a row-major matrix of `width` columns.
fn head_view(
    buf: &[f32],
    off: usize,
    len: usize,
    width: usize,
    col: usize,
    hd: usize,
) -> MatRef<'_, f32> {
    MatRef::from_row_major_slice_with_stride(&buf[off * width + col..], len, hd, width)
}

fn add_bias_opt(y: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        super::kernels::add_bias(y, b);
    }
}

/// `min over rows of RMS(row[group]) / input_norm[row]`, per group of `group_len` columns.
fn min_rms_ratio(proj: &[f32], width: usize, group_len: usize, input_norms: &[f64]) -> Vec<f64> {
    let groups = width / group_len;
    proj.par_chunks(width)
        .zip(input_norms)
        .filter(|(_, &norm)| norm > 0.0)
        .map(|(row, &norm)| {
            row.chunks(group_len)
                .map(|g| {
                    let ms = g.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / group_len as f64;
                    ms.sqrt() / norm
                })
                .collect::<Vec<f64>>()
        })
        .reduce(
            || vec![f64::INFINITY; groups],
            |a, b| a.iter().zip(&b).map(|(x, y)| x.min(*y)).collect(),
        )
}

/// Tokens per chunk of the MLP: bounds its `[tokens, intermediate]` activations (2 x 155 MB at a
/// 7B's width) however many prompt tokens there are. Fixed, so results do not depend on threads.
const MLP_ROWS: usize = 1024;

/// `down(silu(gate(h)) * up(h))`, over chunks of [`MLP_ROWS`] tokens.
fn dense_mlp(
    model: &Model,
    prefix: &str,
    hidden: usize,
    inter: usize,
    bias: bool,
    h: &[f32],
    n: usize,
) -> Result<Vec<f32>> {
    let gate = model.linear(&format!("{prefix}.gate_proj"), inter, hidden, bias)?;
    let up = model.linear(&format!("{prefix}.up_proj"), inter, hidden, bias)?;
    let down = model.linear(&format!("{prefix}.down_proj"), hidden, inter, bias)?;
    let mut out = Vec::with_capacity(n * hidden);
    for chunk in h.chunks(MLP_ROWS * hidden) {
        let rows = chunk.len() / hidden;
        let mut a = gate.forward(chunk, rows);
        silu_mul(&mut a, &up.forward(chunk, rows));
        out.extend(down.forward(&a, rows));
    }
    Ok(out)
}

/// Router decision for one token: softmax in f32, top `k` (ties to the lower expert index),
/// renormalized if asked.
fn route(logits: &[f32], k: usize, renormalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut probs: Vec<(usize, f32)> = exps.iter().map(|&e| e / sum).enumerate().collect();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    probs.truncate(k);
    if renormalize {
        let total: f32 = probs.iter().map(|p| p.1).sum();
        for p in &mut probs {
            p.1 /= total;
        }
    }
    probs
}

/// Row-wise softmax over the keys each query sees (causal, and the sliding window if any);
/// masked entries are exactly 0, as `exp(finfo.min - max)` underflows to in transformers.
fn softmax_causal(scores: &[f32], len: usize, window: Option<usize>) -> Vec<f32> {
    let mut probs = vec![0f32; len * len];
    for q in 0..len {
        let lo = first_key(q, window);
        let row = &scores[q * len + lo..q * len + q + 1];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let out = &mut probs[q * len + lo..q * len + q + 1];
        let mut sum = 0f32;
        for (o, &s) in out.iter_mut().zip(row) {
            *o = (s - max).exp();
            sum += *o;
        }
        for o in out.iter_mut() {
            *o /= sum;
        }
    }
    probs
}

/// One head of one prompt (`q`, `k`, `v` are `[len, head_dim]` views): scores `q kᵀ · scale`,
/// the masked softmax, the visitor, and the head's context `P v` (`[len, head_dim]`, row-major;
/// empty without `v`). `at` is (prompt, head) for the visitor.
pub fn attend_head<R>(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: Option<MatRef<'_, f32>>,
    scale: f32,
    window: Option<usize>,
    at: (usize, usize),
    visit: &(dyn Fn(&HeadView) -> R + Sync),
) -> (R, Vec<f32>) {
    let (len, hd) = (q.nrows(), q.ncols());
    let mut scores = vec![0f32; len * len];
    matmul(
        MatMut::from_row_major_slice_mut(&mut scores, len, len),
        Accum::Replace,
        q,
        k.transpose(),
        scale,
        Par::Seq,
    );
    let probs = softmax_causal(&scores, len, window);
    let out = visit(&HeadView {
        prompt: at.0,
        head: at.1,
        len,
        scores: &scores,
        probs: &probs,
        window,
    });
    let Some(v) = v else {
        return (out, Vec::new());
    };
    let mut ctx = vec![0f32; len * hd];
    matmul(
        MatMut::from_row_major_slice_mut(&mut ctx, len, hd),
        Accum::Replace,
        MatRef::from_row_major_slice(&probs, len, len),
        v,
        1.0f32,
        Par::Seq,
    );
    (out, ctx)
}

/// Per-layer attention probabilities and final logits of a full forward pass: the library entry
/// point the parity tests compare against transformers.
pub struct Trace {
    /// `attentions[layer][prompt]` is `[heads, len, len]` row-major.
    pub attentions: Vec<Vec<Vec<f32>>>,
    /// `logits[prompt]` is `[len, vocab]`.
    pub logits: Vec<Vec<f32>>,
}

/// Run every layer (including the last MLP, final norm and LM head) and keep every attention
/// probability. Memory grows with layers x heads x len²: for tests and small inputs.
pub fn trace(ckpt: &Checkpoint, prompts: &[Vec<u32>]) -> Result<Trace> {
    let model = Model::new(ckpt)?;
    let mut state = State::new(&model, prompts)?;
    let nh = model.spec.num_heads;
    let mut attentions = Vec::with_capacity(model.spec.num_layers());
    for layer in 0..model.spec.num_layers() {
        let out = state.attention(layer, &|h: &HeadView| h.probs.to_vec(), true)?;
        let mut per_prompt: Vec<Vec<f32>> = vec![Vec::new(); prompts.len()];
        for (i, probs) in out.heads.into_iter().enumerate() {
            per_prompt[i / nh].extend(probs);
        }
        attentions.push(per_prompt);
        state.mlp(layer)?;
    }
    let all = state.logits()?;
    let vocab = all.len() / (state.x.len() / model.spec.hidden_size);
    let mut logits = Vec::with_capacity(prompts.len());
    for range in &state.prompts {
        logits.push(all[range.start * vocab..range.end * vocab].to_vec());
    }
    Ok(Trace { attentions, logits })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_respects_causality_and_window() {
        let scores: Vec<f32> = (0..16).map(|i| i as f32 * 0.1).collect();
        let p = softmax_causal(&scores, 4, Some(2));
        for q in 0..4 {
            let row = &p[q * 4..q * 4 + 4];
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            for (k, &v) in row.iter().enumerate() {
                assert_eq!(v == 0.0, k > q || k + 2 <= q, "q {q} k {k}");
            }
        }
    }

    #[test]
    fn router_takes_top_k_and_renormalizes() {
        let r = route(&[0.0, 2.0, 1.0, 2.0], 2, true);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!((r[0].1 - 0.5).abs() < 1e-6 && (r[1].1 - 0.5).abs() < 1e-6);
        let r = route(&[0.0, 2.0, 1.0], 1, false);
        assert!(r[0].1 < 1.0);
    }
}
