//! The pointwise activations of the MLPs and vision towers, by their Hugging Face `hidden_act`
//! names: a spec names one ([`crate::forward::model::DecoderSpec`]), a backend applies it.

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
