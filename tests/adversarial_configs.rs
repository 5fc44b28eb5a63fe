//! Config contradictions through the command line: a key the forward pass reads that is of the
//! wrong type, outside what the math allows, or contradicting the weights, the tower or the
//! processor is bad input (exit 2, one line naming the key and the file), never a silent default,
//! an "activations overflowed" (exit 3) or a run with no observations. Also the other side of the
//! same rules: every activation transformers' `ACT2FN` defines runs with its formula, and a
//! composite model saved with its head tied at the top level ties it in every command.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde_json::{json, Value};

use crate::util::{config, fixture, load, root, sinkmerge, write_model, Stored};

/// An edit of a JSON file.
type Edit<'a> = dyn Fn(&mut Value) + 'a;

/// A copy of the model directory `source` in `dir`: every file linked but those `edits` names,
/// which are JSON files read from `source`, edited and written.
fn variant(source: &Path, dir: &Path, edits: &[(&str, &Edit<'_>)]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(source).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        match edits.iter().find(|(file, _)| *file == name) {
            Some((_, edit)) => {
                let mut value: Value = crate::util::read_json(&path);
                edit(&mut value);
                std::fs::write(dir.join(&name), value.to_string()).unwrap();
            }
            None => std::os::unix::fs::symlink(&path, dir.join(&name)).unwrap(),
        }
    }
    dir.to_path_buf()
}

/// The qwen2 fixture with config.json edited by `edit`.
fn qwen2_with(dir: &Path, edit: &dyn Fn(&mut Value)) -> String {
    variant(&fixture("qwen2"), dir, &[("config.json", edit)])
        .to_str()
        .unwrap()
        .to_string()
}

/// The commands that run the decoder on `model`, writing (if at all) under `tmp`.
fn decoder_runs(model: &str, tmp: &Path) -> Vec<Vec<String>> {
    let out = tmp.join("out.safetensors").to_str().unwrap().to_string();
    [
        vec!["score", model, "--n", "2"],
        vec!["heads", model, model, "--n", "2"],
        vec!["trace", model, "--prompt", "The capital", "-o", &out],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(String::from).collect())
    .collect()
}

/// Every decoder command refuses `model` with one line naming each of `needles` and its
/// config.json, and writes nothing.
fn refused_by_decoder_commands(model: &str, needles: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let config = format!("{model}/config.json");
    for args in decoder_runs(model, tmp.path()) {
        let line = sinkmerge(&args).refused(needles);
        assert!(line.contains(&config), "{args:?}: {line}");
    }
    assert!(!tmp.path().join("out.safetensors").exists());
}

#[test]
fn hidden_act_outside_act2fn_is_refused_naming_the_key_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    // Unknown names, ACT2FN's two activations with learned parameters (which the checkpoint of
    // a supported architecture does not hold), and a value that is not a name.
    for (i, act) in [json!("bogus"), json!("prelu"), json!("xielu"), json!(3)]
        .iter()
        .enumerate()
    {
        let m = qwen2_with(&tmp.path().join(format!("m{i}")), &|c| {
            c["hidden_act"] = act.clone()
        });
        refused_by_decoder_commands(&m, &["hidden_act"]);
    }
}

/// Pre-activations of a few units: the qwen2 fixture's layer-0 gate projection scaled up so that
/// they spread over the range where the activations differ, and its o_proj zeroed so that layer
/// 0's output is exactly its input plus its MLP.
fn mlp_probe(dir: &Path, act: Option<&str>) -> PathBuf {
    let source = fixture("qwen2");
    let mut tensors = load(&source);
    for (name, scale) in [
        ("model.layers.0.mlp.gate_proj.weight", 40.0),
        ("model.layers.0.self_attn.o_proj.weight", 0.0),
    ] {
        let t = &tensors[name];
        let values: Vec<f32> = t.f32().iter().map(|v| v * scale).collect();
        let scaled = Stored::from_f32(t.dtype, t.shape.clone(), &values);
        tensors.insert(name.to_string(), scaled);
    }
    let mut config = config(&source);
    match act {
        Some(a) => config["hidden_act"] = json!(a),
        None => {
            config.as_object_mut().unwrap().remove("hidden_act");
        }
    }
    write_model(dir, &config, &tensors, Some(&source));
    dir.to_path_buf()
}

