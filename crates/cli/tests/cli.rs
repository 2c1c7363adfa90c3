//! The `kvroute` binary as a user runs it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::process::{Command, Stdio};

fn kvroute(args: &[&str], stdin: &str) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("exits");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// xxh3-64 of `bytes` with `seed`, computed here independently of the crate under test (a
/// straight transcription of the XXH3 algorithm for inputs of 1–16 and 17–128 bytes, the sizes
/// these vectors use), so the CLI is checked against more than its own library.
mod xxh3 {
    const P64_1: u64 = 0x9E3779B185EBCA87;
    const SECRET: [u8; 192] = [
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
        0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
        0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
        0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
        0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
        0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
        0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
        0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
        0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
        0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
        0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
    ];
    fn r64(b: &[u8], i: usize) -> u64 {
        u64::from_le_bytes(b[i..i + 8].try_into().unwrap())
    }
    fn avalanche(mut h: u64) -> u64 {
        h ^= h >> 37;
        h = h.wrapping_mul(0x165667919E3779F9);
        h ^ (h >> 32)
    }
    fn mul128_fold64(a: u64, b: u64) -> u64 {
        let p = u128::from(a) * u128::from(b);
        (p as u64) ^ ((p >> 64) as u64)
    }
    fn mix16(b: &[u8], i: usize, s: usize, seed: u64) -> u64 {
        mul128_fold64(
            r64(b, i) ^ r64(&SECRET, s).wrapping_add(seed),
            r64(b, i + 8) ^ r64(&SECRET, s + 8).wrapping_sub(seed),
        )
    }
    pub fn hash(b: &[u8], seed: u64) -> u64 {
        let len = b.len();
        if (9..=16).contains(&len) {
            let lo = (r64(&SECRET, 24) ^ r64(&SECRET, 32)).wrapping_add(seed);
            let hi = (r64(&SECRET, 40) ^ r64(&SECRET, 48)).wrapping_sub(seed);
            let lo = r64(b, 0) ^ lo;
            let hi = r64(b, len - 8) ^ hi;
            let acc = (len as u64)
                .wrapping_add(lo.swap_bytes())
                .wrapping_add(hi)
                .wrapping_add(mul128_fold64(lo, hi));
            return avalanche(acc);
        }
        assert!(
            (17..=128).contains(&len),
            "only the sizes these vectors use"
        );
        let mut acc = (len as u64).wrapping_mul(P64_1);
        if len > 32 {
            if len > 64 {
                if len > 96 {
                    acc = acc.wrapping_add(mix16(b, 48, 96, seed));
                    acc = acc.wrapping_add(mix16(b, len - 64, 112, seed));
                }
                acc = acc.wrapping_add(mix16(b, 32, 64, seed));
                acc = acc.wrapping_add(mix16(b, len - 48, 80, seed));
            }
            acc = acc.wrapping_add(mix16(b, 16, 32, seed));
            acc = acc.wrapping_add(mix16(b, len - 32, 48, seed));
        }
        acc = acc.wrapping_add(mix16(b, 0, 0, seed));
        acc = acc.wrapping_add(mix16(b, len - 16, 16, seed));
        avalanche(acc)
    }
}

#[test]
fn hash_prints_xxh3_local_and_chained_sequence_hashes() {
    let (code, out, _) = kvroute(&["hash", "--block-size", "4"], "[1,2,3,4,5,6,7,8]");
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
    let block = |tokens: [u32; 4]| {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3::hash(&bytes, 1337)
    };
    let l0 = block([1, 2, 3, 4]);
    let l1 = block([5, 6, 7, 8]);
    let mut chained = Vec::new();
    chained.extend_from_slice(&l0.to_le_bytes());
    chained.extend_from_slice(&l1.to_le_bytes());
    let s1 = xxh3::hash(&chained, 1337);
    assert_eq!(v["local_hashes"], serde_json::json!([l0 as i64, l1 as i64]));
    assert_eq!(
        v["sequence_hashes"],
        serde_json::json!([l0 as i64, s1 as i64])
    );
    // And the values Dynamo 1.6.1's own functions give (SPEC §2).
    assert_eq!(l0 as i64, -3803038269031200164);
    assert_eq!(s1 as i64, 4945711292740353085);
}

