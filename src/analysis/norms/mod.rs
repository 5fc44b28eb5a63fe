//! Weight drift between two checkpoints of one architecture, per tensor and per module type:
//! operator and Frobenius norms of dW = TARGET - REF, stable rank, relative drift, and for
//! vectors (norm scales, biases) the L2/L-inf drift and ||REF||_inf. With a second pair, the
//! per-layer ratio pair1/pair2 (the paper's Section 3.1 comparison of a VL endpoint with a
//! text-only endpoint).

pub mod compute;
pub mod matching;
pub mod summary;

use std::ops::Range;

use crate::arch::config::check_compatible;
use crate::arch::Module;
use crate::checkpoint::hub_cache::HubRef;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
pub use compute::{MatrixMetrics, Metrics, Row, VectorMetrics};
pub use matching::LayerSelection;
pub use summary::{MedianMax, Metric, RatioSeries, Summary};

/// What to compare and how precisely.
#[derive(Debug, Clone)]
pub struct Options {
    /// Module types to report (all when `None`).
    pub modules: Option<Vec<Module>>,
    pub layers: LayerSelection,
    /// Summary window: the model's last `window` layers.
    pub window: usize,
    /// Relative accuracy of the operator norms.
    pub tol: f64,
}

/// The report of one REF/TARGET pair.
#[derive(Debug, Clone)]
pub struct DriftReport {
    pub reference: String,
    pub target: String,
    /// The Hub repos and resolved commits, for models from the Hugging Face cache.
    pub hub: (Option<HubRef>, Option<HubRef>),
    pub rows: Vec<Row>,
    pub summary: Summary,
    /// Tensors outside the language model, in REF and TARGET.
    pub ignored: (usize, usize),
}

/// Everything `sinkmerge norms` reports.
#[derive(Debug, Clone)]
pub struct Report {
    pub num_layers: usize,
    pub window: Range<usize>,
    pub pair: DriftReport,
    /// The second pair and the ratios pair1/pair2.
    pub vs: Option<(DriftReport, Vec<RatioSeries>)>,
    pub warnings: Vec<String>,
}

/// Compare `reference` with `target` (and, with `vs`, a second pair), streaming every tensor.
pub fn run(
    reference: &Checkpoint,
    target: &Checkpoint,
    vs: Option<(&Checkpoint, &Checkpoint)>,
    options: &Options,
    show_progress: bool,
) -> Result<Report> {
    let modules = options.modules.as_deref();
    let first = matching::match_tensors(reference, target, modules, &options.layers)?;
    let second = match vs {
        Some((r2, t2)) => {
            let m = matching::match_tensors(r2, t2, modules, &options.layers)?;
            check_compatible(
                &first.reference_config,
                &m.reference_config,
                &format!("REF {}", reference.label),
                &format!("--vs REF {}", r2.label),
            )?;
            Some(m)
        }
        None => None,
    };
    let num_layers = first.num_layers;
    let window = num_layers.saturating_sub(options.window)..num_layers;
    let mut warnings = first.warnings.clone();

    let total = compute::job_count(&first.pairs)
        + second.as_ref().map_or(0, |m| compute::job_count(&m.pairs));
    let bar = crate::progress::items(total as u64, "norms", show_progress);
    let inputs = compute::Inputs {
        reference,
        target,
        tol: options.tol,
        known: None,
    };
    let (rows, ref_norms, w) = compute::compute_rows(&inputs, &first.pairs, &bar)?;
    warnings.extend(w);
    let pair = DriftReport {
        reference: reference.label.clone(),
        target: target.label.clone(),
        hub: (reference.hub.clone(), target.hub.clone()),
        summary: summary::summarize(&rows, window.clone()),
        rows,
        ignored: first.ignored,
    };

    let vs = match (vs, second) {
        (Some((r2, t2)), Some(m)) => {
            warnings.extend(m.warnings.iter().map(|w| format!("--vs: {w}")));
            let same_ref = same_dir(reference, r2);
            let inputs = compute::Inputs {
                reference: r2,
                target: t2,
                tol: options.tol,
                known: same_ref.then_some(&ref_norms),
            };
            let (rows, _, w) = compute::compute_rows(&inputs, &m.pairs, &bar)?;
            warnings.extend(w.iter().map(|w| format!("--vs: {w}")));
            let ratios = summary::ratios(&pair.rows, &rows, window.clone());
            let report = DriftReport {
                reference: r2.label.clone(),
                target: t2.label.clone(),
                hub: (r2.hub.clone(), t2.hub.clone()),
                summary: summary::summarize(&rows, window.clone()),
                rows,
                ignored: m.ignored,
            };
            Some((report, ratios))
        }
        _ => None,
    };
    bar.finish_and_clear();
    Ok(Report {
        num_layers,
        window,
        pair,
        vs,
        warnings,
    })
}

/// Whether two checkpoints are the same directory (so REF norms can be reused).
fn same_dir(a: &Checkpoint, b: &Checkpoint) -> bool {
    match (a.dir.canonicalize(), b.dir.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}
