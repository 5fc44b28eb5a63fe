//! Merges through the real binary on the fixtures of tests/fixtures/merge (made by
//! tools/gen_merge_goldens.py): parity with mergekit 0.1.5 goldens, DARE statistics and exact
//! rescales, TIES trimming rules, determinism across thread counts, replay of the recorded
//! config, the output directory, and bad input.

use std::collections::BTreeMap;
use std::path::Path;

use sinkmerge::checkpoint::{Checkpoint, Shard};
use sinkmerge::dtype;

use crate::util::{fake_hub_cache, model_card, ok, root, sinkmerge, strings};

fn model(name: &str) -> String {
    format!("tests/fixtures/merge/models/{name}")
}

type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Every tensor of a model directory, decoded to f32.
fn read_model(dir: &Path) -> Tensors {
    let ckpt = Checkpoint::open_dir(dir, "test").unwrap();
    ckpt.names()
        .iter()
        .map(|n| {
            let t = ckpt.read_tensor(n).unwrap();
            (n.clone(), (t.shape, t.data))
        })
        .collect()
}

/// Every tensor of one safetensors file (the goldens), decoded to f32.
fn read_file(path: &Path) -> Tensors {
    let shard = Shard::open(path).unwrap();
    shard
        .header
        .tensors
        .iter()
        .map(|t| {
            let data = dtype::decode(t.dtype, shard.bytes(t), &t.name).unwrap();
            (t.name.clone(), (t.shape.clone(), data))
        })
        .collect()
}

fn max_abs_diff(a: &Tensors, b: &Tensors) -> (f32, String) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "tensor names differ"
    );
    let mut worst = (0f32, String::new());
    for (name, (shape, x)) in a {
        let (shape_b, y) = &b[name];
        assert_eq!(shape, shape_b, "{name}");
        for (p, q) in x.iter().zip(y) {
            let d = (p - q).abs();
            if d > worst.0 || d.is_nan() {
                worst = (d, name.clone());
            }
        }
    }
    worst
}

#[test]
fn linear_task_arithmetic_and_ties_match_mergekit() {
    for config in [
        "linear",
        "linear_vocab",
        "task_arithmetic",
        "task_arithmetic_gradient",
        "ties",
        "ties_options",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out_dir = tmp.path().join("out");
        let cfg = format!("tests/fixtures/merge/configs/{config}.yml");
        let out = sinkmerge(["merge", &cfg, "-o", out_dir.to_str().unwrap(), "--json"]).output();
        ok(&out);
        let golden =
            read_file(&root().join(format!("tests/fixtures/merge/goldens/{config}.safetensors")));
        let (err, at) = max_abs_diff(&read_model(&out_dir), &golden);
        assert!(err <= 1e-6, "{config}: max abs error {err} at {at}");
    }
}

/// Output of a merge with one task model, a fresh temp dir holding it.
fn merge_one(method_args: &[&str]) -> (tempfile::TempDir, Tensors) {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let mut args: Vec<&str> = method_args.to_vec();
    args.extend(["-o", out_dir.to_str().unwrap()]);
    sinkmerge(&args).ok();
    let tensors = read_model(&out_dir);
    (tmp, tensors)
}

/// (base, task) tensors as the merge sees them: the tied base contributes its embedding as
/// lm_head.
fn base_and_task(task: &str) -> (Tensors, Tensors) {
    let mut base = read_model(&root().join(model("base")));
    let embed = base["model.embed_tokens.weight"].clone();
    base.insert("lm_head.weight".into(), embed);
    (base, read_model(&root().join(model(task))))
}

