//! Several replicas sharing state through a real `nats-server` (SPEC §10): each test starts its
//! own server on 127.0.0.1 with a free port and a temporary JetStream store, and kills it at the
//! end. The server is the Debian package's binary: `KVROUTE_NATS_SERVER`, else `nats-server` on
//! the PATH, else `/usr/sbin/nats-server`; without one the tests fail and say how to install it.

use crate::common::TestApp;
use crate::common::nats::Nats;
use kvroute_core::error::PartitionKey;
use kvroute_core::selector::{Prompt, ReplicaSpread};
use kvroute_service::sync;
use kvroute_service::sync_tasks::{SyncTasks, start};
use kvroute_service::{AppState, ServeConfig};
use kvroute_testkit::fake_engine::FakeEngine;
use kvroute_wire::Encoding;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const MODEL: &str = "m";
const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// Replicas

struct Replica {
    app: TestApp,
    tasks: SyncTasks,
}

impl Replica {
    fn state(&self) -> &AppState {
        &self.app.state
    }
}

/// `kvroute serve --nats-url URL --replica-id ID --nats-snapshot-secs 1 EXTRA…`, in process.
async fn replica(nats: &Nats, id: &str, extra: &[&str]) -> Replica {
    let url = nats.url();
    let mut args = vec![
        "kvroute",
        "--nats-url",
        &url,
        "--replica-id",
        id,
        "--nats-snapshot-secs",
        "1",
    ];
    args.extend_from_slice(extra);
    let app = TestApp::with_config(ServeConfig::parse_from(args).unwrap());
    let tasks = start(&app.state).await.unwrap().expect("sync on");
    Replica { app, tasks }
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    start.elapsed()
}

fn worker(worker_id: u64) -> Value {
    json!({
        "worker_id": worker_id,
        "model_name": MODEL,
        "endpoint": format!("http://worker-{worker_id}"),
        "block_size": BLOCK,
    })
}

/// `(worker, rank) → (prefill tokens, decode blocks, requests)` as `/loads` reports them.
fn loads(state: &AppState) -> BTreeMap<(u64, u32), (u64, u64, u64)> {
    state
        .selector_for_tests()
        .read()
        .loads(None, None)
        .into_iter()
        .flat_map(|p| p.loads)
        .map(|l| {
            (
                (l.worker_id, l.dp_rank),
                (
                    l.potential_prefill_tokens,
                    l.potential_decode_blocks,
                    l.active_requests,
                ),
            )
        })
        .collect()
}

fn total_requests(state: &AppState) -> u64 {
    loads(state).values().map(|l| l.2).sum()
}

fn workers(state: &AppState) -> Vec<u64> {
    state
        .selector_for_tests()
        .read()
        .list_workers(None, None)
        .iter()
        .map(|r| r.spec.worker_id)
        .collect()
}

fn tokens(first: u32, count: u32) -> Vec<u32> {
    (first..first + count).collect()
}

async fn book(replica: &Replica, id: &str, worker_id: u64, prompt: &[u32]) {
    let reply = replica
        .app
        .post(
            "/reservations",
            json!({"reservation_id": id, "worker_id": worker_id, "model_name": MODEL,
                   "token_ids": prompt}),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text);
}

async fn free(replica: &Replica, id: &str) {
    let reply = replica.app.delete(&format!("/reservations/{id}")).await;
    assert_eq!(reply.status, 200, "free {id}: {}", reply.text);
}

