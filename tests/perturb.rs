//! `sinkmerge perturb`: the random-dW control matches TARGET's per-tensor drift with noise that
//! is unrelated to TARGET's change, and leaves every other byte alone.

use std::collections::BTreeMap;
use std::path::Path;

use crate::util::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use safetensors::Dtype;
use serde_json::json;
use sinkmerge::arch::names;

fn is_projection(name: &str) -> bool {
    let n = names::standard_name(name).unwrap_or_default();
    n.ends_with("_proj.weight") && !n.contains("visual")
}

/// Relative drift of projection number `i`: spread over two orders of magnitude.
fn drift_of(i: usize) -> f32 {
    [0.002, 0.01, 0.05, 0.2][i % 4]
}

/// TARGET = REF + a structured (rank-two) change of relative size `drift_of(i)` on every
/// projection, plus changes to biases, norms and embeddings that the control must ignore.
/// TARGET's tensors are renamed as a VLM stores them (`model.language_model.*`).
fn make_target(reference: &BTreeMap<String, Stored>) -> BTreeMap<String, Stored> {
    let mut out = BTreeMap::new();
    for (i, (name, t)) in reference.iter().enumerate() {
        let w = t.f32();
        let changed: Vec<f32> = if is_projection(name) {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let dw: Vec<f32> = (0..rows * cols)
                .map(|k| {
                    let (r, c) = ((k / cols) as f32, (k % cols) as f32);
                    (0.37 * r + 1.0).sin() * (0.11 * c).cos()
                        + 0.5 * (0.7 * r).cos() * (0.29 * c + 2.0).sin()
                })
                .collect();
            let scale = drift_of(i) * frobenius(&w) as f32 / frobenius(&dw) as f32;
            w.iter().zip(&dw).map(|(a, d)| a + scale * d).collect()
        } else {
            w.iter().map(|a| a * 1.1 + 0.01).collect()
        };
        let renamed = name.replacen("model.", "model.language_model.", 1);
        out.insert(
            renamed,
            Stored::from_f32(t.dtype, t.shape.clone(), &changed),
        );
    }
    out
}

/// Check the output against REF and TARGET; returns (name, cosine) per projection.
fn check_output(
    reference: &Path,
    target: &BTreeMap<String, Stored>,
    out: &Path,
) -> Vec<(String, f64)> {
    let r = load(reference);
    let o = load(out);
    assert_eq!(
        r.keys().collect::<Vec<_>>(),
        o.keys().collect::<Vec<_>>(),
        "same tensor names"
    );
    assert_eq!(
        std::fs::read(reference.join("config.json")).unwrap(),
        std::fs::read(out.join("config.json")).unwrap(),
        "config.json is copied byte for byte"
    );
    let mut cosines = Vec::new();
    for (name, rt) in &r {
        let ot = &o[name];
        assert_eq!((ot.dtype, &ot.shape), (rt.dtype, &rt.shape), "{name}");
        if !is_projection(name) {
            assert_eq!(ot.bytes, rt.bytes, "{name} must be byte-identical");
            continue;
        }
        let tt = &target[&name.replacen("model.", "model.language_model.", 1)];
        let (w, t, y) = (rt.f32(), tt.f32(), ot.f32());
        let target_dw = diff(&t, &w);
        let noise = diff(&y, &w);
        let want = frobenius(&target_dw) / frobenius(&w);
        let got = frobenius(&noise) / frobenius(&w);
        assert!(
            (got / want - 1.0).abs() < 1e-3,
            "{name}: realized drift {got} vs TARGET's {want}"
        );
        cosines.push((name.clone(), cosine(&noise, &target_dw)));
    }
    cosines
}

#[test]
fn noise_matches_target_drift_on_the_qwen2_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = fixture("qwen2");
    let target = make_target(&load(&reference));
    let target_dir = tmp.path().join("vlm-lm");
    write_model(&target_dir, &config(&reference), &target, None);
    let out = tmp.path().join("random-dw");
    let report: serde_json::Value = sinkmerge([
        "perturb",
        reference.to_str().unwrap(),
        "--match",
        target_dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--json",
    ])
    .json();
    let cosines = check_output(&reference, &target, &out);
    assert_eq!(cosines.len(), 14, "7 projections in each of 2 layers");
    assert_eq!(report["perturbed"], 14);
    assert_eq!(report["copied"], 12);
    assert!(report["max_mismatch"].as_f64().unwrap() < 1e-5);
    // The fixture's matrices are small (2048-8192 entries, so a random cosine has a standard
    // deviation of 0.011-0.022): below 0.05 holds here at seed 0; the wide model below checks
    // it with a margin of nine standard deviations.
    for (name, c) in &cosines {
        assert!(c.abs() < 0.05, "{name}: cosine {c}");
    }
    for f in [
        "tokenizer.json",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
    ] {
        assert!(out.join(f).exists(), "{f} copied");
    }
}

