//! Singular value decompositions and products for the spectral merge methods (TSV, STAR), on
//! faer. Everything is computed in f64 on the f32 input (see [`to_f64`] for why), by one of two
//! routes:
//! - the eigendecomposition of the Gram matrix of the smaller side ([`GramEvd`]): 2.4 s for the
//!   product plus 6.5 s (1.9 s when few vectors are wanted, [`Wanted`]) against 28 s for the SVD
//!   of a 18944 x 3584 matrix on one core, used whenever its error bound shows the result is
//!   accurate enough for the caller;
//! - faer's SVD (QR + divide-and-conquer bidiagonal), otherwise: exactly low-rank matrices and
//!   badly conditioned concatenations, where squaring the matrix loses the digits that matter.
//!
//! The functions:
//! - [`thin_svd`]: every singular triplet (SVD only).
//! - [`top_svd`]: the top r triplets (TSV's per-task decomposition).
//! - [`small_side_svd`]: every singular value and the singular vectors of the smaller dimension
//!   (STAR, which needs the nuclear norm and the leading subspace).
//! - [`polar`]: the orthogonal polar factor, `U V^T` of the SVD or `A (A^T A)^(-1/2)`.
//! - [`matmul`]: a product split into fixed row blocks computed in parallel.
//!
//! Every faer call runs single-threaded (`Par::Seq`): faer splits parallel work by thread
//! count, which would change rounding between machines. Callers parallelize over independent
//! work instead (tasks, the two polar factors, fixed row blocks), so results are the same bytes
//! at any thread count.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
use faer::linalg::evd::tridiag::{tridiag_in_place, tridiag_in_place_scratch};
use faer::linalg::evd::ComputeEigenvectors;
use faer::linalg::householder::{
    apply_block_householder_sequence_on_the_left_in_place_scratch,
    apply_block_householder_sequence_on_the_left_in_place_with_conj,
};
use faer::linalg::matmul::matmul as faer_matmul;
use faer::linalg::matmul::triangular::{self, BlockStructure};
use faer::linalg::qr::no_pivoting::factor::recommended_block_size;
use faer::linalg::svd::{svd, svd_scratch, ComputeSvdVectors};
use faer::{Accum, Conj, Mat, MatRef, Par};

use super::tridiagonal::{self, selected_eigenvectors};
use super::two_stage::{self, TwoStage};
use rayon::prelude::*;
use std::mem::take;
use std::ops::Range;

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

/// Every singular value (non-increasing) and the leading singular vectors of the smaller
/// dimension (V when `m >= n`, U otherwise), as many as `rank` asks for once it has seen the
/// singular values (STAR keeps 72-86 of 3584 on its benchmark). Computed in f64.
///
/// `rank(s, err)` gets the singular values and a bound `err[j]` on the error of each (its f32
/// rounding included), and returns `None` when those errors could change its answer; with
/// every bound 0 it must decide.
///
/// First from the Gram matrix of the smaller side ([`GramEvd`]), which is about twice as fast as
/// the SVD on the 7B MLP shapes. From faer's SVD when the Gram route's error bound on the
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

/// The top `r` singular triplets (fewer if `r > min(m, n)`), computed in f64.
///
/// From [`GramEvd`] when every kept σ² is at least [`GRAM_RELATIVE_GAP`] times the eigenvalue
/// error bound away from zero: the large-side vectors are then `A v / σ` (or `Aᵀu / σ`) to
/// that relative accuracy. Otherwise from the thin SVD.
pub fn top_svd(a: MatRef<'_, f32>, r: usize) -> Result<Svd, SvdFailed> {
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
        let (u, v) = if m >= n {
            (large, small)
        } else {
            (small, large)
        };
        return Ok(Svd {
            u: to_f32(&u),
            s,
            v: to_f32(&v),
        });
    }
    Ok(thin_svd(a)?.truncate(r))
}

