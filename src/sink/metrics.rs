//! The attention-sink metrics, exactly as `docs/reference/sink-metrics.md` defines them
//! (paper Sections 3.2, 4.1-4.3, Appendices A, D, E).
//!
//! Per prompt x, layer l, head h, with scores `s[q,p]` (after scaling and the causal / sliding
//! mask) and `A[q,p] = softmax_p s[q,p]`:
//! - sink position `p_sink = argmax_p Σ_q A[q,p]` (column mass, lowest index on ties), or with
//!   [`SinkPosition::PerQuery`] `argmax_p A[q,p]` for each row;
//! - valid queries: `q >= max(1, p_sink)` whose window still contains `p_sink` (without a sliding
//!   window, or with prompts no longer than it, that is just `q >= max(1, p_sink)`);
//! - sink gap `G = s[q,p_sink] - log Σ_{p visible, p != p_sink} exp s[q,p]` = `log(a/(1-a))`,
//!   from the scores with a stable log-sum-exp in f64, never from rounded probabilities;
//! - gap perturbation between a reference R and a target T on the same token ids, at R's sink:
//!   `B = max_{p visible, p != p_sink} |(sT[q,p] - sT[q,p_sink]) - (sR[q,p] - sR[q,p_sink])|`;
//! - `pos0 = A[q,0]` per valid query.
//!
//! Medians are exact and follow numpy: the middle value of the sorted observations, or the mean
//! of the two middle values when their count is even.

use serde::Serialize;

use crate::forward::backend::HeadView;

/// How the sink position is chosen (`--sink-position`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SinkPosition {
    /// One position per (prompt, layer, head): the key with the largest attention column mass
    /// (the default of docs/reference/sink-metrics.md#observations).
    Column,
    /// Each query row's own most-attended key.
    PerQuery,
}

/// What the sink gap G is computed from (`--gap-from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum GapFrom {
    /// The scores, with a stable log-sum-exp in f64: never infinite (the default of
    /// docs/reference/sink-metrics.md#observations).
    Scores,
    /// The attention probability a of the sink as the forward pass stored it (bf16-rounded under
    /// `--precision bf16`), as `log(a / (1 - a))`: what a probe on transformers' attention
    /// weights computes. In bf16 every a above 1 - 2^-9 is 1, and G = +inf.
    Probabilities,
}

/// The statistic Sink Strength S reports (`--stat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Stat {
    /// Median of G (the paper's S, Section 3.2).
    Median,
    /// Mean of G (Appendix E.4).
    Mean,
}

/// G above this counts as a strong sink (a > 0.881; Appendix D.2).
pub const STRONG_SINK_G: f64 = 2.0;

/// The metric observations of one head of one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadObservations {
    /// Valid queries, ascending.
    pub queries: Vec<u32>,
    /// Sink position of each valid query (all equal in column mode).
    pub sinks: Vec<u32>,
    /// G of each valid query.
    pub g: Vec<f64>,
    /// `A[q, 0]` of each valid query.
    pub pos0: Vec<f64>,
}

/// What a reference head keeps for the gap perturbation B of its targets: its causal scores
/// (the lower triangle, row `q` at offset `q(q+1)/2`) and its valid queries and sinks.
#[derive(Debug, Clone)]
pub struct ReferenceHead {
    pub len: usize,
    pub scores: Vec<f32>,
    pub queries: Vec<u32>,
    pub sinks: Vec<u32>,
}

/// For one query's visible scores `row` with the sink at `sink`: the sink gap
/// `G = row[sink] - log Σ_{p != sink} exp(row[p])` and `log Σ_p exp(row[p])`, both in f64 and
/// stable (each log-sum-exp is taken about its own maximum), in two passes over the row.
fn sink_gap(row: &[f32], sink: usize) -> (f64, f64) {
    let s_sink = row[sink] as f64;
    let mut m_others = f64::NEG_INFINITY;
    for (p, &v) in row.iter().enumerate() {
        if p != sink {
            m_others = m_others.max(v as f64);
        }
    }
    let mut sum_others = 0f64;
    for (p, &v) in row.iter().enumerate() {
        if p != sink {
            sum_others += (v as f64 - m_others).exp();
        }
    }
    let lse_others = m_others + sum_others.ln();
    // Σ over all keys about the overall maximum: the others' sum rescaled, plus the sink.
    let m_all = m_others.max(s_sink);
    let sum_all = sum_others * (m_others - m_all).exp() + (s_sink - m_all).exp();
    (s_sink - lse_others, m_all + sum_all.ln())
}

