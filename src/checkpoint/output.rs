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

/// What an output path names, which decides what may already be there: an existing regular file
/// is replaced by a new report; an existing folder only with `--force`, and only when it holds
/// nothing but what this kind of output holds (docs/reference/checkpoints.md, "Writing outputs").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// One file: a report, CSV, SVG or capture file.
    File,
    /// A model folder: config, weights, tokenizer and the files a model ships with.
    Model,
    /// A folder of figures (`visual-sinks --plot`).
    Figures,
    /// A folder a command fills file by file and resumes in (`reproduce -o DIR`): what is in
    /// it stays, and it is never replaced whole.
    Workspace,
}

impl OutputKind {
    /// Whether a folder of this kind holds a file named `name`: `--force` replaces a folder only
    /// when all of its entries are such files, so a folder of the user's is never removed.
    fn holds(self, name: &str) -> bool {
        let extension = Path::new(name).extension().and_then(|e| e.to_str());
        match self {
            OutputKind::File | OutputKind::Workspace => false,
            OutputKind::Model => {
                name == ".gitattributes"
                    || matches!(
                        extension,
                        Some(
                            "safetensors"
                                | "json"
                                | "txt"
                                | "model"
                                | "md"
                                | "jinja"
                                | "py"
                                | "tiktoken"
                                | "yml"
                                | "yaml"
                        )
                    )
            }
            OutputKind::Figures => {
                matches!(extension, Some("svg" | "html" | "png" | "json" | "csv"))
            }
        }
    }

    fn describe(self) -> &'static str {
        match self {
            OutputKind::File => "a file",
            OutputKind::Model => "a model folder",
            OutputKind::Figures => "a folder of figures",
            OutputKind::Workspace => "a working folder of its own",
        }
    }
}

/// The one check of every path a command writes, made before any work: each output against the
/// others and against every input, with all paths resolved as the kernel resolves them (symlinks
/// at any position, `..` after a link, hard links), and each existing output against what may
/// be replaced. [`OutputDir::create`] and [`write_file_atomic`] check again when they write.
pub struct Outputs<'a> {
    outputs: Vec<(&'a str, &'a Path, OutputKind)>,
    inputs: Vec<(&'a str, &'a Path)>,
    force: bool,
}

impl<'a> Outputs<'a> {
    /// `force`: replace an existing output folder of the command's own kind (`--force`).
    pub fn new(force: bool) -> Outputs<'a> {
        Outputs {
            outputs: Vec::new(),
            inputs: Vec::new(),
            force,
        }
    }

    /// An output named by `flag` (`-o`, `--csv`, ...), when given.
    pub fn output(mut self, flag: &'a str, path: Option<&'a Path>, kind: OutputKind) -> Self {
        self.outputs.extend(path.map(|p| (flag, p, kind)));
        self
    }

    /// Report files named by their flags, the ones given.
    pub fn files(mut self, files: impl IntoIterator<Item = (&'a str, Option<&'a Path>)>) -> Self {
        for (flag, path) in files {
            self = self.output(flag, path, OutputKind::File);
        }
        self
    }

    /// Inputs, named as `label` in messages: a flag for an input file (`--prompts`), `input`
    /// for a model folder.
    pub fn inputs(mut self, label: &'a str, paths: impl IntoIterator<Item = &'a Path>) -> Self {
        self.inputs.extend(paths.into_iter().map(|p| (label, p)));
        self
    }

    /// Every check: run it once the inputs are known, before any output is written.
    pub fn check(&self) -> Result<()> {
        self.run(true)
    }

    /// The checks that need no inputs (what each output path is, where it lies, the outputs
    /// against each other), for a command that resolves its models (perhaps from the Hub) only
    /// later: what an existing folder holds is judged by [`Outputs::check`], so that an output
    /// that is an input is named as such and not offered `--force`.
    pub fn check_before_inputs(&self) -> Result<()> {
        self.run(false)
    }

    fn run(&self, contents: bool) -> Result<()> {
        let inputs: Vec<ResolvedInput> = (self.inputs.iter())
            .map(|&(label, path)| ResolvedInput::new(label, path))
            .collect::<Result<_>>()?;
        let mut seen: Vec<(&str, &Path, PathBuf)> = Vec::new();
        for &(flag, path, kind) in &self.outputs {
            refuse_special(flag, path, kind)?;
            let abs = absolute(path)?;
            // The deepest existing ancestor must be a folder: writing below a file would fail
            // only at the end.
            if let Some(file) = abs.ancestors().skip(1).find(|a| a.exists()) {
                if !file.is_dir() {
                    bail!(
                        "{flag} {}: {} is a file, not a directory",
                        path.display(),
                        file.display()
                    );
                }
            }
            if matches!(kind, OutputKind::Model | OutputKind::Figures) {
                refuse_home_and_working_folder(flag, path, &abs)?;
            }
            for (other_flag, other, other_abs) in &seen {
                let relation = if same_file(&abs, other_abs) {
                    "is the same file as"
                } else if abs.starts_with(other_abs) {
                    "lies inside"
                } else if other_abs.starts_with(&abs) {
                    "contains"
                } else {
                    continue;
                };
                bail!(
                    "{flag} {} {relation} {other_flag} {}; give each output its own path",
                    path.display(),
                    other.display()
                );
            }
            for input in &inputs {
                input.refuse(flag, path, &abs)?;
            }
            if contents {
                check_existing(flag, path, kind, self.force)?;
            }
            seen.push((flag, path, abs));
        }
        Ok(())
    }
}