/// Relative error bound on the nuclear norm (the sum of the singular values) that STAR accepts
/// from [`GramEvd`]. STAR's output scales with the nuclear norm, so this bounds the relative
/// error it adds; the merges promise 1e-4, which leaves half for everything else. The bound is a
/// worst case: on a 3584 x 3584 task vector of the merge benchmark it is 1.5e-5 while the Gram
/// route's nuclear norm is 2.7e-11 from the SVD's.
const GRAM_NUCLEAR_TOL: f64 = 5e-5;

/// How many times the eigenvalue error bound a kept σ² must be for [`top_svd`] and [`polar`] to
/// use [`GramEvd`]: their results then carry a relative error of about 1e-5 at most (the bound
/// is for the worst case; rounding errors of random sign are far smaller).
const GRAM_RELATIVE_GAP: f64 = 1e5;

/// How many eigenvectors a caller of [`GramEvd`] will form, which decides the route:
/// - `Few` (STAR's tens): the [`TwoStage`] reduction, 1.4 s on a 3584 x 3584 Gram matrix
///   against 4.5-5.0 s for faer's, eigenvalues alone (0.3 s), and the wanted vectors of the
///   tridiagonal form by inverse iteration ([`selected_eigenvectors`]) instead of all of them
///   by divide and conquer (1.05 s). Each vector's back-transformation costs more (0.17 s for
///   96 against 0.03 s).
/// - `Most` (TSV's top half, the polar factor's all): faer's one-stage reduction and divide and
///   conquer, whose blocked back-transformation is the cheaper one per vector.
#[derive(Clone, Copy)]
enum Wanted {
    Few,
    Most,
}

/// Why [`GramEvd::vectors`] cannot fail on the `Most` route: every eigenvector of the tridiagonal
/// form is computed with the eigenvalues.
const KEPT_VECTORS: &str = "Wanted::Most keeps every tridiagonal eigenvector";

/// How `G = Q T Qᵀ` was reduced to tridiagonal form.
enum Reduction {
    /// faer's one-stage reduction: the reflectors below the subdiagonal and their block factors.
    OneStage {
        reflectors: Mat<f64>,
        block_factors: Mat<f64>,
    },
    TwoStage(TwoStage),
}

/// The eigendecomposition of the Gram matrix of `a`'s smaller side, `G = AᵀA` (or `AAᵀ` for a
/// wide matrix), in f64: σ² and the small-side singular vectors, with a bound on the error.
///
/// The f32 entries' products are exact in f64, so `G` is off by at most `l·eps·||A||_F²` (sums
/// of length `l`, the larger side) and its symmetric eigendecomposition adds a backward error
/// of about `k·eps·||G||` (k the smaller side): every computed eigenvalue λ is within `delta` of
/// a true σ². Small singular values are the weak point: σ = √λ is only known to about √delta.
///
/// The eigenvectors are formed on demand ([`GramEvd::vectors`]): STAR needs only the leading
/// few and TSV the top half, and forming all of them (the back-transformation through the
/// tridiagonal reduction's reflectors) is 1.4 of the 6.3 s of a 3584 x 3584 eigendecomposition.
/// Both reductions are orthogonal similarities with the same kind of backward error, so
/// `delta` holds for either (the tests measure their difference at 0.6-2.4 of `k·eps·λ_max`,
/// against the 8 `delta` allows).
struct GramEvd {
    /// Eigenvalues, non-increasing (σ² up to `delta`).
    lambda: Vec<f64>,
    delta: f64,
    /// `G = Q T Qᵀ`, with `Q` kept as reflectors.
    reduction: Reduction,
    /// T's diagonal and subdiagonal.
    diag: Vec<f64>,
    subdiag: Vec<f64>,
    /// Every eigenvector of T, ascending like faer's eigenvalues (column k-1-j for `lambda[j]`),
    /// when most are wanted ([`Wanted::Most`]); otherwise they come one by one from inverse
    /// iteration ([`GramEvd::tridiagonal_vectors`]).
    all_tridiagonal_vectors: Option<Mat<f64>>,
    /// Tighter upper bounds on the smallest singular values, smallest first, from
    /// [`GramEvd::refine_tail`]; empty until then.
    tail_upper: Vec<f64>,
}

