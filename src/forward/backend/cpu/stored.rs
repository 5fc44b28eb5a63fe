//! Linear layers on weights kept as stored (bf16, f16 or f32 bytes, as mapped from safetensors),
//! for decoding: a step runs every layer on one token, so a linear layer is a matrix-vector
//! product whose cost is reading the weights once. Decoding them to f32 first would read them,
//! write twice their bf16 size and read that again; the GEMV kernel here reads the stored bytes
//! once and widens them in registers (bf16 and f16 to f32 are exact, so the products are f32 math
//! on the decoded weights; only the summation order differs from [`linear`]).
//!
//! Summation order, the same in both builds: each output `y[r, o] = x[r, :]·w[o, :]` is 32
//! lanes (four AVX2 vectors), lane `l` accumulating the products of the inner indices
//! `k ≡ l (mod 32)` of the whole 32-chunks in increasing `k`; the four vectors are added as
//! `(v0 + v1) + (v2 + v3)`, their 8 lanes as `(l, l+4)`, then `(l, l+2)`, then `(0, 1)`; then the
//! remaining `n_in mod 32` products are added in order. The AVX2 build fuses every multiply-add,
//! the scalar build (no AVX2+FMA+F16C) does not ([`crate::linalg::simd`]), so the two differ by
//! rounding alone. Each output is computed by one thread in that order, whatever the blocks and
//! the thread count: results are bit-identical on any number of threads.
//!
//! Each weight row is read start to end before the next, one sequential stream per thread: on
//! this crate's 2-core Zen 4 VM, tiles of 2 or 4 rows read side by side (each `x` load shared by
//! the rows) ran at 35-45% of the read bandwidth on 896-wide rows, one row at a time at 90-100%;
//! software prefetch made it slower (examples/read_bandwidth.rs measures the kernel).

use rayon::prelude::*;
use safetensors::Dtype;

use super::linear;
use crate::bail;
use crate::error::Result;
use crate::linalg::simd::{avx2_fma, madd};

/// The largest `rows` the GEMV kernel takes; above it the weights are decoded to f32 and faer's
/// GEMM runs ([`linear`]), whose bits a prefill then has. Past 2 rows the kernel is compute-bound
/// (each pair of `x` rows passes over the weight row again, from L1) but still reads the weights
/// from memory once, while the decode to f32 costs 5x the bf16 bytes in memory traffic: a
/// 0.5B-shaped bf16 pass (`read_bandwidth --sweep`, 2 threads on the 2-core Zen 4 VM, loaded)
/// took 270 / 419 / 798 ms in the kernel at 8 / 16 / 32 rows, 608 / 748 / 994 ms decoded.
/// 16 keeps a clear margin; at 32 the kernel was 20% ahead in one run, near the noise here.
pub const GEMV_MAX_ROWS: usize = 16;

/// `x` rows per pass over a weight row: 2 x 4 accumulators, the weight vector and the `x`
/// vectors fit AVX2's 16 registers.
const X_GROUP: usize = 2;

/// Lanes of an AVX2 f32 vector.
const LANES: usize = 8;

/// Accumulator vectors per output: independent chains that cover the FMA latency (4 cycles on
/// Zen 4 and recent Intel) at one weight vector per cycle.
const CHAINS: usize = 4;

/// Inner indices per step of the summation order (module docs).
const STEP: usize = LANES * CHAINS;

/// Weight bytes per parallel block (whole rows): small enough that a 896-wide matrix gives a few
/// dozen blocks to balance over the threads, large enough that the per-block overhead is noise
/// against reading it.
const BLOCK_BYTES: usize = 64 << 10;

/// The stored element types the kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Bf16,
    F16,
    F32,
}

impl Kind {
    fn of(dtype: Dtype) -> Option<Kind> {
        Some(match dtype {
            Dtype::BF16 => Kind::Bf16,
            Dtype::F16 => Kind::F16,
            Dtype::F32 => Kind::F32,
            _ => return None,
        })
    }

