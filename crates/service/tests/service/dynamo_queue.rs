//! Dynamo's admission queue (`queue.json`, recorded from Dynamo 1.6.1 with
//! `DYN_ROUTER_QUEUE_THRESHOLD=0.5` and each `DYN_ROUTER_QUEUE_POLICY`), replayed against
//! `kvroute serve --router-profile dynamo --queue-threshold 0.5 --queue-policy P`.
//!
//! The recording lists exchanges in the order they completed; a queued request was sent
//! earlier. So the replay sends each queued request in the background where the capture did
//! (after its round's blocker for the `orders` rounds, at the arrival times recorded there,
//! played on the service's clock; [`spawned_after`] for the others), and awaits it where the
//! recording lists its answer. Before every other exchange, each request still to be answered
//! must still wait: nothing is released earlier than in Dynamo.

use crate::common::{Reply, TestApp};
use crate::dynamo_compat::{capture_batch, fixtures, publish_until_held, swap_engine_endpoint};
use axum::http::Method;
use kvroute_service::ServeConfig;
use kvroute_testkit::fake_engine::FakeEngine;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// Exchanges where kvroute differs from Dynamo 1.6.1 on purpose (docs/admission-queue.md).
const QUEUE_DEVIATIONS: &[(&str, &str)] = &[
    (
        "lcfs_shutdown_queued_select_and_reserve",
        "kvroute answers 503 `selection service is shutting down` (Dynamo: `endpoint subscriber shutdown`)",
    ),
    (
        "lcfs_shutdown_queued_select",
        "kvroute answers 503 `selection service is shutting down` (Dynamo: `endpoint subscriber shutdown`)",
    ),
];

/// Scenarios not replayed, and why.
const NOT_REPLAYED: &[(&str, &str)] = &[
    (
        "disc_",
        "client disconnects: a closed /select leaves kvroute's queue at once (Dynamo keeps it counted until popped); `queue::a_client_that_disconnects_leaves_the_queue_and_shutdown_answers_503` holds kvroute's behaviour",
    ),
    (
        "policy_config_",
        "DYN_ROUTER_POLICY_CONFIG (YAML policy classes) is not read; kvroute bounds its queue with --queue-max-requests",
    ),
];

/// Loads after `catalog_queued_then_patch`, whose worker the capture notes "varies run to run"
/// (any of 11, 12, 13 at equal cost): only what waits is compared.
const LOADS_AFTER_A_VARYING_PICK: &[&str] =
    &["catalog_loads_all_busy", "catalog_loads_after_delete"];

/// Queued requests of the capture outside the `orders` rounds: sent after this exchange.
fn spawned_after(name: &str) -> &'static [&'static str] {
    match name {
        "busy_replay_cached_select" => &["busy_queued_dup"],
        "edge_select_and_reserve_at_32" => &["edge_select_and_reserve_at_33"],
        "multi_select_and_reserve_one_busy" => &["multi_pinned_to_busy_11"],
        "multi_loads_after_release_on_11" => {
            &["hol_allowed_only_busy_11", "hol_unpinned_behind_it"]
        }
        "multi_book_12_again" => &["catalog_queued_then_worker_added"],
        "catalog_queued_then_worker_added" => &["catalog_queued_then_patch"],
        "catalog_loads_all_busy" => &[
            "catalog_queued_select_and_reserve_then_worker_deleted",
            "catalog_queued_select_then_worker_deleted",
        ],
        "zero_select_and_reserve_idle" => &["zero_select_and_reserve_busy"],
        "lcfs_shutdown_book_blocker" => &[
            "lcfs_shutdown_queued_select_and_reserve",
            "lcfs_shutdown_queued_select",
        ],
        _ => &[],
    }
}

/// Bookings the capture freed without recording it, after this exchange.
fn freed_after(name: &str) -> &'static [&'static str] {
    match name {
        "busy_explicit_reservation" => &["busy-ex"],
        "busy_potential_loads" => &["busy-blk"],
        "busy_replay_cached_select" => &["cached-1"],
        "busy_queued_dup" => &["dup-1"],
        "edge_select_and_reserve_at_33" => &["edge-32", "edge-1", "edge-2"],
        "hol_loads_after_release" => &[
            "mb-11",
            "mm-free",
            "mm-free-2",
            "mm-pin",
            "hol-allowed",
            "hol-free",
        ],
        _ => &[],
    }
}

