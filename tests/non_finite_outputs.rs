//! No command writes NaN or Inf: every writer (extract, the merges, and the rewrites: repair-heads,
//! ablate, perturb, inject-qknorm) checks every tensor it writes, copied or computed, and stops
//! with exit 3 and no output, naming the input it came from (src/checkpoint/writer.rs).

use std::collections::BTreeMap;
use std::path::Path;

use crate::util::{config, fixture, leftovers, load, sinkmerge, write_model, Stored};

const Q_PROJ: &str = "model.layers.1.self_attn.q_proj.weight";
const DOWN_PROJ: &str = "model.layers.0.mlp.down_proj.weight";
/// qwen2's hidden size: a row of q_proj. Head 1 of 4 (dim 16) owns rows 16..32.
const HIDDEN: usize = 64;

/// Fixture `from` with `edit` applied to `name`'s values (same dtype), written to `dir`.
fn edited(from: &str, dir: &Path, name: &str, edit: impl Fn(&mut [f32])) {
    let source = fixture(from);
    let mut tensors: BTreeMap<String, Stored> = load(&source);
    let t = &tensors[name];
    let mut values = t.f32();
    edit(&mut values);
    let stored = Stored::from_f32(t.dtype, t.shape.clone(), &values);
    tensors.insert(name.into(), stored);
    write_model(dir, &config(&source), &tensors, Some(&source));
}

/// `args` (with `-o OUT` added) exits 3 naming `needles`, and leaves neither OUT nor a partial
/// directory.
fn refuses_to_write(tmp: &Path, args: &[&str], needles: &[&str]) {
    let out = tmp.join("out");
    let mut all = args.to_vec();
    all.extend(["-o", out.to_str().unwrap()]);
    sinkmerge(&all).non_finite(needles);
    assert!(!out.exists(), "{args:?} left {}", out.display());
    assert_eq!(leftovers(tmp), Vec::<String>::new());
}

#[test]
fn repair_heads_never_writes_nan() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let qwen2 = fixture("qwen2");
    let qwen2 = qwen2.to_str().unwrap();
    let in_head_1 = |v: &mut [f32]| v[20 * HIDDEN + 3] = f32::NAN;
    edited("qwen2", &tmp.path().join("ref-nan"), Q_PROJ, in_head_1);
    edited("qwen2", &tmp.path().join("target-nan"), Q_PROJ, in_head_1);
    edited("qwen2", &tmp.path().join("untouched-nan"), DOWN_PROJ, |v| {
        v[5] = f32::INFINITY
    });
    let repair = |reference: &str, target: &str, lambda: &str| -> Vec<String> {
        [
            "repair-heads",
            "--ref",
            reference,
            target,
            "--heads",
            "1.1",
            "--lambda",
            lambda,
        ]
        .map(String::from)
        .to_vec()
    };
    let cases = [
        // The reference's repaired rows, blended in or copied whole.
        (repair(&p("ref-nan"), qwen2, "0.5"), "ref-nan", Q_PROJ),
        (repair(&p("ref-nan"), qwen2, "1"), "ref-nan", Q_PROJ),
        // The target's repaired rows.
        (repair(qwen2, &p("target-nan"), "0.5"), "target-nan", Q_PROJ),
        // A tensor no head touches, copied from the target.
        (
            repair(qwen2, &p("untouched-nan"), "0.5"),
            "untouched-nan",
            DOWN_PROJ,
        ),
    ];
    for (args, input, tensor) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refuses_to_write(tmp.path(), &args, &[input, tensor]);
    }
    // At lambda 1 the target's NaN in the repaired rows is replaced by the reference's values.
    let out = tmp.path().join("replaced");
    let mut args = repair(qwen2, &p("target-nan"), "1");
    args.extend(["-o".into(), out.to_str().unwrap().into()]);
    sinkmerge(&args).ok();
    assert!(load(&out)[Q_PROJ].f32().iter().all(|v| v.is_finite()));
}

#[test]
fn every_other_writer_refuses_to_write_nan() {
    let tmp = tempfile::tempdir().unwrap();
    let qwen2 = fixture("qwen2");
    let qwen2 = qwen2.to_str().unwrap();
    let nan = tmp.path().join("nan");
    edited("qwen2", &nan, DOWN_PROJ, |v| v[5] = f32::NAN);
    let nan = nan.to_str().unwrap();
    let vlm = tmp.path().join("vlm");
    edited("qwen2_5_vl", &vlm, DOWN_PROJ, |v| v[5] = -f32::INFINITY);
    // A target whose k_proj drifted, so that perturb has noise to add.
    let drifted = tmp.path().join("drifted");
    edited(
        "qwen2",
        &drifted,
        "model.layers.0.self_attn.k_proj.weight",
        |v| v.iter_mut().for_each(|x| *x *= 1.5),
    );
    let drifted = drifted.to_str().unwrap();

    let cases: [&[&str]; 5] = [
        &["extract", vlm.to_str().unwrap()],
        &["ablate", nan, "--norms", "input_layernorm"],
        &["perturb", nan, "--match", drifted],
        &["inject-qknorm", nan],
        &["linear", "--models", qwen2, nan],
    ];
    for args in cases {
        refuses_to_write(tmp.path(), args, &[DOWN_PROJ]);
    }
}
