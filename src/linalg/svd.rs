//! Singular value decompositions for the spectral merge methods (TSV, STAR), on faer, and the
//! choice of route for each call. Everything is computed in f64 on the f32 input (see [`to_f64`]
//! for why), by one of two routes:
//! - the eigendecomposition of the Gram matrix of the smaller side ([`GramEvd`]): several times
//!   faster than the SVD on 7B-shaped task vectors, more so when few vectors are wanted
//!   ([`Wanted`]; `cargo bench --bench merge_kernels` times both routes), used whenever its error
//!   bound shows the result is accurate enough for the caller;
//! - faer's SVD (QR + divide-and-conquer bidiagonal), otherwise: exactly low-rank matrices and
//!   badly conditioned concatenations, where squaring the matrix loses the digits that matter.
//!
//! The functions:
//! - [`thin_svd`]: every singular triplet (SVD only).
//! - [`top_svd`]: the top r triplets (TSV's per-task decomposition).
//! - [`small_side_svd`]: every singular value and the singular vectors of the smaller dimension
//!   (STAR, which needs the nuclear norm and the leading subspace).
//! - [`polar`]: the orthogonal polar factor, `U V^T` of the SVD or `A (A^T A)^(-1/2)`, as two
//!   factors ([`Polar`]).
//!
//! Every faer call runs single-threaded (`Par::Seq`): faer splits parallel work by thread
//! count, which would change rounding between machines. Callers parallelize over independent
//! work instead (tasks, the two polar factors, the fixed row blocks of
//! [`super::gemm::matmul`]), so results are the same bytes at any thread count. The definitions
//! and their sources (TSV, STAR) are in docs/reference/spectral.md.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::matmul::matmul as faer_matmul;
use faer::linalg::svd::{svd, svd_scratch, ComputeSvdVectors};
use faer::{Accum, Mat, MatRef, Par};

use super::f64_blocks::long_side_product;
use super::gram_evd::{Gram, GramEvd, Wanted, KEPT_VECTORS};
use super::polar_pair;
use super::simd::clear_upper_state;

/// Singular triplets: `A ~ U diag(s) V^T`, `u` is m x r, `v` is n x r, `s` non-increasing.
#[derive(Debug, Clone)]
pub struct Svd {
    pub u: Mat<f32>,
    pub s: Vec<f32>,
    pub v: Mat<f32>,
}

/// Why an SVD failed (faer reports non-convergence, which NaN/Inf input causes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SvdFailed;

impl std::fmt::Display for SvdFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the SVD did not converge (non-finite values?)")
    }
}