/// `hidden_states.1 - hidden_states.0` of `trace` on `model`: layer 0's MLP output, `[seq, 64]`,
/// and the MLP's input (`hidden_states.0`).
fn traced_mlp(model: &Path, out: &Path) -> (Vec<f32>, Vec<f32>, Vec<u8>) {
    sinkmerge([
        "trace",
        model.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
    ])
    .args(["--layers", "0", "--capture", "hidden_states,logits", "-o"])
    .args([out])
    .ok();
    let t = load_file(out);
    let input = t["hidden_states.0"].f32();
    let output = t["hidden_states.1"].f32();
    let mlp = output.iter().zip(&input).map(|(o, i)| o - i).collect();
    (input, mlp, t["logits"].bytes.clone())
}

fn load_file(path: &Path) -> BTreeMap<String, Stored> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(path, dir.path().join("t.safetensors")).unwrap();
    load(dir.path())
}

/// `laplace`'s `mu` in transformers, which is not 1/√2.
#[allow(clippy::approx_constant)]
const LAPLACE_MU: f64 = 0.707107;

/// transformers' formulas (`activations.py`, torch's functional definitions), in f64.
fn reference_activation(name: &str, x: f64) -> f64 {
    let erf = libm::erf;
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    let tanh_gelu = |v: f64| {
        0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
    };
    let gelu = |v: f64| v * 0.5 * (1.0 + erf(v / std::f64::consts::SQRT_2));
    match name {
        "silu" | "swish" => x * sigmoid(x),
        "gelu" | "gelu_python" => gelu(x),
        "gelu_10" => gelu(x).clamp(-10.0, 10.0),
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_accurate" => tanh_gelu(x),
        "gelu_fast" => 0.5 * x * (1.0 + (x * 0.7978845608 * (1.0 + 0.044715 * x * x)).tanh()),
        "quick_gelu" => x * sigmoid(1.702 * x),
        "relu" => x.max(0.0),
        "relu2" => x.max(0.0).powi(2),
        "relu6" => x.clamp(0.0, 6.0),
        "leaky_relu" => {
            if x < 0.0 {
                0.01 * x
            } else {
                x
            }
        }
        "linear" => x,
        "sigmoid" => sigmoid(x),
        "tanh" => x.tanh(),
        "mish" => x * x.exp().ln_1p().tanh(),
        "laplace" => 0.5 * (1.0 + erf((x - LAPLACE_MU) / (0.282095 * std::f64::consts::SQRT_2))),
        other => panic!("no reference for {other}"),
    }
}

/// The MLP of layer 0 of the probe on `input` (`[seq, 64]`) with `act`, in f64:
/// `down(act(gate(n)) * up(n))`, `n` the post-attention RMSNorm of the input.
fn reference_mlp(tensors: &BTreeMap<String, Stored>, input: &[f32], act: &str) -> Vec<f64> {
    let w = |n: &str| -> Vec<f64> {
        tensors[&format!("model.layers.0.{n}")]
            .f32()
            .iter()
            .map(|&v| v as f64)
            .collect()
    };
    let (norm, gate, up, down) = (
        w("post_attention_layernorm.weight"),
        w("mlp.gate_proj.weight"),
        w("mlp.up_proj.weight"),
        w("mlp.down_proj.weight"),
    );
    let (hidden, inter) = (64, 128);
    let mut out = Vec::new();
    for row in input.chunks(hidden) {
        let mean = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hidden as f64;
        let n: Vec<f64> = (row.iter().zip(&norm))
            .map(|(&v, g)| v as f64 / (mean + 1e-6).sqrt() * g)
            .collect();
        let dot = |m: &[f64], i: usize, x: &[f64]| -> f64 {
            m[i * x.len()..(i + 1) * x.len()]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        };
        let a: Vec<f64> = (0..inter)
            .map(|i| reference_activation(act, dot(&gate, i, &n)) * dot(&up, i, &n))
            .collect();
        out.extend((0..hidden).map(|j| dot(&down, j, &a)));
    }
    out
}

