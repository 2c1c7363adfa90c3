//! `kvroute sim`: replays a workload on a simulated fleet under several routing policies and
//! prints a side-by-side table; `--out DIR` also writes `report.json` and `report.svg`.
//! `kvroute sim --suite` runs the workload suite (`kvroute_sim::suite`) instead: every policy on
//! every shape, load, replica count and engine model, then a summary; `--suite-out DIR` writes
//! `suite.json` and `suite.md`.
//!
//! The simulation itself is `kvroute-sim` (pure and deterministic); this module parses flags,
//! reads the trace file, runs the policies on parallel threads with a progress bar per policy
//! (hidden when stderr is not a terminal), and writes the outputs.

use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvroute_core::selector::{DEFAULT_SOFT_FACTOR, PredictConfig};
use kvroute_sim::engine::DEFAULT_KV_BLOCKS;
use kvroute_sim::policy::{DEFAULT_SESSION_TTL, SelectorPolicy, kvroute_policy};
use kvroute_sim::sim::{DEFAULT_EVENT_DELAY, DEFAULT_SYNC_DELAY, DEFAULT_TTFT_TARGET, SimQueue};
use kvroute_sim::suite::{
    DEFAULT_POLICIES, Shape, SuiteOptions, SuiteReport, TraceShape, run_suite, shapes,
};
use kvroute_sim::workload::{
    AgenticSpec, agentic_workload, mooncake_workload, parse_mooncake, sessions_by_opening,
    synthetic_workload,
};
use kvroute_sim::{
    ArrivalOptions, BatchDecode, EngineConfig, EngineModel, Policy, PolicyRun, SimConfig, SimError,
    SyntheticSpec, TimingModel, UnavailablePolicy, Workload, build_report, render_svg, resolve,
    run_policy,
};
use std::io::{BufReader, IsTerminal};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The synthetic workload `kvroute sim` runs when given neither `--trace` nor `--synthetic`.
const DEFAULT_SYNTHETIC: &str = "16x64";

