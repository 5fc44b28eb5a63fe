//! `sinkmerge inject-qknorm`: a Qwen2 checkpoint becomes a Qwen3 one with unit QK norms, every
//! original tensor byte-identical.

use std::path::Path;

use crate::util::*;
use safetensors::Dtype;
use serde_json::{json, Value};

fn inject(model: &Path, out: &Path) -> Value {
    sinkmerge([
        "inject-qknorm",
        model.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--json",
    ])
    .json()
}

/// Everything the output must satisfy for a Qwen2 input with `layers`, `hidden`, `head_dim`.
fn check(model: &Path, out: &Path, dtype: Dtype, layers: usize, hidden: usize, head_dim: usize) {
    let (before, after) = (load(model), load(out));
    for (name, t) in &before {
        assert_eq!(&after[name], t, "{name} must be byte-identical");
    }
    assert_eq!(after.len(), before.len() + 3 * layers);
    for l in 0..layers {
        for (suffix, len, value) in [
            ("self_attn.q_norm.weight", head_dim, 1.0),
            ("self_attn.k_norm.weight", head_dim, 1.0),
            ("self_attn.o_proj.bias", hidden, 0.0),
        ] {
            let name = format!("model.layers.{l}.{suffix}");
            let t = &after[&name];
            assert_eq!((t.dtype, t.shape.clone()), (dtype, vec![len]), "{name}");
            assert!(t.f32().iter().all(|&v| v == value), "{name}");
        }
    }
    let (c2, c3) = (config(model), config(out));
    assert_eq!(c3["architectures"], json!(["Qwen3ForCausalLM"]));
    assert_eq!(c3["model_type"], "qwen3");
    assert_eq!(c3["attention_bias"], true);
    assert_eq!(c3["head_dim"], head_dim);
    for (key, value) in c2.as_object().unwrap() {
        if !["architectures", "model_type"].contains(&key.as_str()) {
            assert_eq!(&c3[key], value, "config key {key} is kept");
        }
    }
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert_eq!(
            std::fs::read(model.join(f)).unwrap(),
            std::fs::read(out.join(f)).unwrap(),
            "{f}"
        );
    }
    // The output is a per-head QK-norm model to sinkmerge's own reader.
    let inspected: Value =
        sinkmerge(["inspect", out.to_str().unwrap(), "--json", "--check"]).json();
    assert_eq!(inspected["qk_norm"], "per-head");
    assert_eq!(inspected["architecture"], "Qwen3ForCausalLM");
}

#[test]
fn qwen2_becomes_qwen3_with_unit_qk_norms() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2");
    let out = tmp.path().join("qwen2-qknorm");
    let report = inject(&model, &out);
    assert_eq!(report["head_dim"], 16);
    assert_eq!(report["added"].as_array().unwrap().len(), 6);
    check(&model, &out, Dtype::F32, 2, 64, 16);
    assert!(config(&out)["tie_word_embeddings"] == true);
}

#[test]
fn sharded_bf16_input_with_a_4x_config() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-sharded");
    let out = tmp.path().join("o");
    inject(&model, &out);
    let c = config(&model);
    assert!(c.get("rope_theta").is_some() && c.get("torch_dtype").is_some());
    let hidden = c["hidden_size"].as_u64().unwrap() as usize;
    let heads = c["num_attention_heads"].as_u64().unwrap() as usize;
    let layers = c["num_hidden_layers"].as_u64().unwrap() as usize;
    check(&model, &out, Dtype::BF16, layers, hidden, hidden / heads);
}

#[test]
fn inputs_that_are_not_plain_qwen2_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    let o = out.to_str().unwrap();
    for (fixture_name, needle) in [
        ("qwen3", "already has per-head QK norm"),
        ("olmo3", "not model_type `olmo3`"),
        ("llama31-tied", "not model_type `llama`"),
        ("qwen2_5_vl", "vision-language model (family qwen2.5-vl)"),
    ] {
        let err = sinkmerge([
            "inject-qknorm",
            fixture(fixture_name).to_str().unwrap(),
            "-o",
            o,
        ])
        .refused(&[]);
        assert!(err.contains(needle), "{fixture_name}: {err}");
    }

    // A qwen2-typed checkpoint that already carries q/k norm tensors.
    let model = fixture("qwen2");
    let mut tensors = load(&model);
    tensors.insert(
        "model.layers.0.self_attn.q_norm.weight".into(),
        Stored::from_f32(Dtype::F32, vec![16], &[1.0; 16]),
    );
    let with_norms = tmp.path().join("with-norms");
    write_model(&with_norms, &config(&model), &tensors, None);
    let err = sinkmerge(["inject-qknorm", with_norms.to_str().unwrap(), "-o", o]).refused(&[]);
    assert!(
        err.contains("already has QK norms") && err.contains("q_norm"),
        "{err}"
    );

    // A Qwen2 checkpoint without its q/k/v biases is not a Qwen2.
    let mut tensors = load(&model);
    tensors.remove("model.layers.1.self_attn.k_proj.bias");
    let no_bias = tmp.path().join("no-bias");
    write_model(&no_bias, &config(&model), &tensors, None);
    let err = sinkmerge(["inject-qknorm", no_bias.to_str().unwrap(), "-o", o]).refused(&[]);
    assert!(
        err.contains("model.layers.1.self_attn.k_proj.bias"),
        "{err}"
    );

    let err = sinkmerge([
        "inject-qknorm",
        model.to_str().unwrap(),
        "-o",
        model.to_str().unwrap(),
    ])
    .refused(&[]);
    assert!(err.contains("is input"), "{err}");
    assert!(!out.exists());
    assert!(leftovers(tmp.path()).is_empty());
}

#[test]
fn the_model_card_names_the_hub_model_and_its_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let commit = "4c1d2e3f00000000000000000000000000000abc";
    fake_hub_cache(
        &cache,
        "Org/Tiny-Qwen2",
        commit,
        &["main"],
        &fixture("qwen2"),
    );
    let out = tmp.path().join("o");
    sinkmerge([
        "inject-qknorm",
        "Org/Tiny-Qwen2",
        "-o",
        out.to_str().unwrap(),
    ])
    .env("HF_HUB_CACHE", &cache)
    .ok();
    let (meta, body) = model_card(&out);
    assert_eq!(strings(&meta["base_model"]), ["Org/Tiny-Qwen2"]);
    assert!(meta.get("base_model_relation").is_none(), "{meta:?}");
    assert_eq!(strings(&meta["tags"]), ["sinkmerge", "qk-norm-injection"]);
    assert_eq!(meta["library_name"], "transformers");
    assert!(
        body.contains(&format!(
            "| model | [Org/Tiny-Qwen2](https://huggingface.co/Org/Tiny-Qwen2) | `{commit}` |"
        )),
        "{body}"
    );
    let again = tmp.path().join("again");
    let replay = replay_args(&body, &again);
    assert_eq!(
        replay,
        [
            "inject-qknorm",
            &format!("Org/Tiny-Qwen2@{commit}"),
            "-o",
            again.to_str().unwrap()
        ]
    );
    let replay: Vec<&str> = replay.iter().map(String::as_str).collect();
    sinkmerge(&replay).env("HF_HUB_CACHE", &cache).ok();
    assert_eq!(load(&out), load(&again));

    let bare = tmp.path().join("bare");
    sinkmerge([
        "inject-qknorm",
        fixture("qwen2").to_str().unwrap(),
        "-o",
        bare.to_str().unwrap(),
        "--no-model-card",
    ])
    .ok();
    assert!(!bare.join("README.md").exists());
    assert_eq!(load(&out), load(&bare));
}
