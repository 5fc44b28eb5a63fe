//! The norm-channel ablation of Appendix D.3: in a norm-scale vector gamma, replace the K
//! entries of largest |gamma| by the mean of all of gamma's entries (the layer-wise channel
//! mean), removing the channels that carry massive activations while keeping the scale's level.
//!
//! Selection is by |gamma| descending; entries of equal magnitude are taken lowest index first,
//! so exactly K entries are chosen even when several tie at the K-th magnitude. The mean is taken
//! in f64 over the stored values before any replacement and rounded once to the tensor's dtype.

use serde::Serialize;

use crate::arch::names::Module;

/// The per-layer norm scales `--norms` accepts.
pub const LAYER_NORMS: [Module; 6] = [
    Module::InputLayernorm,
    Module::PostAttentionLayernorm,
    Module::PreFeedforwardLayernorm,
    Module::PostFeedforwardLayernorm,
    Module::QNorm,
    Module::KNorm,
];

/// The indices of the `k` entries of largest magnitude, ties broken by lowest index, in
/// selection order. `k` must not exceed `values.len()`; values must not be NaN.
pub fn top_k_by_magnitude(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    // Stable sort: equal magnitudes keep ascending index order.
    order.sort_by(|&a, &b| values[b].abs().total_cmp(&values[a].abs()));
    order.truncate(k);
    order
}

/// The outcome for one norm tensor.
#[derive(Debug, Clone, Serialize)]
pub struct Ablation {
    pub tensor: String,
    /// The channel mean written into the selected entries (after rounding to the dtype).
    pub mean: f32,
    /// Selected channels, largest |gamma| first.
    pub channels: Vec<usize>,
    /// Their values before ablation.
    pub replaced: Vec<f32>,
    /// How many stored values actually changed (K unless a selected value already equalled the
    /// rounded mean).
    pub changed: usize,
}

/// Ablate `values` (decoded f32 of the stored tensor) in place. `round` maps an f32 to the
/// nearest value of the storage dtype.
pub fn ablate(tensor: &str, values: &mut [f32], k: usize, round: impl Fn(f32) -> f32) -> Ablation {
    let mean = round((values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64) as f32);
    let channels = top_k_by_magnitude(values, k);
    let replaced: Vec<f32> = channels.iter().map(|&i| values[i]).collect();
    let mut changed = 0;
    for &i in &channels {
        if values[i].to_bits() != mean.to_bits() {
            changed += 1;
        }
        values[i] = mean;
    }
    Ablation {
        tensor: tensor.to_string(),
        mean,
        channels,
        replaced,
        changed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_at_the_kth_magnitude_take_the_lowest_index() {
        let v = [0.5, -3.0, 2.0, 2.0, -2.0, 1.0];
        assert_eq!(top_k_by_magnitude(&v, 1), vec![1]);
        assert_eq!(top_k_by_magnitude(&v, 2), vec![1, 2]);
        assert_eq!(top_k_by_magnitude(&v, 3), vec![1, 2, 3]);
        assert_eq!(top_k_by_magnitude(&v, 4), vec![1, 2, 3, 4]);
    }

    #[test]
    fn exactly_k_entries_become_the_mean() {
        let mut v = vec![1.0f32, 9.0, -8.0, 1.5, 0.5, 2.0];
        let before = v.clone();
        let a = ablate("t", &mut v, 2, |x| x);
        let mean = before.iter().map(|&x| x as f64).sum::<f64>() / 6.0;
        assert_eq!(a.mean, mean as f32);
        assert_eq!(a.channels, vec![1, 2]);
        assert_eq!(a.replaced, vec![9.0, -8.0]);
        assert_eq!(a.changed, 2);
        let differing: Vec<usize> = (0..6).filter(|&i| v[i] != before[i]).collect();
        assert_eq!(differing, vec![1, 2]);
        assert!(differing.iter().all(|&i| v[i] == a.mean));
    }

    #[test]
    fn constant_scales_report_no_change() {
        let mut v = vec![1.0f32; 8];
        let a = ablate("t", &mut v, 3, |x| x);
        assert_eq!((a.changed, a.channels), (0, vec![0, 1, 2]));
    }
}