#[test]
fn every_act2fn_activation_runs_as_transformers_defines_it() {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = load(&mlp_probe(&tmp.path().join("silu"), Some("silu")));
    let run = |name: &str, act: Option<&str>| {
        let model = mlp_probe(&tmp.path().join(name), act);
        traced_mlp(&model, &tmp.path().join(format!("{name}.safetensors")))
    };
    let (input, silu, silu_logits) = run("silu", Some("silu"));
    // SiLU, by either name or by default, is the same computation to the byte.
    for (name, act) in [("swish", Some("swish")), ("default", None)] {
        let (_, mlp, logits) = run(name, act);
        assert_eq!(mlp, silu, "{name}");
        assert_eq!(logits, silu_logits, "{name}");
    }
    let names = [
        "silu",
        "gelu",
        "gelu_python",
        "gelu_10",
        "gelu_new",
        "gelu_pytorch_tanh",
        "gelu_accurate",
        "gelu_fast",
        "quick_gelu",
        "relu",
        "relu2",
        "relu6",
        "leaky_relu",
        "linear",
        "sigmoid",
        "tanh",
        "mish",
        "laplace",
    ];
    let references: BTreeMap<&str, Vec<f64>> = names
        .iter()
        .map(|&n| (n, reference_mlp(&tensors, &input, n)))
        .collect();
    let error = |got: &[f32], want: &[f64]| -> f64 {
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let worst = (got.iter().zip(want)).fold(0f64, |m, (&g, w)| m.max((g as f64 - w).abs()));
        worst / scale
    };
    for name in names {
        let (_, mlp, _) = if name == "silu" {
            (input.clone(), silu.clone(), Vec::new())
        } else {
            run(name, Some(name))
        };
        let own = error(&mlp, &references[name]);
        assert!(
            own < 2e-6,
            "{name}: relative error {own:e} against its formula"
        );
        // The probe tells the activations apart: not SiLU run under another name, and GELU's
        // erf form not its tanh approximation.
        if name != "silu" {
            let silu = error(&mlp, &references["silu"]);
            assert!(silu > 1e-3, "{name} is within {silu:e} of silu");
        }
    }
    let (_, gelu, _) = run("gelu_again", Some("gelu"));
    let tanh = error(&gelu, &references["gelu_pytorch_tanh"]);
    assert!(tanh > 1e-5, "gelu is within {tanh:e} of its tanh form");
}

#[test]
fn vocab_size_that_contradicts_the_embedding_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // The fixture's embedding has 320 rows.
    for (i, vocab) in [10, 321].into_iter().enumerate() {
        let m = qwen2_with(&tmp.path().join(format!("m{i}")), &|c| {
            c["vocab_size"] = json!(vocab)
        });
        refused_by_decoder_commands(&m, &["vocab_size", "model.embed_tokens.weight"]);
    }
}

#[test]
fn rope_parameters_outside_what_the_math_allows_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let rope = |extra: Value| {
        let mut r = json!({"rope_theta": 1_000_000.0, "rope_type": "default"});
        r.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        r
    };
    let cases = [
        (
            rope(
                json!({"rope_type": "yarn", "factor": -4.0, "original_max_position_embeddings": 4096}),
            ),
            "`factor`",
        ),
        (
            rope(json!({"rope_type": "linear", "factor": 0.0})),
            "`factor`",
        ),
        (
            rope(json!({"rope_type": "dynamic", "factor": -1.0})),
            "`factor`",
        ),
        (
            rope(
                json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": -1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
            ),
            "`low_freq_factor`",
        ),
        (
            rope(
                json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}),
            ),
            "`original_max_position_embeddings`",
        ),
        (rope(json!({"rope_theta": 0.0})), "`rope_theta`"),
        (rope(json!({"rope_theta": -10000.0})), "`rope_theta`"),
        (rope(json!({"rope_theta": "10000"})), "`rope_theta`"),
        (rope(json!({"rope_type": "ntk-by-parts"})), "ntk-by-parts"),
        (
            rope(json!({"partial_rotary_factor": 0.5})),
            "partial_rotary_factor",
        ),
    ];
    for (i, (parameters, needle)) in cases.into_iter().enumerate() {
        let m = qwen2_with(&tmp.path().join(format!("m{i}")), &|c| {
            c["rope_parameters"] = parameters.clone()
        });
        refused_by_decoder_commands(&m, &[needle]);
    }
    // The 4.x spelling is read by the same rules.
    let m = qwen2_with(&tmp.path().join("v4"), &|c| {
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = json!(0);
    });
    refused_by_decoder_commands(&m, &["`rope_theta`"]);
}

