//! The Hub fuzz targets of `fuzz/` (`revision`, `hub_answer`) on the stable toolchain, which CI
//! has (libFuzzer needs nightly): a small deterministic mutation fuzzer feeds inputs grown from
//! `fuzz/seeds/<target>/` to the same checks (`fuzz/checks.rs`) for a bounded time, and fails
//! naming the input that broke one. `SINKMERGE_FUZZ_SECONDS` sets the time per target (1 s
//! here, 15 s in `.ci/run`), `SINKMERGE_FUZZ_SEED` the seed (fuzz/README.md).

use std::path::Path;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[path = "../fuzz/checks.rs"]
mod checks;

/// What mutations insert: the pieces of paths, ref names, JSON and headers the checks guard.
const TOKENS: &[&[u8]] = &[
    b"..",
    b"/",
    b"//",
    b".",
    b".lock",
    b"@{",
    b"@",
    b"-",
    b"\"",
    b"W/",
    b"\\",
    b"\0",
    b"~",
    b"^",
    b":",
    b" ",
    b"\t",
    b"\n",
    b"\n\n",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b"\"sha\":",
    b"\"siblings\":",
    b"\"rfilename\":",
    b"null",
    b"X-Repo-Commit: ",
    b"X-Linked-Etag: ",
    b"ETag: ",
    b"Content-Range: bytes 0-0/",
    b"0123456789abcdef",
    b"ABCDEF",
    b"a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1",
    b"\xc3\xa9",
    b"\xff",
    b"\x7f",
];

/// The longest input tried.
const MAX_LEN: usize = 4096;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut seeds: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (p.display().to_string(), std::fs::read(&p).unwrap())
        })
        .collect();
    // Sorted, so a seed gives the same inputs on every machine.
    seeds.sort();
    seeds.into_iter().map(|(_, s)| s).collect()
}

/// One to eight mutations of `input`: bit flips, random bytes, tokens, deletions, duplicated
/// ranges and splices from the corpus.
fn mutate(rng: &mut ChaCha8Rng, input: &mut Vec<u8>, seeds: &[Vec<u8>]) {
    for _ in 0..rng.random_range(1..=8) {
        let at = rng.random_range(0..=input.len());
        match rng.random_range(0..7) {
            0 if at < input.len() => input[at] ^= 1 << rng.random_range(0..8),
            1 => input.insert(at, rng.random()),
            2 | 3 => {
                let token = TOKENS[rng.random_range(0..TOKENS.len())];
                input.splice(at..at, token.iter().copied());
            }
            4 => {
                let end = rng.random_range(at..=input.len().min(at + 16));
                input.drain(at..end);
            }
            5 => {
                let end = rng.random_range(at..=input.len().min(at + 16));
                let copy = input[at..end].to_vec();
                input.splice(at..at, copy);
            }
            _ => {
                let other = &seeds[rng.random_range(0..seeds.len())];
                let from = rng.random_range(0..=other.len());
                let to = rng.random_range(from..=other.len());
                input.splice(at..at, other[from..to].iter().copied());
            }
        }
    }
    input.truncate(MAX_LEN);
}

/// Run `check` on the corpus, then on mutations of it until the time is up; a failing check
/// fails the test with its input.
fn fuzz(target: &str, check: fn(&[u8])) {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let seconds: f64 = var("SINKMERGE_FUZZ_SECONDS").map_or(1.0, |s| s.parse().unwrap());
    let seed: u64 = var("SINKMERGE_FUZZ_SEED").map_or(23, |s| s.parse().unwrap());
    let seeds = corpus(target);
    assert!(!seeds.is_empty(), "fuzz/seeds/{target} is empty");
    let run = |input: &[u8]| {
        if let Err(panic) = std::panic::catch_unwind(|| check(input)) {
            let why = (panic.downcast_ref::<String>().cloned())
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!(
                "fuzz target {target} (seed {seed}) failed on b\"{}\": {why}",
                input.escape_ascii()
            );
        }
    };
    for s in &seeds {
        run(s);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut tried = 0u64;
    while Instant::now() < deadline {
        for _ in 0..256 {
            let mut input = seeds[rng.random_range(0..seeds.len())].clone();
            mutate(&mut rng, &mut input, &seeds);
            run(&input);
            tried += 1;
        }
    }
    eprintln!("fuzz target {target}: {tried} inputs in {seconds} s, seed {seed}");
}

#[test]
fn revision() {
    fuzz("revision", checks::revision);
}

#[test]
fn hub_answer() {
    fuzz("hub_answer", checks::hub_answer);
}
