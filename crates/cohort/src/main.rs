//! The `cohort` command. It only wires: parse the command line, build what the
//! subcommand needs from the library crates, call it, map errors to exit codes.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "cohort",
    version,
    about = "Distributed data-parallel training on CPU"
)]
enum Cli {}

fn main() -> anyhow::Result<()> {
    match Cli::parse() {}
}
