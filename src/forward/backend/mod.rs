//! The seam between the decoder recipe ([`crate::forward::decoder`]) and where its tensor operations
//! run. The recipe walks a [`crate::forward::model::DecoderSpec`] once, for every backend; a backend
//! only implements operations. Adding an architecture touches no backend.
//!
//! What the seam names lives here or below it: the attention's layout ([`AttentionShape`]), the
//! head a visitor sees ([`HeadView`]), the rotary table ([`RopeTable`]), and the weights' source
//! ([`crate::forward::weights::Model`]).
//!
//! - [`cpu`]: f32 on the host (faer GEMMs, rayon); always built.
//! - [`cuda`]: an NVIDIA GPU through cudarc (cuBLAS GEMMs, NVRTC-compiled kernels), loaded at run
//!   time, so the crate builds and runs on machines without CUDA.
//!
//! Tensors are row-major `[rows, cols]` f32 matrices (one row per token); each operation is given
//! the shapes it needs, as the CPU kernels always were.

use std::borrow::Cow;
use std::ops::Range;

use super::activation::Activation;
use super::precision::{Bf16Style, Precision};
use super::weights::Model;
use crate::error::Result;

pub mod cpu;
pub mod cuda;

/// The layout of one layer's attention: which rows belong to which prompt, and the heads.
pub struct AttentionShape<'a> {
    /// Row range of each prompt in the packed `[tokens, ·]` matrices.
    pub prompts: &'a [Range<usize>],
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Whether a query sees only itself and earlier keys (decoders) or every key of its segment
    /// (vision towers: block-diagonal attention over images or windows, each a "prompt").
    pub causal: bool,
    /// Keys a query sees in a sliding-window layer (itself included), if any; causal only.
    pub window: Option<usize>,
    /// Multiplies `q kᵀ` (`head_dim^-1/2`).
    pub scale: f32,
}

impl AttentionShape<'_> {
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// The layout of one layer's attention over a KV cache ([`Backend::attention_cached`]): one
/// sequence whose `queries` new tokens, at positions `offset..offset + queries`, attend every
/// cached key up to their own (causal, within the layer's window).
pub struct CachedShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Positions the cache has room for: the stride between its heads.
    pub capacity: usize,
    pub queries: usize,
    pub offset: usize,
    pub window: Option<usize>,
    pub scale: f32,
}

impl CachedShape {
    /// Keys the last query sees the end of: the cache's filled positions.
    pub fn keys(&self) -> usize {
        self.offset + self.queries
    }
}

/// What [`Backend::attention`] returns: every visited head's result in prompt-major order
/// (`prompt * num_heads + head`), and the context `P v` as `[tokens, num_heads * head_dim]` when
/// values were given.
pub struct Attended<R, T> {
    pub heads: Vec<R>,
    pub context: Option<T>,
}

/// One head of one prompt, as a visitor sees it.
pub struct HeadView<'a> {
    pub prompt: usize,
    pub head: usize,
    /// Queries: the prompt's tokens (or, over a KV cache, the new tokens).
    pub len: usize,
    /// Keys each row spans: `len` for a whole prompt; over a KV cache, every cached position
    /// and the new ones.
    pub keys: usize,
    /// The position of query row 0 (`keys - len`; 0 for a whole prompt).
    pub offset: usize,
    /// `[len, keys]` row-major attention scores after scaling, before the mask
    /// (`scores[q*keys+p]` is meaningful for the keys query `q` sees:
    /// `first_key(q) <= p <= offset + q`).
    pub scores: &'a [f32],
    /// `[len, keys]` softmax probabilities, exactly 0 for masked keys.
    pub probs: &'a [f32],
    /// Whether the attention is causal (every decoder layer); the vision towers' is not, and
    /// [`HeadView::first_key`] then does not describe it.
    pub causal: bool,
    /// Sliding window of this layer (keys a query sees, itself included), if any.
    pub window: Option<usize>,
}

impl HeadView<'_> {
    /// The first key query row `q` sees.
    #[inline]
    pub fn first_key(&self, q: usize) -> usize {
        first_key(self.offset + q, self.window)
    }
}

#[inline]
pub(crate) fn first_key(q: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (q + 1).saturating_sub(w))
}

/// A visitor of one head of one prompt (the metric accumulators, or a probability dump).
pub type Visitor<'v, R> = dyn Fn(&HeadView) -> R + Sync + 'v;

