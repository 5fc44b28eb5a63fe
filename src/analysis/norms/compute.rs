//! Per-tensor drift metrics, streamed tensor by tensor straight from the checkpoint bytes.
//!
//! A matrix's drift dW = TARGET - REF is never materialized: its rows are decoded and subtracted
//! inside each pass of the spectral-norm kernel ([`crate::linalg::spectral`]), which runs on all
//! cores, and REF's own norms ride on the same passes. Memory is two Lanczos bases and a few row
//! buffers, whatever the model size: the next tensor's bytes are prefetched while one is
//! computed, and a finished tensor's pages leave the process's resident set.

use std::collections::HashMap;
use std::sync::mpsc;

use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use super::matching::Pair;
use crate::arch::names::{Module, Param};
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;
use crate::linalg::rows::{DiffRows, RowScratch, RowSet, StoredRows};
use crate::linalg::spectral::{spectral_norm, spectral_norms, SpectralNorm};
use crate::{bad, linalg};

/// The drift of one matrix (`dW = TARGET - REF`, in f32).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MatrixMetrics {
    /// ||dW||_F
    pub fro: f64,
    /// ||dW||_2 (largest singular value, certified to the requested tolerance)
    pub op: f64,
    /// fro² / op²; null for dW = 0.
    pub stable_rank: Option<f64>,
    /// ||dW||_F / ||REF||_F; null for REF = 0.
    pub rel_fro: Option<f64>,
    /// ||dW||_2 / ||REF||_2; null for REF = 0.
    pub rel_op: Option<f64>,
    /// ||REF||_F
    pub ref_fro: f64,
    /// ||REF||_2
    pub ref_op: f64,
}

/// The drift of one vector (norm scales, biases).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VectorMetrics {
    /// ||d||_2
    pub l2: f64,
    /// ||d||_inf
    pub linf: f64,
    /// ||d||_2 / ||REF||_2; null for REF = 0.
    pub rel_l2: Option<f64>,
    /// ||REF||_inf (the ||γ||_inf of the paper's Theorem 1 for norm scales)
    pub ref_linf: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Metrics {
    Matrix(MatrixMetrics),
    Vector(VectorMetrics),
}

/// One row of the report: a tensor, one expert of a fused expert tensor, or the aggregate of a
/// layer's experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Standard tensor name (`[e]` appended for one expert of a fused tensor; `*` for the
    /// aggregate of a layer's experts).
    pub tensor: String,
    pub layer: Option<usize>,
    /// Module type: the short name (`q_proj`), with `.bias` for biases.
    pub module: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert: Option<usize>,
    /// Number of experts aggregated (aggregate rows only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<usize>,
    pub shape: Vec<usize>,
    #[serde(flatten)]
    pub metrics: Metrics,
}

impl Row {
    /// Rows that enter per-layer summaries: layered, and not one expert of several.
    pub fn is_layer_row(&self) -> bool {
        self.layer.is_some() && self.expert.is_none()
    }
}

/// The module label of a parsed name.
pub fn module_label(module: Module, param: Param) -> String {
    match param {
        Param::Weight => module.short_name().to_string(),
        Param::Bias => format!("{}.bias", module.short_name()),
    }
}

/// REF norms by job key, so a second pair with the same REF does not recompute them.
pub type RefNorms = HashMap<String, SpectralNorm>;

/// One unit of work: a vector, a matrix, or one expert's slice of a fused expert tensor.
struct Job<'p> {
    pair: &'p Pair,
    expert: Option<usize>,
    /// Element offset and count in both tensors.
    offset: usize,
    rows: usize,
    cols: usize,
    is_matrix: bool,
}

impl Job<'_> {
    fn label(&self) -> String {
        match (self.expert, self.pair.parsed.module) {
            (Some(e), Module::FusedExpertsGateUp | Module::FusedExpertsDown) => {
                format!("{}[{e}]", self.pair.name)
            }
            _ => self.pair.name.clone(),
        }
    }

    fn key(&self) -> String {
        format!("{}@{}x{}", self.label(), self.rows, self.cols)
    }

    fn shape(&self) -> Vec<usize> {
        if self.is_matrix && self.expert.is_some() && self.pair.shape.len() == 3 {
            vec![self.rows, self.cols]
        } else {
            self.pair.shape.clone()
        }
    }
}

