//! Workers from flags and from the workers file, registered in the selector's catalog like a
//! `POST /workers` (which also works on the gateway's port: the catalog's `endpoint` is the
//! URL the gateway sends a worker's requests to).
//!
//! A worker's id is given in the file or derived from its URL (53 bits of its xxh3, so that
//! JavaScript clients read it exactly), so the same worker keeps its id across reloads and
//! restarts, and a re-registration keeps its bookings.
//!
//! The workers file:
//!
//! ```toml
//! # Defaults for the workers below (else --model, --block-size, --max-num-batched-tokens).
//! model = "llama"
//! block_size = 16
//! max_num_batched_tokens = 8192      # optional: the engines' prefill budget per step
//!
//! [[workers]]
//! url = "http://10.0.0.1:8000"
//! kv_events = "tcp://10.0.0.1:5557"   # optional: the engine's KV-event publisher
//!
//! [[workers]]
//! url = "http://10.0.0.2:8000"
//! model = "qwen"                       # optional, per worker
//! worker_id = 7                        # optional
//!
//! [[workers]]
//! url = "http://10.0.0.3:8000"
//! role = "prefill"                     # optional: both (default), prefill or decode
//! bootstrap_port = 8998                # optional: an SGLang prefill worker's bootstrap server
//! ```
//!
//! The file is read at start (an error stops the gateway) and polled every
//! `--workers-file-poll-ms` after: a change upserts what changed and deletes what it no
//! longer lists; a broken file keeps the workers as they were.

use crate::booking::ServiceLink;
use crate::health::HealthHandle;
use kvroute_core::selector::WorkerRole;
use kvroute_service::types::{RoleBody, WorkerBody};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One worker to register.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEntry {
    pub worker_id: u64,
    pub url: String,
    pub kv_events: Option<String>,
    pub model: String,
    pub block_size: u32,
    /// The engine's `--max-num-batched-tokens` (the admission queue's capacity; required with
    /// `--queue-threshold`).
    pub max_num_batched_tokens: Option<u64>,
    /// Its part in disaggregated serving (`--prefill`, `--decode`, the file's `role`).
    pub role: WorkerRole,
    /// An SGLang prefill worker's bootstrap server port.
    pub bootstrap_port: Option<u16>,
}

impl WorkerEntry {
    pub fn body(&self) -> WorkerBody {
        WorkerBody {
            worker_id: Some(self.worker_id),
            model_name: Some(self.model.clone()),
            endpoint: Some(self.url.clone()),
            block_size: Some(self.block_size),
            kv_events_endpoint: self.kv_events.clone(),
            max_num_batched_tokens: self.max_num_batched_tokens,
            role: Some(match self.role {
                WorkerRole::Both => RoleBody::Both,
                WorkerRole::Prefill => RoleBody::Prefill,
                WorkerRole::Decode => RoleBody::Decode,
            }),
            bootstrap_port: self.bootstrap_port,
            ..WorkerBody::default()
        }
    }
}

/// A worker id from its URL: stable, and at most 2^53 − 1.
pub fn worker_id_for(url: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(url.as_bytes()) & ((1 << 53) - 1)
}

/// A worker's base URL: `http://host[:port][/prefix]`, without a trailing `/`.
pub fn check_url(url: &str) -> Result<String, String> {
    let trimmed = url.trim_end_matches('/');
    let Some(rest) = trimmed.strip_prefix("http://") else {
        return Err(format!(
            "a worker URL must start with http:// (got `{url}`)"
        ));
    };
    if rest.is_empty() || rest.starts_with('/') {
        return Err(format!("a worker URL needs a host (got `{url}`)"));
    }
    trimmed
        .parse::<axum::http::Uri>()
        .map_err(|e| format!("invalid worker URL `{url}`: {e}"))?;
    Ok(trimmed.to_string())
}

fn check_events(endpoint: &str) -> Result<String, String> {
    if endpoint.starts_with("tcp://") && endpoint.len() > "tcp://".len() {
        Ok(endpoint.to_string())
    } else {
        Err(format!(
            "a KV-event endpoint must be tcp://HOST:PORT (got `{endpoint}`)"
        ))
    }
}

