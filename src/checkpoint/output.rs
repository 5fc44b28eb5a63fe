//! All-or-nothing output directories.
//!
//! Everything is written into a hidden temporary directory beside the destination, each file is
//! fsync'd, and the directory is renamed into place only once the whole model is complete. If the
//! process fails before [`OutputDir::commit`], the temporary directory is removed and the
//! destination is untouched.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use crate::bail;
use crate::error::{Error, Result};

/// Temporary outputs in progress, removed if the user interrupts the process.
static IN_PROGRESS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

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

/// On Ctrl-C (or SIGTERM), remove every temporary output in progress before exiting with 130,
/// so an interrupted run leaves neither a destination nor a hidden partial directory behind.
pub fn remove_partial_outputs_on_interrupt() {
    let _ = ctrlc::set_handler(|| {
        for path in IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = if path.is_dir() {
                fs::remove_dir_all(path)
            } else {
                fs::remove_file(path)
            };
        }
        eprintln!("sinkmerge: interrupted; partial output removed");
        std::process::exit(130);
    });
}

pub struct OutputDir {
    dest: PathBuf,
    temp: PathBuf,
    committed: bool,
}

impl OutputDir {
    /// Prepare to write the model directory `dest`. Refuses a destination that is, contains or
    /// lies inside any of `inputs`, an existing file, and a non-empty directory unless `force`.
    pub fn create(dest: &Path, inputs: &[&Path], force: bool) -> Result<OutputDir> {
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
        let parent = dest_abs.parent().unwrap_or(Path::new("/"));
        fs::create_dir_all(parent).map_err(|e| Error::write(parent, e))?;
        remove_dead_partials(parent);
        let name = dest_abs
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        let temp = parent.join(format!(".{name}.sinkmerge-partial-{}", unique_suffix()));
        fs::create_dir(&temp).map_err(|e| Error::write(&temp, e))?;
        track(&temp);
        Ok(OutputDir {
            dest: dest_abs,
            temp,
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

    /// Make the output visible: fsync the directory, then rename it onto the destination
    /// (replacing an existing one, which `create` allowed only with `--force` or when empty).
    pub fn commit(mut self) -> Result<PathBuf> {
        sync_dir(&self.temp)?;
        let parent = self.dest.parent().unwrap_or(Path::new("/")).to_path_buf();
        if self.dest.exists() {
            let old = parent.join(format!(
                ".{}.sinkmerge-old-{}",
                self.dest.file_name().unwrap_or_default().to_string_lossy(),
                unique_suffix()
            ));
            fs::rename(&self.dest, &old).map_err(|e| Error::write(&self.dest, e))?;
            if let Err(e) = fs::rename(&self.temp, &self.dest) {
                // Put the previous output back rather than leave nothing.
                let _ = fs::rename(&old, &self.dest);
                return Err(Error::write(&self.dest, e));
            }
            let _ = fs::remove_dir_all(&old);
        } else {
            fs::rename(&self.temp, &self.dest).map_err(|e| Error::write(&self.dest, e))?;
        }
        self.committed = true;
        untrack(&self.temp);
        sync_dir(&parent)?;
        Ok(self.dest.clone())
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

/// Remove what killed runs left in `dir`: `.NAME.sinkmerge-partial-PID-*` entries whose process
/// is gone (a `kill -9` runs no handler, and a 7B merge leaves 15 GB behind). A process is gone
/// when `/proc/PID` is; without `/proc` nothing is removed, and a live process of the same PID
/// keeps its entry, so a running sinkmerge never loses its output.
fn remove_dead_partials(dir: &Path) {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix('.')
            .and_then(|n| n.rsplit_once(".sinkmerge-partial-"))
            .and_then(|(_, suffix)| suffix.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || proc.join(pid.to_string()).exists() {
            continue;
        }
        let path = entry.path();
        let removed = if path.is_dir() && !path.is_symlink() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        if removed.is_ok() {
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
/// inside and does not contain any of `inputs`, so inputs are never written.
pub fn refuse_inputs(output: &Path, inputs: &[&Path]) -> Result<()> {
    let output_abs = absolute(output)?;
    for input in inputs {
        let input_abs = absolute(input)?;
        let relation = if output_abs == input_abs {
            "is"
        } else if output_abs.starts_with(&input_abs) {
            "lies inside"
        } else if input_abs.starts_with(&output_abs) {
            "contains"
        } else {
            continue;
        };
        bail!(
            "output {} {relation} input {}; inputs are never written, choose another output path",
            output.display(),
            input.display()
        );
    }
    Ok(())
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
pub fn write_file_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&dir).map_err(|e| Error::write(&dir, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    remove_dead_partials(&dir);
    let temp = dir.join(format!(".{name}.sinkmerge-partial-{}", unique_suffix()));
    track(&temp);
    let result = (|| {
        let mut f = File::create(&temp)?;
        f.write_all(contents)?;
        f.sync_all()?;
        fs::rename(&temp, path)
    })();
    untrack(&temp);
    if let Err(e) = result {
        let _ = fs::remove_file(&temp);
        return Err(Error::write(path, e));
    }
    Ok(())
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
}
