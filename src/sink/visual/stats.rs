//! The statistics of one image at one layer, from host copies of the pass's tensors, in f64
//! (`docs/reference/visual-sinks.md`, "Per layer", "Token features", "The gate",
//! "Contributions").

use serde::Serialize;

/// What the unedited pass gives at one layer, on the host.
pub struct LayerTensors<'t> {
    /// Per query head: the question rows' attention probabilities, `[rows, seq]` row-major.
    pub probs: &'t [Vec<f32>],
    /// Per query head: the question rows' scaled scores `q·k/√d`, `[rows, seq]`.
    pub scores: &'t [Vec<f32>],
    /// `[seq, kv_heads · head_dim]`: the keys the cosines use (`--keys`), the keys before RoPE
    /// (the norms), and the values.
    pub keys: &'t [f32],
    pub keys_pre_rope: &'t [f32],
    pub values: &'t [f32],
    /// `[seq, hidden]`: the layer's input.
    pub hidden: &'t [f32],
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// The question's attention `a_j` over every position: probabilities averaged over heads, then
/// over the question rows.
pub fn question_attention(probs: &[Vec<f32>], seq: usize) -> Vec<f64> {
    let rows = question_rows(probs, seq);
    let heads = probs.len() as f64;
    let mut a = vec![0f64; seq];
    for i in 0..rows {
        for (j, aj) in a.iter_mut().enumerate() {
            let over_heads: f64 = probs.iter().map(|p| p[i * seq + j] as f64).sum();
            *aj += over_heads / heads;
        }
    }
    for aj in &mut a {
        *aj /= rows as f64;
    }
    a
}

/// The text sink t*: the non-image position with the largest `a`, ties to the lowest.
pub fn text_sink(a: &[f64], is_image: &[bool]) -> Option<usize> {
    argmax_where(a, |j| !is_image[j])
}

/// `r_j = a_j / (A_img / n)` over the image's positions, and `A_img`; every r is 0 when
/// `A_img` is.
pub fn ratios(a: &[f64], positions: &[usize]) -> (Vec<f64>, f64) {
    let in_image: f64 = positions.iter().map(|&j| a[j]).sum();
    let n = positions.len() as f64;
    let r = positions
        .iter()
        .map(|&j| {
            if in_image > 0.0 {
                a[j] / (in_image / n)
            } else {
                0.0
            }
        })
        .collect();
    (r, in_image)
}

/// The index of the largest value, ties to the lowest index.
pub fn argmax(values: &[f64]) -> Option<usize> {
    argmax_where(values, |_| true)
}

/// The index of the largest value among the indices `kept`, ties to the lowest; none when
/// nothing is kept.
pub fn argmax_where(values: &[f64], kept: impl Fn(usize) -> bool) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, &v) in values.iter().enumerate() {
        if kept(i) && best.is_none_or(|b| v > values[b]) {
            best = Some(i);
        }
    }
    best
}

/// Table 10's masked maps zero every image token at or above these ratios to uniform (`r ≥ X`,
/// as the sink rule compares).
pub const MASKED_100: f64 = 100.0;
pub const MASKED_10: f64 = 10.0;

/// Whether the image token with the largest of `attention` (one value per image token) among
/// those `kept` lies in the box, ties to the lowest position; null without a box or when no
/// token is kept.
pub fn top1_in_box(
    attention: &[f64],
    inside_box: Option<&[bool]>,
    kept: impl Fn(usize) -> bool,
) -> Option<bool> {
    inside_box
        .zip(argmax_where(attention, kept))
        .map(|(b, i)| b[i])
}

/// Of the `tokens` at `r ≥ 100`, the share inside the box, the box's own counted (the sink rule
/// drops them, this does not); null without a box or such a token.
pub fn in_box_share_100<'t>(tokens: impl Iterator<Item = &'t TokenStats>) -> Option<f64> {
    mean_present(
        tokens
            .filter(|t| t.ratio >= MASKED_100)
            .map(|t| t.inside_box.map(|b| f64::from(u8::from(b)))),
    )
}

