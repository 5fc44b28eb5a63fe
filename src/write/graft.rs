//! Writing a language model back into its vision-language model: the exact inverse of the VLM
//! family's extraction plan (docs/reference/graft.md).
//!
//! The plan that `extract` follows maps every output tensor to parts of stored tensors (whole
//! tensors, row ranges, transposed expert blocks). Grafting walks the same parts the other way:
//! each stored language-model tensor of the VLM is assembled from the LM tensors whose parts it
//! holds, in the VLM's own names, orientation and fusing; a head the tie rule left out is written
//! from the LM's embedding, as the VLM stores it. Every other stored tensor (vision tower,
//! projector, image-newline vectors) and every other file is the VLM's, byte for byte. A whole
//! tensor moved under a new name is passed through without a copy, so the common case streams at
//! disk speed with memory bounded by the writer's window.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

use indicatif::ProgressBar;
use safetensors::Dtype;
use serde::Serialize;
use serde_json::Value;

use crate::arch::config::{check_compatible, TextConfig};
use crate::arch::families::{detect_family, ExtractPlan, Family, OutTensor, Part, Piece};
use crate::arch::names;
use crate::checkpoint::output::{OutputDir, OutputKind};
use crate::checkpoint::writer::{self, PlannedTensor, Progress};
use crate::checkpoint::{natural_cmp, Checkpoint, CONFIG_FILE, INDEX_FILE};
use crate::error::Result;
use crate::{bail, dtype};

use super::model_card::{self, ModelCard};

/// One piece of a stored VLM tensor taken from an LM tensor.
#[derive(Debug, Clone)]
struct Scatter {
    /// Index of the LM tensor in the extraction plan's outputs.
    lm: usize,
    /// First element of the LM tensor that this piece takes.
    lm_start: usize,
    /// Where the piece lies in the stored tensor.
    piece: Piece,
}

/// How one stored tensor of the grafted VLM is produced.
#[derive(Debug, Clone)]
enum Fill {
    /// The VLM's own bytes.
    Vlm,
    /// Assembled from LM tensors; elements no piece covers keep the VLM's values.
    Lm(Vec<Scatter>),
}

/// How an LM tensor's bytes are brought to the layout the VLM stores.
#[derive(Debug, Clone, Default)]
struct Adapt {
    /// The LM stores it in this dtype; it is converted to the VLM's (round to nearest even).
    from_dtype: Option<Dtype>,
    /// The LM's vocabulary rows, when they differ from the VLM's.
    from_rows: Option<usize>,
}

/// What the LM provides: its tensors and its config.
pub struct LmSide<'a> {
    /// Names the LM in messages (its directory, or "the merged model").
    pub label: &'a str,
    pub tensors: &'a [PlannedTensor],
    pub config: &'a Value,
}

/// Everything a graft writes, decided before any byte is read.
pub struct GraftPlan<'v> {
    pub vlm: &'v Checkpoint,
    pub family: &'static str,
    /// The VLM's extraction plan, whose outputs are the LM tensors the graft takes.
    pub extract: ExtractPlan,
    /// The stored tensors of the output, in the VLM's order.
    pub tensors: Vec<PlannedTensor>,
    fills: Vec<Fill>,
    /// For each LM tensor of the plan, its index on the LM side.
    lm_index: Vec<usize>,
    adapt: Vec<Adapt>,
    /// The output's config.json when it is not the VLM's (another text class).
    config: Option<Value>,
    /// Decisions the user should know about (vocabulary rows restored, dtype converted).
    pub warnings: Vec<String>,
}

