//! `sinkmerge ablate`: exactly K entries of each listed norm scale become its mean; everything
//! else is byte-identical.

use std::collections::BTreeMap;
use std::path::Path;

use crate::util::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use serde_json::Value;

/// Planted channels of a norm scale of length `n`: eight large entries of distinct magnitude
/// and three entries tied at |gamma| = 7 (so with K = 10 the tie sits at the K-th place).
fn planted(n: usize) -> (Vec<(usize, f32)>, [usize; 3]) {
    let large = [30.0, -25.0, 20.0, 18.0, -16.0, 14.0, 12.0, -10.0];
    let at: Vec<usize> = (0..8).map(|i| (i * 7 + 3) % n).collect();
    let ties = if n >= 64 { [40, 50, 60] } else { [21, 26, 29] };
    (at.into_iter().zip(large).collect(), ties)
}

/// The qwen3 fixture (bf16) with every norm scale randomized around 1 and the planted channels.
fn gamma_model(dir: &Path) -> BTreeMap<String, Stored> {
    let source = fixture("qwen3");
    let mut tensors = load(&source);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (name, t) in tensors.iter_mut() {
        if !name.contains("norm") {
            continue;
        }
        let n = t.shape[0];
        let mut v: Vec<f32> = (0..n).map(|_| 1.0 + rng.random_range(-0.3..0.3)).collect();
        let (large, ties) = planted(n);
        for (i, x) in large {
            v[i] = x;
        }
        v[ties[0]] = 7.0;
        v[ties[1]] = -7.0;
        v[ties[2]] = 7.0;
        *t = Stored::from_f32(Dtype::BF16, t.shape.clone(), &v);
    }
    write_model(dir, &config(&source), &tensors, Some(&source));
    tensors
}

/// The mean of `values` rounded to bf16, as the ablation must write it.
fn bf16_mean(values: &[f32]) -> f32 {
    let mean = values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64;
    Stored::from_f32(Dtype::BF16, vec![1], &[mean as f32]).f32()[0]
}

#[test]
fn top_k_channels_become_the_mean_and_nothing_else_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    let before = gamma_model(&model);
    let out = tmp.path().join("ablated");
    let report: Value = sinkmerge([
        "ablate",
        model.to_str().unwrap(),
        "--norms",
        "input_layernorm,q_norm,k_norm",
        "--top-k",
        "10",
        "-o",
        out.to_str().unwrap(),
        "--json",
    ])
    .json();
    let after = load(&out);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    let mut ablated = 0;
    for (name, b) in &before {
        let a = &after[name];
        let listed = ["input_layernorm", "q_norm", "k_norm"]
            .iter()
            .any(|n| name.ends_with(&format!(".{n}.weight")));
        if !listed {
            assert_eq!(a.bytes, b.bytes, "{name} must be byte-identical");
            continue;
        }
        ablated += 1;
        let (bv, av) = (b.f32(), a.f32());
        let (large, ties) = planted(bv.len());
        let mut expected: Vec<usize> = large.iter().map(|&(i, _)| i).collect();
        // The tie at |gamma| = 7 is broken by lowest index: two of the three make the top 10.
        expected.extend(&ties[..2]);
        expected.sort();
        let changed: Vec<usize> = (0..bv.len()).filter(|&i| av[i] != bv[i]).collect();
        assert_eq!(changed, expected, "{name}");
        let mean = bf16_mean(&bv);
        assert!(
            changed.iter().all(|&i| av[i] == mean),
            "{name}: mean {mean}"
        );
        assert_eq!(a.dtype, Dtype::BF16);
    }
    assert_eq!(ablated, 6, "3 norms x 2 layers");
    let tensors = report["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 6);
    for t in tensors {
        assert_eq!(t["changed"], 10);
        assert_eq!(t["channels"].as_array().unwrap().len(), 10);
        // Largest |gamma| first.
        assert_eq!(t["replaced"][0], 30.0);
    }
    assert_eq!(
        std::fs::read(model.join("config.json")).unwrap(),
        std::fs::read(out.join("config.json")).unwrap()
    );
    assert!(out.join("tokenizer.json").exists());
}

#[test]
fn layer_selection_leaves_other_layers_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    let before = gamma_model(&model);
    let out = tmp.path().join("o");
    let text = sinkmerge([
        "ablate",
        model.to_str().unwrap(),
        "--norms",
        "post_attention_layernorm",
        "--top-k",
        "3",
        "--layers",
        "1",
        "-o",
        out.to_str().unwrap(),
    ])
    .ok();
    assert!(text.contains("ablated 1 tensors"), "{text}");
    let after = load(&out);
    for (name, b) in &before {
        let same = after[name].bytes == b.bytes;
        assert_eq!(
            same,
            name != "model.layers.1.post_attention_layernorm.weight",
            "{name}"
        );
    }
}

#[test]
fn vlm_language_model_norms_are_found_under_their_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    let model = fixture("qwen2_5_vl-new");
    let o = sinkmerge([
        "ablate",
        model.to_str().unwrap(),
        "--norms",
        "input_layernorm",
        "--top-k",
        "2",
        "-o",
        out.to_str().unwrap(),
        "--json",
    ])
    .output();
    assert!(o.status.success(), "{}", stderr(&o));
    let report: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let names: Vec<&str> = report["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tensor"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "model.language_model.layers.0.input_layernorm.weight",
            "model.language_model.layers.1.input_layernorm.weight"
        ]
    );
    // The fixture's scales are all ones, which equal their mean: nothing changes, and the
    // command says so rather than claiming K changes.
    assert!(report["tensors"][0]["changed"] == 0);
    assert!(
        stderr(&o).contains("already equalled the mean"),
        "{}",
        stderr(&o)
    );
    let (a, b) = (load(&model), load(&out));
    assert!(a.iter().all(|(n, t)| b[n].bytes == t.bytes));
}

