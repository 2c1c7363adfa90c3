//! The run: register the workers, bind their fake engines, then `--concurrency` keep-alive
//! connections in a closed loop until `--duration-secs` or `--max-requests`, with the engines
//! publishing what is routed to them (and, with `--event-storm`, random prompts besides).

use super::args::{LoadgenArgs, Mode, resolve};
use super::prompts;
use super::report::{Outcome, Samples, micros, process_cpu_s};
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use kvroute_service::courtesy;
use kvroute_testkit::client::HttpClient;
use kvroute_testkit::fleet::{self, Fleet};
use kvroute_wire::PackedTokens;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Prompts handed to the engines and not yet published, at most; beyond that the clients wait.
const BACKLOG: usize = 256;

/// Runs a future on the fake engines' runtime and waits for it.
async fn on_engines<T: Send + 'static>(
    engines_rt: &tokio::runtime::Handle,
    task: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    engines_rt.spawn(task).await.ok()
}

/// The fake engines of `--events-base-port`, bound on the engines' runtime (`None`: none asked
/// for, or no workers).
async fn start_engines(
    args: &LoadgenArgs,
    engines_rt: &tokio::runtime::Handle,
) -> Result<Option<Fleet>, String> {
    let Some(base) = args.events_base_port else {
        return Ok(None);
    };
    let workers = args.engine_workers();
    if workers == 0 {
        return Ok(None);
    }
    let (kv_blocks, block_size) = (args.engine_kv_blocks, args.block_size);
    let bound = on_engines(engines_rt, async move {
        fleet::bind_fleet(base, workers, kv_blocks, block_size).await
    })
    .await
    .ok_or("the fake engines' runtime stopped")?;
    bound.map(Some).map_err(|e| e.to_string())
}

async fn register(addr: SocketAddr, args: &LoadgenArgs) -> Result<(), String> {
    if args.skip_register {
        return Ok(());
    }
    let mut client = HttpClient::connect(addr)
        .await
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    for id in 1..=args.workers {
        let mut body = json!({
            "worker_id": id,
            "endpoint": format!("http://worker-{id}:8000"),
            "block_size": args.block_size,
        });
        if let Some(base) = args.events_base_port
            && id <= args.engine_workers()
        {
            body["kv_events_endpoint"] = json!(fleet::engine_endpoint(base, id));
        }
        let (status, reply) = client
            .request("POST", "/workers", Some(body.to_string().as_bytes()))
            .await
            .map_err(|e| format!("registering worker {id}: {e}"))?;
        if status != 201 && status != 200 {
            return Err(format!(
                "registering worker {id}: status {status}: {}",
                String::from_utf8_lossy(&reply)
            ));
        }
    }
    Ok(())
}

