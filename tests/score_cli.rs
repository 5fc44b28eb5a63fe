//! `sinkmerge score` through the real binary: outputs, determinism across thread counts, and one
//! clear error with exit code 2 (and nothing written) for every kind of bad input.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::util::{fixture, read_json, root, score_fixture, sinkmerge, Sinkmerge};

/// `sinkmerge score ARGS`.
fn score(args: &[&str]) -> Sinkmerge {
    sinkmerge(["score"]).args(args)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `score ARGS`, refused: exit code 2 and an error naming every one of `needles`.
fn fails_with(args: &[&str], needles: &[&str]) -> String {
    score(args).refused_with_usage(needles)
}

/// `score MODEL --json EXTRA...`, which must succeed, as JSON.
fn json_report(model: &Path, extra: &[&str]) -> Value {
    let mut args = vec![s(model), "--json"];
    args.extend_from_slice(extra);
    score(&args).json()
}

/// A copy of a fixture directory (symlinked files) with some files replaced or removed.
fn variant(from: &Path, replace: &[(&str, Option<Vec<u8>>)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if replace.iter().any(|(n, _)| *n == name.to_str().unwrap()) {
            continue;
        }
        std::os::unix::fs::symlink(entry.path(), dir.path().join(&name)).unwrap();
    }
    for (name, contents) in replace {
        if let Some(bytes) = contents {
            std::fs::write(dir.path().join(name), bytes).unwrap();
        }
    }
    dir
}

fn edited_json(path: &Path, edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut v: Value = read_json(path);
    edit(&mut v);
    serde_json::to_vec_pretty(&v).unwrap()
}

#[test]
fn reports_a_before_after_table_and_json() {
    let (r, t) = (fixture("qwen2"), fixture("qwen2-sharded"));
    let out = score(&["--ref", s(&r), s(&t)]).output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for col in [
        "S",
        "pos0_share",
        "strong_sink_frac",
        "b_gap_median",
        "margin",
        "(ref)",
    ] {
        assert!(text.contains(col), "{col} missing from:\n{text}");
    }
    let out = score(&["--ref", s(&r), s(&t), "--json"]).output();
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let models = v["models"].as_array().unwrap();
    assert_eq!(models.len(), 2);
    assert_eq!(models[0]["reference"], true);
    for key in [
        "model",
        "sink_strength",
        "pos0_share",
        "strong_sink_frac",
        "n_observations",
        "per_layer",
        "per_head",
    ] {
        assert!(models[1].get(key).is_some(), "{key}");
    }
    let layer = &models[1]["per_layer"][0];
    for key in ["layer", "median_g", "pos0_share"] {
        assert!(layer.get(key).is_some(), "{key}");
    }
    let pair = &v["pairs"][0];
    for key in ["ref", "target", "g_base_median", "b_gap_median", "margin"] {
        assert!(pair.get(key).is_some(), "{key}");
    }
    let margin = pair["margin"].as_f64().unwrap();
    let g = pair["g_base_median"].as_f64().unwrap();
    let b = pair["b_gap_median"].as_f64().unwrap();
    assert!((margin - (g - b)).abs() < 1e-12);
    assert_eq!(v["settings"]["n_prompts"], 15);
    assert_eq!(v["settings"]["prompts"]["kind"], "default");
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let model = score_fixture("olmoe");
    let args = ["--ref", s(&model), s(&model), "--n", "6", "--json"];
    let one = score(&args).threads("1").output();
    let two = score(&args).threads("2").output();
    let four = score(&args).threads("4").output();
    assert!(
        one.status.success(),
        "{}",
        String::from_utf8_lossy(&one.stderr)
    );
    assert_eq!(one.stdout, two.stdout, "1 vs 2 threads");
    assert_eq!(one.stdout, four.stdout, "1 vs 4 threads");
    // A model against itself: B is exactly zero.
    let v: Value = serde_json::from_slice(&one.stdout).unwrap();
    assert_eq!(v["pairs"][0]["b_gap_median"], 0.0);
}

/// Reading ahead (the default, docs/commands/score.md#memory-and-reading-ahead) changes no byte
/// of the output: against `--max-memory 1`, which reads nothing ahead (each weight decoded when
/// asked for, as before reading ahead existed), and at 1 and 2 threads,
/// on a pair of models (one sharded) and on per-expert and fused-expert MoE models.
#[test]
fn reading_ahead_gives_the_same_bytes_at_any_thread_count() {
    let (r, t) = (fixture("qwen2"), fixture("qwen2-sharded"));
    let runs: [Vec<String>; 3] = [
        vec!["--ref".into(), s(&r).into(), s(&t).into()],
        vec![s(&score_fixture("qwen3_moe")).into()],
        vec![s(&score_fixture("olmoe")).into(), "--n".into(), "4".into()],
    ];
    for run in &runs {
        let mut args: Vec<&str> = run.iter().map(String::as_str).collect();
        args.push("--json");
        let plain = [args.clone(), vec!["--max-memory", "1"]].concat();
        let one = score(&args).threads("1").output();
        assert!(
            one.status.success(),
            "{}",
            String::from_utf8_lossy(&one.stderr)
        );
        let two = score(&args).threads("2").output();
        let not_ahead = score(&plain).threads("2").output();
        assert!(not_ahead.status.success());
        assert_eq!(one.stdout, two.stdout, "{run:?}: 1 vs 2 threads");
        assert_eq!(
            one.stdout, not_ahead.stdout,
            "{run:?}: with and without reading ahead"
        );
    }
}

#[test]
fn seeded_draws_and_prompt_files() {
    let m = score_fixture("qwen3_bias");
    let run = |extra: &[&str]| json_report(&m, extra);
    let a = run(&["--n", "7", "--seed", "3"]);
    assert_eq!(a["settings"]["n_prompts"], 7);
    assert_eq!(a["settings"]["prompts"]["seed"], 3);
    assert_eq!(a["models"], run(&["--n", "7", "--seed", "3"])["models"]);
    assert_ne!(a["models"], run(&["--n", "7", "--seed", "4"])["models"]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.txt");
    std::fs::write(
        &file,
        "Write one word.\n\nName a color in capital letters.\n",
    )
    .unwrap();
    let b = run(&["--prompts", s(&file)]);
    assert_eq!(b["settings"]["n_prompts"], 2);
}

#[test]
fn writes_plot_and_heatmap_svgs() {
    let dir = tempfile::tempdir().unwrap();
    let (plot, heat) = (dir.path().join("layers.svg"), dir.path().join("heads.svg"));
    let out = score(&[
        "--ref",
        s(&fixture("olmo3")),
        s(&fixture("olmo3")),
        "--plot",
        s(&plot),
        "--heatmap",
        s(&heat),
        "--n",
        "3",
    ])
    .output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [&plot, &heat] {
        let svg = std::fs::read_to_string(f).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("olmo3"),
            "{}",
            f.display()
        );
    }
    assert!(std::fs::read_to_string(&plot).unwrap().contains("pos0"));
    // The legends and panel titles name the models as the per-layer table does ("olmo3", the
    // reference marked as in the summary table), never by the absolute path they were given as.
    let legend = std::fs::read_to_string(&plot).unwrap();
    assert!(
        legend.contains(">\nolmo3 (ref)\n</text>") && legend.contains(">\nolmo3\n</text>"),
        "{legend}"
    );
    let abs = s(&fixture("olmo3")).to_string();
    for f in [&plot, &heat] {
        let svg = std::fs::read_to_string(f).unwrap();
        assert!(!svg.contains(&abs), "{} names {abs}", f.display());
    }
}

#[test]
fn unsupported_architecture_lists_the_supported_ones() {
    let from = fixture("qwen2");
    let config = edited_json(&from.join("config.json"), |c| {
        c["model_type"] = "gpt_neox".into();
    });
    let dir = variant(&from, &[("config.json", Some(config))]);
    let err = fails_with(&[s(dir.path())], &["gpt_neox", "config.json"]);
    for arch in [
        "qwen2",
        "qwen3",
        "llama",
        "mistral",
        "olmo2",
        "olmo3",
        "qwen3_moe",
        "olmoe",
    ] {
        assert!(err.contains(arch), "{arch} not listed: {err}");
    }
}

#[test]
fn missing_tokenizer_json() {
    let dir = variant(&fixture("qwen2"), &[("tokenizer.json", None)]);
    fails_with(&[s(dir.path())], &["tokenizer.json", "missing"]);
}

#[test]
fn prompt_longer_than_the_context() {
    let from = fixture("qwen2");
    let config = edited_json(&from.join("config.json"), |c| {
        c["max_position_embeddings"] = 16.into();
    });
    let dir = variant(&from, &[("config.json", Some(config))]);
    fails_with(
        &[s(dir.path())],
        &["prompt 1", "max_position_embeddings = 16"],
    );
}

#[test]
fn empty_prompt_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("empty.txt");
    std::fs::write(&file, "\n   \n").unwrap();
    fails_with(
        &[s(&fixture("qwen2")), "--prompts", s(&file)],
        &["empty.txt", "no prompts"],
    );
    fails_with(
        &[
            s(&fixture("qwen2")),
            "--prompts",
            "/nonexistent/prompts.txt",
        ],
        &["prompts.txt", "missing"],
    );
}

