//! Every command reports through the writer its `run` is handed, never straight to stdout: a
//! `reproduce` step saves what its command wrote to the writer as the step's report, so a report
//! printed around the writer would be lost. Each command that has `--json` runs through the
//! library entry with a buffer for its writer while the process's stdout (fd 1) is a file; the
//! file must stay empty and every buffer must hold one JSON document.
//!
//! fd 1 belongs to the whole process, and the test harness writes its own lines there, so the
//! commands run in a child: this test's own binary, rerun with only this test selected.

use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use sinkmerge::cli::Cli;

use crate::util::{root, CLEARED_HF_VARIABLES};

/// Set in the child: the file its fd 1 is redirected to.
const CHILD_STDOUT: &str = "SINKMERGE_TEST_REPORT_WRITER_STDOUT";
/// The Hub repo the child's cache holds, for `fetch`.
const CACHED_REPO: &str = "test-org/tiny-qwen3";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[test]
fn every_json_report_goes_through_the_writer() {
    if let Some(file) = std::env::var_os(CHILD_STDOUT) {
        run_every_command(Path::new(&file));
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let stdout_file = tmp.path().join("stdout");
    let hf_home = tmp.path().join("hf");
    cache_a_model(&hf_home.join("hub"));
    let mut child = Command::new(std::env::current_exe().unwrap());
    child
        .args([
            "--exact",
            "report_writer::every_json_report_goes_through_the_writer",
            "--nocapture",
            "--test-threads=1",
        ])
        .current_dir(root())
        .env(CHILD_STDOUT, &stdout_file)
        .env("HF_HOME", &hf_home)
        .env("HF_HUB_CACHE", hf_home.join("hub"));
    for name in CLEARED_HF_VARIABLES {
        child.env_remove(name);
    }
    let output = child.output().unwrap();
    assert!(
        output.status.success(),
        "the child failed: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&fs::read(&stdout_file).unwrap_or_default())
    );
    let leaked = fs::read(&stdout_file).unwrap();
    assert!(
        leaked.is_empty(),
        "reached stdout around the writer: {}",
        String::from_utf8_lossy(&leaked)
    );
}

/// `CACHED_REPO` in a Hugging Face cache layout (refs/main naming a snapshot folder).
fn cache_a_model(hub: &Path) {
    let repo = hub.join(format!("models--{}", CACHED_REPO.replace('/', "--")));
    let snapshot = repo.join("snapshots").join(COMMIT);
    fs::create_dir_all(&snapshot).unwrap();
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), COMMIT).unwrap();
    for entry in fs::read_dir(root().join("assets/models/tiny-qwen3/ref")).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, snapshot.join(path.file_name().unwrap())).unwrap();
    }
}

/// The child: fd 1 to `file` while every command runs, then back for the harness's last line.
fn run_every_command(file: &Path) {
    let tmp = tempfile::tempdir().unwrap();
    let commands = json_commands(tmp.path());
    let redirect = fs::File::create(file).unwrap();
    std::io::stdout().flush().unwrap();
    // SAFETY: dup and dup2 on descriptors this process holds open; fd 1 is restored below.
    let saved = unsafe { libc::dup(1) };
    assert!(saved >= 0 && unsafe { libc::dup2(redirect.as_raw_fd(), 1) } == 1);
    let reports: Vec<(String, sinkmerge::error::Result<Vec<u8>>)> = (commands.into_iter())
        .map(|argv| {
            let name = argv[2].to_string_lossy().into_owned();
            let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
            let mut report = Vec::new();
            let globals = cli.globals();
            let result = sinkmerge::commands::run(cli.command, globals, &mut report);
            (name, result.map(|()| report))
        })
        .collect();
    // Whatever a print! left in std's buffer reaches the file before fd 1 is restored.
    std::io::stdout().flush().unwrap();
    assert!(unsafe { libc::dup2(saved, 1) } == 1);
    unsafe { libc::close(saved) };
    for (name, report) in reports {
        match (name.as_str(), report) {
            (_, Ok(report)) => {
                let text = String::from_utf8(report).unwrap();
                assert!(!text.is_empty(), "{name}: an empty report");
                serde_json::from_str::<serde_json::Value>(&text)
                    .unwrap_or_else(|e| panic!("{name}: not one JSON document ({e}): {text}"));
            }
            // Parity compares a GPU with the CPU: without one it stops before its report.
            ("parity", Err(_)) => {}
            (_, Err(e)) => panic!("{name}: {e}"),
        }
    }
}

