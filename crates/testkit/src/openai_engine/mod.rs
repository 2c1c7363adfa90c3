//! A mock OpenAI-compatible engine (`kvroute fake-engine --openai`): the simulator's engine model
//! behind vLLM's HTTP routes, so a gateway's whole path runs without a GPU and time to first
//! token reflects cache hits as on a real engine.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use kvroute_testkit::openai_engine::{MockEngine, MockEngineConfig};
//! let config = MockEngineConfig {
//!     events_bind: Some("tcp://127.0.0.1:0".to_string()),
//!     ..MockEngineConfig::default()
//! };
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let engine = MockEngine::start(config, listener).await?;
//! // POST http://{engine.addr()}/v1/completions; KV events on engine.events_endpoint().
//! engine.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! ## What it serves (vLLM's shapes; `protocol.rs` has them)
//! `POST /v1/completions` and `POST /v1/chat/completions` (`n` choices, `tools` accepted),
//! streaming (SSE, usage on the last chunk with `stream_options.include_usage`) or not, with
//! `usage.prompt_tokens_details.cached_tokens` (`null` with `prompt_tokens_details: false`, as
//! vLLM without `--enable-prompt-tokens-details`); `POST /v1/responses` (OpenAI's Responses API,
//! its `event:` stream included: `responses.rs`); `POST /tokenize`, `POST /detokenize`,
//! `GET /health`, `GET /v1/models` (`owned_by` `vllm`, or `sglang` for an engine speaking
//! SGLang's P/D protocol, as routers that detect the engine read it), `GET /metrics` (vLLM's
//! running/waiting/KV-usage gauges and its request, prompt-token and prefix-cache counters).
//! Every answer is `max_tokens` tokens long (default 16), as with `ignore_eos`.
//!
//! ## The model
//! - **Engine**: a [`kvroute_sim::Engine`] (KV pool with prefix caching and LRU eviction,
//!   vLLM-v1 scheduling with chunked prefill, the fitted step time) driven in real time by one
//!   task, `engine_loop`: each step sleeps its modelled duration × `time_scale`, then streams
//!   each request's new token. A repeated prompt is served from the cache, so its first token
//!   comes sooner.
//! - **Tokens**: `tokenizer` (the built-in byte-level one, or a HuggingFace `tokenizer.json`);
//!   chat messages are rendered with a built-in template. `/tokenize` calls the same code as the
//!   generation routes, so it answers with exactly the ids the engine caches.
//! - **KV events**: with `events_bind`, every step's `BlockStored` / `BlockRemoved` go out as
//!   one vLLM batch on a ZeroMQ PUB socket ([`crate::fake_engine::FakeEngine`]), each stored
//!   block with its tokens and named by kvroute's sequence hash of them: a router hashing the
//!   prompt at `block_size` finds this engine's blocks.
//!
//! ## Faults and counters, for tests
//! [`MockEngine::kill`] (every connection dropped at once, new ones refused, the engine and its
//! PUB socket stopped), [`MockEngine::set_unhealthy`], [`MockEngine::set_first_token_delay`],
//! [`MockEngine::set_prompt_prefix_tokens`] (a prompt prefix the router does not know),
//! [`MockEngine::requests_served`], [`MockEngine::in_flight`], [`MockEngine::recent_requests`].
//!
//! ## Disaggregated prefill and decode
//! With [`PdConfig`] of role `prefill` or `decode`, the engine is one leg of a P/D pair in
//! vLLM's (`kv_transfer_params`) or SGLang's (bootstrap rooms) protocol: a prefill holds its
//! prompt's blocks until a decode engine pulls them over HTTP (`disagg.rs` has the protocol).
//!
//! Files: `disagg.rs` (P/D legs, held blocks, the pull routes), `engine_loop.rs` (the real-time
//! loop and its KV events), `generate.rs` (the generation routes, streaming), `responses.rs` (the
//! Responses API's shapes), `http.rs` (the other routes, the server and its connections),
//! `protocol.rs` (the JSON), `tokenizer.rs`.

mod disagg;
mod engine_loop;
mod generate;
mod http;
mod protocol;
mod responses;
pub mod tokenizer;

use crate::fake_engine::FakeEngine;
use engine_loop::{EngineLoop, Publisher};
use kvroute_sim::EngineConfig;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub use disagg::{
    DEFAULT_BOOTSTRAP_PORT, DEFAULT_FETCH_TIMEOUT, DEFAULT_HOLD_TIMEOUT,
    DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_KV_TRANSFER_GBPS, PdConfig, PdProtocol, PdRole,
};
pub use tokenizer::MockTokenizer;