/// Runs the whole measurement; the clients run on the calling runtime, the fake engines on
/// `engines_rt`.
pub async fn run(
    args: &LoadgenArgs,
    engines_rt: tokio::runtime::Handle,
) -> Result<Outcome, String> {
    let addr = resolve(&args.url)?;
    // The fake engines (stand-ins for engines on other hosts) run on a thread of their own, so
    // publishing never delays this process's clients, whose latencies are the measurement.
    // They bind first: a service that already lists their workers reconnects to them while the
    // prompts are read and prepared below (a second or more), instead of after.
    let engines = start_engines(args, &engines_rt).await?;
    let prompts = prompts::load(args.trace.as_deref(), args.max_prompt_tokens)?;
    // Pre-render the select bodies' token arrays (with the closing brace) so JSON encoding is not
    // measured; each request sends its own short head and this tail without copying it. With
    // the engines' block hashes of every prompt, computed once, not per request.
    let block_size = args.block_size as usize;
    let prepared = prompts::prepare(&prompts, block_size, args.events_base_port.is_some())?;
    let bodies: Arc<Vec<String>> = Arc::new(prepared.bodies);
    let sequences: Arc<Vec<Vec<u64>>> = Arc::new(prepared.sequences);
    let packed: Arc<Vec<PackedTokens>> = Arc::new(prepared.packed);
    let mean_prompt_tokens = prompts.iter().map(Vec::len).sum::<usize>() / prompts.len();
    register(addr, args).await?;
    if let Some(engines) = &engines
        && args.subscriber_wait_secs > 0
    {
        // Let the service's listeners connect before the first events are published (all
        // engines at once: each wait ends with a short pause for the subscription frame).
        let engines = Arc::clone(engines);
        let wait = Duration::from_secs(args.subscriber_wait_secs);
        on_engines(&engines_rt, async move {
            let mut waits = tokio::task::JoinSet::new();
            for at in 0..engines.len() {
                let engines = Arc::clone(&engines);
                waits.spawn(async move {
                    if let Some(e) = engines.get(at) {
                        e.wait_for_subscriber(wait).await;
                    }
                });
            }
            while waits.join_next().await.is_some() {}
        })
        .await;
    }
    let duration = Duration::from_secs_f64(args.duration_secs.clamp(0.1, 3600.0));
    let counter = Arc::new(AtomicU64::new(0));
    let backlog = Arc::new(Semaphore::new(BACKLOG));
    let cpu_before = process_cpu_s();
    let start = Instant::now();
    let prompts = Arc::new(prompts);
    // Engines at SCHED_IDLE stand in for engines on other hosts: besides giving a core up to a
    // thread that wakes, their thread yields after each stretch of work, so a client thread
    // that waits runnable for the core gets it then rather than at the next timer tick.
    let courteous = args.engine_idle;
    if let Some(engines) = &engines {
        for at in 0..engines.len() {
            let engines = Arc::clone(engines);
            let packed = Arc::clone(&packed);
            let sequences = Arc::clone(&sequences);
            engines_rt.spawn(async move {
                engines[at]
                    .flush_forever(&packed, &sequences, courteous)
                    .await
            });
        }
    }
    let mut storm = Vec::new();
    if let (true, Some(engines)) = (args.event_storm, &engines) {
        for (i, _) in engines.iter().enumerate() {
            let engines = Arc::clone(engines);
            let prompts = Arc::clone(&prompts);
            storm.push(engines_rt.spawn(async move {
                let mut n = i;
                while start.elapsed() < duration {
                    // Random-looking prompts the fleet never asks for: pure index churn.
                    let mut tokens = prompts[n % prompts.len()].clone();
                    for t in tokens.iter_mut().take(64) {
                        *t = t.wrapping_add(1 + (n as u32).wrapping_mul(7919));
                    }
                    let sequence =
                        PromptHashes::from_tokens(&tokens, block_size, BASE_SEED).sequence;
                    engines[i].publish_one_off(&tokens, &sequence).await;
                    if courteous {
                        courtesy::after_work(courtesy::STRETCH);
                    }
                    n += engines.len();
                    tokio::task::yield_now().await;
                }
                (n - i) / engines.len().max(1)
            }));
        }
    }
    let mut tasks = Vec::new();
    for task in 0..args.concurrency.max(1) {
        let connection = Connection {
            addr,
            engines: engines.clone(),
            backlog: Arc::clone(&backlog),
            bodies: Arc::clone(&bodies),
            counter: Arc::clone(&counter),
            label: args.label.clone(),
            task,
            mode: args.mode,
            max_requests: args.max_requests,
            start,
            duration,
        };
        tasks.push(tokio::spawn(connection.closed_loop()));
    }
    let mut samples = Samples::default();
    for t in tasks {
        if let Ok(s) = t.await {
            samples.merge(s);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // The load generator's own CPU over the measured loop (clients and fake engines), so that a
    // run can say how much of the machine the harness took per request.
    let cpu = process_cpu_s()
        .zip(cpu_before)
        .map(|((u1, s1), (u0, s0))| (u1 - u0, s1 - s0));
    let mut storm_prompts = 0;
    for t in storm {
        storm_prompts += t.await.unwrap_or(0);
    }
    Ok(Outcome {
        samples,
        secs,
        prompts: prompts.len(),
        mean_prompt_tokens,
        cpu,
        storm_prompts,
    })
}

/// One client connection of the closed loop and what it shares with the others.
struct Connection {
    addr: SocketAddr,
    engines: Option<Fleet>,
    backlog: Arc<Semaphore>,
    /// Each prompt's pre-rendered select-body tail.
    bodies: Arc<Vec<String>>,
    /// Requests started by all connections.
    counter: Arc<AtomicU64>,
    label: String,
    /// This connection's number, in its requests' ids.
    task: usize,
    mode: Mode,
    max_requests: u64,
    start: Instant,
    duration: Duration,
}

impl Connection {
    /// Sends cycle after cycle until the run's time or request budget is spent.
    async fn closed_loop(self) -> Samples {
        let Connection {
            addr,
            engines,
            backlog,
            bodies,
            counter,
            label,
            task,
            mode,
            max_requests: max,
            start,
            duration,
        } = self;
        let mut samples = Samples::default();
        let Ok(mut client) = HttpClient::connect(addr).await else {
            samples.transport_errors += 1;
            return samples;
        };
        while start.elapsed() < duration {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            if n >= max {
                break;
            }
            let id = format!("{label}-{task}-{n}");
            let index = (n as usize) % bodies.len();
            let tokens = &bodies[index];
            let (route, id_field) = match mode {
                Mode::Reserve => ("select_and_reserve", "reservation_id"),
                Mode::Select | Mode::Cycle => ("select", "selection_id"),
            };
            let head = format!("{{\"{id_field}\":\"{id}\",\"token_ids\":");
            let cycle_start = Instant::now();
            let status = timed(
                &mut client,
                &mut samples,
                route,
                "POST",
                &format!("/{route}"),
                &[head.as_bytes(), tokens.as_bytes()],
            )
            .await;
            if mode == Mode::Reserve && status == Some(200) {
                let free = format!("/reservations/{id}");
                timed(&mut client, &mut samples, "free", "DELETE", &free, &[]).await;
            }
            if mode == Mode::Cycle && status == Some(200) {
                let reserve = format!("{{\"selection_id\":\"{id}\"}}");
                let start_booking = Instant::now();
                let booked = match client
                    .request("POST", "/reservations", Some(reserve.as_bytes()))
                    .await
                {
                    Ok((status, reply)) => {
                        samples.reply("reservations", start_booking.elapsed(), status);
                        let worker = reply_worker_id(&reply);
                        // The engine that got the request now caches its prompt. An engine that
                        // holds the whole prompt has nothing to publish: seen from here, without
                        // a round trip to the engines' thread.
                        if let (Some(engines), Some(w)) = (&engines, worker) {
                            let at = (w as usize).wrapping_sub(1);
                            if !engines.get(at).is_some_and(|e| e.holds_prompt(index)) {
                                // The engine publishes in the background, as a real one does
                                // while it serves the request; a bounded backlog makes the
                                // clients wait when the engines fall behind.
                                if let (Some(engine), Some(permit)) =
                                    (engines.get(at), backlog_room(&backlog, &mut samples).await)
                                {
                                    engine.route(index, permit);
                                }
                            }
                        }
                        Some(status)
                    }
                    Err(_) => {
                        samples.transport_errors += 1;
                        None
                    }
                };
                if booked == Some(201) {
                    let prefill = format!("/reservations/{id}/prefill_complete");
                    timed(
                        &mut client,
                        &mut samples,
                        "prefill_complete",
                        "POST",
                        &prefill,
                        &[b"{}"],
                    )
                    .await;
                    let free = format!("/reservations/{id}");
                    timed(&mut client, &mut samples, "free", "DELETE", &free, &[]).await;
                }
            }
            if status.is_none() {
                // The connection is unusable after a transport error: reconnect.
                match HttpClient::connect(addr).await {
                    Ok(c) => client = c,
                    Err(_) => break,
                }
            }
            samples.cycles.push(micros(cycle_start.elapsed()));
        }
        samples
    }
}

/// Sends one request and counts its latency and status in `samples` (a transport error: `None`).
async fn timed(
    client: &mut HttpClient,
    samples: &mut Samples,
    route: &'static str,
    method: &str,
    path: &str,
    body: &[&[u8]],
) -> Option<u16> {
    let start = Instant::now();
    match client.request_parts(method, path, body).await {
        Ok((status, _)) => {
            samples.reply(route, start.elapsed(), status);
            Some(status)
        }
        Err(_) => {
            samples.transport_errors += 1;
            None
        }
    }
}

/// A place in the engines' backlog, counting in `samples` a wait when the engines are behind
/// (`None` only once the backlog is closed).
async fn backlog_room(
    backlog: &Arc<Semaphore>,
    samples: &mut Samples,
) -> Option<OwnedSemaphorePermit> {
    if let Ok(permit) = Arc::clone(backlog).try_acquire_owned() {
        return Some(permit);
    }
    let waited = Instant::now();
    let permit = Arc::clone(backlog).acquire_owned().await.ok();
    samples.backlog_waits += 1;
    samples.backlog_wait_us += waited.elapsed().as_micros() as u64;
    permit
}

/// The `worker_id` of a reservation reply, read without parsing the whole document (both
/// servers put it at the top level and no string before it contains the key).
fn reply_worker_id(reply: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"worker_id\"";
    let at = memchr::memmem::find(reply, KEY)? + KEY.len();
    let rest = &reply[at..];
    let rest = &rest[rest.iter().position(|b| !b.is_ascii_whitespace())?..];
    let rest = rest.strip_prefix(b":")?;
    let rest = &rest[rest.iter().position(|b| !b.is_ascii_whitespace())?..];
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::reply_worker_id;

    #[test]
    fn worker_id_is_read_from_either_servers_reply() {
        assert_eq!(
            reply_worker_id(br#"{"reservation_id":"a","worker_id":17,"dp_rank":0}"#),
            Some(17)
        );
        assert_eq!(
            reply_worker_id(br#"{"reservation_id": "a", "worker_id" : 9, "dp_rank": 0}"#),
            Some(9)
        );
        assert_eq!(
            reply_worker_id(br#"{"error":"reservation x not found"}"#),
            None
        );
        assert_eq!(reply_worker_id(br#"{"worker_id":null}"#), None);
    }
}
