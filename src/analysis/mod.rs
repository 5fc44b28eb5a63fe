//! Analyses of checkpoints' weights: drift norms between checkpoints.

pub mod norms;
