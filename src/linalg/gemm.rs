//! The f32 matrix product of the spectral merges, split into fixed blocks of rows so that it
//! runs in parallel and rounds the same at any thread count.

use faer::linalg::matmul::matmul as faer_matmul;
use faer::{Accum, Mat, MatRef, Par};
use rayon::prelude::*;

use super::simd::clear_upper_state;

/// Rows per block of [`matmul`]: fixed, so the rounding does not depend on the thread count.
const MATMUL_ROWS: usize = 256;

/// Rows `start..` (at most [`MATMUL_ROWS`]) of `lhs * rhs`, column-major.
fn block_product(lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>, start: usize) -> Mat<f32> {
    let rows = MATMUL_ROWS.min(lhs.nrows() - start);
    let mut out = Mat::<f32>::zeros(rows, rhs.ncols());
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
}

/// `lhs * rhs`, computed in parallel over fixed blocks of rows.
pub fn matmul(lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>) -> Mat<f32> {
    let m = lhs.nrows();
    let blocks: Vec<Mat<f32>> = (0..m)
        .step_by(MATMUL_ROWS)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|start| block_product(lhs, rhs, start))
        .collect();
    let mut out = Mat::<f32>::zeros(m, rhs.ncols());
    for (b, block) in blocks.iter().enumerate() {
        out.as_mut()
            .subrows_mut(b * MATMUL_ROWS, block.nrows())
            .copy_from(block.as_ref());
    }
    out
}

/// `lhs * rhs` as a row-major vector (the layout of the merges' outputs): the same blocks, so
/// the same bytes, as [`matmul`], each copied straight into its rows. Neither a column-major
/// copy of the whole product nor a second pass over it is made; at 7B widths each would be
/// hundreds of MB of fresh pages per task vector.
pub fn matmul_row_major(lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>) -> Vec<f32> {
    let (m, n) = (lhs.nrows(), rhs.ncols());
    let mut out = vec![0f32; m * n];
    if n == 0 {
        return out;
    }
    out.par_chunks_mut(MATMUL_ROWS * n)
        .enumerate()
        .for_each(|(b, rows)| {
            let block = block_product(lhs, rhs, b * MATMUL_ROWS);
            for (i, row) in rows.chunks_exact_mut(n).enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = block[(i, j)];
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_major_product_has_the_bytes_of_the_column_major_one() {
        // Rows past one block and a partial last block; an empty product.
        for (m, k, n) in [(600, 37, 23), (5, 3, 0)] {
            let lhs = Mat::<f32>::from_fn(m, k, |i, j| ((i * 7 + j * 3) % 11) as f32 / 7.0 - 0.6);
            let rhs = Mat::<f32>::from_fn(k, n, |i, j| ((i * 5 + j) % 13) as f32 / 9.0 - 0.7);
            let want = matmul(lhs.as_ref(), rhs.as_ref());
            let got = matmul_row_major(lhs.as_ref(), rhs.as_ref());
            assert_eq!(got.len(), m * n);
            for i in 0..m {
                for j in 0..n {
                    assert_eq!(
                        got[i * n + j].to_bits(),
                        want[(i, j)].to_bits(),
                        "({i}, {j})"
                    );
                }
            }
        }
    }
}
