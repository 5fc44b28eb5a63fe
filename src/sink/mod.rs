//! The sink scorer: a layer-streaming f32 decoder forward pass that matches transformers' eager
//! attention, and the attention-sink metrics of the paper (Sink Strength S, G_base, B_gap,
//! margin, pos0 share; `docs/reference/sink-metrics.md`).
//!
//! - [`model`]: the supported architectures, one file each, as switches over one skeleton.
//! - [`rope`]: rotary embeddings (default, linear, dynamic, llama3, yarn) as transformers computes them.
//! - [`backend`]: where the recipe's tensor operations run: [`backend::cpu`] and [`backend::cuda`].
//! - [`forward`]: the decoder recipe, written once over the backend; per-head scores go to visitors, never stored for
//!   all layers; [`forward::trace`] keeps everything for parity tests.
//! - [`metrics`]: G, B, sink positions, pos0 and exact medians (docs/reference/sink-metrics.md#observations).
//! - [`score`]: several models in lockstep, the reference first, into one report.
//! - [`prompts`] and [`tokenize`]: the shipped calibration prompts, tokenizer.json encoding and
//!   chat templates.
//! - [`text_loss`]: next-token loss and perplexity on a text file, a capability proxy beside the
//!   sink metrics.

pub mod backend;
pub mod forward;
pub mod metrics;
pub mod model;
pub mod parity;
pub mod prompts;
pub mod rope;
pub mod score;
pub mod text_loss;
pub mod tokenize;
