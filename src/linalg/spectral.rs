//! The spectral norm ||A||_2 (largest singular value) of a large matrix, certified to a relative
//! tolerance, by Lanczos with full reorthogonalization.
//!
//! # Method
//! Golub-Kahan-Lanczos bidiagonalization of `A` started from `v1` produces the same Krylov space
//! and the same Ritz values as symmetric Lanczos on the Gram operator `M = AᵀA / ||A||_F²`
//! started from `v1` (`B_kᵀB_k = T_k`). We run the latter because one pass over the rows of `A`
//! computes `Mv = Σ_i (a_i·v) a_iᵀ` with every row used twice while it is in cache: each
//! Lanczos step reads the matrix once instead of twice (`Av`, then `Aᵀu`) ([`super::gram`]).
//! The matrix is read straight from its stored bytes ([`RowSource`]), so a weight difference is
//! never materialized, and [`spectral_norms`] runs several matrices that share rows in lockstep
//! (TARGET - REF and REF from the same two stored rows: one read serves both). The first pass
//! also sums the squares for ||A||_F.
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
//! reproducible. A quadratic (Temple-Kato) refinement `r²/(θ₁ − θ₂ − r₂)` would certify a
//! separated top value in fewer steps, but it also needs every unseen eigenvalue to lie below
//! `θ₂ + r₂`, which fails early on clustered spectra: on the clustered test matrix it certified
//! an estimate 2e-4 low, so only the linear bound is used. Rounding in the f32 products (about
//! 1e-7 relative) sets the floor of useful tolerances. If the bound is not reached within [`MAX_STEPS`] steps the result says so
//! (`certified = false`) and carries the bound reached.
//!
//! Exact low rank, zero matrices, tall and wide shapes need no special cases: a zero Frobenius
//! norm returns 0 at once, and when the Krylov space becomes invariant (rank exhausted) β_k
//! falls to rounding level and the residual certifies the exact Ritz value.
//!
//! Results do not depend on the thread count (see [`super::gram`]). What `sinkmerge norms`
//! reports from these norms is defined in docs/reference/spectral.md.

use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};

use super::gram::{self, PassWorkspace};
use super::rows::{RowSet, RowSource};
use super::simd::axpy;
use super::tridiagonal::top_eigenpair;

/// Most Lanczos steps before giving up on the certificate (memory: steps x cols f64).
pub const MAX_STEPS: usize = 500;
/// Seed of the fixed start vector.
const START_SEED: u64 = 0x5157_A7CE;
/// Frobenius norms for which the first, unscaled pass cannot overflow or underflow in f32;
/// outside it the first product is recomputed with the start vector scaled.
const UNSCALED_FRO: std::ops::RangeInclusive<f64> = 1e-10..=1e10;

/// The result of [`spectral_norm`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpectralNorm {
    /// ||A||_F, summed in f64.
    pub fro: f64,
    /// The estimate of ||A||_2 (a lower bound, see the module docs).
    pub op: f64,
    /// The certified upper bound on the singular value the estimate converged to.
    pub bound: f64,
    /// Passes over the matrix (the first also gives the Frobenius norm).
    pub steps: usize,
    /// Whether `bound <= (1 + tol) * op` was reached.
    pub certified: bool,
}

impl SpectralNorm {
    fn exact(fro: f64, op: f64) -> SpectralNorm {
        SpectralNorm {
            fro,
            op,
            bound: op,
            steps: 1,
            certified: !op.is_nan(),
        }
    }
}

/// ||A||_F and ||A||_2 of `a` to relative accuracy `tol` (see the module docs).
/// A non-finite entry gives a non-finite `fro` and NaN `op`.
pub fn spectral_norm<S: RowSource>(a: &S, tol: f64) -> SpectralNorm {
    let [norm] = spectral_norms::<1, S>(a, tol);
    norm
}

/// [`spectral_norm`] of each matrix of a row set, all in one stream of passes.
pub fn spectral_norms<const K: usize, S: RowSet<K>>(a: &S, tol: f64) -> [SpectralNorm; K] {
    let (m, n) = (a.rows(), a.cols());
    if m == 0 || n == 0 {
        return [SpectralNorm::exact(0.0, 0.0); K];
    }
    let mut workspace = PassWorkspace::new(m, n);
    let target = (1.0 + tol) * (1.0 + tol) - 1.0;
    let max_steps = n.min(MAX_STEPS);
    let start = start_vector(n);
    let start32: Vec<f32> = start.iter().map(|&x| x as f32).collect();

    let first = gram::pass(a, &mut workspace, [Some(&start32[..]); K], true);
    let mut states: [Lanczos; K] = std::array::from_fn(|_| Lanczos::new(start.clone()));
    for (k, (state, product)) in states.iter_mut().zip(first.products).enumerate() {
        let fro = first.squares[k].sqrt();
        state.fro = fro;
        if !fro.is_finite() {
            state.done = Some(SpectralNorm::exact(fro, f64::NAN));
            continue;
        }
        if fro == 0.0 {
            state.done = Some(SpectralNorm::exact(0.0, 0.0));
            continue;
        }
        let mut w = product.expect("every matrix takes part in the first pass");
        if UNSCALED_FRO.contains(&fro) && w.iter().all(|x| x.is_finite()) {
            scale(&mut w, 1.0 / (fro * fro));
        } else {
            let scaled: Vec<f32> = start.iter().map(|&x| (x / fro) as f32).collect();
            let mut only: [Option<&[f32]>; K] = [None; K];
            only[k] = Some(&scaled);
            w = gram::pass(a, &mut workspace, only, false).products[k]
                .take()
                .expect("requested product");
            scale(&mut w, 1.0 / fro);
        }
        state.absorb(w, target, max_steps);
    }

    loop {
        // v is scaled by 1/||A||_F before the pass and AᵀAv by 1/||A||_F after it, so every f32
        // quantity in the pass is at most of the order of the entries of A.
        let inputs: [Option<Vec<f32>>; K] = std::array::from_fn(|k| {
            let s = &states[k];
            s.done
                .is_none()
                .then(|| s.v.iter().map(|&x| (x / s.fro) as f32).collect())
        });
        if inputs.iter().all(Option::is_none) {
            break;
        }
        let v: [Option<&[f32]>; K] = std::array::from_fn(|k| inputs[k].as_deref());
        let result = gram::pass(a, &mut workspace, v, false);
        for (state, product) in states.iter_mut().zip(result.products) {
            if let Some(mut w) = product {
                scale(&mut w, 1.0 / state.fro);
                state.absorb(w, target, max_steps);
            }
        }
    }
    states.map(|s| s.done.expect("loop ends when every matrix is done"))
}

