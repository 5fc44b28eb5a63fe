//! `sinkmerge graft` through the real binary: `extract` then `graft` gives every family fixture
//! back (tensor set, dtypes, shapes and bytes, every other file), an edited language model lands
//! where `extract` finds it again, vocabulary and dtype adaptation, and bad input (exit 2, one
//! line naming what differs, no output).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::Digest;

use sinkmerge::checkpoint::Checkpoint;

use crate::util::{
    leftovers, model_card, read_json, root, sinkmerge, strings, write_model, Stored,
};

/// Every tensor of a model directory's checkpoint (its shards, not other safetensors files).
fn load(dir: &Path) -> BTreeMap<String, Stored> {
    let ckpt = Checkpoint::open_dir(dir, "model").unwrap();
    (ckpt.names().iter())
        .map(|n| {
            let info = ckpt.info(n).unwrap();
            let t = Stored {
                dtype: info.dtype,
                shape: info.shape.clone(),
                bytes: ckpt.bytes(n).unwrap().to_vec(),
            };
            (n.clone(), t)
        })
        .collect()
}

/// Whether `name` is a weight shard or the index (the files `graft` writes itself).
fn is_weights(name: &str) -> bool {
    (name.starts_with("model") && name.ends_with(".safetensors"))
        || name == "model.safetensors.index.json"
}

/// Every VLM fixture: the extraction goldens' sources and the tiny transformers-built VLMs.
fn vlm_fixtures() -> Vec<PathBuf> {
    let goldens: serde_json::Map<String, Value> =
        read_json(root().join("tests/fixtures/goldens/extract.json"));
    let mut dirs: Vec<PathBuf> = (goldens.iter())
        .filter(|(k, _)| *k != "_meta")
        .map(|(_, g)| root().join(g["dir"].as_str().unwrap()))
        .collect();
    for e in fs::read_dir(root().join("tests/fixtures/vlm")).unwrap() {
        let path = e.unwrap().path();
        if path.join("config.json").is_file() {
            dirs.push(path);
        }
    }
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Name -> bytes of every file of a model directory but its safetensors shards and index.
fn other_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            p.is_file() && !is_weights(&name)
        })
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, fs::read(&p).unwrap())
        })
        .collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn extract(vlm: &Path, out: &Path) {
    sinkmerge(["extract", s(vlm), "-o", s(out), "-q"]).ok();
}

fn graft(vlm: &Path, lm: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec!["graft", "--vlm", s(vlm), "--lm", s(lm), "-o", s(out)];
    args.extend_from_slice(extra);
    sinkmerge(args).ok()
}

#[test]
fn extract_then_graft_gives_every_family_fixture_back() {
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = vlm_fixtures();
    assert!(fixtures.len() >= 20, "{} fixtures", fixtures.len());
    for (i, vlm) in fixtures.iter().enumerate() {
        let (lm, back) = (
            tmp.path().join(format!("lm{i}")),
            tmp.path().join(format!("vl{i}")),
        );
        extract(vlm, &lm);
        graft(
            vlm,
            &lm,
            &back,
            &["--no-model-card", "--max-shard-size", "64k"],
        );
        let (want, got) = (load(vlm), load(&back));
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{}: tensor set",
            vlm.display()
        );
        for (name, w) in &want {
            let g = &got[name];
            assert!(
                g == w,
                "{}: `{name}` differs ({:?} {:?} vs {:?} {:?})",
                vlm.display(),
                g.dtype,
                g.shape,
                w.dtype,
                w.shape
            );
        }
        assert_eq!(
            other_files(&back),
            other_files(vlm),
            "{}: the other files",
            vlm.display()
        );
        fs::remove_dir_all(&lm).unwrap();
        fs::remove_dir_all(&back).unwrap();
    }
}