#[test]
fn dare_keeps_density_of_entries_and_rescales_exactly() {
    let (base, task) = base_and_task("task_a");
    let (b, m) = (model("base"), model("task_a"));

    // Keep fraction: no rescale, one model, weight 1 -> each entry is base or model.
    let density = 0.3;
    let (_t, out) = merge_one(&[
        "dare",
        "--base",
        &b,
        "--models",
        &m,
        "--density",
        "0.3",
        "--rescale",
        "none",
    ]);
    let (mut kept_all, mut n_all) = (0usize, 0usize);
    for (name, (_, y)) in &out {
        let (x0, x1) = (&base[name].1, &task[name].1);
        let mut kept = 0;
        for ((&o, &b0), &m1) in y.iter().zip(x0).zip(x1) {
            if o != b0 {
                assert_eq!(o, b0 + (m1 - b0), "{name}: a kept entry is the model's");
                kept += 1;
            }
        }
        let n = y.len() as f64;
        let sigma = (n * density * (1.0 - density)).sqrt();
        assert!(
            (kept as f64 - n * density).abs() <= 3.0 * sigma + 1.0,
            "{name}: kept {kept} of {n}"
        );
        kept_all += kept;
        n_all += y.len();
    }
    let n = n_all as f64;
    let frac = kept_all as f64 / n;
    assert!(
        (frac - density).abs() <= 3.0 * (density * (1.0 - density) / n).sqrt(),
        "pooled keep fraction {frac}"
    );

    // L1 rescale: every task vector keeps its L1 norm to 1e-5 relative.
    let (_t, out) = merge_one(&[
        "dare",
        "--base",
        &b,
        "--models",
        &m,
        "--drop-rate",
        "0.9",
        "--rescale",
        "l1",
    ]);
    for (name, (_, y)) in &out {
        let (x0, x1) = (&base[name].1, &task[name].1);
        let before: f64 = x0.iter().zip(x1).map(|(p, q)| (q - p).abs() as f64).sum();
        let after: f64 = x0.iter().zip(y).map(|(p, q)| (q - p).abs() as f64).sum();
        if after == 0.0 {
            // Every entry dropped (likely for 8-entry biases at p = 0.9): nothing to rescale,
            // as mergekit's guard says.
            continue;
        }
        assert!(
            ((after - before) / before).abs() <= 1e-5,
            "{name}: L1 {after} vs {before}"
        );
    }

    // Inverse rescale: kept entries are exactly base + delta / density.
    let (_t, out) = merge_one(&[
        "dare",
        "--base",
        &b,
        "--models",
        &m,
        "--density",
        "0.25",
        "--rescale",
        "inverse",
    ]);
    for (name, (_, y)) in &out {
        let (x0, x1) = (&base[name].1, &task[name].1);
        for ((&o, &b0), &m1) in y.iter().zip(x0).zip(x1) {
            assert!(o == b0 || o == b0 + (m1 - b0) / 0.25f32, "{name}: {o}");
        }
    }
}

fn model_bytes(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors")).unwrap()
}

#[test]
fn dare_masks_follow_the_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |seed: &str, name: &str| {
        let out = tmp.path().join(name);
        sinkmerge([
            "dare",
            "--base",
            &model("base"),
            "--models",
            &model("task_a"),
            &model("task_b"),
            "--density",
            "0.5",
            "--consensus",
            "ties",
            "--seed",
            seed,
            "-o",
            out.to_str().unwrap(),
        ])
        .ok();
        model_bytes(&out)
    };
    let a = run("7", "a");
    assert_eq!(a, run("7", "b"), "same seed, same bytes");
    assert_ne!(a, run("8", "c"), "another seed, other masks");
}

/// Indices kept by a stable descending sort of |d| (ties to the lower index).
fn stable_top_k(d: &[f32], k: usize) -> Vec<bool> {
    let mut idx: Vec<usize> = (0..d.len()).collect();
    idx.sort_by(|&a, &b| d[b].abs().total_cmp(&d[a].abs()).then(a.cmp(&b)));
    let mut keep = vec![false; d.len()];
    for &i in &idx[..k] {
        keep[i] = true;
    }
    keep
}

