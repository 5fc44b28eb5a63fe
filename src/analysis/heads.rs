//! Per-head diagnosis: each head's sink before and after (from one scoring pass over the
//! reference and the target), joined to how far that head's slices of the attention weights
//! moved, with rank correlations between the two (`docs/reference/heads.md`).
//!
//! A head's slices are the ones that compute it: its rows of `q_proj`, its KV group's rows of
//! `k_proj` and `v_proj`, and its columns of `o_proj` (transformers'
//! `LlamaAttention.forward`: `view(..., -1, head_dim)` splits the projections' outputs into heads
//! and `o_proj` reads their concatenation).

use std::borrow::Cow;
use std::ops::Range;

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, Par, Side};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::predict::{average_ranks, pearson};
use crate::arch::names::{layer_name, Module, Param};
use crate::arch::QkNorm;
use crate::bail;
use crate::error::Result;
use crate::forward::backend::Backend;
use crate::forward::model::DecoderSpec;
use crate::forward::weights::Model;
use crate::sink::prompts::IndexStream;
use crate::sink::score::{score, HeadPairStatistics, Input, PairStatistics, Scores, Settings};

/// One of the four attention projections, as `--modules` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Projection {
    Q,
    K,
    V,
    O,
}

impl Projection {
    pub const ALL: [Projection; 4] = [Projection::Q, Projection::K, Projection::V, Projection::O];

    pub fn short_name(self) -> &'static str {
        match self {
            Projection::Q => "q",
            Projection::K => "k",
            Projection::V => "v",
            Projection::O => "o",
        }
    }

    pub fn from_short_name(name: &str) -> Option<Projection> {
        Projection::ALL.into_iter().find(|p| p.short_name() == name)
    }

    pub fn module(self) -> Module {
        match self {
            Projection::Q => Module::QProj,
            Projection::K => Module::KProj,
            Projection::V => Module::VProj,
            Projection::O => Module::OProj,
        }
    }

    /// Whether the head's slice is a block of rows (q, k, v: output features) rather than of
    /// columns (o: input features).
    pub fn slices_rows(self) -> bool {
        self != Projection::O
    }

    /// The weight's `[rows, cols]` in `spec`.
    pub fn shape(self, spec: &DecoderSpec) -> [usize; 2] {
        let (h, d, kv) = (spec.num_heads, spec.head_dim, spec.num_kv_heads);
        match self {
            Projection::Q => [h * d, spec.hidden_size],
            Projection::K | Projection::V => [kv * d, spec.hidden_size],
            Projection::O => [spec.hidden_size, h * d],
        }
    }

    /// How many distinct slices `p` has: one per query head for q and o, one per KV head for k
    /// and v (the heads of a GQA group read the same k and v rows).
    fn units(self, spec: &DecoderSpec) -> usize {
        match self {
            Projection::Q | Projection::O => spec.num_heads,
            Projection::K | Projection::V => spec.num_kv_heads,
        }
    }

    /// Which of the [`Projection::units`] slices query head `head` reads.
    fn unit(self, spec: &DecoderSpec, head: usize) -> usize {
        match self {
            Projection::Q | Projection::O => head,
            Projection::K | Projection::V => head / spec.group(),
        }
    }

    /// The indices, along the sliced axis, of query head `head`'s slice: its own rows of q and
    /// columns of o, its KV group's rows of k and v.
    pub fn slice(self, spec: &DecoderSpec, head: usize) -> Range<usize> {
        let (d, unit) = (spec.head_dim, self.unit(spec, head));
        unit * d..(unit + 1) * d
    }
}

/// The drift of one head's slice of one projection: `dW = TARGET - REF` restricted to it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SliceDrift {
    /// `||dW||_F`
    pub fro: f64,
    /// `||dW||_2`, the largest singular value.
    pub op: f64,
    /// `||dW||_F / ||REF||_F`; null for a zero reference slice.
    pub rel_fro: Option<f64>,
    /// `||dW||_2 / ||REF||_2`; null for a zero reference slice.
    pub rel_op: Option<f64>,
}

/// The drift of the part of a QK-norm scale that acts on one head.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NormDrift {
    pub l2: f64,
    pub linf: f64,
    /// `l2 / ||REF||_2`; null for a zero reference.
    pub rel_l2: Option<f64>,
}