/// How one of Table 10's maps is read off a layer's statistics.
pub type Top1Map = fn(&LayerStats) -> Option<bool>;

/// The mean of the values that are not null; null when none is.
pub fn mean_present(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let (sum, n) = values
        .flatten()
        .fold((0.0, 0usize), |(sum, n), v| (sum + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// The share of `rows` whose `map` top-1 is in the box, over the rows where it is not null.
pub fn top1_rate(rows: &[&LayerStats], map: Top1Map) -> Option<f64> {
    mean_present(rows.iter().map(|s| map(s).map(|b| f64::from(u8::from(b)))))
}

/// Table 10's four columns as rates: how often the top-1 of the raw map, of the maps with every
/// token at ≥ 100× and ≥ 10× uniform zeroed, and of the edited map lies in the box (over one
/// image's layers, or over the images of a manifest); each null where it has no value.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Top1Rates {
    pub top1_in_box: Option<f64>,
    pub top1_in_box_masked_100: Option<f64>,
    pub top1_in_box_masked_10: Option<f64>,
    pub top1_in_box_edited: Option<f64>,
}

impl Top1Rates {
    /// Each column from `rate`, told how to read its map off a layer's statistics.
    pub fn each(rate: impl Fn(Top1Map) -> Option<f64>) -> Top1Rates {
        Top1Rates {
            top1_in_box: rate(|s| s.top1_in_box),
            top1_in_box_masked_100: rate(|s| s.top1_in_box_masked_100),
            top1_in_box_masked_10: rate(|s| s.top1_in_box_masked_10),
            top1_in_box_edited: rate(|s| s.top1_in_box_edited),
        }
    }

    /// The rates over `rows`.
    pub fn of(rows: &[&LayerStats]) -> Top1Rates {
        Top1Rates::each(|map| top1_rate(rows, map))
    }
}

/// One image token's features at one layer (`images[i].tokens[L][j]`).
#[derive(Debug, Clone, Serialize)]
pub struct TokenStats {
    pub position: usize,
    /// Whether the token's region centre is in the target box; null without a box.
    pub inside_box: Option<bool>,
    pub attention: f64,
    pub ratio: f64,
    pub centered_cos: f64,
    pub raw_cos: f64,
    pub key_norm: f64,
    pub value_norm: f64,
    pub hidden_norm: f64,
    pub logit_std: f64,
    pub sink: bool,
    pub gated: bool,
    /// The edited pass's a_j, when an edit ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_edited: Option<f64>,
}

/// One image's summary at one layer (`images[i].layers[L]`).
#[derive(Debug, Clone, Serialize)]
pub struct LayerStats {
    pub text_sink_position: usize,
    pub text_sink_share: f64,
    pub in_image_share: f64,
    pub max_ratio: f64,
    pub sink_count: usize,
    pub sink_mean_ratio: Option<f64>,
    pub sink_share: f64,
    pub top1_in_box: Option<bool>,
    /// The box top-1 with every image token at `r ≥ 100` (`≥ 10`) zeroed; null without a box
    /// or when every token is.
    pub top1_in_box_masked_100: Option<bool>,
    pub top1_in_box_masked_10: Option<bool>,
    /// The box top-1 of the edit pass's attention (`--edit`); null without an edit or a box.
    pub top1_in_box_edited: Option<bool>,
    pub sink_contribution: f64,
    pub text_sink_contribution: f64,
    pub output_cos_without_sinks: f64,
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

fn norm(x: &[f32]) -> f64 {
    dot(x, x).sqrt()
}

/// The cosine of two f64 vectors; 0 when either is zero.
pub fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    }
}

/// Per KV head g, the mean key over `positions` (`μ_g`, `[kv_heads][head_dim]`).
pub fn mean_keys(keys: &[f32], positions: &[usize], kv: usize, hd: usize) -> Vec<Vec<f64>> {
    let width = kv * hd;
    (0..kv)
        .map(|g| {
            let mut mu = vec![0f64; hd];
            for &j in positions {
                let k = &keys[j * width + g * hd..j * width + (g + 1) * hd];
                for (m, &v) in mu.iter_mut().zip(k) {
                    *m += v as f64;
                }
            }
            mu.iter_mut().for_each(|m| *m /= positions.len() as f64);
            mu
        })
        .collect()
}

/// Per image token: the centred key cosine with the text sink, averaged over KV heads; `mu` is
/// [`mean_keys`] of the image's tokens.
pub fn centered_cosines(
    keys: &[f32],
    positions: &[usize],
    sink: usize,
    mu: &[Vec<f64>],
    kv: usize,
    hd: usize,
) -> Vec<f64> {
    let width = kv * hd;
    let centred = |j: usize, g: usize| -> Vec<f64> {
        keys[j * width + g * hd..j * width + (g + 1) * hd]
            .iter()
            .zip(&mu[g])
            .map(|(&k, &m)| k as f64 - m)
            .collect()
    };
    let sink_centred: Vec<Vec<f64>> = (0..kv).map(|g| centred(sink, g)).collect();
    positions
        .iter()
        .map(|&j| {
            (0..kv)
                .map(|g| cosine(&centred(j, g), &sink_centred[g]))
                .sum::<f64>()
                / kv as f64
        })
        .collect()
}

/// Everything about one image at one layer: its tokens' features and its summary.
/// `positions` are the image's token positions, `inside_box` each token's box membership when
/// there is a box.
pub fn layer_stats(
    t: &LayerTensors,
    a: &[f64],
    is_image: &[bool],
    positions: &[usize],
    inside_box: Option<&[bool]>,
    ratio_threshold: f64,
    gate: f64,
) -> (LayerStats, Vec<TokenStats>) {
    let seq = a.len();
    let (kv, hd) = (t.num_kv_heads, t.head_dim);
    let width = kv * hd;
    let hidden = t.hidden.len() / seq;
    let sink = text_sink(a, is_image).expect("the question rows are not image tokens");
    let (r, in_image) = ratios(a, positions);
    let mu = mean_keys(t.keys, positions, kv, hd);
    let centered = centered_cosines(t.keys, positions, sink, &mu, kv, hd);
    let key = |keys: &'_ [f32], j: usize, g: usize| -> Vec<f64> {
        keys[j * width + g * hd..j * width + (g + 1) * hd]
            .iter()
            .map(|&v| v as f64)
            .collect()
    };
    let rows = question_rows(t.probs, seq);
    let group = t.probs.len() / kv;
    let tokens: Vec<TokenStats> = positions
        .iter()
        .enumerate()
        .map(|(idx, &j)| {
            let inside = inside_box.map(|b| b[idx]);
            let raw_cos = (0..kv)
                .map(|g| cosine(&key(t.keys, j, g), &key(t.keys, sink, g)))
                .sum::<f64>()
                / kv as f64;
            let scores: Vec<f64> = t
                .scores
                .iter()
                .flat_map(|s| (0..rows).map(move |i| s[i * seq + j] as f64))
                .collect();
            TokenStats {
                position: j,
                inside_box: inside,
                attention: a[j],
                ratio: r[idx],
                centered_cos: centered[idx],
                raw_cos,
                key_norm: norm(&t.keys_pre_rope[j * width..(j + 1) * width]),
                value_norm: norm(&t.values[j * width..(j + 1) * width]),
                hidden_norm: norm(&t.hidden[j * hidden..(j + 1) * hidden]),
                logit_std: population_std(&scores),
                sink: r[idx] >= ratio_threshold && inside != Some(true),
                gated: centered[idx] >= gate,
                attention_edited: None,
            }
        })
        .collect();
    let sinks: Vec<&TokenStats> = tokens.iter().filter(|s| s.sink).collect();
    let sink_positions: Vec<usize> = sinks.iter().map(|s| s.position).collect();
    let sink_attention: f64 = sinks.iter().map(|s| s.attention).sum();
    let image_attention: Vec<f64> = positions.iter().map(|&j| a[j]).collect();
    let masked_top1 = |at: f64| top1_in_box(&image_attention, inside_box, |k| r[k] < at);
    let (sink_contribution, text_sink_contribution, output_cos_without_sinks) = contributions(
        t.probs,
        t.values,
        seq,
        rows,
        group,
        (kv, hd),
        &sink_positions,
        sink,
    );
    let stats = LayerStats {
        text_sink_position: sink,
        text_sink_share: a[sink],
        in_image_share: in_image,
        max_ratio: r.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        sink_count: sinks.len(),
        sink_mean_ratio: (!sinks.is_empty())
            .then(|| sinks.iter().map(|s| s.ratio).sum::<f64>() / sinks.len() as f64),
        sink_share: if in_image > 0.0 {
            sink_attention / in_image
        } else {
            0.0
        },
        top1_in_box: top1_in_box(&image_attention, inside_box, |_| true),
        top1_in_box_masked_100: masked_top1(MASKED_100),
        top1_in_box_masked_10: masked_top1(MASKED_10),
        // The edit pass fills it in.
        top1_in_box_edited: None,
        sink_contribution,
        text_sink_contribution,
        output_cos_without_sinks,
    };
    (stats, tokens)
}

