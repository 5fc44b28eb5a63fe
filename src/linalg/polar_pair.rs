//! The polar factor of two concatenated orthonormal bases, `polar([X1 X2])`, from the principal
//! angles between them: TSV's smaller-side concatenation for two tasks, which is square and
//! badly conditioned (docs/reference/spectral.md, "Two tasks: TSV's square polar factors from the principal
//! angles").
//!
//! With `XᵢᵀXᵢ = I` and `C = X1ᵀX2`, the Gram matrix is `G = [[I, C], [Cᵀ, I]]` and, for
//! `f(y) = y^(-1/2)`, `f(G)` has the blocks `I + C m(CᵀC) Cᵀ`, `C k(CᵀC)` and `h(CᵀC)`, where
//! `h`, `k`, `m` are the even and odd parts of `f(1 ± √x)` (derived in the reference). The
//! eigenvalues of `CᵀC` are the squared cosines `1 - s²` of the principal angles, and their
//! sines `s` are the singular values of `S = X2 - X1 C` (Björck and Golub, "Numerical methods for
//! computing angles between linear subspaces", Math. Comp. 27 (1973)), accurate to rounding of
//! `‖S‖` even when small. `G`'s smallest eigenvalue `1 - cos = s² / (1 + cos)` is then known to
//! a relative `eps/s`, where forming `G` and taking its eigenvalues, as the Gram route does,
//! knows it only to an absolute `eps·‖G‖`.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::matmul::matmul as faer_matmul;
use faer::linalg::svd::{svd, svd_scratch, ComputeSvdVectors};
use faer::{Accum, Mat, MatRef, Par};

use super::simd::clear_upper_state;

/// `lhs * rhs` in f64, single-threaded (the callers run the two polar factors side by side).
fn product(lhs: MatRef<'_, f64>, rhs: MatRef<'_, f64>) -> Mat<f64> {
    let mut out = Mat::<f64>::zeros(lhs.nrows(), rhs.ncols());
    faer_matmul(out.as_mut(), Accum::Replace, lhs, rhs, 1.0, Par::Seq);
    clear_upper_state();
    out
}

/// `XᵀX - I` and its Frobenius norm: how far `x`'s columns are from orthonormal.
fn departure(x: MatRef<'_, f64>) -> (Mat<f64>, f64) {
    let mut e = product(x.transpose(), x);
    let mut sum = 0.0;
    for j in 0..e.ncols() {
        e[(j, j)] -= 1.0;
        sum += e.col(j).iter().map(|v| v * v).sum::<f64>();
    }
    (e, sum.sqrt())
}

/// Largest departure [`orthonormalized`] corrects: the neglected `3E²/8` is then below 4e-13.
const MAX_DEPARTURE: f64 = 1e-6;

/// `x (XᵀX)^(-1/2)`, the orthonormal matrix nearest to `x`, as `x (I - E/2)` with `E = XᵀX - I`
/// (the series' next term is `3E²/8`), and the departure left after it; `None` when `‖E‖_F`
/// exceeds [`MAX_DEPARTURE`]. TSV's large-side vectors `A v / σ` depart from orthonormal by
/// the Gram route's error (about 1e-10 on 1.5B-shaped task vectors), which this removes: the
/// columns move by about that much, within their own error.
fn orthonormalized(x: MatRef<'_, f64>) -> Option<(Mat<f64>, f64)> {
    let (e, norm) = departure(x);
    if norm > MAX_DEPARTURE {
        return None;
    }
    let mut corrected = x.to_owned();
    faer_matmul(
        corrected.as_mut(),
        Accum::Add,
        x,
        e.as_ref(),
        -0.5,
        Par::Seq,
    );
    clear_upper_state();
    let (_, left) = departure(corrected.as_ref());
    Some((corrected, left))
}

/// `G`'s eigenvalue `1 - cos θ = s² / (1 + cos θ)` for a principal angle of sine `s`, without
/// cancellation.
fn small_eigenvalue(s: f64) -> f64 {
    s * s / (1.0 + (1.0 - s * s).max(0.0).sqrt())
}

