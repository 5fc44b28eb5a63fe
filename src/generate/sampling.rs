//! Choosing each next token from the model's logits, as transformers' `generate` does: the
//! logits processors `GenerationMixin._get_logits_processor` (`generation/utils.py`) builds for
//! the settings, in its order, then greedy's argmax or one draw from the softmax; and the
//! per-step statistics of the raw distribution.
//!
//! The processors compute in f32 as torch does: a Python float (temperature, penalty, `min_p`,
//! `1 - top_p`) meets an f32 tensor as an f32, so it is rounded to f32 first, and `cumsum`
//! accumulates in f64 and stores f32 (torch's CPU kernel). Softmax sums in f64, which is within an
//! ulp of torch's vectorised f32 sum; the goldens (`tools/gen_sampling_goldens.py`) stay clear of
//! top-p and min-p thresholds that an ulp decides.
//!
//! The draws are ours: `torch.multinomial`'s stream depends on torch's generator, device and
//! kernel, and cannot be matched, so a sampled run follows transformers' distribution, not its
//! tokens. A draw is one f64 uniform `u` in [0, 1) from `rand_chacha::ChaCha20Rng::seed_from_u64`,
//! and the token is the first id, in id order, whose cumulative probability (an f64 sum of the
//! f32 probabilities) exceeds `u` times their total. Everything here is sequential (no parallel
//! reduction), so the same seed gives the same tokens at any thread count.

use std::cmp::Ordering;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::Serialize;

use crate::error::Result;
use crate::generate::config::Settings;
use crate::non_finite;

/// One of the processors transformers builds for these settings (`generation/logits_process.py`).
/// The values are the settings' Python floats, rounded to f32 where torch rounds them.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Processor {
    /// `RepetitionPenaltyLogitsProcessor`: applies in greedy decoding too.
    RepetitionPenalty(f32),
    /// `TemperatureLogitsWarper`.
    Temperature(f32),
    /// `TopKLogitsWarper`, k already at least `min_tokens_to_keep` (1).
    TopK(usize),
    /// `TopPLogitsWarper`: the threshold `1 - top_p`, computed in f64 by Python, then f32.
    TopP(f32),
    /// `MinPLogitsWarper`.
    MinP(f32),
}