/// KV blocks of the default pool: 65,536 blocks of 16 tokens, the simulator's default capacity
/// (16,384 blocks of 64) in vLLM's block size.
pub const DEFAULT_KV_BLOCKS: u64 = 65_536;

/// How long [`MockEngine::shutdown`] lets open responses finish before dropping them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How many served requests [`MockEngine::recent_requests`] keeps.
pub const RECENT_REQUESTS: usize = 1_024;

/// The mock engine's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct MockEngineConfig {
    /// The served model name (`/v1/models`; requests naming another get a 404).
    pub model: String,
    /// Tokens per KV block (vLLM's default 16). It overrides `engine.block_size`.
    pub block_size: u32,
    /// A HuggingFace `tokenizer.json`; `None` is the built-in byte-level tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// The ZeroMQ PUB endpoint of the KV events (`tcp://127.0.0.1:5557`; port 0 picks one);
    /// `None` publishes nothing.
    pub events_bind: Option<String>,
    /// The events' msgpack layout: vLLM's older array form or its newer map form.
    pub events_encoding: kvroute_wire::Encoding,
    /// The simulated engine: pool size, step budget, batch size, timing model.
    pub engine: EngineConfig,
    /// Real seconds per modelled second: 1.0 is the modelled pace, 0.1 ten times faster, 0
    /// as fast as the machine goes.
    pub time_scale: f64,
    /// The context length (`/v1/models`, `/tokenize`; longer requests get a 400).
    pub max_model_len: u32,
    /// Output tokens of a request without `max_tokens`.
    pub default_max_tokens: u32,
    /// Tokens the engine puts before every prompt it generates from (not in `/tokenize`'s
    /// answer), as a chat template or system prompt the router does not know would: its
    /// `usage.prompt_tokens` and its KV blocks then differ from what a router computes, which
    /// the router should report (`tokenizer_mismatch`). 0 by default;
    /// [`MockEngine::set_prompt_prefix_tokens`] changes it while running.
    pub prompt_prefix_tokens: u32,
    /// Report `usage.prompt_tokens_details.cached_tokens`, as vLLM does with
    /// `--enable-prompt-tokens-details` (the default here); `false`: `null`, vLLM's default.
    pub prompt_tokens_details: bool,
    /// Disaggregated prefill/decode: the role, the protocol and the transfer's model.
    pub pd: PdConfig,
}

impl Default for MockEngineConfig {
    fn default() -> Self {
        Self {
            model: "default".to_string(),
            block_size: 16,
            tokenizer: None,
            events_bind: None,
            events_encoding: kvroute_wire::Encoding::Array,
            engine: EngineConfig {
                block_size: 16,
                kv_blocks: Some(DEFAULT_KV_BLOCKS),
                nominal_kv_blocks: DEFAULT_KV_BLOCKS,
                ..EngineConfig::default()
            },
            time_scale: 1.0,
            max_model_len: 32_768,
            default_max_tokens: 16,
            prompt_prefix_tokens: 0,
            prompt_tokens_details: true,
            pd: PdConfig::default(),
        }
    }
}

impl MockEngineConfig {
    /// The engine configuration in force (`block_size` applied), or what is wrong.
    pub fn validated_engine(&self) -> Result<EngineConfig, String> {
        if self.model.is_empty() {
            return Err("the model name must not be empty".to_string());
        }
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return Err(format!(
                "time scale must be a non-negative number, got {}",
                self.time_scale
            ));
        }
        if self.max_model_len == 0 || self.default_max_tokens == 0 {
            return Err("max_model_len and default_max_tokens must be at least 1".to_string());
        }
        self.pd.validate()?;
        let engine = EngineConfig {
            block_size: self.block_size,
            ..self.engine
        };
        engine.validate().map_err(|e| e.to_string())?;
        Ok(engine)
    }
}

/// One request the engine finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedRequest {
    /// The response's `id` (`cmpl-…` or `chatcmpl-…`).
    pub id: String,
    pub prompt_tokens: u64,
    /// Prompt tokens served from the KV cache (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// From the request's arrival to its first token, first-token delay included.
    pub time_to_first_token: Duration,
    /// From its arrival to its last token.
    pub latency: Duration,
}

