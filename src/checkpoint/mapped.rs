//! Which input files are mapped where, so that the writer can copy a tensor that a command passes
//! through unchanged (borrowed from an input's mmap) inside the kernel, file to file, with
//! `copy_file_range(2)` as `cp` does, instead of through user space. On the development VM a
//! user-space copy takes about 1.6 times as long as the kernel's (docs/benchmarks.md#graft).

use std::fs::File;
use std::sync::{Arc, RwLock};

/// One mapped input file: the address range of its map.
struct Mapping {
    start: usize,
    len: usize,
    file: Arc<File>,
}

static MAPPINGS: RwLock<Vec<Mapping>> = RwLock::new(Vec::new());

/// Record that `file` is mapped at `map` (the whole file from offset 0).
pub fn register(map: &[u8], file: Arc<File>) {
    let mut all = MAPPINGS.write().unwrap_or_else(|e| e.into_inner());
    all.push(Mapping {
        start: map.as_ptr() as usize,
        len: map.len(),
        file,
    });
}

/// Forget the map at `map` (before it is unmapped).
pub fn unregister(map: &[u8]) {
    let mut all = MAPPINGS.write().unwrap_or_else(|e| e.into_inner());
    all.retain(|m| m.start != map.as_ptr() as usize);
}

/// The mapped file and offset that `bytes` are a view of, if they lie inside a registered map.
pub fn file_range(bytes: &[u8]) -> Option<(Arc<File>, u64)> {
    let (start, end) = (
        bytes.as_ptr() as usize,
        bytes.as_ptr() as usize + bytes.len(),
    );
    let all = MAPPINGS.read().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .find(|m| m.start <= start && end <= m.start + m.len)
        .map(|m| (Arc::clone(&m.file), (start - m.start) as u64))
}

/// Append `len` bytes of `src` from `offset` to `dst` at its current position, in the kernel.
/// Returns how many bytes were copied: fewer than `len` when the kernel declines (another
/// filesystem, an old kernel), and the caller writes the rest itself.
#[cfg(target_os = "linux")]
pub fn copy(src: &File, offset: u64, dst: &File, len: usize) -> std::io::Result<usize> {
    let mut off = offset;
    let mut done = 0;
    while done < len {
        match rustix::fs::copy_file_range(src, Some(&mut off), dst, None, len - done) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => continue,
            // The kernel cannot do this copy: the caller falls back to write(2).
            Err(
                rustix::io::Errno::XDEV
                | rustix::io::Errno::NOSYS
                | rustix::io::Errno::INVAL
                | rustix::io::Errno::OPNOTSUPP,
            ) if done == 0 => break,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(done)
}

/// Elsewhere the caller always writes the bytes itself.
#[cfg(not(target_os = "linux"))]
pub fn copy(_: &File, _: u64, _: &File, _: usize) -> std::io::Result<usize> {
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn a_slice_of_a_registered_map_is_copied_file_to_file() {
        let dir = tempfile::tempdir().unwrap();
        let src_path = dir.path().join("src");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        std::fs::write(&src_path, &data).unwrap();
        let file = Arc::new(File::open(&src_path).unwrap());
        // SAFETY: the file is private to the test and not written while mapped.
        let map = unsafe { memmap2::Mmap::map(&*file) }.unwrap();
        register(&map, Arc::clone(&file));
        let (found, offset) = file_range(&map[1000..5000]).expect("inside the map");
        assert_eq!(offset, 1000);
        assert!(file_range(&data[10..20]).is_none(), "not a registered map");

        let mut dst = tempfile::tempfile().unwrap();
        dst.write_all(b"head").unwrap();
        let n = copy(&found, offset, &dst, 4000).unwrap();
        // Whatever the kernel declined is written from the slice, as the writer does.
        dst.write_all(&map[1000 + n..5000]).unwrap();
        dst.rewind().unwrap();
        let mut back = Vec::new();
        dst.read_to_end(&mut back).unwrap();
        assert_eq!(&back[..4], b"head");
        assert_eq!(&back[4..], &data[1000..5000]);
        unregister(&map);
        assert!(file_range(&map[1000..5000]).is_none());
    }
}
