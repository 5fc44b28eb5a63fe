//! Dot products with bounded f32 rounding: f32 products in [`LANES`] independent accumulators
//! over blocks of [`DOT_BLOCK`] values, each block's sum added into f64. Every function here sums
//! in exactly this order, so a fused kernel gives the same bits as decoding first and calling
//! [`dot_f32`].

/// Values per f32 partial dot product before it is added into f64 (bounds the f32 rounding).
const DOT_BLOCK: usize = 1024;
/// Independent f32 accumulators (a multiple of every SIMD width in use).
pub const LANES: usize = 32;

use super::simd::{self, madd};
use crate::dtype::bf16_to_f32;

/// How far ahead of the row being read (in stored bytes) the passes ask the CPU to load
/// memory. The hardware prefetchers stop at every 4 KiB page boundary, which a pass over
/// page-cache memory crosses every few hundred nanoseconds; software prefetches do not. 2 KiB
/// ahead was the fastest distance of 1 to 32 KiB on `benches/norms_vs_torch.sh`.
pub const PREFETCH_AHEAD: usize = 2 << 10;

/// x·y (see the module docs for the order of summation).
#[inline(always)]
pub fn dot_f32<const FMA: bool>(x: &[f32], y: &[f32]) -> f64 {
    let mut total = 0f64;
    for (xb, yb) in x.chunks(DOT_BLOCK).zip(y.chunks(DOT_BLOCK)) {
        let mut acc = [0f32; LANES];
        let (xc, yc) = (xb.chunks_exact(LANES), yb.chunks_exact(LANES));
        let (xr, yr) = (xc.remainder(), yc.remainder());
        for (p, q) in xc.zip(yc) {
            for l in 0..LANES {
                acc[l] = madd::<FMA, f32>(p[l], q[l], acc[l]);
            }
        }
        let mut s = 0f32;
        for (p, q) in xr.iter().zip(yr) {
            s = madd::<FMA, f32>(*p, *q, s);
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>() + s as f64;
    }
    total
}

/// One row of a bf16 drift and the same row of its reference, in a lockstep pass: the stored
/// bytes, where they are decoded to, and the Lanczos vector of each matrix.
pub struct DiffRowPair<'a> {
    /// TARGET's and REF's stored rows (little-endian bf16).
    pub target: &'a [u8],
    pub reference: &'a [u8],
    /// Written: `target - reference` and `reference`, as f32.
    pub diff: &'a mut [f32],
    pub reference_f32: &'a mut [f32],
    /// The vectors the two rows are dotted with.
    pub v_diff: &'a [f32],
    pub v_reference: &'a [f32],
}

impl DiffRowPair<'_> {
    fn check(&self) {
        let n = self.diff.len();
        assert!(self.target.len() == 2 * n && self.reference.len() == 2 * n);
        assert!(self.reference_f32.len() == n && self.v_diff.len() == n);
        assert!(self.v_reference.len() == n);
    }

    /// Decode and dot element `j`.
    #[inline(always)]
    fn element<const FMA: bool>(&mut self, j: usize, acc_d: &mut f32, acc_r: &mut f32) {
        let rv = bf16_to_f32(&self.reference[2 * j..2 * j + 2]);
        let dv = bf16_to_f32(&self.target[2 * j..2 * j + 2]) - rv;
        self.diff[j] = dv;
        self.reference_f32[j] = rv;
        *acc_d = madd::<FMA, f32>(dv, self.v_diff[j], *acc_d);
        *acc_r = madd::<FMA, f32>(rv, self.v_reference[j], *acc_r);
    }
}

/// Decodes the row pair in one sweep and returns `(diff·v_diff, reference·v_reference)`, summed
/// as [`dot_f32`] sums them: both products of a lockstep pass without re-reading the decoded rows.
#[inline(always)]
pub fn diff_dots_bf16<const FMA: bool>(pair: &mut DiffRowPair) -> (f64, f64) {
    pair.check();
    let n = pair.diff.len();
    let (mut total_d, mut total_r) = (0f64, 0f64);
    for start in (0..n).step_by(DOT_BLOCK) {
        let end = (start + DOT_BLOCK).min(n);
        let whole = start + (end - start) / LANES * LANES;
        let (mut acc_d, mut acc_r) = ([0f32; LANES], [0f32; LANES]);
        if !simd_chunks::<FMA>(pair, start..whole, &mut acc_d, &mut acc_r) {
            for c in (start..whole).step_by(LANES) {
                for l in 0..LANES {
                    pair.element::<FMA>(c + l, &mut acc_d[l], &mut acc_r[l]);
                }
            }
        }
        let (mut s_d, mut s_r) = (0f32, 0f32);
        for j in whole..end {
            pair.element::<FMA>(j, &mut s_d, &mut s_r);
        }
        total_d += acc_d.iter().map(|&a| a as f64).sum::<f64>() + s_d as f64;
        total_r += acc_r.iter().map(|&a| a as f64).sum::<f64>() + s_r as f64;
    }
    (total_d, total_r)
}