#[test]
fn ties_trims_by_magnitude_locally_and_globally() {
    let (base, task) = base_and_task("task_a");
    let deltas: BTreeMap<&String, Vec<f32>> = base
        .iter()
        .map(|(n, (_, b))| (n, b.iter().zip(&task[n].1).map(|(p, q)| q - p).collect()))
        .collect();
    let check = |out: &Tensors, keep: &dyn Fn(&str, usize) -> bool| {
        for (name, (_, y)) in out {
            let b0 = &base[name].1;
            for (j, (&o, &x)) in y.iter().zip(b0).enumerate() {
                let expected = if keep(name, j) {
                    x + deltas[name][j]
                } else {
                    x
                };
                assert_eq!(o, expected, "{name}[{j}]");
            }
        }
    };

    // Local: per tensor the max(1, int(0.2 n)) largest, ties to the lowest index. The planted
    // ties in layers.0.input_layernorm (5 equal of 16, k = 3) and layers.1 k_proj.bias are here.
    let (_t, out) = merge_one(&[
        "ties",
        "--base",
        &model("base"),
        "--models",
        &model("task_a"),
        "--density",
        "0.2",
    ]);
    let local: BTreeMap<&String, Vec<bool>> = deltas
        .iter()
        .map(|(n, d)| {
            (
                *n,
                stable_top_k(d, ((0.2 * d.len() as f64) as usize).max(1)),
            )
        })
        .collect();
    let ln = &local[&"model.layers.0.input_layernorm.weight".to_string()];
    assert_eq!(
        (0..16).filter(|&j| ln[j]).collect::<Vec<_>>(),
        [2, 5, 7],
        "the three lowest-indexed of the five tied entries"
    );
    check(&out, &|n, j| local[&n.to_string()][j]);

    // Global (official TIES): kth = kthvalue(|M|, n - k) over the whole model, keep |d| >= kth.
    let (_t, out) = merge_one(&[
        "ties",
        "--base",
        &model("base"),
        "--models",
        &model("task_a"),
        "--density",
        "0.2",
        "--trim",
        "global",
    ]);
    let mut all: Vec<f32> = deltas.values().flatten().map(|x| x.abs()).collect();
    all.sort_by(f32::total_cmp);
    let n = all.len();
    let k = (n as f64 * 0.2) as usize;
    let kth = all[n - k - 1];
    check(&out, &|name, j| deltas[&name.to_string()][j].abs() >= kth);
}

const METHOD_RUNS: &[&[&str]] = &[
    &[
        "linear",
        "--models",
        "M:base",
        "M:task_a",
        "M:task_c",
        "--weights",
        "0.95,0.03,0.02",
    ],
    &[
        "task-arithmetic",
        "--base",
        "M:base",
        "--models",
        "M:task_a",
        "M:task_b",
    ],
    &[
        "ties",
        "--base",
        "M:base",
        "--models",
        "M:task_a",
        "M:task_b",
        "M:task_c",
        "--density",
        "0.2",
    ],
    &[
        "dare",
        "--base",
        "M:base",
        "--models",
        "M:task_a",
        "M:task_b",
        "--drop-rate",
        "0.9",
    ],
    &[
        "dare",
        "--base",
        "M:base",
        "--models",
        "M:task_a",
        "M:task_c",
        "--density",
        "0.4",
        "--consensus",
        "ties",
        "--seed",
        "3",
    ],
    &[
        "tsv", "--base", "M:base", "--models", "M:task_a", "M:task_b",
    ],
    &[
        "star", "--base", "M:base", "--models", "M:task_a", "M:task_c", "--eta", "40",
    ],
];

fn expand(args: &[&str]) -> Vec<String> {
    args.iter()
        .map(|a| match a.strip_prefix("M:") {
            Some(m) => model(m),
            None => a.to_string(),
        })
        .collect()
}

#[test]
fn outputs_do_not_depend_on_the_thread_count() {
    for run in METHOD_RUNS {
        let tmp = tempfile::tempdir().unwrap();
        let mut bytes = Vec::new();
        for threads in ["1", "2"] {
            let out = tmp.path().join(threads);
            let mut args = expand(run);
            args.extend(["-o".into(), out.to_str().unwrap().into()]);
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            sinkmerge(&argv).threads(threads).ok();
            bytes.push(model_bytes(&out));
        }
        assert!(
            bytes[0] == bytes[1],
            "{}: differs between 1 and 2 threads",
            run[0]
        );
    }
}

#[test]
fn the_recorded_config_replays_to_identical_bytes() {
    for run in METHOD_RUNS {
        let tmp = tempfile::tempdir().unwrap();
        let first = tmp.path().join("first");
        let mut args = expand(run);
        args.extend([
            "-o".into(),
            first.to_str().unwrap().into(),
            "--out-dtype".into(),
            "bf16".into(),
        ]);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        sinkmerge(&argv).ok();
        let record = first.join("sinkmerge_config.yml");
        let text = std::fs::read_to_string(&record).unwrap();
        assert!(text.contains("sinkmerge_version"), "{text}");
        let second = tmp.path().join("second");
        sinkmerge([
            "merge",
            record.to_str().unwrap(),
            "-o",
            second.to_str().unwrap(),
        ])
        .ok();
        assert!(
            model_bytes(&first) == model_bytes(&second),
            "{}: replay differs",
            run[0]
        );
        for file in ["config.json", "sinkmerge_config.yml", "tokenizer.json"] {
            assert_eq!(
                std::fs::read(first.join(file)).unwrap(),
                std::fs::read(second.join(file)).unwrap(),
                "{}: {file} differs",
                run[0]
            );
        }
    }
}

