//! One file per subcommand: its arguments and the glue between the library rooms.

pub mod ablate;
pub mod aliases;
pub mod args;
pub mod edit_probe;
pub mod extract;
pub mod fetch;
pub mod generate;
pub mod graft;
pub mod heads;
pub mod image_prompt;
pub mod inject_qknorm;
pub mod inspect;
pub mod manifest;
pub mod merge;
pub mod methods;
pub mod norms;
pub mod parity;
pub mod perturb;
pub mod predict;
pub mod repair_heads;
pub mod reproduce;
pub mod score;
pub mod scoring_args;
pub mod trace;
pub mod visual_sinks;

use std::io::Write;

use clap::Subcommand;

use crate::error::{Error, Result};

/// Every subcommand, parsed by `cli::Cli` and run by [`dispatch`].
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Summarize a checkpoint: architecture, family, dtypes, parameters, layers, QK-norm class
    Inspect(inspect::Args),
    /// List the paper's model aliases and whether each is in the local Hugging Face cache
    Aliases(aliases::Args),
    /// Download models into the Hugging Face cache ahead of time (what sinkmerge reads only)
    Fetch(fetch::Args),
    /// Cut the language model out of a VLM as a standalone causal LM (every supported family)
    Extract(extract::Args),
    Graft(graft::Args),
    // The controls' help texts (about and long_about) live on their Args.
    Predict(predict::Args),
    Perturb(perturb::Args),
    Ablate(ablate::Args),
    InjectQknorm(inject_qknorm::Args),
    /// Attention-sink scores: Sink Strength S, pos0 share; with --ref, B_gap and the margin
    #[command(long_about = score::LONG_ABOUT, after_help = score::AFTER_HELP)]
    Score(score::Args),
    /// Per-head diagnosis: each head's sink before and after, joined to its weight drift
    #[command(long_about = heads::LONG_ABOUT, after_help = heads::AFTER_HELP)]
    Heads(heads::Args),
    /// Head-selective repair: move chosen heads' weight slices toward the reference
    #[command(long_about = repair_heads::LONG_ABOUT, after_help = repair_heads::AFTER_HELP)]
    RepairHeads(repair_heads::Args),
    /// Check the GPU scorer against the CPU scorer: probabilities, logits, S, B_gap, margin
    #[command(long_about = parity::LONG_ABOUT)]
    Parity(parity::Args),
    /// One forward pass of a prompt with images; the activations to a safetensors file
    #[command(long_about = trace::LONG_ABOUT, after_help = trace::AFTER_HELP)]
    Trace(trace::Args),
    /// Decode a model's answer (images too) with a KV cache, exactly as transformers' generate
    #[command(long_about = generate::LONG_ABOUT, after_help = generate::AFTER_HELP)]
    Generate(generate::Args),
    /// Visual attention sinks of a VLM on images: the gate, the features, the key edit
    #[command(long_about = visual_sinks::LONG_ABOUT, after_help = visual_sinks::AFTER_HELP)]
    VisualSinks(visual_sinks::Args),
    // About and long help live with the arguments in commands/norms.rs.
    Norms(norms::Args),
    Linear(methods::LinearArgs),
    TaskArithmetic(methods::TaskArithmeticArgs),
    Ties(methods::TiesArgs),
    Dare(methods::DareArgs),
    Tsv(methods::TsvArgs),
    Star(methods::StarArgs),
    Merge(merge::Args),
    /// The paper's whole analysis of one VLM-LLM pair (or a panel of pairs), resumable, with an
    /// HTML report
    #[command(long_about = reproduce::LONG_ABOUT, after_help = reproduce::AFTER_HELP)]
    Reproduce(reproduce::Args),
}

/// The settings every command shares (`--threads`, `--quiet`, `--no-download`).
pub struct Globals {
    pub threads: Option<usize>,
    pub quiet: bool,
    pub no_download: bool,
}

