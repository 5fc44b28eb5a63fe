//! `sinkmerge extract` through the real binary: every family's fixture against the goldens of
//! tools/gen_extract_goldens.py (tensor set, dtypes, shapes, sha256 of every tensor's bytes, config
//! fields), both Qwen3-VL-MoE expert orientations, determinism, default output paths, and bad input
//! (exit code 2, one clear message, nothing left behind). No Python needed.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Output;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::util::{
    fake_hub_cache, model_card, read_json, refused, replay_args, root, sinkmerge, stderr, strings,
};
use sinkmerge::checkpoint::Checkpoint;

fn goldens() -> serde_json::Map<String, Value> {
    let mut g: serde_json::Map<String, Value> =
        read_json(root().join("tests/fixtures/goldens/extract.json"));
    g.remove("_meta");
    g
}

fn extract(src: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "extract",
        src.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--json",
    ];
    args.extend_from_slice(extra);
    sinkmerge(&args).output()
}

fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_json(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// Name -> (dtype, shape, sha256) of every tensor of a model directory.
fn tensor_digests(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, String)> {
    let ckpt = Checkpoint::open_dir(dir, "out").unwrap();
    ckpt.names()
        .iter()
        .map(|n| {
            let info = ckpt.info(n).unwrap();
            let sha = format!("{:x}", Sha256::digest(ckpt.bytes(n).unwrap()));
            (
                n.clone(),
                (format!("{:?}", info.dtype), info.shape.clone(), sha),
            )
        })
        .collect()
}

/// Nothing but `keep` in `dir` (no temporary output left behind).
fn assert_only(dir: &Path, keep: &[&str]) {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, keep, "unexpected files in {}", dir.display());
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn every_family_matches_its_goldens() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, g) in goldens() {
        let src = root().join(g["dir"].as_str().unwrap());
        let out = tmp.path().join(&case);
        let o = extract(&src, &out, &[]);
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let summary: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(summary["family"], g["family"], "{case}");
        assert_eq!(summary["architecture"], g["architecture"], "{case}");
        assert_eq!(summary["verified"], Value::Bool(true), "{case}");
        assert_eq!(summary["tie_word_embeddings"], g["tied"], "{case}");

        let want = g["tensors"].as_object().unwrap();
        let got = tensor_digests(&out);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{case}: tensor set"
        );
        for (name, (dtype, shape, sha)) in &got {
            let w = &want[name];
            assert_eq!(dtype, w["dtype"].as_str().unwrap(), "{case}: {name} dtype");
            let wshape: Vec<usize> = serde_json::from_value(w["shape"].clone()).unwrap();
            assert_eq!(shape, &wshape, "{case}: {name} shape");
            assert_eq!(sha, w["sha256"].as_str().unwrap(), "{case}: {name} bytes");
        }

        let config: Value = read_json(out.join("config.json"));
        for (key, want) in g["config"].as_object().unwrap() {
            let have = config.get(key).unwrap_or(&Value::Null);
            assert!(
                same_json(have, want),
                "{case}: config `{key}` is {have}, golden {want}"
            );
        }

        // Every source tensor is either used or dropped, and counted once.
        let dropped: u64 = summary["dropped"]
            .as_object()
            .unwrap()
            .values()
            .map(|c| c["tensors"].as_u64().unwrap())
            .sum();
        assert_eq!(
            summary["tensors_kept"].as_u64().unwrap() + dropped,
            g["source_tensors"].as_u64().unwrap(),
            "{case}: kept + dropped"
        );
        assert!(
            out.join("tokenizer.json").is_file(),
            "{case}: tokenizer copied"
        );
        assert!(
            !fs::read_dir(&out).unwrap().any(|e| {
                let n = e.unwrap().file_name().to_string_lossy().into_owned();
                n.ends_with(".py") || n == "preprocessor_config.json" || n == "chat_template.json"
            }),
            "{case}: remote code and processor files are not copied"
        );
    }
}

