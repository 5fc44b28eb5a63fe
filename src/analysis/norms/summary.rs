//! Per-module summaries over layers (all selected layers and the last-K window) and the
//! per-layer ratio of two pairs (the paper's "median ratio 4.44x on q_proj").

use std::ops::Range;

use super::compute::{Metrics, Row};

/// A reported quantity of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Metric {
    /// ||dW||_2
    Op,
    /// ||dW||_F
    Fro,
    /// ||dW||_F² / ||dW||_2²
    #[value(alias = "stable_rank")]
    StableRank,
    /// ||dW||_2 / ||REF||_2
    #[value(alias = "rel_op")]
    RelOp,
    /// ||dW||_F / ||REF||_F
    #[value(alias = "rel_fro")]
    RelFro,
    /// ||d||_2 of a vector
    L2,
    /// ||d||_inf of a vector
    Linf,
    /// ||d||_2 / ||REF||_2 of a vector
    #[value(alias = "rel_l2")]
    RelL2,
    /// ||REF||_inf of a vector
    #[value(alias = "ref_linf")]
    RefLinf,
}

impl Metric {
    pub const MATRIX: [Metric; 5] = [
        Metric::Op,
        Metric::Fro,
        Metric::StableRank,
        Metric::RelOp,
        Metric::RelFro,
    ];
    pub const VECTOR: [Metric; 4] = [Metric::L2, Metric::Linf, Metric::RelL2, Metric::RefLinf];

    /// The key used in JSON, CSV and tables.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Op => "op",
            Metric::Fro => "fro",
            Metric::StableRank => "stable_rank",
            Metric::RelOp => "rel_op",
            Metric::RelFro => "rel_fro",
            Metric::L2 => "l2",
            Metric::Linf => "linf",
            Metric::RelL2 => "rel_l2",
            Metric::RefLinf => "ref_linf",
        }
    }

    pub fn is_matrix(self) -> bool {
        Metric::MATRIX.contains(&self)
    }

    /// The value for `row`; `None` when the row is of the other kind or the value is undefined.
    pub fn of(self, row: &Row) -> Option<f64> {
        match (&row.metrics, self) {
            (Metrics::Matrix(m), Metric::Op) => Some(m.op),
            (Metrics::Matrix(m), Metric::Fro) => Some(m.fro),
            (Metrics::Matrix(m), Metric::StableRank) => m.stable_rank,
            (Metrics::Matrix(m), Metric::RelOp) => m.rel_op,
            (Metrics::Matrix(m), Metric::RelFro) => m.rel_fro,
            (Metrics::Vector(v), Metric::L2) => Some(v.l2),
            (Metrics::Vector(v), Metric::Linf) => Some(v.linf),
            (Metrics::Vector(v), Metric::RelL2) => v.rel_l2,
            (Metrics::Vector(v), Metric::RefLinf) => Some(v.ref_linf),
            _ => None,
        }
    }

    /// The metrics reported for rows like `row`.
    pub fn for_row(row: &Row) -> &'static [Metric] {
        match row.metrics {
            Metrics::Matrix(_) => &Metric::MATRIX,
            Metrics::Vector(_) => &Metric::VECTOR,
        }
    }
}

/// Median (mean of the two middle values for an even count, as numpy) and maximum.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MedianMax {
    pub median: Option<f64>,
    pub max: Option<f64>,
    pub count: usize,
}

impl MedianMax {
    pub fn of(values: impl IntoIterator<Item = f64>) -> MedianMax {
        let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = match n {
            0 => None,
            _ if n % 2 == 1 => Some(v[n / 2]),
            _ => Some(0.5 * (v[n / 2 - 1] + v[n / 2])),
        };
        MedianMax {
            median,
            max: v.last().copied(),
            count: n,
        }
    }
}

/// One module type's statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleSummary {
    pub module: String,
    /// Per metric: over all selected layers, and over the window.
    pub stats: Vec<(Metric, MedianMax, MedianMax)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The window: the model's last K layers.
    pub window: Range<usize>,
    pub modules: Vec<ModuleSummary>,
}

/// Module labels of the layered rows: matrices, then vectors, each in first-appearance order.
pub fn layer_modules(rows: &[Row]) -> Vec<String> {
    let mut out: Vec<(bool, String)> = Vec::new();
    for row in rows.iter().filter(|r| r.is_layer_row()) {
        if !out.iter().any(|(_, m)| *m == row.module) {
            let vector = matches!(row.metrics, Metrics::Vector(_));
            out.push((vector, row.module.clone()));
        }
    }
    // Stable: first appearance within each kind.
    out.sort_by_key(|(vector, _)| *vector);
    out.into_iter().map(|(_, m)| m).collect()
}

/// `(layer, value)` of `module`'s layer rows.
pub fn per_layer(rows: &[Row], module: &str, metric: Metric) -> Vec<(usize, f64)> {
    rows.iter()
        .filter(|r| r.is_layer_row() && r.module == module)
        .filter_map(|r| Some((r.layer?, metric.of(r)?)))
        .collect()
}

