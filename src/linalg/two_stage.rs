//! Reduction of a symmetric matrix to tridiagonal form in two stages, for STAR's Gram matrices.
//!
//! The classic one-stage reduction (faer's `tridiag_in_place`, LAPACK's `dsytrd`) reads the
//! whole trailing matrix once per column: it is bound by memory bandwidth, and two running at
//! once (one per task) slow each other down. Two stages move most of the work into matrix
//! products (the structure of LAPACK's `dsytrd_sy2sb` + `dsytrd_sb2st`):
//! 1. dense to band of half-bandwidth `b`: the QR factorization of each panel of `b` columns
//!    below the band gives a block reflector `Q = I - V S Vᵀ`, and the trailing matrix becomes
//!    `Qᵀ A Q` through one symmetric product and one symmetric rank-2b update;
//! 2. band to tridiagonal by bulge chasing: a reflector of length `b` zeroes a column of the
//!    band, and the fill it creates below the band (the bulge) is chased down the diagonal by
//!    further reflectors, each touching only a `b x b` block. Work is O(n² b) on data that stays
//!    in cache.
//!
//! Both stages are orthogonal similarity transformations, so the eigenvalues carry the same
//! kind of backward error as the one-stage reduction (a small multiple of `n·eps·||A||`; the
//! tests measure it). Eigenvectors are formed on demand, for the few columns a caller needs,
//! by applying both stages' reflectors in reverse ([`TwoStage::back_transform`]).

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::matmul::matmul;
use faer::linalg::matmul::triangular::{self, BlockStructure};
use faer::linalg::qr::no_pivoting::factor::{qr_in_place, qr_in_place_scratch};
use faer::{Accum, Mat, MatMut, MatRef, Par};

use super::simd::{self, axpy, dot, madd};

/// Half-bandwidth of the intermediate band matrix. Stage 1's products get faster with wider
/// panels, stage 2's chase slower (its work grows as `b`); on a 3584 x 3584 Gram matrix the sum
/// is flat from 32 to 48 and slower outside (`cargo bench --bench merge_kernels`, `two_stage`).
pub const BAND: usize = 32;

/// The tridiagonal form `T = Qᵀ A Q` of a symmetric matrix, with `Q` kept as the reflectors of
/// both stages.
pub struct TwoStage {
    pub diag: Vec<f64>,
    /// `subdiag[i] = T[i + 1, i]`.
    pub subdiag: Vec<f64>,
    panels: Vec<Panel>,
    chase: Vec<Reflector>,
    /// The chase reflectors' vectors, concatenated (each starts with its implicit 1).
    chase_vectors: Vec<f64>,
}

/// A block reflector of stage 1, `I - V S Vᵀ` on rows `offset..`.
struct Panel {
    offset: usize,
    v: Mat<f64>,
    s: Mat<f64>,
}

/// A reflector of stage 2, `I - tau v vᵀ` on rows `offset..offset + len`, `v` at
/// `chase_vectors[start..start + len]`.
struct Reflector {
    offset: usize,
    start: usize,
    len: usize,
    tau: f64,
}

impl TwoStage {
    /// Reduce the symmetric matrix whose lower triangle is `lower` (the upper triangle is not
    /// read; the matrix is overwritten).
    pub fn reduce(mut lower: Mat<f64>, band: usize) -> TwoStage {
        let n = lower.nrows();
        assert!(band >= 1 && lower.ncols() == n);
        let panels = reduce_to_band(&mut lower, band);
        let mut chased = BandMatrix::from_lower(lower.as_ref(), band);
        drop(lower);
        let (chase, chase_vectors) = chase(&mut chased);
        let diag = (0..n).map(|i| chased.get(i, i)).collect();
        let subdiag = (0..n.saturating_sub(1))
            .map(|i| chased.get(i + 1, i))
            .collect();
        TwoStage {
            diag,
            subdiag,
            panels,
            chase,
            chase_vectors,
        }
    }

