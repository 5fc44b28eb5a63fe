//! The top eigenpair of a small symmetric tridiagonal matrix (the Lanczos matrix T_k).
//!
//! Bisection on Sturm counts gives the largest eigenvalue to full f64 accuracy in O(k) per
//! probe; two steps of inverse iteration give its eigenvector, whose last component is what the
//! Lanczos residual bound needs. Both are O(k), so the bound can be checked after every step.

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
/// with partial pivoting (LAPACK `dgttrf`/`dgttrs`); tiny pivots are raised to a floor, as
/// inverse iteration intends.
fn inverse_iteration(diag: &[f64], off: &[f64], lambda: f64) -> Vec<f64> {
    let k = diag.len();
    let floor = pivot_floor(diag, off).max(f64::MIN_POSITIVE) * 1e3;
    let mut d: Vec<f64> = diag.iter().map(|a| a - lambda).collect();
    let mut dl = off.to_vec();
    let mut du = off.to_vec();
    let mut du2 = vec![0.0; k.saturating_sub(2)];
    let mut swapped = vec![false; k - 1];
    for i in 0..k - 1 {
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
            let fact = d[i] / dl[i];
            d[i] = dl[i];
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

    let mut x = vec![1.0; k];
    for _ in 0..3 {
        // Forward: L y = P b.
        for i in 0..k - 1 {
            if swapped[i] {
                x.swap(i, i + 1);
            }
            x[i + 1] -= dl[i] * x[i];
        }
        // Backward: U x = y.
        x[k - 1] /= d[k - 1];
        x[k - 2] = (x[k - 2] - du[k - 2] * x[k - 1]) / d[k - 2];
        for i in (0..k.saturating_sub(2)).rev() {
            x[i] = (x[i] - du[i] * x[i + 1] - du2[i] * x[i + 2]) / d[i];
        }
        let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
        if !(norm.is_finite() && norm > 0.0) {
            break;
        }
        x.iter_mut().for_each(|v| *v /= norm);
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use faer::Mat;
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
}