#[derive(Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("suites").args(["suite", "suite_pd"]).multiple(true)))]
pub struct SimArgs {
    /// Mooncake JSONL trace to replay (`timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids` of 512-token blocks).
    #[arg(long, conflicts_with = "synthetic")]
    pub trace: Option<PathBuf>,
    /// Synthetic workload: shared-prefix groups GROUPSxPROMPTS (the default, 16x64, when no
    /// --trace), or `agentic[:key=value,...]` (multi-turn tool-using sessions, fan-out bursts and
    /// one-shot requests; keys in crates/sim/README.md).
    #[arg(long, value_name = "GROUPSxPROMPTS|agentic")]
    pub synthetic: Option<String>,
    /// Simulated workers (one engine each).
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// `all` or a comma-separated list: round_robin, random, least_loaded, cache_aware, dynamo,
    /// kvroute, kvroute-approx-ttl, kvroute-approx-lru, kvroute-session-hard,
    /// kvroute-session-soft. Default: all; with --suite, round_robin, least_loaded,
    /// cache_aware, dynamo and kvroute.
    #[arg(long)]
    pub policies: Option<String>,
    /// KV blocks per worker, or `unlimited`.
    #[arg(long, default_value_t = DEFAULT_KV_BLOCKS.to_string())]
    pub kv_blocks: String,
    /// Tokens per KV block (engines and hashing).
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,
    /// Engine speed-up: every step's duration is divided by this.
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    pub speedup: f64,
    /// Arrival speed-up: arrival times are divided by this (2 replays a trace twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub arrival_speedup: f64,
    /// Mean arrival rate, requests per second: rescales a trace's arrivals (instead of
    /// --arrival-speedup) or sets the synthetic workload's Poisson rate (default 16); with
    /// `--synthetic agentic`, sessions started per second (default 1).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seed of every random choice (policies, synthetic workload).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Replay only the first N requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Directory for report.json and report.svg (created if missing).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Delay between an engine publishing KV events and the router applying them, ms (default
    /// about one engine step; report 0 and 100 too).
    #[arg(
        long,
        default_value_t = DEFAULT_EVENT_DELAY.as_secs_f64() * 1e3,
        allow_hyphen_values = true
    )]
    pub event_delay_ms: f64,
    /// Routers of each policy in front of the engines, the requests dealt round robin across
    /// them; each hears of the others' bookings --sync-delay-ms late (kvroute replicas over NATS).
    #[arg(long, default_value_t = 1)]
    pub router_replicas: usize,
    /// How late one router replica hears of another's bookings, ms.
    #[arg(
        long,
        default_value_t = DEFAULT_SYNC_DELAY.as_secs_f64() * 1e3,
        allow_hyphen_values = true
    )]
    pub sync_delay_ms: f64,
    /// Whether selector-backed router replicas prefer their own share of near-equal ranks.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub replica_spread: bool,
    /// Router-side queue: requests wait in the router while every worker's routed,
    /// not yet prefilled prompt tokens exceed this × --max-num-batched-tokens (off by default).
    #[arg(long, allow_hyphen_values = true)]
    pub queue_threshold: Option<f64>,
    /// Order of the queue: fcfs, lcfs or wspt (shortest prompt first, with aging).
    #[arg(long, default_value = "fcfs")]
    pub queue_policy: String,
    /// Also queue while every worker's routed, unfinished requests would fill more than this
    /// share of its KV pool (prompt + output tokens; off by default).
    #[arg(long)]
    pub queue_kv_threshold: Option<f64>,
    /// At most this many requests wait; more are shed.
    #[arg(long, default_value_t = 10_000)]
    pub queue_max_requests: usize,
    /// A request waits at most this long, ms, then is shed (default: no limit).
    #[arg(long, allow_hyphen_values = true)]
    pub queue_timeout_ms: Option<f64>,
    /// A request counts toward goodput when its TTFT is at most this, ms.
    #[arg(long, default_value_t = DEFAULT_TTFT_TARGET.as_secs_f64() * 1e3)]
    pub ttft_target_ms: f64,
    /// Keep only the requests of this tenant (agentic workload), e.g. to see what it gets alone.
    #[arg(long)]
    pub only_tenant: Option<u32>,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: u64,
    /// Most requests an engine runs at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Prefill step time a·T²+b·T+c ms for T uncached tokens: `a,b,c`.
    #[arg(
        long,
        allow_hyphen_values = true,
        value_name = "A,B,C",
        default_value = "4.209989e-7,1.518344e-2,16.50142"
    )]
    pub prefill_coefficients: String,
    /// Decode step time d·u²+e·u+f ms at KV usage u ∈ [0,1]: `d,e,f`.
    #[arg(
        long,
        allow_hyphen_values = true,
        value_name = "D,E,F",
        default_value = "-25.74,54.01,5.74"
    )]
    pub decode_coefficients: String,
    /// Floor of a decode step, ms.
    #[arg(long, default_value_t = 1.0)]
    pub decode_min_ms: f64,
    /// Decode step model: `fitted` (the --decode-coefficients curve over KV usage) or `batch`
    /// (grows with the decoding sequences and their context; --batch-decode-coefficients).
    #[arg(long, default_value = "fitted", value_name = "fitted|batch")]
    pub engine_model: String,
    /// Batch engine model: decode step base + per_seq·sequences + per_token·context tokens, ms:
    /// `base,per_seq,per_token` (default: vLLM, an 8B model, one H100; see crates/sim/README.md).
    #[arg(
        long,
        value_name = "BASE,PER_SEQ,PER_TOKEN",
        default_value = "6.5,0.03,2.6e-5"
    )]
    pub batch_decode_coefficients: String,
    /// Run the workload suite instead of one workload (see crates/sim/README.md).
    #[arg(long, conflicts_with_all = ["trace", "synthetic", "out"])]
    pub suite: bool,
    /// With --suite or --suite-pd: also run this Mooncake JSONL trace as the shape `trace`.
    #[arg(long, requires = "suites")]
    pub suite_trace: Option<PathBuf>,
    /// With --suite: directory for suite.json and suite.md; with --suite-pd, pd.json and pd.md
    /// (created if missing).
    #[arg(long, requires = "suites")]
    pub suite_out: Option<PathBuf>,
    /// With --suite or --suite-pd: only these shapes, comma-separated (default: all).
    #[arg(long, requires = "suites")]
    pub suite_shapes: Option<String>,
    /// With --suite: these load multipliers, comma-separated.
    #[arg(long, requires = "suite", default_value = "1,2,4,8")]
    pub suite_loads: String,
    /// With --suite: these router replica counts, comma-separated.
    #[arg(long, requires = "suite", default_value = "1,2")]
    pub suite_replicas: String,
    /// With --suite or --suite-pd: these engine models, comma-separated.
    #[arg(long, requires = "suites", default_value = "fitted,batch")]
    pub suite_engines: String,
    #[command(flatten)]
    pub pd: crate::sim_pd::PdArgs,
    /// Synthetic workload: tokens of each group's shared system prompt.
    #[arg(long, default_value_t = 4096)]
    pub system_prompt_tokens: usize,
    /// Synthetic workload: tokens of each prompt's own question.
    #[arg(long, default_value_t = 512)]
    pub question_tokens: usize,
    /// Synthetic workload: output tokens per request.
    #[arg(long, default_value_t = 256)]
    pub output_tokens: u64,
    /// `kvroute` policy: cache credit per device block hit (SPEC §6 `overlap_score_credit`).
    #[arg(long)]
    pub kvroute_overlap_score_credit: Option<f64>,
    /// `kvroute` policy: weight of the prefill term (SPEC §6 `prefill_load_scale`).
    #[arg(long)]
    pub kvroute_prefill_load_scale: Option<f64>,
    /// `kvroute` policy: cost per active request (SPEC §6 `decode_active_request_weight`).
    #[arg(long)]
    pub kvroute_decode_active_request_weight: Option<f64>,
    /// `kvroute` policy: softmax temperature of the pick (0 = lowest cost).
    #[arg(long)]
    pub kvroute_temperature: Option<f64>,
    /// `kvroute` policy: predict a booked prompt's blocks on the chosen worker until its events
    /// confirm them or the core's TTL (2 s) passes.
    #[arg(long)]
    pub kvroute_predict_blocks: Option<bool>,
    /// `kvroute-session-hard` / `-soft` policies: a session stays bound this many seconds after
    /// its last request ended.
    #[arg(long, default_value_t = DEFAULT_SESSION_TTL.as_secs_f64())]
    pub session_affinity_ttl_secs: f64,
    /// `kvroute-session-soft`: the bound worker is left when its cost exceeds this × the
    /// cheapest worker's (at least 1).
    #[arg(long, default_value_t = DEFAULT_SOFT_FACTOR)]
    pub session_affinity_soft_factor: f64,
    /// With --trace: a request without a `session_id` gets the session its first two 512-token
    /// blocks name (the FAST'25 traces record no sessions; see crates/sim/README.md).
    #[arg(long)]
    pub trace_sessions: bool,
    /// Policies simulated in parallel (default: the machine's cores).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Never draw progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

