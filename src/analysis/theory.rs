//! The closed-form pieces of the paper's theory (Appendix A) and its sanity checks (A.6).
//!
//! Notation for one attention row (query q over keys p <= q) with sink position `sink`:
//! - sink log-odds `G = s_sink - log sum_{p != sink} exp(s_p)`, so the sink's share is
//!   `a = sigmoid(G)` and the non-sink mass is `1 - a = sigmoid(-G)`;
//! - gap perturbation between scores `s` and perturbed scores `s'`:
//!   `B = max_{p != sink} |(s'_p - s'_sink) - (s_p - s_sink)|`.
//!
//! **Lemma 1 (saturation transfer).** After a perturbation of size B the non-sink mass is at most
//! `sigmoid(B - G)`. Every non-sink gap `s_p - s_sink` grows by at most B, so the log-sum-exp of
//! the non-sink scores minus the sink's score grows by at most B: `G' >= G - B`. The bound is
//! attained when every non-sink score rises by B/2 and the sink's falls by B/2
//! ([`worst_case_perturbation`]).
//!
//! **Theorem 1 without QK norm** ([`gap_bound_without_qk_norm`]). With scores
//! `s[q,p] = (W_q x_q) . (W_k x_p) / sqrt(d_h)` (no bias, no RoPE) and weights moved to
//! `W_q + dW_q`, `W_k + dW_k`, the gap change is bilinear:
//! `(s'_p - s'_sink) - (s_p - s_sink) = x_q^T dM (x_p - x_sink) / sqrt(d_h)` with
//! `dM = (W_q + dW_q)^T (W_k + dW_k) - W_q^T W_k`, hence
//!
//! `B(q) <= ||x_q|| * (||dW_q|| ||W_k|| + ||W_q|| ||dW_k|| + ||dW_q|| ||dW_k||) * max_p ||x_p - x_sink|| / sqrt(d_h)`
//!
//! (operator norms). The bound, and in practice B, grows linearly with the sink token's massive
//! activation through `||x_p - x_sink||`: a small weight change moves a strong sink a lot.
//!
//! **With per-head QK norm** ([`gap_bound_with_qk_norm`]; eps = 0). With `q = n_q(W_q x)` where
//! `n(v) = gamma * v / RMS(v)`, every normalized vector has norm at most `sqrt(d_h) gamma_inf`,
//! and `||n(v') - n(v)|| <= 2 gamma_inf ||v' - v|| / RMS(v)`. With
//! `m = min_x RMS(W x) / ||x||` (the scorer's `m_q`, `m_k`), this gives
//!
//! `B <= 4 gamma_q_inf gamma_k_inf (||dW_q|| / m_q + ||dW_k|| / m_k)`,
//!
//! independent of any activation's magnitude: the norm caps how far a weight change can move the
//! sink gap.

use faer::Mat;

pub fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `log sum exp` over the entries of `scores` other than `skip`.
fn log_sum_exp_except(scores: &[f64], skip: usize) -> f64 {
    let max = scores
        .iter()
        .enumerate()
        .filter(|&(p, _)| p != skip)
        .map(|(_, &s)| s)
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = scores
        .iter()
        .enumerate()
        .filter(|&(p, _)| p != skip)
        .map(|(_, &s)| (s - max).exp())
        .sum();
    max + sum.ln()
}

/// Sink log-odds G of one attention row.
pub fn sink_log_odds(scores: &[f64], sink: usize) -> f64 {
    scores[sink] - log_sum_exp_except(scores, sink)
}

/// Attention mass outside the sink: `1 - softmax(scores)[sink]`, computed from the log-odds.
pub fn non_sink_mass(scores: &[f64], sink: usize) -> f64 {
    sigmoid(-sink_log_odds(scores, sink))
}

/// Gap perturbation B between two rows of scores at the same sink.
pub fn gap_perturbation(before: &[f64], after: &[f64], sink: usize) -> f64 {
    (0..before.len())
        .filter(|&p| p != sink)
        .map(|p| ((after[p] - after[sink]) - (before[p] - before[sink])).abs())
        .fold(0.0, f64::max)
}

/// Lemma 1's bound on the non-sink mass after a perturbation of size `b` of a row with sink
/// log-odds `g`.
pub fn lemma1_bound(g: f64, b: f64) -> f64 {
    sigmoid(b - g)
}

/// The perturbation of size `b` that attains Lemma 1's bound: every non-sink score rises by
/// b/2 and the sink's falls by b/2.
pub fn worst_case_perturbation(scores: &[f64], sink: usize, b: f64) -> Vec<f64> {
    scores
        .iter()
        .enumerate()
        .map(|(p, &s)| if p == sink { s - b / 2.0 } else { s + b / 2.0 })
        .collect()
}