/// Every drift measure of one head.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HeadDrift {
    pub q: SliceDrift,
    pub k: SliceDrift,
    pub v: SliceDrift,
    pub o: SliceDrift,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub q_norm: Option<NormDrift>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub k_norm: Option<NormDrift>,
}

impl HeadDrift {
    fn of(&self, p: Projection) -> &SliceDrift {
        match p {
            Projection::Q => &self.q,
            Projection::K => &self.k,
            Projection::V => &self.v,
            Projection::O => &self.o,
        }
    }
}

/// `||A||_F` and `||A||_2` in f64. The spectral norm is the square root of the top eigenvalue
/// of the Gram matrix of A's smaller side (a head slice is `head_dim` by `hidden`, so that
/// Gram is `head_dim` square); every product runs sequentially, so the result does not depend
/// on the thread count. A is scaled in place: a scaled copy would cost an allocation the size
/// of the slice for every norm.
fn norms(mut a: Mat<f64>) -> Result<(f64, f64)> {
    let fro = a.norm_l2();
    if fro == 0.0 {
        return Ok((0.0, 0.0));
    }
    // Scaling by ||A||_F keeps the Gram's entries near 1 whatever the weights' magnitude.
    a *= faer::Scale(1.0 / fro);
    let small = a.nrows().min(a.ncols());
    let mut gram = Mat::<f64>::zeros(small, small);
    if a.nrows() <= a.ncols() {
        matmul(
            gram.as_mut(),
            Accum::Replace,
            &a,
            a.transpose(),
            1.0,
            Par::Seq,
        );
    } else {
        matmul(
            gram.as_mut(),
            Accum::Replace,
            a.transpose(),
            &a,
            1.0,
            Par::Seq,
        );
    }
    let top = gram
        .self_adjoint_eigenvalues(Side::Lower)
        .map_err(|e| crate::error::Error::Internal(format!("head drift eigenvalues: {e:?}")))?
        .last()
        .copied()
        .unwrap_or(0.0);
    Ok((fro, fro * top.max(0.0).sqrt()))
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b != 0.0).then(|| a / b)
}

/// Slice `unit` of `p` (see [`Projection::units`]) as the two f64 matrices [`norms`] reads,
/// `TARGET - REF` and `REF`, in the slice's own orientation. The stored weights are row-major
/// and faer's matrices column-major, so the copy walks bands of 64 rows column by column: the
/// band's source rows stay in cache while each column's writes are contiguous, whichever axis
/// is sliced. The values are those of any other fill order.
fn slice_pair(
    spec: &DecoderSpec,
    p: Projection,
    unit: usize,
    reference: &[f32],
    target: &[f32],
) -> (Mat<f64>, Mat<f64>) {
    const TILE: usize = 64;
    let [rows, cols] = p.shape(spec);
    let d = spec.head_dim;
    // The slice is `n` by `m` and starts at row `row0`, column `col0` of the stored matrix.
    let (n, m, row0, col0) = if p.slices_rows() {
        (d, cols, unit * d, 0)
    } else {
        (rows, d, 0, unit * d)
    };
    let (mut diff, mut base) = (Mat::<f64>::zeros(n, m), Mat::<f64>::zeros(n, m));
    for i0 in (0..n).step_by(TILE) {
        let tile_rows = i0..(i0 + TILE).min(n);
        for j in 0..m {
            let (dc, bc) = (diff.col_as_slice_mut(j), base.col_as_slice_mut(j));
            for i in tile_rows.clone() {
                let k = (row0 + i) * cols + col0 + j;
                let r = reference[k] as f64;
                dc[i] = target[k] as f64 - r;
                bc[i] = r;
            }
        }
    }
    (diff, base)
}

/// The drift of slice `unit` of projection `p` of one layer.
fn slice_drift(
    spec: &DecoderSpec,
    p: Projection,
    unit: usize,
    reference: &[f32],
    target: &[f32],
) -> Result<SliceDrift> {
    let (diff, base) = slice_pair(spec, p, unit, reference, target);
    let (fro, op) = norms(diff)?;
    let (ref_fro, ref_op) = norms(base)?;
    Ok(SliceDrift {
        fro,
        op,
        rel_fro: ratio(fro, ref_fro),
        rel_op: ratio(op, ref_op),
    })
}

