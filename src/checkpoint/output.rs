//! All-or-nothing output directories, and the signal handling that keeps them so.
//!
//! Everything is written into a hidden staging directory beside the destination, each file is
//! fsync'd, and the directory is renamed into place only once the whole model is complete: an
//! atomic exchange with an existing destination under `--force`, an atomic no-replace rename
//! otherwise, so two concurrent runs never replace each other's output in silence. A signal only
//! requests cancellation; the thread that writes notices at its next tensor or file, removes its
//! own staging directory and never renames after it. The protocol, and what a user finds after
//! each way a run can die: docs/reference/checkpoints.md, "Writing outputs".

use std::fs::{self, File};
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::error::{signal_name, Error, Result, EXIT_SIGNAL_BASE};
use crate::{bad, bail};

/// The infixes of staging directories and of previous outputs moved aside, after `.NAME`.
const PARTIAL: &str = ".sinkmerge-partial-";
const OLD: &str = ".sinkmerge-old-";

/// Staging paths being written, removed by their writer if the run is cancelled.
static IN_PROGRESS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The signal that requested cancellation, 0 while none has.
static CANCELLED_BY: AtomicI32 = AtomicI32::new(0);

/// Set once an output is in place: a signal that finds no write in progress after that came too
/// late to stop the run, which then finishes as if it had not come.
static OUTPUT_COMMITTED: AtomicBool = AtomicBool::new(false);

/// Held by whichever thread ends the process, so the main thread and the signal thread never
/// run `exit` at the same time.
static EXITING: Mutex<()> = Mutex::new(());

fn track(path: &Path) {
    IN_PROGRESS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(path.to_path_buf());
}

fn untrack(path: &Path) {
    IN_PROGRESS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|p| p != path);
}

/// `Err(Interrupted)` once a signal has requested cancellation. Writers call it before each
/// tensor, file and rename, so a cancelled output is never completed or committed.
pub fn check_cancelled() -> Result<()> {
    match CANCELLED_BY.load(Ordering::SeqCst) {
        0 => Ok(()),
        signal => Err(Error::Interrupted(signal)),
    }
}

/// Print `message` (if any) to stderr and end the process with `code`. The one way sinkmerge
/// exits, so that an exit requested by the signal thread and one by the main thread cannot race
/// (concurrent `exit` calls are undefined in C): the second caller blocks, unheard, until the
/// process is gone.
pub fn exit(code: i32, message: Option<&str>) -> ! {
    let _exiting = EXITING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(message) = message {
        eprintln!("{message}");
    }
    std::process::exit(code)
}

/// What a run stopped by `signal` says: a cancelled output was removed before it was renamed,
/// so the destination is as it was before the run.
pub fn interrupted_message(signal: i32) -> String {
    format!(
        "sinkmerge: interrupted by {}; outputs are complete or absent",
        signal_name(signal)
    )
}

/// Handle SIGINT, SIGTERM and SIGHUP by requesting cancellation. With no output being written
/// the process exits at once with 128 + the signal; otherwise the writing thread removes its
/// staging directory and returns [`Error::Interrupted`], and this thread exits as soon as no
/// write is in progress, unless an output is already in place (the signal came too late to
/// stop it; the run finishes as usual, or stops at its next write check if it has more to
/// write). A second signal exits at once: the destination is still untouched (the rename is
/// atomic), and the staging directory left behind is removed by the next run beside it.
pub fn handle_signals() -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|e| crate::internal!("cannot install the signal handlers: {e}"))?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let Some(signal) = signals.forever().next() else {
                return;
            };
            CANCELLED_BY.store(signal, Ordering::SeqCst);
            let code = EXIT_SIGNAL_BASE + signal;
            loop {
                let writing = IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner());
                if writing.is_empty() {
                    if !OUTPUT_COMMITTED.load(Ordering::SeqCst) {
                        // Exit holding the list: a writer starting now blocks in `track`, so no
                        // staging directory can be created between this check and the end of
                        // the process (one was left behind when `create` ran in that gap).
                        exit(code, Some(&interrupted_message(signal)));
                    }
                    drop(writing);
                    // Past the point of no return: the main thread reports the output it
                    // wrote (and stops at its next check if it has more to write).
                    if let Some(again) = signals.forever().next() {
                        let message =
                            format!("sinkmerge: {} again: exiting now", signal_name(again));
                        exit(EXIT_SIGNAL_BASE + again, Some(&message));
                    }
                    return;
                }
                drop(writing);
                if let Some(again) = signals.pending().next() {
                    let message = format!(
                        "sinkmerge: {} again: exiting now; outputs are complete or absent, and \
                         the next run beside them removes the staging directories left",
                        signal_name(again)
                    );
                    exit(code, Some(&message));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
        .map_err(|e| crate::internal!("cannot start the signal thread: {e}"))?;
    Ok(())
}

