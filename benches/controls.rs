//! The paper's controls, per tensor: `perturb` on one q_proj-sized matrix (3584 x 3584, as in
//! Qwen2.5-7B) at a realistic 2% relative drift, in f32 and bf16 (bf16 needs the rounding-aware
//! scale search), against the two costs it cannot avoid: drawing the noise and decoding the two
//! inputs plus encoding the output. `benches/controls.sh` measures whole commands.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use safetensors::Dtype;
use sinkmerge::analysis::perturb::{perturb_tensor, standard_normal};
use sinkmerge::dtype;

const ROWS: usize = 3584;
const COLS: usize = 3584;

fn perturb(c: &mut Criterion) {
    let n = ROWS * COLS;
    let w: Vec<f32> = standard_normal(1, "w", n)
        .iter()
        .map(|x| 0.02 * x)
        .collect();
    let dw = standard_normal(2, "dw", n);
    let t: Vec<f32> = w
        .iter()
        .zip(&dw)
        .map(|(a, d)| a + 0.02 * 0.02 * d)
        .collect();

    let mut g = c.benchmark_group("perturb_3584x3584");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    for dt in [Dtype::F32, Dtype::BF16] {
        let (wb, tb) = (
            dtype::encode(dt, &w).unwrap(),
            dtype::encode(dt, &t).unwrap(),
        );
        g.bench_function(format!("perturb_tensor_{dt:?}"), |b| {
            b.iter(|| {
                perturb_tensor(
                    "model.layers.0.self_attn.q_proj.weight",
                    0,
                    dt,
                    black_box(&wb),
                    dt,
                    black_box(&tb),
                    "t",
                )
                .unwrap()
            })
        });
        g.bench_function(format!("decode_two_encode_one_{dt:?}"), |b| {
            b.iter(|| {
                let a = dtype::decode(dt, black_box(&wb), "w").unwrap();
                let _t = dtype::decode(dt, black_box(&tb), "t").unwrap();
                dtype::encode(dt, &a).unwrap()
            })
        });
    }
    g.bench_function("standard_normal_only", |b| {
        b.iter(|| standard_normal(0, black_box("model.layers.0.self_attn.q_proj.weight"), n))
    });
    g.finish();
}

criterion_group!(benches, perturb);
criterion_main!(benches);