    /// `Q z` for vectors `z` of the tridiagonal form (one per column): eigenvectors of `T`
    /// become eigenvectors of the original matrix.
    pub fn back_transform(&self, mut z: Mat<f64>) -> Mat<f64> {
        // Q = Q1 Q2, Q2 = H_1 H_2 ... H_N: the last chase reflector acts first. Each touches
        // `len` rows of every vector, so the vectors are held as rows (zᵀ, rows contiguous):
        // the updates then run along the k vectors at once.
        let (n, k) = z.shape();
        if k > 0 && !self.chase.is_empty() {
            let mut rows: Vec<f64> = (0..n)
                .flat_map(|i| (0..k).map(move |j| (i, j)))
                .map(|(i, j)| z[(i, j)])
                .collect();
            apply_chase(&self.chase, &self.chase_vectors, &mut rows, k);
            z = Mat::from_fn(n, k, |i, j| rows[i * k + j]);
        }
        // Q1 = P_0 P_1 ...: the last panel acts first.
        for p in self.panels.iter().rev() {
            let (m, w) = p.v.shape();
            let k = z.ncols();
            let mut rows = z.as_mut().subrows_mut(p.offset, m);
            let mut vtz = Mat::<f64>::zeros(w, k);
            matmul(
                vtz.as_mut(),
                Accum::Replace,
                p.v.transpose(),
                rows.as_ref(),
                1.0,
                Par::Seq,
            );
            let mut svtz = Mat::<f64>::zeros(w, k);
            matmul(
                svtz.as_mut(),
                Accum::Replace,
                p.s.as_ref(),
                vtz.as_ref(),
                1.0,
                Par::Seq,
            );
            matmul(
                rows.as_mut(),
                Accum::Add,
                p.v.as_ref(),
                svtz.as_ref(),
                -1.0,
                Par::Seq,
            );
        }
        z
    }
}

// Stage 2 and its back-transformation are short loops over band columns, which vectorize well
// only in the AVX2 and FMA build ([`simd`]; `cargo bench --bench merge_kernels` times the
// reduction): both are compiled twice and picked at run time.

/// Stage 2 on `band`: its reflectors and their concatenated vectors.
fn chase(band: &mut BandMatrix) -> (Vec<Reflector>, Vec<f64>) {
    #[cfg(target_arch = "x86_64")]
    if simd::avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { chase_avx2(band) };
    }
    band.chase_to_tridiagonal::<false>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chase_avx2(band: &mut BandMatrix) -> (Vec<Reflector>, Vec<f64>) {
    band.chase_to_tridiagonal::<true>()
}

/// `H_1 ... H_N` applied to vectors stored as rows (row i at `rows[i·k..(i+1)·k]`).
fn apply_chase(chase: &[Reflector], vectors: &[f64], rows: &mut [f64], k: usize) {
    #[cfg(target_arch = "x86_64")]
    if simd::avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { apply_chase_avx2(chase, vectors, rows, k) };
    }
    apply_chase_with::<false>(chase, vectors, rows, k)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn apply_chase_avx2(chase: &[Reflector], vectors: &[f64], rows: &mut [f64], k: usize) {
    apply_chase_with::<true>(chase, vectors, rows, k)
}

#[inline(always)]
fn apply_chase_with<const FMA: bool>(
    chase: &[Reflector],
    vectors: &[f64],
    rows: &mut [f64],
    k: usize,
) {
    let mut w = vec![0.0; k];
    for r in chase.iter().rev() {
        let v = &vectors[r.start..r.start + r.len];
        let block = &mut rows[r.offset * k..(r.offset + r.len) * k];
        w.fill(0.0);
        for (&vi, x) in v.iter().zip(block.chunks_exact(k)) {
            axpy::<FMA>(vi, x, &mut w);
        }
        for (&vi, x) in v.iter().zip(block.chunks_exact_mut(k)) {
            axpy::<FMA>(-r.tau * vi, &w, x);
        }
    }
}