/// How many question rows each head's `[rows, seq]` block holds.
fn question_rows(probs: &[Vec<f32>], seq: usize) -> usize {
    probs.first().map_or(0, |p| p.len() / seq)
}

/// The population standard deviation (two passes).
fn population_std(x: &[f64]) -> f64 {
    if x.is_empty() {
        return 0.0;
    }
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    (x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n).sqrt()
}

/// Table 9: the mean over question rows of `‖c^{sinks}‖ / ‖o‖`, `‖c^{t*}‖ / ‖o‖` and
/// `cos(o, o − c^{sinks})`, where `o` is the row's attention output before `o_proj` (all heads
/// concatenated) and `c^S` the part of it that the positions S contribute.
#[allow(clippy::too_many_arguments)]
fn contributions(
    probs: &[Vec<f32>],
    values: &[f32],
    seq: usize,
    rows: usize,
    group: usize,
    (kv, hd): (usize, usize),
    sinks: &[usize],
    text_sink: usize,
) -> (f64, f64, f64) {
    if rows == 0 {
        return (0.0, 0.0, 1.0);
    }
    let width = kv * hd;
    let heads = probs.len();
    let (mut sink_sum, mut text_sum, mut cos_sum) = (0f64, 0f64, 0f64);
    for i in 0..rows {
        let mut o = vec![0f64; heads * hd];
        let mut c_sinks = vec![0f64; heads * hd];
        let mut c_text = vec![0f64; heads * hd];
        for (h, p) in probs.iter().enumerate() {
            let g = h / group;
            let row = &p[i * seq..(i + 1) * seq];
            let out = &mut o[h * hd..(h + 1) * hd];
            for (j, &pj) in row.iter().enumerate() {
                if pj == 0.0 {
                    continue;
                }
                let v = &values[j * width + g * hd..j * width + (g + 1) * hd];
                for (x, &vv) in out.iter_mut().zip(v) {
                    *x += pj as f64 * vv as f64;
                }
            }
            let add = |dst: &mut [f64], j: usize| {
                let v = &values[j * width + g * hd..j * width + (g + 1) * hd];
                for (x, &vv) in dst.iter_mut().zip(v) {
                    *x += row[j] as f64 * vv as f64;
                }
            };
            for &j in sinks {
                add(&mut c_sinks[h * hd..(h + 1) * hd], j);
            }
            add(&mut c_text[h * hd..(h + 1) * hd], text_sink);
        }
        let norm64 = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
        let on = norm64(&o);
        if on > 0.0 {
            sink_sum += norm64(&c_sinks) / on;
            text_sum += norm64(&c_text) / on;
        }
        let without: Vec<f64> = o.iter().zip(&c_sinks).map(|(a, b)| a - b).collect();
        cos_sum += if sinks.is_empty() {
            1.0
        } else {
            cosine(&o, &without)
        };
    }
    let n = rows as f64;
    (sink_sum / n, text_sum / n, cos_sum / n)
}