/// The drift of one head's part of a QK-norm scale: the whole vector for per-head norms (one
/// `head_dim` scale shared by every head), the head's (or its KV head's) slice for layerwise
/// ones.
fn norm_drift(reference: &[f32], target: &[f32], range: Range<usize>) -> NormDrift {
    let (r, t) = (&reference[range.clone()], &target[range]);
    let d: Vec<f64> = t
        .iter()
        .zip(r)
        .map(|(&t, &r)| t as f64 - r as f64)
        .collect();
    let l2 = d.iter().map(|x| x * x).sum::<f64>().sqrt();
    let ref_l2 = r.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    NormDrift {
        l2,
        linf: d.iter().fold(0.0, |m, x| m.max(x.abs())),
        rel_l2: ratio(l2, ref_l2),
    }
}

/// Per-head drift of the listed `layers` of `target` against `reference` (which share a
/// geometry), layer-major then head order.
pub fn head_drift(reference: &Model, target: &Model, layers: &[usize]) -> Result<Vec<HeadDrift>> {
    let spec = &reference.spec;
    let mut out = Vec::with_capacity(layers.len() * spec.num_heads);
    for &layer in layers {
        let mut weights = Vec::with_capacity(4);
        for p in Projection::ALL {
            let name = layer_name(layer, p.module(), Param::Weight);
            let shape = p.shape(spec);
            weights.push((
                reference.tensor(&name, &shape)?,
                target.tensor(&name, &shape)?,
            ));
        }
        // Every distinct slice of the layer is one task: a head's Gram runs sequentially inside
        // its task (`norms`), so the values do not depend on the thread count, and k and v are
        // measured once per KV head rather than once per query head that reads them.
        let tasks: Vec<(usize, usize)> = (0..Projection::ALL.len())
            .flat_map(|pi| (0..Projection::ALL[pi].units(spec)).map(move |unit| (pi, unit)))
            .collect();
        let drifts = tasks
            .par_iter()
            .map(|&(pi, unit)| {
                let (r, t) = &weights[pi];
                slice_drift(spec, Projection::ALL[pi], unit, r, t)
            })
            .collect::<Result<Vec<SliceDrift>>>()?;
        drop(weights);
        // The drift of query head `head`'s slice of projection `pi`: the tasks are in
        // projection order, then unit order.
        let of = |pi: usize, head: usize| {
            let first: usize = Projection::ALL[..pi].iter().map(|p| p.units(spec)).sum();
            drifts[first + Projection::ALL[pi].unit(spec, head)]
        };
        let norm = |module: Module, kv: bool| -> Result<Option<Vec<NormDrift>>> {
            let name = layer_name(layer, module, Param::Weight);
            let d = spec.head_dim;
            let units = if kv {
                spec.num_kv_heads
            } else {
                spec.num_heads
            };
            let len = match spec.qk_norm {
                QkNorm::PerHead => d,
                QkNorm::Layerwise => units * d,
                QkNorm::None => return Ok(None),
            };
            let (r, t) = (
                reference.tensor(&name, &[len])?,
                target.tensor(&name, &[len])?,
            );
            let unit_of = |head: usize| if kv { head / spec.group() } else { head };
            Ok(Some(
                (0..spec.num_heads)
                    .map(|head| {
                        let range = match spec.qk_norm {
                            QkNorm::Layerwise => unit_of(head) * d..(unit_of(head) + 1) * d,
                            _ => 0..d,
                        };
                        norm_drift(&r, &t, range)
                    })
                    .collect(),
            ))
        };
        let q_norm = norm(Module::QNorm, false)?;
        let k_norm = norm(Module::KNorm, true)?;
        for head in 0..spec.num_heads {
            out.push(HeadDrift {
                q: of(0, head),
                k: of(1, head),
                v: of(2, head),
                o: of(3, head),
                q_norm: q_norm.as_ref().map(|v| v[head]),
                k_norm: k_norm.as_ref().map(|v| v[head]),
            });
        }
    }
    Ok(out)
}