#[test]
fn the_output_is_a_complete_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let out = sinkmerge([
        "task-arithmetic",
        "--base",
        &model("base"),
        "--models",
        &model("task_c"),
        &model("task_a"),
        "--out-dtype",
        "bfloat16",
        "--json",
        "-o",
        out_dir.to_str().unwrap(),
    ])
    .output();
    ok(&out);
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["method"], "task_arithmetic");
    assert_eq!(summary["dtype"], "bfloat16");
    assert_eq!(summary["tensors"], 39);
    // The tokenizer comes from the first of --models by default.
    assert_eq!(summary["tokenizer_from"], model("task_c"));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["dtype"], "bfloat16");
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "sinkmerge_config.yml",
    ] {
        assert!(out_dir.join(file).is_file(), "{file} missing");
    }
    let ckpt = Checkpoint::open_dir(&out_dir, "out").unwrap();
    assert!(ckpt
        .iter_infos()
        .all(|t| t.dtype == safetensors::Dtype::BF16));

    // Tied inputs only: no lm_head; the bf16 base dtype is kept without --out-dtype.
    let tied = tmp.path().join("tied");
    sinkmerge([
        "linear",
        "--models",
        &model("task_c"),
        &model("base"),
        "-o",
        tied.to_str().unwrap(),
    ])
    .ok();
    let ckpt = Checkpoint::open_dir(&tied, "tied").unwrap();
    assert!(!ckpt.contains("lm_head.weight"));
    assert!(ckpt
        .iter_infos()
        .all(|t| t.dtype == safetensors::Dtype::BF16));
}

/// Run a merge that must fail with exit 2, one error line containing `expected`, and leave no
/// output (nor temporary directory) behind.
fn fails(args: &[&str], expected: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let mut argv = args.to_vec();
    argv.extend(["-o", out_dir.to_str().unwrap()]);
    sinkmerge(&argv).refused(expected);
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "{args:?}: something was written"
    );
}

#[test]
fn bad_input_is_refused_before_anything_is_written() {
    let (base, a) = (model("base"), model("task_a"));
    fails(
        &[
            "task-arithmetic",
            "--base",
            &base,
            "--models",
            &model("bad_wide"),
        ],
        &["different architectures", "hidden_size"],
    );
    fails(
        &["linear", "--models", &a, &model("bad_shape")],
        &[
            "bad_shape/model.safetensors",
            "model.layers.1.mlp.up_proj.weight",
            "[33, 16]",
        ],
    );
    fails(
        &[
            "ties",
            "--base",
            &model("bad_missing"),
            "--models",
            &a,
            "--density",
            "0.2",
        ],
        &["model.layers.2.self_attn.q_proj.bias"],
    );
    for density in ["1.5", "0", "-0.1"] {
        fails(
            &[
                "ties",
                "--base",
                &base,
                "--models",
                &a,
                "--density",
                density,
            ],
            &["density", "outside (0, 1]"],
        );
    }
    fails(
        &["dare", "--base", &base, "--models", &a, "--drop-rate", "1"],
        &["density", "outside (0, 1]"],
    );
    fails(
        &["star", "--base", &base, "--models", &a, "--eta", "0"],
        &["eta", "outside (0, 100]"],
    );
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("bad.yml");
    std::fs::write(
        &cfg,
        format!("merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {a}\n    parameters: {{weight: 1, density: 0.2}}\nnormalise: true\n"),
    )
    .unwrap();
    fails(
        &["merge", cfg.to_str().unwrap()],
        &["bad.yml", "unknown key `normalise`"],
    );
    fails(
        &[
            "task-arithmetic",
            "--base",
            &base,
            "--models",
            &a,
            "--out-dtype",
            "int8",
        ],
        &["--out-dtype int8"],
    );
    // The output may not be an input.
    let out = sinkmerge(["linear", "--models", &a, &base, "-o", &a, "--force"]).output();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("inputs are never written"));
}

