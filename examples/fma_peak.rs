//! This machine's fused multiply-add peak in f32 and f64, measured: every thread runs independent
//! chains of vector FMAs at the widest width the CPU has (AVX-512F, else AVX2 with FMA), with
//! enough chains to cover the FMA latency. No kernel does more arithmetic per second, so a
//! benchmark's counted flops over this peak is its compute floor (docs/benchmarks.md).
//!
//!     cargo run --release --example fma_peak [-- THREADS]     # default: every core
//!
//! Prints one line: `fma peak: f32 X GFLOP/s, f64 Y GFLOP/s on N threads (ISA)`; the best of three
//! half-second runs of each, all threads at once (clocks drop when every core is busy).

// An example prints its result; the rule against printing is for the commands (clippy.toml).
#![allow(clippy::disallowed_macros)]

use std::time::Instant;

/// Independent accumulators per thread: at least latency x ports (4 x 2 on current x86 cores).
const CHAINS: usize = 12;
/// Iterations of the CHAINS-wide step per run: about half a second at 3 GHz.
const STEPS: usize = 120_000_000;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{CHAINS, STEPS};
    use std::arch::x86_64::*;

    /// Each kernel runs the chains and returns the flops done (2 per lane per FMA) and the sum
    /// of the chains, which keeps every chain alive (the compiler drops a chain whose value is
    /// never used).
    macro_rules! kernels {
        ($($name:ident: $feature:literal, $vec:ty, $set1:ident, $fma:ident, $add:ident, $lanes:expr;)*) => {$(
            #[target_feature(enable = $feature)]
            pub unsafe fn $name() -> (f64, $vec) {
                let (a, b) = ($set1(0.999), $set1(1e-3));
                let mut acc = [$set1(0.0); CHAINS];
                for _ in 0..STEPS {
                    for x in acc.iter_mut() {
                        *x = $fma(*x, a, b);
                    }
                }
                let sum = acc.iter().fold($set1(0.0), |s, &x| $add(s, x));
                ((STEPS * CHAINS * $lanes * 2) as f64, sum)
            }
        )*};
    }
    kernels! {
        f32_512: "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, 16;
        f64_512: "avx512f", __m512d, _mm512_set1_pd, _mm512_fmadd_pd, _mm512_add_pd, 8;
        f32_256: "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, 8;
        f64_256: "avx2,fma", __m256d, _mm256_set1_pd, _mm256_fmadd_pd, _mm256_add_pd, 4;
    }
}

/// One thread's run: returns the flops it did.
type Kernel = fn() -> f64;

/// GFLOP/s of `threads` threads running `kernel` at once, the best of three runs.
fn measure(threads: usize, kernel: Kernel) -> f64 {
    (0..3)
        .map(|_| {
            let start = Instant::now();
            let flops: f64 = std::thread::scope(|s| {
                let runs: Vec<_> = (0..threads).map(|_| s.spawn(kernel)).collect();
                runs.into_iter().map(|r| r.join().unwrap()).sum()
            });
            flops / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn main() {
    let threads = match std::env::args().nth(1) {
        Some(n) => n.parse().expect("THREADS: a positive integer"),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY (each closure): its kernel needs the features its branch has just detected.
        let (isa, f32_kernel, f64_kernel): (&str, Kernel, Kernel) =
            if is_x86_feature_detected!("avx512f") {
                (
                    "AVX-512F",
                    || std::hint::black_box(unsafe { x86::f32_512() }).0,
                    || std::hint::black_box(unsafe { x86::f64_512() }).0,
                )
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                (
                    "AVX2+FMA",
                    || std::hint::black_box(unsafe { x86::f32_256() }).0,
                    || std::hint::black_box(unsafe { x86::f64_256() }).0,
                )
            } else {
                println!("fma peak: unmeasured (no AVX2+FMA or AVX-512F)");
                return;
            };
        println!(
            "fma peak: f32 {:.1} GFLOP/s, f64 {:.1} GFLOP/s on {threads} threads ({isa})",
            measure(threads, f32_kernel),
            measure(threads, f64_kernel)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    println!("fma peak: unmeasured (x86-64 only)");
}
