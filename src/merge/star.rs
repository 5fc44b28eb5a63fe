//! STAR, Spectral Truncation And Rescale (Lee et al., NAACL 2025), as the official code's
//! `merger/STAR.py` computes it (docs/reference/merges.md#star):
//!
//! ```text
//! for each task i and 2-D tensor:  U, s, V = svd(delta_i)
//!     total = sum(s)                                     (nuclear norm)
//!     r = searchsorted(cumsum(s), total * eta / 100) + 1 (fewest components holding eta% of it)
//!     delta_i' = U_r diag(s_r * total / sum(s_r)) V_r^T  (rescaled: nuclear norm preserved)
//! merged = sum_i delta_i' / T;  theta = base + merged
//! ```
//!
//! Guards the official code lacks: a zero task vector (total = 0) contributes zero instead of
//! NaN, and r is capped at min(m, n) when rounding pushes eta = 100 past the last cumulative
//! sum. The cumulative sums are in f64. STAR's task vectors are LoRA products (never 1-D), so
//! it defines nothing else: 1-D tensors, and embeddings unless `svd_embeddings`, are averaged
//! with the same 1/T weights.

use std::ops::Range;

use rayon::prelude::*;

use super::params::{Kind, ParamDefault, ParamSpec, Scope};
use super::tsv::{is_spectral, svd_failed, SVD_EMBEDDINGS};
use super::{Method, MethodInfo, TensorJob, TensorValues};
use crate::bail;
use crate::error::Result;
use crate::linalg::gemm::{matmul, matmul_row_major};
use crate::linalg::svd::small_side_svd;
use crate::tensor::Tensor;
use faer::Mat;

/// Spectral truncation to eta% of the nuclear norm and rescale, then average (Lee et al. 2025,
/// official STAR code).
pub struct Star;

pub const ETA: ParamSpec = ParamSpec {
    name: "eta",
    scope: Scope::Global,
    kind: Kind::Number,
    default: ParamDefault::Number(40.0),
    doc: "percent of each task vector's nuclear norm KEPT by the truncation, in (0, 100] (official code: --eta 40)",
};

const INFO: MethodInfo = MethodInfo {
    name: "star",
    needs_base: true,
    params: &[ETA, SVD_EMBEDDINGS],
};

/// `star`'s parameters for one tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StarParams {
    /// Percent of the nuclear norm kept, checked to be in (0, 100].
    pub eta: f64,
    /// Whether this tensor is decomposed (see [`is_spectral`]).
    pub spectral: bool,
}

impl Method for Star {
    type Params = StarParams;
    type Prepared = ();

