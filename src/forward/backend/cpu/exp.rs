//! `exp` in f32, vectorised, with glibc's results bit for bit.
//!
//! The scorer's numbers were first produced with `f32::exp`, which is glibc's `expf`, and they
//! must not move by an ulp (docs/reference/forward.md, "CPU kernels"). glibc's x86-64 `expf`
//! (the FMA build, `__expf_fma`, from ARM's optimized-routines:
//! `sysdeps/ieee754/flt-32/e_expf.c`) reduces `x`
//! against a 32-entry table of `2^(i/32)`, evaluates a cubic in f64 and rounds once to f32. Every
//! step is an IEEE operation, so the same steps with the same fused multiply-adds give the same
//! bits in any lane of any vector unit. This module does them eight (AVX-512) or four (AVX2+FMA)
//! lanes at a time, and in scalar code with `f64::mul_add` elsewhere. A test compares every f32
//! input against the C library.
//!
//! Out-of-range inputs are handled explicitly, by comparisons and blends, before they reach the
//! arithmetic: above `ln(f32::MAX)` the result is `+inf`, below `ln(2⁻¹⁵⁰)` it is `+0` (glibc
//! reaches both through its error-reporting slow path), and NaN stays NaN. The arithmetic itself
//! only sees inputs in range, where every f64 intermediate is normal; the one rounding to f32 makes
//! the subnormal results of `[-103.97, -87.34]` as glibc does.

/// `tab[i] = bits(2^(i/32)) - (i << 47)`: adding `k << 47` for the reduction integer `k` gives
/// `2^(k/32)` (glibc's `__exp2f_data.tab`).
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// 32 / ln 2.
const INV_LN2_N: f64 = f64::from_bits(0x40471547652b82fe);
/// 1.5 · 2⁵²: adding it rounds to an integer held in the low mantissa bits.
const SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// The cubic's coefficients, scaled for the reduced argument `r` of `2^(r/32)`.
const C0: f64 = f64::from_bits(0x3ebc6af84b912394);
const C1: f64 = f64::from_bits(0x3f2ebfce50fac4f3);
const C2: f64 = f64::from_bits(0x3f962e42ff0c52d6);
/// Above this (0x1.62e42ep6 ≈ ln f32::MAX) the result overflows to `+inf`.
const OVERFLOW: f32 = f32::from_bits(0x42b17217);
/// Below this (-0x1.9fe368p6 ≈ ln 2⁻¹⁵⁰) the result rounds to `+0`.
const UNDERFLOW: f32 = f32::from_bits(0xc2cff1b4);

/// `eˣ`, equal bit for bit to glibc's `expf` (FMA build) for every input.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x + x;
    }
    if x > OVERFLOW {
        return f32::INFINITY;
    }
    if x < UNDERFLOW {
        return 0.0;
    }
    let xd = x as f64;
    let shifted = INV_LN2_N.mul_add(xd, SHIFT);
    let k = shifted.to_bits();
    let kd = shifted - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(TABLE[(k & 31) as usize].wrapping_add(k << 47));
    let z = C0.mul_add(r, C1);
    let y = C2.mul_add(r, 1.0);
    let y = z.mul_add(r * r, y);
    (y * s) as f32
}

