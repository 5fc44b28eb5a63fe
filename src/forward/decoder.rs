//! The decoder recipe: one layer of the forward pass at a time (f32 or bf16, eager attention, no
//! cache, batch of one per prompt), following transformers' eager path step by step
//! (`docs/reference/forward.md`, "Step list"), written once over the [`Backend`] seam.
//!
//! A [`State`] holds the hidden states of every prompt, packed as one `[tokens, hidden]` matrix so
//! the projections run as one large GEMM. [`State::attention`] loads a layer's attention weights
//! from the [`Model`], computes every prompt's and head's scores and probabilities, hands each
//! head to a visitor (the metric accumulators, or a probability dump for tests) and drops the
//! weights; [`State::mlp`] does the same for the feed-forward block; [`State::logits`] runs the
//! final norm and LM head. What a layer may do besides: edit its keys ([`KeyEdit`]), keep its keys
//! and values ([`State::capture_kv`]), have rows replaced or added ([`State::replace_rows`],
//! [`State::add_rows`]). The loop over layers is [`crate::forward::pass`]'s.

use std::ops::Range;

use rayon::prelude::*;

use super::backend::{Attended, AttentionShape, Backend, RopeTable, Visitor};
use super::cache::KvCache;
use super::model::{LayerSpec, MoeSpec, NormPlacement};
use super::resident::Resident;
use super::rope::frequencies;
use super::weights::Model;
use crate::arch::config::RopeScaling;
use crate::arch::QkNorm;
use crate::bail;
use crate::dtype;
use crate::error::Result;

/// Theorem-1 ingredients of one layer with QK norms (docs/commands/score.md#the-metrics,
/// docs/reference/theory.md; paper Appendix A.3).
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
    /// Per-head diagnostics of layerwise norms (OLMo-2/3, Molmo), `None` for per-head norms.
    pub layerwise: Option<LayerwiseHeads>,
}

/// How a layerwise QK norm (one RMSNorm over all heads' projections) treats each head (paper
/// Remark 1, Appendix A.5). Head h's normalized slice is `γ_h ⊙ q_h / RMS(q)`, so its norm is at
/// most `||γ_h||_∞ · sqrt(ρ_h · n)` for the projection width n: a head that carries little of
/// the layer's energy `ρ_h = ||q_h||² / ||q||²` is scaled down with it, unlike under per-head
/// norms.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LayerwiseHeads {
    /// Per query head: the mean over calibration tokens of `ρ_h`, and its maximum.
    pub rho_q: Vec<f64>,
    pub rho_q_max: Vec<f64>,
    /// Per query head: `max |γ|` over its slice of `q_norm.weight`.
    pub gamma_q_head_inf: Vec<f64>,
    /// The same for the key/value heads and `k_norm`.
    pub rho_k: Vec<f64>,
    pub rho_k_max: Vec<f64>,
    pub gamma_k_head_inf: Vec<f64>,
}

/// Per head: the mean and the maximum over rows (tokens) of the head's share of the row's
/// squared norm; rows of zero norm are skipped.
fn energy_shares(rows: &[f32], width: usize, head_dim: usize) -> (Vec<f64>, Vec<f64>) {
    let heads = width / head_dim;
    let (mut sum, mut max, mut n) = (vec![0f64; heads], vec![0f64; heads], 0usize);
    for row in rows.chunks(width) {
        let energy: Vec<f64> = row
            .chunks(head_dim)
            .map(|h| h.iter().map(|&v| v as f64 * v as f64).sum())
            .collect();
        let total: f64 = energy.iter().sum();
        if total > 0.0 {
            n += 1;
            for (h, e) in energy.iter().enumerate() {
                sum[h] += e / total;
                max[h] = max[h].max(e / total);
            }
        }
    }
    (sum.iter().map(|s| s / n.max(1) as f64).collect(), max)
}

/// `max |γ|` over each head's slice of a norm weight.
fn head_inf_norms(weight: &[f32], head_dim: usize) -> Vec<f64> {
    weight
        .chunks(head_dim)
        .map(|h| h.iter().fold(0f64, |m, &v| m.max(v.abs() as f64)))
        .collect()
}

/// What [`State::attention`] returns: each visited head's result, in prompt-major order
/// (`index = prompt * num_heads + head`), and the QK-norm statistics where the model has them.
pub struct AttentionOutput<R> {
    pub heads: Vec<R>,
    pub qk_norm: Option<QkNormStats>,
}