#[test]
fn both_qwen3_vl_moe_orientations_give_identical_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let fam = root().join("tests/fixtures/families");
    let (a, b) = (tmp.path().join("5x"), tmp.path().join("hub"));
    for (src, out) in [("qwen3_vl_moe-5x", &a), ("qwen3_vl_moe-hub", &b)] {
        let o = extract(&fam.join(src), out, &[]);
        assert!(o.status.success(), "{src}: {}", stderr(&o));
    }
    let bytes = |d: &Path| fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(bytes(&a), bytes(&b), "model.safetensors differ");
    // The 5.x layout is copied by byte ranges, the Hub layout transposed: same 24 expert tensors.
    assert!(tensor_digests(&a)
        .keys()
        .any(|n| n == "model.layers.1.mlp.experts.3.down_proj.weight"));
}

#[test]
fn output_bytes_do_not_depend_on_threads_or_shard_size_beyond_sharding() {
    let tmp = tempfile::tempdir().unwrap();
    let src = root().join("tests/fixtures/families/qwen3_vl_moe-hub");
    let mut trees = Vec::new();
    for threads in ["1", "2"] {
        let out = tmp.path().join(format!("t{threads}"));
        let o = sinkmerge([
            "--threads",
            threads,
            "extract",
            src.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--max-shard-size",
            "8k",
            "-q",
        ])
        .output();
        assert!(o.status.success(), "{}", stderr(&o));
        let mut files: Vec<(String, Vec<u8>)> = fs::read_dir(&out)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                let bytes = if name == "README.md" {
                    Vec::new() // names the output directory
                } else {
                    fs::read(e.path()).unwrap()
                };
                (name, bytes)
            })
            .collect();
        files.sort();
        assert!(
            files
                .iter()
                .any(|(n, _)| n == "model.safetensors.index.json"),
            "sharded"
        );
        trees.push(files);
    }
    assert_eq!(trees[0], trees[1]);
    // Sharded output holds the same tensors as the single-file one.
    let single = tmp.path().join("single");
    assert!(extract(&src, &single, &[]).status.success());
    assert_eq!(
        tensor_digests(&single),
        tensor_digests(&tmp.path().join("t1"))
    );
}

#[test]
fn json_summary_and_text_report() {
    let tmp = tempfile::tempdir().unwrap();
    let src = root().join("tests/fixtures/models/qwen2_5_vl");
    let o = extract(&src, &tmp.path().join("a"), &[]);
    let s: Value = serde_json::from_slice(&o.stdout).unwrap();
    for key in [
        "source",
        "family",
        "architecture",
        "output",
        "tensors_written",
        "tensors_kept",
        "dropped",
        "bytes_written",
        "shards",
        "tie_word_embeddings",
        "files",
        "chat_template",
        "verified",
        "seconds",
    ] {
        assert!(s.get(key).is_some(), "missing `{key}` in {s}");
    }
    assert!(s["dropped"]["vision"]["tensors"].as_u64().unwrap() > 0);
    assert!(s["dropped"]["projector"]["tensors"].as_u64().unwrap() > 0);
    let o = sinkmerge([
        "extract",
        src.to_str().unwrap(),
        "-o",
        tmp.path().join("b").to_str().unwrap(),
        "--no-verify",
    ])
    .output();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success());
    assert!(
        text.contains("dropped: vision tower") && text.contains("not verified"),
        "{text}"
    );
}

#[test]
fn default_output_is_named_after_the_directory_alias_or_repo() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path().join("work");
    fs::create_dir(&cwd).unwrap();
    let src = root().join("tests/fixtures/families/qwen2_vl");
    let o = sinkmerge(["extract", src.to_str().unwrap(), "-q"])
        .current_dir(&cwd)
        .output();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(cwd.join("qwen2_vl-lm/model.safetensors").is_file());

    // `qwen2.5-vl` resolves through the HF cache: models--ORG--NAME/snapshots/<refs/main>.
    let cache = tmp.path().join("hub");
    fake_hub_cache(
        &cache,
        "Qwen/Qwen2.5-VL-7B-Instruct",
        "0123abcd",
        &["main"],
        &root().join("tests/fixtures/models/qwen2_5_vl"),
    );
    let o = sinkmerge(["extract", "qwen2.5-vl", "-q"])
        .current_dir(&cwd)
        .env("HF_HUB_CACHE", &cache)
        .output();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(cwd.join("qwen2.5-vl-lm/config.json").is_file());
    let o = sinkmerge(["extract", "Qwen/Qwen2.5-VL-7B-Instruct", "-q"])
        .current_dir(&cwd)
        .env("HF_HUB_CACHE", &cache)
        .output();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(cwd.join("Qwen2.5-VL-7B-Instruct-lm/config.json").is_file());
    assert_only(
        &cwd,
        &["Qwen2.5-VL-7B-Instruct-lm", "qwen2.5-vl-lm", "qwen2_vl-lm"],
    );
}