/// A language model edited after extraction goes where `extract` finds it again, and nothing
/// outside the language model changes: transposed experts (Qwen3-VL-MoE Hub layout), a
/// remote-code prefix (InternVL) and a fused layout (MolmoE).
#[test]
fn an_edited_language_model_is_extracted_again_from_the_graft() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["qwen3_vl_moe-hub", "internvl-hf", "molmoe-hf"] {
        let t = |n: &str| tmp.path().join(name).join(n);
        let vlm = root().join("tests/fixtures/families").join(name);
        extract(&vlm, &t("lm"));
        scaled(&t("lm"), &t("edited"), 1.5);
        graft(&vlm, &t("edited"), &t("vl"), &[]);
        extract(&t("vl"), &t("again"));
        let edited = load(&t("edited"));
        assert_eq!(load(&t("again")), edited, "{name}: re-extracted LM");
        assert_ne!(load(&t("lm")), edited, "{name}: the edit changed something");
        let (want, got) = (load(&vlm), load(&t("vl")));
        let lm_sources = changed(&want, &got);
        assert!(!lm_sources.is_empty(), "{name}");
        for n in &lm_sources {
            assert!(
                !n.contains("visual") && !n.contains("vision") && !n.contains("projector"),
                "{name}: `{n}` changed"
            );
        }
    }
}

/// Names whose bytes differ between two tensor maps with the same keys.
fn changed(a: &BTreeMap<String, Stored>, b: &BTreeMap<String, Stored>) -> Vec<String> {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .filter(|(n, t)| b[*n] != **t)
        .map(|(n, _)| n.clone())
        .collect()
}

#[test]
fn the_default_model_card_names_the_vlm_and_the_lm_as_bases_of_a_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let vlm = root().join("tests/fixtures/vlm/qwen2_5_vl");
    let (lm, out) = (tmp.path().join("lm"), tmp.path().join("out"));
    extract(&vlm, &lm);
    graft(&vlm, &lm, &out, &[]);
    let (meta, body) = model_card(&out);
    assert_eq!(meta["base_model_relation"], "merge");
    assert!(strings(&meta["tags"]).contains(&"graft".to_string()));
    assert!(body.contains("sinkmerge graft --vlm"), "{body}");
    // The card replaces the VLM's README.md only; every other file is the VLM's.
    let mut files = other_files(&out);
    files.remove("README.md");
    assert_eq!(files, other_files(&vlm));
}

#[test]
fn a_cropped_vocabulary_is_restored_from_the_vlm_and_another_dtype_converted() {
    let tmp = tempfile::tempdir().unwrap();
    let vlm = root().join("tests/fixtures/vlm/qwen2_5_vl");
    let (lm, small, out) = (
        tmp.path().join("lm"),
        tmp.path().join("small"),
        tmp.path().join("out"),
    );
    extract(&vlm, &lm);
    let mut tensors = load(&lm);
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        let t = tensors.get_mut(name).unwrap();
        let row = t.bytes.len() / t.shape[0];
        t.shape[0] -= 7;
        t.bytes.truncate(t.shape[0] * row);
    }
    let bf16: BTreeMap<_, _> = (tensors.into_iter())
        .map(|(n, t)| {
            let t = Stored::from_f32(safetensors::Dtype::BF16, t.shape.clone(), &t.f32());
            (n, t)
        })
        .collect();
    let mut config: Value = read_json(lm.join("config.json"));
    config["vocab_size"] = Value::from(config["vocab_size"].as_u64().unwrap() - 7);
    write_model(&small, &config, &bf16, Some(&lm));
    let (_, err) = sinkmerge(["graft", "--vlm", s(&vlm), "--lm", s(&small), "-o", s(&out)])
        .warns(&["vocabulary rows", "rows 313..", "BF16", "converted"]);
    assert!(err.contains("model.embed_tokens.weight"), "{err}");
    let (want, got) = (load(&vlm), load(&out));
    for (name, stored) in [
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ] {
        let (w, g) = (want[stored].f32(), got[stored].f32());
        let row = want[stored].shape[1];
        let cut = (want[stored].shape[0] - 7) * row;
        // The LM's rows, through bf16; the VLM's rows past the LM's vocabulary.
        let lm_rows = bf16[name].f32();
        assert_eq!(&g[..cut], &lm_rows[..], "{name}: the LM's rows");
        assert_eq!(&g[cut..], &w[cut..], "{name}: the VLM's rows");
    }
    assert_eq!(
        got["visual.merger.mlp.0.weight"],
        want["visual.merger.mlp.0.weight"]
    );
    assert_eq!(
        read_json::<Value>(out.join("config.json")),
        read_json::<Value>(vlm.join("config.json"))
    );
}