fn coefficients(knob: &str, text: &str) -> Result<[f64; 3], String> {
    let values: Result<Vec<f64>, _> = text.split(',').map(|v| v.trim().parse::<f64>()).collect();
    match values {
        Ok(v) if v.len() == 3 && v.iter().all(|x| x.is_finite()) => Ok([v[0], v[1], v[2]]),
        _ => Err(format!(
            "invalid --{knob}: expected three comma-separated numbers, got `{text}`"
        )),
    }
}

/// The engine model `name` with the flags' batch coefficients.
pub(crate) fn engine_model(name: &str, args: &SimArgs) -> Result<EngineModel, String> {
    match EngineModel::parse(name).map_err(|e| e.to_string())? {
        EngineModel::Fitted => Ok(EngineModel::Fitted),
        EngineModel::Batch(_) => {
            let [base_ms, per_sequence_ms, per_context_token_ms] =
                coefficients("batch-decode-coefficients", &args.batch_decode_coefficients)?;
            Ok(EngineModel::Batch(BatchDecode {
                base_ms,
                per_sequence_ms,
                per_context_token_ms,
            }))
        }
    }
}

/// The simulation configuration the flags describe.
pub fn sim_config(args: &SimArgs) -> Result<SimConfig, String> {
    let kv_blocks = match args.kv_blocks.trim() {
        "unlimited" | "inf" | "infinite" => None,
        n => Some(n.parse::<u64>().map_err(|_| {
            format!("invalid --kv-blocks: expected a number of blocks or `unlimited`, got `{n}`")
        })?),
    };
    if !(args.event_delay_ms.is_finite() && args.event_delay_ms >= 0.0) {
        return Err(format!(
            "invalid --event-delay-ms: must be a non-negative number, got {}",
            args.event_delay_ms
        ));
    }
    if !(args.sync_delay_ms.is_finite() && args.sync_delay_ms >= 0.0) {
        return Err(format!(
            "invalid --sync-delay-ms: must be a non-negative number, got {}",
            args.sync_delay_ms
        ));
    }
    let config = SimConfig {
        workers: args.workers,
        engine: EngineConfig {
            block_size: args.block_size,
            kv_blocks,
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_num_seqs: args.max_num_seqs,
            nominal_kv_blocks: DEFAULT_KV_BLOCKS,
            timing: TimingModel {
                prefill_coefficients: coefficients(
                    "prefill-coefficients",
                    &args.prefill_coefficients,
                )?,
                decode_coefficients: coefficients(
                    "decode-coefficients",
                    &args.decode_coefficients,
                )?,
                decode_min_ms: args.decode_min_ms,
                speedup: args.speedup,
                engine_model: engine_model(&args.engine_model, args)?,
            },
        },
        event_delay: Duration::from_secs_f64(args.event_delay_ms / 1e3),
        seed: args.seed,
        router_replicas: args.router_replicas,
        sync_delay: Duration::from_secs_f64(args.sync_delay_ms / 1e3),
        replica_spread: args.replica_spread,
        queue: match args.queue_threshold {
            None => None,
            Some(threshold) => Some(SimQueue {
                threshold,
                policy: args
                    .queue_policy
                    .parse()
                    .map_err(|e| format!("invalid --queue-policy: {e}"))?,
                max_requests: args.queue_max_requests,
                kv_threshold: args.queue_kv_threshold,
                timeout: match args.queue_timeout_ms {
                    None => None,
                    Some(ms) if ms.is_finite() && ms > 0.0 => {
                        Some(Duration::from_secs_f64(ms / 1e3))
                    }
                    Some(ms) => {
                        return Err(format!(
                            "invalid --queue-timeout-ms: must be a positive number, got {ms}"
                        ));
                    }
                },
            }),
        },
        ttft_target: if args.ttft_target_ms.is_finite() && args.ttft_target_ms > 0.0 {
            Duration::from_secs_f64(args.ttft_target_ms / 1e3)
        } else {
            return Err(format!(
                "invalid --ttft-target-ms: must be a positive number, got {}",
                args.ttft_target_ms
            ));
        },
    };
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

/// Reads or generates the workload the flags describe.
pub fn load_workload(args: &SimArgs) -> Result<Workload, String> {
    let mut workload = build_workload(args)?;
    if let Some(tenant) = args.only_tenant {
        workload.requests.retain(|r| r.tenant == Some(tenant));
        if workload.requests.is_empty() {
            return Err(format!(
                "invalid --only-tenant: no request of tenant {tenant} in the workload"
            ));
        }
        workload.name = format!("{} (tenant {tenant} only)", workload.name);
    }
    Ok(workload)
}

fn build_workload(args: &SimArgs) -> Result<Workload, String> {
    let arrival = ArrivalOptions {
        speedup: args.arrival_speedup,
        rate_rps: args.rate,
        max_requests: args.max_requests,
    };
    if let Some(path) = &args.trace {
        let file = std::fs::File::open(path)
            .map_err(|e| format!("cannot open trace {}: {e}", path.display()))?;
        let mut rows =
            parse_mooncake(BufReader::new(file)).map_err(|e| format!("{}: {e}", path.display()))?;
        if args.trace_sessions {
            sessions_by_opening(&mut rows);
        }
        return mooncake_workload(
            &path.display().to_string(),
            &rows,
            args.block_size,
            &arrival,
        )
        .map_err(|e| e.to_string());
    }
    let shape = args.synthetic.as_deref().unwrap_or(DEFAULT_SYNTHETIC);
    if let Some(spec) = AgenticSpec::parse(shape, args.seed) {
        let spec = spec.map_err(|e| e.to_string())?;
        return agentic_workload(&spec, args.block_size, &arrival).map_err(|e| e.to_string());
    }
    let (groups, prompts_per_group) =
        SyntheticSpec::parse_shape(shape).map_err(|e| e.to_string())?;
    let spec = SyntheticSpec {
        groups,
        prompts_per_group,
        system_prompt_tokens: args.system_prompt_tokens,
        question_tokens: args.question_tokens,
        output_tokens: args.output_tokens,
        seed: args.seed,
        ..SyntheticSpec::default()
    };
    synthetic_workload(&spec, args.block_size, &arrival).map_err(|e| e.to_string())
}

fn progress_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix:>20} [{bar:40}] {pos}/{len} requests {elapsed}")
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}