/// The fixed pseudo-random unit start vector.
fn start_vector(n: usize) -> Vec<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(START_SEED);
    let mut v: Vec<f64> = (0..n)
        .map(|_| -> f64 { StandardNormal.sample(&mut rng) })
        .collect();
    let length = norm(&v);
    scale(&mut v, 1.0 / length);
    v
}

/// Lanczos on M = AᵀA / ||A||_F² for one matrix.
struct Lanczos {
    fro: f64,
    /// The current Lanczos vector.
    v: Vec<f64>,
    basis: Vec<Vec<f64>>,
    alpha: Vec<f64>,
    beta: Vec<f64>,
    done: Option<SpectralNorm>,
}

impl Lanczos {
    fn new(v: Vec<f64>) -> Lanczos {
        Lanczos {
            fro: 0.0,
            v,
            basis: Vec::new(),
            alpha: Vec::new(),
            beta: Vec::new(),
            done: None,
        }
    }

    /// Take `w = M v` for the current vector: extend T_k, check the certificate, and either
    /// finish or move to the next vector.
    fn absorb(&mut self, mut w: Vec<f64>, target: f64, max_steps: usize) {
        let v = std::mem::take(&mut self.v);
        let mut a_k = dot(&v, &w);
        axpy::<false>(-a_k, &v, &mut w);
        if let (Some(prev), Some(&b)) = (self.basis.last(), self.beta.last()) {
            axpy::<false>(-b, prev, &mut w);
        }
        self.basis.push(v);
        // Full reorthogonalization, twice (CGS2).
        for _ in 0..2 {
            for (i, q) in self.basis.iter().enumerate() {
                let c = dot(q, &w);
                axpy::<false>(-c, q, &mut w);
                if i + 1 == self.basis.len() {
                    a_k += c;
                }
            }
        }
        self.alpha.push(a_k);
        let b_k = norm(&w);
        let (theta, last) = top_eigenpair(&self.alpha, &self.beta);
        let theta = theta.max(0.0);
        let residual = b_k * last.abs();
        let steps = self.alpha.len();
        let certified = residual <= theta * target;
        let finished =
            certified || !residual.is_finite() || b_k <= f64::EPSILON * theta || steps == max_steps;
        if finished {
            self.done = Some(SpectralNorm {
                fro: self.fro,
                op: self.fro * theta.sqrt(),
                bound: self.fro * (theta + residual).sqrt(),
                steps,
                certified,
            });
            self.basis = Vec::new();
        } else {
            self.beta.push(b_k);
            scale(&mut w, 1.0 / b_k);
            self.v = w;
        }
    }
}

/// x·y summed in index order, not in [`super::simd::dot`]'s lanes: the Lanczos basis, and so
/// every reported norm, is computed with this order.
fn dot(x: &[f64], y: &[f64]) -> f64 {
    x.iter().zip(y).map(|(a, b)| a * b).sum()
}

fn norm(x: &[f64]) -> f64 {
    dot(x, x).sqrt()
}

fn scale(x: &mut [f64], a: f64) {
    x.iter_mut().for_each(|v| *v *= a);
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
    fn lockstep_drift_and_reference_match_separate_runs() {
        use crate::dtype;
        use crate::linalg::rows::{DiffRows, StoredRows};
        use safetensors::Dtype;
        let (rows, cols) = (90, 70);
        let reference = gaussian(rows, cols, 10);
        let drift = with_spectrum(rows, cols, &[2.0, 1.9, 0.5], 11);
        let target: Vec<f32> = reference.iter().zip(&drift).map(|(r, d)| r + d).collect();
        let (t, r) = (
            dtype::encode(Dtype::BF16, &target).unwrap(),
            dtype::encode(Dtype::BF16, &reference).unwrap(),
        );
        let (ts, rs) = (
            StoredRows::new(Dtype::BF16, &t, rows, cols).unwrap(),
            StoredRows::new(Dtype::BF16, &r, rows, cols).unwrap(),
        );
        let diff = DiffRows::new(ts, rs).unwrap();
        let [d, rr] = spectral_norms(&diff, 1e-6);
        let (d1, r1) = (spectral_norm(&diff, 1e-6), spectral_norm(&rs, 1e-6));
        // Same matrices, same start vector, same passes: the same bits.
        assert_eq!((d, rr), (d1, r1));
        assert!(
            d.steps != rr.steps,
            "the two converge at different steps: {d:?} {rr:?}"
        );
        let decoded = |b: &[u8]| dtype::decode(Dtype::BF16, b, "x").unwrap();
        let dense: Vec<f32> = decoded(&t)
            .iter()
            .zip(decoded(&r))
            .map(|(a, b)| a - b)
            .collect();
        let want = dense_sigma(&dense, rows, cols);
        assert!((d.op - want).abs() / want < 2e-6, "{} vs {want}", d.op);
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
