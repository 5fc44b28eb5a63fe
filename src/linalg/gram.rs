//! One streaming pass over K matrices' rows: `z_k = A_kᵀ A_k v_k` for every k given a vector,
//! and on request `Σ a²` of every matrix.
//!
//! Each row is used twice while it is in cache (`t = a_i·v`, then `z += t a_i`), so a pass reads
//! the matrix once. The rows are split into tasks by the shape alone; every task sums in a fixed
//! order (f32 partial sums of bounded length, added into f64), and task results are added in
//! task order, so the bits do not depend on the thread count.

use std::ops::Range;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::dot::{madd, LANES};
use super::rows::{RowScratch, RowSet};

/// Rows whose f32 contributions to z are summed before being added into f64.
const FLUSH_ROWS: usize = 16;
/// How far ahead (in f32 bytes of a row) rows are prefetched.
const PREFETCH_BYTES_AHEAD: usize = 16 << 10;
/// At most this many parallel row tasks per pass.
const MAX_TASKS: usize = 64;
/// At least this many matrix entries per task, so small matrices are not over-split.
const MIN_TASK_ENTRIES: usize = 1 << 16;
/// Bound on the f64 partial results held at once (entries).
const PARTIAL_ENTRIES: usize = 1 << 22;

/// The row tasks of a pass (a function of the shape only) and the buffers they fill, kept from
/// pass to pass: fresh zeroed vectors for every task of every pass cost more page faults than
/// the pass itself costs arithmetic.
pub struct Plan<const K: usize> {
    tasks: Vec<Range<usize>>,
    cols: usize,
    /// One per task of a batch of tasks run at once.
    slots: Vec<Slot<K>>,
}

/// What one task writes: its share of every product and sum of squares, and its working rows.
struct Slot<const K: usize> {
    products: [Vec<f64>; K],
    acc: [Vec<f32>; K],
    squares: [f64; K],
    scratch: RowScratch,
}

impl<const K: usize> Plan<K> {
    pub fn new(rows: usize, cols: usize) -> Plan<K> {
        let per_task = rows
            .div_ceil(MAX_TASKS)
            .max(MIN_TASK_ENTRIES.div_ceil(cols.max(1)))
            .max(1);
        let tasks: Vec<Range<usize>> = (0..rows.div_ceil(per_task))
            .map(|t| t * per_task..((t + 1) * per_task).min(rows))
            .collect();
        let batch = (PARTIAL_ENTRIES / (cols * K).max(1)).clamp(2, tasks.len().max(2));
        Plan {
            slots: (0..batch.min(tasks.len()))
                .map(|_| Slot {
                    products: std::array::from_fn(|_| Vec::new()),
                    acc: std::array::from_fn(|_| Vec::new()),
                    squares: [0.0; K],
                    scratch: RowScratch::new(),
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
    plan: &mut Plan<K>,
    v: [Option<&[f32]>; K],
    squares: bool,
) -> PassResult<K> {
    let n = plan.cols;
    let mut products: [Option<Vec<f64>>; K] = std::array::from_fn(|k| v[k].map(|_| vec![0f64; n]));
    let mut total_squares = [0f64; K];
    let batch = plan.slots.len().max(1);
    for tasks in plan.tasks.chunks(batch) {
        tasks
            .par_iter()
            .zip(plan.slots.par_iter_mut())
            .for_each(|(rows, slot)| kernel().task(a, rows.clone(), &v, squares, slot));
        // Task order, whatever thread ran which task: the sums do not depend on the thread count.
        for slot in &plan.slots[..tasks.len()] {
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

/// The row kernels, compiled once for the baseline CPU and once for AVX2+FMA (chosen at run
/// time), so the loops vectorize without requiring a newer CPU.
#[derive(Clone, Copy)]
enum Kernel {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

fn kernel() -> Kernel {
    static KERNEL: OnceLock<Kernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Kernel::Avx2Fma;
        }
        Kernel::Baseline
    })
}

impl Kernel {
    fn task<const K: usize, S: RowSet<K>>(
        self,
        a: &S,
        rows: Range<usize>,
        v: &[Option<&[f32]>; K],
        squares: bool,
        slot: &mut Slot<K>,
    ) {
        match self {
            Kernel::Baseline => task::<K, S, false>(a, rows, v, squares, slot),
            // SAFETY: selected only when the CPU reports AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => unsafe { task_avx2(a, rows, v, squares, slot) },
        }
    }
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
        scratch,
    } = slot;
    *sums = [0.0; K];
    let ahead = PREFETCH_BYTES_AHEAD.div_ceil(n * 4).max(1);
    let mut pending = 0;
    for i in rows {
        a.prefetch_row(i + ahead);
        let (set, dots) = a.row_set_dots::<FMA>(i, need, v, scratch);
        for k in 0..K {
            if squares {
                sums[k] += squares_f64(set[k]);
            }
            if v[k].is_some() {
                let t = dots[k] as f32;
                for (s, x) in acc[k].iter_mut().zip(set[k]) {
                    *s = madd::<FMA>(t, *x, *s);
                }
            }
        }
        pending += 1;
        if pending == FLUSH_ROWS {
            flush(acc, products);
            pending = 0;
        }
    }
    if pending > 0 {
        flush(acc, products);
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
    use crate::linalg::rows::DenseRows;

    #[test]
    fn one_pass_gives_the_gram_product_and_the_squares() {
        // A = [[1, 2], [3, 4], [0, -1]]: AᵀA = [[10, 14], [14, 21]].
        let a = [1.0f32, 2.0, 3.0, 4.0, 0.0, -1.0];
        let dense = DenseRows::new(&a, 3, 2);
        let mut plan = Plan::new(3, 2);
        let r = pass(&dense, &mut plan, [Some(&[1.0, -1.0][..])], true);
        assert_eq!(r.products[0].as_deref(), Some(&[-4.0, -7.0][..]));
        assert_eq!(r.squares, [31.0]);
        let r = pass(&dense, &mut plan, [None], false);
        assert!(r.products[0].is_none() && r.squares == [0.0]);
    }

    #[test]
    fn tasks_depend_on_the_shape_only_and_cover_every_row() {
        for (m, n) in [(0, 5), (1, 1), (100, 3), (18944, 3584), (3584, 18944)] {
            let plan = Plan::<1>::new(m, n);
            assert!(plan.tasks.len() <= MAX_TASKS);
            let covered: usize = plan.tasks.iter().map(|t| t.len()).sum();
            assert_eq!(covered, m);
            assert!(plan.tasks.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}
