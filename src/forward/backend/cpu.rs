//! The CPU backend: f32 on the host. Linear layers on faer's GEMM, RMSNorm, the gated MLP, and
//! exact eager attention one (prompt, head) at a time, in parallel. Matrices are row-major
//! `[rows, cols]` slices (one row per token).
//!
//! Determinism: a linear layer is split into fixed blocks of output features, and of tokens where
//! the features give few blocks (the k/v projections), and each block is one sequential GEMM call.
//! The blocks are a function of the shape alone, so results are bitwise identical with 1 or 64
//! threads. The split does not change a bit either: faer's kernels compute each output element as
//! a chain of fused multiply-adds over 512-wide slices of the inner dimension, summed in order
//! (`kc = min(depth, 512)` in private-gemm-x86), whatever rows and columns share the call
//! (unit-tested below).

use std::borrow::Cow;
use std::ops::Range;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

use super::{
    first_key, Attended, AttentionShape, Backend, CachedShape, HeadView, RopeTable, Visitor,
};
use crate::error::Result;
use crate::forward::activation::Activation;
use crate::forward::precision::{Bf16Style, Precision};
use crate::forward::weights::Model;
use crate::linalg::simd::clear_upper_state;

mod exp;
pub mod stored;

/// Keeps the buffers the forward pass frees in the process, for the next layer to reuse.
///
/// Each layer allocates its activations afresh (22 MB per projection output at Qwen2.5-0.5B shapes
/// with 1133 tokens). glibc's malloc maps blocks that large, or trims them off the heap once
/// freed, so every layer faults in and zeroes new pages: 1.4-1.8 s of system time in a 7-8 s
/// 0.5B-shaped `score` (docs/benchmarks.md, "Where the time goes"). With the mmap threshold at the
/// largest documented value and trimming off (mallopt(3): `M_MMAP_THRESHOLD`, `M_TRIM_THRESHOLD`),
/// freed blocks of up to 32 MiB are reused from the heap; larger ones are still mapped and
/// unmapped. Peak memory is unchanged: it is the live set's, which the heap held at its peak
/// anyway. Process-wide, set once; other C libraries keep their defaults.
pub fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: mallopt only changes malloc's parameters; it is thread-safe in glibc.
        ONCE.call_once(|| unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        });
    }
}

/// The largest `M_MMAP_THRESHOLD` that mallopt(3) documents for 64-bit targets
/// (`DEFAULT_MMAP_THRESHOLD_MAX`; glibc 2.36 accepts more, older versions refuse it).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const LARGEST_MMAP_THRESHOLD: i32 = 32 << 20;

/// Output features per parallel GEMM block. Fixed (see the module docs); 192 keeps a block's
/// weights (192 x 4096 f32 = 3 MiB) near the cache while giving 2-cores-to-many enough blocks,
/// and is two of faer's 96-wide AVX-512 tiles, so no block ends in a narrow tail tile.
const OUT_BLOCK: usize = 192;

/// `x Wᵀ`: `x` is `[rows, n_in]`, `w` is `[n_out, n_in]` as stored in safetensors; returns
/// `[rows, n_out]`. Biases are added after the GEMM, in f32, as torch's addmm does.
pub fn linear(x: &[f32], rows: usize, w: &[f32], n_out: usize, n_in: usize) -> Vec<f32> {
    assert_eq!(x.len(), rows * n_in, "linear input shape");
    assert_eq!(w.len(), n_out * n_in, "linear weight shape");
    let mut y = zeroed(rows * n_out);
    if rows == 0 || n_out == 0 || n_in == 0 {
        return y;
    }
    // Wᵀ as an [in, out] view of the row-major [out, in] weight.
    let rhs = MatRef::from_row_major_slice(w, n_out, n_in).transpose();
    let row_block = rows.div_ceil(row_blocks(rows, n_out));
    y.par_chunks_mut(row_block * n_out)
        .zip(x.par_chunks(row_block * n_in))
        .for_each(|(y, x)| {
            let rows = x.len() / n_in;
            let lhs = MatRef::from_row_major_slice(x, rows, n_in);
            let dst = MatMut::from_row_major_slice_mut(y, rows, n_out);
            dst.par_col_chunks_mut(OUT_BLOCK)
                .enumerate()
                .for_each(|(block, dst)| {
                    let start = block * OUT_BLOCK;
                    let cols = dst.ncols();
                    matmul(
                        dst,
                        Accum::Replace,
                        lhs,
                        rhs.subcols(start, cols),
                        1.0f32,
                        Par::Seq,
                    );
                    clear_upper_state();
                });
        });
    y
}

