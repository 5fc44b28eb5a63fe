//! Path resolution against the user's files: every output path is compared with the inputs as
//! the kernel resolves it, with symlinks at every position, `..` after a link, aliases of one
//! folder (a link to it, `/proc/self/root/...`) and hard links
//! (docs/reference/checkpoints.md, "Writing outputs").

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use crate::util::{root, sinkmerge};

/// The bundled tiny Qwen3-VL (a VLM `extract` and `trace` run on) and a tiny Qwen3 LM.
fn vlm() -> PathBuf {
    root().join("assets/models/tiny-qwen3/vlm")
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// Every file of a folder with its bytes, to show it untouched.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap_or_default(),
            )
        })
        .collect()
}

/// A work folder `tmp` holding `d/vlm` (a copy of the bundled VLM) and `d/vlm/sub`, `d/sub`.
struct Work {
    tmp: tempfile::TempDir,
}

impl Work {
    fn new() -> Work {
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(&vlm(), &tmp.path().join("d/vlm"));
        fs::create_dir(tmp.path().join("d/sub")).unwrap();
        fs::create_dir(tmp.path().join("d/vlm/sub")).unwrap();
        Work { tmp }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    fn link(&self, name: &str, target: &str) {
        symlink(self.path(target), self.path(name)).unwrap();
    }

    /// `trace` of `d/vlm` into `output`, run in the work folder, refused naming `needles`.
    fn trace_refused(&self, output: &str, needles: &[&str]) {
        sinkmerge(["trace", "d/vlm", "--prompt", "hi", "-o", output])
            .current_dir(self.tmp.path())
            .refused(needles);
    }
}

#[test]
fn an_input_named_through_a_link_and_dotdot_is_never_the_output() {
    let work = Work::new();
    work.link("L", "d/sub");
    let before = snapshot(&work.path("d/vlm"));
    // `L/../vlm` is d/vlm to the kernel (L is followed first), not ./vlm.
    let out = work.path("d/vlm");
    sinkmerge([
        "extract",
        "L/../vlm",
        "-o",
        out.to_str().unwrap(),
        "--force",
    ])
    .current_dir(work.tmp.path())
    .refused(&["inputs are never written"]);
    assert_eq!(snapshot(&work.path("d/vlm")), before);
}

#[test]
fn an_output_named_through_a_link_and_dotdot_is_checked_where_it_lands() {
    let work = Work::new();
    work.link("L", "d/vlm/sub");
    let weights = fs::read(work.path("d/vlm/model.safetensors")).unwrap();
    // `L/../model.safetensors` is the model's own weights.
    work.trace_refused(
        "L/../model.safetensors",
        &["L/../model.safetensors", "inputs are never written"],
    );
    assert_eq!(
        fs::read(work.path("d/vlm/model.safetensors")).unwrap(),
        weights
    );
    // A link at the start, in the middle and at the end of an output that lies in the input.
    work.link("M", "d");
    for output in [
        "M/vlm/trace.safetensors",
        "d/../M/vlm/sub/../trace.safetensors",
        "L/trace.safetensors",
    ] {
        work.trace_refused(output, &["inputs are never written"]);
    }
    assert!(!work.path("d/vlm/trace.safetensors").exists());
}

#[test]
fn a_model_output_through_a_link_and_dotdot_lands_where_the_kernel_puts_it() {
    let work = Work::new();
    work.link("L", "d/sub");
    // ./out is a folder the user never named; d/out is what `L/../out` names.
    fs::create_dir(work.path("out")).unwrap();
    fs::write(work.path("out/keep.txt"), b"mine").unwrap();
    let reference = root().join("assets/models/tiny-qwen3/ref");
    let target = root().join("assets/models/tiny-qwen3/vl");
    let (reference, target) = (reference.to_str().unwrap(), target.to_str().unwrap());
    sinkmerge([
        "linear", "--models", reference, target, "-o", "L/../out", "-q",
    ])
    .current_dir(work.tmp.path())
    .ok();
    assert_eq!(fs::read(work.path("out/keep.txt")).unwrap(), b"mine");
    assert!(work.path("d/out/model.safetensors").is_file());
    assert!(!work.path("out/model.safetensors").exists());
}

#[test]
fn reproduce_into_its_reference_through_a_link_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("deep/ref");
    copy_dir(&root().join("assets/models/tiny-qwen3/ref"), &reference);
    fs::create_dir(tmp.path().join("deep/sub")).unwrap();
    symlink(tmp.path().join("deep/sub"), tmp.path().join("L")).unwrap();
    let before = snapshot(&reference);
    let vlm = vlm();
    sinkmerge([
        "reproduce",
        "--ref",
        "deep/ref",
        "--vlm",
        vlm.to_str().unwrap(),
        "-o",
        "L/../ref",
    ])
    .current_dir(tmp.path())
    .refused(&["inputs are never written"]);
    assert_eq!(snapshot(&reference), before);
}

#[test]
fn aliases_of_an_input_folder_are_the_input() {
    let work = Work::new();
    work.link("alias", "d/vlm");
    let weights = fs::read(work.path("d/vlm/model.safetensors")).unwrap();
    let through_proc = format!("/proc/self/root{}", work.path("d/vlm").display());
    for output in [
        work.path("alias").join("out.safetensors"),
        PathBuf::from(&through_proc).join("out.safetensors"),
        work.path("d/./vlm/sub/../out.safetensors"),
    ] {
        work.trace_refused(output.to_str().unwrap(), &["inputs are never written"]);
    }
    // The input named through the alias, the output the real folder.
    let out = work.path("d/vlm");
    sinkmerge([
        "extract",
        &through_proc,
        "-o",
        out.to_str().unwrap(),
        "--force",
    ])
    .refused(&["inputs are never written"]);
    assert_eq!(
        fs::read(work.path("d/vlm/model.safetensors")).unwrap(),
        weights
    );
}

#[test]
fn a_report_that_is_a_hard_link_to_an_input_file_is_refused() {
    let work = Work::new();
    let prompts = work.path("prompts.txt");
    fs::write(&prompts, "The capital of France is\n").unwrap();
    // The same inode under another name, inside and outside the model folder.
    fs::hard_link(&prompts, work.path("report.svg")).unwrap();
    copy_dir(
        &root().join("assets/models/tiny-qwen3/ref"),
        &work.path("d/ref"),
    );
    fs::hard_link(work.path("d/ref/config.json"), work.path("config-copy.svg")).unwrap();
    let reference = root().join("assets/models/tiny-qwen3/ref");
    let target = root().join("assets/models/tiny-qwen3/vl");
    let (reference, target) = (reference.to_str().unwrap(), target.to_str().unwrap());
    sinkmerge([
        "score",
        "--ref",
        reference,
        target,
        "--prompts",
        "prompts.txt",
        "--plot",
        "report.svg",
    ])
    .current_dir(work.tmp.path())
    .refused(&["report.svg", "--prompts"]);
    let config = fs::read(work.path("d/ref/config.json")).unwrap();
    sinkmerge(["norms", "d/ref", "d/ref", "--plot", "config-copy.svg"])
        .current_dir(work.tmp.path())
        .refused(&["config-copy.svg", "inputs are never written"]);
    assert_eq!(fs::read(work.path("d/ref/config.json")).unwrap(), config);
    assert_eq!(
        fs::read_to_string(&prompts).unwrap(),
        "The capital of France is\n"
    );
}
