//! One run at a time in a run's directory: `DIR/.sinkmerge-lock`, locked with flock(2) for as
//! long as the run writes there (docs/commands/reproduce.md, "Concurrent runs"). The kernel
//! releases a flock when the holder's descriptor closes, also when the process is killed, so a
//! dead run never leaves DIR locked and there is nothing to clean up.
//!
//! The file is never replaced nor removed: a flock belongs to the file's inode, and a run that
//! renamed a new file into place (as every other output is written) or removed it would let the
//! next run lock a second inode beside the first holder's.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::bad;
use crate::error::{Error, Result};

/// The lock file, inside DIR.
pub const LOCK: &str = ".sinkmerge-lock";

/// How a run shares DIR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The local executor: DIR is this run's alone.
    Exclusive,
    /// The Slurm executor's submission and its jobs: they share DIR with each other (a job runs
    /// its one step, and Slurm's dependencies order them) but not with a local run.
    Shared,
}

/// Who holds an exclusive lock, written into the lock file for the runs it refuses.
#[derive(Debug, Serialize, Deserialize)]
struct Holder {
    pid: u32,
    host: String,
}

/// A held lock; dropping it releases it.
#[derive(Debug)]
pub struct Lock {
    file: File,
    /// Whether this run wrote its record into the file.
    recorded: bool,
}

impl Drop for Lock {
    fn drop(&mut self) {
        // An exclusive holder clears its record, so that a run refused later by Slurm jobs
        // (shared holders, which record nothing) is not told about a run that has ended.
        if self.recorded {
            let _ = self.file.set_len(0);
        }
    }
}

/// Lock `dir` (created if need be) in `mode`, or refuse at once when another run holds it in a
/// mode that excludes this one: waiting would leave a run hanging for hours behind another
/// with no word, and two runs started into one DIR by mistake are better told at once.
pub fn acquire(dir: &Path, mode: Mode) -> Result<Lock> {
    std::fs::create_dir_all(dir).map_err(|e| Error::write(dir, e))?;
    let path = dir.join(LOCK);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        // A link here could point the holder's record at any file.
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => bad!(
                "{}: is a symlink; reproduce writes only real files inside DIR, remove it",
                path.display()
            ),
            _ => Error::write(&path, e),
        })?;
    let meta = file.metadata().map_err(|e| Error::write(&path, e))?;
    if !meta.is_file() {
        return Err(bad!(
            "{}: not a regular file; reproduce keeps its lock there, remove it",
            path.display()
        ));
    }
    let operation = match mode {
        Mode::Exclusive => libc::LOCK_EX,
        Mode::Shared => libc::LOCK_SH,
    } | libc::LOCK_NB;
    // SAFETY: flock(2) on a descriptor `file` owns; closing it releases the lock.
    if unsafe { libc::flock(file.as_raw_fd(), operation) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(busy(dir, &path, &mut file));
        }
        // A filesystem without flock (Lustre mounted without `flock`, say): the run goes on,
        // unprotected, and says so.
        eprintln!(
            "sinkmerge: warning: {}: cannot lock ({err}); another reproduce into this DIR at \
             the same time would not be refused",
            path.display()
        );
        return Ok(Lock {
            file,
            recorded: false,
        });
    }
    let recorded = mode == Mode::Exclusive;
    if recorded {
        let record = serde_json::to_string(&Holder {
            pid: std::process::id(),
            host: host(),
        })
        .map_err(|e| crate::internal!("lock record: {e}"))?;
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(format!("{record}\n").as_bytes()))
            .and_then(|()| file.sync_all())
            .map_err(|e| Error::write(&path, e))?;
    }
    Ok(Lock { file, recorded })
}

/// The refusal of a run that found DIR locked, naming the holder when it recorded itself.
fn busy(dir: &Path, path: &Path, file: &mut File) -> Error {
    let mut text = String::new();
    let holder = file
        .read_to_string(&mut text)
        .ok()
        .and_then(|_| serde_json::from_str::<Holder>(text.trim()).ok())
        // A record of a process gone from this host is left by a run that was killed; whoever
        // holds the lock now did not record itself.
        .filter(|h| h.host != host() || Path::new(&format!("/proc/{}", h.pid)).exists());
    let who = match holder {
        Some(h) => format!(
            "another sinkmerge reproduce, process {} on host {}, holds {}",
            h.pid,
            h.host,
            path.display()
        ),
        None => format!(
            "another sinkmerge reproduce (a job of its Slurm executor, or a run that has not \
             recorded itself yet) holds {}",
            path.display()
        ),
    };
    Error::Write(format!(
        "-o {}: in use: {who}; this run refuses rather than wait: run it again once that one \
         has ended",
        dir.display()
    ))
}

/// This machine's name, as `hostname` prints it.
fn host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most `buf.len()` bytes into `buf`.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
