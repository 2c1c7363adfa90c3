//! What the service benches share.

use kvroute_service::api;
use kvroute_service::config::ServeConfig;
use kvroute_service::http::types::WorkerBody;
use kvroute_service::state::AppState;
use std::sync::Arc;

/// A service built from `config` with workers 1..=`workers` registered (block size 64, no
/// KV-event endpoints).
pub fn service_with_workers(config: ServeConfig, workers: u64) -> Arc<AppState> {
    let state = AppState::new(config).expect("a valid configuration");
    for id in 1..=workers {
        let body: WorkerBody = serde_json::from_value(serde_json::json!({
            "worker_id": id, "endpoint": format!("http://worker-{id}:8000"), "block_size": 64,
        }))
        .expect("a valid worker body");
        api::upsert_worker(&state, body).expect("the worker registers");
    }
    state
}