/// Whether the angles resolve `G`'s smallest eigenvalue `lambda[0]`, known to within `error`,
/// well enough (`lambda[1]` is the next one): its relative error `error / lambda[0]` must be at
/// most `1 / min_relative_gap`, or below 1 and below the error bound of the fallback, the polar
/// factor of the concatenation rounded to f32. That rounding moves the `columns` unit columns by
/// `‖ΔY‖_F ≤ u √columns` (`u = 2⁻²⁴`), and the polar factor of a real square matrix by up to
/// `2 ‖ΔY‖_F / (σ_min + σ_next)` to first order (R.-C. Li, "New perturbation bounds for the
/// unitary polar factor", SIAM J. Matrix Anal. Appl. 16 (1995)), with `σ = √λ`. Refusing the
/// angles there would trade their error for a larger one.
fn resolves(lambda: [f64; 2], error: f64, columns: usize, min_relative_gap: f64) -> bool {
    if lambda[0].is_nan() || lambda[0] <= 0.0 {
        return false;
    }
    let relative = error / lambda[0];
    let moved = f32::EPSILON as f64 / 2.0 * (columns as f64).sqrt();
    let fallback = 2.0 * moved / (lambda[0].sqrt() + lambda[1].sqrt());
    relative * min_relative_gap <= 1.0 || (relative < 1.0 && relative <= fallback)
}

/// The coefficients of `f(G)` for one principal angle of sine `s` in (0, 1]: `h`, `k` and `m`
/// of the module's formula, written in `s` alone so that none cancels, whatever the angle.
fn coefficients(s: f64) -> (f64, f64, f64) {
    // √(1 - cos) + √(1 + cos), from its square 2 + 2s.
    let sum_of_roots = (2.0 + 2.0 * s).sqrt();
    let h = sum_of_roots / (2.0 * s);
    let k = -1.0 / (s * sum_of_roots);
    let m = (1.0 + 2.0 * s) / (s * (1.0 + s) * (sum_of_roots + 2.0 * s));
    (h, k, m)
}

