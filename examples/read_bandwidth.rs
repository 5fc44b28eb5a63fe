//! This machine's memory read bandwidth, measured STREAM-style, and the decode GEMV against it.
//! A decode step reads every weight once, so weight bytes per token over the read bandwidth is
//! the floor of a step's time; the second measurement runs `linear_stored` (the GEMV kernel) on
//! the linear layers of a Qwen2.5-0.5B-shaped bf16 model, one token, and reports how close it
//! comes to that floor.
//!
//!     cargo run --release --example read_bandwidth [-- --bytes N] [--threads N] [--repeats N] [--json] [--sweep]
//!
//! Read bandwidth: the sum of a buffer far beyond the caches (default 2 GiB of u64, filled first
//! so its pages exist), split over the rayon threads, in the AVX2 build where the CPU has it;
//! GB/s are decimal (1e9 bytes). GEMV: per layer q and o (896x896), k and v (128x896), gate and
//! up (4864x896) and down (896x4864), 24 layers, and the tied 151936x896 head: 988 MB of
//! synthetic bf16 per token. Both report the best and the median of the repeats.
//!
//! `--sweep` also times that pass with 1 to 32 rows (tokens) through `linear_stored`, which takes
//! the GEMV kernel up to `GEMV_MAX_ROWS` rows, against decoding each weight to f32 and running
//! `linear` (faer), to place the threshold between them: one line per row count, best of three.

// An example prints its result; the rule against printing is for the commands (clippy.toml).
#![allow(clippy::disallowed_macros)]

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;
use safetensors::Dtype;
use sinkmerge::dtype;
use sinkmerge::forward::backend::cpu::linear;
use sinkmerge::forward::backend::cpu::stored::{linear_stored, GEMV_MAX_ROWS};

/// u64 values per parallel chunk of the sum (8 MiB).
const CHUNK: usize = 1 << 20;

/// The 0.5B shape: hidden, intermediate, layers, kv width (2 heads of 64), vocabulary.
const HIDDEN: usize = 896;
const INTERMEDIATE: usize = 4864;
const LAYERS: usize = 24;
const KV: usize = 128;
const VOCAB: usize = 151_936;

struct Args {
    bytes: usize,
    threads: usize,
    repeats: usize,
    json: bool,
    sweep: bool,
}

