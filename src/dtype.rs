//! Conversions between stored dtypes and the f32 all math runs in.
//!
//! Decoding is memory-bound, so the loops are written to vectorize (bf16 is a 16-bit shift) and
//! large tensors are split over rayon workers. Encoding rounds to nearest-even, as torch does.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::Dtype;

use crate::bail;
use crate::error::Result;

/// Elements per parallel chunk: large enough that rayon's overhead is noise, small enough that
/// a 7B-class matrix spreads over every core.
const CHUNK: usize = 1 << 16;

/// Whether `dtype` can be decoded to f32 (and so merged, normed or scored).
pub fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

/// Bytes per element of a byte-aligned dtype.
pub fn byte_size(dtype: Dtype) -> usize {
    dtype.bitsize() / 8
}

/// The dtype name as configs spell it (`torch_dtype` / `dtype`).
pub fn torch_name(dtype: Dtype) -> Option<&'static str> {
    Some(match dtype {
        Dtype::F32 => "float32",
        Dtype::F16 => "float16",
        Dtype::BF16 => "bfloat16",
        _ => return None,
    })
}

/// Parse a dtype as users and configs spell it: `bf16`, `bfloat16`, `BF16`, `float16`, `fp32`, ...
pub fn parse_float_dtype(s: &str) -> Option<Dtype> {
    match s.to_ascii_lowercase().trim_start_matches("torch.") {
        "f32" | "fp32" | "float32" | "float" => Some(Dtype::F32),
        "f16" | "fp16" | "float16" | "half" => Some(Dtype::F16),
        "bf16" | "bfloat16" => Some(Dtype::BF16),
        _ => None,
    }
}

/// Decode `bytes` (little-endian `dtype` values) into `out`, which must hold exactly one f32 per
/// element. `what` names the tensor in errors.
pub fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut [f32], what: &str) -> Result<()> {
    if !is_float(dtype) {
        bail!("{what}: dtype {dtype:?} cannot be read as floating point");
    }
    let size = byte_size(dtype);
    if bytes.len() != out.len() * size {
        bail!(
            "{what}: {} bytes do not hold {} {dtype:?} values",
            bytes.len(),
            out.len()
        );
    }
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(CHUNK * size))
        .for_each(|(o, b)| decode_unchecked(dtype, b, o));
    Ok(())
}

/// Decode into a new vector.
pub fn decode(dtype: Dtype, bytes: &[u8], what: &str) -> Result<Vec<f32>> {
    let mut out = vec![0f32; bytes.len() / byte_size(dtype).max(1)];
    decode_into(dtype, bytes, &mut out, what)?;
    Ok(out)
}

/// The f32 value of two little-endian bf16 bytes (bf16 is the high half of an f32).
#[inline(always)]
pub fn bf16_to_f32(b: &[u8]) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
}

/// Decode little-endian `dtype` values into `out` without checks: the caller guarantees a float
/// dtype and one f32 of `out` per stored value. Always inlined, so it vectorizes for the
/// caller's target features (the AVX2 build of the row passes, [`crate::linalg::rows`]).
#[inline(always)]
pub fn decode_unchecked(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        Dtype::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(b);
            }
        }
        Dtype::F16 => {
            // half's bulk conversion uses F16C where the CPU has it, but needs aligned input.
            let mut bits = [f16::ZERO; 1024];
            for (o, b) in out.chunks_mut(1024).zip(bytes.chunks(2048)) {
                for (h, pair) in bits.iter_mut().zip(b.chunks_exact(2)) {
                    *h = f16::from_bits(u16::from_le_bytes([pair[0], pair[1]]));
                }
                bits[..o.len()].convert_to_f32_slice(o);
            }
        }
        Dtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        other => unreachable!("the caller admits float dtypes only, not {other:?}"),
    }
}

/// Encode f32 values as `dtype` bytes (round to nearest even for the 16-bit types).
pub fn encode(dtype: Dtype, values: &[f32]) -> Result<Vec<u8>> {
    if !is_float(dtype) {
        bail!("cannot write floating-point values as {dtype:?}");
    }
    let size = byte_size(dtype);
    let mut out = vec![0u8; values.len() * size];
    out.par_chunks_mut(CHUNK * size)
        .zip(values.par_chunks(CHUNK))
        .for_each(|(o, v)| encode_chunk(dtype, v, o));
    Ok(out)
}

/// Encode f32 values as `dtype` bytes into `out`, which must hold exactly one value per element
/// (for callers that fill a larger buffer piece by piece).
pub fn encode_into(dtype: Dtype, values: &[f32], out: &mut [u8]) -> Result<()> {
    if !is_float(dtype) {
        bail!("cannot write floating-point values as {dtype:?}");
    }
    let size = byte_size(dtype);
    if out.len() != values.len() * size {
        return Err(crate::internal!(
            "internal: {} bytes cannot hold {} {dtype:?} values",
            out.len(),
            values.len()
        ));
    }
    out.par_chunks_mut(CHUNK * size)
        .zip(values.par_chunks(CHUNK))
        .for_each(|(o, v)| encode_chunk(dtype, v, o));
    Ok(())
}

