//! Outputs are complete or absent, and inputs are never written, whatever happens to the run:
//! SIGINT and SIGTERM at twenty points of a write (into a new OUT, and under `--force` over a
//! complete one), concurrent writers, leftovers of killed runs, and outputs that reach an input
//! through symlinks. The protocol: docs/reference/checkpoints.md, "Writing outputs".

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use safetensors::Dtype;

use crate::util::{self, fixture, sinkmerge, Stored};

/// A Qwen3-shaped model of about 24 MB in f32 (hidden 512, one layer), with values from `seed`,
/// large enough that writing a merge of two takes a measurable time on any disk.
pub fn big_model(dir: &Path, seed: u32) {
    let mut config = util::config(&fixture("qwen3"));
    config["hidden_size"] = 512.into();
    config["intermediate_size"] = 2048.into();
    config["num_attention_heads"] = 8.into();
    config["num_key_value_heads"] = 4.into();
    config["head_dim"] = 64.into();
    config["num_hidden_layers"] = 1.into();
    config["layer_types"] = serde_json::json!(["full_attention"]);
    config["dtype"] = "float32".into();
    let shapes: [(&str, [usize; 2]); 7] = [
        ("self_attn.q_proj.weight", [512, 512]),
        ("self_attn.k_proj.weight", [256, 512]),
        ("self_attn.v_proj.weight", [256, 512]),
        ("self_attn.o_proj.weight", [512, 512]),
        ("mlp.gate_proj.weight", [2048, 512]),
        ("mlp.up_proj.weight", [2048, 512]),
        ("mlp.down_proj.weight", [512, 2048]),
    ];
    let mut tensors = BTreeMap::new();
    let mut state = seed.wrapping_mul(2_654_435_761) | 1;
    let mut next = move || {
        // xorshift32: cheap, deterministic values in [-0.05, 0.05).
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        (state as f32 / u32::MAX as f32 - 0.5) * 0.1
    };
    let mut add = |name: String, shape: Vec<usize>| {
        let values: Vec<f32> = (0..shape.iter().product::<usize>())
            .map(|_| next())
            .collect();
        tensors.insert(name, Stored::from_f32(Dtype::F32, shape, &values));
    };
    for (name, shape) in shapes {
        add(format!("model.layers.0.{name}"), shape.to_vec());
    }
    for norm in [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
    ] {
        add(norm.into(), vec![512]);
    }
    for norm in ["q_norm", "k_norm"] {
        add(format!("model.layers.0.self_attn.{norm}.weight"), vec![64]);
    }
    add("model.embed_tokens.weight".into(), vec![384, 512]);
    util::write_model(dir, &config, &tensors, Some(&fixture("qwen3")));
}

/// Two inputs, and the bytes of the merges `weights` of them writes, by file name.
struct Inputs {
    _tmp: tempfile::TempDir,
    a: PathBuf,
    b: PathBuf,
    work: PathBuf,
}

fn inputs() -> Inputs {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    big_model(&a, 1);
    big_model(&b, 2);
    let work = tmp.path().join("work");
    std::fs::create_dir(&work).unwrap();
    Inputs {
        _tmp: tmp,
        a,
        b,
        work,
    }
}

/// `command` writing into `out`, in 6 MB shards, quiet, with `--force` when asked.
fn writing(command: &[&str], out: &Path, force: bool) -> Vec<String> {
    let mut args: Vec<String> = command.iter().map(|s| s.to_string()).collect();
    args.extend(["--max-shard-size", "6M", "-q", "-o"].map(String::from));
    args.push(out.to_str().unwrap().into());
    if force {
        args.push("--force".into());
    }
    args
}

fn linear_args(inputs: &Inputs, weight: &str, out: &Path, force: bool) -> Vec<String> {
    let (a, b) = (inputs.a.to_str().unwrap(), inputs.b.to_str().unwrap());
    let weights = format!("{weight},1");
    writing(
        &["linear", "--models", a, b, "--weights", &weights],
        out,
        force,
    )
}

/// A command line that writes `out` from the inputs.
type Job = fn(&Inputs, &Path, bool) -> Vec<String>;

/// The merge the interrupted runs write.
fn merge_3_1(inputs: &Inputs, out: &Path, force: bool) -> Vec<String> {
    linear_args(inputs, "3", out, force)
}