type Answer = JoinHandle<Reply>;

struct Instances {
    fcfs: TestApp,
    lcfs: TestApp,
    wspt: TestApp,
}

impl Instances {
    fn for_exchange(&self, name: &str) -> &TestApp {
        if name.starts_with("lcfs_") {
            &self.lcfs
        } else if name.starts_with("wspt_") {
            &self.wspt
        } else {
            &self.fcfs
        }
    }
}

fn request_of(ex: &Value) -> (Method, String, Option<Value>) {
    let method =
        Method::from_bytes(ex["method"].as_str().expect("method").as_bytes()).expect("method");
    let path = ex["path"].as_str().expect("path").to_string();
    let body = (!ex["request"].is_null()).then(|| ex["request"].clone());
    (method, path, body)
}

async fn pending_count(app: &TestApp, model: &str) -> u64 {
    let loads = app.get(&format!("/loads?model_name={model}")).await;
    loads.body[0]["pending_count"].as_u64().unwrap_or(0)
}

/// Sends a queued exchange in the background and waits until it waits in its partition.
async fn spawn_queued(app: &TestApp, ex: &Value) -> Answer {
    let model = ex["request"]["model_name"]
        .as_str()
        .unwrap_or("default")
        .to_string();
    let before = pending_count(app, &model).await;
    let (method, path, body) = request_of(ex);
    let task = {
        let app = app.clone();
        tokio::spawn(async move { app.call(method, &path, body).await })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while pending_count(app, &model).await <= before && !task.is_finished() {
        assert!(
            Instant::now() < deadline,
            "{} never waited in the queue",
            ex["name"]
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    task
}

/// `{round}_release_{n}` of a release exchange.
fn step_of(name: &str) -> Option<&str> {
    let at = name.find("_release_")?;
    let rest = &name[at + "_release_".len()..];
    let digits = rest.find('_').unwrap_or(rest.len());
    Some(&name[..at + "_release_".len() + digits])
}

/// What differs between Dynamo's answer and ours, if anything.
fn difference(ex: &Value, ours: &Reply) -> Option<String> {
    let name = ex["name"].as_str().unwrap_or("");
    let path = ex["path"].as_str().unwrap_or("");
    let want = ex["status"].as_u64().expect("status") as u16;
    let theirs = &ex["response"];
    let body = &ours.body;
    if ours.status.as_u16() != want {
        return Some(format!(
            "status {} (Dynamo {want}): {}",
            ours.status, ours.text
        ));
    }
    if want >= 400 {
        let strip = |m: &str| m.split(" at line ").next().unwrap_or("").to_string();
        let (t, o) = (
            strip(theirs["error"].as_str().unwrap_or("")),
            strip(body["error"].as_str().unwrap_or("")),
        );
        return (t != o).then(|| format!("message {o:?} (Dynamo {t:?})"));
    }
    // Where the capture notes its worker varies from run to run, only the status counts.
    if ex["note"]
        .as_str()
        .unwrap_or("")
        .contains("varies run to run")
    {
        return None;
    }
    if path == "/select" || path == "/select_and_reserve" || path == "/reservations" {
        let pick = |v: &Value| (v["worker_id"].clone(), v["dp_rank"].clone());
        return (pick(body) != pick(theirs)).then(|| {
            format!(
                "worker {} rank {} (Dynamo worker {} rank {})",
                body["worker_id"], body["dp_rank"], theirs["worker_id"], theirs["dp_rank"]
            )
        });
    }
    if path.starts_with("/workers") {
        return (body["lifecycle"] != theirs["lifecycle"]).then(|| {
            format!(
                "lifecycle {} (Dynamo {})",
                body["lifecycle"], theirs["lifecycle"]
            )
        });
    }
    if path.starts_with("/loads") && LOADS_AFTER_A_VARYING_PICK.contains(&name) {
        let pending = |v: &Value| {
            (
                v[0]["pending_count"].clone(),
                v[0]["pending_isl_tokens"].clone(),
            )
        };
        return (pending(body) != pending(theirs))
            .then(|| format!("pending {:?} (Dynamo {:?})", pending(body), pending(theirs)));
    }
    if path.starts_with("/loads") {
        // Per partition: what waits, and each rank's active prefill and requests.
        let view = |v: &Value| -> Vec<Value> {
            v.as_array()
                .into_iter()
                .flatten()
                .map(|p| {
                    let mut ranks: Vec<Value> = p["loads"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|l| {
                            json!([
                                l["worker_id"],
                                l["potential_prefill_tokens"],
                                l["active_requests"]
                            ])
                        })
                        .collect();
                    ranks.sort_by_key(|r| r[0].as_u64());
                    json!([
                        p["model_name"],
                        p["pending_count"],
                        p["pending_isl_tokens"],
                        ranks
                    ])
                })
                .collect()
        };
        let (t, o) = (view(theirs), view(body));
        return (t != o).then(|| format!("{name}: loads {o:?} (Dynamo {t:?})"));
    }
    None
}

/// Every recorded exchange of Dynamo's queue, replayed with the capture's sends, frees and
/// events: the same statuses, workers, error texts, waiting counts and release order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_exchanges_replay_as_recorded() {
    let text = std::fs::read_to_string(fixtures().join("queue.json")).expect("fixture");
    let doc: Value = serde_json::from_str(&text).expect("fixture json");
    let instance = |policy: &str| {
        TestApp::with_config(
            ServeConfig::parse_from([
                "kvroute",
                "--router-profile",
                "dynamo",
                "--queue-threshold",
                "0.5",
                "--queue-policy",
                policy,
            ])
            .expect("flags"),
        )
    };
    let apps = Instances {
        fcfs: instance("fcfs"),
        lcfs: instance("lcfs"),
        wspt: instance("wspt"),
    };
    let exchanges: Vec<&Value> = doc["exchanges"]
        .as_array()
        .expect("exchanges")
        .iter()
        .collect();
    let by_name: HashMap<&str, &Value> = exchanges
        .iter()
        .map(|ex| (ex["name"].as_str().expect("name"), *ex))
        .collect();
    // The `orders` rounds: their queued requests go after the round's blocker, in send order.
    let mut round_sends: HashMap<String, Vec<(String, u64)>> = HashMap::new();
    let mut round_frees: HashMap<String, Vec<String>> = HashMap::new();
    for round in doc["orders"].as_array().expect("orders") {
        let name = round["name"].as_str().expect("round");
        let sent = round["sent"]
            .as_array()
            .expect("sent")
            .iter()
            .map(|s| {
                (
                    format!("{name}_queued_{}", s["name"].as_str().expect("name")),
                    s["t_ms"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        round_sends.insert(format!("{name}_book_blocker"), sent);
        // After its last exchange the capture freed the round's blocker and bookings.
        let prefix = format!("{name}_");
        let last = exchanges
            .iter()
            .rev()
            .find_map(|ex| ex["name"].as_str().filter(|n| n.starts_with(&prefix)))
            .expect("the round's exchanges");
        let mut ids = vec![format!("{name}-blocker")];
        for s in round["sent"].as_array().expect("sent") {
            if s["route"] != "/select" {
                ids.push(format!("{name}-{}", s["name"].as_str().expect("name")));
            }
        }
        round_frees.insert(last.to_string(), ids);
    }
    let mut engines: HashMap<String, FakeEngine> = HashMap::new();
    // Sent and not yet answered, by exchange name.
    let mut waiting: HashMap<String, Answer> = HashMap::new();
    let mut previous = "";
    let (mut report, mut compared, mut deviations_seen, mut skipped) = (Vec::new(), 0, 0, 0);
    for ex in &exchanges {
        let name = ex["name"].as_str().expect("name");
        if NOT_REPLAYED
            .iter()
            .any(|(prefix, _)| name.starts_with(prefix))
        {
            skipped += 1;
            continue;
        }
        let app = apps.for_exchange(name);
        let reply = if let Some(task) = waiting.remove(name) {
            tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .unwrap_or_else(|_| panic!("{name} was never answered"))
                .expect("task")
        } else {
            // Nothing still waiting may have been answered before this exchange (a step's
            // later releases excepted: the capture made them back to back and listed what
            // completed after the first).
            tokio::time::sleep(Duration::from_millis(20)).await;
            let same_step = step_of(name).is_some() && step_of(name) == step_of(previous);
            for (queued, task) in waiting.iter().filter(|_| !same_step) {
                assert!(
                    !task.is_finished(),
                    "{queued} was answered before {name}, earlier than in Dynamo"
                );
            }
            if name == "wspt_overlap_prefix" {
                hold_prefix(app, &mut engines, ex).await;
            }
            let (method, path, mut body) = request_of(ex);
            if let Some(b) = body.as_mut() {
                swap_engine_endpoint(&mut engines, b).await;
            }
            app.call(method, &path, body).await
        };
        previous = name;
        compared += 1;
        if let Some(problem) = difference(ex, &reply) {
            if QUEUE_DEVIATIONS.iter().any(|(n, _)| *n == name) {
                deviations_seen += 1;
            } else {
                report.push(format!("{name}: {problem}"));
            }
        }
        for id in freed_after(name) {
            app.delete(&format!("/reservations/{id}")).await;
        }
        for id in round_frees.get(name).into_iter().flatten() {
            app.delete(&format!("/reservations/{id}")).await;
        }
        // A `type_*` booking that succeeded was freed by the capture.
        if name.starts_with("type_") && reply.status == 200 {
            let id = ex["request"]["selection_id"].as_str().expect("id");
            app.delete(&format!("/reservations/{id}")).await;
        }
        if let Some(sends) = round_sends.get(name) {
            let mut last_ms = 0;
            for (queued, t_ms) in sends {
                // The recorded arrival times, on the service's clock.
                app.state
                    .advance_clock(Duration::from_millis(t_ms.saturating_sub(last_ms)));
                last_ms = *t_ms;
                let task = spawn_queued(app, by_name[queued.as_str()]).await;
                waiting.insert(queued.clone(), task);
            }
        }
        for queued in spawned_after(name) {
            let task = spawn_queued(apps.for_exchange(queued), by_name[queued]).await;
            waiting.insert((*queued).to_string(), task);
        }
        if name == "lcfs_shutdown_book_blocker" {
            // The capture's SIGINT with both requests waiting.
            apps.lcfs.state.begin_shutdown();
        }
    }
    assert!(waiting.is_empty(), "never answered: {:?}", waiting.keys());
    assert_eq!(compared + skipped, exchanges.len());
    assert!(compared >= 180, "{compared}");
    assert!(
        report.is_empty(),
        "differences from Dynamo's queue exchanges:\n{}",
        report.join("\n")
    );
    assert_eq!(deviations_seen, QUEUE_DEVIATIONS.len());
}

/// The capture's engine stored a 32-token prefix on worker 1 of the wspt instance before
/// `wspt_overlap_prefix`: publish its blocks and wait until they are indexed.
async fn hold_prefix(app: &TestApp, engines: &mut HashMap<String, FakeEngine>, ex: &Value) {
    let tokens: Vec<u32> = ex["request"]["token_ids"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("token") as u32)
        .collect();
    let hashes: Vec<u64> = (7001..7009).collect();
    let batch = capture_batch(&hashes, &tokens, None, None);
    let workers = app.get("/workers").await;
    let endpoint = workers.body[0]["kv_events_endpoint"]
        .as_str()
        .expect("endpoint")
        .to_string();
    let engine = engines
        .values_mut()
        .find(|e| e.pub_endpoint() == endpoint)
        .expect("the wspt worker's engine");
    publish_until_held(app, engine, &batch, &tokens, 1, 8).await;
}
