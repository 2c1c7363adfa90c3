//! A worker to register: its entry, its id, its `--worker`/`--prefill`/`--decode` flags.

use crate::booking::ServiceLink;
use kvroute_core::selector::WorkerRole;
use kvroute_service::types::{RoleBody, WorkerBody};

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

pub(super) fn check_events(endpoint: &str) -> Result<String, String> {
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

/// Registers (or re-registers) workers in the catalog.
pub fn register(link: &ServiceLink, workers: &[WorkerEntry]) -> Result<(), String> {
    for worker in workers {
        link.upsert_worker(worker.body())
            .map_err(|e| format!("worker {}: {e}", worker.url))?;
    }
    Ok(())
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
}
