//! Test matrices with a chosen spectrum, shared by the decompositions' tests.

use faer::Mat;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// The thin Q factor of `y`: orthonormal columns spanning its columns.
pub fn orthonormal(y: &Mat<f32>) -> Mat<f32> {
    y.qr().compute_thin_Q()
}

/// An m x n matrix with singular values `(j + 1)^-decay` and random singular vectors.
pub fn matrix(m: usize, n: usize, decay: f64, seed: u64) -> Mat<f32> {
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

/// The largest entrywise difference.
pub fn max_abs_diff(a: &Mat<f32>, b: &Mat<f32>) -> f32 {
    let mut d = 0f32;
    for j in 0..a.ncols() {
        for i in 0..a.nrows() {
            d = d.max((a[(i, j)] - b[(i, j)]).abs());
        }
    }
    d
}
