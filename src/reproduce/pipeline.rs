//! Running `reproduce`'s steps: every check before the first step, a manifest per finished
//! step, and a rerun that redoes only what changed (docs/commands/reproduce.md, "Resuming").

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::hash::{HashCache, Identity};
use super::plan::{self, PlanInput, Read, Role, Step};
use crate::arch::config::{check_compatible, TextConfig};
use crate::checkpoint::output::{check_cancelled, write_file_atomic, OutputKind, Outputs};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::sink::score::Scores;
use crate::units::human_bytes;
use crate::{bad, bail};

/// The bundled text of the perplexity column, used when `--text` is not given.
pub const SAMPLE_TEXT: &str = include_str!("../../assets/text/sample.txt");

/// Runs one step's command line (`argv`, without the program's name) and returns what the
/// command printed: each step is an existing command, run by the caller that knows the
/// commands (`commands/reproduce.rs`), so its report is that command's own.
pub trait StepRunner {
    fn run(&self, argv: &[String], progress: bool) -> Result<String>;
}

/// What `reproduce` is asked to do for one pair.
#[derive(Debug, Clone)]
pub struct Options {
    pub reference: String,
    pub vlm: String,
    pub base: Option<String>,
    pub dir: PathBuf,
    /// The perplexity text; `None`: the bundled sample, copied to `DIR/inputs/sample.txt`.
    pub text: Option<PathBuf>,
    /// `cpu`, `cuda` or `cuda:N`, passed to the scoring steps.
    pub device: String,
    pub merges: Vec<&'static str>,
    /// Steps not to run (with the steps that need them).
    pub skip: Vec<String>,
    /// Steps to redo even if their manifest matches.
    pub force: Vec<String>,
    pub keep_models: bool,
    pub progress: bool,
    /// `--answers`: each model's greedy answers to the bundled prompts.
    pub answers: bool,
}

/// `steps/NAME/manifest.json`, written after everything else the step writes: a step is done
/// when its manifest exists and its key is the key of the step as planned now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub step: String,
    /// The command line that replays the step (its report is its stdout).
    pub command: String,
    pub argv: Vec<String>,
    pub sinkmerge_version: String,
    pub inputs: Vec<Identity>,
    /// The keys of the steps it read from.
    pub after: BTreeMap<String, String>,
    /// Every file the step wrote, by its path under DIR: a rerun reuses the step only when each
    /// is there as written (see [`intact`]).
    pub outputs: BTreeMap<String, OutputFile>,
    /// SHA-256 of the version, the command line, the inputs and the upstream keys.
    pub key: String,
    pub seconds: f64,
}

/// A file a step wrote, as its manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputFile {
    pub bytes: u64,
    /// The hex XXH3-128 of its contents.
    pub xxh3: String,
}

/// The plan of a pair after every check, ready to run or to print.
pub struct Prepared {
    pub options: Options,
    pub steps: Vec<Step>,
    pub skipped: Vec<(String, String)>,
    pub keys: BTreeMap<String, String>,
    pub identities: BTreeMap<String, Vec<Identity>>,
    pub text: PathBuf,
    /// Bytes the plan writes at its peak, and bytes free where it writes.
    pub disk_needed: u64,
    pub disk_free: u64,
    pub estimate_seconds: f64,
    pub models: PairModels,
    /// The content hashes learned while preparing, saved once DIR exists, and those of the
    /// steps' outputs, learned while checking them (also for `--dry-run`, which saves nothing).
    pub cache: RefCell<HashCache>,
}

/// The pair's models as opened, for the summary.
pub struct PairModels {
    pub reference: Checkpoint,
    pub vlm: Checkpoint,
    pub base: Option<Checkpoint>,
    pub family: &'static str,
}

