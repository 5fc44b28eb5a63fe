use clap::Parser;

use sinkmerge::checkpoint::output::{exit, interrupted_message};
use sinkmerge::error::{panic_message, Kind, EXIT_FAILURE};

fn main() {
    let cli = sinkmerge::cli::Cli::parse();
    let globals = cli.globals();
    sinkmerge::commands::build_thread_pool(globals.threads, true);
    // The last line of defence: a panic is a bug, never the answer to an input. It still gets
    // one line and the internal-error exit code, not Rust's exit 101 and a backtrace prompt.
    std::panic::set_hook(Box::new(|info| {
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let message = panic_message(info.payload()).unwrap_or_else(|| "unknown panic".into());
        eprintln!("sinkmerge: internal error: {message}{location}; please report this as a bug");
    }));
    match std::panic::catch_unwind(|| {
        // The one place stdout is taken: every command reports through the writer it is handed.
        #[allow(clippy::disallowed_methods)]
        let mut stdout = std::io::stdout();
        sinkmerge::commands::run(cli.command, globals, &mut stdout)
    }) {
        Ok(Ok(())) => exit(0, None),
        Ok(Err(err)) => {
            let message = match err.kind() {
                Kind::Interrupted(signal) => interrupted_message(signal),
                _ => format!("sinkmerge: error: {err}"),
            };
            exit(err.exit_code(), Some(&message))
        }
        // The hook has said what happened.
        Err(_) => exit(EXIT_FAILURE, None),
    }
}
