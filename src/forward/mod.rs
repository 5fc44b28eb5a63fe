//! The forward pass, shared by every command that runs a model: `score`, `heads`, `parity`, text
//! loss and `trace`. Like candle's split between `candle-nn` and `candle-transformers/models`, the
//! operations live apart from the architectures that use them.
//!
//! - [`backend`]: where tensor operations run: [`backend::cpu`] and [`backend::cuda`].
//! - [`model`]: the supported decoder architectures, one file each, as switches over one skeleton.
//! - [`rope`]: rotary embeddings (default, linear, dynamic, llama3, yarn) as transformers computes them.
//! - [`decoder`]: the decoder recipe, written once over the backend; per-head scores go to
//!   visitors, never stored for all layers; [`decoder::trace`] keeps everything for parity tests.
//! - [`vision`]: the VLMs' vision towers, one file per family, over the same backend.
//! - [`capture`]: one full forward pass keeping the activations `trace` writes.
//! - [`memory`]: the host memory a pass over a long prompt will hold, checked before it runs.
//! - [`vlm`]: a VLM prompt as its processor builds it: placeholders and M-RoPE positions.
//! - [`device`]: `--device` and the one dispatch of a job onto the CPU or CUDA backend.

pub mod backend;
pub mod capture;
pub mod decoder;
pub mod device;
pub mod memory;
pub mod model;
pub mod rope;
pub mod vision;
pub mod vlm;
