//! An extraction plan: which output tensors to write and where their bytes come from, which source
//! tensors are dropped and why, and the standalone config.
//!
//! Plans are pure header work. An output tensor is a list of [`Part`]s of source tensors, each a
//! contiguous element range (renames, row splits, expert slices: copied as borrowed bytes) or a
//! transposed 2-D block (expert unfusing of layouts stored `x @ W`); bytes are never decoded.

use std::borrow::Cow;
use std::collections::HashMap;

use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::target::Target;
use super::transpose;
use crate::arch::{config::TextConfig, layout};
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// Why a source tensor is not part of the language model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropKind {
    /// The vision encoder.
    Vision,
    /// The projector / resampler / merger between vision and language.
    Projector,
    /// Anything else outside the language model (image-newline vectors, image-token embeddings, a head
    /// tied to the embedding).
    Other,
}

impl DropKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DropKind::Vision => "vision tower",
            DropKind::Projector => "projector",
            DropKind::Other => "other",
        }
    }
}

/// Where some of an output tensor's elements come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Elements `[start, start + len)` of the flattened source, in order.
    Range { start: usize, len: usize },
    /// The 2-D block of `rows` rows of row length `stride` that starts at element `start`, restricted
    /// to columns `[col, col + cols)` and transposed: it contributes `cols` rows of `rows` elements.
    Transposed {
        start: usize,
        rows: usize,
        stride: usize,
        col: usize,
        cols: usize,
    },
}

impl Piece {
    pub fn numel(&self) -> usize {
        match *self {
            Piece::Range { len, .. } => len,
            Piece::Transposed { rows, cols, .. } => rows * cols,
        }
    }

    /// Append this piece of the stored tensor `src` (elements of `size` bytes) to `out`, in the
    /// order the output tensor holds it.
    pub fn append_to(&self, out: &mut Vec<u8>, src: &[u8], size: usize) {
        match *self {
            Piece::Range { start, len } => {
                out.extend_from_slice(&src[start * size..(start + len) * size])
            }
            Piece::Transposed {
                start,
                rows,
                stride,
                col,
                cols,
            } => transpose::append(out, src, size, start + col, rows, stride, cols),
        }
    }

    /// Write `chunk`, this piece in the order the output tensor holds it, back to its place in the
    /// stored tensor `dst`: the inverse of [`Piece::append_to`].
    pub fn scatter_into(&self, dst: &mut [u8], chunk: &[u8], size: usize) {
        match *self {
            Piece::Range { start, len } => {
                dst[start * size..(start + len) * size].copy_from_slice(chunk)
            }
            Piece::Transposed {
                start,
                rows,
                stride,
                col,
                cols,
            } => transpose::scatter(dst, chunk, size, start + col, rows, stride, cols),
        }
    }

    /// One past the last source element read.
    fn end(&self) -> usize {
        match *self {
            Piece::Range { start, len } => start + len,
            Piece::Transposed {
                start,
                rows,
                stride,
                col,
                cols,
            } => {
                if rows == 0 || cols == 0 {
                    start
                } else {
                    start + (rows - 1) * stride + col + cols
                }
            }
        }
    }
}

/// A piece of a named source tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub source: String,
    pub piece: Piece,
}

/// One tensor of the output model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Concatenated in order, they are the tensor's elements (row-major).
    pub parts: Vec<Part>,
}

impl OutTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn byte_len(&self) -> usize {
        self.numel() * self.dtype.bitsize() / 8
    }

    /// The tensor's bytes: borrowed from the source mmap when it is one contiguous range (renames,
    /// row splits, expert slices), else assembled (concatenations, transposes).
    pub fn bytes<'c>(&self, ckpt: &'c Checkpoint) -> Result<Cow<'c, [u8]>> {
        let size = self.dtype.bitsize() / 8;
        if let [Part {
            source,
            piece: Piece::Range { start, len },
        }] = self.parts.as_slice()
        {
            return Ok(Cow::Borrowed(
                &ckpt.bytes(source)?[start * size..(start + len) * size],
            ));
        }
        let mut out = Vec::with_capacity(self.byte_len());
        for part in &self.parts {
            part.piece
                .append_to(&mut out, ckpt.bytes(&part.source)?, size);
        }
        Ok(Cow::Owned(out))
    }
}

/// A source tensor left out of the output.
#[derive(Debug, Clone)]
pub struct Dropped {
    pub name: String,
    pub kind: DropKind,
    pub bytes: u64,
}