/// The lowest index of the largest value.
fn argmax(values: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, v) in values.enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0
}

/// Sink position per query row (`None` for rows that are not valid) and the valid rows.
fn sink_rows(view: &HeadView, mode: SinkPosition) -> Vec<Option<u32>> {
    let len = view.len;
    match mode {
        SinkPosition::Column => {
            let mut mass = vec![0f64; len];
            for q in 0..len {
                for (m, &a) in mass.iter_mut().zip(&view.probs[q * len..q * len + q + 1]) {
                    *m += a as f64;
                }
            }
            let sink = argmax(mass.into_iter());
            (0..len)
                .map(|q| {
                    let valid = q >= sink.max(1) && view.first_key(q) <= sink;
                    valid.then_some(sink as u32)
                })
                .collect()
        }
        SinkPosition::PerQuery => (0..len)
            .map(|q| {
                if q == 0 {
                    return None;
                }
                let lo = view.first_key(q);
                let row = &view.probs[q * len + lo..q * len + q + 1];
                Some((lo + argmax(row.iter().map(|&a| a as f64))) as u32)
            })
            .collect(),
    }
}

/// G and pos0 for every valid query of one head.
pub fn observe(view: &HeadView, mode: SinkPosition, gap_from: GapFrom) -> HeadObservations {
    let len = view.len;
    let mut obs = HeadObservations {
        queries: Vec::new(),
        sinks: Vec::new(),
        g: Vec::new(),
        pos0: Vec::new(),
    };
    for (q, sink) in sink_rows(view, mode).into_iter().enumerate() {
        let Some(sink) = sink else { continue };
        let sink = sink as usize;
        let lo = view.first_key(q);
        let row = &view.scores[q * len..q * len + q + 1];
        let (g, lse_all) = sink_gap(&row[lo..], sink - lo);
        let g = match gap_from {
            GapFrom::Scores => g,
            GapFrom::Probabilities => {
                let a = view.probs[q * len + sink] as f64;
                a.ln() - (1.0 - a).ln()
            }
        };
        let pos0 = if lo == 0 {
            (row[0] as f64 - lse_all).exp()
        } else {
            0.0
        };
        obs.queries.push(q as u32);
        obs.sinks.push(sink as u32);
        obs.g.push(g);
        obs.pos0.push(pos0);
    }
    obs
}

/// The paper's position-0 probe for one head (Section 4.3, Appendix C.3): the sum of `A[q, 0]`
/// over the trailing `trailing` query positions `q >= max(1, len - trailing)`, and their count.
/// Every such query counts, sink or not; `A[q, 0]` is 0 where key 0 has left a sliding window.
pub fn trailing_pos0(view: &HeadView, trailing: usize) -> (f64, usize) {
    let len = view.len;
    let first = len.saturating_sub(trailing).max(1);
    let mut sum = 0f64;
    for q in first..len {
        let lo = view.first_key(q);
        if lo == 0 {
            let row = &view.scores[q * len..q * len + q + 1];
            sum += (row[0] as f64 - log_sum_exp(row)).exp();
        }
    }
    (sum, len.saturating_sub(first))
}

/// `log Σ exp(row)` in f64, about the row's maximum.
fn log_sum_exp(row: &[f32]) -> f64 {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
}

impl ReferenceHead {
    /// Keep what B needs from a reference head: its scores and its valid queries and sinks.
    pub fn new(view: &HeadView, obs: &HeadObservations) -> ReferenceHead {
        let len = view.len;
        let mut scores = Vec::with_capacity(len * (len + 1) / 2);
        for q in 0..len {
            scores.extend_from_slice(&view.scores[q * len..q * len + q + 1]);
        }
        ReferenceHead {
            len,
            scores,
            queries: obs.queries.clone(),
            sinks: obs.sinks.clone(),
        }
    }

