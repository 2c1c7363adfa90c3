//! The scenario of docs/replicas.md, as written there: a `nats-server`, two
//! `kvroute serve --nats-url … --replica-id …` processes on their own ports, and the curl calls
//! (made with kvroute's own HTTP client).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../service/tests/service/common/nats.rs"]
mod nats;

use kvroute_testkit::client::HttpClient;
use nats::{Nats, free_port};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);

/// A `kvroute serve` process, killed when dropped; its log (stderr) is printed when the test
/// fails, so a failure says what the server did.
struct Serve(Child, std::path::PathBuf);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.1).unwrap_or_default();
            eprintln!("--- {}:\n{log}", self.1.display());
        }
        let _ = std::fs::remove_file(&self.1);
    }
}

fn serve(port: u16, nats: &Nats, replica_id: &str) -> Serve {
    let log = std::env::temp_dir().join(format!(
        "kvroute-replicas-test-{}-{replica_id}.log",
        std::process::id()
    ));
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--port", &port.to_string(), "--nats-url"])
        .arg(nats.url())
        .args(["--replica-id", replica_id])
        .env("RUST_LOG", "kvroute=debug,info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("kvroute serve starts");
    Serve(child, log)
}

async fn call(port: u16, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + WAIT;
    let mut client = loop {
        match HttpClient::connect(addr).await {
            Ok(client) => break client,
            Err(_) => {
                assert!(
                    Instant::now() < deadline,
                    "kvroute on port {port} never listened"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let bytes = body.map(|b| serde_json::to_vec(&b).unwrap());
    let (status, reply) = client
        .request(method, path, bytes.as_deref())
        .await
        .expect("reply");
    (
        status,
        serde_json::from_slice(&reply).unwrap_or(Value::Null),
    )
}

/// Polls `GET path` on `port` until `check` holds.
async fn eventually(port: u16, path: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, body) = call(port, "GET", path, None).await;
        if status == 200 && check(&body) {
            return body;
        }
        assert!(Instant::now() < deadline, "GET {path} on {port}: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn active_requests(loads: &Value) -> u64 {
    loads
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["loads"].as_array().into_iter().flatten())
        .filter_map(|l| l["active_requests"].as_u64())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_scenario_with_two_replicas() {
    let nats = Nats::start();
    let (r1, r2) = (free_port(), free_port());
    let _first = serve(r1, &nats, "r1");
    let _second = serve(r2, &nats, "r2");

    let (status, _) = call(
        r1,
        "POST",
        "/workers",
        Some(json!({"worker_id": 1, "endpoint": "http://gpu-1:8000", "block_size": 4})),
    )
    .await;
    assert_eq!(status, 201);
    eventually(r2, "/workers", |w| w[0]["worker_id"] == 1).await;
    let (status, reply) = call(
        r1,
        "POST",
        "/select_and_reserve",
        Some(json!({"token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "reservation_id": "req-1"})),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    eventually(r2, "/loads", |l| active_requests(l) == 1).await;
    let (status, _) = call(r1, "DELETE", "/reservations/req-1", None).await;
    assert_eq!(status, 200);
    eventually(r2, "/loads", |l| active_requests(l) == 0).await;
}