/// `n` zeros, written by the pool's threads: the calling thread would otherwise clear every
/// projection's output alone while the pool waits (the freed buffers are reused, see
/// [`keep_freed_buffers`], so the allocator must clear them).
fn zeroed(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(0f32, n).with_min_len(1 << 16));
    v
}

/// How many blocks of rows `linear` splits its input into: enough for at least `MIN_BLOCKS`
/// blocks in all when the output has few blocks of features, with no row block under `MIN_ROWS`.
/// A function of the shape alone, never of the thread count. Without it a 128-wide k or v
/// projection was one block, run on one core while the others waited.
fn row_blocks(rows: usize, n_out: usize) -> usize {
    const MIN_BLOCKS: usize = 16;
    const MIN_ROWS: usize = 64;
    let col_blocks = n_out.div_ceil(OUT_BLOCK);
    MIN_BLOCKS.div_ceil(col_blocks).min(rows / MIN_ROWS).max(1)
}

/// `y[r, :] += b` for every row.
pub fn add_bias(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_exact_mut(b.len()) {
        for (v, &bi) in row.iter_mut().zip(b) {
            *v += bi;
        }
    }
}

/// `a += b`, elementwise.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    a.par_chunks_mut(1 << 14)
        .zip(b.par_chunks(1 << 14))
        .for_each(|(a, b)| {
            for (x, &y) in a.iter_mut().zip(b) {
                *x += y;
            }
        });
}

/// RMSNorm of every `width`-sized row of `x` in place, in parallel over rows:
/// `h = x * rsqrt(mean(x²) + eps)` (the mean accumulated in f64 and rounded once, as
/// transformers' f32 path), then `scale(h, w)` for each value and its weight.
#[inline]
fn rms_norm_rows_with(
    x: &mut [f32],
    width: usize,
    weight: &[f32],
    eps: f32,
    scale: impl Fn(f32, f32) -> f32 + Sync,
) {
    assert_eq!(weight.len(), width);
    x.par_chunks_mut(width).for_each(|row| {
        let mean = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / width as f64;
        let inv = 1.0f32 / ((mean as f32) + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = scale(*v * inv, w);
        }
    });
}

/// RMSNorm in `precision`: `w * h` in f32; in bf16 `R(w · R(h))` (Llama style) or `R(w · h)`
/// (OLMo style), as transformers' bf16 path computes it.
fn rms_norm_rows(
    x: &mut [f32],
    width: usize,
    weight: &[f32],
    eps: f32,
    precision: Precision,
    style: Bf16Style,
) {
    let r = |v| precision.round(v);
    match (precision, style) {
        (Precision::F32, _) => rms_norm_rows_with(x, width, weight, eps, |h, w| w * h),
        (Precision::Bf16, Bf16Style::Llama) => {
            rms_norm_rows_with(x, width, weight, eps, |h, w| r(w * r(h)))
        }
        (Precision::Bf16, Bf16Style::Olmo) => {
            rms_norm_rows_with(x, width, weight, eps, |h, w| r(w * h))
        }
    }
}

/// SiLU, `x * sigmoid(x)`, in f32, as `x / (1 + exp(-x))` (transformers' formula and rounding).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp::exp(-x))
}

/// `gate = silu(gate) * up`, elementwise, in place in `gate`: [`silu`]'s operations, with the
/// exponentials computed a vector at a time.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    /// Elements per exponential batch: small enough to stay in L1 beside `gate` and `up`.
    const BATCH: usize = 1024;
    gate.par_chunks_mut(1 << 14)
        .zip(up.par_chunks(1 << 14))
        .for_each(|(g, u)| {
            let mut e = [0f32; BATCH];
            for (g, u) in g.chunks_mut(BATCH).zip(u.chunks(BATCH)) {
                let e = &mut e[..g.len()];
                e.iter_mut().zip(g.iter()).for_each(|(e, &x)| *e = -x);
                exp::exp_in_place(e);
                for ((a, &b), &e) in g.iter_mut().zip(u).zip(e.iter()) {
                    *a = *a / (1.0 + e) * b;
                }
            }
        });
}