/// The checks [`OutputDir::create`] makes, without creating anything, for commands that compute
/// for minutes before they write: `dest` is, contains and lies inside none of `inputs` (nor what
/// their symlinks resolve to), and is not a file, nor a non-empty directory unless `force`.
pub fn check_destination(dest: &Path, inputs: &[&Path], force: bool) -> Result<()> {
    refuse_inputs(dest, inputs)?;
    let dest_abs = absolute(dest)?;
    if dest_abs.exists() {
        if !dest_abs.is_dir() {
            bail!("output {} exists and is not a directory", dest.display());
        }
        let non_empty = fs::read_dir(&dest_abs)
            .map_err(|e| Error::read(dest, e))?
            .next()
            .is_some();
        if non_empty && !force {
            bail!(
                "output {} exists and is not empty; pass --force to replace it",
                dest.display()
            );
        }
    }
    Ok(())
}

pub struct OutputDir {
    dest: PathBuf,
    temp: PathBuf,
    /// Replace an existing destination at commit; without it, a destination that appeared
    /// meanwhile (another run's) is an error.
    force: bool,
    committed: bool,
}

impl OutputDir {
    /// Prepare to write the model directory `dest`. Refuses a destination that is, contains or
    /// lies inside any of `inputs`, an existing file, and a non-empty directory unless `force`.
    pub fn create(dest: &Path, inputs: &[&Path], force: bool) -> Result<OutputDir> {
        check_destination(dest, inputs, force)?;
        let dest_abs = absolute(dest)?;
        let parent = dest_abs.parent().unwrap_or(Path::new("/"));
        fs::create_dir_all(parent).map_err(|e| Error::write(parent, e))?;
        remove_dead_leftovers(parent);
        let name = dest_abs
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        let temp = parent.join(format!(".{name}{PARTIAL}{}", unique_suffix()));
        // Tracked before it exists, so a signal in between cannot leave it behind.
        track(&temp);
        if let Err(e) = fs::create_dir(&temp) {
            untrack(&temp);
            return Err(Error::write(&temp, e));
        }
        Ok(OutputDir {
            dest: dest_abs,
            temp,
            force,
            committed: false,
        })
    }

    /// The directory to write into (the temporary one until commit).
    pub fn path(&self) -> &Path {
        &self.temp
    }

    /// The final destination.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Write a whole small file and fsync it.
    pub fn write_file(&self, name: &str, contents: &[u8]) -> Result<()> {
        check_cancelled()?;
        let path = self.temp.join(name);
        let mut f = File::create(&path).map_err(|e| Error::write(&path, e))?;
        f.write_all(contents).map_err(|e| Error::write(&path, e))?;
        f.sync_all().map_err(|e| Error::write(&path, e))
    }

    /// Write `value` as pretty JSON (with a trailing newline, as `save_pretrained` does).
    pub fn write_json(&self, name: &str, value: &serde_json::Value) -> Result<()> {
        let mut text = serde_json::to_string_pretty(value).expect("JSON values serialize");
        text.push('\n');
        self.write_file(name, text.as_bytes())
    }

    /// Copy `src` into the output under `name`.
    pub fn copy_file(&self, src: &Path, name: &str) -> Result<()> {
        let bytes = fs::read(src).map_err(|e| Error::read(src, e))?;
        self.write_file(name, &bytes)
    }

    /// Make the output visible: fsync the directory, then move it onto the destination in one
    /// atomic step. An existing destination is exchanged with the staging directory (allowed by
    /// `create` only with `--force` or when empty) and then removed; a destination that another
    /// run created while this one wrote is never replaced without `--force`.
    pub fn commit(mut self) -> Result<PathBuf> {
        sync_dir(&self.temp)?;
        let parent = self.dest.parent().unwrap_or(Path::new("/")).to_path_buf();
        check_cancelled()?;
        let replaced = place(&self.temp, &self.dest, self.force)?;
        self.committed = true;
        // Before `untrack`, so the signal thread always sees a write in progress or an output.
        OUTPUT_COMMITTED.store(true, Ordering::SeqCst);
        // After an exchange the staging path holds the previous output, which goes now; if the
        // process dies first, the next run beside it removes it as a dead run's staging.
        if replaced {
            let _ = remove_path(&self.temp);
        }
        untrack(&self.temp);
        sync_dir(&parent)?;
        Ok(self.dest.clone())
    }
}

