//! Serving connections, and what a slow or idle client may hold. [`serve`] accepts
//! through a [`GuardedListener`] and serves each connection with hyper's HTTP/1, over a
//! `GuardedIo`, until the shutdown signal; then it stops accepting, lets each connection
//! finish the request it has and waits for them all.
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
//! A connection that runs out of time is closed: its blocked read or write fails with
//! `TimedOut`, which ends hyper's connection. While the router has a request, from its parsed
//! head to its answer, nothing here closes the connection: in-flight requests always finish.
//!
//! How it knows the phase: hyper calls the connection's `ConnectionService` as soon as a
//! request's head is parsed, and the service's future completes when the router has answered;
//! both mark it in the connection's `Phase`; a write of the answer sets the idle deadline.
//! The connection has one alarm, looked at only when a read or write would block. A later
//! deadline does not move it: it goes off early and is set on then (at most once per idle
//! timeout of a busy connection); it is moved only when a deadline comes earlier (a slow head
//! after an idle spell). A request so costs two relaxed stores, an `Arc` clone, a clock read
//! and a relaxed load of the alarm's state; no allocation, task or timer registration.

use crate::config::ConnectionLimits;
use crate::metrics::ConnectionMetrics;
use axum::Router;
use axum::response::Response;
use axum::routing::future::RouteFuture;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};
use tower_service::Service as _;

/// Serves `router` on `listener`'s connections until `shutdown` resolves; then accepts no
/// more, lets every connection finish its request (an idle one closes at once) and returns
/// once all have closed.
pub async fn serve(
    mut listener: GuardedListener,
    router: Router,
    shutdown: impl Future<Output = ()>,
) {
    // Each connection holds a receiver of both: `stop` tells it to finish, and the server waits
    // for every `open` receiver to be dropped.
    let (stop_tx, stop_rx) = watch::channel(());
    let (open_tx, open_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let io = tokio::select! {
            io = listener.accept() => io,
            () = &mut shutdown => break,
        };
        let service = ConnectionService {
            router: router.clone(),
            phase: Arc::clone(&io.phase),
        };
        let (mut stop, open) = (stop_rx.clone(), open_rx.clone());
        tokio::spawn(async move {
            let builder = hyper::server::conn::http1::Builder::new();
            let mut connection = pin!(builder.serve_connection(TokioIo::new(io), service));
            let result = tokio::select! {
                result = connection.as_mut() => result,
                // The one change there is: shutdown.
                _ = stop.changed() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(error) = result {
                tracing::trace!(%error, "connection ended with an error");
            }
            drop(open);
        });
    }
    drop(listener);
    drop(open_rx);
    let _ = stop_tx.send(());
    open_tx.closed().await;
}

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

    /// The next connection under the limit; those beyond it are closed as they come.
    async fn accept(&mut self) -> GuardedIo {
        loop {
            // axum's accept retries at once after a connection's own error and after 1 s after
            // any other (such as running out of file descriptors).
            let (stream, _): (TcpStream, SocketAddr) =
                axum::serve::Listener::accept(&mut self.listener).await;
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
            return GuardedIo::new(stream, Arc::clone(&self.shared));
        }
    }
}

/// Where a connection's current request is, written by `ConnectionService` and `GuardedIo`
/// (both driven by the connection's one task: the atomics only make it `Sync`).
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

