//! The top eigenpair of a small symmetric tridiagonal matrix (the Lanczos matrix T_k).
//!
//! Bisection on Sturm counts gives the largest eigenvalue to full f64 accuracy in O(k) per
//! probe; two steps of inverse iteration give its eigenvector, whose last component is what the
//! Lanczos residual bound needs. Both are O(k), so the bound can be checked after every step.
//!
//! [`selected_eigenvectors`] gives the eigenvectors of chosen eigenvalues of a large tridiagonal
//! matrix the same way, for STAR's Gram matrices, whose eigenvalues come from the root-free
//! QL/QR iteration ([`eigenvalues`]); [`evd`] is faer's divide and conquer on a whole one.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::evd::{
    self_adjoint_evd_scratch, tridiagonal_self_adjoint_evd, ComputeEigenvectors,
};
use faer::{Mat, Par};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Largest eigenvalue of the symmetric tridiagonal matrix with diagonal `diag` and off-diagonal
/// `off` (`off.len() == diag.len() - 1`), and the last component of its unit eigenvector.
pub fn top_eigenpair(diag: &[f64], off: &[f64]) -> (f64, f64) {
    let k = diag.len();
    assert!(
        k >= 1 && off.len() + 1 == k,
        "tridiagonal of {k} with {} off",
        off.len()
    );
    if k == 1 {
        return (diag[0], 1.0);
    }
    let lambda = largest_eigenvalue(diag, off);
    let vector = inverse_iteration(diag, off, lambda);
    (lambda, vector[k - 1])
}

/// The smallest pivot magnitude allowed in Sturm sequences and factorizations.
fn pivot_floor(diag: &[f64], off: &[f64]) -> f64 {
    let scale = diag
        .iter()
        .chain(off)
        .fold(0f64, |m, &x| m.max(x.abs()))
        .max(f64::MIN_POSITIVE);
    scale * f64::EPSILON * 1e-3
}

/// Number of eigenvalues strictly below `x` (Sturm count of the LDLᵀ pivots of T - xI).
fn count_below(diag: &[f64], off: &[f64], x: f64, floor: f64) -> usize {
    let mut count = 0;
    let mut q = diag[0] - x;
    for i in 0..diag.len() {
        if i > 0 {
            q = diag[i] - x - off[i - 1] * off[i - 1] / q;
        }
        if q.abs() < floor {
            q = -floor;
        }
        if q < 0.0 {
            count += 1;
        }
    }
    count
}

fn largest_eigenvalue(diag: &[f64], off: &[f64]) -> f64 {
    let k = diag.len();
    let floor = pivot_floor(diag, off);
    // Gershgorin interval.
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for i in 0..k {
        let radius =
            if i > 0 { off[i - 1].abs() } else { 0.0 } + if i + 1 < k { off[i].abs() } else { 0.0 };
        lo = lo.min(diag[i] - radius);
        hi = hi.max(diag[i] + radius);
    }
    let slack = (hi - lo).abs().max(hi.abs()).max(f64::MIN_POSITIVE) * f64::EPSILON * 4.0;
    lo -= slack;
    hi += slack;
    // Invariant: the largest eigenvalue lies in [lo, hi].
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if count_below(diag, off, mid, floor) == k {
            hi = mid;
        } else {
            lo = mid;
        }
        if hi - lo <= 2.0 * f64::EPSILON * lo.abs().max(hi.abs()) {
            break;
        }
    }
    0.5 * (lo + hi)
}

/// Unit eigenvector of the eigenvalue `lambda` by inverse iteration on T - λI, factored once
/// ([`ShiftedLu`]), from the all-ones vector.
fn inverse_iteration(diag: &[f64], off: &[f64], lambda: f64) -> Vec<f64> {
    let k = diag.len();
    let floor = pivot_floor(diag, off).max(f64::MIN_POSITIVE) * 1e3;
    let lu = ShiftedLu::factor(diag, off, lambda, floor);
    let mut x = vec![1.0; k];
    for _ in 0..3 {
        lu.solve(&mut x);
        let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
        if !(norm.is_finite() && norm > 0.0) {
            break;
        }
        x.iter_mut().for_each(|v| *v /= norm);
    }
    x
}

