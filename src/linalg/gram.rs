//! One streaming pass over K matrices' rows: `z_k = A_kᵀ A_k v_k` for every k given a vector,
//! and on request `Σ a²` of every matrix.
//!
//! Each row is used twice while it is in cache (`t = a_i·v`, then `z += t a_i`), so a pass reads
//! the matrix once. The rows are split into tasks by the shape alone; every task sums in a fixed
//! order (f32 partial sums of bounded length, added into f64), and task results are added in
//! task order, so the bits do not depend on the thread count.

use std::ops::Range;

use rayon::prelude::*;

use super::dot::LANES;
use super::rows::{RowScratch, RowSet};
use super::simd::{self, madd};

/// Rows whose f32 contributions to z are summed before being added into f64.
const FLUSH_ROWS: usize = 16;
/// At most this many parallel row tasks per pass.
const MAX_TASKS: usize = 64;
/// At least this many matrix entries per task, so small matrices are not over-split.
const MIN_TASK_ENTRIES: usize = 1 << 16;
/// Bound on the f64 partial results held at once (entries).
const PARTIAL_ENTRIES: usize = 1 << 22;

/// The row tasks of a pass (a function of the shape only) and the buffers they fill, kept from
/// pass to pass: fresh zeroed vectors for every task of every pass cost more page faults than
/// the pass itself costs arithmetic.
pub struct PassWorkspace<const K: usize> {
    tasks: Vec<Range<usize>>,
    cols: usize,
    /// One per task of a batch of tasks run at once.
    slots: Vec<Slot<K>>,
}

/// What one task writes: its share of every product and sum of squares.
struct Slot<const K: usize> {
    products: [Vec<f64>; K],
    acc: [Vec<f32>; K],
    squares: [f64; K],
}

impl<const K: usize> PassWorkspace<K> {
    pub fn new(rows: usize, cols: usize) -> PassWorkspace<K> {
        let per_task = rows
            .div_ceil(MAX_TASKS)
            .max(MIN_TASK_ENTRIES.div_ceil(cols.max(1)))
            .max(1);
        let tasks: Vec<Range<usize>> = (0..rows.div_ceil(per_task))
            .map(|t| t * per_task..((t + 1) * per_task).min(rows))
            .collect();
        // Tasks run at once, each with its own slot: bounded by PARTIAL_ENTRIES, at least two.
        let batch = (PARTIAL_ENTRIES / (cols * K).max(1))
            .max(2)
            .min(tasks.len());
        PassWorkspace {
            slots: (0..batch)
                .map(|_| Slot {
                    products: std::array::from_fn(|_| Vec::new()),
                    acc: std::array::from_fn(|_| Vec::new()),
                    squares: [0.0; K],
                })
                .collect(),
            tasks,
            cols,
        }
    }
}

/// What one pass returns: `z_k` for every k given a vector (else `None`), and `Σ a²` per matrix
/// (zeros unless requested).
pub struct PassResult<const K: usize> {
    pub products: [Option<Vec<f64>>; K],
    pub squares: [f64; K],
}

/// One pass over `a`: `AᵀA v_k` in f64 for each `Some(v_k)`, and the sums of squares if asked.
pub fn pass<const K: usize, S: RowSet<K>>(
    a: &S,
    workspace: &mut PassWorkspace<K>,
    v: [Option<&[f32]>; K],
    squares: bool,
) -> PassResult<K> {
    let n = workspace.cols;
    let mut products: [Option<Vec<f64>>; K] = std::array::from_fn(|k| v[k].map(|_| vec![0f64; n]));
    let mut total_squares = [0f64; K];
    let batch = workspace.slots.len().max(1);
    for tasks in workspace.tasks.chunks(batch) {
        tasks
            .par_iter()
            .zip(workspace.slots.par_iter_mut())
            .for_each(|(rows, slot)| run_task(a, rows.clone(), &v, squares, slot));
        // Task order, whatever thread ran which task: the sums do not depend on the thread count.
        for slot in &workspace.slots[..tasks.len()] {
            for k in 0..K {
                total_squares[k] += slot.squares[k];
                if let Some(total) = &mut products[k] {
                    for (t, x) in total.iter_mut().zip(&slot.products[k]) {
                        *t += x;
                    }
                }
            }
        }
    }
    PassResult {
        products,
        squares: total_squares,
    }
}