/// Write `text`, part of a command's report, to `out`: every command reports through the writer
/// its `run` is handed, stdout on the command line ([`run`]) or a `reproduce` step's buffer
/// ([`run_captured`]), so a step's saved report is the command's whole output.
pub fn emit(out: &mut dyn Write, text: &str) -> Result<()> {
    out.write_all(text.as_bytes())
        .map_err(|e| Error::Write(format!("cannot write the report: {e}")))
}

/// Run one parsed subcommand as its library call and return what it would have printed: the
/// steps of `reproduce` are the commands themselves, so their reports are the commands' own.
pub fn run_captured(command: Command, progress: bool) -> Result<String> {
    let mut report = Vec::new();
    dispatch(command, progress, &mut report)?;
    String::from_utf8(report).map_err(|e| crate::internal!("a report that is not UTF-8: {e}"))
}

/// Build rayon's global pool: `threads` workers (default: rayon's, all cores or
/// RAYON_NUM_THREADS). With `this_thread` the calling thread is one of them, so the parallel
/// loops it starts run on rayon's worker path instead of being handed to the pool while it
/// sleeps on a lock: a decode step starts a few hundred loops, and the hand-off's wake-ups were
/// a large part of a 0.5B model's step on 2 cores (`docs/benchmarks.md`, "generate"). Only a
/// thread that lives as long as the process may join (the binary's main thread). A pool already
/// built is kept (only possible when embedding the library).
pub fn build_thread_pool(threads: Option<usize>, this_thread: bool) {
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads {
        pool = pool.num_threads(n.max(1));
    } else if !this_thread {
        return;
    }
    if this_thread {
        pool = pool.use_current_thread();
    }
    let _ = pool.build_global();
}

/// Run the parsed command line, its report to `out` (stdout, for the binary).
pub fn run(command: Command, globals: Globals, out: &mut dyn Write) -> Result<()> {
    build_thread_pool(globals.threads, false);
    crate::checkpoint::output::handle_signals()?;
    let progress = crate::progress::enabled(globals.quiet);
    crate::checkpoint::resolve::allow_downloads(!globals.no_download, progress);
    dispatch(command, progress, out)
}

fn dispatch(command: Command, progress: bool, out: &mut dyn Write) -> Result<()> {
    match command {
        Command::Inspect(args) => inspect::run(args, progress, out),
        Command::Generate(args) => generate::run(args, progress, out),
        Command::Aliases(args) => aliases::run(args, out),
        Command::Fetch(args) => fetch::run(args, out),
        Command::Extract(args) => extract::run(args, progress, out),
        Command::Graft(args) => graft::run(args, progress, out),
        Command::Predict(args) => predict::run(args, progress, out),
        Command::Perturb(args) => perturb::run(args, progress, out),
        Command::Ablate(args) => ablate::run(args, progress, out),
        Command::InjectQknorm(args) => inject_qknorm::run(args, progress, out),
        Command::Score(args) => score::run(args, progress, out),
        Command::Heads(args) => heads::run(args, progress, out),
        Command::RepairHeads(args) => repair_heads::run(args, progress, out),
        Command::Parity(args) => parity::run(args, out),
        Command::Trace(args) => trace::run(args, progress, out),
        Command::VisualSinks(args) => visual_sinks::run(args, progress, out),
        Command::Norms(args) => norms::run(args, progress, out),
        Command::Linear(args) => methods::run_linear(args, progress, out),
        Command::TaskArithmetic(args) => methods::run_task_arithmetic(args, progress, out),
        Command::Ties(args) => methods::run_ties(args, progress, out),
        Command::Dare(args) => methods::run_dare(args, progress, out),
        Command::Tsv(args) => methods::run_tsv(args, progress, out),
        Command::Star(args) => methods::run_star(args, progress, out),
        Command::Merge(args) => merge::run(args, progress, out),
        Command::Reproduce(args) => reproduce::run(args, progress, out),
    }
}