/// `T - λI = P L U` with partial pivoting (LAPACK `dgttrf`); pivots below `floor` are raised to
/// it, as inverse iteration intends (an exact eigenvalue makes the matrix singular).
struct ShiftedLu {
    /// U's diagonal and two superdiagonals.
    d: Vec<f64>,
    du: Vec<f64>,
    du2: Vec<f64>,
    /// L's multipliers and whether rows i and i + 1 were swapped.
    dl: Vec<f64>,
    swapped: Vec<bool>,
}

impl ShiftedLu {
    fn factor(diag: &[f64], off: &[f64], lambda: f64, floor: f64) -> ShiftedLu {
        let k = diag.len();
        let mut d: Vec<f64> = diag.iter().map(|a| a - lambda).collect();
        let mut dl = off.to_vec();
        let mut du = off.to_vec();
        let mut du2 = vec![0.0; k.saturating_sub(2)];
        let mut swapped = vec![false; k.saturating_sub(1)];
        for i in 0..k.saturating_sub(1) {
            if d[i].abs() >= dl[i].abs() {
                let pivot = if d[i].abs() < floor {
                    floor.copysign(d[i])
                } else {
                    d[i]
                };
                d[i] = pivot;
                let fact = dl[i] / pivot;
                dl[i] = fact;
                d[i + 1] -= fact * du[i];
            } else {
                // |dl[i]| > |d[i]|, but both may be below the floor.
                let pivot = if dl[i].abs() < floor {
                    floor.copysign(dl[i])
                } else {
                    dl[i]
                };
                let fact = d[i] / pivot;
                d[i] = pivot;
                dl[i] = fact;
                let upper = du[i];
                du[i] = d[i + 1];
                d[i + 1] = upper - fact * d[i + 1];
                if i + 2 < k {
                    du2[i] = du[i + 1];
                    du[i + 1] *= -fact;
                }
                swapped[i] = true;
            }
        }
        if d[k - 1].abs() < floor {
            d[k - 1] = floor.copysign(d[k - 1]);
        }
        ShiftedLu {
            d,
            du,
            du2,
            dl,
            swapped,
        }
    }

    /// x <- (T - λI)⁻¹ x.
    fn solve(&self, x: &mut [f64]) {
        let k = self.d.len();
        // Forward: L y = P b.
        for i in 0..k - 1 {
            if self.swapped[i] {
                x.swap(i, i + 1);
            }
            x[i + 1] -= self.dl[i] * x[i];
        }
        // Backward: U x = y.
        x[k - 1] /= self.d[k - 1];
        if k >= 2 {
            x[k - 2] = (x[k - 2] - self.du[k - 2] * x[k - 1]) / self.d[k - 2];
        }
        for i in (0..k.saturating_sub(2)).rev() {
            x[i] = (x[i] - self.du[i] * x[i + 1] - self.du2[i] * x[i + 2]) / self.d[i];
        }
    }
}

/// The eigenvalues (ascending) of the symmetric tridiagonal matrix (`diag`, `subdiag`) and all
/// its eigenvectors, by faer's divide and conquer; None if it fails or gives a non-finite value.
/// TSV's eigendecompositions, and STAR's fallback for eigenvectors.
pub fn evd(diag: &[f64], subdiag: &[f64]) -> Option<(Vec<f64>, Mat<f64>)> {
    let k = diag.len();
    let mut d = Diag::<f64>::zeros(k);
    let mut s = Diag::<f64>::zeros(k);
    for i in 0..k {
        d[i] = diag[i];
        if i + 1 < k {
            s[i] = subdiag[i];
        }
    }
    let mut eigenvalues = Diag::<f64>::zeros(k);
    let mut vectors = Mat::<f64>::zeros(k, k);
    let compute = ComputeEigenvectors::Yes;
    let scratch = self_adjoint_evd_scratch::<f64>(k, compute, Par::Seq, Default::default());
    tridiagonal_self_adjoint_evd(
        d.as_ref(),
        s.as_ref(),
        eigenvalues.as_mut(),
        Some(vectors.as_mut()),
        Par::Seq,
        MemStack::new(&mut MemBuffer::new(scratch)),
        Default::default(),
    )
    .ok()?;
    let values: Vec<f64> = eigenvalues.column_vector().iter().copied().collect();
    values
        .iter()
        .all(|l| l.is_finite())
        .then_some((values, vectors))
}