/// What an existing entry is, in words, when it is not a regular file or folder.
fn special_kind(file_type: &fs::FileType) -> Option<&'static str> {
    (!file_type.is_file() && !file_type.is_dir()).then(|| crate::input::kind_in_words(file_type))
}

/// Device nodes, FIFOs, sockets and links are never replaced: a rename would put a regular file
/// in their place (`-o /dev/null` as root would replace the system's). A file output is never a
/// folder.
fn refuse_special(flag: &str, path: &Path, kind: OutputKind) -> Result<()> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    if let Some(what) = special_kind(&meta.file_type()) {
        let target = match fs::read_link(path) {
            Ok(target) => format!(" to {}", target.display()),
            Err(_) => String::new(),
        };
        bail!(
            "{flag} {} is {what}{target}; sinkmerge writes {} and never replaces anything else: \
             choose another path",
            path.display(),
            kind.describe()
        );
    }
    if kind == OutputKind::File && meta.is_dir() {
        bail!("{flag} {} is a directory; give a file name", path.display());
    }
    Ok(())
}

/// An existing output may be replaced only by one of its kind: a regular file by a file; a
/// folder by a folder, when empty or, with `--force`, when it holds only what this kind of
/// output holds.
fn check_existing(flag: &str, path: &Path, kind: OutputKind, force: bool) -> Result<()> {
    let Ok(meta) = fs::metadata(path) else {
        return Ok(());
    };
    match kind {
        OutputKind::File => Ok(()),
        _ if !meta.is_dir() => bail!("{flag} {} exists and is not a directory", path.display()),
        OutputKind::Workspace => Ok(()),
        _ => {
            let entries = fs::read_dir(path).map_err(|e| Error::read(path, e))?;
            let mut any = false;
            for entry in entries {
                let entry = entry.map_err(|e| Error::read(path, e))?;
                any = true;
                let name = entry.file_name().to_string_lossy().into_owned();
                let file_type = entry.file_type().map_err(|e| Error::read(path, e))?;
                let foreign = if file_type.is_file() {
                    (!kind.holds(&name)).then(|| format!("`{name}`"))
                } else if file_type.is_dir() {
                    Some(format!("the folder `{name}`"))
                } else {
                    Some(format!(
                        "`{name}`, {}",
                        special_kind(&file_type).unwrap_or("")
                    ))
                };
                if let Some(foreign) = foreign {
                    bail!(
                        "{flag} {} holds {foreign}, which is not part of {}; --force replaces \
                         only a folder of what this command writes: move it away or choose \
                         another path",
                        path.display(),
                        kind.describe()
                    );
                }
            }
            if any && !force {
                bail!(
                    "{flag} {} exists and is not empty; pass --force to replace it",
                    path.display()
                );
            }
            Ok(())
        }
    }
}

/// A folder output is written by renaming a new folder over it: never the working folder, the
/// home folder or a folder that holds either, whatever they hold.
fn refuse_home_and_working_folder(flag: &str, path: &Path, abs: &Path) -> Result<()> {
    let working = std::env::current_dir().and_then(fs::canonicalize);
    let home = std::env::var_os("HOME").map(|h| fs::canonicalize(h).unwrap_or_default());
    for (folder, name) in [
        (working.ok(), "the working folder"),
        (home, "your home folder"),
    ] {
        let Some(folder) = folder.filter(|f| f.is_absolute()) else {
            continue;
        };
        let relation = if folder == abs {
            "is"
        } else if folder.starts_with(abs) {
            "holds"
        } else {
            continue;
        };
        bail!(
            "{flag} {} {relation} {name} ({}); sinkmerge replaces an output folder whole, so \
             name a new folder inside it",
            path.display(),
            folder.display()
        );
    }
    Ok(())
}

