//! One file per subcommand: its arguments and the glue between the library rooms.

pub mod ablate;
pub mod aliases;
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

use crate::cli::{Cli, Command};
use crate::error::Result;

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
pub fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        // Ignore the error of a pool already built (only possible when embedding the library).
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global();
    }
    crate::checkpoint::output::handle_signals()?;
    let progress = crate::progress::enabled(cli.quiet);
    crate::checkpoint::resolve::allow_downloads(!cli.no_download, progress);
    dispatch(cli.command, progress)
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