/// Every check that needs no step: the models open, the VLM's language model has the
/// reference's architecture (and the base's), DIR is no input, the disk holds the plan.
pub fn prepare(options: Options) -> Result<Prepared> {
    let reference = Checkpoint::open_ref(&options.reference)?;
    let vlm = Checkpoint::open_ref(&options.vlm)?;
    let base = options
        .base
        .as_deref()
        .map(Checkpoint::open_ref)
        .transpose()?;
    let family = crate::arch::families::detect_family(&vlm).map_err(|e| {
        bad!(
            "--vlm {}: not a vision-language model sinkmerge can extract a language model from: {e}",
            options.vlm
        )
    })?;
    let lm_plan = family.plan(&vlm)?;
    let ref_config = TextConfig::from_model_config(&reference.config)
        .map_err(|e| bad!("--ref {}: {e}", options.reference))?;
    let lm_config = TextConfig::from_model_config(&lm_plan.config)
        .map_err(|e| bad!("--vlm {}: its language model: {e}", options.vlm))?;
    let ref_name = format!(
        "--ref {} ({})",
        options.reference,
        architecture(&reference.config)
    );
    let lm_name = format!(
        "the language model of --vlm {} ({}, family {})",
        options.vlm,
        architecture(&lm_plan.config),
        family.name()
    );
    check_compatible(&ref_config, &lm_config, &ref_name, &lm_name)?;
    if ref_config.vocab_size != lm_config.vocab_size {
        bail!(
            "{ref_name} and {lm_name} have different vocabularies: vocab_size is {} vs {}; the \
             merges and the margin need the same token rows",
            ref_config.vocab_size,
            lm_config.vocab_size
        );
    }
    if let Some(base) = &base {
        let base_config = TextConfig::from_model_config(&base.config)
            .map_err(|e| bad!("--base {}: {e}", base.label))?;
        let base_name = format!("--base {} ({})", base.label, architecture(&base.config));
        check_compatible(&ref_config, &base_config, &ref_name, &base_name)?;
    }
    let dir = options.dir.clone();
    let mut inputs: Vec<&Path> = vec![&reference.dir, &vlm.dir];
    inputs.extend(base.iter().map(|b| b.dir.as_path()));
    inputs.extend(options.text.as_deref());
    Outputs::new(false)
        .output("-o", Some(&dir), OutputKind::Workspace)
        .inputs("input", inputs.iter().copied())
        .check()?;
    let text = options
        .text
        .clone()
        .unwrap_or_else(|| dir.join("inputs").join("sample.txt"));
    if let Some(t) = &options.text {
        if !t.is_file() {
            bail!("--text {}: not a readable file", t.display());
        }
    }

    let answers_file = dir.join("inputs").join("answers.jsonl");
    let steps = plan::steps(&PlanInput {
        reference: &options.reference,
        vlm: &options.vlm,
        base: options.base.as_deref(),
        dir: &dir,
        text: &text,
        device: &options.device,
        merges: &options.merges,
        answers: options.answers.then_some(answers_file.as_path()),
    });
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    for name in options.skip.iter().chain(&options.force) {
        if !names.contains(&name.as_str()) && name != "merges" {
            bail!(
                "no step `{name}` in this plan; its steps: {} (and `merges`, every merge)",
                names.join(", ")
            );
        }
    }
    let skipped = skipped_steps(&steps, &options.skip)?;
    let steps: Vec<Step> = steps
        .into_iter()
        .filter(|s| !skipped.iter().any(|(n, _)| *n == s.name))
        .collect();
    // Every path the run writes under DIR is checked as DIR is: no link on the way (with
    // DIR/models a link to a store of models, `extract --force` would write into the store),
    // and none is, holds or lies inside an input.
    let bundled = options.text.is_none().then_some(text.as_path());
    let mut written = written_paths(&dir, &steps, bundled);
    if options.answers {
        written.push((answers_file.clone(), OutputKind::File));
    }
    refuse_links(&dir, written.iter().map(|(path, _)| path.as_path()))?;
    for (path, kind) in &written {
        // Model folders are replaced whole (`extract`, `merge` with --force), and only when
        // they hold nothing but a model's files.
        Outputs::new(true)
            .output("-o DIR's", Some(path), *kind)
            .inputs("input", inputs.iter().copied())
            .check()?;
    }

    // Peak disk use: the language model, and one merged model at a time (all of them with
    // --keep-models), each as large as the reference in its own dtype; less what is there.
    let lm_bytes = reference.total_bytes();
    let merges = steps.iter().filter(|s| s.role == Role::Merge).count() as u64;
    let kept = if options.keep_models {
        merges
    } else {
        merges.min(1)
    };
    let present = dir_bytes(&dir.join("models"));
    let disk_needed = (lm_bytes + kept * lm_bytes).saturating_sub(present);
    let disk_free = free_bytes(&dir)?;
    if disk_needed > disk_free {
        bail!(
            "-o {}: the plan needs {} of disk (the language model and {} merged model{} of {} \
             each) and its filesystem has {} free; free space, choose another -o, or trim the \
             run with --merges",
            dir.display(),
            human_bytes(disk_needed),
            kept,
            if kept == 1 { "" } else { "s" },
            human_bytes(lm_bytes),
            human_bytes(disk_free)
        );
    }

    if options.answers {
        check_answers_memory(&reference, &lm_plan, &ref_config, &steps)?;
    }

    // The models' identities: Hub commits, or content hashes (cached under DIR).
    let mut cache = HashCache::load(&dir.join(HASH_CACHE));
    let mut model_ids = BTreeMap::new();
    for (input, ckpt) in [(&options.reference, &reference), (&options.vlm, &vlm)]
        .into_iter()
        .chain(options.base.iter().zip(base.iter()))
    {
        model_ids.insert(
            input.clone(),
            cache.model(input, &ckpt.dir, ckpt.hub.as_ref())?,
        );
    }
    let text_id = match &options.text {
        Some(t) => cache.file_identity(&t.to_string_lossy(), t)?,
        None => Identity {
            input: text.to_string_lossy().into_owned(),
            kind: "xxh3-128".into(),
            value: format!(
                "{:032x}",
                xxhash_rust::xxh3::xxh3_128(SAMPLE_TEXT.as_bytes())
            ),
        },
    };
    let mut keys = BTreeMap::new();
    let mut identities = BTreeMap::new();
    for step in &steps {
        let mut ids = Vec::new();
        for read in &step.reads {
            ids.push(match read {
                Read::Model { input } => model_ids[input].clone(),
                Read::File { path } if *path == text => text_id.clone(),
                Read::File { path } if *path == answers_file => Identity {
                    input: path.to_string_lossy().into_owned(),
                    kind: "xxh3-128".into(),
                    value: format!(
                        "{:032x}",
                        xxhash_rust::xxh3::xxh3_128(plan::ANSWER_PROMPTS.as_bytes())
                    ),
                },
                Read::File { path } => Identity {
                    input: path.to_string_lossy().into_owned(),
                    kind: "xxh3-128".into(),
                    // A merge config is written by the step itself, from the plan.
                    value: format!(
                        "{:032x}",
                        xxhash_rust::xxh3::xxh3_128(
                            step.config.as_deref().unwrap_or_default().as_bytes()
                        )
                    ),
                },
            });
        }
        let after: BTreeMap<String, String> = step
            .after
            .iter()
            .map(|a| (a.clone(), keys.get(a).cloned().unwrap_or_default()))
            .collect();
        keys.insert(step.name.clone(), step_key(&step.argv, &ids, &after));
        identities.insert(step.name.clone(), ids);
    }
    let estimate_seconds = estimate(&reference, &steps);
    Ok(Prepared {
        options,
        steps,
        skipped,
        keys,
        identities,
        text,
        disk_needed,
        disk_free,
        estimate_seconds,
        models: PairModels {
            reference,
            vlm,
            base,
            family: family.name(),
        },
        cache: RefCell::new(cache),
    })
}

