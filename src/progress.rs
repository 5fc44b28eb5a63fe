//! Progress bars that appear only for a person watching a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Whether progress should be drawn: stdout and stderr are both terminals and `--quiet`/`--json`
/// were not given. Pipes, files and CI logs stay clean.
// Asks whether stdout is a terminal; it writes nothing there (clippy.toml).
#[allow(clippy::disallowed_methods)]
pub fn enabled(quiet: bool) -> bool {
    !quiet && std::io::stdout().is_terminal() && std::io::stderr().is_terminal()
}

/// A bar over `total` bytes.
pub fn bytes(total: u64, message: &str, show: bool) -> ProgressBar {
    make(
        total,
        message,
        show,
        "{msg:>10} [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
}

/// A bar over `total` items (tensors, layers, prompts).
pub fn items(total: u64, message: &str, show: bool) -> ProgressBar {
    make(
        total,
        message,
        show,
        "{msg:>10} [{bar:40}] {pos}/{len} eta {eta}",
    )
}

fn make(total: u64, message: &str, show: bool, template: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(template)
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}