/// Everything `extract` writes, decided before any byte is read.
#[derive(Debug, Clone)]
pub struct ExtractPlan {
    pub family: &'static str,
    pub target: Target,
    /// The standalone `config.json`.
    pub config: Value,
    pub outputs: Vec<OutTensor>,
    pub dropped: Vec<Dropped>,
    /// Decisions worth telling the user (tie rule, re-split embeddings, ...).
    pub notes: Vec<String>,
    /// The stored output head that the tie rule left out because it is byte-identical to the
    /// embedding: `graft` writes the embedding back into it.
    pub tied_head: Option<String>,
}

/// Maps a standard output name to the name it would have in the checkpoint.
type StoredHint<'a> = Box<dyn Fn(&str) -> Option<String> + 'a>;

/// Builds an [`ExtractPlan`] from per-tensor decisions, then applies the tie rule and checks the result
/// against the target config.
pub struct PlanBuilder<'a> {
    ckpt: &'a Checkpoint,
    family: &'static str,
    outputs: Vec<OutTensor>,
    dropped: Vec<Dropped>,
    notes: Vec<String>,
    head: Option<String>,
    /// The head dropped by the tie rule.
    tied_head: Option<String>,
    /// Output name -> the stored name it came from, for messages.
    origin: HashMap<String, String>,
    /// How an output name that is missing would be stored, for messages.
    stored_hint: Option<StoredHint<'a>>,
}

impl<'a> PlanBuilder<'a> {
    pub fn new(ckpt: &'a Checkpoint, family: &'static str) -> Self {
        PlanBuilder {
            ckpt,
            family,
            outputs: Vec::new(),
            dropped: Vec::new(),
            notes: Vec::new(),
            head: None,
            tied_head: None,
            origin: HashMap::new(),
            stored_hint: None,
        }
    }