impl Processor {
    /// transformers' class name.
    fn name(self) -> &'static str {
        match self {
            Processor::RepetitionPenalty(_) => "RepetitionPenaltyLogitsProcessor",
            Processor::Temperature(_) => "TemperatureLogitsWarper",
            Processor::TopK(_) => "TopKLogitsWarper",
            Processor::TopP(_) => "TopPLogitsWarper",
            Processor::MinP(_) => "MinPLogitsWarper",
        }
    }

    fn apply(self, scores: &mut [f32], previous_ids: &[u32]) {
        match self {
            Processor::RepetitionPenalty(penalty) => {
                // transformers gathers the scores of the ids present, penalises each once and
                // scatters them back; ids past the vocabulary fall in a padding column it drops.
                let mut seen = vec![false; scores.len()];
                for &id in previous_ids {
                    if let Some(s) = seen.get_mut(id as usize) {
                        *s = true;
                    }
                }
                for (score, _) in scores.iter_mut().zip(&seen).filter(|(_, &s)| s) {
                    *score = if *score < 0.0 {
                        *score * penalty
                    } else {
                        *score / penalty
                    };
                }
            }
            Processor::Temperature(t) => scores.iter_mut().for_each(|s| *s /= t),
            Processor::TopK(k) => {
                // `scores < torch.topk(scores, k)[0][..., -1]`: every tie of the k-th value stays.
                let Some(k) = k.min(scores.len()).checked_sub(1) else {
                    return;
                };
                let mut sorted = scores.to_vec();
                let (_, kth, _) = sorted.select_nth_unstable_by(k, |a, b| by_value(b, a));
                let kth = *kth;
                remove(scores, |s| s < kth);
            }
            Processor::TopP(threshold) => {
                // Sort ascending (torch's CPU sort is stable: lower ids first among ties),
                // remove where the cumulative probability is <= 1 - top_p, but never the last
                // (largest) `min_tokens_to_keep` = 1.
                let mut order: Vec<usize> = (0..scores.len()).collect();
                order.sort_by(|&a, &b| by_value(&scores[a], &scores[b]));
                let sorted: Vec<f32> = order.iter().map(|&i| scores[i]).collect();
                let probs = softmax(&sorted);
                let mut cumulative = 0f64;
                let mut drop = Vec::new();
                for (&i, &p) in order.iter().zip(&probs).take(order.len().saturating_sub(1)) {
                    cumulative += f64::from(p);
                    if cumulative as f32 <= threshold {
                        drop.push(i);
                    }
                }
                for i in drop {
                    scores[i] = f32::NEG_INFINITY;
                }
            }
            Processor::MinP(min_p) => {
                // Relative to the top probability. transformers also keeps the top
                // `min_tokens_to_keep` (1) token, which min_p <= 1 never removes.
                let probs = softmax(scores);
                let top = probs.iter().copied().fold(0f32, f32::max);
                let scaled = min_p * top;
                for (s, p) in scores.iter_mut().zip(probs) {
                    if p < scaled {
                        *s = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Set the scores `filter` picks to -inf, transformers' `filter_value`.
fn remove(scores: &mut [f32], filter: impl Fn(f32) -> bool) {
    for s in scores.iter_mut().filter(|s| filter(**s)) {
        *s = f32::NEG_INFINITY;
    }
}

/// Order by value as torch compares (-0.0 equals 0.0); the scores hold no NaN by then
/// ([`Sampler::step`] refuses them first).
fn by_value(a: &f32, b: &f32) -> Ordering {
    a.partial_cmp(b).unwrap_or(Ordering::Equal)
}

/// The processor chain for some settings, in `_get_logits_processor`'s order.
#[derive(Debug, Clone, PartialEq)]
pub struct Processors {
    chain: Vec<Processor>,
}

impl Processors {
    /// The chain `_get_logits_processor` builds for `settings` with one beam (so
    /// `min_tokens_to_keep` = 1): the repetition penalty unless 1.0, then, only when sampling,
    /// temperature unless 1.0, top-k unless 0, top-p unless >= 1.0, and min-p when set.
    pub fn new(settings: &Settings) -> Processors {
        let mut chain = Vec::new();
        let penalty = settings.repetition_penalty.value;
        if penalty != 1.0 {
            chain.push(Processor::RepetitionPenalty(penalty as f32));
        }
        if settings.do_sample.value {
            let temperature = settings.temperature.value;
            if temperature != 1.0 {
                chain.push(Processor::Temperature(temperature as f32));
            }
            let top_k = settings.top_k.value;
            if top_k != 0 {
                chain.push(Processor::TopK(
                    usize::try_from(top_k).unwrap_or(usize::MAX),
                ));
            }
            let top_p = settings.top_p.value;
            if top_p < 1.0 {
                chain.push(Processor::TopP((1.0 - top_p) as f32));
            }
            if let Some(min_p) = settings.min_p.value {
                chain.push(Processor::MinP(min_p as f32));
            }
        }
        Processors { chain }
    }

    /// transformers' class names of the chain, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.chain.iter().map(|p| p.name()).collect()
    }

    /// Apply the chain to one step's `logits` (NaN-free), given the sequence so far,
    /// `previous_ids`, prompt included (transformers' `input_ids`).
    pub fn process(&self, logits: &mut [f32], previous_ids: &[u32]) {
        for p in &self.chain {
            p.apply(logits, previous_ids);
        }
    }
}

/// The softmax of `scores` (-inf entries give 0): f32 exponentials of the max-subtracted scores,
/// summed in f64.
pub fn softmax(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|&s| (s - max).exp()).collect();
    let total: f64 = exps.iter().map(|&e| f64::from(e)).sum();
    exps.iter()
        .map(|&e| (f64::from(e) / total) as f32)
        .collect()
}

/// Greedy's choice: the first index of the largest score, as `torch.argmax`.
pub fn argmax(scores: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &s) in scores.iter().enumerate() {
        if s > scores[best] {
            best = i;
        }
    }
    best as u32
}

/// One draw from `probs` (not all zero) with the module's rule: the first id whose cumulative
/// probability exceeds `u` times the total. Rounding can leave the sum short of the target at the
/// end; the last id with a nonzero probability is then drawn, never a zero one.
pub fn draw(rng: &mut ChaCha20Rng, probs: &[f32]) -> u32 {
    let total: f64 = probs.iter().map(|&p| f64::from(p)).sum();
    let target = rng.random::<f64>() * total;
    let mut cumulative = 0f64;
    let mut last = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cumulative += f64::from(p);
            last = i;
            if cumulative > target {
                return i as u32;
            }
        }
    }
    last as u32
}