/// Relative error of a merged model against a reference, per tensor, on the merged task
/// vector: ||out - ref|| / ||ref - base|| (an exact match is required where ref == base).
fn worst_relative_error(out: &Tensors, reference: &Tensors, base: &Tensors) -> (f64, String) {
    let mut worst = (0f64, String::new());
    for (name, (_, r)) in reference {
        let o = &out[name].1;
        let b = &base[name].1;
        let diff: f64 = o
            .iter()
            .zip(r)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let size: f64 = r
            .iter()
            .zip(b)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let rel = if size == 0.0 { diff } else { diff / size };
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
    }
    worst
}

#[test]
fn tsv_and_star_match_the_torch_reference() {
    let (base, _) = base_and_task("task_a");
    for config in ["tsv", "tsv_options", "star", "star_options"] {
        let tmp = tempfile::tempdir().unwrap();
        let out_dir = tmp.path().join("out");
        let cfg = format!("tests/fixtures/merge/configs/{config}.yml");
        sinkmerge(["merge", &cfg, "-o", out_dir.to_str().unwrap()]).ok();
        let reference =
            read_file(&root().join(format!("tests/fixtures/merge/goldens/{config}.safetensors")));
        let out = read_model(&out_dir);
        assert_eq!(
            out.keys().collect::<Vec<_>>(),
            reference.keys().collect::<Vec<_>>()
        );
        let (err, at) = worst_relative_error(&out, &reference, &base);
        assert!(err <= 1e-4, "{config}: relative error {err} at {at}");
    }
}

#[test]
fn spectral_edge_cases_match_the_torch_reference() {
    use sinkmerge::merge::{star, tsv};
    use sinkmerge::tensor::Tensor;
    let path = root().join("tests/fixtures/merge/goldens/spectral_cases.safetensors");
    let tensors = read_file(&path);
    let shard = Shard::open(&path).unwrap();
    assert_eq!(shard.header.metadata.len(), 8);
    for (case, spec) in &shard.header.metadata {
        let fields: Vec<&str> = spec.split(' ').collect();
        let tasks: usize = fields[1].parse().unwrap();
        let deltas: Vec<Tensor> = (0..tasks)
            .map(|i| {
                let (shape, data) = tensors[&format!("{case}.delta{i}")].clone();
                Tensor::new(shape, data)
            })
            .collect();
        let got = match fields[0] {
            "tsv" => tsv::merge_matrix(&deltas).unwrap(),
            _ => {
                let eta: f64 = fields[2].parse().unwrap();
                let parts: Vec<Vec<f32>> = deltas
                    .iter()
                    .map(|d| star::truncate(d, eta).unwrap())
                    .collect();
                star::average(&parts)
            }
        };
        let expected = &tensors[&format!("{case}.expected")].1;
        let size: f64 = expected
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let diff: f64 = got
            .iter()
            .zip(expected)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        match case.as_str() {
            // T > min(m, n): nothing survives, exactly.
            "tsv_t_gt_k" => assert!(got.iter().all(|&x| x == 0.0) && size == 0.0),
            _ => assert!(diff <= 1e-4 * size, "{case}: {diff} vs size {size}"),
        }
        if case == "star_eta100" {
            // eta = 100 keeps everything unscaled: the plain mean of the task vectors.
            let mean: Vec<f32> = (0..got.len())
                .map(|j| deltas.iter().map(|d| d.data[j] * 0.5).sum())
                .collect();
            let off = got
                .iter()
                .zip(&mean)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(off < 1e-6, "eta 100: {off}");
        }
    }
}