/// `--answers`: refuse, before any step, a model whose greedy decode would not fit in memory.
/// The decode keeps the weights mapped as stored and a KV cache of the prompt and the answer:
/// the reference as it is, the VLM's language model as extract writes it, each merge as large as
/// the reference (as the disk check counts it). The prompt's tokens are bounded by its bytes.
fn check_answers_memory(
    reference: &Checkpoint,
    lm_plan: &crate::arch::families::plan::ExtractPlan,
    ref_config: &TextConfig,
    steps: &[Step],
) -> Result<()> {
    let spec = crate::forward::model::DecoderSpec::base(ref_config)?;
    let longest = (plan::answer_prompts().iter())
        .map(String::len)
        .max()
        .unwrap_or(0);
    // A BOS token, the prompt, the answer.
    let capacity = 1 + longest + plan::ANSWER_TOKENS;
    let cache = crate::forward::cache::KvCache::<Vec<f32>>::bytes(&spec, capacity);
    let lm_bytes: u64 = (lm_plan.outputs.iter())
        .map(|t| (t.numel() * t.dtype.bitsize() / 8) as u64)
        .sum();
    for step in steps.iter().filter(|s| s.role == Role::Answers) {
        let model = &step.argv[1];
        let weights = if step.name == plan::answers_step("vlm-lm") {
            lm_bytes
        } else {
            reference.total_bytes()
        };
        crate::forward::memory::check(
            weights as f64 + cache,
            &format!(
                "--answers: step {} (generate on {model}: {} of weights as stored, and a KV \
                 cache of {capacity} tokens, {})",
                step.name,
                human_bytes(weights),
                human_bytes(cache as u64)
            ),
            "run without --answers, or on a machine with more memory",
        )?;
    }
    Ok(())
}

/// Every path a run of `steps` writes under `dir` (with `text`, the bundled text's copy), with
/// what it is: the model folders of `extract` and the merges, and files.
fn written_paths(dir: &Path, steps: &[Step], text: Option<&Path>) -> Vec<(PathBuf, OutputKind)> {
    let mut files: Vec<PathBuf> = [
        PLAN,
        HASH_CACHE,
        super::lock::LOCK,
        "summary.json",
        "report.html",
        SLURM_REPORT_JOB,
    ]
    .iter()
    .map(|name| dir.join(name))
    .collect();
    files.extend(text.map(Path::to_path_buf));
    let mut models = Vec::new();
    for step in steps {
        let folder = plan::step_dir(dir, &step.name);
        files.extend([MANIFEST, REPORT, REMOVED, CONFIG, SLURM_JOB].map(|n| folder.join(n)));
        files.extend(step.files.iter().cloned());
        models.extend(step.model.iter().cloned());
    }
    (files.into_iter().map(|f| (f, OutputKind::File)))
        .chain(models.into_iter().map(|m| (m, OutputKind::Model)))
        .collect()
}