#[test]
fn inspect_reports_the_family_of_every_fixture() {
    for (case, g) in goldens() {
        let src = root().join(g["dir"].as_str().unwrap());
        let o = sinkmerge(["inspect", src.to_str().unwrap(), "--json"]).output();
        assert!(o.status.success(), "{case}: {}", stderr(&o));
        let r: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(r["family"], g["family"], "{case}");
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input: exit 2, one clear message naming file and tensor, nothing written.
// ---------------------------------------------------------------------------------------------

/// Rewrite `dir/model.safetensors` keeping only the tensors `keep` accepts.
fn filter_tensors(dir: &Path, keep: impl Fn(&str) -> bool) {
    let path = dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| keep(n)).collect();
    let out = safetensors::serialize(views, None).unwrap();
    fs::write(&path, out).unwrap();
}

#[test]
fn a_vlm_missing_a_language_tensor_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("vlm");
    copy_dir(&root().join("tests/fixtures/models/qwen3_vl"), &src);
    let gone = "model.language_model.layers.1.mlp.up_proj.weight";
    filter_tensors(&src, |n| n != gone);
    let o = extract(&src, &tmp.path().join("out"), &[]);
    refused(&o, &["model.layers.1.mlp.up_proj.weight", gone, "missing"]);
    assert_only(tmp.path(), &["vlm"]);
}

#[test]
fn a_truncated_shard_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("vlm");
    copy_dir(&root().join("tests/fixtures/families/llava_next"), &src);
    let path = src.join("model.safetensors");
    let len = fs::metadata(&path).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let o = extract(&src, &tmp.path().join("out"), &[]);
    refused(&o, &["model.safetensors"]);
    assert_only(tmp.path(), &["vlm"]);
}

#[test]
fn an_unknown_family_lists_the_supported_ones() {
    let tmp = tempfile::tempdir().unwrap();
    // A plain causal LM: nothing to extract.
    let o = extract(
        &root().join("tests/fixtures/models/qwen2"),
        &tmp.path().join("out"),
        &[],
    );
    refused(
        &o,
        &[
            "cannot tell which VLM family",
            "plain language model",
            "qwen2.5-vl",
            "molmoe",
            "--family",
        ],
    );
    // A VLM of no supported family.
    let src = tmp.path().join("vlm");
    copy_dir(&root().join("tests/fixtures/models/qwen2_5_vl"), &src);
    let cfg = fs::read_to_string(src.join("config.json")).unwrap();
    fs::write(
        src.join("config.json"),
        cfg.replace("qwen2_5_vl", "fancy_vl")
            .replace("Qwen2_5_VL", "Fancy"),
    )
    .unwrap();
    let o = extract(&src, &tmp.path().join("out"), &[]);
    refused(&o, &["`fancy_vl`", "internvl", "minicpm-v"]);
    // A family name clap does not know: usage error, exit 2, with the possible values.
    let o = extract(&src, &tmp.path().join("out"), &["--family", "gpt4v"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("qwen3-vl-moe"), "{}", stderr(&o));
    assert_only(tmp.path(), &["vlm"]);
}

#[test]
fn a_wrong_family_names_the_first_foreign_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let o = extract(
        &root().join("tests/fixtures/models/qwen2_5_vl"),
        &tmp.path().join("out"),
        &["--family", "idefics3"],
    );
    refused(
        &o,
        &["model.safetensors", "not part of the idefics3 layout"],
    );
    assert_only(tmp.path(), &[]);
}

