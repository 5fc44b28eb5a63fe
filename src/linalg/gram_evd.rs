//! The Gram route of the decompositions ([`super::svd`] chooses it): the symmetric
//! eigendecomposition of the Gram matrix of a matrix's smaller side, in f64, with the error
//! bound on every singular value that decides whether a caller may use it.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::cholesky::llt::factor::{cholesky_in_place, cholesky_in_place_scratch};
use faer::linalg::evd::tridiag::{tridiag_in_place, tridiag_in_place_scratch};
use faer::linalg::householder::{
    apply_block_householder_sequence_on_the_left_in_place_scratch,
    apply_block_householder_sequence_on_the_left_in_place_with_conj,
};
use faer::linalg::matmul::triangular::{self, BlockStructure};
use faer::linalg::qr::no_pivoting::factor::recommended_block_size;
use faer::linalg::svd::{svd, svd_scratch, ComputeSvdVectors};
use faer::{Accum, Conj, Mat, MatRef, Par};
use std::mem::take;
use std::ops::Range;

use super::f64_blocks::{for_each_f64_block, long_side_product};
use super::tridiagonal::{self, selected_eigenvectors};
use super::two_stage::{self, TwoStage};

/// How many eigenvectors a caller of [`GramEvd`] will form, which decides the route:
/// - `Few` (STAR's tens): the [`TwoStage`] reduction, about three times faster than faer's on a
///   3584 x 3584 Gram matrix (`cargo bench --bench merge_kernels`), eigenvalues alone, and the
///   wanted vectors of the tridiagonal form by inverse iteration ([`selected_eigenvectors`])
///   instead of all of them by divide and conquer. Each vector's back-transformation costs more
///   than with faer's reduction.
/// - `Most` (TSV's top half, the polar factor's all): faer's one-stage reduction and divide and
///   conquer, whose blocked back-transformation is the cheaper one per vector.
#[derive(Clone, Copy)]
pub(super) enum Wanted {
    Few,
    Most,
}

/// Why [`GramEvd::vectors`] cannot fail on the `Most` route: every eigenvector of the tridiagonal
/// form is computed with the eigenvalues.
pub(super) const KEPT_VECTORS: &str = "Wanted::Most keeps every tridiagonal eigenvector";

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
/// tridiagonal reduction's reflectors) is a fifth of a full eigendecomposition's cost.
/// Both reductions are orthogonal similarities with the same kind of backward error, so
/// `delta` holds for either (their difference stays within a few `k·eps·λ_max`, against the 8
/// `delta` allows: the two-stage reduction's tests check it).
pub(super) struct GramEvd {
    /// Eigenvalues, non-increasing (σ² up to `delta`).
    pub(super) lambda: Vec<f64>,
    pub(super) delta: f64,
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
    pub(super) fn of(a: MatRef<'_, f32>, wanted: Wanted) -> Option<GramEvd> {
        Gram::of(a)?.evd(wanted)
    }

    /// The eigenvectors of the leading `r` eigenvalues, column j for `lambda[j]` (None when
    /// [`GramEvd::tridiagonal_vectors`] fails).
    pub(super) fn vectors(&self, r: usize) -> Option<Mat<f64>> {
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
            let (_, all) = tridiagonal::evd(&self.diag, &self.subdiag)?;
            Some(select(&all))
        };
        // Inverse iteration orthogonalizes each vector against the rest of its cluster, and most
        // of a decaying spectrum is one cluster: beyond about k/8 vectors, divide and conquer for
        // all of them is the cheaper.
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

    pub(super) fn singular_values(&self) -> Vec<f32> {
        (0..self.lambda.len())
            .map(|j| self.singular_value(j) as f32)
            .collect()
    }

    pub(super) fn nuclear(&self) -> f64 {
        (0..self.lambda.len()).map(|j| self.singular_value(j)).sum()
    }

    /// The width of every [`GramEvd::bounds`] interval: a bound on each singular value's error.
    pub(super) fn widths(&self) -> Vec<f64> {
        (0..self.lambda.len())
            .map(|j| {
                let (lower, upper) = self.bounds(j);
                upper - lower
            })
            .collect()
    }

    /// The sum of the [`GramEvd::widths`], which bounds the error of the nuclear norm and of
    /// every partial sum of the singular values.
    pub(super) fn nuclear_error(&self) -> f64 {
        self.widths().iter().sum()
    }