/// REF and TARGET must share the geometry that heads and slices are defined on.
pub fn check_same_geometry(reference: &Model, target: &Model) -> Result<()> {
    let shape = |s: &DecoderSpec| {
        (
            s.num_layers(),
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.hidden_size,
            s.qk_norm,
        )
    };
    let (r, t) = (&reference.spec, &target.spec);
    if shape(r) != shape(t) {
        bail!(
            "{} ({} layers, {} heads, {} KV heads of dim {}, hidden {}, QK norm {}) and {} ({} \
             layers, {} heads, {} KV heads of dim {}, hidden {}, QK norm {}) have different \
             geometry; per-head comparison needs the same heads",
            reference.ckpt.label,
            r.num_layers(),
            r.num_heads,
            r.num_kv_heads,
            r.head_dim,
            r.hidden_size,
            r.qk_norm.as_str(),
            target.ckpt.label,
            t.num_layers(),
            t.num_heads,
            t.num_kv_heads,
            t.head_dim,
            t.hidden_size,
            t.qk_norm.as_str()
        );
    }
    // The configs agree; the attention weights must have the shapes they declare before any
    // head is counted or sliced (a config with more heads than its tensors hold is refused
    // here rather than met as an out-of-range slice or a vast candidate list).
    for model in [reference, target] {
        for layer in 0..model.spec.num_layers() {
            for p in Projection::ALL {
                let name = layer_name(layer, p.module(), Param::Weight);
                model.stored_bytes(&name, &p.shape(&model.spec))?;
            }
        }
    }
    Ok(())
}

/// One head: its sink before and after, and its drift.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeadRow {
    #[serde(flatten)]
    pub sink: HeadPairStatistics,
    /// The KV head whose k and v the head reads (GQA).
    pub kv_head: usize,
    pub drift: HeadDrift,
}

/// The sink measure that ranks damaged heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum RankBy {
    /// Most negative ΔG first: the heads whose sink weakened most.
    DeltaG,
    /// Lowest margin G_base - B_gap first: the heads whose perturbation most exceeds their sink.
    Margin,
}

impl RankBy {
    fn value(self, sink: &HeadPairStatistics) -> Option<f64> {
        match self {
            RankBy::DeltaG => sink.delta_g,
            RankBy::Margin => sink.margin,
        }
    }
}

/// Indices of `sinks`, most damaged first under `rank_by`; heads without the measure last, ties
/// in layer and head order.
pub fn rank<'a>(
    sinks: impl IntoIterator<Item = &'a HeadPairStatistics>,
    rank_by: RankBy,
) -> Vec<usize> {
    let sinks: Vec<&HeadPairStatistics> = sinks.into_iter().collect();
    let mut order: Vec<usize> = (0..sinks.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (sinks[a], sinks[b]);
        match (rank_by.value(a), rank_by.value(b)) {
            (Some(x), Some(y)) => x.total_cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => std::cmp::Ordering::Equal,
        }
        .then((a.layer, a.head).cmp(&(b.layer, b.head)))
    });
    order
}

/// Join the per-head sink statistics with the per-head drift (both layer-major, head order).
pub fn join(
    spec: &DecoderSpec,
    sink: Vec<HeadPairStatistics>,
    drift: Vec<HeadDrift>,
) -> Vec<HeadRow> {
    sink.into_iter()
        .zip(drift)
        .map(|(sink, drift)| HeadRow {
            kv_head: sink.head / spec.group(),
            sink,
            drift,
        })
        .collect()
}

/// Spearman's rank correlation of a sink measure with a drift measure across heads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Correlation {
    /// `delta_g` or `margin`.
    pub sink: Cow<'static, str>,
    /// `q.fro`, `k.rel_op`, `q_norm.l2`, ...
    pub drift: String,
    /// Heads with both measures defined.
    pub n: usize,
    /// Null when either measure is constant over those heads.
    pub spearman: Option<f64>,
    /// Two-sided permutation p-value: `(1 + #{|rho_perm| >= |rho|}) / (1 + permutations)`.
    pub p_value: Option<f64>,
}

