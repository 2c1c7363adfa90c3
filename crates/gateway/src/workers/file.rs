//! The workers file: parsed, applied as a diff, and watched.

use super::entry::{WorkerEntry, check_events, check_url, register, worker_id_for};
use crate::booking::ServiceLink;
use crate::health::HealthHandle;
use kvroute_core::selector::WorkerRole;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
