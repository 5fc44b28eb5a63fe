//! `sinkmerge norms` through the binary: every number against float64 torch goldens
//! (tools/gen_norms_goldens.py), the `--vs` ratio on a pair built with a known answer, thread
//! independence, the CSV and SVG outputs, and one clear error (exit 2, nothing written) per kind
//! of bad input.

use std::path::Path;
use std::process::Output;

use serde_json::Value;

use crate::util::{fixtures, non_finite, ok, read_json, refused, sinkmerge, stderr};

fn fixture(rel: &str) -> String {
    fixtures().join(rel).to_string_lossy().into_owned()
}

/// `sinkmerge norms ARGS`.
fn run(args: &[&str]) -> Output {
    sinkmerge(["norms"]).args(args).output()
}

fn json_of(out: &Output) -> Value {
    serde_json::from_str(&ok(out)).expect("--json prints JSON")
}

/// Relative tolerance per reported key: op 1e-5 and fro 1e-6 (the acceptance figures), and what
/// follows from them for the derived quantities.
fn tolerance(key: &str) -> Option<f64> {
    Some(match key {
        "op" | "ref_op" => 1e-5,
        "fro" | "ref_fro" | "l2" | "linf" | "ref_linf" => 1e-6,
        "rel_op" => 2e-5,
        "rel_fro" | "rel_l2" => 2e-6,
        "stable_rank" => 3e-5,
        _ => return None,
    })
}

fn close(got: &Value, want: &Value, tol: f64, what: &str) {
    match (got.as_f64(), want.as_f64()) {
        (None, None) => assert!(got.is_null() && want.is_null(), "{what}: {got} vs {want}"),
        (Some(g), Some(0.0)) => assert_eq!(g, 0.0, "{what}: exact zero expected"),
        (Some(g), Some(w)) => {
            let rel = (g - w).abs() / w.abs();
            assert!(
                rel <= tol,
                "{what}: {g} vs {w} (relative error {rel:e} > {tol:e})"
            );
        }
        _ => panic!("{what}: {got} vs {want}"),
    }
}

fn goldens() -> Vec<Value> {
    let v: Value = read_json(fixtures().join("norms/goldens.json"));
    v["cases"].as_array().unwrap().clone()
}

