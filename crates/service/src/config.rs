//! Service configuration: one struct, parsed by clap from flags and `KVROUTE_*` environment
//! variables (so tests can build it from an argument list without touching the process
//! environment), validated with messages that name the knob.

use crate::admission::queue::QueueSettings;
use clap::{Args, ValueEnum};
use kvroute_core::admission::{QueueConfig, QueuePolicy};
use kvroute_core::index::IndexConfig;
use kvroute_core::pending::PendingConfig;
use kvroute_core::schedule::{RouterProfile, SchedulerConfig};
use kvroute_core::selector::{
    DEFAULT_ENGINE_LOAD_MAX_AGE, PredictConfig, SelectorConfig, SessionConfig, SessionMode,
};
use std::net::IpAddr;
use std::time::Duration;

/// How workers without KV events have their cache predicted (SPEC §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum ApproximatePolicy {
    /// Booked prompts are assumed cached for a fixed time.
    #[default]
    Ttl,
    /// A capacity-bounded LRU model of each rank's KV pool.
    Lru,
}

/// How strongly a session is bound to its rank (`--session-affinity-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum SessionAffinityMode {
    /// The bound rank always wins, busy or not (Dynamo 1.6.1).
    #[default]
    Hard,
    /// The bound rank wins unless it is busy or costs more than the soft factor × the cheapest.
    Soft,
}

/// Accepted `--session-affinity-ttl-secs`, in seconds (Dynamo's range: one second to a year).
pub const SESSION_AFFINITY_TTL_RANGE: std::ops::RangeInclusive<f64> = 1.0..=31_536_000.0;