/// A feature scored against the attention-defined sinks (`images[i].features.NAME`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FeatureScore {
    pub auc: Option<f64>,
    pub precision_at_k: Option<f64>,
    pub top1: Option<bool>,
}

/// A token feature: its value for one token.
pub type Feature = fn(&TokenStats) -> f64;

/// The features of Table 6, by their JSON names.
pub const FEATURES: [(&str, Feature); 7] = [
    ("centered_cos", |t| t.centered_cos),
    ("raw_cos", |t| t.raw_cos),
    ("neg_value_norm", |t| -t.value_norm),
    ("hidden_norm", |t| t.hidden_norm),
    ("key_norm", |t| t.key_norm),
    ("neg_key_norm", |t| -t.key_norm),
    ("neg_logit_std", |t| -t.logit_std),
];

/// AUC (Mann-Whitney, ties ½), precision at k = the number of positives, and top-1 of `feature`
/// against `positive`; each null without positives (the AUC also with only positives).
pub fn score_feature(feature: &[f64], positive: &[bool]) -> FeatureScore {
    let k = positive.iter().filter(|&&p| p).count();
    if k == 0 {
        return FeatureScore {
            auc: None,
            precision_at_k: None,
            top1: None,
        };
    }
    let negatives = positive.len() - k;
    let auc = (negatives > 0).then(|| {
        let mut wins = 0f64;
        for (i, _) in positive.iter().enumerate().filter(|(_, &p)| p) {
            for (j, _) in positive.iter().enumerate().filter(|(_, &p)| !p) {
                wins += match feature[i].partial_cmp(&feature[j]) {
                    Some(std::cmp::Ordering::Greater) => 1.0,
                    Some(std::cmp::Ordering::Equal) => 0.5,
                    _ => 0.0,
                };
            }
        }
        wins / (k * negatives) as f64
    });
    // Highest first, ties to the lower index (a stable sort keeps index order among equals).
    let mut order: Vec<usize> = (0..feature.len()).collect();
    order.sort_by(|&i, &j| feature[j].total_cmp(&feature[i]));
    let hits = order[..k].iter().filter(|&&i| positive[i]).count();
    FeatureScore {
        auc,
        precision_at_k: Some(hits as f64 / k as f64),
        top1: Some(positive[order[0]]),
    }
}