/// The merge that stands for an earlier output under `--force`.
fn merge_1_1(inputs: &Inputs, out: &Path, force: bool) -> Vec<String> {
    linear_args(inputs, "1", out, force)
}

/// repair-heads, the rewrite pipeline: a copy of `b` with one head blended toward `a`.
fn repair(inputs: &Inputs, out: &Path, force: bool) -> Vec<String> {
    let (a, b) = (inputs.a.to_str().unwrap(), inputs.b.to_str().unwrap());
    writing(
        &[
            "repair-heads",
            "--ref",
            a,
            b,
            "--heads",
            "0.1",
            "--lambda",
            "0.5",
        ],
        out,
        force,
    )
}

/// Every file of a directory with a hash of its bytes (a failed comparison stays readable).
fn tree(dir: &Path) -> BTreeMap<String, u64> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let bytes = std::fs::read(e.path()).unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                xxhash_rust::xxh3::xxh3_64(&bytes),
            )
        })
        .collect()
}

/// A complete output, written by an undisturbed run under the same name `out` (the model card
/// holds the name) in a folder of its own.
fn reference(inputs: &Inputs, job: Job) -> BTreeMap<String, u64> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    sinkmerge(job(inputs, &out, false)).ok();
    tree(&out)
}

/// Start `job` into `out` in the background, its stderr kept.
fn spawn(inputs: &Inputs, job: Job, out: &Path, force: bool) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_sinkmerge"))
        .args(job(inputs, out, force))
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn send(pid: u32, signal: i32) {
    // SAFETY: kill(2) with a child's pid; no memory is involved.
    let rc = unsafe { libc::kill(pid as libc::pid_t, signal) };
    assert!(rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH));
}

/// Start the run, send `signal` after `delay`, and check what OUT holds: nothing or `old`
/// when the run was stopped, `new` when it finished first, and never a staging directory.
/// True when the handler stopped the run (exit 128 + signal).
#[allow(clippy::too_many_arguments)]
fn interrupt_at(
    inputs: &Inputs,
    job: Job,
    out: &Path,
    force: bool,
    signal: i32,
    delay: Duration,
    old: Option<&BTreeMap<String, u64>>,
    new: &BTreeMap<String, u64>,
) -> bool {
    let child = spawn(inputs, job, out, force);
    std::thread::sleep(delay);
    send(child.id(), signal);
    let output = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    let what = format!("signal {signal} after {delay:?}, force {force}: {err}");
    match output.status.code() {
        Some(0) => assert_eq!(&tree(out), new, "finished run: {what}"),
        Some(code) => {
            assert_eq!(code, 128 + signal, "{what}");
            assert!(err.contains("interrupted by SIG"), "{what}");
            match old {
                Some(old) => assert_eq!(&tree(out), old, "the old output survives: {what}"),
                None => assert!(!out.exists(), "no output: {what}"),
            }
        }
        // Before the handlers are installed the signal's default action ends the process;
        // nothing has been written then.
        None => match old {
            Some(old) => assert_eq!(&tree(out), old, "{what}"),
            None => assert!(!out.exists(), "{what}"),
        },
    }
    let left = util::leftovers(&inputs.work);
    assert!(left.is_empty(), "staging left behind: {left:?} ({what})");
    output.status.code() == Some(128 + signal)
}

/// The runs the handler stopped must be a good share of the forty, or the test says nothing.
fn assert_many_stopped(stopped: usize) {
    assert!(
        stopped >= 8,
        "only {stopped} of 40 runs were stopped by the signal"
    );
}

/// Twenty delays spread over an undisturbed run (the median of three), from before the signal
/// handlers are installed to the commit.
fn delays(inputs: &Inputs, job: Job) -> Vec<Duration> {
    let out = inputs.work.join("timed");
    let mut runs: Vec<Duration> = (0..3)
        .map(|_| {
            let start = Instant::now();
            sinkmerge(job(inputs, &out, false)).ok();
            std::fs::remove_dir_all(&out).unwrap();
            start.elapsed()
        })
        .collect();
    runs.sort();
    (0..20).map(|k| runs[1].mul_f64(k as f64 / 20.0)).collect()
}