/// What the routes, the engine loop and the handle share.
pub(crate) struct Shared {
    /// Set before the kill signal goes out: a response whose engine stopped for this reason
    /// never ends (its connection is about to be dropped), rather than racing to end cleanly.
    killed: AtomicBool,
    unhealthy: AtomicBool,
    first_token_delay_nanos: AtomicU64,
    prompt_prefix_tokens: std::sync::atomic::AtomicU32,
    served: AtomicU64,
    /// Prompt tokens of the requests served, and those of them served from the KV cache
    /// (`GET /metrics`: vLLM's `prompt_tokens` and `prefix_cache_hits` counters).
    prompt_tokens_served: AtomicU64,
    cached_tokens_served: AtomicU64,
    in_flight: AtomicUsize,
    event_batches: AtomicU64,
    recent: Mutex<VecDeque<ServedRequest>>,
    next_request: AtomicU64,
    /// The engine loop's latest load, served by `GET /metrics`.
    load: EngineLoadGauges,
    /// Makes response ids differ between engines and runs.
    nonce: u64,
    /// Blocks a prefill engine holds for decode engines.
    transfers: disagg::Transfers,
}

impl Shared {
    fn new() -> Self {
        let nonce = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            killed: AtomicBool::new(false),
            unhealthy: AtomicBool::new(false),
            first_token_delay_nanos: AtomicU64::new(0),
            prompt_prefix_tokens: std::sync::atomic::AtomicU32::new(0),
            served: AtomicU64::new(0),
            prompt_tokens_served: AtomicU64::new(0),
            cached_tokens_served: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            event_batches: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::new()),
            next_request: AtomicU64::new(0),
            load: EngineLoadGauges::default(),
            nonce,
            transfers: disagg::Transfers::default(),
        }
    }

    fn request_id(&self, prefix: &str) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:016x}{n:016x}", self.nonce)
    }

    fn prompt_prefix_tokens(&self) -> u32 {
        self.prompt_prefix_tokens.load(Ordering::Relaxed)
    }

    fn first_token_delay(&self) -> Duration {
        Duration::from_nanos(self.first_token_delay_nanos.load(Ordering::Relaxed))
    }

    fn record(&self, served: ServedRequest) {
        self.served.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens_served
            .fetch_add(served.prompt_tokens, Ordering::Relaxed);
        self.cached_tokens_served
            .fetch_add(served.cached_tokens, Ordering::Relaxed);
        let mut recent = self.recent.lock();
        if recent.len() >= RECENT_REQUESTS {
            recent.pop_front();
        }
        recent.push_back(served);
    }
}

/// The engine's load as vLLM's `/metrics` gauges report it, written by the engine loop after
/// each change of its queues and read by the route (each value on its own: a reader may see
/// one turn's running with the next turn's waiting, as with a real engine's scrape).
#[derive(Debug, Default)]
pub(crate) struct EngineLoadGauges {
    running: AtomicU64,
    waiting: AtomicU64,
    kv_blocks_in_use: AtomicU64,
    kv_blocks_total: AtomicU64,
}

impl EngineLoadGauges {
    pub(crate) fn store(&self, running: u64, waiting: u64, in_use: u64, total: u64) {
        self.running.store(running, Ordering::Relaxed);
        self.waiting.store(waiting, Ordering::Relaxed);
        self.kv_blocks_in_use.store(in_use, Ordering::Relaxed);
        self.kv_blocks_total.store(total, Ordering::Relaxed);
    }

    /// Running requests, waiting requests, and the fraction of KV blocks in use.
    pub(crate) fn read(&self) -> (u64, u64, f64) {
        let total = self.kv_blocks_total.load(Ordering::Relaxed);
        let in_use = self.kv_blocks_in_use.load(Ordering::Relaxed);
        let usage = if total == 0 {
            0.0
        } else {
            (in_use as f64 / total as f64).min(1.0)
        };
        (
            self.running.load(Ordering::Relaxed),
            self.waiting.load(Ordering::Relaxed),
            usage,
        )
    }
}

/// Resolves once the flag is true (or its sender is gone). The guard `wait_for` returns is
/// dropped here: it must not live across another await of the caller.
pub(crate) async fn until_true(flag: &mut watch::Receiver<bool>) {
    let _ = flag.wait_for(|&set| set).await;
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Counts a request in flight for as long as it lives.
pub(crate) struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.in_flight.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(shared))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the routes read.
pub(crate) struct AppState {
    model: String,
    block_size: u32,
    max_model_len: u32,
    default_max_tokens: u32,
    prompt_tokens_details: bool,
    engine: EngineConfig,
    time_scale: f64,
    tokenizer: MockTokenizer,
    submissions: mpsc::UnboundedSender<engine_loop::Command>,
    shared: Arc<Shared>,
    pd: disagg::PdState,
}