impl GramEvd {
    fn of(a: MatRef<'_, f32>, wanted: Wanted) -> Option<GramEvd> {
        Gram::of(a)?.evd(wanted)
    }

    /// The eigenvectors of the leading `r` eigenvalues, column j for `lambda[j]` (None when
    /// [`GramEvd::tridiagonal_vectors`] fails).
    fn vectors(&self, r: usize) -> Option<Mat<f64>> {
        let k = self.lambda.len();
        let ascending = self.tridiagonal_vectors(k - r..k)?;
        Some(self.back_transform(Mat::<f64>::from_fn(k, r, |i, j| ascending[(i, r - 1 - j)])))
    }

    /// The eigenvectors of T for the eigenvalues `ascending` counts in ascending order (index i
    /// is `lambda[k - 1 - i]`), one per column: from [`selected_eigenvectors`] when they were not
    /// all computed, or from a full divide and conquer if inverse iteration does not converge
    /// (None if that fails too).
    fn tridiagonal_vectors(&self, ascending: Range<usize>) -> Option<Mat<f64>> {
        let k = self.lambda.len();
        let select = |all: &Mat<f64>| all.subcols(ascending.start, ascending.len()).to_owned();
        if let Some(all) = &self.all_tridiagonal_vectors {
            return Some(select(all));
        }
        let all = || {
            let (_, all) = tridiagonal::evd(&self.diag, &self.subdiag, ComputeEigenvectors::Yes)?;
            all.as_ref().map(select)
        };
        // Inverse iteration orthogonalizes each vector against the rest of its cluster, and most
        // of a decaying spectrum is one cluster: for many vectors divide and conquer is cheaper
        // (k = 2000: 96 vectors 9 ms against 161 ms, half of them 0.8 s, all 5.6 s).
        if ascending.len() > k / 8 {
            return all();
        }
        let values: Vec<f64> = ascending.clone().map(|i| self.lambda[k - 1 - i]).collect();
        selected_eigenvectors(&self.diag, &self.subdiag, &values).or_else(all)
    }

    /// `Q z` for eigenvectors `z` of the tridiagonal form.
    fn back_transform(&self, mut out: Mat<f64>) -> Mat<f64> {
        let (k, r) = out.shape();
        match &self.reduction {
            Reduction::OneStage {
                reflectors,
                block_factors,
            } if k > 1 && r > 0 => {
                let scratch = apply_block_householder_sequence_on_the_left_in_place_scratch::<f64>(
                    k - 1,
                    block_factors.nrows(),
                    r,
                );
                apply_block_householder_sequence_on_the_left_in_place_with_conj(
                    reflectors.as_ref().submatrix(1, 0, k - 1, k - 1),
                    block_factors.as_ref(),
                    Conj::No,
                    out.as_mut().subrows_mut(1, k - 1),
                    Par::Seq,
                    MemStack::new(&mut MemBuffer::new(scratch)),
                );
                out
            }
            Reduction::OneStage { .. } => out,
            Reduction::TwoStage(reduced) => reduced.back_transform(out),
        }
    }

    /// The interval holding the true σ of `lambda[j]`: `[√max(λ - delta, 0), √(λ + delta)]`
    /// (Weyl), its top lowered by [`GramEvd::refine_tail`] where that is tighter.
    fn bounds(&self, j: usize) -> (f64, f64) {
        let l = self.lambda[j];
        let mut upper = (l + self.delta).sqrt();
        if let Some(&u) = self.tail_upper.get(self.lambda.len() - 1 - j) {
            upper = upper.min(u);
        }
        ((l - self.delta).max(0.0).sqrt(), upper)
    }

    /// σ_j: `√λ_j`, kept inside [`GramEvd::bounds`].
    fn singular_value(&self, j: usize) -> f64 {
        let (lower, upper) = self.bounds(j);
        self.lambda[j].max(0.0).sqrt().min(upper).max(lower)
    }

