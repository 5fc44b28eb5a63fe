//! TSV-Merge (Gargiulo et al., CVPR 2025, "Task Singular Vectors"), as the official code's
//! `compute_and_sum_svd_mem_reduction` computes it (docs/reference/merges.md#tsv-merge):
//!
//! ```text
//! for each 2-D tensor, T tasks, k = min(m, n), r = int(k * (1/T)):
//!     U_i, s_i, V_i = svd(delta_i);  keep the top r triplets of each task
//!     U_cat = [U_1r .. U_Tr],  s_cat,  V_cat = [V_1r .. V_Tr]
//!     merged = polar(U_cat) diag(s_cat) polar(V_cat)^T        polar(X) = U_X V_X^T of svd(X)
//! other tensors: merged = running mean of the deltas
//! theta = base + alpha * merged                               (alpha scales every tensor)
//! ```
//!
//! Choices (documented in docs/reference/merges.md#tsv-merge):
//! - Embeddings and lm_head are averaged, not SVD'd, as mergekit PR #639 does; set
//!   `svd_embeddings: true` for the official code's behaviour (it SVDs every 2-D tensor).
//! - The official code leaves the last `k - T r` columns of `U_cat` zero and orthogonalizes the
//!   full m x k matrix; their singular values are zero, so dropping them gives the same product.
//!   Triplets whose singular value is exactly 0 (a zero task vector) are dropped the same way:
//!   the official code orthogonalizes whatever arbitrary vectors its SVD returns for them.
//! - `T > min(m, n)` gives r = 0 and an unchanged tensor, as in the official code.

use rayon::prelude::*;

use super::params::{Kind, ParamDefault, ParamSpec, Scope};
use super::{Method, MethodInfo, TensorJob, TensorValues};
use crate::error::{Error, Result};
use crate::linalg::gemm::{matmul, matmul_row_major};
use crate::linalg::svd::{polar, polar_from_angles, top_svd, Polar, SvdFailed};
use crate::tensor::Tensor;
use crate::{internal, non_finite};
use faer::Mat;

/// Task singular vectors: top 1/T of each task's spectrum, decorrelated by polar factors
/// (Gargiulo et al. 2025, official TSVM code).
pub struct Tsv;

/// `svd_embeddings`, shared with STAR.
pub const SVD_EMBEDDINGS: ParamSpec = ParamSpec {
    name: "svd_embeddings",
    scope: Scope::Global,
    kind: Kind::Bool,
    default: ParamDefault::Bool(false),
    doc: "also decompose embed_tokens and lm_head (official code); by default they are averaged like 1-D tensors (mergekit PR #639)",
};

pub const ALPHA: ParamSpec = ParamSpec {
    name: "alpha",
    scope: Scope::Global,
    kind: Kind::Number,
    default: ParamDefault::Number(1.0),
    doc: "scale of the merged task vector, every tensor included (official code and FusionBench; default 1)",
};

const INFO: MethodInfo = MethodInfo {
    name: "tsv",
    needs_base: true,
    params: &[ALPHA, SVD_EMBEDDINGS],
};

/// `tsv`'s parameters for one tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TsvParams {
    pub alpha: f32,
    /// Whether this tensor is decomposed (see [`is_spectral`]).
    pub spectral: bool,
}

/// Whether a job's tensor is decomposed (2-D, and not a vocabulary tensor unless asked).
pub fn is_spectral(job: &TensorJob, svd_embeddings: bool) -> bool {
    job.shape.len() == 2 && (svd_embeddings || !job.is_vocab())
}

/// The official code's running mean `m += (x_i - m) / (i + 1)` of the task vectors.
pub fn running_mean(deltas: &[Tensor]) -> Vec<f32> {
    let mut mean = deltas[0].data.clone();
    for (i, d) in deltas.iter().enumerate().skip(1) {
        let count = (i + 1) as f32;
        for (m, &x) in mean.iter_mut().zip(&d.data) {
            *m += (x - *m) / count;
        }
    }
    mean
}

impl Method for Tsv {
    type Params = TsvParams;
    type Prepared = ();

