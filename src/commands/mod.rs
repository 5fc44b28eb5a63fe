//! One file per subcommand: its arguments and the glue between the library rooms.

pub mod aliases;
pub mod inspect;
pub mod norms;

use crate::cli::{Cli, Command};
use crate::error::Result;

/// Run the parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        // Ignore the error of a pool already built (only possible when embedding the library).
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global();
    }
    crate::checkpoint::output::remove_partial_outputs_on_interrupt();
    let progress = crate::progress::enabled(cli.quiet);
    match cli.command {
        Command::Inspect(args) => inspect::run(args, progress),
        Command::Aliases(args) => aliases::run(args),
        Command::Norms(args) => norms::run(args, progress),
    }
}
