//! What a step's inputs are, as a manifest records them: a Hub model by its commit, anything else
//! by a content hash (XXH3-128 of every file). Hashing a 15 GB model takes a disk read, so hashes
//! are cached in the output directory, keyed by each file's size, inode, mtime and ctime: a rerun
//! rehashes only files that changed, and any write to a file changes its ctime.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::hub_cache::HubRef;
use crate::checkpoint::output::write_file_atomic;
use crate::error::{Error, Result};

/// How a manifest names one input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The input as the command line names it.
    pub input: String,
    /// `hub` (the Hub commit identifies it) or `xxh3-128` (the hash of its contents).
    pub kind: String,
    /// The commit, or the hex digest.
    pub value: String,
}

/// Each file's stat signature and hash, from earlier runs.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct HashCache {
    #[serde(skip)]
    path: PathBuf,
    #[serde(skip)]
    dirty: bool,
    files: BTreeMap<String, Cached>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Cached {
    size: u64,
    inode: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    xxh3: String,
}

impl HashCache {
    /// The cache stored at `path`; a missing or unreadable cache is an empty one (it only saves
    /// time).
    pub fn load(path: &Path) -> HashCache {
        let mut cache: HashCache = fs::read(path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        cache.path = path.to_path_buf();
        cache
    }

    /// Write the cache back if it learned anything.
    pub fn save(&mut self) -> Result<()> {
        if self.dirty {
            let text =
                serde_json::to_vec_pretty(self).map_err(|e| crate::internal!("hash cache: {e}"))?;
            write_file_atomic(&self.path, &text)?;
            self.dirty = false;
        }
        Ok(())
    }

    /// A model: its Hub commit, or the hash of its directory.
    pub fn model(&mut self, input: &str, dir: &Path, hub: Option<&HubRef>) -> Result<Identity> {
        Ok(match hub {
            Some(hub) => Identity {
                input: input.to_string(),
                kind: "hub".into(),
                value: format!("{}@{}", hub.repo, hub.commit),
            },
            None => Identity {
                input: input.to_string(),
                kind: "xxh3-128".into(),
                value: self.dir(dir)?,
            },
        })
    }

    /// A single file.
    pub fn file_identity(&mut self, input: &str, path: &Path) -> Result<Identity> {
        Ok(Identity {
            input: input.to_string(),
            kind: "xxh3-128".into(),
            value: self.file(path)?,
        })
    }

    /// The hash of a directory: its top-level regular files (links followed, hidden files and
    /// subfolders left out: a model folder is flat), by name in byte order, each as its name
    /// and its contents' hash.
    pub fn dir(&mut self, dir: &Path) -> Result<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .map_err(|e| crate::bad!("{}: {e}", dir.display()))?
            .filter_map(|entry| entry.ok())
            .filter(|entry| entry.path().is_file())
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| !name.starts_with('.'))
            .collect();
        names.sort();
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        for name in names {
            let digest = self.file(&dir.join(&name))?;
            hasher.update(name.as_bytes());
            hasher.update(&[0]);
            hasher.update(digest.as_bytes());
            hasher.update(&[0]);
        }
        Ok(format!("{:032x}", hasher.digest128()))
    }

    /// The hash of one file's contents, from the cache when its stat signature is unchanged.
    pub fn file(&mut self, path: &Path) -> Result<String> {
        let canonical =
            fs::canonicalize(path).map_err(|e| crate::bad!("{}: {e}", path.display()))?;
        let meta = fs::metadata(&canonical).map_err(|e| crate::bad!("{}: {e}", path.display()))?;
        let key = canonical.to_string_lossy().into_owned();
        let signature = |xxh3: String| Cached {
            size: meta.size(),
            inode: meta.ino(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
            xxh3,
        };
        if let Some(cached) = self.files.get(&key) {
            if *cached == signature(cached.xxh3.clone()) {
                return Ok(cached.xxh3.clone());
            }
        }
        let digest = hash_contents(&canonical)?;
        self.files.insert(key, signature(digest.clone()));
        self.dirty = true;
        Ok(digest)
    }
}

fn hash_contents(path: &Path) -> Result<String> {
    let file = File::open(path).map_err(|e| crate::bad!("{}: {e}", path.display()))?;
    let len = file
        .metadata()
        .map_err(|e| crate::bad!("{}: {e}", path.display()))?
        .len();
    let digest = if len == 0 {
        xxhash_rust::xxh3::xxh3_128(&[])
    } else {
        // SAFETY: inputs are read-only to sinkmerge; a file changed underneath by another
        // program gives a hash of mixed contents, and its new ctime a rehash on the next run.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::Read {
            path: path.to_path_buf(),
            source: e,
        })?;
        xxhash_rust::xxh3::xxh3_128(&map)
    };
    Ok(format!("{digest:032x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_file_is_rehashed_and_an_unchanged_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.txt");
        fs::write(&file, b"one").unwrap();
        let mut cache = HashCache::load(&dir.path().join(".cache.json"));
        let first = cache.file(&file).unwrap();
        assert_eq!(
            first,
            format!("{:032x}", xxhash_rust::xxh3::xxh3_128(b"one"))
        );
        cache.save().unwrap();
        let mut again = HashCache::load(&dir.path().join(".cache.json"));
        assert_eq!(again.file(&file).unwrap(), first);
        assert!(!again.dirty, "an unchanged file came from the cache");
        fs::write(&file, b"two").unwrap();
        assert_ne!(again.file(&file).unwrap(), first);
    }

    #[test]
    fn a_directory_hash_covers_names_and_contents() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("a"), b"x").unwrap();
        fs::write(dir.path().join(".hidden"), b"y").unwrap();
        let mut cache = HashCache::load(&dir.path().join(".cache.json"));
        let h1 = cache.dir(dir.path()).unwrap();
        fs::write(dir.path().join(".hidden"), b"z").unwrap();
        assert_eq!(
            cache.dir(dir.path()).unwrap(),
            h1,
            "hidden files are not inputs"
        );
        fs::rename(dir.path().join("a"), dir.path().join("b")).unwrap();
        assert_ne!(cache.dir(dir.path()).unwrap(), h1);
    }
}
