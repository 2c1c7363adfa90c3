//! The `kvroute` binary: `hash` today; `serve`, `sim`, `fake-engine` as they land.
#![forbid(unsafe_code)]

mod hash_cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware worker selection for LLM fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Hash a token prompt (a JSON array on stdin) the way kvroute, Dynamo and the engines do.
    Hash(hash_cmd::HashArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Hash(args) => hash_cmd::run(&args),
    }
}