/// SIGINT and SIGTERM at twenty points of `job` into a new OUT.
fn new_output_absent(job: Job) {
    let inputs = inputs();
    let new = reference(&inputs, job);
    let out = inputs.work.join("out");
    let mut stopped = 0;
    for delay in delays(&inputs, job) {
        for signal in [libc::SIGINT, libc::SIGTERM] {
            stopped += interrupt_at(&inputs, job, &out, false, signal, delay, None, &new) as usize;
            if out.exists() {
                std::fs::remove_dir_all(&out).unwrap();
            }
        }
    }
    assert_many_stopped(stopped);
}

#[test]
fn sigint_and_sigterm_leave_a_new_output_absent() {
    new_output_absent(merge_3_1);
}

#[test]
fn sigint_and_sigterm_leave_a_new_rewrite_absent() {
    new_output_absent(repair);
}

#[test]
fn sigint_and_sigterm_under_force_keep_the_previous_output() {
    let inputs = inputs();
    let old = reference(&inputs, merge_1_1);
    let new = reference(&inputs, merge_3_1);
    let out = inputs.work.join("out");
    let mut stopped = 0;
    for delay in delays(&inputs, merge_3_1) {
        for signal in [libc::SIGINT, libc::SIGTERM] {
            sinkmerge(merge_1_1(&inputs, &out, true)).ok();
            stopped += interrupt_at(
                &inputs,
                merge_3_1,
                &out,
                true,
                signal,
                delay,
                Some(&old),
                &new,
            ) as usize;
        }
    }
    assert_many_stopped(stopped);
}

#[test]
fn two_concurrent_writers_of_one_new_output_never_replace_each_other() {
    let inputs = inputs();
    let expected = reference(&inputs, merge_3_1);
    for _ in 0..3 {
        let out = inputs.work.join("out");
        let runs: Vec<_> = (0..2)
            .map(|_| spawn(&inputs, merge_3_1, &out, false))
            .collect();
        let outputs: Vec<_> = runs
            .into_iter()
            .map(|r| r.wait_with_output().unwrap())
            .collect();
        let mut codes: Vec<_> = outputs.iter().map(|o| o.status.code()).collect();
        codes.sort();
        assert_eq!(codes, [Some(0), Some(2)], "exactly one run writes OUT");
        let loser = outputs.iter().find(|o| o.status.code() == Some(2)).unwrap();
        let err = String::from_utf8_lossy(&loser.stderr);
        assert!(
            err.contains(out.to_str().unwrap()) && err.contains("--force"),
            "{err}"
        );
        assert_eq!(tree(&out), expected);
        assert!(util::leftovers(&inputs.work).is_empty());
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn two_concurrent_force_writers_leave_one_complete_output_and_no_leftovers() {
    let inputs = inputs();
    let expected = reference(&inputs, merge_3_1);
    let out = inputs.work.join("out");
    sinkmerge(merge_1_1(&inputs, &out, false)).ok();
    for _ in 0..3 {
        let runs: Vec<_> = (0..2)
            .map(|_| spawn(&inputs, merge_3_1, &out, true))
            .collect();
        for run in runs {
            let output = run.wait_with_output().unwrap();
            assert!(output.status.success(), "{}", util::stderr(&output));
        }
        assert_eq!(tree(&out), expected);
        let names: Vec<_> = std::fs::read_dir(&inputs.work)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["out"], "nothing beside OUT");
    }
}

#[test]
fn an_output_created_during_the_run_is_not_replaced_without_force() {
    let inputs = inputs();
    let out = inputs.work.join("out");
    // An empty OUT is allowed; another process fills it while this run writes.
    std::fs::create_dir(&out).unwrap();
    let child = spawn(&inputs, merge_3_1, &out, false);
    std::fs::write(out.join("theirs.txt"), b"another run's output").unwrap();
    let output = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    // Either it saw the file at start (not empty) or at commit (created meanwhile).
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("--force"), "{err}");
    let theirs: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert_eq!(theirs.len(), 1);
    assert_eq!(
        std::fs::read(out.join("theirs.txt")).unwrap(),
        b"another run's output"
    );
}

