//! The spectral norm ||A||_2 (largest singular value) of a large matrix, certified to a relative
//! tolerance, by Lanczos with full reorthogonalization.
//!
//! # Method
//! Golub-Kahan-Lanczos bidiagonalization of `A` started from `v1` produces the same Krylov space
//! and the same Ritz values as symmetric Lanczos on the Gram operator `M = AᵀA / ||A||_F²`
//! started from `v1` (`B_kᵀB_k = T_k`). We run the latter because one pass over the rows of `A`
//! computes `Mv = Σ_i (a_i·v) a_iᵀ` with every row used twice while it is in cache: each
//! Lanczos step reads the matrix once instead of twice (`Av`, then `Aᵀu`). The matrix is read
//! straight from its stored bytes ([`RowSource`]), so a weight difference is never materialized.
//! Every new Lanczos vector is reorthogonalized twice against all previous ones (CGS2), which
//! keeps the basis orthonormal to working precision, so no spurious copies of converged Ritz
//! values appear. Scaling by `||A||_F²` keeps every quantity near 1 (no overflow or underflow
//! in f32, whatever the magnitude of the weights).
//!
//! # Certificate
//! After k steps, `M V_k = V_k T_k + β_k v_{k+1} e_kᵀ`. Let θ be the largest eigenvalue of the
//! tridiagonal `T_k`, with unit eigenvector `s`.
//! 1. Lower bound: `T_k = V_kᵀ M V_k` is a compression of `M`, so θ ≤ λ_max(M) = σ₁²/||A||_F²
//!    (Cauchy interlacing). The estimate `σ = ||A||_F √θ` never exceeds σ₁.
//! 2. Upper bound: the Ritz vector `x = V_k s` has residual `||Mx − θx|| = β_k |s_k|` =: r, so
//!    `M` has an eigenvalue in `[θ − r, θ + r]` (Krylov-Bogoliubov); the Ritz value converging
//!    from below onto the top of the spectrum is within r of it.
//!
//! We stop when `√(θ + r) ≤ (1 + tol) √θ`, i.e. the interval certified by the residual has
//! relative width `tol` in σ. The one assumption, shared by every Krylov method (ARPACK,
//! PROPACK, `svds`), is that the start vector is not orthogonal to the top singular vector;
//! it is a fixed pseudo-random Gaussian vector, so this has probability zero and results are
//! reproducible. Rounding in the f32 products (about 1e-7 relative) sets the floor of useful
//! tolerances. If the bound is not reached within [`MAX_STEPS`] steps the result says so
//! (`certified = false`) and carries the bound reached.
//!
//! Exact low rank, zero matrices, tall and wide shapes need no special cases: a zero Frobenius
//! norm returns 0 at once, and when the Krylov space becomes invariant (rank exhausted) β_k
//! falls to rounding level and the residual certifies the exact Ritz value.
//!
//! # Determinism
//! The rows are split into tasks by the matrix shape only; each task sums in a fixed order and
//! the task results are added in task order, so the bits do not depend on the thread count.

use std::ops::Range;
use std::sync::OnceLock;

use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;

use super::rows::{RowScratch, RowSource};
use super::tridiagonal::top_eigenpair;

/// Most Lanczos steps before giving up on the certificate (memory: steps x cols f64).
pub const MAX_STEPS: usize = 500;
/// Seed of the fixed start vector.
const START_SEED: u64 = 0x5157_A7CE;
/// Values per f32 partial sum before it is added into f64 (bounds the f32 rounding).
const DOT_BLOCK: usize = 1024;
/// Independent f32 accumulators (a multiple of every SIMD width in use).
const LANES: usize = 32;
/// Rows whose f32 contributions to Mv are summed before being added into f64.
const FLUSH_ROWS: usize = 16;
/// At most this many parallel row tasks per pass.
const MAX_TASKS: usize = 64;
/// At least this many matrix entries per task, so small matrices are not over-split.
const MIN_TASK_ENTRIES: usize = 1 << 16;
/// Bound on the f64 partial results held at once (entries).
const PARTIAL_ENTRIES: usize = 1 << 22;

/// The result of [`spectral_norm`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpectralNorm {
    /// ||A||_F, summed in f64.
    pub fro: f64,
    /// The estimate of ||A||_2 (a lower bound, see the module docs).
    pub op: f64,
    /// The certified upper bound on the singular value the estimate converged to.
    pub bound: f64,
    /// Lanczos steps taken (= passes over the matrix, plus one for the Frobenius norm).
    pub steps: usize,
    /// Whether `bound <= (1 + tol) * op` was reached.
    pub certified: bool,
}