/// cos/sin per position, `half = head_dim / 2` entries per position: the table a backend
/// rotates heads with. The decoder's tables are built from a rope's frequencies in
/// [`crate::forward::rope`]; the vision towers' from their own angles.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// A table whose row `t` holds the angles `angles[t * half..(t + 1) * half]`: M-RoPE and the
    /// vision towers' 2-D rotary give each token angles of its own (from its (t, h, w) position),
    /// computed in f32 as transformers does (`position * inv_freq`); cos and sin as in
    /// [`RopeTable::new`].
    pub fn from_angles(half: usize, angles: &[f32], attention_scaling: f32) -> RopeTable {
        assert_eq!(angles.len() % half.max(1), 0, "rope angles per row");
        let cos = angles
            .iter()
            .map(|&a| (a as f64).cos() as f32 * attention_scaling)
            .collect();
        let sin = angles
            .iter()
            .map(|&a| (a as f64).sin() as f32 * attention_scaling)
            .collect();
        RopeTable { half, cos, sin }
    }

    /// Rotate one head vector (`2 * half` values) at position `t` in place.
    #[inline]
    pub fn apply(&self, x: &mut [f32], t: usize) {
        let h = self.half;
        let (cos, sin) = (&self.cos[t * h..(t + 1) * h], &self.sin[t * h..(t + 1) * h]);
        let (lo, hi) = x.split_at_mut(h);
        for i in 0..h {
            let (a, b) = (lo[i], hi[i]);
            lo[i] = a * cos[i] - b * sin[i];
            hi[i] = b * cos[i] + a * sin[i];
        }
    }

    /// [`RopeTable::apply`] in bf16 as transformers computes `q * cos + rotate_half(q) * sin`:
    /// cos and sin rounded to bf16, each product and each sum rounded.
    #[inline]
    pub fn apply_bf16(&self, x: &mut [f32], t: usize) {
        let r = |v| Precision::Bf16.round(v);
        let h = self.half;
        let (cos, sin) = (&self.cos[t * h..(t + 1) * h], &self.sin[t * h..(t + 1) * h]);
        let (lo, hi) = x.split_at_mut(h);
        for i in 0..h {
            let (a, b, c, s) = (lo[i], hi[i], r(cos[i]), r(sin[i]));
            lo[i] = r(r(a * c) - r(b * s));
            hi[i] = r(r(b * c) + r(a * s));
        }
    }
}

/// The tensor operations of the decoder recipe and the vision towers.
pub trait Backend: Sync {
    /// A row-major f32 matrix where this backend computes.
    type Tensor: Send;

    /// "cpu", or the GPU's name and index, for reports.
    fn describe(&self) -> String;

    /// The arithmetic every operation follows.
    fn precision(&self) -> Precision;

    /// Round every value to [`Backend::precision`] (nothing to do in f32).
    fn round(&self, x: &mut Self::Tensor) -> Result<()>;

    /// A host matrix moved to the backend.
    fn upload(&self, host: Vec<f32>) -> Result<Self::Tensor>;

    /// Weight `name` of `model` (Hugging Face standard name) of the expected `shape`, as f32.
    fn load(&self, model: &Model, name: &str, shape: &[usize]) -> Result<Self::Tensor>;

    /// A weight matrix held for a whole decode, as this backend keeps it: on the CPU the stored
    /// bytes, mapped from the file and never decoded to f32 (`docs/commands/generate.md`,
    /// "Weights").
    type Stored<'w>: Send + Sync;