    fn info(&self) -> &'static MethodInfo {
        &INFO
    }

    fn parse(&self, job: &TensorJob, values: &TensorValues) -> Result<TsvParams> {
        Ok(TsvParams {
            alpha: values.number(&ALPHA) as f32,
            spectral: is_spectral(job, values.flag(&SVD_EMBEDDINGS)),
        })
    }

    fn merge(&self, job: &TensorJob, params: &TsvParams, _: &()) -> Result<Vec<u8>> {
        let deltas = (0..job.models.len())
            .map(|i| job.read_delta(i))
            .collect::<Result<Vec<_>>>()?;
        let merged = if params.spectral {
            merge_matrix(&deltas).map_err(|e| e.context(format!("tsv: tensor `{}`", job.name)))?
        } else {
            running_mean(&deltas)
        };
        drop(deltas);
        job.produce(|block, out| {
            let merged = &merged[block.range.clone()];
            for ((o, b), m) in out.iter_mut().zip(block.base()?.iter()).zip(merged) {
                *o = b + params.alpha * m;
            }
            Ok(())
        })
    }
}

/// The error for a task vector's SVD that did not converge: faer fails on NaN or Inf, which is
/// then the input's (exit 3, as any NaN/Inf the arithmetic meets); on finite values it is an
/// internal failure of the decomposition (exit 1). With one task vector the message names none:
/// the caller's context says which.
pub fn svd_failed(task_vectors: &[&[f32]]) -> Error {
    for (i, delta) in task_vectors.iter().enumerate() {
        if let Some(v) = delta.iter().find(|v| !v.is_finite()) {
            let which = match task_vectors.len() {
                1 => "the task vector".to_string(),
                _ => format!("task vector {i}"),
            };
            return non_finite!("{which} holds {v}, so its SVD cannot run");
        }
    }
    internal!("the SVD did not converge on finite values")
}

/// The merged task vector of one matrix (row-major, like the inputs).
pub fn merge_matrix(deltas: &[Tensor]) -> Result<Vec<f32>> {
    let (m, n) = (deltas[0].rows(), deltas[0].cols());
    let tasks = deltas.len();
    let k = m.min(n);
    // int(k * (1/T)) in f64, exactly as the official code computes it.
    let r = (k as f64 * (1.0 / tasks as f64)) as usize;
    if r == 0 {
        return Ok(vec![0.0; m * n]);
    }
    let svds = deltas
        .par_iter()
        .map(|d| top_svd(d.mat(), r))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| {
            let values: Vec<&[f32]> = deltas.iter().map(|d| d.data.as_slice()).collect();
            svd_failed(&values)
        })?;
    // Triplets with σ = 0 are dropped (module doc); σ is non-increasing, so each task keeps a
    // prefix. The rest in the official code's order.
    let kept: Vec<usize> = svds
        .iter()
        .map(|svd| svd.s[..r].iter().take_while(|&&x| x > 0.0).count())
        .collect();
    let owner: Vec<(usize, usize)> = (0..tasks)
        .flat_map(|i| (0..kept[i]).map(move |j| (i, j)))
        .collect();
    let p = owner.len();
    if p == 0 {
        return Ok(vec![0.0; m * n]);
    }
    let s_cat: Vec<f32> = owner.iter().map(|&(i, j)| svds[i].s[j]).collect();
    let side = |large: bool| {
        let blocks: Vec<&Mat<f64>> = svds
            .iter()
            .map(|svd| if large { &svd.large } else { &svd.small })
            .collect();
        side_polar(&blocks, &kept, &owner)
    };
    let (large_polar, small_polar) = rayon::join(|| side(true), || side(false));
    drop(svds);
    let (large_polar, small_polar) = match (large_polar, small_polar) {
        (Ok(a), Ok(b)) => (a, b),
        _ => {
            return Err(internal!(
                "the SVD of the concatenated singular vectors did not converge"
            ))
        }
    };
    let (pu, pv) = if m >= n {
        (large_polar, small_polar)
    } else {
        (small_polar, large_polar)
    };
    Ok(product_of_factors(pu, &s_cat, pv))
}

