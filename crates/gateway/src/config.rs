//! The gateway's own flags (`kvroute gateway` takes every `kvroute serve` flag besides these),
//! each also a `KVROUTE_*` environment variable, and their validation.

use crate::breaker::BreakerConfig;
use crate::tokenize::{TokenizeMode, parse_tokenizer_flag};
use crate::workers::{WorkerEntry, parse_role_flag, parse_worker_flag};
use clap::Args;
use kvroute_core::selector::WorkerRole;
use std::path::PathBuf;
use std::time::Duration;

/// `--gateway-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GatewayPolicy {
    /// The selector's choice (the service's `--router-profile` and knobs).
    #[default]
    Kvroute,
    /// Each model's schedulable workers in turn, whatever they cache (booked all the same).
    RoundRobin,
}

/// `--pd-protocol`: how a disaggregated request's two legs are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PdProtocol {
    /// vLLM's NixlConnector: the prefill leg first (`max_tokens: 1`, `kv_transfer_params`
    /// asking for a remote decode), then the decode leg with the prefill's answer's
    /// `kv_transfer_params`.
    Vllm,
    /// SGLang's `--disaggregation-mode`: the same body, with `bootstrap_host`,
    /// `bootstrap_port` and `bootstrap_room`, to both legs at once.
    Sglang,
}

