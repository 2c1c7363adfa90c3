//! `kvroute bench index`: the index at fleet scale. A Mooncake trace becomes the KV events and
//! lookups of `workers × duplication` simulated engines (`kvroute_sim::index_bench`), replayed
//! open loop at absolute deadlines into a `Selector` (`replay`), then checked against the
//! reference index on a sample of lookups (`verify`). `bench/index/README.md` is the manual.

mod replay;
mod verify;

#[cfg(test)]
mod tests;

use clap::{Args, Subcommand};
use kvroute_core::error::PartitionKey;
use kvroute_core::selector::{Selector, SelectorConfig, WorkerSpec};
use kvroute_sim::EngineConfig;
use kvroute_sim::index_bench::{IndexBenchSpec, IndexSchedule, build_schedule};
use kvroute_sim::workload::parse_mooncake;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Subcommand, Debug, Clone)]
pub enum BenchWhat {
    /// Replay a Mooncake trace's KV events and lookups from a simulated fleet into the index,
    /// open loop, and report throughput, latency, drain and memory.
    Index(IndexBenchArgs),
}

#[derive(Args, Debug, Clone)]
pub struct IndexBenchArgs {
    /// Mooncake JSONL trace (`timestamp`, `input_length`, `output_length`, `hash_ids`).
    #[arg(long)]
    pub trace: PathBuf,
    /// Distinct simulated engines the trace's sessions are spread over.
    #[arg(long, default_value_t = 1000)]
    pub workers: usize,
    /// Copies of the fleet: worker `w + r × workers` replays engine `w`'s events.
    #[arg(short = 'd', long, default_value_t = 1)]
    pub duplication: usize,
    /// Replay window the trace is rescaled to.
    #[arg(long, default_value_t = 30.0)]
    pub window_secs: f64,
    /// Offered-rate multiplier: the schedule spans `window-secs / rate-scale`.
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Tokens per KV block of the engines and the index.
    #[arg(long, default_value_t = 128)]
    pub block_size: u32,
    /// KV blocks of each engine's pool (prefix cache with LRU eviction).
    #[arg(long, default_value_t = 16_384)]
    pub num_gpu_blocks: u64,
    /// Seed of the sessions' assignment to engines.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Keep only the first N requests of the trace.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Spread arrivals over the trace's resolution, in trace milliseconds: each request's
    /// timestamp moves later by a seeded uniform draw below this, and each worker (copies
    /// included) its whole timeline. 0 replays the timestamps as recorded (the Mooncake traces
    /// record whole seconds, so a second's requests arrive at one instant); 1000 spreads them
    /// over their second.
    #[arg(long, default_value_t = 0.0)]
    pub spread_ms: f64,
    /// Threads issuing lookups (lookups are dealt to them round robin); events have one thread,
    /// as the service's applier. The default, one, makes one thread a core on two cores.
    #[arg(long, default_value_t = 1)]
    pub lookup_threads: usize,
    /// Lookups checked against the reference index after the run (0: no check).
    #[arg(long, default_value_t = 100)]
    pub verify_sample: usize,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl IndexBenchArgs {
    fn spec(&self) -> Result<IndexBenchSpec, String> {
        if !(self.window_secs.is_finite() && self.window_secs > 0.0) {
            return Err(format!(
                "--window-secs must be a positive number, got {}",
                self.window_secs
            ));
        }
        if self.num_gpu_blocks == 0 {
            return Err("--num-gpu-blocks must be greater than 0".into());
        }
        Ok(IndexBenchSpec {
            workers: self.workers,
            duplication: self.duplication,
            window_nanos: (self.window_secs * 1e9).round() as u64,
            rate_scale: self.rate_scale,
            seed: self.seed,
            engine: EngineConfig {
                block_size: self.block_size,
                kv_blocks: Some(self.num_gpu_blocks),
                nominal_kv_blocks: self.num_gpu_blocks,
                ..EngineConfig::default()
            },
            max_requests: self.max_requests,
            spread_ms: self.spread_ms,
        })
    }
}

/// The partition every bench worker is in.
fn partition() -> PartitionKey {
    PartitionKey::new("bench", "default")
}

/// A selector with the schedule's workers registered as publishing KV events, as the service
/// registers them.
pub fn fleet_selector(total_workers: u64, block_size: u32) -> Result<Selector, String> {
    let mut selector = Selector::new(SelectorConfig::default());
    let partition = partition();
    for worker_id in 0..total_workers {
        selector
            .upsert_worker(WorkerSpec {
                worker_id,
                model_name: partition.model_name.clone(),
                routing_group: partition.routing_group.clone(),
                endpoint: Some(format!("bench://worker-{worker_id}")),
                block_size: Some(block_size),
                // Marks the worker as publishing events; the bench hands them over in process.
                kv_events_endpoint: Some("tcp://127.0.0.1:1".to_string()),
                ..WorkerSpec::default()
            })
            .map_err(|e| format!("registering worker {worker_id}: {e}"))?;
    }
    Ok(selector)
}

/// Reads the trace and builds the schedule.
pub fn schedule_from(args: &IndexBenchArgs) -> Result<IndexSchedule, String> {
    let spec = args.spec()?;
    let file = std::fs::File::open(&args.trace)
        .map_err(|e| format!("cannot open trace {}: {e}", args.trace.display()))?;
    let rows = parse_mooncake(BufReader::new(file))
        .map_err(|e| format!("{}: {e}", args.trace.display()))?;
    build_schedule(&rows, &spec).map_err(|e| e.to_string())
}

/// Peak and current resident set of this process in bytes (Linux; `None` elsewhere).
fn rss_bytes() -> (Option<u64>, Option<u64>) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return (None, None);
    };
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// CPU time (user + system) this process has used, in seconds (Linux; `None` elsewhere).
fn cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at its closing parenthesis;
    // utime and stime are the 14th and 15th fields, in clock ticks of 1/100 s on Linux.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: f64 = fields.next()?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

