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
//! - [`inputs`]: each model's token ids of the prompt set and the same-token check B needs.
//! - [`device`]: `--device` and the one dispatch of a job onto the CPU or CUDA backend.
//! - [`pass`]: a scoring run with its progress bars and `--text` pass, and the default S.
//! - [`sweep`]: the N-sweep's draws and their statistics from one pass over their union.
//! - [`parity`]: a backend against the CPU backend on the same token ids.
//! - [`prompts`] and [`tokenize`]: the shipped calibration prompts, tokenizer.json encoding and
//!   chat templates.
//! - [`text_loss`]: next-token loss and perplexity on a text file, a capability proxy beside the
//!   sink metrics.

pub mod backend;
pub mod device;
pub mod forward;
pub mod inputs;
pub mod metrics;
pub mod model;
pub mod parity;
pub mod pass;
pub mod prompts;
pub mod rope;
pub mod score;
pub mod sweep;
pub mod text_loss;
pub mod tokenize;
