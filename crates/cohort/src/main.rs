//! The `cohort` command. It only wires: parse the command line, build what the
//! subcommand needs from the library crates, call it, map errors to exit codes.

use std::io::{IsTerminal, Write};

use clap::Parser;

mod bench;
mod checkpoint;
mod convert;
mod debug;
mod demo;
mod device;
mod gpu;
mod nccl;
mod plot;
mod run;
mod sample;
mod serve;
mod tokenizer;
mod train;

#[derive(Parser)]
#[command(
    name = "cohort",
    version,
    about = "Distributed data-parallel training on CPU"
)]
enum Cli {
    Run(run::RunArgs),
    Train(train::TrainCmd),
    Bench(bench::BenchArgs),
    Sample(sample::SampleArgs),
    Serve(serve::ServeArgs),
    Plot(plot::PlotArgs),
    #[command(subcommand)]
    Tokenizer(tokenizer::TokenizerCmd),
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCmd),
    Convert(convert::ConvertArgs),
    #[command(subcommand)]
    Gpu(gpu::GpuCmd),
    #[command(subcommand)]
    Debug(debug::DebugCmd),
    #[command(hide = true)]
    Demo(demo::DemoArgs),
}

fn main() {
    if let Err(e) = run_command() {
        print_error(&format!("Error: {}\n", one_line(&e)));
        std::process::exit(1);
    }
}

/// Writes an error message to stderr in one write. Stderr is unbuffered, so
/// `eprintln!` and clap's styled printing issue a write per piece; under
/// `cohort run` a worker stopped between two pieces (the launcher stops the
/// others when one fails) would leave a torn line such as `error:` alone.
pub(crate) fn print_error(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// An error and its causes on one line, each cause once: a library error
/// whose message already ends with its source's is not followed by the
/// source again. No backtrace: these are the user's errors (bad input, a
/// peer gone), not the program's; a panic still prints one.
pub(crate) fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn run_command() -> anyhow::Result<()> {
    // Under `cohort run`, tell the launcher this worker is alive (not
    // stopped or frozen), from a thread that long steps do not delay.
    cohort_launcher::start_beating_from_env();
    // Backends beyond cohort-comm's own are registered here, the one place
    // that links them; the libraries only name them.
    cohort_mpi::register()?;
    // `--device cuda`: the GPU backend, which only this binary links, and NCCL for the
    // gradients of a model on a GPU (`--backend nccl`, or the default where it fits).
    device::register();
    nccl::register();
    // A command line that does not parse fails the same way every time: the
    // launcher must not restart workers for it.
    let cli = Cli::try_parse().unwrap_or_else(|e| {
        let code = e.exit_code();
        if code == 0 || std::io::stderr().is_terminal() {
            // Help and version go to stdout; a terminal gets clap's colours.
            let _ = e.print();
        } else {
            print_error(&e.render().to_string());
        }
        std::process::exit(if code == 0 {
            0
        } else {
            cohort_launcher::EXIT_NOT_RETRYABLE
        })
    });
    match cli {
        Cli::Run(args) => run::main(args),
        Cli::Train(args) => train::main(args),
        Cli::Bench(args) => bench::main(args),
        Cli::Sample(args) => sample::main(args),
        Cli::Serve(args) => serve::main(args),
        Cli::Plot(args) => plot::main(args),
        Cli::Tokenizer(cmd) => tokenizer::main(cmd),
        Cli::Checkpoint(cmd) => checkpoint::main(cmd),
        Cli::Convert(args) => convert::main(args),
        Cli::Gpu(cmd) => gpu::main(cmd),
        Cli::Debug(cmd) => debug::main(cmd),
        Cli::Demo(args) => demo::main(args),
    }
}
