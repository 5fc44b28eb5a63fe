//! Resume-state tampering in `sinkmerge reproduce`: what a rerun finds in DIR is used only when it
//! is what the run wrote. A deleted or edited step output, an edited manifest, a truncated model
//! or a removed-model record is redone; a symlink inside DIR is refused (it could send a write
//! into an input); and concurrent runs into one DIR leave one to work and refuse the others as
//! busy (docs/commands/reproduce.md, "Resuming" and "Concurrent runs").

use std::fs;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::{read_json, root, sinkmerge, stderr, Sinkmerge};

const REF: &str = "assets/models/tiny-qwen3/ref";
const VLM: &str = "assets/models/tiny-qwen3/vlm";
/// The shortest plan that still has a model output, a report that feeds a later command line
/// (score-ref's S, read by predict) and a summary.
const QUICK: [&str; 4] = ["--merges", "none", "--skip", "heads"];

/// `reproduce --ref REF --vlm VLM -o dir --json` with `extra`.
fn reproduce(dir: &Path, extra: &[&str]) -> Sinkmerge {
    sinkmerge(["reproduce", "--ref", REF, "--vlm", VLM, "--json"])
        .args([Path::new("-o"), dir])
        .args(extra)
}

/// Every step's manifest, by name.
fn manifests(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = fs::read_dir(dir.join("steps"))
        .unwrap()
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let bytes = fs::read(e.path().join("manifest.json")).unwrap_or_default();
            (name, bytes)
        })
        .collect();
    out.sort();
    out
}

/// The steps whose manifests differ between two snapshots.
fn redone(before: &[(String, Vec<u8>)], after: &[(String, Vec<u8>)]) -> Vec<String> {
    after
        .iter()
        .filter(|(name, bytes)| !before.iter().any(|(n, b)| n == name && b == bytes))
        .map(|(name, _)| name.clone())
        .collect()
}

/// Edit a JSON file in place.
fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut value: Value = read_json(path);
    edit(&mut value);
    fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

/// Two summaries are equal; else the keys where they differ (a summary is long).
fn assert_same(a: &Value, b: &Value) {
    let keys = a.as_object().unwrap().keys();
    let differ: Vec<&String> = keys.filter(|k| a[k.as_str()] != b[k.as_str()]).collect();
    assert!(differ.is_empty(), "the summaries differ in {differ:?}");
}

/// A copy of the bundled reference at `dest`.
fn copy_model(from: &Path, dest: &Path) {
    fs::create_dir_all(dest).unwrap();
    for entry in fs::read_dir(from).unwrap().flatten() {
        fs::copy(entry.path(), dest.join(entry.file_name())).unwrap();
    }
}

#[test]
fn a_deleted_or_edited_report_redoes_its_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let first = reproduce(&dir, &QUICK).json();
    let before = manifests(&dir);

    // Deleted: the step runs again (it was "missing", exit 2).
    fs::remove_file(dir.join("steps/norms/report.json")).unwrap();
    let again = reproduce(&dir, &QUICK).json();
    assert_same(&again, &first);
    let after_delete = manifests(&dir);
    assert_eq!(redone(&before, &after_delete), ["norms"]);

    // Edited: S = 42 must not reach the summary, nor the predictor that reads it.
    edit_json(&dir.join("steps/score-ref/report.json"), |r| {
        r["models"][0]["sink_strength"] = 42.into();
    });
    let again = reproduce(&dir, &QUICK).json();
    assert_same(&again, &first);
    assert_ne!(again["scores"][0]["sink_strength"], 42.0);
    assert_eq!(
        redone(&after_delete, &manifests(&dir)),
        ["predict", "score-ref"]
    );
}