    fn size(self) -> usize {
        match self {
            Kind::Bf16 | Kind::F16 => 2,
            Kind::F32 => 4,
        }
    }

    /// The f32 value of the element at the start of `b`.
    #[inline(always)]
    fn scalar(self, b: &[u8]) -> f32 {
        match self {
            Kind::Bf16 => f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
            Kind::F16 => half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            Kind::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

/// `x Wᵀ`: `x` is `[rows, n_in]` f32, `w` the `[n_out, n_in]` weight as stored (little-endian
/// BF16, F16 or F32 bytes); returns `[rows, n_out]` in f32, unrounded. Up to [`GEMV_MAX_ROWS`]
/// rows run the GEMV kernel on the stored bytes; more decode `w` to f32 and run [`linear`], so a
/// prefill gives exactly the bits of the f32 pass. Other dtypes are an error; shapes that do not
/// match the slices panic, as in [`linear`].
pub fn linear_stored(
    x: &[f32],
    rows: usize,
    w: &[u8],
    dtype: Dtype,
    n_out: usize,
    n_in: usize,
) -> Result<Vec<f32>> {
    let Some(kind) = Kind::of(dtype) else {
        bail!("a linear layer's weight cannot be {dtype:?}: BF16, F16 or F32 only");
    };
    assert_eq!(x.len(), rows * n_in, "linear input shape");
    assert_eq!(w.len(), n_out * n_in * kind.size(), "linear weight shape");
    if rows > GEMV_MAX_ROWS {
        let w = crate::dtype::decode(dtype, w, "linear weight")?;
        return Ok(linear(x, rows, &w, n_out, n_in));
    }
    let mut y = vec![0f32; rows * n_out];
    gemv(x, rows, w, kind, n_out, n_in, simd_available(), &mut y);
    Ok(y)
}

/// Whether the AVX2 build can run: AVX2 and FMA ([`avx2_fma`]) and F16C (every AVX2 CPU has it;
/// it is required for all dtypes so there is one feature set).
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_fma() && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        avx2_fma()
    }
}

/// A raw pointer to the output that the blocks share: each writes only its own columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: the blocks write disjoint elements (their own output columns), and `gemv` holds the
// `&mut` borrow until every block has finished.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// # Safety
    /// `i` is in the output, and no other block writes it.
    unsafe fn write(&self, i: usize, v: f32) {
        *self.0.add(i) = v;
    }
}

/// The GEMV into `y` (`[rows, n_out]`, `rows <= GEMV_MAX_ROWS`), in the AVX2 build when `simd`.
#[allow(clippy::too_many_arguments)]
fn gemv(
    x: &[f32],
    rows: usize,
    w: &[u8],
    kind: Kind,
    n_out: usize,
    n_in: usize,
    simd: bool,
    y: &mut [f32],
) {
    assert!(rows <= GEMV_MAX_ROWS && y.len() == rows * n_out);
    if rows == 0 || n_out == 0 {
        return;
    }
    let row_bytes = n_in * kind.size();
    let block = (BLOCK_BYTES / row_bytes.max(1)).max(1);
    let out = Out(y.as_mut_ptr());
    (0..n_out.div_ceil(block)).into_par_iter().for_each(|b| {
        for o in b * block..((b + 1) * block).min(n_out) {
            let w = &w[o * row_bytes..(o + 1) * row_bytes];
            for g in (0..rows).step_by(X_GROUP) {
                let group = X_GROUP.min(rows - g);
                let x = &x[g * n_in..(g + group) * n_in];
                let mut sums = [0f32; X_GROUP];
                row_sums(simd, kind, w, x, group, n_in, &mut sums);
                for (r, &v) in sums[..group].iter().enumerate() {
                    // SAFETY: `g + r < rows` and `o < n_out`, so the element is in `y`, and
                    // only this block writes column `o` (see `Out`).
                    unsafe { out.write((g + r) * n_out + o, v) };
                }
            }
        }
    });
}

