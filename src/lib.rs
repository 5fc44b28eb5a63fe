//! sinkmerge: weight-space analysis and merging of LLM and VLM checkpoints.
//!
//! The crate is organised in rooms with one concern each:
//! - [`checkpoint`]: reading (validated, mmap'd, sharded safetensors), resolving model references
//!   (paths, HF cache, aliases), and writing outputs atomically.
//! - [`analysis`]: the sink-strength predictor, the paper's weight-space controls and theory checks,
//!   drift norms between checkpoints.
//! - [`arch`]: the tensor-name grammar, config normalization, VLM families, QK-norm classes.
//! - [`extract`]: running a VLM family's extraction plan (streamed copy, verification, atomic commit).
//! - [`write`](mod@write): the plans for whole output models, above [`checkpoint`]'s disk layer:
//!   a copy of one checkpoint with some tensors recomputed, a language model grafted back into
//!   its VLM (the inverse of the extraction plan), and the model card each carries.
//! - [`linalg`]: deterministic f32 reductions and the seeded per-tensor random streams.
//! - [`dtype`]: decoding and encoding the stored float dtypes (bf16, f16, f32) to and from f32,
//!   below both [`checkpoint`] and [`linalg`], which read stored bytes directly.
//! - [`tensor`]: the decoded f32 tensor all math works on.
//! - [`merge`]: linear, task arithmetic, TIES, DARE, TSV and STAR merges, streamed to disk.
//! - [`report`]: tables, number formatting and SVG plots.
//! - [`shell`]: quoting the command lines that messages and model cards suggest.
//! - [`units`]: quantities in words (`1.5 KiB`) for messages and reports, below every room.
//! - [`forward`]: the forward pass over a backend seam (CPU, CUDA): decoder architectures, rotary
//!   embeddings, and the dispatch onto a device.
//! - [`generate`]: decoding answers over [`forward`]'s KV cache: sampling as transformers'
//!   `generate` defines it, stopping, streaming, key edits and captures at every step.
//! - [`sink`]: the sink scorer and the paper's sink metrics over [`forward`]'s passes.
//! - [`image`]: images to pixel tensors exactly as transformers' PIL image processors make them.
//! - [`input`]: input files read whole (manifests, prompts, panels, pixel values, images), each
//!   a regular file under a size cap, or standard input where a stream makes sense.
//! - [`commands`] and [`cli`]: the command line, one file per subcommand.

// The library exists for the binary, the tests and the benches, and its docs are for the people
// working on it (`cargo doc --document-private-items`, which CI checks): public items may point
// at the private helpers that explain them.
#![allow(rustdoc::private_intra_doc_links)]
// Unit tests print what they measured; the rule against printing (clippy.toml) is for the
// commands, whose reports go through their writer.
#![cfg_attr(test, allow(clippy::disallowed_macros))]

pub mod analysis;
pub mod arch;
pub mod checkpoint;
pub mod cli;
pub mod commands;
pub mod dtype;
pub mod error;
pub mod extract;
pub mod forward;
pub mod generate;
pub mod image;
pub mod input;
pub mod linalg;
pub mod merge;
pub mod progress;
pub mod report;
pub mod reproduce;
pub mod shell;
pub mod sink;
pub mod tensor;
pub mod units;
pub mod write;

pub use error::{Error, Result};