impl<'v> GraftPlan<'v> {
    /// Plan grafting `lm` into `vlm` of `family`, checking that the LM fits the VLM's language
    /// model: same architecture and config, the same tensors with the same shapes (vocabulary
    /// rows excepted).
    pub fn new(vlm: &'v Checkpoint, family: &'static dyn Family, lm: &LmSide) -> Result<Self> {
        let mut extract = family.plan(vlm)?;
        let mut warnings = Vec::new();
        let config = check_config(vlm, family.name(), &extract, lm)?;
        if config.is_some() {
            place_new_tensors(vlm, &mut extract, lm)?;
        }
        let (lm_index, adapt) = check_tensors(vlm, &extract, lm, &mut warnings)?;

        let mut pieces: HashMap<&str, Vec<Scatter>> = HashMap::new();
        for (j, out) in extract.outputs.iter().enumerate() {
            let mut offset = 0;
            for part in &out.parts {
                pieces
                    .entry(part.source.as_str())
                    .or_default()
                    .push(Scatter {
                        lm: j,
                        lm_start: offset,
                        piece: part.piece.clone(),
                    });
                offset += part.piece.numel();
            }
        }
        if let Some(head) = &extract.tied_head {
            let embed = (extract.outputs.iter())
                .position(|t| t.name == "model.embed_tokens.weight")
                .ok_or_else(|| crate::internal!("internal: a tied head without an embedding"))?;
            let numel = extract.outputs[embed].numel();
            pieces.entry(head.as_str()).or_default().push(Scatter {
                lm: embed,
                lm_start: 0,
                piece: Piece::Range {
                    start: 0,
                    len: numel,
                },
            });
        }
        let mut planned: Vec<(PlannedTensor, Fill)> = (vlm.planned_tensors().into_iter())
            .map(|t| {
                let fill = match pieces.remove(t.name.as_str()) {
                    Some(s) => Fill::Lm(s),
                    None => Fill::Vlm,
                };
                (t, fill)
            })
            .collect();
        // What is left are the tensors another text class adds (placed by `place_new_tensors`).
        for (name, scatters) in pieces {
            let Some(t) = (config.is_some())
                .then(|| &extract.outputs[scatters[0].lm])
                .filter(|t| scatters.len() == 1 && t.parts[0].source == name)
            else {
                return Err(crate::internal!(
                    "internal: the {} plan reads `{name}`, which {} does not store",
                    family.name(),
                    vlm.label
                ));
            };
            let added = PlannedTensor {
                name: name.to_string(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            };
            planned.push((added, Fill::Lm(scatters)));
        }
        planned.sort_by(|a, b| natural_cmp(&a.0.name, &b.0.name));
        let (tensors, fills) = planned.into_iter().unzip();
        Ok(GraftPlan {
            vlm,
            family: family.name(),
            extract,
            tensors,
            fills,
            lm_index,
            adapt,
            config,
            warnings,
        })
    }

    /// Bytes of every stored tensor of the output.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.byte_len() as u64).sum()
    }

    /// Stored tensors that come from the LM, and those kept from the VLM.
    pub fn counts(&self) -> (usize, usize) {
        let from_lm = (self.fills.iter())
            .filter(|f| matches!(f, Fill::Lm(_)))
            .count();
        (from_lm, self.fills.len() - from_lm)
    }

