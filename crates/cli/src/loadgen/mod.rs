//! `kvroute loadgen`: drives any server with the selection API (kvroute or Dynamo's) in a closed
//! loop at a fixed concurrency for a bounded time, and reports throughput and latency per route.
//!
//! Per request, in `cycle` mode: `POST /select` (with a `selection_id` and token ids) →
//! `POST /reservations` (replay) → `POST /reservations/{id}/prefill_complete` →
//! `DELETE /reservations/{id}`; in `reserve` mode `POST /select_and_reserve` → `DELETE
//! /reservations/{id}`; in `select` mode only the select. Prompts come from a Mooncake
//! trace (hash ids expanded into token ids, 512 tokens per id) or a synthetic shared-prefix set.
//!
//! - [`args`]: the flags.
//! - [`prompts`]: the prompts, and what is computed from them before the run.
//! - [`mod@run`]: registration, the fake engines ([`kvroute_testkit::fleet`]) and the closed loop.
//! - [`report`]: the samples, the JSON report and the table.

mod args;
mod prompts;
mod report;
mod run;

pub use args::LoadgenArgs;

use kvroute_service::courtesy;
use kvroute_service::ingest::{idle_current_thread, lower_current_thread_priority};
use std::process::ExitCode;

pub fn run(args: LoadgenArgs) -> ExitCode {
    // The clients share one thread: a closed loop of keep-alive connections needs no work
    // stealing, and on a machine shared with the server every wakeup of a second client thread
    // is CPU taken from the server being measured.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute loadgen: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let nice = args.engine_nice.min(19);
    let idle = args.engine_idle;
    let engines_rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("fake-engines")
        .enable_all()
        .on_thread_unpark(courtesy::woke)
        .on_thread_start(move || {
            // Best effort: failing that, the engines publish at normal priority.
            if !idle || idle_current_thread().is_err() {
                let _ = lower_current_thread_priority(nice);
            }
        })
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute loadgen: cannot start the engines' runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(run::run(&args, engines_rt.handle().clone()));
    engines_rt.shutdown_background();
    match outcome {
        Ok(outcome) => {
            let report = report::report(&args, outcome);
            report::print_table(&report);
            if let Some(path) = &args.out {
                let text = serde_json::to_string_pretty(&report).unwrap_or_default();
                if let Err(e) = std::fs::write(path, text) {
                    eprintln!("kvroute loadgen: cannot write {path:?}: {e}");
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("kvroute loadgen: {message}");
            ExitCode::from(2)
        }
    }
}