fn jobs(pairs: &[Pair]) -> Vec<Job<'_>> {
    let mut out = Vec::new();
    for pair in pairs {
        let shape = &pair.shape;
        let fused = matches!(
            pair.parsed.module,
            Module::FusedExpertsGateUp | Module::FusedExpertsDown
        );
        if shape.len() <= 1 {
            out.push(Job {
                pair,
                expert: pair.parsed.expert,
                offset: 0,
                rows: 1,
                cols: shape.iter().product(),
                is_matrix: false,
            });
        } else if fused && shape.len() == 3 {
            let (rows, cols) = (shape[1], shape[2]);
            out.extend((0..shape[0]).map(|e| Job {
                pair,
                expert: Some(e),
                offset: e * rows * cols,
                rows,
                cols,
                is_matrix: true,
            }));
        } else {
            out.push(Job {
                pair,
                expert: pair.parsed.expert,
                offset: 0,
                rows: shape[0],
                cols: shape[1..].iter().product(),
                is_matrix: true,
            });
        }
    }
    out
}

/// Units of work (progress steps) for `pairs`.
pub fn job_count(pairs: &[Pair]) -> usize {
    jobs(pairs).len()
}

/// Everything [`compute_rows`] needs besides the pairs.
pub struct Inputs<'a> {
    pub reference: &'a Checkpoint,
    pub target: &'a Checkpoint,
    pub tol: f64,
    /// REF norms computed for an earlier pair with the same REF.
    pub known: Option<&'a RefNorms>,
}

/// Metrics of every pair (one row per tensor or expert, then one aggregate row per layer and
/// expert module), the REF norms computed, and warnings (uncertified spectral norms).
pub fn compute_rows(
    inputs: &Inputs,
    pairs: &[Pair],
    bar: &ProgressBar,
) -> Result<(Vec<Row>, RefNorms, Vec<String>)> {
    let jobs = jobs(pairs);
    let mut rows = Vec::with_capacity(jobs.len());
    let mut ref_norms = RefNorms::new();
    let mut warnings = Vec::new();
    std::thread::scope(|scope| -> Result<()> {
        // The reader is told which job the computation has reached; it stops when `started`
        // is dropped (at the end, or on an error).
        let (started, reached) = mpsc::channel();
        scope.spawn(|| read_ahead(inputs, &jobs, reached));
        for (i, job) in jobs.iter().enumerate() {
            let _ = started.send(i);
            let metrics = if job.is_matrix {
                let (metrics, reference) = matrix_job(inputs, job, &mut warnings)?;
                ref_norms.insert(job.key(), reference);
                Metrics::Matrix(metrics)
            } else {
                Metrics::Vector(vector_job(inputs, job)?)
            };
            let parsed = &job.pair.parsed;
            rows.push(Row {
                tensor: job.label(),
                layer: parsed.layer,
                module: module_label(parsed.module, parsed.param),
                expert: job.expert,
                experts: None,
                shape: job.shape(),
                metrics,
            });
            bar.inc(1);
            if jobs.get(i + 1).is_none_or(|n| n.pair.name != job.pair.name) {
                inputs.reference.release(&job.pair.reference);
                inputs.target.release(&job.pair.target);
            }
        }
        Ok(())
    })?;
    Ok((aggregate_experts(rows), ref_norms, warnings))
}

/// Bytes of upcoming tensors (both checkpoints) asked from the disk ahead of the computation,
/// so a cold read overlaps the passes over the tensors before it. They land in the page cache,
/// not in the process's memory.
const READ_AHEAD: usize = 768 << 20;

/// Asks the disk for the jobs' tensors in order, keeping READ_AHEAD bytes ahead of the job the
/// computation has reached (the latest index received). It runs on its own thread because
/// asking is not free: the kernel allocates the page-cache pages and queues the reads inside
/// the call, and the passes should not wait for that.
fn read_ahead(inputs: &Inputs, jobs: &[Job], reached: mpsc::Receiver<usize>) {
    let stored = |job: &Job| {
        [
            (inputs.reference, &job.pair.reference),
            (inputs.target, &job.pair.target),
        ]
        .iter()
        .filter_map(|(ckpt, name)| ckpt.info(name).map(|t| t.end - t.begin))
        .sum::<usize>()
    };
    // Experts of one fused tensor are consecutive jobs over the same bytes: count them once.
    let first_of_tensor = |i: usize| i == 0 || jobs[i].pair.name != jobs[i - 1].pair.name;
    let mut next: usize = 0;
    // Bytes asked for in jobs current+1..next.
    let mut ahead = 0usize;
    let mut current = 0;
    while let Ok(i) = reached.recv() {
        ahead -= (current + 1..(i + 1).min(next))
            .filter(|&j| first_of_tensor(j))
            .map(|j| stored(&jobs[j]))
            .sum::<usize>();
        current = i;
        next = next.max(i + 1);
        while next < jobs.len() && ahead < READ_AHEAD {
            if first_of_tensor(next) {
                let job = &jobs[next];
                inputs.reference.prefetch(&job.pair.reference);
                inputs.target.prefetch(&job.pair.target);
                ahead += stored(job);
            }
            next += 1;
        }
    }
}

