//! The spectral-norm kernel on one 7B-class down_proj-shaped matrix (3584 x 18944): Lanczos
//! (`linalg::spectral`, certified to 1e-6) against faer's dense `singular_values`, which is what
//! a full SVD costs. Three spectra: a drift-like one (rank-32 decaying + noise; the common case),
//! the flat-tailed drift of docs/benchmarks.md (rank 16 with singular values 1/(j+1) at 0.9% of
//! ||REF||_F plus dense noise at 0.4%), and a plain Gaussian matrix (top singular values
//! clustered at the Marchenko-Pastur edge; the hard case). Lanczos also runs on bf16 bytes as
//! `sinkmerge norms` does: TARGET - REF decoded row by row, with REF's own norm in the same
//! passes.
//!
//!     cargo bench --bench spectral_norm
//!
//! The dense SVD takes tens of seconds per call; criterion's minimum of 10 samples applies.

// A bench prints its measurements; the rule against printing is for the commands (clippy.toml).
#![allow(clippy::disallowed_macros)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use faer::{Accum, Mat, MatRef, Par};
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use safetensors::Dtype;
use sinkmerge::dtype;
use sinkmerge::linalg::rows::{DenseRows, DiffRows, StoredRows};
use sinkmerge::linalg::spectral::{spectral_norm, spectral_norms};

const ROWS: usize = 3584;
const COLS: usize = 18944;
const TOL: f64 = 1e-6;

fn gaussian(rows: usize, cols: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..rows * cols)
        .map(|_| scale * rng.sample::<f32, _>(StandardNormal))
        .collect()
}

/// U diag(s) V with Gaussian U (ROWS x rank) and V (rank x COLS): singular values close to
/// `s` times sqrt(ROWS * COLS) (the columns of U and rows of V are nearly orthogonal at these sizes).
fn low_rank(rank: usize, s: impl Fn(usize) -> f32 + 'static, seed: u64) -> Mat<f32> {
    let u = Mat::<f32>::from_fn(ROWS, rank, {
        let g = gaussian(ROWS, rank, 1.0, seed);
        move |i, j| g[i * rank + j] * s(j)
    });
    let v = {
        let g = gaussian(rank, COLS, 1.0, seed + 1);
        MatRef::from_row_major_slice(&g, rank, COLS).to_owned()
    };
    let mut low = Mat::<f32>::zeros(ROWS, COLS);
    faer::linalg::matmul::matmul(low.as_mut(), Accum::Replace, &u, &v, 1.0, Par::rayon(0));
    low
}

fn frobenius(x: impl Iterator<Item = f32>) -> f32 {
    x.map(|v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32
}

/// Rank-32 term with singular values 0.8^i plus Gaussian noise at a tenth of its entries' size.
fn drift_like(seed: u64) -> Vec<f32> {
    let low = low_rank(32, |j| 0.8f32.powi(j as i32), seed);
    let noise = gaussian(ROWS, COLS, 0.1, seed + 2);
    (0..ROWS * COLS)
        .map(|k| low[(k / COLS, k % COLS)] + noise[k])
        .collect()
}

/// The flat-tailed drift: a rank-16 term with singular values 1/(j+1), scaled to 0.9% of
/// ||reference||_F, plus dense Gaussian noise scaled to 0.4% of it.
fn flat_tailed(reference: &[f32], seed: u64) -> Vec<f32> {
    let size = frobenius(reference.iter().copied());
    let low = low_rank(16, |j| 1.0 / (1.0 + j as f32), seed);
    let low_scale = 0.009 * size / frobenius((0..ROWS * COLS).map(|k| low[(k / COLS, k % COLS)]));
    let noise = gaussian(ROWS, COLS, 1.0, seed + 2);
    let noise_scale = 0.004 * size / frobenius(noise.iter().copied());
    (0..ROWS * COLS)
        .map(|k| low_scale * low[(k / COLS, k % COLS)] + noise_scale * noise[k])
        .collect()
}

fn bench(c: &mut Criterion) {
    let drift = drift_like(1);
    let random = gaussian(ROWS, COLS, 1.0, 4);
    // REF with a decaying spectrum, as trained weights have: rows scaled by (1 + i)^-0.3.
    let mut reference = gaussian(ROWS, COLS, 1.0, 5);
    for (i, row) in reference.chunks_mut(COLS).enumerate() {
        let d = (1.0 + i as f32).powf(-0.3);
        row.iter_mut().for_each(|x| *x *= d);
    }
    let flat = flat_tailed(&reference, 7);
    let target: Vec<f32> = reference.iter().zip(&drift).map(|(r, d)| r + d).collect();
    let (t16, r16) = (
        dtype::encode(Dtype::BF16, &target).unwrap(),
        dtype::encode(Dtype::BF16, &reference).unwrap(),
    );
    drop((target, reference));
    let diff = DiffRows::new(
        StoredRows::new(Dtype::BF16, &t16, ROWS, COLS).unwrap(),
        StoredRows::new(Dtype::BF16, &r16, ROWS, COLS).unwrap(),
    )
    .unwrap();

    for (what, data) in [
        ("drift-like", &drift),
        ("flat-tailed", &flat),
        ("gaussian", &random),
    ] {
        let n = spectral_norm(&DenseRows::new(data, ROWS, COLS), TOL);
        println!(
            "{what}: op {} certified {} in {} passes",
            n.op, n.certified, n.steps
        );
    }

    let mut g = c.benchmark_group("spectral_norm_3584x18944");
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(1));
    g.measurement_time(Duration::from_secs(20));
    g.bench_function("lanczos_f32_drift_like", |b| {
        b.iter(|| spectral_norm(&DenseRows::new(black_box(&drift), ROWS, COLS), TOL))
    });
    g.bench_function("lanczos_f32_flat_tailed", |b| {
        b.iter(|| spectral_norm(&DenseRows::new(black_box(&flat), ROWS, COLS), TOL))
    });
    g.bench_function("lanczos_f32_gaussian", |b| {
        b.iter(|| spectral_norm(&DenseRows::new(black_box(&random), ROWS, COLS), TOL))
    });
    g.bench_function("lanczos_bf16_target_minus_ref_and_ref", |b| {
        b.iter(|| spectral_norms::<2, _>(black_box(&diff), TOL))
    });
    g.bench_function("faer_dense_singular_values_f32", |b| {
        b.iter(|| {
            MatRef::from_row_major_slice(black_box(&drift), ROWS, COLS)
                .singular_values()
                .unwrap()[0]
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