#[test]
fn hash_rejects_bad_input_with_one_line_and_exit_code_2() {
    for (args, stdin, needle) in [
        (vec!["hash", "--block-size", "4"], "[1, -2]", "token 1"),
        (
            vec!["hash", "--block-size", "4"],
            "[1, 4294967296]",
            "token 1",
        ),
        (
            vec!["hash", "--block-size", "4"],
            "{\"a\": 1}",
            "JSON array",
        ),
        (vec!["hash", "--block-size", "4"], "[1,", "not JSON"),
        (
            vec!["hash", "--block-size", "0"],
            "[1,2,3,4]",
            "--block-size",
        ),
    ] {
        let (code, out, err) = kvroute(&args, stdin);
        assert_eq!(code, 2, "{stdin}");
        assert!(out.is_empty());
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
}

/// `kvroute hash` against Dynamo 1.6.1's own hashes: a spread of the fixture cases (every
/// fourth), each with its LoRA name, salt, Eagle flag and multimodal infos.
#[test]
fn hash_equals_dynamo_with_lora_salt_eagle_and_multimodal_infos() {
    let fixtures: serde_json::Value = serde_json::from_str(include_str!(
        "../../core/tests/fixtures/dynamo_block_hashes.json"
    ))
    .expect("fixtures");
    let cases = fixtures["cases"].as_array().expect("cases");
    let mut flags_seen = [false; 2];
    for case in cases.iter().step_by(4) {
        let mut args = vec![
            "hash".to_string(),
            "--block-size".to_string(),
            case["block_size"].to_string(),
        ];
        for (flag, key) in [("--lora-name", "lora_name"), ("--cache-salt", "cache_salt")] {
            if let Some(value) = case[key].as_str() {
                args.push(format!("{flag}={value}"));
            }
        }
        if case["is_eagle"] == true {
            args.push("--eagle".to_string());
            flags_seen[0] = true;
        }
        if !case["block_mm_infos"].is_null() {
            args.push("--block-mm-infos".to_string());
            args.push(case["block_mm_infos"].to_string());
            flags_seen[1] = true;
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = kvroute(&args, &case["tokens"].to_string());
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
        let expected: Vec<i64> = case["hashes"]
            .as_array()
            .expect("hashes")
            .iter()
            .map(|h| h.as_u64().expect("u64") as i64)
            .collect();
        assert_eq!(v["local_hashes"], serde_json::json!(expected), "{args:?}");
    }
    assert_eq!(flags_seen, [true, true]);
    let (code, _, err) = kvroute(
        &[
            "hash",
            "--block-size",
            "1",
            "--block-mm-infos",
            r#"[{"mm_objects": [{"mm_hash": 5}]}]"#,
        ],
        "[1, 2]",
    );
    assert_eq!(code, 2);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("--block-mm-infos: missing field `offsets`"),
        "{err}"
    );
}

#[test]
fn serve_refuses_an_invalid_knob_naming_it() {
    let (code, _, err) = kvroute(&["serve", "--router-temperature=-1", "--port", "0"], "");
    assert_eq!(code, 2);
    assert!(err.contains("--router-temperature"), "{err}");
}

/// `kvroute serve` with `args`: `Ok(())` once it listens (then stopped), else its exit code
/// and stderr.
fn serve_starts(args: &[&str]) -> Result<(), (i32, String)> {
    use std::io::{BufRead, BufReader, Read};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--port", "0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("stdout");
    if line.starts_with("kvroute listening") {
        child.kill().expect("kill");
        child.wait().expect("exits");
        return Ok(());
    }
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    let code = child.wait().expect("exits").code().unwrap_or(-1);
    Err((code, err))
}

/// The command-line cases recorded from Dynamo's `--session-affinity-ttl-secs`: the values it
/// accepts start kvroute too; clap's refusals are word for word; the out-of-range values Dynamo
/// refuses with a Python exception (exit 1) kvroute refuses as any invalid knob (exit 2, the
/// same words after the flag's name); `--session-affinity-mode` is kvroute's own.
#[test]
fn serve_takes_the_session_affinity_ttl_values_dynamo_takes() {
    let fixtures: serde_json::Value = serde_json::from_str(include_str!(
        "../../service/tests/fixtures/dynamo/sessions.json"
    ))
    .expect("fixtures");
    let cases = fixtures["cli"].as_array().expect("cli cases");
    assert!(cases.len() >= 18);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        // `python -m dynamo.select_service --port 18082 ...`: the arguments after the port.
        let args: Vec<&str> = case["args"].as_array().expect("args")[5..]
            .iter()
            .map(|a| a.as_str().expect("arg"))
            .collect();
        let outcome = serve_starts(&args);
        match (name, case["started"].as_bool(), &outcome) {
            ("session_mode_flag", _, _) => assert_eq!(outcome, Ok(()), "kvroute's own flag"),
            (_, Some(true), _) => assert_eq!(outcome, Ok(()), "{name}"),
            (_, _, Ok(())) => panic!("{name}: started, Dynamo refused {args:?}"),
            (_, _, Err((code, err))) => {
                assert_eq!(*code, 2, "{name}: {err}");
                if let Some(exception) = case["exception"].as_str() {
                    let words =
                        exception.trim_start_matches("Exception: session_affinity_ttl_secs");
                    let ours = format!("kvroute serve: --session-affinity-ttl-secs{words}");
                    assert!(err.starts_with(&ours), "{name}: {err}");
                } else {
                    let theirs = case["stderr"].as_str().expect("stderr");
                    let first = |t: &str| t.lines().next().unwrap_or("").to_string();
                    assert_eq!(first(err), first(theirs), "{name}");
                }
            }
        }
    }
}