/// Largest singular value of a small dense matrix.
pub fn op_norm(m: &Mat<f64>) -> f64 {
    m.singular_values()
        .expect("SVD of a small finite matrix converges")
        .first()
        .copied()
        .unwrap_or(0.0)
}

fn vec_norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// `W x` for `W` of shape [rows, cols].
pub fn mat_vec(w: &Mat<f64>, x: &[f64]) -> Vec<f64> {
    (0..w.nrows())
        .map(|i| (0..w.ncols()).map(|j| w[(i, j)] * x[j]).sum())
        .collect()
}

/// RMSNorm with unit scale and eps = 0.
fn rms_normalize(v: &[f64]) -> Vec<f64> {
    let rms = (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt();
    v.iter().map(|x| x / rms).collect()
}

/// One head's attention projections and their perturbation.
pub struct HeadWeights {
    /// [d_h, d]
    pub w_q: Mat<f64>,
    pub w_k: Mat<f64>,
    pub dw_q: Mat<f64>,
    pub dw_k: Mat<f64>,
}

impl HeadWeights {
    pub fn head_dim(&self) -> usize {
        self.w_q.nrows()
    }

    /// Scores of query `q` against keys `0..=q` (causal), without or with unit-scale per-head
    /// QK norm, before (`perturbed = false`) or after the weight change.
    pub fn scores(&self, x: &[Vec<f64>], q: usize, perturbed: bool, qk_norm: bool) -> Vec<f64> {
        let (wq, wk) = if perturbed {
            (&self.w_q + &self.dw_q, &self.w_k + &self.dw_k)
        } else {
            (self.w_q.clone(), self.w_k.clone())
        };
        let project = |w: &Mat<f64>, v: &[f64]| {
            let y = mat_vec(w, v);
            if qk_norm {
                rms_normalize(&y)
            } else {
                y
            }
        };
        let query = project(&wq, &x[q]);
        let scale = (self.head_dim() as f64).sqrt();
        (0..=q)
            .map(|p| {
                let key = project(&wk, &x[p]);
                query.iter().zip(&key).map(|(a, b)| a * b).sum::<f64>() / scale
            })
            .collect()
    }
}

/// Theorem 1's bound (no QK norm) on B for query `q` of tokens `x` with sink `sink`.
pub fn gap_bound_without_qk_norm(h: &HeadWeights, x: &[Vec<f64>], q: usize, sink: usize) -> f64 {
    let (nq, nk) = (op_norm(&h.w_q), op_norm(&h.w_k));
    let (dq, dk) = (op_norm(&h.dw_q), op_norm(&h.dw_k));
    let spread = (0..=q)
        .filter(|&p| p != sink)
        .map(|p| {
            let diff: Vec<f64> = x[p].iter().zip(&x[sink]).map(|(a, b)| a - b).collect();
            vec_norm(&diff)
        })
        .fold(0.0, f64::max);
    vec_norm(&x[q]) * (dq * nk + nq * dk + dq * dk) * spread / (h.head_dim() as f64).sqrt()
}

/// `min_x RMS(W x) / ||x||` over the given inputs (the scorer's `m_q` / `m_k` for one head).
pub fn min_rms_gain(w: &Mat<f64>, x: &[Vec<f64>]) -> f64 {
    x.iter()
        .map(|v| {
            let y = mat_vec(w, v);
            (y.iter().map(|a| a * a).sum::<f64>() / y.len() as f64).sqrt() / vec_norm(v)
        })
        .fold(f64::INFINITY, f64::min)
}

/// The QK-norm bound on B (unit gamma, so `gamma_inf = 1`), with `m_q`, `m_k` taken over `x`.
pub fn gap_bound_with_qk_norm(h: &HeadWeights, x: &[Vec<f64>]) -> f64 {
    let m_q = min_rms_gain(&h.w_q, x);
    let m_k = min_rms_gain(&h.w_k, x);
    4.0 * (op_norm(&h.dw_q) / m_q + op_norm(&h.dw_k) / m_k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::metrics::percentile_sorted;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use rand_distr::StandardNormal;

    /// Appendix A.6, Lemma 1: G = 3.0, B = 0.4, N = 64 keys; the worst case leaves non-sink
    /// mass sigmoid(B - G) = 0.069, and no perturbation of size B leaves more.
    #[test]
    fn lemma1_worst_case_attains_the_bound() {
        let (g, b, n, sink) = (3.0, 0.4, 64, 0);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut scores: Vec<f64> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        // Place the sink's score so that its log-odds are exactly G.
        scores[sink] = g + log_sum_exp_except(&scores, sink);
        assert!((sink_log_odds(&scores, sink) - g).abs() < 1e-12);
        assert!((non_sink_mass(&scores, sink) - sigmoid(-g)).abs() < 1e-12);

        let worst = worst_case_perturbation(&scores, sink, b);
        assert!((gap_perturbation(&scores, &worst, sink) - b).abs() < 1e-12);
        let mass = non_sink_mass(&worst, sink);
        let bound = lemma1_bound(g, b);
        assert!((mass - bound).abs() < 1e-12, "{mass} vs {bound}");
        assert_eq!(format!("{bound:.3}"), "0.069");
        // Direct softmax agrees with the log-odds route.
        let max = worst.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = worst.iter().map(|s| (s - max).exp()).sum();
        assert!((1.0 - (worst[sink] - max).exp() / z - mass).abs() < 1e-12);

        // Any other perturbation of size at most B stays under the bound.
        for _ in 0..2000 {
            let moved: Vec<f64> = scores
                .iter()
                .map(|s| s + rng.random_range(-b / 2.0..=b / 2.0))
                .collect();
            assert!(gap_perturbation(&scores, &moved, sink) <= b + 1e-12);
            assert!(non_sink_mass(&moved, sink) <= bound + 1e-12);
        }
    }

    fn gaussian(rng: &mut ChaCha8Rng, rows: usize, cols: usize, std: f64) -> Mat<f64> {
        Mat::from_fn(rows, cols, |_, _| {
            std * rng.sample::<f64, _>(StandardNormal)
        })
    }

    /// The synthetic case of Appendix A.6: d = 16, d_h = 4, N = 8 tokens, the sink token
    /// (position 0) carries a massive activation of 10 in channel 3, ||dW||_op = 0.1.
    fn synthetic(massive: f64) -> (HeadWeights, Vec<Vec<f64>>) {
        let (d, d_h, n) = (16, 4, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(2609_00746);
        let mut x: Vec<Vec<f64>> = (0..n)
            .map(|_| (0..d).map(|_| rng.sample(StandardNormal)).collect())
            .collect();
        x[0][3] = massive;
        (head_weights(&mut rng, d, d_h), x)
    }

    /// Gaussian W_q, W_k with standard deviation 1/sqrt(d), and Gaussian dW_q, dW_k scaled to
    /// ||dW||_op = 0.1 (Appendix A.6), drawn in that order.
    fn head_weights(rng: &mut ChaCha8Rng, d: usize, d_h: usize) -> HeadWeights {
        let std = 1.0 / (d as f64).sqrt();
        let scaled = |rng: &mut ChaCha8Rng| {
            let m = gaussian(rng, d_h, d, 1.0);
            let s = 0.1 / op_norm(&m);
            Mat::from_fn(d_h, d, |i, j| m[(i, j)] * s)
        };
        HeadWeights {
            w_q: gaussian(rng, d_h, d, std),
            w_k: gaussian(rng, d_h, d, std),
            dw_q: scaled(rng),
            dw_k: scaled(rng),
        }
    }

    #[test]
    fn theorem1_synthetic_case_satisfies_the_no_qk_norm_bound() {
        let (h, x) = synthetic(10.0);
        assert!((op_norm(&h.dw_q) - 0.1).abs() < 1e-12 && (op_norm(&h.dw_k) - 0.1).abs() < 1e-12);
        let sink = 0;
        let mut tightest: f64 = 0.0;
        for q in 1..x.len() {
            let before = h.scores(&x, q, false, false);
            let after = h.scores(&x, q, true, false);
            let b = gap_perturbation(&before, &after, sink);
            let bound = gap_bound_without_qk_norm(&h, &x, q, sink);
            assert!(
                b > 0.0 && b <= bound,
                "query {q}: B = {b} exceeds the bound {bound}"
            );
            tightest = tightest.max(b / bound);
        }
        // The bound is informative here, not vacuous.
        assert!(tightest > 0.05, "B / bound peaked at {tightest}");
    }

    /// Appendix A.6's own setup for Theorem 1 (RoPE-free, no QK norm): d = 16, d_h = 4, N = 8
    /// key positions with i.i.d. Gaussian backgrounds normalized to unit norm; the sink (position
    /// 0) is its background plus 10 in channel 3; Gaussian dW_q, dW_k scaled to
    /// ||dW||_op = 0.1. The query is the last position, which sees all N keys.
    fn paper_synthetic(seed: u64) -> (HeadWeights, Vec<Vec<f64>>) {
        let (d, d_h, n) = (16, 4, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut x: Vec<Vec<f64>> = (0..n)
            .map(|_| {
                let b: Vec<f64> = (0..d).map(|_| rng.sample(StandardNormal)).collect();
                let norm = vec_norm(&b);
                b.into_iter().map(|v| v / norm).collect()
            })
            .collect();
        x[0][3] += 10.0;
        (head_weights(&mut rng, d, d_h), x)
    }

    /// Percent of the sorted draws `v` strictly below `x`.
    fn rank_of(v: &[f64], x: f64) -> f64 {
        100.0 * v.partition_point(|&a| a < x) as f64 / v.len() as f64
    }

    /// The paper's single unseeded draw gave sup_p |delta_p - delta_sink| = 0.169 against the
    /// bound 0.197 (ratio 0.86). Over ChaCha8 seeds 0..999 the bound holds for every query of every
    /// draw; the distribution for the last query, and where the paper's sample falls in it,
    /// prints with `cargo test --lib theorem1_paper_setup -- --nocapture`.
    #[test]
    fn theorem1_paper_setup_holds_the_bound_on_1000_seeded_draws() {
        let sink = 0;
        let (mut measured, mut bound, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        for seed in 0..1000 {
            let (h, x) = paper_synthetic(seed);
            assert!(
                (op_norm(&h.dw_q) - 0.1).abs() < 1e-12 && (op_norm(&h.dw_k) - 0.1).abs() < 1e-12
            );
            assert!((vec_norm(&x[1]) - 1.0).abs() < 1e-12);
            for q in 1..x.len() {
                let before = h.scores(&x, q, false, false);
                let after = h.scores(&x, q, true, false);
                let b = gap_perturbation(&before, &after, sink);
                let limit = gap_bound_without_qk_norm(&h, &x, q, sink);
                assert!(
                    b > 0.0 && b <= limit,
                    "seed {seed}, query {q}: B = {b} exceeds the bound {limit}"
                );
                if q == x.len() - 1 {
                    measured.push(b);
                    bound.push(limit);
                    ratio.push(b / limit);
                }
            }
        }
        println!("Theorem 1, Appendix A.6 setup, 1000 draws (ChaCha8 seeds 0..999), last query:");
        println!(
            "{:8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}   paper  its rank",
            "", "min", "p5", "p25", "median", "p75", "p95", "max"
        );
        for (name, v, paper) in [
            ("measured", &mut measured, 0.169),
            ("bound", &mut bound, 0.197),
            ("ratio", &mut ratio, 0.86),
        ] {
            v.sort_by(f64::total_cmp);
            let cols: Vec<String> = [0.0, 5.0, 25.0, 50.0, 75.0, 95.0, 100.0]
                .iter()
                .map(|&p| format!("{:7.3}", percentile_sorted(v, p)))
                .collect();
            println!(
                "{name:8} {}   {paper:5.3}  {:5.1}%",
                cols.join(" "),
                rank_of(v, paper)
            );
        }
        // This general bound (the triangle inequality over dW_q and dW_k, operator norms) is
        // several times the paper's specialised 0.197, so the paper's ratio 0.86 lies beyond
        // every draw; it is still within a factor of 20 of B on the top 5% of draws.
        let p95 = percentile_sorted(&ratio, 95.0);
        assert!(p95 > 0.05, "95th percentile of B / bound: {p95}");
    }

    #[test]
    fn qk_norm_caps_the_gap_change_a_massive_activation_inflates() {
        let worst_b = |massive: f64, qk_norm: bool| {
            let (h, x) = synthetic(massive);
            (1..x.len())
                .map(|q| {
                    let before = h.scores(&x, q, false, qk_norm);
                    let after = h.scores(&x, q, true, qk_norm);
                    gap_perturbation(&before, &after, 0)
                })
                .fold(0.0, f64::max)
        };
        // Without QK norm, B grows with the massive activation.
        assert!(worst_b(100.0, false) > 5.0 * worst_b(10.0, false));
        // With QK norm, B stays under a bound that does not depend on it.
        for massive in [10.0, 100.0, 1000.0] {
            let (h, x) = synthetic(massive);
            let bound = gap_bound_with_qk_norm(&h, &x);
            let b = worst_b(massive, true);
            assert!(b <= bound, "massive {massive}: B = {b} vs bound {bound}");
        }
        assert!(worst_b(1000.0, true) < 2.0 * worst_b(10.0, true));
    }
}