#[test]
fn reference_with_another_vocabulary() {
    // Same architecture and weights layout, but a tokenizer whose vocabulary maps text to other ids.
    let from = fixture("qwen2-sharded");
    let tokenizer = edited_json(&from.join("tokenizer.json"), |t| {
        let vocab = t["model"]["vocab"].as_object_mut().unwrap();
        let (a, b) = (vocab["e"].clone(), vocab["t"].clone());
        vocab.insert("e".into(), b);
        vocab.insert("t".into(), a);
    });
    let dir = variant(&from, &[("tokenizer.json", Some(tokenizer))]);
    fails_with(
        &["--ref", s(&fixture("qwen2")), s(dir.path())],
        &["different vocabularies", "prompt 1"],
    );
}

#[test]
fn reference_with_another_architecture() {
    fails_with(
        &["--ref", s(&fixture("qwen2")), s(&fixture("qwen3"))],
        &["cannot be compared", "same layers and heads"],
    );
}

#[test]
fn a_qwen2_reference_pairs_with_its_qk_norm_injected_copy() {
    // `inject-qknorm` turns Qwen2 into Qwen3 with unit QK norms: other model type, same layout.
    let dir = tempfile::tempdir().unwrap();
    let injected = dir.path().join("injected");
    sinkmerge(["inject-qknorm", s(&fixture("qwen2")), "-o", s(&injected)]).ok();
    let out = score(&[
        "--ref",
        s(&fixture("qwen2")),
        s(&injected),
        "--n",
        "2",
        "--json",
    ])
    .output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["models"][1]["model_type"], "qwen3");
    assert_eq!(v["models"][1]["qk_norm"], "per-head");
    assert!(v["models"][1]["per_layer"][0]["m_q"].is_array());
    assert!(v["pairs"][0]["b_gap_median"].as_f64().unwrap() > 0.0);
}