/// The gate's precision and recall against the sinks at one threshold.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GatePoint {
    pub threshold: f64,
    pub precision: Option<f64>,
    pub recall: Option<f64>,
}

/// `images[i].gate`: at `--gate`, and the sweep over −1.00, −0.95, …, 1.00.
#[derive(Debug, Clone, Serialize)]
pub struct Gate {
    pub threshold: f64,
    pub precision: Option<f64>,
    pub recall: Option<f64>,
    pub sweep: Vec<GatePoint>,
}

pub fn gate_point(tokens: &[TokenStats], threshold: f64) -> GatePoint {
    let gated = tokens.iter().filter(|t| t.centered_cos >= threshold);
    let (mut n_gated, mut hits) = (0usize, 0usize);
    for t in gated {
        n_gated += 1;
        hits += t.sink as usize;
    }
    let sinks = tokens.iter().filter(|t| t.sink).count();
    GatePoint {
        threshold,
        precision: (n_gated > 0).then(|| hits as f64 / n_gated as f64),
        recall: (sinks > 0).then(|| hits as f64 / sinks as f64),
    }
}

pub fn gate(tokens: &[TokenStats], threshold: f64) -> Gate {
    let at = gate_point(tokens, threshold);
    Gate {
        threshold,
        precision: at.precision,
        recall: at.recall,
        // (5k − 100) / 100 is the correctly rounded decimal threshold.
        sweep: (0..=40)
            .map(|k| gate_point(tokens, (5 * k - 100) as f64 / 100.0))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_counts_ties_as_half_and_precision_breaks_ties_by_index() {
        let s = score_feature(&[3.0, 1.0, 1.0, 0.0], &[true, false, true, false]);
        // Pairs (pos, neg): (3,1) win, (3,0) win, (1,1) tie, (1,0) win.
        assert_eq!(s.auc, Some(3.5 / 4.0));
        // Top 2 by value, ties to the lower index: 0 and 1, one sink.
        assert_eq!(s.precision_at_k, Some(0.5));
        assert_eq!(s.top1, Some(true));
        let none = score_feature(&[1.0, 2.0], &[false, false]);
        assert_eq!(
            (none.auc, none.precision_at_k, none.top1),
            (None, None, None)
        );
        assert_eq!(score_feature(&[1.0], &[true]).auc, None);
    }

    #[test]
    fn text_sink_and_argmax_take_the_lowest_of_ties() {
        assert_eq!(
            text_sink(&[0.2, 0.3, 0.3, 0.9], &[false, false, false, true]),
            Some(1)
        );
        assert_eq!(argmax(&[1.0, 2.0, 2.0]), Some(1));
        let (r, total) = ratios(&[0.5, 0.1, 0.3], &[1, 2]);
        assert!((total - 0.4).abs() < 1e-15);
        assert!((r[0] - 0.5).abs() < 1e-12 && (r[1] - 1.5).abs() < 1e-12);
        assert_eq!(ratios(&[1.0, 0.0], &[1]).0, vec![0.0]);
    }

    #[test]
    fn masked_top1_drops_the_tokens_at_the_threshold_and_is_null_when_none_is_left() {
        let (a, inside) = ([0.5, 0.2, 0.3], [false, false, true]);
        assert_eq!(top1_in_box(&a, Some(&inside), |_| true), Some(false));
        // r ≥ X is masked: 100 itself goes, 99.9 stays.
        let r = [100.0, 0.5, 99.9];
        assert_eq!(
            top1_in_box(&a, Some(&inside), |k| r[k] < MASKED_100),
            Some(true)
        );
        assert_eq!(top1_in_box(&a, Some(&inside), |k| r[k] < 0.1), None);
        assert_eq!(top1_in_box(&a, None, |_| true), None);
        assert_eq!(
            mean_present([Some(1.0), None, Some(0.0)].into_iter()),
            Some(0.5)
        );
        assert_eq!(mean_present([None].into_iter()), None);
    }

    #[test]
    fn the_in_box_share_counts_the_box_tokens_the_sink_rule_drops() {
        let token = |ratio: f64, inside_box: Option<bool>| TokenStats {
            position: 0,
            inside_box,
            attention: 0.0,
            ratio,
            centered_cos: 0.0,
            raw_cos: 0.0,
            key_norm: 0.0,
            value_norm: 0.0,
            hidden_norm: 0.0,
            logit_std: 0.0,
            sink: false,
            gated: false,
            attention_edited: None,
        };
        let boxed = [
            token(150.0, Some(true)),
            token(100.0, Some(false)),
            token(120.0, Some(false)),
            token(99.0, Some(true)),
        ];
        let share = in_box_share_100(boxed.iter()).unwrap();
        assert!((share - 1.0 / 3.0).abs() < 1e-15, "{share}");
        assert_eq!(in_box_share_100(boxed[3..].iter()), None);
        assert_eq!(in_box_share_100([token(300.0, None)].iter()), None);
    }

    #[test]
    fn the_sweep_runs_from_minus_one_to_one_in_twentieths() {
        let g = gate(&[], 0.5);
        assert_eq!(g.sweep.len(), 41);
        assert_eq!(g.sweep[0].threshold, -1.0);
        assert_eq!(g.sweep[1].threshold, -0.95);
        assert_eq!(g.sweep[40].threshold, 1.0);
    }
}