#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Address to bind (loopback by default; use 0.0.0.0 to listen on every interface).
    #[arg(long, env = "KVROUTE_BIND", default_value = "127.0.0.1")]
    pub bind: IpAddr,
    /// TCP port of the HTTP API.
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Bearer token required on every route except /health, /ready and /metrics.
    #[arg(long, env = "KVROUTE_API_KEY")]
    pub api_key: Option<String>,
    /// Largest accepted request body, in bytes (413 beyond).
    #[arg(long, env = "KVROUTE_BODY_LIMIT_BYTES", default_value_t = 8 * 1024 * 1024)]
    pub body_limit_bytes: usize,
    /// A connection must deliver each request's head (request line and headers) within this
    /// many milliseconds: a new connection from its accept, a kept-alive one from the request's
    /// first byte. Beyond it the connection is closed.
    #[arg(long, env = "KVROUTE_HEADER_READ_TIMEOUT_MS", default_value_t = 10_000)]
    pub header_read_timeout_ms: u64,
    /// A request's body must arrive within this many milliseconds of the service reading it
    /// (408 and the connection closed beyond).
    #[arg(long, env = "KVROUTE_BODY_READ_TIMEOUT_MS", default_value_t = 30_000)]
    pub body_read_timeout_ms: u64,
    /// A kept-alive connection with no request in progress and no bytes moving for this many
    /// seconds is closed.
    #[arg(long, env = "KVROUTE_IDLE_TIMEOUT_SECS", default_value_t = 75.0)]
    pub idle_timeout_secs: f64,
    /// Most open HTTP connections; beyond it a new connection is closed at once (the open ones
    /// are served). Each takes a file descriptor: keep it below the open-file limit.
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,

    /// How long a cached selection can be replayed, in seconds.
    #[arg(
        long,
        env = "KVROUTE_SELECTION_CACHE_TTL_SECS",
        default_value_t = 120.0
    )]
    pub selection_cache_ttl_secs: f64,
    /// Most cached selections kept.
    #[arg(
        long,
        env = "KVROUTE_SELECTION_CACHE_MAX_ENTRIES",
        default_value_t = 4096
    )]
    pub selection_cache_max_entries: usize,
    /// Approximate byte budget of cached selections.
    #[arg(long, env = "KVROUTE_SELECTION_CACHE_MAX_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub selection_cache_max_bytes: u64,

    /// Where the cost weights' defaults come from: `kvroute` (its own tuned weights; effective
    /// prefill is what the engine will compute) or `dynamo` (Dynamo 1.6.1's weights and
    /// formula, for identical decisions). The weight flags below override single values.
    #[arg(
        long,
        env = "KVROUTE_ROUTER_PROFILE",
        default_value_t = RouterProfile::default(),
        value_parser = parse_router_profile()
    )]
    pub router_profile: RouterProfile,
    /// Weight of a block cached on the device in the cost function [default: the profile's,
    /// kvroute 3, dynamo 1].
    #[arg(long, env = "KVROUTE_OVERLAP_SCORE_CREDIT")]
    pub overlap_score_credit: Option<f64>,
    /// Multiplier of the prefill term of the cost function [default: the profile's, kvroute 32,
    /// dynamo 1].
    #[arg(long, env = "KVROUTE_PREFILL_LOAD_SCALE")]
    pub prefill_load_scale: Option<f64>,
    /// Credit of a block cached on the host (CPU) tier [default: the profile's, 0.75].
    #[arg(long, env = "KVROUTE_HOST_CACHE_HIT_WEIGHT")]
    pub host_cache_hit_weight: Option<f64>,
    /// Credit of a block cached on disk or external storage [default: the profile's, 0.25].
    #[arg(long, env = "KVROUTE_DISK_CACHE_HIT_WEIGHT")]
    pub disk_cache_hit_weight: Option<f64>,
    /// Cost of each active request on a rank [default: the profile's, 0].
    #[arg(long, env = "KVROUTE_DECODE_ACTIVE_REQUEST_WEIGHT")]
    pub decode_active_request_weight: Option<f64>,
    /// 0 picks the cheapest rank; above 0 samples ranks with p ∝ exp(−cost/T).
    #[arg(long, env = "KVROUTE_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    pub router_temperature: f64,
    /// Whether bookings count their prefill tokens as load until prefill completes.
    #[arg(long, env = "KVROUTE_TRACK_PREFILL_TOKENS", default_value_t = true, action = clap::ArgAction::Set)]
    pub track_prefill_tokens: bool,
    /// A rank is busy when its active decode blocks reach this fraction of total_kv_blocks.
    #[arg(long, env = "KVROUTE_BUSY_DECODE_FRACTION")]
    pub busy_decode_fraction: Option<f64>,
    /// A rank is busy when its active prefill tokens reach this many.
    #[arg(long, env = "KVROUTE_BUSY_PREFILL_TOKENS")]
    pub busy_prefill_tokens: Option<u64>,
    /// A rank is busy when its active prefill tokens reach this fraction of
    /// max_num_batched_tokens.
    #[arg(long, env = "KVROUTE_BUSY_PREFILL_FRACTION")]
    pub busy_prefill_fraction: Option<f64>,

    /// A booking with no lifecycle call for this long is freed, in seconds.
    #[arg(
        long,
        env = "KVROUTE_ACTIVE_REQUEST_EXPIRY_SECS",
        default_value_t = 300.0
    )]
    pub active_request_expiry_secs: f64,
    /// Cap on indexed blocks per partition; the oldest are evicted beyond it.
    #[arg(long, env = "KVROUTE_MAX_INDEXED_BLOCKS", default_value_t = 1 << 22)]
    pub max_indexed_blocks: usize,
    /// A booked prompt's blocks count as held on the chosen rank (one with KV events) until its
    /// own events confirm them, or this many seconds; 0 turns prediction off [default: the
    /// profile's: kvroute 2, dynamo 0]
    #[arg(long, env = "KVROUTE_PREDICTED_TTL_SECS")]
    pub predicted_ttl_secs: Option<f64>,

    /// Session affinity: a session's requests (`session_id` or `session_context`) go to the rank
    /// its bookings went to, until this many seconds after its last booking ended (1 to
    /// 31536000). Without it session fields are ignored.
    #[arg(long, env = "KVROUTE_SESSION_AFFINITY_TTL_SECS")]
    pub session_affinity_ttl_secs: Option<f64>,
    /// hard: a bound session always goes to its rank (Dynamo's behaviour); soft: unless that
    /// rank is busy or costs more than --session-affinity-soft-factor × the cheapest rank.
    #[arg(long, env = "KVROUTE_SESSION_AFFINITY_MODE", value_enum, default_value_t = SessionAffinityMode::Hard)]
    pub session_affinity_mode: SessionAffinityMode,
    /// Soft mode: how many times the cheapest rank's cost the bound rank may cost and still be
    /// chosen (at least 1).
    #[arg(
        long,
        env = "KVROUTE_SESSION_AFFINITY_SOFT_FACTOR",
        default_value_t = kvroute_core::selector::DEFAULT_SOFT_FACTOR
    )]
    pub session_affinity_soft_factor: f64,
    /// Most session bindings kept; the least recently booked is evicted beyond.
    #[arg(
        long,
        env = "KVROUTE_SESSION_AFFINITY_MAX_SESSIONS",
        default_value_t = kvroute_core::selector::DEFAULT_MAX_SESSIONS
    )]
    pub session_affinity_max_sessions: usize,

    /// Admission queue: `/select` and `/select_and_reserve` wait while every rank they may go
    /// to has more than this × its max_num_batched_tokens of active prefill, and are decided
    /// when capacity frees (Dynamo's DYN_ROUTER_QUEUE_THRESHOLD, also read). Without it
    /// requests never wait. With it a worker must state max_num_batched_tokens to be
    /// schedulable.
    #[arg(long, env = "KVROUTE_QUEUE_THRESHOLD")]
    pub queue_threshold: Option<f64>,
    /// The queue's order inside a tenant: fcfs, lcfs or wspt (shortest uncached prompt first),
    /// after `strict_priority` and `priority_jump` (DYN_ROUTER_QUEUE_POLICY is also read)
    /// [default: fcfs]
    #[arg(long, env = "KVROUTE_QUEUE_POLICY", value_parser = parse_queue_policy())]
    pub queue_policy: Option<QueuePolicy>,
    /// Most requests waiting in all partitions together; beyond it a request gets 429 at once.
    #[arg(long, env = "KVROUTE_QUEUE_MAX_REQUESTS", default_value_t = 10_000)]
    pub queue_max_requests: usize,
    /// The longest a request waits, in milliseconds, unless its `queue_timeout_ms` says
    /// otherwise (429 beyond). Without it a request waits until it is decided.
    #[arg(long, env = "KVROUTE_QUEUE_TIMEOUT_MS")]
    pub queue_timeout_ms: Option<u64>,
    /// A request that has waited this many milliseconds goes before its tenant's others, so no
    /// order or priority starves it.
    #[arg(long, env = "KVROUTE_QUEUE_PROMOTION_MS", default_value_t = 10_000)]
    pub queue_promotion_ms: u64,
    /// Fair share between tenants: each tenant's turn admits up to its weight × this many
    /// prompt tokens before the next tenant's turn (deficit round robin).
    #[arg(long, env = "KVROUTE_QUEUE_QUANTUM_TOKENS", default_value_t = 65_536)]
    pub queue_quantum_tokens: u64,
    /// A tenant's share of the queue's admissions, NAME=WEIGHT (repeatable; 1 by default).
    /// Requests name their tenant with the `x-tenant-id` header.
    #[arg(
        long = "tenant-weight",
        env = "KVROUTE_TENANT_WEIGHTS",
        value_delimiter = ',',
        value_parser = parse_tenant_weight
    )]
    pub tenant_weights: Vec<(String, u32)>,

    /// Do not subscribe to engines' KV events; predict every worker's cache from bookings.
    #[arg(long, env = "KVROUTE_NO_KV_EVENTS", default_value_t = false)]
    pub no_kv_events: bool,
    /// The approximate cache model for workers without KV events: the model is active for a
    /// rank exactly when it has no KV-event endpoint or the router runs with --no-kv-events.
    #[arg(long, env = "KVROUTE_APPROXIMATE_CACHE_POLICY", value_enum, default_value_t = ApproximatePolicy::Ttl)]
    pub approximate_cache_policy: ApproximatePolicy,

    /// Niceness (0–19) of the thread that receives and decodes KV events. The listeners run on
    /// their own thread, apart from the HTTP threads; above 0 the OS favours request handling
    /// when both want the CPU, so an event storm delays the index rather than the selects.
    #[arg(long, env = "KVROUTE_INGEST_NICE", default_value_t = 10)]
    pub ingest_nice: u8,

    /// Poll each worker's `{endpoint}/metrics` (vLLM, SGLang) every this many milliseconds
    /// (10–60000) and raise its booked load to the running/waiting requests and KV usage its
    /// engine reports; a report older than 2 s (or two intervals) is ignored. Off by default.
    #[arg(long, env = "KVROUTE_ENGINE_METRICS_POLL_MS")]
    pub engine_metrics_poll_ms: Option<u64>,

    /// A disaggregated select (`"disaggregated": true`) runs the request whole on its best
    /// decode (or both) worker, without a prefill worker, when that worker lacks at most this
    /// many of the prompt's tokens (SPEC §6.1).
    #[arg(long, env = "KVROUTE_PD_BYPASS_TOKENS", default_value_t = kvroute_core::selector::DEFAULT_PD_BYPASS_TOKENS)]
    pub pd_bypass_tokens: u64,
    /// A worker with a KV-event endpoint that got --kv-silence-bookings bookings over at least
    /// this many seconds and no KV-event message since the first of them is reported as routing
    /// blind (`no_kv_events`: the gauge `kvroute_routing_degraded`, a warning, `GET /loads`);
    /// 0 turns the check off.
    #[arg(long, env = "KVROUTE_KV_SILENCE_SECS", default_value_t = 30)]
    pub kv_silence_secs: u64,
    /// See --kv-silence-secs (at least 1).
    #[arg(long, env = "KVROUTE_KV_SILENCE_BOOKINGS", default_value_t = 20)]
    pub kv_silence_bookings: u64,

    /// Replica sync over NATS (SPEC §10).
    #[command(flatten)]
    pub sync: crate::sync::SyncConfig,
}

