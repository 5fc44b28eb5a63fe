//! Matrices read one row at a time, straight from where they are stored.
//!
//! The spectral norm only needs products with the matrix, and every product streams the matrix
//! row by row. Reading rows from the checkpoint bytes (decoding bf16/f16/f32 on the fly, and
//! subtracting two checkpoints' rows for a weight difference) means no f32 copy of a tensor ever
//! exists: a 7B-class `[18944, 3584]` difference costs two row buffers instead of 271 MB.

use safetensors::Dtype;

use super::dot::{diff_dots_bf16, dot_f32, DiffRowPair, PREFETCH_AHEAD};
use crate::dtype;

/// A matrix that hands out its rows as f32.
pub trait RowSource: Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Row `i` as f32, either borrowed from the source or decoded into `scratch`.
    fn row<'a>(&'a self, i: usize, scratch: &'a mut RowScratch) -> &'a [f32];
}

/// K matrices of one shape whose rows are read together, so one pass over the stored bytes
/// serves K computations (the drift TARGET - REF and REF itself, from the same two rows).
/// Every [`RowSource`] is a set of one.
pub trait RowSet<const K: usize>: Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Row `i` of each matrix `k` with `need[k]`; the other slices are empty.
    fn row_set<'a>(
        &'a self,
        i: usize,
        need: [bool; K],
        scratch: &'a mut RowScratch,
    ) -> [&'a [f32]; K];
    /// [`RowSet::row_set`], plus `row_k · v_k` for every k with a vector (0 for the others),
    /// summed as [`dot_f32`] sums. Sources that decode can fuse the two.
    #[inline(always)]
    fn row_set_dots<'a, const FMA: bool>(
        &'a self,
        i: usize,
        need: [bool; K],
        v: &[Option<&[f32]>; K],
        scratch: &'a mut RowScratch,
    ) -> ([&'a [f32]; K], [f64; K]) {
        let set = self.row_set(i, need, scratch);
        (set, dots::<K, FMA>(&set, v))
    }
}

impl<S: RowSource> RowSet<1> for S {
    fn rows(&self) -> usize {
        RowSource::rows(self)
    }
    fn cols(&self) -> usize {
        RowSource::cols(self)
    }
    #[inline(always)]
    fn row_set<'a>(
        &'a self,
        i: usize,
        need: [bool; 1],
        scratch: &'a mut RowScratch,
    ) -> [&'a [f32]; 1] {
        if need[0] {
            [self.row(i, scratch)]
        } else {
            [&[]]
        }
    }
}

/// Per-worker buffers that decoding sources write rows into.
#[derive(Debug, Default)]
pub struct RowScratch {
    first: Vec<f32>,
    second: Vec<f32>,
}

impl RowScratch {
    pub fn new() -> RowScratch {
        RowScratch::default()
    }
}

/// A row-major f32 matrix in memory.
#[derive(Debug, Clone, Copy)]
pub struct DenseRows<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
}

impl<'a> DenseRows<'a> {
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> DenseRows<'a> {
        assert_eq!(data.len(), rows * cols, "{rows}x{cols} matrix");
        DenseRows { data, rows, cols }
    }
}

impl RowSource for DenseRows<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn row<'a>(&'a self, i: usize, _: &'a mut RowScratch) -> &'a [f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
}

/// A row-major matrix stored as little-endian F32, F16 or BF16 bytes (a safetensors view).
#[derive(Debug, Clone, Copy)]
pub struct StoredRows<'a> {
    dtype: Dtype,
    bytes: &'a [u8],
    rows: usize,
    cols: usize,
}