/// ||A||_F and ||A||_2 of `a` to relative accuracy `tol` (see the module docs).
/// A non-finite entry gives a non-finite `fro` and NaN `op`.
pub fn spectral_norm<S: RowSource>(a: &S, tol: f64) -> SpectralNorm {
    let (m, n) = (a.rows(), a.cols());
    let tasks = plan_tasks(m, n);
    let fro = frobenius_pass(a, &tasks).sqrt();
    if !fro.is_finite() {
        return SpectralNorm {
            fro,
            op: f64::NAN,
            bound: f64::NAN,
            steps: 1,
            certified: false,
        };
    }
    if fro == 0.0 {
        return SpectralNorm {
            fro,
            op: 0.0,
            bound: 0.0,
            steps: 1,
            certified: true,
        };
    }
    let target = (1.0 + tol) * (1.0 + tol) - 1.0;
    let max_steps = n.min(MAX_STEPS);

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(START_SEED);
    let mut v: Vec<f64> = (0..n)
        .map(|_| -> f64 { StandardNormal.sample(&mut rng) })
        .collect();
    let start_norm = norm(&v);
    scale(&mut v, 1.0 / start_norm);
    let mut basis: Vec<Vec<f64>> = Vec::new();
    let (mut alpha, mut beta): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    let mut v32 = vec![0f32; n];
    let (mut theta, mut residual) = (0.0, f64::INFINITY);
    for step in 1..=max_steps {
        // v is scaled by 1/||A||_F before the pass and Mv by 1/||A||_F after it, so every f32
        // quantity in the pass is at most of the order of the entries of A.
        for (x, y) in v32.iter_mut().zip(&v) {
            *x = (y / fro) as f32;
        }
        let mut w = gram_pass(a, &v32, &tasks);
        scale(&mut w, 1.0 / fro);
        let mut a_k = dot(&v, &w);
        axpy(&mut w, -a_k, &v);
        if let (Some(prev), Some(&b)) = (basis.last(), beta.last()) {
            axpy(&mut w, -b, prev);
        }
        basis.push(v);
        for _ in 0..2 {
            for (i, q) in basis.iter().enumerate() {
                let c = dot(q, &w);
                axpy(&mut w, -c, q);
                if i + 1 == basis.len() {
                    a_k += c;
                }
            }
        }
        alpha.push(a_k);
        let b_k = norm(&w);
        let (t, last) = top_eigenpair(&alpha, &beta);
        theta = t.max(0.0);
        residual = b_k * last.abs();
        if !residual.is_finite() || !theta.is_finite() {
            break;
        }
        if residual <= theta * target || b_k <= f64::EPSILON * theta || step == max_steps {
            return finish(fro, theta, residual, step, target);
        }
        beta.push(b_k);
        scale(&mut w, 1.0 / b_k);
        v = w;
    }
    finish(fro, theta, residual, max_steps, target)
}

fn finish(fro: f64, theta: f64, residual: f64, steps: usize, target: f64) -> SpectralNorm {
    SpectralNorm {
        fro,
        op: fro * theta.sqrt(),
        bound: fro * (theta + residual).sqrt(),
        // +1: the Frobenius pass.
        steps: steps + 1,
        certified: residual <= theta * target || theta == 0.0 && residual == 0.0,
    }
}

/// Row ranges of the parallel tasks; a function of the shape only.
fn plan_tasks(m: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.max(1);
    let per_task = m
        .div_ceil(MAX_TASKS)
        .max(MIN_TASK_ENTRIES.div_ceil(n))
        .max(1);
    (0..m.div_ceil(per_task))
        .map(|t| t * per_task..((t + 1) * per_task).min(m))
        .collect()
}

/// Tasks whose f64 partials are held at once.
fn batch_len(n: usize) -> usize {
    (PARTIAL_ENTRIES / n.max(1)).max(2)
}

/// Σ a_ij² in f64.
fn frobenius_pass<S: RowSource>(a: &S, tasks: &[Range<usize>]) -> f64 {
    let partial: Vec<f64> = tasks
        .par_iter()
        .map(|rows| kernel().sum_squares_rows(a, rows.clone()))
        .collect();
    partial.iter().sum()
}