/// `x ← eˣ` for every element, with [`exp`]'s results, eight or four lanes at a time where the
/// CPU allows.
pub fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return unsafe { x86::exp_avx512(xs) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { x86::exp_avx2(xs) };
        }
    }
    xs.iter_mut().for_each(|x| *x = exp(*x));
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{exp, C0, C1, C2, INV_LN2_N, OVERFLOW, SHIFT, TABLE, UNDERFLOW};

    /// Eight inputs as one ZMM register of f64 lanes.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn exp_avx512(xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let x = _mm256_loadu_ps(c.as_ptr());
            let xd = _mm512_cvtps_pd(clamp(x));
            let shifted = _mm512_fmadd_pd(_mm512_set1_pd(INV_LN2_N), xd, _mm512_set1_pd(SHIFT));
            let k = _mm512_castpd_si512(shifted);
            let kd = _mm512_sub_pd(shifted, _mm512_set1_pd(SHIFT));
            let r = _mm512_fmsub_pd(_mm512_set1_pd(INV_LN2_N), xd, kd);
            let index = _mm512_and_si512(k, _mm512_set1_epi64(31));
            let t = _mm512_i64gather_epi64::<8>(index, TABLE.as_ptr().cast());
            let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(k)));
            let z = _mm512_fmadd_pd(_mm512_set1_pd(C0), r, _mm512_set1_pd(C1));
            let y = _mm512_fmadd_pd(_mm512_set1_pd(C2), r, _mm512_set1_pd(1.0));
            let y = _mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y);
            let y = _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
            _mm256_storeu_ps(c.as_mut_ptr(), out_of_range(x, y));
        }
        chunks
            .into_remainder()
            .iter_mut()
            .for_each(|x| *x = exp(*x));
    }

    /// Eight inputs as two YMM registers of four f64 lanes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_avx2(xs: &mut [f32]) {
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let x = _mm256_loadu_ps(c.as_ptr());
            let xc = clamp(x);
            let low = four_lanes(_mm256_cvtps_pd(_mm256_castps256_ps128(xc)));
            let high = four_lanes(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(xc)));
            _mm256_storeu_ps(c.as_mut_ptr(), out_of_range(x, _mm256_set_m128(high, low)));
        }
        chunks
            .into_remainder()
            .iter_mut()
            .for_each(|x| *x = exp(*x));
    }

    /// [`super::exp`]'s arithmetic on four in-range inputs held as f64.
    #[inline(always)]
    unsafe fn four_lanes(xd: __m256d) -> __m128 {
        let shifted = _mm256_fmadd_pd(_mm256_set1_pd(INV_LN2_N), xd, _mm256_set1_pd(SHIFT));
        let k = _mm256_castpd_si256(shifted);
        let kd = _mm256_sub_pd(shifted, _mm256_set1_pd(SHIFT));
        let r = _mm256_fmsub_pd(_mm256_set1_pd(INV_LN2_N), xd, kd);
        let index = _mm256_and_si256(k, _mm256_set1_epi64x(31));
        let t = _mm256_i64gather_epi64::<8>(TABLE.as_ptr().cast(), index);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(k)));
        let z = _mm256_fmadd_pd(_mm256_set1_pd(C0), r, _mm256_set1_pd(C1));
        let y = _mm256_fmadd_pd(_mm256_set1_pd(C2), r, _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }

    /// `x` limited to `[UNDERFLOW, OVERFLOW]`, NaN to `UNDERFLOW`, so the arithmetic sees only
    /// inputs whose intermediates are normal f64 (`max_ps` returns its second operand for NaN).
    #[inline(always)]
    unsafe fn clamp(x: __m256) -> __m256 {
        _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(UNDERFLOW)),
            _mm256_set1_ps(OVERFLOW),
        )
    }

    /// `y` where `x` is in range; `+inf` above it, `+0` below it, `x + x` for NaN (glibc's
    /// results).
    #[inline(always)]
    unsafe fn out_of_range(x: __m256, y: __m256) -> __m256 {
        let above = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(OVERFLOW));
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(UNDERFLOW));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let y = _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), above);
        let y = _mm256_andnot_ps(below, y);
        _mm256_blendv_ps(y, _mm256_add_ps(x, x), nan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An implementation of [`exp_in_place`], by name.
    type Implementation = (&'static str, fn(&mut [f32]));

    /// Every implementation this CPU can run: the scalar one and each vector build.
    fn implementations() -> Vec<Implementation> {
        let mut all: Vec<Implementation> =
            vec![("scalar", |xs| xs.iter_mut().for_each(|x| *x = exp(*x)))];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA.
                all.push(("avx2", |xs| unsafe { x86::exp_avx2(xs) }));
            }
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                all.push(("avx512", |xs| unsafe { x86::exp_avx512(xs) }));
            }
        }
        all
    }

    /// Every `step`-th f32 bit pattern (all of them with `step` 1), through every implementation,
    /// against the C library's `expf` (which `f32::exp` calls).
    fn check_against_libm(step: usize) {
        let implementations = implementations();
        let mut batch = Vec::with_capacity(1 << 16);
        let mut bits = 0u64;
        while bits <= u32::MAX as u64 {
            batch.clear();
            while batch.len() < batch.capacity() && bits <= u32::MAX as u64 {
                batch.push(f32::from_bits(bits as u32));
                bits += step as u64;
            }
            for (name, implementation) in &implementations {
                let mut ours = batch.clone();
                implementation(&mut ours);
                for (&x, &y) in batch.iter().zip(&ours) {
                    let libm = x.exp();
                    assert!(
                        y.to_bits() == libm.to_bits() || (y.is_nan() && libm.is_nan()),
                        "{name} exp({x:e} = {:#x}) = {y:e}, libm {libm:e}",
                        x.to_bits()
                    );
                }
            }
        }
    }

    #[test]
    fn equals_libm_on_a_sample_of_every_exponent() {
        // 65537 is odd, so the sample walks through every exponent and sign, every low-bit
        // pattern class, and both ends of the range.
        check_against_libm(65537);
    }

    #[test]
    fn equals_libm_at_the_edges() {
        let edges = [
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::from_bits(1),
            OVERFLOW,
            f32::from_bits(OVERFLOW.to_bits() + 1),
            UNDERFLOW,
            f32::from_bits(UNDERFLOW.to_bits() + 1),
            f32::from_bits(UNDERFLOW.to_bits() - 1),
            -87.33655,
            -103.27893,
            88.0,
            -88.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
        ];
        // Each edge in every lane position and in the scalar remainder.
        let inputs: Vec<f32> = edges
            .iter()
            .cycle()
            .take(edges.len() * 8 + 3)
            .copied()
            .collect();
        for (name, implementation) in implementations() {
            let mut ours = inputs.clone();
            implementation(&mut ours);
            for (&x, &y) in inputs.iter().zip(&ours) {
                assert_eq!(y.to_bits(), x.exp().to_bits(), "{name} exp({x:e})");
            }
            let mut nan = [f32::NAN; 9];
            implementation(&mut nan);
            assert!(nan.iter().all(|v| v.is_nan()), "{name} exp(NaN)");
        }
    }

    /// All 2³² inputs through every implementation: about a minute per implementation in a
    /// release build (`cargo test --release --lib exp::tests -- --ignored`); `.ci/run` runs it.
    #[test]
    #[ignore = "exhaustive: run in release"]
    fn equals_libm_on_every_input() {
        check_against_libm(1);
    }
}