/// Runs the policies on up to `jobs` threads; results come back in the policies' order.
fn run_all(
    workload: &Workload,
    config: &SimConfig,
    policies: &[Policy],
    jobs: usize,
    show_progress: bool,
) -> Result<Vec<PolicyRun>, SimError> {
    let bars = MultiProgress::with_draw_target(if show_progress {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    });
    let total = workload.requests.len() as u64;
    let progress: Vec<ProgressBar> = policies
        .iter()
        .map(|p| {
            let bar = bars.add(ProgressBar::new(total));
            bar.set_style(progress_style());
            bar.set_prefix(p.name);
            bar
        })
        .collect();
    let origin = Instant::now();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<PolicyRun, SimError>>>> =
        Mutex::new(policies.iter().map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, policies.len().max(1)) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(policy) = policies.get(i) else {
                        break;
                    };
                    let bar = &progress[i];
                    let result = run_policy(workload, config, policy, origin, &mut |done| {
                        if done % 64 == 0 {
                            bar.set_position(done as u64);
                        }
                    });
                    bar.finish();
                    let mut slots = results.lock().unwrap_or_else(|e| e.into_inner());
                    slots[i] = Some(result);
                }
            });
        }
    });
    let _ = bars.clear();
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(SimError::Internal("a policy did not run".into()))))
        .collect()
}

/// The `kvroute` policy: its defaults with the `--kvroute-*` overrides, and the session
/// policies' `--session-affinity-*` settings.
pub fn kvroute_settings(args: &SimArgs) -> Result<SelectorPolicy, String> {
    let mut policy = kvroute_policy();
    let (ttl, factor) = (
        args.session_affinity_ttl_secs,
        args.session_affinity_soft_factor,
    );
    if !(ttl.is_finite() && ttl > 0.0 && ttl < 1e9) {
        return Err(format!(
            "invalid --session-affinity-ttl-secs: must be a number of seconds > 0, got {ttl}"
        ));
    }
    if !(factor.is_finite() && factor >= 1.0) {
        return Err(format!(
            "invalid --session-affinity-soft-factor: must be a number ≥ 1, got {factor}"
        ));
    }
    policy.session_ttl = Duration::from_secs_f64(ttl);
    policy.sessions.soft_factor = factor;
    let s = &mut policy.scheduler;
    if let Some(v) = args.kvroute_overlap_score_credit {
        s.overlap_score_credit = v;
    }
    if let Some(v) = args.kvroute_prefill_load_scale {
        s.prefill_load_scale = v;
    }
    if let Some(v) = args.kvroute_decode_active_request_weight {
        s.decode_active_request_weight = v;
    }
    if let Some(v) = args.kvroute_temperature {
        s.router_temperature = v;
    }
    if let Some(v) = args.kvroute_predict_blocks {
        policy.predicted_ttl = if v {
            PredictConfig::default().ttl
        } else {
            Duration::ZERO
        };
    }
    Ok(policy)
}

