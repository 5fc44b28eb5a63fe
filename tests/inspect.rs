//! `sinkmerge inspect` on every fixture, checked against goldens computed in Python from the
//! safetensors headers and configs (tools/gen_fixtures.py), and the config-dialect equivalence.

use std::path::Path;

use serde_json::Value;
use sinkmerge::arch::TextConfig;

use crate::util::{fixtures, read_json, sinkmerge};

fn inspect_json(dir: &Path) -> Value {
    sinkmerge(["inspect", "--json", dir.to_str().unwrap()]).json()
}

#[test]
fn inspect_matches_python_goldens_for_every_fixture() {
    let goldens: Value = read_json(fixtures().join("goldens/inspect.json"));
    let mut checked = 0;
    for (name, want) in goldens.as_object().unwrap() {
        if name.starts_with('_') {
            continue;
        }
        let got = inspect_json(&fixtures().join("models").join(name));
        for key in [
            "architecture",
            "model_type",
            "family",
            "num_parameters",
            "num_tensors",
            "num_layers",
            "qk_norm",
            "dtypes",
            "shards",
            "tie_word_embeddings",
        ] {
            assert_eq!(got[key], want[key], "{name}: `{key}`");
        }
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} fixtures checked");
}

#[test]
fn num_parameters_is_the_sum_of_tensor_sizes() {
    let dir = fixtures().join("models/qwen2-sharded");
    let ckpt = sinkmerge::checkpoint::Checkpoint::open_dir(&dir, "qwen2-sharded").unwrap();
    let sum: u64 = ckpt
        .iter_infos()
        .map(|t| t.shape.iter().product::<usize>() as u64)
        .sum();
    assert_eq!(inspect_json(&dir)["num_parameters"], sum);
}

#[test]
fn four_x_and_five_x_configs_normalize_identically() {
    let mut pairs = 0;
    for entry in std::fs::read_dir(fixtures().join("configs")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".4x.json") else {
            continue;
        };
        let v4: Value = read_json(&path);
        let v5: Value = read_json(path.with_file_name(format!("{stem}.5x.json")));
        assert_ne!(v4, v5, "{stem}: the two files should differ in dialect");
        let a = TextConfig::from_model_config(&v4).unwrap();
        let b = TextConfig::from_model_config(&v5).unwrap();
        assert_eq!(a, b, "{stem}: 4.x and 5.x configs normalize differently");
        pairs += 1;
    }
    assert!(pairs >= 5, "only {pairs} config pairs found");
}

#[test]
fn check_reports_nan_and_inf_by_name_with_exit_code_3() {
    let dir = fixtures().join("nonfinite");
    let expected: Value = read_json(dir.join("expected.json"));
    let out = sinkmerge(["inspect", "--check", "--json", dir.to_str().unwrap()]).output();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let found = report["non_finite"].as_array().unwrap();
    let want = expected["nonfinite_tensors"].as_array().unwrap();
    assert_eq!(found.len(), want.len());
    for w in want {
        let f = found
            .iter()
            .find(|f| f["tensor"] == w["tensor"])
            .expect("named");
        assert_eq!(f["nan"], w["nan"]);
        assert_eq!(
            f["inf"].as_u64().unwrap(),
            w["pos_inf"].as_u64().unwrap() + w["neg_inf"].as_u64().unwrap()
        );
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("NaN/Inf") && stderr.lines().count() == 1,
        "{stderr}"
    );

    // A clean model passes the check.
    let out = sinkmerge([
        "inspect",
        "--check",
        fixtures().join("models/qwen3").to_str().unwrap(),
    ])
    .output();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("no NaN or Inf"));
}

#[test]
fn plain_output_names_the_essentials() {
    let out = sinkmerge([
        "inspect",
        fixtures().join("models/qwen3_vl").to_str().unwrap(),
    ])
    .output();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "qwen3-vl",
        "per-head",
        "q_norm.weight",
        "Qwen3VLForConditionalGeneration",
        "model.visual",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
    }
}
