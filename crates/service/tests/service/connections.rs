//! Slow and idle clients: the header-read, body-read and idle timeouts and
//! `--max-connections`, over real sockets on 127.0.0.1, while a real client is served. Every
//! wait is bounded; the timeouts are short (hundreds of milliseconds) so the tests are too.

use crate::common::TestApp;
use axum::body::Body;
use axum::http::Request;
use bytes::Bytes;
use http_body_util::BodyExt;
use kvroute_service::{AppState, ServeConfig, app};
use kvroute_testkit::client::HttpClient;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower::ServiceExt;

/// A `kvroute serve` of the test's own on 127.0.0.1, until [`Served::stop`].
struct Served {
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn serve(flags: &[&str]) -> Served {
    let config = ServeConfig::parse_from(std::iter::once("kvroute").chain(flags.iter().copied()))
        .expect("flags");
    let state = AppState::new(config).expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvroute_service::http::serve(state, listener, async move {
        let _ = stopped.await;
    }));
    let served = Served { addr, stop, task };
    let mut client = served.client().await;
    let worker = json!({"worker_id": 1, "endpoint": "http://worker-1:8000", "block_size": 4});
    let (status, _) = client
        .request("POST", "/workers", Some(worker.to_string().as_bytes()))
        .await
        .expect("register a worker");
    assert_eq!(status, 201);
    served
}

impl Served {
    /// A keep-alive client whose every request must answer within 2 s.
    async fn client(&self) -> HttpClient {
        HttpClient::connect(self.addr)
            .await
            .expect("connect")
            .with_timeout(Duration::from_secs(2))
    }

    /// Signals shutdown; the time the server took to stop (at most 10 s).
    async fn stop(self) -> Duration {
        let start = Instant::now();
        self.stop.send(()).expect("signal");
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the server stops within 10 s")
            .expect("server task")
            .expect("server");
        start.elapsed()
    }
}

/// A `/select` body of 64 tokens.
fn select_body() -> String {
    json!({"token_ids": (1..=64).collect::<Vec<u32>>()}).to_string()
}

/// The head of a `POST /select` with a JSON body of `length` bytes.
fn select_head(length: usize) -> String {
    format!(
        "POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    )
}

/// What a connection received until the server closed it (end of stream or reset), when its
/// first byte came and when it closed. Panics if it is still open after `limit`.
struct Closed {
    received: Vec<u8>,
    first_byte: Option<Instant>,
    at: Instant,
}

impl Closed {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.received).into_owned()
    }
}

async fn until_closed(stream: &mut TcpStream, limit: Duration) -> Closed {
    let deadline = tokio::time::Instant::now() + limit;
    let (mut received, mut first_byte) = (Vec::new(), None);
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => panic!(
                "the server left the connection open for {limit:?}; it sent {:?}",
                String::from_utf8_lossy(&received)
            ),
            Ok(Ok(0) | Err(_)) => {
                return Closed {
                    received,
                    first_byte,
                    at: Instant::now(),
                };
            }
            Ok(Ok(n)) => {
                first_byte.get_or_insert_with(Instant::now);
                received.extend_from_slice(&buf[..n]);
            }
        }
    }
}

/// A value of the service's `/metrics`: the first sample line starting with `series`.
async fn metric(client: &mut HttpClient, series: &str) -> f64 {
    let (status, body) = client
        .request("GET", "/metrics", None)
        .await
        .expect("metrics");
    assert_eq!(status, 200);
    let text = String::from_utf8(body).expect("utf-8");
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in /metrics"))
}

/// The misbehaving clients of the first test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slow {
    /// Connects and sends nothing.
    Silent,
    /// Sends half a request head, then nothing.
    HalfHead,
    /// Sends a head one byte every 40 ms: progress, but never the whole head in time.
    TrickledHead,
    /// Sends a whole head of a `POST /select` and half its body.
    HalfBody,
    /// Makes one request, reads the answer, then sends nothing.
    IdleKeepAlive,
}

