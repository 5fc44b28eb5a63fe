//! Helpers shared by the integration tests of the paper's controls (predict, perturb, ablate,
//! inject-qknorm), and the model-card readers extract and merge use too: run the real binary, read
//! model directories back, and build derived models.
#![allow(dead_code)] // each test file uses a different subset

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use sinkmerge::dtype;

/// A tensor as stored: dtype, shape, raw bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl Stored {
    pub fn f32(&self) -> Vec<f32> {
        dtype::decode(self.dtype, &self.bytes, "test").unwrap()
    }

    pub fn from_f32(dtype: Dtype, shape: Vec<usize>, values: &[f32]) -> Stored {
        Stored {
            dtype,
            shape,
            bytes: dtype::encode(dtype, values).unwrap(),
        }
    }
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

pub fn sinkmerge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sinkmerge"))
        .args(args)
        .output()
        .expect("the binary runs")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Run, expect success, return stdout.
pub fn ok(args: &[&str]) -> String {
    let o = sinkmerge(args);
    assert!(
        o.status.success(),
        "sinkmerge {args:?} failed: {}",
        stderr(&o)
    );
    stdout(&o)
}

/// Run, expect exit code 2 with one error line, return it.
pub fn bad_input(args: &[&str]) -> String {
    let o = sinkmerge(args);
    assert_eq!(
        o.status.code(),
        Some(2),
        "sinkmerge {args:?}: stdout {} stderr {}",
        stdout(&o),
        stderr(&o)
    );
    let err = stderr(&o);
    assert_eq!(err.trim_end().lines().count(), 1, "one error line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Every tensor of a model directory (all `*.safetensors` files).
pub fn load(dir: &Path) -> BTreeMap<String, Stored> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                let prev = out.insert(
                    name.clone(),
                    Stored {
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                        bytes: view.data().to_vec(),
                    },
                );
                assert!(prev.is_none(), "{name} twice");
            }
        }
    }
    out
}

/// Write a single-file model directory with `config` and `tensors`, plus the tokenizer files of
/// `aux_from` (if given).
pub fn write_model(
    dir: &Path,
    config: &serde_json::Value,
    tensors: &BTreeMap<String, Stored>,
    aux_from: Option<&Path>,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap(),
            )
        })
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(meta), &dir.join("model.safetensors"))
        .unwrap();
    if let Some(from) = aux_from {
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            if from.join(f).exists() {
                std::fs::copy(from.join(f), dir.join(f)).unwrap();
            }
        }
    }
}

pub fn config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

pub fn frobenius(x: &[f32]) -> f64 {
    x.iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt()
}

pub fn diff(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x - y).collect()
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    dot / (frobenius(a) * frobenius(b))
}

/// Names under the output directory's parent that the writer leaves while working; a failed
/// command must leave none.
pub fn leftovers(parent: &Path) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("sinkmerge-partial"))
        .collect()
}

/// Run with extra environment variables, expect success, return stdout.
pub fn ok_env(args: &[&str], env: &[(&str, &Path)]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sinkmerge"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("the binary runs");
    assert!(
        o.status.success(),
        "sinkmerge {args:?} failed: {}",
        stderr(&o)
    );
    stdout(&o)
}

/// The README.md model card of a model directory: its YAML front matter, parsed, and the body.
pub fn model_card(dir: &Path) -> (serde_yaml_ng::Value, String) {
    let text = std::fs::read_to_string(dir.join("README.md")).unwrap();
    let rest = text.strip_prefix("---\n").expect("the card opens with ---");
    let (yaml, body) = rest
        .split_once("\n---\n")
        .expect("front matter closed by ---");
    (serde_yaml_ng::from_str(yaml).unwrap(), body.to_string())
}

/// A YAML list of strings.
pub fn strings(v: &serde_yaml_ng::Value) -> Vec<String> {
    v.as_sequence()
        .unwrap_or_else(|| panic!("not a list: {v:?}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// The card's replay command (its ```sh block) as arguments after `sinkmerge`, with `OUT`
/// replaced by `out`.
pub fn replay_args(body: &str, out: &Path) -> Vec<String> {
    let block = body
        .split_once("```sh\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .expect("a replay block")
        .0;
    let mut words = block.split_whitespace();
    assert_eq!(words.next(), Some("sinkmerge"), "{block}");
    words
        .map(|w| match w {
            "OUT" => out.to_str().unwrap().to_string(),
            w => w.to_string(),
        })
        .collect()
}

/// An HF hub cache in `cache` holding `model`'s files as `repo` (`ORG/NAME`) at `commit`:
/// `models--ORG--NAME/refs/main` and `snapshots/<commit>/` of symlinks, as the Hub client writes.
pub fn fake_hub_cache(cache: &Path, repo: &str, commit: &str, model: &Path) {
    let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = repo_dir.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::write(repo_dir.join("refs/main"), commit).unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let path = entry.unwrap().path();
        std::os::unix::fs::symlink(&path, snapshot.join(path.file_name().unwrap())).unwrap();
    }
}