/// One accepted connection: the stream, its request's phase and its one alarm. Closing it
/// (dropping) gives its slot back.
#[derive(Debug)]
struct GuardedIo {
    stream: TcpStream,
    shared: Arc<Shared>,
    phase: Arc<Phase>,
    /// The connection's one alarm. Once armed it goes off no later than `deadline`, maybe
    /// earlier (then it is set on when it does).
    timer: Pin<Box<Sleep>>,
    /// The alarm was polled since it was last set: it will wake the connection's task, the
    /// one task (axum's) that drives this stream.
    armed: bool,
    /// What the connection waits for, and until when; `None` while a request is in flight,
    /// and from a kept-alive connection's next request's first byte to the first time a read
    /// blocks.
    deadline: Option<(Wait, Instant)>,
    /// The connection ran out of time: every blocked read and write fails from then on.
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
            armed: false,
            deadline: Some((Wait::Head, head_by)),
            expired: false,
        }
    }

    /// A new deadline; the alarm is disarmed only if it must go off earlier.
    fn set_deadline(&mut self, wait: Wait, at: Instant) {
        self.deadline = Some((wait, at));
        if self.timer.deadline() > at {
            self.armed = false;
        }
    }

    /// Arms the alarm for `at` unless it is armed already: `Ready` once `at` has passed.
    fn poll_alarm(&mut self, cx: &mut Context<'_>, at: Instant) -> Poll<()> {
        if self.armed && !self.timer.is_elapsed() {
            return Poll::Pending;
        }
        loop {
            if self.timer.deadline() > at {
                self.timer.as_mut().reset(at);
            }
            match self.timer.as_mut().poll(cx) {
                Poll::Pending => {
                    self.armed = true;
                    return Poll::Pending;
                }
                Poll::Ready(()) if self.timer.deadline() >= at => {
                    self.armed = false;
                    return Poll::Ready(());
                }
                // An earlier deadline's alarm: set it for this one.
                Poll::Ready(()) => self.timer.as_mut().reset(at),
            }
        }
    }

    /// A read or write would block: `Pending`, or the error that ends the connection when
    /// what it waits for is late.
    fn poll_deadline(&mut self, cx: &mut Context<'_>, writing: bool) -> Poll<io::Error> {
        if self.expired {
            return Poll::Ready(timed_out());
        }
        let wait = match self.phase.get() {
            Phase::HEAD => Wait::Head,
            Phase::ANSWERED => Wait::Idle,
            _ => {
                self.deadline = None;
                return Poll::Pending;
            }
        };
        let at = match self.deadline {
            Some((current, at)) if current == wait => at,
            // The answer's first write sets the idle deadline (`wrote`), or its blocking here.
            None if wait == Wait::Idle && !writing => return Poll::Pending,
            _ => {
                let limits = &self.shared.limits;
                let at = Instant::now()
                    + match wait {
                        Wait::Head => limits.header_read_timeout,
                        Wait::Idle => limits.idle_timeout,
                    };
                self.set_deadline(wait, at);
                at
            }
        };
        ready!(self.poll_alarm(cx, at));
        self.expired = true;
        let metrics = &self.shared.metrics;
        match wait {
            Wait::Head => metrics.header_timeouts.inc(),
            Wait::Idle => metrics.idle_timeouts.inc(),
        };
        tracing::debug!(?wait, "closing a connection that ran out of time");
        Poll::Ready(timed_out())
    }

    /// After a write: an answer's bytes moving start the idle time again; a blocked write
    /// counts as a blocked read does.
    fn wrote(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match written {
            Poll::Ready(Ok(n)) if n > 0 && self.phase.get() == Phase::ANSWERED => {
                let at = Instant::now() + self.shared.limits.idle_timeout;
                self.set_deadline(Wait::Idle, at);
                // Armed for it; should it have passed already, the next blocked call says so.
                let _ = self.poll_alarm(cx, at);
                written
            }
            Poll::Pending => self.poll_deadline(cx, true).map(Err),
            written => written,
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
            Poll::Pending => this.poll_deadline(cx, false).map(Err),
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
        this.wrote(cx, written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.wrote(cx, written)
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

/// The router as one connection's service: it marks its requests' phases for the connection.
#[derive(Debug, Clone)]
struct ConnectionService {
    router: Router,
    phase: Arc<Phase>,
}

impl hyper::service::Service<hyper::Request<Incoming>> for ConnectionService {
    type Response = Response;
    type Error = Infallible;
    type Future = Answered;

    fn call(&self, request: hyper::Request<Incoming>) -> Answered {
        self.phase.set(Phase::IN_FLIGHT);
        Answered {
            future: self.router.clone().call(request),
            phase: Arc::clone(&self.phase),
        }
    }
}

/// The router's answer to a request; marks the connection's phase when it comes.
struct Answered {
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