/// Every eigenvalue (ascending) of the symmetric tridiagonal matrix (`diag`, `off`), without
/// eigenvectors, by the root-free QL/QR iteration of Pal, Walker and Kahan (B. N. Parlett, *The
/// Symmetric Eigenvalue Problem*, SIAM 1998, chapter 8; LAPACK's `dsterf`). It works on the
/// squared off-diagonal and takes no square root or Givens rotation per step, which makes it
/// several times faster than the implicit QR iteration with rotations (faer's eigenvalue-only
/// route) at the same backward error, a small multiple of `eps·||T||`. None if an iteration
/// does not converge within 30 steps per eigenvalue or a value is not finite.
pub fn eigenvalues(diag: &[f64], off: &[f64]) -> Option<Vec<f64>> {
    let n = diag.len();
    let mut d = diag.to_vec();
    let mut e: Vec<f64> = off.to_vec();
    let eps = f64::EPSILON / 2.0;
    let mut budget = 30 * n;
    let mut start = 0;
    while start < n {
        // The next unreduced block [start, end]: off-diagonals negligible against their
        // neighbours' geometric mean split the matrix.
        let mut end = start;
        while end + 1 < n && e[end].abs() > (d[end].abs().sqrt() * d[end + 1].abs().sqrt()) * eps {
            end += 1;
        }
        if end + 1 < n {
            e[end] = 0.0;
        }
        if end > start {
            // A power of two brings the block near unit norm exactly, so squaring cannot
            // overflow or underflow whatever the input's scale.
            let norm = (start..=end)
                .map(|i| d[i].abs() + if i < end { e[i].abs() } else { 0.0 })
                .fold(0.0, f64::max);
            let scale = if norm > 0.0 && norm.is_finite() {
                2f64.powi(-norm.log2().round() as i32)
            } else {
                1.0
            };
            for x in &mut d[start..=end] {
                *x *= scale;
            }
            for x in &mut e[start..end] {
                *x = (*x * scale) * (*x * scale);
            }
            // QL converges fastest toward the smaller end, which it deflates first: a block
            // whose last diagonal entry is the smaller is reversed (the same eigenvalues), which
            // is LAPACK's QR sweep written as QL.
            if d[end].abs() < d[start].abs() {
                d[start..=end].reverse();
                e[start..end].reverse();
            }
            let converged = root_free_ql(&mut d, &mut e, start, end, &mut budget);
            for x in &mut d[start..=end] {
                *x /= scale;
            }
            if !converged {
                return None;
            }
        }
        start = end + 1;
    }
    d.sort_by(f64::total_cmp);
    d.iter().all(|x| x.is_finite()).then_some(d)
}