#[test]
fn out_equal_to_or_inside_source_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("vlm");
    copy_dir(&root().join("tests/fixtures/families/ovis2"), &src);
    let before = tensor_digests(&src);
    let listing = |d: &Path| {
        let mut v: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let files = listing(&src);
    for out in [
        src.clone(),
        src.join("lm"),
        src.join("."),
        tmp.path().join("x/../vlm"),
    ] {
        let o = extract(&src, &out, &["--force"]);
        refused(&o, &["input", "vlm"]);
    }
    assert_eq!(listing(&src), files);
    assert_eq!(tensor_digests(&src), before);
    assert_only(tmp.path(), &["vlm"]);
}

#[test]
fn ambiguous_expert_shapes_are_refused() {
    // hidden 8 = 2 * expert width 4: [E, 8, 8] reads both as [E, 2I, H] and [E, H, 2I].
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("vlm");
    fs::create_dir(&src).unwrap();
    fs::write(
        src.join("config.json"),
        r#"{"model_type": "qwen3_vl_moe", "tie_word_embeddings": false,
            "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 8, "intermediate_size": 16,
                            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "head_dim": 4, "vocab_size": 10, "num_experts": 2, "num_experts_per_tok": 1,
                            "moe_intermediate_size": 4}}"#,
    )
    .unwrap();
    let data = vec![0u8; 2 * 8 * 8 * 2];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![2, 8, 8], &data)
        .unwrap();
    let bytes = safetensors::serialize(
        [(
            "model.language_model.layers.0.mlp.experts.gate_up_proj",
            view,
        )],
        None,
    )
    .unwrap();
    fs::write(src.join("model.safetensors"), bytes).unwrap();
    let o = extract(&src, &tmp.path().join("out"), &[]);
    refused(&o, &["gate_up_proj", "refusing to guess"]);
    assert_only(tmp.path(), &["vlm"]);
}

#[test]
fn a_tie_flag_contradicting_a_distinct_head_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("vlm");
    copy_dir(&root().join("tests/fixtures/models/qwen3_vl"), &src);
    let mut cfg: Value = read_json(src.join("config.json"));
    cfg["text_config"]["tie_word_embeddings"] = Value::Bool(true);
    fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    let o = extract(&src, &tmp.path().join("out"), &[]);
    refused(&o, &["lm_head.weight", "tie_word_embeddings"]);
    assert_only(tmp.path(), &["vlm"]);
}

#[test]
fn an_existing_output_needs_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("keep.txt"), "mine").unwrap();
    let src = root().join("tests/fixtures/families/qwen2_vl");
    refused(&extract(&src, &out, &[]), &["--force"]);
    assert_eq!(fs::read_to_string(out.join("keep.txt")).unwrap(), "mine");
    assert!(extract(&src, &out, &["--force"]).status.success());
    assert!(!out.join("keep.txt").exists() && out.join("model.safetensors").is_file());
    assert_only(tmp.path(), &["out"]);
}

#[test]
fn a_fused_projection_that_does_not_match_the_config_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("vlm");
    copy_dir(&root().join("tests/fixtures/families/molmo2-o"), &src);
    let mut cfg: Value = read_json(src.join("config.json"));
    cfg["text_config"]["num_key_value_heads"] = Value::from(2);
    fs::write(src.join("config.json"), cfg.to_string()).unwrap();
    let o = extract(&src, &tmp.path().join("out"), &[]);
    refused(
        &o,
        &[
            "model.transformer.blocks.0.self_attn.att_proj.weight",
            "rows",
        ],
    );
    assert_only(tmp.path(), &["vlm"]);
}