/// An input as the checks compare outputs with it, resolved once for all outputs: a file, or
/// a folder with the canonical targets of the symlinks inside it (each with the link's path).
struct ResolvedInput<'a> {
    label: &'a str,
    path: &'a Path,
    abs: PathBuf,
    /// `None` for a file.
    locations: Option<Vec<(PathBuf, Option<PathBuf>)>>,
}

impl<'a> ResolvedInput<'a> {
    fn new(label: &'a str, path: &'a Path) -> Result<ResolvedInput<'a>> {
        let abs = absolute(path)?;
        let locations = (!abs.is_file()).then(|| {
            let mut locations = vec![(abs.clone(), None)];
            linked_locations(&abs, 0, &mut locations);
            locations
        });
        Ok(ResolvedInput {
            label,
            path,
            abs,
            locations,
        })
    }

    /// The output `path` (resolved: `abs`) is not, does not lie inside and does not contain the
    /// input, nor any file or folder that a symlink inside the input resolves to (the Hugging Face
    /// cache's snapshots are links into `blobs/`), nor a hard link of one of the input's files.
    fn refuse(&self, flag: &str, path: &Path, abs: &Path) -> Result<()> {
        let (label, input) = (self.label, self.path);
        let Some(locations) = &self.locations else {
            if same_file(abs, &self.abs) || self.abs.starts_with(abs) {
                bail!(
                    "{flag} {} would overwrite the {label} file {}; inputs are never written",
                    path.display(),
                    input.display()
                );
            }
            return Ok(());
        };
        for (location, link) in locations {
            let relation = if abs == location.as_path() {
                "is"
            } else if abs.starts_with(location) {
                "lies inside"
            } else if location.starts_with(abs) {
                "contains"
            } else {
                continue;
            };
            match link {
                None => bail!(
                    "{flag} {} {relation} {label} {}; inputs are never written, choose another \
                     output path",
                    path.display(),
                    input.display()
                ),
                Some(link) => bail!(
                    "{flag} {} {relation} {}, which {label} {} links to (from {}); inputs are never \
                     written, choose another output path",
                    path.display(),
                    location.display(),
                    input.display(),
                    link.display()
                ),
            }
        }
        // A hard link: another name of one of the input's files.
        if let Some(file) = same_inode_inside(abs, &self.abs) {
            bail!(
                "{flag} {} is a hard link of {}, a file of {label} {}; inputs are never written, \
                 choose another output path",
                path.display(),
                file.display(),
                input.display()
            );
        }
        Ok(())
    }
}

/// Whether two resolved paths are one file: equal, or hard links of the same inode.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    a == b
        || matches!(
            (fs::metadata(a), fs::metadata(b)),
            (Ok(x), Ok(y)) if x.dev() == y.dev() && x.ino() == y.ino()
        )
}

/// The file under `dir` (as deep as [`LINK_SEARCH_DEPTH`]) that is the inode of the existing
/// file `output`, if any.
fn same_inode_inside(output: &Path, dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(output).ok().filter(|m| m.is_file())?;
    fn walk(dir: &Path, depth: usize, dev: u64, ino: u64) -> Option<PathBuf> {
        if depth > LINK_SEARCH_DEPTH {
            return None;
        }
        for entry in fs::read_dir(dir).ok()?.flatten() {
            let kind = entry.file_type().ok()?;
            let path = entry.path();
            if kind.is_dir() {
                if let Some(found) = walk(&path, depth + 1, dev, ino) {
                    return Some(found);
                }
            } else if kind.is_file() {
                let m = entry.metadata().ok()?;
                if m.dev() == dev && m.ino() == ino {
                    return Some(path);
                }
            }
        }
        None
    }
    walk(dir, 0, meta.dev(), meta.ino())
}

pub struct OutputDir {
    dest: PathBuf,
    temp: PathBuf,
    /// Replace an existing destination at commit; without it, a destination that appeared
    /// meanwhile (another run's) is an error.
    force: bool,
    committed: bool,
    /// The flock(2) held on the staging folder while this run lives, so that a run beside it
    /// (in any PID namespace) knows it is not a dead run's leftover; `None` on a file system
    /// without flock.
    _lock: Option<File>,
}

