//! Dot products with bounded f32 rounding: f32 products in [`LANES`] independent accumulators
//! over blocks of [`DOT_BLOCK`] values, each block's sum added into f64. Every function here sums
//! in exactly this order, so a fused kernel gives the same bits as decoding first and calling
//! [`dot_f32`].

/// Values per f32 partial dot product before it is added into f64 (bounds the f32 rounding).
const DOT_BLOCK: usize = 1024;
/// Independent f32 accumulators (a multiple of every SIMD width in use).
pub const LANES: usize = 32;

/// How far ahead of the row being read (in stored bytes) the passes ask the CPU to load
/// memory. The hardware prefetchers stop at every 4 KiB page boundary, which a pass over
/// page-cache memory crosses every few hundred nanoseconds; software prefetches do not. Measured
/// on the norms benchmark: 2 KiB ahead beat 1, 4, 16 and 32 KiB (2.08 s against 2.15-2.28 s).
pub const PREFETCH_AHEAD: usize = 2 << 10;

/// `a * b + c`, fused when the caller is compiled for FMA.
#[inline(always)]
pub fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

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
                acc[l] = madd::<FMA>(p[l], q[l], acc[l]);
            }
        }
        let mut s = 0f32;
        for (p, q) in xr.iter().zip(yr) {
            s = madd::<FMA>(*p, *q, s);
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>() + s as f64;
    }
    total
}

/// The f32 value of two little-endian bf16 bytes.
#[inline(always)]
pub fn bf16_bits(b: &[u8]) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
}

/// Decodes two rows of little-endian bf16 bytes `t` and `r` in one sweep, writing `d = t - r` and
/// `r` as f32, and returns `(d·vd, r·vr)` summed as [`dot_f32`] sums them: the drift's and the
/// reference's products of one lockstep pass without re-reading the decoded rows.
#[inline(always)]
pub fn diff_dots_bf16<const FMA: bool>(
    t: &[u8],
    r: &[u8],
    d: &mut [f32],
    rf: &mut [f32],
    vd: &[f32],
    vr: &[f32],
) -> (f64, f64) {
    let n = d.len();
    assert!(t.len() == 2 * n && r.len() == 2 * n && rf.len() == n);
    assert!(vd.len() == n && vr.len() == n);
    let (mut total_d, mut total_r) = (0f64, 0f64);
    for start in (0..n).step_by(DOT_BLOCK) {
        let end = (start + DOT_BLOCK).min(n);
        let whole = start + (end - start) / LANES * LANES;
        let (mut acc_d, mut acc_r) = ([0f32; LANES], [0f32; LANES]);
        #[cfg(target_arch = "x86_64")]
        let simd = FMA && has_avx2_fma();
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: AVX2 and FMA are present; the lengths were checked above.
            (acc_d, acc_r) = unsafe { diff_dots_avx2(t, r, d, rf, vd, vr, start..whole) };
        }
        for c in (start..whole).step_by(LANES).filter(|_| !simd) {
            let (tc, rc) = (&t[2 * c..2 * c + 2 * LANES], &r[2 * c..2 * c + 2 * LANES]);
            let (dc, rfc) = (&mut d[c..c + LANES], &mut rf[c..c + LANES]);
            let (vdc, vrc) = (&vd[c..c + LANES], &vr[c..c + LANES]);
            for l in 0..LANES {
                let rv = bf16_bits(&rc[2 * l..2 * l + 2]);
                let dv = bf16_bits(&tc[2 * l..2 * l + 2]) - rv;
                dc[l] = dv;
                rfc[l] = rv;
                acc_d[l] = madd::<FMA>(dv, vdc[l], acc_d[l]);
                acc_r[l] = madd::<FMA>(rv, vrc[l], acc_r[l]);
            }
        }
        let (mut s_d, mut s_r) = (0f32, 0f32);
        for j in whole..end {
            let rv = bf16_bits(&r[2 * j..2 * j + 2]);
            let dv = bf16_bits(&t[2 * j..2 * j + 2]) - rv;
            d[j] = dv;
            rf[j] = rv;
            s_d = madd::<FMA>(dv, vd[j], s_d);
            s_r = madd::<FMA>(rv, vr[j], s_r);
        }
        total_d += acc_d.iter().map(|&a| a as f64).sum::<f64>() + s_d as f64;
        total_r += acc_r.iter().map(|&a| a as f64).sum::<f64>() + s_r as f64;
    }
    (total_d, total_r)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// The whole-chunk part of [`diff_dots_bf16`] for `range` (a multiple of [`LANES`] long), in
/// AVX2: LLVM turns the portable loop's byte pairs into shuffles. Four 8-lane registers are
/// the 32 lanes, with the same fused multiply-adds, so the sums are the portable loop's bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn diff_dots_avx2(
    t: &[u8],
    r: &[u8],
    d: &mut [f32],
    rf: &mut [f32],
    vd: &[f32],
    vr: &[f32],
    range: std::ops::Range<usize>,
) -> ([f32; LANES], [f32; LANES]) {
    use std::arch::x86_64::*;
    const REGS: usize = LANES / 8;
    assert!(range.end <= d.len() && range.len() % LANES == 0);
    assert!(2 * d.len() <= t.len().min(r.len()) && d.len() <= rf.len().min(vd.len().min(vr.len())));
    let mut acc_d = [_mm256_setzero_ps(); REGS];
    let mut acc_r = [_mm256_setzero_ps(); REGS];
    // bf16 -> f32: widen the 16 bits to 32 and shift them into the high half.
    let widen = |p: *const u8| {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p as *const __m128i),
        )))
    };
    for c in range.step_by(LANES) {
        // One 64-byte line of each stored row per step, PREFETCH_AHEAD bytes on (past the end
        // of the row is the next row; a prefetch never faults).
        _mm_prefetch::<_MM_HINT_T0>(t.as_ptr().wrapping_add(2 * c + PREFETCH_AHEAD) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(r.as_ptr().wrapping_add(2 * c + PREFETCH_AHEAD) as *const i8);
        for q in 0..REGS {
            let j = c + 8 * q;
            let rv = widen(r.as_ptr().add(2 * j));
            let dv = _mm256_sub_ps(widen(t.as_ptr().add(2 * j)), rv);
            _mm256_storeu_ps(d.as_mut_ptr().add(j), dv);
            _mm256_storeu_ps(rf.as_mut_ptr().add(j), rv);
            acc_d[q] = _mm256_fmadd_ps(dv, _mm256_loadu_ps(vd.as_ptr().add(j)), acc_d[q]);
            acc_r[q] = _mm256_fmadd_ps(rv, _mm256_loadu_ps(vr.as_ptr().add(j)), acc_r[q]);
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
    use crate::checkpoint::dtype;
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
            let (unfused, fused) = (
                diff_dots_bf16::<false>(&t, &r, &mut d, &mut rf, &vd, &vr),
                // The SIMD kernel where the CPU has one.
                diff_dots_bf16::<true>(&t, &r, &mut d, &mut rf, &vd, &vr),
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