#[test]
fn an_edited_manifest_or_plan_is_redone_never_used() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let first = reproduce(&dir, &QUICK).json();
    let elsewhere = tmp.path().join("elsewhere");

    // The command a manifest shows (the summary's steps[].command), and one that points
    // outside DIR: both are the step's record of what ran, and a rerun that cannot vouch for
    // them runs the step again.
    edit_json(&dir.join("steps/inspect-ref/manifest.json"), |m| {
        m["command"] = "sinkmerge inspect /somewhere/else --json".into();
    });
    edit_json(&dir.join("steps/extract/manifest.json"), |m| {
        let argv = m["argv"].as_array_mut().unwrap();
        let out = argv.iter().position(|a| a == "-o").unwrap() + 1;
        argv[out] = elsewhere.to_string_lossy().into_owned().into();
        m["command"] = format!(
            "sinkmerge extract {VLM} -o {} --force --json",
            elsewhere.display()
        )
        .into();
    });
    // Not JSON at all.
    fs::write(dir.join("steps/score-vlm-lm/manifest.json"), "{\"step\": ").unwrap();
    // The plan `--status` and the Slurm jobs read.
    fs::write(dir.join("plan.json"), "{\"steps\": []}").unwrap();
    let plan_before = manifests(&dir);

    let again = reproduce(&dir, &QUICK).json();
    assert_same(&again, &first);
    assert!(!elsewhere.exists());
    // extract's key is unchanged once it is redone, so the steps after it are reused.
    assert_eq!(
        redone(&plan_before, &manifests(&dir)),
        ["extract", "inspect-ref", "score-vlm-lm"]
    );
    let plan: Value = read_json(dir.join("plan.json"));
    assert_eq!(plan["steps"].as_array().unwrap().len(), 7);
}

#[test]
fn a_truncated_model_or_an_edited_removal_record_is_redone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let quick = ["--merges", "average", "--skip", "heads"];
    let first = reproduce(&dir, &quick).json();
    let weights = dir.join("models/vlm-lm/model.safetensors");
    let bytes = fs::read(&weights).unwrap();
    let before = manifests(&dir);

    // A truncated VLM-LM: extract writes it again, and nothing else changes.
    fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    // The record of the merged model deleted after scoring: its bytes go into the summary.
    let removed = dir.join("steps/merge-average/removed.json");
    edit_json(&removed, |r| r["bytes"] = 42.into());
    let again = reproduce(&dir, &quick).json();
    assert_same(&again, &first);
    assert_eq!(fs::read(&weights).unwrap(), bytes);
    assert_eq!(
        redone(&before, &manifests(&dir)),
        ["extract", "merge-average"]
    );

    // A kept merged model, truncated.
    let kept = tmp.path().join("kept");
    let quick = ["--merges", "average", "--skip", "heads", "--keep-models"];
    reproduce(&kept, &quick).json();
    let merged = kept.join("models/average/model.safetensors");
    let merged_bytes = fs::read(&merged).unwrap();
    let before = manifests(&kept);
    fs::write(&merged, &merged_bytes[..100]).unwrap();
    reproduce(&kept, &quick).json();
    assert_eq!(fs::read(&merged).unwrap(), merged_bytes);
    assert_eq!(redone(&before, &manifests(&kept)), ["merge-average"]);
}

#[test]
fn a_symlink_inside_dir_is_refused_before_any_step() {
    let tmp = tempfile::tempdir().unwrap();
    // DIR/models -> store, where the store holds REF under the name extract writes: extract
    // --force would overwrite REF, and the run would score the VLM-LM as REF.
    let store = tmp.path().join("store");
    let reference = store.join("vlm-lm");
    copy_model(&root().join(REF), &reference);
    let dir = tmp.path().join("run");
    fs::create_dir(&dir).unwrap();
    std::os::unix::fs::symlink(&store, dir.join("models")).unwrap();
    let reference_bytes = fs::read(reference.join("model.safetensors")).unwrap();
    sinkmerge(["reproduce", "--vlm", VLM, "--json"])
        .args([Path::new("--ref"), &reference, Path::new("-o"), &dir])
        .args(QUICK)
        .refused(&["run/models", "symlink"]);
    assert_eq!(
        fs::read(reference.join("model.safetensors")).unwrap(),
        reference_bytes
    );
    assert!(!dir.join("steps").exists());

    // A step's folder replaced by a link to a copy of itself, after a complete run.
    let dir = tmp.path().join("done");
    reproduce(&dir, &QUICK).json();
    let copy = tmp.path().join("norms-copy");
    fs::rename(dir.join("steps/norms"), &copy).unwrap();
    std::os::unix::fs::symlink(&copy, dir.join("steps/norms")).unwrap();
    reproduce(&dir, &QUICK).refused(&["steps/norms", "symlink"]);

    // The lock file, linked to a file outside DIR that the lock would write.
    let dir = tmp.path().join("locked");
    fs::create_dir(&dir).unwrap();
    let target = tmp.path().join("target.txt");
    fs::write(&target, "keep me\n").unwrap();
    std::os::unix::fs::symlink(&target, dir.join(".sinkmerge-lock")).unwrap();
    reproduce(&dir, &QUICK).refused(&[".sinkmerge-lock", "symlink"]);
    assert_eq!(fs::read_to_string(&target).unwrap(), "keep me\n");
}