#[test]
fn bad_input_is_refused_naming_what_differs_with_no_output() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |n: &str| tmp.path().join(n);
    let qwen25 = root().join("tests/fixtures/vlm/qwen2_5_vl");
    let qwen3 = root().join("tests/fixtures/vlm/qwen3_vl");
    extract(&qwen25, &t("lm25"));
    extract(&qwen3, &t("lm3"));
    let out = t("out");
    let refused = |vlm: &Path, lm: &Path, needles: &[&str]| {
        sinkmerge(["graft", "--vlm", s(vlm), "--lm", s(lm), "-o", s(&out)]).refused(needles);
        assert!(!out.exists(), "{needles:?}: output left");
        assert!(
            leftovers(tmp.path()).is_empty(),
            "{needles:?}: partial output left"
        );
    };
    // Another architecture.
    refused(
        &qwen25,
        &t("lm3"),
        &["lm3", "`qwen3`", "`qwen2`", "cannot hold"],
    );
    // Another layer count: drop the last layer.
    let mut fewer = load(&t("lm25"));
    fewer.retain(|n, _| !n.starts_with("model.layers.2."));
    let mut config: Value = read_json(t("lm25").join("config.json"));
    config["num_hidden_layers"] = Value::from(2);
    write_model(&t("fewer"), &config, &fewer, Some(&t("lm25")));
    refused(&qwen25, &t("fewer"), &["num_hidden_layers", "3 vs 2"]);
    // Another shape under the same config.
    let mut wider = load(&t("lm25"));
    let q = wider.get_mut("model.layers.1.mlp.up_proj.weight").unwrap();
    q.shape[0] /= 2;
    q.bytes.truncate(q.bytes.len() / 2);
    write_model(
        &t("wider"),
        &read_json(t("lm25").join("config.json")),
        &wider,
        Some(&t("lm25")),
    );
    refused(
        &qwen25,
        &t("wider"),
        &["model.layers.1.mlp.up_proj.weight", "shape"],
    );
    // The VLM is not a VLM; the LM is a VLM.
    refused(
        &t("lm25"),
        &t("lm25"),
        &["cannot tell which VLM family", "plain language model"],
    );
    refused(&qwen25, &qwen25, &["is a vision-language model", "extract"]);
    // A feature the VLM's architecture cannot hold: per-head QK-norm from inject-qknorm.
    sinkmerge(["inject-qknorm", s(&t("lm25")), "-o", s(&t("qk")), "-q"]).ok();
    refused(
        &qwen25,
        &t("qk"),
        &["`qwen3`", "q_norm/k_norm", "cannot hold"],
    );
    // OUT inside an input.
    let inside = t("lm25").join("vl");
    sinkmerge([
        "graft",
        "--vlm",
        s(&qwen25),
        "--lm",
        s(&t("lm25")),
        "-o",
        s(&inside),
    ])
    .refused(&["inside"]);
    assert!(!inside.exists());
}

/// Every file of a model directory but the two that say how it was made (the model card and the
/// recorded recipe), with its bytes.
fn model_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name != "README.md" && name != "sinkmerge_config.yml"
        })
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                fs::read(&p).unwrap(),
            )
        })
        .collect()
}

/// `edited` = `lm` with every float tensor scaled by `factor`: a second model to merge.
fn scaled(lm: &Path, edited: &Path, factor: f32) {
    let tensors: BTreeMap<String, Stored> = load(lm)
        .into_iter()
        .map(|(n, t)| {
            let v: Vec<f32> = t.f32().iter().map(|x| x * factor).collect();
            (n, Stored::from_f32(t.dtype, t.shape.clone(), &v))
        })
        .collect();
    write_model(
        edited,
        &read_json(lm.join("config.json")),
        &tensors,
        Some(lm),
    );
}

