//! Parsing and validating one safetensors header.
//!
//! The `safetensors` crate's own parser keeps the last of two equal tensor names (serde map
//! semantics) and reports offset problems without saying which tensors collide, so the header is
//! parsed here with a visitor that sees every key, and every rule is checked with an error that
//! names the file and the tensor. The dtype vocabulary and the header layout are the crate's.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;

use safetensors::Dtype;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use crate::error::Result;
use crate::{bad, bail};

/// Largest header accepted, the same cap as the `safetensors` crate (100 MB). Real headers of
/// 70B checkpoints are well under 1 MB.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor as the header describes it; offsets are relative to the start of the data area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn byte_len(&self) -> usize {
        self.end - self.begin
    }
}

/// A validated header: tensors sorted by offset, the `__metadata__` map and where data starts.
#[derive(Debug, Clone)]
pub struct Header {
    pub tensors: Vec<TensorInfo>,
    pub metadata: BTreeMap<String, String>,
    /// Absolute file offset of the data area (8 + header length).
    pub data_start: usize,
}

/// Parse and validate the header of the safetensors file `path` whose full contents (usually an
/// mmap) are `file`. Checks: header length within the file and the cap, UTF-8 JSON object, no
/// duplicate names, known dtypes, `numel * dtype size == byte length`, offsets inside the data
/// area, tensors neither overlapping nor leaving gaps, and the data area ending at end of file.
pub fn parse(path: &Path, file: &[u8]) -> Result<Header> {
    let file_name = path.display();
    if file.len() < 8 {
        bail!(
            "{file_name}: file is {} bytes, too short for a safetensors header (truncated?)",
            file.len()
        );
    }
    let header_len = u64::from_le_bytes(file[..8].try_into().expect("8 bytes"));
    if header_len > MAX_HEADER_LEN {
        bail!(
            "{file_name}: header length field says {header_len} bytes, over the {MAX_HEADER_LEN}-byte cap (not a safetensors file, or corrupt)"
        );
    }
    let header_end = 8 + header_len as usize;
    if header_end > file.len() {
        bail!(
            "{file_name}: header length field says {header_len} bytes but the file has only {} bytes after it (truncated?)",
            file.len() - 8
        );
    }
    let text = std::str::from_utf8(&file[8..header_end])
        .map_err(|e| bad!("{file_name}: header is not valid UTF-8: {e}"))?;
    let raw: RawHeader = serde_json::from_str(text)
        .map_err(|e| bad!("{file_name}: header is not a valid safetensors JSON object: {e}"))?;
    if let Some(name) = raw.duplicate {
        bail!("{file_name}: tensor `{name}` appears twice in the header");
    }

    let data_len = file.len() - header_end;
    let mut tensors = Vec::with_capacity(raw.tensors.len());
    for (name, entry) in raw.tensors {
        tensors.push(validate_entry(path, name, entry)?);
    }
    // Zero-size tensors sort before a non-empty tensor at the same offset.
    tensors.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));

    // Overlaps first, over the whole file: two tensors that share bytes are the fault, not the
    // gap their sharing leaves before some later tensor.
    let mut reach: Option<&TensorInfo> = None;
    for t in &tensors {
        if let Some(p) = reach.filter(|p| t.begin < p.end) {
            let how = if (t.begin, t.end) == (p.begin, p.end) {
                "shares its bytes with"
            } else {
                "overlaps"
            };
            bail!(
                "{file_name}: tensor `{}` (bytes {}..{}) {how} tensor `{}` (bytes {}..{})",
                t.name,
                t.begin,
                t.end,
                p.name,
                p.begin,
                p.end
            );
        }
        if reach.is_none_or(|p| t.end > p.end) {
            reach = Some(t);
        }
    }
    let mut covered = 0usize;
    for t in &tensors {
        if t.end > data_len {
            bail!(
                "{file_name}: tensor `{}` spans bytes {}..{} of the data area, which has only {data_len} bytes (truncated file, or a header that lies)",
                t.name, t.begin, t.end
            );
        }
        if t.begin > covered {
            bail!(
                "{file_name}: {} unused bytes before tensor `{}` (bytes {}..{}); safetensors data must be contiguous",
                t.begin - covered, t.name, t.begin, t.end
            );
        }
        covered = t.end;
    }
    if covered != data_len {
        bail!(
            "{file_name}: tensors cover {covered} bytes but the data area has {data_len}; the file has trailing bytes"
        );
    }
    Ok(Header {
        tensors,
        metadata: raw.metadata,
        data_start: header_end,
    })
}