    /// B for every valid query of the reference, with `target` the same head of the same prompt
    /// of a model run on the same token ids.
    pub fn gap_perturbation(&self, target: &HeadView) -> Vec<f64> {
        let len = self.len;
        debug_assert_eq!(len, target.len);
        self.queries
            .iter()
            .zip(&self.sinks)
            .map(|(&q, &sink)| {
                let (q, sink) = (q as usize, sink as usize);
                let r = &self.scores[q * (q + 1) / 2..(q + 1) * (q + 2) / 2];
                let t = &target.scores[q * len..q * len + q + 1];
                let (r_sink, t_sink) = (r[sink] as f64, t[sink] as f64);
                (target.first_key(q)..=q)
                    .filter(|&p| p != sink)
                    .map(|p| ((t[p] as f64 - t_sink) - (r[p] as f64 - r_sink)).abs())
                    .fold(0f64, f64::max)
            })
            .collect()
    }
}

/// numpy's median: the middle value, or the mean of the two middle values for an even count;
/// NaN for no values. Reorders `values`.
pub fn median(values: &mut [f64]) -> f64 {
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    let k = n / 2;
    let (lower, upper, _) = values.select_nth_unstable_by(k, f64::total_cmp);
    let upper = *upper;
    if n % 2 == 1 {
        upper
    } else {
        let lower = lower.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (lower + upper) / 2.0
    }
}

/// Arithmetic mean; NaN for no values.
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        f64::NAN
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// numpy's default percentile (linear interpolation between closest ranks) of sorted values, for
/// `p` in `[0, 100]`; NaN for no values.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let h = (sorted.len() - 1) as f64 * p / 100.0;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

/// Sample standard deviation (n - 1 in the denominator); `None` below two values.
pub fn sample_std(values: &[f64]) -> Option<f64> {
    if values.len() < 2 {
        return None;
    }
    let m = mean(values);
    let ss: f64 = values.iter().map(|v| (v - m) * (v - m)).sum();
    Some((ss / (values.len() - 1) as f64).sqrt())
}

