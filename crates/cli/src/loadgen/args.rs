//! The flags of `kvroute loadgen`.

use clap::{Args, ValueEnum};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Only `POST /select`.
    Select,
    /// select → reservations (replay) → prefill_complete → free.
    Cycle,
    /// select_and_reserve → free.
    Reserve,
}

#[derive(Args, Debug, Clone)]
pub struct LoadgenArgs {
    /// Base URL of the service, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub url: String,
    /// Workers in the fleet (ids 1..=N), registered at the start unless --skip-register.
    #[arg(long, default_value_t = 64)]
    pub workers: u64,
    /// Do not register the workers (a previous run did).
    #[arg(long, default_value_t = false)]
    pub skip_register: bool,
    /// KV-event endpoint base port: worker i gets a fake engine publishing on
    /// tcp://127.0.0.1:(base+i), registered as its kv_events_endpoint. After each booking the
    /// engine publishes the prompt's blocks as stored (evicting its oldest past
    /// --engine-kv-blocks), so the index fills as in production.
    #[arg(long)]
    pub events_base_port: Option<u16>,
    /// With --events-base-port, only workers 1..=N get a fake engine and a KV-event endpoint
    /// (default: all). The others register without one: Dynamo lists them as incomplete (not
    /// schedulable), kvroute schedules them on load alone. A fleet too big for a server that
    /// holds file descriptors per endpoint (Dynamo 1.6.1: ten each) can so still be registered.
    #[arg(long)]
    pub event_workers: Option<u64>,
    /// KV capacity of each fake engine, in blocks.
    #[arg(long, default_value_t = 16_384)]
    pub engine_kv_blocks: usize,
    /// Fake engines also publish stored/removed events of random prompts as fast as they can
    /// for the whole run (an event storm).
    #[arg(long, default_value_t = false)]
    pub event_storm: bool,

    /// Niceness (0–19) of the fake engines' thread. 0 lets them compete for the CPU like any
    /// process; 19 stands in for engines on other hosts, whose publishing costs the router's
    /// machine nothing: they then use only the CPU the service and the clients leave (at most
    /// 256 routed prompts wait to be published; beyond that the clients wait for the engines).
    #[arg(long, default_value_t = 0)]
    pub engine_nice: u8,
    /// Run the fake engines' thread under Linux's `SCHED_IDLE` instead (`--engine-nice` is then
    /// ignored): it gets a core only when no thread of the service or the clients wants one,
    /// and gives it up as soon as one wakes. Closer to engines on other hosts than nice 19,
    /// which still takes its slice of a core (over a millisecond) once the scheduler picks it.
    #[arg(long, default_value_t = false)]
    pub engine_idle: bool,
    /// How long each fake engine waits, before the run, for the service to subscribe to it
    /// (0: publish at once, e.g. to engines nobody subscribes to).
    #[arg(long, default_value_t = 5)]
    pub subscriber_wait_secs: u64,
    /// Concurrent keep-alive connections (closed loop).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 20.0)]
    pub duration_secs: f64,
    /// Stop after this many requests (cycles) in all.
    #[arg(long, default_value_t = 10_000_000)]
    pub max_requests: u64,
    #[arg(long, value_enum, default_value_t = Mode::Cycle)]
    pub mode: Mode,
    /// Mooncake JSONL trace to take prompts from (default: a synthetic shared-prefix set).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Cap on prompt length in tokens.
    #[arg(long, default_value_t = 16_384)]
    pub max_prompt_tokens: usize,
    /// Block size the workers are registered with.
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,
    /// Write the report as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// A name for this run in the report.
    #[arg(long, default_value = "run")]
    pub label: String,
}

/// The address of `--url` (`http://HOST:PORT`, an optional trailing slash).
pub fn resolve(url: &str) -> Result<SocketAddr, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("--url must start with http:// (got {url})"))?;
    let host_port = rest.trim_end_matches('/');
    host_port
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host_port}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host_port} resolves to no address"))
}

impl LoadgenArgs {
    /// Workers `1..=` this have a fake engine and a KV-event endpoint (with --events-base-port).
    pub fn engine_workers(&self) -> u64 {
        self.event_workers
            .map_or(self.workers, |n| n.min(self.workers))
    }
}
