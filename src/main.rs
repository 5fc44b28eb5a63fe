use clap::Parser;

fn main() {
    let cli = sinkmerge::cli::Cli::parse();
    if let Err(err) = sinkmerge::commands::run(cli) {
        eprintln!("sinkmerge: error: {err}");
        std::process::exit(err.exit_code());
    }
}
