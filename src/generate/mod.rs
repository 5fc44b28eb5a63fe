//! Generation: decoding a model's answer token by token over the forward stack's KV cache, as
//! transformers' `generate` does (`docs/commands/generate.md`). Like candle's
//! `candle-transformers/src/generation`, it sits in a room of its own above the forward pass: the
//! forward stack knows nothing of sampling or stopping.

pub mod answer;
pub mod capture;
pub mod config;
pub mod decode;
pub mod sampling;
pub mod sequence;
pub mod teacher;
