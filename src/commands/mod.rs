//! One file per subcommand: its arguments and the glue between the library rooms.

pub mod ablate;
pub mod aliases;
pub mod args;
pub mod extract;
pub mod fetch;
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

use std::cell::RefCell;

use clap::Subcommand;

use crate::error::Result;

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

thread_local! {
    /// Where [`emit`] sends a command's report on this thread: stdout, or the buffer of a
    /// [`dispatch_captured`] call (a `reproduce` step keeps each command's own report).
    static CAPTURE: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Print a command's report: to stdout, or into the capture of the step that runs it.
pub fn emit(text: &str) {
    CAPTURE.with(|capture| match capture.borrow_mut().as_mut() {
        Some(buffer) => buffer.push_str(text),
        None => print!("{text}"),
    })
}

/// Run one parsed subcommand as its library call and return what it would have printed: the
/// steps of `reproduce` are the commands themselves, so their reports are the commands' own.
pub fn dispatch_captured(command: Command, progress: bool) -> Result<String> {
    let previous = CAPTURE.with(|capture| capture.replace(Some(String::new())));
    let result = dispatch(command, progress);
    let text = CAPTURE
        .with(|capture| capture.replace(previous))
        .unwrap_or_default();
    result.map(|()| text)
}

/// Run the parsed command line.
pub fn run(command: Command, globals: Globals) -> Result<()> {
    if let Some(n) = globals.threads {
        // Ignore the error of a pool already built (only possible when embedding the library).
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global();
    }
    crate::checkpoint::output::handle_signals()?;
    let progress = crate::progress::enabled(globals.quiet);
    crate::checkpoint::resolve::allow_downloads(!globals.no_download, progress);
    dispatch(command, progress)
}

fn dispatch(command: Command, progress: bool) -> Result<()> {
    match command {
        Command::Inspect(args) => inspect::run(args, progress),
        Command::Aliases(args) => aliases::run(args),
        Command::Fetch(args) => fetch::run(args),
        Command::Extract(args) => extract::run(args, progress),
        Command::Graft(args) => graft::run(args, progress),
        Command::Predict(args) => predict::run(args, progress),
        Command::Perturb(args) => perturb::run(args, progress),
        Command::Ablate(args) => ablate::run(args, progress),
        Command::InjectQknorm(args) => inject_qknorm::run(args, progress),
        Command::Score(args) => score::run(args, progress),
        Command::Heads(args) => heads::run(args, progress),
        Command::RepairHeads(args) => repair_heads::run(args, progress),
        Command::Parity(args) => parity::run(args),
        Command::Trace(args) => trace::run(args, progress),
        Command::VisualSinks(args) => visual_sinks::run(args, progress),
        Command::Norms(args) => norms::run(args, progress),
        Command::Linear(args) => methods::run_linear(args, progress),
        Command::TaskArithmetic(args) => methods::run_task_arithmetic(args, progress),
        Command::Ties(args) => methods::run_ties(args, progress),
        Command::Dare(args) => methods::run_dare(args, progress),
        Command::Tsv(args) => methods::run_tsv(args, progress),
        Command::Star(args) => methods::run_star(args, progress),
        Command::Merge(args) => merge::run(args, progress),
        Command::Reproduce(args) => reproduce::run(args, progress),
    }
}