fn run_inner(args: &SimArgs) -> Result<(), String> {
    if args.pd.suite_pd {
        return crate::sim_pd::run_suite_pd_cmd(args);
    }
    if args.suite {
        return run_suite_cmd(args);
    }
    if args.pd.wanted() {
        return crate::sim_pd::run_pd_cmd(args);
    }
    let started = Instant::now();
    let config = sim_config(args)?;
    let kvroute = kvroute_settings(args)?;
    let policies = args.policies.as_deref().unwrap_or("all");
    let requested = resolve(policies, kvroute).map_err(|e| e.to_string())?;
    let (runnable, unavailable): (Vec<Policy>, Vec<Policy>) =
        requested.into_iter().partition(|p| p.unavailable.is_none());
    let unavailable: Vec<UnavailablePolicy> = unavailable
        .into_iter()
        .map(|p| UnavailablePolicy {
            name: p.name.to_string(),
            reason: p.unavailable.unwrap_or_default().to_string(),
        })
        .collect();
    if runnable.is_empty() {
        let names: Vec<&str> = unavailable.iter().map(|u| u.name.as_str()).collect();
        return Err(format!(
            "no runnable policy: {} {}",
            names.join(", "),
            unavailable
                .first()
                .map(|u| u.reason.as_str())
                .unwrap_or_default()
        ));
    }
    let workload = load_workload(args)?;
    let loaded = started.elapsed();
    let jobs = args.jobs.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let show_progress = !args.no_progress && std::io::stderr().is_terminal();
    let runs =
        run_all(&workload, &config, &runnable, jobs, show_progress).map_err(|e| e.to_string())?;
    let report = build_report(&workload, &config, &runs, unavailable);

    println!(
        "workload: {} — {} requests, {} prompt tokens; {} workers × {} KV blocks of {} tokens, \
         engine speed-up {}, event delay {} ms{}, seed {}",
        report.trace,
        report.requests,
        workload.prompt_tokens(),
        report.workers,
        report
            .kv_blocks
            .map_or_else(|| "unlimited".to_string(), |b| b.to_string()),
        report.block_size,
        report.speedup,
        report.event_delay_ms,
        if report.router_replicas > 1 {
            format!(
                ", {} router replicas (sync delay {} ms)",
                report.router_replicas, report.sync_delay_ms
            )
        } else {
            String::new()
        },
        report.seed
    );
    print!("{}", report.to_table());
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create --out {}: {e}", dir.display()))?;
        let json_path = dir.join("report.json");
        let svg_path = dir.join("report.svg");
        let json = report.to_json().map_err(|e| e.to_string())?;
        std::fs::write(&json_path, json)
            .map_err(|e| format!("cannot write {}: {e}", json_path.display()))?;
        let svg = render_svg(&report, &runs).map_err(|e| e.to_string())?;
        std::fs::write(&svg_path, svg)
            .map_err(|e| format!("cannot write {}: {e}", svg_path.display()))?;
        println!("wrote {} and {}", json_path.display(), svg_path.display());
    }
    eprintln!(
        "simulated {} policies in {:.1} s (workload built in {:.1} s)",
        runs.len(),
        started.elapsed().as_secs_f64(),
        loaded.as_secs_f64()
    );
    Ok(())
}

/// A comma-separated list of `what`, each parsed by `parse`.
pub(crate) fn list<T>(
    knob: &str,
    text: &str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let items: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() {
        return Err(format!("invalid --{knob}: empty list"));
    }
    items
        .into_iter()
        .map(|item| parse(item).map_err(|e| format!("invalid --{knob}: {e}")))
        .collect()
}

/// The suite the flags describe: shapes, loads, replicas, engine models and policies.
pub fn suite_options(args: &SimArgs) -> Result<SuiteOptions, String> {
    let selected = suite_shapes(args)?;
    let loads = list("suite-loads", &args.suite_loads, |l| {
        match l.parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(format!("a load must be a positive number, got `{l}`")),
        }
    })?;
    let replicas = list("suite-replicas", &args.suite_replicas, |r| {
        match r.parse::<usize>() {
            Ok(n) if (1..=64).contains(&n) => Ok(n),
            _ => Err(format!("replicas must be between 1 and 64, got `{r}`")),
        }
    })?;
    let engines = list("suite-engines", &args.suite_engines, |e| {
        engine_model(e, args)
    })?;
    let kvroute = kvroute_settings(args)?;
    let policies = resolve(
        args.policies.as_deref().unwrap_or(DEFAULT_POLICIES),
        kvroute,
    )
    .map_err(|e| e.to_string())?;
    if let Some(p) = policies.iter().find(|p| p.unavailable.is_some()) {
        return Err(format!(
            "policy {} is unavailable: {}",
            p.name,
            p.unavailable.unwrap_or_default()
        ));
    }
    Ok(SuiteOptions {
        shapes: selected,
        loads,
        replicas,
        engines,
        policies,
        base: sim_config(args)?,
    })
}

/// The suite's shapes the flags select (`--suite-shapes`, `--suite-trace`), in the suite's order.
pub(crate) fn suite_shapes(args: &SimArgs) -> Result<Vec<Box<dyn Shape>>, String> {
    let mut all_shapes = shapes();
    if let Some(path) = &args.suite_trace {
        let file = std::fs::File::open(path)
            .map_err(|e| format!("cannot open --suite-trace {}: {e}", path.display()))?;
        let rows =
            parse_mooncake(BufReader::new(file)).map_err(|e| format!("{}: {e}", path.display()))?;
        if rows.is_empty() {
            return Err(format!(
                "invalid --suite-trace: {} holds no request",
                path.display()
            ));
        }
        all_shapes.push(Box::new(TraceShape {
            source: path.display().to_string(),
            rows,
        }));
    }
    let selected: Vec<Box<dyn Shape>> = match &args.suite_shapes {
        None => all_shapes,
        Some(names) => {
            let names = list("suite-shapes", names, |n| Ok(n.to_string()))?;
            let known: Vec<String> = all_shapes.iter().map(|s| s.name().to_string()).collect();
            if let Some(unknown) = names.iter().find(|n| !known.contains(n)) {
                return Err(format!(
                    "invalid --suite-shapes: unknown shape `{unknown}` (known: {})",
                    known.join(", ")
                ));
            }
            all_shapes
                .into_iter()
                .filter(|s| names.iter().any(|n| n == s.name()))
                .collect()
        }
    };
    Ok(selected)
}

/// How many runs of a suite go at once: `--jobs`, else one per core.
pub(crate) fn suite_jobs(args: &SimArgs) -> usize {
    args.jobs.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    })
}

/// A suite's progress bar on stderr (hidden with `--no-progress` or off a terminal).
pub(crate) fn suite_progress(label: &str, total: usize, args: &SimArgs) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(total as u64),
        if !args.no_progress && std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{label} [{{bar:40}}] {{pos}}/{{len}} runs {{elapsed}}"
        ))
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

