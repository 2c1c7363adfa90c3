//! What a slow or idle client may hold (issue 31): [`serve`](super::serve) accepts through a
//! [`GuardedListener`], whose connections are [`GuardedIo`]s.
//!
//! - `--max-connections`: the listener counts open connections. At the limit it accepts each
//!   new connection and closes it at once, sending nothing: the kernel's backlog keeps draining
//!   and the client learns at once. An open connection, busy or idle, is never closed to make
//!   room; slots come back as connections close (the timeouts below see to idle ones).
//! - `--header-read-timeout-ms`: a request's head (request line and headers) must be in by then:
//!   a new connection's first one counted from its accept, a kept-alive connection's from the
//!   request's first byte. Bytes trickling in do not extend it.
//! - `--idle-timeout-secs`: once the service has answered, the connection may go this long
//!   with no byte moving, while the response is written (a client that stops reading it) and
//!   then until the next request's first byte.
//! - `--body-read-timeout-ms` is not here: the body extractors time their own reads
//!   (`json::body_bytes`), where a late body is still answered, with a 408.
//!
//! A connection that runs out of time is closed (its read fails with `TimedOut`, which ends
//! hyper's connection). While the router has a request, from its parsed head to its answer,
//! nothing here closes the connection: in-flight requests always finish.
//!
//! How it knows the phase: hyper calls the connection's [`ConnectionService`] once a request's
//! head is parsed, and the service's future completes when the router has answered; both mark
//! it in the connection's [`Phase`]; a write of the answer sets the idle deadline. The
//! connection has one timer, checked only when a read would block. A later deadline does not
//! move it: it fires early and is set on then (at most once per idle timeout of a kept-alive
//! connection); it is moved only when a deadline comes earlier (a slow head after an idle
//! spell). A request so costs two relaxed stores, an `Arc` clone (two with the clone of the
//! service hyper-util makes per request) and a clock read; no allocation, task or timer
//! registration.

use crate::config::ConnectionLimits;
use crate::metrics::ConnectionMetrics;
use axum::Router;
use axum::extract::Request;
use axum::response::Response;
use axum::routing::future::RouteFuture;
use axum::serve::{IncomingStream, Listener};
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

/// What every connection shares: the limits, the count of open connections, the counters.
#[derive(Debug)]
struct Shared {
    limits: ConnectionLimits,
    open: AtomicUsize,
    metrics: ConnectionMetrics,
}

/// The service's listener: TCP_NODELAY on every connection (responses leave at once, with no
/// Nagle delay behind an unacknowledged segment), at most `max_connections` open.
#[derive(Debug)]
pub struct GuardedListener {
    listener: TcpListener,
    shared: Arc<Shared>,
    /// Whether the last connection was refused: the warning is logged once per spell.
    refusing: bool,
}

impl GuardedListener {
    pub fn new(
        listener: TcpListener,
        limits: ConnectionLimits,
        metrics: ConnectionMetrics,
    ) -> Self {
        Self {
            listener,
            shared: Arc::new(Shared {
                limits,
                open: AtomicUsize::new(0),
                metrics,
            }),
            refusing: false,
        }
    }

    /// Takes a slot for a new connection, unless `max_connections` are open. Only the accept
    /// loop adds, so the count cannot pass the limit between the check and the add.
    fn admit(&self) -> bool {
        let shared = &self.shared;
        if shared.open.load(Ordering::Relaxed) >= shared.limits.max_connections {
            return false;
        }
        shared.open.fetch_add(1, Ordering::Relaxed);
        shared.metrics.open.inc();
        true
    }
}

