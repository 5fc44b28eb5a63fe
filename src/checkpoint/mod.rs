//! Checkpoints on disk: resolving a model reference, reading sharded safetensors lazily through
//! mmap with every header validated up front, and writing outputs atomically.

pub mod header;
pub mod hub;
pub mod hub_cache;
pub mod mapped;
pub mod output;
pub mod prefetch;
mod residency;
pub mod resolve;
pub mod writer;

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::Dtype;
use serde_json::Value;

use crate::dtype;
use crate::error::{Error, Result};
use crate::{bad, bail};
pub use header::TensorInfo;
pub use resolve::ModelRef;

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";
pub const CONFIG_FILE: &str = "config.json";

/// One mmap'd safetensors file and its validated header.
pub struct Shard {
    pub path: PathBuf,
    /// Shared with the read-ahead thread of a streaming pass (`prefetch`), which may outlive a
    /// borrow of the checkpoint by the time it takes to finish one tensor.
    mmap: std::sync::Arc<Mmap>,
    pub header: header::Header,
}

impl Drop for Shard {
    fn drop(&mut self) {
        mapped::unregister(&self.mmap);
    }
}

impl Shard {
    pub fn open(path: &Path) -> Result<Shard> {
        let file = File::open(path).map_err(|e| Error::read(path, e))?;
        // SAFETY: inputs are opened read-only and never written by this process; a concurrent
        // writer from another process is outside what any mmap-based reader can guard against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::read(path, e))?;
        let header = header::parse(path, &mmap)?;
        mapped::register(&mmap, std::sync::Arc::new(file));
        Ok(Shard {
            path: path.to_path_buf(),
            mmap: std::sync::Arc::new(mmap),
            header,
        })
    }

    pub fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// The raw bytes of tensor `t` (which must belong to this shard).
    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.mmap[self.header.data_start + t.begin..self.header.data_start + t.end]
    }

    /// Drop tensor `t`'s pages from this process's resident set (they stay in the OS page cache
    /// and fault back in if read again). Streaming passes call it once a tensor is decoded, so
    /// resident memory stays at one layer rather than growing to the whole mapped file.
    pub fn release(&self, t: &TensorInfo) {
        // SAFETY: the map is read-only and file-backed, so MADV_DONTNEED discards nothing: the
        // next access reloads the same bytes from the file. Failure only costs memory.
        #[cfg(unix)]
        let _ = unsafe {
            self.mmap.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                self.header.data_start + t.begin,
                t.byte_len(),
            )
        };
    }
}

/// A model directory: its config and its tensors across shards, addressed by name.
pub struct Checkpoint {
    /// The directory holding the files.
    pub dir: PathBuf,
    /// How the user named the model (alias, repo id or path), for messages and reports.
    pub label: String,
    /// The Hub repo and commit, for models from the HF cache.
    pub hub: Option<hub_cache::HubRef>,
    /// `config.json` as written.
    pub config: Value,
    pub shards: Vec<Shard>,
    /// Tensor name -> (shard index, index into that shard's header).
    index: HashMap<String, (usize, usize)>,
    /// Tensor names in natural order (layer 2 before layer 10).
    names: Vec<String>,
}

impl Checkpoint {
    /// Resolve `reference` (a directory, an HF-cache repo id or an alias) and open it.
    pub fn open_ref(reference: &str) -> Result<Checkpoint> {
        let model = resolve::resolve(reference)?;
        let mut ckpt = Self::open_dir(&model.dir, &model.label)?;
        ckpt.hub = model.hub;
        Ok(ckpt)
    }

