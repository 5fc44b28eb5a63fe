//! Merge kernels on one 4096 x 4096 f32 tensor (a base and two task models on disk, read from the
//! page cache): the TIES top-k cut by radix selection against a full sort of the magnitudes (what
//! mergekit's argsort does), DARE masks, and whole-tensor merges per method. Then STAR's
//! decomposition of one 2048 x 1024 task vector with a decaying spectrum: the f64 Gram route with
//! 64 leading vectors against faer's f64 thin SVD. Last, the tridiagonal reduction under it, on a
//! 3584 x 3584 Gram matrix (the 7B hidden size): faer's one-stage reduction against the two-stage one STAR uses.
//!
//!     cargo bench --bench merge_kernels

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::evd::tridiag::{tridiag_in_place, tridiag_in_place_scratch};
use faer::linalg::qr::no_pivoting::factor::recommended_block_size;
use faer::{Mat, Par};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use safetensors::tensor::TensorView;
use sinkmerge::checkpoint::Checkpoint;
use sinkmerge::linalg::svd::{small_side_svd, thin_svd};
use sinkmerge::linalg::two_stage::{self, TwoStage};
use sinkmerge::merge::job::{Source, TensorJob};
use sinkmerge::merge::params::{default_value, ParamValue, Scope};
use sinkmerge::merge::{self, sparsify, TensorValues};

const N: usize = 4096;
const NAME: &str = "model.layers.0.mlp.up_proj.weight";

fn write_model(dir: &Path, seed: u64, base: &[f32]) {
    std::fs::create_dir_all(dir).unwrap();
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/merge/models/base/config.json");
    std::fs::copy(fixture, dir.join("config.json")).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let bytes: Vec<u8> = base
        .iter()
        .flat_map(|&x| {
            let d = if seed == 0 {
                0.0
            } else {
                (rng.random::<f32>() - 0.5) * 0.01
            };
            (x + d).to_le_bytes()
        })
        .collect();
    let view = TensorView::new(safetensors::Dtype::F32, vec![N, N], &bytes).unwrap();
    safetensors::tensor::serialize_to_file([(NAME, view)], None, &dir.join("model.safetensors"))
        .unwrap();
}

fn values(method: &str, models: usize) -> TensorValues {
    let m = merge::method(method).unwrap();
    let mut p = TensorValues {
        global: Default::default(),
        models: vec![Default::default(); models],
    };
    for spec in m.params() {
        let value = match spec.name {
            "weight" => ParamValue::Number(1.0),
            "density" => ParamValue::Number(0.2),
            _ => default_value(spec).unwrap(),
        };
        match spec.scope {
            Scope::Global => {
                p.global.insert(spec.name, value);
            }
            Scope::PerModel => {
                for model in &mut p.models {
                    model.insert(spec.name, value.clone());
                }
            }
        }
    }
    p
}

fn bench(c: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    let base: Vec<f32> = (0..N * N).map(|_| rng.random::<f32>() - 0.5).collect();
    for (name, seed) in [("base", 0), ("a", 1), ("b", 2)] {
        write_model(&tmp.path().join(name), seed, &base);
    }
    let open = |name: &str| Checkpoint::open_dir(&tmp.path().join(name), name).unwrap();
    let (b, a, bb) = (open("base"), open("a"), open("b"));
    let source = |ckpt| Source {
        ckpt,
        tensor: NAME.to_string(),
        dtype: safetensors::Dtype::F32,
    };
    let job = TensorJob {
        name: NAME.to_string(),
        shape: vec![N, N],
        out_dtype: safetensors::Dtype::F32,
        base: Some(source(&b)),
        models: vec![source(&a), source(&bb)],
    };

    let mut g = c.benchmark_group("ties_top_k_16M");
    g.sample_size(10);
    g.bench_function("radix_selection", |bench| {
        bench.iter(|| sparsify::top_k_cuts(&job, &[0.2]).unwrap())
    });
    g.bench_function("full_sort_of_magnitudes", |bench| {
        bench.iter(|| {
            let delta = job.read_delta(0).unwrap();
            let mut mags: Vec<f32> = delta.data.iter().map(|x| x.abs()).collect();
            mags.sort_unstable_by(|p, q| q.total_cmp(p));
            mags[sparsify::keep_count(0.2, mags.len()) - 1]
        })
    });
    g.finish();

    let mut g = c.benchmark_group("dare_mask_16M");
    g.sample_size(10);
    g.bench_function("bernoulli_mask", |bench| {
        bench.iter(|| sparsify::bernoulli_mask(0, NAME, 0, 0..N * N, 0.1))
    });
    g.finish();

    let mut g = c.benchmark_group("merge_one_4096x4096_tensor");
    g.sample_size(10);
    for method in ["task_arithmetic", "ties", "dare_linear"] {
        let values = values(method, 2);
        let jobs = std::slice::from_ref(&job);
        let merger = merge::method(method)
            .unwrap()
            .prepare(jobs, &|_| Ok(values.clone()))
            .unwrap();
        g.bench_function(method, |bench| {
            bench.iter(|| merger.merge(0, &job).unwrap())
        });
    }
    g.finish();

    // G1 diag(j^-0.8) G2ᵀ, like benches/gen_merge_tasks.py's task vectors.
    let (m, n) = (2048, 1024);
    let g1 = Mat::<f32>::from_fn(m, n, |_, j| {
        let x: f32 = StandardNormal.sample(&mut rng);
        x * ((j + 1) as f32).powf(-0.8)
    });
    let g2 = Mat::<f32>::from_fn(n, n, |_, _| StandardNormal.sample(&mut rng));
    let task_vector = &g1 * g2.transpose();
    let mut g = c.benchmark_group("star_decomposition_2048x1024");
    g.sample_size(10);
    g.bench_function("gram_route_64_vectors", |bench| {
        bench.iter(|| small_side_svd(task_vector.as_ref(), |_, _| Some(64)).unwrap())
    });
    g.bench_function("thin_svd", |bench| {
        bench.iter(|| thin_svd(task_vector.as_ref()).unwrap())
    });
    g.finish();

    let k = 3584;
    let x = Mat::<f64>::from_fn(k, k, |_, _| StandardNormal.sample(&mut rng));
    let gram = &x * x.transpose();
    let mut g = c.benchmark_group("tridiagonal_reduction_3584");
    g.sample_size(10);
    g.bench_function("one_stage_faer", |bench| {
        bench.iter(|| {
            let mut a = gram.clone();
            let block = recommended_block_size::<f64>(k, k);
            let mut factors = Mat::<f64>::zeros(block, k - 1);
            let scratch = tridiag_in_place_scratch::<f64>(k, Par::Seq, Default::default());
            tridiag_in_place(
                a.as_mut(),
                factors.as_mut(),
                Par::Seq,
                MemStack::new(&mut MemBuffer::new(scratch)),
                Default::default(),
            );
            a
        })
    });
    g.bench_function("two_stage", |bench| {
        bench.iter(|| TwoStage::reduce(gram.clone(), two_stage::BAND))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