/// AᵀA v in f64, from f32 products.
fn gram_pass<S: RowSource>(a: &S, v: &[f32], tasks: &[Range<usize>]) -> Vec<f64> {
    let n = a.cols();
    let mut total = vec![0f64; n];
    for batch in tasks.chunks(batch_len(n)) {
        let partials: Vec<Vec<f64>> = batch
            .par_iter()
            .map(|rows| {
                let mut out = vec![0f64; n];
                kernel().gram_rows(a, rows.clone(), v, &mut out);
                out
            })
            .collect();
        for p in &partials {
            for (t, x) in total.iter_mut().zip(p) {
                *t += x;
            }
        }
    }
    total
}

fn dot(x: &[f64], y: &[f64]) -> f64 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

fn norm(x: &[f64]) -> f64 {
    dot(x, x).sqrt()
}

fn axpy(y: &mut [f64], a: f64, x: &[f64]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

fn scale(x: &mut [f64], a: f64) {
    x.iter_mut().for_each(|v| *v *= a);
}

/// The row kernels, compiled once for the baseline CPU and once for AVX2+FMA (chosen at run
/// time), so the loops vectorize without requiring a newer CPU.
#[derive(Clone, Copy)]
enum Kernel {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

fn kernel() -> Kernel {
    static KERNEL: OnceLock<Kernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Kernel::Avx2Fma;
        }
        Kernel::Baseline
    })
}

impl Kernel {
    fn gram_rows<S: RowSource>(self, a: &S, rows: Range<usize>, v: &[f32], out: &mut [f64]) {
        match self {
            Kernel::Baseline => gram_rows::<S, false>(a, rows, v, out),
            // SAFETY: selected only when the CPU reports AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => unsafe { gram_rows_avx2(a, rows, v, out) },
        }
    }