/// Stage 1: reduce the lower triangle of `a` to half-bandwidth `b` in place (entries below the
/// band are left as zeros), returning the block reflectors in the order applied.
fn reduce_to_band(a: &mut Mat<f64>, b: usize) -> Vec<Panel> {
    let n = a.nrows();
    let mut panels = Vec::new();
    let mut j = 0;
    // A panel needs at least two rows below the band for there to be anything to zero.
    while j + b + 1 < n {
        let offset = j + b;
        let m = n - offset;
        let (v, s) = {
            let mut panel = a.as_mut().submatrix_mut(offset, j, m, b);
            let original = panel.to_owned();
            faer_panel_qr(panel.as_mut()).unwrap_or_else(|| {
                panel.copy_from(original.as_ref());
                panel_qr(panel)
            })
        };
        symmetric_update(a.as_mut().submatrix_mut(offset, offset, m, m), &v, &s);
        panels.push(Panel { offset, v, s });
        j += b;
    }
    panels
}

/// `A <- Qᵀ A Q` for `Q = I - V S Vᵀ`, on the lower triangle of symmetric `A`:
/// with `X = A V S` and `M = Sᵀ Vᵀ X` (symmetric), `Qᵀ A Q = A - V Yᵀ - Y Vᵀ` where
/// `Y = X - V M / 2`.
fn symmetric_update(mut a: MatMut<'_, f64>, v: &Mat<f64>, s: &Mat<f64>) {
    let (m, w) = v.shape();
    // A V from the lower triangle: (L + strict Lᵀ) V.
    let mut av = Mat::<f64>::zeros(m, w);
    triangular::matmul(
        av.as_mut(),
        BlockStructure::Rectangular,
        Accum::Replace,
        a.as_ref(),
        BlockStructure::TriangularLower,
        v.as_ref(),
        BlockStructure::Rectangular,
        1.0,
        Par::Seq,
    );
    triangular::matmul(
        av.as_mut(),
        BlockStructure::Rectangular,
        Accum::Add,
        a.as_ref().transpose(),
        BlockStructure::StrictTriangularUpper,
        v.as_ref(),
        BlockStructure::Rectangular,
        1.0,
        Par::Seq,
    );
    let mut x = Mat::<f64>::zeros(m, w);
    matmul(
        x.as_mut(),
        Accum::Replace,
        av.as_ref(),
        s.as_ref(),
        1.0,
        Par::Seq,
    );
    let mut vtx = Mat::<f64>::zeros(w, w);
    matmul(
        vtx.as_mut(),
        Accum::Replace,
        v.transpose(),
        x.as_ref(),
        1.0,
        Par::Seq,
    );
    let mut half_m = Mat::<f64>::zeros(w, w);
    matmul(
        half_m.as_mut(),
        Accum::Replace,
        s.transpose(),
        vtx.as_ref(),
        0.5,
        Par::Seq,
    );
    // [V Y] and [Y V]: one rank-2w update of the lower triangle.
    let mut vy = Mat::<f64>::zeros(m, 2 * w);
    let mut yv = Mat::<f64>::zeros(m, 2 * w);
    vy.as_mut().subcols_mut(0, w).copy_from(v.as_ref());
    yv.as_mut().subcols_mut(w, w).copy_from(v.as_ref());
    {
        let mut y = vy.as_mut().subcols_mut(w, w);
        y.copy_from(x.as_ref());
        matmul(
            y.as_mut(),
            Accum::Add,
            v.as_ref(),
            half_m.as_ref(),
            -1.0,
            Par::Seq,
        );
    }
    let y = vy.as_ref().subcols(w, w).to_owned();
    yv.as_mut().subcols_mut(0, w).copy_from(y.as_ref());
    triangular::matmul(
        a.as_mut(),
        BlockStructure::TriangularLower,
        Accum::Add,
        vy.as_ref(),
        BlockStructure::Rectangular,
        yv.as_ref().transpose(),
        BlockStructure::Rectangular,
        -1.0,
        Par::Seq,
    );
}

