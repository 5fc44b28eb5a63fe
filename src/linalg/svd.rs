//! Singular value decompositions and products for the spectral merge methods (TSV, STAR), on
//! faer.
//!
//! - [`thin_svd`]: every singular triplet (faer's QR + divide-and-conquer bidiagonal SVD, run
//!   in f64 on the f32 input, factors returned in f32; see [`to_f64`] for why).
//! - [`small_side_svd`]: every singular value, and the singular vectors of the smaller dimension
//!   only (V of a tall matrix, U of a wide one), from the f64 Gram matrix's eigendecomposition
//!   where its error bound allows (12 s against 28 s for the SVD of a 18944 x 3584 matrix on one
//!   core), else from the SVD without forming the large factor.
//! - [`polar`]: the orthogonal polar factor `U V^T` of a thin SVD. It is taken from the SVD
//!   rather than from `A (A^T A)^{-1/2}`, which loses half the digits in f32 on the badly
//!   conditioned concatenations TSV builds (merging.md, numerical notes).
//! - [`matmul`]: a product split into fixed row blocks computed in parallel.
//!
//! Every faer call runs single-threaded (`Par::Seq`): faer splits parallel work by thread
//! count, which would change rounding between machines. Callers parallelize over independent
//! work instead (tasks, the two polar factors, fixed row blocks), so results are the same bytes
//! at any thread count.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::evd::{self_adjoint_evd, self_adjoint_evd_scratch, ComputeEigenvectors};
use faer::linalg::matmul::matmul as faer_matmul;
use faer::linalg::matmul::triangular::{self, BlockStructure};
use faer::linalg::svd::{svd, svd_scratch, ComputeSvdVectors};
use faer::{Accum, Mat, MatRef, Par};
use rayon::prelude::*;

/// Singular triplets: `A ~ U diag(s) V^T`, `u` is m x r, `v` is n x r, `s` non-increasing.
#[derive(Debug, Clone)]
pub struct Svd {
    pub u: Mat<f32>,
    pub s: Vec<f32>,
    pub v: Mat<f32>,
}

impl Svd {
    /// Keep the first `r` triplets.
    pub fn truncate(self, r: usize) -> Svd {
        let r = r.min(self.s.len());
        Svd {
            u: self.u.subcols(0, r).to_owned(),
            s: self.s[..r].to_vec(),
            v: self.v.subcols(0, r).to_owned(),
        }
    }
}

/// Why an SVD failed (faer reports non-convergence, which NaN/Inf input causes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SvdFailed;

impl std::fmt::Display for SvdFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the SVD did not converge (non-finite values?)")
    }
}

/// `a` in f64, where the decompositions run: faer's f32 SVD reconstructed a 18944 x 3584 task
/// vector of the merge benchmark only to 1.2e-2 relative (both its divide-and-conquer and its QR
/// algorithm), while f64 reconstructs it to 1e-14 (the merges take about twice as long).
fn to_f64(a: MatRef<'_, f32>) -> Mat<f64> {
    Mat::<f64>::from_fn(a.nrows(), a.ncols(), |i, j| a[(i, j)] as f64)
}

fn to_f32(a: &Mat<f64>) -> Mat<f32> {
    Mat::<f32>::from_fn(a.nrows(), a.ncols(), |i, j| a[(i, j)] as f32)
}

/// faer's SVD of `a` in f64, single-threaded, computing the factors asked for.
fn svd_f64(
    a: MatRef<'_, f32>,
    u: Option<&mut Mat<f64>>,
    v: Option<&mut Mat<f64>>,
) -> Result<Vec<f32>, SvdFailed> {
    let (m, n) = a.shape();
    let mut s = Diag::<f64>::zeros(m.min(n));
    if m.min(n) > 0 {
        let want = |x: &Option<&mut Mat<f64>>| match x {
            Some(_) => ComputeSvdVectors::Thin,
            None => ComputeSvdVectors::No,
        };
        let scratch = svd_scratch::<f64>(m, n, want(&u), want(&v), Par::Seq, Default::default());
        svd(
            to_f64(a).as_ref(),
            s.as_mut(),
            u.map(|x| x.as_mut()),
            v.map(|x| x.as_mut()),
            Par::Seq,
            MemStack::new(&mut MemBuffer::new(scratch)),
            Default::default(),
        )
        .map_err(|_| SvdFailed)?;
    }
    Ok(s.column_vector().iter().map(|&x| x as f32).collect())
}

/// The thin SVD (k = min(m, n) triplets), computed in f64.
pub fn thin_svd(a: MatRef<'_, f32>) -> Result<Svd, SvdFailed> {
    let (m, n) = a.shape();
    let k = m.min(n);
    let (mut u, mut v) = (Mat::<f64>::zeros(m, k), Mat::<f64>::zeros(n, k));
    let s = svd_f64(a, Some(&mut u), Some(&mut v))?;
    Ok(Svd {
        u: to_f32(&u),
        s,
        v: to_f32(&v),
    })
}