#[derive(Debug, Clone, Args)]
pub struct GatewayArgs {
    /// A worker: `URL` (an OpenAI-compatible server, e.g. `http://10.0.0.1:8000`, whose cache
    /// kvroute predicts from its bookings) or `URL=tcp://HOST:PORT` (one that publishes KV
    /// events there). Repeatable.
    #[arg(long = "worker", value_name = "URL[=tcp://HOST:PORT]")]
    pub workers: Vec<String>,
    /// A prefill worker of disaggregated serving (with --pd-protocol): `--worker`'s syntax,
    /// then `@PORT` for an SGLang prefill worker's bootstrap port. Repeatable.
    #[arg(
        long = "prefill",
        value_name = "URL[=tcp://HOST:PORT][@BOOTSTRAP_PORT]"
    )]
    pub prefill_workers: Vec<String>,
    /// A decode worker of disaggregated serving (with --pd-protocol): `--worker`'s syntax.
    /// Repeatable.
    #[arg(long = "decode", value_name = "URL[=tcp://HOST:PORT]")]
    pub decode_workers: Vec<String>,
    /// Serve requests disaggregated: each one's prefill on a prefill worker and its decode on
    /// a decode worker, in vLLM's or SGLang's protocol (short or cached prompts run whole on a
    /// decode worker: `--pd-bypass-tokens`).
    #[arg(long, env = "KVROUTE_PD_PROTOCOL", value_enum)]
    pub pd_protocol: Option<PdProtocol>,
    /// The KV block size of the `--worker` workers (vLLM's `--block-size`).
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// The engines' `--max-num-batched-tokens` for the `--worker` workers (and the workers file's
    /// default): their prefill budget per step, which `--queue-threshold` multiplies. Required
    /// with the admission queue.
    #[arg(long, env = "KVROUTE_MAX_NUM_BATCHED_TOKENS")]
    pub max_num_batched_tokens: Option<u64>,
    /// How the gateway picks a worker: `kvroute` (the selector: cached prefix against load) or
    /// `round-robin` (each model's schedulable workers in turn, for comparison; no tokenizing).
    #[arg(long, env = "KVROUTE_GATEWAY_POLICY", value_enum, default_value_t = GatewayPolicy::Kvroute)]
    pub gateway_policy: GatewayPolicy,
    /// The model of the `--worker` workers: the `model` field of the requests they serve.
    #[arg(long, env = "KVROUTE_MODEL", default_value = "default")]
    pub model: String,
    /// A TOML file of workers, read again whenever it changes (see the README).
    #[arg(long, env = "KVROUTE_WORKERS_FILE")]
    pub workers_file: Option<PathBuf>,
    /// How often the workers file is looked at, in milliseconds.
    #[arg(long, env = "KVROUTE_WORKERS_FILE_POLL_MS", default_value_t = 1000)]
    pub workers_file_poll_ms: u64,
    /// A model's tokenizer: `MODEL=PATH`, PATH a `tokenizer.json` or the directory holding it
    /// (its `tokenizer_config.json` gives the chat template). Repeatable.
    #[arg(long = "tokenizer", value_name = "MODEL=PATH")]
    pub tokenizers: Vec<String>,
    /// `local`: with the --tokenizer files, models without one are routed by load only;
    /// `remote`: models without one are tokenized by a worker's `POST /tokenize` (vLLM).
    #[arg(long, env = "KVROUTE_TOKENIZE", value_enum, default_value_t = TokenizeMode::Local)]
    pub tokenize: TokenizeMode,
    /// The key sent to the workers as `Authorization: Bearer <key>` (vLLM's `--api-key`).
    #[arg(long, env = "KVROUTE_UPSTREAM_API_KEY")]
    pub upstream_api_key: Option<String>,
    /// Send the client's own `Authorization` header to the workers (never by default; it is
    /// ignored when --upstream-api-key is set).
    #[arg(
        long,
        env = "KVROUTE_FORWARD_CLIENT_AUTHORIZATION",
        default_value_t = false
    )]
    pub forward_client_authorization: bool,
    /// Longest a request may take from dispatch to its last byte, in seconds.
    #[arg(long, env = "KVROUTE_REQUEST_TIMEOUT_SECS", default_value_t = 600.0)]
    pub request_timeout_secs: f64,
    /// Longest a streamed request may wait for its first token, in seconds.
    #[arg(long, env = "KVROUTE_FIRST_TOKEN_TIMEOUT_SECS", default_value_t = 60.0)]
    pub first_token_timeout_secs: f64,
    /// Longest a connection to a worker may take to open, in milliseconds.
    #[arg(long, env = "KVROUTE_CONNECT_TIMEOUT_MS", default_value_t = 1000)]
    pub connect_timeout_ms: u64,
    /// How many other workers a request tries after a connection failure.
    #[arg(long, env = "KVROUTE_CONNECT_RETRIES", default_value_t = 2)]
    pub connect_retries: u32,
    /// Consecutive failures that open a worker's circuit breaker.
    #[arg(long, env = "KVROUTE_BREAKER_FAILURES", default_value_t = 3)]
    pub breaker_failures: u32,
    /// How long an open breaker keeps its worker out before one probe request, in seconds.
    #[arg(long, env = "KVROUTE_BREAKER_OPEN_SECS", default_value_t = 10.0)]
    pub breaker_open_secs: f64,
    /// How often each worker's `GET /health` is checked, in seconds; 0 turns checks off.
    #[arg(long, env = "KVROUTE_HEALTH_CHECK_SECS", default_value_t = 5.0)]
    pub health_check_secs: f64,
    /// A request header that names the request's session (session affinity, with
    /// --session-affinity-ttl-secs); the first one present counts, the body's `session_id`
    /// wins over all. Repeatable; replaces the defaults (aiperf's and inference-perf's).
    #[arg(
        long = "session-header",
        value_name = "NAME",
        default_values_t = ["X-Correlation-ID".to_string(), "x-session-id".to_string()]
    )]
    pub session_headers: Vec<String>,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub workers: Vec<WorkerEntry>,
    /// `None`: every request runs whole on one worker.
    pub pd_protocol: Option<PdProtocol>,
    pub default_model: String,
    pub block_size: u32,
    pub max_num_batched_tokens: Option<u64>,
    pub policy: GatewayPolicy,
    pub workers_file: Option<PathBuf>,
    pub workers_file_poll: Duration,
    pub tokenizers: Vec<(String, PathBuf)>,
    pub tokenize: TokenizeMode,
    pub upstream_authorization: Option<String>,
    pub forward_client_authorization: bool,
    pub request_timeout: Duration,
    pub first_token_timeout: Duration,
    pub connect_timeout: Duration,
    pub connect_retries: u32,
    pub breaker: BreakerConfig,
    /// `None`: no health checks.
    pub health_check_every: Option<Duration>,
    /// Headers naming a request's session, in order (`--session-header`).
    pub session_headers: Vec<axum::http::HeaderName>,
}