    /// Tighten the upper bounds of the singular values the Gram matrix cannot resolve (`λ` below
    /// [`TAIL_DELTAS`] times `delta`, where the interval is about `√delta` wide whatever the true
    /// σ), from the matrix itself: with `W` their t eigenvectors, the singular values of `A W` (or
    /// `Aᵀ W`), computed in f64 without squaring, bound the t smallest of `A` from above one by
    /// one (interlacing: `σ_i(A W) >= σ_{i+k-t}(A)` for orthonormal `W`). The slack
    /// `k·eps·||A||` covers `W`'s rounding. Tiny singular values of a square task vector are
    /// what this is for: a 3584 x 3584 one has tens below `√delta`, and refining them tightens
    /// the nuclear-norm bound by about a third.
    ///
    /// Returns whether it tightened anything; skipped (false) when more than k/8 values are
    /// unresolved (exactly low-rank matrices: the product and its SVD would cost about as much
    /// as the SVD of `A`).
    pub(super) fn refine_tail(&mut self, a: MatRef<'_, f32>) -> bool {
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

/// Eigenvalues below this many times [`GramEvd`]'s `delta` count as unresolved for
/// [`GramEvd::refine_tail`].
const TAIL_DELTAS: f64 = 4.0;

/// The lower triangle of the Gram matrix of `a`'s smaller side (`AᵀA` or `AAᵀ`) in f64: the
/// first step of [`GramEvd`], kept apart so that [`polar`](super::svd::polar) can test its
/// conditioning cheaply.
pub(super) struct Gram {
    lower: Mat<f64>,
    /// `||A||_F²`, the trace.
    fro2: f64,
    /// The larger side: the length of each product's sum.
    long: usize,
}

impl Gram {
    /// `XᵀX`, X the long side of `a` as rows ([`for_each_f64_block`]).
    pub(super) fn of(a: MatRef<'_, f32>) -> Option<Gram> {
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
    pub(super) fn product_error(&self) -> f64 {
        f64::EPSILON * self.long as f64 * self.fro2
    }

    /// Whether the smallest eigenvalue is below `t`: the Cholesky factorization of `G - t·I`
    /// fails. A tenth of the eigendecomposition's cost, so [`polar`](super::svd::polar) can refuse an ill-conditioned
    /// matrix (TSV's square concatenations) before paying for it. Cholesky's own rounding,
    /// about `k·eps·||G||`, is far below the thresholds it is used with.
    pub(super) fn smallest_eigenvalue_below(&self, t: f64) -> bool {
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

    /// The eigendecomposition without the eigenvectors of `G`, by the route `wanted` picks:
    /// [`TwoStage`] and the eigenvalues alone by root-free QL/QR ([`tridiagonal::eigenvalues`]),
    /// or faer's one-stage reduction and every eigenvector of the tridiagonal form by divide
    /// and conquer.
    pub(super) fn evd(self, wanted: Wanted) -> Option<GramEvd> {
        let k = self.lower.nrows();
        let product_error = self.product_error();
        let (diag, subdiag, reduction, eigenvalues, all_tridiagonal_vectors) = match wanted {
            Wanted::Few => {
                let mut reduced = TwoStage::reduce(self.lower, two_stage::BAND);
                let (diag, subdiag) = (take(&mut reduced.diag), take(&mut reduced.subdiag));
                let eigenvalues = tridiagonal::eigenvalues(&diag, &subdiag)?;
                let reduction = Reduction::TwoStage(reduced);
                (diag, subdiag, reduction, eigenvalues, None)
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
                let diag: Vec<f64> = (0..k).map(|i| reflectors[(i, i)]).collect();
                let subdiag: Vec<f64> = (1..k).map(|i| reflectors[(i, i - 1)]).collect();
                let (eigenvalues, vectors) = tridiagonal::evd(&diag, &subdiag)?;
                let reduction = Reduction::OneStage {
                    reflectors,
                    block_factors,
                };
                (diag, subdiag, reduction, eigenvalues, Some(vectors))
            }
        };
        // Ascending; singular values go the other way.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linalg::f64_blocks::F64_BLOCK_ROWS;
    use crate::linalg::svd::{thin_svd, to_f64};
    use crate::linalg::test_matrices::{matrix, orthonormal};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use rand_distr::{Distribution, StandardNormal};

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
}