/// `--into-vlm` writes, in one pass, the same bytes as the command followed by `graft`, for every
/// command that writes a model; the merge's recorded `into_vlm` replays it.
#[test]
fn into_vlm_equals_the_command_then_graft_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |n: &str| tmp.path().join(n);
    let vlm = root().join("tests/fixtures/vlm/qwen2_5_vl");
    extract(&vlm, &t("lm"));
    scaled(&t("lm"), &t("a"), 1.25);
    scaled(&t("lm"), &t("b"), 0.75);
    let (lm, a, b) = (t("lm"), t("a"), t("b"));
    let (lm, a, b) = (s(&lm), s(&a), s(&b));
    let task = ["--base", lm, "--models", a, b];
    let commands: Vec<(&str, Vec<&str>)> = vec![
        (
            "linear",
            vec!["linear", "--models", lm, a, "--weights", "0.3,0.7"],
        ),
        (
            "task-arithmetic",
            [&["task-arithmetic"][..], &task[..]].concat(),
        ),
        (
            "ties",
            [&["ties"][..], &task[..], &["--density", "0.5"][..]].concat(),
        ),
        (
            "dare",
            [
                &["dare"][..],
                &task[..],
                &["--density", "0.5", "--seed", "3"][..],
            ]
            .concat(),
        ),
        ("tsv", [&["tsv"][..], &task[..]].concat()),
        ("star", [&["star"][..], &task[..]].concat()),
        (
            "repair-heads",
            vec![
                "repair-heads",
                "--ref",
                lm,
                a,
                "--heads",
                "random:2",
                "--seed",
                "1",
            ],
        ),
        (
            "ablate",
            vec!["ablate", a, "--norms", "input_layernorm", "--top-k", "3"],
        ),
        ("perturb", vec!["perturb", lm, "--match", a, "--seed", "2"]),
    ];
    for (name, args) in &commands {
        let (two, one) = (t(&format!("{name}-lm")), t(&format!("{name}-vl")));
        let mut plain = args.clone();
        plain.extend(["-o", s(&two), "-q"]);
        sinkmerge(&plain).ok();
        let grafted = t(&format!("{name}-grafted"));
        graft(&vlm, &two, &grafted, &[]);
        let mut into = args.clone();
        into.extend(["--into-vlm", s(&vlm), "-o", s(&one), "-q"]);
        sinkmerge(&into).ok();
        assert_eq!(model_files(&one), model_files(&grafted), "{name}");
        // The card names the VLM among the inputs (local directories are not `base_model`s).
        let (_, body) = model_card(&one);
        assert!(
            body.contains("--into-vlm") && body.contains("qwen2_5_vl"),
            "{name}: {body}"
        );
    }
    // The merge records `into_vlm`; `sinkmerge merge` replays it.
    let record = t("ties-vl").join("sinkmerge_config.yml");
    let text = fs::read_to_string(&record).unwrap();
    assert!(text.contains("into_vlm: "), "{text}");
    sinkmerge(["merge", s(&record), "-o", s(&t("replayed")), "-q"]).ok();
    assert_eq!(model_files(&t("replayed")), model_files(&t("ties-vl")));
}