/// Every prompt's hidden states for one model, between layers.
pub struct State<'m, 'a, B: Backend> {
    model: &'m Model<'a>,
    backend: &'m B,
    /// Row range of each prompt in `x`.
    prompts: Vec<Range<usize>>,
    /// `[tokens, hidden]`.
    x: B::Tensor,
    /// Rows of `x`.
    rows: usize,
    /// RoPE tables built so far, keyed by (rope, the sequence length that matters for it), and
    /// for prompts with M-RoPE positions by the prompt too.
    ropes: Vec<(LayerRopeKey, RopeTable)>,
    /// Each prompt's M-RoPE positions (`position_ids [3, len]`) when it holds images; `None`:
    /// positions `0..len` on every axis.
    mrope: Vec<Option<[Vec<i64>; 3]>>,
    /// The layers whose keys and values [`State::attention`] keeps, and what it kept.
    capture: Option<KvCapture>,
    /// An edit of every layer's keys inside the pass (`visual-sinks --edit`).
    key_edit: Option<&'m dyn KeyEdit>,
    /// A decode's KV cache: the rows are the positions after the cached ones, and attend them.
    cache: Option<KvCache<B::Tensor>>,
    /// The position of row 0: the cached positions (0 without a cache).
    offset: usize,
    /// A decode's held weights (`None`: each block reads its own and drops them).
    resident: Option<&'m Resident<'a, B>>,
}

/// Where in a layer's attention a [`KeyEdit`] acts: on the keys after their bias and k-norm,
/// before or after RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStage {
    PreRope,
    PostRope,
}

/// An edit of the keys inside the forward pass (`docs/reference/visual-sinks.md`, "The key
/// edit"): called once per layer with the layer's keys `[tokens, kv_heads · head_dim]` on the
/// host, which it may change in place.
pub trait KeyEdit: Sync {
    fn stage(&self) -> KeyStage;
    fn edit(&self, layer: usize, keys: &mut [f32]) -> Result<()>;
}

/// One layer's keys and values as `trace` writes them, host copies of the backend's
/// `[tokens, kv_heads · head_dim]` matrices.
#[derive(Debug, Clone)]
pub struct CapturedKv {
    pub layer: usize,
    /// After the bias and any QK norm, before RoPE.
    pub keys_pre_rope: Vec<f32>,
    /// After RoPE, as transformers' KV cache holds them.
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

/// Which layers to keep keys and values of, and what was kept.
#[derive(Debug, Default)]
struct KvCapture {
    layers: Vec<bool>,
    kept: Vec<CapturedKv>,
}

#[derive(Debug, Clone, PartialEq)]
struct LayerRopeKey {
    rope: crate::arch::config::Rope,
    /// Sequence length for dynamic NTK scaling; 0 for the others.
    seq_len: usize,
    /// The prompt whose M-RoPE positions the table holds; `None` for position-indexed tables.
    prompt: Option<usize>,
}

impl<'m, 'a, B: Backend> State<'m, 'a, B> {
    /// Embed `prompts` (token ids). Every id must index the embedding matrix. The rows are
    /// gathered on the host, so only the prompts' rows of the embedding ever reach the backend.
    pub fn new(
        model: &'m Model<'a>,
        backend: &'m B,
        prompts: &[Vec<u32>],
    ) -> Result<State<'m, 'a, B>> {
        Self::embed(model, backend, prompts, None)
    }

    /// [`State::new`] for a decode: every weight comes from `resident`, and the embedding's
    /// mapped pages stay (a tied LM head reads them every step).
    pub fn with_weights(
        model: &'m Model<'a>,
        backend: &'m B,
        prompts: &[Vec<u32>],
        resident: &'m Resident<'a, B>,
    ) -> Result<State<'m, 'a, B>> {
        Self::embed(model, backend, prompts, Some(resident))
    }

    fn embed(
        model: &'m Model<'a>,
        backend: &'m B,
        prompts: &[Vec<u32>],
        resident: Option<&'m Resident<'a, B>>,
    ) -> Result<State<'m, 'a, B>> {
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
        if resident.is_none() {
            model.ckpt.release(stored);
        }
        let mut x = backend.upload(x)?;
        backend.round(&mut x)?;
        Ok(State {
            model,
            backend,
            prompts: ranges,
            x,
            rows: total,
            ropes: Vec::new(),
            mrope: vec![None; prompts.len()],
            capture: None,
            key_edit: None,
            cache: None,
            offset: 0,
            resident,
        })
    }

    /// Read every weight from `resident` from here on (a prompt's pass streamed its layers; its
    /// head is the decode's).
    pub fn use_weights(&mut self, resident: &'m Resident<'a, B>) {
        self.resident = Some(resident);
    }

    /// Run the rows after the positions `cache` holds, attending them: one prompt's next tokens.
    /// Its rows' keys and values join the cache; [`State::take_cache`] hands it back.
    pub fn attach_cache(&mut self, cache: KvCache<B::Tensor>) -> Result<()> {
        if self.prompts.len() != 1 {
            bail!("a KV cache serves one sequence, not {}", self.prompts.len());
        }
        if cache.len() + self.rows > cache.capacity() {
            bail!(
                "{} positions after the {} cached exceed the KV cache's {}",
                self.rows,
                cache.len(),
                cache.capacity()
            );
        }
        self.offset = cache.len();
        self.cache = Some(cache);
        Ok(())
    }

    /// The KV cache, with this state's rows counted in it once every layer has run.
    pub fn take_cache(&mut self) -> Option<KvCache<B::Tensor>> {
        let mut cache = self.cache.take()?;
        cache.advance(self.rows);
        Some(cache)
    }

