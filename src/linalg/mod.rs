//! f32 numerical kernels shared by norms, merges and the controls. Reductions accumulate in f64
//! in a fixed order so results do not depend on the thread count.

mod dot;
mod f64_blocks;
pub mod gemm;
mod gram;
mod gram_evd;
mod polar_pair;
pub mod rows;
pub(crate) mod simd;
pub mod spectral;
pub mod svd;
#[cfg(test)]
mod test_matrices;
mod tridiagonal;
pub mod two_stage;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

/// Values per parallel block of a reduction. Fixed, so the summation order (and the result) is
/// the same at any thread count.
const BLOCK: usize = 1 << 14;

/// Sum of squares in f64, blocked deterministically.
pub fn sum_squares(x: &[f32]) -> f64 {
    let partial: Vec<f64> = x
        .par_chunks(BLOCK)
        .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum())
        .collect();
    partial.iter().sum()
}

/// Frobenius (Euclidean) norm.
pub fn frobenius(x: &[f32]) -> f64 {
    sum_squares(x).sqrt()
}

/// Sum of absolute values (L1 norm) in f64, blocked deterministically.
pub fn l1(x: &[f32]) -> f64 {
    let partial: Vec<f64> = x
        .par_chunks(BLOCK)
        .map(|c| c.iter().map(|&v| v.abs() as f64).sum())
        .collect();
    partial.iter().sum()
}

/// Largest absolute value.
pub fn linf(x: &[f32]) -> f64 {
    x.par_chunks(BLOCK)
        .map(|c| c.iter().fold(0f32, |m, &v| m.max(v.abs())))
        .reduce(|| 0.0, f32::max) as f64
}

/// Dot product in f64, blocked deterministically.
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let partial: Vec<f64> = a
        .par_chunks(BLOCK)
        .zip(b.par_chunks(BLOCK))
        .map(|(x, y)| x.iter().zip(y).map(|(&p, &q)| p as f64 * q as f64).sum())
        .collect();
    partial.iter().sum()
}

/// A random generator seeded by `(seed, tensor name)`: every tensor gets its own stream, so
/// random masks and noise do not depend on the order or thread tensors are processed in.
pub fn tensor_rng(seed: u64, tensor: &str) -> ChaCha8Rng {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(tensor.as_bytes());
    ChaCha8Rng::from_seed(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn norms_of_a_known_vector() {
        let x = [3.0f32, -4.0, 0.0];
        assert_eq!(frobenius(&x), 5.0);
        assert_eq!(l1(&x), 7.0);
        assert_eq!(linf(&x), 4.0);
        assert_eq!(dot(&x, &x), 25.0);
    }

    #[test]
    fn tensor_streams_differ_by_name_and_seed_and_repeat() {
        let draw = |seed, name| tensor_rng(seed, name).random::<u64>();
        assert_eq!(draw(0, "a"), draw(0, "a"));
        assert_ne!(draw(0, "a"), draw(0, "b"));
        assert_ne!(draw(0, "a"), draw(1, "a"));
    }
}