fn args() -> Args {
    let mut a = Args {
        bytes: 2 << 30,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        repeats: 7,
        json: false,
        sweep: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> usize {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name}: a positive integer"))
        };
        match flag.as_str() {
            "--bytes" => a.bytes = value("--bytes"),
            "--threads" => a.threads = value("--threads"),
            "--repeats" => a.repeats = value("--repeats"),
            "--json" => a.json = true,
            "--sweep" => a.sweep = true,
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// Wrapping sum of `v`, in the AVX2 build where the CPU has it (it vectorizes to `vpaddq`).
fn sum(v: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn sum_avx2(v: &[u64]) -> u64 {
            v.iter().fold(0, |s, &x| s.wrapping_add(x))
        }
        // SAFETY: the CPU has AVX2.
        return unsafe { sum_avx2(v) };
    }
    v.iter().fold(0, |s, &x| s.wrapping_add(x))
}

/// Seconds of each of `repeats` runs of `f`, sorted.
fn times(repeats: usize, mut f: impl FnMut()) -> Vec<f64> {
    let mut t: Vec<f64> = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t
}

/// The weight matrices of one token's pass, `(n_out, n_in)`, in the order the pass runs them.
fn shapes() -> Vec<(usize, usize)> {
    let layer = [
        (HIDDEN, HIDDEN),
        (KV, HIDDEN),
        (KV, HIDDEN),
        (HIDDEN, HIDDEN),
        (INTERMEDIATE, HIDDEN),
        (INTERMEDIATE, HIDDEN),
        (HIDDEN, INTERMEDIATE),
    ];
    let mut all: Vec<_> = (0..LAYERS).flat_map(|_| layer).collect();
    all.push((VOCAB, HIDDEN));
    all
}

fn main() {
    let a = args();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(a.threads)
        .build()
        .expect("a thread pool");
    pool.install(|| {
        let n = a.bytes / 8;
        let buf: Vec<u64> = (0..n).into_par_iter().map(|i| i as u64).collect();
        let read = times(a.repeats, || {
            black_box(buf.par_chunks(CHUNK).map(sum).reduce(|| 0, u64::wrapping_add));
        });
        drop(buf);
        let bytes = (n * 8) as f64;
        let (read_best, read_median) = (bytes / read[0] / 1e9, bytes / read[read.len() / 2] / 1e9);

        let shapes = shapes();
        let weights: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(o, i)| {
                // Small bf16 values with varied bits (0x3C00..0x3CFF: about 0.008 to 0.03).
                (0..o * i * 2)
                    .into_par_iter()
                    .map(|b| if b % 2 == 0 { (b / 2 * 7) as u8 } else { 0x3C })
                    .collect()
            })
            .collect();
        let weight_bytes: usize = weights.iter().map(Vec::len).sum();
        let (xh, xi) = (vec![0.5f32; HIDDEN], vec![0.25f32; INTERMEDIATE]);
        let token = || {
            for (&(o, i), w) in shapes.iter().zip(&weights) {
                let x = if i == HIDDEN { &xh } else { &xi };
                black_box(linear_stored(x, 1, w, Dtype::BF16, o, i).unwrap());
            }
        };
        token();
        let gemv = times(a.repeats, token);
        let (best, median) = (gemv[0], gemv[gemv.len() / 2]);
        let gemv_gbs = weight_bytes as f64 / best / 1e9;
        let floor = weight_bytes as f64 / (read_best * 1e9);
        if a.json {
            println!(
                "{{\"threads\": {}, \"read_bytes\": {}, \"repeats\": {}, \"read_gbs_best\": {read_best:.2}, \"read_gbs_median\": {read_median:.2}, \"gemv_weight_bytes\": {weight_bytes}, \"gemv_s_best\": {best:.6}, \"gemv_s_median\": {median:.6}, \"gemv_gbs_best\": {gemv_gbs:.2}, \"gemv_gbs_median\": {:.2}, \"tokens_per_s\": {:.2}, \"gemv_over_floor\": {:.3}}}",
                a.threads,
                n * 8,
                a.repeats,
                weight_bytes as f64 / median / 1e9,
                1.0 / best,
                best / floor,
            );
        } else {
            println!(
                "read bandwidth: best {read_best:.2} GB/s, median {read_median:.2} GB/s ({} bytes, {} threads, {} repeats)",
                n * 8,
                a.threads,
                a.repeats
            );
            println!(
                "gemv bf16 0.5B shape: best {:.2} ms/token ({:.2} tokens/s), median {:.2} ms; {gemv_gbs:.2} GB/s effective ({weight_bytes} weight bytes); {:.3}x the read floor ({:.2} ms)",
                best * 1e3,
                1.0 / best,
                median * 1e3,
                best / floor,
                floor * 1e3,
            );
        }
        if a.sweep {
            for rows in [1, 2, 4, 8, 16, 32] {
                let (xh, xi) = (vec![0.5f32; rows * HIDDEN], vec![0.25f32; rows * INTERMEDIATE]);
                let pass = |decoded: bool| {
                    for (&(o, i), w) in shapes.iter().zip(&weights) {
                        let x = if i == HIDDEN { &xh } else { &xi };
                        black_box(if decoded {
                            linear(x, rows, &dtype::decode(Dtype::BF16, w, "w").unwrap(), o, i)
                        } else {
                            linear_stored(x, rows, w, Dtype::BF16, o, i).unwrap()
                        });
                    }
                };
                let stored = times(3, || pass(false))[0];
                let decoded = times(3, || pass(true))[0];
                println!(
                    "rows {rows}: linear_stored ({}) {:.1} ms/pass, decode + linear {:.1} ms/pass",
                    if rows <= GEMV_MAX_ROWS { "gemv" } else { "decode + linear" },
                    stored * 1e3,
                    decoded * 1e3
                );
            }
        }
    });
}
