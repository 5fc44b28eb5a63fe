//! Parity of a backend with the CPU backend on the same models and token ids: the largest
//! attention-probability and logit differences of a full forward pass, and the differences of
//! S, G_base, B_gap and the margin. The tests run it through the host stand-in of the CUDA
//! device; `sinkmerge parity --device cuda` runs it on a GPU (`docs/reference/gpu.md`).

use serde::Serialize;

use super::inputs::tokenize_prompts;
use super::prompts::default_prompts;
use super::score::{score, Input, Scores, Settings};
use crate::bad;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::backend::cpu::CpuBackend;
use crate::forward::backend::Backend;
use crate::forward::model::DecoderSpec;
use crate::forward::pass::{record_all_on, Recorded};
use crate::forward::precision::Precision;
use crate::forward::vision::{Pixels, Tower};
use crate::forward::weights::Model;
use crate::image::Processor;

/// Absolute tolerances of a parity check.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Tolerances {
    /// Attention probabilities.
    pub probs: f64,
    /// Logits.
    pub logits: f64,
    /// S, G_base, B_gap and the margin.
    pub metrics: f64,
    /// A vision tower's output (`image_embeds`, deepstack features), relative to its largest
    /// magnitude.
    pub image_embeds: f64,
}

impl Tolerances {
    /// f32: 1e-5, 1e-4, 1e-4, and 1e-4 relative for a tower's output. bf16: one bf16 step of a
    /// probability near 1 (2^-8) and of a logit below 16 (2^-4), since a GEMM summed in another
    /// order can round the other way; 0.02 for the metrics; 2^-4 relative for a tower's output.
    pub fn of(precision: Precision) -> Tolerances {
        match precision {
            Precision::F32 => Tolerances {
                probs: 1e-5,
                logits: 1e-4,
                metrics: 1e-4,
                image_embeds: 1e-4,
            },
            Precision::Bf16 => Tolerances {
                probs: 1.0 / 256.0,
                logits: 1.0 / 16.0,
                metrics: 0.02,
                image_embeds: 1.0 / 16.0,
            },
        }
    }
}

/// Largest differences of one model's forward pass.
#[derive(Debug, Clone, Serialize)]
pub struct TraceParity {
    pub model: String,
    pub max_prob_diff: f64,
    pub max_logit_diff: f64,
}

/// One metric on both backends.
#[derive(Debug, Clone, Serialize)]
pub struct MetricParity {
    /// `"S of MODEL"`, `"margin of MODEL"`, ...
    pub metric: String,
    pub cpu: Option<f64>,
    pub other: Option<f64>,
}

impl MetricParity {
    /// The absolute difference; infinite when only one side is defined.
    pub fn diff(&self) -> f64 {
        match (self.cpu, self.other) {
            (Some(a), Some(b)) => (a - b).abs(),
            (None, None) => 0.0,
            _ => f64::INFINITY,
        }
    }
}

/// A vision tower's output on both backends, on the bundled image.
#[derive(Debug, Clone, Serialize)]
pub struct TowerParity {
    pub model: String,
    /// Image tokens the tower produced.
    pub image_tokens: usize,
    /// max |Δ| over max |CPU| of `image_embeds` and every deepstack feature.
    pub max_relative_diff: f64,
}

/// The image a parity run feeds a VLM's vision tower through the model's own processor
/// (`assets/images/parity.png`, 100×75: every processor resizes it).
const PARITY_IMAGE: &[u8] = include_bytes!("../../assets/images/parity.png");

#[derive(Debug, Clone, Serialize)]
pub struct Parity {
    pub precision: Precision,
    pub tolerances: Tolerances,
    pub traces: Vec<TraceParity>,
    pub metrics: Vec<MetricParity>,
    /// The vision towers of the models that have one.
    pub towers: Vec<TowerParity>,
}

impl Parity {
    /// Whether every difference is within its tolerance.
    pub fn holds(&self) -> bool {
        let t = &self.tolerances;
        self.traces
            .iter()
            .all(|x| x.max_prob_diff <= t.probs && x.max_logit_diff <= t.logits)
            && self.metrics.iter().all(|m| m.diff() <= t.metrics)
            && self
                .towers
                .iter()
                .all(|x| x.max_relative_diff <= t.image_embeds)
    }
}

/// The largest probability and logit differences of two records of the same inputs.
pub fn recorded_diff(a: &Recorded, b: &Recorded) -> (f64, f64) {
    let max = |x: &[Vec<f32>], y: &[Vec<f32>]| {
        x.iter()
            .zip(y)
            .flat_map(|(p, q)| p.iter().zip(q))
            .map(|(&u, &v)| (u as f64 - v as f64).abs())
            .fold(
                0f64,
                |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
            )
    };
    let probs = a
        .attentions
        .iter()
        .zip(&b.attentions)
        .map(|(x, y)| max(x, y))
        .fold(0f64, f64::max);
    (probs, max(&a.logits, &b.logits))
}

/// S of every model, and G_base, B_gap and the margin of every pair, on both sides.
pub fn metric_diffs(cpu: &Scores, other: &Scores) -> Vec<MetricParity> {
    let mut out = Vec::new();
    for (a, b) in cpu.models.iter().zip(&other.models) {
        out.push(MetricParity {
            metric: format!("S of {}", a.model),
            cpu: a.statistics.sink_strength,
            other: b.statistics.sink_strength,
        });
    }
    for (a, b) in cpu.pairs.iter().zip(&other.pairs) {
        for (name, x, y) in [
            (
                "G_base",
                a.statistics.g_base_median,
                b.statistics.g_base_median,
            ),
            (
                "B_gap",
                a.statistics.b_gap_median,
                b.statistics.b_gap_median,
            ),
            ("margin", a.statistics.margin, b.statistics.margin),
        ] {
            out.push(MetricParity {
                metric: format!("{name} of {}", a.target),
                cpu: x,
                other: y,
            });
        }
    }
    out
}

