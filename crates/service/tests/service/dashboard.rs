//! The status page (`GET /dashboard`) in a real browser: headless Chromium loads it from a live
//! service on 127.0.0.1, with an API key, workers in two partitions (dp ranks, a fake engine's
//! KV events, predicted caches) and bookings, and the rendered DOM is held to `GET /loads`; and
//! workers whose routing is degraded are named in its banner with the fix, until fixed.
//!
//! Chromium is found at `$KVROUTE_CHROMIUM`, else `chromium` on `PATH`, else
//! `/usr/bin/chromium`; without it the test fails (`.ci/run` installs the Debian package).
//! With `KVROUTE_DASHBOARD_SCREENSHOT=<file.png>` it also keeps the service busy for a while and
//! saves a screenshot of the page there (`docs/dashboard.png` was made so).

use crate::common::TestApp;
use axum::http::{Method, StatusCode};
use kvroute_service::{AppState, ServeConfig};
use kvroute_testkit::fake_engine::FakeEngine;
use kvroute_wire::Encoding;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &str = "dash-s3cret";
const BLOCK: u32 = 16;
/// The longest the browser may take to load and render the page.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(90);

fn chromium() -> PathBuf {
    let on_path = || {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("chromium"))
                .find(|p| p.is_file())
        })
    };
    let path = std::env::var_os("KVROUTE_CHROMIUM")
        .map(PathBuf::from)
        .or_else(on_path)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    assert!(
        path.is_file(),
        "the dashboard test needs Chromium and found none (KVROUTE_CHROMIUM, `chromium` on PATH, \
         /usr/bin/chromium): install it with `apt-get install -y chromium` (scripts/deps.sh does)"
    );
    path
}

