//! f32 building blocks of the decoder forward pass: linear layers on faer's GEMM, RMSNorm and
//! the SiLU gate. Matrices are row-major `[rows, cols]` slices (one row per token).
//!
//! Determinism: a linear layer is split into fixed blocks of output features, and each block is
//! one sequential GEMM call. Every output element is therefore computed by the same kernel call
//! with the same shapes at any thread count, so results are bitwise identical with 1 or 64
//! threads.

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

/// Output features per parallel GEMM block. Fixed (see the module docs); 128 keeps a block's
/// weights (128 x 4096 f32 = 2 MiB) near the cache while giving 2-cores-to-many enough blocks.
const OUT_BLOCK: usize = 128;

/// A linear layer `y = x Wᵀ + b` with `W` stored `[out, in]` as in safetensors.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Vec<f32>,
    pub out_features: usize,
    pub in_features: usize,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// `x` is `[rows, in]`; returns `[rows, out]`. The bias is added after the GEMM (f32, as
    /// torch's addmm does in f32).
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut y = self.forward_no_bias(x, rows);
        if let Some(b) = &self.bias {
            add_bias(&mut y, b);
        }
        y
    }

    /// `x Wᵀ` without the bias.
    pub fn forward_no_bias(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (n_in, n_out) = (self.in_features, self.out_features);
        assert_eq!(x.len(), rows * n_in, "linear input shape");
        let mut y = vec![0f32; rows * n_out];
        if rows == 0 || n_out == 0 {
            return y;
        }
        let lhs = MatRef::from_row_major_slice(x, rows, n_in);
        // Wᵀ as an [in, out] view of the row-major [out, in] weight.
        let rhs = MatRef::from_row_major_slice(&self.weight, n_out, n_in).transpose();
        let dst = MatMut::from_row_major_slice_mut(&mut y, rows, n_out);
        dst.par_col_chunks_mut(OUT_BLOCK)
            .enumerate()
            .for_each(|(block, dst)| {
                let start = block * OUT_BLOCK;
                let cols = dst.ncols();
                matmul(
                    dst,
                    Accum::Replace,
                    lhs,
                    rhs.subcols(start, cols),
                    1.0f32,
                    Par::Seq,
                );
            });
        y
    }
}

/// `y[r, :] += b` for every row.
pub fn add_bias(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_exact_mut(b.len()) {
        for (v, &bi) in row.iter_mut().zip(b) {
            *v += bi;
        }
    }
}

/// `a += b`, elementwise.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    a.par_chunks_mut(1 << 14)
        .zip(b.par_chunks(1 << 14))
        .for_each(|(a, b)| {
            for (x, &y) in a.iter_mut().zip(b) {
                *x += y;
            }
        });
}

/// RMSNorm of one vector in place: `x * rsqrt(mean(x²) + eps) * w` (transformers' f32 path;
/// the mean is accumulated in f64 and rounded once).
#[inline]
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let mean = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let inv = 1.0f32 / ((mean as f32) + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = w * (*v * inv);
    }
}

/// RMSNorm over every `width`-sized row of `x`, in parallel over rows.
pub fn rms_norm_rows(x: &mut [f32], width: usize, weight: &[f32], eps: f32) {
    assert_eq!(weight.len(), width);
    x.par_chunks_mut(width)
        .for_each(|row| rms_norm_in_place(row, weight, eps));
}

/// A normalized copy of `x` (rows of `width`).
pub fn rms_norm(x: &[f32], width: usize, weight: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm_rows(&mut y, width, weight, eps);
    y
}

/// SiLU, `x * sigmoid(x)`, in f32.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate = silu(gate) * up`, elementwise, in place in `gate`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    gate.par_chunks_mut(1 << 14)
        .zip(up.par_chunks(1 << 14))
        .for_each(|(g, u)| {
            for (a, &b) in g.iter_mut().zip(u) {
                *a = silu(*a) * b;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_matches_a_naive_product() {
        let (rows, n_in, n_out) = (3, 5, 300);
        let x: Vec<f32> = (0..rows * n_in).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..n_out * n_in).map(|i| (i as f32 * 0.11).cos()).collect();
        let b: Vec<f32> = (0..n_out).map(|i| i as f32 * 0.01).collect();
        let lin = Linear {
            weight: w.clone(),
            out_features: n_out,
            in_features: n_in,
            bias: Some(b.clone()),
        };
        let y = lin.forward(&x, rows);
        for r in 0..rows {
            for o in 0..n_out {
                let want: f32 = (0..n_in)
                    .map(|k| x[r * n_in + k] * w[o * n_in + k])
                    .sum::<f32>()
                    + b[o];
                assert!((y[r * n_out + o] - want).abs() < 1e-5, "{r} {o}");
            }
        }
    }

    #[test]
    fn rms_norm_gives_unit_rms() {
        let mut x = vec![3.0f32, -4.0, 0.0, 5.0];
        rms_norm_in_place(&mut x, &[1.0; 4], 0.0);
        let ms: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
        assert_eq!(silu(0.0), 0.0);
    }
}