/// One alternative in [`StepStats::top5`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopToken {
    pub token_id: u32,
    pub logprob: f32,
}

/// A step's chosen token and the raw distribution it came from: the model's log-softmax, before
/// any processor (transformers' `output_logits`, not the processed `output_scores`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepStats {
    pub token_id: u32,
    /// The chosen token's log-probability under the raw distribution.
    pub logprob: f32,
    /// The raw distribution's entropy, in nats.
    pub entropy: f32,
    /// The five most likely tokens, by log-probability descending then id ascending; tokens of
    /// probability 0 (-inf logits) are left out.
    pub top5: Vec<TopToken>,
}

/// The most likely tokens [`StepStats::top5`] lists.
const TOP: usize = 5;

/// [`StepStats`] for `token_id` from the raw `logits` (finite or -inf, not all -inf): a stable
/// log-softmax, max subtracted, the exponentials summed in f64. It runs on every decode step over
/// the whole vocabulary, so it takes one exponential per logit (the entropy as
/// `ln Z - Σ e·(x - max) / Z`, with `e = exp(x - max)` and `Z = Σ e`) and keeps the top five in
/// one pass instead of sorting the vocabulary.
pub fn step_stats(logits: &[f32], token_id: u32) -> StepStats {
    let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let (mut total, mut weighted) = (0f64, 0f64);
    for &x in logits.iter().filter(|x| x.is_finite()) {
        let shifted = f64::from(x) - max;
        let e = shifted.exp();
        total += e;
        weighted += e * shifted;
    }
    let log_total = max + total.ln();
    let logprob = |i: usize| f64::from(logits[i]) - log_total;
    // Scanning ids upwards and displacing only a strictly smaller entry keeps the lower id first
    // among equal log-probabilities.
    let mut top: Vec<(usize, f64)> = Vec::with_capacity(TOP + 1);
    for i in (0..logits.len()).filter(|&i| logits[i].is_finite()) {
        let l = logprob(i);
        if top.len() == TOP && l <= top[TOP - 1].1 {
            continue;
        }
        let at = top.partition_point(|&(_, t)| t >= l);
        top.insert(at, (i, l));
        top.truncate(TOP);
    }
    let top5 = top
        .iter()
        .map(|&(i, l)| TopToken {
            token_id: i as u32,
            logprob: l as f32,
        })
        .collect();
    let entropy = total.ln() - weighted / total;
    StepStats {
        token_id,
        logprob: logprob(token_id as usize) as f32,
        entropy: entropy as f32,
        top5,
    }
}

/// The next-token chooser of one generation: the processor chain, and the seeded generator when
/// sampling.
#[derive(Debug, Clone)]
pub struct Sampler {
    processors: Processors,
    rng: Option<ChaCha20Rng>,
}

impl Sampler {
    /// The chooser for `settings`; `seed` seeds the draws when they sample.
    pub fn new(settings: &Settings, seed: u64) -> Sampler {
        Sampler {
            processors: Processors::new(settings),
            rng: settings
                .do_sample
                .value
                .then(|| ChaCha20Rng::seed_from_u64(seed)),
        }
    }

    /// The processor chain, for reports.
    pub fn processors(&self) -> &Processors {
        &self.processors
    }

    /// Choose the token after `previous_ids` (the whole sequence so far) from the model's
    /// `logits` for it; `step` (0 for the first generated token) names the step in errors.
    /// Logits with NaN or +inf, or all -inf, are a non-finite error (exit 3), and so are
    /// processed scores that overflow (a tiny temperature).
    pub fn step(&mut self, logits: &[f32], previous_ids: &[u32], step: usize) -> Result<StepStats> {
        check_scores(logits, step, "the model's logits")?;
        let mut scores = logits.to_vec();
        self.processors.process(&mut scores, previous_ids);
        check_scores(&scores, step, "the processed scores")?;
        let token_id = match &mut self.rng {
            Some(rng) => draw(rng, &softmax(&scores)),
            None => argmax(&scores),
        };
        Ok(step_stats(logits, token_id))
    }
}