/// Refuse a symbolic link at or above any of `paths` below `dir`: a run writes only real files
/// and folders inside its DIR, so that no link can send a write elsewhere, into an input or
/// another run's folder (what DIR itself resolves to is checked as any output is).
pub fn refuse_links<'a>(dir: &Path, paths: impl IntoIterator<Item = &'a Path>) -> Result<()> {
    for path in paths {
        let Ok(rest) = path.strip_prefix(dir) else {
            continue;
        };
        let mut at = dir.to_path_buf();
        for component in rest.components() {
            at.push(component);
            match fs::symlink_metadata(&at) {
                Ok(meta) if meta.file_type().is_symlink() => {
                    let target = fs::read_link(&at).unwrap_or_default();
                    bail!(
                        "-o {}: {} is a symlink (to {}); reproduce writes only real files and \
                         folders inside DIR, so that no link sends a write elsewhere (into an \
                         input, say): put the folder itself there, or choose another -o",
                        dir.display(),
                        at.display(),
                        target.display()
                    );
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }
    Ok(())
}

fn architecture(config: &serde_json::Value) -> String {
    config["architectures"][0]
        .as_str()
        .map(str::to_string)
        .or_else(|| config["model_type"].as_str().map(str::to_string))
        .unwrap_or_else(|| "unknown architecture".into())
}

/// The steps `--skip` leaves out, each with why: named, or needing a step that is left out.
fn skipped_steps(steps: &[Step], skip: &[String]) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    for step in steps {
        let named = skip.contains(&step.name)
            || (step.role == Role::Merge && skip.iter().any(|s| s == "merges"));
        if named {
            if step.role == Role::Extract {
                bail!("--skip extract: every other step reads the extracted language model");
            }
            out.push((step.name.clone(), "--skip".into()));
        } else if let Some(needed) = step.after.iter().find(|a| out.iter().any(|(n, _)| n == *a)) {
            out.push((
                step.name.clone(),
                format!("needs {needed}, which is skipped"),
            ));
        }
    }
    Ok(out)
}

/// A step's key: the same version, command line, inputs and upstream keys give the same key.
fn step_key(argv: &[String], inputs: &[Identity], after: &BTreeMap<String, String>) -> String {
    let value = serde_json::json!({
        "sinkmerge_version": env!("CARGO_PKG_VERSION"),
        "argv": argv,
        "inputs": inputs,
        "after": after,
    });
    let digest = Sha256::digest(value.to_string().as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file holding a step's report (the command's own `--json` output).
pub const REPORT: &str = "report.json";
/// The file a step writes last.
pub const MANIFEST: &str = "manifest.json";
/// Beside a merge step's manifest once its model was deleted after scoring: the bytes freed.
pub const REMOVED: &str = "removed.json";
/// Beside a step's manifest: the Slurm job that runs it.
pub const SLURM_JOB: &str = "slurm.json";
/// In the run's directory: the Slurm job that writes summary.json and report.html.
pub const SLURM_REPORT_JOB: &str = "slurm-report.json";

/// Where a step's plan is kept for `--status` and for the jobs of the Slurm executor.
pub const PLAN: &str = "plan.json";
/// The content hashes of input and output files, by stat signature.
const HASH_CACHE: &str = ".hash-cache.json";
/// A merge step's config, written before it runs.
const CONFIG: &str = "config.yml";

/// Make the run's directory ready: the hash cache, the bundled text, the plan. Every
/// executor calls it before running or submitting a step.
pub fn begin(prepared: &mut Prepared) -> Result<()> {
    let dir = prepared.options.dir.clone();
    fs::create_dir_all(&dir).map_err(|e| crate::error::Error::write(&dir, e))?;
    prepared.cache.borrow_mut().save()?;
    if prepared.options.text.is_none() {
        let current = fs::read(&prepared.text).unwrap_or_default();
        if current != SAMPLE_TEXT.as_bytes() {
            write_file_atomic(&prepared.text, SAMPLE_TEXT.as_bytes())?;
        }
    }
    if prepared.options.answers {
        let path = dir.join("inputs").join("answers.jsonl");
        if fs::read(&path).unwrap_or_default() != plan::ANSWER_PROMPTS.as_bytes() {
            write_file_atomic(&path, plan::ANSWER_PROMPTS.as_bytes())?;
        }
    }
    let plan = crate::report::json_text(&stored_plan(prepared))?;
    if fs::read(dir.join(PLAN)).ok().as_deref() != Some(plan.as_bytes()) {
        write_file_atomic(&dir.join(PLAN), plan.as_bytes())?;
    }
    Ok(())
}

/// The steps that need not run: their manifest matches, they are not forced, and what they
/// wrote is still there (a merged model deleted after its score is needed again only when that
/// score is to be redone).
pub fn done_steps(prepared: &Prepared) -> Vec<String> {
    finished_steps(prepared, &prepared.options.force)
}

/// The steps whose outputs are complete and current, `force` aside (see [`done_steps`]).
pub fn finished_steps(prepared: &Prepared, force: &[String]) -> Vec<String> {
    let steps = &prepared.steps;
    let mut done: Vec<String> = steps
        .iter()
        .filter(|s| !forced(force, s))
        .filter(|s| intact(prepared, s))
        .map(|s| s.name.clone())
        .collect();
    // A merge whose model was deleted is redone when a step that reads the model is not done.
    let rescored: Vec<String> = steps
        .iter()
        .filter(|s| s.role == Role::Merge)
        .filter(|s| {
            let readers = merged_model_readers(steps, s.setting.as_deref().unwrap_or_default());
            readers.iter().any(|r| !done.contains(&r.name))
                && !s.model.as_ref().is_some_and(|m| m.is_dir())
        })
        .map(|s| s.name.clone())
        .collect();
    done.retain(|name| !rescored.contains(name));
    done
}

/// Whether what DIR holds of a step is what the step wrote, so that a rerun may reuse it
/// instead of trusting files anyone could have changed since: its manifest is this step's as
/// planned (key, inputs, upstream keys, and the command line it shows), and every file the
/// manifest records is there, a regular file of the size and XXH3-128 recorded, and no other in
/// its model. A merged model deleted once scored (not with `--keep-models`) must have left a
/// `removed.json` that agrees with the manifest.
fn intact(prepared: &Prepared, step: &Step) -> bool {
    let dir = &prepared.options.dir;
    let Some(manifest) = read_manifest(dir, &step.name) else {
        return false;
    };
    let planned = manifest.step == step.name
        && manifest.key == prepared.keys[&step.name]
        && manifest.sinkmerge_version == env!("CARGO_PKG_VERSION")
        && manifest.inputs == prepared.identities[&step.name]
        && manifest.after == after_keys(prepared, step)
        && resolved_argv(dir, step).is_ok_and(|argv| argv == manifest.argv)
        && manifest.command == format!("sinkmerge {}", command_line(&manifest.argv));
    let Some(now) = planned.then(|| outputs_now(prepared, step)).flatten() else {
        return false;
    };
    let model = step.model.as_ref();
    if model.is_none_or(|m| is_real_dir(m)) {
        return now == manifest.outputs;
    }
    if step.role != Role::Merge || prepared.options.keep_models {
        return false;
    }
    let model = model.expect("checked above");
    let (weights, rest): (BTreeMap<_, _>, BTreeMap<_, _>) =
        (manifest.outputs.into_iter()).partition(|(path, _)| dir.join(path).starts_with(model));
    let removed = fs::read(plan::step_dir(dir, &step.name).join(REMOVED))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok());
    now == rest
        && removed.is_some_and(|r| {
            r["model"].as_str() == Some(&*model.to_string_lossy())
                && r["bytes"].as_u64() == Some(weight_bytes(&weights))
        })
}

/// A folder, not a link to one.
fn is_real_dir(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// The bytes of the weights among a model's recorded files: what deleting it frees. The rest
/// (model card, recorded config) is a few KB that name the inputs by absolute path, and would
/// make the summary depend on where the run was made.
fn weight_bytes(files: &BTreeMap<String, OutputFile>) -> u64 {
    (files.iter())
        .filter(|(path, _)| path.ends_with(".safetensors"))
        .map(|(_, f)| f.bytes)
        .sum()
}

/// The files of a step as they are now, by path under DIR: its report, its config, its plots,
/// and the top-level files of the model it writes when that folder is there (names starting
/// with `.` left out, as in an input's hash). `None` when one is missing, or is not a regular
/// file (a link could point anywhere).
fn outputs_now(prepared: &Prepared, step: &Step) -> Option<BTreeMap<String, OutputFile>> {
    let dir = &prepared.options.dir;
    let folder = plan::step_dir(dir, &step.name);
    let mut files = vec![folder.join(REPORT)];
    files.extend(step.config.as_ref().map(|_| folder.join(CONFIG)));
    files.extend(step.files.iter().cloned());
    if let Some(model) = step.model.as_ref().filter(|m| is_real_dir(m)) {
        for entry in fs::read_dir(model).ok()? {
            let entry = entry.ok()?;
            if !entry.file_name().to_string_lossy().starts_with('.') {
                files.push(entry.path());
            }
        }
    }
    let mut cache = prepared.cache.borrow_mut();
    (files.iter())
        .map(|path| {
            let meta = fs::symlink_metadata(path).ok().filter(|m| m.is_file())?;
            let name = path.strip_prefix(dir).ok()?.to_string_lossy().into_owned();
            let xxh3 = cache.file(path).ok()?;
            Some((
                name,
                OutputFile {
                    bytes: meta.len(),
                    xxh3,
                },
            ))
        })
        .collect()
}

/// The keys of the steps `step` reads, by name, as its manifest records them.
fn after_keys(prepared: &Prepared, step: &Step) -> BTreeMap<String, String> {
    (step.after.iter())
        .map(|a| (a.clone(), prepared.keys.get(a).cloned().unwrap_or_default()))
        .collect()
}

/// The local executor: run the plan's steps in order, one at a time (each command uses every
/// thread of the pool), reusing every step that is done.
pub fn execute(prepared: &mut Prepared, runner: &dyn StepRunner) -> Result<()> {
    begin(prepared)?;
    let done = done_steps(prepared);
    // The hashes of the outputs just checked, so the next run reads no model again.
    prepared.cache.borrow_mut().save()?;
    let total = prepared.steps.len();
    for (i, step) in prepared.steps.iter().enumerate() {
        check_cancelled()?;
        let tag = format!("[{:>2}/{total}] {}", i + 1, step.name);
        if done.contains(&step.name) {
            if prepared.options.progress {
                eprintln!("{tag}: done earlier (its manifest matches)");
            }
        } else {
            if prepared.options.progress {
                eprintln!("{tag}: sinkmerge {}", command_line(&step.argv));
            }
            let seconds = run_step(prepared, step, runner)?;
            if prepared.options.progress {
                eprintln!("{tag}: done in {seconds:.1} s");
            }
        }
        finish_step(prepared, step)?;
    }
    Ok(())
}

/// Run the one step `name` (a job of the Slurm executor, which submits only steps to redo):
/// the steps it reads must be done.
pub fn execute_one(prepared: &mut Prepared, name: &str, runner: &dyn StepRunner) -> Result<()> {
    begin(prepared)?;
    let done = done_steps(prepared);
    prepared.cache.borrow_mut().save()?;
    let step = (prepared.steps.iter())
        .find(|s| s.name == name)
        .ok_or_else(|| bad!("--step {name}: no such step in this plan"))?;
    if let Some(missing) = step.after.iter().find(|a| !done.contains(a)) {
        bail!("step {name} reads step {missing}, which is not done");
    }
    run_step(prepared, step, runner)?;
    finish_step(prepared, step)
}

/// What follows a step, done now or earlier: a merged model is deleted once the last step that
/// reads it (its score, or with `--answers` its answers) is done.
fn finish_step(prepared: &Prepared, step: &Step) -> Result<()> {
    let Some(setting) = step.setting.as_deref() else {
        return Ok(());
    };
    let last = merged_model_readers(&prepared.steps, setting)
        .last()
        .is_some_and(|r| r.name == step.name);
    if last && !prepared.options.keep_models {
        remove_merged_model(&prepared.options.dir, &prepared.steps, setting)
    } else {
        Ok(())
    }
}

/// The steps that read the merged model of `setting`, in the plan's order.
fn merged_model_readers<'s>(steps: &'s [Step], setting: &str) -> Vec<&'s Step> {
    (steps.iter())
        .filter(|s| s.role != Role::Merge && s.setting.as_deref() == Some(setting))
        .collect()
}

/// Whether `--force` names the step (or `merges`, and it is a merge).
fn forced(force: &[String], step: &Step) -> bool {
    force.contains(&step.name) || (step.role == Role::Merge && force.iter().any(|f| f == "merges"))
}

/// Delete a merged model once it is scored, recording the weights' bytes freed beside its
/// manifest.
fn remove_merged_model(dir: &Path, steps: &[Step], setting: &str) -> Result<()> {
    let Some(merge) = steps
        .iter()
        .find(|s| s.role == Role::Merge && s.setting.as_deref() == Some(setting))
    else {
        return Ok(());
    };
    let Some(model) = merge.model.as_ref().filter(|m| is_real_dir(m)) else {
        return Ok(());
    };
    // The merge is done (checked, or run just now): its manifest holds the model's files.
    let manifest = read_manifest(dir, &merge.name).ok_or_else(|| {
        crate::internal!("step {}: no manifest to delete its model by", merge.name)
    })?;
    let bytes = weight_bytes(&manifest.outputs);
    fs::remove_dir_all(model).map_err(|e| crate::error::Error::write(model, e))?;
    let record = serde_json::json!({ "model": model, "bytes": bytes });
    write_file_atomic(
        &plan::step_dir(dir, &merge.name).join(REMOVED),
        crate::report::json_text(&record)?.as_bytes(),
    )
}

/// The manifest of step `name`, if it exists and parses.
pub fn read_manifest(dir: &Path, name: &str) -> Option<Manifest> {
    let bytes = fs::read(plan::step_dir(dir, name).join(MANIFEST)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The command line of a step with the values only known once earlier steps ran: the
/// predictor's S is the reference's, from its score step.
fn resolved_argv(dir: &Path, step: &Step) -> Result<Vec<String>> {
    if step.role != Role::Predict {
        return Ok(step.argv.clone());
    }
    let scores: Scores = read_step_report(dir, "score-ref")?;
    let s = (scores.models.first())
        .and_then(|m| m.statistics.sink_strength)
        .ok_or_else(|| crate::internal!("score-ref's report has no sink_strength"))?;
    Ok(step
        .argv
        .iter()
        .map(|a| if a == "S" { format!("{s}") } else { a.clone() })
        .collect())
}

/// A finished step's report as the struct its command serialised: a report that does not fit
/// it is an error naming the step and the file, never a silent empty value.
pub fn read_step_report<T: DeserializeOwned>(dir: &Path, name: &str) -> Result<T> {
    let path = plan::step_dir(dir, name).join(REPORT);
    let value =
        crate::checkpoint::read_json(&path).map_err(|e| e.context(format!("step {name}")))?;
    serde_json::from_value(value).map_err(|e| {
        bad!(
            "step {name}: {}: not the report its command writes: {e}",
            path.display()
        )
    })
}

/// Run one step with `runner`; its report, then its manifest, are written atomically. Returns
/// the seconds it took.
fn run_step(prepared: &Prepared, step: &Step, runner: &dyn StepRunner) -> Result<f64> {
    let dir = &prepared.options.dir;
    let folder = plan::step_dir(dir, &step.name);
    fs::create_dir_all(&folder).map_err(|e| crate::error::Error::write(&folder, e))?;
    // An earlier manifest never outlives a step that runs again.
    for stale in [MANIFEST, REMOVED] {
        let path = folder.join(stale);
        if path.exists() {
            fs::remove_file(&path).map_err(|e| crate::error::Error::write(&path, e))?;
        }
    }
    if let Some(config) = &step.config {
        write_file_atomic(&folder.join(CONFIG), config.as_bytes())?;
    }
    let argv = resolved_argv(dir, step)?;
    let started = Instant::now();
    let report = (runner.run(&argv, prepared.options.progress))
        .map_err(|e| e.context(format!("step {}", step.name)))?;
    let seconds = started.elapsed().as_secs_f64();
    write_file_atomic(&folder.join(REPORT), report.as_bytes())?;
    let outputs = outputs_now(prepared, step).ok_or_else(|| {
        crate::internal!(
            "step {}: a file it wrote cannot be read back to hash",
            step.name
        )
    })?;
    let manifest = Manifest {
        step: step.name.clone(),
        command: format!("sinkmerge {}", command_line(&argv)),
        argv,
        sinkmerge_version: env!("CARGO_PKG_VERSION").into(),
        inputs: prepared.identities[&step.name].clone(),
        after: after_keys(prepared, step),
        outputs,
        key: prepared.keys[&step.name].clone(),
        seconds,
    };
    write_file_atomic(
        &folder.join(MANIFEST),
        crate::report::json_text(&manifest)?.as_bytes(),
    )?;
    prepared.cache.borrow_mut().save()?;
    Ok(seconds)
}

/// `argv` as one shell command line: words with anything but safe characters single-quoted.
pub fn command_line(argv: &[String]) -> String {
    argv.iter()
        .map(|a| crate::shell::quote(a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Bytes of the regular files under `path` (0 if it does not exist).
pub fn dir_bytes(path: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Bytes free to an unprivileged writer on the filesystem that holds (or will hold) `path`.
fn free_bytes(path: &Path) -> Result<u64> {
    let mut existing = crate::checkpoint::output::absolute(path)?;
    while !existing.exists() {
        if !existing.pop() {
            break;
        }
    }
    let stat = rustix::fs::statvfs(&existing).map_err(|e| {
        bad!(
            "{}: cannot read its filesystem's free space: {e}",
            existing.display()
        )
    })?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// A rough wall time of the plan, from sizes alone (docs/commands/reproduce.md, "--dry-run"):
/// every model byte read or written at 1 GB/s, and each model's scoring pass at 2 FLOPs per
/// parameter per token, about 2000 tokens, at 50 GFLOP/s on a CPU (1000 on a GPU).
fn estimate(reference: &Checkpoint, steps: &[Step]) -> f64 {
    let bytes = reference.total_bytes() as f64;
    let pass = 2.0 * reference.num_parameters() as f64 * 2000.0;
    steps
        .iter()
        .map(|s| {
            let gpu = s.argv.iter().any(|a| a.starts_with("cuda"));
            let flops = if gpu { 1e12 } else { 5e10 };
            match s.role {
                Role::Inspect | Role::Predict => 0.1,
                // Three prompts of ~64 tokens and 64 new ones: ~400 token passes, and a read.
                Role::Answers => 400.0 * pass / 2000.0 / flops + bytes / 1e9,
                Role::Extract => 2.0 * bytes / 1e9,
                Role::Norms => 2.0 * bytes / 1e9 + 10.0 * pass / 2000.0 / flops,
                Role::Merge => 4.0 * bytes / 1e9,
                // A score against the reference runs both models; the reference's own, one.
                Role::Score if !s.argv.iter().any(|a| a == "--ref") => pass / flops + bytes / 1e9,
                Role::Score | Role::Heads => 2.0 * pass / flops + 2.0 * bytes / 1e9,
            }
        })
        .sum()
}

/// `DIR/plan.json`: each step's name, key, command and the steps it reads, for `--status`.
fn stored_plan(p: &Prepared) -> serde_json::Value {
    serde_json::json!({
        "steps": p.steps.iter().map(|s| serde_json::json!({
            "name": s.name,
            "key": p.keys[&s.name],
            "command": format!("sinkmerge {}", command_line(&s.argv)),
            "after": s.after,
        })).collect::<Vec<_>>(),
        "skipped": p.skipped.iter().map(|(n, why)| serde_json::json!({"name": n, "reason": why}))
            .collect::<Vec<_>>(),
    })
}

/// `--dry-run --json`: the plan as data.
pub fn plan_json(p: &Prepared) -> serde_json::Value {
    let done = done_steps(p);
    serde_json::json!({
        "steps": p.steps.iter().map(|s| serde_json::json!({
            "name": s.name,
            "role": s.role,
            "command": format!("sinkmerge {}", command_line(&s.argv)),
            "after": s.after,
            "done": done.contains(&s.name),
        })).collect::<Vec<_>>(),
        "skipped": p.skipped.iter().map(|(n, why)| serde_json::json!({"name": n, "reason": why}))
            .collect::<Vec<_>>(),
        "disk_needed_bytes": p.disk_needed,
        "disk_free_bytes": p.disk_free,
        "estimate_seconds": p.estimate_seconds,
    })
}

/// `--dry-run`: the plan as text.
pub fn plan_text(p: &Prepared) -> String {
    let mut out = String::new();
    let done_steps = done_steps(p);
    for (i, s) in p.steps.iter().enumerate() {
        let done = done_steps.contains(&s.name);
        out += &format!(
            "{:>2}. {:<22} {}sinkmerge {}\n",
            i + 1,
            s.name,
            if done { "(done) " } else { "" },
            command_line(&s.argv)
        );
    }
    for (name, why) in &p.skipped {
        out += &format!("    {name:<22} skipped: {why}\n");
    }
    let gflops = if p.options.device.starts_with("cuda") {
        1000
    } else {
        50
    };
    out += &format!(
        "disk: {} needed at the peak, {} free\ntime: about {:.0} s (a rough estimate from the \
         model's size: 1 GB/s of disk, {gflops} GFLOP/s on the {})\n",
        human_bytes(p.disk_needed),
        human_bytes(p.disk_free),
        p.estimate_seconds,
        if gflops == 50 { "CPU" } else { "GPU" },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A finished step whose report.json no longer fits its command's report: the summary
    /// must stop there, naming the step and the file, not carry on with empty values.
    #[test]
    fn a_report_that_does_not_deserialise_names_its_step() {
        let dir = tempfile::tempdir().unwrap();
        let folder = plan::step_dir(dir.path(), "score-ref");
        fs::create_dir_all(&folder).unwrap();
        for (corrupted, reason) in [
            (
                r#"{"models": [{"model": "ref"}], "pairs": []}"#,
                "missing field",
            ),
            (r#"{"models": 3, "pairs": []}"#, "invalid type"),
            ("{\"models\": [", "not valid JSON"),
        ] {
            fs::write(folder.join(REPORT), corrupted).unwrap();
            let err = read_step_report::<Scores>(dir.path(), "score-ref").unwrap_err();
            let message = err.to_string();
            assert!(message.starts_with("step score-ref: "), "{message}");
            assert!(
                message.contains(&folder.join(REPORT).display().to_string()),
                "{message}"
            );
            assert!(message.contains(reason), "{message}");
        }
    }
}
