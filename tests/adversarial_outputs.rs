//! Outputs that are not what a command writes: device nodes, FIFOs, sockets and symlinks are
//! never replaced; `--force` replaces only a folder of the kind the command writes, never the
//! working folder or a folder of the user's; and a live run's staging folder survives a run in
//! another PID namespace (docs/reference/checkpoints.md, "Writing outputs").

use std::fs;
use std::os::unix::fs::{symlink, FileTypeExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::util::{root, sinkmerge};

/// Two tiny language models of one architecture (the bundled reference and its VL-tuned copy).
fn tiny_lms() -> (String, String) {
    let path = |name: &str| {
        root()
            .join("assets/models/tiny-qwen3")
            .join(name)
            .to_string_lossy()
            .into_owned()
    };
    (path("ref"), path("vl"))
}

/// A character device made with mknod(2) in `dir` (never the system's), with the numbers of
/// `/dev/null`; `None` where this process may not make device nodes.
fn char_device(dir: &Path, name: &str) -> Option<PathBuf> {
    let path = dir.join(name);
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    (rc == 0).then_some(path)
}

fn fifo(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    path
}

fn socket(dir: &Path, name: &str) -> (PathBuf, std::os::unix::net::UnixListener) {
    let path = dir.join(name);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    (path, listener)
}

/// What kind of thing `path` is now, without following a link.
fn kind(path: &Path) -> &'static str {
    let t = fs::symlink_metadata(path).unwrap().file_type();
    if t.is_symlink() {
        "symlink"
    } else if t.is_char_device() {
        "char device"
    } else if t.is_fifo() {
        "fifo"
    } else if t.is_socket() {
        "socket"
    } else if t.is_dir() {
        "dir"
    } else {
        "file"
    }
}

/// Command lines writing a report file or a model folder at `out`.
fn writers(out: &str) -> Vec<Vec<String>> {
    let (reference, target) = tiny_lms();
    let (reference, target) = (reference.as_str(), target.as_str());
    [
        vec!["norms", reference, target, "--csv", out],
        vec!["norms", reference, target, "--plot", out],
        vec!["score", "--ref", reference, target, "--plot", out],
        vec![
            "linear", "--models", reference, target, "-o", out, "--force", "-q",
        ],
        vec!["extract", reference, "-o", out, "--force"],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(String::from).collect())
    .collect()
}

#[test]
fn device_nodes_fifos_sockets_and_links_are_never_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let mut targets = vec![
        (fifo(tmp.path(), "fifo"), "FIFO"),
        (socket(tmp.path(), "sock").0, "socket"),
    ];
    match char_device(tmp.path(), "null") {
        Some(dev) => targets.push((dev, "character device")),
        None => eprintln!("skipped the device node case: mknod is not allowed here"),
    }
    let _listener = socket(tmp.path(), "sock2").1;
    // A link to a regular file and a dangling link: renaming over either replaces the link.
    fs::write(tmp.path().join("real.csv"), b"mine").unwrap();
    symlink(tmp.path().join("real.csv"), tmp.path().join("link.csv")).unwrap();
    symlink(tmp.path().join("nowhere"), tmp.path().join("dangling")).unwrap();
    targets.push((tmp.path().join("link.csv"), "symbolic link"));
    targets.push((tmp.path().join("dangling"), "symbolic link"));
    for (target, what) in &targets {
        let before = kind(target);
        for args in writers(target.to_str().unwrap()) {
            let err = sinkmerge(&args).refused(&[what]);
            assert!(err.contains(&*target.to_string_lossy()), "{err}");
            assert_eq!(
                kind(target),
                before,
                "{args:?} replaced {}",
                target.display()
            );
        }
    }
    assert_eq!(fs::read(tmp.path().join("real.csv")).unwrap(), b"mine");
}