/// `--worker URL` or `--worker URL=tcp://HOST:PORT`.
pub fn parse_worker_flag(raw: &str, model: &str, block_size: u32) -> Result<WorkerEntry, String> {
    let (url, kv_events) = match raw.split_once("=tcp://") {
        Some((url, rest)) => (url, Some(check_events(&format!("tcp://{rest}"))?)),
        None => (raw, None),
    };
    let url = check_url(url)?;
    Ok(WorkerEntry {
        worker_id: worker_id_for(&url),
        url,
        kv_events,
        model: model.to_string(),
        block_size,
        max_num_batched_tokens: None,
        role: WorkerRole::Both,
        bootstrap_port: None,
    })
}

/// `--prefill` / `--decode`: `--worker`'s syntax, then `@PORT` for an SGLang prefill worker's
/// bootstrap port (`URL[=tcp://HOST:PORT][@BOOTSTRAP_PORT]`).
pub fn parse_role_flag(
    raw: &str,
    role: WorkerRole,
    model: &str,
    block_size: u32,
) -> Result<WorkerEntry, String> {
    let (rest, bootstrap_port) = match raw.rsplit_once('@') {
        Some((rest, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            let port =
                port.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| {
                    format!("bootstrap port `{port}` is not a port from 1 to 65535")
                })?;
            (rest, Some(port))
        }
        _ => (raw, None),
    };
    if bootstrap_port.is_some() && role != WorkerRole::Prefill {
        return Err("only a prefill worker has a bootstrap port (`@PORT`)".to_string());
    }
    Ok(WorkerEntry {
        role,
        bootstrap_port,
        ..parse_worker_flag(rest, model, block_size)?
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkersFile {
    model: Option<String>,
    block_size: Option<u32>,
    max_num_batched_tokens: Option<u64>,
    #[serde(default)]
    workers: Vec<FileWorker>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileWorker {
    url: String,
    kv_events: Option<String>,
    model: Option<String>,
    block_size: Option<u32>,
    max_num_batched_tokens: Option<u64>,
    worker_id: Option<u64>,
    role: Option<String>,
    bootstrap_port: Option<u16>,
}

/// Parses a workers file; `model`, `block_size` and `max_num_batched_tokens` default to the
/// flags'.
pub fn parse_workers_file(
    text: &str,
    default_model: &str,
    default_block_size: u32,
    default_max_num_batched_tokens: Option<u64>,
) -> Result<Vec<WorkerEntry>, String> {
    let file: WorkersFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let max_num_batched_tokens = file
        .max_num_batched_tokens
        .or(default_max_num_batched_tokens);
    let model = file.model.unwrap_or_else(|| default_model.to_string());
    let block_size = file.block_size.unwrap_or(default_block_size);
    let mut seen = BTreeMap::new();
    file.workers
        .into_iter()
        .enumerate()
        .map(|(i, w)| {
            let at = |e: String| format!("workers[{i}]: {e}");
            let url = check_url(&w.url).map_err(at)?;
            let kv_events = w
                .kv_events
                .as_deref()
                .map(check_events)
                .transpose()
                .map_err(at)?;
            let role = match w.role.as_deref() {
                Some(role) => role.parse::<WorkerRole>().map_err(at)?,
                None => WorkerRole::Both,
            };
            if w.bootstrap_port.is_some() && role != WorkerRole::Prefill {
                return Err(at("bootstrap_port is for prefill workers only".to_string()));
            }
            let entry = WorkerEntry {
                worker_id: w.worker_id.unwrap_or_else(|| worker_id_for(&url)),
                url,
                kv_events,
                model: w.model.unwrap_or_else(|| model.clone()),
                block_size: w.block_size.unwrap_or(block_size),
                max_num_batched_tokens: w.max_num_batched_tokens.or(max_num_batched_tokens),
                role,
                bootstrap_port: w.bootstrap_port,
            };
            if entry.block_size == 0 {
                return Err(at("block_size must be at least 1".to_string()));
            }
            if let Some(other) = seen.insert(entry.worker_id, i) {
                return Err(at(format!(
                    "worker_id {} is also workers[{other}]'s",
                    entry.worker_id
                )));
            }
            Ok(entry)
        })
        .collect()
}

/// Registers (or re-registers) workers in the catalog.
pub fn register(link: &ServiceLink, workers: &[WorkerEntry]) -> Result<(), String> {
    for worker in workers {
        link.upsert_worker(worker.body())
            .map_err(|e| format!("worker {}: {e}", worker.url))?;
    }
    Ok(())
}

/// What a workers file's entries default to (the flags').
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDefaults {
    pub model: String,
    pub block_size: u32,
    pub max_num_batched_tokens: Option<u64>,
}

/// The workers file as last applied: what a reload compares against.
#[derive(Debug, Default)]
pub struct FileWorkers {
    text: Option<String>,
    applied: BTreeMap<u64, WorkerEntry>,
}

/// What a reload did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReloadOutcome {
    pub upserted: usize,
    pub deleted: Vec<u64>,
}

impl FileWorkers {
    /// Applies the file's text when it changed: upserts the workers that are new or changed,
    /// deletes those it no longer lists (only ones it had added). On a parse error nothing
    /// changes and the error is returned (once per distinct text).
    pub fn apply(
        &mut self,
        link: &ServiceLink,
        text: &str,
        defaults: &FileDefaults,
    ) -> Result<Option<ReloadOutcome>, String> {
        if self.text.as_deref() == Some(text) {
            return Ok(None);
        }
        self.text = Some(text.to_string());
        let wanted = parse_workers_file(
            text,
            &defaults.model,
            defaults.block_size,
            defaults.max_num_batched_tokens,
        )?;
        let mut outcome = ReloadOutcome::default();
        let mut next = BTreeMap::new();
        for worker in wanted {
            if self.applied.get(&worker.worker_id) != Some(&worker) {
                register(link, std::slice::from_ref(&worker))?;
                outcome.upserted += 1;
            }
            next.insert(worker.worker_id, worker);
        }
        for (&id, _) in self.applied.iter().filter(|(id, _)| !next.contains_key(id)) {
            if let Err(e) = link.delete_worker(id) {
                tracing::debug!(worker_id = id, error = %e, "worker already gone");
            }
            outcome.deleted.push(id);
        }
        self.applied = next;
        Ok(Some(outcome))
    }

    /// Reads and applies the file at start; the error names the file.
    pub fn load(path: &Path, link: &ServiceLink, defaults: &FileDefaults) -> Result<Self, String> {
        let mut file = Self::default();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--workers-file {}: {e}", path.display()))?;
        file.apply(link, &text, defaults)
            .map_err(|e| format!("--workers-file {}: {e}", path.display()))?;
        Ok(file)
    }

    /// Polls the file every `poll` and applies its changes, until the service shuts down; the
    /// breakers of deleted workers are forgotten.
    pub async fn watch(
        mut self,
        path: PathBuf,
        poll: Duration,
        defaults: FileDefaults,
        link: ServiceLink,
        health: HealthHandle,
    ) {
        let mut tick = tokio::time::interval(poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !link.is_shutting_down() {
            tick.tick().await;
            let text = match tokio::fs::read_to_string(&path).await {
                Ok(text) => text,
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "workers file unreadable");
                    continue;
                }
            };
            match self.apply(&link, &text, &defaults) {
                Ok(Some(outcome)) => {
                    for id in &outcome.deleted {
                        health.forget(*id);
                    }
                    tracing::info!(path = %path.display(), upserted = outcome.upserted,
                        deleted = outcome.deleted.len(), "workers file reloaded");
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e,
                        "workers file not reloaded: keeping the workers as they were");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_name_a_url_and_maybe_an_event_endpoint() {
        let w = parse_worker_flag("http://127.0.0.1:8001/", "m", 16).unwrap();
        assert_eq!(w.url, "http://127.0.0.1:8001");
        assert_eq!(w.worker_id, worker_id_for("http://127.0.0.1:8001"));
        assert!(w.worker_id < 1 << 53);
        let w = parse_worker_flag("http://h:1=tcp://h:5557", "m", 16).unwrap();
        assert_eq!(w.kv_events.as_deref(), Some("tcp://h:5557"));
        assert!(parse_worker_flag("https://h", "m", 16).is_err());
        assert!(parse_worker_flag("http://", "m", 16).is_err());
        assert!(parse_worker_flag("http://h:1=tcp://", "m", 16).is_err());
    }

    #[test]
    fn role_flags_take_a_bootstrap_port_after_an_at() {
        let w =
            parse_role_flag("http://h:1=tcp://h:5557@8998", WorkerRole::Prefill, "m", 16).unwrap();
        assert_eq!(
            (w.url.as_str(), w.kv_events.as_deref(), w.bootstrap_port),
            ("http://h:1", Some("tcp://h:5557"), Some(8998))
        );
        assert_eq!(w.role, WorkerRole::Prefill);
        assert_eq!(w.worker_id, worker_id_for("http://h:1"));
        let w = parse_role_flag("http://h:2@9000", WorkerRole::Prefill, "m", 16).unwrap();
        assert_eq!((w.kv_events, w.bootstrap_port), (None, Some(9000)));
        let w = parse_role_flag("http://h:2", WorkerRole::Decode, "m", 16).unwrap();
        assert_eq!((w.role, w.bootstrap_port), (WorkerRole::Decode, None));
        assert!(parse_role_flag("http://h:2@9000", WorkerRole::Decode, "m", 16).is_err());
        assert!(parse_role_flag("http://h:2@70000", WorkerRole::Prefill, "m", 16).is_err());
    }

    #[test]
    fn the_file_gives_defaults_and_refuses_mistakes() {
        let text = r#"
            model = "llama"
            [[workers]]
            url = "http://a:1"
            kv_events = "tcp://a:5557"
            [[workers]]
            url = "http://b:1"
            model = "qwen"
            block_size = 32
            worker_id = 7
        "#;
        let workers = parse_workers_file(text, "default", 16, None).unwrap();
        assert_eq!(workers[0].model, "llama");
        assert_eq!(workers[0].block_size, 16);
        assert_eq!(workers[1].worker_id, 7);
        assert_eq!(
            (workers[1].model.as_str(), workers[1].block_size),
            ("qwen", 32)
        );
        assert!(parse_workers_file("[[workers]]\nurl = 3", "m", 1, None).is_err());
        assert!(
            parse_workers_file("[[workers]]\nurl = \"http://a\"\nport = 1", "m", 1, None)
                .unwrap_err()
                .contains("port")
        );
        let twice = "[[workers]]\nurl = \"http://a\"\n[[workers]]\nurl = \"http://a/\"";
        assert!(
            parse_workers_file(twice, "m", 1, None)
                .unwrap_err()
                .contains("workers[1]")
        );
        assert!(parse_workers_file("", "m", 1, None).unwrap().is_empty());
        let roles = "[[workers]]\nurl = \"http://a\"\nrole = \"prefill\"\nbootstrap_port = 8998\n\
                     [[workers]]\nurl = \"http://b\"\nrole = \"decode\"";
        let workers = parse_workers_file(roles, "m", 16, None).unwrap();
        assert_eq!(
            (workers[0].role, workers[0].bootstrap_port),
            (WorkerRole::Prefill, Some(8998))
        );
        assert_eq!(workers[1].role, WorkerRole::Decode);
        let bad_role = "[[workers]]\nurl = \"http://a\"\nrole = \"prefil\"";
        assert!(
            parse_workers_file(bad_role, "m", 16, None)
                .unwrap_err()
                .contains("role")
        );
        let port_on_decode =
            "[[workers]]\nurl = \"http://a\"\nrole = \"decode\"\nbootstrap_port = 1";
        assert!(parse_workers_file(port_on_decode, "m", 16, None).is_err());
    }
}
