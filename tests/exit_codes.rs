//! Each kind of failure has one exit code in every command (src/error.rs): NaN or Inf, stored in
//! an input or produced by the arithmetic, is 3 whichever command meets it; bad input is 2.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;

use crate::util::{config, fixture, leftovers, load, sinkmerge, write_model, Stored};

const K_PROJ: &str = "model.layers.1.self_attn.k_proj.weight";

fn non_finite(args: &[&str], needles: &[&str]) {
    sinkmerge(args).non_finite(needles);
}

/// The qwen2 fixture with `edit` applied to `name`'s f32 values, written to `dir`.
fn edited_qwen2(dir: &Path, name: &str, edit: impl Fn(&mut [f32])) {
    let source = fixture("qwen2");
    let mut tensors: BTreeMap<String, Stored> = load(&source);
    let t = &tensors[name];
    let mut values = t.f32();
    edit(&mut values);
    let stored = Stored::from_f32(Dtype::F32, t.shape.clone(), &values);
    tensors.insert(name.into(), stored);
    write_model(dir, &config(&source), &tensors, Some(&source));
}

#[test]
fn nan_in_an_input_is_exit_3_for_every_command_that_meets_it() {
    let tmp = tempfile::tempdir().unwrap();
    let nan = tmp.path().join("nan");
    edited_qwen2(&nan, K_PROJ, |v| v[7] = f32::NAN);
    let (qwen2, nan) = (fixture("qwen2"), nan.to_str().unwrap().to_string());
    let qwen2 = qwen2.to_str().unwrap();
    let out = tmp.path().join("out");
    let o = out.to_str().unwrap();

    non_finite(&["score", &nan, "--n", "2"], &[K_PROJ, "NaN/Inf"]);
    non_finite(
        &["norms", qwen2, &nan, "--modules", "k_proj"],
        &[K_PROJ, "NaN or Inf"],
    );
    non_finite(
        &["linear", "--models", qwen2, &nan, "-o", o],
        &[K_PROJ, "NaN"],
    );
    non_finite(
        &["star", "--base", qwen2, "--models", &nan, qwen2, "-o", o],
        &[K_PROJ, "NaN"],
    );
    let inspect = sinkmerge(["inspect", &nan, "--check"]).output();
    assert_eq!(inspect.status.code(), Some(3));
    assert!(!out.exists());
    assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
}

#[test]
fn arithmetic_overflowing_f32_on_finite_inputs_is_exit_3() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let qwen2 = fixture("qwen2");
    let copy = tmp.path().join("copy");
    edited_qwen2(&copy, K_PROJ, |_| {});
    // The norms' weights are near 1: 3e38 + 3e38 is past f32's largest, 3.4e38.
    non_finite(
        &[
            "linear",
            "--models",
            qwen2.to_str().unwrap(),
            copy.to_str().unwrap(),
            "--weights",
            "3e38,3e38",
            "--no-normalize",
            "-o",
            out.to_str().unwrap(),
        ],
        &["overflows", "all inputs are finite"],
    );
    assert!(!out.exists());

    // Every entry of one layer's input norm at 1e30: finite weights whose activations overflow.
    let huge = tmp.path().join("huge");
    edited_qwen2(&huge, "model.layers.0.input_layernorm.weight", |v| {
        v.fill(1e30)
    });
    non_finite(
        &["score", huge.to_str().unwrap(), "--n", "2"],
        &["layer 0", "activations overflowed f32"],
    );
}