/// [`panel_qr`] by faer's blocked QR, several times faster; None (the panel partly overwritten)
/// when faer found the panel rank-deficient, having then skipped columns (see [`panel_qr`]).
fn faer_panel_qr(mut panel: MatMut<'_, f64>) -> Option<(Mat<f64>, Mat<f64>)> {
    let (m, b) = panel.shape();
    let w = m.min(b);
    let mut factor = Mat::<f64>::zeros(w, w);
    let scratch = qr_in_place_scratch::<f64>(m, b, w, Par::Seq, Default::default());
    let info = qr_in_place(
        panel.as_mut(),
        factor.as_mut(),
        Par::Seq,
        MemStack::new(&mut MemBuffer::new(scratch)),
        Default::default(),
    );
    if info.rank < w {
        return None;
    }
    let v = Mat::<f64>::from_fn(m, w, |r, c| match r.cmp(&c) {
        std::cmp::Ordering::Less => 0.0,
        std::cmp::Ordering::Equal => 1.0,
        std::cmp::Ordering::Greater => panel[(r, c)],
    });
    for c in 0..b {
        for r in (c + 1)..m {
            panel[(r, c)] = 0.0;
        }
    }
    // faer's factor F gives H_0 ... H_{w-1} = I - V F⁻¹ Vᵀ.
    Some((v, upper_triangular_inverse(factor.as_ref())))
}

/// The inverse of an upper triangular matrix with a nonzero diagonal, by back substitution.
fn upper_triangular_inverse(t: MatRef<'_, f64>) -> Mat<f64> {
    let w = t.nrows();
    let mut s = Mat::<f64>::zeros(w, w);
    for j in 0..w {
        s[(j, j)] = 1.0 / t[(j, j)];
        for i in (0..j).rev() {
            let sum: f64 = ((i + 1)..=j).map(|k| t[(i, k)] * s[(k, j)]).sum();
            s[(i, j)] = -sum / t[(i, i)];
        }
    }
    s
}

/// The Householder QR factorization of a panel (LAPACK's `dgeqr2` + `dlarft`, forward and
/// columnwise), in place: the panel becomes R (zeros below its diagonal), and the returned `V`
/// (unit lower trapezoidal) and `T` (upper triangular) give `H_0 ... H_{w-1} = I - V T Vᵀ`.
/// For the panels faer's QR finds rank-deficient ([`faer_panel_qr`]): it skips a column whose
/// remaining norm is below a rank threshold and leaves that remainder in R, a backward error of up
/// to about `16·m·eps·||column||` per skipped column, outside what `GramEvd` budgets for the
/// reduction.
fn panel_qr(mut panel: MatMut<'_, f64>) -> (Mat<f64>, Mat<f64>) {
    let (m, b) = panel.shape();
    let w = m.min(b);
    let mut v = Mat::<f64>::zeros(m, w);
    let mut taus = vec![0.0; w];
    let mut reflector = vec![0.0; m];
    for c in 0..w {
        let len = m - c;
        let tau = householder(column(panel.as_mut(), c, c), &mut reflector);
        let h = &reflector[..len];
        for (r, &x) in h.iter().enumerate() {
            v[(c + r, c)] = x;
        }
        if tau != 0.0 {
            for k in (c + 1)..b {
                let col = column(panel.as_mut(), k, c);
                let d = tau * dot::<false>(h, col);
                axpy::<false>(-d, h, col);
            }
        }
        taus[c] = tau;
    }
    // dlarft: T[i, i] = tau_i, T[..i, i] = -tau_i T[..i, ..i] V[:, ..i]ᵀ v_i.
    let mut t = Mat::<f64>::zeros(w, w);
    for i in 0..w {
        t[(i, i)] = taus[i];
        if i == 0 || taus[i] == 0.0 {
            continue;
        }
        let z: Vec<f64> = (0..i)
            .map(|k| -taus[i] * (i..m).map(|r| v[(r, k)] * v[(r, i)]).sum::<f64>())
            .collect();
        for r in 0..i {
            t[(r, i)] = (r..i).map(|k| t[(r, k)] * z[k]).sum();
        }
    }
    (v, t)
}

