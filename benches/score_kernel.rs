//! The scorer's attention + metrics kernel for one head of one prompt: scores `q kᵀ`, masked
//! softmax, the metric visitor (sink position, G, pos0 — and B against a reference head), and the
//! context `P v`, at Qwen2.5-7B's head_dim 128, on one core. The "scores only" line is the same
//! kernel with a visitor that does nothing, so the difference is the cost of the metrics.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use faer::MatRef;
use sinkmerge::forward::backend::cpu::attend_head;
use sinkmerge::forward::backend::HeadView;
use sinkmerge::forward::precision::Precision;
use sinkmerge::sink::metrics::{observe, GapFrom, ReferenceHead, SinkPosition};

const HEAD_DIM: usize = 128;

fn random(n: usize, seed: u32) -> Vec<f32> {
    // A cheap deterministic generator; values in about [-1, 1], a strong first key like a sink.
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) as f32;
            (x * 1e-9).sin()
        })
        .collect()
}

fn view(x: &[f32]) -> MatRef<'_, f32> {
    MatRef::from_row_major_slice(x, x.len() / HEAD_DIM, HEAD_DIM)
}

fn kernel(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let mut g = c.benchmark_group("attention_metrics_one_head");
    g.sample_size(20);
    for len in [128usize, 512] {
        let (q, k, v) = (
            random(len * HEAD_DIM, 1),
            random(len * HEAD_DIM, 2),
            random(len * HEAD_DIM, 3),
        );
        let k2 = random(len * HEAD_DIM, 4);
        let scale = (HEAD_DIM as f32).powf(-0.5);
        // A reference head for B, from a second key matrix.
        let (reference, _) = attend_head(
            view(&q),
            view(&k2),
            Some(view(&v)),
            scale,
            true,
            None,
            Precision::F32,
            (0, 0),
            &|h: &HeadView| {
                ReferenceHead::new(h, &observe(h, SinkPosition::Column, GapFrom::Scores))
            },
        );
        g.throughput(Throughput::Elements((len * len) as u64));
        g.bench_with_input(BenchmarkId::new("scores_only", len), &len, |b, _| {
            b.iter(|| {
                pool.install(|| {
                    attend_head(
                        view(&q),
                        view(&k),
                        Some(view(&v)),
                        scale,
                        true,
                        None,
                        Precision::F32,
                        (0, 0),
                        &|_| (),
                    )
                })
            })
        });
        g.bench_with_input(BenchmarkId::new("with_g_pos0", len), &len, |b, _| {
            b.iter(|| {
                pool.install(|| {
                    attend_head(
                        view(&q),
                        view(&k),
                        Some(view(&v)),
                        scale,
                        true,
                        None,
                        Precision::F32,
                        (0, 0),
                        &|h| black_box(observe(h, SinkPosition::Column, GapFrom::Scores)),
                    )
                })
            })
        });
        g.bench_with_input(BenchmarkId::new("with_g_pos0_b", len), &len, |b, _| {
            b.iter(|| {
                pool.install(|| {
                    attend_head(
                        view(&q),
                        view(&k),
                        Some(view(&v)),
                        scale,
                        true,
                        None,
                        Precision::F32,
                        (0, 0),
                        &|h| {
                            (
                                black_box(observe(h, SinkPosition::Column, GapFrom::Scores)),
                                black_box(reference.gap_perturbation(h)),
                            )
                        },
                    )
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, kernel);
criterion_main!(benches);
