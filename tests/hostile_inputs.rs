//! Hostile configs and headers through the command line: each is bad input (exit 2, one line
//! naming the field or tensor), never a panic (exit 101), an overflow or an allocation that
//! aborts. docs/architecture.md#panics states the policy.

use std::path::Path;

use serde_json::{json, Value};

use crate::util::{fixture, sinkmerge};

/// The qwen2 fixture with config.json's `edits` applied (its other files linked), in `dir`.
fn with_config(dir: &Path, edits: &Value) {
    let source = fixture("qwen2");
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "config.json" {
            std::os::unix::fs::symlink(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    let mut config: Value = crate::util::config(&source);
    for (k, v) in edits.as_object().unwrap() {
        config[k] = v.clone();
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

#[test]
fn hostile_configs_are_refused_by_every_command_that_reads_heads() {
    let cases = [
        (
            json!({"num_attention_heads": -4}),
            "`num_attention_heads` must be a non-negative",
        ),
        (
            json!({"num_attention_heads": u64::MAX}),
            "not divisible by num_attention_heads",
        ),
        (
            json!({"num_attention_heads": 5}),
            "hidden_size 64 is not divisible",
        ),
        (
            json!({"num_key_value_heads": 3}),
            "not a multiple of num_key_value_heads 3",
        ),
        (json!({"vocab_size": 0}), "`vocab_size` is 0"),
        // Per-layer tables would be allocated before any weight is read.
        (
            json!({"num_hidden_layers": 1u64 << 40}),
            "num_hidden_layers 1099511627776 is outside 1-65536",
        ),
        (
            json!({"num_hidden_layers": 0}),
            "num_hidden_layers 0 is outside 1-65536",
        ),
        (json!({"head_dim": 0}), "`head_dim` is 0"),
        (
            json!({"head_dim": 1u64 << 62}),
            "larger than any machine can address",
        ),
        (
            json!({"intermediate_size": 1u64 << 61}),
            "intermediate_size",
        ),
        // Products that fit, but more heads than the tensors hold.
        (
            json!({"num_attention_heads": 1u64 << 32, "head_dim": 16}),
            "expected [68719476736, 64] from config.json",
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (i, (edits, needle)) in cases.iter().enumerate() {
        let dir = tmp.path().join(format!("m{i}"));
        with_config(&dir, edits);
        let m = dir.to_str().unwrap();
        let out = tmp.path().join("out");
        let o = out.to_str().unwrap();
        let runs: [&[&str]; 5] = [
            &["score", m, "--n", "2"],
            &["heads", m, m, "--n", "2"],
            &["repair-heads", "--ref", m, m, "--heads", "1.1", "-o", o],
            &["inject-qknorm", m, "-o", o],
            &["predict", "--model", m],
        ];
        for args in runs {
            let line = sinkmerge(args).refused(&[]);
            assert!(line.contains(needle), "{args:?} with {edits}: {line}");
        }
        assert!(!out.exists());
    }
}

#[test]
fn a_header_whose_shape_overflows_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    with_config(&dir, &json!({}));
    let file = dir.join("model.safetensors");
    std::fs::remove_file(&file).unwrap();
    let header =
        json!({"a": {"dtype": "F32", "shape": [1u64 << 40, 1u64 << 40], "data_offsets": [0, 8]}});
    let mut header = header.to_string().into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend([0u8; 8]);
    std::fs::write(&file, bytes).unwrap();
    let m = dir.to_str().unwrap();
    let o = tmp.path().join("out");
    let o = o.to_str().unwrap();
    let runs: [&[&str]; 5] = [
        &["inspect", m, "--check"],
        &["score", m],
        &["norms", m, m],
        &["extract", m, "-o", o],
        &["ablate", m, "--norms", "input_layernorm", "-o", o],
    ];
    for args in runs {
        sinkmerge(args).refused(&["tensor `a`", "overflows"]);
    }
}

#[test]
fn a_scalar_embedding_is_refused_not_indexed() {
    let tmp = tempfile::tempdir().unwrap();
    let qwen2 = fixture("qwen2");
    let mut tensors = crate::util::load(&qwen2);
    tensors.insert(
        "model.embed_tokens.weight".into(),
        crate::util::Stored::from_f32(safetensors::Dtype::F32, vec![], &[1.0]),
    );
    let dir = tmp.path().join("m");
    crate::util::write_model(&dir, &crate::util::config(&qwen2), &tensors, Some(&qwen2));
    let (m, q) = (dir.to_str().unwrap(), qwen2.to_str().unwrap());
    let o = tmp.path().join("out");
    let o = o.to_str().unwrap();
    let runs: [&[&str]; 4] = [
        &["linear", "--models", m, &format!("{m}/."), "-o", o],
        &["task-arithmetic", "--base", m, "--models", q, "-o", o],
        &["score", m],
        &["repair-heads", "--ref", m, q, "--heads", "1.1", "-o", o],
    ];
    for args in runs {
        sinkmerge(args).refused(&["model.embed_tokens.weight"]);
    }
}