#[test]
fn tie_word_embeddings_that_is_not_a_bool_is_refused_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let m = qwen2_with(&tmp.path().join("m"), &|c| {
        c["tie_word_embeddings"] = json!("yes")
    });
    refused_by_decoder_commands(&m, &["tie_word_embeddings", "\"yes\""]);
    let out = tmp.path().join("x");
    // In a VLM's text section too.
    let vlm = variant(
        &root().join("tests/fixtures/vlm/internvl"),
        &tmp.path().join("vlm"),
        &[("config.json", &|c: &mut Value| {
            c["text_config"]["tie_word_embeddings"] = json!(1)
        })],
    );
    let vlm = vlm.to_str().unwrap();
    refused_by_decoder_commands(vlm, &["tie_word_embeddings"]);
    sinkmerge(["extract", vlm, "-o", out.to_str().unwrap()]).refused(&["tie_word_embeddings"]);
}

#[test]
fn keys_of_the_wrong_type_or_sign_are_refused_not_defaulted() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, Value, &str); 9] = [
        ("rms_norm_eps", json!("abc"), "`rms_norm_eps`"),
        ("rms_norm_eps", json!(-1e-6), "`rms_norm_eps`"),
        ("attention_bias", json!("yes"), "`attention_bias`"),
        ("num_attention_heads", json!(-4), "`num_attention_heads`"),
        ("num_attention_heads", json!(0), "num_attention_heads"),
        ("num_key_value_heads", json!(0), "num_key_value_heads"),
        ("num_key_value_heads", json!(3), "num_key_value_heads 3"),
        ("head_dim", json!(8), "q_proj.weight"),
        ("intermediate_size", json!(64), "gate_proj.weight"),
    ];
    for (i, (key, value, needle)) in cases.into_iter().enumerate() {
        let m = qwen2_with(&tmp.path().join(format!("m{i}")), &|c| {
            c[key] = value.clone()
        });
        let out = tmp.path().join("out.safetensors");
        for args in decoder_runs(&m, tmp.path()) {
            let line = sinkmerge(&args).refused(&[needle]);
            assert!(line.contains(&m), "{args:?}: {line}");
        }
        assert!(!out.exists());
    }
}

/// The qwen2_vl fixture with `edit` applied to its preprocessor_config.json (in `dir`), traced
/// on an image to `out`.
fn trace_qwen2_vl_image(
    dir: &Path,
    out: &Path,
    edit: &dyn Fn(&mut Value),
) -> crate::util::Sinkmerge {
    let m = variant(
        &root().join("tests/fixtures/vlm/qwen2_vl"),
        dir,
        &[("preprocessor_config.json", edit)],
    );
    sinkmerge([
        "trace",
        m.to_str().unwrap(),
        "--prompt",
        "<image>Describe it.",
    ])
    .args(["--image", "tests/fixtures/images/scene_100x75.png", "-o"])
    .args([out])
}

#[test]
fn a_processor_that_contradicts_the_tower_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for (key, value) in [
        ("merge_size", 3),
        ("patch_size", 7),
        ("temporal_patch_size", 1),
    ] {
        let out = tmp.path().join("out.safetensors");
        trace_qwen2_vl_image(&tmp.path().join(key), &out, &|p| p[key] = json!(value)).refused(&[
            key,
            "preprocessor_config.json",
            "vision_config",
        ]);
        assert!(!out.exists());
    }
}

#[test]
fn normalisation_that_divides_by_zero_is_refused_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("image_std", json!([0.0, 0.0, 0.0])),
        ("image_std", json!([0.2, -0.0, 0.2])),
    ];
    for (i, (key, value)) in cases.into_iter().enumerate() {
        let out = tmp.path().join("out.safetensors");
        trace_qwen2_vl_image(&tmp.path().join(format!("p{i}")), &out, &|p| {
            p[key] = value.clone()
        })
        .refused(&[key, "preprocessor_config.json"]);
        assert!(!out.exists());
    }
}