pub fn summarize(rows: &[Row], window: Range<usize>) -> Summary {
    let modules = layer_modules(rows)
        .into_iter()
        .map(|module| {
            let first = rows
                .iter()
                .find(|r| r.is_layer_row() && r.module == module)
                .expect("module comes from the rows");
            let stats = Metric::for_row(first)
                .iter()
                .map(|&metric| {
                    let series = per_layer(rows, &module, metric);
                    let all = MedianMax::of(series.iter().map(|p| p.1));
                    let win =
                        MedianMax::of(series.iter().filter(|p| window.contains(&p.0)).map(|p| p.1));
                    (metric, all, win)
                })
                .collect();
            ModuleSummary { module, stats }
        })
        .collect();
    Summary { window, modules }
}

/// Per-layer ratio pair1 / pair2 of one module and metric.
#[derive(Debug, Clone, PartialEq)]
pub struct RatioSeries {
    pub module: String,
    pub metric: Metric,
    /// Layers present in both pairs, and the ratio there (`None` where pair 2's value is 0).
    pub per_layer: Vec<(usize, Option<f64>)>,
    pub all: MedianMax,
    pub window: MedianMax,
}

/// Ratios of every module and metric present in both pairs.
pub fn ratios(first: &[Row], second: &[Row], window: Range<usize>) -> Vec<RatioSeries> {
    let mut out = Vec::new();
    for module in layer_modules(first) {
        let Some(row) = first
            .iter()
            .find(|r| r.is_layer_row() && r.module == module)
        else {
            continue;
        };
        for &metric in Metric::for_row(row) {
            let b = per_layer(second, &module, metric);
            let per_layer: Vec<(usize, Option<f64>)> = per_layer(first, &module, metric)
                .into_iter()
                .filter_map(|(layer, a)| {
                    let &(_, b) = b.iter().find(|p| p.0 == layer)?;
                    Some((layer, (b > 0.0).then(|| a / b)))
                })
                .collect();
            if per_layer.is_empty() {
                continue;
            }
            let all = MedianMax::of(per_layer.iter().filter_map(|p| p.1));
            let in_window = MedianMax::of(
                per_layer
                    .iter()
                    .filter(|p| window.contains(&p.0))
                    .filter_map(|p| p.1),
            );
            out.push(RatioSeries {
                module: module.clone(),
                metric,
                all,
                window: in_window,
                per_layer,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::norms::compute::{MatrixMetrics, VectorMetrics};

    fn matrix(layer: usize, module: &str, op: f64) -> Row {
        Row {
            tensor: format!("model.layers.{layer}.self_attn.{module}.weight"),
            layer: Some(layer),
            module: module.into(),
            expert: None,
            experts: None,
            shape: vec![4, 4],
            metrics: Metrics::Matrix(MatrixMetrics {
                fro: 2.0 * op,
                op,
                stable_rank: Some(4.0),
                rel_fro: Some(op),
                rel_op: Some(op),
                ref_fro: 1.0,
                ref_op: 1.0,
            }),
        }
    }

    #[test]
    fn medians_follow_numpy_and_skip_undefined_values() {
        assert_eq!(MedianMax::of([3.0, 1.0, 2.0]).median, Some(2.0));
        assert_eq!(MedianMax::of([4.0, 1.0, 2.0, 3.0]).median, Some(2.5));
        let s = MedianMax::of([f64::NAN, 5.0]);
        assert_eq!((s.median, s.max, s.count), (Some(5.0), Some(5.0), 1));
        assert_eq!(MedianMax::of([]).median, None);
    }

    #[test]
    fn window_and_ratio_medians() {
        // Pair 2 moves layer l by 1/2^l of pair 1's displacement... in a shuffled order, so the
        // medians are not the trivial middle layer: ratios 8, 2, 4, 16 for layers 0..4.
        let factors = [8.0, 2.0, 4.0, 16.0];
        let first: Vec<Row> = (0..4)
            .map(|l| matrix(l, "q_proj", 1.0 + l as f64))
            .collect();
        let second: Vec<Row> = (0..4)
            .map(|l| matrix(l, "q_proj", (1.0 + l as f64) / factors[l]))
            .collect();
        let summary = summarize(&first, 1..4);
        let (metric, all, win) = summary.modules[0].stats[0];
        assert_eq!(metric, Metric::Op);
        assert_eq!((all.median, all.max), (Some(2.5), Some(4.0)));
        assert_eq!((win.median, win.max, win.count), (Some(3.0), Some(4.0), 3));

        let r = ratios(&first, &second, 1..4);
        let op = r.iter().find(|s| s.metric == Metric::Op).unwrap();
        assert_eq!(op.window.median, Some(4.0));
        assert_eq!(op.all.median, Some(6.0));
        assert_eq!(op.per_layer[3], (3, Some(16.0)));
        // Matrix modules get the matrix metrics only.
        assert_eq!(r.len(), Metric::MATRIX.len());
    }

    #[test]
    fn zero_displacement_in_pair_two_gives_no_ratio() {
        let first = vec![matrix(0, "k_proj", 1.0)];
        let second = vec![matrix(0, "k_proj", 0.0)];
        let r = ratios(&first, &second, 0..1);
        assert_eq!(r[0].per_layer, vec![(0, None)]);
        assert_eq!(r[0].window.median, None);
        let v = Row {
            metrics: Metrics::Vector(VectorMetrics {
                l2: 1.0,
                linf: 0.5,
                rel_l2: None,
                ref_linf: 0.0,
            }),
            ..matrix(0, "q_norm", 0.0)
        };
        assert_eq!(Metric::Op.of(&v), None);
        assert_eq!(Metric::RelL2.of(&v), None);
        assert_eq!(Metric::Linf.of(&v), Some(0.5));
    }
}