#[test]
fn non_finite_weights_are_named_with_exit_3() {
    score(&[s(&root().join("tests/fixtures/nonfinite"))])
        .non_finite(&["model.layers.0.self_attn.k_proj.weight", "NaN/Inf"]);
}

#[test]
fn the_precision_is_always_reported() {
    let model = fixture("qwen2");
    let run = |extra: &[&str]| json_report(&model, extra);
    let f32 = run(&[]);
    let bf16 = run(&["--precision", "bf16"]);
    assert_eq!(f32["settings"]["precision"], "f32");
    assert_eq!(bf16["settings"]["precision"], "bf16");
    let s_of = |v: &Value| v["models"][0]["sink_strength"].as_f64().unwrap();
    assert_ne!(s_of(&f32), s_of(&bf16));
    assert!((s_of(&f32) - s_of(&bf16)).abs() < 0.1);
    fails_with(&[s(&model), "--precision", "fp8"], &["fp8"]);
}

#[test]
fn cuda_device_errors_are_clear() {
    let model = fixture("qwen2");
    match sinkmerge::forward::backend::cuda::driver::missing_library() {
        // This machine: no CUDA library, so every GPU index gets the same clear refusal.
        Some(lib) => {
            for device in ["cuda", "cuda:1"] {
                fails_with(
                    &[s(&model), "--device", device],
                    &["--device cuda", lib, "cannot be loaded", "--device cpu"],
                );
            }
        }
        // A GPU machine: an index past the last GPU.
        None => {
            fails_with(
                &[s(&model), "--device", "cuda:4096"],
                &["cuda:4096", "out of range"],
            );
        }
    }
    fails_with(&[s(&model), "--device", "gpu"], &["not a device", "cuda:N"]);
}