    fn info(&self) -> &'static MethodInfo {
        &INFO
    }

    fn parse(&self, job: &TensorJob, values: &TensorValues) -> Result<StarParams> {
        let eta = values.number(&ETA);
        if !(eta > 0.0 && eta <= 100.0) {
            bail!(
                "star: eta {eta} at tensor `{}` is outside (0, 100]; eta is the percent of the nuclear norm kept",
                job.name
            );
        }
        Ok(StarParams {
            eta,
            spectral: is_spectral(job, values.flag(&SVD_EMBEDDINGS)),
        })
    }

    fn merge(&self, job: &TensorJob, params: &StarParams, _: &()) -> Result<Vec<u8>> {
        let StarParams { eta, spectral } = *params;
        let parts = (0..job.models.len())
            .into_par_iter()
            .map(|i| {
                let delta = job.read_delta(i)?;
                if spectral {
                    truncate(&delta, eta).map_err(|e| {
                        e.context(format!("star: tensor `{}`, task vector {i}", job.name))
                    })
                } else {
                    Ok(delta.data)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        // Added to the base a block at a time: no whole copy of the base or of the average.
        job.produce(|block, out| {
            out.fill(0.0);
            add_average(&parts, block.range.clone(), out);
            for (o, b) in out.iter_mut().zip(block.base()?.iter()) {
                *o += b;
            }
            Ok(())
        })
    }
}

/// The official merge rule `sum_i (1/T) part_i` (`merger/simple_avg.py: weighted_merge`).
pub fn average(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut merged = vec![0f32; parts[0].len()];
    add_average(parts, 0..merged.len(), &mut merged);
    merged
}

/// Elements `range` of [`average`] added to `merged`, in its order: zeros in, the same bytes out.
fn add_average(parts: &[Vec<f32>], range: Range<usize>, merged: &mut [f32]) {
    let weight = 1.0 / parts.len() as f32;
    for part in parts {
        for (m, &x) in merged.iter_mut().zip(&part[range.clone()]) {
            *m += weight * x;
        }
    }
}

/// The number of leading singular values that hold `eta` percent of their sum:
/// `searchsorted(cumsum(s), total * eta / 100) + 1`, capped at `s.len()`.
pub fn kept_rank(s: &[f32], eta: f64) -> usize {
    let total: f64 = s.iter().map(|&x| x as f64).sum();
    let target = total * (eta / 100.0);
    let mut cumsum = 0f64;
    for (i, &x) in s.iter().enumerate() {
        cumsum += x as f64;
        if cumsum >= target {
            return i + 1;
        }
    }
    s.len()
}

/// [`kept_rank`] when errors of at most `err[j]` in `s[j]` cannot move it: the sum just below
/// the cut must stay under the target and the sum at the cut reach it, whatever the errors of
/// those sums and of the target (`eta/100` of the total's). `None` otherwise; always decided
/// when every error is 0.
pub fn certain_kept_rank(s: &[f32], eta: f64, err: &[f64]) -> Option<usize> {
    let r = kept_rank(s, eta);
    let total_err: f64 = err.iter().sum();
    if total_err == 0.0 || s.is_empty() {
        return Some(r);
    }
    let total: f64 = s.iter().map(|&x| x as f64).sum();
    let (target, target_err) = (total * (eta / 100.0), total_err * (eta / 100.0));
    let below: f64 = s[..r - 1].iter().map(|&x| x as f64).sum();
    let below_err: f64 = err[..r - 1].iter().sum();
    let (at, at_err) = (below + s[r - 1] as f64, below_err + err[r - 1]);
    let enough = r == s.len() || at - at_err >= target + target_err;
    (below + below_err < target - target_err && enough).then_some(r)
}

/// One task vector truncated to eta% of its nuclear norm and rescaled (row-major).
///
/// `U_r diag(s_r) V_r^T` is computed as the projection `D V_r V_r^T` (or `U_r U_r^T D` for a wide
/// matrix), equal since `D V_r = U_r diag(s_r)`: only the small-side singular vectors are needed.
pub fn truncate(delta: &Tensor, eta: f64) -> Result<Vec<f32>> {
    let (m, n) = (delta.rows(), delta.cols());
    let (s, top) = small_side_svd(delta.mat(), |s, err| certain_kept_rank(s, eta, err))
        .map_err(|_| svd_failed(&[&delta.data]))?;
    let total: f64 = s.iter().map(|&x| x as f64).sum();
    if total == 0.0 {
        return Ok(vec![0.0; m * n]);
    }
    let r = top.ncols();
    let kept: f64 = s[..r].iter().map(|&x| x as f64).sum();
    let scale = (total / kept) as f32;
    let basis = Mat::<f32>::from_fn(top.nrows(), r, |i, j| top[(i, j)] * scale);
    Ok(if m >= n {
        let coords = matmul(delta.mat(), top.as_ref());
        matmul_row_major(coords.as_ref(), basis.transpose())
    } else {
        let coords = matmul(top.transpose(), delta.mat());
        matmul_row_major(basis.as_ref(), coords.as_ref())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_rank_follows_searchsorted_and_is_capped() {
        let s = [4.0f32, 3.0, 2.0, 1.0]; // total 10, cumsum 4, 7, 9, 10
        assert_eq!(kept_rank(&s, 40.0), 1);
        assert_eq!(kept_rank(&s, 41.0), 2);
        assert_eq!(kept_rank(&s, 70.0), 2);
        assert_eq!(kept_rank(&s, 100.0), 4);
        // Rounding cannot push eta = 100 past the end.
        let odd = [0.1f32, 0.2, 0.7000001];
        assert_eq!(kept_rank(&odd, 100.0), 3);
    }

    #[test]
    fn the_rank_is_certain_only_when_rounding_cannot_move_it() {
        let s = [4.0f32, 3.0, 2.0, 1.0]; // total 10, cumsum 4, 7, 9, 10
        let each = |e: f64| [e; 4];
        // eta 50: target 5, cut at 2 (4 < 5 <= 7). With e per value the sum below the cut is
        // off by e, the one at the cut by 2e and the target by 2e (half of 4e).
        assert_eq!(certain_kept_rank(&s, 50.0, &each(0.0)), Some(2));
        // 4.3 < 4.4 and 6.4 >= 5.6:
        assert_eq!(certain_kept_rank(&s, 50.0, &each(0.3)), Some(2));
        // 4.4 < 4.2 fails:
        assert_eq!(certain_kept_rank(&s, 50.0, &each(0.4)), None);
        // Errors only in the tail, far from the cut, move just the target.
        assert_eq!(certain_kept_rank(&s, 50.0, &[0.0, 0.0, 0.0, 1.0]), Some(2));
        // eta 40: target exactly 4 = cumsum at 1, so any error makes it undecided.
        assert_eq!(certain_kept_rank(&s, 40.0, &each(0.0)), Some(1));
        assert_eq!(certain_kept_rank(&s, 40.0, &each(1e-9)), None);
        // eta 100 keeps everything unless the last value is within the errors of zero.
        // 9.3 < 9.6, then 9.6 < 9.2 fails:
        assert_eq!(certain_kept_rank(&s, 100.0, &each(0.1)), Some(4));
        assert_eq!(certain_kept_rank(&s, 100.0, &each(0.2)), None);
    }

    #[test]
    fn zero_task_vector_stays_zero() {
        let zero = Tensor::zeros(vec![5, 3]);
        assert_eq!(truncate(&zero, 40.0).unwrap(), vec![0.0; 15]);
    }
}