/// `sums[r] = x[r]·w` for the weight row `w` and the `group` (1 or 2) rows of `x`, `n_in` each.
#[inline(always)]
fn row_sums(
    simd: bool,
    kind: Kind,
    w: &[u8],
    x: &[f32],
    group: usize,
    n_in: usize,
    sums: &mut [f32; X_GROUP],
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        macro_rules! run {
            ($d:expr) => {
                // SAFETY: `simd` is only set where `simd_available()` holds; `w` holds one row
                // and `x` `group` rows of `n_in`, as the kernel reads.
                unsafe {
                    if group == 2 {
                        *sums = avx2::row::<$d, 2>(w, x, n_in);
                    } else {
                        sums[0] = avx2::row::<$d, 1>(w, x, n_in)[0];
                    }
                }
            };
        }
        match kind {
            Kind::Bf16 => run!({ avx2::BF16 }),
            Kind::F16 => run!({ avx2::F16 }),
            Kind::F32 => run!({ avx2::F32 }),
        }
        return;
    }
    let _ = simd;
    for (r, s) in sums[..group].iter_mut().enumerate() {
        *s = dot_scalar(kind, w, &x[r * n_in..(r + 1) * n_in]);
    }
}

/// One output in the module's summation order, unfused.
fn dot_scalar(kind: Kind, w: &[u8], x: &[f32]) -> f32 {
    let size = kind.size();
    let whole = x.len() / STEP * STEP;
    let mut acc = [[0f32; LANES]; CHAINS];
    for (xc, wc) in x[..whole]
        .chunks_exact(STEP)
        .zip(w.chunks_exact(STEP * size))
    {
        for (c, acc) in acc.iter_mut().enumerate() {
            for (l, a) in acc.iter_mut().enumerate() {
                let k = c * LANES + l;
                *a = madd::<false, f32>(kind.scalar(&wc[k * size..]), xc[k], *a);
            }
        }
    }
    let mut s = lane_sum(acc);
    for k in whole..x.len() {
        s = madd::<false, f32>(kind.scalar(&w[k * size..]), x[k], s);
    }
    s
}