/// How long after its start the server closed the connection, and what it had sent.
async fn misbehave(addr: SocketAddr, kind: Slow) -> (Duration, Closed) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let start = Instant::now();
    let limit = Duration::from_secs(5);
    match kind {
        Slow::Silent => {
            let closed = until_closed(&mut stream, limit).await;
            (closed.at - start, closed)
        }
        Slow::HalfHead => {
            stream
                .write_all(b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-ty")
                .await
                .expect("write");
            let closed = until_closed(&mut stream, limit).await;
            (closed.at - start, closed)
        }
        Slow::TrickledHead => {
            let head = select_head(10);
            let (mut reader, mut writer) = stream.into_split();
            let sent = Arc::new(AtomicUsize::new(0));
            let trickle = tokio::spawn({
                let sent = Arc::clone(&sent);
                async move {
                    for byte in head.as_bytes().iter().take(100) {
                        if writer.write_all(&[*byte]).await.is_err() {
                            break;
                        }
                        sent.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(40)).await;
                    }
                }
            });
            let deadline = tokio::time::Instant::now() + limit;
            let mut received = Vec::new();
            let mut buf = [0u8; 256];
            let at = loop {
                match tokio::time::timeout_at(deadline, reader.read(&mut buf)).await {
                    Err(_) => panic!("a trickled head held its connection for {limit:?}"),
                    Ok(Ok(0) | Err(_)) => break Instant::now(),
                    Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
                }
            };
            trickle.abort();
            let sent = sent.load(Ordering::Relaxed);
            assert!(sent >= 3, "the trickle made progress: {sent} bytes");
            let closed = Closed {
                received,
                first_byte: None,
                at,
            };
            (at - start, closed)
        }
        Slow::HalfBody => {
            let body = select_body();
            let mut request = select_head(body.len()).into_bytes();
            request.extend_from_slice(&body.as_bytes()[..body.len() / 2]);
            stream.write_all(&request).await.expect("write");
            let sent = Instant::now();
            let closed = until_closed(&mut stream, limit).await;
            (closed.at - sent, closed)
        }
        Slow::IdleKeepAlive => {
            stream
                .write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                .await
                .expect("write");
            let closed = until_closed(&mut stream, limit).await;
            let answered = closed.first_byte.expect("an answer before the close");
            (closed.at - answered, closed)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_idle_connections_are_closed_in_time_while_clients_are_served() {
    const EACH: usize = 6;
    let served = serve(&[
        "--header-read-timeout-ms=300",
        "--body-read-timeout-ms=500",
        "--idle-timeout-secs=0.5",
        "--max-connections=50",
    ])
    .await;

    // A real client: `/health` and a `/select` every 20 ms on one keep-alive connection, until
    // the misbehaving ones are done (10 s at most).
    let done = Arc::new(AtomicBool::new(false));
    let real = {
        let (done, mut client) = (Arc::clone(&done), served.client().await);
        tokio::spawn(async move {
            let start = Instant::now();
            let mut rounds = 0u32;
            while !done.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(10) {
                let (health, _) = client
                    .request("GET", "/health", None)
                    .await
                    .expect("/health");
                let (select, answer) = client
                    .request("POST", "/select", Some(select_body().as_bytes()))
                    .await
                    .expect("/select");
                assert_eq!((health, select), (200, 200), "{answer:?}");
                let answer: Value = serde_json::from_slice(&answer).expect("JSON");
                assert_eq!(answer["worker_id"], 1);
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            rounds
        })
    };

    let kinds = [
        Slow::Silent,
        Slow::HalfHead,
        Slow::TrickledHead,
        Slow::HalfBody,
        Slow::IdleKeepAlive,
    ];
    let clients: Vec<_> = kinds
        .iter()
        .flat_map(|&kind| std::iter::repeat_n(kind, EACH))
        .map(|kind| tokio::spawn(misbehave(served.addr, kind)))
        .collect();
    let mut waits: Vec<(Slow, Duration)> = Vec::new();
    for (i, client) in clients.into_iter().enumerate() {
        let kind = kinds[i / EACH];
        let (waited, closed) = client.await.expect("misbehaving client");
        let (at_least, response) = match kind {
            Slow::Silent | Slow::HalfHead | Slow::TrickledHead => (300, None),
            Slow::HalfBody => (500, Some("HTTP/1.1 408")),
            Slow::IdleKeepAlive => (500, Some("HTTP/1.1 200")),
        };
        // Never before the timeout (less timer rounding), and in time on a loaded machine.
        assert!(
            waited >= Duration::from_millis(at_least - 20) && waited < Duration::from_secs(4),
            "{kind:?} closed after {waited:?}"
        );
        match response {
            None => assert!(closed.received.is_empty(), "{kind:?}: {}", closed.text()),
            Some(status_line) => assert!(
                closed.text().starts_with(status_line),
                "{kind:?}: {}",
                closed.text()
            ),
        }
        if kind == Slow::HalfBody {
            let text = closed.text().to_ascii_lowercase();
            assert!(text.contains("\r\nconnection: close\r\n"), "{text}");
            assert!(
                closed.text().ends_with(
                    r#"{"error":"Timed out reading the request body: not received within 500 ms"}"#
                ),
                "{}",
                closed.text()
            );
        }
        waits.push((kind, waited));
    }
    done.store(true, Ordering::Relaxed);
    let rounds = real.await.expect("the real client was served throughout");
    for kind in kinds {
        let of_kind: Vec<Duration> = waits
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, w)| *w)
            .collect();
        let first = *of_kind.iter().min().expect("some");
        let last = *of_kind.iter().max().expect("some");
        println!("{kind:?}: {EACH} connections closed after {first:?} to {last:?}");
        // Its timeout, not a later alarm, closed the first of each kind.
        let timeout = if matches!(kind, Slow::HalfBody | Slow::IdleKeepAlive) {
            500
        } else {
            300
        };
        assert!(
            first < Duration::from_millis(timeout + 300),
            "{kind:?}: {first:?}"
        );
    }
    println!("meanwhile the real client made {rounds} rounds of /health and /select, all 200");
    assert!(rounds >= 5, "the real client ran ({rounds} rounds)");

    let mut client = served.client().await;
    let timeouts = "kvroute_http_connection_timeouts_total{phase=";
    assert_eq!(
        metric(&mut client, &format!("{timeouts}\"header\"}}")).await,
        (3 * EACH) as f64
    );
    assert_eq!(
        metric(&mut client, &format!("{timeouts}\"idle\"}}")).await,
        EACH as f64
    );
    assert_eq!(
        metric(
            &mut client,
            r#"kvroute_http_requests_total{route="/select",method="POST",status="408"}"#
        )
        .await,
        EACH as f64
    );
    // Every slow connection's slot is back: only this client's is open.
    let start = Instant::now();
    while metric(&mut client, "kvroute_http_connections_open").await != 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "slots not given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    served.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_refuses_new_ones_and_never_those_in_flight() {
    const MAX: usize = 8;
    let served = serve(&[
        "--max-connections=8",
        "--header-read-timeout-ms=2000",
        "--body-read-timeout-ms=5000",
        "--idle-timeout-secs=5",
    ])
    .await;
    // One keep-alive client, one request in flight (its body half sent), and silent
    // connections up to the limit.
    let mut client = served.client().await;
    let start = Instant::now();
    while metric(&mut client, "kvroute_http_connections_open").await != 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "the setup's client still open"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let body = select_body();
    let mut in_flight = TcpStream::connect(served.addr).await.expect("connect");
    let mut request = select_head(body.len()).into_bytes();
    request.extend_from_slice(&body.as_bytes()[..body.len() / 2]);
    in_flight.write_all(&request).await.expect("write");
    let mut silent = Vec::new();
    for _ in 0..MAX - 2 {
        silent.push(TcpStream::connect(served.addr).await.expect("connect"));
    }
    let start = Instant::now();
    while metric(&mut client, "kvroute_http_connections_open").await < MAX as f64 {
        assert!(start.elapsed() < Duration::from_secs(2), "not all accepted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // At the limit a new connection is closed at once, with nothing sent.
    for _ in 0..3 {
        let mut refused = TcpStream::connect(served.addr).await.expect("TCP connect");
        let _ = refused
            .write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            .await;
        let sent = Instant::now();
        let closed = until_closed(&mut refused, Duration::from_secs(1)).await;
        assert!(closed.received.is_empty(), "{}", closed.text());
        println!("refused: closed {:?} after the request", closed.at - sent);
    }
    assert_eq!(
        metric(&mut client, "kvroute_http_connections_refused_total").await,
        3.0
    );
    // The open connections are served: the kept-alive client, and the request in flight.
    let (status, _) = client
        .request("GET", "/health", None)
        .await
        .expect("health");
    assert_eq!(status, 200);
    in_flight
        .write_all(&body.as_bytes()[body.len() / 2..])
        .await
        .expect("write");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while !String::from_utf8_lossy(&answer).contains("\"worker_id\":1") {
        let n = tokio::time::timeout_at(deadline, in_flight.read(&mut buf))
            .await
            .expect("the in-flight request is answered within 2 s")
            .expect("read");
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buf[..n]);
    }
    assert!(answer.starts_with(b"HTTP/1.1 200"));

    // The silent connections run out of time, and new clients are served again.
    for stream in &mut silent {
        let closed = until_closed(stream, Duration::from_secs(5)).await;
        assert!(closed.received.is_empty());
    }
    let mut again = served.client().await;
    let (status, _) = again.request("GET", "/health", None).await.expect("health");
    assert_eq!(status, 200);
    println!(
        "the silent connections closed {:?} after the limit was reached; a new client is served",
        start.elapsed()
    );
    served.stop().await;
}

#[tokio::test]
async fn a_slow_client_does_not_hold_up_graceful_shutdown() {
    let served = serve(&["--header-read-timeout-ms=300", "--body-read-timeout-ms=300"]).await;
    let mut half_head = TcpStream::connect(served.addr).await.expect("connect");
    half_head
        .write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.")
        .await
        .expect("write");
    let mut half_body = TcpStream::connect(served.addr).await.expect("connect");
    let body = select_body();
    let mut request = select_head(body.len()).into_bytes();
    request.extend_from_slice(&body.as_bytes()[..10]);
    half_body.write_all(&request).await.expect("write");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let took = served.stop().await;
    println!("stopped in {took:?} with a half-sent head and a half-sent body open");
    assert!(took < Duration::from_secs(3), "{took:?}");
    let closed = until_closed(&mut half_body, Duration::from_secs(1)).await;
    assert!(
        closed.text().starts_with("HTTP/1.1 408"),
        "{}",
        closed.text()
    );
}

/// A request whose body is sent in `pieces` from a channel (the sender is returned, so that the
/// body stays open after them).
fn streamed_select(
    pieces: Vec<Bytes>,
) -> (
    Request<Body>,
    futures::channel::mpsc::UnboundedSender<Result<Bytes, std::io::Error>>,
) {
    let (tx, rx) = futures::channel::mpsc::unbounded();
    for piece in pieces {
        tx.unbounded_send(Ok(piece)).expect("send");
    }
    let request = Request::post("/select")
        .header("content-type", "application/json")
        .body(Body::from_stream(rx))
        .expect("request");
    (request, tx)
}

#[tokio::test]
async fn a_late_body_is_a_408_and_a_slow_one_in_time_is_served() {
    let mut config = ServeConfig::defaults();
    config.body_read_timeout_ms = 200;
    let test = TestApp::with_config(config);
    let worker = json!({"worker_id": 1, "endpoint": "http://worker-1:8000", "block_size": 4});
    assert_eq!(test.post("/workers", worker).await.status, 201);
    let body = Bytes::from(select_body());

    let (request, _open) = streamed_select(vec![body.slice(..body.len() / 2)]);
    let start = Instant::now();
    let response = app(Arc::clone(&test.state))
        .oneshot(request)
        .await
        .expect("infallible");
    let waited = start.elapsed();
    assert_eq!(response.status(), 408);
    assert_eq!(response.headers()["connection"], "close");
    let answer = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(
        serde_json::from_slice::<Value>(&answer).expect("JSON"),
        json!({"error": "Timed out reading the request body: not received within 200 ms"})
    );
    assert!(
        waited >= Duration::from_millis(190) && waited < Duration::from_secs(3),
        "{waited:?}"
    );

    // Three pieces 30 ms apart: slow, but whole within the 200 ms.
    let (request, tx) = streamed_select(vec![body.slice(..10)]);
    let rest = body.slice(10..);
    let feeder = tokio::spawn(async move {
        for piece in [rest.slice(..rest.len() / 2), rest.slice(rest.len() / 2..)] {
            tokio::time::sleep(Duration::from_millis(30)).await;
            tx.unbounded_send(Ok(piece)).expect("send");
        }
    });
    let response = app(Arc::clone(&test.state))
        .oneshot(request)
        .await
        .expect("infallible");
    assert_eq!(response.status(), 200);
    feeder.await.expect("feeder");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_answers_is_closed_as_idle() {
    let served = serve(&["--idle-timeout-secs=0.5"]).await;
    // A small receive buffer and 400 pipelined requests for the OpenAPI document: the answers
    // fill the socket's buffers and the service's writes block.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stuck = socket.connect(served.addr).await.expect("connect");
    let request = b"GET /openapi.json HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n";
    stuck
        .write_all(&request.repeat(400))
        .await
        .expect("write the requests");
    let mut client = served.client().await;
    let start = Instant::now();
    let idle = "kvroute_http_connection_timeouts_total{phase=\"idle\"}";
    while metric(&mut client, idle).await < 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "a client not reading its answers held its connection for 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "a client not reading its answers was closed {:?} after its requests",
        start.elapsed()
    );
    assert!(start.elapsed() >= Duration::from_millis(450));
    let closed = until_closed(&mut stuck, Duration::from_secs(5)).await;
    assert!(closed.text().starts_with("HTTP/1.1 200"));
    served.stop().await;
}
