//! The random-dW control of Appendix D.4: move every attention and MLP projection of a reference
//! model by Gaussian noise of exactly the size a target model moved it, and nothing else.
//!
//! For a projection W with target W_T, the noise is `G = s * Z`, `Z` i.i.d. standard normal from
//! the tensor's own seeded stream, and `s` is chosen so that the *stored* output matches the
//! target's drift: `||enc(W + G) - W||_F = ||W_T - W||_F`, where `enc` rounds to the tensor's
//! dtype. In f32 the first guess `s = ||W_T - W||_F / ||Z||_F` already matches to ~1e-7; in
//! bf16/f16, rounding W + G adds its own error, so `s` is refined by a secant search on `s^2`
//! (the realized squared drift is close to linear in it) until the relative mismatch is below
//! [`TOLERANCE`] or no longer improves.

use std::collections::HashMap;
use std::ops::Range;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use rayon::prelude::*;
use safetensors::Dtype;
use serde::Serialize;

use crate::arch::names::{self, Module, Param, TensorName};
use crate::arch::{config, TextConfig};
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;
use crate::linalg::tensor_rng;
use crate::{bad, bail};

/// Elements per block: the unit of parallel work, of summation order and of random streams
/// (block `b` draws from stream `b` of the tensor's generator), so results do not depend on
/// the thread count.
const BLOCK: usize = 1 << 16;

/// Relative mismatch between realized and target drift at which the search stops.
pub const TOLERANCE: f64 = 1e-5;

/// Refinement steps after the first guess.
const MAX_STEPS: usize = 30;

/// Whether a (standard) tensor name is one the control perturbs: the weight matrices of the
/// attention projections (q/k/v/o) and of the MLP (gate/up/down, dense or per expert). Biases,
/// norm scales, embeddings, the LM head and MoE routers are left as they are.
pub fn is_perturbed(name: &TensorName) -> bool {
    name.param == Param::Weight
        && (name.module.is_attention_projection() || name.module.is_mlp_projection())
        && name.module != Module::Router
}

/// Which tensors of REF the control perturbs, and against which of TARGET's.
#[derive(Debug, Clone)]
pub struct Pairing {
    /// REF's stored name of each perturbed tensor -> TARGET's stored name of its partner.
    pub partners: HashMap<String, String>,
    /// What the user should be told about the inputs (a check that could not be made).
    pub warnings: Vec<String>,
}

/// Pair every perturbed tensor of `reference` with `target`'s tensor of the same standard
/// causal-LM name (so TARGET may be a VLM). Refuses incompatible architectures, a missing
/// partner, differing shapes, non-float dtypes and a REF without projections. When a config
/// does not normalize, the architecture check is skipped with a warning.
pub fn pair(reference: &Checkpoint, target: &Checkpoint) -> Result<Pairing> {
    let mut warnings = Vec::new();
    match (
        TextConfig::from_model_config(&reference.config),
        TextConfig::from_model_config(&target.config),
    ) {
        (Ok(a), Ok(b)) => config::check_compatible(&a, &b, &reference.label, &target.label)?,
        (a, b) => {
            for (ckpt, err) in [(reference, a.err()), (target, b.err())] {
                if let Some(e) = err {
                    warnings.push(format!(
                        "{}: config.json does not normalize ({e}); the architectures of REF and \
                         TARGET are not compared, only their projections' names and shapes",
                        ckpt.label
                    ));
                }
            }
        }
    }

    let target_by_standard: HashMap<String, &String> = target
        .names()
        .iter()
        .filter_map(|n| names::standard_name(n).map(|s| (s, n)))
        .collect();
    let mut partners = HashMap::new();
    for name in reference.names() {
        let info = reference.require(name)?;
        let standard = names::standard_name(name);
        let perturbed = standard
            .as_deref()
            .and_then(names::parse)
            .is_some_and(|p| is_perturbed(&p));
        if !perturbed {
            continue;
        }
        let standard = standard.expect("parsed");
        let t = target_by_standard.get(&standard).copied().ok_or_else(|| {
            bad!(
                "{}: no matching tensor in {} (looked for `{standard}` under any of the usual \
                 language-model prefixes)",
                reference.describe(name),
                target.label
            )
        })?;
        let t_info = target.require(t)?;
        if t_info.shape != info.shape {
            bail!(
                "{} has shape {:?} but {} has {:?}",
                reference.describe(name),
                info.shape,
                target.describe(t),
                t_info.shape
            );
        }
        for (ckpt, n, d) in [(reference, name, info.dtype), (target, t, t_info.dtype)] {
            if !dtype::is_float(d) {
                bail!("{}: dtype {d:?} is not floating point", ckpt.describe(n));
            }
        }
        partners.insert(name.clone(), t.clone());
    }
    if partners.is_empty() {
        bail!(
            "{}: no attention or MLP projection weights found (expected names like \
             model.layers.0.self_attn.q_proj.weight)",
            reference.label
        );
    }
    Ok(Pairing { partners, warnings })
}