/// `P_U diag(s) P_Vᵀ` for the polar factors `P_U = Lu Ru` (m x p) and `P_V = Lv Rv` (n x p):
/// the p x p middle `Ru diag(s) Rvᵀ` first, then the two large products in the cheaper order.
/// With a factored `P_U`, the m x p x p product `Lu Ru` is never formed
/// (docs/reference/spectral.md). Row-major, like the inputs.
fn product_of_factors(pu: Polar, s: &[f32], pv: Polar) -> Vec<f32> {
    let (lu, lv) = (pu.left.as_ref(), pv.left.as_ref());
    // `x diag(s)`.
    let scaled = |x: &Mat<f32>| Mat::<f32>::from_fn(x.nrows(), x.ncols(), |i, j| x[(i, j)] * s[j]);
    let middle = match (&pu.right, &pv.right) {
        (None, None) => return matmul_row_major(scaled(&pu.left).as_ref(), lv.transpose()),
        (Some(ru), None) => scaled(ru),
        (None, Some(rv)) => scaled(rv).transpose().to_owned(),
        (Some(ru), Some(rv)) => matmul(scaled(ru).as_ref(), rv.transpose()),
    };
    // (Lu M) Lvᵀ costs m·p·p + m·p·n, Lu (M Lvᵀ) costs p·p·n + m·p·n.
    if lu.nrows() <= lv.nrows() {
        matmul_row_major(matmul(lu, middle.as_ref()).as_ref(), lv.transpose())
    } else {
        matmul_row_major(lu, matmul(middle.as_ref(), lv.transpose()).as_ref())
    }
}

/// The polar factor of one side's kept vectors, concatenated in the official order (`owner`
/// lists each column's task and index). Two tasks whose concatenation is square, TSV's smaller
/// side (and both sides of a square matrix), take it from the principal angles of the two
/// bases: the route is fast and accurate there, where the Gram route cannot resolve the
/// concatenation's smallest singular values (docs/reference/spectral.md). Otherwise the polar
/// factor of the f32 concatenation.
fn side_polar(
    blocks: &[&Mat<f64>],
    kept: &[usize],
    owner: &[(usize, usize)],
) -> std::result::Result<Polar, SvdFailed> {
    let rows = blocks[0].nrows();
    if blocks.len() == 2 && owner.len() == rows && kept.iter().all(|&k| k > 0) {
        let pick = |i: usize| blocks[i].as_ref().subcols(0, kept[i]);
        if let Some(left) = polar_from_angles(pick(0), pick(1)) {
            return Ok(Polar { left, right: None });
        }
    }
    let cat = Mat::<f32>::from_fn(rows, owner.len(), |row, c| {
        blocks[owner[c].0][(row, owner[c].1)] as f32
    });
    polar(cat)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

    #[test]
    fn an_svd_failure_is_non_finite_when_a_task_vector_holds_nan_and_internal_otherwise() {
        let finite = [1.0f32, 2.0];
        let nan = [0.5f32, f32::NAN];
        let err = svd_failed(&[&finite, &nan]);
        assert_eq!(err.kind(), Kind::NonFinite);
        assert_eq!(
            err.to_string(),
            "task vector 1 holds NaN, so its SVD cannot run"
        );
        assert_eq!(
            svd_failed(&[&nan]).to_string(),
            "the task vector holds NaN, so its SVD cannot run"
        );
        assert_eq!(svd_failed(&[&finite]).kind(), Kind::Internal);
    }

    fn uniform(rows: usize, cols: usize, seed: u64) -> Mat<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        Mat::from_fn(rows, cols, |_, _| rng.random_range(-1.0f32..1.0))
    }

    #[test]
    fn factored_polar_factors_give_the_product_of_the_explicit_ones() {
        // Tall and wide, so that both orders of the large products run.
        for (m, n, p) in [(40, 12, 10), (12, 40, 10)] {
            let (lu, ru) = (uniform(m, p, 1), uniform(p, p, 2));
            let (lv, rv) = (uniform(n, p, 3), uniform(p, p, 4));
            let s: Vec<f32> = (0..p).map(|j| 1.0 / (j + 1) as f32).collect();
            let (pu, pv) = (&lu * &ru, &lv * &rv);
            let want = &Mat::from_fn(m, p, |i, j| pu[(i, j)] * s[j]) * pv.transpose();
            let form = |factored: bool, left: &Mat<f32>, right: &Mat<f32>, full: &Mat<f32>| {
                if factored {
                    Polar {
                        left: left.clone(),
                        right: Some(right.clone()),
                    }
                } else {
                    Polar {
                        left: full.clone(),
                        right: None,
                    }
                }
            };
            for (u_factored, v_factored) in
                [(false, false), (true, false), (false, true), (true, true)]
            {
                let got = product_of_factors(
                    form(u_factored, &lu, &ru, &pu),
                    &s,
                    form(v_factored, &lv, &rv, &pv),
                );
                let worst = (0..m)
                    .flat_map(|i| (0..n).map(move |j| (i, j)))
                    .map(|(i, j)| (got[i * n + j] - want[(i, j)]).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst < 1e-5,
                    "{m}x{n}, factored ({u_factored}, {v_factored}): {worst}"
                );
            }
        }
    }
}