/// The chains added as the module docs say: `(v0 + v1) + (v2 + v3)`, then the lanes as
/// `(l, l+4)`, `(l, l+2)`, `(0, 1)`.
#[inline(always)]
fn lane_sum(a: [[f32; LANES]; CHAINS]) -> f32 {
    let v: [f32; LANES] = std::array::from_fn(|l| (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]));
    let h: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
    let q = [h[0] + h[2], h[1] + h[3]];
    q[0] + q[1]
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{lane_sum, Kind, CHAINS, LANES, STEP};
    use crate::linalg::simd::madd;

    pub const BF16: u8 = 0;
    pub const F16: u8 = 1;
    pub const F32: u8 = 2;

    const fn kind(d: u8) -> Kind {
        match d {
            BF16 => Kind::Bf16,
            F16 => Kind::F16,
            _ => Kind::F32,
        }
    }

    /// Eight stored values at `p` as f32: bf16 zero-extended and shifted into the high half,
    /// f16 by F16C's `vcvtph2ps`, f32 loaded.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const D: u8>(p: *const u8) -> __m256 {
        match D {
            BF16 => {
                let h = _mm_loadu_si128(p as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _ => _mm256_loadu_ps(p as *const f32),
        }
    }

    /// `x[r]·w` for the weight row `w` (stored `D` values) and `R` rows of `x`, each of `n_in`,
    /// in the module's summation order with fused multiply-adds.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `w` holds `n_in` values and `x` `R * n_in`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row<const D: u8, const R: usize>(w: &[u8], x: &[f32], n_in: usize) -> [f32; R] {
        let kind = const { kind(D) };
        let size = kind.size();
        debug_assert!(w.len() >= n_in * size && x.len() >= R * n_in);
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let whole = n_in / STEP * STEP;
        let mut acc = [[_mm256_setzero_ps(); CHAINS]; R];
        let mut k = 0;
        while k < whole {
            for c in 0..CHAINS {
                let wv = load8::<D>(wp.add((k + c * LANES) * size));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(xp.add(r * n_in + k + c * LANES));
                    acc[c] = _mm256_fmadd_ps(wv, xv, acc[c]);
                }
            }
            k += STEP;
        }
        let mut out = [0f32; R];
        for (r, (o, acc)) in out.iter_mut().zip(&acc).enumerate() {
            let mut lanes = [[0f32; LANES]; CHAINS];
            for (l, &a) in lanes.iter_mut().zip(acc) {
                _mm256_storeu_ps(l.as_mut_ptr(), a);
            }
            let mut s = lane_sum(lanes);
            let x = &x[r * n_in..];
            for k in whole..n_in {
                s = madd::<true, f32>(kind.scalar(&w[k * size..]), x[k], s);
            }
            *o = s;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 0.7312).sin() * 1.5)
            .collect()
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    /// `x Wᵀ` in f64 on the decoded weights, and `Σ|x w|` per output (the error scale).
    fn naive(x: &[f32], rows: usize, w: &[f32], n_out: usize, n_in: usize) -> (Vec<f64>, Vec<f64>) {
        let mut y = vec![0f64; rows * n_out];
        let mut scale = vec![0f64; rows * n_out];
        for r in 0..rows {
            for o in 0..n_out {
                for k in 0..n_in {
                    let p = x[r * n_in + k] as f64 * w[o * n_in + k] as f64;
                    y[r * n_out + o] += p;
                    scale[r * n_out + o] += p.abs();
                }
            }
        }
        (y, scale)
    }

    /// The f32 error bound of either build against the exact sum: the roundings on one output's
    /// path (its lane's chain, five sums of lanes, the tail, and one more for unfused products),
    /// each at most a unit roundoff of `Σ|x w|`.
    fn bound(n_in: usize, scale: f64) -> f64 {
        (n_in / STEP + 6 + n_in % STEP) as f64 * f32::EPSILON as f64 * 0.5 * scale * 1.01
            + f64::MIN_POSITIVE
    }

    const DTYPES: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

    #[test]
    fn matches_an_f64_product_for_every_dtype_and_odd_shape() {
        for dtype in DTYPES {
            for (n_out, n_in) in [(1, 37), (7, 8), (7, 203), (1000, 61), (13, 1)] {
                let w = crate::dtype::encode(dtype, &data(n_out * n_in, 0.5)).unwrap();
                let wf = crate::dtype::decode(dtype, &w, "w").unwrap();
                for rows in 1..=5 {
                    let x = data(rows * n_in, 3.0);
                    let (want, scale) = naive(&x, rows, &wf, n_out, n_in);
                    for simd in [false, true] {
                        if simd && !simd_available() {
                            continue;
                        }
                        let mut y = vec![0f32; rows * n_out];
                        gemv(
                            &x,
                            rows,
                            &w,
                            Kind::of(dtype).unwrap(),
                            n_out,
                            n_in,
                            simd,
                            &mut y,
                        );
                        for (i, (&y, (&want, &s))) in
                            y.iter().zip(want.iter().zip(&scale)).enumerate()
                        {
                            assert!(
                                (y as f64 - want).abs() <= bound(n_in, s),
                                "{dtype:?} {n_out}x{n_in} rows {rows} simd {simd} [{i}]: {y} vs {want}"
                            );
                        }
                    }
                    let y = linear_stored(&x, rows, &w, dtype, n_out, n_in).unwrap();
                    assert_eq!(y.len(), rows * n_out);
                }
            }
        }
    }

    #[test]
    fn more_rows_than_the_kernel_takes_give_the_bits_of_linear() {
        let (rows, n_out, n_in) = (GEMV_MAX_ROWS + 9, 300, 203);
        let x = data(rows * n_in, 1.0);
        for dtype in DTYPES {
            let w = crate::dtype::encode(dtype, &data(n_out * n_in, 2.0)).unwrap();
            let wf = crate::dtype::decode(dtype, &w, "w").unwrap();
            let y = linear_stored(&x, rows, &w, dtype, n_out, n_in).unwrap();
            assert!(y == linear(&x, rows, &wf, n_out, n_in), "{dtype:?}");
        }
    }

    #[test]
    fn one_and_two_threads_give_the_same_bits() {
        // Several blocks, an odd group of rows and a tail of the inner loop.
        let (n_out, n_in) = (1001, 903);
        assert!(n_out * n_in * 2 > 4 * BLOCK_BYTES);
        for dtype in DTYPES {
            let w = crate::dtype::encode(dtype, &data(n_out * n_in, 0.25)).unwrap();
            for rows in [1, 3, GEMV_MAX_ROWS] {
                let x = data(rows * n_in, 7.0);
                let run = |threads| {
                    pool(threads)
                        .install(|| linear_stored(&x, rows, &w, dtype, n_out, n_in).unwrap())
                };
                assert!(run(1) == run(2), "{dtype:?} rows {rows}");
            }
        }
    }

    #[test]
    fn scalar_and_simd_builds_agree_to_the_rounding_bound() {
        if !simd_available() {
            return;
        }
        let (n_out, n_in) = (257, 4867);
        for dtype in DTYPES {
            let w = crate::dtype::encode(dtype, &data(n_out * n_in, 4.0)).unwrap();
            let wf = crate::dtype::decode(dtype, &w, "w").unwrap();
            let rows = GEMV_MAX_ROWS;
            let x = data(rows * n_in, 5.0);
            let (_, scale) = naive(&x, rows, &wf, n_out, n_in);
            let [mut a, mut b] = [vec![0f32; rows * n_out], vec![0f32; rows * n_out]];
            let kind = Kind::of(dtype).unwrap();
            gemv(&x, rows, &w, kind, n_out, n_in, false, &mut a);
            gemv(&x, rows, &w, kind, n_out, n_in, true, &mut b);
            for ((a, b), s) in a.iter().zip(&b).zip(&scale) {
                assert!(
                    (*a as f64 - *b as f64).abs() <= 2.0 * bound(n_in, *s),
                    "{dtype:?}"
                );
            }
            // Products exact in f32 (small integers times 4-bit-mantissa weights) make fusing
            // change nothing, while magnitudes from 2^-10 to 2^10 make every sum depend on its
            // order: equal bits mean the two builds add in the same order.
            let xi: Vec<f32> = (0..rows * n_in).map(|i| (i % 7) as f32 - 3.0).collect();
            let wi: Vec<f32> = (0..n_out * n_in)
                .map(|i| (1.0 + (i % 8) as f32 / 8.0) * 2f32.powi((i * 7 % 21) as i32 - 10))
                .collect();
            let wi = crate::dtype::encode(dtype, &wi).unwrap();
            gemv(&xi, rows, &wi, kind, n_out, n_in, false, &mut a);
            gemv(&xi, rows, &wi, kind, n_out, n_in, true, &mut b);
            assert!(a == b, "{dtype:?}");
        }
    }

    #[test]
    fn other_dtypes_are_an_error_and_an_empty_inner_dimension_gives_zeros() {
        assert!(linear_stored(&[1.0], 1, &[0; 8], Dtype::F64, 1, 1).is_err());
        let y = linear_stored(&[], 2, &[], Dtype::BF16, 3, 0).unwrap();
        assert_eq!(y, [0.0; 6]);
    }
}