#[test]
fn bad_flags() {
    fails_with(&[s(&fixture("qwen2")), "--n", "0"], &["--n 0"]);
    fails_with(&[s(&fixture("qwen2")), "--n", "100000"], &["pool holds"]);
    fails_with(&[s(&fixture("qwen2")), "--last", "0"], &["--last"]);
    fails_with(&[s(&fixture("qwen2")), "--seed", "1"], &["--n"]);
}

#[test]
fn nothing_is_written_on_error_and_inputs_are_protected() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("plot.svg");
    let bad = variant(&fixture("qwen2"), &[("tokenizer.json", None)]);
    fails_with(
        &[s(&fixture("qwen2")), s(bad.path()), "--plot", s(&plot)],
        &["tokenizer.json"],
    );
    assert!(!plot.exists());
    let model = variant(&fixture("qwen2"), &[]);
    let inside = model.path().join("plot.svg");
    fails_with(
        &[s(model.path()), "--plot", s(&inside)],
        &["lies inside input"],
    );
    assert!(!inside.exists());
}

/// Every report path is checked before the scorer runs and before any file is written: a
/// heatmap that cannot be written leaves no plot behind.
#[test]
fn a_bad_heatmap_path_writes_no_plot() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("a.svg");
    let heatmap = dir.path().join("heatmap-is-a-directory");
    std::fs::create_dir(&heatmap).unwrap();
    fails_with(
        &[
            s(&fixture("qwen2")),
            "--plot",
            s(&plot),
            "--heatmap",
            s(&heatmap),
        ],
        &["is a directory"],
    );
    assert!(!plot.exists());
}

#[test]
fn chat_templates_follow_the_reference_unless_told_otherwise() {
    // A VLM-LM whose template adds a default system prompt, as Qwen2.5-VL's does.
    let reference = root().join("assets/models/tiny-qwen3/ref");
    let config = reference.join("tokenizer_config.json");
    let vl = variant(
        &root().join("assets/models/tiny-qwen3/vl"),
        &[(
            "tokenizer_config.json",
            Some(edited_json(&config, |c| {
                let t = c["chat_template"].as_str().unwrap().to_string();
                let system =
                    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}";
                c["chat_template"] =
                    Value::String(t.replacen("{%- for", &format!("{system}{{%- for"), 1));
            })),
        )],
    );
    let args = ["--ref", s(&reference), "--chat-template"];
    let report = json_report(vl.path(), &args);
    assert_eq!(report["settings"]["chat_template_from"], "ref");
    assert!(report["pairs"][0]["margin"].is_f64());
    let mut own = args.to_vec();
    own.extend(["--template-from", "own"]);
    own.insert(0, s(vl.path()));
    fails_with(&own, &["other token ids", "--template-from ref"]);
    // Its own template, scored alone, renders more tokens than the reference's.
    let alone = |extra: &[&str]| {
        let mut a = vec!["--chat-template"];
        a.extend_from_slice(extra);
        json_report(vl.path(), &a)["models"][0]["n_tokens"]
            .as_u64()
            .unwrap()
    };
    assert!(
        alone(&[])
            > json_report(&reference, &["--chat-template"])["models"][0]["n_tokens"]
                .as_u64()
                .unwrap()
    );
    fails_with(
        &[s(vl.path()), "--chat-template", "--template-from", "ref"],
        &["needs --ref"],
    );
}

/// The bundled sample text of `--text`.
fn sample_text() -> PathBuf {
    root().join("assets/text/sample.txt")
}

