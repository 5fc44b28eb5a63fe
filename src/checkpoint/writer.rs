//! Sharded safetensors output in Hugging Face's layout.
//!
//! The tensor list (names, dtypes, shapes) is known before any data is produced, so every
//! shard's header is written first and the data then streams in: a model is never held in
//! memory. Tensors are produced in parallel a window at a time while the previous window is
//! being written, so computing and writing overlap; output order (and so the bytes) does not
//! depend on the thread count.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};

use indicatif::ProgressBar;
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::json;

use super::header::{self, TensorInfo};
use super::mapped;
use super::output::OutputDir;
use super::{INDEX_FILE, SINGLE_FILE};
use crate::dtype;
use crate::error::{Error, Result};
use crate::{bad, bail, non_finite};

/// Default `--max-shard-size`, as transformers and mergekit use.
pub const DEFAULT_MAX_SHARD_SIZE: u64 = 5_000_000_000;

/// Produced tensors of one window, in order, with the index of the first.
type Window<'a> = (usize, Vec<Result<Cow<'a, [u8]>>>);

/// Bytes of produced tensors held per window before they are written.
const WINDOW_BYTES: usize = 256 << 20;

/// Tensors borrowed from an input and at least this large are copied in the kernel
/// ([`mapped`]); smaller ones are cheaper batched through the buffer.
const KERNEL_COPY_MIN: usize = 1 << 20;

/// The input file and offset of `bytes` when they are a large tensor passed through unchanged
/// from an input's map (bytes a command computed never lie inside one).
fn kernel_source(bytes: &[u8]) -> Option<(std::sync::Arc<File>, u64)> {
    (bytes.len() >= KERNEL_COPY_MIN)
        .then(|| mapped::file_range(bytes))
        .flatten()
}

/// A tensor to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl PlannedTensor {
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// How the progress bar advances.
#[derive(Debug, Clone, Copy)]
pub enum Progress {
    Bytes,
    Tensors,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct Written {
    pub files: Vec<String>,
    pub total_bytes: u64,
    pub weight_map: BTreeMap<String, String>,
}

/// Parse a shard size such as `5G`, `500M`, `2GB`, `1.5G` or `1000000` (decimal units, as
/// transformers and mergekit use; `Ki`/`Mi`/`Gi` for binary).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| bad!("invalid size `{s}`"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().trim_end_matches('b') {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "ki" => 1024.0,
        "mi" => 1024.0 * 1024.0,
        "gi" => 1024.0 * 1024.0 * 1024.0,
        _ => bail!("invalid size `{s}`: unit must be one of k, M, G, T (or Ki, Mi, Gi)"),
    };
    let bytes = value * mult;
    if bytes.is_nan() || bytes < 1.0 {
        bail!("invalid size `{s}`: must be at least one byte");
    }
    Ok(bytes as u64)
}

/// Assign tensors (in order) to shards: a new shard starts when adding a tensor would exceed
/// `max_shard_size` and the current one is non-empty (mergekit's and transformers' rule). A
/// tensor larger than the limit gets a shard of its own.
pub fn plan_shards(tensors: &[PlannedTensor], max_shard_size: u64) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut size) = (0usize, 0u64);
    for (i, t) in tensors.iter().enumerate() {
        let n = t.byte_len() as u64;
        if i > start && size + n > max_shard_size {
            shards.push(start..i);
            start = i;
            size = 0;
        }
        size += n;
    }
    if start < tensors.len() || tensors.is_empty() {
        shards.push(start..tensors.len());
    }
    shards
}

/// Shard file names: `model.safetensors` for one shard, else `model-0000i-of-0000N.safetensors`.
pub fn shard_names(count: usize) -> Vec<String> {
    if count == 1 {
        return vec![SINGLE_FILE.to_string()];
    }
    (1..=count)
        .map(|i| format!("model-{i:05}-of-{count:05}.safetensors"))
        .collect()
}