/// One flag of `kvroute serve --help`: its environment variable and its default, if shown.
#[derive(Debug, PartialEq)]
struct Knob {
    env: String,
    default: Option<String>,
}

fn help_knobs(help: &str) -> std::collections::BTreeMap<String, Knob> {
    let mut knobs = std::collections::BTreeMap::new();
    let mut current: Option<(String, Knob)> = None;
    for line in help.lines().map(str::trim) {
        if let Some(flag) = line.strip_prefix("--") {
            let name = flag.split_whitespace().next().unwrap_or_default();
            if let Some((name, knob)) = current.take() {
                knobs.insert(name, knob);
            }
            if name != "help" {
                let knob = Knob {
                    env: String::new(),
                    default: None,
                };
                current = Some((format!("--{name}"), knob));
            }
        } else if let Some((_, knob)) = current.as_mut() {
            if let Some(env) = line.strip_prefix("[env: ") {
                knob.env = env.split('=').next().unwrap_or_default().to_string();
            } else if let Some(default) = line.strip_prefix("[default: ") {
                knob.default = Some(default.trim_end_matches(']').to_string());
            }
        }
    }
    knobs.extend(current);
    knobs
}

/// The rows of the configuration table (docs/configuration.md): flag → (variable, default cell).
fn readme_knobs(readme: &str) -> std::collections::BTreeMap<String, (String, String)> {
    let section = readme
        .split("\n## Configuration\n")
        .nth(1)
        .expect("a Configuration section")
        .split("\n## ")
        .next()
        .unwrap_or_default();
    let code = |cell: &str| cell.trim().trim_matches('`').to_string();
    section
        .lines()
        .filter(|line| line.starts_with("| `--"))
        .map(|line| {
            let cells: Vec<&str> = line.split(" | ").collect();
            assert!(cells.len() >= 4, "a row of four cells: {line}");
            let flag = code(cells[0].trim_start_matches('|'));
            (flag, (code(cells[1]), cells[2].trim().to_string()))
        })
        .collect()
}

#[test]
fn the_readme_configuration_table_matches_serve_help() {
    let (code, help, _) = kvroute(&["serve", "--help"], "");
    assert_eq!(code, 0);
    let knobs = help_knobs(&help);
    let readme = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/configuration.md"
    ))
    .expect("docs/configuration.md");
    let rows = readme_knobs(&readme);
    assert!(knobs.len() > 30, "{knobs:?}");
    let flags: Vec<&String> = knobs.keys().collect();
    assert_eq!(flags, rows.keys().collect::<Vec<_>>(), "the same flags");
    for (flag, knob) in &knobs {
        let (env, default) = &rows[flag];
        assert_eq!(&knob.env, env, "{flag}'s variable");
        // A default `--help` shows is the first code span of the table's cell.
        if let Some(shown) = &knob.default {
            let cell = default.split('`').nth(1).unwrap_or_default();
            assert_eq!(
                cell, shown,
                "{flag}'s default: docs/configuration.md says {default}"
            );
        }
    }
    for flag in [
        "--header-read-timeout-ms",
        "--body-read-timeout-ms",
        "--idle-timeout-secs",
        "--max-connections",
    ] {
        assert!(knobs.contains_key(flag), "{flag}");
    }
}