/// The two stored views of a job's elements.
fn views<'c>(inputs: &Inputs<'c>, job: &Job) -> Result<(StoredRows<'c>, StoredRows<'c>)> {
    let view = |ckpt: &'c Checkpoint, stored: &str| -> Result<StoredRows<'c>> {
        let info = ckpt.require(stored)?;
        let size = dtype::byte_size(info.dtype);
        let all = ckpt.bytes(stored)?;
        let (start, end) = (job.offset * size, (job.offset + job.rows * job.cols) * size);
        all.get(start..end)
            .and_then(|b| StoredRows::new(info.dtype, b, job.rows, job.cols))
            .ok_or_else(|| {
                bad!(
                    "{}: cannot read {}x{} {:?} values",
                    ckpt.describe(stored),
                    job.rows,
                    job.cols,
                    info.dtype
                )
            })
    };
    Ok((
        view(inputs.target, &job.pair.target)?,
        view(inputs.reference, &job.pair.reference)?,
    ))
}

fn matrix_job(
    inputs: &Inputs,
    job: &Job,
    warnings: &mut Vec<String>,
) -> Result<(MatrixMetrics, SpectralNorm)> {
    let (target, reference) = views(inputs, job)?;
    let diff = DiffRows::new(target, reference).expect("views share the job's shape");
    let tol = inputs.tol;
    let (d, r) = match inputs.known.and_then(|k| k.get(&job.key())) {
        Some(r) => (spectral_norm(&diff, tol), *r),
        None => {
            // dW and REF in lockstep: each pass reads the two stored rows once for both.
            let [d, r] = spectral_norms(&diff, tol);
            (d, r)
        }
    };
    check_finite(inputs, job, r.fro, d.fro)?;
    for (what, n) in [("TARGET - REF", &d), ("REF", &r)] {
        if !n.certified {
            warnings.push(format!(
                "`{}`: ||{what}||_2 = {} not certified to --tol {tol:e} within {} steps (certified upper bound {})",
                job.label(),
                n.op,
                n.steps,
                n.bound
            ));
        }
    }
    let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
    Ok((
        MatrixMetrics {
            fro: d.fro,
            op: d.op,
            stable_rank: ratio(d.fro * d.fro, d.op * d.op),
            rel_fro: ratio(d.fro, r.fro),
            rel_op: ratio(d.op, r.op),
            ref_fro: r.fro,
            ref_op: r.op,
        },
        r,
    ))
}

fn vector_job(inputs: &Inputs, job: &Job) -> Result<VectorMetrics> {
    let (target, reference) = views(inputs, job)?;
    let diff = DiffRows::new(target, reference).expect("views share the job's shape");
    let mut scratch = RowScratch::new();
    let [d, r] = diff.row_set(0, [true, true], &mut scratch);
    let (l2, ref_l2) = (linalg::frobenius(d), linalg::frobenius(r));
    check_finite(inputs, job, ref_l2, l2)?;
    Ok(VectorMetrics {
        l2,
        linf: linalg::linf(d),
        rel_l2: (ref_l2 > 0.0).then(|| l2 / ref_l2),
        ref_linf: linalg::linf(r),
    })
}

/// One error naming the file and tensor when REF or TARGET holds NaN/Inf (or their difference
/// overflows f32).
fn check_finite(inputs: &Inputs, job: &Job, ref_norm: f64, diff_norm: f64) -> Result<()> {
    if ref_norm.is_finite() && diff_norm.is_finite() {
        return Ok(());
    }
    let pair = job.pair;
    let non_finite = |ckpt: &Checkpoint, stored: &str| -> Result<bool> {
        let info = ckpt.require(stored)?;
        let (nan, inf) = dtype::count_non_finite(info.dtype, ckpt.bytes(stored)?);
        Ok(nan + inf > 0)
    };
    let hint = "(`sinkmerge inspect --check` lists every one)";
    if non_finite(inputs.reference, &pair.reference)? {
        return Err(crate::non_finite!(
            "{}: holds NaN or Inf values {hint}",
            inputs.reference.describe(&pair.reference)
        ));
    }
    if non_finite(inputs.target, &pair.target)? {
        return Err(crate::non_finite!(
            "{}: holds NaN or Inf values {hint}",
            inputs.target.describe(&pair.target)
        ));
    }
    Err(crate::non_finite!(
        "{}: the norm of TARGET - REF overflows (values near the f32 limit)",
        inputs.target.describe(&pair.target)
    ))
}

