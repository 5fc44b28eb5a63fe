//! The second build of the hot loops. The crate is compiled for the baseline x86-64 CPU, so the
//! loops that dominate a pass are compiled once more with AVX2 and FMA enabled and chosen at run
//! time by [`avx2_fma`]. Kernels take `const FMA: bool`; with it every multiply-add is fused
//! ([`madd`]), which is the one way the two builds round differently, so a kernel's result is a
//! function of its input and `FMA` alone.
//!
//! Everything here is `#[inline(always)]`: a helper called rather than inlined would run without
//! the caller's AVX2 context, and its `mul_add` would become a call to a software fma.

use std::ops::{Add, Mul};

/// Whether the CPU has AVX2 and FMA (std caches the detection), so the `FMA = true` build of a
/// kernel may run under `#[target_feature(enable = "avx2,fma")]`.
#[inline(always)]
pub fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The float types the kernels run in.
pub trait MulAdd: Copy + Mul<Output = Self> + Add<Output = Self> {
    /// `self * b + c` with one rounding.
    fn fused_mul_add(self, b: Self, c: Self) -> Self;
}

impl MulAdd for f32 {
    #[inline(always)]
    fn fused_mul_add(self, b: f32, c: f32) -> f32 {
        self.mul_add(b, c)
    }
}

impl MulAdd for f64 {
    #[inline(always)]
    fn fused_mul_add(self, b: f64, c: f64) -> f64 {
        self.mul_add(b, c)
    }
}

/// `a * b + c`, fused when the caller is the FMA build.
#[inline(always)]
pub fn madd<const FMA: bool, T: MulAdd>(a: T, b: T, c: T) -> T {
    if FMA {
        a.fused_mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Independent sums of [`dot`], so its loop vectorizes (two AVX2 registers of f64).
const DOT_LANES: usize = 8;

/// x·y in [`DOT_LANES`] independent sums (lane `l` takes the entries `l mod DOT_LANES` of the
/// whole chunks, in order), added together, then the remainder's sum added.
#[inline(always)]
pub fn dot<const FMA: bool>(x: &[f64], y: &[f64]) -> f64 {
    debug_assert_eq!(x.len(), y.len());
    let mut acc = [0.0; DOT_LANES];
    let (xc, yc) = (x.chunks_exact(DOT_LANES), y.chunks_exact(DOT_LANES));
    let mut rest = 0.0;
    for (&a, &b) in xc.remainder().iter().zip(yc.remainder()) {
        rest = madd::<FMA, f64>(a, b, rest);
    }
    for (p, q) in xc.zip(yc) {
        for l in 0..DOT_LANES {
            acc[l] = madd::<FMA, f64>(p[l], q[l], acc[l]);
        }
    }
    acc.iter().sum::<f64>() + rest
}

/// y += alpha x.
#[inline(always)]
pub fn axpy<const FMA: bool>(alpha: f64, x: &[f64], y: &mut [f64]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = madd::<FMA, f64>(alpha, xi, *yi);
    }
}

/// Clears the upper halves of the vector registers (`vzeroupper`). Call it after a faer matrix
/// product, on the thread that ran it: faer's x86 kernels (the generated assembly of
/// `private-gemm-x86`) return with the upper halves of the ZMM registers dirty, and while they are,
/// every legacy-SSE instruction pays a state penalty. This crate is compiled for baseline x86-64,
/// so most of its code is SSE; on a Sapphire Rapids VM that penalty made libm's `expf` 50x slower
/// (docs/reference/forward.md, "CPU kernels"). Results are unchanged: no SSE value lives in the
/// cleared bits.
#[inline]
pub fn clear_upper_state() {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX. `clobber_abi("C")` marks every vector register as clobbered
        // (all are caller-saved in the SysV ABI), so no live value is held in one across this.
        unsafe {
            std::arch::asm!(
                "vzeroupper",
                clobber_abi("C"),
                options(nomem, nostack, preserves_flags)
            )
        };
    }
}