/// The most frequent value, lowest on ties; `None` for no values.
pub fn mode(values: &[u32]) -> Option<u32> {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let mut best: Option<(u32, usize)> = None;
    let mut i = 0;
    while i < sorted.len() {
        let j = sorted[i..].iter().take_while(|&&v| v == sorted[i]).count();
        if best.is_none_or(|(_, c)| j > c) {
            best = Some((sorted[i], j));
        }
        i += j;
    }
    best.map(|(v, _)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(
        scores: &'a [f32],
        probs: &'a [f32],
        len: usize,
        window: Option<usize>,
    ) -> HeadView<'a> {
        HeadView {
            prompt: 0,
            head: 0,
            len,
            keys: len,
            offset: 0,
            scores,
            probs,
            causal: true,
            window,
        }
    }

    /// Causal softmax of a square score matrix (test helper).
    fn softmax(scores: &[f32], len: usize) -> Vec<f32> {
        let mut p = vec![0f32; len * len];
        for q in 0..len {
            let row = &scores[q * len..q * len + q + 1];
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = row.iter().map(|&s| (s - m).exp()).sum();
            for k in 0..=q {
                p[q * len + k] = (row[k] - m).exp() / z;
            }
        }
        p
    }

    #[test]
    fn median_follows_numpy_for_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
        // numpy.percentile([1, 2, 3, 4], [2.5, 97.5]) = [1.075, 3.925]
        assert!((percentile_sorted(&[1.0, 2.0, 3.0, 4.0], 2.5) - 1.075).abs() < 1e-12);
        assert!((percentile_sorted(&[1.0, 2.0, 3.0, 4.0], 97.5) - 3.925).abs() < 1e-12);
        assert_eq!(sample_std(&[1.0]), None);
        assert!((sample_std(&[1.0, 2.0, 3.0]).unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(mode(&[3, 1, 3, 1, 2]), Some(1));
    }

    #[test]
    fn sink_gap_is_the_log_odds_of_the_sink_share() {
        // Key 0 is the sink: a strong score on it for every query.
        let len = 4;
        let mut s = vec![0f32; len * len];
        for q in 0..len {
            s[q * len] = 3.0;
            for p in 1..=q {
                s[q * len + p] = 0.5 * p as f32;
            }
        }
        let a = softmax(&s, len);
        let obs = observe(
            &view(&s, &a, len, None),
            SinkPosition::Column,
            GapFrom::Scores,
        );
        assert_eq!(obs.queries, vec![1, 2, 3]);
        assert!(obs.sinks.iter().all(|&p| p == 0));
        for (i, &q) in obs.queries.iter().enumerate() {
            let share = a[q as usize * len] as f64;
            assert!((obs.g[i] - (share / (1.0 - share)).ln()).abs() < 1e-5);
            assert!((obs.pos0[i] - share).abs() < 1e-6);
        }
    }

    #[test]
    fn gaps_from_saturated_probabilities_are_infinite() {
        let len = 3;
        let s = vec![0f32, 0.0, 0.0, 9.0, 0.0, 0.0, 9.0, 0.0, 0.0];
        let mut a = softmax(&s, len);
        // bf16 rounds 0.99988 up to 1: the probe on the rounded weights sees a saturated sink.
        a[len] = 1.0;
        let obs = observe(
            &view(&s, &a, len, None),
            SinkPosition::Column,
            GapFrom::Probabilities,
        );
        assert_eq!(obs.g[0], f64::INFINITY);
        let from_scores = observe(
            &view(&s, &a, len, None),
            SinkPosition::Column,
            GapFrom::Scores,
        );
        assert!((from_scores.g[0] - 9.0).abs() < 1e-6);
        let share = a[2 * len] as f64;
        assert!((obs.g[1] - (share / (1.0 - share)).ln()).abs() < 1e-9);
        // An f32 share 2.5e-4 below 1 holds 1 - a to about 2.4e-4 of itself, and so G.
        assert!((from_scores.g[1] - obs.g[1]).abs() < 2e-3);
    }

    #[test]
    fn trailing_pos0_averages_the_last_queries_only() {
        let len = 5;
        let mut s = vec![0f32; len * len];
        for q in 0..len {
            s[q * len] = 1.0;
        }
        let a = softmax(&s, len);
        let v = view(&s, &a, len, None);
        // The last 2 queries are 3 and 4: A[3,0] = e/(e+3), A[4,0] = e/(e+4).
        let e = std::f64::consts::E;
        let (sum, n) = trailing_pos0(&v, 2);
        assert_eq!(n, 2);
        assert!((sum - (e / (e + 3.0) + e / (e + 4.0))).abs() < 1e-6);
        // More trailing queries than the prompt has: every query but 0.
        assert_eq!(trailing_pos0(&v, 8).1, 4);
        // Key 0 out of a window of 2 for queries 2..: they count, with A[q,0] = 0.
        let (sum, n) = trailing_pos0(&view(&s, &a, len, Some(2)), 2);
        assert_eq!((sum, n), (0.0, 2));
    }

    #[test]
    fn gap_perturbation_is_zero_against_itself_and_sees_a_shift() {
        let len = 3;
        let s = vec![2.0f32, 0.0, 0.0, 2.0, 0.5, 0.0, 2.0, 0.1, 0.3];
        let a = softmax(&s, len);
        let v = view(&s, &a, len, None);
        let obs = observe(&v, SinkPosition::Column, GapFrom::Scores);
        let r = ReferenceHead::new(&v, &obs);
        assert!(r.gap_perturbation(&v).iter().all(|&b| b == 0.0));
        let mut t = s.clone();
        t[2 * len + 2] += 0.4; // query 2, key 2 gains 0.4 against the sink
        let b = r.gap_perturbation(&view(&t, &a, len, None));
        assert_eq!(b.len(), 2);
        assert_eq!(b[0], 0.0);
        assert!((b[1] - 0.4).abs() < 1e-6);
    }

    #[test]
    fn queries_that_no_longer_see_the_sink_are_not_valid() {
        let len = 4;
        let s = vec![0f32; len * len];
        let mut a = softmax(&s, len);
        // a window of 2 keys
        for q in 0..len {
            for k in 0..len {
                a[q * len + k] = if k <= q && k + 2 > q {
                    if q == 0 {
                        1.0
                    } else {
                        0.5
                    }
                } else {
                    0.0
                };
            }
        }
        let obs = observe(
            &view(&s, &a, len, Some(2)),
            SinkPosition::Column,
            GapFrom::Scores,
        );
        // column 0 holds 1.5 of mass, column 1 holds 1.0: sink 0, visible to queries 0 and 1 only.
        assert_eq!(obs.queries, vec![1]);
        let per_query = observe(
            &view(&s, &a, len, Some(2)),
            SinkPosition::PerQuery,
            GapFrom::Scores,
        );
        assert_eq!(per_query.queries, vec![1, 2, 3]);
        assert_eq!(per_query.sinks, vec![0, 1, 2]);
    }
}
