//! Disaggregated prefill and decode (P/D): a mock engine of role `prefill` computes a prompt and
//! holds its KV blocks until a `decode` engine has pulled them over HTTP, in the protocol of vLLM
//! (NixlConnector) or SGLang (`--disaggregation-mode`). Role `both` ignores every P/D field.
//!
//! ## vLLM (NixlConnector)
//! - **Prefill leg**: a request with `kv_transfer_params: {"do_remote_decode": true,
//!   "do_remote_prefill": false, ...}` runs with `max_tokens: 1`; its full prompt blocks are then
//!   held (not evictable) and the answer's body (a whole one: a streamed prefill leg holds its
//!   blocks all the same, but has no body to say so) carries `kv_transfer_params`:
//!   `do_remote_prefill: true`, `do_remote_decode: false`, `remote_engine_id` (this engine's
//!   id), `remote_request_id` (the answer's id), `remote_block_ids` (ids minted for the held
//!   blocks), `remote_host`/`remote_port` (this engine's HTTP address: the mock's transfer
//!   channel is its `POST /kv_transfer/pull` route) and `tp_size: 1`.
//! - **Decode leg**: a request carrying those params pulls the blocks from
//!   `remote_host:remote_port` (which releases them there), checks they are this prompt's,
//!   waits the transfer time, caches them and decodes. Without `kv_transfer_params` (or with
//!   `do_remote_prefill` false) a decode engine runs the whole request, as vLLM does.
//!
//! ## SGLang
//! Requests carry `bootstrap_host`, `bootstrap_port` (SGLang's default 8998 when absent) and
//! `bootstrap_room` (an integer, or a list of one); the router sends the same body to both
//! engines at once. The prefill engine runs it with `max_tokens: 1` and holds the blocks under
//! the room; its bootstrap server (an HTTP listener on `--bootstrap-port`) answers the decode
//! engine's `POST /kv_transfer/pull {"bootstrap_room", "wait_ms"}` once the room is prefilled
//! (or 404 after `wait_ms`). Both roles refuse a request without a room.
//!
//! ## Held blocks and transfer time
//! Held blocks count as in use in the engine's pool until pulled or until `hold_timeout`
//! (vLLM's default abort timeout, 480 s) passes. A transfer lasts `blocks × block_size ×
//! kv_bytes_per_token × 8 / (kv_transfer_gbps × 10⁹)` modelled seconds (× `time_scale`); the
//! default 131,072 bytes per token is a Llama-3-8B-sized KV (32 layers × 8 KV heads × 128 dims ×
//! K and V × 2 bytes).
//!
//! Any mistake a router can make — a missing field, an unknown engine id or request, block ids
//! other than those held, a room never prefilled, a prefill of another prompt — fails the
//! request with a 4xx (502 when the prefill engine cannot be reached) whose message names it.

use super::AppState;
use super::engine_loop::Command;
use super::http::read_body;
use super::protocol::{ApiError, json_response, parse};
use crate::client::HttpClient;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use hashbrown::HashMap;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

/// KV bytes per token of a Llama-3-8B-sized model in bf16 (see the module doc).
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 131_072;
/// Transfer bandwidth, gigabits per second.
pub const DEFAULT_KV_TRANSFER_GBPS: f64 = 100.0;
/// How long a prefill engine holds blocks nobody pulls (vLLM's default abort timeout).
pub const DEFAULT_HOLD_TIMEOUT: Duration = Duration::from_secs(480);
/// How long an SGLang decode engine waits for its room to be prefilled.
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// SGLang's default bootstrap port.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// What the engine does in a disaggregated fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PdRole {
    /// Whole requests; P/D fields are ignored.
    #[default]
    Both,
    Prefill,
    Decode,
}

impl PdRole {
    pub fn as_str(self) -> &'static str {
        match self {
            PdRole::Both => "both",
            PdRole::Prefill => "prefill",
            PdRole::Decode => "decode",
        }
    }
}

/// The P/D protocol spoken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdProtocol {
    /// vLLM's NixlConnector: prefill first, its `kv_transfer_params` into the decode leg.
    Vllm,
    /// SGLang's bootstrap rooms: the same body to both legs at once.
    Sglang,
}

impl PdProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            PdProtocol::Vllm => "vllm",
            PdProtocol::Sglang => "sglang",
        }
    }
}