    /// Open the model directory `dir`; every shard header is validated before this returns.
    pub fn open_dir(dir: &Path, label: &str) -> Result<Checkpoint> {
        if !dir.is_dir() {
            bail!("{}: not a directory", dir.display());
        }
        let config = read_json(&dir.join(CONFIG_FILE))?;
        if !config.is_object() {
            bail!(
                "{}: expected a JSON object",
                dir.join(CONFIG_FILE).display()
            );
        }
        let index_path = dir.join(INDEX_FILE);
        let (shard_paths, weight_map) = if index_path.exists() {
            let (paths, map) = read_index(&index_path)?;
            (paths, Some(map))
        } else if dir.join(SINGLE_FILE).exists() {
            (vec![dir.join(SINGLE_FILE)], None)
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| Error::read(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                let has_bin = dir.join("pytorch_model.bin").exists()
                    || dir.join("pytorch_model.bin.index.json").exists();
                let hint = if has_bin {
                    " (only pytorch_model*.bin weights; convert them to safetensors first)"
                } else {
                    ""
                };
                bail!("{}: no safetensors weights found{hint}", dir.display());
            }
            (found, None)
        };

        let mut shards = Vec::with_capacity(shard_paths.len());
        let mut index = HashMap::new();
        for path in &shard_paths {
            let shard = Shard::open(path)?;
            let s = shards.len();
            for (t, info) in shard.header.tensors.iter().enumerate() {
                if let Some((other, _)) = index.insert(info.name.clone(), (s, t)) {
                    let other: &Shard = &shards[other];
                    bail!(
                        "{}: tensor `{}` is also in {}; a tensor must live in exactly one shard",
                        path.display(),
                        info.name,
                        other.file_name()
                    );
                }
            }
            shards.push(shard);
        }
        if let Some(map) = weight_map {
            check_weight_map(&index_path, &map, &shards, &index)?;
        }
        let mut names: Vec<String> = index.keys().cloned().collect();
        names.sort_by(|a, b| natural_cmp(a, b));
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            label: label.to_string(),
            hub: None,
            config,
            shards,
            index,
            names,
        })
    }

    /// Tensor names in natural order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.index
            .get(name)
            .map(|&(s, t)| &self.shards[s].header.tensors[t])
    }

    /// The tensor's header entry, or an error naming the model and tensor.
    pub fn require(&self, name: &str) -> Result<&TensorInfo> {
        self.info(name)
            .ok_or_else(|| bad!("{}: tensor `{name}` is missing", self.label))
    }

    /// The shard holding `name`.
    pub fn shard_of(&self, name: &str) -> Option<&Shard> {
        self.index.get(name).map(|&(s, _)| &self.shards[s])
    }

    /// Raw stored bytes of a tensor (zero-copy from the mmap).
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let &(s, t) = self
            .index
            .get(name)
            .ok_or_else(|| bad!("{}: tensor `{name}` is missing", self.label))?;
        let shard = &self.shards[s];
        Ok(shard.bytes(&shard.header.tensors[t]))
    }

    /// Release a tensor's mapped pages from the resident set (see [`Shard::release`]).
    pub fn release(&self, name: &str) {
        if let Some(&(s, t)) = self.index.get(name) {
            let shard = &self.shards[s];
            shard.release(&shard.header.tensors[t]);
        }
    }

    /// Decode a floating-point tensor to f32.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.require(name)?;
        dtype::decode(info.dtype, self.bytes(name)?, &self.describe(name))
    }

    /// "file: tensor `name`" for messages.
    /// Every stored tensor's name, dtype and shape, in the checkpoint's order, as a writer plans
    /// them.
    pub fn planned_tensors(&self) -> Vec<writer::PlannedTensor> {
        (self.names().iter())
            .map(|n| {
                let info = self.info(n).expect("listed");
                writer::PlannedTensor {
                    name: n.clone(),
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                }
            })
            .collect()
    }

    pub fn describe(&self, name: &str) -> String {
        match self.shard_of(name) {
            Some(shard) => format!("{}: tensor `{name}`", shard.path.display()),
            None => format!("{}: tensor `{name}`", self.label),
        }
    }

    pub fn num_parameters(&self) -> u64 {
        self.iter_infos().map(|t| t.numel() as u64).sum()
    }

    /// Sum of all tensor byte lengths.
    pub fn total_bytes(&self) -> u64 {
        self.iter_infos().map(|t| t.byte_len() as u64).sum()
    }

    pub fn iter_infos(&self) -> impl Iterator<Item = &TensorInfo> {
        self.shards.iter().flat_map(|s| s.header.tensors.iter())
    }

    /// dtype -> number of tensors.
    pub fn dtype_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for t in self.iter_infos() {
            *counts.entry(format!("{:?}", t.dtype)).or_insert(0) += 1;
        }
        counts
    }

    /// The most common floating-point dtype by bytes (the model's "dtype" for outputs).
    pub fn main_float_dtype(&self) -> Option<Dtype> {
        let mut bytes: BTreeMap<Dtype, u64> = BTreeMap::new();
        for t in self.iter_infos().filter(|t| dtype::is_float(t.dtype)) {
            *bytes.entry(t.dtype).or_insert(0) += t.byte_len() as u64;
        }
        bytes
            .into_iter()
            .max_by_key(|&(d, b)| (b, d))
            .map(|(d, _)| d)
    }

    /// Auxiliary files (tokenizer, generation config, chat template) present in the directory.
    pub fn aux_files(&self) -> Vec<PathBuf> {
        AUX_FILES
            .iter()
            .map(|f| self.dir.join(f))
            .filter(|p| p.is_file())
            .collect()
    }
}