/// A browser process, killed when dropped (a test that fails half-way leaves none behind).
struct Browser {
    child: Child,
    profile: PathBuf,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Runs headless Chromium on `url` with `extra` arguments; returns its stdout once it exits,
/// killing it past [`BROWSER_TIMEOUT`].
fn run_chromium(url: &str, extra: &[String]) -> String {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let profile = std::env::temp_dir().join(format!(
        "kvroute-dashboard-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&profile);
    std::fs::create_dir_all(&profile).unwrap();
    let out = profile.join("stdout");
    let child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromium");
    let mut browser = Browser { child, profile };
    let deadline = Instant::now() + BROWSER_TIMEOUT;
    loop {
        if let Some(status) = browser.child.try_wait().unwrap() {
            assert!(status.success(), "chromium exited with {status}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "chromium did not finish within {BROWSER_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::read_to_string(&out).unwrap()
}

/// The value of attribute `name` in an HTML start tag.
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let at = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    tag[at..].split('"').next()
}

/// The text of the first element with `data-field="<field>"` in `html` (tags inside removed).
fn field(html: &str, name: &str) -> Option<String> {
    let at = html.find(&format!("data-field=\"{name}\""))?;
    let rest = &html[at..];
    let content = &rest[rest.find('>')? + 1..];
    let mut text = String::new();
    let mut depth = 0usize;
    let mut in_tag = false;
    let mut chars = content.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '<' if chars.peek() == Some(&'/') && depth == 0 => break,
            '<' => {
                in_tag = true;
                if chars.peek() == Some(&'/') {
                    depth -= 1;
                } else {
                    depth += 1;
                }
            }
            '>' if in_tag => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    Some(text.trim().to_string())
}

/// A rank's row as the page rendered it.
#[derive(Debug)]
struct Row {
    model_name: String,
    routing_group: String,
    worker_id: u64,
    dp_rank: u64,
    fields: Vec<(&'static str, String)>,
    policy: Option<String>,
}

const NUMBERS: [&str; 3] = [
    "potential_prefill_tokens",
    "potential_decode_blocks",
    "active_requests",
];

/// Every `<tr class="rank">` of the dumped DOM, with the partition section it sits in.
fn rows(dom: &str) -> Vec<Row> {
    let mut out = Vec::new();
    for section in dom.split("<section class=\"partition\"").skip(1) {
        let head = &section[..section.find('>').unwrap()];
        let model_name = attr(head, "data-model-name").unwrap().to_string();
        let routing_group = attr(head, "data-routing-group").unwrap().to_string();
        let section = &section[..section.find("</section>").unwrap()];
        for row in section.split("<tr class=\"rank\"").skip(1) {
            let tag = &row[..row.find('>').unwrap()];
            let row = &row[..row.find("</tr>").unwrap()];
            let mut fields = Vec::new();
            for name in NUMBERS {
                fields.push((name, field(row, name).unwrap_or_default()));
            }
            let policy = row
                .find("data-field=\"cache_model\"")
                .and_then(|at| attr(&row[at - 1..], "data-policy"))
                .map(str::to_string);
            out.push(Row {
                model_name: model_name.clone(),
                routing_group: routing_group.clone(),
                worker_id: attr(tag, "data-worker-id").unwrap().parse().unwrap(),
                dp_rank: attr(tag, "data-dp-rank").unwrap().parse().unwrap(),
                fields,
                policy,
            });
        }
    }
    out
}

fn bearer() -> String {
    format!("Bearer {KEY}")
}

async fn call(app: &TestApp, method: Method, path: &str, body: Option<Value>) -> Value {
    let auth = bearer();
    let headers = [("authorization", auth.as_str())];
    let (ct, bytes) = match &body {
        Some(b) => (Some("application/json"), serde_json::to_vec(b).unwrap()),
        None => (None, Vec::new()),
    };
    let reply = app.raw(method.clone(), path, ct, bytes, &headers).await;
    assert!(
        reply.status.is_success(),
        "{method} {path}: {} {}",
        reply.status,
        reply.text
    );
    reply.body
}

fn prompt(family: u32, len: u32) -> Vec<u32> {
    (0..len).map(|t| family * 100_000 + t).collect()
}

/// The service's partitions: worker 1 (dp ranks 0 and 1, KV events from a fake engine each)
/// and worker 2 (one rank, its cache predicted) in `default`; worker 3 (dp ranks 4 and 5,
/// predicted) in `llama`/`tenant-b`. Returns the engines, warmed up: each of worker 1's ranks
/// holds a prompt.
async fn populate(app: &TestApp) -> Vec<FakeEngine> {
    let mut engines = Vec::new();
    for rank in 0..2 {
        let mut engine = FakeEngine::bind("tcp://127.0.0.1:0", None, Encoding::Array)
            .await
            .unwrap();
        engine.set_data_parallel_rank(Some(rank));
        engines.push(engine);
    }
    let w1 = json!({"worker_id": 1, "endpoint": "http://127.0.0.1:9001", "block_size": BLOCK,
                    "data_parallel_size": 2, "total_kv_blocks": 4096,
                    "kv_events_endpoints": {"0": engines[0].pub_endpoint(),
                                            "1": engines[1].pub_endpoint()}});
    call(app, Method::POST, "/workers", Some(w1)).await;
    let w2 = json!({"worker_id": 2, "endpoint": "http://127.0.0.1:9002", "block_size": BLOCK,
                    "total_kv_blocks": 4096});
    call(app, Method::POST, "/workers", Some(w2)).await;
    let w3 = json!({"worker_id": 3, "model_name": "llama", "routing_group": "tenant-b",
                    "endpoint": "http://127.0.0.1:9003", "block_size": BLOCK,
                    "data_parallel_start_rank": 4, "data_parallel_size": 2});
    call(app, Method::POST, "/workers", Some(w3)).await;
    // Publish until the index has it: the listener is subscribed from then on.
    for (rank, engine) in engines.iter_mut().enumerate() {
        let cached = prompt(7 + rank as u32, 256);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            engine
                .publish_stored(None, &cached, BLOCK, None)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let scores = call(
                app,
                Method::POST,
                "/overlap_scores",
                Some(json!({"token_ids": cached})),
            )
            .await;
            let held = scores["workers"].as_array().unwrap().iter().any(|w| {
                w["worker_id"] == 1 && w["dp_rank"] == rank && w["device_blocks"].as_u64() > Some(0)
            });
            if held {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the KV events of worker 1 rank {rank} never reached the index"
            );
        }
    }
    engines
}

/// Bookings in both partitions, one through each lifecycle step, and plain selections.
async fn book(app: &TestApp, round: u32) {
    for i in 0..6u32 {
        let family = if i % 2 == 0 {
            7 + i % 4 / 2
        } else {
            10 + i + round * 10
        };
        let body = json!({"token_ids": prompt(family, 200 + 37 * i), "reservation_id": format!("r{round}-{i}"),
                          "expected_output_tokens": 64 + 16 * i});
        call(app, Method::POST, "/select_and_reserve", Some(body)).await;
    }
    for i in 0..3u32 {
        let body = json!({"model_name": "llama", "routing_group": "tenant-b",
                          "token_ids": prompt(50 + i, 96 + 64 * i),
                          "reservation_id": format!("b{round}-{i}")});
        call(app, Method::POST, "/select_and_reserve", Some(body)).await;
    }
    let r = format!("/reservations/r{round}-1/prefill_complete");
    call(app, Method::POST, &r, None).await;
    let r = format!("/reservations/r{round}-2/output_block");
    call(app, Method::POST, &r, None).await;
    call(
        app,
        Method::DELETE,
        &format!("/reservations/b{round}-0"),
        None,
    )
    .await;
    for i in 0..4u32 {
        let body = json!({"token_ids": prompt(7, 160 + 16 * i)});
        call(app, Method::POST, "/select", Some(body)).await;
    }
}

/// Serves `state` on 127.0.0.1; returns the port and the stop signal.
async fn serve(state: &Arc<AppState>) -> (u16, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(kvroute_service::http::serve(
        Arc::clone(state),
        listener,
        async move {
            let _ = rx.await;
        },
    ));
    (port, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_renders_a_row_per_rank_with_the_loads() {
    let chromium = chromium();
    let mut config = ServeConfig::defaults();
    config.api_key = Some(KEY.into());
    let app = TestApp::with_config(config);
    let (port, stop) = serve(&app.state).await;

    // The page is behind the key; its 401 asks a browser for it, as a Basic password.
    let open = app.get("/dashboard").await;
    assert_eq!(open.status, StatusCode::UNAUTHORIZED);
    let basic = "Basic a3Zyb3V0ZTpkYXNoLXMzY3JldA=="; // kvroute:dash-s3cret
    let page = app
        .raw(
            Method::GET,
            "/dashboard",
            None,
            Vec::new(),
            &[("authorization", basic)],
        )
        .await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.text.starts_with("<!DOCTYPE html>"));
    let wrong = app
        .raw(
            Method::GET,
            "/loads",
            None,
            Vec::new(),
            &[("authorization", "Basic a3Zyb3V0ZTpub3BlCg==")], // kvroute:nope
        )
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(
        !page.text.contains("src=\"http") && !page.text.contains("href=\"http"),
        "the page loads nothing from elsewhere"
    );

    let mut engines = populate(&app).await;
    book(&app, 0).await;
    let loads = call(&app, Method::GET, "/loads", None).await;

    // The browser logs in with the key in the address, as a user's would after the dialog.
    let url = format!("http://kvroute:{KEY}@127.0.0.1:{port}/dashboard");
    let started = Instant::now();
    let dom = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            run_chromium(
                &url,
                &["--virtual-time-budget=4000".into(), "--dump-dom".into()],
            )
        }
    })
    .await
    .unwrap();
    let browser_time = started.elapsed();
    assert!(
        dom.contains("data-state=\"ready\""),
        "the page never rendered the service's data ({chromium:?}, {browser_time:?}):\n{dom}"
    );
    let rendered = rows(&dom);
    let mut expected = 0;
    for partition in loads.as_array().unwrap() {
        let (model, group) = (
            partition["model_name"].as_str().unwrap(),
            partition["routing_group"].as_str().unwrap(),
        );
        for load in partition["loads"].as_array().unwrap() {
            expected += 1;
            let (worker, rank) = (
                load["worker_id"].as_u64().unwrap(),
                load["dp_rank"].as_u64().unwrap(),
            );
            let row: Vec<&Row> = rendered
                .iter()
                .filter(|r| {
                    (
                        r.model_name.as_str(),
                        r.routing_group.as_str(),
                        r.worker_id,
                        r.dp_rank,
                    ) == (model, group, worker, rank)
                })
                .collect();
            assert_eq!(
                row.len(),
                1,
                "one row for {model}/{group} worker {worker} rank {rank}: {rendered:?}"
            );
            for (name, text) in &row[0].fields {
                assert_eq!(
                    text.parse::<u64>().ok(),
                    load[*name].as_u64(),
                    "{name} of worker {worker} rank {rank}"
                );
            }
            assert_eq!(
                row[0].policy.as_deref(),
                load["cache_model"]["policy"].as_str(),
                "cache model of worker {worker} rank {rank}"
            );
        }
    }
    assert_eq!(expected, 5, "{loads}");
    assert_eq!(rendered.len(), expected, "a row per rank and no more");
    // The bookings show: some rank carries load.
    assert!(rendered.iter().any(|r| {
        r.fields
            .iter()
            .any(|(n, v)| *n == "active_requests" && v != "0")
    }));
    // Decision quality and the listener made it to the page.
    assert!(dom.contains("data-field=\"quality\""));
    assert!(dom.contains("<svg width=\"200\" height=\"36\" data-chart=\"quality\">"));
    assert!(
        dom.contains("class=\"pill live\""),
        "worker 1's listener is live"
    );
    eprintln!("dashboard: chromium rendered the page in {browser_time:?}");

    if let Some(file) = std::env::var_os("KVROUTE_DASHBOARD_SCREENSHOT") {
        screenshot(&app, &mut engines, &url, Path::new(&file)).await;
    }
    let _ = stop.send(());
}

/// Keeps the service busy (bookings, frees, KV events) while the browser polls the page for a
/// minute of its virtual time, then saves the screenshot.
async fn screenshot(app: &TestApp, engines: &mut [FakeEngine], url: &str, file: &Path) {
    let file = std::path::absolute(file).unwrap();
    let shot = tokio::task::spawn_blocking({
        let url = url.to_string();
        let arg = format!("--screenshot={}", file.display());
        move || {
            run_chromium(
                &url,
                &[
                    "--virtual-time-budget=60000".into(),
                    "--window-size=1280,960".into(),
                    arg,
                ],
            )
        }
    });
    let mut round = 1;
    while !shot.is_finished() {
        book(app, round).await;
        for engine in engines.iter_mut() {
            let tokens = prompt(1000 + round, 64 + 16 * (round % 8));
            engine
                .publish_stored(None, &tokens, BLOCK, None)
                .await
                .unwrap();
        }
        for i in 0..6u32 {
            if (round + i) % 3 != 0 {
                let _ = app
                    .raw(
                        Method::DELETE,
                        &format!("/reservations/r{}-{i}", round - 1),
                        None,
                        Vec::new(),
                        &[("authorization", bearer().as_str())],
                    )
                    .await;
            }
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shot.await.unwrap();
    assert!(file.is_file(), "no screenshot at {}", file.display());
    eprintln!("dashboard: screenshot at {}", file.display());
}

/// With the admission queue on, the page shows what waits in a partition and for which tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_the_admission_queue() {
    let chromium = chromium();
    let mut config =
        ServeConfig::parse_from(["kvroute", "--queue-threshold", "0.5"]).expect("flags");
    config.api_key = Some(KEY.into());
    let app = TestApp::with_config(config);
    let (port, stop) = serve(&app.state).await;
    call(
        &app,
        Method::POST,
        "/workers",
        Some(
            serde_json::json!({"worker_id": 1, "endpoint": "http://w1:8000", "block_size": 4,
                                "max_num_batched_tokens": 64}),
        ),
    )
    .await;
    call(
        &app,
        Method::POST,
        "/reservations",
        Some(serde_json::json!({"selection_id": "blk", "worker_id": 1,
                                "token_ids": prompt(1, 40)})),
    )
    .await;
    let mut waiting = Vec::new();
    for (i, tenant) in ["gold", "gold", "free"].into_iter().enumerate() {
        let app = app.clone();
        let body = serde_json::json!({"token_ids": prompt(10 + i as u32, 12)}).to_string();
        waiting.push(tokio::spawn(async move {
            app.raw(
                Method::POST,
                "/select_and_reserve",
                Some("application/json"),
                body.into_bytes(),
                &[("authorization", &bearer()), ("x-tenant-id", tenant)],
            )
            .await
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while call(&app, Method::GET, "/loads", None).await[0]["pending_count"] != 3 {
        assert!(Instant::now() < deadline, "the requests never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let url = format!("http://kvroute:{KEY}@127.0.0.1:{port}/dashboard");
    let dom = tokio::task::spawn_blocking(move || {
        run_chromium(
            &url,
            &["--virtual-time-budget=4000".into(), "--dump-dom".into()],
        )
    })
    .await
    .unwrap();
    assert!(dom.contains("data-state=\"ready\""), "{chromium:?}:\n{dom}");
    assert_eq!(field(&dom, "pending_count").as_deref(), Some("3"), "{dom}");
    assert_eq!(field(&dom, "pending_isl_tokens").as_deref(), Some("36"));
    assert_eq!(
        field(&dom, "queue_tenants").as_deref(),
        Some("free 1, gold 2"),
        "{dom}"
    );
    let _ = stop.send(());
    for task in waiting {
        assert_eq!(task.await.unwrap().status, StatusCode::SERVICE_UNAVAILABLE);
    }
}

/// The `<li class="degraded-item">` entries of the banner: worker, reason and text.
fn banner(dom: &str) -> Vec<(u64, String, String)> {
    dom.split("<li class=\"degraded-item\"")
        .skip(1)
        .map(|item| {
            let tag = &item[..item.find('>').unwrap()];
            let body = &item[item.find('>').unwrap() + 1..item.find("</li>").unwrap()];
            let text = body.replace("<code>", "").replace("</code>", "");
            (
                attr(tag, "data-worker-id").unwrap().parse().unwrap(),
                attr(tag, "data-reason").unwrap().to_string(),
                text,
            )
        })
        .collect()
}

/// Routing gone blind shows as a banner naming the worker and the fix, and goes once fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_names_degraded_workers_and_the_fix() {
    let chromium = chromium();
    let mut config = ServeConfig::parse_from([
        "kvroute",
        "--kv-silence-secs",
        "30",
        "--kv-silence-bookings",
        "3",
    ])
    .expect("flags");
    config.api_key = Some(KEY.into());
    let app = TestApp::with_config(config);
    let (port, stop) = serve(&app.state).await;
    // Worker 5: an engine of 32-token blocks behind a worker registered with 16.
    let mut engine = FakeEngine::bind("tcp://127.0.0.1:0", None, Encoding::Array)
        .await
        .unwrap();
    let w5 = json!({"worker_id": 5, "endpoint": "http://127.0.0.1:9005", "block_size": BLOCK,
                    "kv_events_endpoint": engine.pub_endpoint()});
    call(&app, Method::POST, "/workers", Some(w5)).await;
    // Worker 6: its events address has nothing behind it.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let wrong = format!("tcp://{}", silent.local_addr().unwrap());
    drop(silent);
    let w6 = json!({"worker_id": 6, "endpoint": "http://127.0.0.1:9006", "block_size": BLOCK,
                    "kv_events_endpoint": wrong});
    call(&app, Method::POST, "/workers", Some(w6)).await;
    for i in 0..4u32 {
        let body = json!({"token_ids": prompt(60 + i, 64), "pinned_worker": {"worker_id": 6}});
        call(&app, Method::POST, "/select_and_reserve", Some(body)).await;
    }
    app.state.advance_clock(Duration::from_secs(31));
    app.state.tick(app.state.now());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        engine
            .publish_stored(None, &prompt(70, 64), 2 * BLOCK, None)
            .await
            .unwrap();
        let loads = call(&app, Method::GET, "/loads", None).await;
        let flagged = loads[0]["loads"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["degraded"].is_array())
            .count();
        if flagged == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "not both degraded: {loads}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let url = format!("http://kvroute:{KEY}@127.0.0.1:{port}/dashboard");
    let render = |url: String| {
        tokio::task::spawn_blocking(move || {
            run_chromium(
                &url,
                &["--virtual-time-budget=4000".into(), "--dump-dom".into()],
            )
        })
    };
    let dom = render(url.clone()).await.unwrap();
    assert!(dom.contains("data-state=\"ready\""), "{chromium:?}:\n{dom}");
    assert!(
        dom.contains("<section id=\"degraded\" role=\"alert\" class=\"shown\">"),
        "{dom}"
    );
    let items = banner(&dom);
    assert_eq!(items.len(), 2, "{items:?}");
    assert_eq!(
        (items[0].0, items[0].1.as_str()),
        (5, "block_size_mismatch")
    );
    assert!(
        items[0].2.contains("worker 5: its KV events")
            && items[0].2.contains("register it with block_size 32"),
        "{items:?}"
    );
    assert_eq!((items[1].0, items[1].1.as_str()), (6, "no_kv_events"));
    assert!(
        items[1]
            .2
            .contains("worker 6: 4 bookings in 31 s and no KV event")
            && items[1].2.contains(&wrong),
        "{items:?}"
    );

    // Fixed: worker 5's engine uses 16-token blocks, worker 6 is deleted.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        engine
            .publish_stored(None, &prompt(71, 64), BLOCK, None)
            .await
            .unwrap();
        let loads = call(&app, Method::GET, "/loads", None).await;
        if loads[0]["loads"][0]["degraded"].is_null() {
            break;
        }
        assert!(Instant::now() < deadline, "never cleared: {loads}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    call(&app, Method::DELETE, "/workers/6", None).await;
    let dom = render(url).await.unwrap();
    assert!(dom.contains("data-state=\"ready\""), "{dom}");
    assert!(banner(&dom).is_empty(), "{dom}");
    assert!(
        !dom.contains("<section id=\"degraded\" role=\"alert\" class=\"shown\">"),
        "the banner is hidden: {dom}"
    );
    let _ = stop.send(());
}