/// Rows `first..` of column `c` of `a`, as a slice (faer matrices are column-major).
fn column(a: MatMut<'_, f64>, c: usize, first: usize) -> &mut [f64] {
    let rows = a.nrows() - first;
    a.col_mut(c)
        .subrows_mut(first, rows)
        .try_as_col_major_mut()
        .expect("faer columns are contiguous")
        .as_slice_mut()
}

/// The lower triangle of a symmetric band matrix with room for the bulge: entry `(i, j)`,
/// `0 <= i - j <= 2b`, at `i + j·2b` (LAPACK's band layout read with leading dimension
/// `2b + 1`), so every column segment is contiguous.
struct BandMatrix {
    data: Vec<f64>,
    n: usize,
    b: usize,
}

impl BandMatrix {
    fn from_lower(a: MatRef<'_, f64>, b: usize) -> BandMatrix {
        let n = a.nrows();
        let mut band = BandMatrix {
            data: vec![0.0; n * (2 * b + 1)],
            n,
            b,
        };
        for j in 0..n {
            for i in j..(j + b + 1).min(n) {
                let at = band.index(i, j);
                band.data[at] = a[(i, j)];
            }
        }
        band
    }

    #[inline]
    fn index(&self, i: usize, j: usize) -> usize {
        debug_assert!(i >= j && i - j <= 2 * self.b);
        i + j * 2 * self.b
    }

    fn get(&self, i: usize, j: usize) -> f64 {
        self.data[self.index(i, j)]
    }

    /// Rows `rows` of column `j`.
    #[inline(always)]
    fn column(&mut self, j: usize, rows: std::ops::RangeInclusive<usize>) -> &mut [f64] {
        let (start, end) = (self.index(*rows.start(), j), self.index(*rows.end(), j));
        &mut self.data[start..=end]
    }

    /// Stage 2 (`dsb2st`'s kernels, lower case): for each column c, a reflector zeroes rows
    /// `c+2..=c+b`; applying it from the right to the block below fills it (the bulge), whose
    /// first column the next reflector zeroes, and so on down the matrix. Returns the reflectors
    /// in the order applied and their concatenated vectors.
    #[inline(always)]
    fn chase_to_tridiagonal<const FMA: bool>(&mut self) -> (Vec<Reflector>, Vec<f64>) {
        let (n, b) = (self.n, self.b);
        let mut reflectors = Vec::new();
        let mut vectors = Vec::new();
        let mut v = vec![0.0; b];
        let mut work = vec![0.0; b];
        for c in 0..n.saturating_sub(2) {
            let (mut st, mut ed) = (c + 1, (c + b).min(n - 1));
            if ed <= st {
                continue;
            }
            let mut tau = householder(self.column(c, st..=ed), &mut v);
            self.two_sided::<FMA>(st, &v[..=ed - st], tau, &mut work);
            push(&mut reflectors, &mut vectors, st, &v[..=ed - st], tau);
            while ed + 1 < n {
                let (j1, j2) = (ed + 1, (ed + b).min(n - 1));
                self.right::<FMA>(j1..=j2, st..=ed, &v[..=ed - st], tau, &mut work);
                tau = householder(self.column(st, j1..=j2), &mut v);
                let vj = &v[..=j2 - j1];
                for j in (st + 1)..=ed {
                    let col = self.column(j, j1..=j2);
                    let d = tau * dot::<FMA>(vj, col);
                    axpy::<FMA>(-d, vj, col);
                }
                self.two_sided::<FMA>(j1, vj, tau, &mut work);
                push(&mut reflectors, &mut vectors, j1, vj, tau);
                (st, ed) = (j1, j2);
            }
        }
        (reflectors, vectors)
    }

