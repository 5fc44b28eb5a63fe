//! Running an extraction plan: stream the kept tensors into a new model directory (bytes copied
//! verbatim, borrowed straight from the source mmap unless surgery assembles them), write the
//! standalone config and the tokenizer files, verify the result against the source, and commit it
//! atomically. Memory stays bounded by the writer's window, whatever the model size.

pub mod aux_files;
pub mod verify;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_128;

use crate::arch::families::{DropKind, Piece, Plan};
use crate::checkpoint::output::OutputDir;
use crate::checkpoint::writer::{self, PlannedTensor, Progress};
use crate::checkpoint::{Checkpoint, CONFIG_FILE};
use crate::error::Result;

/// How to run an extraction.
#[derive(Debug, Clone)]
pub struct Options {
    pub max_shard_size: u64,
    /// Replace a non-empty destination.
    pub force: bool,
    /// Reopen the output and compare every tensor with its source before committing.
    pub verify: bool,
    /// Draw progress bars.
    pub progress: bool,
}

/// What an extraction did, for the text and `--json` reports.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub source: String,
    pub source_dir: String,
    /// The source's Hub repo and resolved commit, for models from the Hugging Face cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_hub: Option<crate::checkpoint::resolve::HubRef>,
    pub family: &'static str,
    pub architecture: &'static str,
    pub output: String,
    /// Output tensors written.
    pub tensors_written: usize,
    /// Source tensors whose bytes went into the output.
    pub tensors_kept: usize,
    /// Output tensors made by surgery (row splits, expert unfusing) rather than whole copies.
    pub tensors_from_surgery: usize,
    /// Source tensors dropped, by kind: `vision`, `projector`, `other`.
    pub dropped: BTreeMap<DropKind, Count>,
    pub bytes_written: u64,
    pub shards: usize,
    pub tie_word_embeddings: bool,
    /// Files written next to the weights.
    pub files: Vec<String>,
    /// Where the chat template came from.
    pub chat_template: String,
    pub notes: Vec<String>,
    pub verified: bool,
    pub seconds: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct Count {
    pub tensors: usize,
    pub bytes: u64,
}

/// Write `plan` for `ckpt` into `dest`.
pub fn run(ckpt: &Checkpoint, plan: &Plan, dest: &Path, opts: &Options) -> Result<Summary> {
    let started = Instant::now();
    let out = OutputDir::create(dest, &[&ckpt.dir], opts.force)?;
    let (written, aux, hashes) = write(&out, ckpt, plan, opts)?;
    let mut notes = plan.notes.clone();
    notes.extend(aux.notes.iter().cloned());

    let mut dropped: BTreeMap<DropKind, Count> = BTreeMap::new();
    for d in &plan.dropped {
        let c = dropped.entry(d.kind).or_default();
        c.tensors += 1;
        c.bytes += d.bytes;
    }
    let sources: BTreeSet<&str> = plan
        .outputs
        .iter()
        .flat_map(|t| t.parts.iter().map(|p| p.source.as_str()))
        .collect();
    let surgery = plan
        .outputs
        .iter()
        .filter(|t| match t.parts.as_slice() {
            [p] => match p.piece {
                Piece::Range { start, len } => {
                    start != 0 || ckpt.info(&p.source).map(|i| i.numel()) != Some(len)
                }
                Piece::Transposed { .. } => true,
            },
            _ => true,
        })
        .count();
    let tie = plan.config["tie_word_embeddings"]
        .as_bool()
        .unwrap_or(false);
    let mut summary = Summary {
        source: ckpt.label.clone(),
        source_dir: ckpt.dir.display().to_string(),
        source_hub: ckpt.hub.clone(),
        family: plan.family,
        architecture: plan.target.architecture(),
        output: out.dest().display().to_string(),
        tensors_written: plan.outputs.len(),
        tensors_kept: sources.len(),
        tensors_from_surgery: surgery,
        dropped,
        bytes_written: written.total_bytes,
        shards: written.files.len(),
        tie_word_embeddings: tie,
        files: Vec::new(),
        chat_template: aux.chat_template.clone(),
        notes,
        verified: false,
        seconds: 0.0,
    };
    out.write_file("README.md", readme(&summary).as_bytes())?;
    let mut files = written.files.clone();
    if written.files.len() > 1 {
        files.push(crate::checkpoint::INDEX_FILE.to_string());
    }
    files.push(CONFIG_FILE.to_string());
    files.extend(aux.files);
    files.push("README.md".to_string());
    summary.files = files;
    if opts.verify {
        verify::check(&out, plan, &hashes, opts.progress)?;
        summary.verified = true;
    }
    out.commit()?;
    summary.seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

/// Write the tensors, config.json and the tokenizer files of `plan` into `out` (not committed).
/// With `opts.verify`, also returns the xxh3-128 of every output tensor's bytes as they were taken
/// from the source (empty otherwise), for [`verify::check`].
pub fn write(
    out: &OutputDir,
    ckpt: &Checkpoint,
    plan: &Plan,
    opts: &Options,
) -> Result<(writer::Written, aux_files::Aux, Vec<u128>)> {
    let hashes: Vec<OnceLock<u128>> = plan.outputs.iter().map(|_| OnceLock::new()).collect();
    let planned: Vec<PlannedTensor> = plan
        .outputs
        .iter()
        .map(|t| PlannedTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    let total: u64 = plan.outputs.iter().map(|t| t.byte_len() as u64).sum();
    let bar = crate::progress::bytes(total, "extracting", opts.progress);
    let written = writer::write_tensors(
        out,
        &planned,
        opts.max_shard_size,
        Some((&bar, Progress::Bytes)),
        |i| {
            let bytes = plan.outputs[i].bytes(ckpt)?;
            if opts.verify {
                hashes[i].get_or_init(|| xxh3_128(&bytes));
            }
            Ok(bytes)
        },
    )?;
    bar.finish_and_clear();
    out.write_json(CONFIG_FILE, &plan.config)?;
    let aux = aux_files::copy(out, ckpt, plan.target)?;
    let hashes = hashes
        .into_iter()
        .filter_map(OnceLock::into_inner)
        .collect();
    Ok((written, aux, hashes))
}

/// A short model card: where the model came from and what was done to it.
fn readme(s: &Summary) -> String {
    let mut text = format!(
        "# {}\n\nThe language model of `{}` ({} family) as a standalone `{}`, cut out by `sinkmerge extract`.\n\n",
        Path::new(&s.output)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        s.source,
        s.family,
        s.architecture
    );
    text += &format!(
        "* {} tensors ({} bytes) from {} source tensors; {} made by surgery (row splits, expert unfusing); bytes otherwise copied verbatim\n",
        s.tensors_written, s.bytes_written, s.tensors_kept, s.tensors_from_surgery
    );
    for (kind, c) in &s.dropped {
        text += &format!(
            "* dropped ({}): {} tensors, {} bytes\n",
            kind.as_str(),
            c.tensors,
            c.bytes
        );
    }
    text += &format!("* tie_word_embeddings: {}\n", s.tie_word_embeddings);
    text += &format!("* chat template: {}\n", s.chat_template);
    for n in &s.notes {
        text += &format!("* {n}\n");
    }
    text
}