/// A Qwen2-shaped bf16 model with 256-wide layers: every projection has at least 32768
/// entries, so a random cosine has a standard deviation below 0.006.
fn wide_model(dir: &Path) -> BTreeMap<String, Stored> {
    let (h, inter, kv, vocab) = (256usize, 512usize, 128usize, 64usize);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut t = BTreeMap::new();
    // Entries mean + std * N(0, 1).
    let mut add = |name: String, shape: Vec<usize>, mean: f32, std: f32, rng: &mut ChaCha8Rng| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| mean + std * rng.sample::<f32, _>(StandardNormal))
            .collect();
        t.insert(name, Stored::from_f32(Dtype::BF16, shape, &v));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![vocab, h],
        0.0,
        0.02,
        &mut rng,
    );
    add("model.norm.weight".into(), vec![h], 1.0, 0.3, &mut rng);
    for l in 0..2 {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (n, shape) in [
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("mlp.gate_proj.weight", vec![inter, h]),
            ("mlp.up_proj.weight", vec![inter, h]),
            ("mlp.down_proj.weight", vec![h, inter]),
            ("self_attn.q_proj.bias", vec![h]),
            ("self_attn.k_proj.bias", vec![kv]),
            ("self_attn.v_proj.bias", vec![kv]),
        ] {
            add(p(n), shape, 0.0, 0.02, &mut rng);
        }
        add(p("input_layernorm.weight"), vec![h], 1.0, 0.3, &mut rng);
        add(
            p("post_attention_layernorm.weight"),
            vec![h],
            1.0,
            0.3,
            &mut rng,
        );
    }
    let config = json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16"
    });
    write_model(dir, &config, &t, None);
    t
}

#[test]
fn bf16_noise_is_orthogonal_to_target_dw_per_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("ref");
    let r = wide_model(&reference);
    let target = make_target(&r);
    let target_dir = tmp.path().join("target");
    write_model(&target_dir, &config(&reference), &target, None);
    let out = tmp.path().join("out");
    sinkmerge([
        "perturb",
        reference.to_str().unwrap(),
        "--match",
        target_dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--seed",
        "3",
    ])
    .ok();
    let cosines = check_output(&reference, &target, &out);
    assert_eq!(cosines.len(), 14);
    for (name, c) in &cosines {
        assert!(c.abs() < 0.05, "{name}: cosine {c}");
    }
}

#[test]
fn output_is_deterministic_across_threads_and_follows_the_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = fixture("qwen2");
    let target = make_target(&load(&reference));
    let target_dir = tmp.path().join("t");
    write_model(&target_dir, &config(&reference), &target, None);
    let run = |threads: &str, seed: &str, name: &str| {
        let out = tmp.path().join(name);
        sinkmerge([
            "perturb",
            reference.to_str().unwrap(),
            "--match",
            target_dir.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--seed",
            seed,
            "--threads",
            threads,
        ])
        .ok();
        std::fs::read(out.join("model.safetensors")).unwrap()
    };
    let one = run("1", "0", "a");
    assert_eq!(one, run("2", "0", "b"));
    assert_eq!(one, run("3", "0", "c"));
    assert_ne!(one, run("2", "1", "d"));
}

#[test]
fn sharded_bf16_reference_keeps_untouched_tensors_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = fixture("qwen2-sharded");
    let target = make_target(&load(&reference));
    let target_dir = tmp.path().join("t");
    write_model(&target_dir, &config(&reference), &target, None);
    let out = tmp.path().join("o");
    sinkmerge([
        "perturb",
        reference.to_str().unwrap(),
        "--match",
        target_dir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--max-shard-size",
        "40k",
    ])
    .ok();
    assert!(out.join("model.safetensors.index.json").exists());
    check_output(&reference, &target, &out);
}

