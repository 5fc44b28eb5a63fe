//! One pipeline for the commands that write a copy of one checkpoint with some tensors
//! recomputed from their stored bytes (the controls, head repair): every tensor is planned with
//! the source's name, dtype and shape, the output directory is staged beside its destination,
//! config.json and the tokenizer and processor files are copied, and the shards are written in
//! parallel, the caller's own files (a model card, a recipe) are added, and the output is
//! committed: complete or absent.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use indicatif::ProgressBar;

use super::graft::{IntoVlm, ModelLayout};
use crate::checkpoint::header::TensorInfo;
use crate::checkpoint::output::{ExtraFile, OutputDir, OutputKind};
use crate::checkpoint::writer::{PlannedTensor, Progress};
use crate::checkpoint::{copy_aux_files, natural_cmp, Checkpoint};
use crate::error::Result;

/// The committed output and what the edits reported, by tensor name in natural order.
pub struct Rewritten<R> {
    pub dest: PathBuf,
    pub edits: Vec<(String, R)>,
}

/// Where the output goes.
#[derive(Debug, Clone, Copy)]
pub struct Destination<'a> {
    /// The output directory.
    pub dir: &'a Path,
    /// Inputs besides the source that the output must not lie inside.
    pub other_inputs: &'a [&'a Path],
    /// Replace a non-empty `dir`.
    pub force: bool,
    pub max_shard_size: u64,
    /// Write the output into this VLM's layout instead (`--into-vlm`).
    pub into_vlm: Option<&'a IntoVlm>,
}

/// What the output has besides the source's tensors and files.
#[derive(Default)]
pub struct Additions<'a> {
    /// config.json to write instead of the source's.
    pub config: Option<serde_json::Value>,
    /// New tensors and their bytes, placed among the source's in natural name order.
    pub tensors: Vec<(PlannedTensor, Vec<u8>)>,
    /// Files to add, in this order.
    pub files: Vec<&'a dyn ExtraFile>,
}

/// What an edit does with one tensor.
pub enum Edit<R> {
    /// Copy it byte for byte.
    Copy,
    /// Copy it byte for byte, and report on it.
    Keep(R),
    /// Write these bytes instead (same dtype and length), and report on it.
    Replace(Vec<u8>, R),
}

/// Write `source` to `to.dir` with the tensors `edit(name, info, bytes)` recomputes, plus
/// `additions`, and commit it. On any error nothing is left at the destination.
pub fn rewrite<R: Send>(
    source: &Checkpoint,
    to: &Destination,
    bar: &ProgressBar,
    additions: &Additions<'_>,
    edit: impl Fn(&str, &TensorInfo, &[u8]) -> Result<Edit<R>> + Sync,
) -> Result<Rewritten<R>> {
    // Each planned tensor, and the index of its bytes in `additions` when it is new.
    let mut planned: Vec<(PlannedTensor, Option<usize>)> = (source.planned_tensors().into_iter())
        .map(|t| (t, None))
        .chain((additions.tensors.iter().enumerate()).map(|(i, (t, _))| (t.clone(), Some(i))))
        .collect();
    planned.sort_by(|a, b| natural_cmp(&a.0.name, &b.0.name));
    let (planned, added): (Vec<PlannedTensor>, Vec<Option<usize>>) = planned.into_iter().unzip();
    let config = additions.config.as_ref().unwrap_or(&source.config);
    let layout = ModelLayout::plan(to.into_vlm, &source.label, &planned, config)?;
    let mut inputs = vec![source.dir.as_path()];
    inputs.extend_from_slice(to.other_inputs);
    inputs.extend(to.into_vlm.map(|v| v.ckpt.dir.as_path()));
    let out = OutputDir::create(to.dir, OutputKind::Model, &inputs, to.force)?;
    let edits = Mutex::new(Vec::new());
    // A tensor the LM and the VLM both take (a tied head) is produced once per stored tensor,
    // so its edit is reported once.
    let reported = Mutex::new(std::collections::HashSet::new());
    let origin = |i: usize| {
        added[i]
            .is_none()
            .then(|| source.describe(&planned[i].name))
    };
    let produce = |i: usize| {
        if let Some(a) = added[i] {
            return Ok(Cow::Borrowed(additions.tensors[a].1.as_slice()));
        }
        let name = &planned[i].name;
        let bytes = source.bytes(name)?;
        let info = source.info(name).expect("listed");
        let report = |r: R| {
            if (reported.lock().expect("no panics hold the lock")).insert(i) {
                (edits.lock().expect("no panics hold the lock")).push((name.clone(), r));
            }
        };
        match edit(name, info, bytes)? {
            Edit::Copy => Ok(Cow::Borrowed(bytes)),
            Edit::Keep(r) => {
                report(r);
                Ok(Cow::Borrowed(bytes))
            }
            // The writer refuses bytes of another length than planned (an internal error).
            Edit::Replace(new, r) => {
                report(r);
                Ok(Cow::Owned(new))
            }
        }
    };
    for w in layout.warnings() {
        eprintln!("sinkmerge: warning: {w}");
    }
    layout.write_tensors(
        &out,
        &planned,
        to.max_shard_size,
        (bar, Progress::Bytes),
        origin,
        produce,
    )?;
    // The caller's files (a model card) come after, and replace the VLM's README.md.
    layout.write_files(&out, false, || {
        match &additions.config {
            Some(config) => out.write_json("config.json", config)?,
            None => out.copy_file(&source.dir.join("config.json"), "config.json")?,
        }
        copy_aux_files(&out, source).map(|_| ())
    })?;
    for file in &additions.files {
        file.write_into(&out)?;
    }
    let dest = out.commit()?;
    let mut edits = edits.into_inner().expect("no panics hold the lock");
    edits.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    Ok(Rewritten { dest, edits })
}