/// A running mock engine. Dropping it kills it; [`shutdown`](Self::shutdown) ends it cleanly.
pub struct MockEngine {
    addr: SocketAddr,
    events_endpoint: Option<String>,
    model: String,
    tokenizer: MockTokenizer,
    shared: Arc<Shared>,
    /// Connections: finish the response in progress, then close.
    graceful: watch::Sender<bool>,
    /// Everything stops at once.
    killed: watch::Sender<bool>,
    /// Closed once every connection (and the accept loop) has ended.
    open: watch::Sender<()>,
    publisher: Option<Publisher>,
    tasks: Vec<JoinHandle<()>>,
    engine_id: String,
    bootstrap_addr: Option<SocketAddr>,
}

impl MockEngine {
    /// Starts the engine on `listener` (and binds its PUB socket when `events_bind` is set).
    /// Must run inside a tokio runtime.
    pub async fn start(config: MockEngineConfig, listener: TcpListener) -> io::Result<MockEngine> {
        let engine_config = config
            .validated_engine()
            .map_err(|reason| io::Error::new(io::ErrorKind::InvalidInput, reason))?;
        let tokenizer = match &config.tokenizer {
            Some(path) => MockTokenizer::from_file(path)?,
            None => MockTokenizer::bytes(),
        };
        let addr = listener.local_addr()?;
        let (publisher, events_endpoint) = match &config.events_bind {
            None => (None, None),
            Some(bind) => {
                let engine = FakeEngine::bind(bind, None, config.events_encoding)
                    .await
                    .map_err(|e| io::Error::new(io::ErrorKind::AddrNotAvailable, e.to_string()))?;
                let endpoint = engine.pub_endpoint().to_string();
                (
                    Some(Arc::new(tokio::sync::Mutex::new(Some(engine)))),
                    Some(endpoint),
                )
            }
        };
        let shared = Arc::new(Shared::new());
        shared
            .prompt_prefix_tokens
            .store(config.prompt_prefix_tokens, Ordering::Relaxed);
        let bootstrap = if config.pd.serves_bootstrap() {
            Some(TcpListener::bind((addr.ip(), config.pd.bootstrap_port)).await?)
        } else {
            None
        };
        let bootstrap_addr = match &bootstrap {
            Some(listener) => Some(listener.local_addr()?),
            None => None,
        };
        let engine_id = config
            .pd
            .engine_id
            .clone()
            .unwrap_or_else(|| format!("mock-{:016x}-{}", shared.nonce, addr.port()));
        let (graceful, _) = watch::channel(false);
        let (killed, _) = watch::channel(false);
        let (open, open_rx) = watch::channel(());
        let (submissions, submissions_rx) = mpsc::unbounded_channel();
        let engine_loop = EngineLoop::new(
            engine_config,
            config.time_scale,
            publisher.clone(),
            Arc::clone(&shared),
        );
        let state = Arc::new(AppState {
            model: config.model.clone(),
            block_size: config.block_size,
            max_model_len: config.max_model_len,
            default_max_tokens: config.default_max_tokens,
            prompt_tokens_details: config.prompt_tokens_details,
            engine: engine_config,
            time_scale: config.time_scale,
            tokenizer: tokenizer.clone(),
            submissions,
            shared: Arc::clone(&shared),
            pd: disagg::PdState {
                config: config.pd.clone(),
                engine_id: engine_id.clone(),
                host: addr.ip().to_string(),
                port: addr.port(),
                bootstrap_port: bootstrap_addr.map(|a| a.port()),
            },
        });
        let mut tasks = vec![tokio::spawn(
            engine_loop.run(submissions_rx, killed.subscribe()),
        )];
        if let Some(bootstrap) = bootstrap {
            tasks.push(tokio::spawn(http::serve(
                bootstrap,
                disagg::bootstrap_router(Arc::clone(&state)),
                graceful.subscribe(),
                killed.subscribe(),
                open_rx.clone(),
            )));
        }
        tasks.push(tokio::spawn(http::serve(
            listener,
            http::router(state),
            graceful.subscribe(),
            killed.subscribe(),
            open_rx,
        )));
        Ok(MockEngine {
            addr,
            events_endpoint,
            model: config.model,
            tokenizer,
            shared,
            graceful,
            killed,
            open,
            publisher,
            tasks,
            engine_id,
            bootstrap_addr,
        })
    }

    /// [`start`](Self::start) on a new listener bound to `addr` (port 0 picks one).
    pub async fn start_on(config: MockEngineConfig, addr: SocketAddr) -> io::Result<MockEngine> {
        Self::start(config, TcpListener::bind(addr).await?).await
    }