/// The P/D settings of a mock engine.
#[derive(Debug, Clone, PartialEq)]
pub struct PdConfig {
    pub role: PdRole,
    /// Required for roles `prefill` and `decode`.
    pub protocol: Option<PdProtocol>,
    /// Transfer bandwidth, gigabits per second.
    pub kv_transfer_gbps: f64,
    pub kv_bytes_per_token: u64,
    /// Held blocks nobody pulled are released after this long.
    pub hold_timeout: Duration,
    /// How long a decode engine waits for its blocks (SGLang: for the room to be prefilled).
    pub fetch_timeout: Duration,
    /// The SGLang prefill engine's bootstrap server port (0 picks one).
    pub bootstrap_port: u16,
    /// This engine's id in `kv_transfer_params` (`None`: one is made up).
    pub engine_id: Option<String>,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            role: PdRole::Both,
            protocol: None,
            kv_transfer_gbps: DEFAULT_KV_TRANSFER_GBPS,
            kv_bytes_per_token: DEFAULT_KV_BYTES_PER_TOKEN,
            hold_timeout: DEFAULT_HOLD_TIMEOUT,
            fetch_timeout: DEFAULT_FETCH_TIMEOUT,
            bootstrap_port: DEFAULT_BOOTSTRAP_PORT,
            engine_id: None,
        }
    }
}

impl PdConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.role != PdRole::Both && self.protocol.is_none() {
            return Err(format!(
                "role {} needs a P/D protocol (vllm or sglang)",
                self.role.as_str()
            ));
        }
        if !(self.kv_transfer_gbps.is_finite() && self.kv_transfer_gbps > 0.0) {
            return Err(format!(
                "the KV transfer bandwidth must be a positive number of Gbit/s, got {}",
                self.kv_transfer_gbps
            ));
        }
        if self.kv_bytes_per_token == 0 {
            return Err("KV bytes per token must be at least 1".to_string());
        }
        Ok(())
    }

    /// Whether this engine serves an SGLang bootstrap server.
    pub fn serves_bootstrap(&self) -> bool {
        self.role == PdRole::Prefill && self.protocol == Some(PdProtocol::Sglang)
    }

    /// Modelled transfer time of `blocks` blocks of `block_size` tokens.
    pub fn transfer_time(&self, blocks: usize, block_size: u32) -> Duration {
        let bits = blocks as f64 * f64::from(block_size) * self.kv_bytes_per_token as f64 * 8.0;
        Duration::try_from_secs_f64(bits / (self.kv_transfer_gbps * 1e9)).unwrap_or(Duration::MAX)
    }
}

/// The P/D fields of a generation request, as sent (flattened into the request types).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct PdFieldsIn {
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
    #[serde(default)]
    pub bootstrap_host: Option<Value>,
    #[serde(default)]
    pub bootstrap_port: Option<Value>,
    #[serde(default)]
    pub bootstrap_room: Option<Value>,
}

/// What a request is to this engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Leg {
    Whole,
    /// vLLM prefill: held under the answer's id.
    PrefillVllm,
    /// SGLang prefill: held under the room.
    PrefillRoom(u64),
    Decode(Source),
}

impl Leg {
    pub fn is_prefill(&self) -> bool {
        matches!(self, Leg::PrefillVllm | Leg::PrefillRoom(_))
    }
}

/// Where a decode leg's blocks are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    Vllm {
        engine_id: String,
        request_id: String,
        block_ids: Vec<u64>,
        host: String,
        port: u16,
    },
    Sglang {
        host: String,
        port: u16,
        room: u64,
    },
}

/// What the request's P/D fields make of it on this engine, or what is wrong with them.
pub(crate) fn leg(state: &AppState, fields: &PdFieldsIn) -> Result<Leg, ApiError> {
    let pd = &state.pd.config;
    match (pd.role, pd.protocol) {
        (PdRole::Both, _) | (_, None) => Ok(Leg::Whole),
        (role, Some(PdProtocol::Vllm)) => vllm_leg(role, fields.kv_transfer_params.as_ref()),
        (role, Some(PdProtocol::Sglang)) => sglang_leg(state, role, fields),
    }
}

fn flag(params: &serde_json::Map<String, Value>, name: &str) -> Result<bool, ApiError> {
    match params.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::bad_request(format!(
            "kv_transfer_params.{name} must be a boolean, got {other}"
        ))),
    }
}