/// `a` in f64, where the decompositions run: faer's f32 SVD (divide-and-conquer or QR) does not
/// reconstruct 7B-shaped task vectors to the 1e-4 the merges promise, while f64 reconstructs them
/// to rounding level, at about twice the time (`benches/merge_vs_mergekit.sh` checks the merges'
/// accuracy against the full-SVD reference).
pub(super) fn to_f64(a: MatRef<'_, f32>) -> Mat<f64> {
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

/// Every singular value (non-increasing) and the leading singular vectors of the smaller
/// dimension (V when `m >= n`, U otherwise), as many as `rank` asks for once it has seen the
/// singular values (STAR keeps tens of 3584 on low-rank task vectors, hundreds on flat-tailed
/// ones). Computed in f64.
///
/// `rank(s, err)` gets the singular values and a bound `err[j]` on the error of each (its f32
/// rounding included), and returns `None` when those errors could change its answer; with
/// every bound 0 it must decide.
///
/// First from the Gram matrix of the smaller side ([`GramEvd`]), the faster route on the 7B MLP
/// shapes (`cargo bench --bench merge_kernels`). From faer's SVD when the Gram route's error bound on the
/// nuclear norm is above [`GRAM_NUCLEAR_TOL`] (exactly low-rank matrices, whose zero singular
/// values come out as rounding noise of size `sqrt(eps)·||A||`) or leaves `rank` undecided,
/// even after [`GramEvd::refine_tail`].
pub fn small_side_svd(
    a: MatRef<'_, f32>,
    rank: impl Fn(&[f32], &[f64]) -> Option<usize>,
) -> Result<(Vec<f32>, Mat<f32>), SvdFailed> {
    let (m, n) = a.shape();
    let k = m.min(n);
    if let Some(mut evd) = GramEvd::of(a, Wanted::Few) {
        let decide = |e: &GramEvd| {
            (e.nuclear_error() <= GRAM_NUCLEAR_TOL * e.nuclear())
                .then(|| {
                    let (s, mut errors) = (e.singular_values(), e.widths());
                    for (err, &x) in errors.iter_mut().zip(&s) {
                        *err += x as f64 * f64::from(f32::EPSILON);
                    }
                    rank(&s, &errors).map(|r| (s, r))
                })
                .flatten()
        };
        let decided = decide(&evd).or_else(|| evd.refine_tail(a).then(|| decide(&evd)).flatten());
        if let Some((s, vectors)) = decided.and_then(|(s, r)| Some((s, evd.vectors(r.min(k))?))) {
            return Ok((s, to_f32(&vectors)));
        }
    }
    let mut vectors = Mat::<f64>::zeros(k, k);
    let s = if m >= n {
        svd_f64(a, None, Some(&mut vectors))?
    } else {
        svd_f64(a, Some(&mut vectors), None)?
    };
    // The SVD's own rounding (about k·eps·σ1 per value) is the floor of any route: taken as exact.
    let r = rank(&s, &vec![0.0; s.len()]).unwrap_or(k).min(k);
    Ok((s, to_f32(&vectors.subcols(0, r).to_owned())))
}

/// The top singular triplets of [`top_svd`], in f64 as computed: [`polar_from_angles`] needs
/// columns orthonormal to rounding.
#[derive(Debug, Clone)]
pub struct TopSvd {
    /// The larger side's vectors (U when `m >= n`).
    pub large: Mat<f64>,
    pub s: Vec<f32>,
    /// The smaller side's vectors (V when `m >= n`).
    pub small: Mat<f64>,
}

/// The top `r` singular triplets (fewer if `r > min(m, n)`), computed in f64.
///
/// From [`GramEvd`] when every kept σ² is at least [`GRAM_RELATIVE_GAP`] times the eigenvalue
/// error bound away from zero: the large-side vectors are then `A v / σ` (or `Aᵀu / σ`) to
/// that relative accuracy. Otherwise from the thin SVD.
pub fn top_svd(a: MatRef<'_, f32>, r: usize) -> Result<TopSvd, SvdFailed> {
    let (m, n) = a.shape();
    let r = r.min(m.min(n));
    if let Some(evd) = GramEvd::of(a, Wanted::Most)
        .filter(|e| r == 0 || e.lambda[r - 1] >= GRAM_RELATIVE_GAP * e.delta)
    {
        let s: Vec<f32> = evd.singular_values()[..r].to_vec();
        let small = evd.vectors(r).expect(KEPT_VECTORS);
        let lambda = evd.lambda[..r].to_vec();
        // Its reflectors and tridiagonal eigenvectors are no longer needed (206 MB at k = 3584).
        drop(evd);
        // The large side: A v_j / σ_j (tall) or Aᵀ u_j / σ_j (wide), in f64.
        let mut large = long_side_product(a, small.as_ref());
        for (j, l) in lambda.iter().enumerate() {
            let inv = 1.0 / l.sqrt();
            large.col_mut(j).iter_mut().for_each(|x| *x *= inv);
        }
        return Ok(TopSvd { large, s, small });
    }
    let k = m.min(n);
    let (mut u, mut v) = (Mat::<f64>::zeros(m, k), Mat::<f64>::zeros(n, k));
    let s = svd_f64(a, Some(&mut u), Some(&mut v))?;
    let (large, small) = if m >= n { (u, v) } else { (v, u) };
    Ok(TopSvd {
        large: large.subcols(0, r).to_owned(),
        s: s[..r].to_vec(),
        small: small.subcols(0, r).to_owned(),
    })
}

/// Relative error bound on the nuclear norm (the sum of the singular values) that STAR accepts
/// from [`GramEvd`]. STAR's output scales with the nuclear norm, so this bounds the relative
/// error it adds; the merges promise 1e-4, which leaves half for everything else. The bound is a
/// worst case, orders of magnitude above the Gram route's actual difference from the SVD's
/// nuclear norm on task vectors.
const GRAM_NUCLEAR_TOL: f64 = 5e-5;

/// How many times the eigenvalue error bound a kept σ² must be for [`top_svd`] and [`polar`] to
/// use [`GramEvd`]: their results then carry a relative error of about 1e-5 at most (the bound
/// is for the worst case; rounding errors of random sign are far smaller).
const GRAM_RELATIVE_GAP: f64 = 1e5;

/// An orthogonal polar factor kept as the product `left · right` (`right` absent: the
/// identity), so that a caller multiplying it further can apply the p x p `right` to its
/// smaller operand first: TSV's merged task vector `P_U diag(s) P_Vᵀ` then takes one large
/// product where the explicit factors would take two (docs/reference/spectral.md).
#[derive(Debug, Clone)]
pub struct Polar {
    /// m x p.
    pub left: Mat<f32>,
    /// p x p.
    pub right: Option<Mat<f32>>,
}

/// The orthogonal polar factor `U V^T` of `a` (m x p, m >= p): the matrix with orthonormal
/// columns nearest to `a` (orthogonal Procrustes).
///
/// As `a · (aᵀa)^(-1/2)` from [`GramEvd`] when `aᵀa` is well conditioned (its smallest
/// eigenvalue at least [`GRAM_RELATIVE_GAP`] times the error bound), else as `U · Vᵀ` of the thin
/// SVD: TSV's concatenated singular vectors are badly conditioned when the tasks share
/// directions, and the inverse square root would then amplify rounding
/// (docs/reference/spectral.md). So are the square concatenations TSV builds for a matrix's
/// smaller side; a Cholesky test ([`Gram::smallest_eigenvalue_below`]) refuses those before the
/// eigendecomposition.
pub fn polar(a: Mat<f32>) -> Result<Polar, SvdFailed> {
    let (m, p) = a.shape();
    let evd = (m >= p)
        .then(|| Gram::of(a.as_ref()))
        .flatten()
        .filter(|g| !g.smallest_eigenvalue_below(GRAM_RELATIVE_GAP * g.product_error()))
        .and_then(|g| g.evd(Wanted::Most));
    if let Some(evd) = evd.filter(|e| e.lambda[p - 1] >= GRAM_RELATIVE_GAP * e.delta) {
        // (aᵀa)^(-1/2) = W diag(λ^(-1/2)) Wᵀ
        let vectors = evd.vectors(p).expect(KEPT_VECTORS);
        let scaled = Mat::<f64>::from_fn(p, p, |i, j| vectors[(i, j)] / evd.lambda[j].sqrt());
        let mut inv_sqrt = Mat::<f64>::zeros(p, p);
        faer_matmul(
            inv_sqrt.as_mut(),
            Accum::Replace,
            scaled.as_ref(),
            vectors.transpose(),
            1.0,
            Par::Seq,
        );
        clear_upper_state();
        return Ok(Polar {
            left: a,
            right: Some(to_f32(&inv_sqrt)),
        });
    }
    let svd = thin_svd(a.as_ref())?;
    Ok(Polar {
        left: svd.u,
        right: Some(svd.v.transpose().to_owned()),
    })
}

/// `polar([x1 x2])` for two sets of orthonormal columns (TSV's smaller side for two tasks),
/// from their principal angles ([`polar_pair`]); `None` when those resolve `[x1 x2]`'s smallest
/// singular value neither to [`GRAM_RELATIVE_GAP`] nor better than [`polar`] of the f32
/// concatenation would, and the caller takes [`polar`] instead.
pub fn polar_from_angles(x1: MatRef<'_, f64>, x2: MatRef<'_, f64>) -> Option<Mat<f32>> {
    polar_pair::polar_of_pair(x1, x2, GRAM_RELATIVE_GAP)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linalg::gemm::matmul;
    use crate::linalg::test_matrices::{matrix, max_abs_diff};

    fn explicit(p: Polar) -> Mat<f32> {
        match p.right {
            Some(right) => matmul(p.left.as_ref(), right.as_ref()),
            None => p.left,
        }
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

    /// The first `r` triplets.
    fn first(svd: &Svd, r: usize) -> Svd {
        Svd {
            u: svd.u.subcols(0, r).to_owned(),
            s: svd.s[..r].to_vec(),
            v: svd.v.subcols(0, r).to_owned(),
        }
    }

    fn as_svd(top: TopSvd, tall: bool) -> Svd {
        let (large, small) = (to_f32(&top.large), to_f32(&top.small));
        let (u, v) = if tall { (large, small) } else { (small, large) };
        Svd { u, s: top.s, v }
    }

    /// |<x_j, y_j>| = 1 for every column: the same singular vectors up to sign.
    fn same_vectors(x: &Mat<f32>, y: &Mat<f32>) {
        for j in 0..x.ncols() {
            let dot: f32 = (0..x.nrows()).map(|i| x[(i, j)] * y[(i, j)]).sum();
            assert!((dot.abs() - 1.0).abs() < 1e-4, "vector {j}: {dot}");
        }
    }

    #[test]
    fn the_gram_route_gives_the_svd_and_refuses_exact_low_rank() {
        for (m, n) in [(60, 25), (25, 60)] {
            let a = matrix(m, n, 0.8, 3);
            let evd = GramEvd::of(a.as_ref(), Wanted::Few).unwrap();
            assert!(evd.nuclear_error() <= GRAM_NUCLEAR_TOL * evd.nuclear());
            // The two reductions agree within the error bound, vectors included.
            let one_stage = GramEvd::of(a.as_ref(), Wanted::Most).unwrap();
            for (x, y) in evd.lambda.iter().zip(&one_stage.lambda) {
                assert!((x - y).abs() <= evd.delta, "{x} vs {y}");
            }
            same_vectors(
                &to_f32(&evd.vectors(10).unwrap()),
                &to_f32(&one_stage.vectors(10).unwrap()),
            );
            let svd = thin_svd(a.as_ref()).unwrap();
            let (s, vectors) = small_side_svd(a.as_ref(), |s, _| Some(s.len())).unwrap();
            for (x, y) in s.iter().zip(&svd.s) {
                assert!((x - y).abs() <= 1e-6 * svd.s[0], "{x} vs {y}");
            }
            same_vectors(&vectors, if m >= n { &svd.v } else { &svd.u });
            // The top 10 triplets, large side included.
            let top = as_svd(top_svd(a.as_ref(), 10).unwrap(), m >= n);
            let want = first(&svd, 10);
            same_vectors(&top.u, &want.u);
            same_vectors(&top.v, &want.v);
            assert!(max_abs_diff(&low_rank(&top), &low_rank(&want)) < 1e-5);
        }
        // Rank 2 of 200: 198 singular values are zero, which the Gram route only resolves to
        // about sqrt(eps)·||A|| each, so its bound on the nuclear norm fails and the SVD is used.
        let low = &matrix(400, 2, 0.0, 4) * &matrix(2, 200, 0.0, 5);
        let evd = GramEvd::of(low.as_ref(), Wanted::Few).unwrap();
        assert!(evd.nuclear_error() > GRAM_NUCLEAR_TOL * evd.nuclear());
        let (s, _) = small_side_svd(low.as_ref(), |_, _| Some(0)).unwrap();
        assert!(s[2..].iter().all(|&x| x <= 1e-5 * s[0]), "{:?}", &s[..4]);
        // Its third singular value is noise, so asking for 3 triplets also takes the SVD: the
        // third pair of vectors is then SVD's (arbitrary but orthonormal) choice.
        assert!(evd.lambda[2] < GRAM_RELATIVE_GAP * evd.delta);
        let top = as_svd(top_svd(low.as_ref(), 3).unwrap(), true);
        let gram = matmul(top.u.transpose(), top.u.as_ref());
        assert!(max_abs_diff(&gram, &Mat::identity(3, 3)) < 1e-5);
    }

    #[test]
    fn an_ill_conditioned_polar_factor_comes_from_the_svd() {
        // Two nearly equal columns: aᵀa has an eigenvalue of about 1e-12.
        let mut a = matrix(30, 4, 0.0, 6);
        for i in 0..30 {
            a[(i, 3)] = a[(i, 2)] + 1e-6 * a[(i, 0)];
        }
        let evd = GramEvd::of(a.as_ref(), Wanted::Few).unwrap();
        assert!(evd.lambda[3] < GRAM_RELATIVE_GAP * evd.delta);
        // The Cholesky test refuses it before the eigendecomposition.
        let gram = Gram::of(a.as_ref()).unwrap();
        assert!(gram.smallest_eigenvalue_below(GRAM_RELATIVE_GAP * gram.product_error()));
        let p = explicit(polar(a).unwrap());
        let gram = matmul(p.transpose(), p.as_ref());
        assert!(max_abs_diff(&gram, &Mat::identity(4, 4)) < 1e-5);
    }

    #[test]
    fn polar_factor_is_orthonormal_and_nearest() {
        let a = matrix(30, 12, 0.3, 2);
        let p = explicit(polar(a.clone()).unwrap());
        let gram = matmul(p.transpose(), p.as_ref());
        assert!(max_abs_diff(&gram, &Mat::identity(12, 12)) < 1e-5);
        // For A = U S V^T, P = U V^T, so P^T A = V S V^T is symmetric.
        let pa = matmul(p.transpose(), a.as_ref());
        assert!(max_abs_diff(&pa, &pa.transpose().to_owned()) < 1e-5);
    }
}