    /// The HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound PUB endpoint of the KV events (`tcp://127.0.0.1:PORT`), when publishing.
    pub fn events_endpoint(&self) -> Option<String> {
        self.events_endpoint.clone()
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// The engine's id in vLLM's `kv_transfer_params` (`remote_engine_id`).
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// The SGLang bootstrap server's address (a prefill engine of protocol `sglang`).
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.bootstrap_addr
    }

    /// Prefill legs whose blocks are held for a decode engine now.
    pub fn held_transfers(&self) -> usize {
        self.shared.transfers.len()
    }

    /// The tokenizer the routes use (what `/tokenize` answers with).
    pub fn tokenizer(&self) -> &MockTokenizer {
        &self.tokenizer
    }

    /// Waits until `count` subscribers are connected to the KV-event socket (a PUB socket drops
    /// what it publishes before then); false on timeout or without events.
    pub async fn wait_for_event_subscribers(&self, count: usize, timeout: Duration) -> bool {
        let Some(publisher) = &self.publisher else {
            return false;
        };
        match publisher.lock().await.as_mut() {
            Some(engine) => engine.wait_for_subscribers(count, timeout).await,
            None => false,
        }
    }

    /// Simulates the engine dying: every open connection is dropped at once (a response being
    /// streamed ends without its last chunk), new connections are refused, the engine loop
    /// and its PUB socket stop. For good.
    pub fn kill(&self) {
        self.shared.killed.store(true, Ordering::SeqCst);
        self.killed.send_replace(true);
    }

    /// Makes `/health` answer 503 (`true`) or 200 again; the other routes keep serving.
    pub fn set_unhealthy(&self, unhealthy: bool) {
        self.shared.unhealthy.store(unhealthy, Ordering::Relaxed);
    }

    /// Holds every new request this long before it reaches the engine (0: none).
    pub fn set_first_token_delay(&self, delay: Duration) {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.shared
            .first_token_delay_nanos
            .store(nanos, Ordering::Relaxed);
    }

    /// Puts `tokens` tokens before every new prompt from now on (see
    /// [`MockEngineConfig::prompt_prefix_tokens`]; 0: none).
    pub fn set_prompt_prefix_tokens(&self, tokens: u32) {
        self.shared
            .prompt_prefix_tokens
            .store(tokens, Ordering::Relaxed);
    }

    /// Requests that got every token.
    pub fn requests_served(&self) -> u64 {
        self.shared.served.load(Ordering::Relaxed)
    }

    /// Generation requests accepted and not yet answered in full.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Relaxed)
    }

    /// What `GET /metrics` reports now: running and waiting requests, KV usage (0..1).
    pub fn engine_load(&self) -> (u64, u64, f64) {
        self.shared.load.read()
    }

    /// KV-event batches published.
    pub fn event_batches(&self) -> u64 {
        self.shared.event_batches.load(Ordering::Relaxed)
    }

    /// The last [`RECENT_REQUESTS`] requests served, oldest first.
    pub fn recent_requests(&self) -> Vec<ServedRequest> {
        self.shared.recent.lock().iter().cloned().collect()
    }

    /// The cached prompt tokens of the last request served.
    pub fn last_cached_tokens(&self) -> Option<u64> {
        self.shared.recent.lock().back().map(|r| r.cached_tokens)
    }

    /// Stops accepting, lets open responses finish (up to [`SHUTDOWN_GRACE`]), then stops
    /// everything and waits for it.
    pub async fn shutdown(mut self) {
        self.graceful.send_replace(true);
        let _ = tokio::time::timeout(SHUTDOWN_GRACE, self.open.closed()).await;
        self.kill();
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
    }
}

impl Drop for MockEngine {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_validated_and_block_size_wins() {
        let config = MockEngineConfig::default();
        assert_eq!(config.validated_engine().unwrap().block_size, 16);
        let engine = MockEngineConfig {
            block_size: 32,
            ..MockEngineConfig::default()
        }
        .validated_engine()
        .unwrap();
        assert_eq!(engine.block_size, 32);
        for bad in [
            MockEngineConfig {
                time_scale: f64::NAN,
                ..MockEngineConfig::default()
            },
            MockEngineConfig {
                time_scale: -1.0,
                ..MockEngineConfig::default()
            },
            MockEngineConfig {
                block_size: 0,
                ..MockEngineConfig::default()
            },
            MockEngineConfig {
                model: String::new(),
                ..MockEngineConfig::default()
            },
            MockEngineConfig {
                default_max_tokens: 0,
                ..MockEngineConfig::default()
            },
        ] {
            assert!(bad.validated_engine().is_err(), "{bad:?}");
        }
    }
}