/// What happened to one tensor.
#[derive(Debug, Clone, Serialize)]
pub struct TensorReport {
    pub tensor: String,
    /// `||W_T - W||_F / ||W||_F`.
    pub target_drift: f64,
    /// `||out - W||_F / ||W||_F` of the stored output.
    pub realized_drift: f64,
    /// `|realized / target - 1|` (0 when both are 0).
    pub mismatch: f64,
    /// Cosine between the realized noise `out - W` and the target's `W_T - W`.
    pub cosine_with_target_dw: f64,
}

/// Perturb one tensor: `w` and `target` are the stored bytes of REF's and TARGET's tensor
/// (`w_dtype`, `t_dtype`), `name` seeds the noise. Returns the output bytes in `w_dtype` (`None`
/// when TARGET equals REF here, so the tensor is copied unchanged) and the report.
pub fn perturb_tensor(
    name: &str,
    seed: u64,
    w_dtype: Dtype,
    w: &[u8],
    t_dtype: Dtype,
    target: &[u8],
    what: &str,
) -> Result<(Option<Vec<u8>>, TensorReport)> {
    if let Some((k, v)) = dtype::first_non_finite(w_dtype, w) {
        return Err(crate::non_finite!(
            "{what}: holds {v} at flat index {k}; perturbing would spread it into `{name}`"
        ));
    }
    let w = dtype::decode(w_dtype, w, what)?;
    if !dtype::is_float(t_dtype) || target.len() != w.len() * dtype::byte_size(t_dtype) {
        crate::bail!(
            "{what}: TARGET's tensor holds {} bytes of {t_dtype:?}, not {} values",
            target.len(),
            w.len()
        );
    }
    if let Some((k, v)) = dtype::first_non_finite(t_dtype, target) {
        return Err(crate::non_finite!(
            "{what}: TARGET's tensor holds {v} at flat index {k}, so its drift has no size"
        ));
    }
    // TARGET is decoded a block at a time where it is needed, so that only three f32 copies of
    // the tensor (W, the noise, the output) are ever alive.
    let target_block = |r: &Range<usize>| {
        let size = dtype::byte_size(t_dtype);
        dtype::decode(t_dtype, &target[r.start * size..r.end * size], what)
            .expect("dtype and length checked above")
    };
    let (w_sq, target_sq) = sum_blocks(w.len(), |r| {
        let t = target_block(&r);
        w[r].iter().zip(&t).fold((0.0, 0.0), |(a, b), (&wi, &ti)| {
            let d = ti as f64 - wi as f64;
            (a + wi as f64 * wi as f64, b + d * d)
        })
    });
    let (w_norm, target_dw) = (w_sq.sqrt(), target_sq.sqrt());
    let mut report = TensorReport {
        tensor: name.to_string(),
        target_drift: ratio(target_dw, w_norm),
        realized_drift: 0.0,
        mismatch: 0.0,
        cosine_with_target_dw: 0.0,
    };
    if target_dw == 0.0 {
        return Ok((None, report));
    }

    let z = standard_normal(seed, name, w.len());
    let (z_sq, _) = sum_blocks(z.len(), |r| (squares(&z[r]), 0.0));
    // The realized squared drift for scale s, measured on the stored (rounded) values.
    let realized_sq = |s: f64| {
        let s = s as f32;
        let (sq, _) = sum_blocks(w.len(), |r| {
            let sum = w[r.clone()].iter().zip(&z[r]).fold(0.0, |acc, (&wi, &zi)| {
                let d = round_to(w_dtype, wi + s * zi) as f64 - wi as f64;
                acc + d * d
            });
            (sum, 0.0)
        });
        sq
    };
    let best = secant_on_square(target_sq, z_sq, realized_sq);

    // Reuse the noise buffer for W + s Z, then for the stored (rounded) values.
    let s = best as f32;
    let mut stored = z;
    stored
        .par_iter_mut()
        .zip(w.par_iter())
        .for_each(|(v, &wi)| *v = wi + s * *v);
    let bytes = dtype::encode(w_dtype, &stored)?;
    dtype::decode_into(w_dtype, &bytes, &mut stored, what)?;
    let (noise_sq, cross) = sum_blocks(w.len(), |r| {
        let t = target_block(&r);
        let (w, y) = (&w[r.clone()], &stored[r]);
        (0..t.len()).fold((0.0, 0.0), |(a, b), i| {
            let noise = y[i] as f64 - w[i] as f64;
            (a + noise * noise, b + noise * (t[i] as f64 - w[i] as f64))
        })
    });
    let realized = noise_sq.sqrt();
    report.realized_drift = ratio(realized, w_norm);
    report.mismatch = (realized / target_dw - 1.0).abs();
    report.cosine_with_target_dw = if realized > 0.0 {
        cross / (realized * target_dw)
    } else {
        0.0
    };
    Ok((Some(bytes), report))
}

fn squares(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum()
}