#[test]
fn text_loss_matches_transformers() {
    // tests/fixtures/score/text/*.json: tools/gen_text_goldens.py, transformers' eager f32 loss
    // over the same windows.
    let dir = root().join("tests/fixtures/score/text");
    let mut goldens: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    goldens.sort();
    assert!(goldens.len() >= 8, "{}", dir.display());
    let mut worst = 0f64;
    for path in goldens {
        let golden: Value = read_json(&path);
        let mut args: Vec<&str> = (golden["cli"].as_array().unwrap().iter())
            .map(|a| a.as_str().unwrap())
            .collect();
        args.extend(["--json", "--n", "1"]);
        // The goldens' paths are relative to the repository root, where the binary runs.
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let v = score(&args).json();
        let t = &v["models"][0]["text"];
        for key in ["window", "windows", "tokens_predicted"] {
            assert_eq!(t[key], golden[key], "{name}: {key}");
        }
        assert_eq!(t["file"], golden["text"], "{name}");
        let (loss, want) = (
            t["loss"].as_f64().unwrap(),
            golden["loss"].as_f64().unwrap(),
        );
        let ppl = t["perplexity"].as_f64().unwrap();
        let want_ppl = golden["perplexity"].as_f64().unwrap();
        eprintln!(
            "{name:16} loss {loss:.6} transformers {want:.6} |dloss| {:.1e} ppl rel {:.1e}",
            (loss - want).abs(),
            (ppl / want_ppl - 1.0).abs()
        );
        assert!((loss - want).abs() <= 1e-4, "{name}: loss {loss} vs {want}");
        assert!(
            (ppl / want_ppl - 1.0).abs() <= 1e-4,
            "{name}: perplexity {ppl} vs {want_ppl}"
        );
        worst = worst.max((loss - want).abs());
    }
    eprintln!("max |dloss| over the goldens: {worst:.2e}");
}

#[test]
fn text_loss_table_and_json() {
    let (r, t) = (
        root().join("assets/models/tiny-qwen2/ref"),
        root().join("assets/models/tiny-qwen2/vl"),
    );
    let text = sample_text();
    let args = ["--ref", s(&r), s(&t), "--n", "2", "--text", s(&text)];
    let out = score(&args).output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "text loss on",
        "sample.txt",
        "windows of 512 tokens",
        "perplexity",
        "tokens",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    let mut json = args.to_vec();
    json.push("--json");
    let out = score(&json).output();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    for m in v["models"].as_array().unwrap() {
        let t = &m["text"];
        for key in [
            "file",
            "loss",
            "perplexity",
            "tokens_predicted",
            "windows",
            "window",
        ] {
            assert!(t.get(key).is_some(), "{key} missing from {t}");
        }
        assert_eq!(t["window"], 512, "1024 capped at max_position_embeddings");
    }
    // Without --text nothing of it appears.
    let v = json_report(&r, &["--n", "2"]);
    assert!(v["models"][0].get("text").is_none());
    let out = score(&[s(&r), "--n", "2"]).output();
    assert!(!String::from_utf8(out.stdout).unwrap().contains("text loss"));
}

#[test]
fn text_loss_errors_name_the_file() {
    let m = root().join("assets/models/tiny-qwen2/ref");
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.txt");
    fails_with(
        &[s(&m), "--text", s(&missing)],
        &["missing.txt", "cannot read"],
    );
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, " \n\n").unwrap();
    fails_with(&[s(&m), "--text", s(&empty)], &["empty.txt", "empty"]);
    // One token with a tokenizer that adds no BOS (the bundled models' adds one).
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "a").unwrap();
    fails_with(
        &[s(&fixture("qwen3")), "--text", s(&short)],
        &["short.txt", "1 token(s)", "at least 2"],
    );
    let text = sample_text();
    fails_with(
        &[s(&m), "--text", s(&text), "--text-window", "1"],
        &["--text-window 1", "at least 2"],
    );
    fails_with(
        &[s(&m), "--text", s(&text), "--text-window", "600"],
        &["--text-window 600", "max_position_embeddings = 512"],
    );
    let out = score(&[s(&m), "--text-window", "64"]).output();
    assert_eq!(out.status.code(), Some(2), "--text-window needs --text");
}