fn validate_entry(path: &Path, name: String, entry: RawEntry) -> Result<TensorInfo> {
    let file_name = path.display();
    let dtype: Dtype = serde_json::from_value(serde_json::Value::String(entry.dtype.clone()))
        .map_err(|_| {
            bad!(
                "{file_name}: tensor `{name}` has unknown dtype `{}`",
                entry.dtype
            )
        })?;
    let (begin, end) = entry.data_offsets;
    if end < begin {
        bail!(
            "{file_name}: tensor `{name}` has data_offsets [{begin}, {end}] with end before begin"
        );
    }
    let numel = entry
        .shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            bad!(
                "{file_name}: tensor `{name}` has shape {:?} whose size overflows",
                entry.shape
            )
        })?;
    let bits = numel.checked_mul(dtype.bitsize()).ok_or_else(|| {
        bad!(
            "{file_name}: tensor `{name}` has shape {:?} whose size overflows",
            entry.shape
        )
    })?;
    if bits % 8 != 0 {
        bail!("{file_name}: tensor `{name}` ({dtype:?}, shape {:?}) does not fill a whole number of bytes", entry.shape);
    }
    if bits / 8 != end - begin {
        bail!(
            "{file_name}: tensor `{name}` is {dtype:?} with shape {:?} = {} bytes, but its data_offsets [{begin}, {end}] span {} bytes",
            entry.shape, bits / 8, end - begin
        );
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape: entry.shape,
        begin,
        end,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// The header as written: every entry kept in order, the first duplicate name remembered.
struct RawHeader {
    tensors: Vec<(String, RawEntry)>,
    metadata: BTreeMap<String, String>,
    duplicate: Option<String>,
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HeaderVisitor;
        impl<'de> Visitor<'de> for HeaderVisitor {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                let mut seen = HashSet::new();
                let mut header = RawHeader {
                    tensors: Vec::new(),
                    metadata: BTreeMap::new(),
                    duplicate: None,
                };
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) && header.duplicate.is_none() {
                        header.duplicate = Some(key.clone());
                    }
                    if key == "__metadata__" {
                        header.metadata = map.next_value().map_err(|e| {
                            de::Error::custom(format!(
                                "`__metadata__` must map strings to strings ({e})"
                            ))
                        })?;
                    } else {
                        let entry: RawEntry = map
                            .next_value()
                            .map_err(|e| de::Error::custom(format!("tensor `{key}`: {e}")))?;
                        header.tensors.push((key, entry));
                    }
                }
                Ok(header)
            }
        }
        deserializer.deserialize_map(HeaderVisitor)
    }
}

/// Serialize a header for `tensors` (already in data order, offsets contiguous from 0) with the
/// given metadata, padded with spaces to a multiple of 8 bytes as the reference writer does.
/// Returns the 8-byte length prefix followed by the header.
pub fn serialize(tensors: &[TensorInfo], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let infos = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                safetensors::tensor::TensorInfo {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data_offsets: (t.begin, t.end),
                },
            )
        })
        .collect();
    let meta = (!metadata.is_empty()).then(|| {
        metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    });
    let header = safetensors::tensor::Metadata::new(meta, infos)
        .map_err(|e| crate::internal!("internal: cannot build a safetensors header: {e}"))?;
    let mut value = serde_json::to_value(&header)
        .map_err(|e| crate::internal!("internal: cannot serialize header: {e}"))?;
    // The crate keeps `__metadata__` in a HashMap, whose order changes from run to run; the
    // BTreeMap's sorted order makes the same output the same bytes. The entry keeps its place
    // (serde_json's `preserve_order`).
    if let Some(entry) = value.get_mut("__metadata__") {
        *entry = serde_json::to_value(metadata)
            .map_err(|e| crate::internal!("internal: cannot serialize header: {e}"))?;
    }
    let mut json = serde_json::to_vec(&value)
        .map_err(|e| crate::internal!("internal: cannot serialize header: {e}"))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with_header(json: &str, data: &[u8]) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn round_trip_through_serialize() {
        let tensors = vec![
            TensorInfo {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![2],
                begin: 0,
                end: 8,
            },
            TensorInfo {
                name: "b".into(),
                dtype: Dtype::BF16,
                shape: vec![1, 3],
                begin: 8,
                end: 14,
            },
        ];
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let mut file = serialize(&tensors, &meta).unwrap();
        assert_eq!(file.len() % 8, 0);
        file.extend_from_slice(&[0u8; 14]);
        let header = parse(Path::new("x.safetensors"), &file).unwrap();
        assert_eq!(header.tensors, tensors);
        assert_eq!(header.metadata, meta);
        // The reference crate accepts what we write.
        safetensors::SafeTensors::deserialize(&file).unwrap();
    }

    #[test]
    fn duplicate_names_are_rejected() {
        let json = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let err = parse(Path::new("d.safetensors"), &file_with_header(json, &[0; 8])).unwrap_err();
        assert!(err.to_string().contains("`a` appears twice"), "{err}");
    }

    #[test]
    fn overlap_names_both_tensors() {
        let json = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let err = parse(Path::new("o.safetensors"), &file_with_header(json, &[0; 8]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`b`") && err.contains("`a`") && err.contains("o.safetensors"),
            "{err}"
        );
    }

    #[test]
    fn shared_offsets_are_named_before_the_gap_they_leave() {
        // `b` and `c` share 8..12, so 4..8 is unused: the sharing is the fault.
        let json = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"c":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        let err = parse(
            Path::new("s.safetensors"),
            &file_with_header(json, &[0; 12]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("tensor `c` (bytes 8..12) shares its bytes with tensor `b`"),
            "{err}"
        );
    }

    #[test]
    fn zero_size_tensors_share_an_offset() {
        let json = r#"{"e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"f":{"dtype":"F32","shape":[1,0],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let header = parse(Path::new("z.safetensors"), &file_with_header(json, &[0; 4])).unwrap();
        assert_eq!(header.tensors.len(), 3);
    }
}
