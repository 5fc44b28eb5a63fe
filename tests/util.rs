//! Helpers shared by the integration tests: run the real binary with the Hugging Face
//! environment isolated, find the fixtures, read JSON and model directories back, and build derived
//! models.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::de::DeserializeOwned;
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

/// The repository root, where `cargo test` runs the tests.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `tests/fixtures`.
pub fn fixtures() -> PathBuf {
    root().join("tests/fixtures")
}

/// A model directory of `tests/fixtures/models`.
pub fn fixture(name: &str) -> PathBuf {
    fixtures().join("models").join(name)
}

/// A model directory of `tests/fixtures/score/models`, the scorer's extra architectures.
pub fn score_fixture(name: &str) -> PathBuf {
    fixtures().join("score/models").join(name)
}

/// A JSON file, parsed.
pub fn read_json<T: DeserializeOwned>(path: impl AsRef<Path>) -> T {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not the JSON expected: {e}", path.display()))
}

/// The Hugging Face variables a run starts without, and sinkmerge's own Hub limits
/// (docs/reference/hub.md): a token, a token file, another endpoint, offline mode or a limit of
/// the user's must not change what a test sees.
pub const CLEARED_HF_VARIABLES: [&str; 7] = [
    "HF_TOKEN",
    "HF_TOKEN_PATH",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_HUB_DOWNLOAD_TIMEOUT",
    "SINKMERGE_HUB_MIN_SPEED",
    "SINKMERGE_HUB_SPEED_TIME",
];

/// One run of the `sinkmerge` binary, built up like a [`Command`]. `HF_HOME` and `HF_HUB_CACHE`
/// point into an empty temporary directory of this run and the [`CLEARED_HF_VARIABLES`] are unset,
/// so that no test reads or writes the user's cache or reaches the network by accident; a test
/// that means to sets them again with [`Sinkmerge::env`] or unsets them with
/// [`Sinkmerge::env_remove`].
pub struct Sinkmerge {
    command: Command,
    /// Shown when a run fails.
    args: Vec<String>,
    /// Removed when the run ends.
    _hf_home: tempfile::TempDir,
}

/// `sinkmerge ARGS`, run from the repository root.
pub fn sinkmerge<I, S>(args: I) -> Sinkmerge
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let hf_home = tempfile::tempdir().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_sinkmerge"));
    command
        .current_dir(root())
        .env("HF_HOME", hf_home.path())
        .env("HF_HUB_CACHE", hf_home.path().join("hub"));
    for name in CLEARED_HF_VARIABLES {
        command.env_remove(name);
    }
    Sinkmerge {
        command,
        args: Vec::new(),
        _hf_home: hf_home,
    }
    .args(args)
}