    /// Write the stored tensors into `out`. `lm_bytes(k)` gives the bytes of the LM side's tensor
    /// `k` (the index in [`LmSide::tensors`]) as it declared them (dtype and shape); it is called
    /// in parallel, once for every stored tensor the LM tensor goes into. `lm_origin(k)` names
    /// where an LM tensor comes from, for the non-finite check's message.
    pub fn write_tensors<'a>(
        &'a self,
        out: &OutputDir,
        max_shard_size: u64,
        bar: &ProgressBar,
        lm_origin: impl Fn(usize) -> Option<String> + Sync,
        lm_bytes: impl Fn(usize) -> Result<Cow<'a, [u8]>> + Sync,
    ) -> Result<writer::Written>
    where
        'v: 'a,
    {
        writer::write_tensors(
            out,
            &self.tensors,
            max_shard_size,
            Some((bar, Progress::Bytes)),
            |i| match &self.fills[i] {
                Fill::Vlm => Some(self.vlm.describe(&self.tensors[i].name)),
                Fill::Lm(s) => lm_origin(self.lm_index[s[0].lm]),
            },
            |i| match &self.fills[i] {
                Fill::Vlm => Ok(Cow::Borrowed(self.vlm.bytes(&self.tensors[i].name)?)),
                Fill::Lm(scatters) => self.assemble(i, scatters, &lm_bytes),
            },
        )
    }

    /// The bytes of stored tensor `i` from its pieces.
    fn assemble<'a>(
        &'a self,
        i: usize,
        scatters: &[Scatter],
        lm_bytes: &impl Fn(usize) -> Result<Cow<'a, [u8]>>,
    ) -> Result<Cow<'a, [u8]>>
    where
        'v: 'a,
    {
        let t = &self.tensors[i];
        let size = t.dtype.bitsize() / 8;
        let numel: usize = t.shape.iter().product();
        // The LM tensor stored whole under another name: no copy.
        if let [Scatter {
            lm,
            lm_start: 0,
            piece: Piece::Range { start: 0, len },
        }] = scatters
        {
            if *len == numel && self.extract.outputs[*lm].numel() == numel {
                return self.lm_tensor(*lm, lm_bytes);
            }
        }
        let covered: usize = scatters.iter().map(|s| s.piece.numel()).sum();
        let mut buf = if covered == numel {
            vec![0u8; numel * size]
        } else {
            self.vlm.bytes(&t.name)?.to_vec()
        };
        let mut fetched: Vec<(usize, Cow<'a, [u8]>)> = Vec::new();
        for s in scatters {
            if !fetched.iter().any(|(j, _)| *j == s.lm) {
                fetched.push((s.lm, self.lm_tensor(s.lm, lm_bytes)?));
            }
            let src = &fetched.iter().find(|(j, _)| *j == s.lm).expect("fetched").1;
            let n = s.piece.numel();
            let chunk = &src[s.lm_start * size..(s.lm_start + n) * size];
            s.piece.scatter_into(&mut buf, chunk, size);
        }
        Ok(Cow::Owned(buf))
    }

    /// LM tensor `j` in the VLM's dtype and vocabulary rows.
    fn lm_tensor<'a>(
        &'a self,
        j: usize,
        lm_bytes: &impl Fn(usize) -> Result<Cow<'a, [u8]>>,
    ) -> Result<Cow<'a, [u8]>>
    where
        'v: 'a,
    {
        let t = &self.extract.outputs[j];
        let bytes = lm_bytes(self.lm_index[j])?;
        let adapt = &self.adapt[j];
        if adapt.from_dtype.is_none() && adapt.from_rows.is_none() {
            return Ok(bytes);
        }
        let mut bytes = match adapt.from_dtype {
            Some(from) => {
                let values = dtype::decode(from, &bytes, &t.name)?;
                Cow::Owned(dtype::encode(t.dtype, &values)?)
            }
            None => bytes,
        };
        if let Some(rows) = adapt.from_rows {
            let row = t.byte_len() / t.shape[0];
            let want = t.shape[0];
            let mut owned = bytes.into_owned();
            if rows > want {
                owned.truncate(want * row);
            } else {
                let vlm_rows = t.bytes(self.vlm)?;
                owned.extend_from_slice(&vlm_rows[rows * row..]);
            }
            bytes = Cow::Owned(owned);
        }
        Ok(bytes)
    }

    /// Copy every file of the VLM but its weights (and its README.md when `card` replaces it)
    /// into `out`, byte for byte, config.json included; returns the names copied.
    pub fn copy_files(&self, out: &OutputDir, card: bool) -> Result<Vec<String>> {
        let shards: Vec<String> = self.vlm.shards.iter().map(|s| s.file_name()).collect();
        let mut names = Vec::new();
        let dir = &self.vlm.dir;
        let entries = std::fs::read_dir(dir).map_err(|e| crate::error::Error::read(dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| crate::error::Error::read(dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let skip = shards.contains(&name)
                || name == INDEX_FILE
                || (self.config.is_some() && name == CONFIG_FILE)
                || (card && name == model_card::FILE)
                || name.starts_with('.');
            if skip || !entry.path().is_file() {
                continue;
            }
            out.copy_file(&entry.path(), &name)?;
            names.push(name);
        }
        if let Some(config) = &self.config {
            out.write_json(CONFIG_FILE, config)?;
        }
        names.sort();
        Ok(names)
    }
}

/// Families whose VLM class builds its language model from the text config's own class
/// (`AutoModel.from_config(config.text_config)` in transformers' InternVL, LLaVA-OneVision,
/// LLaVA-NeXT and Idefics3 modeling files), so an LM of another class can be grafted in.
const ANY_TEXT_MODEL: &[&str] = &["internvl", "llava-onevision", "llava-next", "idefics3"];

/// The LM must be the architecture the VLM's language model is, with the same config: what
/// `extract` would write for this VLM, up to the fields that do not change the model. In the
/// families of [`ANY_TEXT_MODEL`], the LM may be another class with the same widths, layers and
/// heads (Qwen3 from `inject-qknorm` in a Qwen2 VLM); the returned config is then the VLM's with
/// the LM's as its text section.
fn check_config(
    vlm: &Checkpoint,
    family: &str,
    extract: &ExtractPlan,
    lm: &LmSide,
) -> Result<Option<Value>> {
    if let Some(f) = crate::arch::families::detect(lm.config, &[]) {
        bail!(
            "{}: is a vision-language model ({} family), not a language model; graft takes the language model that `sinkmerge extract` cuts out (or a merge of it)",
            lm.label,
            f.name()
        );
    }
    let ours = TextConfig::from_model_config(&extract.config)?;
    let theirs = TextConfig::from_model_config(lm.config)
        .map_err(|e| crate::bad!("{}: config.json: {e}", lm.label))?;
    let vlm_side = format!(
        "{}'s language model ({})",
        vlm.label,
        extract.target.architecture()
    );
    let swap = ours.model_type != theirs.model_type;
    let section = crate::arch::config::text_section(&vlm.config).1;
    if swap && !(ANY_TEXT_MODEL.contains(&family) && section.is_some()) {
        let feature = if theirs.model_type == "qwen3" && ours.model_type == "qwen2" {
            " (Qwen3 adds per-head q_norm/k_norm, as inject-qknorm writes)"
        } else {
            ""
        };
        bail!(
            "{}: is `{}`{feature}, but {vlm_side} is `{}`; the {family} architecture cannot hold it (only {} build their language model from the text config's class)",
            lm.label,
            theirs.model_type,
            ours.model_type,
            ANY_TEXT_MODEL.join(", ")
        );
    }
    // The swapped-in class must still fit the projector and the vocabulary: same widths, layers
    // and heads.
    let as_ours = TextConfig {
        model_type: ours.model_type.clone(),
        ..theirs.clone()
    };
    check_compatible(&ours, &as_ours, &vlm_side, lm.label)?;
    let differs: [(&str, String, String); 8] = [
        (
            "tie_word_embeddings",
            ours.tie_word_embeddings.to_string(),
            theirs.tie_word_embeddings.to_string(),
        ),
        (
            "hidden_act",
            ours.hidden_act.clone(),
            theirs.hidden_act.clone(),
        ),
        (
            "rms_norm_eps",
            ours.rms_norm_eps.to_string(),
            theirs.rms_norm_eps.to_string(),
        ),
        (
            "attention_bias",
            ours.attention_bias.to_string(),
            theirs.attention_bias.to_string(),
        ),
        (
            "mlp_bias",
            ours.mlp_bias.to_string(),
            theirs.mlp_bias.to_string(),
        ),
        (
            "layer_types",
            format!("{:?}", ours.layer_types),
            format!("{:?}", theirs.layer_types),
        ),
        (
            "rope",
            format!("{:?}", ours.rope),
            format!("{:?}", theirs.rope),
        ),
        (
            "moe",
            format!("{:?}", ours.moe),
            format!("{:?}", theirs.moe),
        ),
    ];
    // Another class may differ in its bias switches; its tensors are checked one by one.
    let switches = ["attention_bias", "mlp_bias"];
    for (key, a, b) in differs {
        if a != b && !(swap && switches.contains(&key)) {
            bail!(
                "{}: config `{key}` is {b}, but {a} in {vlm_side}; the grafted VLM would not be the LM's model",
                lm.label
            );
        }
    }
    if !swap {
        return Ok(None);
    }
    // The VLM's config with the LM's config as its text section (docs/reference/graft.md#another-text-class).
    let key = section.expect("checked");
    let mut text = lm.config.clone();
    if let Value::Object(map) = &mut text {
        for k in ["transformers_version", "_name_or_path"] {
            map.remove(k);
        }
    }
    let mut config = vlm.config.clone();
    config[key] = text;
    Ok(Some(config))
}

/// The LM tensors that another text class adds (Qwen3's q_norm/k_norm), planned under the VLM's
/// language-model prefix: the one its decoder layers are stored under.
fn place_new_tensors(vlm: &Checkpoint, extract: &mut ExtractPlan, lm: &LmSide) -> Result<()> {
    const LAYERS: &str = "layers.";
    let (stored_prefix, standard_prefix) = (extract.outputs.iter())
        .find_map(|t| {
            let at = t.name.find(LAYERS)?;
            let rest = &t.name[at..];
            let source = &t.parts.first()?.source;
            let stored = source.strip_suffix(rest)?;
            Some((stored.to_string(), t.name[..at].to_string()))
        })
        .ok_or_else(|| {
            crate::bad!(
                "{}: its decoder layers are not stored under one prefix, so tensors another text class adds have no place",
                vlm.label
            )
        })?;
    let planned: std::collections::HashSet<String> =
        extract.outputs.iter().map(|t| t.name.clone()).collect();
    for t in lm.tensors.iter().filter(|t| !planned.contains(&t.name)) {
        let Some(rest) = t.name.strip_prefix(&standard_prefix) else {
            bail!(
                "{}: tensor `{}` has no place in {}: only tensors under `{standard_prefix}` can be added",
                lm.label,
                t.name,
                vlm.label
            );
        };
        let numel = t.shape.iter().product();
        extract.outputs.push(OutTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            parts: vec![Part {
                source: format!("{stored_prefix}{rest}"),
                piece: Piece::Range {
                    start: 0,
                    len: numel,
                },
            }],
        });
    }
    Ok(())
}

