//! The long side of an f32 matrix streamed as f64 blocks of rows, for the products the Gram route
//! takes of it ([`super::gram_evd`]): converting a block at a time bounds the f64 copy.

use faer::linalg::matmul::matmul as faer_matmul;
use faer::{Accum, Mat, MatRef, Par};

use super::simd::clear_upper_state;

/// Rows of the f64 block [`for_each_f64_block`] converts at a time (59 MB at 3584 columns).
pub(super) const F64_BLOCK_ROWS: usize = 2048;

/// Source rows converted together when a row-major source is copied into a column-major block:
/// eight f64 entries are one cache line of a block column.
const TRANSPOSE_ROWS: usize = 8;

/// Call `f(start, block)` on consecutive blocks of [`F64_BLOCK_ROWS`] rows of X, the long side
/// of `a` as rows (`a`, or `aᵀ` if wide), each converted to f64. The products the decompositions
/// take of `a` are exact in f64 either way, and a converted copy of the whole of `a` would cost
/// its size in f64 (543 MB for 18944 x 3584) for every task decomposed at once.
pub(super) fn for_each_f64_block(a: MatRef<'_, f32>, mut f: impl FnMut(usize, MatRef<'_, f64>)) {
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
        if src.col_stride() == 1 {
            // Rows stored contiguously into a column-major block (the layout faer's products
            // are fastest on): eight source rows at a time, so that every column of the block
            // gets a whole cache line per visit instead of one entry.
            for i0 in (0..rows).step_by(TRANSPOSE_ROWS) {
                let tile = TRANSPOSE_ROWS.min(rows - i0);
                let src_rows: Vec<&[f32]> = (i0..i0 + tile)
                    .map(|i| {
                        src.row(i)
                            .try_as_row_major()
                            .expect("unit column stride")
                            .as_slice()
                    })
                    .collect();
                for j in 0..k {
                    let column = dst
                        .as_mut()
                        .col_mut(j)
                        .try_as_col_major_mut()
                        .expect("column-major block")
                        .as_slice_mut();
                    for (d, row) in column[i0..i0 + tile].iter_mut().zip(&src_rows) {
                        *d = row[j] as f64;
                    }
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
pub(super) fn long_side_product(a: MatRef<'_, f32>, w: MatRef<'_, f64>) -> Mat<f64> {
    let mut out = Mat::<f64>::zeros(a.nrows().max(a.ncols()), w.ncols());
    for_each_f64_block(a, |start, block| {
        faer_matmul(
            out.as_mut().subrows_mut(start, block.nrows()),
            Accum::Replace,
            block,
            w,
            1.0,
            Par::Seq,
        );
        // The next block's conversion is SSE code (see `clear_upper_state`).
        clear_upper_state();
    });
    out
}