impl Listener for GuardedListener {
    type Io = GuardedIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (GuardedIo, SocketAddr) {
        loop {
            // axum's accept retries at once after a connection's own error and after 1 s after
            // any other (such as running out of file descriptors).
            let (stream, addr) = Listener::accept(&mut self.listener).await;
            if !self.admit() {
                drop(stream);
                self.shared.metrics.refused.inc();
                if !self.refusing {
                    self.refusing = true;
                    tracing::warn!(
                        max_connections = self.shared.limits.max_connections,
                        "connection limit reached: closing new connections until open ones close"
                    );
                }
                continue;
            }
            self.refusing = false;
            if let Err(error) = stream.set_nodelay(true) {
                tracing::debug!(%error, "cannot set TCP_NODELAY");
            }
            return (GuardedIo::new(stream, Arc::clone(&self.shared)), addr);
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// Where a connection's current request is, written by [`ConnectionService`] and
/// [`GuardedIo`] (both driven by the connection's one task: the atomics only make it `Sync`).
#[derive(Debug, Default)]
struct Phase(AtomicU8);

impl Phase {
    /// Waiting for a request's head, or the rest of it (a new connection starts here).
    const HEAD: u8 = 0;
    /// The router has the request: no timeout from the connection.
    const IN_FLIGHT: u8 = 1;
    /// The router has answered: the response is written, then the connection waits for the
    /// next request's first byte.
    const ANSWERED: u8 = 2;

    fn get(&self) -> u8 {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, phase: u8) {
        self.0.store(phase, Ordering::Relaxed);
    }
}

/// What a connection's deadline is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    Head,
    Idle,
}

/// One accepted connection: the stream, its request's phase and its one timer. Closing it
/// (dropping) gives its slot back.
#[derive(Debug)]
pub struct GuardedIo {
    stream: TcpStream,
    shared: Arc<Shared>,
    phase: Arc<Phase>,
    /// Never later than `deadline`; may be earlier (then it fires and is set on).
    timer: Pin<Box<Sleep>>,
    /// What the connection waits for, and until when; `None` once that is over, until a read
    /// blocks again.
    deadline: Option<(Wait, Instant)>,
    /// The connection ran out of time: every read fails from then on.
    expired: bool,
}

impl GuardedIo {
    fn new(stream: TcpStream, shared: Arc<Shared>) -> Self {
        let head_by = Instant::now() + shared.limits.header_read_timeout;
        Self {
            stream,
            shared,
            phase: Arc::default(),
            timer: Box::pin(tokio::time::sleep_until(head_by)),
            deadline: Some((Wait::Head, head_by)),
            expired: false,
        }
    }

    /// A read would block: `Pending`, or the error that ends the connection when what it waits
    /// for is late.
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.expired {
            return Poll::Ready(Err(timed_out()));
        }
        let wait = match self.phase.get() {
            Phase::HEAD => Wait::Head,
            Phase::ANSWERED => Wait::Idle,
            _ => {
                self.deadline = None;
                return Poll::Pending;
            }
        };
        let deadline = match self.deadline {
            Some((current, at)) if current == wait => at,
            _ => {
                let limits = &self.shared.limits;
                let at = Instant::now()
                    + match wait {
                        Wait::Head => limits.header_read_timeout,
                        Wait::Idle => limits.idle_timeout,
                    };
                self.deadline = Some((wait, at));
                at
            }
        };
        loop {
            if self.timer.deadline() > deadline {
                self.timer.as_mut().reset(deadline);
            }
            match self.timer.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(()) if self.timer.deadline() >= deadline => break,
                // An earlier deadline's alarm: set it for this one.
                Poll::Ready(()) => self.timer.as_mut().reset(deadline),
            }
        }
        self.expired = true;
        let metrics = &self.shared.metrics;
        match wait {
            Wait::Head => metrics.header_timeouts.inc(),
            Wait::Idle => metrics.idle_timeouts.inc(),
        };
        tracing::debug!(?wait, "closing a connection that ran out of time");
        Poll::Ready(Err(timed_out()))
    }