/// Every singular value (non-increasing) and the singular vectors of the smaller dimension: V
/// (n x n) when `m >= n`, U (m x m) otherwise. Computed in f64.
///
/// First from the Gram matrix of the smaller side (see [`gram_eigen`]), which is about twice as
/// fast as the SVD on the 7B MLP shapes; when its error bound on the nuclear norm is not tight
/// enough (exactly low-rank matrices, whose zero singular values come out as rounding noise of
/// size `sqrt(eps) * ||A||`), from faer's SVD.
pub fn small_side_svd(a: MatRef<'_, f32>) -> Result<(Vec<f32>, Mat<f32>), SvdFailed> {
    if let Some(found) = gram_eigen(a) {
        return Ok(found);
    }
    let (m, n) = a.shape();
    let k = m.min(n);
    let mut vectors = Mat::<f64>::zeros(k, k);
    let s = if m >= n {
        svd_f64(a, None, Some(&mut vectors))?
    } else {
        svd_f64(a, Some(&mut vectors), None)?
    };
    Ok((s, to_f32(&vectors)))
}

/// Relative error of the nuclear norm (the sum of the singular values) that [`gram_eigen`]
/// accepts. STAR's output scales with the nuclear norm, and the merges promise 1e-4 relative.
const GRAM_NUCLEAR_TOL: f64 = 1e-5;

/// The singular values and small-side singular vectors of `a` from the eigendecomposition of
/// `G = AᵀA` (or `AAᵀ` for a wide matrix) in f64, or `None` when they cannot be trusted to
/// [`GRAM_NUCLEAR_TOL`].
///
/// The f32 entries' products are exact in f64, so `G` is off by at most `l·eps·||A||_F²` (sums
/// of length `l`, the larger side) and its symmetric eigendecomposition adds a backward error
/// of about `k·eps·||G||` (k the smaller side): every computed eigenvalue λ is within `δ` of a
/// true σ². Each σ then lies in `[√max(λ-δ, 0), √(λ+δ)]`, and the sum of those widths bounds the
/// error of the nuclear norm; above the tolerance the caller falls back to the SVD.
fn gram_eigen(a: MatRef<'_, f32>) -> Option<(Vec<f32>, Mat<f32>)> {
    let (m, n) = a.shape();
    let (k, long) = (m.min(n), m.max(n));
    if k == 0 {
        return None;
    }
    let x = to_f64(a);
    let (lhs, rhs) = if m >= n {
        (x.transpose(), x.as_ref())
    } else {
        (x.as_ref(), x.transpose())
    };
    let mut gram = Mat::<f64>::zeros(k, k);
    triangular::matmul(
        gram.as_mut(),
        BlockStructure::TriangularLower,
        Accum::Replace,
        lhs,
        BlockStructure::Rectangular,
        rhs,
        BlockStructure::Rectangular,
        1.0,
        Par::Seq,
    );
    drop(x);
    let mut eigenvalues = Diag::<f64>::zeros(k);
    let mut eigenvectors = Mat::<f64>::zeros(k, k);
    let scratch =
        self_adjoint_evd_scratch::<f64>(k, ComputeEigenvectors::Yes, Par::Seq, Default::default());
    self_adjoint_evd(
        gram.as_ref(),
        eigenvalues.as_mut(),
        Some(eigenvectors.as_mut()),
        Par::Seq,
        MemStack::new(&mut MemBuffer::new(scratch)),
        Default::default(),
    )
    .ok()?;
    let fro2: f64 = (0..k).map(|i| gram[(i, i)]).sum();
    // Ascending from faer; singular values go the other way.
    let lambda: Vec<f64> = eigenvalues.column_vector().iter().rev().copied().collect();
    let top = lambda.first().copied().unwrap_or(0.0).max(0.0);
    let delta = f64::EPSILON * (long as f64 * fro2 + 8.0 * k as f64 * top);
    let nuclear: f64 = lambda.iter().map(|&l| l.max(0.0).sqrt()).sum();
    let width: f64 = lambda
        .iter()
        .map(|&l| (l + delta).sqrt() - (l - delta).max(0.0).sqrt())
        .sum();
    // NaN (from non-finite input) fails the test too.
    let trusted = width <= GRAM_NUCLEAR_TOL * nuclear;
    if !trusted {
        return None;
    }
    let s = lambda.iter().map(|&l| l.max(0.0).sqrt() as f32).collect();
    let vectors = Mat::<f32>::from_fn(k, k, |i, j| eigenvectors[(i, k - 1 - j)] as f32);
    Some((s, vectors))
}

/// The orthogonal polar factor `U V^T` of `a` (m x p, m >= p): the matrix with orthonormal
/// columns nearest to `a` (orthogonal Procrustes).
pub fn polar(a: MatRef<'_, f32>) -> Result<Mat<f32>, SvdFailed> {
    let svd = thin_svd(a)?;
    Ok(matmul(svd.u.as_ref(), svd.v.transpose()))
}

