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

/// Count NaN and infinite values in stored floating-point bytes without decoding: a value is
/// non-finite when its exponent bits are all ones (NaN if the mantissa is non-zero).
pub fn count_non_finite(dtype: Dtype, bytes: &[u8]) -> (u64, u64) {
    match dtype {
        Dtype::BF16 => scan::<2>(bytes, 0x7F80, 0x007F),
        Dtype::F16 => scan::<2>(bytes, 0x7C00, 0x03FF),
        Dtype::F32 => scan::<4>(bytes, 0x7F80_0000, 0x007F_FFFF),
        _ => (0, 0),
    }
}

/// Blocks are first checked with a branch-free count that vectorizes; the rare block holding a
/// non-finite value is then split into NaN and Inf.
fn scan<const N: usize>(bytes: &[u8], exp_mask: u32, mant_mask: u32) -> (u64, u64) {
    let load = |v: &[u8]| -> u32 {
        if N == 2 {
            u16::from_le_bytes([v[0], v[1]]) as u32
        } else {
            u32::from_le_bytes([v[0], v[1], v[2], v[3]])
        }
    };
    bytes
        .par_chunks(CHUNK * N)
        .map(|chunk| {
            let (mut nan, mut inf) = (0u64, 0u64);
            for block in chunk.chunks(4096 * N) {
                let special: u32 = block
                    .chunks_exact(N)
                    .map(|v| (load(v) & exp_mask == exp_mask) as u32)
                    .sum();
                if special == 0 {
                    continue;
                }
                for v in block.chunks_exact(N) {
                    let bits = load(v);
                    if bits & exp_mask == exp_mask {
                        if bits & mant_mask != 0 {
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
    }
}