    /// `D <- H D H` for the diagonal block `D` at rows and columns `start..start + v.len()`,
    /// `H = I - tau v vᵀ` (LAPACK's `dlarfy`): `w = tau D v - (tau²/2)(vᵀ D v) v`,
    /// `D <- D - v wᵀ - w vᵀ`.
    #[inline(always)]
    fn two_sided<const FMA: bool>(&mut self, start: usize, v: &[f64], tau: f64, work: &mut [f64]) {
        if tau == 0.0 {
            return;
        }
        let len = v.len();
        let w = &mut work[..len];
        w.fill(0.0);
        for j in 0..len {
            let col = self.column(start + j, start + j..=start + len - 1);
            // The diagonal, then the strict lower part of column j and its mirror.
            let (diagonal, below) = (col.split_first()).expect("the range starts at the diagonal");
            let sum = madd::<FMA, f64>(*diagonal, v[j], dot::<FMA>(below, &v[j + 1..]));
            axpy::<FMA>(v[j], below, &mut w[j + 1..]);
            w[j] += sum;
        }
        w.iter_mut().for_each(|x| *x *= tau);
        let alpha = -0.5 * tau * dot::<FMA>(w, v);
        axpy::<FMA>(alpha, v, w);
        for j in 0..len {
            let col = self.column(start + j, start + j..=start + len - 1);
            let (vj, wj) = (v[j], w[j]);
            axpy::<FMA>(-wj, &v[j..], col);
            axpy::<FMA>(-vj, &w[j..], col);
        }
    }

    /// `C <- C H` for the block `C` at `rows x cols`, `H = I - tau v vᵀ`.
    #[inline(always)]
    fn right<const FMA: bool>(
        &mut self,
        rows: std::ops::RangeInclusive<usize>,
        cols: std::ops::RangeInclusive<usize>,
        v: &[f64],
        tau: f64,
        work: &mut [f64],
    ) {
        if tau == 0.0 {
            return;
        }
        let w = &mut work[..rows.end() - rows.start() + 1];
        w.fill(0.0);
        for (k, j) in cols.clone().enumerate() {
            axpy::<FMA>(v[k], self.column(j, rows.clone()), w);
        }
        for (k, j) in cols.enumerate() {
            axpy::<FMA>(-tau * v[k], w, self.column(j, rows.clone()));
        }
    }
}

fn push(
    reflectors: &mut Vec<Reflector>,
    vectors: &mut Vec<f64>,
    offset: usize,
    v: &[f64],
    tau: f64,
) {
    if tau == 0.0 {
        return;
    }
    reflectors.push(Reflector {
        offset,
        start: vectors.len(),
        len: v.len(),
        tau,
    });
    vectors.extend_from_slice(v);
}

/// The 2-norm of `x` from its plain sum of squares, rescaled by the largest entry only where a
/// square could overflow or underflow: the chase builds tens of thousands of reflectors per
/// matrix, and a `hypot` per entry cost more than the chase's arithmetic (`perf`).
#[inline(always)]
fn norm2(x: &[f64]) -> f64 {
    let largest = x.iter().fold(0f64, |m, t| m.max(t.abs()));
    if largest == 0.0 || !largest.is_finite() {
        return largest;
    }
    if (1e-150..=1e150).contains(&largest) {
        return x.iter().map(|t| t * t).sum::<f64>().sqrt();
    }
    let inv = 1.0 / largest;
    largest * x.iter().map(|t| (t * inv) * (t * inv)).sum::<f64>().sqrt()
}

