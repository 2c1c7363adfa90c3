//! What a run measured: each connection's [`Samples`], merged, then summarised as the JSON
//! report (`--out`) and the table printed at the end.

use super::args::LoadgenArgs;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

/// What one connection (or, merged, the whole run) measured.
#[derive(Default)]
pub struct Samples {
    /// Latencies in microseconds per route.
    pub routes: BTreeMap<&'static str, Vec<u32>>,
    /// Latencies of whole cycles (every request of one prompt), in microseconds.
    pub cycles: Vec<u32>,
    pub statuses: BTreeMap<u16, u64>,
    pub transport_errors: u64,
    /// Bookings whose engine backlog was full, and the time they waited for room in it.
    pub backlog_waits: u64,
    pub backlog_wait_us: u64,
}

/// A latency in whole microseconds, saturated at `u32::MAX` (71 minutes).
pub fn micros(elapsed: Duration) -> u32 {
    elapsed.as_micros().min(u32::MAX as u128) as u32
}

impl Samples {
    /// A reply to `route` after `elapsed`, with its status.
    pub fn reply(&mut self, route: &'static str, elapsed: Duration, status: u16) {
        self.routes.entry(route).or_default().push(micros(elapsed));
        *self.statuses.entry(status).or_default() += 1;
    }

    pub fn merge(&mut self, other: Samples) {
        for (route, mut v) in other.routes {
            self.routes.entry(route).or_default().append(&mut v);
        }
        self.cycles.extend(other.cycles);
        for (s, n) in other.statuses {
            *self.statuses.entry(s).or_default() += n;
        }
        self.transport_errors += other.transport_errors;
        self.backlog_waits += other.backlog_waits;
        self.backlog_wait_us += other.backlog_wait_us;
    }
}

/// What the run loop hands the report besides the samples.
pub struct Outcome {
    pub samples: Samples,
    /// Length of the measured loop.
    pub secs: f64,
    pub prompts: usize,
    pub mean_prompt_tokens: usize,
    /// The load generator's own user and system CPU seconds over the loop, where known.
    pub cpu: Option<(f64, f64)>,
    /// Prompts the event storm published, in all.
    pub storm_prompts: usize,
}

/// This process's user and system CPU seconds so far (all threads), from `/proc/self/stat`; `None`
/// where there is no such file. The kernel reports them in `USER_HZ` ticks, 100 a second on Linux.
pub fn process_cpu_s() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (in parentheses, which may contain spaces): utime and stime
    // are the 12th and 13th of them.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some((ticks(11)? / 100.0, ticks(12)? / 100.0))
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(v: &mut [u32], secs: f64) -> serde_json::Value {
    v.sort_unstable();
    json!({
        "count": v.len(),
        "rps": v.len() as f64 / secs,
        "p50_us": percentile(v, 0.5),
        "p90_us": percentile(v, 0.9),
        "p99_us": percentile(v, 0.99),
    })
}

/// The JSON report of a run.
pub fn report(args: &LoadgenArgs, outcome: Outcome) -> serde_json::Value {
    let Outcome {
        samples: mut all,
        secs,
        prompts,
        mean_prompt_tokens,
        cpu,
        storm_prompts,
    } = outcome;
    let cpu = cpu.map(|(user_s, system_s)| json!({"user_s": user_s, "system_s": system_s}));
    let mut routes = serde_json::Map::new();
    for (route, v) in all.routes.iter_mut() {
        routes.insert((*route).to_string(), summary(v, secs));
    }
    let errors: u64 = all
        .statuses
        .iter()
        .filter(|(s, _)| **s >= 400)
        .map(|(_, n)| n)
        .sum::<u64>()
        + all.transport_errors;
    json!({
        "label": args.label,
        "url": args.url,
        "mode": format!("{:?}", args.mode).to_lowercase(),
        "workers": args.workers,
        "engine_workers": args.events_base_port.map(|_| args.engine_workers()),
        "concurrency": args.concurrency,
        "duration_s": secs,
        "prompts": prompts,
        "mean_prompt_tokens": mean_prompt_tokens,
        "cycles": summary(&mut all.cycles, secs),
        "routes": routes,
        "statuses": all.statuses.iter().map(|(s, n)| (s.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
        "errors": errors,
        "loadgen_cpu": cpu,
        "engine_backlog_waits": all.backlog_waits,
        "engine_backlog_wait_s": all.backlog_wait_us as f64 / 1e6,
        "events": args.events_base_port.is_some(),
        "event_storm_prompts": storm_prompts,
        "engine_nice": args.engine_nice,
        "engine_idle": args.engine_idle,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    })
}

/// The report as a table: one row per route, then the whole cycle.
pub fn print_table(report: &serde_json::Value) {
    println!(
        "{} ({} mode, {} workers, concurrency {}, {:.1} s, mean prompt {} tokens): {} errors",
        report["label"].as_str().unwrap_or(""),
        report["mode"].as_str().unwrap_or(""),
        report["workers"],
        report["concurrency"],
        report["duration_s"].as_f64().unwrap_or(0.0),
        report["mean_prompt_tokens"],
        report["errors"]
    );
    println!(
        "{:<18} {:>9} {:>10} {:>9} {:>9} {:>9}",
        "route", "count", "req/s", "p50 µs", "p90 µs", "p99 µs"
    );
    let mut rows: Vec<(String, &serde_json::Value)> = report["routes"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v)).collect())
        .unwrap_or_default();
    rows.push(("cycle".to_string(), &report["cycles"]));
    for (name, r) in rows {
        println!(
            "{:<18} {:>9} {:>10.0} {:>9} {:>9} {:>9}",
            name,
            r["count"],
            r["rps"].as_f64().unwrap_or(0.0),
            r["p50_us"],
            r["p90_us"],
            r["p99_us"]
        );
    }
}