/// Every command that has `--json`, on the bundled tiny models and the fixtures, with its outputs
/// under `tmp`.
fn json_commands(tmp: &Path) -> Vec<Vec<OsString>> {
    let asset = |name: &str| root().join("assets/models").join(name);
    let (reference, vl, vlm) = (
        asset("tiny-qwen3/ref"),
        asset("tiny-qwen3/vl"),
        asset("tiny-qwen3/vlm"),
    );
    let out = |name: &str| tmp.join(name);
    let config = out("linear.yml");
    fs::write(
        &config,
        format!(
            "merge_method: linear\nmodels:\n  - model: {}\n    parameters: {{weight: 0.5}}\n  \
             - model: {}\n    parameters: {{weight: 0.5}}\ndtype: float32\n",
            reference.display(),
            vl.display()
        ),
    )
    .unwrap();
    let image = root().join("tests/fixtures/images/scene_100x75.png");
    let planted = root().join("tests/fixtures/visual_sinks/planted");
    let p = |path: &PathBuf| path.display().to_string();
    let (r, t) = (p(&reference), p(&vl));
    let lines: Vec<Vec<String>> = vec![
        vec!["inspect".into(), r.clone()],
        vec!["aliases".into()],
        vec!["fetch".into(), CACHED_REPO.into()],
        vec!["extract".into(), p(&vlm), "-o".into(), p(&out("lm"))],
        vec![
            "graft".into(),
            "--vlm".into(),
            p(&vlm),
            "--lm".into(),
            t.clone(),
            "-o".into(),
            p(&out("grafted")),
        ],
        vec!["predict".into(), "--s".into(), "-0.5".into()],
        vec![
            "perturb".into(),
            r.clone(),
            "--match".into(),
            t.clone(),
            "-o".into(),
            p(&out("perturbed")),
        ],
        vec![
            "ablate".into(),
            r.clone(),
            "--norms".into(),
            "input_layernorm".into(),
            "--top-k".into(),
            "2".into(),
            "-o".into(),
            p(&out("ablated")),
        ],
        vec![
            "inject-qknorm".into(),
            p(&asset("tiny-qwen2/ref")),
            "-o".into(),
            p(&out("injected")),
        ],
        vec!["score".into(), "--ref".into(), r.clone(), t.clone()],
        vec!["heads".into(), r.clone(), t.clone()],
        vec![
            "repair-heads".into(),
            "--ref".into(),
            r.clone(),
            t.clone(),
            "--heads".into(),
            "2.0".into(),
            "-o".into(),
            p(&out("repaired")),
        ],
        vec!["parity".into(), r.clone(), "--device".into(), "cuda".into()],
        vec![
            "trace".into(),
            p(&root().join("tests/fixtures/vlm/qwen2_vl")),
            "--prompt".into(),
            "<image>Describe it.".into(),
            "--image".into(),
            p(&image),
            "-o".into(),
            p(&out("trace.safetensors")),
        ],
        vec![
            "visual-sinks".into(),
            p(&planted.join("model")),
            "--image".into(),
            p(&planted.join("image.png")),
            "--question".into(),
            "Where is the red square?".into(),
        ],
        vec!["norms".into(), r.clone(), t.clone()],
        vec![
            "linear".into(),
            "--models".into(),
            r.clone(),
            t.clone(),
            "-o".into(),
            p(&out("linear")),
        ],
        vec![
            "task-arithmetic".into(),
            "--base".into(),
            r.clone(),
            "--models".into(),
            t.clone(),
            "-o".into(),
            p(&out("task-arithmetic")),
        ],
        vec![
            "ties".into(),
            "--base".into(),
            r.clone(),
            "--models".into(),
            t.clone(),
            "--density".into(),
            "0.5".into(),
            "-o".into(),
            p(&out("ties")),
        ],
        vec![
            "dare".into(),
            "--base".into(),
            r.clone(),
            "--models".into(),
            t.clone(),
            "--density".into(),
            "0.5".into(),
            "-o".into(),
            p(&out("dare")),
        ],
        vec![
            "tsv".into(),
            "--base".into(),
            r.clone(),
            "--models".into(),
            t.clone(),
            "-o".into(),
            p(&out("tsv")),
        ],
        vec![
            "star".into(),
            "--base".into(),
            r.clone(),
            "--models".into(),
            t.clone(),
            "-o".into(),
            p(&out("star")),
        ],
        vec!["merge".into(), p(&config), "-o".into(), p(&out("merged"))],
        vec![
            "reproduce".into(),
            "--ref".into(),
            r.clone(),
            "--vlm".into(),
            p(&vlm),
            "--merges".into(),
            "none".into(),
            "-o".into(),
            p(&out("repro")),
        ],
        vec!["reproduce".into(), "--status".into(), p(&out("repro"))],
    ];
    (lines.into_iter())
        .map(|line| {
            let mut argv: Vec<OsString> = vec!["sinkmerge".into(), "--no-download".into()];
            argv.extend(line.into_iter().map(OsString::from));
            argv.push("--json".into());
            argv
        })
        .collect()
}