fn encode_chunk(dtype: Dtype, values: &[f32], out: &mut [u8]) {
    match dtype {
        Dtype::BF16 => {
            let mut tmp = [bf16::ZERO; 1024];
            for (v, o) in values.chunks(1024).zip(out.chunks_mut(2048)) {
                tmp[..v.len()].convert_from_f32_slice(v);
                for (x, b) in tmp.iter().zip(o.chunks_exact_mut(2)) {
                    b.copy_from_slice(&x.to_bits().to_le_bytes());
                }
            }
        }
        Dtype::F16 => {
            let mut tmp = [f16::ZERO; 1024];
            for (v, o) in values.chunks(1024).zip(out.chunks_mut(2048)) {
                tmp[..v.len()].convert_from_f32_slice(v);
                for (x, b) in tmp.iter().zip(o.chunks_exact_mut(2)) {
                    b.copy_from_slice(&x.to_bits().to_le_bytes());
                }
            }
        }
        Dtype::F32 => {
            for (v, b) in values.iter().zip(out.chunks_exact_mut(4)) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => unreachable!("checked by encode"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_is_exact_and_rounds_to_nearest_even() {
        let values: Vec<f32> = (0..5000).map(|i| (i as f32 - 2500.0) * 0.37).collect();
        let bytes = encode(Dtype::BF16, &values).unwrap();
        let back = decode(Dtype::BF16, &bytes, "t").unwrap();
        for (v, b) in values.iter().zip(&back) {
            assert_eq!(*b, bf16::from_f32(*v).to_f32());
        }
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even mantissa (1.0).
        let halfway = f32::from_bits(0x3F80_8000);
        let enc = encode(Dtype::BF16, &[halfway]).unwrap();
        assert_eq!(decode(Dtype::BF16, &enc, "t").unwrap()[0], 1.0);
    }

    #[test]
    fn f16_and_f32_round_trip() {
        // Quarter steps below 512 are exact in f16.
        let values: Vec<f32> = (0..2400).map(|i| i as f32 * 0.25 - 100.0).collect();
        for dtype in [Dtype::F16, Dtype::F32] {
            let back = decode(dtype, &encode(dtype, &values).unwrap(), "t").unwrap();
            assert!(back == values, "{dtype:?} round trip changed values");
        }
    }

    #[test]
    fn non_float_and_wrong_length_are_errors() {
        assert!(decode(Dtype::I64, &[0; 8], "t").is_err());
        let mut out = [0f32; 3];
        assert!(decode_into(Dtype::BF16, &[0; 4], &mut out, "t").is_err());
    }
}

/// Which stored values of a float dtype are NaN or Inf, as bit patterns: a value `bits` is
/// special when `bits & mask == value`, and then NaN when `bits & nan_bits != 0`, else infinite.
/// For the IEEE-style formats the mask is the exponent (all ones) and `nan_bits` the mantissa.
/// The 8-bit formats follow the OCP FP8 and MX specifications as torch stores them: E5M2 is
/// IEEE-style; E4M3 (torch's `float8_e4m3fn`) has no Inf and one NaN per sign, S.1111.111; the
/// FNUZ variants' only NaN is the negative-zero pattern 0x80; E8M0's is 0xFF. F4 and F6 have
/// neither NaN nor Inf. C64 is two F32s.
#[derive(Debug, Clone, Copy)]
struct Special {
    bytes: usize,
    mask: u64,
    value: u64,
    nan_bits: u64,
}

fn special(dtype: Dtype) -> Option<Special> {
    let ieee = |bytes, exp: u64, mant| Special {
        bytes,
        mask: exp,
        value: exp,
        nan_bits: mant,
    };
    Some(match dtype {
        Dtype::BF16 => ieee(2, 0x7F80, 0x007F),
        Dtype::F16 => ieee(2, 0x7C00, 0x03FF),
        Dtype::F32 | Dtype::C64 => ieee(4, 0x7F80_0000, 0x007F_FFFF),
        Dtype::F64 => ieee(8, 0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
        Dtype::F8_E5M2 => ieee(1, 0x7C, 0x03),
        Dtype::F8_E4M3 => ieee(1, 0x7F, 0x7F),
        Dtype::F8_E8M0 => ieee(1, 0xFF, 0xFF),
        Dtype::F8_E4M3FNUZ | Dtype::F8_E5M2FNUZ => Special {
            bytes: 1,
            mask: 0xFF,
            value: 0x80,
            nan_bits: 0x80,
        },
        _ => return None,
    })
}

impl Special {
    fn load(&self, v: &[u8]) -> u64 {
        let mut b = [0u8; 8];
        b[..v.len()].copy_from_slice(v);
        u64::from_le_bytes(b)
    }

    fn is_special(&self, bits: u64) -> bool {
        bits & self.mask == self.value
    }
}

/// Count NaN and infinite values in stored floating-point bytes without decoding (0 for
/// integer and boolean dtypes).
pub fn count_non_finite(dtype: Dtype, bytes: &[u8]) -> (u64, u64) {
    match special(dtype) {
        Some(s) => scan(bytes, s),
        None => (0, 0),
    }
}

/// The first NaN or Inf in stored floating-point bytes: its flat index and `NaN`, `inf` or
/// `-inf`. For messages, after [`count_non_finite`] found one.
pub fn first_non_finite(dtype: Dtype, bytes: &[u8]) -> Option<(usize, &'static str)> {
    let s = special(dtype)?;
    let (k, bits) = (bytes.chunks_exact(s.bytes).map(|v| s.load(v)).enumerate())
        .find(|&(_, bits)| s.is_special(bits))?;
    let sign = 1u64 << (8 * s.bytes - 1);
    let what = match (bits & s.nan_bits != 0, bits & sign != 0) {
        (true, _) => "NaN",
        (false, false) => "inf",
        (false, true) => "-inf",
    };
    // C64's elements are pairs: report the complex element.
    Some((if dtype == Dtype::C64 { k / 2 } else { k }, what))
}

/// Blocks are first checked with a branch-free count that vectorizes; the rare block holding a
/// non-finite value is then split into NaN and Inf.
fn scan(bytes: &[u8], s: Special) -> (u64, u64) {
    let n = s.bytes;
    bytes
        .par_chunks(CHUNK * n)
        .map(|chunk| {
            let (mut nan, mut inf) = (0u64, 0u64);
            for block in chunk.chunks(4096 * n) {
                let count: u32 = match n {
                    1 => count_special::<1>(block, s),
                    2 => count_special::<2>(block, s),
                    4 => count_special::<4>(block, s),
                    _ => count_special::<8>(block, s),
                };
                if count == 0 {
                    continue;
                }
                for v in block.chunks_exact(n) {
                    let bits = s.load(v);
                    if s.is_special(bits) {
                        if bits & s.nan_bits != 0 {
                            nan += 1;
                        } else {
                            inf += 1;
                        }
                    }
                }
            }
            (nan, inf)
        })
        .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// The special values in `block`, compared in integers of the element's own width so the loop
/// vectorizes with as many lanes as the width allows (a u64 compare of 2-byte elements ran at a
/// quarter of the lanes).
fn count_special<const N: usize>(block: &[u8], s: Special) -> u32 {
    macro_rules! count {
        ($t:ty) => {{
            let (mask, value) = (s.mask as $t, s.value as $t);
            (block.chunks_exact(N))
                .map(|v| {
                    let word = <$t>::from_le_bytes(v.try_into().expect("chunks of the width"));
                    (word & mask == value) as u32
                })
                .sum()
        }};
    }
    match N {
        1 => count!(u8),
        2 => count!(u16),
        4 => count!(u32),
        _ => count!(u64),
    }
}

#[cfg(test)]
mod scan_tests {
    use super::*;

    #[test]
    fn counts_nan_and_inf_per_dtype() {
        let values = [
            1.0f32,
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            0.0,
            65504.0,
        ];
        for dtype in [Dtype::BF16, Dtype::F16, Dtype::F32] {
            assert_eq!(
                count_non_finite(dtype, &encode(dtype, &values).unwrap()),
                (1, 2),
                "{dtype:?}"
            );
        }
        assert_eq!(
            first_non_finite(Dtype::F16, &encode(Dtype::F16, &values).unwrap()),
            Some((1, "NaN"))
        );
        assert_eq!(first_non_finite(Dtype::F32, &[0; 8]), None);
    }

    #[test]
    fn counts_nan_and_inf_of_f64_and_the_8_bit_formats() {
        let f64s: Vec<u8> = [1.0f64, f64::NAN, -f64::INFINITY, f64::MAX]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(Dtype::F64, &f64s), (1, 1));
        assert_eq!(first_non_finite(Dtype::F64, &f64s[16..]), Some((0, "-inf")));
        // E5M2: 0x7C is inf, 0x7D NaN, 0x7B (57344) the largest finite.
        assert_eq!(
            count_non_finite(Dtype::F8_E5M2, &[0x7B, 0x7C, 0xFC, 0x7D]),
            (1, 2)
        );
        // E4M3 (fn): 0x7E is 448, finite; only S.1111.111 is NaN.
        assert_eq!(
            count_non_finite(Dtype::F8_E4M3, &[0x7E, 0x78, 0x7F, 0xFF]),
            (2, 0)
        );
        // FNUZ: 0x80 is the one NaN; 0x7F and 0xFF are finite.
        for dtype in [Dtype::F8_E4M3FNUZ, Dtype::F8_E5M2FNUZ] {
            assert_eq!(count_non_finite(dtype, &[0x7F, 0xFF, 0x80, 0x00]), (1, 0));
        }
        assert_eq!(count_non_finite(Dtype::F8_E8M0, &[0xFE, 0xFF]), (1, 0));
        assert_eq!(count_non_finite(Dtype::I32, &[0xFF; 8]), (0, 0));
        let c64: Vec<u8> = [1.0f32, 2.0, 3.0, f32::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(first_non_finite(Dtype::C64, &c64), Some((1, "NaN")));
    }
}