fn run_suite_cmd(args: &SimArgs) -> Result<(), String> {
    let started = Instant::now();
    let options = suite_options(args)?;
    let jobs = suite_jobs(args);
    let total = options.cells().len() * options.policies.len();
    let bar = suite_progress("suite", total, args);
    let cells = run_suite(&options, jobs, Instant::now(), &|done, _| {
        bar.set_position(done as u64)
    })
    .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    let report = SuiteReport::new(cells);
    let base = &options.base;
    let mut md = format!(
        "Workload suite: {} workers × {} KV blocks of {} tokens, event delay {} ms, replica          sync delay {} ms, seed {}; loads {:?}, replicas {:?}.

Shapes:
",
        base.workers,
        base.engine
            .kv_blocks
            .map_or_else(|| "unlimited".to_string(), |b| b.to_string()),
        base.engine.block_size,
        base.event_delay.as_secs_f64() * 1e3,
        base.sync_delay.as_secs_f64() * 1e3,
        base.seed,
        options.loads,
        options.replicas
    );
    for shape in &options.shapes {
        md.push_str(&format!(
            "- `{}`: {}
",
            shape.name(),
            shape.description()
        ));
    }
    md.push('\n');
    md.push_str(&report.to_markdown());
    print!("{md}");
    if let Some(dir) = &args.suite_out {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create --suite-out {}: {e}", dir.display()))?;
        let settings = serde_json::json!({
            "workers": base.workers,
            "kv_blocks": base.engine.kv_blocks,
            "block_size": base.engine.block_size,
            "event_delay_ms": base.event_delay.as_secs_f64() * 1e3,
            "sync_delay_ms": base.sync_delay.as_secs_f64() * 1e3,
            "seed": base.seed,
            "loads": options.loads,
            "replicas": options.replicas,
            "engines": options.engines.iter().map(|e| e.name()).collect::<Vec<_>>(),
            "policies": options.policies.iter().map(|p| p.name).collect::<Vec<_>>(),
            "shapes": options.shapes.iter().map(|s| serde_json::json!({
                "name": s.name(),
                "description": s.description(),
            })).collect::<Vec<_>>(),
        });
        let json = serde_json::json!({ "settings": settings, "suite": report });
        let mut text = serde_json::to_string_pretty(&json)
            .map_err(|e| format!("cannot serialise the suite: {e}"))?;
        text.push('\n');
        let json_path = dir.join("suite.json");
        let md_path = dir.join("suite.md");
        std::fs::write(&json_path, text)
            .map_err(|e| format!("cannot write {}: {e}", json_path.display()))?;
        std::fs::write(&md_path, &md)
            .map_err(|e| format!("cannot write {}: {e}", md_path.display()))?;
        println!("wrote {} and {}", json_path.display(), md_path.display());
    }
    eprintln!(
        "suite: {} runs in {:.1} s on {} threads",
        total,
        started.elapsed().as_secs_f64(),
        jobs.clamp(1, total.max(1))
    );
    Ok(())
}