/// A VLM class that builds its language model from the text config's class (InternVL) takes an
/// LM of another class with the same widths: Qwen3 with per-head QK-norm from `inject-qknorm`,
/// whose added tensors go under the VLM's language-model prefix and whose config becomes the
/// text config. `--into-vlm` writes the same bytes, and `extract` finds the LM again.
#[test]
fn a_qk_norm_injection_goes_into_a_vlm_that_takes_any_text_class() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |n: &str| tmp.path().join(n);
    let vlm = root().join("tests/fixtures/vlm/internvl");
    extract(&vlm, &t("lm"));
    sinkmerge(["inject-qknorm", s(&t("lm")), "-o", s(&t("qk")), "-q"]).ok();
    graft(&vlm, &t("qk"), &t("vl"), &[]);
    sinkmerge([
        "inject-qknorm",
        s(&t("lm")),
        "--into-vlm",
        s(&vlm),
        "-o",
        s(&t("one")),
        "-q",
    ])
    .ok();
    assert_eq!(model_files(&t("one")), model_files(&t("vl")));
    let config: Value = read_json(t("vl").join("config.json"));
    let qk: Value = read_json(t("qk").join("config.json"));
    assert_eq!(config["text_config"]["model_type"], "qwen3");
    assert_eq!(config["text_config"]["head_dim"], qk["head_dim"]);
    assert_eq!(
        config["vision_config"],
        read_json::<Value>(vlm.join("config.json"))["vision_config"]
    );
    let got = load(&t("vl"));
    assert!(got.contains_key("language_model.model.layers.2.self_attn.q_norm.weight"));
    extract(&t("vl"), &t("again"));
    assert_eq!(load(&t("again")), load(&t("qk")));
    // Everything else is the VLM's.
    for (name, w) in load(&vlm) {
        if !name.starts_with("language_model.") {
            assert_eq!(got[&name], w, "{name}");
        }
    }
}

/// The chain of `tools/check_graft.py` (extract, two `perturb` task models, TIES, graft) rebuilds
/// exactly the grafted bytes that transformers was checked on: each loads with its VLM class with
/// no missing or unexpected keys, its text logits equal the merged LM's within 1e-5 and its
/// vision outputs the original's bitwise (tests/fixtures/graft/README.md). `trace` of the grafted
/// VLMs matches transformers' forward of them. The same holds for the Qwen3 LM of `inject-qknorm`
/// grafted into the Qwen2 InternVL (another text class).
#[test]
fn the_grafts_transformers_checked_are_rebuilt_byte_for_byte_and_trace_like_it() {
    let cases: Value = read_json(root().join("tests/fixtures/graft/cases.json"));
    let families = cases["families"].as_object().unwrap();
    let swap = ("text_class_swap", &cases["text_class_swap"]);
    assert_eq!(swap.1["text_class"], "qwen3");
    for (family, case) in [
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "llava_onevision",
        "idefics3",
        "internvl",
    ]
    .map(|f| (f, &families[f]))
    .into_iter()
    .chain([swap])
    {
        assert!(case["vision_bitwise_equal"].as_bool().unwrap(), "{family}");
        assert!(
            case["text_logits_max_abs"].as_f64().unwrap() <= 1e-5,
            "{family}"
        );
        for keys in ["missing_keys", "unexpected_keys", "mismatched_keys"] {
            assert_eq!(
                case["loading"][keys],
                Value::Array(vec![]),
                "{family}: {keys}"
            );
        }
        let tmp = tempfile::tempdir().unwrap();
        let vlm = root().join(case["vlm"].as_str().unwrap());
        for step in case["chain"].as_array().unwrap() {
            let args: Vec<String> = (step.as_array().unwrap().iter())
                .map(|a| {
                    (a.as_str().unwrap())
                        .replace("{VLM}", s(&vlm))
                        .replace("{TMP}", s(tmp.path()))
                })
                .chain(["-q".to_string()])
                .collect();
            sinkmerge(&args).ok();
        }
        let grafted = tmp.path().join("grafted");
        let want = case["grafted_tensors_sha256"].as_object().unwrap();
        let got = load(&grafted);
        assert_eq!(got.len(), want.len(), "{family}: tensor count");
        for (name, t) in &got {
            let sha = format!("{:x}", sha2::Sha256::digest(&t.bytes));
            assert_eq!(
                Some(sha.as_str()),
                want[name].as_str(),
                "{family}: `{name}`"
            );
        }
        if let Some(trace) = case.get("trace_case").filter(|c| !c.is_null()) {
            let mut trace: crate::trace::Case = serde_json::from_value(trace.clone()).unwrap();
            trace.model = s(&grafted).to_string();
            crate::trace::traces_like_its_golden(&trace, tmp.path());
        }
    }
}
