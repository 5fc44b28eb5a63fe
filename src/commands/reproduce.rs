//! `sinkmerge reproduce`: the paper's whole analysis of one VLM-LLM pair, as a resumable
//! pipeline of the other commands, with `summary.json` and a self-contained `report.html`.

use std::io::Write;
use std::path::PathBuf;

use clap::Parser;

use crate::bail;
use crate::error::Result;
use crate::forward::device::ComputeDevice;
use crate::reproduce::lock::{self, Mode};
use crate::reproduce::pipeline::StepRunner;
use crate::reproduce::plan::setting_names;
use crate::reproduce::slurm::Slurm;
use crate::reproduce::{self, pipeline};

/// `sinkmerge reproduce --help`: what the command runs.
pub const LONG_ABOUT: &str = "The paper's whole analysis of one VLM and the LLM it came from \
(arXiv 2609.00746), each step an existing sinkmerge command, with summary.json and a \
self-contained report.html.\n\n\
Steps, in the order they run: inspect of both models; extract of the VLM's language model \
(VLM-LM); norms of REF -> VLM-LM (per-layer drift, stable ranks, the norm-scale drift); score of \
REF and of VLM-LM against REF (S, the margin, pos0_trailing with its CI, the thirds, perplexity on \
--text); heads of REF -> VLM-LM; predict (where REF's S places the pair on the paper's panel); then \
each of the paper's merge settings (merge-configs/) followed by its score. With --answers, each model (REF, VLM-LM, each merge) also answers three fixed prompts greedily (generate --batch), side by side in the report. TIES and DARE need \
--base (task vectors from the pretrained base); without it they are skipped and the report says \
so.\n\n\
Each step writes under DIR/steps/NAME/: the command's own --json report (report.json) and, last, a \
manifest (the command line, the sinkmerge version, the inputs' Hub commits or content hashes, the \
keys of the steps it read). A rerun reuses every step whose manifest matches, redoes the ones whose \
inputs changed and everything downstream of them, and resumes a killed run at its first unfinished \
step. Merged models are deleted once scored unless --keep-models.\n\n\
Every check that needs no step comes first, with exit 2: the models open, the VLM's language model \
has REF's architecture (and BASE's), DIR is not inside an input, and DIR's filesystem holds the \
plan.";

/// `sinkmerge reproduce --help`: examples.
pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge reproduce --ref assets/models/tiny-qwen3/ref --vlm assets/models/tiny-qwen3/vlm -o repro\n  \
sinkmerge reproduce --ref qwen3-vl:ref --vlm qwen3-vl --base Qwen/Qwen3-8B-Base -o qwen3-vl-repro --device cuda\n  \
sinkmerge reproduce --ref REF --vlm VLM -o DIR --merges average,tsv --skip heads --dry-run";

/// The steps' runner: each step's command line parsed as the binary parses its own, and run
/// with its report captured.
struct Steps;

/// A step's command line: the subcommand and its flags (steps never set the global flags).
#[derive(clap::Parser)]
#[command(name = "sinkmerge")]
struct StepLine {
    #[command(subcommand)]
    command: super::Command,
}

impl StepRunner for Steps {
    fn run(&self, argv: &[String], progress: bool) -> Result<String> {
        let program = std::iter::once("sinkmerge".to_string());
        let line = StepLine::try_parse_from(program.chain(argv.iter().cloned()))
            .map_err(|e| crate::internal!("its command line does not parse: {e}"))?;
        super::run_captured(line.command, progress)
    }
}

