//! The Slurm executor: each step not done becomes an `sbatch` job running
//! `sinkmerge reproduce ... --step NAME`, its edges `--dependency=afterok:...`, then one job
//! writes the pair's report (docs/commands/reproduce.md, "Slurm").
//!
//! A step's job id is kept beside its manifest (`slurm.json`, with the step's key). A rerun never
//! resubmits a step that is done, nor one whose job is still queued or running; a job that was
//! cancelled, failed, or waits on a dependency that can never be met is submitted again.

use std::fs;
use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::pipeline::{self, command_line, Prepared, SLURM_JOB, SLURM_REPORT_JOB};
use super::plan::{self, Role};
use crate::checkpoint::output::write_file_atomic;
use crate::error::Result;
use crate::{bad, bail};

/// How the jobs are submitted.
#[derive(Debug, Clone, Default)]
pub struct Slurm {
    /// Passed to every `sbatch` (partition, account, time limit, ...).
    pub args: Vec<String>,
    /// Scoring steps run on a GPU: they ask for `--gres=gpu:1`.
    pub gpu: bool,
}

/// A submitted job and the key of the step it runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Submitted {
    pub job: String,
    pub key: String,
}

/// A job as the controller reports it (`squeue --states=all`), while it remembers the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobState {
    /// `PENDING`, `RUNNING`, `COMPLETED`, `CANCELLED`, ...
    pub state: String,
    /// Why it pends: `Dependency`, `Priority`, `DependencyNeverSatisfied`, ...
    pub reason: String,
    /// The jobs it waits on, each with Slurm's note (`unfulfilled`, `failed`).
    pub after: Vec<(String, String)>,
}

