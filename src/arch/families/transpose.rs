//! Byte-level transpose of a strided 2-D block, for expert tensors stored as `x @ W` (the
//! safetensors format has no strides, so unfusing them needs a real copy). Element bytes are moved,
//! never decoded, so any dtype round-trips exactly.

/// Append to `out` the transpose of the block of `rows` rows whose first element is `start`
/// (row length `stride` elements of `size` bytes in `src`), restricted to `cols` columns: `cols` rows
/// of `rows` elements.
pub fn append(
    out: &mut Vec<u8>,
    src: &[u8],
    size: usize,
    start: usize,
    rows: usize,
    stride: usize,
    cols: usize,
) {
    let base = out.len();
    out.resize(base + rows * cols * size, 0);
    let dst = &mut out[base..];
    let block = Block {
        start,
        rows,
        stride,
        cols,
    };
    match size {
        1 => tiled::<1>(dst, src, &block),
        2 => tiled::<2>(dst, src, &block),
        4 => tiled::<4>(dst, src, &block),
        8 => tiled::<8>(dst, src, &block),
        _ => {
            for c in 0..cols {
                for r in 0..rows {
                    let s = (start + r * stride + c) * size;
                    let o = (c * rows + r) * size;
                    dst[o..o + size].copy_from_slice(&src[s..s + size]);
                }
            }
        }
    }
}

/// The inverse of [`append`]: write `chunk` (`cols` rows of `rows` elements) back into the block of
/// `dst` that [`append`] would read it from, transposing it again.
pub fn scatter(
    dst: &mut [u8],
    chunk: &[u8],
    size: usize,
    start: usize,
    rows: usize,
    stride: usize,
    cols: usize,
) {
    for r0 in (0..rows).step_by(TILE) {
        let r1 = (r0 + TILE).min(rows);
        for c in 0..cols {
            for r in r0..r1 {
                let d = (start + r * stride + c) * size;
                let s = (c * rows + r) * size;
                dst[d..d + size].copy_from_slice(&chunk[s..s + size]);
            }
        }
    }
}

struct Block {
    start: usize,
    rows: usize,
    stride: usize,
    cols: usize,
}

/// Tile edge: a 32x32 tile of source rows stays in L1 while its columns are written out.
const TILE: usize = 32;

fn tiled<const N: usize>(dst: &mut [u8], src: &[u8], b: &Block) {
    for r0 in (0..b.rows).step_by(TILE) {
        let r1 = (r0 + TILE).min(b.rows);
        for c0 in (0..b.cols).step_by(TILE) {
            for c in c0..(c0 + TILE).min(b.cols) {
                let out = &mut dst[(c * b.rows + r0) * N..(c * b.rows + r1) * N];
                for (k, elem) in out.chunks_exact_mut(N).enumerate() {
                    let s = (b.start + (r0 + k) * b.stride + c) * N;
                    elem.copy_from_slice(&src[s..s + N]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(src: &[u16], start: usize, rows: usize, stride: usize, cols: usize) -> Vec<u16> {
        let mut out = Vec::new();
        for c in 0..cols {
            for r in 0..rows {
                out.push(src[start + r * stride + c]);
            }
        }
        out
    }

    #[test]
    fn matches_the_naive_transpose_for_every_element_size() {
        // 70 x 45 block of a 70 x 50 matrix, starting 3 columns in: covers partial tiles.
        let (rows, stride, cols, start) = (70, 50, 45, 3);
        let src: Vec<u16> = (0..(rows * stride + start) as u16).collect();
        let bytes: Vec<u8> = src.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut out = vec![7u8]; // appended after existing content
        append(&mut out, &bytes, 2, start, rows, stride, cols);
        let got: Vec<u16> = out[1..]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(out[0], 7);
        assert_eq!(got, naive(&src, start, rows, stride, cols));

        // The generic path (3-byte elements) agrees with the 1-byte path applied per byte lane.
        let src3: Vec<u8> = (0..(4 * 5 * 3) as u8).collect();
        let mut t3 = Vec::new();
        append(&mut t3, &src3, 3, 0, 4, 5, 5);
        assert_eq!(&t3[..3], &src3[..3]);
        assert_eq!(&t3[3..6], &src3[15..18]); // row 1, column 0
    }

    #[test]
    fn scatter_undoes_append() {
        let (rows, stride, cols, start) = (70, 50, 45, 3);
        let src: Vec<u8> = (0..(rows * stride + start) * 2).map(|i| i as u8).collect();
        let mut chunk = Vec::new();
        append(&mut chunk, &src, 2, start, rows, stride, cols);
        let mut back = vec![0u8; src.len()];
        scatter(&mut back, &chunk, 2, start, rows, stride, cols);
        for r in 0..rows {
            let (a, b) = ((start + r * stride) * 2, (start + r * stride + cols) * 2);
            assert_eq!(&back[a..b], &src[a..b], "row {r}");
        }
    }
}