/// Write `tensors` into `out` as sharded safetensors plus (for several shards) the index.
/// `produce(i)` returns the bytes of `tensors[i]`; it is called in parallel, a window at a time.
///
/// Every float tensor's bytes are checked for NaN and Inf before they are written, whether
/// copied or computed: one holding any is a non-finite error (exit 3) and the caller's output
/// is never committed. `origin(i)` names what `tensors[i]` was made from ("file: tensor `x`")
/// for that message, where the caller knows it.
pub fn write_tensors<'a, F, O>(
    out: &OutputDir,
    tensors: &[PlannedTensor],
    max_shard_size: u64,
    progress: Option<(&ProgressBar, Progress)>,
    origin: O,
    produce: F,
) -> Result<Written>
where
    F: Fn(usize) -> Result<Cow<'a, [u8]>> + Sync,
    O: Fn(usize) -> Option<String> + Sync,
{
    let mut seen = std::collections::HashSet::new();
    for t in tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(crate::internal!(
                "internal: tensor `{}` planned twice",
                t.name
            ));
        }
    }
    let ranges = plan_shards(tensors, max_shard_size);
    let names = shard_names(ranges.len());
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);

    let mut files = Vec::with_capacity(ranges.len());
    let mut weight_map = BTreeMap::new();
    for (range, file_name) in ranges.iter().zip(&names) {
        let mut offset = 0;
        let infos: Vec<TensorInfo> = tensors[range.clone()]
            .iter()
            .map(|t| {
                let begin = offset;
                offset += t.byte_len();
                weight_map.insert(t.name.clone(), file_name.clone());
                TensorInfo {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    begin,
                    end: offset,
                }
            })
            .collect();
        let path = out.path().join(file_name);
        let file = File::create(&path).map_err(|e| Error::write(&path, e))?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        w.write_all(&header::serialize(&infos, &metadata)?)
            .map_err(|e| Error::write(&path, e))?;
        files.push((path, w));
    }

    // Windows of consecutive tensors; window k+1 is produced while window k is written.
    let windows = windows(tensors);
    let shard_of = |i: usize| ranges.iter().position(|r| r.contains(&i)).expect("planned");
    let write_window = |files: &mut Vec<(std::path::PathBuf, BufWriter<File>)>,
                        start: usize,
                        data: Vec<Result<Cow<'a, [u8]>>>|
     -> Result<()> {
        for (k, bytes) in data.into_iter().enumerate() {
            super::output::check_cancelled()?;
            let i = start + k;
            let bytes = bytes?;
            let t = &tensors[i];
            if bytes.len() != t.byte_len() {
                return Err(crate::internal!(
                    "internal: tensor `{}` produced {} bytes, expected {}",
                    t.name,
                    bytes.len(),
                    t.byte_len()
                ));
            }
            let (path, w) = &mut files[shard_of(i)];
            let mut rest: &[u8] = &bytes;
            // A tensor passed through from an input is copied file to file in the kernel.
            if let Some((src, offset)) = kernel_source(&bytes) {
                w.flush().map_err(|e| Error::write(path, e))?;
                let n = mapped::copy(&src, offset, w.get_ref(), bytes.len())
                    .map_err(|e| Error::write(path, e))?;
                rest = &bytes[n..];
            }
            w.write_all(rest).map_err(|e| Error::write(path, e))?;
            if let Some((bar, unit)) = progress {
                bar.inc(match unit {
                    Progress::Bytes => bytes.len() as u64,
                    Progress::Tensors => 1,
                });
            }
        }
        Ok(())
    };
    let produce_checked = |i: usize| -> Result<Cow<'a, [u8]>> {
        let bytes = produce(i)?;
        check_finite(&tensors[i], &bytes, || origin(i))?;
        Ok(bytes)
    };
    let produce_window = |r: &std::ops::Range<usize>| -> Vec<Result<Cow<'a, [u8]>>> {
        r.clone()
            .into_par_iter()
            .map(|i| {
                // A cancelled run stops producing too: a window of SVDs can take minutes.
                super::output::check_cancelled()?;
                produce_checked(i)
            })
            .collect()
    };

    let mut pending: Option<Window<'a>> = None;
    for r in &windows {
        let (written, produced) = rayon::join(
            || match pending.take() {
                Some((start, data)) => write_window(&mut files, start, data),
                None => Ok(()),
            },
            || produce_window(r),
        );
        written?;
        pending = Some((r.start, produced));
    }
    if let Some((start, data)) = pending {
        write_window(&mut files, start, data)?;
    }

    let mut file_names = Vec::with_capacity(files.len());
    for ((path, w), name) in files.into_iter().zip(names) {
        let file = w
            .into_inner()
            .map_err(|e| Error::write(&path, e.into_error()))?;
        file.sync_all().map_err(|e| Error::write(&path, e))?;
        file_names.push(name);
    }
    let total_bytes: u64 = tensors.iter().map(|t| t.byte_len() as u64).sum();
    if file_names.len() > 1 {
        let index = json!({
            "metadata": { "total_size": total_bytes },
            "weight_map": weight_map,
        });
        out.write_json(INDEX_FILE, &index)?;
    }
    Ok(Written {
        files: file_names,
        total_bytes,
        weight_map,
    })
}

/// The one finiteness check of everything written: a bit-pattern scan of the stored bytes
/// (exponent all ones, see [`dtype::count_non_finite`]), so it runs at memory speed and needs
/// no decoding. No command writes NaN or Inf on purpose: an input holding them, or arithmetic
/// that overflows, is an error (docs/reference/checkpoints.md#writing).
fn check_finite(
    t: &PlannedTensor,
    bytes: &[u8],
    origin: impl Fn() -> Option<String>,
) -> Result<()> {
    let (nan, inf) = dtype::count_non_finite(t.dtype, bytes);
    if nan + inf == 0 {
        return Ok(());
    }
    let (k, what) = dtype::first_non_finite(t.dtype, bytes).unwrap_or((0, "NaN"));
    let found = format!("{what} at flat index {k} ({nan} NaN, {inf} Inf in all)");
    Err(match origin() {
        Some(from) => non_finite!(
            "{from}: written as `{}`, it would hold {found}; no output is written",
            t.name
        ),
        None => non_finite!(
            "output tensor `{}` would hold {found}; no output is written",
            t.name
        ),
    })
}

