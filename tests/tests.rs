//! The integration tests, one module per command or area, in one binary (as ripgrep does): the
//! crate is linked once instead of once per file. `util` holds what the modules share, above all
//! [`util::sinkmerge`], which runs the binary with the Hugging Face environment isolated. A new
//! file of tests is a new `mod` line here; `cargo test --test tests MODULE::` runs one module.

// The tests print what they measured (with --nocapture); the rule against printing is for the
// commands, whose reports go through their writer (clippy.toml).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

mod util;

mod ablate;
mod adversarial_configs;
mod adversarial_misc;
mod adversarial_outputs;
mod adversarial_paths;
mod adversarial_resume;
mod adversarial_sizes;
mod bad_flags;
mod bad_input;
mod browser;
mod cuda_loading;
mod docs_links;
mod exit_codes;
mod extract;
mod fuzz;
mod generate;
mod graft;
mod heads;
mod hostile_inputs;
mod hub;
mod image;
mod import_graph;
mod inject_qknorm;
mod inspect;
mod merge;
mod merge_configs;
mod non_finite_outputs;
mod norms;
mod perturb;
mod predict;
mod report_writer;
mod reproduce;
mod resolve;
mod score_bytes;
mod score_cli;
mod score_metrics;
mod score_paper;
mod score_parity;
mod score_tokenize;
mod trace;
mod visual_sinks;
mod write_safety;
mod writer;