    fn singular_values(&self) -> Vec<f32> {
        (0..self.lambda.len())
            .map(|j| self.singular_value(j) as f32)
            .collect()
    }

    fn nuclear(&self) -> f64 {
        (0..self.lambda.len()).map(|j| self.singular_value(j)).sum()
    }

    /// The width of every [`GramEvd::bounds`] interval: a bound on each singular value's error.
    fn widths(&self) -> Vec<f64> {
        (0..self.lambda.len())
            .map(|j| {
                let (lower, upper) = self.bounds(j);
                upper - lower
            })
            .collect()
    }

    /// The sum of the [`GramEvd::widths`], which bounds the error of the nuclear norm and of
    /// every partial sum of the singular values.
    fn nuclear_error(&self) -> f64 {
        self.widths().iter().sum()
    }

    /// Tighten the upper bounds of the singular values the Gram matrix cannot resolve (`λ` below
    /// [`TAIL_DELTAS`] times `delta`, where the interval is about `√delta` wide whatever the true
    /// σ), from the matrix itself: with `W` their t eigenvectors, the singular values of `A W` (or
    /// `Aᵀ W`), computed in f64 without squaring, bound the t smallest of `A` from above one by
    /// one (interlacing: `σ_i(A W) >= σ_{i+k-t}(A)` for orthonormal `W`). The slack
    /// `k·eps·||A||` covers `W`'s rounding. Tiny singular values of a square task vector are
    /// what this is for: the 3584 x 3584 ones of the merge benchmark have about 50 below
    /// `√delta`, and refining them takes a nuclear-norm bound from 1.5e-5 to 1.0e-5.
    ///
    /// Returns whether it tightened anything; skipped (false) when more than k/8 values are
    /// unresolved (exactly low-rank matrices: the product and its SVD would cost about as much
    /// as the SVD of `A`).
    fn refine_tail(&mut self, a: MatRef<'_, f32>) -> bool {
        let k = self.lambda.len();
        let t = self
            .lambda
            .iter()
            .filter(|&&l| l < TAIL_DELTAS * self.delta)
            .count();
        if t == 0 || t > k / 8 {
            return false;
        }
        let Some(tail) = self.tridiagonal_vectors(0..t) else {
            return false;
        };
        let w = self.back_transform(tail);
        let b = long_side_product(a, w.as_ref());
        let mut ritz = Diag::<f64>::zeros(t);
        let scratch = svd_scratch::<f64>(
            b.nrows(),
            t,
            ComputeSvdVectors::No,
            ComputeSvdVectors::No,
            Par::Seq,
            Default::default(),
        );
        let solved = svd(
            b.as_ref(),
            ritz.as_mut(),
            None,
            None,
            Par::Seq,
            MemStack::new(&mut MemBuffer::new(scratch)),
            Default::default(),
        );
        if solved.is_err() {
            return false;
        }
        let slack = f64::EPSILON * k as f64 * (self.lambda[0] + self.delta).sqrt();
        // Descending from faer; the bounds go smallest first.
        self.tail_upper = ritz
            .column_vector()
            .iter()
            .rev()
            .map(|&r| r + slack)
            .collect();
        let consistent = (k - t..k).all(|j| {
            let (lower, upper) = self.bounds(j);
            lower <= upper
        });
        if !consistent {
            self.tail_upper.clear();
        }
        consistent
    }
}

/// Rows of the f64 block [`for_each_f64_block`] converts at a time (59 MB at 3584 columns).
const F64_BLOCK_ROWS: usize = 2048;

