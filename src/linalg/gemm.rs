//! The f32 matrix product of the spectral merges, split into fixed blocks of rows so that it
//! runs in parallel and rounds the same at any thread count.

use faer::linalg::matmul::matmul as faer_matmul;
use faer::{Accum, Mat, MatRef, Par};
use rayon::prelude::*;

use super::simd::clear_upper_state;

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
            clear_upper_state();
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