fn vllm_leg(role: PdRole, params: Option<&Value>) -> Result<Leg, ApiError> {
    let params = match params {
        None | Some(Value::Null) => return Ok(Leg::Whole),
        Some(Value::Object(params)) => params,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "kv_transfer_params must be an object, got {other}"
            )));
        }
    };
    let remote_decode = flag(params, "do_remote_decode")?;
    let remote_prefill = flag(params, "do_remote_prefill")?;
    match (role, remote_decode, remote_prefill) {
        (_, true, true) => Err(ApiError::bad_request(
            "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true",
        )),
        (PdRole::Prefill, true, false) => Ok(Leg::PrefillVllm),
        (PdRole::Decode, true, false) => Err(ApiError::bad_request(
            "kv_transfer_params.do_remote_decode is true, but this is a decode engine: \
             send the prefill leg to a prefill engine",
        )),
        (PdRole::Prefill, false, true) => Err(ApiError::bad_request(
            "kv_transfer_params.do_remote_prefill is true, but this is a prefill engine: \
             send the decode leg to a decode engine",
        )),
        (PdRole::Decode, false, true) => {
            let text = |name: &str| match params.get(name) {
                Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
                None | Some(Value::Null) => Err(ApiError::bad_request(format!(
                    "kv_transfer_params.{name} is missing: copy the prefill answer's \
                     kv_transfer_params into the decode request unchanged"
                ))),
                Some(other) => Err(ApiError::bad_request(format!(
                    "kv_transfer_params.{name} must be a non-empty string, got {other}"
                ))),
            };
            let port = match params.get("remote_port") {
                Some(v) => v
                    .as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "kv_transfer_params.remote_port must be a port number, got {v}"
                        ))
                    })?,
                None => {
                    return Err(ApiError::bad_request(
                        "kv_transfer_params.remote_port is missing: copy the prefill answer's \
                         kv_transfer_params into the decode request unchanged",
                    ));
                }
            };
            let block_ids = match params.get("remote_block_ids") {
                Some(Value::Array(ids)) => ids
                    .iter()
                    .map(|id| {
                        id.as_u64().ok_or_else(|| {
                            ApiError::bad_request(format!(
                                "kv_transfer_params.remote_block_ids holds {id}, not a block id"
                            ))
                        })
                    })
                    .collect::<Result<Vec<u64>, ApiError>>()?,
                _ => {
                    return Err(ApiError::bad_request(
                        "kv_transfer_params.remote_block_ids must be the list of block ids \
                         the prefill answer gave",
                    ));
                }
            };
            Ok(Leg::Decode(Source::Vllm {
                engine_id: text("remote_engine_id")?,
                request_id: text("remote_request_id")?,
                host: text("remote_host")?,
                port,
                block_ids,
            }))
        }
        // Neither flag: vLLM runs the request whole.
        (_, false, false) | (PdRole::Both, _, _) => Ok(Leg::Whole),
    }
}

/// The room of a request: an integer, or a list of one (a batch of one prompt).
fn room(value: Option<&Value>) -> Result<Option<u64>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(rooms)) if rooms.len() == 1 => room(rooms.first()),
        Some(Value::Array(rooms)) => Err(ApiError::bad_request(format!(
            "bootstrap_room holds {} rooms; the mock engine takes one prompt per request",
            rooms.len()
        ))),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad_request(format!(
                "bootstrap_room must be a non-negative integer, got {v}"
            ))
        }),
    }
}

fn sglang_leg(state: &AppState, role: PdRole, fields: &PdFieldsIn) -> Result<Leg, ApiError> {
    let Some(room) = room(fields.bootstrap_room.as_ref())? else {
        return Err(ApiError::bad_request(format!(
            "bootstrap_room is missing: an SGLang {} engine serves only disaggregated requests \
             (bootstrap_host, bootstrap_port, bootstrap_room)",
            role.as_str()
        )));
    };
    let port = match fields.bootstrap_port.as_ref() {
        None | Some(Value::Null) => DEFAULT_BOOTSTRAP_PORT,
        Some(v) => v
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| {
                ApiError::bad_request(format!("bootstrap_port must be a port number, got {v}"))
            })?,
    };
    match role {
        PdRole::Prefill => match state.pd.bootstrap_port {
            Some(own) if own != port => Err(ApiError::bad_request(format!(
                "bootstrap_port {port} is not this prefill engine's bootstrap port {own}"
            ))),
            _ => Ok(Leg::PrefillRoom(room)),
        },
        _ => {
            let host = match fields.bootstrap_host.as_ref() {
                Some(Value::String(host)) if !host.is_empty() => host.clone(),
                None | Some(Value::Null) => {
                    return Err(ApiError::bad_request(
                        "bootstrap_host is missing: the decode engine fetches the KV from the \
                         prefill engine's bootstrap server",
                    ));
                }
                Some(other) => {
                    return Err(ApiError::bad_request(format!(
                        "bootstrap_host must be a host name, got {other}"
                    )));
                }
            };
            Ok(Leg::Decode(Source::Sglang { host, port, room }))
        }
    }
}

