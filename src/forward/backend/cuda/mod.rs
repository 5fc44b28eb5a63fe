//! The CUDA backend: the recipe's operations as cuBLAS GEMMs and the kernels of `kernels.cu`,
//! through the thin [`Device`] layer. It holds no model logic: what runs is decided by
//! [`crate::forward::decoder`], as on the CPU (`docs/reference/gpu.md`).
//!
//! - A pass that streams its weights (`score`, a prompt's prefill) uploads each as stored,
//!   widens bf16 and f16 to f32 on the device (exactly), uses it once and frees it, so GPU memory
//!   holds one layer's weights and the activations: a model of any size streams through.
//! - A decode (`generate`) holds every matrix on the device in its stored bytes
//!   ([`StoredWeight`], never widened). A step's few rows run a GEMV kernel that reads them
//!   directly with f32 accumulation; more rows widen a scratch copy for the GEMM. The KV cache
//!   lives on the device too, written and attended there; only the visited heads' scores and
//!   probabilities and the logits come back (`docs/commands/generate.md`, "How it runs").
//! - Weights are copied on the device layer's copy stream; the compute stream waits for each
//!   copy's event before its first use, so a copy overlaps the GEMMs queued before it.
//! - Activations are f32. In f32 mode GEMMs are SGEMMs with TF32 off (the parity mode). In bf16
//!   mode the same kernels round where transformers' bf16 path rounds ([`Precision`]), and the
//!   GEMMs take bf16 operands on tensor cores with f32 accumulation and an f32 output, which the
//!   recipe rounds after the bias, as torch's bf16 GEMM does.
//! - Embedding rows are gathered on the host (the recipe does), so the embedding matrix never
//!   reaches the device.
//! - Attention runs one thread per (token, head) over all prompts of a layer at once, in groups
//!   of whole prompts whose scores fit [`SCORES_BUDGET`] (a KV cache's attention, in groups of
//!   whole heads); each group's scores and probabilities come back to the host for the same
//!   metric visitors the CPU feeds.

use std::borrow::Cow;
use std::ops::Range;

use rayon::prelude::*;
use safetensors::Dtype;

use super::{Attended, AttentionShape, Backend, CachedShape, HeadView, RopeTable, Visitor};
use crate::error::{Error, Result};
use crate::forward::activation::Activation;
use crate::forward::precision::{Bf16Style, Precision};
use crate::forward::weights::Model;

pub mod device;
pub mod driver;
#[cfg(test)]
pub(crate) mod host;
#[cfg(test)]
mod parity_tests;

pub use device::{Arg, Device, Gemm, Kernel, Op};

/// Score and probability values one attention group may hold on the device (each; 1 GiB of
/// f32). A layer's prompts are split into groups of whole prompts under it, a cached
/// attention's heads into groups of whole heads.
const SCORES_BUDGET: usize = 1 << 28;

/// An f32 matrix on the device.
pub struct DeviceTensor<B> {
    buf: B,
    /// Number of f32 values.
    len: usize,
    /// The same values as bf16 (16 bits each), kept from a bf16 checkpoint's bytes in bf16 mode:
    /// a weight's GEMM operand without a narrowing pass. Any write drops it ([`Self::buf_mut`]).
    bf16: Option<B>,
}

impl<B> DeviceTensor<B> {
    /// The f32 values, to be written: the bf16 copy no longer holds them.
    fn buf_mut(&mut self) -> &mut B {
        self.bf16 = None;
        &mut self.buf
    }
}

/// A weight held for a decode ([`Backend::store`]): its bytes as the checkpoint stores them
/// (bf16, f16 or f32), never widened, read by [`Backend::linear_stored`].
pub struct StoredWeight<B> {
    buf: B,
    dtype: Dtype,
    /// `[out, in]`.
    shape: Vec<usize>,
}

