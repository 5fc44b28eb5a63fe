//! Rotary position embeddings as transformers computes them (`modeling_rope_utils.py`, 5.23):
//! inverse frequencies per rope type in f32, angles `f32(pos) * inv_freq` in f32, then cos/sin
//! times the attention scaling (YaRN only). HF's rotate-half (NeoX) layout: element `i` pairs
//! with `i + dim/2`, and the cos/sin table of length `dim` is two copies of a `dim/2` table, so
//! only the half table is stored.

use std::f64::consts::PI;

use super::backend::RopeTable;
use crate::arch::config::{Rope, RopeScaling, Yarn};
use crate::bail;
use crate::error::Result;

/// The resolved frequencies of one rope: what [`RopeTable`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct Frequencies {
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (so the logits by its square); 1 except for YaRN.
    pub attention_scaling: f32,
}

/// `1 / theta^(2i/dim)` as HF computes it: exponent in f32, power of the f32 base, f32 reciprocal.
fn default_inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / dim as f32;
            let power = ((theta as f32) as f64).powf(exponent as f64) as f32;
            1.0f32 / power
        })
        .collect()
}

/// Frequencies of `rope` for a head of `head_dim`, for sequences of `seq_len` tokens
/// (only dynamic NTK scaling depends on it) in a model with `max_position_embeddings`.
pub fn frequencies(
    rope: &Rope,
    head_dim: usize,
    max_position_embeddings: usize,
    seq_len: usize,
) -> Result<Frequencies> {
    if rope.partial_rotary_factor != 1.0 {
        bail!(
            "partial_rotary_factor {} is not supported (the scorer's architectures rotate the whole head)",
            rope.partial_rotary_factor
        );
    }
    let dim = head_dim;
    let theta = rope.theta;
    let plain = |inv_freq| Frequencies {
        inv_freq,
        attention_scaling: 1.0,
    };
    Ok(match &rope.scaling {
        RopeScaling::Default | RopeScaling::Mrope { .. } => plain(default_inv_freq(theta, dim)),
        RopeScaling::Linear { factor } => {
            let factor = *factor as f32;
            plain(
                default_inv_freq(theta, dim)
                    .into_iter()
                    .map(|f| f / factor)
                    .collect(),
            )
        }
        RopeScaling::Dynamic { factor, .. } => {
            // HF grows the base only once the sequence is longer than max_position_embeddings.
            let max_pos = max_position_embeddings as f64;
            let seq = (seq_len as f64).max(max_pos);
            let d = dim as f64;
            let base = theta * ((factor * seq / max_pos) - (factor - 1.0)).powf(d / (d - 2.0));
            plain(default_inv_freq(base, dim))
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = *original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            plain(
                default_inv_freq(theta, dim)
                    .into_iter()
                    .map(|f| {
                        let inv = f as f64;
                        let wavelen = 2.0 * PI / inv;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            (inv / factor) as f32
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            ((1.0 - smooth) * inv / factor + smooth * inv) as f32
                        }
                    })
                    .collect(),
            )
        }
        RopeScaling::Yarn(params) => yarn(theta, dim, params, max_position_embeddings),
        RopeScaling::Other { name } => {
            bail!("rope type `{name}` is not supported (supported: default, linear, dynamic, llama3, yarn)")
        }
    })
}