/// Call `f(start, block)` on consecutive blocks of [`F64_BLOCK_ROWS`] rows of X, the long side
/// of `a` as rows (`a`, or `aᵀ` if wide), each converted to f64. The products the decompositions
/// take of `a` are exact in f64 either way, and a converted copy of the whole of `a` would cost
/// its size in f64 (543 MB for 18944 x 3584) for every task decomposed at once.
fn for_each_f64_block(a: MatRef<'_, f32>, mut f: impl FnMut(usize, MatRef<'_, f64>)) {
    let x = if a.nrows() >= a.ncols() {
        a
    } else {
        a.transpose()
    };
    let (long, k) = x.shape();
    let mut block = Mat::<f64>::zeros(F64_BLOCK_ROWS.min(long), k);
    for start in (0..long).step_by(F64_BLOCK_ROWS) {
        let rows = F64_BLOCK_ROWS.min(long - start);
        let src = x.subrows(start, rows);
        let mut dst = block.as_mut().subrows_mut(0, rows);
        // Walk the source in its storage order.
        if src.col_stride().unsigned_abs() == 1 {
            for i in 0..rows {
                for j in 0..k {
                    dst[(i, j)] = src[(i, j)] as f64;
                }
            }
        } else {
            for j in 0..k {
                for i in 0..rows {
                    dst[(i, j)] = src[(i, j)] as f64;
                }
            }
        }
        f(start, block.as_ref().subrows(0, rows));
    }
}

/// `X w` in f64, X the long side of `a` as rows ([`for_each_f64_block`]).
fn long_side_product(a: MatRef<'_, f32>, w: MatRef<'_, f64>) -> Mat<f64> {
    let mut out = Mat::<f64>::zeros(a.nrows().max(a.ncols()), w.ncols());
    for_each_f64_block(a, |start, block| {
        faer_matmul(
            out.as_mut().subrows_mut(start, block.nrows()),
            Accum::Replace,
            block,
            w,
            1.0,
            Par::Seq,
        )
    });
    out
}

/// Eigenvalues below this many times [`GramEvd`]'s `delta` count as unresolved for
/// [`GramEvd::refine_tail`].
const TAIL_DELTAS: f64 = 4.0;

/// The lower triangle of the Gram matrix of `a`'s smaller side (`AᵀA` or `AAᵀ`) in f64: the
/// first step of [`GramEvd`], kept apart so that [`polar`] can test its conditioning cheaply.
struct Gram {
    lower: Mat<f64>,
    /// `||A||_F²`, the trace.
    fro2: f64,
    /// The larger side: the length of each product's sum.
    long: usize,
}

impl Gram {
    /// `XᵀX`, X the long side of `a` as rows ([`for_each_f64_block`]).
    fn of(a: MatRef<'_, f32>) -> Option<Gram> {
        let (m, n) = a.shape();
        let (k, long) = (m.min(n), m.max(n));
        if k == 0 {
            return None;
        }
        let mut lower = Mat::<f64>::zeros(k, k);
        for_each_f64_block(a, |start, block| {
            triangular::matmul(
                lower.as_mut(),
                BlockStructure::TriangularLower,
                if start == 0 {
                    Accum::Replace
                } else {
                    Accum::Add
                },
                block.transpose(),
                BlockStructure::Rectangular,
                block,
                BlockStructure::Rectangular,
                1.0,
                Par::Seq,
            )
        });
        let fro2 = (0..k).map(|i| lower[(i, i)]).sum();
        Some(Gram { lower, fro2, long })
    }

    /// The rounding error of the products, the part of [`GramEvd`]'s `delta` known before the
    /// eigendecomposition.
    fn product_error(&self) -> f64 {
        f64::EPSILON * self.long as f64 * self.fro2
    }

    /// Whether the smallest eigenvalue is below `t`: the Cholesky factorization of `G - t·I`
    /// fails. A tenth of the eigendecomposition's cost, so [`polar`] can refuse an ill-conditioned
    /// matrix (TSV's square concatenations) before paying for it. Cholesky's own rounding,
    /// about `k·eps·||G||`, is far below the thresholds it is used with.
    fn smallest_eigenvalue_below(&self, t: f64) -> bool {
        let k = self.lower.nrows();
        let mut shifted = self.lower.clone();
        for i in 0..k {
            shifted[(i, i)] -= t;
        }
        let scratch = cholesky_in_place_scratch::<f64>(k, Par::Seq, Default::default());
        cholesky_in_place(
            shifted.as_mut(),
            Default::default(),
            Par::Seq,
            MemStack::new(&mut MemBuffer::new(scratch)),
            Default::default(),
        )
        .is_err()
    }