/// Every LM tensor the VLM's plan has, with its shape; vocabulary rows and float dtypes may
/// differ and are adapted (with a warning). Returns, for each plan output, its index on the LM
/// side and its adaptation.
fn check_tensors(
    vlm: &Checkpoint,
    extract: &ExtractPlan,
    lm: &LmSide,
    warnings: &mut Vec<String>,
) -> Result<(Vec<usize>, Vec<Adapt>)> {
    let given: HashMap<&str, usize> = (lm.tensors.iter().enumerate())
        .map(|(k, t)| (t.name.as_str(), k))
        .collect();
    let wanted: HashSet<&str> = extract.outputs.iter().map(|t| t.name.as_str()).collect();
    if let Some(extra) = (lm.tensors.iter()).find(|t| !wanted.contains(t.name.as_str())) {
        bail!(
            "{}: tensor `{}` has no place in {} ({} family: its language model, {}, has no such tensor)",
            lm.label,
            extra.name,
            vlm.label,
            extract.family,
            extract.target.architecture()
        );
    }
    let mut index = Vec::with_capacity(extract.outputs.len());
    let mut adapt = Vec::with_capacity(extract.outputs.len());
    // How many tensors are converted, and the first one's dtypes, for one warning.
    let mut converted: Vec<(&str, Dtype, Dtype)> = Vec::new();
    for t in &extract.outputs {
        let Some(&k) = given.get(t.name.as_str()) else {
            bail!(
                "{}: tensor `{}` is missing; {}'s language model stores it",
                lm.label,
                t.name,
                vlm.label
            );
        };
        let g = &lm.tensors[k];
        let mut a = Adapt::default();
        if g.shape != t.shape {
            let vocab = names::parse(&t.name).is_some_and(|n| n.module.is_vocab());
            if !(vocab && g.shape.len() == 2 && g.shape[1..] == t.shape[1..]) {
                bail!(
                    "{}: tensor `{}` has shape {:?}, but {:?} in {}'s language model",
                    lm.label,
                    t.name,
                    g.shape,
                    t.shape,
                    vlm.label
                );
            }
            a.from_rows = Some(g.shape[0]);
            warnings.push(if g.shape[0] < t.shape[0] {
                format!(
                    "`{}` has {} vocabulary rows, {} has {}: rows {}.. are the VLM's",
                    t.name, g.shape[0], vlm.label, t.shape[0], g.shape[0]
                )
            } else {
                format!(
                    "`{}` has {} vocabulary rows, {} has {}: the rows past {} are dropped",
                    t.name, g.shape[0], vlm.label, t.shape[0], t.shape[0]
                )
            });
        }
        if g.dtype != t.dtype {
            if !(dtype::is_float(g.dtype) && dtype::is_float(t.dtype)) {
                bail!(
                    "{}: tensor `{}` is {:?}, but {:?} in {}",
                    lm.label,
                    t.name,
                    g.dtype,
                    t.dtype,
                    vlm.label
                );
            }
            a.from_dtype = Some(g.dtype);
            converted.push((&t.name, g.dtype, t.dtype));
        }
        index.push(k);
        adapt.push(a);
    }
    if let Some((first, from, to)) = converted.first() {
        warnings.push(format!(
            "{} LM tensor(s) are {from:?}, the VLM stores {to:?}: converted (round to nearest even), `{first}` first",
            converted.len()
        ));
    }
    Ok((index, adapt))
}