/// Three models (base and two tasks) with tensors of several row blocks each, in `dir`.
fn large_models(dir: &Path) -> Vec<String> {
    use rand::{Rng, SeedableRng};
    use safetensors::tensor::TensorView;
    let shapes = [
        (
            "model.layers.0.mlp.up_proj.weight",
            vec![600usize, 500usize],
        ),
        ("model.layers.0.self_attn.k_proj.weight", vec![40, 300]),
        ("model.layers.0.input_layernorm.weight", vec![300]),
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let base: Vec<Vec<f32>> = shapes
        .iter()
        .map(|(_, s)| {
            (0..s.iter().product())
                .map(|_| rng.random::<f32>() - 0.5)
                .collect()
        })
        .collect();
    ["base", "a", "b"]
        .iter()
        .enumerate()
        .map(|(m, name)| {
            let out = dir.join(name);
            std::fs::create_dir_all(&out).unwrap();
            std::fs::copy(
                root().join(model("base")).join("config.json"),
                out.join("config.json"),
            )
            .unwrap();
            let bytes: Vec<Vec<u8>> = base
                .iter()
                .map(|b| {
                    b.iter()
                        .flat_map(|&x| {
                            let d = if m == 0 {
                                0.0
                            } else {
                                (rng.random::<f32>() - 0.5) * 0.05
                            };
                            (x + d).to_le_bytes()
                        })
                        .collect()
                })
                .collect();
            let views: Vec<(&str, TensorView)> = shapes
                .iter()
                .zip(&bytes)
                .map(|((n, s), b)| {
                    (
                        *n,
                        TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
                    )
                })
                .collect();
            safetensors::tensor::serialize_to_file(views, None, &out.join("model.safetensors"))
                .unwrap();
            out.to_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn large_tensors_are_identical_at_any_thread_count() {
    let tmp = tempfile::tempdir().unwrap();
    let m = large_models(tmp.path());
    let runs: [Vec<&str>; 7] = [
        vec!["linear", "--models", &m[0], &m[1], &m[2]],
        vec!["task-arithmetic", "--base", &m[0], "--models", &m[1], &m[2]],
        vec![
            "ties",
            "--base",
            &m[0],
            "--models",
            &m[1],
            &m[2],
            "--density",
            "0.2",
            "--rescale",
        ],
        vec![
            "ties",
            "--base",
            &m[0],
            "--models",
            &m[1],
            &m[2],
            "--density",
            "0.3",
            "--trim",
            "global",
        ],
        vec![
            "dare",
            "--base",
            &m[0],
            "--models",
            &m[1],
            &m[2],
            "--density",
            "0.1",
            "--consensus",
            "ties",
        ],
        vec!["tsv", "--base", &m[0], "--models", &m[1], &m[2]],
        vec!["star", "--base", &m[0], "--models", &m[1], &m[2]],
    ];
    for run in &runs {
        let mut bytes = Vec::new();
        for threads in ["1", "2"] {
            let out = tmp.path().join(format!("{}-{threads}", run[0]));
            let mut args = run.clone();
            args.extend(["-o", out.to_str().unwrap(), "--force"]);
            sinkmerge(&args).threads(threads).ok();
            bytes.push(model_bytes(&out));
        }
        assert!(
            bytes[0] == bytes[1],
            "{run:?}: differs between 1 and 2 threads"
        );
    }
}

const REPLAY: &str = "```sh\nsinkmerge merge sinkmerge_config.yml -o OUT\n```";

/// The card of a merge of local fixtures: no base_model (no repo ids), the merge tags, the
/// record verbatim and the replay command.
fn check_local_merge_card(out: &Path, what: &str) {
    let record = std::fs::read_to_string(out.join("sinkmerge_config.yml")).unwrap();
    let parsed: serde_yaml_ng::Value = serde_yaml_ng::from_str(&record).unwrap();
    let method = parsed["merge_method"].as_str().unwrap();
    let (meta, body) = model_card(out);
    assert!(meta.get("base_model").is_none(), "{what}: {meta:?}");
    assert_eq!(meta["base_model_relation"], "merge", "{what}");
    assert_eq!(
        strings(&meta["tags"]),
        ["sinkmerge", "merge", method],
        "{what}"
    );
    assert_eq!(meta["library_name"], "transformers", "{what}");
    assert!(
        body.contains(&format!("```yaml\n{record}```\n")),
        "{what}: {body}"
    );
    assert!(body.contains(REPLAY), "{what}: {body}");
    let base = std::fs::canonicalize(root().join(model("base"))).unwrap();
    assert!(
        body.contains(&format!("`{}` | local directory |", base.display())),
        "{what}: {body}"
    );
}

#[test]
fn every_merge_command_writes_a_model_card() {
    let tmp = tempfile::tempdir().unwrap();
    for (i, run) in METHOD_RUNS.iter().enumerate() {
        let out = tmp.path().join(i.to_string());
        let mut args = expand(run);
        args.extend(["-o".into(), out.to_str().unwrap().into()]);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        sinkmerge(&argv).ok();
        check_local_merge_card(&out, run[0]);
    }
    let out = tmp.path().join("config");
    sinkmerge([
        "merge",
        "tests/fixtures/merge/configs/ties.yml",
        "-o",
        out.to_str().unwrap(),
    ])
    .ok();
    check_local_merge_card(&out, "merge ties.yml");
}

#[test]
fn a_cached_base_is_the_base_model_and_the_card_replays() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let commit = "feedface00000000000000000000000000000001";
    fake_hub_cache(
        &cache,
        "Org/Tiny-Base",
        commit,
        &["main"],
        &root().join(model("base")),
    );
    let out = tmp.path().join("merged");
    sinkmerge([
        "ties",
        "--base",
        "Org/Tiny-Base",
        "--models",
        &model("task_a"),
        &model("task_b"),
        "--density",
        "0.5",
        "--tokenizer-from",
        &model("task_c"),
        "-o",
        out.to_str().unwrap(),
    ])
    .env("HF_HUB_CACHE", &cache)
    .ok();
    let (meta, body) = model_card(&out);
    // Only the repo id; the local models and the tokenizer donor are in the body.
    assert_eq!(strings(&meta["base_model"]), ["Org/Tiny-Base"]);
    assert_eq!(meta["base_model_relation"], "merge");
    assert_eq!(strings(&meta["tags"]), ["sinkmerge", "merge", "ties"]);
    assert_eq!(meta["library_name"], "transformers");
    assert!(
        body.contains(&format!(
            "| base | [Org/Tiny-Base](https://huggingface.co/Org/Tiny-Base) | `{commit}` |"
        )),
        "{body}"
    );
    for (role, m) in [
        ("model", "task_a"),
        ("model", "task_b"),
        ("tokenizer", "task_c"),
    ] {
        let path = std::fs::canonicalize(root().join(model(m))).unwrap();
        assert!(
            body.contains(&format!(
                "| {role} | `{}` | local directory |",
                path.display()
            )),
            "{m}: {body}"
        );
    }
    assert!(body.contains(REPLAY), "{body}");

    // The replay, run in OUT as the card says.
    let again = tmp.path().join("again");
    sinkmerge([
        "merge",
        "sinkmerge_config.yml",
        "-o",
        again.to_str().unwrap(),
    ])
    .current_dir(&out)
    .env("HF_HUB_CACHE", &cache)
    .ok();
    assert!(model_bytes(&out) == model_bytes(&again), "replay differs");
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(again.join("tokenizer.json")).unwrap()
    );
}

#[test]
fn no_model_card_writes_none_and_changes_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let listing = |dir: &Path| {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).unwrap())
            })
            .collect();
        files.sort();
        files
    };
    let mut trees = Vec::new();
    for (name, flag) in [("with", None), ("without", Some("--no-model-card"))] {
        let out = tmp.path().join(name);
        let mut args = vec![
            "task-arithmetic".to_string(),
            "--base".into(),
            model("base"),
            "--models".into(),
            model("task_a"),
            "-o".into(),
            out.to_str().unwrap().into(),
        ];
        args.extend(flag.map(String::from));
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        sinkmerge(&argv).ok();
        trees.push(listing(&out));
    }
    assert!(trees[0].iter().any(|(n, _)| n == "README.md"));
    trees[0].retain(|(n, _)| n != "README.md");
    assert_eq!(trees[0], trees[1]);
}

