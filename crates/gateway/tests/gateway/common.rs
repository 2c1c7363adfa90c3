//! What the tests share: a gateway in process on a real socket, a small vLLM-shaped upstream
//! whose faults the tests set, and an HTTP client that reads streams frame by frame.

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{self, get};
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_gateway::{Gateway, GatewayArgs};
use kvroute_service::{AppState, ServeConfig, http};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Longest any test waits for anything.
pub const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// The upstream: a vLLM-shaped engine, only as far as the gateway reads it.

/// What the upstream does; the tests change it as they go.
#[derive(Debug, Default)]
pub struct Faults {
    /// Answer completions with this status (and `Retry-After: 7`) instead.
    pub status: Mutex<Option<u16>>,
    /// Cut the stream after this many tokens.
    pub die_after_tokens: Mutex<Option<usize>>,
    /// Before the first token.
    pub first_token_delay: Mutex<Duration>,
    /// Between tokens.
    pub token_delay: Mutex<Duration>,
    pub unhealthy: AtomicBool,
    /// Fields added to a whole (not streamed) answer, as a vLLM prefill engine adds
    /// `kv_transfer_params`.
    pub answer_extra: Mutex<Option<Value>>,
}

/// One request the upstream received.
#[derive(Debug, Clone)]
pub struct Received {
    pub path: String,
    pub authorization: Option<String>,
    pub request_id: Option<String>,
    pub body: Value,
}

#[derive(Debug, Default)]
pub struct UpstreamState {
    pub faults: Faults,
    pub received: Mutex<Vec<Received>>,
    /// Streams whose body is still being written (the engine's view of live requests).
    pub streams_open: AtomicUsize,
}

pub struct Upstream {
    pub addr: SocketAddr,
    pub state: Arc<UpstreamState>,
    stop: Option<oneshot::Sender<()>>,
}

impl Upstream {
    pub async fn start() -> Self {
        let state = Arc::new(UpstreamState::default());
        let app = Router::new()
            .route("/v1/completions", routing::post(completion))
            .route("/v1/chat/completions", routing::post(completion))
            .route("/tokenize", routing::post(tokenize))
            .route("/health", get(health))
            .with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Self {
            addr,
            state,
            stop: Some(stop),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self, path: &str) -> Vec<Received> {
        self.state
            .received
            .lock()
            .iter()
            .filter(|r| r.path == path)
            .cloned()
            .collect()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A body fed from a channel: an `Err` cuts the connection, as an engine dying does.
struct ChannelBody(mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0.poll_recv(cx).map(|r| r.map(|r| r.map(Frame::data)))
    }
}

fn record(state: &UpstreamState, path: &str, headers: &HeaderMap, body: &Value) {
    state.received.lock().push(Received {
        path: path.to_string(),
        authorization: headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        request_id: headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        body: body.clone(),
    });
}

/// The word the upstream generates at position `i`.
pub fn token_text(i: usize) -> String {
    format!("t{i} ")
}

async fn completion(
    State(state): State<Arc<UpstreamState>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    record(&state, uri.path(), &headers, &body);
    if let Some(status) = *state.faults.status.lock() {
        let status = StatusCode::from_u16(status).unwrap();
        let mut response = (
            status,
            axum::Json(json!({"error": {"message": "upstream says no"}})),
        )
            .into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, "7".parse().unwrap());
        return response;
    }
    let chat = uri.path().contains("chat");
    let tokens = body["max_tokens"].as_u64().unwrap_or(4) as usize;
    let first_delay = *state.faults.first_token_delay.lock();
    let delay = *state.faults.token_delay.lock();
    let die_after = *state.faults.die_after_tokens.lock();
    let text: String = (0..tokens).map(token_text).collect();
    if body["stream"] != json!(true) {
        tokio::time::sleep(first_delay).await;
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        let mut answer = json!({
            "id": "cmpl-1", "object": if chat { "chat.completion" } else { "text_completion" },
            "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": tokens + 3},
        });
        if let Some(Value::Object(extra)) = state.faults.answer_extra.lock().clone() {
            answer.as_object_mut().unwrap().extend(extra);
        }
        return axum::Json(answer).into_response();
    }
    let (tx, rx) = mpsc::channel(4);
    let open = Arc::clone(&state);
    open.streams_open.fetch_add(1, Ordering::SeqCst);
    tokio::spawn(async move {
        let event = |v: Value| Ok(Bytes::from(format!("data: {v}\n\n")));
        if chat {
            let role =
                json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]});
            if tx.send(event(role)).await.is_err() {
                open.streams_open.fetch_sub(1, Ordering::SeqCst);
                return;
            }
        }
        tokio::time::sleep(first_delay).await;
        for i in 0..tokens {
            if i > 0 {
                tokio::time::sleep(delay).await;
            }
            if die_after == Some(i) {
                let _ = tx.send(Err(std::io::Error::other("the engine died"))).await;
                open.streams_open.fetch_sub(1, Ordering::SeqCst);
                return;
            }
            let chunk = if chat {
                json!({"choices": [{"index": 0, "delta": {"content": token_text(i)}}]})
            } else {
                json!({"choices": [{"index": 0, "text": token_text(i)}]})
            };
            if tx.send(event(chunk)).await.is_err() {
                open.streams_open.fetch_sub(1, Ordering::SeqCst);
                return;
            }
        }
        let _ = tx
            .send(event(
                json!({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
            ))
            .await;
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        open.streams_open.fetch_sub(1, Ordering::SeqCst);
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::new(ChannelBody(rx)))
        .unwrap()
}