    /// Weight `name` of `model` of the expected `shape` (`[out, in]`), held for [`Backend::linear_stored`].
    fn store<'w>(&self, model: &Model<'w>, name: &str, shape: &[usize])
        -> Result<Self::Stored<'w>>;

    /// [`Backend::linear`] with a held weight: `x Wᵀ`, f32 accumulation, not rounded.
    fn linear_stored(
        &self,
        x: &Self::Tensor,
        rows: usize,
        w: &Self::Stored<'_>,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self::Tensor>;

    /// `x Wᵀ` with f32 accumulation, not rounded (the recipe rounds after any bias): `x` is
    /// `[rows, in_features]`, `w` is `[out_features, in_features]` as stored.
    fn linear(
        &self,
        x: &Self::Tensor,
        rows: usize,
        w: &Self::Tensor,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self::Tensor>;

    /// `y[r, :] += b` for every row (`b` has `width` values), not rounded.
    fn add_bias(&self, y: &mut Self::Tensor, b: &Self::Tensor, width: usize) -> Result<()>;

    /// RMSNorm of every `width`-wide row, in place (transformers' f32 path: the mean of squares
    /// accumulated in f64 and rounded once, `w * (x * rsqrt(mean + eps))`; in bf16, rounded as
    /// `style` says).
    fn rms_norm_rows(
        &self,
        x: &mut Self::Tensor,
        width: usize,
        w: &Self::Tensor,
        eps: f32,
        style: Bf16Style,
    ) -> Result<()>;

    /// A normalized copy of `x` (rows of `width`).
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        width: usize,
        w: &Self::Tensor,
        eps: f32,
        style: Bf16Style,
    ) -> Result<Self::Tensor>;

    /// LayerNorm of every `width`-wide row: `(x - mean) / sqrt(var + eps) · w + b` with the
    /// biased variance, the moments accumulated in f64 (a copy; the result rounded once in bf16).
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        width: usize,
        w: &Self::Tensor,
        b: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor>;

    /// `act(x)` elementwise, in place (rounded in bf16).
    fn activate(&self, x: &mut Self::Tensor, act: Activation) -> Result<()>;

    /// `x[r, j] *= w[j]` for every row (`w` has `width` values): InternViT's layer scale.
    fn scale_columns(&self, x: &mut Self::Tensor, width: usize, w: &Self::Tensor) -> Result<()>;

    /// Clamp every value to `[-c, c]`.
    fn clamp(&self, x: &mut Self::Tensor, c: f32) -> Result<()>;

    /// Rotate every `head_dim`-wide head of every row in place; row `segment.0.start + t` is at
    /// position `t` of its prompt and uses that prompt's table (in bf16, rounded as `style`
    /// says).
    fn rope(
        &self,
        x: &mut Self::Tensor,
        width: usize,
        head_dim: usize,
        segments: &[(Range<usize>, &RopeTable)],
        style: Bf16Style,
    ) -> Result<()>;

    /// Scores `q kᵀ · scale` of every prompt and head, the masked softmax, `visit` on each
    /// (prompt, head) with the scores and probabilities on the host, and with `v` the context.
    /// `q` is `[tokens, heads * head_dim]`, `k` and `v` `[tokens, kv_heads * head_dim]`.
    fn attention<R: Send>(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: Option<&Self::Tensor>,
        shape: &AttentionShape,
        visit: &Visitor<R>,
    ) -> Result<Attended<R, Self::Tensor>>;

    /// Write `new` (`[rows, kv_heads · head_dim]`, token-major as the projections make them) into
    /// a KV cache tensor laid out as transformers' `DynamicCache` holds a layer's keys or values,
    /// `[kv_heads, capacity, head_dim]`, at positions `at..at + rows`.
    fn cache_write(
        &self,
        cache: &mut Self::Tensor,
        new: &Self::Tensor,
        shape: &CachedShape,
        at: usize,
    ) -> Result<()>;

    /// Attention of `q` (`[queries, heads · head_dim]`) over the cached `keys` and `values`
    /// ([`Backend::cache_write`]'s layout): the scores, masked softmax and context as
    /// [`Backend::attention`] computes them for the same rows of a whole prompt, each head handed
    /// to `visit` (`len` queries by `keys` columns).
    fn attention_cached<R: Send>(
        &self,
        q: &Self::Tensor,
        keys: &Self::Tensor,
        values: &Self::Tensor,
        shape: &CachedShape,
        visit: &Visitor<R>,
    ) -> Result<Attended<R, Self::Tensor>>;

    /// `gate = act(gate) * up`, elementwise (the gated MLP; each result rounded in bf16).
    fn act_mul(&self, gate: &mut Self::Tensor, up: &Self::Tensor, act: Activation) -> Result<()>;

    /// `a += b`, elementwise.
    fn add_assign(&self, a: &mut Self::Tensor, b: &Self::Tensor) -> Result<()>;

    /// Whether every value is finite.
    fn all_finite(&self, x: &Self::Tensor) -> Result<bool>;

    /// The values on the host (borrowed where they already are).
    fn to_host<'t>(&self, x: &'t Self::Tensor) -> Result<Cow<'t, [f32]>>;

    /// A `[rows, width]` matrix of zeros.
    fn zeros(&self, rows: usize, width: usize) -> Result<Self::Tensor>;

    /// A copy of rows `rows` of `x`.
    fn slice_rows(
        &self,
        x: &Self::Tensor,
        width: usize,
        rows: Range<usize>,
    ) -> Result<Self::Tensor>;

    /// The rows of `parts`, one after another.
    fn concat_rows(&self, parts: Vec<Self::Tensor>) -> Result<Self::Tensor>;

    /// Rows `index[i]` of `x`, in that order.
    fn gather_rows(&self, x: &Self::Tensor, width: usize, index: &[u32]) -> Result<Self::Tensor>;

    /// `out[index[i], :] += y[i, :] * weight[i]` for every i, in order.
    fn scatter_add_rows(
        &self,
        out: &mut Self::Tensor,
        y: &Self::Tensor,
        width: usize,
        index: &[u32],
        weight: &[f32],
    ) -> Result<()>;
}
