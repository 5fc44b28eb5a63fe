//! The arithmetic of a forward pass: [`Precision`] (`--precision`) and where transformers' bf16
//! path rounds, [`Bf16Style`] (`docs/reference/forward.md`, "The bf16 path"). The floor of the
//! forward stack: the specs, the backends and the recipe all read it.

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