/// A copy of the Qwen2-VL golden's processor output, with `pixel_values` reshaped to `shape`
/// and its values edited by `edit`.
fn pixel_file(path: &Path, shape: Option<Vec<usize>>, edit: &dyn Fn(&mut Vec<f32>)) {
    let golden = load_file(&root().join("tests/fixtures/vlm/qwen2_vl/golden_scene.safetensors"));
    let pv = &golden["pixel_values"];
    let mut values = pv.f32();
    edit(&mut values);
    let pv = Stored::from_f32(Dtype::F32, shape.unwrap_or(pv.shape.clone()), &values);
    let grid = &golden["image_grid_thw"];
    let views = vec![
        (
            "pixel_values",
            safetensors::tensor::TensorView::new(pv.dtype, pv.shape.clone(), &pv.bytes).unwrap(),
        ),
        (
            "image_grid_thw",
            safetensors::tensor::TensorView::new(grid.dtype, grid.shape.clone(), &grid.bytes)
                .unwrap(),
        ),
    ];
    std::fs::write(path, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
}

fn trace_pixel_file(file: &Path, out: &Path) -> crate::util::Sinkmerge {
    sinkmerge([
        "trace",
        "tests/fixtures/vlm/qwen2_vl",
        "--prompt",
        "<image>Describe it.",
    ])
    .args(["--pixel-values"])
    .args([file])
    .args(["-o"])
    .args([out])
}

#[test]
fn pixel_values_of_the_wrong_rank_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let golden = load_file(&root().join("tests/fixtures/vlm/qwen2_vl/golden_scene.safetensors"));
    let [rows, width] = golden["pixel_values"].shape[..] else {
        panic!("a Qwen golden's pixel_values are [patches, C·T·P·P]")
    };
    let out = tmp.path().join("out.safetensors");
    for (i, shape) in [
        vec![rows * width],
        vec![rows, width / 2, 2],
        vec![rows / 2, width * 2],
        vec![1, rows, width],
    ]
    .into_iter()
    .enumerate()
    {
        let file = tmp.path().join(format!("pv{i}.safetensors"));
        pixel_file(&file, Some(shape.clone()), &|_| ());
        let line =
            trace_pixel_file(&file, &out).refused(&[file.to_str().unwrap(), "`pixel_values`"]);
        assert!(line.contains(&format!("{shape:?}")), "{line}");
        assert!(!out.exists());
    }
}

#[test]
fn nan_in_a_pixel_values_file_is_bad_input_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.safetensors");
    for (i, bad) in [f32::NAN, f32::INFINITY].into_iter().enumerate() {
        let file = tmp.path().join(format!("pv{i}.safetensors"));
        pixel_file(&file, None, &|v| v[7] = bad);
        trace_pixel_file(&file, &out).refused(&[file.to_str().unwrap(), "`pixel_values`"]);
        assert!(!out.exists());
    }
}

#[test]
fn an_empty_tokenizer_vocabulary_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let m = variant(
        &root().join("assets/models/tiny-qwen2/ref"),
        &tmp.path().join("m"),
        &[("tokenizer.json", &|t: &mut Value| {
            t["model"]["vocab"] = json!({});
            t["model"]["merges"] = json!([]);
        })],
    );
    let m = m.to_str().unwrap();
    for args in decoder_runs(m, tmp.path()) {
        sinkmerge(&args).refused(&[&format!("{m}/tokenizer.json"), "vocab"]);
    }
}

#[test]
fn merge_weights_and_scalars_that_are_not_finite_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let m = fixture("qwen2");
    let m = m.to_str().unwrap();
    let other = variant(&fixture("qwen2"), &tmp.path().join("other"), &[]);
    let n = other.to_str().unwrap();
    let out = tmp.path().join("out");
    let o = out.to_str().unwrap();
    for weights in ["nan,1", "1,inf", "-inf"] {
        sinkmerge(["linear", "--models", m, n, "--weights", weights, "-o", o])
            .refused_with_usage(&["--weights"]);
        sinkmerge(["task-arithmetic", "--base", m, "--models", n, m])
            .args(["--weights", weights, "-o", o])
            .refused_with_usage(&["--weights"]);
        assert!(!out.exists());
    }
    // And the methods' scalars.
    for (method, flag) in [("task-arithmetic", "--lambda"), ("tsv", "--alpha")] {
        sinkmerge([method, "--base", m, "--models", n, flag, "nan", "-o", o])
            .refused_with_usage(&[flag, "NaN is not a finite number"]);
        assert!(!out.exists());
    }
}