/// The run's command line with `options`, for `Command::spawn`.
fn command(dir: &Path, options: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sinkmerge"));
    command
        .current_dir(root())
        .args(["reproduce", "--ref", REF, "--vlm", VLM, "--json"])
        .args(options)
        .arg("-o")
        .arg(dir);
    command
}

/// A busy refusal: exit 1 (running again later can succeed; not the input's fault), one line
/// naming DIR's lock, and `pid`'s process when given.
fn assert_busy(output: &Output, pid: Option<u32>) {
    let err = stderr(output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("in use") && err.contains(".sinkmerge-lock"),
        "{err}"
    );
    if let Some(pid) = pid {
        assert!(err.contains(&format!("process {pid}")), "{err}");
    }
    assert!(output.stdout.is_empty());
}

#[test]
fn a_second_run_into_a_busy_dir_is_refused_naming_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut first = command(&dir, &QUICK)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait for the first run to record itself in its lock, then freeze it there.
    let lock = dir.join(".sinkmerge-lock");
    let started = Instant::now();
    while !fs::read_to_string(&lock).is_ok_and(|t| t.contains(&first.id().to_string())) {
        assert!(
            first.try_wait().unwrap().is_none(),
            "the first run ended without recording itself in {}",
            lock.display()
        );
        assert!(started.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(2));
    }
    let pid = first.id();
    // SAFETY: kill(2) on our own child, which has not been waited for.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let before = manifests_or_none(&dir);
    for _ in 0..2 {
        assert_busy(&command(&dir, &QUICK).output().unwrap(), Some(pid));
    }
    assert_eq!(manifests_or_none(&dir), before, "a busy run wrote a step");
    // SAFETY: as above.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    assert!(first.wait().unwrap().success());
    assert!(dir.join("summary.json").is_file() && dir.join("report.html").is_file());
}

/// [`manifests`], or none before `steps/` exists.
fn manifests_or_none(dir: &Path) -> Vec<(String, Vec<u8>)> {
    if dir.join("steps").exists() {
        manifests(dir)
    } else {
        vec![]
    }
}

#[test]
fn three_runs_at_once_one_works_the_others_are_busy() {
    let tmp = tempfile::tempdir().unwrap();
    // Two merges, each deleted once scored: without a lock, one run deleted a merged model
    // while another scored it.
    let options = ["--merges", "mix95,average", "--skip", "heads"];
    let expected = reproduce(&tmp.path().join("alone"), &options).json();
    let dir = tmp.path().join("run");
    let outputs: Vec<Output> = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..3)
            .map(|_| scope.spawn(|| command(&dir, &options).output().unwrap()))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    // The first to lock DIR runs the whole plan (seconds); the others find it locked within
    // milliseconds of their start.
    let (done, busy): (Vec<&Output>, Vec<&Output>) =
        outputs.iter().partition(|o| o.status.success());
    assert_eq!(
        done.len(),
        1,
        "{:?}",
        outputs.iter().map(stderr).collect::<Vec<_>>()
    );
    for output in busy {
        assert_busy(output, None);
    }
    let summary: Value = serde_json::from_slice(&done[0].stdout).unwrap();
    assert_eq!(
        relative(&summary, &dir),
        relative(&expected, &tmp.path().join("alone"))
    );
    let summary: Value = read_json(dir.join("summary.json"));
    assert_eq!(
        relative(&summary, &dir),
        relative(&expected, &tmp.path().join("alone"))
    );
    // Complete: a run now finds every step done and changes nothing.
    let before = manifests(&dir);
    reproduce(&dir, &options).json();
    assert!(redone(&before, &manifests(&dir)).is_empty());
}

/// A summary with its run's directory written as `DIR`.
fn relative(summary: &Value, dir: &Path) -> String {
    summary.to_string().replace(&*dir.to_string_lossy(), "DIR")
}