/// Row-wise softmax over the keys each query sees: query row `q` is at position `offset + q`,
/// and sees the keys up to it (causal, and the sliding window if any; or every key when not
/// causal). `scores` is `[len, keys]`; masked entries are exactly 0, as `exp(finfo.min - max)`
/// underflows to in transformers.
fn softmax_masked(
    scores: &[f32],
    len: usize,
    keys: usize,
    offset: usize,
    causal: bool,
    window: Option<usize>,
) -> Vec<f32> {
    let mut probs = vec![0f32; len * keys];
    for q in 0..len {
        let (lo, hi) = if causal {
            (first_key(offset + q, window), offset + q + 1)
        } else {
            (0, keys)
        };
        let row = &scores[q * keys + lo..q * keys + hi];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let out = &mut probs[q * keys + lo..q * keys + hi];
        out.iter_mut().zip(row).for_each(|(o, &s)| *o = s - max);
        exp::exp_in_place(out);
        // Summed in key order, one key at a time, as before vectorising the exponentials.
        let sum = out.iter().fold(0f32, |sum, &o| sum + o);
        for o in out.iter_mut() {
            *o /= sum;
        }
    }
    probs
}

/// One head of one sequence: `q` is `[len, head_dim]`, its rows at positions `offset..offset +
/// len`; `k` and `v` are `[keys, head_dim]` for positions `0..keys` (a whole prompt: `keys ==
/// len`, `offset` 0; over a KV cache, every cached position). Scores `q kᵀ · scale`, the masked
/// softmax (`causal` with an optional `window`, or over every key), the visitor, and the head's
/// context `P v` (`[len, head_dim]`, row-major; empty without `v`), in `precision` (see
/// [`Precision`]). `at` is (prompt, head) for the visitor.
#[allow(clippy::too_many_arguments)]
pub fn attend_head<R>(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: Option<MatRef<'_, f32>>,
    scale: f32,
    causal: bool,
    window: Option<usize>,
    precision: Precision,
    at: (usize, usize),
    visit: &Visitor<R>,
) -> (R, Vec<f32>) {
    let (len, hd, keys) = (q.nrows(), q.ncols(), k.nrows());
    let offset = keys - len;
    let mut scores = vec![0f32; len * keys];
    let bf16 = !precision.is_f32();
    matmul(
        MatMut::from_row_major_slice_mut(&mut scores, len, keys),
        Accum::Replace,
        q,
        k.transpose(),
        if bf16 { 1.0 } else { scale },
        Par::Seq,
    );
    clear_upper_state();
    if bf16 {
        // torch: `matmul(q, kᵀ) * scaling`, each result rounded.
        for s in &mut scores {
            *s = precision.round(precision.round(*s) * scale);
        }
    }
    let mut probs = softmax_masked(&scores, len, keys, offset, causal, window);
    if bf16 {
        probs.iter_mut().for_each(|p| *p = precision.round(*p));
    }
    let out = visit(&HeadView {
        prompt: at.0,
        head: at.1,
        len,
        keys,
        offset,
        scores: &scores,
        probs: &probs,
        causal,
        window,
    });
    let Some(v) = v else {
        return (out, Vec::new());
    };
    let mut ctx = vec![0f32; len * hd];
    matmul(
        MatMut::from_row_major_slice_mut(&mut ctx, len, hd),
        Accum::Replace,
        MatRef::from_row_major_slice(&probs, len, keys),
        v,
        1.0f32,
        Par::Seq,
    );
    clear_upper_state();
    if bf16 {
        ctx.iter_mut().for_each(|c| *c = precision.round(*c));
    }
    (out, ctx)
}

/// [`Backend::cache_write`] on host slices.
pub fn cache_write(cache: &mut [f32], new: &[f32], shape: &CachedShape, at: usize) {
    let (kv, hd, cap) = (shape.num_kv_heads, shape.head_dim, shape.capacity);
    for (t, row) in new.chunks_exact(kv * hd).enumerate() {
        for (g, head) in row.chunks_exact(hd).enumerate() {
            let dst = (g * cap + at + t) * hd;
            cache[dst..dst + hd].copy_from_slice(head);
        }
    }
}