/// Insert after each run of per-expert rows of one layer and module an aggregate row: the
/// experts as one block-diagonal map (fro: root of the sum of squares, op: the largest).
fn aggregate_experts(rows: Vec<Row>) -> Vec<Row> {
    let mut out: Vec<Row> = Vec::with_capacity(rows.len());
    let mut group: Vec<Row> = Vec::new();
    let flush = |group: &mut Vec<Row>, out: &mut Vec<Row>| {
        let agg = aggregate(group);
        out.append(group);
        out.extend(agg);
    };
    for row in rows {
        let same = group
            .last()
            .is_some_and(|g| g.layer == row.layer && g.module == row.module);
        if row.expert.is_none() || !same {
            flush(&mut group, &mut out);
        }
        if row.expert.is_some() {
            group.push(row);
        } else {
            out.push(row);
        }
    }
    flush(&mut group, &mut out);
    out
}

fn aggregate(group: &[Row]) -> Option<Row> {
    let first = group.first()?;
    let (mut fro2, mut ref_fro2, mut op, mut ref_op) = (0.0, 0.0, 0f64, 0f64);
    for row in group {
        let Metrics::Matrix(m) = &row.metrics else {
            return None;
        };
        fro2 += m.fro * m.fro;
        ref_fro2 += m.ref_fro * m.ref_fro;
        op = op.max(m.op);
        ref_op = ref_op.max(m.ref_op);
    }
    let (fro, ref_fro) = (f64::sqrt(fro2), f64::sqrt(ref_fro2));
    let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
    let tensor = match first.tensor.rfind('[') {
        Some(i) => format!("{}[*]", &first.tensor[..i]),
        None => first
            .tensor
            .replacen(&format!(".experts.{}.", first.expert?), ".experts.*.", 1),
    };
    let mut shape = vec![group.len()];
    shape.extend(&first.shape);
    Some(Row {
        tensor,
        layer: first.layer,
        module: first.module.clone(),
        expert: None,
        experts: Some(group.len()),
        shape,
        metrics: Metrics::Matrix(MatrixMetrics {
            fro,
            op,
            stable_rank: ratio(fro2, op * op),
            rel_fro: ratio(fro, ref_fro),
            rel_op: ratio(op, ref_op),
            ref_fro,
            ref_op,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expert_row(layer: usize, e: usize, fro: f64, op: f64) -> Row {
        Row {
            tensor: format!("model.layers.{layer}.mlp.experts.{e}.up_proj.weight"),
            layer: Some(layer),
            module: "expert_up_proj".into(),
            expert: Some(e),
            experts: None,
            shape: vec![8, 4],
            metrics: Metrics::Matrix(MatrixMetrics {
                fro,
                op,
                stable_rank: Some(fro * fro / (op * op)),
                rel_fro: Some(0.1),
                rel_op: Some(0.1),
                ref_fro: 10.0 * fro,
                ref_op: 10.0 * op,
            }),
        }
    }

    #[test]
    fn experts_aggregate_as_one_block_diagonal_map_per_layer() {
        let rows = vec![
            expert_row(0, 0, 3.0, 2.0),
            expert_row(0, 1, 4.0, 3.0),
            expert_row(1, 0, 1.0, 1.0),
        ];
        let out = aggregate_experts(rows);
        assert_eq!(out.len(), 5);
        let agg = &out[2];
        assert_eq!(agg.tensor, "model.layers.0.mlp.experts.*.up_proj.weight");
        assert_eq!(
            (agg.experts, agg.expert, &agg.shape),
            (Some(2), None, &vec![2, 8, 4])
        );
        let Metrics::Matrix(m) = &agg.metrics else {
            panic!("matrix")
        };
        assert_eq!((m.fro, m.op, m.ref_op), (5.0, 3.0, 30.0));
        assert!((m.stable_rank.unwrap() - 25.0 / 9.0).abs() < 1e-15);
        assert!((m.rel_fro.unwrap() - 0.1).abs() < 1e-15);
        assert_eq!(out[4].experts, Some(1));
        assert!(out[4].is_layer_row() && !out[0].is_layer_row());
    }
}
