//! Live KV-event ingest over real ZeroMQ sockets on 127.0.0.1: a [`FakeEngine`] publishes, the
//! service's listeners (started by `POST /workers`) apply, and the selector's overlap scores show
//! the result. Every wait polls with a deadline.

use crate::common::TestApp;
use kvroute_core::error::PartitionKey;
use kvroute_core::event::KvEvent;
use kvroute_core::selector::{Prompt, Selector, WorkerSpec};
use kvroute_service::AppState;
use kvroute_service::ingest::{EventSink, IngestConfig, IngestManager, ListenerState};
use kvroute_service::metrics::Metrics;
use kvroute_testkit::fake_engine::{
    FakeEngine, ReplayLayout, ReplayMode, StoredBlocks, stored_event,
};
use kvroute_wire::frames;
use kvroute_wire::{EncodeOptions, Encoding, EventBatch, RawEvent, RawStored, encode_batch};
use parking_lot::RwLock;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const MODEL: &str = "m";
const BLOCK: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

/// Polls `check` every few milliseconds until it holds; panics after [`WAIT`].
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn tokens(first: u32, blocks: u32) -> Vec<u32> {
    (first..first + blocks * BLOCK).collect()
}

/// `(device, host, disk)` blocks a rank holds of `prompt`.
fn held(
    selector: &RwLock<Selector>,
    worker_id: u64,
    dp_rank: u32,
    prompt: &[u32],
) -> (u32, u32, u32) {
    let selector = selector.read();
    let Ok(scores) = selector.overlap_scores(
        &PartitionKey::new(MODEL, "default"),
        Prompt::Tokens {
            tokens: prompt,
            lora_name: None,
            cache_salt: None,
            extras: kvroute_core::hash::BlockExtras::default(),
        },
    ) else {
        return (0, 0, 0);
    };
    scores
        .workers
        .iter()
        .find(|w| w.worker_id == worker_id && w.dp_rank == dp_rank)
        .map_or((0, 0, 0), |w| {
            (w.device_blocks, w.host_pinned_blocks, w.disk_blocks)
        })
}

fn device(state: &AppState, worker_id: u64, dp_rank: u32, prompt: &[u32]) -> u32 {
    held(state.selector_for_tests(), worker_id, dp_rank, prompt).0
}

fn labelled(
    worker_id: u64,
    dp_rank: u32,
    endpoint: &str,
    extra: Option<(&str, &str)>,
) -> Vec<(String, String)> {
    let mut labels = Metrics::endpoint_labels(worker_id, dp_rank, endpoint);
    if let Some((k, v)) = extra {
        labels.push((k.to_string(), v.to_string()));
    }
    labels
}

fn messages(metrics: &Metrics, worker_id: u64, endpoint: &str, status: &str) -> u64 {
    metrics
        .kv_messages
        .get_or_create(&labelled(worker_id, 0, endpoint, Some(("status", status))))
        .get()
}

fn gaps(metrics: &Metrics, worker_id: u64, endpoint: &str, outcome: &str) -> u64 {
    metrics
        .kv_gaps
        .get_or_create(&labelled(
            worker_id,
            0,
            endpoint,
            Some(("outcome", outcome)),
        ))
        .get()
}

fn restarts(metrics: &Metrics, worker_id: u64, endpoint: &str) -> u64 {
    metrics
        .kv_restarts
        .get_or_create(&labelled(worker_id, 0, endpoint, None))
        .get()
}

fn listener_state(metrics: &Metrics, worker_id: u64, endpoint: &str) -> i64 {
    metrics
        .kv_listener_state
        .get_or_create(&labelled(worker_id, 0, endpoint, None))
        .get()
}

fn worker(worker_id: u64, engine: &FakeEngine) -> Value {
    let mut body = json!({
        "worker_id": worker_id,
        "model_name": MODEL,
        "endpoint": format!("http://worker-{worker_id}"),
        "block_size": BLOCK,
        "kv_events_endpoint": engine.pub_endpoint(),
    });
    if let Some(replay) = engine.replay_endpoint() {
        body["replay_endpoint"] = json!(replay);
    }
    body
}

async fn register(app: &TestApp, body: Value) {
    let reply = app.post("/workers", body).await;
    assert_eq!(reply.status, 201, "{}", reply.text);
}

async fn engine(replay: bool, encoding: Encoding) -> FakeEngine {
    FakeEngine::bind(
        "tcp://127.0.0.1:0",
        replay.then_some("tcp://127.0.0.1:0"),
        encoding,
    )
    .await
    .unwrap()
}