#[test]
fn every_number_matches_the_float64_torch_goldens() {
    let (mut matrices, mut worst_op, mut worst_fro) = (0, 0f64, 0f64);
    for case in goldens() {
        let name = case["name"].as_str().unwrap();
        let mut args = vec![
            fixture(case["reference"].as_str().unwrap()),
            fixture(case["target"].as_str().unwrap()),
            "--json".to_string(),
        ];
        args.extend(
            case["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string()),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let report = json_of(&run(&args));
        let rows = report["rows"].as_array().unwrap();
        let want_rows = case["rows"].as_array().unwrap();
        assert_eq!(rows.len(), want_rows.len(), "{name}: row count");
        for want in want_rows {
            let tensor = want["tensor"].as_str().unwrap();
            let got = rows
                .iter()
                .find(|r| r["tensor"] == want["tensor"])
                .unwrap_or_else(|| panic!("{name}: no row for {tensor}"));
            for key in ["layer", "module", "shape"] {
                assert_eq!(got[key], want[key], "{name}: {tensor} `{key}`");
            }
            assert_eq!(
                got.get("expert").unwrap_or(&Value::Null),
                &want["expert"],
                "{name}: {tensor} expert"
            );
            for (key, value) in want.as_object().unwrap() {
                if let Some(tol) = tolerance(key) {
                    close(&got[key], value, tol, &format!("{name}: {tensor} `{key}`"));
                }
            }
            if let (Some(g), Some(w)) = (got["op"].as_f64(), want["op"].as_f64()) {
                if w > 0.0 {
                    matrices += 1;
                    worst_op = worst_op.max((g - w).abs() / w);
                    let wf = want["fro"].as_f64().unwrap();
                    worst_fro = worst_fro.max((got["fro"].as_f64().unwrap() - wf).abs() / wf);
                }
            }
        }
        for (module, want) in case["summary"].as_object().unwrap() {
            for scope in ["all", "window"] {
                for (metric, stat) in want[scope].as_object().unwrap() {
                    let got = &report["summary"][module][scope][metric];
                    let tol = 3.0 * tolerance(metric).unwrap();
                    for s in ["median", "max"] {
                        close(
                            &got[s],
                            &stat[s],
                            tol,
                            &format!("{name}: summary {module} {scope} {metric} {s}"),
                        );
                    }
                }
            }
        }
    }
    assert!(matrices >= 100, "only {matrices} matrices checked");
    println!("{matrices} matrices: worst op relative error {worst_op:e}, worst fro {worst_fro:e}");
}

#[test]
fn vs_ratio_is_exactly_four_for_a_quarter_of_the_displacement() {
    let (r, t, q) = (
        fixture("norms/spectra-ref"),
        fixture("norms/spectra-target"),
        fixture("norms/spectra-target-quarter"),
    );
    let report = json_of(&run(&[&r, &t, "--vs", &r, &q, "--json", "--window", "3"]));
    let ratio = &report["vs"]["ratio"];
    for module in ["q_proj", "k_proj", "gate_proj", "down_proj"] {
        for metric in ["op", "fro"] {
            let series = &ratio[module][metric];
            assert_eq!(series["median_window"], 4.0, "{module} {metric}: {series}");
            assert_eq!(series["median"], 4.0, "{module} {metric}");
            let layers = series["layers"].as_array().unwrap();
            assert_eq!(layers.len(), 4, "{module} {metric}");
            for (layer, value) in layers.iter().zip(series["values"].as_array().unwrap()) {
                if module == "k_proj" && layer == 1 {
                    // dW = 0 in both pairs there: no ratio.
                    assert!(value.is_null(), "{module} layer 1: {value}");
                } else {
                    assert_eq!(value, 4.0, "{module} {metric} layer {layer}");
                }
            }
        }
        // Relative norms share REF, so they scale alike; the stable rank does not move.
        assert_eq!(ratio[module]["rel_op"]["median_window"], 4.0, "{module}");
        assert_eq!(
            ratio[module]["stable_rank"]["median_window"], 1.0,
            "{module}"
        );
    }
    for module in ["input_layernorm", "q_proj.bias"] {
        assert_eq!(ratio[module]["l2"]["median_window"], 4.0, "{module}");
    }
    assert_eq!(report["window"]["layers"], serde_json::json!([1, 2, 3]));
    assert_eq!(report["vs"]["target"], q.as_str());
    // The plain output prints the same medians in the ratio table.
    let plain = run(&[&r, &t, "--vs", &r, &q, "--window", "3"]);
    let text = String::from_utf8(plain.stdout).unwrap();
    let line = text
        .lines()
        .skip_while(|l| !l.starts_with("ratio pair1/pair2"))
        .find(|l| l.starts_with("q_proj"))
        .expect("ratio table row for q_proj");
    assert!(line.split_whitespace().nth(2) == Some("4.000"), "{line}");
    // k_proj has a ratio in 3 of its 4 layers (none where dW = 0).
    let k_line = text
        .lines()
        .skip_while(|l| !l.starts_with("ratio pair1/pair2"))
        .find(|l| l.starts_with("k_proj"))
        .expect("ratio table row for k_proj");
    assert_eq!(k_line.split_whitespace().last(), Some("3"), "{k_line}");
}

#[test]
fn same_bytes_at_any_thread_count() {
    let args = [
        &fixture("norms/spectra-ref")[..],
        &fixture("norms/spectra-target"),
        "--json",
    ];
    let one = sinkmerge(["norms"]).args(args).threads("1").output();
    let two = sinkmerge(["norms"]).args(args).threads("2").output();
    let three = sinkmerge(["norms"]).args(args).threads("3").output();
    assert!(one.status.success());
    assert_eq!(one.stdout, two.stdout);
    assert_eq!(one.stdout, three.stdout);
}

#[test]
fn csv_and_plot_are_written_with_every_row() {
    let tmp = tempfile::tempdir().unwrap();
    let (csv, svg) = (tmp.path().join("rows.csv"), tmp.path().join("ratio.svg"));
    let (r, t, q) = (
        fixture("norms/spectra-ref"),
        fixture("norms/spectra-target"),
        fixture("norms/spectra-target-quarter"),
    );
    let out = run(&[
        &r,
        &t,
        "--vs",
        &r,
        &q,
        "--csv",
        csv.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(
        &header[..7],
        &["pair", "tensor", "layer", "module", "expert", "experts", "shape"]
    );
    assert!(header.contains(&"stable_rank") && header.contains(&"ref_linf"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 2 * 27);
    assert!(rows.iter().all(|r| r.len() == header.len()));
    let op = header.iter().position(|h| *h == "op").unwrap();
    let q0: Vec<&Vec<&str>> = rows
        .iter()
        .filter(|r| r[1] == "model.layers.0.self_attn.q_proj.weight")
        .collect();
    let (a, b): (f64, f64) = (q0[0][op].parse().unwrap(), q0[1][op].parse().unwrap());
    assert_eq!((q0[0][0], q0[1][0], a / b), ("1", "2", 4.0));
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("q_proj") && svg.contains("ratio"));

    // Without --vs the plot shows the metric itself; vector metrics plot the vectors.
    let svg2 = tmp.path().join("l2.svg");
    let out = run(&[
        &r,
        &t,
        "--plot",
        svg2.to_str().unwrap(),
        "--plot-metric",
        "rel-l2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let svg2 = std::fs::read_to_string(&svg2).unwrap();
    assert!(svg2.contains("input_layernorm") && !svg2.contains("gate_proj"));
    // The title names the pairs by their last path component, never by the absolute paths given.
    assert!(svg.contains("spectra-target - spectra-ref") && svg.contains("spectra-target-quarter"));
    assert!(svg2.contains("rel_l2 of spectra-target - spectra-ref"));
    for text in [&svg, &svg2] {
        assert!(!text.contains(&r) && !text.contains(&t) && !text.contains(&q));
    }
}

#[test]
fn selections_and_warnings() {
    let (r, t) = (
        fixture("norms/spectra-ref"),
        fixture("norms/spectra-target"),
    );
    let last = json_of(&run(&[
        &r,
        &t,
        "--json",
        "--last",
        "2",
        "--modules",
        "q_proj,k_proj",
    ]));
    let rows = last["rows"].as_array().unwrap();
    // q_proj weight + bias and k_proj of layers 2 and 3; no top-level tensors.
    assert_eq!(rows.len(), 6);
    assert!(rows.iter().all(|r| r["layer"] == 2 || r["layer"] == 3));
    let range = json_of(&run(&[&r, &t, "--json", "--layers", "1:2"]));
    assert!(range["rows"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["layer"] == 1));

    let vocab = run(&[
        &r,
        &fixture("norms/vocab-target"),
        "--modules",
        "embed_tokens,lm_head",
    ]);
    assert!(vocab.status.success(), "{}", stderr(&vocab));
    assert!(stderr(&vocab).contains(
        "vocabularies differ for `model.embed_tokens.weight` (80 rows in REF, 88 in TARGET)"
    ));
    let tied = run(&[
        &fixture("models/qwen2-sharded"),
        &fixture("models/llava_onevision"),
        "--json",
    ]);
    let report = json_of(&tied);
    assert!(report["warnings"][0]
        .as_str()
        .unwrap()
        .contains("stands in for `lm_head.weight`"));
    assert_eq!(report["ignored"]["target"], 26);
    assert!(stderr(&tied).contains("warning: TARGET"));

    let text =
        String::from_utf8(run(&[&fixture("norms/moe-ref"), &fixture("norms/moe-target")]).stdout)
            .unwrap();
    assert!(text.contains("expert_up_proj") && text.contains("one row per expert"));
}

/// `--layers` takes the syntax of every command: the slice `A:B` (half-open, ends optional) and
/// the list `0-3,7` (inclusive ranges) select the same layers for the same intent.
#[test]
fn layers_take_slices_and_lists_alike() {
    let (r, t) = (
        fixture("norms/spectra-ref"),
        fixture("norms/spectra-target"),
    );
    let layers_of = |spec: &str| -> Vec<Value> {
        let report = json_of(&run(&[&r, &t, "--json", "--layers", spec]));
        let mut layers: Vec<Value> = (report["rows"].as_array().unwrap().iter())
            .map(|row| row["layer"].clone())
            .collect();
        layers.dedup();
        layers
    };
    let (one, two, three) = (Value::from(1), Value::from(2), Value::from(3));
    for (spec, want) in [
        ("1:3", vec![one.clone(), two.clone()]),
        ("1-2", vec![one.clone(), two.clone()]),
        ("2:", vec![two.clone(), three.clone()]),
        ("2-3", vec![two.clone(), three.clone()]),
        (":2", vec![Value::from(0), one.clone()]),
        ("1,3", vec![one.clone(), three.clone()]),
    ] {
        assert_eq!(layers_of(spec), want, "--layers {spec}");
    }
    for (spec, needle) in [
        ("1-5", "outside the model's layers 0-3"),
        ("2:2", "is empty"),
    ] {
        let out = run(&[&r, &t, "--layers", spec]);
        assert_eq!(out.status.code(), Some(2), "{spec}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{spec}: {}", stderr(&out));
    }
}

#[test]
fn bad_inputs_give_one_clear_error_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("out.csv");
    let svg = tmp.path().join("out.svg");
    let csv_s = csv.to_str().unwrap();
    let svg_s = svg.to_str().unwrap();
    let r = fixture("norms/spectra-ref");
    let outputs = ["--csv", csv_s, "--plot", svg_s];

    let bad_shape = fixture("norms/bad-shape");
    let k = ["--modules", "k_proj", "--layers", "0:1"];
    let out = run(&[&[&r[..], &bad_shape][..], &k, &outputs].concat());
    refused(
        &out,
        &[
            "shape mismatch",
            "model.layers.0.self_attn.k_proj.weight",
            "[24, 48]",
            "[20, 48]",
            "spectra-ref/model.safetensors",
            "bad-shape/model.safetensors",
        ],
    );

    let missing = fixture("norms/missing");
    let out = run(&[
        &[&r[..], &missing],
        &["--modules", "q_proj,k_proj", "--layers", "0:1"][..],
        &outputs,
    ]
    .concat());
    refused(
        &out,
        &[
            "model.layers.0.self_attn.k_proj.weight",
            "is in REF",
            "spectra-ref/model.safetensors",
            "not in TARGET",
        ],
    );

    let nonfinite = fixture("norms/nonfinite");
    let out = run(&[
        &[&r[..], &nonfinite],
        &["--modules", "q_proj", "--layers", "0:1"][..],
        &outputs,
    ]
    .concat());
    // NaN or Inf in an input is exit 3 in every command (tests/exit_codes.rs).
    non_finite(
        &out,
        &[
            "nonfinite/model.safetensors",
            "model.layers.0.self_attn.q_proj.weight",
            "NaN or Inf",
        ],
    );

    let (moe, fused) = (fixture("norms/moe-ref"), fixture("norms/moe-fused-target"));
    let out = run(&[&[&moe[..], &fused, "--layers", "0:1"][..], &outputs].concat());
    refused(
        &out,
        &[
            "model.layers.0.mlp.experts.0.down_proj.weight",
            "fused expert tensors",
            "sinkmerge extract",
        ],
    );

    let out = run(&[
        &[&fixture("models/qwen2")[..], &fixture("models/qwen3")],
        &outputs[..],
    ]
    .concat());
    refused(
        &out,
        &["different architectures", "model_type", "qwen2", "qwen3"],
    );

    let t = fixture("norms/spectra-target");
    for (extra, needle) in [
        (&["--layers", "2:9"][..], "--layers 2:9"),
        (&["--modules", "qq_proj"][..], "unknown module `qq_proj`"),
        (&["--tol", "1e-9"][..], "outside 1e-7"),
        (
            &["--layers", "1:2", "--last", "2"][..],
            "cannot be used with",
        ),
        (&["--vs", &r][..], "--vs"),
        (
            &["--plot-metric", "l2", "--modules", "k_proj"][..],
            "--plot",
        ),
    ] {
        let out = run(&[&[&r[..], &t], extra, &outputs].concat());
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{extra:?}: {}", stderr(&out));
    }
    // A report file inside an input model is refused before any work.
    let inside = format!("{}/drift.csv", fixture("norms/spectra-target"));
    let out = run(&[&r, &t, "--csv", &inside]);
    refused(&out, &["lies inside input"]);
    assert!(!Path::new(&inside).exists());

    assert!(!csv.exists() && !svg.exists());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "no temp files left"
    );
}