async fn metric(replica: &Replica, prefix: &str) -> f64 {
    let text = replica.app.get("/metrics").await.text;
    text.lines()
        .filter(|line| line.starts_with(prefix))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn sorted_remote(state: &AppState) -> Vec<(String, String)> {
    let mut remote = state.selector_for_tests().read().remote_bookings();
    remote.sort();
    remote
}

// ---------------------------------------------------------------------------------------------
// The scenario of docs/replicas.md: two replicas, one catalog, one load view

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_catalog_and_bookings() {
    let nats = Nats::start();
    let a = replica(&nats, "a", &[]).await;
    let b = replica(&nats, "b", &[]).await;

    for id in [1, 2] {
        let reply = a.app.post("/workers", worker(id)).await;
        assert_eq!(reply.status, 201, "{}", reply.text);
    }
    eventually("B gets A's catalog", || workers(b.state()) == vec![1, 2]).await;

    let reply = a
        .app
        .post(
            "/select_and_reserve",
            json!({"model_name": MODEL, "token_ids": tokens(1, 17), "reservation_id": "a1"}),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    book(&b, "b1", 2, &tokens(100, 9)).await;
    let lag = eventually("both bookings on both replicas", || {
        total_requests(a.state()) == 2 && loads(a.state()) == loads(b.state())
    })
    .await;
    println!("bookings visible on the other replica within {lag:?}");

    let reply = a
        .app
        .post("/reservations/a1/prefill_complete", json!({}))
        .await;
    assert_eq!(reply.status, 200);
    eventually("prefill completion travels", || {
        loads(b.state()) == loads(a.state())
            && loads(b.state()).values().map(|l| l.0).sum::<u64>() == 9
    })
    .await;

    // Output blocks (not published at once by default) travel with the next reconciliation.
    for _ in 0..3 {
        let reply = a.app.post("/reservations/a1/output_block", json!({})).await;
        assert_eq!(reply.status, 200);
    }
    eventually("output blocks reconciled", || {
        loads(b.state()) == loads(a.state())
            && loads(a.state()).values().map(|l| l.1).sum::<u64>() == 5 + 3 + 3
    })
    .await;

    // Another replica's booking is not a client's to free; its own is.
    assert_eq!(b.app.delete("/reservations/a1").await.status, 404);
    free(&a, "a1").await;
    free(&b, "b1").await;
    eventually("frees travel", || {
        total_requests(a.state()) == 0 && total_requests(b.state()) == 0
    })
    .await;

    // A replica ignores its own messages, applies the others', and drops unknown workers.
    assert!(
        metric(
            &a,
            "kvroute_sync_messages_dropped_total{kind=\"booking\",reason=\"own\"}"
        )
        .await
            > 0.0
    );
    assert!(
        metric(
            &b,
            "kvroute_sync_messages_applied_total{kind=\"booking_put\"}"
        )
        .await
            > 0.0
    );
    let lag_count = metric(&b, "kvroute_sync_lag_seconds_count{kind=\"booking\"}").await;
    let lag_sum = metric(&b, "kvroute_sync_lag_seconds_sum{kind=\"booking\"}").await;
    assert!(lag_count > 0.0);
    println!(
        "sync lag (publish → apply) on B: {lag_count} booking messages, mean {:.2} ms",
        lag_sum / lag_count * 1e3
    );

    // Raw messages from a third party: twice the same state counts once; an unknown worker is
    // dropped and counted.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let bucket = async_nats::jetstream::new(client)
        .get_key_value("kvroute_bookings")
        .await
        .unwrap();
    let partition = PartitionKey::new(MODEL, "default");
    let state = json!({"v": 1, "replica": "x", "seq": 1, "ts_us": 0, "worker_id": 1,
        "dp_rank": 0, "block_size": BLOCK, "sequence_hashes": [1, 2], "isl_tokens": 8,
        "effective_prefill_tokens": 8, "track_prefill_tokens": true, "prefill_complete": false,
        "output_blocks": 0, "decode_blocks": 2});
    let key = sync::codec::booking_key(&partition, "x", "x1");
    for _ in 0..2 {
        bucket
            .put(&key, serde_json::to_vec(&state).unwrap().into())
            .await
            .unwrap();
    }
    let mut unknown = state.clone();
    unknown["worker_id"] = json!(999);
    bucket
        .put(
            sync::codec::booking_key(&partition, "x", "x2"),
            serde_json::to_vec(&unknown).unwrap().into(),
        )
        .await
        .unwrap();
    let dropped = "kvroute_sync_messages_dropped_total{kind=\"booking\",reason=\"unknown_worker\"}";
    let deadline = Instant::now() + WAIT;
    while metric(&b, dropped).await < 1.0 {
        assert!(Instant::now() < deadline, "unknown worker not counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        total_requests(b.state()),
        1,
        "the same state twice counts once"
    );
    assert_eq!(total_requests(a.state()), 1);

    // Deleting a worker on one replica deletes it everywhere.
    assert_eq!(b.app.delete("/workers/2").await.status, 200);
    eventually("A loses worker 2", || workers(a.state()) == vec![1]).await;
    drop(a.tasks);
    drop(b.tasks);
}

// ---------------------------------------------------------------------------------------------
// Faults

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookings_made_while_nats_restarts_are_reconciled() {
    let mut nats = Nats::start();
    let a = replica(&nats, "a", &[]).await;
    let b = replica(&nats, "b", &[]).await;
    for id in [1, 2, 3] {
        assert_eq!(a.app.post("/workers", worker(id)).await.status, 201);
    }
    eventually("catalog", || workers(b.state()).len() == 3).await;
    book(&a, "a1", 1, &tokens(1, 8)).await;
    book(&a, "a2", 2, &tokens(1, 8)).await;
    book(&b, "b1", 3, &tokens(50, 8)).await;
    eventually("synced", || {
        total_requests(b.state()) == 3 && loads(a.state()) == loads(b.state())
    })
    .await;

    nats.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // During the outage both sides keep serving.
    free(&a, "a1").await;
    book(&a, "a3", 3, &tokens(200, 12)).await;
    book(&b, "b2", 1, &tokens(300, 5)).await;
    free(&b, "b1").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    nats.restart();
    let restarted = Instant::now();

    eventually("views reconciled after the outage", || {
        sorted_remote(a.state()) == vec![("b".to_string(), "b2".to_string())]
            && sorted_remote(b.state())
                == vec![
                    ("a".to_string(), "a2".to_string()),
                    ("a".to_string(), "a3".to_string()),
                ]
            && loads(a.state()) == loads(b.state())
    })
    .await;
    println!(
        "NATS restart: views agree {:?} after the server accepted connections again",
        restarted.elapsed()
    );
    assert_eq!(
        total_requests(a.state()),
        3,
        "no booking lost, none doubled"
    );
    assert!(metric(&a, "kvroute_sync_reconnects_total").await >= 1.0);
    assert!(metric(&b, "kvroute_sync_reconnects_total").await >= 1.0);
    // Both keep syncing afterwards.
    free(&a, "a2").await;
    eventually("a free after the restart travels", || {
        total_requests(b.state()) == 2
    })
    .await;
    drop(a.tasks);
    drop(b.tasks);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookings_are_republished_to_a_server_that_lost_its_store() {
    let mut nats = Nats::start();
    let a = replica(&nats, "a", &[]).await;
    let b = replica(&nats, "b", &[]).await;
    for id in [1, 2] {
        assert_eq!(a.app.post("/workers", worker(id)).await.status, 201);
    }
    eventually("catalog", || workers(b.state()).len() == 2).await;
    book(&a, "a1", 1, &tokens(1, 8)).await;
    book(&b, "b1", 2, &tokens(50, 8)).await;
    eventually("synced", || {
        total_requests(b.state()) == 2 && loads(a.state()) == loads(b.state())
    })
    .await;

    nats.stop_and_wipe();
    nats.restart();
    free(&a, "a1").await;
    book(&a, "a2", 2, &tokens(90, 8)).await;
    eventually("views agree again", || {
        sorted_remote(a.state()) == vec![("b".to_string(), "b1".to_string())]
            && sorted_remote(b.state()) == vec![("a".to_string(), "a2".to_string())]
    })
    .await;
    // The catalog is not re-published: registered again, a new replica gets everything.
    for id in [1, 2] {
        assert_eq!(a.app.post("/workers", worker(id)).await.status, 201);
    }
    let c = replica(&nats, "c", &[]).await;
    eventually("a new replica catches up", || {
        workers(c.state()).len() == 2 && loads(c.state()) == loads(a.state())
    })
    .await;
    assert_eq!(total_requests(c.state()), 2);
    drop((a.tasks, b.tasks, c.tasks));
}

fn device_blocks(state: &AppState, worker_id: u64, prompt: &[u32]) -> u32 {
    let selector = state.selector_for_tests().read();
    selector
        .overlap_scores(
            &PartitionKey::new(MODEL, "default"),
            Prompt::Tokens {
                tokens: prompt,
                lora_name: None,
                cache_salt: None,
                extras: kvroute_core::hash::BlockExtras::default(),
            },
        )
        .ok()
        .and_then(|scores| {
            scores
                .workers
                .iter()
                .find(|w| w.worker_id == worker_id)
                .map(|w| w.device_blocks)
        })
        .unwrap_or(0)
}

/// Publishes `prompt` from `engine` until `state`'s index holds it on worker 1 (the first ones
/// may be published before a subscription is in place).
async fn publish_until_indexed(
    engine: &mut FakeEngine,
    state: &AppState,
    prompt: &[u32],
    what: &str,
) {
    let blocks = prompt.len() as u32 / BLOCK;
    let deadline = Instant::now() + WAIT;
    while device_blocks(state, 1, prompt) < blocks {
        assert!(Instant::now() < deadline, "{what}");
        engine
            .publish_stored(None, prompt, BLOCK, None)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// With the relay, a replica that does not listen to a worker's engine is fed by the stream:
/// those events count as arriving there, so it does not call the worker silent; a worker whose
/// engine publishes nothing is called silent (`no_kv_events`) where it is booked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_events_keep_a_worker_from_being_called_silent() {
    use kvroute_service::degraded::Reason;
    let nats = Nats::start();
    let flags = [
        "--nats-relay-events",
        "--kv-silence-secs",
        "30",
        "--kv-silence-bookings",
        "3",
    ];
    let a = replica(&nats, "a", &flags).await;
    let b = replica(&nats, "b", &flags).await;
    let mut engine = FakeEngine::bind("tcp://127.0.0.1:0", None, Encoding::Array)
        .await
        .unwrap();
    let mut with_events = worker(1);
    with_events["kv_events_endpoint"] = json!(engine.pub_endpoint());
    assert_eq!(a.app.post("/workers", with_events).await.status, 201);
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut silent_worker = worker(3);
    silent_worker["kv_events_endpoint"] = json!(format!("tcp://{}", silent.local_addr().unwrap()));
    drop(silent);
    assert_eq!(a.app.post("/workers", silent_worker).await.status, 201);
    eventually("catalog", || workers(b.state()) == vec![1, 3]).await;
    publish_until_indexed(
        &mut engine,
        a.state(),
        &tokens(9_000, 4),
        "never subscribed",
    )
    .await;
    for i in 0..4u32 {
        book(&b, &format!("r{i}"), 1, &tokens(100 * i, 16)).await;
        book(&b, &format!("s{i}"), 3, &tokens(100 * i, 16)).await;
    }
    // The engine's next event reaches B through the relay only.
    let prompt = tokens(5_000, 16);
    engine
        .publish_stored(None, &prompt, BLOCK, None)
        .await
        .unwrap();
    eventually("B's index via the relay", || {
        device_blocks(b.state(), 1, &prompt) == 4
    })
    .await;
    b.state().advance_clock(Duration::from_secs(31));
    b.state().tick(b.state().now());
    let degraded = kvroute_service::api::degraded(b.state());
    assert!(!degraded.contains_key(&1), "{degraded:?}");
    assert_eq!(degraded[&3].len(), 1, "{degraded:?}");
    assert_eq!(degraded[&3][0].reason, Reason::NoKvEvents);
    assert!(
        degraded[&3][0]
            .message
            .starts_with("worker 3: 4 bookings in 31 s and no KV event")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replica_recovers_its_bookings_and_the_index() {
    let nats = Nats::start();
    let relay = ["--nats-relay-events"];
    let a = replica(&nats, "a", &relay).await;
    let b = replica(&nats, "b", &relay).await;
    let mut engine = FakeEngine::bind("tcp://127.0.0.1:0", None, Encoding::Array)
        .await
        .unwrap();
    let mut with_events = worker(1);
    with_events["kv_events_endpoint"] = json!(engine.pub_endpoint());
    assert_eq!(a.app.post("/workers", with_events).await.status, 201);
    assert_eq!(a.app.post("/workers", worker(2)).await.status, 201);
    eventually("catalog", || workers(b.state()) == vec![1, 2]).await;
    assert_eq!(
        b.state().ingest().active_listeners(),
        0,
        "with the relay, only the registering replica opens the engine's stream"
    );

    // Publish until A's listener is subscribed, then a prompt: both indexes hold it, B's via
    // the relayed stream.
    let probe = tokens(9_000, 4);
    publish_until_indexed(&mut engine, a.state(), &probe, "listener never subscribed").await;
    let prompt = tokens(1, 40);
    engine
        .publish_stored(None, &prompt, BLOCK, None)
        .await
        .unwrap();
    eventually("B's index via the relay", || {
        device_blocks(b.state(), 1, &prompt) == 10
    })
    .await;

    book(&a, "a1", 1, &prompt).await;
    book(&b, "b1", 2, &tokens(500, 8)).await;
    eventually("synced", || {
        total_requests(a.state()) == 2 && loads(a.state()) == loads(b.state())
    })
    .await;
    let before = loads(a.state());

    // Kill B and start it again under the same id.
    drop(b);
    let started = Instant::now();
    let b = replica(&nats, "b", &relay).await;
    let recovered = started.elapsed();
    println!(
        "replica b restarted: catch-up {:?} (start() returned after {recovered:?}); \
         bookings and index recovered on return",
        b.tasks.catch_up
    );
    assert_eq!(loads(b.state()), before, "bookings recovered");
    assert_eq!(device_blocks(b.state(), 1, &prompt), 10, "index recovered");
    assert_eq!(b.state().ingest().active_listeners(), 0);
    free(&b, "b1").await;
    eventually("B's own recovered booking freed everywhere", || {
        total_requests(a.state()) == 1
    })
    .await;

    // Kill A, the replica that consumes the engine: it recovers too, and resumes consuming.
    drop(a);
    let started = Instant::now();
    let a = replica(&nats, "a", &relay).await;
    println!(
        "replica a (the engine's consumer) restarted: recovered in {:?}",
        started.elapsed()
    );
    assert_eq!(total_requests(a.state()), 1);
    assert_eq!(device_blocks(a.state(), 1, &prompt), 10);
    assert_eq!(a.state().ingest().active_listeners(), 1);
    free(&a, "a1").await;
    eventually("A's own recovered booking freed everywhere", || {
        total_requests(b.state()) == 0
    })
    .await;
    let later = tokens(100, 8);
    publish_until_indexed(&mut engine, b.state(), &later, "relay did not resume").await;
    drop(a.tasks);
    drop(b.tasks);
}

/// One request's flow: select_and_reserve (the popular prefix plus its own suffix), then its
/// prefill completes.
async fn serve(app: &TestApp, popular: &[u32], i: u32) {
    let mut prompt = popular.to_vec();
    prompt.extend(tokens(100_000 + i * 8, 8));
    let request =
        json!({"model_name": MODEL, "token_ids": prompt, "reservation_id": format!("r{i}")});
    let reply = app.post("/select_and_reserve", request).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let done = app
        .post(&format!("/reservations/r{i}/prefill_complete"), json!({}))
        .await;
    assert_eq!(done.status, 200);
}

/// Bookings per worker after `requests` select_and_reserve calls for one popular prefix, split
/// over two replicas in concurrent pairs; `(max, min)` over the workers.
///
/// Under Dynamo's weights (`--router-profile dynamo`), where a rank's decode blocks weigh as much
/// as the prompt's uncached prefill: the others' bookings are what steers a replica away. (With
/// kvroute's weights a 32-block hit outweighs hundreds of bookings whose prefill is done, so every
/// request stays on the cached worker, synced or not.)
async fn herd(nats: Option<&Nats>, workers: u64, requests: u32) -> (u64, u64) {
    const DYNAMO: [&str; 2] = ["--router-profile", "dynamo"];
    let mut tasks = Vec::new();
    let (a, b) = match nats {
        Some(nats) => {
            let a = replica(nats, "a", &DYNAMO).await;
            let b = replica(nats, "b", &DYNAMO).await;
            tasks.extend([a.tasks, b.tasks]);
            (a.app, b.app)
        }
        None => {
            let app = || {
                let config = ServeConfig::parse_from(["kvroute"].into_iter().chain(DYNAMO));
                TestApp::with_config(config.unwrap())
            };
            (app(), app())
        }
    };
    for id in 1..=workers {
        assert_eq!(a.post("/workers", worker(id)).await.status, 201);
        if nats.is_none() {
            assert_eq!(b.post("/workers", worker(id)).await.status, 201);
        }
    }
    eventually("catalog", || {
        workers as usize
            == b.state
                .selector_for_tests()
                .read()
                .list_workers(None, None)
                .len()
    })
    .await;
    // Worker 1 served the popular prefix recently: both replicas predict it cached there (their
    // approximate cache model learns from their own bookings), as both would see it in an
    // engine's KV events; that is what makes independent replicas herd.
    let popular = tokens(1, 32 * BLOCK);
    for (app, id) in [(&a, "warm-a"), (&b, "warm-b")] {
        let reply = app
            .post(
                "/reservations",
                json!({"reservation_id": id, "worker_id": 1, "model_name": MODEL,
                       "token_ids": popular}),
            )
            .await;
        assert_eq!(reply.status, 201, "{}", reply.text);
        assert_eq!(app.delete(&format!("/reservations/{id}")).await.status, 200);
    }
    for pair in 0..requests / 2 {
        let (i, j) = (2 * pair, 2 * pair + 1);
        tokio::join!(serve(&a, &popular, i), serve(&b, &popular, j));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut per_worker: BTreeMap<u64, u64> = (1..=workers).map(|w| (w, 0)).collect();
    for app in [&a, &b] {
        for (_, booking) in app.state.selector_for_tests().read().local_bookings() {
            *per_worker.entry(booking.worker_id).or_default() += 1;
        }
    }
    println!("bookings per worker: {per_worker:?}");
    drop(tasks);
    let max = per_worker.values().copied().max().unwrap_or(0);
    let min = per_worker.values().copied().min().unwrap_or(0);
    (max, min)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_spreads_a_popular_prefix_over_the_workers() {
    let (workers, requests) = (4, 64);
    let off = herd(None, workers, requests).await;
    let nats = Nats::start();
    let on = herd(Some(&nats), workers, requests).await;
    println!(
        "herding, {requests} select_and_reserve over 2 replicas, {workers} workers: \
         sync off max/min bookings per worker {}/{}, sync on {}/{}",
        off.0, off.1, on.0, on.1
    );
    assert!(
        on.0 - on.1 < off.0 - off.1,
        "sync on ({on:?}) must spread better than off ({off:?})"
    );
}

/// Replica spread: each replica finds its place among the replicas it shares bookings with
/// (`ReplicaSpread`: near-equal picks spread by it), refreshed by the housekeeping tick, and is
/// alone again once the other's bookings are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_learn_their_place_among_each_other_from_shared_bookings() {
    let nats = Nats::start();
    let a = replica(&nats, "a", &[]).await;
    let b = replica(&nats, "b", &[]).await;
    assert_eq!(a.app.post("/workers", worker(1)).await.status, 201);
    eventually("B knows worker 1", || workers(b.state()) == vec![1]).await;
    let spread_of = |r: &Replica| {
        r.state().tick(Instant::now());
        r.state().selector_for_tests().read().replica_spread()
    };
    assert_eq!((spread_of(&a), spread_of(&b)), (None, None));
    book(&a, "from-a", 1, &tokens(0, 16)).await;
    book(&b, "from-b", 1, &tokens(100, 16)).await;
    eventually("each replica has both bookings", || {
        total_requests(a.state()) == 2 && total_requests(b.state()) == 2
    })
    .await;
    let place = |index| Some(ReplicaSpread { index, replicas: 2 });
    assert_eq!((spread_of(&a), spread_of(&b)), (place(0), place(1)));
    free(&a, "from-a").await;
    eventually("B heard of the free", || total_requests(b.state()) == 1).await;
    // B still has its own booking but no other replica's: alone.
    assert_eq!(spread_of(&b), None);
    assert_eq!(spread_of(&a), place(0), "A still hears of B's booking");
}

/// Recovery time of a restarted replica with a few thousand live bookings and relayed event
/// batches (printed for the closing note; asserted complete).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_recovery_time_with_thousands_of_bookings_and_events() {
    const BOOKINGS: u32 = 2_000;
    const BATCHES: u32 = 1_000;
    let nats = Nats::start();
    let relay = ["--nats-relay-events"];
    let a = replica(&nats, "a", &relay).await;
    let mut engine = FakeEngine::bind("tcp://127.0.0.1:0", None, Encoding::Array)
        .await
        .unwrap();
    let mut with_events = worker(1);
    with_events["kv_events_endpoint"] = json!(engine.pub_endpoint());
    assert_eq!(a.app.post("/workers", with_events).await.status, 201);
    assert_eq!(a.app.post("/workers", worker(2)).await.status, 201);
    let probe = tokens(9_000_000, 4);
    publish_until_indexed(&mut engine, a.state(), &probe, "listener never subscribed").await;
    // Distinct 16-block prompts, one stored batch each.
    let prompt = |i: u32| tokens(i * 64, 64);
    for i in 0..BATCHES {
        engine
            .publish_stored(None, &prompt(i), BLOCK, None)
            .await
            .unwrap();
    }
    eventually("A indexed every batch", || {
        device_blocks(a.state(), 1, &prompt(BATCHES - 1)) == 16
    })
    .await;
    for i in 0..BOOKINGS {
        book(
            &a,
            &format!("a{i}"),
            1 + u64::from(i % 2),
            &prompt(i % BATCHES),
        )
        .await;
    }
    let a_loads = loads(a.state());
    let b_first = replica(&nats, "b", &relay).await;
    eventually("B has every booking", || loads(b_first.state()) == a_loads).await;
    drop(b_first);

    let started = Instant::now();
    let b = replica(&nats, "b", &relay).await;
    let recovered = started.elapsed();
    assert_eq!(
        loads(b.state()),
        a_loads,
        "every booking recovered at start"
    );
    for i in [0, BATCHES / 2, BATCHES - 1] {
        assert_eq!(device_blocks(b.state(), 1, &prompt(i)), 16, "batch {i}");
    }
    println!(
        "restart with {BOOKINGS} live bookings and {BATCHES} relayed event batches of 16 blocks: \
         bookings and index recovered in {recovered:?}"
    );
    drop(a.tasks);
    drop(b.tasks);
}

// ---------------------------------------------------------------------------------------------
// Routing constraints travel with the catalog

/// A worker's taints, topology domains and KV-transfer fields reach the other replica with the
/// rest of its record, a PATCH of them too, and the other replica's selects honour them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_taints_travel_with_the_catalog() {
    let nats = Nats::start();
    let a = replica(&nats, "a", &[]).await;
    let b = replica(&nats, "b", &[]).await;
    let mut tainted = worker(2);
    tainted["taints"] = json!(["gpu=h100", "pref"]);
    tainted["topology_domains"] = json!({"zone": "a"});
    tainted["kv_transfer_domain"] = json!("zone");
    tainted["kv_transfer_enforcement"] = json!("preferred");
    tainted["kv_transfer_preferred_weight"] = json!(0.85);
    for body in [worker(1), tainted] {
        let reply = a.app.post("/workers", body).await;
        assert_eq!(reply.status, 201, "{}", reply.text);
    }
    eventually("B gets A's catalog", || workers(b.state()) == vec![1, 2]).await;
    let listed = a.app.get("/workers").await.body;
    assert_eq!(listed[1]["kv_transfer_preferred_weight"], json!(0.85));
    assert_eq!(b.app.get("/workers").await.body, listed);

    let select = |taint: &str| {
        json!({"model_name": MODEL, "token_ids": tokens(1, 9),
               "routing_constraints": {"required_taints": [taint]}})
    };
    let reply = b.app.post("/select", select("gpu=h100")).await;
    assert_eq!(
        (reply.status.as_u16(), reply.body["worker_id"].clone()),
        (200, json!(2))
    );

    let reply = a
        .app
        .call(
            axum::http::Method::PATCH,
            "/workers/2",
            Some(json!({"taints": ["gpu=a100"]})),
        )
        .await;
    assert_eq!(reply.body["taints"], json!(["gpu=a100"]), "{}", reply.text);
    eventually("the PATCH travels", || {
        b.state()
            .selector_for_tests()
            .read()
            .worker(2)
            .is_some_and(|r| r.spec.taints.contains("gpu=a100"))
    })
    .await;
    assert_eq!(b.app.post("/select", select("gpu=h100")).await.status, 503);
    let reply = b.app.post("/select", select("gpu=a100")).await;
    assert_eq!(reply.body["worker_id"], json!(2), "{}", reply.text);
}

// ---------------------------------------------------------------------------------------------
// Session affinity

/// The rank a replica's table binds `session` to, if alive.
fn bound(replica: &Replica, session: &str) -> Option<(u64, u32)> {
    let key =
        kvroute_core::selector::SessionKey::new(&PartitionKey::new(MODEL, "default"), session);
    let state = replica.state();
    let binding = state
        .selector_for_tests()
        .read()
        .session_binding(&key, state.now());
    binding.map(|b| (b.rank.worker_id, b.rank.dp_rank))
}

/// Whether `session`'s binding on `replica` is idle (expiring) rather than held by a booking.
fn idle(replica: &Replica, session: &str) -> bool {
    let key =
        kvroute_core::selector::SessionKey::new(&PartitionKey::new(MODEL, "default"), session);
    let state = replica.state();
    let binding = state
        .selector_for_tests()
        .read()
        .session_binding(&key, state.now());
    binding.is_some_and(|b| b.idle_until.is_some())
}

/// `select_and_reserve` of a 17-token prompt in `session` under `id`; the status and worker.
async fn book_session(
    replica: &Replica,
    session: &str,
    id: &str,
    allowed: Option<&[u64]>,
) -> (u16, Value) {
    let mut body = json!({"model_name": MODEL, "token_ids": tokens(1, 17),
                          "reservation_id": id, "session_id": session});
    if let Some(allowed) = allowed {
        body["allowed_worker_ids"] = json!(allowed);
    }
    let reply = replica.app.post("/select_and_reserve", body).await;
    (reply.status.as_u16(), reply.body["worker_id"].clone())
}

/// Moves both replicas' clocks past the TTL and runs their housekeeping.
fn after_the_ttl(replicas: &[&Replica]) {
    for r in replicas {
        r.state().advance_clock(Duration::from_secs(61));
        r.state().tick(r.state().now());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_bindings_are_shared_survive_a_restart_and_expire_everywhere() {
    let nats = Nats::start();
    let ttl = ["--session-affinity-ttl-secs", "60"];
    let a = replica(&nats, "a", &ttl).await;
    let b = replica(&nats, "b", &ttl).await;
    for id in [1, 2, 3] {
        assert_eq!(a.app.post("/workers", worker(id)).await.status, 201);
    }
    eventually("catalog", || workers(b.state()).len() == 3).await;

    // A binds session s to worker 2; B sees the binding and routes s there.
    assert_eq!(
        book_session(&a, "s", "a1", Some(&[2])).await,
        (200, json!(2))
    );
    eventually("B learns s → 2", || bound(&b, "s") == Some((2, 0))).await;
    assert_eq!(book_session(&b, "s", "b1", None).await, (200, json!(2)));
    // A's booking ends; B's still holds the session on both replicas past the TTL.
    free(&a, "a1").await;
    eventually("A sees B's booking", || total_requests(a.state()) == 1).await;
    after_the_ttl(&[&a, &b]);
    assert_eq!(
        (bound(&a, "s"), bound(&b, "s")),
        (Some((2, 0)), Some((2, 0)))
    );
    // B's booking ends: the binding idles on both, and expires on both.
    free(&b, "b1").await;
    eventually("A sees the session idle", || idle(&a, "s")).await;
    assert!(idle(&b, "s"));
    after_the_ttl(&[&a, &b]);
    assert_eq!((bound(&a, "s"), bound(&b, "s")), (None, None));

    // B binds r (then idle) and h (held by its booking), and restarts under the same id.
    assert_eq!(
        book_session(&b, "r", "b2", Some(&[3])).await,
        (200, json!(3))
    );
    free(&b, "b2").await;
    assert_eq!(
        book_session(&b, "h", "b3", Some(&[1])).await,
        (200, json!(1))
    );
    eventually("A learns r and h", || {
        bound(&a, "r") == Some((3, 0)) && idle(&a, "r") && bound(&a, "h") == Some((1, 0))
    })
    .await;
    drop(b);
    let b = replica(&nats, "b", &ttl).await;
    assert_eq!(bound(&b, "r"), Some((3, 0)), "idle binding recovered");
    assert!(idle(&b, "r"));
    assert_eq!(bound(&b, "h"), Some((1, 0)), "held binding recovered");
    assert!(!idle(&b, "h"), "held by its recovered booking");
    // The recovered booking's free lets h idle, here and on A.
    free(&b, "b3").await;
    assert!(idle(&b, "h"));
    eventually("A sees h idle", || idle(&a, "h")).await;

    // A refused booking drops the binding on every replica.
    assert_eq!(book_session(&a, "h", "a2", Some(&[2])).await.0, 400);
    eventually("B drops h", || bound(&b, "h").is_none()).await;
    assert!(
        metric(
            &b,
            "kvroute_sync_messages_applied_total{kind=\"session_put\"}"
        )
        .await
            > 0.0
    );
    drop(a.tasks);
    drop(b.tasks);
}