#[test]
fn a_saved_rotary_buffer_is_dropped_not_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("vlm");
    copy_dir(&root().join("tests/fixtures/models/qwen2_5_vl"), &src);
    let path = src.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let inv_freq = vec![0u8; 8 * 4];
    let mut views = st.tensors();
    views.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![8], &inv_freq).unwrap(),
    ));
    let out_bytes = safetensors::serialize(views, None).unwrap();
    fs::write(&path, out_bytes).unwrap();
    let o = extract(&src, &tmp.path().join("out"), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["dropped"]["other"]["tensors"], Value::from(1));
    assert_eq!(
        tensor_digests(&tmp.path().join("out")),
        tensor_digests(&{
            let plain = tmp.path().join("plain");
            assert!(extract(
                &root().join("tests/fixtures/models/qwen2_5_vl"),
                &plain,
                &[]
            )
            .status
            .success());
            plain
        })
    );
}

#[test]
fn the_model_card_names_a_cached_source_with_its_commit_and_replays() {
    let tmp = tempfile::tempdir().unwrap();
    // An HF cache as the Hub client writes it: refs/main and a snapshot of symlinks.
    let cache = tmp.path().join("hub");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let src = root().join("tests/fixtures/models/qwen2_5_vl");
    fake_hub_cache(&cache, "Org/Tiny-VL", commit, &["main"], &src);
    let out = tmp.path().join("tiny-lm");
    let o = sinkmerge(["extract", "Org/Tiny-VL", "-o", out.to_str().unwrap(), "-q"])
        .env("HF_HUB_CACHE", &cache)
        .output();
    assert!(o.status.success(), "{}", stderr(&o));
    let (meta, body) = model_card(&out);
    assert_eq!(strings(&meta["base_model"]), ["Org/Tiny-VL"]);
    assert!(meta.get("base_model_relation").is_none(), "{meta:?}");
    assert_eq!(strings(&meta["tags"]), ["sinkmerge", "extraction"]);
    assert_eq!(meta["library_name"], "transformers");
    assert!(body.starts_with("\n# tiny-lm\n"), "{body}");
    assert!(
        body.contains(&format!(
            "| source | [Org/Tiny-VL](https://huggingface.co/Org/Tiny-VL) | `{commit}` |"
        )),
        "{body}"
    );
    let again = tmp.path().join("again");
    let replay = replay_args(&body, &again);
    assert_eq!(
        replay,
        [
            "extract",
            &format!("Org/Tiny-VL@{commit}"),
            "--family",
            "qwen2.5-vl",
            "-o",
            again.to_str().unwrap()
        ]
    );
    let replay: Vec<&str> = replay.iter().map(String::as_str).collect();
    let o = sinkmerge(&replay).env("HF_HUB_CACHE", &cache).output();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(tensor_digests(&out), tensor_digests(&again));
}

#[test]
fn a_local_source_is_listed_by_path_and_no_model_card_writes_none() {
    let tmp = tempfile::tempdir().unwrap();
    let src = root().join("tests/fixtures/families/qwen2_vl");
    let out = tmp.path().join("a");
    let o = extract(&src, &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(summary["files"]
        .as_array()
        .unwrap()
        .contains(&"README.md".into()));
    let (meta, body) = model_card(&out);
    assert!(meta.get("base_model").is_none(), "{meta:?}");
    assert_eq!(strings(&meta["tags"]), ["sinkmerge", "extraction"]);
    assert_eq!(meta["library_name"], "transformers");
    let path = fs::canonicalize(&src).unwrap();
    assert!(
        body.contains(&format!(
            "| source | `{}` | local directory |",
            path.display()
        )),
        "{body}"
    );
    assert!(
        body.contains(&format!(
            "```sh\nsinkmerge extract {} --family qwen2-vl -o OUT\n```",
            path.display()
        )),
        "{body}"
    );

    let bare = tmp.path().join("b");
    let o = extract(&src, &bare, &["--no-model-card"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(!summary["files"]
        .as_array()
        .unwrap()
        .contains(&"README.md".into()));
    assert!(!bare.join("README.md").exists());
    let listing = |d: &Path| {
        let mut v: Vec<(String, Vec<u8>)> = fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    fs::read(e.path()).unwrap(),
                )
            })
            .filter(|(n, _)| n != "README.md")
            .collect();
        v.sort();
        v
    };
    assert_eq!(listing(&out), listing(&bare), "only README.md differs");
}