    pub fn ckpt(&self) -> &'a Checkpoint {
        self.ckpt
    }

    pub fn family(&self) -> &'static str {
        self.family
    }

    /// Tell the builder how a standard output name would be stored in this checkpoint, so that a
    /// missing tensor can be reported under the name the user would look for.
    pub fn set_stored_hint(&mut self, hint: impl Fn(&str) -> Option<String> + 'a) {
        self.stored_hint = Some(Box::new(hint));
    }

    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    /// Copy the whole stored tensor `stored` as `name`.
    pub fn keep(&mut self, stored: &str, name: String) -> Result<()> {
        let info = self.ckpt.require(stored)?;
        let (dtype, shape, numel) = (info.dtype, info.shape.clone(), info.numel());
        self.push_range(stored, name, dtype, shape, 0, numel)
    }

    /// Rows `[first, first + count)` of the 2-D (or N-D, split on the first axis) stored tensor as `name`.
    pub fn rows(&mut self, stored: &str, first: usize, count: usize, name: String) -> Result<()> {
        let info = self.ckpt.require(stored)?;
        let Some((&total, rest)) = info.shape.split_first() else {
            bail!(
                "{}: expected at least one axis to split, got a scalar",
                self.ckpt.describe(stored)
            );
        };
        if first + count > total {
            bail!(
                "{}: shape {:?} has {total} rows, {} needed",
                self.ckpt.describe(stored),
                info.shape,
                first + count
            );
        }
        let row: usize = rest.iter().product();
        let mut shape = vec![count];
        shape.extend_from_slice(rest);
        let dtype = info.dtype;
        self.push_range(stored, name, dtype, shape, first * row, count * row)
    }

    /// `name` as one contiguous range of elements of the stored tensor.
    fn push_range(
        &mut self,
        stored: &str,
        name: String,
        dtype: Dtype,
        shape: Vec<usize>,
        start: usize,
        len: usize,
    ) -> Result<()> {
        let piece = Piece::Range { start, len };
        let parts = vec![Part {
            source: stored.to_string(),
            piece,
        }];
        self.push(
            stored,
            OutTensor {
                name,
                dtype,
                shape,
                parts,
            },
        )
    }

    /// Split the stored tensor by rows into consecutive `(rows, name)` pieces that must cover it
    /// exactly (fused q/k/v, fused up/gate).
    pub fn split_rows(&mut self, stored: &str, pieces: &[(usize, String)]) -> Result<()> {
        let info = self.ckpt.require(stored)?;
        let wanted: usize = pieces.iter().map(|(n, _)| n).sum();
        if info.shape.first() != Some(&wanted) {
            bail!(
                "{}: shape {:?}, but the config implies {wanted} rows to split into {}",
                self.ckpt.describe(stored),
                info.shape,
                pieces
                    .iter()
                    .map(|(n, name)| format!("`{name}` ({n})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let mut first = 0;
        for (count, name) in pieces {
            self.rows(stored, first, *count, name.clone())?;
            first += count;
        }
        Ok(())
    }

    /// Split the stored tensor whose rows are `groups` repetitions of the row pattern `pieces`
    /// (`(rows, name)` each) into one output per piece: the concatenation, over the groups, of that
    /// piece's rows (InternLM2's `wqkv`, grouped per KV head as
    /// `[q × heads/kv_heads, k, v] × kv_heads`). Every row goes to exactly one output, in order
    /// within it, so the split is exactly invertible.
    pub fn split_grouped_rows(
        &mut self,
        stored: &str,
        groups: usize,
        pieces: &[(usize, String)],
    ) -> Result<()> {
        let info = self.ckpt.require(stored)?;
        let per_group: usize = pieces.iter().map(|(n, _)| n).sum();
        let Some((&total, rest)) = info.shape.split_first() else {
            bail!(
                "{}: expected at least one axis to split, got a scalar",
                self.ckpt.describe(stored)
            );
        };
        if total != groups * per_group {
            bail!(
                "{}: shape {:?}, but the config implies {groups} groups of {per_group} rows ({})",
                self.ckpt.describe(stored),
                info.shape,
                pieces
                    .iter()
                    .map(|(n, name)| format!("{n} for `{name}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let row: usize = rest.iter().product();
        let dtype = info.dtype;
        let mut offset = 0;
        for (count, name) in pieces {
            let parts = (0..groups)
                .map(|g| Part {
                    source: stored.to_string(),
                    piece: Piece::Range {
                        start: (g * per_group + offset) * row,
                        len: count * row,
                    },
                })
                .collect();
            let mut shape = vec![groups * count];
            shape.extend_from_slice(rest);
            self.push(
                stored,
                OutTensor {
                    name: name.clone(),
                    dtype,
                    shape,
                    parts,
                },
            )?;
            offset += count;
        }
        Ok(())
    }

    /// Add an output tensor made of arbitrary parts (`stored` names its main source for messages).
    pub fn push(&mut self, stored: &str, t: OutTensor) -> Result<()> {
        if !t.dtype.bitsize().is_multiple_of(8) {
            bail!(
                "{}: dtype {:?} packs several values per byte; extract copies whole elements only",
                self.ckpt.describe(stored),
                t.dtype
            );
        }
        let mut numel = 0;
        for p in &t.parts {
            let info = self.ckpt.require(&p.source)?;
            if info.dtype != t.dtype {
                bail!(
                    "{}: dtype {:?} differs from {:?} of the other parts of `{}`",
                    self.ckpt.describe(&p.source),
                    info.dtype,
                    t.dtype,
                    t.name
                );
            }
            if p.piece.end() > info.numel() {
                bail!(
                    "{}: shape {:?} is too small for the slice `{}` needs",
                    self.ckpt.describe(&p.source),
                    info.shape,
                    t.name
                );
            }
            numel += p.piece.numel();
        }
        if numel != t.numel() {
            return Err(crate::internal!(
                "internal: `{}` planned with {numel} elements for shape {:?}",
                t.name,
                t.shape
            ));
        }
        if let Some(prev) = self.origin.insert(t.name.clone(), stored.to_string()) {
            bail!(
                "{}: maps to `{}`, which `{prev}` already maps to",
                self.ckpt.describe(stored),
                t.name
            );
        }
        self.outputs.push(t);
        Ok(())
    }

    pub fn drop(&mut self, stored: &str, kind: DropKind) -> Result<()> {
        let bytes = self.ckpt.require(stored)?.byte_len() as u64;
        self.dropped.push(Dropped {
            name: stored.to_string(),
            kind,
            bytes,
        });
        Ok(())
    }

    /// Register the stored output head; whether it is kept is decided by the tie rule in `finish`.
    pub fn head(&mut self, stored: &str) -> Result<()> {
        if let Some(prev) = &self.head {
            bail!(
                "{}: two output heads, `{prev}` and `{stored}`",
                self.ckpt.describe(stored)
            );
        }
        self.head = Some(stored.to_string());
        Ok(())
    }

    /// Apply the tie rule (docs/reference/vlm-layouts.md#tied-embeddings), set
    /// `tie_word_embeddings` in `config`, then check every tensor the target class will load
    /// against the planned ones: nothing missing, nothing extra, every shape as the config implies.
    pub fn finish(
        mut self,
        target: Target,
        mut config: Value,
        tie_flag: Option<bool>,
    ) -> Result<ExtractPlan> {
        let tied = self.apply_tie_rule(tie_flag)?;
        config["tie_word_embeddings"] = Value::Bool(tied);
        let text = TextConfig::from_model_config(&config).map_err(|e| {
            crate::bad!(
                "{}: the {} config built for {} is not valid: {e}",
                self.ckpt.label,
                self.family,
                target.architecture()
            )
        })?;
        let expected = layout::expected_tensors(&text)?;
        let planned: HashMap<&str, &OutTensor> =
            self.outputs.iter().map(|t| (t.name.as_str(), t)).collect();
        for (name, shape) in &expected {
            match planned.get(name.as_str()) {
                None => {
                    let stored = self
                        .stored_hint
                        .as_ref()
                        .and_then(|h| h(name))
                        .map(|s| format!(" (stored as `{s}`)"))
                        .unwrap_or_default();
                    bail!(
                        "{}: language-model tensor `{name}`{stored} is missing; {} with this config needs it ({} files in {})",
                        self.ckpt.label,
                        target.architecture(),
                        self.ckpt.shards.len(),
                        self.ckpt.dir.display()
                    );
                }
                Some(t) if &t.shape != shape => bail!(
                    "{}: has shape {:?}, but the {} config implies {shape:?} for `{name}`",
                    self.ckpt.describe(&self.origin[name.as_str()]),
                    t.shape,
                    target.architecture()
                ),
                Some(_) => {}
            }
        }
        if self.outputs.len() != expected.len() {
            let wanted: std::collections::HashSet<&str> =
                expected.iter().map(|(n, _)| n.as_str()).collect();
            if let Some(extra) = self
                .outputs
                .iter()
                .find(|t| !wanted.contains(t.name.as_str()))
            {
                bail!(
                    "{}: maps to `{}`, which {} with this config does not have (unexpected tensor for the {} family)",
                    self.ckpt.describe(&self.origin[&extra.name]),
                    extra.name,
                    target.architecture(),
                    self.family
                );
            }
        }
        // Write in the order the target class declares its tensors.
        let order: HashMap<&str, usize> = expected
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.as_str(), i))
            .collect();
        self.outputs.sort_by_key(|t| order[t.name.as_str()]);
        self.dropped
            .sort_by(|a, b| crate::checkpoint::natural_cmp(&a.name, &b.name));
        Ok(ExtractPlan {
            family: self.family,
            target,
            config,
            outputs: self.outputs,
            dropped: self.dropped,
            notes: self.notes,
            tied_head: self.tied_head,
        })
    }

    /// docs/reference/vlm-layouts.md#tied-embeddings: head absent -> tied; head present and flag
    /// false (or unstated) -> kept; head present and flag true -> tied if byte-identical to the
    /// embedding, else an error.
    fn apply_tie_rule(&mut self, flag: Option<bool>) -> Result<bool> {
        let Some(head) = self.head.take() else {
            self.note("tie_word_embeddings: true (the checkpoint stores no output head)");
            return Ok(true);
        };
        if flag != Some(true) {
            return self.keep(&head, "lm_head.weight".into()).map(|_| false);
        }
        let embed = self
            .outputs
            .iter()
            .find(|t| t.name == "model.embed_tokens.weight")
            .cloned();
        let info = self.ckpt.require(&head)?;
        let same = match &embed {
            Some(e) if e.shape == info.shape && e.dtype == info.dtype => {
                let head_bytes = self.ckpt.bytes(&head)?;
                e.bytes(self.ckpt)?.as_ref() == head_bytes
            }
            _ => false,
        };
        if !same {
            bail!(
                "{}: the config ties the output head to the embedding (tie_word_embeddings: true) but the stored head differs from it; transformers 4.x and 5.x would build different models from this folder. Fix tie_word_embeddings in config.json to say which one is meant",
                self.ckpt.describe(&head)
            );
        }
        self.drop(&head, DropKind::Other)?;
        self.note(format!(
            "tie_word_embeddings: true (`{head}` is byte-identical to the embedding; not written)"
        ));
        self.tied_head = Some(head);
        Ok(true)
    }
}
