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

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_128;

use crate::arch::families::{DropKind, ExtractPlan, Piece};
use crate::checkpoint::output::{OutputDir, OutputKind};
use crate::checkpoint::writer::{self, PlannedTensor, Progress};
use crate::checkpoint::{Checkpoint, CONFIG_FILE};
use crate::error::Result;
use crate::write::model_card::{self, ModelCard};

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
    /// Write a README.md model card.
    pub model_card: bool,
}

/// What an extraction did, for the text and `--json` reports.
#[derive(Debug, Serialize, Deserialize)]
pub struct Summary {
    pub source: String,
    pub source_dir: String,
    /// The source's Hub repo and resolved commit, for models from the Hugging Face cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_hub: Option<crate::checkpoint::hub_cache::HubRef>,
    pub family: String,
    pub architecture: String,
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

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Count {
    pub tensors: usize,
    pub bytes: u64,
}

/// Write `plan` for `ckpt` into `dest`.
pub fn run(ckpt: &Checkpoint, plan: &ExtractPlan, dest: &Path, opts: &Options) -> Result<Summary> {
    let started = Instant::now();
    let out = OutputDir::create(dest, OutputKind::Model, &[&ckpt.dir], opts.force)?;
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
        family: plan.family.to_string(),
        architecture: plan.target.architecture().to_string(),
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
    if opts.model_card {
        card(ckpt, &summary).write(&out)?;
    }
    let mut files = written.files.clone();
    if written.files.len() > 1 {
        files.push(crate::checkpoint::INDEX_FILE.to_string());
    }
    files.push(CONFIG_FILE.to_string());
    files.extend(aux.files);
    if opts.model_card {
        files.push(model_card::FILE.to_string());
    }
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
    plan: &ExtractPlan,
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
            let mut sources: Vec<&str> = plan.outputs[i]
                .parts
                .iter()
                .map(|p| p.source.as_str())
                .collect();
            sources.dedup();
            Some(
                sources
                    .iter()
                    .map(|s| ckpt.describe(s))
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        },
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

/// The model card: where the model came from and what was done to it.
fn card(ckpt: &Checkpoint, s: &Summary) -> ModelCard {
    let source = model_card::Input::new("source", true, ckpt);
    let description = format!(
        "The language model of `{}` ({} family) as a standalone `{}`, cut out by `sinkmerge \
         extract`: the language-model tensors under standard causal-LM names, bytes copied \
         verbatim (row splits and expert unfusing only where the family needs them), a config.json \
         for the target class, and the tokenizer files. Vision tower, projector and other \
         non-language tensors are dropped.",
        source.name(),
        s.family,
        s.architecture
    );
    let mut recipe = vec![
        ("family", s.family.clone()),
        ("architecture", format!("`{}`", s.architecture)),
        (
            "tensors",
            format!(
                "{} ({} bytes) from {} source tensors; {} made by surgery",
                s.tensors_written, s.bytes_written, s.tensors_kept, s.tensors_from_surgery
            ),
        ),
    ];
    for (kind, c) in &s.dropped {
        recipe.push((
            "dropped",
            format!(
                "{}: {} tensors, {} bytes",
                kind.as_str(),
                c.tensors,
                c.bytes
            ),
        ));
    }
    recipe.push(("tie_word_embeddings", s.tie_word_embeddings.to_string()));
    recipe.push(("chat template", s.chat_template.clone()));
    for n in &s.notes {
        recipe.push(("note", n.clone()));
    }
    let replay = vec![
        "sinkmerge".to_string(),
        "extract".to_string(),
        source.reference(),
        "--family".to_string(),
        s.family.clone(),
        "-o".to_string(),
        "OUT".to_string(),
    ];
    ModelCard {
        kind: model_card::Kind::Extraction,
        description,
        recipe,
        config_yaml: None,
        inputs: vec![source],
        replay,
    }
}