    /// The eigendecomposition without the eigenvectors, by the route `wanted` picks: a
    /// tridiagonal reduction (faer's or [`TwoStage`]), then faer's divide and conquer.
    fn evd(self, wanted: Wanted) -> Option<GramEvd> {
        let k = self.lower.nrows();
        let product_error = self.product_error();
        // Few: two stages and eigenvalues alone; Most: faer's reduction and every vector.
        let (diag, subdiag, reduction, compute) = match wanted {
            Wanted::Few => {
                let mut reduced = TwoStage::reduce(self.lower, two_stage::BAND);
                let (diag, subdiag) = (take(&mut reduced.diag), take(&mut reduced.subdiag));
                let reduction = Reduction::TwoStage(reduced);
                (diag, subdiag, reduction, ComputeEigenvectors::No)
            }
            Wanted::Most => {
                let mut reflectors = self.lower;
                let block = recommended_block_size::<f64>(k, k);
                let mut block_factors = Mat::<f64>::zeros(block, k - 1);
                let scratch = tridiag_in_place_scratch::<f64>(k, Par::Seq, Default::default());
                tridiag_in_place(
                    reflectors.as_mut(),
                    block_factors.as_mut(),
                    Par::Seq,
                    MemStack::new(&mut MemBuffer::new(scratch)),
                    Default::default(),
                );
                let diag = (0..k).map(|i| reflectors[(i, i)]).collect();
                let subdiag = (1..k).map(|i| reflectors[(i, i - 1)]).collect();
                let reduction = Reduction::OneStage {
                    reflectors,
                    block_factors,
                };
                (diag, subdiag, reduction, ComputeEigenvectors::Yes)
            }
        };
        let (eigenvalues, all_tridiagonal_vectors) = tridiagonal::evd(&diag, &subdiag, compute)?;
        // Ascending from faer; singular values go the other way.
        let lambda: Vec<f64> = eigenvalues.iter().rev().copied().collect();
        let top = lambda[0].max(0.0);
        Some(GramEvd {
            delta: product_error + f64::EPSILON * 8.0 * k as f64 * top,
            lambda,
            reduction,
            diag,
            subdiag,
            all_tridiagonal_vectors,
            tail_upper: Vec::new(),
        })
    }
}