/// `--router-profile`'s parser: the names of [`RouterProfile::ALL`], listed in `--help`.
fn parse_router_profile() -> impl clap::builder::TypedValueParser<Value = RouterProfile> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(RouterProfile::ALL.map(RouterProfile::name))
        .try_map(|name| name.parse::<RouterProfile>())
}

/// Parses a group of flags (`clap::Args`: the service's, the gateway's) from arguments, the
/// first being the program's name, as a command of its own would.
pub fn parse_args<A, I, T>(args: I) -> Result<A, clap::Error>
where
    A: Args + clap::FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let command = A::augment_args(clap::Command::new("kvroute"));
    let matches = command.try_get_matches_from(args)?;
    A::from_arg_matches(&matches)
}

/// `--queue-policy`'s parser: fcfs, lcfs, wspt.
fn parse_queue_policy() -> impl clap::builder::TypedValueParser<Value = QueuePolicy> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(QueuePolicy::ALL.map(QueuePolicy::name))
        .try_map(|name| name.parse::<QueuePolicy>())
}

/// `--tenant-weight NAME=WEIGHT`.
fn parse_tenant_weight(raw: &str) -> Result<(String, u32), String> {
    let (name, weight) = raw
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=WEIGHT (got {raw:?})"))?;
    let weight: u32 = weight.trim().parse().map_err(|_| {
        format!("the weight of {name:?} must be a whole number ≥ 1 (got {weight:?})")
    })?;
    if name.is_empty() || weight == 0 {
        return Err(format!(
            "expected a tenant name and a weight ≥ 1 (got {raw:?})"
        ));
    }
    Ok((name.to_string(), weight))
}