/// The engine's P/D state the routes read.
pub(crate) struct PdState {
    pub config: PdConfig,
    pub engine_id: String,
    /// This engine's HTTP address, as `remote_host` / `remote_port`.
    pub host: String,
    pub port: u16,
    /// The bound bootstrap port (SGLang prefill).
    pub bootstrap_port: Option<u16>,
}

/// What a held transfer is filed under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum TransferKey {
    Request(String),
    Room(u64),
}

struct Held {
    block_ids: Vec<u64>,
    hashes: Vec<u64>,
    serial: u64,
}

/// The blocks a prefill engine holds for decode engines.
#[derive(Default)]
pub(crate) struct Transfers {
    held: Mutex<HashMap<TransferKey, Held>>,
    arrived: Notify,
    next_block_id: AtomicU64,
    next_serial: AtomicU64,
}

impl Transfers {
    pub fn len(&self) -> usize {
        self.held.lock().len()
    }

    fn take(&self, key: &TransferKey) -> Option<Held> {
        self.held.lock().remove(key)
    }
}

/// Files the blocks a prefill leg holds (`hashes`, held in the pool already) under `key` and
/// starts their hold timeout. Returns the block ids minted for them, or `None` when the key is
/// taken (the blocks are then released).
pub(crate) fn hold(state: &Arc<AppState>, key: TransferKey, hashes: Vec<u64>) -> Option<Vec<u64>> {
    let transfers = &state.shared.transfers;
    let first = transfers
        .next_block_id
        .fetch_add(hashes.len() as u64, Ordering::Relaxed);
    let block_ids: Vec<u64> = (first..first + hashes.len() as u64).collect();
    let serial = transfers.next_serial.fetch_add(1, Ordering::Relaxed);
    {
        let mut held = transfers.held.lock();
        if held.contains_key(&key) {
            drop(held);
            release(state, hashes);
            return None;
        }
        held.insert(
            key.clone(),
            Held {
                block_ids: block_ids.clone(),
                hashes,
                serial,
            },
        );
    }
    transfers.arrived.notify_waiters();
    let state = Arc::clone(state);
    let timeout = state.pd.config.hold_timeout;
    tokio::spawn(async move {
        tokio::time::sleep(timeout).await;
        let expired = {
            let mut held = state.shared.transfers.held.lock();
            match held.get(&key) {
                Some(h) if h.serial == serial => held.remove(&key),
                _ => None,
            }
        };
        if let Some(expired) = expired {
            tracing::debug!(
                ?key,
                "mock engine: held KV blocks released after the hold timeout"
            );
            release(&state, expired.hashes);
        }
    });
    Some(block_ids)
}

fn release(state: &AppState, hashes: Vec<u64>) {
    if !hashes.is_empty() {
        // A stopped engine has nothing left to release.
        let _ = state.submissions.send(Command::Release(hashes));
    }
}

/// The prefill answer's `kv_transfer_params` (vLLM).
pub(crate) fn vllm_answer_params(state: &AppState, request_id: &str, block_ids: &[u64]) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": block_ids,
        "remote_engine_id": state.pd.engine_id,
        "remote_request_id": request_id,
        "remote_host": state.pd.host,
        "remote_port": state.pd.port,
        "tp_size": 1,
    })
}

#[derive(Debug, Deserialize)]
struct VllmPull {
    remote_engine_id: String,
    remote_request_id: String,
    remote_block_ids: Vec<u64>,
}

#[derive(Debug, Deserialize)]
struct RoomPull {
    bootstrap_room: u64,
    #[serde(default)]
    wait_ms: u64,
}

