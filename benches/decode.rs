//! Decode throughput: bf16 -> f32 against a plain memcpy of the same output size, on one core
//! (the figure docs/benchmarks.md reports is per core), and reading every tensor of a checkpoint against reading
//! its files' bytes. `benches/read_vs_cat.sh` compares whole-checkpoint reads with `cat`.

use std::borrow::Cow;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use safetensors::Dtype;
use sinkmerge::checkpoint::{
    output::{OutputDir, OutputKind},
    writer, Checkpoint,
};
use sinkmerge::dtype;

// 64 Mi elements: 256 MiB of output, far beyond any cache, so this measures memory bandwidth.
const ELEMS: usize = 64 << 20;

fn one_thread() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
}

fn bf16_decode(c: &mut Criterion) {
    let values: Vec<f32> = (0..ELEMS).map(|i| (i as f32 * 1e-3).sin()).collect();
    let bf16 = dtype::encode(Dtype::BF16, &values).unwrap();
    let f16 = dtype::encode(Dtype::F16, &values).unwrap();
    let mut out = vec![0f32; ELEMS];
    let mut copy = vec![0u8; ELEMS * 4];
    let source = vec![1u8; ELEMS * 4];
    let pool = one_thread();

    let mut g = c.benchmark_group("decode_one_core");
    g.throughput(Throughput::Bytes((ELEMS * 4) as u64));
    g.sample_size(20);
    g.bench_function("bf16_to_f32", |b| {
        b.iter(|| {
            pool.install(|| {
                dtype::decode_into(Dtype::BF16, black_box(&bf16), &mut out, "t").unwrap()
            })
        })
    });
    g.bench_function("f16_to_f32", |b| {
        b.iter(|| {
            pool.install(|| dtype::decode_into(Dtype::F16, black_box(&f16), &mut out, "t").unwrap())
        })
    });
    g.bench_function("memcpy_same_output_bytes", |b| {
        b.iter(|| copy.copy_from_slice(black_box(&source)))
    });
    g.finish();
}

fn read_checkpoint(c: &mut Criterion) {
    // A 128 MiB bf16 checkpoint in two shards.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let out = OutputDir::create(&dir, OutputKind::Model, &[], false).unwrap();
    out.write_json("config.json", &serde_json::json!({"model_type": "qwen2"}))
        .unwrap();
    let planned: Vec<writer::PlannedTensor> = (0..16)
        .map(|i| writer::PlannedTensor {
            name: format!("t{i}"),
            dtype: Dtype::BF16,
            shape: vec![2048, 2048],
        })
        .collect();
    let block = dtype::encode(Dtype::BF16, &vec![0.5f32; 2048 * 2048]).unwrap();
    writer::write_tensors(
        &out,
        &planned,
        70_000_000,
        None,
        |_| None,
        |_| Ok(Cow::Borrowed(&block[..])),
    )
    .unwrap();
    out.commit().unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    let total: u64 = files.iter().map(|f| f.metadata().unwrap().len()).sum();

    let mut g = c.benchmark_group("read_checkpoint");
    g.throughput(Throughput::Bytes(total));
    g.sample_size(10);
    g.bench_function(BenchmarkId::new("read_files", total), |b| {
        b.iter(|| {
            files
                .iter()
                .map(|f| std::fs::read(f).unwrap().len())
                .sum::<usize>()
        })
    });
    let mut buf = vec![0f32; 2048 * 2048];
    g.bench_function(
        BenchmarkId::new("open_and_decode_every_tensor", total),
        |b| {
            b.iter(|| {
                let ckpt = Checkpoint::open_dir(&dir, "m").unwrap();
                for name in ckpt.names() {
                    let info = ckpt.info(name).unwrap();
                    dtype::decode_into(info.dtype, ckpt.bytes(name).unwrap(), &mut buf, name)
                        .unwrap();
                }
                black_box(buf[0])
            })
        },
    );
    g.finish();
}

criterion_group!(benches, bf16_decode, read_checkpoint);
criterion_main!(benches);