/// One task, by the AVX2 and FMA build of the row kernels where the CPU has them ([`simd`]).
fn run_task<const K: usize, S: RowSet<K>>(
    a: &S,
    rows: Range<usize>,
    v: &[Option<&[f32]>; K],
    squares: bool,
    slot: &mut Slot<K>,
) {
    #[cfg(target_arch = "x86_64")]
    if simd::avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { task_avx2(a, rows, v, squares, slot) };
    }
    task::<K, S, false>(a, rows, v, squares, slot)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2<const K: usize, S: RowSet<K>>(
    a: &S,
    rows: Range<usize>,
    v: &[Option<&[f32]>; K],
    squares: bool,
    slot: &mut Slot<K>,
) {
    task::<K, S, true>(a, rows, v, squares, slot)
}

#[inline(always)]
fn task<const K: usize, S: RowSet<K>, const FMA: bool>(
    a: &S,
    rows: Range<usize>,
    v: &[Option<&[f32]>; K],
    squares: bool,
    slot: &mut Slot<K>,
) {
    let n = a.cols();
    let need: [bool; K] = std::array::from_fn(|k| squares || v[k].is_some());
    for (vk, (products, acc)) in v.iter().zip(slot.products.iter_mut().zip(&mut slot.acc)) {
        let len = if vk.is_some() { n } else { 0 };
        products.clear();
        products.resize(len, 0.0);
        acc.clear();
        acc.resize(len, 0.0);
    }
    let Slot {
        products,
        acc,
        squares: sums,
    } = slot;
    *sums = [0.0; K];
    let mut pending = 0;
    // Taken out of the thread-local and put back, rather than used inside `with`: code in a
    // closure is not always inlined into the caller's AVX2 context, and its fused multiply-adds
    // then become calls to a software fma, several times slower
    // (`cargo bench --bench spectral_norm`).
    let mut block = ROW_BLOCK_SCRATCH.take();
    block.resize_with(ROW_BLOCK, RowScratch::new);
    let mut i = rows.start;
    while i < rows.end {
        // ROW_BLOCK divides FLUSH_ROWS, so a block never straddles a flush.
        let end = (i + ROW_BLOCK).min(rows.end);
        let mut sets: [[&[f32]; K]; ROW_BLOCK] = [[&[]; K]; ROW_BLOCK];
        let mut t = [[0f32; K]; ROW_BLOCK];
        for (r, scratch) in (i..end).zip(block.iter_mut()) {
            let (set, dots) = a.row_set_dots::<FMA>(r, need, v, scratch);
            for k in 0..K {
                if squares {
                    sums[k] += squares_f64(set[k]);
                }
                t[r - i][k] = dots[k] as f32;
            }
            sets[r - i] = set;
        }
        for k in 0..K {
            if v[k].is_some() {
                add_rows::<K, FMA>(&mut acc[k], &sets[..end - i], &t[..end - i], k);
            }
        }
        pending += end - i;
        if pending == FLUSH_ROWS {
            flush(acc, products);
            pending = 0;
        }
        i = end;
    }
    ROW_BLOCK_SCRATCH.set(block);
    if pending > 0 {
        flush(acc, products);
    }
}

/// Rows decoded and added into the products together (see [`add_rows`]).
const ROW_BLOCK: usize = 8;
const _: () = assert!(FLUSH_ROWS.is_multiple_of(ROW_BLOCK));