/// Move the complete staging directory `temp` onto `dest`; true when an existing destination
/// was replaced (its contents are then at `temp`).
fn place(temp: &Path, dest: &Path, force: bool) -> Result<bool> {
    let appeared = || {
        bad!(
            "output {} was created by another process while this run was writing it; it was \
             left as it is (pass --force to replace it)",
            dest.display()
        )
    };
    if fs::symlink_metadata(dest).is_ok() {
        if force {
            match atomic_rename(temp, dest, AtomicRename::Exchange) {
                Ok(()) => return Ok(true),
                // Removed meanwhile: a plain no-replace move below.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) if unsupported(&e) => return replace_in_two_steps(temp, dest),
                Err(e) => return Err(Error::write(dest, e)),
            }
        } else {
            // `create` allowed an empty directory; one that has been filled since is another
            // run's output.
            fs::remove_dir(dest).map_err(|_| appeared())?;
        }
    }
    match atomic_rename(temp, dest, AtomicRename::NoReplace) {
        Ok(()) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(appeared()),
        Err(e) if unsupported(&e) => {
            // A filesystem without renameat2 flags: check, then rename (a narrow race remains,
            // docs/reference/checkpoints.md says so).
            if fs::symlink_metadata(dest).is_ok() {
                return Err(appeared());
            }
            fs::rename(temp, dest).map_err(|e| Error::write(dest, e))?;
            Ok(false)
        }
        Err(e) => Err(Error::write(dest, e)),
    }
}

/// `--force` where the filesystem cannot exchange: move the old output aside, the new one in,
/// and remove the old one. A run killed in between leaves `.NAME.sinkmerge-old-*`, which the
/// next run beside it puts back (no destination) or removes (a destination).
fn replace_in_two_steps(temp: &Path, dest: &Path) -> Result<bool> {
    let parent = dest.parent().unwrap_or(Path::new("/"));
    let name = dest.file_name().unwrap_or_default().to_string_lossy();
    let old = parent.join(format!(".{name}{OLD}{}", unique_suffix()));
    fs::rename(dest, &old).map_err(|e| Error::write(dest, e))?;
    if let Err(e) = fs::rename(temp, dest) {
        // Put the previous output back rather than leave nothing.
        let _ = fs::rename(&old, dest);
        return Err(Error::write(dest, e));
    }
    let _ = remove_path(&old);
    Ok(false)
}

#[derive(Clone, Copy)]
enum AtomicRename {
    /// Swap the two paths (`RENAME_EXCHANGE`).
    Exchange,
    /// Fail with `AlreadyExists` when the destination exists (`RENAME_NOREPLACE`).
    NoReplace,
}

#[cfg(target_os = "linux")]
fn atomic_rename(from: &Path, to: &Path, how: AtomicRename) -> std::io::Result<()> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    let flags = match how {
        AtomicRename::Exchange => RenameFlags::EXCHANGE,
        AtomicRename::NoReplace => RenameFlags::NOREPLACE,
    };
    renameat_with(CWD, from, CWD, to, flags).map_err(std::io::Error::from)
}

#[cfg(not(target_os = "linux"))]
fn atomic_rename(_from: &Path, _to: &Path, _how: AtomicRename) -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

/// A filesystem (or kernel) that does not implement the renameat2 flags.
fn unsupported(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::Unsupported
        || matches!(e.raw_os_error(), Some(code) if code == rustix::io::Errno::INVAL.raw_os_error()
            || code == rustix::io::Errno::NOSYS.raw_os_error())
}

fn remove_path(path: &Path) -> std::io::Result<()> {
    if path.is_dir() && !path.is_symlink() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    }
}

impl Drop for OutputDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.temp);
            untrack(&self.temp);
        }
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::write(dir, e))
}