/// Consecutive tensors of at most [`WINDOW_BYTES`] together (a larger tensor alone), and of at
/// most a quarter of the output: the last window's write overlaps no computing, so a small
/// output (a one-layer merge of 200 MB) would otherwise be computed whole, then written whole.
fn windows(tensors: &[PlannedTensor]) -> Vec<std::ops::Range<usize>> {
    let total: usize = tensors.iter().map(PlannedTensor::byte_len).sum();
    let limit = WINDOW_BYTES.min(total.div_ceil(4));
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, t) in tensors.iter().enumerate() {
        if i > start && bytes + t.byte_len() > limit {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += t.byte_len();
    }
    if start < tensors.len() {
        out.push(start..tensors.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, n: usize) -> PlannedTensor {
        PlannedTensor {
            name: name.into(),
            dtype: Dtype::F32,
            shape: vec![n],
        }
    }

    #[test]
    fn windows_hold_a_quarter_of_a_small_output_and_at_most_the_window_bytes() {
        // f32 tensors of n elements are 4n bytes. 400 bytes in all: windows of at most 100.
        let small = [t("a", 5), t("b", 20), t("c", 30), t("d", 10), t("e", 35)];
        assert_eq!(windows(&small), vec![0..2, 2..3, 3..4, 4..5]);
        // A tensor larger than the limit gets a window of its own.
        let big = [t("a", 5), t("b", 90), t("c", 5)];
        assert_eq!(windows(&big), vec![0..1, 1..2, 2..3]);
        // A large output: windows of WINDOW_BYTES, whatever a quarter of it is.
        let quarter = WINDOW_BYTES / 16;
        let large: Vec<PlannedTensor> = (0..40).map(|i| t(&i.to_string(), quarter)).collect();
        let w = windows(&large);
        assert_eq!(w.len(), 10);
        assert!(w.iter().all(|r| r.len() == 4));
        assert!(windows(&[]).is_empty());
    }

    #[test]
    fn sizes_parse_with_decimal_and_binary_units() {
        assert_eq!(parse_size("5G").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("500M").unwrap(), 500_000_000);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("1.5k").unwrap(), 1500);
        assert_eq!(parse_size("1Ki").unwrap(), 1024);
        assert_eq!(parse_size("123").unwrap(), 123);
        assert!(parse_size("12X").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn shard_plan_follows_the_greedy_rule() {
        let ts = [t("a", 10), t("b", 10), t("c", 30), t("d", 5)];
        // 40, 40, 120, 20 bytes with an 80-byte limit.
        assert_eq!(plan_shards(&ts, 80), vec![0..2, 2..3, 3..4]);
        assert_eq!(plan_shards(&ts, 1 << 20), vec![0..4]);
        assert_eq!(shard_names(3)[1], "model-00002-of-00003.safetensors");
        assert_eq!(shard_names(1), vec!["model.safetensors"]);
    }

    /// A large tensor passed through from an input's map is copied in the kernel: the bytes
    /// arrive whole, and a NaN in it still stops the output with the non-finite error, naming
    /// where the tensor came from.
    #[test]
    fn a_passed_through_tensor_is_copied_whole_and_still_checked() {
        let dir = tempfile::tempdir().unwrap();
        let n = (KERNEL_COPY_MIN / 4) * 2 + 1000;
        let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let write_input = |name: &str, values: &[f32]| {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![n], &bytes).unwrap();
            let path = dir.path().join(name);
            safetensors::tensor::serialize_to_file([("w", view)], None, &path).unwrap();
            super::super::Shard::open(&path).unwrap()
        };
        let planned = [t("w", n)];
        let run = |shard: &super::super::Shard, dest: &str| {
            let out = OutputDir::create(
                &dir.path().join(dest),
                super::super::output::OutputKind::Model,
                &[],
                false,
            )
            .unwrap();
            let info = &shard.header.tensors[0];
            let written = write_tensors(
                &out,
                &planned,
                u64::MAX,
                None,
                |_| Some("input: tensor `w`".to_string()),
                |_| Ok(Cow::Borrowed(shard.bytes(info))),
            );
            written.map(|_| out.commit().unwrap())
        };

        let clean = write_input("clean.safetensors", &values);
        assert!(kernel_source(clean.bytes(&clean.header.tensors[0])).is_some());
        let dest = run(&clean, "out").unwrap();
        let back = super::super::Shard::open(&dest.join(SINGLE_FILE)).unwrap();
        assert_eq!(
            back.bytes(&back.header.tensors[0]),
            clean.bytes(&clean.header.tensors[0])
        );

        let mut bad = values.clone();
        bad[KERNEL_COPY_MIN / 4 + 5] = f32::NAN;
        let bad = write_input("bad.safetensors", &bad);
        let err = run(&bad, "bad-out").unwrap_err().to_string();
        assert!(
            err.contains("input: tensor `w`") && err.contains("NaN"),
            "{err}"
        );
        assert!(!dir.path().join("bad-out").exists());
    }
}