/// The most rows of `x` that [`Backend::linear_stored`] runs through the stored GEMV kernel;
/// more widen the weight into a scratch f32 copy and run [`Backend::linear`]'s GEMM. The
/// kernel reads the weight from memory once, in its stored bytes (each further row of `x`
/// rereads a weight row the row before it just brought into the cache); the widening reads those
/// bytes, writes and reads f32, about 5x a bf16 weight's traffic before the GEMM starts. So as
/// on the CPU (`cpu::stored::GEMV_MAX_ROWS`, measured there), decode steps and short feeds take
/// the kernel and a prompt's rows the GEMM, whose results are `linear`'s bit for bit.
const STORED_GEMV_MAX_ROWS: usize = 16;

/// Threads summing one output of the stored GEMV (`GEMV_LANES` in kernels.cu).
const GEMV_LANES: usize = 32;

/// The `kind` argument of the stored-weight kernels (the numbering in kernels.cu).
fn stored_kind(dtype: Dtype) -> i32 {
    match dtype {
        Dtype::F32 => 0,
        Dtype::BF16 => 1,
        Dtype::F16 => 2,
        other => unreachable!("stored_bytes refuses {other:?}"),
    }
}

/// The CUDA backend over a device layer `D` (cudarc's [`driver::Driver`] on a GPU).
pub struct CudaBackend<D: Device> {
    device: D,
    precision: Precision,
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn i32_bytes(values: impl IntoIterator<Item = i32>) -> Vec<u8> {
    values.into_iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn i64_bytes(values: impl IntoIterator<Item = i64>) -> Vec<u8> {
    values.into_iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The `kind` argument of the `activate` and `act_mul` kernels (the numbering in kernels.cu).
fn kernel_kind(act: Activation) -> i32 {
    match act {
        Activation::Gelu => 0,
        Activation::GeluTanh => 1,
        Activation::QuickGelu => 2,
        Activation::Silu => 3,
        Activation::GeluPython => 4,
        Activation::Gelu10 => 5,
        Activation::GeluFast => 6,
        Activation::Relu => 7,
        Activation::Relu2 => 8,
        Activation::Relu6 => 9,
        Activation::LeakyRelu => 10,
        Activation::Linear => 11,
        Activation::Sigmoid => 12,
        Activation::Tanh => 13,
        Activation::Mish => 14,
        Activation::Laplace => 15,
    }
}

/// Items `groups[i]` of an attention (whole prompts, or a cached attention's whole heads):
/// consecutive items whose `sizes` (score values each) sum to at most `budget` (a larger item
/// forms a group of its own, so every group has at least one).
fn attention_groups(sizes: &[usize], budget: usize) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for (i, &size) in sizes.iter().enumerate() {
        if i > start && used + size > budget {
            groups.push(start..i);
            start = i;
            used = 0;
        }
        used += size;
    }
    if start < sizes.len() {
        groups.push(start..sizes.len());
    }
    groups
}

impl<D: Device> CudaBackend<D> {
    pub fn new(device: D, precision: Precision) -> CudaBackend<D> {
        CudaBackend { device, precision }
    }

    /// The `bf16` flag of the kernels that round.
    fn bf16<'a>(&self) -> Arg<'a, D::Buffer> {
        Arg::I32(!self.precision.is_f32() as i32)
    }

    /// The `bf16` mode of RMSNorm and RoPE: 0 f32, 1 Llama style, 2 OLMo style.
    fn bf16_style<'a>(&self, style: Bf16Style) -> Arg<'a, D::Buffer> {
        Arg::I32(match (self.precision, style) {
            (Precision::F32, _) => 0,
            (Precision::Bf16, Bf16Style::Llama) => 1,
            (Precision::Bf16, Bf16Style::Olmo) => 2,
        })
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    fn tensor(&self, buf: D::Buffer, len: usize) -> DeviceTensor<D::Buffer> {
        DeviceTensor {
            buf,
            len,
            bf16: None,
        }
    }

    /// `t`'s values as bf16, for a tensor-core GEMM: its bf16 copy, or one narrowed into
    /// `scratch` (exact: bf16 mode's values are bf16 already).
    fn bf16_operand<'t>(
        &self,
        t: &'t DeviceTensor<D::Buffer>,
        scratch: &'t mut Option<D::Buffer>,
    ) -> Result<&'t D::Buffer> {
        if let Some(b) = &t.bf16 {
            return Ok(b);
        }
        let mut out = self.device.zeros(t.len * 2)?;
        self.launch(
            Kernel::NarrowBf16,
            t.len,
            &mut [Arg::Mut(&mut out), Arg::Ref(&t.buf), Arg::I64(t.len as i64)],
        )?;
        Ok(scratch.insert(out))
    }

    fn zeros_f32(&self, len: usize) -> Result<DeviceTensor<D::Buffer>> {
        Ok(self.tensor(self.device.zeros(len * 4)?, len))
    }

    fn upload_f32(&self, values: &[f32]) -> Result<DeviceTensor<D::Buffer>> {
        Ok(self.tensor(self.device.upload(&f32_bytes(values))?, values.len()))
    }

    /// Weight `name`'s stored bytes (checked by [`Model::stored_bytes`]) on the device, and their
    /// dtype: copied on the copy stream, which the compute stream then waits for.
    fn upload_stored(
        &self,
        model: &Model,
        name: &str,
        shape: &[usize],
    ) -> Result<(Dtype, D::Buffer)> {
        let (dtype, bytes) = model.stored_bytes(name, shape)?;
        // The bytes are staged before `upload_async` returns, so the file's pages can go.
        let uploaded = self.device.upload_async(bytes);
        model.release(name);
        let (raw, copied) = uploaded?;
        // The copy stream fills `raw`; nothing on the compute stream may read it before this.
        self.device.wait(&copied)?;
        Ok((dtype, raw))
    }

    /// The f32 tensor of `len` stored values `raw` of `dtype`: bf16 and f16 widened on the device
    /// (exact); f32 and f16 rounded in bf16 mode; a bf16 checkpoint's bytes kept as the bf16
    /// GEMM's operand in bf16 mode.
    fn widen(&self, dtype: Dtype, raw: D::Buffer, len: usize) -> Result<DeviceTensor<D::Buffer>> {
        let widen = match dtype {
            Dtype::F32 => None,
            Dtype::BF16 => Some(Kernel::WidenBf16),
            Dtype::F16 => Some(Kernel::WidenF16),
            other => unreachable!("stored_bytes refuses {other:?}"),
        };
        let mut out = match widen {
            None => self.tensor(raw, len),
            Some(kernel) => {
                let mut out = self.zeros_f32(len)?;
                self.launch(
                    kernel,
                    len,
                    &mut [Arg::Mut(&mut out.buf), Arg::Ref(&raw), Arg::I64(len as i64)],
                )?;
                // In bf16 mode a bf16 checkpoint's bytes are the tensor-core GEMM's operand.
                if dtype == Dtype::BF16 && !self.precision.is_f32() {
                    out.bf16 = Some(raw);
                }
                out
            }
        };
        // bf16 weights are exact; f32 and f16 ones are rounded in bf16 mode.
        if dtype != Dtype::BF16 {
            self.round(&mut out)?;
        }
        Ok(out)
    }

    /// [`Backend::attention_cached`] in groups of whole heads whose scores (`queries * keys`
    /// values a head) sum to at most `budget` (a larger head is a group alone: a visitor reads a
    /// head's whole `[queries, keys]`). Besides `ctx`, the device holds two buffers, the
    /// scores and the probabilities, of at most `max(budget, queries * keys)` f32 each (1 GiB at
    /// [`SCORES_BUDGET`] unless one head is larger), and the host one group's copies of them,
    /// where a single launch held `heads * queries * keys` each: quadratic in a prefill's length.
    /// Each thread computes what it did in one launch, so the results are the same bits.
    fn attention_cached_within<R: Send>(
        &self,
        q: &DeviceTensor<D::Buffer>,
        keys: &DeviceTensor<D::Buffer>,
        values: &DeviceTensor<D::Buffer>,
        shape: &CachedShape,
        visit: &Visitor<R>,
        budget: usize,
    ) -> Result<Attended<R, DeviceTensor<D::Buffer>>> {
        let (nh, hd, len, n) = (shape.num_heads, shape.head_dim, shape.queries, shape.keys());
        let per_head = len * n;
        let groups = attention_groups(&vec![per_head; nh], budget);
        // Every group but the last has the first's heads, so its buffers serve them all.
        let most = groups.first().map_or(0, |g| g.len()) * per_head;
        let mut scores = self.zeros_f32(most)?;
        let mut probs = self.zeros_f32(most)?;
        let mut ctx = self.zeros_f32(len * nh * hd)?;
        let mut heads = Vec::with_capacity(nh);
        for group in groups {
            self.launch(
                Kernel::AttentionCached,
                len * group.len(),
                &mut [
                    Arg::Mut(&mut scores.buf),
                    Arg::Mut(&mut probs.buf),
                    Arg::Mut(&mut ctx.buf),
                    Arg::Ref(&q.buf),
                    Arg::Ref(&keys.buf),
                    Arg::Ref(&values.buf),
                    Arg::I64(len as i64),
                    Arg::I64(shape.offset as i64),
                    Arg::I64(shape.capacity as i64),
                    Arg::I32(nh as i32),
                    Arg::I32(group.start as i32),
                    Arg::I32(group.len() as i32),
                    Arg::I32(shape.num_kv_heads as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(shape.window.unwrap_or(0) as i32),
                    Arg::F32(shape.scale),
                    self.bf16(),
                ],
            )?;
            // The visitor's type says nothing of what it reads, so every head's scores and
            // probabilities come back, as the CPU hands them over: `[len, keys]` per head, only
            // the filled positions (the cache itself stays on the device).
            let bytes = 0..group.len() * per_head * 4;
            let group_scores = f32s(&self.device.download(&scores.buf, bytes.clone())?);
            let group_probs = f32s(&self.device.download(&probs.buf, bytes)?);
            let first = group.start;
            heads.par_extend(group.into_par_iter().map(|h| {
                let at = (h - first) * per_head..(h - first + 1) * per_head;
                visit(&HeadView {
                    prompt: 0,
                    head: h,
                    len,
                    keys: n,
                    offset: shape.offset,
                    scores: &group_scores[at.clone()],
                    probs: &group_probs[at],
                    causal: true,
                    window: shape.window,
                })
            }));
        }
        Ok(Attended {
            heads,
            context: Some(ctx),
        })
    }

    fn launch(&self, kernel: Kernel, threads: usize, args: &mut [Arg<D::Buffer>]) -> Result<()> {
        if threads == 0 {
            return Ok(());
        }
        self.device.launch(kernel, threads, args)
    }
}

impl<D: Device> Backend for CudaBackend<D> {
    type Tensor = DeviceTensor<D::Buffer>;
    type Stored<'w> = StoredWeight<D::Buffer>;

    fn describe(&self) -> String {
        self.device.describe()
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn round(&self, x: &mut Self::Tensor) -> Result<()> {
        if self.precision.is_f32() {
            return Ok(());
        }
        let n = x.len;
        self.launch(
            Kernel::RoundBf16,
            n,
            &mut [Arg::Mut(x.buf_mut()), Arg::I64(n as i64)],
        )
    }

    fn upload(&self, host: Vec<f32>) -> Result<Self::Tensor> {
        self.upload_f32(&host)
    }

    fn load(&self, model: &Model, name: &str, shape: &[usize]) -> Result<Self::Tensor> {
        let (dtype, raw) = self.upload_stored(model, name, shape)?;
        self.widen(dtype, raw, shape.iter().product())
    }

    fn store<'w>(
        &self,
        model: &Model<'w>,
        name: &str,
        shape: &[usize],
    ) -> Result<Self::Stored<'w>> {
        let (dtype, buf) = self.upload_stored(model, name, shape)?;
        Ok(StoredWeight {
            buf,
            dtype,
            shape: shape.to_vec(),
        })
    }

    fn linear_stored(
        &self,
        x: &Self::Tensor,
        rows: usize,
        w: &Self::Stored<'_>,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self::Tensor> {
        // The kernels cannot check what they read.
        if w.shape != [out_features, in_features] || x.len != rows * in_features {
            return Err(Error::Internal(format!(
                "linear_stored: a weight of shape {:?} as [{out_features}, {in_features}], \
                 {} input values as {rows} rows",
                w.shape, x.len
            )));
        }
        if rows > STORED_GEMV_MAX_ROWS {
            let bytes = out_features * in_features * crate::dtype::byte_size(w.dtype);
            let mut copy = self.device.zeros(bytes)?;
            self.device.copy(&w.buf, 0, &mut copy, 0, bytes)?;
            let wide = self.widen(w.dtype, copy, out_features * in_features)?;
            return self.linear(x, rows, &wide, out_features, in_features);
        }
        let outputs = rows * out_features;
        let mut partial = self.zeros_f32(outputs * GEMV_LANES)?;
        self.launch(
            Kernel::StoredGemvPartials,
            outputs * GEMV_LANES,
            &mut [
                Arg::Mut(&mut partial.buf),
                Arg::Ref(&x.buf),
                Arg::Ref(&w.buf),
                Arg::I64(rows as i64),
                Arg::I64(out_features as i64),
                Arg::I32(in_features as i32),
                Arg::I32(stored_kind(w.dtype)),
                self.bf16(),
            ],
        )?;
        let mut y = self.zeros_f32(outputs)?;
        self.launch(
            Kernel::StoredGemvSum,
            outputs,
            &mut [
                Arg::Mut(&mut y.buf),
                Arg::Ref(&partial.buf),
                Arg::I64(outputs as i64),
            ],
        )?;
        Ok(y)
    }

    fn linear(
        &self,
        x: &Self::Tensor,
        rows: usize,
        w: &Self::Tensor,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self::Tensor> {
        let mut y = self.zeros_f32(rows * out_features)?;
        if rows == 0 || out_features == 0 {
            return Ok(y);
        }
        let gemm = Gemm::linear(rows, out_features, in_features);
        match self.precision {
            Precision::F32 => self.device.gemm(&gemm, &w.buf, &x.buf, &mut y.buf)?,
            Precision::Bf16 => {
                let (mut sw, mut sx) = (None, None);
                let a = self.bf16_operand(w, &mut sw)?;
                let b = self.bf16_operand(x, &mut sx)?;
                self.device.gemm_bf16(&gemm, a, b, &mut y.buf)?;
            }
        }
        Ok(y)
    }

    fn add_bias(&self, y: &mut Self::Tensor, b: &Self::Tensor, width: usize) -> Result<()> {
        let n = y.len;
        self.launch(
            Kernel::AddBias,
            n,
            &mut [
                Arg::Mut(y.buf_mut()),
                Arg::Ref(&b.buf),
                Arg::I64(n as i64),
                Arg::I32(width as i32),
            ],
        )
    }

    fn rms_norm_rows(
        &self,
        x: &mut Self::Tensor,
        width: usize,
        w: &Self::Tensor,
        eps: f32,
        style: Bf16Style,
    ) -> Result<()> {
        *x = self.rms_norm(x, width, w, eps, style)?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Self::Tensor,
        width: usize,
        w: &Self::Tensor,
        eps: f32,
        style: Bf16Style,
    ) -> Result<Self::Tensor> {
        let rows = x.len / width;
        let mut y = self.zeros_f32(x.len)?;
        self.launch(
            Kernel::RmsNormRows,
            rows,
            &mut [
                Arg::Mut(&mut y.buf),
                Arg::Ref(&x.buf),
                Arg::Ref(&w.buf),
                Arg::I64(rows as i64),
                Arg::I32(width as i32),
                Arg::F32(eps),
                self.bf16_style(style),
            ],
        )?;
        Ok(y)
    }

    fn clamp(&self, x: &mut Self::Tensor, c: f32) -> Result<()> {
        let n = x.len;
        self.launch(
            Kernel::ClampValues,
            n,
            &mut [
                Arg::Mut(x.buf_mut()),
                Arg::I64(n as i64),
                Arg::F32(c),
                self.bf16(),
            ],
        )
    }

    fn rope(
        &self,
        x: &mut Self::Tensor,
        width: usize,
        head_dim: usize,
        segments: &[(Range<usize>, &RopeTable)],
        style: Bf16Style,
    ) -> Result<()> {
        let rows = x.len / width;
        let half = head_dim / 2;
        // Each row's cos/sin, from its prompt's host table.
        let (mut cos, mut sin) = (vec![0f32; rows * half], vec![0f32; rows * half]);
        for (range, table) in segments {
            for (t, row) in range.clone().enumerate() {
                cos[row * half..(row + 1) * half]
                    .copy_from_slice(&table.cos[t * half..(t + 1) * half]);
                sin[row * half..(row + 1) * half]
                    .copy_from_slice(&table.sin[t * half..(t + 1) * half]);
            }
        }
        let (cos, sin) = (self.upload_f32(&cos)?, self.upload_f32(&sin)?);
        self.launch(
            Kernel::Rope,
            rows * (width / head_dim) * half,
            &mut [
                Arg::Mut(x.buf_mut()),
                Arg::Ref(&cos.buf),
                Arg::Ref(&sin.buf),
                Arg::I64(rows as i64),
                Arg::I32(width as i32),
                Arg::I32(head_dim as i32),
                self.bf16_style(style),
            ],
        )
    }

    fn attention<R: Send>(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: Option<&Self::Tensor>,
        shape: &AttentionShape,
        visit: &Visitor<R>,
    ) -> Result<Attended<R, Self::Tensor>> {
        let (nh, hd) = (shape.num_heads, shape.head_dim);
        let qd = nh * hd;
        let rows = q.len / qd;
        let mut ctx = match v {
            Some(_) => Some(self.zeros_f32(rows * qd)?),
            None => None,
        };
        // Stand-ins for the pointers a kernel without values never reads.
        let mut unused = self.zeros_f32(1)?;
        let mut heads = Vec::with_capacity(shape.prompts.len() * nh);
        let sizes: Vec<usize> = shape
            .prompts
            .iter()
            .map(|r| nh * r.len() * r.len())
            .collect();
        for group in attention_groups(&sizes, SCORES_BUDGET) {
            let prompts = &shape.prompts[group.clone()];
            let row_begin = prompts[0].start;
            let group_rows = prompts.last().map_or(0, |r| r.end) - row_begin;
            let mut offsets = Vec::with_capacity(prompts.len());
            let mut total = 0usize;
            for &size in &sizes[group.clone()] {
                offsets.push(total);
                total += size;
            }
            let row_prompt = prompts
                .iter()
                .enumerate()
                .flat_map(|(p, r)| std::iter::repeat_n(p as i32, r.len()));
            let row_prompt = self.device.upload(&i32_bytes(row_prompt))?;
            let starts = i64_bytes(prompts.iter().map(|r| r.start as i64));
            let lens = i64_bytes(prompts.iter().map(|r| r.len() as i64));
            let offs = i64_bytes(offsets.iter().map(|&o| o as i64));
            let (starts, lens, offs) = (
                self.device.upload(&starts)?,
                self.device.upload(&lens)?,
                self.device.upload(&offs)?,
            );
            let mut scores = self.zeros_f32(total)?;
            let mut probs = self.zeros_f32(total)?;
            let ctx_buf = match &mut ctx {
                Some(c) => &mut c.buf,
                None => &mut unused.buf,
            };
            let v_buf = v.map_or(&q.buf, |v| &v.buf);
            self.launch(
                Kernel::Attention,
                group_rows * nh,
                &mut [
                    Arg::Mut(&mut scores.buf),
                    Arg::Mut(&mut probs.buf),
                    Arg::Mut(ctx_buf),
                    Arg::Ref(&q.buf),
                    Arg::Ref(&k.buf),
                    Arg::Ref(v_buf),
                    Arg::Ref(&row_prompt),
                    Arg::Ref(&starts),
                    Arg::Ref(&lens),
                    Arg::Ref(&offs),
                    Arg::I64(row_begin as i64),
                    Arg::I64(group_rows as i64),
                    Arg::I32(nh as i32),
                    Arg::I32(shape.num_kv_heads as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(shape.causal as i32),
                    Arg::I32(shape.window.unwrap_or(0) as i32),
                    Arg::F32(shape.scale),
                    Arg::I32(v.is_some() as i32),
                    self.bf16(),
                ],
            )?;
            let scores = f32s(&self.device.download(&scores.buf, 0..total * 4)?);
            let probs = f32s(&self.device.download(&probs.buf, 0..total * 4)?);
            let tasks: Vec<(usize, usize)> = (0..prompts.len())
                .flat_map(|p| (0..nh).map(move |h| (p, h)))
                .collect();
            heads.par_extend(tasks.par_iter().map(|&(p, h)| {
                let len = prompts[p].len();
                let at = offsets[p] + h * len * len;
                visit(&HeadView {
                    prompt: group.start + p,
                    head: h,
                    len,
                    keys: len,
                    offset: 0,
                    scores: &scores[at..at + len * len],
                    probs: &probs[at..at + len * len],
                    causal: shape.causal,
                    window: shape.window,
                })
            }));
        }
        Ok(Attended {
            heads,
            context: ctx,
        })
    }

    fn cache_write(
        &self,
        cache: &mut Self::Tensor,
        new: &Self::Tensor,
        shape: &CachedShape,
        at: usize,
    ) -> Result<()> {
        let (kv, hd, cap) = (shape.num_kv_heads, shape.head_dim, shape.capacity);
        let rows = new.len / (kv * hd);
        // The kernel cannot check where it writes.
        if cache.len != kv * cap * hd || at + rows > cap {
            return Err(Error::Internal(format!(
                "cache_write: {rows} rows at {at} into a cache of {} values, {kv} x {cap} x {hd}",
                cache.len
            )));
        }
        self.launch(
            Kernel::CacheWrite,
            new.len,
            &mut [
                Arg::Mut(cache.buf_mut()),
                Arg::Ref(&new.buf),
                Arg::I64(rows as i64),
                Arg::I32(kv as i32),
                Arg::I32(hd as i32),
                Arg::I64(cap as i64),
                Arg::I64(at as i64),
            ],
        )
    }

    fn attention_cached<R: Send>(
        &self,
        q: &Self::Tensor,
        keys: &Self::Tensor,
        values: &Self::Tensor,
        shape: &CachedShape,
        visit: &Visitor<R>,
    ) -> Result<Attended<R, Self::Tensor>> {
        self.attention_cached_within(q, keys, values, shape, visit, SCORES_BUDGET)
    }

    fn layer_norm(
        &self,
        x: &Self::Tensor,
        width: usize,
        w: &Self::Tensor,
        b: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        let rows = x.len / width;
        let mut y = self.zeros_f32(x.len)?;
        self.launch(
            Kernel::LayerNormRows,
            rows,
            &mut [
                Arg::Mut(&mut y.buf),
                Arg::Ref(&x.buf),
                Arg::Ref(&w.buf),
                Arg::Ref(&b.buf),
                Arg::I64(rows as i64),
                Arg::I32(width as i32),
                Arg::F32(eps),
                self.bf16(),
            ],
        )?;
        Ok(y)
    }

    fn activate(&self, x: &mut Self::Tensor, act: Activation) -> Result<()> {
        let n = x.len;
        self.launch(
            Kernel::Activate,
            n,
            &mut [
                Arg::Mut(x.buf_mut()),
                Arg::I64(n as i64),
                Arg::I32(kernel_kind(act)),
                self.bf16(),
            ],
        )
    }

    fn scale_columns(&self, x: &mut Self::Tensor, width: usize, w: &Self::Tensor) -> Result<()> {
        let n = x.len;
        self.launch(
            Kernel::ScaleColumns,
            n,
            &mut [
                Arg::Mut(x.buf_mut()),
                Arg::Ref(&w.buf),
                Arg::I64(n as i64),
                Arg::I32(width as i32),
                self.bf16(),
            ],
        )
    }

    fn act_mul(&self, gate: &mut Self::Tensor, up: &Self::Tensor, act: Activation) -> Result<()> {
        let n = gate.len;
        self.launch(
            Kernel::ActMul,
            n,
            &mut [
                Arg::Mut(gate.buf_mut()),
                Arg::Ref(&up.buf),
                Arg::I64(n as i64),
                Arg::I32(kernel_kind(act)),
                self.bf16(),
            ],
        )
    }

    fn add_assign(&self, a: &mut Self::Tensor, b: &Self::Tensor) -> Result<()> {
        let n = a.len;
        self.launch(
            Kernel::AddAssign,
            n,
            &mut [
                Arg::Mut(a.buf_mut()),
                Arg::Ref(&b.buf),
                Arg::I64(n as i64),
                self.bf16(),
            ],
        )
    }

    fn all_finite(&self, x: &Self::Tensor) -> Result<bool> {
        let mut flag = self.device.zeros(4)?;
        self.launch(
            Kernel::FlagNonFinite,
            x.len,
            &mut [
                Arg::Mut(&mut flag),
                Arg::Ref(&x.buf),
                Arg::I64(x.len as i64),
            ],
        )?;
        Ok(self.device.download(&flag, 0..4)? == [0, 0, 0, 0])
    }

    fn to_host<'t>(&self, x: &'t Self::Tensor) -> Result<Cow<'t, [f32]>> {
        Ok(Cow::Owned(f32s(
            &self.device.download(&x.buf, 0..x.len * 4)?,
        )))
    }

    fn zeros(&self, rows: usize, width: usize) -> Result<Self::Tensor> {
        self.zeros_f32(rows * width)
    }

    fn slice_rows(
        &self,
        x: &Self::Tensor,
        width: usize,
        rows: Range<usize>,
    ) -> Result<Self::Tensor> {
        let len = rows.len() * width;
        let mut out = self.zeros_f32(len)?;
        self.device
            .copy(&x.buf, rows.start * width * 4, &mut out.buf, 0, len * 4)?;
        Ok(out)
    }

    fn concat_rows(&self, parts: Vec<Self::Tensor>) -> Result<Self::Tensor> {
        let total = parts.iter().map(|p| p.len).sum();
        let mut out = self.zeros_f32(total)?;
        let mut at = 0;
        for p in &parts {
            self.device
                .copy(&p.buf, 0, &mut out.buf, at * 4, p.len * 4)?;
            at += p.len;
        }
        Ok(out)
    }

    fn gather_rows(&self, x: &Self::Tensor, width: usize, index: &[u32]) -> Result<Self::Tensor> {
        let rows = index.len();
        let idx = self
            .device
            .upload(&i32_bytes(index.iter().map(|&i| i as i32)))?;
        let mut out = self.zeros_f32(rows * width)?;
        self.launch(
            Kernel::GatherRows,
            rows * width,
            &mut [
                Arg::Mut(&mut out.buf),
                Arg::Ref(&x.buf),
                Arg::Ref(&idx),
                Arg::I64(rows as i64),
                Arg::I32(width as i32),
            ],
        )?;
        Ok(out)
    }

    fn scatter_add_rows(
        &self,
        out: &mut Self::Tensor,
        y: &Self::Tensor,
        width: usize,
        index: &[u32],
        weight: &[f32],
    ) -> Result<()> {
        let idx = self
            .device
            .upload(&i32_bytes(index.iter().map(|&i| i as i32)))?;
        let w = self.upload_f32(weight)?;
        self.launch(
            Kernel::ScatterAddRows,
            width,
            &mut [
                Arg::Mut(out.buf_mut()),
                Arg::Ref(&y.buf),
                Arg::Ref(&idx),
                Arg::Ref(&w.buf),
                Arg::I64(index.len() as i64),
                Arg::I32(width as i32),
                self.bf16(),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_groups_hold_whole_items_under_the_budget() {
        // Prompts of 4, 2, 10 and 1 tokens, one head.
        let sizes = [16, 4, 100, 1];
        assert_eq!(attention_groups(&sizes, 20), vec![0..2, 2..3, 3..4]);
        assert_eq!(attention_groups(&sizes, 1000), vec![0..4]);
        assert!(attention_groups(&[], 10).is_empty());
    }
}