/// Where the steps run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Executor {
    /// Here, one step at a time in dependency order, each on every thread of --threads
    Local,
    /// As Slurm jobs, one per step, submitted with sbatch (then watch with --status)
    Slurm,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The reference LLM the VLM was adapted from: a directory, an HF repo id or an alias
    #[arg(long = "ref", value_name = "REF", required_unless_present_any = ["panel", "status"],
          conflicts_with = "panel")]
    pub reference: Option<String>,

    /// The VLM
    #[arg(long, value_name = "VLM", required_unless_present_any = ["panel", "status"],
          conflicts_with = "panel")]
    pub vlm: Option<String>,

    /// The pretrained base both descend from: the task-vector settings (task arithmetic, TSV,
    /// STAR, TIES, DARE) take their task vectors from it, as in the paper; without it TIES and
    /// DARE are skipped and the others use REF as the base
    #[arg(long, value_name = "BASE", conflicts_with = "panel")]
    pub base: Option<String>,

    /// Many pairs: a CSV with the columns name, ref, vlm and optionally base and delta (the
    /// observed task change, for the predictor's fit); each pair runs into DIR/NAME/, and DIR
    /// gets the panel's report
    #[arg(long, value_name = "PAIRS.csv")]
    pub panel: Option<PathBuf>,

    /// The run's directory: steps/, models/, summary.json, report.html
    #[arg(
        short = 'o',
        long = "output",
        value_name = "DIR",
        required_unless_present = "status"
    )]
    pub output: Option<PathBuf>,

    /// Show every step of the run in DIR (done, queued, running, failed, skipped, not run) with
    /// its Slurm job and log, and run nothing
    #[arg(long, value_name = "DIR", conflicts_with_all = ["reference", "vlm", "panel", "output"])]
    pub status: Option<PathBuf>,

    /// Where the steps run
    #[arg(long, value_enum, default_value_t = Executor::Local)]
    pub executor: Executor,

    /// Arguments for every sbatch of --executor slurm, e.g. "--partition=gpu --account=lab"
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    pub slurm_args: Option<String>,

    /// Where the scoring steps compute: `cpu`, `cuda` or `cuda:N` (with --executor slurm, their
    /// jobs ask for --gres=gpu:1)
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: String,

    /// The merge settings to run, comma-separated [default: all seven], or `none`
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub merges: Option<Vec<String>>,

    /// Do not run this step (or `merges`, every merge), nor the steps that need it; repeatable
    #[arg(long, value_name = "STEP")]
    pub skip: Vec<String>,

    /// Redo this step (or `merges`) even if its manifest matches; repeatable
    #[arg(long, value_name = "STEP")]
    pub force: Vec<String>,

    /// Print the plan (steps, commands, disk space, a time estimate) and run nothing
    #[arg(long)]
    pub dry_run: bool,

    /// Keep the merged models under DIR/models/ instead of deleting each once it is scored
    #[arg(long)]
    pub keep_models: bool,

    /// Also ask each model (REF, the VLM-LM and each merge) for its greedy answers to three
    /// fixed prompts (assets/prompts/answers.jsonl, 64 tokens each): one `generate --batch` step
    /// per model, side by side in the report; refused when a model does not fit in memory
    #[arg(long)]
    pub answers: bool,

    /// The text of the perplexity column [default: the bundled sample, assets/text/sample.txt]
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,

    /// Print summary.json instead of the text summary (with --dry-run: the plan; with
    /// --status: the states)
    #[arg(long)]
    pub json: bool,

    /// Run one step of the plan (or `report`, `panel-report`): what each Slurm job runs
    #[arg(long, value_name = "STEP", hide = true)]
    pub step: Option<String>,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    if let Some(dir) = &args.status {
        let status = reproduce::status::collect(dir)?;
        super::emit(
            out,
            &if args.json {
                crate::report::json_text(&status)?
            } else {
                reproduce::status::text(&status)
            },
        )?;
        return Ok(());
    }
    args.device
        .parse::<ComputeDevice>()
        .map_err(|e| crate::bad!("--device {}: {e}", args.device))?;
    let merges = merges(args.merges.as_deref())?;
    let dir = args
        .output
        .clone()
        .expect("clap requires -o without --status");
    let slurm = Slurm {
        args: split_words(args.slurm_args.as_deref().unwrap_or(""))?,
        gpu: args.device.starts_with("cuda"),
    };
    let options =
        |reference: &str, vlm: &str, base: Option<&str>, dir: PathBuf| pipeline::Options {
            reference: reference.into(),
            vlm: vlm.into(),
            base: base.map(str::to_string),
            dir,
            text: args.text.clone(),
            device: args.device.clone(),
            merges: merges.clone(),
            skip: args.skip.clone(),
            force: args.force.clone(),
            keep_models: args.keep_models,
            progress: progress && !args.json,
            answers: args.answers,
        };

    let Some(panel_csv) = &args.panel else {
        let reference = args.reference.as_deref().expect("clap requires --ref");
        let vlm = args.vlm.as_deref().expect("clap requires --vlm");
        let mut prepared =
            pipeline::prepare(options(reference, vlm, args.base.as_deref(), dir.clone()))?;
        if args.dry_run {
            return super::emit(out, &dry_run(&[("", &prepared)], false, args.json)?);
        }
        // Held until the run returns (docs/commands/reproduce.md, "Concurrent runs").
        let _lock = lock::acquire(&dir, lock_mode(&args))?;
        return match (&args.step, args.executor) {
            (Some(step), _) if step == "report" => reproduce::report(&mut prepared).map(|_| ()),
            (Some(step), _) => pipeline::execute_one(&mut prepared, step, &Steps),
            (None, Executor::Local) => {
                let summary = reproduce::run(&mut prepared, &Steps)?;
                super::emit(out, &finished(&summary, &dir, args.json)?)
            }
            (None, Executor::Slurm) => {
                let reinvoke = pair_argv(&args, reference, vlm, args.base.as_deref(), &dir);
                let s = reproduce::slurm::submit(&mut prepared, &reinvoke, &slurm)?;
                let report = s.report.into_iter().collect();
                super::emit(out, &submitted(&dir, s.submitted, report, args.json)?)
            }
        };
    };

    // A panel: every pair is checked before any step of any pair runs.
    let pairs = reproduce::panel::load(panel_csv)?;
    reproduce::check_panel_dir(&dir, &pairs)?;
    match args.step.as_deref() {
        Some("panel-report") => {
            let _lock = lock::acquire(&dir, lock_mode(&args))?;
            return reproduce::panel_report(&pairs, &dir).map(|_| ());
        }
        Some(step) => bail!("--step {step} with --panel: a panel runs only `panel-report`"),
        None => {}
    }
    let mut prepared: Vec<(String, pipeline::Prepared)> = Vec::new();
    for pair in &pairs {
        let p = pipeline::prepare(options(
            &pair.reference,
            &pair.vlm,
            pair.base.as_deref(),
            dir.join(&pair.name),
        ))
        .map_err(|e| e.context(format!("{}: pair {}", panel_csv.display(), pair.name)))?;
        prepared.push((pair.name.clone(), p));
    }
    if args.dry_run {
        let views: Vec<(&str, &pipeline::Prepared)> =
            prepared.iter().map(|(n, p)| (n.as_str(), p)).collect();
        return super::emit(out, &dry_run(&views, true, args.json)?);
    }
    // The panel's folder, then each pair's while it runs or is submitted.
    let _lock = lock::acquire(&dir, lock_mode(&args))?;
    reproduce::write_panel(&dir, &pairs)?;
    match args.executor {
        Executor::Local => {
            for (_, p) in &mut prepared {
                let _pair = lock::acquire(&p.options.dir, Mode::Exclusive)?;
                reproduce::run(p, &Steps)?;
            }
            let summary = reproduce::panel_report(&pairs, &dir)?;
            super::emit(
                out,
                &if args.json {
                    crate::report::json_text(&summary)?
                } else {
                    reproduce::panel::text(&summary, &dir)
                },
            )?;
            Ok(())
        }
        Executor::Slurm => {
            let (mut jobs, mut count) = (Vec::new(), 0);
            for (pair, (_, p)) in pairs.iter().zip(&mut prepared) {
                let reinvoke = pair_argv(
                    &args,
                    &pair.reference,
                    &pair.vlm,
                    pair.base.as_deref(),
                    &dir.join(&pair.name),
                );
                let _pair = lock::acquire(&p.options.dir, Mode::Shared)?;
                let s = reproduce::slurm::submit(p, &reinvoke, &slurm)?;
                count += s.submitted;
                jobs.extend(s.report);
            }
            if count == 0 && jobs.is_empty() && dir.join("report.html").is_file() {
                return super::emit(out, &submitted(&dir, 0, jobs, args.json)?);
            }
            let mut reinvoke: Vec<String> = vec!["reproduce".into(), "--panel".into()];
            reinvoke.push(panel_csv.to_string_lossy().into_owned());
            reinvoke.extend(["-o".into(), dir.to_string_lossy().into_owned()]);
            reinvoke.extend(common_argv(&args));
            let panel_job = reproduce::slurm::submit_panel_report(&dir, &reinvoke, &slurm, &jobs)?;
            jobs.push(panel_job);
            super::emit(out, &submitted(&dir, count, jobs, args.json)?)
        }
    }
}

