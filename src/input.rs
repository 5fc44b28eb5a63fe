//! Input files that are read whole (manifests, prompt files, panels, `--pixel-values`, images,
//! processor configs), each with a documented size cap (docs/reference/checkpoints.md, "Input
//! files and their caps"). Only regular files are read: a link to `/dev/zero` would fill memory
//! and a FIFO would block forever, so the path's type is checked, following links, before it is
//! opened, and a refusal says what the path is. Standard input, `-`, is taken where a stream
//! makes sense ([`read_stream`]), under the same cap.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, Result};
use crate::units::human_bytes;
use crate::{bad, bail};

/// A kind of input file: its name in messages and the most bytes read from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cap {
    pub what: &'static str,
    pub bytes: u64,
}

/// `visual-sinks --manifest`: a line is a few hundred bytes, so 64 MiB is some 200,000 lines.
pub const MANIFEST: Cap = Cap {
    what: "manifest",
    bytes: 64 << 20,
};

/// `--prompts`: one prompt a line; 64 MiB is far past any prompt set a forward pass per prompt
/// can score.
pub const PROMPTS: Cap = Cap {
    what: "prompt file",
    bytes: 64 << 20,
};

/// `reproduce --panel`: a CSV of model pairs, each a whole pipeline.
pub const PANEL: Cap = Cap {
    what: "panel",
    bytes: 1 << 20,
};

/// `--pixel-values`: a processor's output. 4 GiB is the largest output a processor may be
/// configured to make ([`crate::image`]): `3 · temporal_patch_size · max_pixels` f32 values with
/// the default temporal patch of 2 at the decoder's pixel limit.
pub const PIXEL_VALUES: Cap = Cap {
    what: "pixel-values file",
    bytes: 4 << 30,
};

/// An image file (PNG, JPEG, WebP). Compressed, an image at the decoder's pixel limit
/// ([`crate::image::decode::MAX_PIXELS`]) is well under this.
pub const IMAGE: Cap = Cap {
    what: "image",
    bytes: 512 << 20,
};

/// `preprocessor_config.json` and `processor_config.json`: a few hundred bytes in practice.
pub const PROCESSOR_CONFIG: Cap = Cap {
    what: "processor config",
    bytes: 1 << 20,
};

/// `generation_config.json`: a few hundred bytes in practice, like the processor configs.
pub const GENERATION_CONFIG: Cap = Cap {
    what: "generation config",
    bytes: 1 << 20,
};

/// What a file system entry is, in words, for the messages that refuse one that is not a
/// regular file (here, and the outputs' checks in `checkpoint::output`).
pub fn kind_in_words(t: &std::fs::FileType) -> &'static str {
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// The size of `path`, a regular file (through links); else an error that says what it is.
fn regular_file(path: &Path, what: &str, or_stdin: bool) -> Result<u64> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{}: no such {what} (the file is missing)", path.display())
        }
        Err(e) => return Err(Error::read(path, e)),
    };
    let t = meta.file_type();
    if t.is_file() {
        return Ok(meta.len());
    }
    let kind = kind_in_words(&t);
    let target = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path)
            .map(|t| format!(" (a link to {})", t.display()))
            .unwrap_or_default(),
        _ => String::new(),
    };
    let or = if or_stdin {
        ", or `-` for standard input"
    } else {
        ""
    };
    bail!(
        "{}: is {kind}{target}, not a regular file; the {what} must be a file{or}",
        path.display()
    )
}

/// Check that `path` is a regular file of at most `cap.bytes`, without reading it: for inputs
/// read later, checked with the others before any work.
pub fn check(path: &Path, cap: Cap) -> Result<()> {
    let len = regular_file(path, cap.what, false)?;
    check_len(path, len, cap)
}

/// The bytes of `path`, a regular file of at most `cap.bytes`.
pub fn read(path: &Path, cap: Cap) -> Result<Vec<u8>> {
    check(path, cap)?;
    open_and_read(path, cap)
}

/// The bytes of `path`, already checked to be a regular file within `cap`.
fn open_and_read(path: &Path, cap: Cap) -> Result<Vec<u8>> {
    // Non-blocking, so that a FIFO swapped in after the check cannot hang the open; the type is
    // checked again on what was opened.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::read(path, e))?;
    let meta = file.metadata().map_err(|e| Error::read(path, e))?;
    if !meta.is_file() {
        bail!(
            "{}: changed into something other than a regular file while opened",
            path.display()
        );
    }
    read_at_most(file, path, cap)
}

/// The bytes of `path`, or of standard input when `path` is `-`, at most `cap.bytes`.
pub fn read_stream(path: &Path, cap: Cap) -> Result<Vec<u8>> {
    if is_stdin(path) {
        return read_at_most(std::io::stdin().lock(), Path::new("standard input"), cap);
    }
    let len = regular_file(path, cap.what, true)?;
    check_len(path, len, cap)?;
    open_and_read(path, cap)
}

/// [`read_stream`] as UTF-8 text.
pub fn read_stream_text(path: &Path, cap: Cap) -> Result<String> {
    let bytes = read_stream(path, cap)?;
    String::from_utf8(bytes).map_err(|e| {
        bad!(
            "{}: the {} is not UTF-8 text (byte {})",
            shown(path).display(),
            cap.what,
            e.utf8_error().valid_up_to()
        )
    })
}

/// Whether `path` names standard input.
pub fn is_stdin(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// `path` as messages name it: `standard input` for `-`.
pub fn shown(path: &Path) -> &Path {
    if is_stdin(path) {
        Path::new("standard input")
    } else {
        path
    }
}

fn check_len(path: &Path, len: u64, cap: Cap) -> Result<()> {
    if len > cap.bytes {
        bail!(
            "{}: the {} is {len} bytes, more than the {} sinkmerge reads",
            path.display(),
            cap.what,
            human_bytes(cap.bytes)
        );
    }
    Ok(())
}

/// At most `cap.bytes` from `reader`; one byte more is an error (a file that grew after its size
/// was checked, or a stream past the cap).
fn read_at_most(reader: impl Read, path: &Path, cap: Cap) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    reader
        .take(cap.bytes + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::read(path, e))?;
    if bytes.len() as u64 > cap.bytes {
        bail!(
            "{}: the {} is more than the {} sinkmerge reads",
            path.display(),
            cap.what,
            human_bytes(cap.bytes)
        );
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_and_types_are_refused_with_what_the_path_is() {
        let dir = tempfile::tempdir().unwrap();
        let small = Cap {
            what: "test file",
            bytes: 4,
        };
        let file = dir.path().join("f");
        std::fs::write(&file, b"1234").unwrap();
        assert_eq!(read(&file, small).unwrap(), b"1234");
        std::fs::write(&file, b"12345").unwrap();
        let e = read(&file, small).unwrap_err().to_string();
        assert!(e.contains("5 bytes") && e.contains("4 B "), "{e}");
        let e = read(dir.path(), small).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let link = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = read(&link, small).unwrap_err().to_string();
        assert!(
            e.contains("a character device") && e.contains("/dev/zero"),
            "{e}"
        );
        let e = read(&dir.path().join("nope"), small)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such test file"), "{e}");
    }
}