fn run_index(args: &IndexBenchArgs) -> Result<(), String> {
    let prep = Instant::now();
    let schedule = schedule_from(args)?;
    let selector = fleet_selector(schedule.total_workers, args.block_size)?;
    let prep_secs = prep.elapsed().as_secs_f64();
    let (_, rss_before) = rss_bytes();
    let cpu_before = cpu_secs();
    let mut report = replay::replay(&schedule, selector, &partition(), args.lookup_threads)?;
    report.cpu_secs = cpu_before.zip(cpu_secs()).map(|(a, b)| b - a);
    let (peak_rss, rss_after) = rss_bytes();
    let verify = if args.verify_sample > 0 {
        Some(verify::verify(
            &schedule,
            args.block_size,
            args.verify_sample,
        )?)
    } else {
        None
    };
    let json = report.to_json(
        &schedule,
        serde_json::json!({
            "trace": args.trace.display().to_string(),
            "workers": args.workers,
            "duplication": args.duplication,
            "total_workers": schedule.total_workers,
            "window_secs": args.window_secs,
            "rate_scale": args.rate_scale,
            "spread_ms": args.spread_ms,
            "block_size": args.block_size,
            "num_gpu_blocks": args.num_gpu_blocks,
            "seed": args.seed,
            "lookup_threads": args.lookup_threads,
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "prep_secs": prep_secs,
        }),
        serde_json::json!({
            "rss_before_replay_bytes": rss_before,
            "rss_after_replay_bytes": rss_after,
            "peak_rss_bytes": peak_rss,
        }),
        verify.as_ref(),
    );
    println!("{}", report.render(&schedule, peak_rss, verify.as_ref()));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if let Some(v) = &verify
        && v.mismatches > 0
    {
        return Err(format!(
            "{} of {} sampled lookups differ from the reference index",
            v.mismatches, v.checked
        ));
    }
    Ok(())
}

pub fn run(args: &BenchArgs) -> ExitCode {
    let result = match &args.what {
        BenchWhat::Index(a) => run_index(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