#[test]
fn mismatched_inputs_are_refused_with_nothing_written() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = fixture("qwen2");
    let out = tmp.path().join("o");
    let r = reference.to_str().unwrap();
    let o = out.to_str().unwrap();

    // A different architecture.
    let err = sinkmerge([
        "perturb",
        r,
        "--match",
        fixture("qwen3").to_str().unwrap(),
        "-o",
        o,
    ])
    .refused(&[]);
    assert!(err.contains("different architectures"), "{err}");

    // TARGET lacks one projection.
    let mut target = make_target(&load(&reference));
    target.remove("model.language_model.layers.1.mlp.up_proj.weight");
    let t = tmp.path().join("t");
    write_model(&t, &config(&reference), &target, None);
    let err = sinkmerge(["perturb", r, "--match", t.to_str().unwrap(), "-o", o]).refused(&[]);
    assert!(
        err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("no matching tensor"),
        "{err}"
    );

    // A projection of another shape.
    let mut target = make_target(&load(&reference));
    target.insert(
        "model.language_model.layers.0.self_attn.k_proj.weight".into(),
        Stored::from_f32(Dtype::F32, vec![16, 64], &[0.0; 1024]),
    );
    let t2 = tmp.path().join("t2");
    write_model(&t2, &config(&reference), &target, None);
    let err = sinkmerge(["perturb", r, "--match", t2.to_str().unwrap(), "-o", o]).refused(&[]);
    assert!(err.contains("k_proj") && err.contains("[16, 64]"), "{err}");

    // The output may not be an input.
    let good = tmp.path().join("good");
    write_model(
        &good,
        &config(&reference),
        &make_target(&load(&reference)),
        None,
    );
    let g = good.to_str().unwrap();
    let err = sinkmerge(["perturb", r, "--match", g, "-o", g]).refused(&[]);
    assert!(err.contains("is input"), "{err}");
    let err = sinkmerge(["perturb", r, "--match", g, "-o", &format!("{r}/sub")]).refused(&[]);
    assert!(err.contains("lies inside input"), "{err}");

    let err = sinkmerge(["perturb", r, "--match", g]).refused(&[]);
    assert!(err.contains("-o OUT"), "{err}");

    assert!(!out.exists());
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn a_vlm_checkpoint_can_be_the_target() {
    // The Qwen2.5-VL fixture (transformers 5.x layout, bf16) has the qwen2 fixture's text widths;
    // its language model is matched under `model.language_model.`, its vision tower ignored.
    let tmp = tempfile::tempdir().unwrap();
    let reference = fixture("qwen2");
    let vlm = fixture("qwen2_5_vl-new");
    let out = tmp.path().join("o");
    sinkmerge([
        "perturb",
        reference.to_str().unwrap(),
        "--match",
        vlm.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ])
    .ok();
    let cosines = check_output(&reference, &load(&vlm), &out);
    assert_eq!(cosines.len(), 14);
}

#[test]
fn the_model_card_lists_ref_as_base_model_and_both_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = fixture("qwen2");
    let target = make_target(&load(&reference));
    let target_dir = tmp.path().join("t");
    write_model(&target_dir, &config(&reference), &target, None);
    let cache = tmp.path().join("hub");
    let commit = "aa11bb22cc33dd44ee55ff6600000000000000ff";
    fake_hub_cache(&cache, "Org/Ref", commit, &["main"], &reference);
    let out = tmp.path().join("o");
    let t = target_dir.to_str().unwrap();
    sinkmerge([
        "perturb",
        "Org/Ref",
        "--match",
        t,
        "--seed",
        "5",
        "-o",
        out.to_str().unwrap(),
    ])
    .env("HF_HUB_CACHE", &cache)
    .ok();
    let (meta, body) = model_card(&out);
    // TARGET only sizes the noise: it is listed, but not a base model.
    assert_eq!(strings(&meta["base_model"]), ["Org/Ref"]);
    assert!(meta.get("base_model_relation").is_none(), "{meta:?}");
    assert_eq!(strings(&meta["tags"]), ["sinkmerge", "perturbation"]);
    assert_eq!(meta["library_name"], "transformers");
    let t_abs = std::fs::canonicalize(&target_dir).unwrap();
    assert!(body.contains(&format!("`{commit}`")), "{body}");
    assert!(
        body.contains(&format!(
            "| drift target | `{}` | local directory |",
            t_abs.display()
        )),
        "{body}"
    );
    let again = tmp.path().join("again");
    let replay = replay_args(&body, &again);
    assert_eq!(
        replay,
        [
            "perturb",
            &format!("Org/Ref@{commit}"),
            "--match",
            t_abs.to_str().unwrap(),
            "--seed",
            "5",
            "-o",
            again.to_str().unwrap()
        ]
    );
    let replay: Vec<&str> = replay.iter().map(String::as_str).collect();
    sinkmerge(&replay).env("HF_HUB_CACHE", &cache).ok();
    assert_eq!(load(&out), load(&again));

    let bare = tmp.path().join("bare");
    let r = reference.to_str().unwrap();
    sinkmerge([
        "perturb",
        r,
        "--match",
        t,
        "--seed",
        "5",
        "-o",
        bare.to_str().unwrap(),
        "--no-model-card",
    ])
    .ok();
    assert!(!bare.join("README.md").exists());
    assert_eq!(load(&out), load(&bare));
}

#[test]
fn a_config_that_does_not_normalize_skips_the_architecture_check_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = fixture("qwen2");
    let target = tmp.path().join("t");
    let mut broken = config(&reference);
    broken["hidden_size"] = "wide".into();
    write_model(&target, &broken, &make_target(&load(&reference)), None);
    let out = tmp.path().join("o");
    let (_, warning) = sinkmerge([
        "perturb",
        reference.to_str().unwrap(),
        "--match",
        target.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ])
    .warns(&["config.json does not normalize", "not compared"]);
    assert_eq!(warning.lines().count(), 1, "{warning}");
}
