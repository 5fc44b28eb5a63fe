//! The forward pass, shared by every command that runs a model: `score`, `heads`, `parity`, text
//! loss, `trace` and `visual-sinks`. Like candle's split between `candle-nn` and
//! `candle-transformers/models`, the operations live apart from the architectures that use them.
//!
//! The files form a stack: each imports only files on floors below its own (none on its floor),
//! bottom to top:
//!
//! ```text
//! 0 precision.rs
//! 0 activation.rs
//! 1 model/
//! 2 memory.rs
//! 2 weights.rs
//! 3 backend/
//! 4 rope.rs
//! 4 device.rs
//! 4 cache.rs
//! 4 resident.rs
//! 5 decoder.rs
//! 6 vision/
//! 7 pass.rs
//! 8 vlm.rs
//! 9 capture.rs
//! ```
//!
//! - [`precision`]: `--precision` and where the bf16 path rounds.
//! - [`activation`]: the pointwise activations, by their `hidden_act` names.
//! - [`model`]: the supported decoder architectures, one file each, as switches over one skeleton.
//! - [`weights`]: an opened checkpoint as the pass's weight source, and reading ahead.
//! - [`backend`]: where tensor operations run: [`backend::cpu`] and [`backend::cuda`].
//! - [`rope`]: rotary embeddings (default, linear, dynamic, llama3, yarn) as transformers computes them.
//! - [`decoder`]: the decoder recipe, one layer at a time, written once over the backend; per-head
//!   scores go to visitors, never stored for all layers.
//! - [`vision`]: the VLMs' vision towers, one file per family, over the same backend.
//! - [`pass`]: the one loop over the layers, with hooks, that every pass runs;
//!   [`pass::record_all`] keeps everything for parity tests.
//! - [`capture`]: one full forward pass keeping the activations `trace` writes.
//! - [`memory`]: the host memory a pass over a long prompt will hold, checked before it runs.
//! - [`vlm`]: a VLM prompt as its processor builds it: placeholders and M-RoPE positions.
//! - [`device`]: `--device` and the one dispatch of a job onto the CPU or CUDA backend.
//! - [`cache`]: a decode's KV cache, as transformers' `DynamicCache` holds keys and values.
//! - [`resident`]: a decode's weights, held for every step in their stored dtype.

pub mod activation;
pub mod backend;
pub mod cache;
pub mod capture;
pub mod decoder;
pub mod device;
pub mod memory;
pub mod model;
pub mod pass;
pub mod precision;
pub mod resident;
pub mod rope;
pub mod vision;
pub mod vlm;
pub mod weights;