/// Runs the whole chunks of `range` through [`diff_dots_avx2`] when the sums are fused and the
/// CPU has AVX2 and FMA; false (nothing done) otherwise.
#[inline(always)]
fn simd_chunks<const FMA: bool>(
    pair: &mut DiffRowPair,
    range: std::ops::Range<usize>,
    acc_d: &mut [f32; LANES],
    acc_r: &mut [f32; LANES],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if FMA && simd::avx2_fma() {
        // SAFETY: AVX2 and FMA are present.
        (*acc_d, *acc_r) = unsafe { diff_dots_avx2(pair, range) };
        return true;
    }
    let _ = (pair, range, acc_d, acc_r);
    false
}

/// The whole-chunk part of [`diff_dots_bf16`] for `range` (a multiple of [`LANES`] long), in
/// AVX2: LLVM turns the portable loop's byte pairs into shuffles. Four 8-lane registers are
/// the 32 lanes, with the same fused multiply-adds, so the sums are the portable loop's bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn diff_dots_avx2(
    pair: &mut DiffRowPair,
    range: std::ops::Range<usize>,
) -> ([f32; LANES], [f32; LANES]) {
    use std::arch::x86_64::*;
    const REGS: usize = LANES / 8;
    pair.check();
    assert!(range.end <= pair.diff.len() && range.len().is_multiple_of(LANES));
    let (t, r) = (pair.target.as_ptr(), pair.reference.as_ptr());
    let (d, rf) = (pair.diff.as_mut_ptr(), pair.reference_f32.as_mut_ptr());
    let (vd, vr) = (pair.v_diff.as_ptr(), pair.v_reference.as_ptr());
    let mut acc_d = [_mm256_setzero_ps(); REGS];
    let mut acc_r = [_mm256_setzero_ps(); REGS];
    /// Eight bf16 values at `p` as f32: widen the 16 bits to 32 and shift them into the high
    /// half. A function always inlined here rather than a closure, which might not be inlined
    /// into this AVX2 context.
    #[inline(always)]
    unsafe fn widen(p: *const u8) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p as *const __m128i),
        )))
    }
    for c in range.step_by(LANES) {
        // One 64-byte line of each stored row per step, PREFETCH_AHEAD bytes on (past the end
        // of the row is the next row; a prefetch never faults).
        _mm_prefetch::<_MM_HINT_T0>(t.wrapping_add(2 * c + PREFETCH_AHEAD) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(2 * c + PREFETCH_AHEAD) as *const i8);
        for q in 0..REGS {
            let j = c + 8 * q;
            let rv = widen(r.add(2 * j));
            let dv = _mm256_sub_ps(widen(t.add(2 * j)), rv);
            _mm256_storeu_ps(d.add(j), dv);
            _mm256_storeu_ps(rf.add(j), rv);
            acc_d[q] = _mm256_fmadd_ps(dv, _mm256_loadu_ps(vd.add(j)), acc_d[q]);
            acc_r[q] = _mm256_fmadd_ps(rv, _mm256_loadu_ps(vr.add(j)), acc_r[q]);
        }
    }
    let lanes = |regs: [__m256; REGS]| {
        let mut out = [0f32; LANES];
        for (q, reg) in regs.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * q), *reg);
        }
        out
    };
    (lanes(acc_d), lanes(acc_r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype;
    use safetensors::Dtype;

    #[test]
    fn the_fused_kernel_gives_the_bits_of_decoding_then_dotting() {
        for n in [1, 31, 32, 100, 1024, 1057, 3000] {
            let value = |j: usize, s: f32| ((j as f32 * 0.37 + s).sin() * 3.0).round() / 8.0;
            let tv: Vec<f32> = (0..n).map(|j| value(j, 1.0)).collect();
            let rv: Vec<f32> = (0..n).map(|j| value(j, 2.0) * 0.5).collect();
            let vd: Vec<f32> = (0..n).map(|j| (j as f32 * 0.11).cos()).collect();
            let vr: Vec<f32> = (0..n).map(|j| (j as f32 * 0.07).sin()).collect();
            let (t, r) = (
                dtype::encode(Dtype::BF16, &tv).unwrap(),
                dtype::encode(Dtype::BF16, &rv).unwrap(),
            );
            let (mut d, mut rf) = (vec![0f32; n], vec![0f32; n]);
            let diff: Vec<f32> = tv.iter().zip(&rv).map(|(a, b)| a - b).collect();
            let mut pair = DiffRowPair {
                target: &t,
                reference: &r,
                diff: &mut d,
                reference_f32: &mut rf,
                v_diff: &vd,
                v_reference: &vr,
            };
            let (unfused, fused) = (
                diff_dots_bf16::<false>(&mut pair),
                // The SIMD kernel where the CPU has one.
                diff_dots_bf16::<true>(&mut pair),
            );
            let bits = |(x, y): (f64, f64)| (x.to_bits(), y.to_bits());
            let want_unfused = (dot_f32::<false>(&diff, &vd), dot_f32::<false>(&rv, &vr));
            let want_fused = (dot_f32::<true>(&diff, &vd), dot_f32::<true>(&rv, &vr));
            assert_eq!(bits(unfused), bits(want_unfused), "n = {n}");
            assert_eq!(bits(fused), bits(want_fused), "n = {n}");
            assert_eq!(d, diff);
            assert_eq!(rf, rv);
        }
    }
}