/// QL sweeps of [`eigenvalues`] on the block `l..=end` (e holds squared off-diagonals),
/// deflating from the top; false when `budget` runs out first.
fn root_free_ql(
    d: &mut [f64],
    e: &mut [f64],
    mut l: usize,
    end: usize,
    budget: &mut usize,
) -> bool {
    let eps2 = (f64::EPSILON / 2.0).powi(2);
    while l <= end {
        let m = (l..end)
            .find(|&m| e[m].abs() <= eps2 * (d[m] * d[m + 1]).abs())
            .unwrap_or(end);
        if m < end {
            e[m] = 0.0;
        }
        if m == l {
            l += 1;
            continue;
        }
        if m == l + 1 {
            (d[l], d[l + 1]) = pair_eigenvalues(d[l], e[l].sqrt(), d[l + 1]);
            e[l] = 0.0;
            l += 2;
            continue;
        }
        if *budget == 0 {
            return false;
        }
        *budget -= 1;
        let sigma = wilkinson_shift(d[l], e[l], d[l + 1]);
        let (mut c, mut s) = (1.0, 0.0);
        let mut gamma = d[m] - sigma;
        let mut p = gamma * gamma;
        for i in (l..m).rev() {
            let bb = e[i];
            let r = p + bb;
            if i + 1 != m {
                e[i + 1] = s * r;
            }
            let old_c = c;
            c = p / r;
            s = bb / r;
            let old_gamma = gamma;
            let alpha = d[i];
            gamma = c * (alpha - sigma) - s * old_gamma;
            d[i + 1] = old_gamma + (alpha - gamma);
            p = if c != 0.0 {
                gamma * gamma / c
            } else {
                old_c * bb
            };
        }
        e[l] = s * p;
        d[l] = sigma + gamma;
    }
    true
}

/// The eigenvalue of the 2 x 2 block `[[p, √e2], [√e2, q]]` nearer `p` (Wilkinson's shift),
/// from the squared off-diagonal `e2`.
fn wilkinson_shift(p: f64, e2: f64, q: f64) -> f64 {
    let off = e2.sqrt();
    let g = (q - p) / (2.0 * off);
    // √(g² + 1) without `hypot`'s cost where g² cannot overflow.
    let r = if g.abs() < 1e150 {
        (g * g + 1.0).sqrt()
    } else {
        g.abs()
    };
    p - off / (g + r.copysign(g))
}

/// Both eigenvalues of the symmetric 2 x 2 matrix `[[a, b], [b, c]]`: the larger in magnitude
/// from the mean and the half-gap, the other from the determinant, so neither cancels.
fn pair_eigenvalues(a: f64, b: f64, c: f64) -> (f64, f64) {
    let (sum, half_gap) = (a + c, ((a - c) / 2.0).hypot(b));
    if sum == 0.0 {
        return (half_gap, -half_gap);
    }
    let big = sum / 2.0 + half_gap.copysign(sum);
    let (large, small) = if a.abs() >= c.abs() { (a, c) } else { (c, a) };
    (big, (large / big) * small - (b / big) * b)
}