#[test]
fn partial_outputs_of_killed_runs_are_removed_on_the_next_run() {
    let tmp = tempfile::tempdir().unwrap();
    // What `kill -9` during a merge leaves: no process 4294967 exists (pid_max is below 2^22).
    let dead = tmp
        .path()
        .join(".merged.sinkmerge-partial-4294967-0000beef");
    std::fs::create_dir(&dead).unwrap();
    std::fs::write(
        dead.join("model-00001-of-00002.safetensors"),
        vec![0u8; 4096],
    )
    .unwrap();
    // A run in progress (this test's own process stands in for it) keeps its directory.
    let live = tmp.path().join(format!(
        ".other.sinkmerge-partial-{}-0000cafe",
        std::process::id()
    ));
    std::fs::create_dir(&live).unwrap();
    let out_dir = tmp.path().join("merged");
    let out = sinkmerge([
        "linear",
        "--models",
        &model("task_a"),
        &model("task_b"),
        "-o",
        out_dir.to_str().unwrap(),
        "-q",
    ])
    .output();
    ok(&out);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!dead.exists(), "the dead run's partial output is gone");
    assert!(err.contains("removed") && err.contains("4294967"), "{err}");
    assert!(live.is_dir(), "a live process keeps its partial output");
    assert!(out_dir.join("config.json").is_file());
}