/// Find `s` with `realized_sq(s) = target_sq`, starting from `s^2 = target_sq / z_sq` and
/// stepping by the secant on `u = s^2`. Returns the best `s` seen.
fn secant_on_square(target_sq: f64, z_sq: f64, realized_sq: impl Fn(f64) -> f64) -> f64 {
    let err = |r: f64| (r.sqrt() / target_sq.sqrt() - 1.0).abs();
    let mut u0 = target_sq / z_sq;
    let mut r0 = realized_sq(u0.sqrt());
    let (mut best_u, mut best_err) = (u0, err(r0));
    if best_err <= TOLERANCE {
        return u0.sqrt();
    }
    // Second point: rescale as if the drift were proportional to s (exact without rounding).
    let mut u1 = if r0 > 0.0 {
        u0 * target_sq / r0
    } else {
        4.0 * u0
    };
    for _ in 0..MAX_STEPS {
        let r1 = realized_sq(u1.sqrt());
        let e1 = err(r1);
        if e1 < best_err {
            (best_u, best_err) = (u1, e1);
        }
        if best_err <= TOLERANCE || r1 == r0 {
            break;
        }
        let next = u1 + (target_sq - r1) * (u1 - u0) / (r1 - r0);
        // Noise large enough to overflow the dtype has no finite secant: keep the best seen
        // (the writer refuses an output that overflowed).
        if !next.is_finite() {
            break;
        }
        (u0, r0) = (u1, r1);
        // Stay positive and within a factor 4 of the last point (steps of the rounding can
        // make a secant wild).
        u1 = next.clamp(u1 / 4.0, u1 * 4.0);
        if u1 == u0 {
            break;
        }
    }
    best_u.sqrt()
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else if a > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

/// `x` rounded to `dtype` and back (round to nearest even, as `dtype::encode`).
fn round_to(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::BF16 => half::bf16::from_f32(x).to_f32(),
        Dtype::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Two sums over `0..len`, computed by `term` per fixed block of indices and added in block
/// order (in f64), so the result does not depend on the thread count.
fn sum_blocks(len: usize, term: impl Fn(Range<usize>) -> (f64, f64) + Sync) -> (f64, f64) {
    let partial: Vec<(f64, f64)> = (0..len.div_ceil(BLOCK))
        .into_par_iter()
        .map(|b| term(b * BLOCK..((b + 1) * BLOCK).min(len)))
        .collect();
    partial
        .iter()
        .fold((0.0, 0.0), |(a, c), (x, y)| (a + x, c + y))
}

/// `n` standard normal values for tensor `name`: block `b` draws from stream `b` of
/// `tensor_rng(seed, name)`.
pub fn standard_normal(seed: u64, name: &str, n: usize) -> Vec<f32> {
    let base = tensor_rng(seed, name);
    let mut z = vec![0f32; n];
    z.par_chunks_mut(BLOCK).enumerate().for_each(|(b, chunk)| {
        let mut rng: ChaCha8Rng = base.clone();
        rng.set_stream(b as u64);
        rng.set_word_pos(0);
        for v in chunk.iter_mut() {
            *v = rng.sample(StandardNormal);
        }
    });
    z
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(dtype: Dtype, v: &[f32]) -> Vec<u8> {
        dtype::encode(dtype, v).unwrap()
    }

    #[test]
    fn realized_drift_matches_the_target_in_every_dtype() {
        let n = 3 * BLOCK + 17;
        let w: Vec<f32> = standard_normal(7, "w", n)
            .iter()
            .map(|x| 0.02 * x)
            .collect();
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            let w_stored = dtype::decode(dtype, &bytes(dtype, &w), "w").unwrap();
            for rel in [0.3, 0.02, 0.004] {
                // A structured target: a rank-one change.
                let t: Vec<f32> = w_stored
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| x + rel * 0.02 * ((i % 97) as f32 / 97.0 - 0.5) * 3.4)
                    .collect();
                let (out, r) = perturb_tensor(
                    "model.layers.0.self_attn.q_proj.weight",
                    0,
                    dtype,
                    &bytes(dtype, &w_stored),
                    Dtype::F32,
                    &bytes(Dtype::F32, &t),
                    "t",
                )
                .unwrap();
                assert!(out.is_some());
                assert!(
                    r.mismatch < 1e-4,
                    "{dtype:?} rel {rel}: target {} realized {} (mismatch {})",
                    r.target_drift,
                    r.realized_drift,
                    r.mismatch
                );
                assert!(r.cosine_with_target_dw.abs() < 0.02, "{r:?}");
            }
        }
    }

    #[test]
    fn identical_target_means_no_noise() {
        let w = bytes(Dtype::BF16, &[0.5, -0.25, 1.0]);
        let (out, r) = perturb_tensor("x", 0, Dtype::BF16, &w, Dtype::BF16, &w, "t").unwrap();
        assert!(out.is_none());
        assert_eq!((r.target_drift, r.realized_drift), (0.0, 0.0));
    }

    #[test]
    fn noise_streams_do_not_depend_on_threads() {
        let a = standard_normal(3, "t", 2 * BLOCK + 5);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let b = pool.install(|| standard_normal(3, "t", 2 * BLOCK + 5));
        assert_eq!(a, b);
        assert_ne!(a[..BLOCK], a[BLOCK..2 * BLOCK]);
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
    }
}