fn yarn(theta: f64, dim: usize, params: &Yarn, max_position_embeddings: usize) -> Frequencies {
    let Yarn {
        factor,
        original_max_position_embeddings,
        attention_factor,
        beta_fast,
        beta_slow,
        mscale,
        mscale_all_dim,
        truncate,
    } = *params;
    let original_max = original_max_position_embeddings.unwrap_or(max_position_embeddings);
    let get_mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor = attention_factor.unwrap_or(match (mscale, mscale_all_dim) {
        (Some(m), Some(a)) if m != 0.0 && a != 0.0 => get_mscale(factor, m) / get_mscale(factor, a),
        _ => get_mscale(factor, 1.0),
    });
    let d = dim as f64;
    let correction_dim = |rotations: f64| {
        d * (original_max as f64 / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min(d - 1.0);
    if low == high {
        high += 0.001;
    }
    let inv_freq = (0..dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / dim as f32;
            let pos_freq = ((theta as f32) as f64).powf(exponent as f64) as f32;
            let extrapolation = 1.0f32 / pos_freq;
            let interpolation = 1.0f32 / (factor as f32 * pos_freq);
            let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect();
    Frequencies {
        inv_freq,
        attention_scaling: attention_factor as f32,
    }
}

/// The tables of a decoder's rope; the table itself, as a backend applies it, is the backend's.
impl RopeTable {
    /// The table for positions `0..positions`.
    pub fn new(freq: &Frequencies, positions: usize) -> RopeTable {
        RopeTable::span(freq, 0..positions)
    }

    /// The table whose row `i` is position `positions.start + i` (the rows after a KV cache's).
    pub fn span(freq: &Frequencies, positions: std::ops::Range<usize>) -> RopeTable {
        let half = freq.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for t in positions {
            for &f in &freq.inv_freq {
                let angle = t as f32 * f;
                cos.push((angle as f64).cos() as f32 * freq.attention_scaling);
                sin.push((angle as f64).sin() as f32 * freq.attention_scaling);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// The M-RoPE table of one prompt (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): token `t` rotates
    /// frequency `j` by `positions[axis][t] · inv_freq[j]`, where the axis (temporal, height,
    /// width) of each frequency comes from `mrope_section`, in consecutive blocks (Qwen2/2.5:
    /// `apply_multimodal_rotary_pos_emb`) or interleaved `t h w t h w ...` over the first
    /// `3 · section` frequencies (Qwen3-VL: `apply_interleaved_mrope`). With equal positions on
    /// the three axes this is [`RopeTable::new`]'s table.
    pub fn mrope(
        freq: &Frequencies,
        positions: &[Vec<i64>; 3],
        sections: &[usize],
        interleaved: bool,
    ) -> RopeTable {
        let half = freq.inv_freq.len();
        let axis_of = |j: usize| -> usize {
            if interleaved {
                for axis in [1, 2] {
                    let len = sections.get(axis).copied().unwrap_or(0) * 3;
                    if j % 3 == axis && j < len {
                        return axis;
                    }
                }
                0
            } else {
                let mut end = 0;
                for (axis, &len) in sections.iter().enumerate() {
                    end += len;
                    if j < end {
                        return axis % 3;
                    }
                }
                // transformers' `split(mrope_section * 2)` needs the sections to cover every
                // frequency; a config whose sections fall short keeps the rest on the time axis.
                0
            }
        };
        let axes: Vec<usize> = (0..half).map(axis_of).collect();
        let angles: Vec<f32> = (0..positions[0].len())
            .flat_map(|t| {
                axes.iter()
                    .zip(&freq.inv_freq)
                    .map(move |(&axis, &f)| positions[axis][t] as f32 * f)
            })
            .collect();
        RopeTable::from_angles(half, &angles, freq.attention_scaling)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(scaling: RopeScaling) -> Rope {
        Rope {
            theta: 10000.0,
            partial_rotary_factor: 1.0,
            scaling,
        }
    }

    #[test]
    fn default_frequencies_halve_per_step_of_the_exponent() {
        let f = frequencies(&rope(RopeScaling::Default), 4, 512, 8).unwrap();
        assert_eq!(f.inv_freq, vec![1.0, 0.01]);
        assert_eq!(f.attention_scaling, 1.0);
    }

    #[test]
    fn linear_divides_and_dynamic_is_default_within_the_context() {
        let base = frequencies(&rope(RopeScaling::Default), 8, 512, 8).unwrap();
        let lin = frequencies(&rope(RopeScaling::Linear { factor: 2.0 }), 8, 512, 8).unwrap();
        for (a, b) in base.inv_freq.iter().zip(&lin.inv_freq) {
            assert_eq!(*b, a / 2.0);
        }
        let dynamic = RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: None,
        };
        assert_eq!(
            frequencies(&rope(dynamic.clone()), 8, 512, 100).unwrap(),
            base
        );
        let grown = frequencies(&rope(dynamic), 8, 16, 32).unwrap();
        assert!(grown.inv_freq[1] < base.inv_freq[1]);
        assert_eq!(grown.inv_freq[0], 1.0);
    }

    #[test]
    fn mrope_with_equal_axes_is_the_plain_table_and_sections_pick_the_axis() {
        let f = frequencies(&rope(RopeScaling::Default), 16, 512, 8).unwrap();
        let same: [Vec<i64>; 3] = std::array::from_fn(|_| (0..5).collect());
        for interleaved in [false, true] {
            let m = RopeTable::mrope(&f, &same, &[4, 2, 2], interleaved);
            assert_eq!(m, RopeTable::new(&f, 5));
        }
        // Only the height axis moves: the frequencies it owns rotate, the others stay at 0.
        let h_only = [vec![0i64; 2], vec![0, 3], vec![0i64; 2]];
        let blocks = RopeTable::mrope(&f, &h_only, &[4, 2, 2], false);
        let moved: Vec<usize> = (0..8).filter(|&j| blocks.sin[8 + j] != 0.0).collect();
        assert_eq!(moved, [4, 5]);
        let inter = RopeTable::mrope(&f, &h_only, &[4, 2, 2], true);
        let moved: Vec<usize> = (0..8).filter(|&j| inter.sin[8 + j] != 0.0).collect();
        assert_eq!(moved, [1, 4]);
    }

    #[test]
    fn rotation_preserves_the_norm_and_is_identity_at_zero() {
        let f = frequencies(&rope(RopeScaling::Default), 4, 512, 8).unwrap();
        let table = RopeTable::new(&f, 3);
        let mut x = [1.0, 2.0, 3.0, 4.0];
        table.apply(&mut x, 0);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0]);
        table.apply(&mut x, 2);
        let norm: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm - 30.0).abs() < 1e-4);
    }
}