#[test]
fn force_never_replaces_the_working_folder_or_a_folder_of_the_users() {
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path().join("work");
    fs::create_dir(&work).unwrap();
    fs::write(work.join("thesis.tex"), b"years of work").unwrap();
    let planted = root().join("tests/fixtures/visual_sinks/planted");
    let visual_sinks = |plot: &str, cwd: &Path| {
        sinkmerge([
            "visual-sinks",
            planted.join("model").to_str().unwrap(),
            "--image",
            planted.join("image.png").to_str().unwrap(),
            "--question",
            "Where is the red square?",
            "--plot",
            plot,
            "--force",
        ])
        .current_dir(cwd)
    };
    // The working folder, by `.`, by its path and as `sub/..`.
    fs::create_dir(work.join("sub")).unwrap();
    for plot in [".", work.to_str().unwrap(), "sub/.."] {
        visual_sinks(plot, &work).refused(&["working folder"]);
    }
    // The working folder's parent holds it.
    visual_sinks("..", &work).refused(&["working folder"]);
    // A folder holding a file sinkmerge does not write.
    let figures = tmp.path().join("figures");
    fs::create_dir(&figures).unwrap();
    fs::write(figures.join("notes.md"), b"mine").unwrap();
    visual_sinks(figures.to_str().unwrap(), tmp.path()).refused(&["notes.md", "--force"]);
    assert_eq!(fs::read(work.join("thesis.tex")).unwrap(), b"years of work");
    assert_eq!(fs::read(figures.join("notes.md")).unwrap(), b"mine");
    // A folder of an earlier run's figures is replaced.
    fs::remove_file(figures.join("notes.md")).unwrap();
    visual_sinks(figures.to_str().unwrap(), tmp.path()).ok();
    visual_sinks(figures.to_str().unwrap(), tmp.path()).ok();
    assert!(figures.join("image0_heatmap.svg").is_file());

    // A model folder: `--force` replaces an earlier model, not a folder with other things in it.
    let (reference, target) = tiny_lms();
    let out = tmp.path().join("merged");
    let linear = |out: &Path| {
        sinkmerge([
            "linear",
            "--models",
            &reference,
            &target,
            "-o",
            out.to_str().unwrap(),
            "--force",
            "-q",
        ])
    };
    linear(&out).ok();
    linear(&out).ok();
    fs::create_dir(out.join("checkpoints")).unwrap();
    linear(&out).refused(&["checkpoints", "--force"]);
    assert!(out.join("checkpoints").is_dir());
    // $HOME, whatever it holds.
    let home = tmp.path().join("home");
    fs::create_dir(&home).unwrap();
    linear(&home).env("HOME", &home).refused(&["home folder"]);
}

/// The smallest process id that no process of this PID namespace has, at least 3.
fn free_pid() -> u32 {
    (3..)
        .find(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        .unwrap()
}

#[test]
fn a_live_run_in_another_pid_namespace_keeps_its_staging_folder() {
    if Command::new("unshare")
        .args(["--pid", "--fork", "true"])
        .status()
        .map(|s| !s.success())
        .unwrap_or(true)
    {
        eprintln!("skipped: `unshare --pid --fork` is not allowed here");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    crate::write_safety::big_model(&a, 1);
    crate::write_safety::big_model(&b, 2);
    let work = tmp.path().join("work");
    fs::create_dir(&work).unwrap();
    let slow = work.join("slow");
    // In the new namespace the shell is process 1, the `true`s take the ids up to the one
    // before `pid`, and sinkmerge gets `pid`: an id no process has out here, so a rule that asks
    // /proc whether the writer lives would think it dead.
    let pid = free_pid();
    let script = format!(
        "i=2; while [ $i -lt {pid} ]; do /bin/true; i=$((i+1)); done; \"$0\" \"$@\"; exit $?"
    );
    // The run writes in small shards, and is stopped (its whole process group) as soon as its
    // staging folder holds a file; a run that finished before it was seen is started again.
    let (mut first, group, staging) = (0..5)
        .find_map(|_| {
            let _ = fs::remove_dir_all(&slow);
            let mut first = Command::new("unshare")
                .args(["--pid", "--fork", "sh", "-c", &script])
                .arg(env!("CARGO_BIN_EXE_sinkmerge"))
                .args(["linear", "--models"])
                .args([&a, &b])
                .args(["--max-shard-size", "100k", "-q", "-o"])
                .arg(&slow)
                .process_group(0)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let group = first.id() as i32;
            let started = Instant::now();
            loop {
                let found = fs::read_dir(&work).unwrap().flatten().find(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(".slow.sinkmerge-partial-")
                });
                // Once it holds a file: the writer locks its folder before it writes into it.
                let writing = found.filter(|e| {
                    fs::read_dir(e.path()).is_ok_and(|mut files| files.next().is_some())
                });
                if let Some(entry) = writing {
                    unsafe { libc::kill(-group, libc::SIGSTOP) };
                    return Some((first, group, entry.path()));
                }
                if first.try_wait().unwrap().is_some() {
                    return None;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "no staging folder appeared"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        })
        .expect("the run was never caught while writing in 5 tries");
    // A writer that has computed for a while: its folder is older than any grace period, so
    // only its lock says that it lives.
    let long_ago = std::time::SystemTime::now() - Duration::from_secs(600);
    fs::File::open(&staging)
        .unwrap()
        .set_modified(long_ago)
        .unwrap();
    let name = staging.file_name().unwrap().to_string_lossy().into_owned();
    // A run beside it, out here: it must leave the live run's staging folder alone.
    let (reference, target) = tiny_lms();
    let other = work.join("other");
    let output = sinkmerge([
        "linear",
        "--models",
        &reference,
        &target,
        "-o",
        other.to_str().unwrap(),
        "-q",
    ])
    .output();
    unsafe { libc::kill(-group, libc::SIGCONT) };
    let status = first.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(first.stderr.as_mut().unwrap(), &mut err).unwrap();
    crate::util::ok(&output);
    assert!(
        !crate::util::stderr(&output).contains("removed"),
        "{name}: {}",
        crate::util::stderr(&output)
    );
    assert!(status.success(), "the run in the namespace failed: {err}");
    assert!(slow.join("config.json").is_file());
}