/// vLLM's `/tokenize`, with a toy tokenizer: a token per byte of the prompt (or of the
/// messages' contents), plus 1000.
async fn tokenize(
    State(state): State<Arc<UpstreamState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    record(&state, "/tokenize", &headers, &body);
    let text = match body["prompt"].as_str() {
        Some(text) => text.to_string(),
        None => body["messages"]
            .as_array()
            .map(|m| m.iter().filter_map(|m| m["content"].as_str()).collect())
            .unwrap_or_default(),
    };
    let tokens: Vec<u32> = text.bytes().map(|b| 1000 + u32::from(b)).collect();
    axum::Json(json!({"count": tokens.len(), "max_model_len": 4096, "tokens": tokens}))
        .into_response()
}

async fn health(State(state): State<Arc<UpstreamState>>) -> StatusCode {
    if state.faults.unhealthy.load(Ordering::SeqCst) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

// ---------------------------------------------------------------------------------------------
// The gateway

pub struct TestGateway {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    pub gateway: Arc<Gateway>,
    stop: Option<oneshot::Sender<()>>,
}

impl TestGateway {
    /// A gateway with `serve` flags and gateway flags (each list without the program name).
    pub async fn start(serve: &[&str], gateway: &[&str]) -> Self {
        let config =
            ServeConfig::parse_from(std::iter::once("kvroute").chain(serve.iter().copied()))
                .unwrap();
        let args =
            GatewayArgs::parse_from(std::iter::once("kvroute").chain(gateway.iter().copied()))
                .unwrap();
        let state = AppState::new(config).unwrap();
        let gateway = Gateway::new(Arc::clone(&state), args.validate().unwrap()).unwrap();
        gateway.start_background().unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let routes = gateway.routes();
        tokio::spawn(http::serve_with(
            Arc::clone(&state),
            listener,
            routes,
            async {
                let _ = stopped.await;
            },
        ));
        Self {
            addr,
            state,
            gateway,
            stop: Some(stop),
        }
    }

    /// A gateway with default flags in front of one upstream, no health checks.
    pub async fn in_front_of(upstream: &Upstream) -> Self {
        Self::start(
            &[],
            &["--worker", &upstream.url(), "--health-check-secs", "0"],
        )
        .await
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Live bookings of every worker, from `GET /loads`.
    pub fn active_requests(&self) -> u64 {
        kvroute_service::api::loads(&self.state, None, None)
            .iter()
            .flat_map(|p| p.loads.iter())
            .map(|l| l.active_requests)
            .sum()
    }

    /// Waits until no booking is live (and the gateway holds none), or fails.
    pub async fn assert_no_booking_left(&self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.active_requests() > 0 || self.gateway.metrics().bookings_open.get() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a booking was leaked: {} active, {} held by the gateway",
                self.active_requests(),
                self.gateway.metrics().bookings_open.get()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn metrics_text(&self) -> String {
        self.state.render_metrics()
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The client

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub fn post_request(url: &str, body: &Value, auth: Option<&str>) -> hyper::Request<Full<Bytes>> {
    let mut request = hyper::Request::post(url).header(header::CONTENT_TYPE, "application/json");
    if let Some(auth) = auth {
        request = request.header(header::AUTHORIZATION, auth);
    }
    request
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// A request's whole answer: status, headers, body.
pub async fn exchange(
    client: &TestClient,
    request: hyper::Request<Full<Bytes>>,
) -> (StatusCode, HeaderMap, Bytes) {
    tokio::time::timeout(WAIT, async {
        let response = client.request(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        (parts.status, parts.headers, bytes)
    })
    .await
    .expect("the gateway answered in time")
}

pub async fn post(client: &TestClient, url: &str, body: &Value) -> (StatusCode, HeaderMap, Bytes) {
    exchange(client, post_request(url, body, None)).await
}

pub async fn get_json(client: &TestClient, url: &str) -> (StatusCode, Value) {
    let request = hyper::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, _, body) = exchange(client, request).await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// The `data:` payloads of an SSE body.
pub fn sse_payloads(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// Waits for `check` to hold, or fails with `what`.
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A port on 127.0.0.1 with nothing listening (bound, then closed).
pub async fn closed_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}