thread_local! {
    /// Each worker's decoded rows of one block (a few MB at most).
    static ROW_BLOCK_SCRATCH: std::cell::RefCell<Vec<RowScratch>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// `acc += Σ_r t[r][k] · sets[r][k]`, a chunk of `acc` at a time held in registers across the
/// rows: one load and store of `acc` per block instead of per row. Each value still receives
/// the rows' fused multiply-adds in row order, so the bits equal adding one row at a time.
#[inline(always)]
fn add_rows<const K: usize, const FMA: bool>(
    acc: &mut [f32],
    sets: &[[&[f32]; K]],
    t: &[[f32; K]],
    k: usize,
) {
    const CHUNK: usize = 64;
    let mut start = 0;
    for chunk in acc.chunks_mut(CHUNK) {
        let len = chunk.len();
        if len == CHUNK {
            let mut reg = [0f32; CHUNK];
            reg.copy_from_slice(chunk);
            for (set, tr) in sets.iter().zip(t) {
                let x = &set[k][start..start + CHUNK];
                for l in 0..CHUNK {
                    reg[l] = madd::<FMA, f32>(tr[k], x[l], reg[l]);
                }
            }
            chunk.copy_from_slice(&reg);
        } else {
            for (set, tr) in sets.iter().zip(t) {
                for (s, x) in chunk.iter_mut().zip(&set[k][start..start + len]) {
                    *s = madd::<FMA, f32>(tr[k], *x, *s);
                }
            }
        }
        start += len;
    }
}

#[inline(always)]
fn flush<const K: usize>(acc: &mut [Vec<f32>; K], out: &mut [Vec<f64>; K]) {
    for (a, o) in acc.iter_mut().zip(out.iter_mut()) {
        for (o, s) in o.iter_mut().zip(a.iter_mut()) {
            *o += *s as f64;
            *s = 0.0;
        }
    }
}

/// Σ x² with f64 products: f32 squares would underflow or overflow for extreme weights.
#[inline(always)]
fn squares_f64(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| v as f64 * v as f64)
        .sum();
    for c in chunks {
        for l in 0..LANES {
            let v = c[l] as f64;
            acc[l] += v * v;
        }
    }
    acc.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linalg::dot::dot_f32;
    use crate::linalg::rows::DenseRows;

    #[test]
    fn one_pass_gives_the_gram_product_and_the_squares() {
        // A = [[1, 2], [3, 4], [0, -1]]: AᵀA = [[10, 14], [14, 21]].
        let a = [1.0f32, 2.0, 3.0, 4.0, 0.0, -1.0];
        let dense = DenseRows::new(&a, 3, 2);
        let mut workspace = PassWorkspace::new(3, 2);
        let r = pass(&dense, &mut workspace, [Some(&[1.0, -1.0][..])], true);
        assert_eq!(r.products[0].as_deref(), Some(&[-4.0, -7.0][..]));
        assert_eq!(r.squares, [31.0]);
        let r = pass(&dense, &mut workspace, [None], false);
        assert!(r.products[0].is_none() && r.squares == [0.0]);
    }

    /// Rows added a block at a time give the bits of adding them one at a time.
    #[test]
    fn blocked_rows_sum_like_one_row_at_a_time() {
        let (m, n) = (45, 70); // not multiples of ROW_BLOCK, FLUSH_ROWS or the register chunk
        let a: Vec<f32> = (0..m * n).map(|i| ((i as f32) * 0.731).sin()).collect();
        let v: Vec<f32> = (0..n).map(|j| ((j as f32) * 0.173).cos()).collect();
        let dense = DenseRows::new(&a, m, n);
        let got = pass(&dense, &mut PassWorkspace::new(m, n), [Some(&v[..])], false);
        let fma = simd::avx2_fma();
        let mut want = vec![0f64; n];
        for task in PassWorkspace::<1>::new(m, n).tasks {
            let (mut part, mut acc) = (vec![0f64; n], vec![0f32; n]);
            for (done, i) in task.enumerate() {
                let row = &a[i * n..(i + 1) * n];
                let t = if fma {
                    dot_f32::<true>(row, &v)
                } else {
                    dot_f32::<false>(row, &v)
                } as f32;
                for (s, x) in acc.iter_mut().zip(row) {
                    *s = if fma { t.mul_add(*x, *s) } else { t * *x + *s };
                }
                if (done + 1) % FLUSH_ROWS == 0 {
                    for (p, s) in part.iter_mut().zip(&mut acc) {
                        *p += *s as f64;
                        *s = 0.0;
                    }
                }
            }
            for (p, s) in part.iter_mut().zip(&acc) {
                *p += *s as f64;
            }
            for (w, p) in want.iter_mut().zip(&part) {
                *w += p;
            }
        }
        assert_eq!(got.products[0].as_deref(), Some(&want[..]));
    }

    #[test]
    fn tasks_depend_on_the_shape_only_and_cover_every_row() {
        for (m, n) in [(0, 5), (1, 1), (100, 3), (18944, 3584), (3584, 18944)] {
            let workspace = PassWorkspace::<1>::new(m, n);
            assert!(workspace.tasks.len() <= MAX_TASKS);
            let covered: usize = workspace.tasks.iter().map(|t| t.len()).sum();
            assert_eq!(covered, m);
            assert!(workspace.tasks.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}