#[test]
fn norms_the_architecture_lacks_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    let o = out.to_str().unwrap();
    let qwen2 = fixture("qwen2");
    let err = sinkmerge([
        "ablate",
        qwen2.to_str().unwrap(),
        "--norms",
        "input_layernorm,q_norm",
        "-o",
        o,
    ])
    .refused(&[]);
    assert!(
        err.contains("no `q_norm` tensors")
            && err.contains("QK-norm class: none")
            && err.contains("input_layernorm, post_attention_layernorm"),
        "{err}"
    );
    // Olmo-3 is post-norm: no input_layernorm.
    let err = sinkmerge([
        "ablate",
        fixture("olmo3").to_str().unwrap(),
        "--norms",
        "input_layernorm",
        "-o",
        o,
    ])
    .refused(&[]);
    assert!(
        err.contains("no `input_layernorm`") && err.contains("q_norm"),
        "{err}"
    );
    assert!(!out.exists());
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn bad_arguments_and_values_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    let mut tensors = gamma_model(&model);
    let out = tmp.path().join("o");
    let (m, o) = (model.to_str().unwrap(), out.to_str().unwrap());

    let err = sinkmerge(["ablate", m, "--norms", "q_norm", "--top-k", "40", "-o", o]).refused(&[]);
    assert!(
        err.contains("fewer than --top-k 40") && err.contains("q_norm"),
        "{err}"
    );
    let err = sinkmerge(["ablate", m, "--norms", "q_norm", "--top-k", "0", "-o", o]).refused(&[]);
    assert!(err.contains("at least 1"), "{err}");
    let err = sinkmerge(["ablate", m, "--norms", "q_norm", "--layers", "2", "-o", o]).refused(&[]);
    assert!(err.contains("0-1"), "{err}");
    let unknown = sinkmerge(["ablate", m, "--norms", "gamma", "-o", o]).output();
    assert_eq!(unknown.status.code(), Some(2));
    assert!(stderr(&unknown).contains("input_layernorm"));

    let name = "model.layers.1.self_attn.k_norm.weight";
    let mut v = tensors[name].f32();
    v[4] = f32::NAN;
    tensors.insert(
        name.into(),
        Stored::from_f32(Dtype::BF16, vec![v.len()], &v),
    );
    let nan_model = tmp.path().join("nan");
    write_model(&nan_model, &config(&model), &tensors, None);
    // NaN or Inf in an input is exit 3 in every command (tests/exit_codes.rs).
    sinkmerge([
        "ablate",
        nan_model.to_str().unwrap(),
        "--norms",
        "k_norm",
        "-o",
        o,
    ])
    .non_finite(&[name, "NaN"]);
    assert!(!out.exists());
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn the_model_card_records_the_ablation_and_its_replay() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    gamma_model(&model);
    let out = tmp.path().join("ablated");
    let m = model.to_str().unwrap();
    let args = [
        "ablate",
        m,
        "--norms",
        "input_layernorm,k_norm",
        "--top-k",
        "4",
        "--layers",
        "1",
    ];
    sinkmerge([&args[..], &["-o", out.to_str().unwrap()]].concat()).ok();
    let (meta, body) = model_card(&out);
    // A local directory has no repo id: no base_model, and the body gives its path.
    assert!(meta.get("base_model").is_none(), "{meta:?}");
    assert!(meta.get("base_model_relation").is_none(), "{meta:?}");
    assert_eq!(strings(&meta["tags"]), ["sinkmerge", "ablation"]);
    assert_eq!(meta["library_name"], "transformers");
    let path = std::fs::canonicalize(&model).unwrap();
    assert!(
        body.contains(&format!(
            "| model | `{}` | local directory |",
            path.display()
        )),
        "{body}"
    );
    let replay = replay_args(&body, &tmp.path().join("again"));
    assert_eq!(
        replay[..9],
        [
            "ablate",
            path.to_str().unwrap(),
            "--norms",
            "input_layernorm,k_norm",
            "--top-k",
            "4",
            "--layers",
            "1",
            "-o"
        ]
    );
    let replay: Vec<&str> = replay.iter().map(String::as_str).collect();
    sinkmerge(&replay).ok();
    assert_eq!(load(&out), load(&tmp.path().join("again")));

    let bare = tmp.path().join("bare");
    sinkmerge(
        [
            &args[..],
            &["-o", bare.to_str().unwrap(), "--no-model-card"],
        ]
        .concat(),
    )
    .ok();
    assert!(!bare.join("README.md").exists());
    assert_eq!(load(&out), load(&bare));
}

#[test]
fn a_config_that_does_not_normalize_counts_layers_from_the_names_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let source = fixture("qwen3");
    let model = tmp.path().join("m");
    let mut broken = config(&source);
    broken["hidden_size"] = "wide".into();
    write_model(&model, &broken, &load(&source), Some(&source));
    let out = tmp.path().join("o");
    let (stdout, _) = sinkmerge([
        "ablate",
        model.to_str().unwrap(),
        "--norms",
        "input_layernorm",
        "--top-k",
        "2",
        "-o",
        out.to_str().unwrap(),
    ])
    .warns(&[
        "config.json does not normalize",
        "counted from the tensor names",
    ]);
    let layers = load(&source)
        .keys()
        .filter(|n| n.ends_with("input_layernorm.weight"))
        .count();
    assert!(stdout.contains(&format!("ablated {layers} tensors")));
}
