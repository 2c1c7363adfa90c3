//! Engine load from `/metrics` (`--engine-metrics-poll-ms`, off by default): one task polls
//! every catalog worker's `{endpoint}/metrics` each interval, all workers concurrently, and
//! reports what each engine says it runs, queues and holds in KV cache to the selector
//! ([`Selector::report_engine_load`]), which raises the booked load to it while the report is
//! fresh. That load includes requests this router never saw (other routers, direct clients).
//!
//! A poll is bounded: connecting and the whole exchange take at most the interval and never
//! more than [`MAX_POLL_TIMEOUT`]; the body is read up to [`MAX_BODY_BYTES`]. A poll that gives
//! no load (unreachable, slow, an error status, a body without the gauges, a rank the selector
//! refuses) is counted in `kvroute_engine_metrics_poll_errors_total{reason}` and logged at
//! debug; the worker's last report then ages out and its bookings alone count again.
//!
//! Only `http://` endpoints are polled; `https://` ones are counted as `bad_url` (no TLS
//! here), and endpoints of other schemes are not engines' HTTP servers and are left alone.
//!
//! [`Selector::report_engine_load`]: kvroute_core::selector::Selector::report_engine_load

pub mod parse;

use crate::state::AppState;
use axum::http::{Request, StatusCode, Uri, header};
use hyper_util::rt::TokioIo;
use kvroute_core::event::Rank;
use kvroute_core::selector::Lifecycle;
use std::sync::Arc;
use std::time::Duration;

/// The longest one poll may take, whatever the interval.
pub const MAX_POLL_TIMEOUT: Duration = Duration::from_secs(1);
/// The most of a `/metrics` body read (vLLM's is tens of kilobytes).
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// A worker to poll: where, and which data-parallel ranks its engines are.
#[derive(Debug, Clone)]
struct Target {
    worker_id: u64,
    endpoint: String,
    dp_ranks: std::ops::Range<u32>,
}

/// Polls every `every` until the service shuts down.
pub async fn run(state: Arc<AppState>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !state.is_shutting_down() {
        tick.tick().await;
        poll_once(&state, every).await;
    }
}

/// One round: every worker with an HTTP endpoint, concurrently, each bounded by
/// `every` (at most [`MAX_POLL_TIMEOUT`]). Returns how many workers were polled.
pub async fn poll_once(state: &Arc<AppState>, every: Duration) -> usize {
    let limit = every.min(MAX_POLL_TIMEOUT);
    let targets = targets(state);
    let polled = targets.len();
    let mut polls = tokio::task::JoinSet::new();
    for target in targets {
        polls.spawn(async move {
            let body = fetch(&target.endpoint, limit).await;
            (target, body)
        });
    }
    while let Some(joined) = polls.join_next().await {
        // A poll task cannot panic short of a bug; its worker simply goes unreported.
        let Ok((target, body)) = joined else {
            continue;
        };
        let outcome = body.and_then(|body| report(state, &target, &body));
        if let Err(reason) = outcome {
            tracing::debug!(
                worker_id = target.worker_id,
                endpoint = %target.endpoint,
                reason,
                "engine metrics poll gave no load"
            );
        }
        state.metrics().count_engine_poll(outcome);
    }
    polled
}

/// The catalog's workers with an `http://` or `https://` endpoint.
fn targets(state: &AppState) -> Vec<Target> {
    state
        .selector
        .read()
        .list_workers(None, None)
        .into_iter()
        .filter(|r| r.lifecycle != Lifecycle::Unschedulable)
        .filter_map(|r| {
            let endpoint = r.spec.endpoint.as_deref()?;
            let is_http = endpoint.starts_with("http://") || endpoint.starts_with("https://");
            is_http.then(|| Target {
                worker_id: r.spec.worker_id,
                endpoint: endpoint.trim_end_matches('/').to_string(),
                dp_ranks: r.spec.dp_ranks(),
            })
        })
        .collect()
}

/// Gives the selector each engine's load of one body. An engine index names a rank either
/// globally (vLLM numbers its engines by data-parallel rank) or from the worker's first rank;
/// a body naming no engine is the worker's first rank.
fn report(state: &AppState, target: &Target, body: &str) -> Result<(), &'static str> {
    let metrics = parse::parse(body).map_err(parse::ParseError::reason)?;
    let now = state.now();
    let selector = state.selector.read();
    let ranks = &target.dp_ranks;
    let mut reported = 0;
    for (engine, load) in metrics.engines {
        let dp_rank = match engine {
            None => ranks.start,
            Some(i) if ranks.contains(&i) => i,
            Some(i) => match ranks.start.checked_add(i) {
                Some(d) if ranks.contains(&d) => d,
                _ => continue,
            },
        };
        selector
            .report_engine_load(Rank::new(target.worker_id, dp_rank), load, now)
            .map_err(|_| "rejected")?;
        reported += 1;
    }
    if reported == 0 {
        return Err("no_load_metrics");
    }
    Ok(())
}

/// Aborts a spawned task when dropped (a poll given up on takes its connection with it).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `GET {endpoint}/metrics`, all of it within `limit`: the body, or why there is none.
pub async fn fetch(endpoint: &str, limit: Duration) -> Result<String, &'static str> {
    let uri: Uri = format!("{endpoint}/metrics")
        .parse()
        .map_err(|_| "bad_url")?;
    if uri.scheme_str() != Some("http") {
        return Err("bad_url");
    }
    let Some(authority) = uri.authority().cloned() else {
        return Err("bad_url");
    };
    let path = uri
        .path_and_query()
        .map_or("/metrics", |p| p.as_str())
        .to_string();
    let exchange = async move {
        let port = authority.port_u16().unwrap_or(80);
        let stream = tokio::net::TcpStream::connect((authority.host(), port))
            .await
            .map_err(|_| "connect")?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| "connect")?;
        let _connection = AbortOnDrop(tokio::spawn(connection));
        let request = Request::get(path)
            .header(header::HOST, authority.as_str())
            .header(header::ACCEPT, "text/plain")
            .body(String::new())
            .map_err(|_| "bad_url")?;
        let response = sender.send_request(request).await.map_err(|_| "connect")?;
        if response.status() != StatusCode::OK {
            return Err("status");
        }
        let body =
            axum::body::to_bytes(axum::body::Body::new(response.into_body()), MAX_BODY_BYTES)
                .await
                .map_err(|_| "body")?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(limit, exchange)
        .await
        .unwrap_or(Err("timeout"))
}