/// Spearman's rho of `x` and `y` and its permutation p-value: `y`'s ranks shuffled
/// `permutations` times (Fisher-Yates from [`IndexStream`] seeded with `seed`).
pub fn spearman(
    x: &[f64],
    y: &[f64],
    permutations: usize,
    seed: u64,
) -> (Option<f64>, Option<f64>) {
    let (rx, mut ry) = (average_ranks(x), average_ranks(y));
    let Some(rho) = pearson(&rx, &ry) else {
        return (None, None);
    };
    if permutations == 0 {
        return (Some(rho), None);
    }
    let mut stream = IndexStream::new(seed);
    // Rounding can make a permutation that reproduces the observed order differ in the last bit.
    let bar = rho.abs() - 1e-12;
    let mut at_least = 0usize;
    for _ in 0..permutations {
        for i in (1..ry.len()).rev() {
            ry.swap(i, stream.index(i + 1));
        }
        if pearson(&rx, &ry).is_some_and(|r| r.abs() >= bar) {
            at_least += 1;
        }
    }
    (
        Some(rho),
        Some((1 + at_least) as f64 / (1 + permutations) as f64),
    )
}

/// Every drift measure a row has, by name (`q.fro`, ..., `q_norm.l2`, ...).
fn drift_measures(d: &HeadDrift) -> Vec<(String, Option<f64>)> {
    let mut out = Vec::new();
    for p in Projection::ALL {
        let s = d.of(p);
        for (what, v) in [
            ("fro", Some(s.fro)),
            ("op", Some(s.op)),
            ("rel_fro", s.rel_fro),
            ("rel_op", s.rel_op),
        ] {
            out.push((format!("{}.{what}", p.short_name()), v));
        }
    }
    for (name, n) in [("q_norm", d.q_norm), ("k_norm", d.k_norm)] {
        if let Some(n) = n {
            out.push((format!("{name}.l2"), Some(n.l2)));
            out.push((format!("{name}.rel_l2"), n.rel_l2));
        }
    }
    out
}

/// A sink measure of a head, when defined.
type SinkMeasure = fn(&HeadRow) -> Option<f64>;

/// Spearman's rho of ΔG and of the margin with every drift measure across `rows`; each pair of
/// measures gets its own stream (`seed` plus its index), so adding a measure changes no other
/// p-value.
pub fn correlations(rows: &[HeadRow], permutations: usize, seed: u64) -> Vec<Correlation> {
    let Some(first) = rows.first() else {
        return Vec::new();
    };
    let names: Vec<String> = drift_measures(&first.drift)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let drifts: Vec<Vec<Option<f64>>> = rows
        .iter()
        .map(|r| {
            drift_measures(&r.drift)
                .into_iter()
                .map(|(_, v)| v)
                .collect()
        })
        .collect();
    let sinks: [(&'static str, SinkMeasure); 2] = [
        ("delta_g", |r| r.sink.delta_g),
        ("margin", |r| r.sink.margin),
    ];
    let mut out = Vec::new();
    for (si, (sink, value)) in sinks.into_iter().enumerate() {
        for (di, drift) in names.iter().enumerate() {
            let (x, y): (Vec<f64>, Vec<f64>) = rows
                .iter()
                .zip(&drifts)
                .filter_map(|(r, d)| value(r).zip(d[di]))
                .unzip();
            let stream = seed.wrapping_add((si * names.len() + di) as u64);
            let (rho, p_value) = if x.len() < 3 {
                (None, None)
            } else {
                spearman(&x, &y, permutations, stream)
            };
            out.push(Correlation {
                sink: sink.into(),
                drift: drift.clone(),
                n: x.len(),
                spearman: rho,
                p_value,
            });
        }
    }
    out
}

/// What [`diagnose`] found.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Diagnosis {
    /// Every head of the chosen layers, layer-major.
    pub heads: Vec<HeadRow>,
    /// The pair's own statistics over the scoring window (every head pooled).
    pub pair: PairStatistics,
    /// S of the reference and of the target over the scoring window.
    pub sink_strength: [Option<f64>; 2],
    /// First and last layer of the scoring window.
    pub window: [usize; 2],
}