impl<'a> StoredRows<'a> {
    /// `None` unless `dtype` is a float type and `bytes` holds exactly `rows * cols` values.
    pub fn new(dtype: Dtype, bytes: &'a [u8], rows: usize, cols: usize) -> Option<StoredRows<'a>> {
        let ok = dtype::is_float(dtype) && bytes.len() == rows * cols * dtype::byte_size(dtype);
        ok.then_some(StoredRows {
            dtype,
            bytes,
            rows,
            cols,
        })
    }

    /// Ask the CPU to start loading the bytes [`PREFETCH_AHEAD`] past the start of row `i`
    /// (see there).
    #[inline(always)]
    fn prefetch_ahead(&self, i: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let row_bytes = self.cols * dtype::byte_size(self.dtype);
            let start = (i * row_bytes + PREFETCH_AHEAD).min(self.bytes.len());
            let end = (start + row_bytes).min(self.bytes.len());
            for line in self.bytes[start..end].chunks(64) {
                // SAFETY: prefetching is a hint and never faults; the address lies in `bytes`.
                unsafe {
                    std::arch::x86_64::_mm_prefetch(
                        line.as_ptr() as *const i8,
                        std::arch::x86_64::_MM_HINT_T0,
                    )
                };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }

    /// Decode row `i` into `out` (`cols` values).
    #[inline(always)]
    fn decode_row(&self, i: usize, out: &mut [f32]) {
        self.prefetch_ahead(i);
        let size = dtype::byte_size(self.dtype);
        let bytes = &self.bytes[i * self.cols * size..(i + 1) * self.cols * size];
        // `new` admitted a float dtype and the lengths.
        dtype::decode_unchecked(self.dtype, bytes, out);
    }
}

impl RowSource for StoredRows<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn row<'a>(&'a self, i: usize, scratch: &'a mut RowScratch) -> &'a [f32] {
        scratch.first.resize(self.cols, 0.0);
        self.decode_row(i, &mut scratch.first);
        &scratch.first
    }
}

/// `target - reference` of two stored matrices of one shape, in f32 (the weight drift dW).
#[derive(Debug, Clone, Copy)]
pub struct DiffRows<'a> {
    target: StoredRows<'a>,
    reference: StoredRows<'a>,
}

impl<'a> DiffRows<'a> {
    /// `None` when the shapes differ.
    pub fn new(target: StoredRows<'a>, reference: StoredRows<'a>) -> Option<DiffRows<'a>> {
        let same = target.rows == reference.rows && target.cols == reference.cols;
        same.then_some(DiffRows { target, reference })
    }
}

impl RowSource for DiffRows<'_> {
    fn rows(&self) -> usize {
        self.target.rows
    }
    fn cols(&self) -> usize {
        self.target.cols
    }
    #[inline(always)]
    fn row<'a>(&'a self, i: usize, scratch: &'a mut RowScratch) -> &'a [f32] {
        let n = self.target.cols;
        scratch.first.resize(n, 0.0);
        scratch.second.resize(n, 0.0);
        self.target.decode_row(i, &mut scratch.first);
        self.reference.decode_row(i, &mut scratch.second);
        for (t, r) in scratch.first.iter_mut().zip(&scratch.second) {
            *t -= *r;
        }
        &scratch.first
    }
}