/// The orthogonal polar factor `U V^T` of `a` (m x p, m >= p): the matrix with orthonormal
/// columns nearest to `a` (orthogonal Procrustes).
///
/// As `a (aᵀa)^(-1/2)` from [`GramEvd`] when `aᵀa` is well conditioned (its smallest eigenvalue
/// at least [`GRAM_RELATIVE_GAP`] times the error bound), else from the thin SVD: TSV's
/// concatenated singular vectors are badly conditioned when the tasks share directions, and
/// the inverse square root would then amplify rounding (merging.md, numerical notes). So are the
/// square concatenations TSV builds for a matrix's smaller side; a Cholesky test
/// ([`Gram::smallest_eigenvalue_below`]) refuses those before the eigendecomposition.
pub fn polar(a: MatRef<'_, f32>) -> Result<Mat<f32>, SvdFailed> {
    let (m, p) = a.shape();
    let evd = (m >= p)
        .then(|| Gram::of(a))
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
        return Ok(matmul(a, to_f32(&inv_sqrt).as_ref()));
    }
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
            let top = top_svd(a.as_ref(), 10).unwrap();
            let want = svd.clone().truncate(10);
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
        let top = top_svd(low.as_ref(), 3).unwrap();
        let gram = matmul(top.u.transpose(), top.u.as_ref());
        assert!(max_abs_diff(&gram, &Mat::identity(3, 3)) < 1e-5);
    }

    #[test]
    fn refining_the_tail_tightens_the_bounds_and_keeps_the_true_values_inside() {
        // 120 singular values: j^-0.8, then 10 at 1e-9 (f32 rounding leaves them near 1e-7).
        let (m, n) = (200, 120);
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let g1 = Mat::<f32>::from_fn(m, n, |_, _| StandardNormal.sample(&mut rng));
        let g2 = Mat::<f32>::from_fn(n, n, |_, _| StandardNormal.sample(&mut rng));
        let (u, v) = (orthonormal(&g1), orthonormal(&g2));
        let s = |j: usize| {
            if j < n - 10 {
                ((j + 1) as f32).powf(-0.8)
            } else {
                1e-9
            }
        };
        let scaled = Mat::<f32>::from_fn(m, n, |i, j| u[(i, j)] * s(j));
        let a = &scaled * v.transpose();
        let exact = thin_svd(a.as_ref()).unwrap().s;
        let mut evd = GramEvd::of(a.as_ref(), Wanted::Few).unwrap();
        let before = evd.nuclear_error();
        assert!(evd.refine_tail(a.as_ref()));
        let after = evd.nuclear_error();
        assert!(after < before / 3.0, "{before:e} -> {after:e}");
        for (j, &x) in exact.iter().enumerate() {
            let (lower, upper) = evd.bounds(j);
            // The SVD's values were rounded to f32: allow that rounding.
            let (x, rounding) = (x as f64, 1e-7 * x as f64);
            assert!(
                lower - rounding <= x && x <= upper + rounding,
                "{j}: {x:e} not in [{lower:e}, {upper:e}]"
            );
        }
        let exact_nuclear: f64 = exact.iter().map(|&x| x as f64).sum();
        assert!((evd.nuclear() - exact_nuclear).abs() <= after + 1e-7 * exact_nuclear);
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
        let p = polar(a.as_ref()).unwrap();
        let gram = matmul(p.transpose(), p.as_ref());
        assert!(max_abs_diff(&gram, &Mat::identity(4, 4)) < 1e-5);
    }

    #[test]
    fn the_gram_matrix_is_summed_over_blocks_of_rows() {
        // Three blocks of rows (two full, one partial), tall and wide, row- and column-major.
        let tall = matrix(2 * F64_BLOCK_ROWS + 100, 12, 0.5, 9);
        let data: Vec<f32> = (0..tall.nrows())
            .flat_map(|i| (0..12).map(move |j| (i, j)))
            .map(|(i, j)| tall[(i, j)])
            .collect();
        let row_major = MatRef::from_row_major_slice(&data, tall.nrows(), 12);
        for a in [
            tall.as_ref(),
            tall.transpose(),
            row_major,
            row_major.transpose(),
        ] {
            let x = to_f64(if a.nrows() >= a.ncols() {
                a
            } else {
                a.transpose()
            });
            let want = x.transpose() * &x;
            let gram = Gram::of(a).unwrap();
            assert_eq!(gram.long, 2 * F64_BLOCK_ROWS + 100);
            for j in 0..12 {
                for i in j..12 {
                    let d = (gram.lower[(i, j)] - want[(i, j)]).abs();
                    assert!(
                        d <= 1e-12 * want[(j, j)].abs().max(1.0),
                        "({i}, {j}): {d:e}"
                    );
                }
            }
            // The long-side product goes through the same blocks.
            let w = Mat::<f64>::from_fn(12, 3, |i, j| (i * 3 + j) as f64 - 17.0);
            let (got, want) = (long_side_product(a, w.as_ref()), &x * &w);
            for j in 0..3 {
                for i in 0..x.nrows() {
                    assert!(
                        (got[(i, j)] - want[(i, j)]).abs() <= 1e-12 * want[(i, j)].abs().max(1.0)
                    );
                }
            }
        }
    }

    #[test]
    fn the_cholesky_test_brackets_the_smallest_eigenvalue() {
        let a = matrix(50, 8, 1.0, 7);
        let smallest = GramEvd::of(a.as_ref(), Wanted::Few).unwrap().lambda[7];
        let gram = Gram::of(a.as_ref()).unwrap();
        assert!(gram.smallest_eigenvalue_below(smallest * 1.001));
        assert!(!gram.smallest_eigenvalue_below(smallest * 0.999));
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