/// `polar([x1 x2])`, `x1` n x r1 and `x2` n x r2 with columns orthonormal to within
/// [`MAX_DEPARTURE`] (made orthonormal first, [`orthonormalized`]), rounded to f32; `None` when
/// faer's SVD fails, or when the result is worse than the caller's fallback could give
/// ([`resolves`]).
pub(super) fn polar_of_pair(
    x1: MatRef<'_, f64>,
    x2: MatRef<'_, f64>,
    min_relative_gap: f64,
) -> Option<Mat<f32>> {
    let (n, r1, r2) = (x1.nrows(), x1.ncols(), x2.ncols());
    debug_assert_eq!(n, x2.nrows());
    if r1 + r2 > n || r1 == 0 || r2 == 0 {
        return None;
    }
    let (x1, left1) = orthonormalized(x1)?;
    let (x2, left2) = orthonormalized(x2)?;
    let (x1, x2) = (x1.as_ref(), x2.as_ref());
    let c = product(x1.transpose(), x2);
    let mut sines_of = x2.to_owned();
    faer_matmul(
        sines_of.as_mut(),
        Accum::Add,
        x1,
        c.as_ref(),
        -1.0,
        Par::Seq,
    );
    clear_upper_state();
    // S = Z diag(s) Qᵀ: Q diagonalizes CᵀC = I - SᵀS.
    let mut s = Diag::<f64>::zeros(r2);
    let mut q = Mat::<f64>::zeros(r2, r2);
    let scratch = svd_scratch::<f64>(
        n,
        r2,
        ComputeSvdVectors::No,
        ComputeSvdVectors::Thin,
        Par::Seq,
        Default::default(),
    );
    svd(
        sines_of.as_ref(),
        s.as_mut(),
        None,
        Some(q.as_mut()),
        Par::Seq,
        MemStack::new(&mut MemBuffer::new(scratch)),
        Default::default(),
    )
    .ok()?;
    clear_upper_state();
    drop(sines_of);
    let s: Vec<f64> = s.column_vector().iter().copied().collect();
    let smallest = s[r2 - 1];
    let departure = left1.max(left2);
    // Weyl: G is within `departure` of the assumed form; the SVD's sines are within a few
    // r2·eps·‖S‖ (‖S‖ ≤ 1) of the true ones, so s² within twice that times s.
    let error = departure + 2.0 * smallest * r2 as f64 * f64::EPSILON;
    // The next eigenvalue: the next angle's, or 1 for a column of the larger block that the
    // other leaves orthogonal (sines are non-increasing).
    let next = match (r1, r2) {
        (_, 2..) => small_eigenvalue(s[r2 - 2]),
        (2.., _) => 1.0,
        // n = 2: the eigenvalues are 1 - cos and 1 + cos.
        _ => 2.0 - small_eigenvalue(smallest),
    };
    let lambda = [small_eigenvalue(smallest), next];
    if !resolves(lambda, error, r1 + r2, min_relative_gap) {
        return None;
    }
    let (mut h, mut k, mut m) = (vec![0.0; r2], vec![0.0; r2], vec![0.0; r2]);
    for j in 0..r2 {
        (h[j], k[j], m[j]) = coefficients(s[j]);
    }
    // Left = X1 + (A m + B k) Wᵀ and Right = (A k + B h) Qᵀ, with W = C Q, A = X1 W, B = X2 Q.
    let w = product(c.as_ref(), q.as_ref());
    let a = product(x1, w.as_ref());
    let b = product(x2, q.as_ref());
    let mix = |wa: &[f64], wb: &[f64]| {
        Mat::<f64>::from_fn(n, r2, |i, j| a[(i, j)] * wa[j] + b[(i, j)] * wb[j])
    };
    let mut first = x1.to_owned();
    faer_matmul(
        first.as_mut(),
        Accum::Add,
        mix(&m, &k).as_ref(),
        w.transpose(),
        1.0,
        Par::Seq,
    );
    let right = product(mix(&k, &h).as_ref(), q.transpose());
    Some(Mat::<f32>::from_fn(n, r1 + r2, |i, j| {
        if j < r1 {
            first[(i, j)] as f32
        } else {
            right[(i, j - r1)] as f32
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linalg::test_matrices::matrix;

    /// An orthonormal basis of `a`'s column space, in f64.
    fn orthonormal(a: &Mat<f32>) -> Mat<f64> {
        let a = Mat::<f64>::from_fn(a.nrows(), a.ncols(), |i, j| a[(i, j)] as f64);
        a.qr().compute_thin_Q()
    }

    fn concatenate(x1: &Mat<f64>, x2: &Mat<f64>) -> Mat<f64> {
        let r1 = x1.ncols();
        Mat::<f64>::from_fn(x1.nrows(), r1 + x2.ncols(), |i, j| {
            if j < r1 {
                x1[(i, j)]
            } else {
                x2[(i, j - r1)]
            }
        })
    }

    /// The polar factor from faer's SVD, in f64.
    fn polar_by_svd(y: &Mat<f64>) -> Mat<f64> {
        let svd = y.thin_svd().unwrap();
        svd.U() * svd.V().transpose()
    }

    fn max_abs_diff(got: &Mat<f32>, want: &Mat<f64>) -> f64 {
        let mut worst = 0f64;
        for j in 0..got.ncols() {
            for i in 0..got.nrows() {
                worst = worst.max((got[(i, j)] as f64 - want[(i, j)]).abs());
            }
        }
        worst
    }

    #[test]
    fn the_coefficients_are_the_even_and_odd_parts_of_the_inverse_square_root() {
        for s in [1.0f64, 0.9, 0.5, 1e-2, 1e-5] {
            let c = (1.0 - s * s).sqrt();
            let (h, k, m) = coefficients(s);
            // 1 - c as s² / (1 + c): the reference must not cancel either.
            let (p, n) = ((1.0 + c).powf(-0.5), (s * s / (1.0 + c)).powf(-0.5));
            assert!((h - (p + n) / 2.0).abs() <= 1e-9 * h, "h at {s}");
            if c > 1e-3 {
                assert!(
                    (k - (p - n) / (2.0 * c)).abs() <= 1e-9 * k.abs(),
                    "k at {s}"
                );
                assert!((m - (h - 1.0) / (c * c)).abs() <= 1e-9 * m, "m at {s}");
            }
        }
        // The limits at a right angle (cos = 0): h = 1, k = -1/2, m = 3/8.
        assert_eq!(coefficients(1.0), (1.0, -0.5, 0.375));
    }

    #[test]
    fn it_equals_the_polar_factor_of_the_concatenation() {
        // Square and tall, equal and unequal halves.
        for (n, r1, r2) in [(40, 20, 20), (40, 12, 20), (50, 10, 7), (40, 25, 15)] {
            let x1 = orthonormal(&matrix(n, r1, 0.3, 11));
            let x2 = orthonormal(&matrix(n, r2, 0.5, 12));
            let got = polar_of_pair(x1.as_ref(), x2.as_ref(), 1e5).unwrap();
            let want = polar_by_svd(&concatenate(&x1, &x2));
            assert!(max_abs_diff(&got, &want) < 1e-6, "{n} x ({r1} + {r2})");
        }
    }

    /// An orthonormal basis `base` of 8 columns in 30 dimensions, `x1` its first four columns and
    /// `x2` its last four, where column `j` of each `(j, t)` in `tilts` is turned from `base`'s
    /// column `4 + j` to within `t` rad of `x1`'s column `j` (`t = 0`: the same column).
    fn pair_with_tilts(tilts: &[(usize, f64)]) -> (Mat<f64>, Mat<f64>, Mat<f64>) {
        let n = 30;
        let base = orthonormal(&matrix(n, 8, 0.0, 21));
        let x1 = base.subcols(0, 4).to_owned();
        let mut x2 = base.subcols(4, 4).to_owned();
        for &(column, t) in tilts {
            for i in 0..n {
                x2[(i, column)] = t.cos() * base[(i, column)] + t.sin() * base[(i, 4 + column)];
            }
        }
        (base, x1, x2)
    }

    #[test]
    fn a_shared_direction_is_refused_and_a_nearly_shared_one_resolved() {
        // x2 holds x1's first column: G is singular.
        let (_, x1, x2) = pair_with_tilts(&[(0, 0.0)]);
        assert!(polar_of_pair(x1.as_ref(), x2.as_ref(), 1e5).is_none());
        // Tilted by 1e-4 rad: G's smallest eigenvalue is 5e-9.
        let (base, x1, x2) = pair_with_tilts(&[(0, 1e-4)]);
        let n = base.nrows();
        let got = polar_of_pair(x1.as_ref(), x2.as_ref(), 1e5).unwrap();
        let want = polar_by_svd(&concatenate(&x1, &x2));
        assert!(max_abs_diff(&got, &want) < 1e-6);
        // Columns orthogonal to the other basis pass through unchanged.
        let unchanged = |from: usize, to: usize| {
            max_abs_diff(
                &Mat::<f32>::from_fn(n, 3, |i, j| got[(i, j + to)]),
                &base.subcols(from, 3).to_owned(),
            )
        };
        assert!(unchanged(1, 1) < 1e-6 && unchanged(5, 5) < 1e-6);
    }

    #[test]
    fn angles_too_close_for_the_gap_are_taken_where_the_f32_fallback_would_be_worse() {
        // Two columns tilted by 1e-6 and 2e-6 rad: G's two smallest eigenvalues are 5e-13 and
        // 2e-12, known to about 1e-16, so a relative 2e-4: short of the 1e5 gap.
        let (_, x1, x2) = pair_with_tilts(&[(0, 1e-6), (1, 2e-6)]);
        let n = x1.nrows();
        let got = polar_of_pair(x1.as_ref(), x2.as_ref(), 1e5).expect("the angles are taken");
        let y = concatenate(&x1, &x2);
        let want = polar_by_svd(&y);
        let angles = max_abs_diff(&got, &want);
        assert!(angles < 1e-6, "{angles}");
        // The fallback: the polar factor of the concatenation rounded to f32.
        let rounded = Mat::<f64>::from_fn(n, 8, |i, j| y[(i, j)] as f32 as f64);
        let fallback = polar_by_svd(&rounded);
        let fallback_error =
            max_abs_diff(&Mat::from_fn(n, 8, |i, j| fallback[(i, j)] as f32), &want);
        assert!(
            fallback_error > 10.0 * angles.max(1e-7),
            "{fallback_error} {angles}"
        );
    }
}