/// Rows per block of [`matmul`]: fixed, so the rounding does not depend on the thread count.
const MATMUL_ROWS: usize = 256;

/// `lhs * rhs`, computed in parallel over fixed blocks of rows.
pub fn matmul(lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>) -> Mat<f32> {
    let (m, n) = (lhs.nrows(), rhs.ncols());
    let blocks: Vec<Mat<f32>> = (0..m)
        .step_by(MATMUL_ROWS)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|start| {
            let rows = MATMUL_ROWS.min(m - start);
            let mut out = Mat::<f32>::zeros(rows, n);
            faer_matmul(
                out.as_mut(),
                Accum::Replace,
                lhs.subrows(start, rows),
                rhs,
                1.0,
                Par::Seq,
            );
            out
        })
        .collect();
    let mut out = Mat::<f32>::zeros(m, n);
    for (b, block) in blocks.iter().enumerate() {
        out.as_mut()
            .subrows_mut(b * MATMUL_ROWS, block.nrows())
            .copy_from(block.as_ref());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use rand_distr::{Distribution, StandardNormal};

    fn orthonormal(y: &Mat<f32>) -> Mat<f32> {
        y.qr().compute_thin_Q()
    }

    fn matrix(m: usize, n: usize, decay: f64, seed: u64) -> Mat<f32> {
        // U diag(s) V^T with orthonormal factors from QR of Gaussian matrices.
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let k = m.min(n);
        let g1 = Mat::<f32>::from_fn(m, k, |_, _| StandardNormal.sample(&mut rng));
        let g2 = Mat::<f32>::from_fn(n, k, |_, _| StandardNormal.sample(&mut rng));
        let (u, v) = (orthonormal(&g1), orthonormal(&g2));
        let scaled = Mat::<f32>::from_fn(m, k, |i, j| {
            u[(i, j)] * ((j + 1) as f64).powf(-decay) as f32
        });
        &scaled * v.transpose()
    }

    fn max_abs_diff(a: &Mat<f32>, b: &Mat<f32>) -> f32 {
        let mut d = 0f32;
        for j in 0..a.ncols() {
            for i in 0..a.nrows() {
                d = d.max((a[(i, j)] - b[(i, j)]).abs());
            }
        }
        d
    }

    fn low_rank(svd: &Svd) -> Mat<f32> {
        let scaled =
            Mat::<f32>::from_fn(svd.u.nrows(), svd.s.len(), |i, j| svd.u[(i, j)] * svd.s[j]);
        &scaled * svd.v.transpose()
    }

    #[test]
    fn thin_svd_reconstructs() {
        let a = matrix(40, 25, 0.5, 1);
        let svd = thin_svd(a.as_ref()).unwrap();
        assert!(max_abs_diff(&low_rank(&svd), &a) < 1e-5);
        assert!(svd.s.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn the_gram_route_gives_the_svd_and_refuses_exact_low_rank() {
        for (m, n) in [(60, 25), (25, 60)] {
            let a = matrix(m, n, 0.8, 3);
            let (s, vectors) = gram_eigen(a.as_ref()).expect("full rank: the Gram route is used");
            let svd = thin_svd(a.as_ref()).unwrap();
            for (x, y) in s.iter().zip(&svd.s) {
                assert!((x - y).abs() <= 1e-6 * svd.s[0], "{x} vs {y}");
            }
            // The same singular vectors up to sign: |<gram_j, svd_j>| = 1.
            let reference = if m >= n { &svd.v } else { &svd.u };
            for j in 0..s.len() {
                let dot: f32 = (0..vectors.nrows())
                    .map(|i| vectors[(i, j)] * reference[(i, j)])
                    .sum();
                assert!((dot.abs() - 1.0).abs() < 1e-4, "vector {j}: {dot}");
            }
        }
        // Rank 2 of 200: 198 singular values are zero, which the Gram route only resolves to
        // about sqrt(eps)·||A|| each, so its bound on the nuclear norm fails and the SVD is used.
        let low = &matrix(400, 2, 0.0, 4) * &matrix(2, 200, 0.0, 5);
        assert!(gram_eigen(low.as_ref()).is_none());
        let (s, _) = small_side_svd(low.as_ref()).unwrap();
        assert!(s[2..].iter().all(|&x| x <= 1e-5 * s[0]), "{:?}", &s[..4]);
    }

    #[test]
    fn polar_factor_is_orthonormal_and_nearest() {
        let a = matrix(30, 12, 0.3, 2);
        let p = polar(a.as_ref()).unwrap();
        let gram = matmul(p.transpose(), p.as_ref());
        assert!(max_abs_diff(&gram, &Mat::identity(12, 12)) < 1e-5);
        // For A = U S V^T, P = U V^T, so P^T A = V S V^T is symmetric.
        let pa = matmul(p.transpose(), a.as_ref());
        assert!(max_abs_diff(&pa, &pa.transpose().to_owned()) < 1e-5);
    }
}