/// The drift and its reference: `[TARGET - REF, REF]`, decoding each stored row once.
impl RowSet<2> for DiffRows<'_> {
    fn rows(&self) -> usize {
        self.target.rows
    }
    fn cols(&self) -> usize {
        self.target.cols
    }
    #[inline(always)]
    fn row_set<'a>(
        &'a self,
        i: usize,
        need: [bool; 2],
        scratch: &'a mut RowScratch,
    ) -> [&'a [f32]; 2] {
        if !need[0] {
            if !need[1] {
                return [&[], &[]];
            }
            scratch.second.resize(self.target.cols, 0.0);
            self.reference.decode_row(i, &mut scratch.second);
            return [&[], &scratch.second];
        }
        self.row(i, scratch);
        // `row` leaves REF's row in `second` and the difference in `first`.
        let (first, second) = (&scratch.first[..], &scratch.second[..]);
        [first, if need[1] { second } else { &[] }]
    }

    #[inline(always)]
    fn row_set_dots<'a, const FMA: bool>(
        &'a self,
        i: usize,
        need: [bool; 2],
        v: &[Option<&[f32]>; 2],
        scratch: &'a mut RowScratch,
    ) -> ([&'a [f32]; 2], [f64; 2]) {
        let bf16 = self.target.dtype == Dtype::BF16 && self.reference.dtype == Dtype::BF16;
        match (bf16, v) {
            (true, [Some(vd), Some(vr)]) => {
                // The lockstep pass's common case: decode, subtract and both dot products in
                // one sweep over the stored rows.
                let n = self.target.cols;
                scratch.first.resize(n, 0.0);
                scratch.second.resize(n, 0.0);
                let row = i * n * 2..(i + 1) * n * 2;
                let dots = diff_dots_bf16::<FMA>(&mut DiffRowPair {
                    target: &self.target.bytes[row.clone()],
                    reference: &self.reference.bytes[row],
                    diff: &mut scratch.first,
                    reference_f32: &mut scratch.second,
                    v_diff: vd,
                    v_reference: vr,
                });
                ([&scratch.first, &scratch.second], [dots.0, dots.1])
            }
            _ => {
                let set = self.row_set(i, need, scratch);
                (set, dots::<2, FMA>(&set, v))
            }
        }
    }
}

/// `set[k] · v[k]` for every k with a vector, 0 for the others. A plain loop rather than a
/// closure, so it is inlined into the caller's SIMD code path instead of calling a software fma.
#[inline(always)]
fn dots<const K: usize, const FMA: bool>(set: &[&[f32]; K], v: &[Option<&[f32]>; K]) -> [f64; K] {
    let mut out = [0f64; K];
    for ((o, row), vk) in out.iter_mut().zip(set).zip(v) {
        if let Some(vk) = vk {
            *o = dot_f32::<FMA>(row, vk);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_and_difference_rows_decode_every_float_dtype() {
        let values = [1.5f32, -2.0, 0.25, 3.0, -0.5, 8.0];
        let reference = [0.5f32, 1.0, 0.25, -1.0, 0.5, 4.0];
        for dt in [Dtype::F32, Dtype::F16, Dtype::BF16] {
            let t = dtype::encode(dt, &values).unwrap();
            let r = dtype::encode(dt, &reference).unwrap();
            let ts = StoredRows::new(dt, &t, 2, 3).unwrap();
            let rs = StoredRows::new(dt, &r, 2, 3).unwrap();
            let mut scratch = RowScratch::new();
            assert_eq!(ts.row(1, &mut scratch), &values[3..]);
            let diff = DiffRows::new(ts, rs).unwrap();
            assert_eq!(diff.row(0, &mut scratch), &[1.0, -3.0, 0.0]);
            assert_eq!(diff.row(1, &mut scratch), &[4.0, -1.0, 4.0]);
        }
        let (t, r) = (
            dtype::encode(Dtype::BF16, &values).unwrap(),
            dtype::encode(Dtype::BF16, &reference).unwrap(),
        );
        let diff = DiffRows::new(
            StoredRows::new(Dtype::BF16, &t, 2, 3).unwrap(),
            StoredRows::new(Dtype::BF16, &r, 2, 3).unwrap(),
        )
        .unwrap();
        let mut scratch = RowScratch::new();
        assert_eq!(
            diff.row_set(1, [true, true], &mut scratch),
            [&[4.0, -1.0, 4.0][..], &reference[3..]]
        );
        assert_eq!(
            diff.row_set(0, [false, true], &mut scratch),
            [&[][..], &reference[..3]]
        );
        assert_eq!(
            diff.row_set(0, [true, false], &mut scratch),
            [&[1.0, -3.0, 0.0][..], &[]]
        );
        assert!(StoredRows::new(Dtype::BF16, &[0u8; 10], 2, 3).is_none());
        assert!(StoredRows::new(Dtype::I32, &[0u8; 24], 2, 3).is_none());
    }
}
