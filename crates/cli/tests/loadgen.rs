//! `kvroute loadgen` against a real `kvroute serve`: the fake engines' KV events (real ZeroMQ,
//! vLLM's format) must be accepted by the service exactly — every stored block under a parent
//! the service holds — and the closed loop must finish without an error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `kvroute serve` process, killed when dropped.
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A base port whose next `n` ports are free (the fake engines bind base+1 … base+n).
fn free_port_run(n: u16) -> u16 {
    for _ in 0..200 {
        let base = free_port().saturating_sub(n + 1).max(20_000);
        let listeners: Vec<_> = (1..=n)
            .map_while(|i| TcpListener::bind(("127.0.0.1", base + i)).ok())
            .collect();
        if listeners.len() == usize::from(n) {
            return base;
        }
    }
    panic!("no run of {n} free ports");
}

fn metrics(port: u16) -> String {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    use std::io::{Read, Write};
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

/// The sum of the `kvroute_kv_events_total` samples whose labels contain `labels`.
fn events(metrics: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("kvroute_kv_events_total{") && labels.iter().all(|x| l.contains(x))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A `kvroute serve` on a free port, once it listens.
fn serve() -> (Serve, u16) {
    let port = free_port();
    let server = Serve(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvroute serve starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "kvroute serve never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    (server, port)
}

fn get(port: u16, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    use std::io::{Read, Write};
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

/// Runs `kvroute loadgen --mode cycle` against the service on `port` with `args`; its report.
fn cycle_run(port: u16, name: &str, args: &[&str]) -> serde_json::Value {
    let out = std::env::temp_dir().join(format!("kvroute-loadgen-{name}-{port}.json"));
    let status = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["loadgen", "--url", &format!("http://127.0.0.1:{port}")])
        .args(args)
        .args(["--mode", "cycle", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .status()
        .expect("loadgen runs");
    assert!(status.success());
    let report = serde_json::from_slice(&std::fs::read(&out).expect("report")).expect("json");
    let _ = std::fs::remove_file(&out);
    report
}

#[test]
fn event_workers_bounds_the_endpoints_registered_and_the_engines() {
    let (_server, port) = serve();
    let events_base = free_port_run(2);
    let report = cycle_run(
        port,
        "ew",
        &[
            "--workers",
            "5",
            "--event-workers",
            "2",
            "--events-base-port",
            &events_base.to_string(),
            "--concurrency",
            "2",
            "--duration-secs",
            "1",
            "--max-prompt-tokens",
            "512",
        ],
    );
    assert_eq!(report["workers"], 5, "{report}");
    assert_eq!(report["engine_workers"], 2, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    let reply = get(port, "/workers");
    let body = &reply[reply.find("\r\n\r\n").expect("a body") + 4..];
    let listed: serde_json::Value = serde_json::from_str(body).expect("json");
    let mut endpoints: Vec<(u64, bool)> = listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|w| {
            (
                w["worker_id"].as_u64().unwrap(),
                w["kv_events_endpoint"].is_string(),
            )
        })
        .collect();
    endpoints.sort_unstable();
    assert_eq!(
        endpoints,
        vec![(1, true), (2, true), (3, false), (4, false), (5, false)]
    );
}

#[test]
fn cycle_run_books_everything_and_its_engines_events_all_apply() {
    let (_server, port) = serve();
    let workers = 4;
    let events_base = free_port_run(workers);
    let report = cycle_run(
        port,
        "cycle",
        &[
            "--workers",
            &workers.to_string(),
            "--events-base-port",
            &events_base.to_string(),
            "--engine-kv-blocks",
            "256",
            "--concurrency",
            "4",
            "--duration-secs",
            "3",
            "--max-prompt-tokens",
            "1024",
        ],
    );
    let cycles = report["cycles"]["count"].as_u64().unwrap();
    assert!(cycles > 100, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    for route in ["select", "reservations", "prefill_complete", "free"] {
        assert_eq!(
            report["routes"][route]["count"].as_u64(),
            Some(cycles),
            "{route}"
        );
    }
    // The engines cached what was routed to them (small pools: they evict too), and the
    // service applied every block of it under a parent it held.
    let text = metrics(port);
    let stored = events(&text, &["type=\"stored\"", "status=\"applied\""]);
    let removed = events(&text, &["type=\"removed\"", "status=\"applied\""]);
    assert!(stored > 0.0 && removed > 0.0, "{text}");
    let refused = events(&text, &["type=\"stored\""]) - stored;
    assert_eq!(refused, 0.0, "stored blocks not applied:\n{text}");
}