impl OutputDir {
    /// Prepare to write the folder `dest`, of `kind`, checked by [`Outputs::check`] against
    /// `inputs` (model folders and input files).
    pub fn create(
        dest: &Path,
        kind: OutputKind,
        inputs: &[&Path],
        force: bool,
    ) -> Result<OutputDir> {
        Outputs::new(force)
            .output("output", Some(dest), kind)
            .inputs("input", inputs.iter().copied())
            .check()?;
        let dest_abs = absolute(dest)?;
        let parent = dest_abs.parent().unwrap_or(Path::new("/"));
        fs::create_dir_all(parent).map_err(|e| Error::write(parent, e))?;
        remove_dead_leftovers(parent);
        let name = dest_abs
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        let plain = parent.join(format!(".{name}{PARTIAL}{}", unique_suffix()));
        let locked = with_lock_suffix(&plain);
        // Tracked before it exists, so a signal in between cannot leave it behind.
        track(&locked);
        if let Err(e) = fs::create_dir(&locked) {
            untrack(&locked);
            return Err(Error::write(&locked, e));
        }
        let (temp, lock) = match lock(&locked) {
            Some(lock) => (locked, Some(lock)),
            // No flock here: the name without the suffix says that the PID rule applies.
            None => {
                track(&plain);
                let renamed = fs::rename(&locked, &plain);
                untrack(&locked);
                if let Err(e) = renamed {
                    untrack(&plain);
                    let _ = fs::remove_dir(&locked);
                    return Err(Error::write(&plain, e));
                }
                (plain, None)
            }
        };
        Ok(OutputDir {
            dest: dest_abs,
            temp,
            force,
            committed: false,
            _lock: lock,
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
    if let Ok(meta) = fs::symlink_metadata(dest) {
        // Checked before the work began; checked again in case it changed meanwhile.
        if let Some(what) = special_kind(&meta.file_type()) {
            bail!(
                "output {} is now {what}; it was not replaced",
                dest.display()
            );
        }
        if !meta.is_dir() {
            bail!("output {} exists and is not a directory", dest.display());
        }
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
/// and remove the old one. The old output is locked while it is aside, so a run beside it knows
/// that this run lives; one killed in between leaves `.NAME.sinkmerge-old-*`, which the next run
/// beside it puts back (no destination) or removes (a destination).
fn replace_in_two_steps(temp: &Path, dest: &Path) -> Result<bool> {
    let parent = dest.parent().unwrap_or(Path::new("/"));
    let name = dest.file_name().unwrap_or_default().to_string_lossy();
    let plain = parent.join(format!(".{name}{OLD}{}", unique_suffix()));
    let held = lock(dest);
    let old = match held {
        Some(_) => with_lock_suffix(&plain),
        None => plain,
    };
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

/// A file an output model carries besides its weights and the files copied from its inputs (a
/// model card, a recipe), written into the staged directory before it is committed.
pub trait ExtraFile: Sync {
    fn write_into(&self, out: &OutputDir) -> Result<()>;
}

/// An extra file given by its name and bytes.
pub struct NamedFile {
    pub name: &'static str,
    pub bytes: Vec<u8>,
}

impl ExtraFile for NamedFile {
    fn write_into(&self, out: &OutputDir) -> Result<()> {
        out.write_file(self.name, &self.bytes)
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::write(dir, e))
}

/// The suffix of the staging and moved-aside entries whose writer holds flock(2) on them for as
/// long as it lives: the kernel releases the lock when the process dies, in any PID namespace
/// and on any node that shares the lock (docs/reference/checkpoints.md, "Leftovers").
const LOCKED: &str = "-flock";

/// A locked entry younger than this is never taken for a leftover: its writer creates it and
/// locks it a moment later.
const LOCK_GRACE: Duration = Duration::from_secs(10);

fn with_lock_suffix(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(LOCKED);
    PathBuf::from(name)
}

/// An exclusive flock(2) on the folder or regular file `path`, taken without waiting: `None`
/// when another process holds it or the file system has no flock. Links are not followed and
/// opening never blocks (a FIFO planted under a staging name).
fn lock(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !(meta.is_dir() || meta.is_file()) {
        return None;
    }
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).ok()?;
    Some(file)
}

/// Whether the writer of the leftover `path` (named with `pid`, `locked` when its writer held a
/// flock on it) is gone. A locked entry's writer is gone when the lock can be taken; the lock
/// is then returned, held while the entry is removed or restored. An entry without the lock
/// suffix (a file system without flock) is judged by its process id: gone when `/proc/PID` is,
/// which cannot see a writer in another PID namespace (docs/reference/checkpoints.md).
fn writer_gone(path: &Path, pid: u32, locked: bool) -> Option<Option<File>> {
    if locked {
        let meta = fs::symlink_metadata(path).ok()?;
        let age = meta
            .modified()
            .ok()
            .map(|t| match t.elapsed() {
                Ok(age) => age,
                // In the future (another node's clock): young.
                Err(_) => Duration::ZERO,
            })
            .unwrap_or(Duration::ZERO);
        if age < LOCK_GRACE {
            return None;
        }
        return lock(path).map(Some);
    }
    let proc = Path::new("/proc");
    let gone = proc.join("self").exists()
        && pid != std::process::id()
        && !proc.join(pid.to_string()).exists();
    gone.then_some(None)
}

/// Clean up after killed runs in `dir` (a `kill -9` runs no handler, and a 7B merge leaves
/// 15 GB behind): `.NAME.sinkmerge-partial-*` staging entries are removed, and a
/// `.NAME.sinkmerge-old-*` previous output is put back as `NAME` when the run died between its
/// two renames (no `NAME`), else removed. Only entries whose writer is gone are touched
/// ([`writer_gone`]), so a running sinkmerge never loses its output.
fn remove_dead_leftovers(dir: &Path) {
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
        let path = entry.path();
        let Some(_held) = writer_gone(&path, pid, suffix.ends_with(LOCKED)) else {
            continue;
        };
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

/// An absolute path resolved as the kernel resolves it: each existing component is
/// canonicalized before the next is applied, so `..` after a symlink leaves the link's target,
/// not the link's folder (`L/../x`, with `L -> d/sub`, is `d/x`). Components past the deepest
/// existing one are kept as written, with `.` and `..` applied to them.
pub fn absolute(path: &Path) -> Result<PathBuf> {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| Error::read(path, e))?
            .join(path)
    };
    let mut out = PathBuf::from("/");
    // Components pushed as written, after the first that does not exist.
    let mut unresolved = 0usize;
    for comp in joined.components() {
        match comp {
            Component::Prefix(_) | Component::RootDir | Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
                unresolved = unresolved.saturating_sub(1);
            }
            Component::Normal(name) => {
                out.push(name);
                if unresolved > 0 {
                    unresolved += 1;
                } else {
                    match fs::canonicalize(&out) {
                        Ok(real) => out = real,
                        Err(_) => unresolved = 1,
                    }
                }
            }
        }
    }
    Ok(out)
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

/// Write one file atomically (temp file beside it, fsync, rename): for reports, CSV and SVG.
/// A report replaces an earlier regular file of the same name, as reports do, and nothing else
/// ([`Outputs::check`]); a cancelled run leaves the earlier one.
pub fn write_file_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    check_cancelled()?;
    let refuse_special = || -> Result<()> {
        if let Ok(meta) = fs::symlink_metadata(path) {
            if let Some(what) = special_kind(&meta.file_type()) {
                bail!("{} is {what}; it was not replaced", path.display());
            }
            if meta.is_dir() {
                bail!("{} is a directory; give a file name", path.display());
            }
        }
        Ok(())
    };
    refuse_special()?;
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
    let plain = dir.join(format!(".{name}{PARTIAL}{}", unique_suffix()));
    let locked = with_lock_suffix(&plain);
    track(&locked);
    let create = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&locked);
    let mut f = match create {
        Ok(f) => f,
        Err(e) => {
            untrack(&locked);
            return Err(Error::write(path, e));
        }
    };
    let temp =
        if rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok() {
            locked
        } else {
            // No flock here: the name without the suffix says that the PID rule applies.
            track(&plain);
            let renamed = fs::rename(&locked, &plain);
            untrack(&locked);
            if let Err(e) = renamed {
                untrack(&plain);
                let _ = fs::remove_file(&locked);
                return Err(Error::write(path, e));
            }
            plain
        };
    let result = (|| {
        f.write_all(contents).map_err(|e| Error::write(path, e))?;
        f.sync_all().map_err(|e| Error::write(path, e))?;
        check_cancelled()?;
        refuse_special()?;
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
            let err = OutputDir::create(&dest, OutputKind::Model, &[&input], true)
                .err()
                .expect("must refuse");
            assert!(err.to_string().contains("input"), "{err}");
        }
        assert!(OutputDir::create(
            &tmp.path().join("other"),
            OutputKind::Model,
            &[&input],
            false
        )
        .is_ok());
    }

    #[test]
    fn report_files_follow_the_same_rule() {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("model");
        fs::create_dir(&input).unwrap();
        let check = |path: &Path| {
            Outputs::new(false)
                .output("--plot", Some(path), OutputKind::File)
                .inputs("input", [input.as_path()])
                .check()
        };
        let err = check(&input.join("plot.svg")).unwrap_err();
        assert!(err.to_string().contains("lies inside input"), "{err}");
        let err = check(&input).unwrap_err();
        assert!(err.to_string().contains("is a directory"), "{err}");
        assert!(check(&tmp.path().join("plot.svg")).is_ok());
    }

    #[test]
    fn dotdot_after_a_link_leaves_the_links_target() {
        let tmp = tempfile::tempdir().unwrap();
        let real = fs::canonicalize(tmp.path()).unwrap();
        fs::create_dir_all(real.join("d/sub")).unwrap();
        std::os::unix::fs::symlink(real.join("d/sub"), real.join("L")).unwrap();
        assert_eq!(absolute(&real.join("L/../x")).unwrap(), real.join("d/x"));
        assert_eq!(
            absolute(&real.join("L/../sub/.")).unwrap(),
            real.join("d/sub")
        );
        // Past the deepest existing folder, `..` applies to what was written.
        assert_eq!(
            absolute(&real.join("L/new/../y/z")).unwrap(),
            real.join("d/sub/y/z")
        );
        assert_eq!(absolute(&real.join("L/new/../..")).unwrap(), real.join("d"));
    }

    #[test]
    fn force_replaces_only_a_folder_of_the_outputs_kind() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        fs::create_dir(&dest).unwrap();
        fs::write(dest.join("model.safetensors"), b"old").unwrap();
        let check = |kind| {
            Outputs::new(true)
                .output("-o", Some(dest.as_path()), kind)
                .check()
        };
        assert!(check(OutputKind::Model).is_ok());
        let err = check(OutputKind::Figures).unwrap_err();
        assert!(err.to_string().contains("`model.safetensors`"), "{err}");
        fs::create_dir(dest.join("runs")).unwrap();
        let err = check(OutputKind::Model).unwrap_err();
        assert!(err.to_string().contains("the folder `runs`"), "{err}");
        assert!(check(OutputKind::Workspace).is_ok());
    }

    #[test]
    fn a_locked_leftover_is_kept_until_its_lock_is_free() {
        let tmp = tempfile::tempdir().unwrap();
        // Named with a process id nobody has: the lock, not the id, decides.
        let staging = tmp
            .path()
            .join(format!(".out{PARTIAL}4294967-0000beef{LOCKED}"));
        fs::create_dir(&staging).unwrap();
        let old = std::time::SystemTime::now() - 2 * LOCK_GRACE;
        File::open(&staging).unwrap().set_modified(old).unwrap();
        let held = lock(&staging).expect("flock on a new folder");
        remove_dead_leftovers(tmp.path());
        assert!(staging.is_dir(), "a held lock is a live writer");
        drop(held);
        // Just made: its writer may not have locked it yet.
        let young = tmp
            .path()
            .join(format!(".new{PARTIAL}4294967-0000cafe{LOCKED}"));
        fs::create_dir(&young).unwrap();
        remove_dead_leftovers(tmp.path());
        assert!(!staging.exists() && young.is_dir());
    }

    #[test]
    fn uncommitted_output_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        {
            let out = OutputDir::create(&dest, OutputKind::Model, &[], false).unwrap();
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
        assert!(OutputDir::create(&dest, OutputKind::Model, &[], false).is_err());
        let out = OutputDir::create(&dest, OutputKind::Model, &[], true).unwrap();
        out.write_file("new.txt", b"new").unwrap();
        out.commit().unwrap();
        assert!(dest.join("new.txt").exists() && !dest.join("old.txt").exists());
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_destination_created_meanwhile_is_kept_without_force_and_replaced_with_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        let ours = OutputDir::create(&dest, OutputKind::Model, &[], false).unwrap();
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

        let forced = OutputDir::create(&dest, OutputKind::Model, &[], true).unwrap();
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
        let out = OutputDir::create(&dest, OutputKind::Model, &[], false).unwrap();
        out.write_file("a.txt", b"a").unwrap();
        out.commit().unwrap();
        assert!(dest.join("a.txt").is_file());
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1);
    }
}