/// Copy the auxiliary files of `from` (tokenizer, generation config, chat template) into `out`;
/// returns the names copied.
pub fn copy_aux_files(out: &output::OutputDir, from: &Checkpoint) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for path in from.aux_files() {
        let name = path
            .file_name()
            .expect("listed file")
            .to_string_lossy()
            .into_owned();
        out.copy_file(&path, &name)?;
        copied.push(name);
    }
    Ok(copied)
}

/// Files carried over from an input model to an output model, as mergekit and `save_pretrained` do
/// (docs/reference/merges.md#inputs-what-happens-to-each-tensor-as-in-mergekit,
/// docs/commands/extract.md#what-is-written).
pub const AUX_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// A text file's contents; a missing file is a one-line error naming it.
pub fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            bad!("{}: file is missing", path.display())
        } else {
            Error::read(path, e)
        }
    })
}

pub fn read_json(path: &Path) -> Result<Value> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|e| bad!("{}: not valid JSON: {e}", path.display()))
}

/// Read an index file: the shard paths it names (in first-mention order) and its weight map.
fn read_index(path: &Path) -> Result<(Vec<PathBuf>, BTreeMap<String, String>)> {
    let json = read_json(path)?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad!("{}: no `weight_map` object", path.display()))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut weight_map = BTreeMap::new();
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            bad!(
                "{}: weight_map entry for `{tensor}` is not a file name",
                path.display()
            )
        })?;
        if file.contains('/') || file.contains('\\') || file == ".." {
            bail!(
                "{}: weight_map entry for `{tensor}` names `{file}`, outside the model directory",
                path.display()
            );
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
        weight_map.insert(tensor.clone(), file.to_string());
    }
    files.sort();
    let mut paths = Vec::with_capacity(files.len());
    for file in &files {
        let p = dir.join(file);
        if !p.is_file() {
            let tensor = weight_map
                .iter()
                .find(|(_, f)| *f == file)
                .map(|(t, _)| t.as_str())
                .unwrap_or("?");
            bail!(
                "{}: shard `{file}` (listed for tensor `{tensor}`) does not exist",
                path.display()
            );
        }
        paths.push(p);
    }
    Ok((paths, weight_map))
}

fn check_weight_map(
    index_path: &Path,
    map: &BTreeMap<String, String>,
    shards: &[Shard],
    index: &HashMap<String, (usize, usize)>,
) -> Result<()> {
    for (tensor, file) in map {
        match index.get(tensor) {
            Some(&(s, _)) if shards[s].file_name() == *file => {}
            Some(&(s, _)) => bail!(
                "{}: index puts tensor `{tensor}` in {file}, but it is in {}",
                index_path.display(),
                shards[s].file_name()
            ),
            None => bail!(
                "{}: index lists tensor `{tensor}` in {file}, which does not contain it",
                index_path.display()
            ),
        }
    }
    for shard in shards {
        for t in &shard.header.tensors {
            if !map.contains_key(&t.name) {
                bail!(
                    "{}: holds tensor `{}` that {} does not list",
                    shard.path.display(),
                    t.name,
                    index_path.file_name().unwrap_or_default().to_string_lossy()
                );
            }
        }
    }
    Ok(())
}

/// Compare names with digit runs as numbers, so `layers.2` sorts before `layers.10`.
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, _) => return Ordering::Less,
            (_, None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let na = a.iter().take_while(|c| c.is_ascii_digit()).count();
                let nb = b.iter().take_while(|c| c.is_ascii_digit()).count();
                let (da, db) = (trim_zeros(&a[..na]), trim_zeros(&b[..nb]));
                let ord = da
                    .len()
                    .cmp(&db.len())
                    .then_with(|| da.cmp(db))
                    .then(na.cmp(&nb));
                if ord != Ordering::Equal {
                    return ord;
                }
                a = &a[na..];
                b = &b[nb..];
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                a = &a[1..];
                b = &b[1..];
            }
        }
    }
}

fn trim_zeros(d: &[u8]) -> &[u8] {
    let n = d.iter().take_while(|&&c| c == b'0').count();
    &d[n.min(d.len().saturating_sub(1))..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order_sorts_layers_numerically() {
        let mut v = vec![
            "model.layers.10.a",
            "model.layers.2.a",
            "model.layers.2.b",
            "lm_head.weight",
            "model.layers.1.a",
        ];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            v,
            [
                "lm_head.weight",
                "model.layers.1.a",
                "model.layers.2.a",
                "model.layers.2.b",
                "model.layers.10.a"
            ]
        );
    }
}
