//! Calibration prompts: the project's own short instruction-following prompts with verifiable
//! format constraints (IFEval-style, written for sinkmerge, disjoint from IFEval), shipped in the
//! binary. `assets/prompts/default.txt` holds the 15 default prompts; `assets/prompts/pool.txt`
//! holds 100 others, disjoint from them, for seeded draws: the paper's N-sweep (Appendix D.1)
//! draws from a pool of 100 kept apart from the fixed 15. Prompt files have one prompt per line;
//! blank lines are skipped.
//!
//! Draws and bootstrap resamples use SplitMix64 (Steele, Lea and Flood, OOPSLA 2014) with a
//! multiply-shift index, so a few lines of any language reproduce them
//! (`docs/reference/sink-metrics.md`, "Seeded draws").

use std::path::Path;

use rand::{RngCore, SeedableRng};
use rand_xoshiro::SplitMix64;

use crate::bail;
use crate::error::Result;

/// The 15 default prompts.
pub const DEFAULT: &str = include_str!("../../assets/prompts/default.txt");
/// The pool `--n` and `--sweep` draw from (disjoint from the defaults).
pub const POOL: &str = include_str!("../../assets/prompts/pool.txt");

/// Which prompts were used, for reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PromptSource {
    /// The built-in default set.
    Default,
    /// `n` prompts drawn from the built-in pool with `seed`.
    Pool { n: usize, seed: u64 },
    /// The union of the `--sweep` draws: `seeds` draws of each size in `n`.
    Sweep { n: Vec<usize>, seeds: usize },
    /// A user file.
    File { path: String },
}

/// The prompts of `--prompts FILE`, else of `--n N --seed SEED`, else the default set, and where
/// they came from.
pub fn choose(
    file: Option<&Path>,
    n: Option<usize>,
    seed: u64,
) -> Result<(Vec<String>, PromptSource)> {
    Ok(match (file, n) {
        (Some(path), _) => (
            read_file(path)?,
            PromptSource::File {
                path: path.display().to_string(),
            },
        ),
        (None, Some(n)) => (draw(n, seed)?, PromptSource::Pool { n, seed }),
        (None, None) => (default_prompts(), PromptSource::Default),
    })
}

/// One prompt per non-blank line (the line break is not part of the prompt). `what` names the
/// source in errors.
pub fn parse(text: &str, what: &str) -> Result<Vec<String>> {
    let prompts: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    if prompts.is_empty() {
        bail!("{what}: no prompts (the file is empty or blank; write one prompt per line)");
    }
    Ok(prompts)
}

/// The built-in default prompts.
pub fn default_prompts() -> Vec<String> {
    parse(DEFAULT, "assets/prompts/default.txt").expect("the built-in prompts are not empty")
}

/// The built-in pool.
pub fn pool() -> Vec<String> {
    parse(POOL, "assets/prompts/pool.txt").expect("the built-in pool is not empty")
}

/// A seeded stream of indices: SplitMix64 with `state = seed`, and `index(n) = (x · n) >> 64` for
/// each 64-bit output `x` (Lemire's multiply-shift, without rejection: the bias is below
/// n / 2^64).
pub struct IndexStream(SplitMix64);

impl IndexStream {
    pub fn new(seed: u64) -> IndexStream {
        IndexStream(SplitMix64::from_seed(seed.to_le_bytes()))
    }

    /// An index in `0..n`.
    pub fn index(&mut self, n: usize) -> usize {
        ((self.0.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// Pool indices of the `n` prompts drawn with `seed`, ascending: a partial Fisher-Yates shuffle
/// of `0..pool_len` (for each `i < n`, swap `i` with `i + index(pool_len - i)`), whose first `n`
/// entries are then sorted.
pub fn draw_indices(n: usize, seed: u64, pool_len: usize) -> Result<Vec<usize>> {
    if n == 0 || n > pool_len {
        bail!("--n {n}: the built-in pool holds {pool_len} prompts; choose 1 to {pool_len}");
    }
    let mut stream = IndexStream::new(seed);
    let mut order: Vec<usize> = (0..pool_len).collect();
    for i in 0..n {
        let j = i + stream.index(pool_len - i);
        order.swap(i, j);
    }
    order.truncate(n);
    order.sort_unstable();
    Ok(order)
}

/// `n` distinct prompts of the pool drawn with `seed` ([`draw_indices`]), in pool order.
/// Deterministic for a given (n, seed) on every platform.
pub fn draw(n: usize, seed: u64) -> Result<Vec<String>> {
    let pool = pool();
    let picked = draw_indices(n, seed, pool.len())?;
    Ok(picked.into_iter().map(|i| pool[i].clone()).collect())
}

/// Prompts from a file, or from standard input for `-` (docs/reference/checkpoints.md, "Input
/// files and their caps").
pub fn read_file(path: &Path) -> Result<Vec<String>> {
    let text = crate::input::read_stream_text(path, crate::input::PROMPTS)?;
    parse(&text, &crate::input::shown(path).display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_sets_have_the_documented_sizes() {
        let default = default_prompts();
        let pool = pool();
        assert_eq!(default.len(), 15);
        assert_eq!(pool.len(), 100, "--n 100 takes the whole pool");
        assert!(
            default.iter().all(|d| !pool.contains(d)),
            "the pool is disjoint from the defaults"
        );
        let mut unique = pool.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), pool.len(), "no duplicate prompts");
    }

    #[test]
    fn draws_are_seeded_distinct_and_ordered() {
        let a = draw(15, 0).unwrap();
        assert_eq!(a, draw(15, 0).unwrap());
        assert_ne!(a, draw(15, 1).unwrap());
        let pool = pool();
        let positions: Vec<usize> = a
            .iter()
            .map(|p| pool.iter().position(|q| q == p).unwrap())
            .collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]));
        assert!(draw(0, 0).is_err());
        assert!(draw(pool.len() + 1, 0).is_err());
        assert_eq!(draw(pool.len(), 5).unwrap(), pool);
    }

    #[test]
    fn the_index_stream_is_splitmix64() {
        // SplitMix64's first outputs for seed 0 (Vigna's reference splitmix64.c).
        let mut raw = SplitMix64::from_seed(0u64.to_le_bytes());
        assert_eq!(raw.next_u64(), 0xe220a8397b1dcdaf);
        assert_eq!(raw.next_u64(), 0x6e789e6aa1b965f4);
        // index(n) keeps the top bits: (0xe220a8397b1dcdaf * 10) >> 64 = 8.
        assert_eq!(IndexStream::new(0).index(10), 8);
        assert_eq!(
            draw_indices(3, 0, 10).unwrap(),
            draw_indices(3, 0, 10).unwrap()
        );
    }

    #[test]
    fn blank_files_are_refused() {
        assert!(parse("\n  \n", "x").is_err());
        assert_eq!(parse("a\n\nb\n", "x").unwrap(), vec!["a", "b"]);
    }
}