    fn sum_squares_rows<S: RowSource>(self, a: &S, rows: Range<usize>) -> f64 {
        match self {
            Kernel::Baseline => sum_squares_rows(a, rows),
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => unsafe { sum_squares_rows_avx2(a, rows) },
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gram_rows_avx2<S: RowSource>(a: &S, rows: Range<usize>, v: &[f32], out: &mut [f64]) {
    gram_rows::<S, true>(a, rows, v, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_squares_rows_avx2<S: RowSource>(a: &S, rows: Range<usize>) -> f64 {
    sum_squares_rows(a, rows)
}

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// x·y: f32 products in LANES accumulators over blocks of DOT_BLOCK, blocks summed in f64.
#[inline(always)]
fn dot_f32<const FMA: bool>(x: &[f32], y: &[f32]) -> f64 {
    let mut total = 0f64;
    for (xb, yb) in x.chunks(DOT_BLOCK).zip(y.chunks(DOT_BLOCK)) {
        let mut acc = [0f32; LANES];
        let (xc, yc) = (xb.chunks_exact(LANES), yb.chunks_exact(LANES));
        let (xr, yr) = (xc.remainder(), yc.remainder());
        for (p, q) in xc.zip(yc) {
            for l in 0..LANES {
                acc[l] = madd::<FMA>(p[l], q[l], acc[l]);
            }
        }
        let mut s = 0f32;
        for (p, q) in xr.iter().zip(yr) {
            s = madd::<FMA>(*p, *q, s);
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>() + s as f64;
    }
    total
}

#[inline(always)]
fn gram_rows<S: RowSource, const FMA: bool>(a: &S, rows: Range<usize>, v: &[f32], out: &mut [f64]) {
    let mut scratch = RowScratch::new();
    let mut acc = vec![0f32; a.cols()];
    let mut pending = 0;
    for i in rows {
        let row = a.row(i, &mut scratch);
        let t = dot_f32::<FMA>(row, v) as f32;
        for (s, x) in acc.iter_mut().zip(row) {
            *s = madd::<FMA>(t, *x, *s);
        }
        pending += 1;
        if pending == FLUSH_ROWS {
            flush(&mut acc, out);
            pending = 0;
        }
    }
    if pending > 0 {
        flush(&mut acc, out);
    }
}

#[inline(always)]
fn flush(acc: &mut [f32], out: &mut [f64]) {
    for (o, s) in out.iter_mut().zip(acc.iter_mut()) {
        *o += *s as f64;
        *s = 0.0;
    }
}

#[inline(always)]
fn sum_squares_rows<S: RowSource>(a: &S, rows: Range<usize>) -> f64 {
    let mut scratch = RowScratch::new();
    let mut total = 0f64;
    for i in rows {
        total += squares_f64(a.row(i, &mut scratch));
    }
    total
}

/// Σ x² with f64 products: f32 squares would underflow or overflow for extreme weights.
#[inline(always)]
fn squares_f64(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| v as f64 * v as f64)
        .sum();
    for c in chunks {
        for l in 0..LANES {
            let v = c[l] as f64;
            acc[l] += v * v;
        }
    }
    acc.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linalg::rows::DenseRows;
    use faer::Mat;
    use rand::Rng;

    /// A rows x cols matrix U diag(s) Vᵀ with random orthonormal U, V (from QR of Gaussians).
    fn with_spectrum(rows: usize, cols: usize, s: &[f64], seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let k = s.len();
        let mut gauss = |r, c| {
            Mat::<f64>::from_fn(r, c, |_, _| StandardNormal.sample(&mut rng))
                .qr()
                .compute_thin_Q()
        };
        let (u, w) = (gauss(rows, k), gauss(cols, k));
        let mut out = vec![0f32; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                out[i * cols + j] =
                    (0..k).map(|l| u[(i, l)] * s[l] * w[(j, l)]).sum::<f64>() as f32;
            }
        }
        out
    }

    fn gaussian(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect()
    }

    /// σ₁ of the f32 matrix, by a dense f64 SVD.
    fn dense_sigma(data: &[f32], rows: usize, cols: usize) -> f64 {
        let m = Mat::<f64>::from_fn(rows, cols, |i, j| data[i * cols + j] as f64);
        m.singular_values().unwrap()[0]
    }

    fn check(data: &[f32], rows: usize, cols: usize, what: &str) -> SpectralNorm {
        let got = spectral_norm(&DenseRows::new(data, rows, cols), 1e-6);
        let want = dense_sigma(data, rows, cols);
        let rel = (got.op - want).abs() / want.max(f64::MIN_POSITIVE);
        assert!(got.certified, "{what}: not certified: {got:?}");
        assert!(rel <= 2e-6, "{what}: op {} vs {want} (rel {rel:e})", got.op);
        assert!(got.bound >= got.op && got.bound <= got.op * (1.0 + 1e-6) + 1e-300);
        got
    }

    #[test]
    fn matches_dense_svd_on_tall_wide_gapped_clustered_and_low_rank() {
        let gap: Vec<f64> = [10.0, 1.0, 0.9, 0.8, 0.5].to_vec();
        let clustered: Vec<f64> = (0..40).map(|i| 1.0 - 1e-5 * i as f64).collect();
        check(&with_spectrum(120, 70, &gap, 1), 120, 70, "tall gap");
        check(&with_spectrum(70, 120, &gap, 2), 70, 120, "wide gap");
        check(&with_spectrum(90, 90, &clustered, 3), 90, 90, "clustered");
        check(&gaussian(300, 200, 4), 300, 200, "random tall");
        check(&gaussian(150, 400, 5), 150, 400, "random wide");
        let rank1 = check(&with_spectrum(64, 48, &[3.0], 6), 64, 48, "rank 1");
        assert!(rank1.steps <= 4, "rank 1 took {} steps", rank1.steps);
        check(
            &with_spectrum(64, 48, &[2.0, 2.0, 1.0], 7),
            64,
            48,
            "rank 3, double top",
        );
        check(&[0.0, 0.0, 5.0], 1, 3, "one row");
        check(&[1.0, -2.0, 2.0], 3, 1, "one column");
    }

    #[test]
    fn zero_matrix_and_non_finite_entries() {
        let zero = spectral_norm(&DenseRows::new(&[0.0; 12], 3, 4), 1e-6);
        assert_eq!((zero.fro, zero.op, zero.certified), (0.0, 0.0, true));
        let nan = spectral_norm(&DenseRows::new(&[1.0, f32::NAN, 0.0, 1.0], 2, 2), 1e-6);
        assert!(nan.fro.is_nan() && nan.op.is_nan());
        let empty = spectral_norm(&DenseRows::new(&[], 0, 5), 1e-6);
        assert_eq!(empty.op, 0.0);
    }

    #[test]
    fn tiny_and_huge_magnitudes_are_scaled() {
        let base = with_spectrum(40, 30, &[2.0, 1.0, 0.5], 8);
        let want = dense_sigma(&base, 40, 30);
        for factor in [1e-30f32, 1e25] {
            let scaled: Vec<f32> = base.iter().map(|x| x * factor).collect();
            let got = spectral_norm(&DenseRows::new(&scaled, 40, 30), 1e-6);
            let rel = (got.op / factor as f64 - want).abs() / want;
            assert!(rel < 2e-6, "factor {factor}: rel {rel:e}");
        }
    }

    #[test]
    fn same_bits_at_any_thread_count() {
        let data = gaussian(700, 300, 9);
        let run = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| spectral_norm(&DenseRows::new(&data, 700, 300), 1e-6))
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }
}