/// What a pull answers: the blocks' sequence hashes, root first.
#[derive(Debug, Serialize, Deserialize)]
struct Pulled {
    block_hashes: Vec<u64>,
    block_size: u32,
}

fn not_found(message: String) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "NotFoundError",
        message,
    }
}

fn pulled(state: &AppState, held: Held) -> Response {
    let answer = Pulled {
        block_hashes: held.hashes.clone(),
        block_size: state.block_size,
    };
    release(state, held.hashes);
    json_response(serde_json::to_vec(&answer).unwrap_or_default())
}

/// `POST /kv_transfer/pull` on the HTTP port (vLLM): hands over and releases the blocks held
/// for a request.
pub(crate) async fn pull_vllm(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let result = async {
        let body = read_body(body).await?;
        let pull: VllmPull = parse(&body)?;
        if pull.remote_engine_id != state.pd.engine_id {
            return Err(not_found(format!(
                "unknown remote_engine_id `{}`: this engine is `{}`",
                pull.remote_engine_id, state.pd.engine_id
            )));
        }
        let key = TransferKey::Request(pull.remote_request_id.clone());
        let mut held = state.shared.transfers.held.lock();
        let Some(entry) = held.get(&key) else {
            return Err(not_found(format!(
                "no KV blocks held for request `{}` on engine `{}` (never prefilled here, \
                 already pulled, or released after the hold timeout)",
                pull.remote_request_id, state.pd.engine_id
            )));
        };
        if entry.block_ids != pull.remote_block_ids {
            return Err(ApiError {
                status: StatusCode::CONFLICT,
                kind: "ConflictError",
                message: format!(
                    "remote_block_ids {:?} are not the blocks held for request `{}` ({:?})",
                    pull.remote_block_ids, pull.remote_request_id, entry.block_ids
                ),
            });
        }
        Ok(held.remove(&key))
    }
    .await;
    match result {
        Ok(Some(held)) => pulled(&state, held),
        Ok(None) => ApiError::internal("the held blocks vanished").into_response(),
        Err(error) => error.into_response(),
    }
}

/// `POST /kv_transfer/pull` on the bootstrap port (SGLang): waits up to `wait_ms` for the room
/// to be prefilled, then hands over and releases its blocks.
pub(crate) async fn pull_room(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let pull = match read_body(body).await.and_then(|b| parse::<RoomPull>(&b)) {
        Ok(pull) => pull,
        Err(error) => return error.into_response(),
    };
    let key = TransferKey::Room(pull.bootstrap_room);
    let transfers = &state.shared.transfers;
    let deadline = tokio::time::Instant::now() + Duration::from_millis(pull.wait_ms);
    loop {
        let notified = transfers.arrived.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(held) = transfers.take(&key) {
            return pulled(&state, held);
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return not_found(format!(
                "bootstrap room {} was not prefilled on this engine within {} ms",
                pull.bootstrap_room, pull.wait_ms
            ))
            .into_response();
        }
    }
}

/// The decode leg's blocks: pulls them from the prefill engine (releasing them there). Returns
/// their sequence hashes, root first.
pub(crate) async fn fetch(state: &AppState, source: &Source) -> Result<Vec<u64>, ApiError> {
    let wait = state.pd.config.fetch_timeout;
    let (host, port, path, body, what) = match source {
        Source::Vllm {
            engine_id,
            request_id,
            block_ids,
            host,
            port,
        } => (
            host,
            *port,
            "/kv_transfer/pull",
            json!({
                "remote_engine_id": engine_id,
                "remote_request_id": request_id,
                "remote_block_ids": block_ids,
            }),
            format!("prefill engine `{engine_id}` at {host}:{port}"),
        ),
        Source::Sglang { host, port, room } => (
            host,
            *port,
            "/kv_transfer/pull",
            json!({
                "bootstrap_room": room,
                "wait_ms": u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            }),
            format!("bootstrap server {host}:{port} (room {room})"),
        ),
    };
    let unreachable = |reason: String| ApiError {
        status: StatusCode::BAD_GATEWAY,
        kind: "BadGatewayError",
        message: format!("KV transfer from {what} failed: {reason}"),
    };
    let addr = tokio::net::lookup_host((host.as_str(), port))
        .await
        .map_err(|e| unreachable(format!("cannot resolve {host}: {e}")))?
        .next()
        .ok_or_else(|| unreachable(format!("{host} has no address")))?;
    let client = HttpClient::connect(addr)
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let body = serde_json::to_vec(&body).unwrap_or_default();
    let (status, answer) = client
        .with_timeout(wait + Duration::from_secs(5))
        .request("POST", path, Some(&body))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    if status != 200 {
        let message = serde_json::from_slice::<Value>(&answer)
            .ok()
            .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&answer).into_owned());
        let error = format!("KV transfer from {what} failed ({status}): {message}");
        return Err(if (400..500).contains(&status) {
            ApiError::bad_request(error)
        } else {
            unreachable(format!("status {status}: {message}"))
        });
    }
    let pulled: Pulled = serde_json::from_slice(&answer)
        .map_err(|e| unreachable(format!("a pull answer that is not the mock's: {e}")))?;
    if pulled.block_size != state.block_size {
        return Err(ApiError::bad_request(format!(
            "KV transfer from {what}: its block size {} is not this engine's {}",
            pulled.block_size, state.block_size
        )));
    }
    Ok(pulled.block_hashes)
}