    /// After a write: bytes of an answer moving restart the idle time.
    fn wrote(&mut self, written: &Poll<io::Result<usize>>) {
        if matches!(written, Poll::Ready(Ok(n)) if *n > 0) && self.phase.get() == Phase::ANSWERED {
            let idle_by = Instant::now() + self.shared.limits.idle_timeout;
            self.deadline = Some((Wait::Idle, idle_by));
        }
    }
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "connection closed: request head late or connection idle",
    )
}

impl Drop for GuardedIo {
    fn drop(&mut self) {
        self.shared.open.fetch_sub(1, Ordering::Relaxed);
        self.shared.metrics.open.dec();
    }
}

impl AsyncRead for GuardedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let filled = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Pending => this.poll_deadline(cx),
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > filled && this.phase.get() == Phase::ANSWERED {
                    // The next request's first bytes: its head is due from now.
                    this.phase.set(Phase::HEAD);
                    this.deadline = None;
                }
                Poll::Ready(Ok(()))
            }
            failed => failed,
        }
    }
}

impl AsyncWrite for GuardedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.wrote(&written);
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.wrote(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Makes each connection's [`ConnectionService`]: the make-service `axum::serve` takes.
#[derive(Debug, Clone)]
pub struct MakeConnectionService {
    router: Router,
}

impl MakeConnectionService {
    pub fn new(router: Router) -> Self {
        Self { router }
    }
}

impl Service<IncomingStream<'_, GuardedListener>> for MakeConnectionService {
    type Response = ConnectionService;
    type Error = Infallible;
    type Future = std::future::Ready<Result<ConnectionService, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, stream: IncomingStream<'_, GuardedListener>) -> Self::Future {
        std::future::ready(Ok(ConnectionService {
            router: self.router.clone(),
            phase: Arc::clone(&stream.io().phase),
        }))
    }
}

/// The router as one connection's service: it marks its requests' phases for the connection.
#[derive(Debug, Clone)]
pub struct ConnectionService {
    router: Router,
    phase: Arc<Phase>,
}

impl Service<Request> for ConnectionService {
    type Response = Response;
    type Error = Infallible;
    type Future = Answered;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Service::<Request>::poll_ready(&mut self.router, cx)
    }

    fn call(&mut self, request: Request) -> Answered {
        self.phase.set(Phase::IN_FLIGHT);
        Answered {
            future: self.router.call(request),
            phase: Arc::clone(&self.phase),
        }
    }
}

/// The router's answer to a request; marks the connection's phase when it comes.
pub struct Answered {
    future: RouteFuture<Infallible>,
    phase: Arc<Phase>,
}

impl Future for Answered {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let answer = ready!(Pin::new(&mut this.future).poll(cx));
        this.phase.set(Phase::ANSWERED);
        Poll::Ready(answer)
    }
}

/// Descriptors the service keeps besides its connections (listener, runtimes, engines' event
/// sockets, NATS, logs): the headroom asked for below the open-file limit.
const RESERVED_FILES: u64 = 256;

/// This process's soft limit on open files (Linux's `/proc/self/limits`), when known.
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find_map(|line| line.strip_prefix("Max open files"))?;
    line.split_whitespace().next()?.parse().ok()
}

/// Warns when `max_connections` could run the process out of file descriptors first: then
/// accept fails (and axum's accept loop sleeps a second) before the limit refuses anyone.
pub fn warn_if_above_file_limit(max_connections: usize) {
    let Some(limit) = open_file_limit() else {
        return;
    };
    let needed = u64::try_from(max_connections)
        .unwrap_or(u64::MAX)
        .saturating_add(RESERVED_FILES);
    if needed > limit {
        tracing::warn!(
            max_connections,
            open_file_limit = limit,
            "--max-connections plus {RESERVED_FILES} descriptors for the service's own files is \
             above the open-file limit: accept may fail before the limit refuses connections; \
             raise the limit (ulimit -n, systemd LimitNOFILE=) or lower --max-connections"
        );
    }
}