/// How a run shares its DIR: the local executor alone; the Slurm executor's submission and its
/// jobs (`--step`) with each other, so that a submission can run while jobs run.
fn lock_mode(args: &Args) -> Mode {
    if args.step.is_none() && args.executor == Executor::Local {
        Mode::Exclusive
    } else {
        Mode::Shared
    }
}

/// The `reproduce` command line of one pair, as each of its Slurm jobs reruns it.
fn pair_argv(
    args: &Args,
    reference: &str,
    vlm: &str,
    base: Option<&str>,
    dir: &std::path::Path,
) -> Vec<String> {
    let mut argv: Vec<String> = vec![
        "reproduce".into(),
        "--ref".into(),
        reference.into(),
        "--vlm".into(),
        vlm.into(),
    ];
    if let Some(b) = base {
        argv.extend(["--base".into(), b.into()]);
    }
    argv.extend(["-o".into(), dir.to_string_lossy().into_owned()]);
    argv.extend(common_argv(args));
    argv
}

/// The options every pair's jobs share (never --force: a job runs its step regardless).
fn common_argv(args: &Args) -> Vec<String> {
    let mut argv: Vec<String> = vec!["--device".into(), args.device.clone()];
    if let Some(m) = &args.merges {
        argv.extend(["--merges".into(), m.join(",")]);
    }
    for s in &args.skip {
        argv.extend(["--skip".into(), s.clone()]);
    }
    if let Some(t) = &args.text {
        argv.extend(["--text".into(), t.to_string_lossy().into_owned()]);
    }
    if args.keep_models {
        argv.push("--keep-models".into());
    }
    if args.answers {
        argv.push("--answers".into());
    }
    argv
}