    /// Give prompt `prompt` the M-RoPE positions of transformers' `get_rope_index` (a VLM prompt
    /// with images); used by layers whose rope has `mrope_section`.
    pub fn set_mrope_positions(&mut self, prompt: usize, positions: [Vec<i64>; 3]) -> Result<()> {
        let len = self.prompts[prompt].len();
        if positions.iter().any(|axis| axis.len() != len) {
            bail!(
                "prompt {}: M-RoPE positions for {len} tokens expected",
                prompt + 1
            );
        }
        self.mrope[prompt] = Some(positions);
        Ok(())
    }

    /// Replace the hidden states of the packed `rows` by `values` (`[rows, hidden]`): the image
    /// tokens' embeddings become the vision tower's output.
    pub fn replace_rows(&mut self, rows: &[u32], values: &[f32]) -> Result<()> {
        let hidden = self.model.spec.hidden_size;
        if values.len() != rows.len() * hidden {
            bail!(
                "{} image rows of width {hidden} expected, got {} values",
                rows.len(),
                values.len()
            );
        }
        let mut x = self.backend.to_host(&self.x)?.into_owned();
        for (&r, v) in rows.iter().zip(values.chunks_exact(hidden)) {
            let r = r as usize;
            x[r * hidden..(r + 1) * hidden].copy_from_slice(v);
        }
        self.x = self.backend.upload(x)?;
        self.backend.round(&mut self.x)
    }

    /// `x[rows] += values` (`[rows, hidden]`): Qwen3-VL's deepstack features after a layer.
    pub fn add_rows(&mut self, rows: &[u32], values: Vec<f32>) -> Result<()> {
        let hidden = self.model.spec.hidden_size;
        let y = self.backend.upload(values)?;
        let ones = vec![1f32; rows.len()];
        self.backend
            .scatter_add_rows(&mut self.x, &y, hidden, rows, &ones)
    }

    /// Keep the keys and values of the layers flagged in `layers` (see [`State::take_kv`]).
    pub fn capture_kv(&mut self, layers: Vec<bool>) {
        self.capture = Some(KvCapture {
            layers,
            kept: Vec::new(),
        });
    }

    /// The keys and values kept since [`State::capture_kv`], in layer order.
    pub fn take_kv(&mut self) -> Vec<CapturedKv> {
        self.capture
            .as_mut()
            .map(|c| std::mem::take(&mut c.kept))
            .unwrap_or_default()
    }

    /// Edit every layer's keys with `edit` from here on.
    pub fn set_key_edit(&mut self, edit: &'m dyn KeyEdit) {
        self.key_edit = Some(edit);
    }

    /// Run the key edit on `k` if it acts at `stage`; the result is rounded to the precision.
    /// Over a KV cache the edit acts on the rows from position 0 (a decode's prefill), where the
    /// prompt's image keys are: the cache then carries the edited keys into every later step.
    fn edit_keys(&self, layer: usize, k: &mut B::Tensor, stage: KeyStage) -> Result<()> {
        let Some(edit) = self.key_edit.filter(|e| e.stage() == stage) else {
            return Ok(());
        };
        if self.offset > 0 {
            return Ok(());
        }
        let mut host = self.backend.to_host(k)?.into_owned();
        edit.edit(layer, &mut host)?;
        *k = self.backend.upload(host)?;
        self.backend.round(k)
    }

    /// The rows (tokens) this state runs.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The position of row 0: the positions already in the attached KV cache (0 without one).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The model whose layers this state runs.
    pub fn model(&self) -> &'m Model<'a> {
        self.model
    }

    /// The hidden states `[tokens, hidden]` on the host (transformers' `hidden_states[L]` after
    /// L layers).
    pub fn hidden(&self) -> Result<Vec<f32>> {
        Ok(self.backend.to_host(&self.x)?.into_owned())
    }

    fn weight(&self, name: &str, shape: &[usize]) -> Result<Held<'m, B::Tensor>> {
        if let Some(r) = self.resident {
            if let Some(v) = r.vector(self.model, name, shape)? {
                return Ok(Held::Resident(v));
            }
        }
        self.backend.load(self.model, name, shape).map(Held::Read)
    }

    fn matrix(&self, name: &str, shape: &[usize]) -> Result<Matrix<'m, 'a, B>> {
        if let Some(r) = self.resident {
            if let Some(w) = r.matrix(self.model, name, shape)? {
                return Ok(Matrix::Stored(w));
            }
        }
        self.backend.load(self.model, name, shape).map(Matrix::Read)
    }