/// Unit eigenvectors of the symmetric tridiagonal matrix (`diag`, `off`) for `values`, a
/// selection of its eigenvalues in ascending order (as [`eigenvalues`] computes them, to a few
/// `eps·||T||`), one per column: inverse iteration as LAPACK's `dstein` does it. Each vector starts from a
/// fixed pseudo-random vector; values closer than `10·eps·|λ|` are pulled apart so their
/// factorizations differ, and each vector is orthogonalized against the previous ones of its
/// cluster (values within `1e-3·||T||_1` of their neighbour). It stops after two iterations past
/// the growth that marks convergence, `||(T - λI)⁻¹ b||_∞ >= sqrt(0.1/n)` for
/// `||b||_1 = n·||T||_1·max(eps, |u_nn|)`.
///
/// Returns None if a vector fails to converge in [`MAX_ITERATIONS`]; the caller then takes a
/// full decomposition. Cost O(n) per vector and iteration, plus O(n) per earlier member of its
/// cluster, against O(n²) per vector for divide and conquer.
pub fn selected_eigenvectors(diag: &[f64], off: &[f64], values: &[f64]) -> Option<Mat<f64>> {
    let n = diag.len();
    let mut z = Mat::<f64>::zeros(n, values.len());
    if n == 0 {
        return Some(z);
    }
    let norm = (0..n)
        .map(|i| {
            diag[i].abs()
                + if i > 0 { off[i - 1].abs() } else { 0.0 }
                + if i + 1 < n { off[i].abs() } else { 0.0 }
        })
        .fold(0f64, f64::max);
    if norm == 0.0 {
        // The zero matrix: every vector is an eigenvector.
        for j in 0..values.len().min(n) {
            z[(j, j)] = 1.0;
        }
        return Some(z);
    }
    let cluster_gap = 1e-3 * norm;
    let converged = (0.1 / n as f64).sqrt();
    let floor = pivot_floor(diag, off).max(f64::MIN_POSITIVE) * 1e3;
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let mut cluster_start = 0;
    let mut previous = f64::NEG_INFINITY;
    let mut x = vec![0f64; n];
    for (j, &value) in values.iter().enumerate() {
        let mut shift = value;
        if j > 0 {
            let separation = 10.0 * (f64::EPSILON * shift).abs();
            if shift - previous < separation {
                shift = previous + separation;
            }
            if (shift - previous).abs() > cluster_gap {
                cluster_start = j;
            }
        }
        previous = shift;
        let lu = ShiftedLu::factor(diag, off, shift, floor);
        let target = n as f64 * norm * f64::EPSILON.max(lu.d[n - 1].abs());
        x.iter_mut().for_each(|v| *v = rng.random_range(-1.0..1.0));
        let mut checks = 0;
        let mut iterations = 0;
        loop {
            iterations += 1;
            if iterations > MAX_ITERATIONS {
                return None;
            }
            let l1: f64 = x.iter().map(|v| v.abs()).sum();
            if !(l1.is_finite() && l1 > 0.0) {
                return None;
            }
            let scale = target / l1;
            x.iter_mut().for_each(|v| *v *= scale);
            lu.solve(&mut x);
            for i in cluster_start..j {
                let zi = z.col(i);
                let dot: f64 = x.iter().zip(zi.iter()).map(|(a, b)| a * b).sum();
                x.iter_mut().zip(zi.iter()).for_each(|(a, b)| *a -= dot * b);
            }
            let growth = x.iter().fold(0f64, |m, v| m.max(v.abs()));
            if growth >= converged {
                checks += 1;
                if checks > EXTRA_ITERATIONS {
                    break;
                }
            }
        }
        let norm2 = x.iter().map(|v| v * v).sum::<f64>().sqrt();
        if !(norm2.is_finite() && norm2 > 0.0) {
            return None;
        }
        // The sign LAPACK picks: the largest component positive.
        let largest = x
            .iter()
            .fold(0f64, |m, &v| if v.abs() > m.abs() { v } else { m });
        let scale = largest.signum() / norm2;
        for (i, v) in x.iter().enumerate() {
            z[(i, j)] = v * scale;
        }
    }
    Some(z)
}

