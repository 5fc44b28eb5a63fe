//! Linear layers over weights held in their stored dtype (the decode loop's resident weights).

use super::linear;
use crate::dtype;
use crate::error::Result;

/// `x Wᵀ` for `x` `[rows, n_in]` and `W` `[n_out, n_in]` stored as `dtype` bytes.
pub fn linear_stored(
    x: &[f32],
    rows: usize,
    w: &[u8],
    dtype: safetensors::Dtype,
    n_out: usize,
    n_in: usize,
) -> Result<Vec<f32>> {
    let w = dtype::decode(dtype, w, "a stored weight")?;
    Ok(linear(x, rows, &w, n_out, n_in))
}