impl Sinkmerge {
    pub fn args<I, S>(mut self, args: I) -> Sinkmerge
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        for arg in args {
            self.args.push(arg.as_ref().to_string_lossy().into_owned());
            self.command.arg(arg);
        }
        self
    }

    pub fn env(mut self, key: &str, value: impl AsRef<OsStr>) -> Sinkmerge {
        self.command.env(key, value);
        self
    }

    pub fn envs<I, K, V>(mut self, vars: I) -> Sinkmerge
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        self.command.envs(vars);
        self
    }

    pub fn env_remove(mut self, key: &str) -> Sinkmerge {
        self.command.env_remove(key);
        self
    }

    pub fn current_dir(mut self, dir: impl AsRef<Path>) -> Sinkmerge {
        self.command.current_dir(dir);
        self
    }

    /// The size of rayon's thread pool (`RAYON_NUM_THREADS`).
    pub fn threads(self, threads: &str) -> Sinkmerge {
        self.env("RAYON_NUM_THREADS", threads)
    }

    pub fn output(mut self) -> Output {
        self.command.output().expect("the binary runs")
    }

    /// Run, expect success, return stdout.
    pub fn ok(self) -> String {
        let (args, output) = self.output_and_args();
        assert!(
            output.status.success(),
            "sinkmerge {args:?}: exit {:?}: {}",
            output.status.code(),
            stderr(&output)
        );
        stdout(&output)
    }

    /// Run, expect success with a `sinkmerge: warning:` on stderr naming every one of `needles`;
    /// return stdout and stderr.
    pub fn warns(self, needles: &[&str]) -> (String, String) {
        let (args, output) = self.output_and_args();
        let err = stderr(&output);
        assert!(output.status.success(), "sinkmerge {args:?}: {err}");
        assert!(err.contains("sinkmerge: warning:"), "no warning: {err}");
        for needle in needles {
            assert!(err.contains(needle), "`{needle}` not in: {err}");
        }
        (stdout(&output), err)
    }

    /// Run, expect success and JSON on stdout.
    pub fn json(self) -> serde_json::Value {
        serde_json::from_str(&self.ok()).expect("JSON on stdout")
    }

    /// Run, expect it [`refused`] with `needles`, return the error line.
    pub fn refused(self, needles: &[&str]) -> String {
        refused(&self.exit(2), needles)
    }

    /// Run, expect exit code 2 as [`refused`] does but allow the usage lines that clap adds after
    /// an argument error; return stderr.
    pub fn refused_with_usage(self, needles: &[&str]) -> String {
        exit_naming(&self.exit(2), 2, needles)
    }

    /// Run, expect it failed on NaN or Inf as [`non_finite`] says, return the error line.
    pub fn non_finite(self, needles: &[&str]) -> String {
        non_finite(&self.exit(3), needles)
    }

    /// Run, expect exit code `code` (else name the arguments).
    fn exit(self, code: i32) -> Output {
        let (args, output) = self.output_and_args();
        assert_eq!(
            output.status.code(),
            Some(code),
            "sinkmerge {args:?}: {}",
            stderr(&output)
        );
        output
    }

    /// Run with `input` on standard input, killed past `limit`: the output (`None` when it had to
    /// be killed, say blocked on a FIFO) and the peak resident memory in KiB (`VmHWM` of
    /// `/proc/PID/status`, sampled while it runs).
    pub fn watch(mut self, input: &[u8], limit: std::time::Duration) -> (Option<Output>, u64) {
        use std::io::{Read, Write};
        use std::process::Stdio;
        let mut child = self
            .command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary runs");
        let status_file = format!("/proc/{}/status", child.id());
        let mut stdin = child.stdin.take().unwrap();
        let input = input.to_vec();
        // A run that stops reading early closes the pipe; that is not the test's failure.
        let writer = std::thread::spawn(move || drop(stdin.write_all(&input)));
        let drain = |mut pipe: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                pipe.read_to_end(&mut bytes).unwrap();
                bytes
            })
        };
        let stdout = drain(Box::new(child.stdout.take().unwrap()));
        let stderr = drain(Box::new(child.stderr.take().unwrap()));
        let started = std::time::Instant::now();
        let mut peak = 0;
        let status = loop {
            if let Ok(text) = std::fs::read_to_string(&status_file) {
                let hwm = text
                    .lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
                peak = peak.max(hwm.unwrap_or(0));
            }
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if started.elapsed() > limit {
                child.kill().unwrap();
                child.wait().unwrap();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        writer.join().unwrap();
        let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
        let output = status.map(|status| Output {
            status,
            stdout,
            stderr,
        });
        (output, peak)
    }

    fn output_and_args(self) -> (Vec<String>, Output) {
        let args = self.args.clone();
        (args, self.output())
    }
}

/// Expect success (else show stderr), return stdout.
pub fn ok(output: &Output) -> String {
    assert!(
        output.status.success(),
        "exit {:?}: {}",
        output.status.code(),
        stderr(output)
    );
    stdout(output)
}

/// Exit code 2 with one error line that names every one of `needles`, no panic, nothing on
/// stdout: how every command refuses bad input. Returns the error line.
pub fn refused(output: &Output, needles: &[&str]) -> String {
    one_line(exit_naming(output, 2, needles))
}

/// Exit code 3 with one error line that names every one of `needles`, no panic, nothing on
/// stdout: how every command stops on NaN or Inf, in an input or produced by the arithmetic.
pub fn non_finite(output: &Output, needles: &[&str]) -> String {
    one_line(exit_naming(output, 3, needles))
}

fn one_line(err: String) -> String {
    assert_eq!(err.trim_end().lines().count(), 1, "one error line: {err}");
    err
}

/// Exit code `code`, stderr naming every one of `needles`, no panic, nothing on stdout.
fn exit_naming(output: &Output, code: i32, needles: &[&str]) -> String {
    let err = stderr(output);
    assert_eq!(
        output.status.code(),
        Some(code),
        "stdout {} stderr {err}",
        stdout(output)
    );
    for needle in needles {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        output.stdout.is_empty(),
        "nothing on stdout on error: {}",
        stdout(output)
    );
    err
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
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
    read_json(dir.join("config.json"))
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

/// An HF hub cache in `cache` holding `model`'s files as `repo` (`ORG/NAME`) at `commit`, which
/// each of `refs` (branch or tag names) points to: `models--ORG--NAME/refs/REF` and
/// `snapshots/<commit>/` of symlinks, as the Hub client writes them (docs/reference/hub.md).
pub fn fake_hub_cache(cache: &Path, repo: &str, commit: &str, refs: &[&str], model: &Path) {
    let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = repo_dir.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let path = entry.unwrap().path();
        std::os::unix::fs::symlink(&path, snapshot.join(path.file_name().unwrap())).unwrap();
    }
    for name in refs {
        std::fs::write(repo_dir.join("refs").join(name), commit).unwrap();
    }
}