/// Scores a distribution can come from: no NaN, no +inf, not all -inf.
pub fn check_scores(scores: &[f32], step: usize, what: &str) -> Result<()> {
    if let Some(i) = scores
        .iter()
        .position(|s| s.is_nan() || *s == f32::INFINITY)
    {
        return Err(non_finite!(
            "generation step {step}: {what} hold {} at token id {i}",
            scores[i]
        ));
    }
    if scores.iter().all(|s| *s == f32::NEG_INFINITY) {
        return Err(non_finite!(
            "generation step {step}: {what} are all -inf (or empty): no token can be chosen"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;
    use crate::generate::config::{GenerationConfig, Overrides};
    use serde_json::Value;

    /// One case of `tests/fixtures/generate/sampling/processors.json`.
    struct Case {
        kind: String,
        settings: Settings,
        processors: Vec<String>,
        previous_ids: Vec<u32>,
        logits: Vec<f32>,
        scores: Vec<f32>,
        probs: Vec<f32>,
        argmax: u32,
    }

    /// The fixture's numbers: f32 values, null for -inf.
    fn numbers(v: &Value) -> Vec<f32> {
        let list = v.as_array().unwrap();
        list.iter()
            .map(|x| x.as_f64().map_or(f32::NEG_INFINITY, |x| x as f32))
            .collect()
    }

    /// Settings as the CLI would make them: every value a flag, over no generation_config.json.
    fn settings(s: &Value) -> Settings {
        let none = std::path::Path::new("/nonexistent/sinkmerge-sampling-test");
        let flags = Overrides {
            do_sample: s["do_sample"].as_bool(),
            temperature: s["temperature"].as_f64(),
            top_k: s["top_k"].as_u64(),
            top_p: s["top_p"].as_f64(),
            min_p: s["min_p"].as_f64(),
            repetition_penalty: s["repetition_penalty"].as_f64(),
            max_new_tokens: None,
        };
        GenerationConfig::read(none).unwrap().with(&flags).unwrap()
    }

    fn cases() -> Vec<Case> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/generate/sampling/processors.json"
        );
        let doc: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(doc["transformers"], "5.25.0");
        let cases: Vec<Case> = doc["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| Case {
                kind: c["kind"].as_str().unwrap().to_string(),
                settings: settings(&c["settings"]),
                processors: (c["processors"].as_array().unwrap().iter())
                    .map(|p| p.as_str().unwrap().to_string())
                    .collect(),
                previous_ids: (c["previous_ids"].as_array().unwrap().iter())
                    .map(|i| i.as_u64().unwrap() as u32)
                    .collect(),
                logits: numbers(&c["logits"]),
                scores: numbers(&c["scores"]),
                probs: numbers(&c["probs"]),
                argmax: c["argmax"].as_u64().unwrap() as u32,
            })
            .collect();
        assert_eq!(cases.len(), 100);
        cases
    }

    #[test]
    fn processed_scores_and_distributions_match_transformers() {
        for (n, case) in cases().iter().enumerate() {
            let processors = Processors::new(&case.settings);
            let mut scores = case.logits.clone();
            processors.process(&mut scores, &case.previous_ids);
            for (i, (&got, &want)) in scores.iter().zip(&case.scores).enumerate() {
                if want == f32::NEG_INFINITY {
                    assert_eq!(got, want, "case {n} ({}), id {i}", case.kind);
                } else {
                    let tolerance = 1e-6 * want.abs().max(1.0);
                    assert!(
                        (got - want).abs() <= tolerance,
                        "case {n} ({}), id {i}: {got} vs transformers' {want}",
                        case.kind
                    );
                }
            }
            for (i, (got, want)) in softmax(&scores).iter().zip(&case.probs).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-6,
                    "case {n} ({}), id {i}: probability {got} vs transformers' {want}",
                    case.kind
                );
            }
            assert_eq!(argmax(&scores), case.argmax, "case {n}");
            assert_eq!(processors.names(), case.processors, "case {n}");
        }
    }

    /// The regularized upper incomplete gamma function Q(a, x): the series for P below a + 1,
    /// Lentz's continued fraction for Q above (Numerical Recipes, `gser` and `gcf`).
    fn upper_gamma_q(a: f64, x: f64) -> f64 {
        let prefactor = (-x + a * x.ln() - libm::lgamma(a)).exp();
        if x < a + 1.0 {
            let (mut term, mut sum, mut ap) = (1.0 / a, 1.0 / a, a);
            while term.abs() > sum.abs() * 1e-15 {
                ap += 1.0;
                term *= x / ap;
                sum += term;
            }
            1.0 - sum * prefactor
        } else {
            let tiny = 1e-300;
            let mut b = x + 1.0 - a;
            let (mut c, mut d) = (1.0 / tiny, 1.0 / b);
            let mut h = d;
            for i in 1..10_000 {
                let an = -(i as f64) * (i as f64 - a);
                b += 2.0;
                d = an * d + b;
                d = if d.abs() < tiny { tiny } else { d };
                c = b + an / c;
                c = if c.abs() < tiny { tiny } else { c };
                d = 1.0 / d;
                let delta = d * c;
                h *= delta;
                if (delta - 1.0).abs() < 1e-15 {
                    break;
                }
            }
            prefactor * h
        }
    }

    /// Pearson's chi-square p-value of `counts` against `probs`, bins of expected count < 5
    /// merged with their neighbours in id order; `None` when fewer than two bins remain.
    fn chi_square_p(counts: &[u64], probs: &[f32]) -> Option<f64> {
        let n: u64 = counts.iter().sum();
        let mut bins: Vec<(f64, f64)> = Vec::new();
        let (mut expected, mut observed) = (0.0, 0.0);
        for (&c, &p) in counts.iter().zip(probs) {
            expected += n as f64 * f64::from(p);
            observed += c as f64;
            if expected >= 5.0 {
                bins.push((expected, observed));
                (expected, observed) = (0.0, 0.0);
            }
        }
        match bins.last_mut() {
            Some(last) => {
                last.0 += expected;
                last.1 += observed;
            }
            None => return None,
        }
        if bins.len() < 2 {
            return None;
        }
        let chi2: f64 = bins.iter().map(|(e, o)| (o - e) * (o - e) / e).sum();
        Some(upper_gamma_q((bins.len() - 1) as f64 / 2.0, chi2 / 2.0))
    }

    #[test]
    fn the_p_value_matches_chi_square_tables() {
        for (chi2, df, p) in [
            (3.841, 1.0, 0.05),
            (6.635, 1.0, 0.01),
            (18.307, 10.0, 0.05),
            (124.342, 100.0, 0.05),
            (2.558, 10.0, 0.99),
        ] {
            let q = upper_gamma_q(df / 2.0, chi2 / 2.0);
            assert!((q - p).abs() < 2e-4, "chi2 {chi2}, df {df}: {q} vs {p}");
        }
    }

    #[test]
    fn draws_follow_transformers_distribution() {
        const DRAWS: usize = 100_000;
        let mut tested = 0;
        for (n, case) in cases().iter().enumerate() {
            if !case.settings.do_sample.value || tested == 6 {
                continue;
            }
            let mut scores = case.logits.clone();
            Processors::new(&case.settings).process(&mut scores, &case.previous_ids);
            let probs = softmax(&scores);
            let mut rng = ChaCha20Rng::seed_from_u64(n as u64);
            let mut counts = vec![0u64; probs.len()];
            for _ in 0..DRAWS {
                counts[draw(&mut rng, &probs) as usize] += 1;
            }
            for (i, (&c, &p)) in counts.iter().zip(&case.probs).enumerate() {
                assert!(
                    p > 0.0 || c == 0,
                    "case {n}: id {i}, filtered, drawn {c} times"
                );
            }
            let Some(p) = chi_square_p(&counts, &case.probs) else {
                continue;
            };
            assert!(p > 0.001, "case {n} ({}): chi-square p = {p}", case.kind);
            // The same draws against another distribution (the mass of the two most likely
            // tokens swapped, when they differ) are told apart.
            let mut order: Vec<usize> = (0..probs.len()).collect();
            order.sort_by(|&a, &b| case.probs[b].total_cmp(&case.probs[a]));
            let (a, b) = (order[0], order[1]);
            if case.probs[a] - case.probs[b] > 0.01 {
                let mut wrong = case.probs.clone();
                wrong.swap(a, b);
                let p = chi_square_p(&counts, &wrong).unwrap();
                assert!(p < 1e-6, "case {n}: a swapped distribution passes, p = {p}");
            }
            tested += 1;
        }
        assert_eq!(tested, 6);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens_and_another_seed_others() {
        let case = cases()
            .into_iter()
            .find(|c| {
                c.settings.do_sample.value && c.probs.iter().filter(|p| **p > 0.05).count() > 3
            })
            .unwrap();
        let run = |seed: u64| -> Vec<u32> {
            let mut sampler = Sampler::new(&case.settings, seed);
            (0..200)
                .map(|step| {
                    (sampler.step(&case.logits, &case.previous_ids, step))
                        .unwrap()
                        .token_id
                })
                .collect()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn greedy_takes_the_first_largest_processed_score() {
        let case = cases()
            .into_iter()
            .find(|c| !c.settings.do_sample.value && !c.previous_ids.is_empty())
            .unwrap();
        let mut sampler = Sampler::new(&case.settings, 0);
        let stats = sampler.step(&case.logits, &case.previous_ids, 0).unwrap();
        assert_eq!(stats.token_id, case.argmax);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NEG_INFINITY]), 1);
    }

    #[test]
    fn step_stats_top5_and_entropy_match_a_full_sort_and_two_passes() {
        // 2000 logits on a coarse grid (the largest value ~50 times: the top five are all ties)
        // with some -inf, against a full sort by value then id and the textbook entropy.
        let logits: Vec<f32> = (0..2000u32)
            .map(|i| match (i * 7919) % 13 {
                0 => f32::NEG_INFINITY,
                _ => ((i * 104_729) % 37) as f32 * 0.25,
            })
            .collect();
        let stats = step_stats(&logits, 3);
        let mut ids: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i].is_finite())
            .collect();
        ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let top: Vec<u32> = stats.top5.iter().map(|t| t.token_id).collect();
        let want: Vec<u32> = ids[..5].iter().map(|&i| i as u32).collect();
        assert_eq!(top, want);
        assert_eq!(logits[ids[0]], logits[ids[4]], "the case holds ties");
        let max = f64::from(logits[ids[0]]);
        let z: f64 = ids
            .iter()
            .map(|&i| (f64::from(logits[i]) - max).exp())
            .sum();
        let entropy: f64 = ids
            .iter()
            .map(|&i| f64::from(logits[i]) - max - z.ln())
            .map(|l| -l.exp() * l)
            .sum();
        assert!((f64::from(stats.entropy) - entropy).abs() < 1e-6 * entropy);
    }

    #[test]
    fn step_stats_of_a_hand_checked_distribution() {
        // Probabilities 1, 2, 3, 4, 2 and 0 twelfths.
        let logits = [1f32, 2.0, 3.0, 4.0, 2.0, 0.0].map(|w| {
            if w == 0.0 {
                f32::NEG_INFINITY
            } else {
                w.ln() + 0.5
            }
        });
        let stats = step_stats(&logits, 4);
        let ln12 = 12f32.ln();
        assert_eq!(stats.token_id, 4);
        assert!((stats.logprob - (2f32.ln() - ln12)).abs() < 1e-6);
        // -Σ p ln p over the five nonzero twelfths.
        assert!(
            (stats.entropy - 1.517_106_4).abs() < 1e-6,
            "{}",
            stats.entropy
        );
        let top: Vec<u32> = stats.top5.iter().map(|t| t.token_id).collect();
        assert_eq!(top, [3, 2, 1, 4, 0], "ties by id, the -inf token left out");
        let want = [4f32, 3.0, 2.0, 2.0, 1.0].map(|w| w.ln() - ln12);
        for (t, w) in stats.top5.iter().zip(want) {
            assert!((t.logprob - w).abs() < 1e-6, "{t:?} vs {w}");
        }
        let json = serde_json::to_value(&stats).unwrap();
        assert_eq!(json["top5"][0]["token_id"], 3);
    }

    #[test]
    fn non_finite_logits_are_a_non_finite_error_naming_the_step() {
        let sampling = settings(&serde_json::json!({"do_sample": true, "temperature": 0.5}));
        let mut sampler = Sampler::new(&sampling, 1);
        let err = sampler.step(&[0.0, f32::NAN, 1.0], &[], 3).unwrap_err();
        assert_eq!(err.kind(), Kind::NonFinite);
        assert_eq!(err.exit_code(), 3);
        let msg = err.to_string();
        assert!(
            msg.contains("step 3") && msg.contains("token id 1"),
            "{msg}"
        );
        let err = sampler.step(&[f32::NEG_INFINITY; 4], &[], 5).unwrap_err();
        assert!(err.to_string().contains("step 5"), "{err}");
        // A temperature too small for the scores' range overflows them.
        let cold = settings(&serde_json::json!({"do_sample": true, "temperature": 1e-40}));
        let err = Sampler::new(&cold, 1)
            .step(&[0.0, 1e30], &[], 0)
            .unwrap_err();
        assert_eq!(err.kind(), Kind::NonFinite, "{err}");
    }
}
