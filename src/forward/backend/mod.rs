//! The seam between the decoder recipe ([`crate::forward::decoder`]) and where its tensor operations
//! run. The recipe walks a [`crate::forward::model::DecoderSpec`] once, for every backend; a backend
//! only implements operations. Adding an architecture touches no backend.
//!
//! - [`cpu`]: f32 on the host (faer GEMMs, rayon); always built.
//! - [`cuda`]: an NVIDIA GPU through cudarc (cuBLAS GEMMs, NVRTC-compiled kernels), loaded at run
//!   time, so the crate builds and runs on machines without CUDA.
//!
//! Tensors are row-major `[rows, cols]` f32 matrices (one row per token); each operation is given
//! the shapes it needs, as the CPU kernels always were.

use std::borrow::Cow;
use std::ops::Range;

use super::decoder::{HeadView, Model};
use super::rope::RopeTable;
use crate::error::Result;

pub mod cpu;
pub mod cuda;

/// The arithmetic of a forward pass (`--precision`), defined once for every backend.
///
/// - `F32`: f32 weights and activations, f32 accumulation (the default; transformers' f32 eager
///   path, the parity mode).
/// - `Bf16`: transformers' bf16 eager path (`docs/reference/forward.md`, "The bf16 path"): weights and
///   activations rounded to bf16; every GEMM accumulates in f32 and rounds its output (after the
///   bias, as a fused epilogue does); RMSNorm computes in f32, rounds, then multiplies by the
///   weight and rounds; RoPE, SiLU, products and residual adds round each result; attention
///   scores round after `q kᵀ` and again after the scaling; softmax runs in f32 on the rounded
///   scores and its probabilities are rounded; MoE routing runs in f32 and its weights are
///   rounded.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
}

impl Precision {
    /// `x` as this precision stores it (bf16: round to nearest even, as torch).
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::F32 => x,
            Precision::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }

    pub fn is_f32(&self) -> bool {
        *self == Precision::F32
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// Where transformers' bf16 path rounds inside RMSNorm and RoPE, which differs by architecture
/// (`docs/reference/forward.md`, "The bf16 path"). Nothing changes in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bf16Style {
    /// Qwen, Llama, Mistral, OLMoE: RMSNorm `R(w · R(h))`; RoPE with bf16 cos/sin and every
    /// product and sum rounded, `R(R(q c) + R(rot(q) s))`.
    Llama,
    /// OLMo-2, Olmo-3: RMSNorm `R(w · h)`; RoPE in f32 on f32 cos/sin, rounded once.
    Olmo,
}

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

/// What [`Backend::attention`] returns: every visited head's result in prompt-major order
/// (`prompt * num_heads + head`), and the context `P v` as `[tokens, num_heads * head_dim]` when
/// values were given.
pub struct Attended<R, T> {
    pub heads: Vec<R>,
    pub context: Option<T>,
}

/// A visitor of one head of one prompt (the metric accumulators, or a probability dump).
pub type Visitor<'v, R> = dyn Fn(&HeadView) -> R + Sync + 'v;

/// A pointwise activation, by its Hugging Face `hidden_act` name: every parameter-free entry of
/// transformers' `ACT2FN` (`activations.py`), with its formula's f32 operations in its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `gelu`: `x/2 · (1 + erf(x/√2))`, torch's exact GELU.
    Gelu,
    /// `gelu_pytorch_tanh`, `gelu_new`, `gelu_accurate`:
    /// `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`.
    GeluTanh,
    /// `quick_gelu`: `x · sigmoid(1.702 x)`.
    QuickGelu,
    /// `silu`, `swish`: `x · sigmoid(x)`.
    Silu,
    /// `gelu_python`: `x · 0.5 · (1 + erf(x / √2))`, dividing where torch's kernel multiplies.
    GeluPython,
    /// `gelu_10`: `gelu` clipped to [-10, 10].
    Gelu10,
    /// `gelu_fast`: `x/2 · (1 + tanh(x · 0.7978845608 · (1 + 0.044715 x²)))`.
    GeluFast,
    /// `relu`.
    Relu,
    /// `relu2`: `relu(x)²`.
    Relu2,
    /// `relu6`: `x` clamped to [0, 6].
    Relu6,
    /// `leaky_relu`: `nn.LeakyReLU()`, slope 0.01 below 0.
    LeakyRelu,
    /// `linear`: the identity.
    Linear,
    /// `sigmoid`.
    Sigmoid,
    /// `tanh`.
    Tanh,
    /// `mish`: `x · tanh(log(1 + eˣ))`.
    Mish,
    /// `laplace`: `(1 + erf((x - 0.707107) / (0.282095 · √2))) / 2`.
    Laplace,
}