/// LAPACK's `dlarfg` on `x` (in place): `H = I - tau v vᵀ` with `v[0] = 1` maps `x` to
/// `beta e_0`; `x` becomes `(beta, 0, ..., 0)` and `v` (its first `x.len()` entries) is filled.
/// Returns `tau` (0 when `x` is already a multiple of `e_0`).
#[inline(always)]
fn householder(x: &mut [f64], v: &mut [f64]) -> f64 {
    let len = x.len();
    let v = &mut v[..len];
    v.fill(0.0);
    v[0] = 1.0;
    if len < 2 {
        return 0.0;
    }
    let tail_norm = norm2(&x[1..]);
    if tail_norm == 0.0 {
        return 0.0;
    }
    let alpha = x[0];
    let beta = -alpha.signum() * alpha.hypot(tail_norm);
    let scale = 1.0 / (alpha - beta);
    for (vi, &xi) in v[1..].iter_mut().zip(&x[1..]) {
        *vi = xi * scale;
    }
    x[0] = beta;
    x[1..].fill(0.0);
    (beta - alpha) / beta
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linalg::tridiagonal;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn symmetric(n: usize, seed: u64) -> Mat<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let x = Mat::<f64>::from_fn(n, n, |_, _| rng.random_range(-1.0..1.0));
        let mut g = Mat::<f64>::zeros(n, n);
        matmul(
            g.as_mut(),
            Accum::Replace,
            x.as_ref(),
            x.transpose(),
            1.0,
            Par::Seq,
        );
        g
    }

    /// Every eigenpair of the reduced matrix's tridiagonal form, through its reflectors: the
    /// eigenvalues (ascending), the eigenvectors of the original matrix, and `G Q - Q Λ`.
    fn eigenpairs(g: &Mat<f64>, band: usize) -> (Vec<f64>, Mat<f64>, Mat<f64>) {
        let reduced = TwoStage::reduce(g.clone(), band);
        let (values, z) = tridiagonal::evd(&reduced.diag, &reduced.subdiag).unwrap();
        let q = reduced.back_transform(z);
        let mut residual = Mat::<f64>::from_fn(q.nrows(), q.ncols(), |i, j| -q[(i, j)] * values[j]);
        matmul(
            residual.as_mut(),
            Accum::Add,
            g.as_ref(),
            q.as_ref(),
            1.0,
            Par::Seq,
        );
        (values, q, residual)
    }

    #[test]
    fn two_stage_reduction_keeps_the_spectrum_and_gives_eigenvectors() {
        for &(n, band, seed) in &[
            (1, 4, 1),
            (2, 4, 2),
            (5, 4, 3),
            (6, 4, 4),
            (37, 4, 5),
            (64, 8, 6),
            (100, 32, 7),
            (200, 16, 8),
            (33, 32, 9),
            (34, 32, 10),
        ] {
            let g = symmetric(n, seed);
            let reference = g.self_adjoint_eigen(faer::Side::Lower).unwrap();
            let expected: Vec<f64> = reference.S().column_vector().iter().copied().collect();
            let (values, q, residual) = eigenpairs(&g, band);
            let top = expected[n - 1];
            for (a, b) in values.iter().zip(&expected) {
                // GramEvd budgets 8·n·eps·top for the reduction's error; the two routes agree
                // to 0.6 of n·eps·top here with FMA, and a review measured up to 2.4 without.
                let ratio = (a - b).abs() / (f64::EPSILON * top * n as f64);
                assert!(ratio <= 4.0, "n {n} band {band}: {a} vs {b}");
            }
            // G Q = Q Λ and QᵀQ = I.
            let mut qtq = Mat::<f64>::zeros(n, n);
            matmul(
                qtq.as_mut(),
                Accum::Replace,
                q.transpose(),
                q.as_ref(),
                1.0,
                Par::Seq,
            );
            for j in 0..n {
                for i in 0..n {
                    let r = residual[(i, j)];
                    assert!(r.abs() <= 1e-12 * top, "n {n} band {band}: residual {r}");
                    let identity = if i == j { 1.0 } else { 0.0 };
                    assert!((qtq[(i, j)] - identity).abs() <= 1e-12, "n {n}: QᵀQ");
                }
            }
        }
    }

    #[test]
    fn the_baseline_chase_agrees_with_the_one_run_here() {
        // Only one of the two compiled chases runs on a given CPU; the baseline one is what
        // machines without AVX2 and FMA get.
        let n = 100;
        let mut a = symmetric(n, 12);
        reduce_to_band(&mut a, 8);
        let mut baseline = BandMatrix::from_lower(a.as_ref(), 8);
        let mut dispatched = BandMatrix::from_lower(a.as_ref(), 8);
        let (x, vectors) = baseline.chase_to_tridiagonal::<false>();
        let (y, _) = chase(&mut dispatched);
        assert_eq!(x.len(), y.len());
        // And their back-transformations, on 3 vectors held as rows.
        let rows: Vec<f64> = (0..3 * n)
            .map(|i| ((i * 7919) % 101) as f64 - 50.0)
            .collect();
        let (mut p, mut q) = (rows.clone(), rows);
        apply_chase_with::<false>(&x, &vectors, &mut p, 3);
        apply_chase(&x, &vectors, &mut q, 3);
        for (u, v) in p.iter().zip(&q) {
            assert!((u - v).abs() <= 1e-10, "{u} vs {v}");
        }
        let scale = (0..n).map(|i| a[(i, i)].abs()).fold(0f64, f64::max);
        for i in 0..n {
            assert!((baseline.get(i, i) - dispatched.get(i, i)).abs() <= 1e-12 * scale);
            if i + 1 < n {
                let (p, q) = (baseline.get(i + 1, i), dispatched.get(i + 1, i));
                assert!((p - q).abs() <= 1e-12 * scale, "{p} vs {q}");
            }
        }
    }

    #[test]
    fn a_rank_deficient_panel_keeps_the_backward_error_small() {
        // Rank one plus 1e-13 noise: faer's QR would skip the panel's columns past the first as
        // rank-deficient and leave their remainders in R ([`panel_qr`]). Here the residual is
        // about 6e-16 of ||G||.
        let n = 100;
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let x: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let noise = symmetric(n, 14);
        let g = Mat::<f64>::from_fn(n, n, |i, j| x[i] * x[j] + 1e-13 * noise[(i, j)]);
        let (values, _, residual) = eigenpairs(&g, 8);
        let top = values[n - 1];
        let worst = (0..n)
            .map(|j| residual.col(j).norm_l2())
            .fold(0f64, f64::max);
        assert!(worst <= 1e-14 * top, "residual {}", worst / top);
    }

    #[test]
    fn both_panel_factorizations_reproduce_the_panel() {
        let (m, b) = (40, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(15);
        let original = Mat::<f64>::from_fn(m, b, |_, _| rng.random_range(-1.0..1.0));
        let (mut ours, mut faers) = (original.clone(), original.clone());
        let factored = [
            panel_qr(ours.as_mut()),
            faer_panel_qr(faers.as_mut()).unwrap(),
        ];
        for ((v, t), r) in factored.iter().zip([&ours, &faers]) {
            // (I - V T Vᵀ) R = panel, R upper triangular.
            let vt = v * t;
            let qr = r - &vt * (v.transpose() * r);
            for j in 0..b {
                for i in 0..m {
                    assert!((qr[(i, j)] - original[(i, j)]).abs() <= 1e-13);
                    if i > j {
                        assert_eq!(r[(i, j)], 0.0);
                    }
                }
            }
        }
        // Rank one plus 1e-13 noise: faer's QR calls it rank-deficient, so it is not used.
        let x: Vec<f64> = (0..m).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut low = Mat::<f64>::from_fn(m, b, |i, j| {
            x[i] * (j + 1) as f64 + 1e-13 * original[(i, j)]
        });
        assert!(faer_panel_qr(low.as_mut()).is_none());
    }
}