#[test]
fn repair_heads_at_lambda_zero_keeps_the_target_whatever_the_reference_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let target = fixture("qwen2");
    let mut tensors = load(&target);
    let name = "model.layers.1.self_attn.q_proj.weight";
    let mut q = tensors[name].f32();
    // Head 1 of layer 1: rows 16..32 of q_proj (head_dim 16).
    q[16 * 64 + 3] = f32::NAN;
    tensors.insert(name.into(), Stored::from_f32(Dtype::F32, vec![64, 64], &q));
    let reference = tmp.path().join("ref");
    write_model(&reference, &config(&target), &tensors, Some(&target));
    let out = tmp.path().join("out");
    let repair = |lambda: &str| {
        sinkmerge(["repair-heads", "--ref", reference.to_str().unwrap()])
            .args([&target])
            .args([
                "--heads",
                "1.1",
                "--modules",
                "q",
                "--lambda",
                lambda,
                "-q",
                "-o",
            ])
            .args([&out])
    };
    repair("0").ok();
    let (got, want) = (load(&out), load(&target));
    assert_eq!(got[name], want[name], "lambda 0 leaves the target's bytes");
    std::fs::remove_dir_all(&out).unwrap();
    // Any weight on the reference reads its NaN, and the error names the reference.
    let line = repair("0.5").non_finite(&[reference.to_str().unwrap(), name]);
    assert!(!line.contains(target.to_str().unwrap()), "{line}");
}

/// The InternVL fixture saved as transformers 5.x saves a model tied at the top level:
/// `tie_word_embeddings` true there and false in `text_config`, no `lm_head.weight` on disk.
fn internvl_tied_at_the_top(dir: &Path) -> PathBuf {
    let source = root().join("tests/fixtures/vlm/internvl");
    let mut tensors = load_file(&source.join("model.safetensors"));
    let head = tensors
        .remove("language_model.lm_head.weight")
        .expect("the fixture stores a head");
    let mut config = config(&source);
    config["tie_word_embeddings"] = json!(true);
    config["text_config"]["tie_word_embeddings"] = json!(false);
    copy_with_model(&source, dir, &config, &tensors);
    assert_ne!(head, tensors["language_model.model.embed_tokens.weight"]);
    dir.to_path_buf()
}

/// `source`'s files in `dir`, with `config` and `tensors` as its config.json and weights.
fn copy_with_model(source: &Path, dir: &Path, config: &Value, tensors: &BTreeMap<String, Stored>) {
    write_model(dir, config, tensors, None);
    for entry in std::fs::read_dir(source).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if !dir.join(name).exists() && !name.to_str().unwrap().starts_with("golden") {
            std::os::unix::fs::symlink(&path, dir.join(name)).unwrap();
        }
    }
}

#[test]
fn internvl_saved_tied_at_the_top_ties_its_head_in_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let tied = internvl_tied_at_the_top(&tmp.path().join("tied"));
    // The same model with the embedding stored as an untied head.
    let source = root().join("tests/fixtures/vlm/internvl");
    let mut tensors = load_file(&source.join("model.safetensors"));
    let embed = tensors["language_model.model.embed_tokens.weight"].clone();
    tensors.insert("language_model.lm_head.weight".into(), embed);
    let explicit = tmp.path().join("explicit");
    copy_with_model(&source, &explicit, &config(&source), &tensors);

    let trace = |model: &Path, name: &str| {
        let out = tmp.path().join(format!("{name}.safetensors"));
        sinkmerge([
            "trace",
            model.to_str().unwrap(),
            "--prompt",
            "<image>What is it?",
        ])
        .args(["--image", "tests/fixtures/images/wide_150x61.jpg"])
        .args(["--capture", "logits", "-o"])
        .args([&out])
        .ok();
        load_file(&out)["logits"].clone()
    };
    assert_eq!(trace(&tied, "tied"), trace(&explicit, "explicit"));

    let sinks = |model: &Path| {
        sinkmerge(["visual-sinks", model.to_str().unwrap()])
            .args(["--image", "tests/fixtures/images/wide_150x61.jpg"])
            .args(["--question", "Where is the red square?", "--json"])
            .json()
    };
    let (a, b) = (sinks(&tied), sinks(&explicit));
    assert_eq!(a["images"], b["images"]);
    // extract agreed before: the head is the embedding.
    let out = tmp.path().join("lm");
    sinkmerge([
        "extract",
        tied.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "-q",
    ])
    .ok();
    assert_eq!(config(&out)["tie_word_embeddings"], json!(true));
}