/// `laplace`'s `mu`: transformers' literal, which is not 1/√2 in f32.
#[allow(clippy::approx_constant)]
const LAPLACE_MU: f32 = 0.707_107;

impl Activation {
    /// Every name [`Activation::from_hf`] accepts, for messages.
    pub const NAMES: &'static str = "silu, swish, gelu, gelu_python, gelu_10, gelu_new, \
        gelu_pytorch_tanh, gelu_accurate, gelu_fast, quick_gelu, relu, relu2, relu6, leaky_relu, \
        linear, sigmoid, tanh, mish, laplace";

    /// The activation named `name` in a config (`hidden_act`). `ACT2FN`'s `prelu` and `xielu`
    /// are not here: they have learned parameters.
    pub fn from_hf(name: &str) -> Option<Activation> {
        Some(match name {
            "gelu" => Activation::Gelu,
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_accurate" => Activation::GeluTanh,
            "quick_gelu" => Activation::QuickGelu,
            "silu" | "swish" => Activation::Silu,
            "gelu_python" => Activation::GeluPython,
            "gelu_10" => Activation::Gelu10,
            "gelu_fast" => Activation::GeluFast,
            "relu" => Activation::Relu,
            "relu2" => Activation::Relu2,
            "relu6" => Activation::Relu6,
            "leaky_relu" => Activation::LeakyRelu,
            "linear" => Activation::Linear,
            "sigmoid" => Activation::Sigmoid,
            "tanh" => Activation::Tanh,
            "mish" => Activation::Mish,
            "laplace" => Activation::Laplace,
            _ => return None,
        })
    }

    /// The activation of one value, in f32 (the CPU backend's definition; `kernels.cu` has the
    /// same formulas). Comparisons are written so that NaN passes through, as in torch.
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        let gelu = |x: f32| x * 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
        let relu = |x: f32| if x < 0.0 { 0.0 } else { x };
        match self {
            Activation::Gelu => gelu(x),
            Activation::GeluTanh => {
                // torch: kBeta = √2 · (2/√π) · ½ = √(2/π), kKappa = 0.044715.
                let beta = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
                let inner = beta * (x + 0.044715 * x * x * x);
                0.5 * x * (1.0 + inner.tanh())
            }
            Activation::QuickGelu => x * (1.0 / (1.0 + (-1.702 * x).exp())),
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::GeluPython => x * 0.5 * (1.0 + libm::erff(x / std::f32::consts::SQRT_2)),
            Activation::Gelu10 => gelu(x).clamp(-10.0, 10.0),
            Activation::GeluFast => {
                0.5 * x * (1.0 + (x * 0.797_884_6 * (1.0 + 0.044715 * x * x)).tanh())
            }
            Activation::Relu => relu(x),
            Activation::Relu2 => relu(x) * relu(x),
            Activation::Relu6 => {
                if x > 6.0 {
                    6.0
                } else {
                    relu(x)
                }
            }
            Activation::LeakyRelu => {
                if x > 0.0 {
                    x
                } else {
                    x * 0.01
                }
            }
            Activation::Linear => x,
            Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Activation::Tanh => x.tanh(),
            Activation::Mish => x * x.exp().ln_1p().tanh(),
            // 0.282095 · √2, as Python computes it before torch casts it to f32.
            Activation::Laplace => 0.5 * (1.0 + libm::erff((x - LAPLACE_MU) / 0.398_942_6)),
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