fn seconds(name: &str, value: f64, zero_ok: bool) -> Result<Duration, String> {
    let ok = value.is_finite() && value < 1e7 && (value > 0.0 || (zero_ok && value == 0.0));
    if ok {
        Ok(Duration::from_secs_f64(value))
    } else if zero_ok {
        Err(format!(
            "--{name} must be a number of seconds ≥ 0 (got {value})"
        ))
    } else {
        Err(format!(
            "--{name} must be a number of seconds > 0 (got {value})"
        ))
    }
}

fn millis(name: &str, value: u64) -> Result<Duration, String> {
    if (1..=86_400_000).contains(&value) {
        Ok(Duration::from_millis(value))
    } else {
        Err(format!(
            "--{name} must be a number of milliseconds from 1 to 86400000 (got {value})"
        ))
    }
}

impl GatewayArgs {
    pub fn validate(&self) -> Result<GatewayConfig, String> {
        if self.block_size == 0 {
            return Err("--block-size must be at least 1".to_string());
        }
        if self.model.is_empty() {
            return Err("--model must not be empty".to_string());
        }
        let workers = self
            .workers
            .iter()
            .map(|raw| {
                parse_worker_flag(raw, &self.model, self.block_size)
                    .map(|w| WorkerEntry {
                        max_num_batched_tokens: self.max_num_batched_tokens,
                        ..w
                    })
                    .map_err(|e| format!("--worker {raw}: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut workers = workers;
        for (flag, role, raws) in [
            ("--prefill", WorkerRole::Prefill, &self.prefill_workers),
            ("--decode", WorkerRole::Decode, &self.decode_workers),
        ] {
            if !raws.is_empty() && self.pd_protocol.is_none() {
                return Err(format!("{flag} needs --pd-protocol vllm or sglang"));
            }
            for raw in raws {
                let worker = parse_role_flag(raw, role, &self.model, self.block_size)
                    .map_err(|e| format!("{flag} {raw}: {e}"))?;
                workers.push(WorkerEntry {
                    max_num_batched_tokens: self.max_num_batched_tokens,
                    ..worker
                });
            }
        }
        let tokenizers = self
            .tokenizers
            .iter()
            .map(|raw| parse_tokenizer_flag(raw).map_err(|e| format!("--tokenizer: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        if self.breaker_failures == 0 {
            return Err("--breaker-failures must be at least 1".to_string());
        }
        if self.connect_retries > 16 {
            return Err(format!(
                "--connect-retries must be at most 16 (got {})",
                self.connect_retries
            ));
        }
        if self
            .upstream_api_key
            .as_deref()
            .is_some_and(|k| k.is_empty() || k.contains(['\r', '\n']))
        {
            return Err("--upstream-api-key must be a non-empty single line".to_string());
        }
        let health = seconds("health-check-secs", self.health_check_secs, true)?;
        let session_headers = self
            .session_headers
            .iter()
            .map(|name| {
                axum::http::HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| format!("--session-header {name:?} is not a valid header name"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GatewayConfig {
            workers,
            pd_protocol: self.pd_protocol,
            default_model: self.model.clone(),
            block_size: self.block_size,
            max_num_batched_tokens: self.max_num_batched_tokens,
            policy: self.gateway_policy,
            workers_file: self.workers_file.clone(),
            workers_file_poll: millis("workers-file-poll-ms", self.workers_file_poll_ms)?,
            tokenizers,
            tokenize: self.tokenize,
            upstream_authorization: self
                .upstream_api_key
                .as_ref()
                .map(|k| format!("Bearer {k}")),
            forward_client_authorization: self.forward_client_authorization,
            request_timeout: seconds("request-timeout-secs", self.request_timeout_secs, false)?,
            first_token_timeout: seconds(
                "first-token-timeout-secs",
                self.first_token_timeout_secs,
                false,
            )?,
            connect_timeout: millis("connect-timeout-ms", self.connect_timeout_ms)?,
            connect_retries: self.connect_retries,
            breaker: BreakerConfig {
                failure_threshold: self.breaker_failures,
                open_for: seconds("breaker-open-secs", self.breaker_open_secs, false)?,
            },
            health_check_every: (!health.is_zero()).then_some(health),
            session_headers,
        })
    }

    /// Parses the flags from arguments (tests).
    pub fn parse_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        kvroute_service::config::parse_args(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validate(args: &[&str]) -> Result<GatewayConfig, String> {
        let mut all = vec!["kvroute"];
        all.extend_from_slice(args);
        GatewayArgs::parse_from(all).unwrap().validate()
    }

    #[test]
    fn defaults_and_workers_from_flags() {
        let config = validate(&[
            "--worker",
            "http://127.0.0.1:8001",
            "--worker=http://127.0.0.1:8002=tcp://127.0.0.1:5557",
            "--model",
            "llama",
            "--block-size",
            "32",
        ])
        .unwrap();
        assert_eq!(config.workers.len(), 2);
        assert_eq!(config.workers[0].url, "http://127.0.0.1:8001");
        assert_eq!(config.workers[0].kv_events, None);
        assert_eq!(
            config.workers[1].kv_events.as_deref(),
            Some("tcp://127.0.0.1:5557")
        );
        assert!(
            config
                .workers
                .iter()
                .all(|w| w.model == "llama" && w.block_size == 32)
        );
        assert_eq!(config.request_timeout, Duration::from_secs(600));
        assert_eq!(config.pd_protocol, None);
        let pd = validate(&[
            "--pd-protocol",
            "sglang",
            "--prefill",
            "http://127.0.0.1:8001=tcp://127.0.0.1:5601@9001",
            "--decode",
            "http://127.0.0.1:8002",
        ])
        .unwrap();
        assert_eq!(pd.pd_protocol, Some(PdProtocol::Sglang));
        let roles: Vec<_> = pd
            .workers
            .iter()
            .map(|w| (w.role, w.bootstrap_port))
            .collect();
        assert_eq!(
            roles,
            [
                (WorkerRole::Prefill, Some(9001)),
                (WorkerRole::Decode, None)
            ]
        );
        assert_eq!(config.health_check_every, Some(Duration::from_secs(5)));
        assert!(config.upstream_authorization.is_none());
    }

    #[test]
    fn bad_values_are_named() {
        assert_eq!(
            validate(&["--block-size", "0"]).unwrap_err(),
            "--block-size must be at least 1"
        );
        assert!(
            validate(&["--worker", "ftp://x"])
                .unwrap_err()
                .starts_with("--worker ftp://x:")
        );
        assert!(
            validate(&["--request-timeout-secs", "0"])
                .unwrap_err()
                .contains("--request-timeout-secs")
        );
        assert!(
            validate(&["--health-check-secs", "0"])
                .unwrap()
                .health_check_every
                .is_none()
        );
        assert!(
            validate(&["--tokenizer", "x"])
                .unwrap_err()
                .contains("MODEL=PATH")
        );
        assert!(validate(&["--upstream-api-key", ""]).is_err());
        assert_eq!(
            validate(&["--prefill", "http://h:1"]).unwrap_err(),
            "--prefill needs --pd-protocol vllm or sglang"
        );
        assert!(
            validate(&["--pd-protocol", "vllm", "--decode", "http://h:1@8998"])
                .unwrap_err()
                .starts_with("--decode http://h:1@8998:")
        );
        assert_eq!(
            validate(&["--upstream-api-key", "k"])
                .unwrap()
                .upstream_authorization
                .as_deref(),
            Some("Bearer k")
        );
    }
}