/// Clean up after killed runs in `dir` (a `kill -9` runs no handler, and a 7B merge leaves
/// 15 GB behind): `.NAME.sinkmerge-partial-PID-*` staging entries are removed, and a
/// `.NAME.sinkmerge-old-PID-*` previous output is put back as `NAME` when the run died between
/// its two renames (no `NAME`), else removed. Only entries of dead processes are touched: a
/// process is gone when `/proc/PID` is; without `/proc` nothing is done, and a live process of the
/// same PID keeps its entries, so a running sinkmerge never loses its output.
fn remove_dead_leftovers(dir: &Path) {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some((name, kind, suffix)) = file_name.strip_prefix('.').and_then(|n| {
            [PARTIAL, OLD].into_iter().find_map(|infix| {
                n.rsplit_once(infix)
                    .map(|(name, suffix)| (name.to_string(), infix, suffix.to_string()))
            })
        }) else {
            continue;
        };
        let Some(pid) = suffix.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() || proc.join(pid.to_string()).exists() {
            continue;
        }
        let path = entry.path();
        let original = dir.join(&name);
        if kind == OLD && !name.is_empty() && fs::symlink_metadata(&original).is_err() {
            if fs::rename(&path, &original).is_ok() {
                eprintln!(
                    "sinkmerge: restored {} from {}, moved aside by an earlier run (process \
                     {pid}) that was killed while replacing it",
                    original.display(),
                    path.display()
                );
            }
            continue;
        }
        if remove_path(&path).is_ok() {
            eprintln!(
                "sinkmerge: removed {}, left by an earlier run (process {pid}) that was killed",
                path.display()
            );
        }
    }
}

fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{nanos:08x}", std::process::id())
}

/// An absolute, normalized path. Existing prefixes are canonicalized so that symlinks (the HF
/// cache is made of them) and `..` cannot hide that two paths are the same.
pub fn absolute(path: &Path) -> Result<PathBuf> {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| Error::read(path, e))?
            .join(path)
    };
    let mut normal = PathBuf::new();
    for comp in joined.components() {
        match comp {
            Component::ParentDir => {
                normal.pop();
            }
            Component::CurDir => {}
            other => normal.push(other.as_os_str()),
        }
    }
    // Canonicalize the longest existing ancestor, then re-append the rest.
    let mut existing = normal.clone();
    let mut rest = Vec::new();
    while !existing.exists() {
        match existing.file_name() {
            Some(name) => rest.push(name.to_os_string()),
            None => break,
        }
        existing.pop();
    }
    let mut out = fs::canonicalize(&existing).unwrap_or(existing);
    for name in rest.into_iter().rev() {
        out.push(name);
    }
    Ok(out)
}

/// The one rule for every output, model directory or report file: it is not, does not lie
/// inside and does not contain any of `inputs`, nor any file or folder that a symlink inside an
/// input resolves to (the Hugging Face cache's snapshots are links into `blobs/`, and a model
/// folder may be links into another), so inputs are never written, whatever path reaches them.
pub fn refuse_inputs(output: &Path, inputs: &[&Path]) -> Result<()> {
    let output_abs = absolute(output)?;
    for input in inputs {
        let input_abs = absolute(input)?;
        let mut locations = vec![(input_abs.clone(), None)];
        linked_locations(&input_abs, 0, &mut locations);
        for (location, link) in locations {
            let relation = if output_abs == location {
                "is"
            } else if output_abs.starts_with(&location) {
                "lies inside"
            } else if location.starts_with(&output_abs) {
                "contains"
            } else {
                continue;
            };
            match link {
                None => bail!(
                    "output {} {relation} input {}; inputs are never written, choose another \
                     output path",
                    output.display(),
                    input.display()
                ),
                Some(link) => bail!(
                    "output {} {relation} {}, which input {} links to (from {}); inputs are \
                     never written, choose another output path",
                    output.display(),
                    location.display(),
                    input.display(),
                    link.display()
                ),
            }
        }
    }
    Ok(())
}

/// Folders deeper than this inside an input are not searched for links (model folders are
/// flat, the HF cache's snapshots one or two levels deep).
const LINK_SEARCH_DEPTH: usize = 8;

/// The canonical targets of the symlinks inside `dir`, each with the link's own path. Linked
/// folders are not descended into: their target covers everything under them.
fn linked_locations(dir: &Path, depth: usize, out: &mut Vec<(PathBuf, Option<PathBuf>)>) {
    if depth > LINK_SEARCH_DEPTH {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_symlink() {
            if let Ok(target) = fs::canonicalize(&path) {
                out.push((target, Some(path)));
            }
        } else if kind.is_dir() {
            linked_locations(&path, depth + 1, out);
        }
    }
}