/// How to run a graft.
#[derive(Debug, Clone)]
pub struct Options {
    pub max_shard_size: u64,
    /// Replace a non-empty destination.
    pub force: bool,
    pub progress: bool,
    /// Write a README.md model card (instead of the VLM's README.md).
    pub model_card: bool,
}

/// What a graft did, for the text and `--json` reports.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub vlm: String,
    pub lm: String,
    pub family: &'static str,
    /// The VLM's language-model class, which the LM is.
    pub architecture: &'static str,
    pub output: String,
    pub tensors: usize,
    /// Stored tensors assembled from the LM.
    pub from_lm: usize,
    /// Stored tensors copied from the VLM (vision tower, projector, ...).
    pub from_vlm: usize,
    pub bytes: u64,
    pub shards: usize,
    /// Files copied from the VLM, byte for byte.
    pub files: Vec<String>,
    pub warnings: Vec<String>,
    pub seconds: f64,
}

/// Graft the LM checkpoint `lm` into `vlm` at `dest`.
pub fn run(
    vlm: &Checkpoint,
    family: &'static dyn Family,
    lm: &Checkpoint,
    dest: &Path,
    opts: &Options,
) -> Result<Summary> {
    let started = Instant::now();
    let tensors = lm.planned_tensors();
    let side = LmSide {
        label: &lm.label,
        tensors: &tensors,
        config: &lm.config,
    };
    let plan = GraftPlan::new(vlm, family, &side)?;
    let out = OutputDir::create(dest, OutputKind::Model, &[&vlm.dir, &lm.dir], opts.force)?;
    let bar = crate::progress::bytes(plan.total_bytes(), "grafting", opts.progress);
    let written = plan.write_tensors(
        &out,
        opts.max_shard_size,
        &bar,
        |k| Some(lm.describe(&tensors[k].name)),
        |k| Ok(Cow::Borrowed(lm.bytes(&tensors[k].name)?)),
    )?;
    bar.finish_and_clear();
    let files = plan.copy_files(&out, opts.model_card)?;
    if opts.model_card {
        card(vlm, lm, &plan).write(&out)?;
    }
    let dest = out.commit()?;
    let (from_lm, from_vlm) = plan.counts();
    Ok(Summary {
        vlm: vlm.label.clone(),
        lm: lm.label.clone(),
        family: plan.family,
        architecture: plan.extract.target.architecture(),
        output: dest.display().to_string(),
        tensors: plan.tensors.len(),
        from_lm,
        from_vlm,
        bytes: written.total_bytes,
        shards: written.files.len(),
        files,
        warnings: plan.warnings.clone(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The model card of a graft: the VLM and the LM as its bases.
fn card(vlm: &Checkpoint, lm: &Checkpoint, plan: &GraftPlan) -> ModelCard {
    let vlm_input = model_card::Input::new("vlm", true, vlm);
    let lm_input = model_card::Input::new("language model", true, lm);
    let description = format!(
        "`{}` with its language model replaced by `{}` ({} family, `{}`), made by `sinkmerge \
         graft`: every language-model tensor is the LM's, written back in the VLM's own layout \
         (names, fusing, orientation, tied head); the vision tower, projector, processor, \
         tokenizer, chat template and config are the VLM's, byte for byte.",
        vlm_input.name(),
        lm_input.name(),
        plan.family,
        plan.extract.target.architecture()
    );
    let (from_lm, from_vlm) = plan.counts();
    let mut recipe = vec![
        ("family", plan.family.to_string()),
        (
            "tensors",
            format!("{from_lm} from the language model, {from_vlm} from the VLM"),
        ),
    ];
    for w in &plan.warnings {
        recipe.push(("note", w.clone()));
    }
    let replay = vec![
        "sinkmerge".to_string(),
        "graft".to_string(),
        "--vlm".to_string(),
        vlm_input.reference(),
        "--lm".to_string(),
        lm_input.reference(),
        "-o".to_string(),
        "OUT".to_string(),
    ];
    ModelCard {
        kind: model_card::Kind::Graft,
        description,
        recipe,
        config_yaml: None,
        inputs: vec![vlm_input, lm_input],
        replay,
    }
}

/// The VLM of `--into-vlm`, opened, with its family.
pub struct IntoVlm {
    pub ckpt: Checkpoint,
    pub family: &'static dyn Family,
}

impl std::fmt::Debug for IntoVlm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IntoVlm")
            .field("vlm", &self.ckpt.label)
            .field("family", &self.family.name())
            .finish()
    }
}

impl IntoVlm {
    pub fn open(reference: &str) -> Result<IntoVlm> {
        let ckpt = Checkpoint::open_ref(reference)?;
        let family = detect_family(&ckpt)?;
        Ok(IntoVlm { ckpt, family })
    }

    /// Open `--into-vlm`'s VLM, if given.
    pub fn from_arg(reference: Option<&str>) -> Result<Option<IntoVlm>> {
        reference.map(IntoVlm::open).transpose()
    }

    /// Plan writing a model with `tensors` and `config` (named `label`) into this VLM.
    pub fn plan<'v>(
        &'v self,
        label: &str,
        tensors: &[PlannedTensor],
        config: &Value,
    ) -> Result<GraftPlan<'v>> {
        let side = LmSide {
            label,
            tensors,
            config,
        };
        GraftPlan::new(&self.ckpt, self.family, &side)
    }

    /// The VLM as a model-card input: a base of the output.
    pub fn card_input(&self) -> model_card::Input {
        model_card::Input::new("vlm", true, &self.ckpt)
    }

    /// Name the VLM in a model card: a base of the output, a sentence on the layout, and (when
    /// the command line replays it, not a recorded config) `--into-vlm` in the replay.
    pub fn mark_card(&self, card: &mut ModelCard, replay_flag: bool) {
        let input = self.card_input();
        card.description += &format!(
            " It is written into `{}`'s own layout (`--into-vlm`): that VLM's vision tower, \
             projector, config, processor and tokenizer files, with this model as its language \
             model.",
            input.name()
        );
        if replay_flag {
            let at = (card.replay.iter().position(|a| a == "-o")).unwrap_or(card.replay.len());
            card.replay
                .splice(at..at, ["--into-vlm".to_string(), input.reference()]);
        }
        card.inputs.push(input);
    }
}