/// Serves the SGLang bootstrap routes.
pub(crate) fn bootstrap_router(state: Arc<AppState>) -> axum::Router {
    axum::Router::new()
        .route("/kv_transfer/pull", axum::routing::post(pull_room))
        .route("/health", axum::routing::get(|| async { StatusCode::OK }))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_time_is_bytes_over_bandwidth() {
        let config = PdConfig {
            kv_transfer_gbps: 8.0,
            kv_bytes_per_token: 1_000,
            ..PdConfig::default()
        };
        // 10 blocks × 16 tokens × 1000 bytes = 160 kB = 1.28 Mbit at 8 Gbit/s = 160 µs.
        assert_eq!(config.transfer_time(10, 16), Duration::from_micros(160));
        assert_eq!(config.transfer_time(0, 16), Duration::ZERO);
    }

    #[test]
    fn roles_other_than_both_need_a_protocol() {
        let prefill = PdConfig {
            role: PdRole::Prefill,
            ..PdConfig::default()
        };
        assert!(prefill.validate().unwrap_err().contains("protocol"));
        let bad = PdConfig {
            kv_transfer_gbps: 0.0,
            ..PdConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("bandwidth"));
        assert!(PdConfig::default().validate().is_ok());
    }

    #[test]
    fn vllm_params_pick_the_leg_and_name_what_is_missing() {
        let prefill_params = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
            "remote_port": null});
        assert_eq!(
            vllm_leg(PdRole::Prefill, Some(&prefill_params)).unwrap(),
            Leg::PrefillVllm
        );
        assert!(
            vllm_leg(PdRole::Decode, Some(&prefill_params))
                .unwrap_err()
                .message
                .contains("decode engine")
        );
        assert_eq!(vllm_leg(PdRole::Decode, None).unwrap(), Leg::Whole);
        let mut decode_params = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [3, 4],
            "remote_host": "127.0.0.1", "remote_port": 9});
        assert_eq!(
            vllm_leg(PdRole::Decode, Some(&decode_params)).unwrap(),
            Leg::Decode(Source::Vllm {
                engine_id: "e".into(),
                request_id: "r".into(),
                block_ids: vec![3, 4],
                host: "127.0.0.1".into(),
                port: 9,
            })
        );
        for field in ["remote_engine_id", "remote_port", "remote_block_ids"] {
            let mut params = decode_params.clone();
            params.as_object_mut().unwrap().remove(field);
            let error = vllm_leg(PdRole::Decode, Some(&params)).unwrap_err();
            assert!(error.message.contains(field), "{}", error.message);
        }
        decode_params["remote_block_ids"] = json!(["x"]);
        assert!(vllm_leg(PdRole::Decode, Some(&decode_params)).is_err());
    }

    #[test]
    fn rooms_are_integers_or_a_list_of_one() {
        assert_eq!(room(Some(&json!(7))).unwrap(), Some(7));
        assert_eq!(room(Some(&json!([7]))).unwrap(), Some(7));
        assert_eq!(room(None).unwrap(), None);
        assert!(room(Some(&json!([1, 2]))).is_err());
        assert!(room(Some(&json!(-1))).is_err());
        assert!(room(Some(&json!("7"))).is_err());
    }
}