/// A report file (JSON, CSV or SVG) a command will write, checked before any work: a file name,
/// not a directory, and no input (see [`refuse_inputs`]).
pub fn check_report_file(path: &Path, inputs: &[&Path]) -> Result<()> {
    if absolute(path)?.is_dir() {
        bail!("{} is a directory; give a file name", path.display());
    }
    refuse_inputs(path, inputs)
}

/// Write one file atomically (temp file beside it, fsync, rename): for reports, CSV and SVG.
/// A report replaces an earlier one of the same name, as reports do; a cancelled run leaves the
/// earlier one.
pub fn write_file_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    check_cancelled()?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&dir).map_err(|e| Error::write(&dir, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    remove_dead_leftovers(&dir);
    let temp = dir.join(format!(".{name}{PARTIAL}{}", unique_suffix()));
    track(&temp);
    let result = (|| {
        let mut f = File::create(&temp).map_err(|e| Error::write(path, e))?;
        f.write_all(contents).map_err(|e| Error::write(path, e))?;
        f.sync_all().map_err(|e| Error::write(path, e))?;
        check_cancelled()?;
        fs::rename(&temp, path).map_err(|e| Error::write(path, e))?;
        OUTPUT_COMMITTED.store(true, Ordering::SeqCst);
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    untrack(&temp);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_outputs_overlapping_inputs() {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("model");
        fs::create_dir(&input).unwrap();
        for dest in [
            input.clone(),
            input.join("sub"),
            tmp.path().to_path_buf(),
            input.join("x/../"),
        ] {
            let err = OutputDir::create(&dest, &[&input], true)
                .err()
                .expect("must refuse");
            assert!(err.to_string().contains("input"), "{err}");
        }
        assert!(OutputDir::create(&tmp.path().join("other"), &[&input], false).is_ok());
    }

    #[test]
    fn report_files_follow_the_same_rule() {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("model");
        fs::create_dir(&input).unwrap();
        let err = check_report_file(&input.join("plot.svg"), &[&input]).unwrap_err();
        assert!(err.to_string().contains("lies inside input"), "{err}");
        let err = check_report_file(&input, &[&input]).unwrap_err();
        assert!(err.to_string().contains("is a directory"), "{err}");
        assert!(check_report_file(&tmp.path().join("plot.svg"), &[&input]).is_ok());
    }

    #[test]
    fn uncommitted_output_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        {
            let out = OutputDir::create(&dest, &[], false).unwrap();
            out.write_file("a.txt", b"hello").unwrap();
        }
        assert!(!dest.exists());
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn commit_replaces_with_force_only() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        fs::create_dir(&dest).unwrap();
        fs::write(dest.join("old.txt"), b"old").unwrap();
        assert!(OutputDir::create(&dest, &[], false).is_err());
        let out = OutputDir::create(&dest, &[], true).unwrap();
        out.write_file("new.txt", b"new").unwrap();
        out.commit().unwrap();
        assert!(dest.join("new.txt").exists() && !dest.join("old.txt").exists());
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_destination_created_meanwhile_is_kept_without_force_and_replaced_with_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        let ours = OutputDir::create(&dest, &[], false).unwrap();
        ours.write_file("ours.txt", b"ours").unwrap();
        fs::create_dir(&dest).unwrap();
        fs::write(dest.join("theirs.txt"), b"theirs").unwrap();
        let err = ours.commit().unwrap_err();
        assert!(err.to_string().contains("another process"), "{err}");
        assert_eq!(err.exit_code(), 2);
        assert!(dest.join("theirs.txt").exists() && !dest.join("ours.txt").exists());
        assert_eq!(
            fs::read_dir(tmp.path()).unwrap().count(),
            1,
            "staging removed"
        );

        let forced = OutputDir::create(&dest, &[], true).unwrap();
        forced.write_file("ours.txt", b"ours").unwrap();
        forced.commit().unwrap();
        assert!(!dest.join("theirs.txt").exists() && dest.join("ours.txt").exists());
        assert_eq!(
            fs::read_dir(tmp.path()).unwrap().count(),
            1,
            "the old output removed"
        );
    }

    #[test]
    fn an_empty_destination_is_filled_without_force() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        fs::create_dir(&dest).unwrap();
        let out = OutputDir::create(&dest, &[], false).unwrap();
        out.write_file("a.txt", b"a").unwrap();
        out.commit().unwrap();
        assert!(dest.join("a.txt").is_file());
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1);
    }
}