    /// `input Wᵀ` for the `[out, in]` weight `{prefix}.weight`; `input` has every token's row.
    fn project(
        &self,
        input: &B::Tensor,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<B::Tensor> {
        self.product(&self.linear(prefix, out, inp, false)?, input, self.rows)
    }

    /// `x Wᵀ` of `rows` rows, not rounded.
    fn product(
        &self,
        l: &LinearWeights<'m, 'a, B>,
        x: &B::Tensor,
        rows: usize,
    ) -> Result<B::Tensor> {
        match &l.weight {
            Matrix::Read(w) => self.backend.linear(x, rows, w, l.out, l.inp),
            Matrix::Stored(w) => self.backend.linear_stored(x, rows, w, l.out, l.inp),
        }
    }

    /// The linear layer `{prefix}` (`[out, in]` weight, and its bias if `bias`).
    fn linear(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<LinearWeights<'m, 'a, B>> {
        Ok(LinearWeights {
            weight: self.matrix(&format!("{prefix}.weight"), &[out, inp])?,
            bias: if bias {
                Some(self.weight(&format!("{prefix}.bias"), &[out])?)
            } else {
                None
            },
            out,
            inp,
        })
    }

    /// `x Wᵀ + b` of `rows` rows, rounded to the precision once, after the bias.
    fn apply(&self, l: &LinearWeights<'m, 'a, B>, x: &B::Tensor, rows: usize) -> Result<B::Tensor> {
        let be = self.backend;
        let mut y = self.product(l, x, rows)?;
        if let Some(b) = &l.bias {
            be.add_bias(&mut y, b, l.out)?;
        }
        be.round(&mut y)?;
        Ok(y)
    }

    /// `input Wᵀ + b` for the layer `{prefix}`, over every token's row (see [`State::apply`]).
    fn project_bias(
        &self,
        input: &B::Tensor,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<B::Tensor> {
        self.apply(&self.linear(prefix, out, inp, bias)?, input, self.rows)
    }

    fn rope_index(&mut self, layer: &LayerSpec, prompt: usize) -> Result<usize> {
        let spec = &self.model.spec;
        // Dynamic NTK scaling follows the whole sequence, the cached positions included.
        let len = self.offset + self.prompts[prompt].len();
        let seq_len = match layer.rope.scaling {
            RopeScaling::Dynamic { .. } => len.max(spec.max_position_embeddings),
            _ => 0,
        };
        let mrope = match (&layer.rope.scaling, &self.mrope[prompt]) {
            (
                RopeScaling::Mrope {
                    sections,
                    interleaved,
                },
                Some(positions),
            ) => Some((sections, *interleaved, positions)),
            _ => None,
        };
        let key = LayerRopeKey {
            rope: layer.rope.clone(),
            seq_len,
            prompt: mrope.is_some().then_some(prompt),
        };
        if let Some(i) = self.ropes.iter().position(|(k, _)| *k == key) {
            return Ok(i);
        }
        let freq = frequencies(
            &layer.rope,
            spec.head_dim,
            spec.max_position_embeddings,
            len,
        )?;
        let table = match mrope {
            Some((sections, interleaved, positions)) => {
                RopeTable::mrope(&freq, positions, sections, interleaved)
            }
            None => {
                let max_len = self.prompts.iter().map(|r| r.len()).max().unwrap_or(0);
                RopeTable::span(&freq, self.offset..self.offset + max_len)
            }
        };
        self.ropes.push((key, table));
        Ok(self.ropes.len() - 1)
    }

    /// Run layer `layer`'s attention block: every prompt's and head's scores and probabilities go
    /// to `visit` (results come back in prompt-major order), then, if `update_residual`, the
    /// values, output projection and residual update (the last layer of a scoring pass skips
    /// them: nothing downstream reads them). The layer's attention weights are dropped on
    /// return.
    pub fn attention<R: Send>(
        &mut self,
        layer: usize,
        visit: &Visitor<R>,
        update_residual: bool,
    ) -> Result<AttentionOutput<R>> {
        let model = self.model;
        let be = self.backend;
        let spec = &model.spec;
        let lspec = &spec.layers[layer];
        let (hidden, nh, nkv, hd) = (
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        );
        let (qd, kd) = (nh * hd, nkv * hd);
        let (eps, style) = (spec.rms_norm_eps, spec.bf16_style);
        let p = Model::layer_prefix(layer);

        // Attention input: the normalized residual (pre-norm) or the residual itself (OLMo-2/3).
        let normed = match spec.norm_placement {
            NormPlacement::PreNorm => {
                let w = self.weight(&format!("{p}.input_layernorm.weight"), &[hidden])?;
                Some(be.rms_norm(&self.x, hidden, &w, eps, style)?)
            }
            NormPlacement::PostNorm => None,
        };
        let input = normed.as_ref().unwrap_or(&self.x);

        let mut q = self.project(input, &format!("{p}.self_attn.q_proj"), qd, hidden)?;
        let mut k = self.project(input, &format!("{p}.self_attn.k_proj"), kd, hidden)?;
        let mut v = if update_residual {
            let prefix = format!("{p}.self_attn.v_proj");
            Some(self.project_bias(input, &prefix, kd, hidden, spec.qkv_bias)?)
        } else {
            None
        };

        let (q_norm_len, k_norm_len) = match spec.qk_norm {
            QkNorm::PerHead => (hd, hd),
            QkNorm::Layerwise => (qd, kd),
            QkNorm::None => (0, 0),
        };
        // The Theorem-1 ratios use the projections before their bias is added.
        let qk_stats = if spec.qk_norm != QkNorm::None {
            let input_norms: Vec<f64> = be
                .to_host(input)?
                .par_chunks(hidden)
                .map(|r| r.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt())
                .collect();
            Some((
                min_rms_ratio(&be.to_host(&q)?, qd, q_norm_len, &input_norms),
                min_rms_ratio(&be.to_host(&k)?, kd, k_norm_len, &input_norms),
            ))
        } else {
            None
        };
        drop(normed);
        if spec.qkv_bias {
            let bq = self.weight(&format!("{p}.self_attn.q_proj.bias"), &[qd])?;
            be.add_bias(&mut q, &bq, qd)?;
            let bk = self.weight(&format!("{p}.self_attn.k_proj.bias"), &[kd])?;
            be.add_bias(&mut k, &bk, kd)?;
        }
        be.round(&mut q)?;
        be.round(&mut k)?;
        // Energy shares of what the layerwise norm normalizes: the projections with their bias.
        let shares = if spec.qk_norm == QkNorm::Layerwise {
            Some((
                energy_shares(&be.to_host(&q)?, qd, hd),
                energy_shares(&be.to_host(&k)?, kd, hd),
            ))
        } else {
            None
        };
        let qk_stats = match qk_stats {
            Some((m_q, m_k)) => {
                let wq = self.weight(&format!("{p}.self_attn.q_norm.weight"), &[q_norm_len])?;
                let wk = self.weight(&format!("{p}.self_attn.k_norm.weight"), &[k_norm_len])?;
                be.rms_norm_rows(&mut q, q_norm_len, &wq, eps, style)?;
                be.rms_norm_rows(&mut k, k_norm_len, &wk, eps, style)?;
                let (wq, wk) = (be.to_host(&wq)?, be.to_host(&wk)?);
                let inf_norm = |w: &[f32]| w.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
                Some(QkNormStats {
                    gamma_q_inf: inf_norm(&wq),
                    gamma_k_inf: inf_norm(&wk),
                    m_q,
                    m_k,
                    layerwise: shares.map(|((rho_q, rho_q_max), (rho_k, rho_k_max))| {
                        LayerwiseHeads {
                            rho_q,
                            rho_q_max,
                            gamma_q_head_inf: head_inf_norms(&wq, hd),
                            rho_k,
                            rho_k_max,
                            gamma_k_head_inf: head_inf_norms(&wk, hd),
                        }
                    }),
                })
            }
            None => None,
        };
        if let Some(c) = spec.clip_qkv {
            be.clamp(&mut q, c)?;
            be.clamp(&mut k, c)?;
            if let Some(v) = &mut v {
                be.clamp(v, c)?;
            }
        }

        // RoPE, per prompt (dynamic scaling depends on the prompt's length).
        let tables: Vec<usize> = (0..self.prompts.len())
            .map(|pi| self.rope_index(lspec, pi))
            .collect::<Result<_>>()?;
        let segments: Vec<(Range<usize>, &RopeTable)> = self
            .prompts
            .iter()
            .zip(&tables)
            .map(|(r, &t)| (r.clone(), &self.ropes[t].1))
            .collect();
        self.edit_keys(layer, &mut k, KeyStage::PreRope)?;
        let keep = self
            .capture
            .as_ref()
            .is_some_and(|c| c.layers.get(layer).copied().unwrap_or(false));
        let keys_pre_rope = if keep {
            Some(be.to_host(&k)?.into_owned())
        } else {
            None
        };
        be.rope(&mut q, qd, hd, &segments, style)?;
        be.rope(&mut k, kd, hd, &segments, style)?;
        self.edit_keys(layer, &mut k, KeyStage::PostRope)?;
        if let (Some(keys_pre_rope), Some(capture)) = (keys_pre_rope, self.capture.as_mut()) {
            capture.kept.push(CapturedKv {
                layer,
                keys_pre_rope,
                keys: be.to_host(&k)?.into_owned(),
                values: match &v {
                    Some(v) => be.to_host(v)?.into_owned(),
                    None => Vec::new(),
                },
            });
        }

        if !(be.all_finite(&q)? && be.all_finite(&k)?) {
            return Err(self.non_finite_error(layer, "query/key projections"));
        }
        let attended = match (&mut self.cache, &v) {
            (Some(cache), Some(v)) => {
                cache.write(be, layer, &k, v, self.rows)?;
                let (keys, values) = cache.layer(layer);
                let shape = cache.shape(nh, self.rows, lspec.window);
                be.attention_cached(&q, keys, values, &shape, visit)?
            }
            _ => {
                let shape = AttentionShape {
                    prompts: &self.prompts,
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: hd,
                    causal: true,
                    window: lspec.window,
                    scale: (hd as f32).powf(-0.5),
                };
                be.attention(&q, &k, v.as_ref(), &shape, visit)?
            }
        };
        let attended: Attended<R, B::Tensor> = attended;
        drop((q, k, v));
        let Some(ctx) = attended.context else {
            return Ok(AttentionOutput {
                heads: attended.heads,
                qk_norm: qk_stats,
            });
        };
        let prefix = format!("{p}.self_attn.o_proj");
        let mut o = self.project_bias(&ctx, &prefix, hidden, qd, spec.o_bias)?;
        drop(ctx);
        if spec.norm_placement == NormPlacement::PostNorm {
            let w = self.weight(&format!("{p}.post_attention_layernorm.weight"), &[hidden])?;
            be.rms_norm_rows(&mut o, hidden, &w, eps, style)?;
        }
        be.add_assign(&mut self.x, &o)?;
        self.check_finite(layer, "attention")?;
        Ok(AttentionOutput {
            heads: attended.heads,
            qk_norm: qk_stats,
        })
    }

    /// Run layer `layer`'s feed-forward block (dense MLP or MoE) and its residual update.
    pub fn mlp(&mut self, layer: usize) -> Result<()> {
        let be = self.backend;
        let spec = &self.model.spec;
        let hidden = spec.hidden_size;
        let (eps, style) = (spec.rms_norm_eps, spec.bf16_style);
        let p = Model::layer_prefix(layer);
        let mut y = match spec.norm_placement {
            NormPlacement::PreNorm => {
                let w = self.weight(&format!("{p}.post_attention_layernorm.weight"), &[hidden])?;
                let h = be.rms_norm(&self.x, hidden, &w, eps, style)?;
                self.feed_forward(layer, &h)?
            }
            NormPlacement::PostNorm => self.feed_forward(layer, &self.x)?,
        };
        if spec.norm_placement == NormPlacement::PostNorm {
            let w = self.weight(&format!("{p}.post_feedforward_layernorm.weight"), &[hidden])?;
            be.rms_norm_rows(&mut y, hidden, &w, eps, style)?;
        }
        be.add_assign(&mut self.x, &y)?;
        self.check_finite(layer, "MLP")
    }

    fn feed_forward(&self, layer: usize, h: &B::Tensor) -> Result<B::Tensor> {
        let spec = &self.model.spec;
        let p = Model::layer_prefix(layer);
        match &spec.moe {
            Some(moe) if spec.layers[layer].moe => self.moe(&p, moe, h),
            _ => self.dense_mlp(
                &format!("{p}.mlp"),
                spec.intermediate_size,
                spec.mlp_bias,
                h,
                self.rows,
            ),
        }
    }

    /// `down(act(gate(h)) * up(h))` of `rows` tokens, over chunks of [`MLP_ROWS`] tokens.
    fn dense_mlp(
        &self,
        prefix: &str,
        inter: usize,
        bias: bool,
        h: &B::Tensor,
        rows: usize,
    ) -> Result<B::Tensor> {
        let hidden = self.model.spec.hidden_size;
        let gate = self.linear(&format!("{prefix}.gate_proj"), inter, hidden, bias)?;
        let up = self.linear(&format!("{prefix}.up_proj"), inter, hidden, bias)?;
        let down = self.linear(&format!("{prefix}.down_proj"), hidden, inter, bias)?;
        self.gated_mlp(&[gate, up, down], h, rows)
    }

    /// `down(act(gate(h)) * up(h))` with the weights `[gate, up, down]`, over chunks of
    /// [`MLP_ROWS`] tokens (`act` the spec's `hidden_act`).
    fn gated_mlp(
        &self,
        [gate, up, down]: &[LinearWeights<'m, 'a, B>; 3],
        h: &B::Tensor,
        rows: usize,
    ) -> Result<B::Tensor> {
        let be = self.backend;
        let hidden = self.model.spec.hidden_size;
        let chunk = |x: &B::Tensor, n: usize| -> Result<B::Tensor> {
            let mut a = self.apply(gate, x, n)?;
            be.act_mul(&mut a, &self.apply(up, x, n)?, self.model.spec.hidden_act)?;
            self.apply(down, &a, n)
        };
        if rows <= MLP_ROWS {
            return chunk(h, rows);
        }
        let parts = (0..rows)
            .step_by(MLP_ROWS)
            .map(|start| {
                let end = (start + MLP_ROWS).min(rows);
                chunk(&be.slice_rows(h, hidden, start..end)?, end - start)
            })
            .collect::<Result<Vec<_>>>()?;
        be.concat_rows(parts)
    }

    /// Top-k routed experts (`docs/reference/forward.md`, "MoE routing"): f32 softmax over router logits,
    /// top k, optional renormalization, experts visited in ascending index and summed per token.
    /// Routing runs on the host, so every backend makes the same choices (ties included).
    fn moe(&self, p: &str, moe: &MoeSpec, h: &B::Tensor) -> Result<B::Tensor> {
        let be = self.backend;
        let hidden = self.model.spec.hidden_size;
        let e = moe.num_experts;
        let logits = self.project_bias(h, &format!("{p}.mlp.gate"), e, hidden, false)?;
        // Per token: the chosen experts and their weights.
        let routes: Vec<Vec<(usize, f32)>> = be
            .to_host(&logits)?
            .par_chunks(e)
            .map(|row| route(row, moe.top_k, moe.norm_topk_prob))
            .collect();
        drop(logits);
        let fused = self.fused_experts(p, moe)?;
        let mut out = be.zeros(self.rows, hidden)?;
        for expert in 0..e {
            let (tokens, weights): (Vec<u32>, Vec<f32>) = routes
                .iter()
                .enumerate()
                .filter_map(|(t, r)| {
                    r.iter()
                        .find(|(x, _)| *x == expert)
                        .map(|&(_, w)| (t as u32, w))
                })
                .unzip();
            if tokens.is_empty() {
                continue;
            }
            let gathered = be.gather_rows(h, hidden, &tokens)?;
            let y = match &fused {
                Some(f) => self.gated_mlp(&f.expert(be, expert)?, &gathered, tokens.len())?,
                None => self.dense_mlp(
                    &format!("{p}.mlp.experts.{expert}"),
                    moe.expert_intermediate_size,
                    false,
                    &gathered,
                    tokens.len(),
                )?,
            };
            be.scatter_add_rows(&mut out, &y, hidden, &tokens, &weights)?;
        }
        Ok(out)
    }

    /// The layer's experts when stored fused (Qwen3-VL-MoE: `mlp.experts.gate_up_proj` and
    /// `mlp.experts.down_proj`), read once for the layer; `None` for per-expert tensors.
    /// transformers 5.x stores `[E, 2I, H]` and `[E, H, I]` (`nn.functional.linear` per expert,
    /// `gate, up = chunk(2)`); the original Hub release `[E, H, 2I]` and `[E, I, H]` (a bmm). The
    /// orientation is read from whichever shape tells them apart.
    fn fused_experts(&self, p: &str, moe: &MoeSpec) -> Result<Option<FusedExperts>> {
        let model = self.model;
        let per_expert = format!("{p}.mlp.experts.0.gate_proj.weight");
        if model.has(&per_expert) {
            return Ok(None);
        }
        let suffix = |what: &str| format!("{}.mlp.experts.{what}", &p["model.".len()..]);
        let find = |what: &str| {
            let suffix = suffix(what);
            model
                .ckpt
                .names()
                .iter()
                .find(|n| n.ends_with(&suffix))
                .cloned()
        };
        let (Some(gate_up), Some(down)) = (find("gate_up_proj"), find("down_proj")) else {
            // Neither layout: the missing per-expert tensor is the clearest error.
            model.stored_name(&per_expert)?;
            return Ok(None);
        };
        let (e, h, i) = (
            moe.num_experts,
            model.spec.hidden_size,
            moe.expert_intermediate_size,
        );
        let gu_shape = &model.ckpt.require(&gate_up)?.shape;
        let down_shape = &model.ckpt.require(&down)?.shape;
        let out_in = gu_shape == &[e, 2 * i, h] && down_shape == &[e, h, i];
        let in_out = gu_shape == &[e, h, 2 * i] && down_shape == &[e, i, h];
        let transposed = match (out_in, in_out) {
            (true, false) => false,
            (false, true) => true,
            _ => bail!(
                "{} {gu_shape:?} and {} {down_shape:?}: expected [{e}, {}, {h}] and [{e}, {h}, {i}] \
                 (transformers 5.x) or [{e}, {h}, {}] and [{e}, {i}, {h}] (Hub) for the config's \
                 experts, hidden_size and moe_intermediate_size",
                model.ckpt.describe(&gate_up),
                model.ckpt.describe(&down),
                2 * i,
                2 * i
            ),
        };
        let gate_up_values = model.tensor(&gate_up, gu_shape)?;
        let down_values = model.tensor(&down, down_shape)?;
        Ok(Some(FusedExperts {
            gate_up: gate_up_values,
            down: down_values,
            transposed,
            hidden: h,
            inter: i,
        }))
    }

    /// Final norm and LM head: logits `[tokens, vocab]` on the host (for parity checks and the
    /// text loss; the sink scorer never needs them).
    pub fn logits(&self) -> Result<Vec<f32>> {
        self.lm_head(&self.final_norm()?, self.rows)
    }

    /// The logits `[vocab]` of the last token only (the next token's), without the
    /// `[tokens, vocab]` matrix.
    pub fn last_logits(&self) -> Result<Vec<f32>> {
        let hidden = self.model.spec.hidden_size;
        let h = self.final_norm()?;
        let last = self
            .backend
            .slice_rows(&h, hidden, self.rows - 1..self.rows)?;
        self.lm_head(&last, 1)
    }

    /// The final norm's output `[tokens, hidden]` (transformers' last `hidden_states` entry) and
    /// the logits `[tokens, vocab]`, on the host.
    pub fn final_hidden_and_logits(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let h = self.final_norm()?;
        let logits = self.lm_head(&h, self.rows)?;
        Ok((self.backend.to_host(&h)?.into_owned(), logits))
    }

    fn final_norm(&self) -> Result<B::Tensor> {
        let spec = &self.model.spec;
        let hidden = spec.hidden_size;
        let w = self.weight("model.norm.weight", &[hidden])?;
        self.backend
            .rms_norm(&self.x, hidden, &w, spec.rms_norm_eps, spec.bf16_style)
    }

    /// The LM head on the final norm's output `h`.
    /// The logits of the `rows` rows of `h`.
    fn lm_head(&self, h: &B::Tensor, rows: usize) -> Result<Vec<f32>> {
        let model = self.model;
        let be = self.backend;
        let spec = &model.spec;
        let hidden = spec.hidden_size;
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
        // A header's shape may have any rank: `weight` refuses one that is not [rows, hidden].
        let vocab = model.info(head)?.shape.first().copied().unwrap_or(0);
        let lm = LinearWeights {
            weight: self.matrix(head, &[vocab, hidden])?,
            bias: None,
            out: vocab,
            inp: hidden,
        };
        let mut logits = self.product(&lm, h, rows)?;
        be.round(&mut logits)?;
        Ok(be.to_host(&logits)?.into_owned())
    }

    fn check_finite(&self, layer: usize, block: &str) -> Result<()> {
        if self.backend.all_finite(&self.x)? {
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
        crate::non_finite!(
            "{}: values became NaN/Inf in layer {layer}'s {what}: {culprit}",
            self.model.ckpt.dir.display()
        )
    }
}

/// One layer's fused expert weights on the host (see [`State::fused_experts`]).
struct FusedExperts {
    gate_up: Vec<f32>,
    down: Vec<f32>,
    /// Stored `[in, out]` per expert (the Hub layout) rather than `[out, in]`.
    transposed: bool,
    hidden: usize,
    inter: usize,
}

impl FusedExperts {
    /// Expert `e`'s `[gate, up, down]` as `[out, in]` weights on the backend.
    fn expert<'r, 'w, B: Backend>(
        &self,
        be: &B,
        e: usize,
    ) -> Result<[LinearWeights<'r, 'w, B>; 3]> {
        let (h, i) = (self.hidden, self.inter);
        let gate_up = &self.gate_up[e * 2 * i * h..(e + 1) * 2 * i * h];
        let down = &self.down[e * h * i..(e + 1) * h * i];
        // `[out, in]` rows of an expert's matrix stored `[rows, cols]`, transposed if needed.
        let out_in = |m: &[f32], rows: usize, cols: usize| -> Vec<f32> {
            if !self.transposed {
                return m.to_vec();
            }
            let mut t = vec![0f32; m.len()];
            for r in 0..rows {
                for c in 0..cols {
                    t[c * rows + r] = m[r * cols + c];
                }
            }
            t
        };
        let (gate_up, down) = (out_in(gate_up, h, 2 * i), out_in(down, i, h));
        let weights =
            |values: Vec<f32>, out: usize, inp: usize| -> Result<LinearWeights<'r, 'w, B>> {
                let mut weight = be.upload(values)?;
                be.round(&mut weight)?;
                Ok(LinearWeights {
                    weight: Matrix::Read(weight),
                    bias: None,
                    out,
                    inp,
                })
            };
        Ok([
            weights(gate_up[..i * h].to_vec(), i, h)?,
            weights(gate_up[i * h..].to_vec(), i, h)?,
            weights(down, h, i)?,
        ])
    }
}

/// A linear layer's weights on the backend: `[out, in]`, and the bias if it has one.
struct LinearWeights<'r, 'w, B: Backend> {
    weight: Matrix<'r, 'w, B>,
    bias: Option<Held<'r, B::Tensor>>,
    out: usize,
    inp: usize,
}

/// A weight as a block uses it: read for the block (and dropped with it), or held for a decode.
enum Held<'r, T> {
    Read(T),
    Resident(&'r T),
}

impl<T> std::ops::Deref for Held<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        match self {
            Held::Read(t) => t,
            Held::Resident(t) => t,
        }
    }
}

/// A weight matrix: read and decoded for the block, or held in its stored dtype for a decode.
enum Matrix<'r, 'w, B: Backend> {
    Read(B::Tensor),
    Stored(&'r B::Stored<'w>),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::forward::backend::cpu::CpuBackend;

    #[test]
    fn bf16_feed_forward_outputs_are_bf16_values() {
        use crate::forward::precision::Precision;
        for fixture in ["models/qwen2", "score/models/qwen3_moe"] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(fixture);
            let ckpt = Checkpoint::open_dir(&dir, fixture).unwrap();
            let model = Model::new(&ckpt).unwrap();
            let backend = CpuBackend::new(Precision::Bf16);
            let state = State::new(&model, &backend, &[vec![1, 5, 9, 2, 7, 3]]).unwrap();
            let moe = (0..model.spec.num_layers()).find(|&l| model.spec.layers[l].moe);
            let y = state.feed_forward(moe.unwrap_or(0), &state.x).unwrap();
            let rounded = y.iter().all(|&v| Precision::Bf16.round(v) == v);
            assert!(rounded, "{fixture}: MLP outputs are rounded to bf16");
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
