//! The one extraction step that is not a byte-range copy: unfusing Hub-orientation MoE experts
//! (Qwen3-VL-MoE stores `x @ W`, so each expert's gate/up/down slice must be transposed). Measured
//! on one expert of Qwen3-VL-30B-A3B's shape against a memcpy of the same bytes.
//! `benches/extract_vs_cp.sh` measures whole extractions against `cp`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sinkmerge::arch::families::transpose;

fn expert_unfuse(c: &mut Criterion) {
    // hidden 2048, expert width 768, bf16: one expert's gate_up block is [H, 2I].
    let (h, i, size) = (2048, 768, 2);
    let src: Vec<u8> = (0..h * 2 * i * size).map(|k| (k * 31) as u8).collect();
    let bytes = h * i * size;
    let mut g = c.benchmark_group("expert_unfuse_bf16");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("transpose_gate_half", |b| {
        b.iter(|| {
            let mut out = Vec::with_capacity(bytes);
            transpose::append(&mut out, black_box(&src), size, 0, h, 2 * i, i);
            out
        })
    });
    g.bench_function("memcpy_same_bytes", |b| {
        b.iter(|| {
            let mut out = Vec::with_capacity(bytes);
            out.extend_from_slice(black_box(&src[..bytes]));
            out
        })
    });
    g.finish();
}

criterion_group!(benches, expert_unfuse);
criterion_main!(benches);