/// [`Backend::attention_cached`] on host slices: each head in parallel through
/// [`attend_head`], the same arithmetic as a whole prompt's rows; the visitors' results in head
/// order and the context `[queries, heads · head_dim]`.
pub fn attention_cached<R: Send>(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    shape: &CachedShape,
    precision: Precision,
    visit: &Visitor<R>,
) -> (Vec<R>, Vec<f32>) {
    let (nh, hd, cap, n) = (
        shape.num_heads,
        shape.head_dim,
        shape.capacity,
        shape.keys(),
    );
    let qd = nh * hd;
    let group = nh / shape.num_kv_heads;
    fn cached(buf: &[f32], g: usize, cap: usize, n: usize, hd: usize) -> MatRef<'_, f32> {
        MatRef::from_row_major_slice(&buf[g * cap * hd..(g * cap + n) * hd], n, hd)
    }
    let results: Vec<(R, Vec<f32>)> = (0..nh)
        .into_par_iter()
        .map(|h| {
            attend_head(
                head_view(q, 0, shape.queries, qd, h * hd, hd),
                cached(keys, h / group, cap, n, hd),
                Some(cached(values, h / group, cap, n, hd)),
                shape.scale,
                true,
                shape.window,
                precision,
                (0, h),
                visit,
            )
        })
        .collect();
    let mut ctx = vec![0f32; shape.queries * qd];
    let mut heads = Vec::with_capacity(nh);
    for (h, (out, block)) in results.into_iter().enumerate() {
        for (t, row) in block.chunks_exact(hd).enumerate() {
            ctx[t * qd + h * hd..t * qd + (h + 1) * hd].copy_from_slice(row);
        }
        heads.push(out);
    }
    (heads, ctx)
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

/// The CPU backend (see the module docs), in f32 by default.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend {
    precision: Precision,
}

impl CpuBackend {
    pub fn new(precision: Precision) -> CpuBackend {
        CpuBackend { precision }
    }

    fn bf16(&self) -> bool {
        !self.precision.is_f32()
    }

    /// Round in place where the precision asks for it.
    fn round_all(&self, x: &mut [f32]) {
        if self.bf16() {
            let p = self.precision;
            x.par_iter_mut().for_each(|v| *v = p.round(*v));
        }
    }
}

/// A weight held by the CPU backend for a decode ([`Backend::store`]).
pub enum CpuStored<'w> {
    /// The stored bytes, read in place by [`stored::linear_stored`].
    Mapped {
        dtype: safetensors::Dtype,
        bytes: &'w [u8],
    },
    /// Decoded and rounded to bf16: an f32 or f16 checkpoint run in bf16, whose weights must be
    /// rounded as [`CpuBackend::load`] rounds them.
    Decoded(Vec<f32>),
}

impl Backend for CpuBackend {
    type Tensor = Vec<f32>;
    type Stored<'w> = CpuStored<'w>;

