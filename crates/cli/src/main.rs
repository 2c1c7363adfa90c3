//! The `kvroute` binary: `serve` (the HTTP selection service), `gateway` (the same with an
//! OpenAI-compatible front for the workers), `sim` (the fleet simulator), `hash`, and the test
//! tools `fake-engine` (a KV-event publisher, or a mock OpenAI engine) and `loadgen`.
//!
//! `SPEC §n` in this crate is section n of `docs/SPEC.md`.
#![forbid(unsafe_code)]

mod bench_cmd;
mod fake_engine_cmd;
mod gateway_cmd;
mod hash_cmd;
mod loadgen;
mod serve_cmd;
mod sim_cmd;
mod sim_pd;

use clap::{Parser, Subcommand};

// A selection allocates and frees a few buffers sized by the prompt and the fleet; mimalloc
// serves them several times faster than the system allocator (see the selector bench).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
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
    /// Run the HTTP selection service (Dynamo-compatible API) on 127.0.0.1:8000 by default.
    Serve(kvroute_service::ServeConfig),
    /// Run the selection service with an OpenAI-compatible front for vLLM/SGLang workers
    /// (/v1/completions, /v1/chat/completions) that books, tracks and frees each request.
    Gateway(gateway_cmd::GatewayCmdArgs),
    /// Drive a selection service (kvroute or Dynamo's) in a closed loop and report latency.
    Loadgen(loadgen::LoadgenArgs),
    /// Publish KV events like a vLLM engine (ZMQ PUB on 127.0.0.1:5557 by default), for demos.
    FakeEngine(fake_engine_cmd::FakeEngineArgs),
    /// Simulate a fleet: replay a trace (or a synthetic workload) under several routing policies
    /// and compare prefix hit rate, TTFT, latency and balance.
    Sim(sim_cmd::SimArgs),
    /// Benchmarks of kvroute's own parts: `bench index` replays a trace's KV events and lookups
    /// from a simulated fleet into the index, open loop (bench/index/README.md).
    Bench(bench_cmd::BenchArgs),
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Hash(args) => hash_cmd::run(&args),
        Command::Loadgen(args) => loadgen::run(args),
        Command::Serve(config) => {
            init_logging();
            serve_cmd::run(config)
        }
        Command::Gateway(args) => {
            init_logging();
            gateway_cmd::run(args)
        }
        Command::FakeEngine(args) => {
            init_logging();
            fake_engine_cmd::run(&args)
        }
        Command::Sim(args) => sim_cmd::run(&args),
        Command::Bench(args) => bench_cmd::run(&args),
    }
}
