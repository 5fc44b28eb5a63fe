//! Per-image values over a manifest (`docs/reference/visual-sinks.md`, "Over a manifest"):
//! mean, median, population std, min and max of every number, over the images where it is not
//! null; booleans count as 0 and 1 (a rate).

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::depth::upper_half_start;
use super::stats::{mean_present, top1_rate, LayerStats, Top1Rates};
use super::ImageReport;

/// One value's spread over the images.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Spread {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Spread {
    pub fn of(values: &[f64]) -> Option<Spread> {
        if values.is_empty() {
            return None;
        }
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let mean = sorted.iter().sum::<f64>() / n as f64;
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        let var = sorted.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        Some(Spread {
            mean,
            median,
            std: var.sqrt(),
            min: sorted[0],
            max: sorted[n - 1],
            n,
        })
    }
}

/// `aggregate` of the JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct Aggregate {
    pub images: usize,
    pub peak_layer: Option<Spread>,
    /// Each image's layer summary at its peak layer.
    pub at_peak: BTreeMap<String, Spread>,
    /// Every probed layer's summary over the images.
    pub layers: BTreeMap<usize, BTreeMap<String, Spread>>,
    /// `NAME.auc`, `NAME.precision_at_k`, `NAME.top1` at each image's peak.
    pub features: BTreeMap<String, Spread>,
    pub gate: BTreeMap<String, Spread>,
    /// The box top-1 rate of every layer over the images with a box, and the best layer.
    pub box_top1_rate: BTreeMap<usize, f64>,
    pub best_box_layer: Option<usize>,
    pub top1_in_box: Table10,
    /// Each image's edit at its peak layer, and the next token (`next_token.kl`, ...).
    pub edit: Option<BTreeMap<String, Spread>>,
    pub control: Option<BTreeMap<String, Spread>>,
}

/// Table 10 over the images with a box (`aggregate.top1_in_box`).
#[derive(Debug, Clone, Serialize)]
pub struct Table10 {
    /// Per probed layer, the share of the images whose top-1 of each map is in the box.
    pub layers: BTreeMap<usize, Top1Rates>,
    /// Those shares averaged over the probed layers of the upper half: Table 10's row.
    pub upper_half: Top1Rates,
    /// The mean of the images' `in_box_share_100` where it is not null.
    pub in_box_share_100: Option<f64>,
}

/// Every number and boolean of the objects, by `prefix.key`, spread over the objects.
fn spread_fields(objects: &[Value], prefix: &str) -> BTreeMap<String, Spread> {
    let mut columns: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for object in objects {
        collect(object, prefix, &mut columns);
    }
    columns
        .into_iter()
        .filter_map(|(k, v)| Spread::of(&v).map(|s| (k, s)))
        .collect()
}

fn collect(value: &Value, path: &str, columns: &mut BTreeMap<String, Vec<f64>>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let key = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                collect(v, &key, columns);
            }
        }
        Value::Number(n) => columns
            .entry(path.to_string())
            .or_default()
            .extend(n.as_f64()),
        Value::Bool(b) => columns
            .entry(path.to_string())
            .or_default()
            .push(f64::from(u8::from(*b))),
        _ => {}
    }
}

fn to_value<T: Serialize>(x: &T) -> Value {
    serde_json::to_value(x).expect("report values serialize")
}

/// The spread of `images`' values, from a model of `num_layers` layers.
pub fn aggregate(images: &[&ImageReport], num_layers: usize) -> Aggregate {
    let peaks: Vec<f64> = images
        .iter()
        .filter_map(|i| i.peak_layer.map(|l| l as f64))
        .collect();
    let at_peak: Vec<Value> = images
        .iter()
        .filter_map(|i| i.peak_layer.map(|l| to_value(&i.layers[&l])))
        .collect();
    let mut layers: BTreeMap<usize, Vec<&LayerStats>> = BTreeMap::new();
    for image in images {
        for (&l, s) in &image.layers {
            layers.entry(l).or_default().push(s);
        }
    }
    let top1_layers: BTreeMap<usize, Top1Rates> = layers
        .iter()
        .map(|(&l, rows)| (l, Top1Rates::of(rows)))
        .collect();
    let box_top1_rate: BTreeMap<usize, f64> = top1_layers
        .iter()
        .filter_map(|(&l, rates)| rates.top1_in_box.map(|rate| (l, rate)))
        .collect();
    let upper: Vec<&Vec<&LayerStats>> = layers
        .range(upper_half_start(num_layers)..)
        .map(|(_, rows)| rows)
        .collect();
    let top1_in_box = Table10 {
        upper_half: Top1Rates::each(|map| {
            mean_present(upper.iter().map(|rows| top1_rate(rows, map)))
        }),
        layers: top1_layers,
        in_box_share_100: mean_present(images.iter().map(|i| i.in_box_share_100)),
    };
    let mut best_box_layer: Option<usize> = None;
    for (&l, &rate) in &box_top1_rate {
        if best_box_layer.is_none_or(|b| rate > box_top1_rate[&b]) {
            best_box_layer = Some(l);
        }
    }
    let edits = |pick: fn(&ImageReport) -> Option<&super::EditReport>| {
        let objects: Vec<Value> = images
            .iter()
            .filter_map(|i| {
                let e = pick(i)?;
                let mut v = serde_json::Map::new();
                if let Some(row) = i.peak_layer.and_then(|l| e.layers.get(&l)) {
                    v.insert("at_peak".into(), to_value(row));
                }
                v.insert("next_token".into(), to_value(&e.next_token));
                Some(Value::Object(v))
            })
            .collect();
        (!objects.is_empty()).then(|| spread_fields(&objects, ""))
    };
    let features: Vec<Value> = images
        .iter()
        .filter_map(|i| i.features.as_ref().map(to_value))
        .collect();
    let gates: Vec<Value> = images
        .iter()
        .filter_map(|i| {
            i.gate
                .as_ref()
                .map(|g| serde_json::json!({"precision": g.precision, "recall": g.recall}))
        })
        .collect();
    Aggregate {
        images: images.len(),
        peak_layer: Spread::of(&peaks),
        at_peak: spread_fields(&at_peak, ""),
        layers: layers
            .into_iter()
            .map(|(l, rows)| {
                let values: Vec<Value> = rows.into_iter().map(to_value).collect();
                (l, spread_fields(&values, ""))
            })
            .collect(),
        features: spread_fields(&features, ""),
        gate: spread_fields(&gates, ""),
        box_top1_rate,
        best_box_layer,
        top1_in_box,
        edit: edits(|i| i.edit.as_ref()),
        control: edits(|i| i.control.as_ref()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_takes_the_middle_pair_and_the_population_std() {
        let s = Spread::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(
            (s.mean, s.median, s.min, s.max, s.n),
            (2.5, 2.5, 1.0, 4.0, 4)
        );
        assert!((s.std - 1.25f64.sqrt()).abs() < 1e-15);
        assert_eq!(Spread::of(&[]), None);
    }

    #[test]
    fn fields_skip_nulls_and_count_booleans_as_rates() {
        let objects = vec![
            serde_json::json!({"a": 1.0, "b": true, "c": null}),
            serde_json::json!({"a": 3.0, "b": false, "c": 2.0}),
        ];
        let f = spread_fields(&objects, "");
        assert_eq!(f["a"].mean, 2.0);
        assert_eq!(f["b"].mean, 0.5);
        assert_eq!(f["c"].n, 1);
    }
}