/// The controller's view of `job`, or `None` once it has forgotten it (Slurm's MinJobAge).
pub fn job_state(job: &str) -> Option<JobState> {
    let out = Command::new("squeue")
        .args(["-h", "--states=all", "-j", job, "-o", "%T|%r|%E"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut fields = text.lines().next()?.trim().splitn(3, '|');
    let (state, reason) = (fields.next()?.to_string(), fields.next()?.to_string());
    // `afterok:69(unfulfilled),afterok:70(failed)`; `(null)` when there is none.
    let after = (fields.next().unwrap_or("").split(','))
        .filter_map(|d| {
            let (_, rest) = d.split_once(':')?;
            let (id, note) = rest.split_once('(').unwrap_or((rest, ""));
            let id: String = id.chars().take_while(char::is_ascii_digit).collect();
            (!id.is_empty()).then(|| (id, note.trim_end_matches(')').to_string()))
        })
        .collect();
    Some(JobState {
        state,
        reason,
        after,
    })
}

/// A pending job that can never start: Slurm says so, or a job it waits on failed or can
/// never start itself (Slurm marks only the first link of such a chain).
pub fn waits_forever(state: &JobState) -> bool {
    fn stuck(state: &JobState, depth: usize) -> bool {
        state.state == "PENDING"
            && (state.reason == "DependencyNeverSatisfied"
                || state.after.iter().any(|(job, note)| {
                    note == "failed"
                        || (depth < 32 && job_state(job).is_some_and(|s| stuck(&s, depth + 1)))
                }))
    }
    stuck(state, 0)
}

/// A job that will still run (or is running) without help.
pub fn alive(state: &JobState) -> bool {
    match state.state.as_str() {
        "PENDING" => !waits_forever(state),
        "RUNNING" | "CONFIGURING" | "COMPLETING" | "SUSPENDED" | "REQUEUED" | "RESIZING" => true,
        _ => false,
    }
}

/// Read a job record.
pub fn read_job(path: &Path) -> Option<Submitted> {
    serde_json::from_slice(&fs::read(path).ok()?).ok()
}

/// `sbatch` one job; returns its id.
fn sbatch(
    slurm: &Slurm,
    name: &str,
    log: &Path,
    after: &[String],
    gpu: bool,
    command: &[String],
) -> Result<String> {
    let cwd = std::env::current_dir().map_err(|e| bad!("the working directory: {e}"))?;
    let mut cmd = Command::new("sbatch");
    cmd.arg("--parsable")
        .arg(format!("--job-name={name}"))
        .arg(format!("--chdir={}", cwd.display()))
        .arg(format!("--output={}", log.display()));
    if !after.is_empty() {
        cmd.arg(format!("--dependency=afterok:{}", after.join(":")));
    }
    if gpu {
        cmd.arg("--gres=gpu:1");
    }
    cmd.args(&slurm.args);
    cmd.arg(format!("--wrap={}", command_line(command)));
    let out = cmd.output().map_err(|e| {
        bad!("--executor slurm: cannot run sbatch ({e}); is Slurm installed and on PATH?")
    })?;
    if !out.status.success() {
        bail!(
            "sbatch refused the job {name}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let job = text.trim().split(';').next().unwrap_or("").to_string();
    if job.is_empty() || !job.chars().all(|c| c.is_ascii_digit()) {
        bail!("sbatch answered `{}` instead of a job id", text.trim());
    }
    Ok(job)
}

/// Cancel a job that waits forever (its dependency failed or was cancelled).
fn scancel(job: &str) {
    // A job that already left the queue needs no cancelling; nothing else can go wrong here.
    let _ = Command::new("scancel").arg(job).status();
}

/// Submit the steps of one pair that are not done, and its report job. `reinvoke` is the
/// `reproduce` command line (after the program) that plans this pair; each job appends
/// `--step NAME`.
pub fn submit(prepared: &mut Prepared, reinvoke: &[String], slurm: &Slurm) -> Result<Submission> {
    pipeline::begin(prepared)?;
    let dir = prepared.options.dir.clone();
    let exe = std::env::current_exe().map_err(|e| bad!("the sinkmerge binary's path: {e}"))?;
    let command = |step: &str| -> Vec<String> {
        let mut argv = vec![exe.to_string_lossy().into_owned()];
        argv.extend(reinvoke.iter().cloned());
        argv.extend(["--step".into(), step.into()]);
        argv
    };
    let label = dir
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let done = pipeline::done_steps(prepared);
    // (step, job) of every step not done; `fresh`: submitted now, so what reads it is too.
    let mut jobs: Vec<(String, String)> = Vec::new();
    let mut fresh: Vec<String> = Vec::new();
    for step in &prepared.steps {
        if done.contains(&step.name) {
            continue;
        }
        let folder = plan::step_dir(&dir, &step.name);
        fs::create_dir_all(&folder).map_err(|e| crate::error::Error::write(&folder, e))?;
        let record = folder.join(SLURM_JOB);
        let key = prepared.keys[&step.name].clone();
        let upstream_fresh = step.after.iter().any(|a| fresh.contains(a));
        if let Some(previous) = read_job(&record) {
            match job_state(&previous.job) {
                Some(state) if alive(&state) && previous.key == key && !upstream_fresh => {
                    jobs.push((step.name.clone(), previous.job));
                    continue;
                }
                // Waiting on a job that is gone or replaced: it would wait forever.
                Some(state) if state.state == "PENDING" => scancel(&previous.job),
                _ => {}
            }
        }
        let after: Vec<String> = (jobs.iter())
            .filter(|(name, _)| step.after.contains(name))
            .map(|(_, job)| job.clone())
            .collect();
        let gpu = slurm.gpu && matches!(step.role, Role::Score | Role::Heads | Role::Answers);
        let job = sbatch(
            slurm,
            &format!("sinkmerge:{label}:{}", step.name),
            &folder.join("slurm-%j.log"),
            &after,
            gpu,
            &command(&step.name),
        )?;
        write_job(&record, &job, &key)?;
        jobs.push((step.name.clone(), job));
        fresh.push(step.name.clone());
    }
    let report_record = dir.join(SLURM_REPORT_JOB);
    let previous = read_job(&report_record);
    let previous_alive = (previous.as_ref())
        .and_then(|p| job_state(&p.job))
        .is_some_and(|s| alive(&s));
    let report = if fresh.is_empty() && (previous_alive || jobs.is_empty()) {
        // Nothing new: the report job still queued stands, or the report is current.
        match previous {
            Some(p) if previous_alive => Some(p.job),
            _ if dir.join("report.html").is_file() => None,
            _ => Some(submit_report(slurm, &label, &dir, &[], &command("report"))?),
        }
    } else {
        // The report job queued before waits on jobs replaced now: it would wait forever.
        if let Some(p) = previous {
            if job_state(&p.job).is_some_and(|s| s.state == "PENDING") {
                scancel(&p.job);
            }
        }
        let after: Vec<String> = jobs.iter().map(|(_, job)| job.clone()).collect();
        Some(submit_report(
            slurm,
            &label,
            &dir,
            &after,
            &command("report"),
        )?)
    };
    Ok(Submission {
        report,
        submitted: fresh.len(),
    })
}

/// What [`submit`] did: the report job (if one is to run) and how many step jobs it submitted.
pub struct Submission {
    pub report: Option<String>,
    pub submitted: usize,
}

fn submit_report(
    slurm: &Slurm,
    label: &str,
    dir: &Path,
    after: &[String],
    command: &[String],
) -> Result<String> {
    let job = sbatch(
        slurm,
        &format!("sinkmerge:{label}:report"),
        &dir.join("slurm-report-%j.log"),
        after,
        false,
        command,
    )?;
    write_job(&dir.join(SLURM_REPORT_JOB), &job, "")?;
    Ok(job)
}

fn write_job(record: &Path, job: &str, key: &str) -> Result<()> {
    let text = crate::report::json_text(&Submitted {
        job: job.to_string(),
        key: key.to_string(),
    })?;
    write_file_atomic(record, text.as_bytes())
}

/// Submit a job that runs after `after` (the pairs' report jobs): the panel's report.
pub fn submit_panel_report(
    dir: &Path,
    reinvoke: &[String],
    slurm: &Slurm,
    after: &[String],
) -> Result<String> {
    let exe = std::env::current_exe().map_err(|e| bad!("the sinkmerge binary's path: {e}"))?;
    let mut argv = vec![exe.to_string_lossy().into_owned()];
    argv.extend(reinvoke.iter().cloned());
    argv.extend(["--step".into(), "panel-report".into()]);
    fs::create_dir_all(dir).map_err(|e| crate::error::Error::write(dir, e))?;
    if let Some(previous) = read_job(&dir.join(SLURM_REPORT_JOB)) {
        if job_state(&previous.job).is_some_and(|s| s.state == "PENDING") {
            scancel(&previous.job);
        }
    }
    let job = sbatch(
        slurm,
        "sinkmerge:panel:report",
        &dir.join("slurm-panel-report-%j.log"),
        after,
        false,
        &argv,
    )?;
    write_job(&dir.join(SLURM_REPORT_JOB), &job, "")?;
    Ok(job)
}

/// The newest Slurm log of a step, if any.
pub fn log_of(folder: &Path, job: &str) -> Option<std::path::PathBuf> {
    let log = folder.join(format!("slurm-{job}.log"));
    log.is_file().then_some(log)
}