    fn describe(&self) -> String {
        "cpu".into()
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn round(&self, x: &mut Vec<f32>) -> Result<()> {
        self.round_all(x);
        Ok(())
    }

    fn upload(&self, host: Vec<f32>) -> Result<Vec<f32>> {
        Ok(host)
    }

    fn load(&self, model: &Model, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let mut w = model.tensor(name, shape)?;
        self.round_all(&mut w);
        Ok(w)
    }

    fn store<'w>(&self, model: &Model<'w>, name: &str, shape: &[usize]) -> Result<CpuStored<'w>> {
        let (dtype, bytes) = model.stored_bytes(name, shape)?;
        if self.bf16() && dtype != safetensors::Dtype::BF16 {
            return Ok(CpuStored::Decoded(self.load(model, name, shape)?));
        }
        Ok(CpuStored::Mapped { dtype, bytes })
    }

    fn linear_stored(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: &CpuStored<'_>,
        out_features: usize,
        in_features: usize,
    ) -> Result<Vec<f32>> {
        Ok(match w {
            CpuStored::Mapped { dtype, bytes } => {
                stored::linear_stored(x, rows, bytes, *dtype, out_features, in_features)?
            }
            CpuStored::Decoded(w) => linear(x, rows, w, out_features, in_features),
        })
    }

    fn cache_write(
        &self,
        cache: &mut Vec<f32>,
        new: &Vec<f32>,
        shape: &CachedShape,
        at: usize,
    ) -> Result<()> {
        cache_write(cache, new, shape, at);
        Ok(())
    }

    fn attention_cached<R: Send>(
        &self,
        q: &Vec<f32>,
        keys: &Vec<f32>,
        values: &Vec<f32>,
        shape: &CachedShape,
        visit: &Visitor<R>,
    ) -> Result<Attended<R, Vec<f32>>> {
        let (heads, context) = attention_cached(q, keys, values, shape, self.precision, visit);
        Ok(Attended {
            heads,
            context: Some(context),
        })
    }

    fn linear(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: &Vec<f32>,
        out_features: usize,
        in_features: usize,
    ) -> Result<Vec<f32>> {
        Ok(linear(x, rows, w, out_features, in_features))
    }

    fn add_bias(&self, y: &mut Vec<f32>, b: &Vec<f32>, width: usize) -> Result<()> {
        debug_assert_eq!(b.len(), width);
        add_bias(y, b);
        Ok(())
    }

    fn rms_norm_rows(
        &self,
        x: &mut Vec<f32>,
        width: usize,
        w: &Vec<f32>,
        eps: f32,
        style: Bf16Style,
    ) -> Result<()> {
        rms_norm_rows(x, width, w, eps, self.precision, style);
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        width: usize,
        w: &Vec<f32>,
        eps: f32,
        style: Bf16Style,
    ) -> Result<Vec<f32>> {
        let mut y = x.clone();
        self.rms_norm_rows(&mut y, width, w, eps, style)?;
        Ok(y)
    }

    fn clamp(&self, x: &mut Vec<f32>, c: f32) -> Result<()> {
        // In bf16 the bound itself is rounded when it is written.
        let p = self.precision;
        x.par_iter_mut().for_each(|v| *v = p.round(v.clamp(-c, c)));
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        width: usize,
        head_dim: usize,
        segments: &[(Range<usize>, &RopeTable)],
        style: Bf16Style,
    ) -> Result<()> {
        let p = self.precision;
        for (rows, table) in segments {
            x[rows.start * width..rows.end * width]
                .par_chunks_mut(width)
                .enumerate()
                .for_each(|(t, row)| {
                    row.chunks_mut(head_dim).for_each(|h| match (p, style) {
                        (Precision::F32, _) => table.apply(h, t),
                        (Precision::Bf16, Bf16Style::Llama) => table.apply_bf16(h, t),
                        (Precision::Bf16, Bf16Style::Olmo) => {
                            table.apply(h, t);
                            h.iter_mut().for_each(|v| *v = p.round(*v));
                        }
                    })
                });
        }
        Ok(())
    }

    fn attention<R: Send>(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: Option<&Vec<f32>>,
        shape: &AttentionShape,
        visit: &Visitor<R>,
    ) -> Result<Attended<R, Vec<f32>>> {
        let (nh, hd) = (shape.num_heads, shape.head_dim);
        let (qd, kd) = (nh * hd, shape.num_kv_heads * hd);
        let group = shape.group();
        let tasks: Vec<(usize, usize)> = (0..shape.prompts.len())
            .flat_map(|pi| (0..nh).map(move |h| (pi, h)))
            .collect();
        let results: Vec<(R, Vec<f32>)> = tasks
            .par_iter()
            .map(|&(pi, h)| {
                let range = &shape.prompts[pi];
                let (off, len) = (range.start, range.len());
                let g = h / group;
                let view = |buf, width, head| head_view(buf, off, len, width, head * hd, hd);
                attend_head(
                    view(q, qd, h),
                    view(k, kd, g),
                    v.map(|v| view(v, kd, g)),
                    shape.scale,
                    shape.causal,
                    shape.window,
                    self.precision,
                    (pi, h),
                    visit,
                )
            })
            .collect();
        let Some(_) = v else {
            return Ok(Attended {
                heads: results.into_iter().map(|(out, _)| out).collect(),
                context: None,
            });
        };
        let n = q.len() / qd;
        let mut ctx = vec![0f32; n * qd];
        let mut heads = Vec::with_capacity(results.len());
        for (&(pi, h), (out, block)) in tasks.iter().zip(results) {
            let off = shape.prompts[pi].start;
            for (t, row) in block.chunks_exact(hd).enumerate() {
                let dst = (off + t) * qd + h * hd;
                ctx[dst..dst + hd].copy_from_slice(row);
            }
            heads.push(out);
        }
        Ok(Attended {
            heads,
            context: Some(ctx),
        })
    }

    fn layer_norm(
        &self,
        x: &Vec<f32>,
        width: usize,
        w: &Vec<f32>,
        b: &Vec<f32>,
        eps: f32,
    ) -> Result<Vec<f32>> {
        assert_eq!((w.len(), b.len()), (width, width), "layer norm weights");
        let p = self.precision;
        let mut y = x.clone();
        y.par_chunks_mut(width).for_each(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
            let var = row
                .iter()
                .map(|&v| (v as f64 - mean) * (v as f64 - mean))
                .sum::<f64>()
                / width as f64;
            let (mean, inv) = (mean as f32, 1.0 / ((var as f32) + eps).sqrt());
            for ((v, &wj), &bj) in row.iter_mut().zip(w).zip(b) {
                *v = p.round((*v - mean) * inv * wj + bj);
            }
        });
        Ok(y)
    }

    fn activate(&self, x: &mut Vec<f32>, act: Activation) -> Result<()> {
        let p = self.precision;
        x.par_chunks_mut(1 << 14)
            .for_each(|c| c.iter_mut().for_each(|v| *v = p.round(act.apply(*v))));
        Ok(())
    }

    fn scale_columns(&self, x: &mut Vec<f32>, width: usize, w: &Vec<f32>) -> Result<()> {
        assert_eq!(w.len(), width, "column scale");
        let p = self.precision;
        x.par_chunks_mut(width).for_each(|row| {
            for (v, &s) in row.iter_mut().zip(w) {
                *v = p.round(*v * s);
            }
        });
        Ok(())
    }

    fn act_mul(&self, gate: &mut Vec<f32>, up: &Vec<f32>, act: Activation) -> Result<()> {
        // SiLU, the supported architectures' default, keeps its vectorised exponential (and
        // its results to the byte); the other activations are computed a value at a time.
        let silu_gate = act == Activation::Silu;
        if silu_gate && !self.bf16() {
            silu_mul(gate, up);
            return Ok(());
        }
        let p = self.precision;
        gate.par_iter_mut().zip(up.par_iter()).for_each(|(g, &u)| {
            let a = if silu_gate { silu(*g) } else { act.apply(*g) };
            *g = p.round(p.round(a) * u)
        });
        Ok(())
    }

    fn add_assign(&self, a: &mut Vec<f32>, b: &Vec<f32>) -> Result<()> {
        add_assign(a, b);
        self.round_all(a);
        Ok(())
    }

    fn all_finite(&self, x: &Vec<f32>) -> Result<bool> {
        Ok(x.par_iter().all(|v| v.is_finite()))
    }

    fn to_host<'t>(&self, x: &'t Vec<f32>) -> Result<Cow<'t, [f32]>> {
        Ok(Cow::Borrowed(x))
    }

    fn zeros(&self, rows: usize, width: usize) -> Result<Vec<f32>> {
        Ok(zeroed(rows * width))
    }

    fn slice_rows(&self, x: &Vec<f32>, width: usize, rows: Range<usize>) -> Result<Vec<f32>> {
        Ok(x[rows.start * width..rows.end * width].to_vec())
    }

    fn concat_rows(&self, parts: Vec<Vec<f32>>) -> Result<Vec<f32>> {
        let mut parts = parts.into_iter();
        let mut out = parts.next().unwrap_or_default();
        for p in parts {
            out.extend(p);
        }
        Ok(out)
    }

    fn gather_rows(&self, x: &Vec<f32>, width: usize, index: &[u32]) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(index.len() * width);
        for &t in index {
            let t = t as usize;
            out.extend_from_slice(&x[t * width..(t + 1) * width]);
        }
        Ok(out)
    }

    fn scatter_add_rows(
        &self,
        out: &mut Vec<f32>,
        y: &Vec<f32>,
        width: usize,
        index: &[u32],
        weight: &[f32],
    ) -> Result<()> {
        let p = self.precision;
        for ((&t, &w), row) in index.iter().zip(weight).zip(y.chunks_exact(width)) {
            let t = t as usize;
            let out = &mut out[t * width..(t + 1) * width];
            if p.is_f32() {
                for (o, &v) in out.iter_mut().zip(row) {
                    *o += v * w;
                }
            } else {
                // torch: `expert(x) * weight.to(bf16)`, then `index_add_` into bf16.
                let w = p.round(w);
                for (o, &v) in out.iter_mut().zip(row) {
                    *o = p.round(*o + p.round(v * w));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_accepts_the_allocator_settings() {
        keep_freed_buffers();
        // mallopt returns 1 when it takes a value and 0 when it refuses one, which
        // keep_freed_buffers cannot report: check that both values are taken.
        let accepted = unsafe {
            (
                libc::mallopt(libc::M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD),
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX),
            )
        };
        assert_eq!(accepted, (1, 1));
    }

    #[test]
    fn linear_matches_a_naive_product() {
        let (rows, n_in, n_out) = (3, 5, 300);
        let x: Vec<f32> = (0..rows * n_in).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..n_out * n_in).map(|i| (i as f32 * 0.11).cos()).collect();
        let b: Vec<f32> = (0..n_out).map(|i| i as f32 * 0.01).collect();
        let mut y = linear(&x, rows, &w, n_out, n_in);
        add_bias(&mut y, &b);
        for r in 0..rows {
            for o in 0..n_out {
                let want: f32 = (0..n_in)
                    .map(|k| x[r * n_in + k] * w[o * n_in + k])
                    .sum::<f32>()
                    + b[o];
                assert!((y[r * n_out + o] - want).abs() < 1e-5, "{r} {o}");
            }
        }
    }

    /// The blocks of `linear` give the bits of one unsplit faer call, which are chains of fused
    /// multiply-adds over 512-wide slices of the inner dimension, summed in order: splitting rows
    /// and columns (or a faster kernel keeping that order) leaves every output unchanged.
    #[test]
    fn linear_blocks_leave_every_bit_unchanged() {
        let (rows, n_in, n_out) = (200, 1100, 200);
        assert!(row_blocks(rows, n_out) > 1, "the shape must split its rows");
        assert!(n_out > OUT_BLOCK, "the shape must split its columns");
        let x: Vec<f32> = (0..rows * n_in).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..n_out * n_in).map(|i| (i as f32 * 0.11).cos()).collect();
        let y = linear(&x, rows, &w, n_out, n_in);
        let mut whole = vec![0f32; rows * n_out];
        matmul(
            MatMut::from_row_major_slice_mut(&mut whole, rows, n_out),
            Accum::Replace,
            MatRef::from_row_major_slice(&x, rows, n_in),
            MatRef::from_row_major_slice(&w, n_out, n_in).transpose(),
            1.0f32,
            Par::Seq,
        );
        clear_upper_state();
        assert!(y
            .iter()
            .zip(&whole)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        #[cfg(target_arch = "x86_64")]
        for (r, o) in [(0, 0), (77, 13), (120, 193), (199, 199)] {
            let (x, w) = (&x[r * n_in..][..n_in], &w[o * n_in..][..n_in]);
            let chain = |k: Range<usize>| k.fold(0f32, |acc, k| x[k].mul_add(w[k], acc));
            let want = chain(0..512) + chain(512..1024) + chain(1024..n_in);
            assert_eq!(y[r * n_out + o].to_bits(), want.to_bits(), "({r}, {o})");
        }
    }

    #[test]
    fn softmax_respects_causality_and_window() {
        let scores: Vec<f32> = (0..16).map(|i| i as f32 * 0.1).collect();
        let p = softmax_masked(&scores, 4, 4, 0, true, Some(2));
        for q in 0..4 {
            let row = &p[q * 4..q * 4 + 4];
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            for (k, &v) in row.iter().enumerate() {
                assert_eq!(v == 0.0, k > q || k + 2 <= q, "q {q} k {k}");
            }
        }
        // The last two rows over a cache of the first two: the same rows, bit for bit.
        let tail = softmax_masked(&scores[8..], 2, 4, 2, true, Some(2));
        assert_eq!(tail, p[8..]);
    }

    /// A cache written a row at a time holds what one write of every row holds, and attention
    /// of the last rows over it equals those rows of a whole prompt's attention.
    #[test]
    fn attention_over_a_cache_equals_the_whole_prompts_rows() {
        let (nh, nkv, hd, len) = (4, 2, 8, 7);
        let value = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
        let q: Vec<f32> = (0..len * nh * hd).map(value).collect();
        let k: Vec<f32> = (0..len * nkv * hd).map(|i| value(i + 7)).collect();
        let v: Vec<f32> = (0..len * nkv * hd).map(|i| value(i + 13)).collect();
        for window in [None, Some(3)] {
            let prompts = std::slice::from_ref(&(0..len)).to_vec();
            let whole = AttentionShape {
                prompts: &prompts,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                causal: true,
                window,
                scale: (hd as f32).powf(-0.5),
            };
            let be = CpuBackend::default();
            let full = be
                .attention(&q, &k, Some(&v), &whole, &|h| h.probs.to_vec())
                .unwrap();
            let cap = len + 2;
            let (mut kc, mut vc) = (vec![0f32; cap * nkv * hd], vec![0f32; cap * nkv * hd]);
            let shape = |queries, offset| CachedShape {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                capacity: cap,
                queries,
                offset,
                window,
                scale: (hd as f32).powf(-0.5),
            };
            let prefix = len - 2;
            cache_write(&mut kc, &k[..prefix * nkv * hd], &shape(prefix, 0), 0);
            cache_write(&mut vc, &v[..prefix * nkv * hd], &shape(prefix, 0), 0);
            for t in prefix..len {
                let row = t * nkv * hd..(t + 1) * nkv * hd;
                cache_write(&mut kc, &k[row.clone()], &shape(1, t), t);
                cache_write(&mut vc, &v[row], &shape(1, t), t);
                let qt = &q[t * nh * hd..(t + 1) * nh * hd];
                let (heads, ctx) = attention_cached(
                    qt,
                    &kc,
                    &vc,
                    &shape(1, t),
                    Precision::F32,
                    &|h: &HeadView| h.probs.to_vec(),
                );
                // faer's one-row product sums in another order than the square one: a few ulps.
                let close =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6);
                let want_ctx = &full.context.as_ref().unwrap()[t * nh * hd..(t + 1) * nh * hd];
                assert!(
                    close(&ctx, want_ctx),
                    "context of row {t}, window {window:?}"
                );
                for (h, probs) in heads.iter().enumerate() {
                    let want = &full.heads[h][t * len..t * len + t + 1];
                    assert_eq!(probs.len(), want.len());
                    assert!(close(probs, want), "head {h} row {t}, window {window:?}");
                    // Masked keys (outside the window) are exactly 0 in both.
                    for (p, w) in probs.iter().zip(want) {
                        assert_eq!(*p == 0.0, *w == 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_mode_stores_every_result_in_bf16() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3");
        let ckpt = crate::checkpoint::Checkpoint::open_dir(&dir, "qwen3").unwrap();
        let prompts = vec![vec![1u32, 5, 9, 2, 7, 3, 8], vec![4, 4, 6]];
        let bf16 =
            crate::forward::pass::record_all_on(&CpuBackend::new(Precision::Bf16), &ckpt, &prompts)
                .unwrap();
        let f32 = crate::forward::pass::record_all(&ckpt, &prompts).unwrap();
        let exact = |v: &f32| Precision::Bf16.round(*v) == *v;
        for layer in &bf16.attentions {
            assert!(
                layer.iter().flatten().all(exact),
                "probabilities are bf16 values"
            );
        }
        assert!(
            bf16.logits.iter().flatten().all(exact),
            "logits are bf16 values"
        );
        let (dp, dl) = crate::sink::parity::recorded_diff(&f32, &bf16);
        // bf16 moves the numbers by about its resolution, no more.
        assert!(dp > 0.0 && dp < 0.05, "{dp}");
        assert!(dl > 0.0 && dl < 0.5, "{dl}");
    }

    #[test]
    fn bf16_rounding_is_torchs() {
        // Round to nearest even on the 16th bit; NaN stays NaN; overflow goes to infinity.
        let r = |x: f32| Precision::Bf16.round(x);
        assert_eq!(r(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(r(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(r(1.0 + 1.0 / 256.0 + 1e-6), 1.0 + 2.0 / 256.0);
        assert!(r(f32::NAN).is_nan());
        assert_eq!(r(f32::MAX), f32::INFINITY);
        assert_eq!(Precision::F32.round(0.1), 0.1);
    }

    #[test]
    fn rms_norm_gives_unit_rms() {
        let mut x = vec![3.0f32, -4.0, 0.0, 5.0];
        rms_norm_rows(&mut x, 4, &[1.0; 4], 0.0, Precision::F32, Bf16Style::Llama);
        let ms: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
        assert_eq!(silu(0.0), 0.0);
    }
}
