//! sinkmerge: weight-space analysis and merging of LLM and VLM checkpoints.
//!
//! The crate is organised in rooms with one concern each:
//! - [`checkpoint`]: reading (validated, mmap'd, sharded safetensors), resolving model references
//!   (paths, HF cache, aliases), and writing outputs atomically.
//! - [`arch`]: the tensor-name grammar, config normalization, VLM families, QK-norm classes.
//! - [`report`]: tables and number formatting.
//! - [`commands`] and [`cli`]: the command line, one file per subcommand.

pub mod arch;
pub mod checkpoint;
pub mod cli;
pub mod commands;
pub mod error;
pub mod progress;
pub mod report;

pub use error::{Error, Result};