fn finite_non_negative(name: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(format!(
            "--{name} must be a finite number ≥ 0 (got {value})"
        ))
    }
}

fn positive_secs(name: &str, value: f64) -> Result<Duration, String> {
    if value.is_finite() && value > 0.0 && value < 1e9 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(format!(
            "--{name} must be a number of seconds > 0 (got {value})"
        ))
    }
}

fn non_negative_secs(name: &str, value: f64) -> Result<Duration, String> {
    if value.is_finite() && (0.0..1e9).contains(&value) {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(format!(
            "--{name} must be a number of seconds ≥ 0 (got {value})"
        ))
    }
}

/// The longest a millisecond timeout may be: a day.
const MAX_TIMEOUT_MS: u64 = 86_400_000;

fn timeout_millis(name: &str, value: u64) -> Result<Duration, String> {
    if (1..=MAX_TIMEOUT_MS).contains(&value) {
        Ok(Duration::from_millis(value))
    } else {
        Err(format!(
            "--{name} must be a number of milliseconds from 1 to {MAX_TIMEOUT_MS} (got {value})"
        ))
    }
}

/// What slow and idle clients may hold, from the `--header-read-timeout-ms`,
/// `--body-read-timeout-ms`, `--idle-timeout-secs` and `--max-connections` knobs (enforced by
/// `http::connections` and the body extractors of `http::json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