/// `kvroute fake-engine --openai` serves one completion over HTTP, then stops on SIGTERM.
#[test]
fn fake_engine_openai_serves_a_completion_and_stops_on_sigterm() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::time::{Duration, Instant};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["fake-engine", "--openai", "--port", "0"])
        .args(["--bind", "tcp://127.0.0.1:0", "--time-scale", "0.01"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("runs");
    let stdout = child.stdout.take().expect("stdout");
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let banner = lines
        .recv_timeout(Duration::from_secs(20))
        .expect("the engine says where it listens");
    assert!(banner.contains("(OpenAI routes)"), "{banner}");
    assert!(banner.contains("KV events on tcp://127.0.0.1:"), "{banner}");
    let addr = banner
        .split_whitespace()
        .find_map(|word| word.strip_prefix("http://"))
        .expect("an http address");

    let body = r#"{"model": "default", "prompt": "Hello, engine.", "max_tokens": 4}"#;
    let mut stream = std::net::TcpStream::connect(addr).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("sends");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("reads");
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    let json = &response[response.find("\r\n\r\n").expect("a body") + 4..];
    let answer: serde_json::Value = serde_json::from_str(json).expect("JSON");
    assert_eq!(answer["object"], "text_completion");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    assert_eq!(answer["usage"]["prompt_tokens"], 14);
    assert_eq!(answer["usage"]["completion_tokens"], 4);

    let terminated = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(terminated.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waits") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running 20 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    assert_eq!(
        lines.recv_timeout(Duration::from_secs(5)).as_deref(),
        Ok("kvroute fake-engine stopped")
    );
}

#[test]
fn gateway_refuses_an_invalid_flag_naming_it() {
    let (code, _, err) = kvroute(&["gateway", "--port", "0", "--worker", "ftp://x"], "");
    assert_eq!(code, 2);
    assert!(err.contains("--worker ftp://x"), "{err}");
    let (code, _, err) = kvroute(&["gateway", "--port", "0", "--router-temperature=-1"], "");
    assert_eq!(code, 2, "every serve flag is checked as serve checks it");
    assert!(err.contains("--router-temperature"), "{err}");
}

/// A child's stdout lines, read on a thread.
fn stdout_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let stdout = child.stdout.take().expect("stdout");
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// Kills a child when dropped, so a failed assertion leaves no process behind.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn gateway_serves_a_completion_from_a_mock_engine() {
    use std::io::{Read, Write};
    use std::time::Duration;
    let mut engine = Running(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["fake-engine", "--openai", "--port", "0"])
            .args(["--bind", "tcp://127.0.0.1:0", "--time-scale", "0.01"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("runs"),
    );
    let banner = stdout_lines(&mut engine.0)
        .recv_timeout(Duration::from_secs(20))
        .expect("the engine says where it listens");
    let url = banner
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .expect("an http address");
    let events = banner
        .split_whitespace()
        .find(|w| w.starts_with("tcp://"))
        .expect("an events address");
    let worker = format!("{url}={events}");
    let mut gateway = Running(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args([
                "gateway",
                "--port",
                "0",
                "--tokenize",
                "remote",
                "--worker",
                &worker,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("runs"),
    );
    let banner = stdout_lines(&mut gateway.0)
        .recv_timeout(Duration::from_secs(20))
        .expect("the gateway says where it listens");
    let addr = banner
        .strip_prefix("kvroute gateway listening on http://")
        .expect("the banner")
        .to_string();
    let body = r#"{"model": "default", "prompt": "Hello, gateway.", "max_tokens": 4}"#;
    let mut stream = std::net::TcpStream::connect(&addr).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("sends");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("reads");
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    assert!(response.contains("x-kvroute-worker-id: "), "{response}");
    let json = &response[response.find("\r\n\r\n").expect("a body") + 4..];
    let answer: serde_json::Value = serde_json::from_str(json).expect("JSON");
    assert_eq!(answer["usage"]["prompt_tokens"], 15);
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    let terminated = Command::new("kill")
        .args(["-TERM", &gateway.0.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(terminated.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while gateway.0.try_wait().expect("waits").is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "still running after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
