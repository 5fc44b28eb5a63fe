//! The sink scorer: the attention-sink metrics of the paper (Sink Strength S, G_base, B_gap,
//! margin, pos0 share; `docs/reference/sink-metrics.md`) over layer-streaming forward passes of
//! [`crate::forward`].
//!
//! - [`metrics`]: G, B, sink positions, pos0 and exact medians (docs/reference/sink-metrics.md#observations).
//! - [`score`]: several models in lockstep, the reference first, into one report.
//! - [`inputs`]: each model's token ids of the prompt set and the same-token check B needs.
//! - [`pass`]: a scoring run with its progress bars and `--text` pass, and the default S.
//! - [`sweep`]: the N-sweep's draws and their statistics from one pass over their union.
//! - [`parity`]: a backend against the CPU backend on the same token ids.
//! - [`prompts`] and [`tokenize`]: the shipped calibration prompts, tokenizer.json encoding and
//!   chat templates.
//! - [`visual`]: visual attention sinks of a VLM on an image (`visual-sinks`).
//! - [`text_loss`]: next-token loss and perplexity on a text file, a capability proxy beside the
//!   sink metrics.

pub mod inputs;
pub mod metrics;
pub mod parity;
pub mod pass;
pub mod prompts;
pub mod score;
pub mod sweep;
pub mod text_loss;
pub mod tokenize;
pub mod visual;