/// Run `ckpts` (with `tokens[i]` for `ckpts[i]`; `ckpts[0]` is the reference when `with_ref`)
/// on the CPU and on `backend`, in the backend's precision, and compare. Scores use every layer as the window.
pub fn check<B: Backend>(
    backend: &B,
    ckpts: &[&Checkpoint],
    tokens: &[Vec<Vec<u32>>],
    with_ref: bool,
) -> Result<Parity> {
    let cpu_backend = CpuBackend::new(backend.precision());
    let mut traces = Vec::with_capacity(ckpts.len());
    let mut towers = Vec::new();
    for (ckpt, ids) in ckpts.iter().zip(tokens) {
        if let Some(t) = tower_parity(backend, &cpu_backend, ckpt)? {
            towers.push(t);
        }
        let (probs, logits) = recorded_diff(
            &record_all_on(&cpu_backend, ckpt, ids)?,
            &record_all_on(backend, ckpt, ids)?,
        );
        traces.push(TraceParity {
            model: ckpt.label.clone(),
            max_prob_diff: probs,
            max_logit_diff: logits,
        });
    }
    let inputs: Vec<Input> = ckpts
        .iter()
        .zip(tokens)
        .map(|(ckpt, ids)| Input {
            label: ckpt.label.clone(),
            ckpt,
            tokens: ids.clone(),
        })
        .collect();
    let settings = Settings {
        last: usize::MAX,
        ..Settings::default()
    };
    let reference = with_ref.then_some(0);
    let cpu = score(&cpu_backend, &inputs, reference, settings, &|| {})?.scores;
    let other = score(backend, &inputs, reference, settings, &|| {})?.scores;
    Ok(Parity {
        precision: backend.precision(),
        tolerances: Tolerances::of(backend.precision()),
        traces,
        metrics: metric_diffs(&cpu, &other),
        towers,
    })
}

/// The vision tower of `ckpt`, if it has one and a `preprocessor_config.json`, on the bundled
/// image on both backends.
fn tower_parity<B: Backend>(
    backend: &B,
    cpu: &CpuBackend,
    ckpt: &Checkpoint,
) -> Result<Option<TowerParity>> {
    let Some(tower) = Tower::from_config(&ckpt.config)? else {
        return Ok(None);
    };
    if !ckpt.dir.join("preprocessor_config.json").is_file() {
        return Ok(None);
    }
    // The processors read files: the bundled image goes through a temporary one.
    let image = std::env::temp_dir().join(format!("sinkmerge-parity-{}.png", std::process::id()));
    std::fs::write(&image, PARITY_IMAGE).map_err(|e| crate::bad!("{}: {e}", image.display()))?;
    let processed = Processor::from_dir(&ckpt.dir)?.preprocess(std::slice::from_ref(&image));
    let _ = std::fs::remove_file(&image);
    let processed = processed?;
    let pixels = Pixels::from_grid(&processed.values, &processed.grid);
    let model = Model::new(ckpt)?;
    let want = tower.encode(cpu, &model, &pixels, None)?;
    let got = tower.encode(backend, &model, &pixels, None)?;
    let mut worst = 0f64;
    for (a, b) in std::iter::once((&want.embeds, &got.embeds))
        .chain(want.deepstack.iter().zip(&got.deepstack))
    {
        let scale = a.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
        let max = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).abs())
            .fold(
                0f64,
                |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
            );
        worst = worst.max(max / scale.max(f64::MIN_POSITIVE));
    }
    Ok(Some(TowerParity {
        model: ckpt.label.clone(),
        image_tokens: want.tokens,
        max_relative_diff: worst,
    }))
}

/// Token ids of a parity run, per checkpoint (`ckpts[0]` is the reference when `with_ref`),
/// and how the report names them: the 15 built-in prompts through each model's tokenizer (the
/// reference's for every model with a reference) when every model has a tokenizer.json;
/// otherwise [`synthetic_tokens`] below the smallest vocabulary.
pub fn parity_tokens(
    ckpts: &[Checkpoint],
    with_ref: bool,
) -> Result<(Vec<Vec<Vec<u32>>>, &'static str)> {
    if ckpts.iter().all(|c| c.dir.join("tokenizer.json").is_file()) {
        let prompts = default_prompts();
        let own = (ckpts.iter())
            .map(|c| tokenize_prompts(c, &prompts, None))
            .collect::<Result<Vec<_>>>()?;
        let tokens = if with_ref {
            vec![own[0].clone(); ckpts.len()]
        } else {
            own
        };
        return Ok((tokens, "the 15 built-in prompts"));
    }
    let vocab = (ckpts.iter())
        .map(|c| {
            DecoderSpec::from_model_config(&c.config)
                .map(|s| s.vocab_size)
                .map_err(|e| bad!("{}: {e}", c.dir.join("config.json").display()))
        })
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .min()
        .unwrap_or(1);
    Ok((
        vec![synthetic_tokens(vocab.max(1)); ckpts.len()],
        "four pseudo-random prompts of 7-60 tokens",
    ))
}

/// Token ids for parity runs on models without a tokenizer: prompts of 7, 16, 33 and 60 tokens
/// (several prompts, so packing is exercised; longer than the fixtures' sliding windows), ids
/// drawn below `vocab` by a fixed seed.
pub fn synthetic_tokens(vocab: usize) -> Vec<Vec<u32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    [7usize, 16, 33, 60]
        .iter()
        .map(|&len| {
            (0..len)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect()
        })
        .collect()
}
