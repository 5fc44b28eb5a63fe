//! Calibration prompts: the project's own short instruction-following prompts with verifiable
//! format constraints (IFEval-style, written for sinkmerge, disjoint from IFEval), shipped in the
//! binary. `assets/prompts/default.txt` holds the 15 default prompts; `assets/prompts/pool.txt`
//! holds those 15 followed by 108 more, for seeded draws (the paper's N-sweep, Appendix D.1).
//! Prompt files have one prompt per line; blank lines are skipped.

use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::bail;
use crate::error::{Error, Result};

/// The 15 default prompts.
pub const DEFAULT: &str = include_str!("../../assets/prompts/default.txt");
/// The pool `--n` draws from (the 15 defaults first).
pub const POOL: &str = include_str!("../../assets/prompts/pool.txt");

/// Which prompts were used, for reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PromptSource {
    /// The built-in default set.
    Default,
    /// `n` prompts drawn from the built-in pool with `seed`.
    Pool { n: usize, seed: u64 },
    /// A user file.
    File { path: String },
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

/// `n` distinct prompts of the pool drawn with `seed` (ChaCha8), in pool order. Deterministic
/// for a given (n, seed) on every platform.
pub fn draw(n: usize, seed: u64) -> Result<Vec<String>> {
    let pool = pool();
    if n == 0 || n > pool.len() {
        bail!(
            "--n {n}: the built-in pool holds {} prompts; choose 1 to {}",
            pool.len(),
            pool.len()
        );
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut picked = rand::seq::index::sample(&mut rng, pool.len(), n).into_vec();
    picked.sort_unstable();
    Ok(picked.into_iter().map(|i| pool[i].clone()).collect())
}

/// Prompts from a file.
pub fn read_file(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            crate::bad!("{}: prompt file is missing", path.display())
        } else {
            Error::read(path, e)
        }
    })?;
    parse(&text, &path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_sets_have_the_documented_sizes() {
        let default = default_prompts();
        let pool = pool();
        assert_eq!(default.len(), 15);
        assert!(pool.len() >= 100);
        assert_eq!(
            &pool[..15],
            &default[..],
            "the pool starts with the defaults"
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
    }

    #[test]
    fn blank_files_are_refused() {
        assert!(parse("\n  \n", "x").is_err());
        assert_eq!(parse("a\n\nb\n", "x").unwrap(), vec!["a", "b"]);
    }
}