impl ServeConfig {
    /// The connection limits, checked.
    pub fn connection_limits(&self) -> Result<ConnectionLimits, String> {
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".to_string());
        }
        Ok(ConnectionLimits {
            header_read_timeout: timeout_millis(
                "header-read-timeout-ms",
                self.header_read_timeout_ms,
            )?,
            body_read_timeout: timeout_millis("body-read-timeout-ms", self.body_read_timeout_ms)?,
            idle_timeout: positive_secs("idle-timeout-secs", self.idle_timeout_secs)?,
            max_connections: self.max_connections,
        })
    }

    /// Parses a configuration from arguments (tests; the binary uses its own clap command).
    pub fn parse_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        parse_args(args)
    }

    /// The defaults, as `kvroute serve` with no flags (ignores the environment).
    pub fn defaults() -> Self {
        Self {
            bind: IpAddr::from([127, 0, 0, 1]),
            port: 8000,
            api_key: None,
            body_limit_bytes: 8 * 1024 * 1024,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            idle_timeout_secs: 75.0,
            max_connections: 10_000,
            selection_cache_ttl_secs: 120.0,
            selection_cache_max_entries: 4096,
            selection_cache_max_bytes: 256 * 1024 * 1024,
            router_profile: RouterProfile::default(),
            overlap_score_credit: None,
            prefill_load_scale: None,
            host_cache_hit_weight: None,
            disk_cache_hit_weight: None,
            decode_active_request_weight: None,
            router_temperature: 0.0,
            track_prefill_tokens: true,
            busy_decode_fraction: None,
            busy_prefill_tokens: None,
            busy_prefill_fraction: None,
            active_request_expiry_secs: 300.0,
            max_indexed_blocks: 1 << 22,
            predicted_ttl_secs: None,
            session_affinity_ttl_secs: None,
            session_affinity_mode: SessionAffinityMode::Hard,
            session_affinity_soft_factor: kvroute_core::selector::DEFAULT_SOFT_FACTOR,
            session_affinity_max_sessions: kvroute_core::selector::DEFAULT_MAX_SESSIONS,
            queue_threshold: None,
            queue_policy: None,
            queue_max_requests: 10_000,
            queue_timeout_ms: None,
            queue_promotion_ms: 10_000,
            queue_quantum_tokens: 65_536,
            tenant_weights: Vec::new(),
            no_kv_events: false,
            approximate_cache_policy: ApproximatePolicy::Ttl,
            ingest_nice: 10,
            engine_metrics_poll_ms: None,
            pd_bypass_tokens: kvroute_core::selector::DEFAULT_PD_BYPASS_TOKENS,
            kv_silence_secs: 30,
            kv_silence_bookings: 20,
            sync: crate::sync::SyncConfig::default(),
        }
    }

    /// The scheduler: the profile's weights, with the weight flags that were given over them.
    fn scheduler(&self) -> SchedulerConfig {
        let profile = SchedulerConfig::for_profile(self.router_profile);
        SchedulerConfig {
            profile: self.router_profile,
            overlap_score_credit: self
                .overlap_score_credit
                .unwrap_or(profile.overlap_score_credit),
            prefill_load_scale: self
                .prefill_load_scale
                .unwrap_or(profile.prefill_load_scale),
            host_cache_hit_weight: self
                .host_cache_hit_weight
                .unwrap_or(profile.host_cache_hit_weight),
            disk_cache_hit_weight: self
                .disk_cache_hit_weight
                .unwrap_or(profile.disk_cache_hit_weight),
            decode_active_request_weight: self
                .decode_active_request_weight
                .unwrap_or(profile.decode_active_request_weight),
            router_temperature: self.router_temperature,
            track_prefill_tokens: self.track_prefill_tokens,
            busy_decode_fraction: self.busy_decode_fraction,
            busy_prefill_tokens: self.busy_prefill_tokens,
            busy_prefill_fraction: self.busy_prefill_fraction,
            engine: profile.engine,
        }
    }

    /// Session affinity's settings, checked.
    fn sessions(&self) -> Result<SessionConfig, String> {
        let ttl = match self.session_affinity_ttl_secs {
            Some(secs) if SESSION_AFFINITY_TTL_RANGE.contains(&secs) => {
                Some(Duration::from_secs_f64(secs))
            }
            Some(secs) => {
                return Err(format!(
                    "--session-affinity-ttl-secs must be between 1 and 31536000 (got {secs})"
                ));
            }
            None => None,
        };
        let factor = self.session_affinity_soft_factor;
        if !(factor.is_finite() && factor >= 1.0) {
            return Err(format!(
                "--session-affinity-soft-factor must be a finite number ≥ 1 (got {factor})"
            ));
        }
        if self.session_affinity_max_sessions == 0 {
            return Err("--session-affinity-max-sessions must be at least 1".to_string());
        }
        Ok(SessionConfig {
            ttl,
            mode: match self.session_affinity_mode {
                SessionAffinityMode::Hard => SessionMode::Hard,
                SessionAffinityMode::Soft => SessionMode::Soft,
            },
            soft_factor: factor,
            max_sessions: self.session_affinity_max_sessions,
        })
    }

    /// Checks every knob and builds the selector's configuration.
    pub fn validate(&self) -> Result<SelectorConfig, String> {
        let scheduler = self.scheduler();
        for (name, value) in [
            ("overlap-score-credit", scheduler.overlap_score_credit),
            ("prefill-load-scale", scheduler.prefill_load_scale),
            ("host-cache-hit-weight", scheduler.host_cache_hit_weight),
            ("disk-cache-hit-weight", scheduler.disk_cache_hit_weight),
            (
                "decode-active-request-weight",
                scheduler.decode_active_request_weight,
            ),
            ("router-temperature", scheduler.router_temperature),
        ] {
            finite_non_negative(name, value)?;
        }
        for (name, value) in [
            ("busy-decode-fraction", self.busy_decode_fraction),
            ("busy-prefill-fraction", self.busy_prefill_fraction),
        ] {
            if let Some(v) = value
                && !(v.is_finite() && v > 0.0)
            {
                return Err(format!("--{name} must be a fraction > 0 (got {v})"));
            }
        }
        if self.selection_cache_max_entries == 0 {
            return Err("--selection-cache-max-entries must be at least 1".to_string());
        }
        if self.selection_cache_max_bytes == 0 {
            return Err("--selection-cache-max-bytes must be at least 1".to_string());
        }
        if self.max_indexed_blocks == 0 {
            return Err("--max-indexed-blocks must be at least 1".to_string());
        }
        if self.ingest_nice > 19 {
            return Err(format!(
                "--ingest-nice must be between 0 and 19 (got {})",
                self.ingest_nice
            ));
        }
        if self.body_limit_bytes < 1024 {
            return Err("--body-limit-bytes must be at least 1024".to_string());
        }
        if self.api_key.as_deref().is_some_and(str::is_empty) {
            return Err(
                "--api-key must not be empty (omit it to disable authentication)".to_string(),
            );
        }
        self.sync.validate()?;
        self.connection_limits()?;
        let ttl = positive_secs("selection-cache-ttl-secs", self.selection_cache_ttl_secs)?;
        let expiry = positive_secs(
            "active-request-expiry-secs",
            self.active_request_expiry_secs,
        )?;
        let predict = PredictConfig::for_profile(self.router_profile);
        let predicted_ttl = match self.predicted_ttl_secs {
            Some(secs) => non_negative_secs("predicted-ttl-secs", secs)?,
            None => predict.ttl,
        };
        Ok(SelectorConfig {
            scheduler,
            pending: PendingConfig {
                ttl,
                max_entries: self.selection_cache_max_entries,
                max_bytes: self.selection_cache_max_bytes,
            },
            index: IndexConfig {
                max_blocks: self.max_indexed_blocks,
            },
            active_request_expiry: expiry,
            approximate_policy: match self.approximate_cache_policy {
                ApproximatePolicy::Ttl => kvroute_core::approx::CachePolicy::Ttl,
                ApproximatePolicy::Lru => kvroute_core::approx::CachePolicy::Lru,
            },
            no_kv_events: self.no_kv_events,
            ttl: kvroute_core::approx::TtlConfig::default(),
            predict: PredictConfig {
                ttl: predicted_ttl,
                ..predict
            },
            sessions: self.sessions()?,
            queue_threshold: self.queue_settings()?.map(|q| q.threshold),
            // A report stays fresh for two polls, so one slow poll does not drop it.
            engine_load_max_age: self
                .engine_metrics_poll()?
                .map_or(DEFAULT_ENGINE_LOAD_MAX_AGE, |every| {
                    DEFAULT_ENGINE_LOAD_MAX_AGE.max(2 * every)
                }),
            pd_bypass_tokens: self.pd_bypass_tokens,
        })
    }

    /// The interval of `--engine-metrics-poll-ms`; `None` when off.
    pub fn engine_metrics_poll(&self) -> Result<Option<Duration>, String> {
        match self.engine_metrics_poll_ms {
            None => Ok(None),
            Some(ms @ 10..=60_000) => Ok(Some(Duration::from_millis(ms))),
            Some(ms) => Err(format!(
                "--engine-metrics-poll-ms must be between 10 and 60000 (got {ms})"
            )),
        }
    }

    /// The `no_kv_events` rule of `--kv-silence-secs` and `--kv-silence-bookings`; `None` when
    /// off (0 seconds, or `--no-kv-events`: nothing listens).
    pub fn kv_silence_rule(&self) -> Result<Option<crate::degraded::SilenceRule>, String> {
        if self.kv_silence_bookings == 0 {
            return Err("--kv-silence-bookings must be at least 1".to_string());
        }
        if self.kv_silence_secs == 0 || self.no_kv_events {
            return Ok(None);
        }
        Ok(Some(crate::degraded::SilenceRule {
            window: Duration::from_secs(self.kv_silence_secs),
            bookings: self.kv_silence_bookings,
        }))
    }

    /// The admission queue's settings; `None` without `--queue-threshold`.
    pub fn queue_settings(&self) -> Result<Option<QueueSettings>, String> {
        let Some(threshold) = self.queue_threshold else {
            return Ok(None);
        };
        // As Dynamo: ≥ 0; infinity is accepted (nothing is ever full).
        if threshold.is_nan() || threshold < 0.0 {
            return Err(format!(
                "--queue-threshold must be a number ≥ 0 (got {threshold})"
            ));
        }
        if self.queue_max_requests == 0 {
            return Err("--queue-max-requests must be at least 1".to_string());
        }
        let timeout = self
            .queue_timeout_ms
            .map(|ms| timeout_millis("queue-timeout-ms", ms))
            .transpose()?;
        let promotion = timeout_millis("queue-promotion-ms", self.queue_promotion_ms)?;
        if self.queue_quantum_tokens == 0 {
            return Err("--queue-quantum-tokens must be at least 1".to_string());
        }
        Ok(Some(QueueSettings {
            threshold,
            core: QueueConfig {
                threshold: Some(threshold),
                policy: self.queue_policy.unwrap_or_default(),
                max_requests: self.queue_max_requests,
                timeout,
                max_wait_before_promotion: promotion,
                tenant_weights: self.tenant_weights.iter().cloned().collect(),
                quantum_tokens: self.queue_quantum_tokens,
                ..QueueConfig::default()
            },
            retry_after_secs: 1,
        }))
    }

    /// Reads Dynamo's queue variables for drop-in users (`get` looks one up; the binary passes
    /// the process environment): `DYN_ROUTER_QUEUE_THRESHOLD` and `DYN_ROUTER_QUEUE_POLICY`,
    /// where the flags (or `KVROUTE_*`) did not set them. A value that does not parse is an
    /// error naming the variable (Dynamo ignores a threshold that does not parse).
    pub fn apply_dynamo_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), String> {
        if self.queue_threshold.is_none()
            && let Some(raw) = get("DYN_ROUTER_QUEUE_THRESHOLD")
        {
            let value: f64 = raw.parse().map_err(|_| {
                format!("DYN_ROUTER_QUEUE_THRESHOLD must be a number ≥ 0 (got {raw:?})")
            })?;
            self.queue_threshold = Some(value);
        }
        if self.queue_policy.is_none()
            && let Some(raw) = get("DYN_ROUTER_QUEUE_POLICY")
        {
            self.queue_policy = Some(raw.parse().map_err(|_| {
                format!("unknown queue policy: {raw:?}, expected 'fcfs', 'lcfs', or 'wspt' (DYN_ROUTER_QUEUE_POLICY)")
            })?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_flags_without_arguments() {
        let parsed = ServeConfig::parse_from(["kvroute"]).unwrap();
        let defaults = ServeConfig::defaults();
        assert_eq!(parsed.port, defaults.port);
        assert_eq!(parsed.bind, defaults.bind);
        assert_eq!(parsed.validate().unwrap(), defaults.validate().unwrap());
        assert_eq!(defaults.validate().unwrap(), SelectorConfig::default());
    }

    #[test]
    fn engine_metrics_polling_is_off_bounded_and_sets_the_max_age() {
        let parse = |ms: &str| {
            ServeConfig::parse_from(["kvroute", "--engine-metrics-poll-ms", ms]).unwrap()
        };
        assert_eq!(ServeConfig::defaults().engine_metrics_poll(), Ok(None));
        let fast = parse("200");
        assert_eq!(
            fast.engine_metrics_poll(),
            Ok(Some(Duration::from_millis(200)))
        );
        assert_eq!(
            fast.validate().unwrap().engine_load_max_age,
            DEFAULT_ENGINE_LOAD_MAX_AGE
        );
        // A report stays fresh for two intervals when they are longer than the default age.
        assert_eq!(
            parse("5000").validate().unwrap().engine_load_max_age,
            Duration::from_secs(10)
        );
        for bad in ["0", "9", "60001"] {
            let err = parse(bad).validate().unwrap_err();
            assert!(err.contains("--engine-metrics-poll-ms"), "{err}");
        }
    }

    #[test]
    fn the_profile_gives_the_weights_and_flags_override_them() {
        let dynamo = ServeConfig::parse_from(["kvroute", "--router-profile", "dynamo"]).unwrap();
        assert_eq!(
            dynamo.validate().unwrap(),
            SelectorConfig::for_profile(RouterProfile::Dynamo)
        );
        let mixed = ServeConfig::parse_from([
            "kvroute",
            "--router-profile=dynamo",
            "--prefill-load-scale=8",
        ])
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!(mixed.scheduler.profile, RouterProfile::Dynamo);
        assert_eq!(
            (
                mixed.scheduler.prefill_load_scale,
                mixed.scheduler.overlap_score_credit
            ),
            (8.0, 1.0)
        );
        let own = ServeConfig::parse_from(["kvroute", "--overlap-score-credit", "2"])
            .unwrap()
            .validate()
            .unwrap();
        assert_eq!(
            (
                own.scheduler.overlap_score_credit,
                own.scheduler.prefill_load_scale
            ),
            (2.0, 32.0)
        );
        let err = ServeConfig::parse_from(["kvroute", "--router-profile", "fast"]).unwrap_err();
        assert!(err.to_string().contains("kvroute, dynamo"), "{err}");
    }

    #[test]
    fn invalid_knobs_are_named() {
        let bad = ServeConfig::parse_from(["kvroute", "--router-temperature=-1"]).unwrap();
        assert_eq!(
            bad.validate().unwrap_err(),
            "--router-temperature must be a finite number ≥ 0 (got -1)"
        );
        let bad = ServeConfig::parse_from(["kvroute", "--selection-cache-ttl-secs", "0"]).unwrap();
        assert!(
            bad.validate()
                .unwrap_err()
                .contains("--selection-cache-ttl-secs")
        );
        let bad = ServeConfig::parse_from(["kvroute", "--overlap-score-credit=-1"]).unwrap();
        assert_eq!(
            bad.validate().unwrap_err(),
            "--overlap-score-credit must be a finite number ≥ 0 (got -1)"
        );
        assert!(ServeConfig::parse_from(["kvroute", "--port", "70000"]).is_err());
        for bad in ["-1", "NaN", "inf"] {
            let config =
                ServeConfig::parse_from(["kvroute", &format!("--predicted-ttl-secs={bad}")])
                    .unwrap();
            assert!(
                config
                    .validate()
                    .unwrap_err()
                    .starts_with("--predicted-ttl-secs must be a number of seconds ≥ 0"),
                "{bad}"
            );
        }
    }

    #[test]
    fn session_affinity_is_off_by_default_and_its_ttl_is_dynamos_range() {
        let sessions = |args: &[&str]| {
            ServeConfig::parse_from(args)
                .unwrap()
                .validate()
                .map(|c| c.sessions)
        };
        assert_eq!(sessions(&["kvroute"]), Ok(SessionConfig::default()));
        assert!(!SessionConfig::default().enabled());
        for ok in ["1", "1.5", "1e3", "31536000"] {
            let config = sessions(&["kvroute", "--session-affinity-ttl-secs", ok]).unwrap();
            assert_eq!(
                config.ttl,
                Some(Duration::from_secs_f64(ok.parse().unwrap()))
            );
            assert_eq!(config.mode, SessionMode::Hard, "hard unless told");
        }
        for bad in [
            "0",
            "0.5",
            "31536001",
            "18446744073709551616",
            "NaN",
            "inf",
            "-1",
        ] {
            let arg = format!("--session-affinity-ttl-secs={bad}");
            let err = sessions(&["kvroute", &arg]).unwrap_err();
            assert!(
                err.starts_with("--session-affinity-ttl-secs must be between 1 and 31536000"),
                "{bad}: {err}"
            );
        }
        let soft = sessions(&[
            "kvroute",
            "--session-affinity-ttl-secs=60",
            "--session-affinity-mode=soft",
            "--session-affinity-soft-factor=1.5",
            "--session-affinity-max-sessions=10",
        ])
        .unwrap();
        assert_eq!(
            (soft.mode, soft.soft_factor, soft.max_sessions),
            (SessionMode::Soft, 1.5, 10)
        );
        assert!(
            sessions(&["kvroute", "--session-affinity-soft-factor=0.5"])
                .unwrap_err()
                .contains("--session-affinity-soft-factor")
        );
        assert!(
            sessions(&["kvroute", "--session-affinity-max-sessions=0"])
                .unwrap_err()
                .contains("--session-affinity-max-sessions")
        );
        assert!(ServeConfig::parse_from(["kvroute", "--session-affinity-mode", "loose"]).is_err());
    }

    #[test]
    fn connection_limits_default_and_are_checked() {
        let limits = ServeConfig::parse_from(["kvroute"])
            .unwrap()
            .connection_limits()
            .unwrap();
        assert_eq!(limits, ServeConfig::defaults().connection_limits().unwrap());
        assert_eq!(
            limits,
            ConnectionLimits {
                header_read_timeout: Duration::from_secs(10),
                body_read_timeout: Duration::from_secs(30),
                idle_timeout: Duration::from_secs(75),
                max_connections: 10_000,
            }
        );
        let short = ServeConfig::parse_from([
            "kvroute",
            "--header-read-timeout-ms=300",
            "--body-read-timeout-ms=500",
            "--idle-timeout-secs=0.5",
            "--max-connections=50",
        ])
        .unwrap()
        .connection_limits()
        .unwrap();
        assert_eq!(
            (
                short.header_read_timeout,
                short.body_read_timeout,
                short.idle_timeout,
                short.max_connections
            ),
            (
                Duration::from_millis(300),
                Duration::from_millis(500),
                Duration::from_millis(500),
                50
            )
        );
        for (arg, message) in [
            (
                "--header-read-timeout-ms=0",
                "--header-read-timeout-ms must be a number of milliseconds from 1 to 86400000 (got 0)",
            ),
            (
                "--body-read-timeout-ms=86400001",
                "--body-read-timeout-ms must be a number of milliseconds from 1 to 86400000 (got 86400001)",
            ),
            (
                "--idle-timeout-secs=0",
                "--idle-timeout-secs must be a number of seconds > 0 (got 0)",
            ),
            (
                "--max-connections=0",
                "--max-connections must be at least 1",
            ),
        ] {
            let config = ServeConfig::parse_from(["kvroute", arg]).unwrap();
            assert_eq!(config.validate().unwrap_err(), message, "{arg}");
        }
    }

    #[test]
    fn predicted_ttl_sets_the_selectors_and_zero_turns_it_off() {
        let ttl = |args: &[&str]| {
            ServeConfig::parse_from(args)
                .unwrap()
                .validate()
                .unwrap()
                .predict
        };
        assert_eq!(ttl(&["kvroute"]).ttl, Duration::from_secs(2));
        let half = ttl(&["kvroute", "--predicted-ttl-secs", "0.5"]);
        assert_eq!(half.ttl, Duration::from_millis(500));
        let off = ttl(&["kvroute", "--predicted-ttl-secs", "0"]);
        assert!(!off.enabled());
        // The dynamo profile does not predict unless asked to.
        assert!(!ttl(&["kvroute", "--router-profile", "dynamo"]).enabled());
        let asked = ttl(&[
            "kvroute",
            "--router-profile",
            "dynamo",
            "--predicted-ttl-secs",
            "1",
        ]);
        assert_eq!(asked.ttl, Duration::from_secs(1));
    }
}