/// A fake engine bound again at `address` after the last one there was dropped (the port may
/// take a moment to be free again).
async fn rebind(address: &str, encoding: Encoding) -> FakeEngine {
    let deadline = Instant::now() + WAIT;
    loop {
        match FakeEngine::bind(address, None, encoding).await {
            Ok(engine) => return engine,
            Err(error) => {
                assert!(
                    Instant::now() < deadline,
                    "cannot bind {address} again: {error}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Publishes a probe prompt until the rank holds it: from then on the subscription is in place
/// and nothing the engine publishes is lost on the way. Returns the probe.
async fn warm_up(
    engine: &mut FakeEngine,
    state: &AppState,
    worker_id: u64,
    dp_rank: u32,
) -> Vec<u32> {
    let probe = tokens(1_000_000 + worker_id as u32 * 1_000, 1);
    let deadline = Instant::now() + WAIT;
    loop {
        engine
            .publish_stored(None, &probe, BLOCK, None)
            .await
            .unwrap();
        let poll_until = Instant::now() + Duration::from_millis(50);
        while Instant::now() < poll_until {
            if device(state, worker_id, dp_rank, &probe) == 1 {
                return probe;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(
            Instant::now() < deadline,
            "listener of worker {worker_id} never received"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_events_in_both_encodings_change_the_overlap() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    for (worker_id, encoding) in [(1, Encoding::Array), (2, Encoding::Map)] {
        let mut engine = engine(false, encoding).await;
        register(&app, worker(worker_id, &engine)).await;
        warm_up(&mut engine, &state, worker_id, 0).await;

        let prompt = tokens(1, 4);
        let hashes = engine
            .publish_stored(None, &prompt[..12], BLOCK, Some("GPU"))
            .await
            .unwrap();
        eventually("three device blocks", || {
            held(state.selector_for_tests(), worker_id, 0, &prompt) == (3, 3, 3)
        })
        .await;
        // The fourth block continues the chain on the host tier.
        engine
            .publish_stored(Some(hashes[2]), &prompt[12..], BLOCK, Some("CPU"))
            .await
            .unwrap();
        eventually("a fourth block on the host", || {
            held(state.selector_for_tests(), worker_id, 0, &prompt) == (3, 4, 4)
        })
        .await;
        let endpoint = engine.pub_endpoint().to_string();
        // The listener counts a message after handing it to the applier, so the count may
        // trail the index by a moment.
        eventually("three messages counted", || {
            messages(state.metrics(), worker_id, &endpoint, "ok") >= 3
        })
        .await;
        assert_eq!(
            messages(state.metrics(), worker_id, &endpoint, "malformed"),
            0
        );
        assert_eq!(
            listener_state(state.metrics(), worker_id, &endpoint),
            ListenerState::Live as i64
        );
    }
    assert_eq!(state.ingest().active_listeners(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_and_cleared_events_apply() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut engine = engine(false, Encoding::Map).await;
    register(&app, worker(1, &engine)).await;
    let probe = warm_up(&mut engine, &state, 1, 0).await;

    let prompt = tokens(1, 3);
    let hashes = engine
        .publish_stored(None, &prompt, BLOCK, None)
        .await
        .unwrap();
    eventually("stored", || device(&state, 1, 0, &prompt) == 3).await;
    engine.publish_removed(&hashes[2..], None).await.unwrap();
    eventually("last block removed", || device(&state, 1, 0, &prompt) == 2).await;
    engine.publish_removed(&hashes[..1], None).await.unwrap();
    eventually("first block removed", || device(&state, 1, 0, &prompt) == 0).await;

    engine
        .publish_stored(None, &prompt, BLOCK, None)
        .await
        .unwrap();
    eventually("stored again", || device(&state, 1, 0, &prompt) == 3).await;
    engine.publish_cleared().await.unwrap();
    eventually("cleared", || {
        device(&state, 1, 0, &prompt) == 0 && device(&state, 1, 0, &probe) == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_batch_is_recovered_by_replay_in_both_layouts() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    for (worker_id, layout) in [
        (1, ReplayLayout::WithoutTopic),
        (2, ReplayLayout::WithTopic),
    ] {
        let mut engine = engine(true, Encoding::Array).await;
        engine.set_topic(b"kv-events");
        engine.set_replay_layout(layout);
        register(&app, worker(worker_id, &engine)).await;
        assert!(engine.wait_for_subscribers(1, WAIT).await);
        warm_up(&mut engine, &state, worker_id, 0).await;
        let endpoint = engine.pub_endpoint().to_string();
        let replayed_gaps = gaps(state.metrics(), worker_id, &endpoint, "replayed");

        let lost = tokens(100, 2);
        let next = tokens(200, 2);
        engine.drop_next(1);
        engine
            .publish_stored(None, &lost, BLOCK, None)
            .await
            .unwrap();
        engine
            .publish_stored(None, &next, BLOCK, None)
            .await
            .unwrap();
        eventually("the dropped batch, replayed", || {
            device(&state, worker_id, 0, &lost) == 2 && device(&state, worker_id, 0, &next) == 2
        })
        .await;
        eventually("the gap counted as replayed", || {
            gaps(state.metrics(), worker_id, &endpoint, "replayed") == replayed_gaps + 1
        })
        .await;
        assert!(messages(state.metrics(), worker_id, &endpoint, "replayed") >= 1);
        assert_eq!(
            gaps(state.metrics(), worker_id, &endpoint, "not_replayed"),
            0
        );
        assert_eq!(
            gaps(state.metrics(), worker_id, &endpoint, "replay_timeout"),
            0
        );
        eventually("live again", || {
            listener_state(state.metrics(), worker_id, &endpoint) == ListenerState::Live as i64
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_endpoint_is_counted() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut engine = engine(false, Encoding::Array).await;
    register(&app, worker(1, &engine)).await;
    warm_up(&mut engine, &state, 1, 0).await;
    let endpoint = engine.pub_endpoint().to_string();
    assert_eq!(gaps(state.metrics(), 1, &endpoint, "not_replayed"), 0);

    engine.skip_seq();
    engine.skip_seq();
    let prompt = tokens(1, 2);
    engine
        .publish_stored(None, &prompt, BLOCK, None)
        .await
        .unwrap();
    eventually("applied after the gap", || {
        device(&state, 1, 0, &prompt) == 2
    })
    .await;
    assert_eq!(gaps(state.metrics(), 1, &endpoint, "not_replayed"), 1);

    // A repeated sequence number is a duplicate: dropped, counted, no restart.
    let again = tokens(50, 1);
    let (event, _) = stored_event(&StoredBlocks {
        token_ids: &again,
        block_size: BLOCK,
        ..StoredBlocks::default()
    });
    let batch = EventBatch {
        ts: 0.0,
        events: vec![event],
        data_parallel_rank: None,
    };
    let payload = encode_batch(&batch, EncodeOptions::default());
    let last = engine.next_seq() - 1;
    engine
        .publish_raw(frames::live_message(b"", last, payload))
        .await
        .unwrap();
    let next = tokens(60, 1);
    engine
        .publish_stored(None, &next, BLOCK, None)
        .await
        .unwrap();
    eventually("applied after the duplicate", || {
        device(&state, 1, 0, &next) == 1
    })
    .await;
    assert_eq!(device(&state, 1, 0, &again), 0);
    assert_eq!(messages(state.metrics(), 1, &endpoint, "duplicate"), 1);
    assert_eq!(restarts(state.metrics(), 1, &endpoint), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_clears_the_rank() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut engine = engine(false, Encoding::Map).await;
    register(&app, worker(1, &engine)).await;
    let probe = warm_up(&mut engine, &state, 1, 0).await;
    let before = tokens(1, 2);
    engine
        .publish_stored(None, &before, BLOCK, None)
        .await
        .unwrap();
    engine
        .publish_stored(None, &tokens(500, 1), BLOCK, None)
        .await
        .unwrap();
    eventually("stored before the restart", || {
        device(&state, 1, 0, &before) == 2
    })
    .await;
    let endpoint = engine.pub_endpoint().to_string();
    assert_eq!(restarts(state.metrics(), 1, &endpoint), 0);

    engine.restart();
    let after = tokens(100, 1);
    engine
        .publish_stored(None, &after, BLOCK, None)
        .await
        .unwrap();
    eventually("stored after the restart", || {
        device(&state, 1, 0, &after) == 1
    })
    .await;
    assert_eq!(
        device(&state, 1, 0, &before),
        0,
        "the restart cleared the rank"
    );
    assert_eq!(device(&state, 1, 0, &probe), 0);
    assert_eq!(restarts(state.metrics(), 1, &endpoint), 1);
    assert_eq!(gaps(state.metrics(), 1, &endpoint, "not_replayed"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_counted_and_the_listener_keeps_going() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut engine = engine(false, Encoding::Array).await;
    register(&app, worker(1, &engine)).await;
    warm_up(&mut engine, &state, 1, 0).await;
    let endpoint = engine.pub_endpoint().to_string();

    // Bad frames: no sequence number to trust.
    engine
        .publish_raw(vec![b"one frame".to_vec()])
        .await
        .unwrap();
    engine
        .publish_raw(vec![vec![], b"abc".to_vec(), vec![0x90]])
        .await
        .unwrap();
    engine
        .publish_raw(vec![vec![], vec![0xff; 8], vec![0x90]])
        .await
        .unwrap();
    // Bad payloads under real sequence numbers: counted as received, so no gap follows.
    engine.publish_payload(vec![0xc1, 0, 1, 2]).await.unwrap();
    engine
        .publish_payload(b"not msgpack at all".to_vec())
        .await
        .unwrap();
    engine
        .publish_payload(vec![0x92, 0x01, 0x02])
        .await
        .unwrap();
    // Events the conversion drops: an unknown medium, a block-count mismatch.
    let mut events = Vec::new();
    for (medium, block_size) in [("TAPE", BLOCK), ("GPU", 5)] {
        events.push(RawEvent::Stored(RawStored {
            block_hashes: vec![1, 2],
            token_ids: tokens(300, 2),
            block_size,
            medium: Some(medium.to_string()),
            ..RawStored::default()
        }));
    }
    engine.publish_events(events).await.unwrap();

    let prompt = tokens(1, 2);
    engine
        .publish_stored(None, &prompt, BLOCK, None)
        .await
        .unwrap();
    eventually("applied after the garbage", || {
        device(&state, 1, 0, &prompt) == 2
    })
    .await;
    assert_eq!(messages(state.metrics(), 1, &endpoint, "malformed"), 6);
    assert_eq!(gaps(state.metrics(), 1, &endpoint, "not_replayed"), 0);
    assert_eq!(restarts(state.metrics(), 1, &endpoint), 0);
    let text = state.render_metrics();
    assert!(
        text.contains(r#"kvroute_kv_events_total{type="stored",status="unknown_medium"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kvroute_kv_events_total{type="stored",status="block_count_mismatch"} 2"#),
        "{text}"
    );
    assert_eq!(state.ingest().active_listeners(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_or_unscheduling_the_worker_stops_its_listener() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut engine = engine(false, Encoding::Array).await;
    let body = worker(1, &engine);
    register(&app, body.clone()).await;
    assert_eq!(state.ingest().active_listeners(), 1);
    warm_up(&mut engine, &state, 1, 0).await;
    let endpoint = engine.pub_endpoint().to_string();

    // Re-posting the same worker keeps the running listener (and what it indexed).
    register(&app, body.clone()).await;
    assert_eq!(state.ingest().active_listeners(), 1);
    let prompt = tokens(1, 1);
    engine
        .publish_stored(None, &prompt, BLOCK, None)
        .await
        .unwrap();
    eventually("still listening", || device(&state, 1, 0, &prompt) == 1).await;

    let reply = app.delete("/workers/1").await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    eventually("listener stopped", || {
        state.ingest().active_listeners() == 0
    })
    .await;
    assert_eq!(
        listener_state(state.metrics(), 1, &endpoint),
        ListenerState::Stopped as i64
    );

    // Back again, then made unschedulable by a malformed endpoint.
    register(&app, body).await;
    eventually("listener restarted", || {
        state.ingest().active_listeners() == 1
    })
    .await;
    let mut broken = worker(1, &engine);
    broken["kv_events_endpoint"] = json!("not-a-zmq-address");
    register(&app, broken).await;
    eventually("listener stopped again", || {
        state.ingest().active_listeners() == 0
    })
    .await;

    // Shutdown stops everything and starts nothing new.
    register(&app, worker(2, &engine)).await;
    eventually("second listener", || state.ingest().active_listeners() == 1).await;
    state.ingest().shutdown();
    eventually("all stopped", || state.ingest().active_listeners() == 0).await;
    register(&app, worker(3, &engine)).await;
    assert_eq!(state.ingest().active_listeners(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_rank_overrides_the_registered_rank() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut rank0 = engine(false, Encoding::Map).await;
    let rank1 = engine(false, Encoding::Map).await;
    register(
        &app,
        json!({
            "worker_id": 7,
            "model_name": MODEL,
            "endpoint": "http://worker-7",
            "block_size": BLOCK,
            "data_parallel_size": 2,
            "kv_events_endpoints": {"0": rank0.pub_endpoint(), "1": rank1.pub_endpoint()},
        }),
    )
    .await;
    assert_eq!(state.ingest().active_listeners(), 2);
    // The rank-0 endpoint publishes batches that say they come from rank 1.
    rank0.set_data_parallel_rank(Some(1));
    warm_up(&mut rank0, &state, 7, 1).await;
    let prompt = tokens(1, 3);
    rank0
        .publish_stored(None, &prompt, BLOCK, None)
        .await
        .unwrap();
    eventually("indexed under rank 1", || {
        device(&state, 7, 1, &prompt) == 3
    })
    .await;
    assert_eq!(device(&state, 7, 0, &prompt), 0);

    // A rank the worker does not have is dropped and counted.
    rank0.set_data_parallel_rank(Some(9));
    let stray = tokens(100, 1);
    rank0
        .publish_stored(None, &stray, BLOCK, None)
        .await
        .unwrap();
    rank0.set_data_parallel_rank(None);
    let own = tokens(200, 1);
    rank0.publish_stored(None, &own, BLOCK, None).await.unwrap();
    eventually("indexed under the registered rank", || {
        device(&state, 7, 0, &own) == 1
    })
    .await;
    assert_eq!(
        device(&state, 7, 0, &stray) + device(&state, 7, 1, &stray),
        0
    );
    let text = state.render_metrics();
    assert!(
        text.contains(r#"kvroute_kv_events_total{type="any",status="rank_out_of_range"} 1"#),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_coming_back_is_reconnected_and_its_restart_detected() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut first = engine(false, Encoding::Array).await;
    let address = first.pub_endpoint().to_string();
    register(&app, worker(1, &first)).await;
    warm_up(&mut first, &state, 1, 0).await;
    let before = tokens(1, 2);
    for _ in 0..5 {
        first
            .publish_stored(None, &before, BLOCK, None)
            .await
            .unwrap();
    }
    eventually("stored", || device(&state, 1, 0, &before) == 2).await;
    drop(first);

    // The same address comes back.
    let mut second = rebind(&address, Encoding::Map).await;
    assert!(
        second.wait_for_subscribers(1, WAIT).await,
        "the listener did not reconnect"
    );
    let after = tokens(100, 1);
    second
        .publish_stored(None, &after, BLOCK, None)
        .await
        .unwrap();
    eventually("stored after reconnecting", || {
        device(&state, 1, 0, &after) == 1
    })
    .await;
    assert_eq!(
        device(&state, 1, 0, &before),
        0,
        "the restart cleared the rank"
    );
    assert_eq!(restarts(state.metrics(), 1, &address), 1);
}

/// An idle engine's connection is healthy: after it drops, the listener reconnects from the first
/// delay. (Counting each silent session as a failure doubled the delay every time: after five
/// such sessions the sixth connection came 1.6 s after the engine was back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_engine_that_comes_back_is_reconnected_at_once() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let (manager, _metrics) = own_manager(
        &state,
        IngestConfig {
            healthy_connection: Duration::from_millis(200),
            ..IngestConfig::default()
        },
    );
    let first = engine(false, Encoding::Array).await;
    let address = first.pub_endpoint().to_string();
    listen_to(&state, &manager, &first);
    let mut current = first;
    for session in 1..=6 {
        let back = Instant::now();
        assert!(
            current.wait_for_subscribers(1, WAIT).await,
            "session {session}: the listener did not connect"
        );
        if session > 1 {
            let waited = back.elapsed();
            assert!(
                waited < Duration::from_millis(1000),
                "session {session}: reconnected {waited:?} after the engine came back"
            );
        }
        // Up, silent, longer than a healthy connection; then gone and back at once.
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(current);
        current = rebind(&address, Encoding::Array).await;
    }
    manager.remove_worker(1);
    eventually("stopped", || manager.active_listeners() == 0).await;
}

/// Applies events to a selector (what the service's own sink does), for a manager with short
/// timeouts.
struct SelectorSink(Arc<RwLock<Selector>>);

impl EventSink for SelectorSink {
    fn apply(&self, worker_id: u64, dp_rank: u32, events: Vec<KvEvent>) -> bool {
        self.0
            .write()
            .apply_events(worker_id, dp_rank, &events)
            .is_some()
    }
}

/// An ingest manager of its own (with `config`) applying to the app's selector, and its metrics.
fn own_manager(state: &AppState, config: IngestConfig) -> (IngestManager, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let manager = IngestManager::with_config(
        Arc::new(SelectorSink(Arc::clone(state.selector_for_tests()))),
        Arc::clone(&metrics),
        config,
    );
    (manager, metrics)
}

/// Registers worker 1 with `engine`'s endpoints straight in the selector, and has `manager`
/// listen to it.
fn listen_to(state: &AppState, manager: &IngestManager, engine: &FakeEngine) {
    let outcome = state
        .selector_for_tests()
        .write()
        .upsert_worker(WorkerSpec {
            worker_id: 1,
            model_name: MODEL.to_string(),
            routing_group: "default".to_string(),
            endpoint: Some("http://worker-1".to_string()),
            block_size: Some(BLOCK),
            kv_events_endpoint: Some(engine.pub_endpoint().to_string()),
            replay_endpoint: engine.replay_endpoint().map(str::to_string),
            ..WorkerSpec::default()
        })
        .unwrap();
    assert_eq!(outcome.record.not_schedulable_reasons, Vec::<String>::new());
    manager.sync_worker(&outcome.record, outcome.events_changed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_that_never_ends_times_out_and_is_counted() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let (manager, metrics) = own_manager(
        &state,
        IngestConfig {
            replay_timeout: Duration::from_millis(300),
            ..IngestConfig::default()
        },
    );
    let mut engine = engine(true, Encoding::Array).await;
    engine.set_replay_mode(ReplayMode::NoEndMarker);
    let endpoint = engine.pub_endpoint().to_string();
    listen_to(&state, &manager, &engine);
    assert!(engine.wait_for_subscribers(1, WAIT).await);
    // The replay on connect gets no end marker.
    eventually("the connect replay timed out", || {
        gaps(&metrics, 1, &endpoint, "replay_timeout") == 1
    })
    .await;
    warm_up(&mut engine, &state, 1, 0).await;

    // Replies arrive but the end marker never does: applied, and the timeout counted.
    let lost = tokens(100, 1);
    engine.drop_next(1);
    engine
        .publish_stored(None, &lost, BLOCK, None)
        .await
        .unwrap();
    engine
        .publish_stored(None, &tokens(200, 1), BLOCK, None)
        .await
        .unwrap();
    eventually("replayed before the timeout", || {
        device(&state, 1, 0, &lost) == 1
    })
    .await;
    eventually("the gap replay timed out", || {
        gaps(&metrics, 1, &endpoint, "replay_timeout") == 2
    })
    .await;

    // A replay socket that answers nothing: the batch is lost, the listener goes on.
    engine.set_replay_mode(ReplayMode::Silent);
    let gone = tokens(300, 1);
    let later = tokens(400, 1);
    engine.drop_next(1);
    engine
        .publish_stored(None, &gone, BLOCK, None)
        .await
        .unwrap();
    engine
        .publish_stored(None, &later, BLOCK, None)
        .await
        .unwrap();
    eventually("applied after the timeout", || {
        device(&state, 1, 0, &later) == 1
    })
    .await;
    assert_eq!(device(&state, 1, 0, &gone), 0);
    assert_eq!(gaps(&metrics, 1, &endpoint, "replay_timeout"), 3);
    eventually("live again", || {
        listener_state(&metrics, 1, &endpoint) == ListenerState::Live as i64
    })
    .await;
    manager.remove_worker(1);
    eventually("stopped", || manager.active_listeners() == 0).await;
}

/// The whole product path: three workers with fake engines over real ZMQ, events published,
/// `select` follows them, the selection is booked by replay, its lifecycle runs, and `/loads`
/// shows each step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_flow_with_three_fake_engines_over_http() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut engines = Vec::new();
    for worker_id in 1..=3u64 {
        let encoding = if worker_id == 2 {
            Encoding::Map
        } else {
            Encoding::Array
        };
        let mut engine = engine(false, encoding).await;
        register(&app, worker(worker_id, &engine)).await;
        warm_up(&mut engine, &state, worker_id, 0).await;
        engines.push(engine);
    }
    // Worker 3's engine caches the first three blocks of the prompt; worker 1's only one.
    let prompt = tokens(1, 4);
    engines[2]
        .publish_stored(None, &prompt[..3 * BLOCK as usize], BLOCK, None)
        .await
        .unwrap();
    engines[0]
        .publish_stored(None, &prompt[..BLOCK as usize], BLOCK, None)
        .await
        .unwrap();
    eventually("both engines' blocks indexed", || {
        device(&state, 3, 0, &prompt) == 3 && device(&state, 1, 0, &prompt) == 1
    })
    .await;
    let mut prompt_with_tail = prompt.clone();
    prompt_with_tail.push(7);
    let sel = app
        .post(
            "/select",
            json!({"model_name": MODEL, "token_ids": prompt_with_tail, "selection_id": "flow-1"}),
        )
        .await;
    assert_eq!(sel.status, 200, "{}", sel.text);
    assert_eq!(sel.body["worker_id"], 3, "the deepest cached prefix wins");
    assert_eq!(sel.body["overlap"]["gpu"], 3 * BLOCK);
    let load_of = |loads: &Value, worker: u64| -> Value {
        loads[0]["loads"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["worker_id"] == worker)
            .cloned()
            .unwrap()
    };
    let path = format!("/loads?model_name={MODEL}");
    assert_eq!(load_of(&app.get(&path).await.body, 3)["active_requests"], 0);
    let booked = app
        .post(
            "/reservations",
            json!({"model_name": MODEL, "selection_id": "flow-1"}),
        )
        .await;
    assert_eq!(booked.status, 201, "{}", booked.text);
    assert_eq!(booked.body["worker_id"], 3);
    let l = load_of(&app.get(&path).await.body, 3);
    assert_eq!(l["active_requests"], 1);
    assert_eq!(
        l["potential_prefill_tokens"],
        BLOCK + 1,
        "one uncached block and the tail"
    );
    assert_eq!(l["potential_decode_blocks"], 5);
    app.post("/reservations/flow-1/prefill_complete", json!({}))
        .await;
    assert_eq!(
        load_of(&app.get(&path).await.body, 3)["potential_prefill_tokens"],
        0
    );
    app.post("/reservations/flow-1/output_block", json!({}))
        .await;
    assert_eq!(
        load_of(&app.get(&path).await.body, 3)["potential_decode_blocks"],
        6
    );
    assert_eq!(app.delete("/reservations/flow-1").await.status, 200);
    let l = load_of(&app.get(&path).await.body, 3);
    assert_eq!(
        (&l["active_requests"], &l["potential_decode_blocks"]),
        (&json!(0), &json!(0))
    );
    // The engine evicts: the overlap follows.
    let hashes = kvroute_testkit::fake_engine::engine_block_hashes(
        None,
        &prompt[..3 * BLOCK as usize],
        BLOCK,
        None,
    );
    engines[2]
        .publish_removed(&hashes[1..], None)
        .await
        .unwrap();
    eventually("eviction applied", || device(&state, 3, 0, &prompt) == 1).await;
}

/// A counter of `/metrics`' text (0 when absent).
fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

/// Predict-on-route end to end: a booking's prompt counts as held on its rank before the engine
/// says anything; the engine's own `Stored`, over ZeroMQ, confirms it and counts each block once;
/// a prompt whose events never come expires with the tick; `/metrics` counts each outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booking_is_predicted_until_the_engines_events_confirm_it() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut engines = Vec::new();
    for worker_id in 1..=2u64 {
        let mut engine = engine(false, Encoding::Map).await;
        register(&app, worker(worker_id, &engine)).await;
        warm_up(&mut engine, &state, worker_id, 0).await;
        engines.push(engine);
    }
    let metrics = app.get("/metrics").await.text;
    for outcome in ["confirmed", "expired", "withdrawn"] {
        let series = format!("kvroute_predicted_blocks_total{{outcome=\"{outcome}\"}} 0");
        assert!(metrics.contains(&series), "{series} in\n{metrics}");
    }
    let prompt = tokens(1, 4);
    let booked = app
        .post(
            "/select_and_reserve",
            json!({"model_name": MODEL, "token_ids": prompt, "reservation_id": "a"}),
        )
        .await;
    assert_eq!(booked.status, 200, "{}", booked.text);
    let w = booked.body["worker_id"].as_u64().unwrap();
    assert_eq!(
        held(state.selector_for_tests(), w, 0, &prompt),
        (4, 4, 4),
        "predicted"
    );
    let sizes = || {
        let sizes = state.selector_for_tests().read().index_sizes();
        (sizes[0].1, sizes[0].2)
    };
    let predicted = sizes();
    engines[w as usize - 1]
        .publish_stored(None, &prompt, BLOCK, Some("GPU"))
        .await
        .unwrap();
    eventually("the engine's blocks confirm the prediction", || {
        state
            .selector_for_tests()
            .read()
            .prediction_counters()
            .confirmed
            == 4
    })
    .await;
    assert_eq!(held(state.selector_for_tests(), w, 0, &prompt), (4, 4, 4));
    assert_eq!(
        sizes(),
        predicted,
        "the engine's entries replaced the predicted ones: no block counted twice"
    );

    // A replayed selection whose engine never reports it: held until the TTL, then not.
    let other = tokens(500, 3);
    let sel = app
        .post(
            "/select",
            json!({"model_name": MODEL, "token_ids": other, "selection_id": "b"}),
        )
        .await;
    let wb = sel.body["worker_id"].as_u64().unwrap();
    let replay = app
        .post(
            "/reservations",
            json!({"model_name": MODEL, "selection_id": "b"}),
        )
        .await;
    assert_eq!(replay.status, 201, "{}", replay.text);
    eventually("the replay's prediction recorded", || {
        held(state.selector_for_tests(), wb, 0, &other) == (3, 3, 3)
    })
    .await;
    state.tick(std::time::Instant::now() + Duration::from_secs(2));
    assert_eq!(held(state.selector_for_tests(), wb, 0, &other), (0, 0, 0));
    let metrics = app.get("/metrics").await.text;
    assert_eq!(
        [
            counter(
                &metrics,
                "kvroute_predicted_blocks_total{outcome=\"confirmed\"}"
            ),
            counter(
                &metrics,
                "kvroute_predicted_blocks_total{outcome=\"expired\"}"
            ),
            counter(
                &metrics,
                "kvroute_predicted_blocks_total{outcome=\"withdrawn\"}"
            ),
        ],
        [4, 3, 0],
        "{metrics}"
    );
}

/// Device blocks of worker 1 for a prompt body, through `POST /overlap_scores`.
async fn overlap_blocks(app: &TestApp, mut body: Value) -> u64 {
    body["model_name"] = json!(MODEL);
    let reply = app.post("/overlap_scores", body).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    reply.body["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == 1)
        .map_or(0, |w| w["device_blocks"].as_u64().unwrap())
}

fn image(mm_hash: u64) -> Value {
    json!({"mm_objects": [{"mm_hash": mm_hash, "offsets": [[2, 7]]}]})
}

/// A vLLM engine under Dynamo marks an image in its blocks' extra keys: a request for the same
/// tokens finds that cache only with the same image (the same `mm_hash`), in either form of
/// the request, and a text-only request or another image does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multimodal_prompts_match_only_the_cache_of_their_own_images() {
    use kvroute_wire::{ExtraKey, dynamo_mm_marker};
    const IMAGE: u64 = 0x1234_5678_9abc_def0;
    const OTHER_IMAGE: u64 = 0x0fed_cba9_8765_4321;
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    for (encoding, first) in [(Encoding::Array, 1), (Encoding::Map, 500)] {
        let mut engine = engine(false, encoding).await;
        register(&app, worker(1, &engine)).await;
        warm_up(&mut engine, &state, 1, 0).await;
        // Three blocks; the image's placeholder tokens span blocks 0 and 1 (offsets 2..7).
        let prompt = tokens(first, 3);
        let marker = || Some(vec![ExtraKey::Str(dynamo_mm_marker(IMAGE))]);
        engine
            .publish_events(vec![RawEvent::Stored(RawStored {
                block_hashes: vec![first as u64 + 11, first as u64 + 12, first as u64 + 13],
                token_ids: prompt.clone(),
                block_size: BLOCK,
                medium: Some("GPU".into()),
                extra_keys: Some(vec![marker(), marker(), None]),
                ..RawStored::default()
            })])
            .await
            .unwrap();
        let same = json!({
            "model_name": MODEL,
            "token_ids": prompt,
            "block_mm_infos": [image(IMAGE), image(IMAGE), null],
        });
        let deadline = Instant::now() + WAIT;
        while overlap_blocks(&app, same.clone()).await != 3 {
            assert!(
                Instant::now() < deadline,
                "the image prompt was never stored"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // As Dynamo's routing info, whatever `token_ids` says.
        let routed = json!({
            "token_ids": [1],
            "mm_routing_info": {"routing_token_ids": prompt, "block_mm_infos": [image(IMAGE), image(IMAGE)]},
        });
        assert_eq!(overlap_blocks(&app, routed).await, 3);
        // Another image, or none, over the same tokens: no cache.
        let other = json!({
            "model_name": MODEL,
            "token_ids": prompt,
            "block_mm_infos": [image(OTHER_IMAGE), image(OTHER_IMAGE), null],
        });
        assert_eq!(overlap_blocks(&app, other.clone()).await, 0);
        assert_eq!(overlap_blocks(&app, json!({"token_ids": prompt})).await, 0);
        // The selector routes the image prompt to the rank that holds it.
        let reply = app.post("/select", same).await;
        assert_eq!(reply.body["overlap"]["gpu"], 3 * BLOCK, "{}", reply.text);
        let reply = app.post("/select", other).await;
        assert_eq!(reply.body["overlap"]["gpu"], 0, "{}", reply.text);
        let endpoint = engine.pub_endpoint().to_string();
        assert_eq!(messages(state.metrics(), 1, &endpoint, "malformed"), 0);
        assert_eq!(app.delete("/workers/1").await.status, 200);
    }
}

/// SGLang with EAGLE publishes bigram token pairs: its blocks match an Eagle request for the
/// same tokens, not a plain one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_eagle_events_match_eagle_requests() {
    let app = TestApp::new();
    let state = Arc::clone(&app.state);
    let mut engine = engine(false, Encoding::Map).await;
    register(&app, worker(1, &engine)).await;
    warm_up(&mut engine, &state, 1, 0).await;
    // Two Eagle blocks need two blocks of tokens and the next one.
    let prompt: Vec<u32> = (1..=2 * BLOCK + 1).collect();
    engine
        .publish_events(vec![RawEvent::Stored(RawStored {
            block_hashes: vec![21, 22],
            token_ids: prompt.clone(),
            block_size: BLOCK,
            medium: Some("GPU".into()),
            is_eagle: true,
            ..RawStored::default()
        })])
        .await
        .unwrap();
    let eagle = json!({"token_ids": prompt, "is_eagle": true});
    let deadline = Instant::now() + WAIT;
    while overlap_blocks(&app, eagle.clone()).await != 2 {
        assert!(
            Instant::now() < deadline,
            "the Eagle prompt was never stored"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(overlap_blocks(&app, json!({"token_ids": prompt})).await, 0);
}