/// Where a written model's tensors go: its own layout, or a VLM's (`--into-vlm`). The merge and
/// rewrite writers decide it once and write through it.
pub enum ModelLayout<'v> {
    /// As planned, beside the model's own config and tokenizer files.
    Own,
    /// Grafted into the VLM's stored tensors, beside the VLM's other tensors and files.
    IntoVlm(Box<GraftPlan<'v>>),
}

impl<'v> ModelLayout<'v> {
    /// The layout of a model with `tensors` and `config` (named `label` in messages): grafted into
    /// `vlm` when one is given, once the model is checked to fit it.
    pub fn plan(
        vlm: Option<&'v IntoVlm>,
        label: &str,
        tensors: &[PlannedTensor],
        config: &Value,
    ) -> Result<ModelLayout<'v>> {
        Ok(match vlm {
            Some(v) => ModelLayout::IntoVlm(Box::new(v.plan(label, tensors, config)?)),
            None => ModelLayout::Own,
        })
    }

    /// What the graft warns about; nothing in the model's own layout.
    pub fn warnings(&self) -> &[String] {
        match self {
            ModelLayout::Own => &[],
            ModelLayout::IntoVlm(g) => &g.warnings,
        }
    }

    /// Write the model's `tensors` into `out`, each from `produce(i)` (`origin(i)` naming where it
    /// comes from), and finish the bar. In the own layout the bar counts `progress`; in the VLM's
    /// it counts the bytes of the VLM's stored tensors.
    pub fn write_tensors<'a>(
        &'a self,
        out: &OutputDir,
        tensors: &[PlannedTensor],
        max_shard_size: u64,
        (bar, progress): (&ProgressBar, Progress),
        origin: impl Fn(usize) -> Option<String> + Sync,
        produce: impl Fn(usize) -> Result<Cow<'a, [u8]>> + Sync,
    ) -> Result<writer::Written>
    where
        'v: 'a,
    {
        let written = match self {
            ModelLayout::Own => writer::write_tensors(
                out,
                tensors,
                max_shard_size,
                Some((bar, progress)),
                origin,
                produce,
            )?,
            ModelLayout::IntoVlm(g) => {
                bar.set_length(g.total_bytes());
                g.write_tensors(out, max_shard_size, bar, origin, produce)?
            }
        };
        bar.finish_and_clear();
        Ok(written)
    }

    /// Write the files beside the weights: in the own layout those `own` writes (config,
    /// tokenizer); in the VLM's, the VLM's, less its README.md when `card` replaces it.
    pub fn write_files(
        &self,
        out: &OutputDir,
        card: bool,
        own: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        match self {
            ModelLayout::Own => own(),
            ModelLayout::IntoVlm(g) => g.copy_files(out, card).map(|_| ()),
        }
    }
}