/// Which layers [`diagnose`] reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Layers {
    /// The last this many (all if fewer).
    Last(usize),
    /// These layers, ascending.
    List(Vec<usize>),
}

impl Layers {
    /// The layers of a `num_layers`-layer model.
    pub fn of(&self, num_layers: usize) -> Vec<usize> {
        match self {
            Layers::Last(k) => (num_layers.saturating_sub(*k)..num_layers).collect(),
            Layers::List(list) => list.clone(),
        }
    }
}

/// The sink half of [`diagnose`]: score the reference `pair[0]` and the target `pair[1]`
/// (models of `num_layers` layers) in one pass and return each head of `layers` (ascending)
/// against the reference, with the pass's reports. `settings.last` is widened to reach the
/// first of `layers`; `on_layer` is called after each model finishes each layer.
pub fn head_sinks<B: Backend>(
    backend: &B,
    pair: &[Input; 2],
    layers: &[usize],
    num_layers: usize,
    mut settings: Settings,
    on_layer: &dyn Fn(),
) -> Result<(Vec<HeadPairStatistics>, Scores)> {
    settings.last = num_layers - layers.first().copied().unwrap_or(0);
    let scored = score(backend, pair, Some(0), settings, on_layer)?;
    let sinks = (scored.observations.head_pairs(1).into_iter())
        .filter(|h| layers.binary_search(&h.layer).is_ok())
        .collect();
    Ok((sinks, scored.scores))
}

/// Score the reference `pair[0]` and the target `pair[1]` in one pass ([`head_sinks`]) and join
/// each head's sink statistics to its drift over `layers`.
pub fn diagnose<B: Backend>(
    backend: &B,
    pair: &[Input; 2],
    layers: &Layers,
    settings: Settings,
    on_layer: &dyn Fn(),
) -> Result<Diagnosis> {
    let (ref_model, target_model) = (Model::new(pair[0].ckpt)?, Model::new(pair[1].ckpt)?);
    check_same_geometry(&ref_model, &target_model)?;
    let spec = &ref_model.spec;
    let chosen = layers.of(spec.num_layers());
    let (sinks, scores) = head_sinks(
        backend,
        pair,
        &chosen,
        spec.num_layers(),
        settings,
        on_layer,
    )?;
    let drift = head_drift(&ref_model, &target_model, &chosen)?;
    let models = &scores.models;
    Ok(Diagnosis {
        heads: join(spec, sinks, drift),
        pair: scores.pairs[0].statistics.clone(),
        sink_strength: [
            models[0].statistics.sink_strength,
            models[1].statistics.sink_strength,
        ],
        window: models[0].window,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spearman_of_monotone_data_is_one_with_a_small_p_value() {
        let x: Vec<f64> = (0..12).map(f64::from).collect();
        let y: Vec<f64> = x.iter().map(|v| v.powi(3)).collect();
        let (rho, p) = spearman(&x, &y, 999, 1);
        assert_eq!(rho, Some(1.0));
        assert_eq!(p, Some(1.0 / 1000.0));
        let rev: Vec<f64> = y.iter().map(|v| -v).collect();
        assert_eq!(spearman(&x, &rev, 0, 1).0, Some(-1.0));
        assert_eq!(spearman(&x, &[1.0; 12], 10, 1), (None, None));
        // The p-value is seeded.
        let noisy = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0, 6.0, 5.5, 3.5, 8.0, 7.0];
        assert_eq!(spearman(&x, &noisy, 500, 7), spearman(&x, &noisy, 500, 7));
    }

    #[test]
    fn spectral_norm_of_a_slice_matches_a_known_matrix() {
        // [[3, 0], [4, 5]] has singular values sqrt(45) and sqrt(5).
        let a = Mat::from_fn(2, 2, |r, c| [[3.0, 0.0], [4.0, 5.0]][r][c]);
        let (fro, op) = norms(a).unwrap();
        assert!((fro - 50f64.sqrt()).abs() < 1e-14);
        assert!((op - 45f64.sqrt()).abs() < 1e-13, "{op}");
        let wide = Mat::from_fn(1, 3, |_, c| [1.0, 2.0, 2.0][c]);
        assert!((norms(wide).unwrap().1 - 3.0).abs() < 1e-14);
    }
}
