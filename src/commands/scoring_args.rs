//! The arguments every scoring command shares (`score`, `heads`): the prompt set, the window,
//! the arithmetic and the device, declared once and flattened into each command's `Args`.

use std::path::PathBuf;

use crate::arch::config::undeclared_layers;
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::device::ComputeDevice;
use crate::forward::precision::Precision;
use crate::sink::prompts::{self, PromptSource};

#[derive(Debug, clap::Args)]
pub struct ScoringArgs {
    /// Prompt file, one prompt per line (blank lines skipped) [default: the 15 built-in prompts]
    #[arg(long, value_name = "FILE", conflicts_with = "n")]
    pub prompts: Option<PathBuf>,

    /// Draw N prompts from the built-in pool of 100 instead (kept apart from the 15 defaults, as
    /// the paper's N-sweep pool is, Appendix D.1; `--n 100` takes the whole pool)
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub n: Option<usize>,

    /// Seed of the --n draw (SplitMix64, docs/reference/sink-metrics.md; the same N and seed give
    /// the same prompts everywhere)
    #[arg(
        long,
        value_name = "SEED",
        default_value_t = 0,
        requires = "n",
        allow_negative_numbers = true
    )]
    pub seed: u64,

    /// Window: the last K decoder layers (all layers if the model has fewer). Paper: 10
    #[arg(
        long,
        value_name = "K",
        default_value_t = 10,
        allow_negative_numbers = true
    )]
    pub last: usize,

    /// Render each prompt with the tokenizer's chat template as one user message with the
    /// generation prompt (default: raw prompt text with the tokenizer's special tokens); with a
    /// reference, the reference's template
    #[arg(long)]
    pub chat_template: bool,

    /// Arithmetic of the forward pass: f32 (parity with transformers' f32 eager path), or bf16
    /// (transformers' bf16 eager path, the paper's setting, Appendix B: bf16 weights and
    /// activations, each GEMM, norm, product and residual add rounded to bf16, softmax in f32 on
    /// the rounded scores, probabilities rounded). Metrics use the rounded scores
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,

    /// Where to compute: `cpu`, or `cuda` / `cuda:N` for the NVIDIA GPU of index N (f32 GEMMs
    /// with TF32 off; needs libcuda, libnvrtc and libcublas at run time; weights stream
    /// through, so any model size fits)
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: ComputeDevice,

    /// The most f32 weights held at once, in bytes (suffix K, M, G or T for powers of 1024):
    /// the layer computing and those read ahead (docs/commands/score.md#memory-and-reading-ahead).
    /// By default the next layer is read and decoded while one computes, two layers at most;
    /// under one layer more than the largest layer, less is read ahead, and nothing at one layer
    /// or less
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes, allow_negative_numbers = true)]
    pub max_memory: Option<u64>,
}

/// `N` bytes, or `N` followed by K, M, G or T (powers of 1024; a trailing `B` or `iB` allowed).
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let bad = || format!("`{s}`: give a size in bytes, e.g. 8G, 512M or 1073741824");
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(bad()),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits.trim().parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

impl ScoringArgs {
    /// Check what needs no file (the window holds at least one layer), and set `--max-memory`
    /// for the passes to come.
    pub fn validate(&self) -> Result<()> {
        if self.last == 0 {
            bail!("--last must be at least 1");
        }
        crate::checkpoint::prefetch::set_max_memory(self.max_memory);
        Ok(())
    }

    /// The prompt set (`--prompts`, `--n`/`--seed`, or the built-in default) and its name.
    pub fn prompt_set(&self) -> Result<(Vec<String>, PromptSource)> {
        prompts::choose(self.prompts.as_deref(), self.n, self.seed)
    }
}

/// Warn about each checkpoint whose weights hold more decoder layers than its config declares:
/// the scorer runs the declared ones only, as transformers does.
pub fn warn_undeclared_layers(ckpts: &[Checkpoint]) {
    for c in ckpts {
        if let Some(w) = undeclared_layers(&c.label, &c.config, c.names()) {
            eprintln!("sinkmerge: warning: {w}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("3k"), Ok(3 << 10));
        assert!(parse_bytes("8X").is_err());
        assert!(parse_bytes("G").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }
}