/// What `--dry-run` prints: each pair's plan.
fn dry_run(plans: &[(&str, &pipeline::Prepared)], panel: bool, json: bool) -> Result<String> {
    Ok(if json {
        let value: Vec<serde_json::Value> = (plans.iter())
            .map(|(name, p)| {
                let mut v = pipeline::plan_json(p);
                v["pair"] = serde_json::json!(name);
                v
            })
            .collect();
        crate::report::json_text(&match (panel, value.as_slice()) {
            (false, [one]) => one.clone(),
            _ => serde_json::json!({ "pairs": value }),
        })?
    } else {
        (plans.iter())
            .map(|(name, p)| {
                let head = if name.is_empty() {
                    String::new()
                } else {
                    format!("pair {name}\n")
                };
                head + &pipeline::plan_text(p)
            })
            .collect::<Vec<_>>()
            .join("\n")
    })
}

/// What a finished local run prints: its summary.
fn finished(summary: &serde_json::Value, dir: &std::path::Path, json: bool) -> Result<String> {
    Ok(if json {
        crate::report::json_text(summary)?
    } else {
        reproduce::summary::text(summary, dir)
    })
}

/// What the Slurm executor prints: how many step jobs it submitted and the report jobs.
fn submitted(
    dir: &std::path::Path,
    steps: usize,
    reports: Vec<String>,
    json: bool,
) -> Result<String> {
    Ok(if json {
        crate::report::json_text(
            &serde_json::json!({ "step_jobs": steps, "report_jobs": reports }),
        )?
    } else if reports.is_empty() {
        format!(
            "every step is done; report: {}\n",
            dir.join("report.html").display()
        )
    } else {
        format!(
            "submitted {steps} step job(s); report job(s) {}; follow them with: sinkmerge \
             reproduce --status {}\n",
            reports.join(", "),
            dir.display()
        )
    })
}

/// `--slurm-args`: words split as a shell splits them, with single and double quotes.
fn split_words(text: &str) -> Result<Vec<String>> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    for c in text.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_default().push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                word.get_or_insert_default();
            }
            (None, c) if c.is_whitespace() => words.extend(word.take()),
            (None, c) => word.get_or_insert_default().push(c),
        }
    }
    if quote.is_some() {
        bail!("--slurm-args: unterminated quote in `{text}`");
    }
    words.extend(word);
    Ok(words)
}
/// `--merges`: setting names, checked, in the paper's order.
fn merges(list: Option<&[String]>) -> Result<Vec<&'static str>> {
    let all = setting_names();
    let Some(list) = list else {
        return Ok(all);
    };
    if list.len() == 1 && list[0] == "none" {
        return Ok(vec![]);
    }
    for name in list {
        if !all.contains(&name.as_str()) {
            bail!(
                "--merges: unknown setting `{name}`; the settings: {}, or none",
                all.join(", ")
            );
        }
    }
    Ok(all
        .into_iter()
        .filter(|s| list.iter().any(|l| l == s))
        .collect())
}