#[test]
fn leftovers_of_a_killed_replacement_are_restored_or_removed() {
    let inputs = inputs();
    let parent = &inputs.work;
    // A run killed between moving OUT aside and moving the new one in: OUT is missing, so the
    // old output is put back. No process 4294967 exists (pid_max is below 2^22).
    let aside = parent.join(".kept.sinkmerge-old-4294967-0000beef");
    std::fs::create_dir(&aside).unwrap();
    std::fs::write(aside.join("config.json"), b"{}").unwrap();
    // A run killed after the new output was in place: the old one is garbage.
    std::fs::create_dir(parent.join("done")).unwrap();
    let stale = parent.join(".done.sinkmerge-old-4294967-0000cafe");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("model.safetensors"), vec![0u8; 4096]).unwrap();
    // A live process (this test's) keeps its entry.
    let live = parent.join(format!(
        ".busy.sinkmerge-old-{}-0000f00d",
        std::process::id()
    ));
    std::fs::create_dir(&live).unwrap();
    let out = parent.join("merged");
    let output = sinkmerge(merge_3_1(&inputs, &out, false)).output();
    let err = util::ok(&output);
    let err = format!("{err}{}", util::stderr(&output));
    assert_eq!(
        std::fs::read(parent.join("kept/config.json")).unwrap(),
        b"{}"
    );
    assert!(!aside.exists() && !stale.exists(), "{err}");
    assert!(err.contains("restored") && err.contains("removed"), "{err}");
    assert!(live.is_dir());
}

/// A model folder whose files are links into `real`, as a user's `ln -s` or the HF cache makes.
fn linked_model(real: &Path, linked: &Path) {
    std::fs::create_dir_all(linked).unwrap();
    for entry in std::fs::read_dir(real).unwrap() {
        let entry = entry.unwrap();
        std::os::unix::fs::symlink(entry.path(), linked.join(entry.file_name())).unwrap();
    }
}

#[test]
fn outputs_reaching_an_input_through_its_symlinks_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("realdata");
    let linked = tmp.path().join("linked");
    // realdata holds the weights; the input folder only links to them.
    std::fs::create_dir(&real).unwrap();
    for name in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture("qwen3").join(name), real.join(name)).unwrap();
    }
    linked_model(&real, &linked);
    let weights = std::fs::read(real.join("model.safetensors")).unwrap();
    let model = linked.to_str().unwrap();
    let other = fixture("qwen3");
    let other = other.to_str().unwrap();
    let real_out = real.to_str().unwrap();
    for args in [
        vec![
            "linear", "--models", model, other, "-o", real_out, "--force",
        ],
        vec![
            "ablate",
            model,
            "--norms",
            "input_layernorm",
            "-o",
            real_out,
            "--force",
        ],
    ] {
        sinkmerge(&args).refused(&["realdata", "links to", "inputs are never written"]);
    }
    // A report file that is the weights' own file.
    let target = real.join("model.safetensors");
    sinkmerge(["norms", other, model, "--csv", target.to_str().unwrap()])
        .refused(&["model.safetensors", "links to"]);
    assert_eq!(
        std::fs::read(real.join("model.safetensors")).unwrap(),
        weights
    );
}

#[test]
fn outputs_over_the_hub_cache_blobs_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("hub");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    // The layout the Hub client writes: snapshot files are relative links into blobs/.
    let repo = cache.join("models--Org--Tiny");
    let (blobs, snapshot) = (repo.join("blobs"), repo.join("snapshots").join(commit));
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    for (k, name) in ["config.json", "model.safetensors", "tokenizer.json"]
        .iter()
        .enumerate()
    {
        let blob = format!("{k:064x}");
        std::fs::copy(fixture("qwen3").join(name), blobs.join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(name)).unwrap();
    }
    let before: Vec<_> = std::fs::read_dir(&blobs).unwrap().collect();
    assert!(!before.is_empty());
    sinkmerge([
        "linear",
        "--models",
        "Org/Tiny",
        fixture("qwen3").to_str().unwrap(),
        "-o",
        blobs.to_str().unwrap(),
        "--force",
    ])
    .env("HF_HUB_CACHE", &cache)
    .env("HF_HUB_OFFLINE", "1")
    .refused(&["blobs", "links to"]);
    assert_eq!(std::fs::read_dir(&blobs).unwrap().count(), before.len());
}
