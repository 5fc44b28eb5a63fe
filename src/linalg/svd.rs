//! Singular value decompositions for the spectral merge methods (TSV, STAR), on faer.
//!
//! - [`thin_svd`]: every singular triplet in f32 (faer's QR + divide-and-conquer bidiagonal
//!   SVD; 4-6x faster than torch's MKL `linalg.svd` on the same machine).
//! - [`polar`]: the orthogonal polar factor `U V^T` of a thin SVD. It is taken from the SVD
//!   rather than from `A (A^T A)^{-1/2}`, which loses half the digits in f32 on the badly
//!   conditioned concatenations TSV builds (merging.md, numerical notes).

use faer::{Mat, MatRef};

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

/// The thin SVD (k = min(m, n) triplets).
pub fn thin_svd(a: MatRef<'_, f32>) -> Result<Svd, SvdFailed> {
    if a.nrows() == 0 || a.ncols() == 0 {
        return Ok(Svd {
            u: Mat::zeros(a.nrows(), 0),
            s: Vec::new(),
            v: Mat::zeros(a.ncols(), 0),
        });
    }
    let svd = a.thin_svd().map_err(|_| SvdFailed)?;
    let s = svd.S().column_vector().iter().copied().collect();
    Ok(Svd {
        u: svd.U().to_owned(),
        s,
        v: svd.V().to_owned(),
    })
}

/// The orthogonal polar factor `U V^T` of `a` (m x p, m >= p): the matrix with orthonormal
/// columns nearest to `a` (orthogonal Procrustes).
pub fn polar(a: MatRef<'_, f32>) -> Result<Mat<f32>, SvdFailed> {
    let svd = thin_svd(a)?;
    Ok(&svd.u * svd.v.transpose())
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
    fn polar_factor_is_orthonormal_and_nearest() {
        let a = matrix(30, 12, 0.3, 2);
        let p = polar(a.as_ref()).unwrap();
        let gram = p.transpose() * &p;
        assert!(max_abs_diff(&gram, &Mat::identity(12, 12)) < 1e-5);
        // For A = U S V^T, P = U V^T, so P^T A = V S V^T is symmetric.
        let pa = p.transpose() * &a;
        assert!(max_abs_diff(&pa, &pa.transpose().to_owned()) < 1e-5);
    }
}