pub fn run(args: &SimArgs) -> ExitCode {
    match run_inner(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("kvroute sim: {message}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn args(line: &[&str]) -> SimArgs {
        let mut argv = vec!["sim"];
        argv.extend_from_slice(line);
        Cli::try_parse_from(argv).unwrap().sim
    }

    #[test]
    fn flags_become_the_simulation_config() {
        let a = args(&[
            "--kv-blocks",
            "unlimited",
            "--workers",
            "3",
            "--speedup",
            "2",
            "--prefill-coefficients",
            "0,1,2",
            "--event-delay-ms",
            "5",
        ]);
        let c = sim_config(&a).unwrap();
        assert_eq!(c.engine.kv_blocks, None);
        assert_eq!(c.workers, 3);
        assert_eq!(c.engine.timing.speedup, 2.0);
        assert_eq!(c.engine.timing.prefill_coefficients, [0.0, 1.0, 2.0]);
        assert_eq!(c.event_delay, Duration::from_millis(5));
        assert_eq!(
            sim_config(&args(&[])).unwrap().engine.kv_blocks,
            Some(16_384)
        );
        // Events lag about one engine step unless told otherwise; 0 is still allowed.
        assert_eq!(
            sim_config(&args(&[])).unwrap().event_delay,
            Duration::from_millis(20)
        );
        assert_eq!(
            sim_config(&args(&["--event-delay-ms", "0"]))
                .unwrap()
                .event_delay,
            Duration::ZERO
        );
        // The router queue is off unless a threshold is given.
        assert_eq!(sim_config(&args(&[])).unwrap().queue, None);
        let q = sim_config(&args(&[
            "--queue-threshold",
            "1.5",
            "--queue-policy",
            "wspt",
            "--queue-timeout-ms",
            "250",
            "--queue-max-requests",
            "7",
            "--ttft-target-ms",
            "500",
        ]))
        .unwrap();
        assert_eq!(
            q.queue,
            Some(SimQueue {
                threshold: 1.5,
                policy: kvroute_core::admission::QueuePolicy::Wspt,
                max_requests: 7,
                timeout: Some(Duration::from_millis(250)),
                kv_threshold: None,
            })
        );
        assert_eq!(q.ttft_target, Duration::from_millis(500));
        for (bad, knob) in [
            (vec!["--kv-blocks", "lots"], "--kv-blocks"),
            (vec!["--kv-blocks", "0"], "--kv-blocks"),
            (vec!["--workers", "0"], "--workers"),
            (vec!["--speedup", "-1"], "--speedup"),
            (
                vec!["--decode-coefficients", "1,2"],
                "--decode-coefficients",
            ),
            (vec!["--event-delay-ms", "-3"], "--event-delay-ms"),
            (vec!["--queue-threshold", "-1"], "--queue-threshold"),
            (
                vec!["--queue-threshold", "1", "--queue-policy", "sjf"],
                "--queue-policy",
            ),
            (
                vec!["--queue-threshold", "1", "--queue-timeout-ms", "0"],
                "--queue-timeout-ms",
            ),
            (vec!["--ttft-target-ms", "0"], "--ttft-target-ms"),
            (vec!["--router-replicas", "0"], "--router-replicas"),
        ] {
            let err = sim_config(&args(&bad)).unwrap_err();
            assert!(err.contains(knob), "{err}");
        }
        assert!(Cli::try_parse_from(["sim", "--trace", "t.jsonl", "--synthetic", "2x2"]).is_err());
    }

    #[test]
    fn the_engine_model_flag_picks_the_decode_model() {
        assert_eq!(
            sim_config(&args(&[])).unwrap().engine.timing.engine_model,
            EngineModel::Fitted
        );
        let batch = sim_config(&args(&["--engine-model", "batch"])).unwrap();
        assert_eq!(
            batch.engine.timing.engine_model,
            EngineModel::Batch(BatchDecode::default())
        );
        let custom = sim_config(&args(&[
            "--engine-model",
            "batch",
            "--batch-decode-coefficients",
            "5,0.1,1e-5",
        ]))
        .unwrap();
        assert_eq!(
            custom.engine.timing.engine_model,
            EngineModel::Batch(BatchDecode {
                base_ms: 5.0,
                per_sequence_ms: 0.1,
                per_context_token_ms: 1e-5,
            })
        );
        let err = sim_config(&args(&["--engine-model", "gpu"])).unwrap_err();
        assert!(err.contains("--engine-model"), "{err}");
        let err = sim_config(&args(&[
            "--engine-model",
            "batch",
            "--batch-decode-coefficients",
            "1,-1,0",
        ]))
        .unwrap_err();
        assert!(err.contains("batch-decode-coefficients"), "{err}");
    }

    #[test]
    fn suite_flags_select_cells_and_policies() {
        let all = suite_options(&args(&["--suite"])).unwrap();
        assert_eq!(all.shapes.len(), 6);
        assert_eq!(all.loads, vec![1.0, 2.0, 4.0, 8.0]);
        assert_eq!(all.replicas, vec![1, 2]);
        assert_eq!(all.engines.len(), 2);
        assert_eq!(all.cells().len(), 6 * 4 * 2 * 2);
        let names: Vec<&str> = all.policies.iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "round_robin",
                "least_loaded",
                "cache_aware",
                "dynamo",
                "kvroute"
            ]
        );
        assert_eq!(all.base.event_delay, Duration::from_millis(20));
        assert_eq!(all.base.sync_delay, Duration::from_millis(5));
        let one = suite_options(&args(&[
            "--suite",
            "--suite-shapes",
            "no_reuse,hot_prompts",
            "--suite-loads",
            "2",
            "--suite-replicas",
            "1",
            "--suite-engines",
            "fitted",
            "--policies",
            "round_robin,kvroute",
        ]))
        .unwrap();
        let shapes: Vec<&str> = one.shapes.iter().map(|s| s.name()).collect();
        assert_eq!(shapes, ["hot_prompts", "no_reuse"], "the suite's order");
        assert_eq!(one.cells().len(), 2);
        assert_eq!(one.policies.len(), 2);
        for (bad, knob) in [
            (vec!["--suite-shapes", "bogus"], "--suite-shapes"),
            (vec!["--suite-loads", "0"], "--suite-loads"),
            (vec!["--suite-loads", ","], "--suite-loads"),
            (vec!["--suite-replicas", "0"], "--suite-replicas"),
            (vec!["--suite-engines", "gpu"], "engine-model"),
            (
                vec!["--suite-trace", "/nonexistent/t.jsonl"],
                "--suite-trace",
            ),
        ] {
            let mut line = vec!["--suite"];
            line.extend(bad);
            let err = suite_options(&args(&line)).err().unwrap();
            assert!(err.contains(knob), "{err}");
        }
        assert!(Cli::try_parse_from(["sim", "--suite-loads", "1"]).is_err());
        assert!(Cli::try_parse_from(["sim", "--suite", "--synthetic", "2x2"]).is_err());
    }

    #[test]
    fn a_suite_run_writes_its_tables_and_figures() {
        let dir = std::env::temp_dir().join(format!("kvroute-suite-cmd-{}", std::process::id()));
        let a = args(&[
            "--suite",
            "--suite-shapes",
            "no_reuse",
            "--suite-loads",
            "8",
            "--suite-replicas",
            "1",
            "--policies",
            "round_robin,kvroute",
            "--no-progress",
            "--suite-out",
            dir.to_str().unwrap(),
        ]);
        run_inner(&a).unwrap();
        let md = std::fs::read_to_string(dir.join("suite.md")).unwrap();
        assert!(md.contains("fitted / no_reuse / 8x / 1 replica"), "{md}");
        assert!(md.contains("Summary, batch engine model"), "{md}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("suite.json")).unwrap())
                .unwrap();
        let cells = json["suite"]["cells"].as_array().unwrap();
        assert_eq!(cells.len(), 2, "two engine models");
        assert_eq!(cells[0]["policies"][1]["policy"], "kvroute");
        assert_eq!(json["suite"]["summaries"].as_array().unwrap().len(), 2);
        assert_eq!(json["settings"]["workers"], 8);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kvroute_overrides_apply_to_the_kvroute_policy_only() {
        let a = args(&[
            "--kvroute-prefill-load-scale",
            "3",
            "--kvroute-predict-blocks",
            "false",
        ]);
        let k = kvroute_settings(&a).unwrap();
        assert_eq!(k.scheduler.prefill_load_scale, 3.0);
        assert_eq!(k.predicted_ttl, Duration::ZERO);
        assert_eq!(kvroute_settings(&args(&[])), Ok(kvroute_policy()));
    }

    /// Defaults: one source of truth. `kvroute serve` with no flags, `kvroute.SelectionService()`
    /// (its `config_from` starts from `ServeConfig::defaults()` and validates it) and
    /// `kvroute sim --policies kvroute` all run core's default; `--router-profile dynamo` and the
    /// sim's `dynamo` policy run core's Dynamo profile.
    #[test]
    fn serve_python_and_sim_take_their_defaults_from_core() {
        use kvroute_core::schedule::{RouterProfile, SchedulerConfig};
        use kvroute_core::selector::SelectorConfig;
        use kvroute_service::ServeConfig;
        use kvroute_sim::policy::PolicyKind;

        let serve = ServeConfig::parse_from(["kvroute"]).unwrap().validate();
        let python = ServeConfig::defaults().validate();
        assert_eq!(serve, Ok(SelectorConfig::default()));
        assert_eq!(python, Ok(SelectorConfig::default()));
        let scheduler_of = |name: &str| {
            let policies = resolve(name, kvroute_settings(&args(&[])).unwrap()).unwrap();
            match policies[0].kind {
                PolicyKind::Selector(p) => p.scheduler,
                ref other => panic!("{name} is {other:?}"),
            }
        };
        assert_eq!(scheduler_of("kvroute"), SchedulerConfig::default());
        assert_eq!(SchedulerConfig::default().profile, RouterProfile::Kvroute);

        let dynamo = SelectorConfig::for_profile(RouterProfile::Dynamo);
        let serve = ServeConfig::parse_from(["kvroute", "--router-profile", "dynamo"])
            .unwrap()
            .validate();
        let mut python = ServeConfig::defaults();
        python.router_profile = RouterProfile::Dynamo;
        assert_eq!(serve, Ok(dynamo));
        assert_eq!(python.validate(), Ok(dynamo));
        assert_eq!(scheduler_of("dynamo"), dynamo.scheduler);
    }

    #[test]
    fn a_synthetic_run_writes_identical_reports_for_the_same_seed() {
        let dir = std::env::temp_dir().join(format!("kvroute-sim-cmd-{}", std::process::id()));
        let run_once = |sub: &str| {
            let out = dir.join(sub);
            let a = args(&[
                "--synthetic",
                "3x4",
                "--workers",
                "2",
                "--system-prompt-tokens",
                "300",
                "--question-tokens",
                "40",
                "--output-tokens",
                "5",
                "--policies",
                "round_robin,dynamo,kvroute-approx-ttl",
                "--no-progress",
                "--out",
                out.to_str().unwrap(),
            ]);
            run_inner(&a).unwrap();
            assert!(out.join("report.svg").exists());
            std::fs::read_to_string(out.join("report.json")).unwrap()
        };
        let first = run_once("a");
        assert_eq!(first, run_once("b"));
        let report: serde_json::Value = serde_json::from_str(&first).unwrap();
        assert_eq!(report["policies"].as_array().unwrap().len(), 3);
        assert_eq!(report["policies"][2]["name"], "kvroute-approx-ttl");
        assert_eq!(report["requests"], 12);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn synthetic_agentic_builds_the_seeded_agentic_workload() {
        let w =
            load_workload(&args(&["--synthetic", "agentic:sessions=6", "--seed", "4"])).unwrap();
        assert!(w.name.contains("agentic"), "{}", w.name);
        assert!(w.requests.iter().all(|r| r.session_id.is_some()));
        assert_eq!(
            w,
            load_workload(&args(&["--synthetic", "agentic:sessions=6", "--seed", "4"])).unwrap()
        );
        assert_ne!(
            w,
            load_workload(&args(&["--synthetic", "agentic:sessions=6", "--seed", "5"])).unwrap()
        );
        let err = load_workload(&args(&["--synthetic", "agentic:bogus=1"])).unwrap_err();
        assert!(err.contains("bogus"), "{err}");
        // Tenants: tenant 0 gets `tenant-skew` times the others' sessions; --only-tenant keeps
        // one tenant's requests, at the same arrival times.
        let shape = [
            "--synthetic",
            "agentic:tenants=2,tenant-skew=4,sessions=200",
        ];
        let both = load_workload(&args(&shape)).unwrap();
        let count = |t| both.requests.iter().filter(|r| r.tenant == Some(t)).count();
        assert!(count(0) > 3 * count(1), "{} vs {}", count(0), count(1));
        let only = load_workload(&args(&[shape[0], shape[1], "--only-tenant", "1"])).unwrap();
        assert_eq!(only.requests.len(), count(1));
        let arrivals: Vec<_> = both
            .requests
            .iter()
            .filter(|r| r.tenant == Some(1))
            .map(|r| r.arrival_nanos)
            .collect();
        assert_eq!(
            only.requests
                .iter()
                .map(|r| r.arrival_nanos)
                .collect::<Vec<_>>(),
            arrivals
        );
        let err = load_workload(&args(&[shape[0], shape[1], "--only-tenant", "9"])).unwrap_err();
        assert!(err.contains("--only-tenant"), "{err}");
    }
}