/// Inverse iterations allowed per vector before [`selected_eigenvectors`] gives up (`dstein`'s
/// MAXITS), and the iterations it runs past convergence (EXTRA).
const MAX_ITERATIONS: usize = 5;
const EXTRA_ITERATIONS: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;

    use rand::{Rng, SeedableRng};

    fn dense_top(diag: &[f64], off: &[f64]) -> (f64, f64) {
        let k = diag.len();
        let t = Mat::<f64>::from_fn(k, k, |i, j| {
            if i == j {
                diag[i]
            } else if i + 1 == j {
                off[i]
            } else if j + 1 == i {
                off[j]
            } else {
                0.0
            }
        });
        let eig = t.self_adjoint_eigen(faer::Side::Lower).unwrap();
        let s = eig.S().column_vector();
        let top = (0..k).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap();
        (s[top], eig.U()[(k - 1, top)].abs())
    }

    #[test]
    fn matches_dense_eigen_on_random_and_clustered_tridiagonals() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for k in [1usize, 2, 3, 5, 17, 60] {
            for clustered in [false, true] {
                let diag: Vec<f64> = (0..k)
                    .map(|i| {
                        if clustered && i < 3 {
                            1.0 + 1e-9 * i as f64
                        } else {
                            rng.random_range(-1.0..1.0)
                        }
                    })
                    .collect();
                let off: Vec<f64> = (1..k)
                    .map(|_| {
                        if clustered {
                            1e-6 * rng.random::<f64>()
                        } else {
                            rng.random_range(-1.0..1.0)
                        }
                    })
                    .collect();
                let (lambda, last) = top_eigenpair(&diag, &off);
                let (want, want_last) = dense_top(&diag, &off);
                assert!((lambda - want).abs() <= 1e-13, "k={k}: {lambda} vs {want}");
                if !clustered {
                    assert!(
                        (last.abs() - want_last).abs() <= 1e-9,
                        "k={k}: {last} vs {want_last}"
                    );
                }
                // The residual of the computed pair bounds its accuracy in every case.
                assert!(last.abs() <= 1.0 + 1e-12);
            }
        }
    }

    #[test]
    fn handles_zero_off_diagonals() {
        let (lambda, last) = top_eigenpair(&[0.5, 2.0, 1.0], &[0.0, 0.0]);
        assert!((lambda - 2.0).abs() < 1e-15);
        assert!(last.abs() < 1e-12);
        let (lambda, last) = top_eigenpair(&[0.0, 0.0], &[0.0]);
        assert_eq!(lambda, 0.0);
        assert!(last.is_finite());
    }

    /// Residual and orthogonality of `selected_eigenvectors` for a selection of eigenvalues
    /// (ascending indices) against faer's dense eigendecomposition.
    fn check_selected(diag: &[f64], off: &[f64], indices: &[usize]) {
        let k = diag.len();
        let t = Mat::<f64>::from_fn(k, k, |i, j| match i.abs_diff(j) {
            0 => diag[i],
            1 => off[i.min(j)],
            _ => 0.0,
        });
        let all = t.self_adjoint_eigen(faer::Side::Lower).unwrap();
        let values: Vec<f64> = indices.iter().map(|&i| all.S()[i]).collect();
        let z = selected_eigenvectors(diag, off, &values)
            .unwrap_or_else(|| panic!("k {k}: no convergence"));
        let norm = values.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
        let scale = (0..k).map(|i| diag[i].abs()).fold(0f64, f64::max).max(norm);
        for (j, &l) in values.iter().enumerate() {
            let tz = &t * z.col(j);
            let residual = (0..k)
                .map(|i| (tz[i] - l * z[(i, j)]).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(
                residual <= 1e-13 * scale * k as f64,
                "k {k} value {l}: residual {residual}"
            );
            for i in 0..=j {
                let dot: f64 = (0..k).map(|r| z[(r, i)] * z[(r, j)]).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((dot - want).abs() <= 1e-10, "k {k}: z{i}·z{j} = {dot}");
            }
        }
    }

    #[test]
    fn selected_eigenvectors_by_inverse_iteration() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        // Random.
        let diag: Vec<f64> = (0..150).map(|_| rng.random_range(-1.0..1.0)).collect();
        let off: Vec<f64> = (1..150).map(|_| rng.random_range(-1.0..1.0)).collect();
        check_selected(&diag, &off, &[0, 1, 2, 70, 147, 148, 149]);
        check_selected(&diag, &off, &(0..150).collect::<Vec<_>>());
        // Wilkinson's W21+: pairs of eigenvalues agreeing to 1e-14 and more.
        let diag: Vec<f64> = (0..21).map(|i| (10.0 - i as f64).abs()).collect();
        check_selected(&diag, &[1.0; 20], &(0..21).collect::<Vec<_>>());
        // A Gram-like spectrum: a few large values above a tight cluster of tiny ones, and an
        // exact zero off-diagonal splitting the matrix.
        let diag: Vec<f64> = (0..120)
            .map(|i| {
                if i < 10 {
                    100.0 / (i + 1) as f64
                } else {
                    1e-12 * rng.random::<f64>()
                }
            })
            .collect();
        let mut off: Vec<f64> = (1..120)
            .map(|i| {
                if i < 10 {
                    0.3
                } else {
                    1e-13 * rng.random::<f64>()
                }
            })
            .collect();
        off[60] = 0.0;
        check_selected(&diag, &off, &(0..40).collect::<Vec<_>>());
        check_selected(&diag, &off, &(105..120).collect::<Vec<_>>());
        // One by one.
        check_selected(&[3.0], &[], &[0]);
        check_selected(&[0.0, 0.0], &[0.0], &[0, 1]);
    }

    /// `eigenvalues` against faer's dense eigendecomposition of the same matrix: every value
    /// within a few `n·eps·||T||`, on random, graded, clustered, split and scaled matrices.
    #[test]
    fn root_free_eigenvalues_match_the_dense_eigendecomposition() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        // (diagonal, off-diagonal, scale): the matrix is the pair times the scale.
        let mut cases: Vec<(Vec<f64>, Vec<f64>, f64)> = vec![
            (vec![], vec![], 1.0),
            (vec![2.5], vec![], 1.0),
            (vec![1.0, 1.0], vec![1e-300], 1.0),
            (vec![0.0, 0.0, 0.0], vec![1.0, 1.0], 1.0),
            (vec![4.0, -1.0, 3.0, 0.5], vec![0.0, 2.0, 0.0], 1.0),
        ];
        for n in [2usize, 3, 7, 64, 300] {
            let random: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let off: Vec<f64> = (1..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            // Huge and tiny scales too, where the squares of the entries overflow or underflow
            // (the dense reference runs on the unscaled matrix).
            for scale in [1.0, 1e200, 1e-200] {
                cases.push((random.clone(), off.clone(), scale));
            }
            // Graded from 1 to 1e-12 both ways (QL for one, QR for the other).
            let graded: Vec<f64> = (0..n).map(|i| 1e-12f64.powf(i as f64 / n as f64)).collect();
            let graded_off: Vec<f64> = (1..n).map(|i| 0.3 * graded[i]).collect();
            cases.push((graded.clone(), graded_off.clone(), 1.0));
            cases.push((
                graded.iter().rev().copied().collect(),
                graded_off.iter().rev().copied().collect(),
                1.0,
            ));
            // A cluster of equal values weakly coupled, as a Gram matrix's tail gives.
            let weak = (1..n).map(|_| 1e-9 * rng.random::<f64>()).collect();
            cases.push((vec![1.0; n], weak, 1.0));
        }
        for (diag, off, scale) in &cases {
            let n = diag.len();
            let scaled = |x: &[f64]| x.iter().map(|v| v * scale).collect::<Vec<f64>>();
            let got = eigenvalues(&scaled(diag), &scaled(off)).unwrap();
            assert_eq!(got.len(), n);
            if n == 0 {
                continue;
            }
            let t = Mat::<f64>::from_fn(n, n, |i, j| match i.abs_diff(j) {
                0 => diag[i],
                1 => off[i.min(j)],
                _ => 0.0,
            });
            let dense = t.self_adjoint_eigen(faer::Side::Lower).unwrap();
            let mut want: Vec<f64> = dense
                .S()
                .column_vector()
                .iter()
                .map(|x| x * scale)
                .collect();
            want.sort_by(f64::total_cmp);
            let norm = diag.iter().chain(off).fold(0f64, |m, x| m.max(x.abs())) * scale;
            let tol = 8.0 * n as f64 * f64::EPSILON * norm;
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= tol, "n={n}: {g} vs {w} (tol {tol:e})");
            }
            assert!(got.windows(2).all(|w| w[0] <= w[1]), "ascending");
        }
        // Non-finite input is refused, not looped on.
        assert!(eigenvalues(&[1.0, f64::NAN, 2.0], &[0.5, 0.5]).is_none());
    }
}
