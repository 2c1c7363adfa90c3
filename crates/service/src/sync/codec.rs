//! What replicas exchange over NATS: KV keys and compact JSON messages, each with a format
//! version, the publishing replica, its per-replica sequence number and the publish time (for
//! the lag metric). Pure: no I/O, unit-tested here.

use kvroute_core::error::PartitionKey;
use kvroute_core::event::{KvEvent, StoredBlock, Tier, WorkerId};
use kvroute_core::selector::{SessionKey, SyncedBooking};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// The message format; a replica drops messages of another version (counted as `malformed`).
pub const VERSION: u32 = 1;

/// Longest replica id (it is a NATS subject token and part of every booking key).
pub const MAX_REPLICA_ID_BYTES: usize = 64;

/// Checks a replica id: 1 to 64 of `[A-Za-z0-9_-]` (a NATS key/subject token).
pub fn check_replica_id(id: &str) -> Result<(), String> {
    let valid_chars = id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if id.is_empty() || id.len() > MAX_REPLICA_ID_BYTES || !valid_chars {
        return Err(format!(
            "--replica-id must be 1 to {MAX_REPLICA_ID_BYTES} characters of A-Z a-z 0-9 _ - (got `{id}`)"
        ));
    }
    Ok(())
}

/// Microseconds since the Unix epoch, now.
pub fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Seconds from a publish time (Unix µs) until now; 0 when the clocks disagree.
pub fn lag_secs(published_us: u64) -> f64 {
    unix_micros().saturating_sub(published_us) as f64 / 1e6
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| {
        char::from(c)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    text.as_bytes()
        .chunks(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(*pair.get(1)?)?))
        .collect()
}

/// The KV-key token of a partition: `p{hex(model)}_{hex(group)}` (keys allow `[-/_=.A-Za-z0-9]`).
pub fn partition_token(partition: &PartitionKey) -> String {
    format!(
        "p{}_{}",
        hex(partition.model_name.as_bytes()),
        hex(partition.routing_group.as_bytes())
    )
}

/// The partition of a [`partition_token`].
fn parse_partition_token(token: &str) -> Option<PartitionKey> {
    let (model, group) = token.strip_prefix('p')?.split_once('_')?;
    Some(PartitionKey::new(
        String::from_utf8(unhex(model)?).ok()?,
        String::from_utf8(unhex(group)?).ok()?,
    ))
}

/// The key of a session's binding in the sessions bucket: `{partition}.s{hex(session id)}`.
/// One key per session, whichever replica bound it: the last binding wins.
pub fn session_key(key: &SessionKey) -> String {
    format!(
        "{}.s{}",
        partition_token(&key.partition),
        hex(key.session_id.as_bytes())
    )
}

/// The session of a sessions-bucket key.
pub fn parse_session_key(key: &str) -> Option<SessionKey> {
    let (partition, session) = key.split_once('.')?;
    let session_id = String::from_utf8(unhex(session.strip_prefix('s')?)?).ok()?;
    Some(SessionKey {
        partition: parse_partition_token(partition)?,
        session_id,
    })
}

/// The key of a booking in the bookings bucket: `{partition}.{replica}.r{hex(id)}`, so a
/// replica could watch only its partitions (`{partition}.>`).
pub fn booking_key(partition: &PartitionKey, replica: &str, reservation_id: &str) -> String {
    format!(
        "{}.{replica}.r{}",
        partition_token(partition),
        hex(reservation_id.as_bytes())
    )
}

/// `(replica, reservation id)` of a booking key.
pub fn parse_booking_key(key: &str) -> Option<(&str, String)> {
    let mut parts = key.split('.');
    let (_partition, replica, id) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || check_replica_id(replica).is_err() {
        return None;
    }
    let id = String::from_utf8(unhex(id.strip_prefix('r')?)?).ok()?;
    Some((replica, id))
}

/// The key of a worker in the catalog bucket.
pub fn worker_key(worker_id: WorkerId) -> String {
    format!("w{worker_id}")
}

pub fn parse_worker_key(key: &str) -> Option<WorkerId> {
    key.strip_prefix('w')?.parse().ok()
}

/// Every message's header fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// Format version ([`VERSION`]).
    pub v: u32,
    pub replica: String,
    /// Per-replica sequence number (diagnostics; the KV revision orders a key's updates).
    pub seq: u64,
    /// Publish time, Unix microseconds.
    pub ts_us: u64,
}

impl Origin {
    pub fn new(replica: &str, seq: u64) -> Self {
        Self {
            v: VERSION,
            replica: replica.to_string(),
            seq,
            ts_us: unix_micros(),
        }
    }
}

/// A booking's state (the value under its key; a freed booking's key is deleted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookingMessage {
    #[serde(flatten)]
    pub origin: Origin,
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub block_size: u32,
    pub sequence_hashes: Vec<u64>,
    pub isl_tokens: u64,
    pub effective_prefill_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_output_tokens: Option<u64>,
    pub track_prefill_tokens: bool,
    pub prefill_complete: bool,
    pub output_blocks: u64,
    pub decode_blocks: u64,
    /// The session the booking holds (session affinity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
}

impl BookingMessage {
    pub fn new(origin: Origin, state: &SyncedBooking) -> Self {
        Self {
            origin,
            worker_id: state.worker_id,
            dp_rank: state.dp_rank,
            block_size: state.block_size,
            sequence_hashes: state.sequence_hashes.to_vec(),
            isl_tokens: state.isl_tokens,
            effective_prefill_tokens: state.effective_prefill_tokens,
            expected_output_tokens: state.expected_output_tokens,
            track_prefill_tokens: state.track_prefill_tokens,
            prefill_complete: state.prefill_complete,
            output_blocks: state.output_blocks,
            decode_blocks: state.decode_blocks,
            session_id: state.session_id.clone(),
        }
    }

    pub fn state(&self) -> SyncedBooking {
        SyncedBooking {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            block_size: self.block_size,
            sequence_hashes: Arc::from(self.sequence_hashes.as_slice()),
            isl_tokens: self.isl_tokens,
            effective_prefill_tokens: self.effective_prefill_tokens,
            expected_output_tokens: self.expected_output_tokens,
            track_prefill_tokens: self.track_prefill_tokens,
            prefill_complete: self.prefill_complete,
            output_blocks: self.output_blocks,
            decode_blocks: self.decode_blocks,
            session_id: self.session_id.clone(),
        }
    }
}

/// A session's binding (the value under its key; a dropped binding's key is deleted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionMessage {
    #[serde(flatten)]
    pub origin: Origin,
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    /// Until when (Unix µs) the binding lives unless a booking holds it; absent when the
    /// publisher's own booking held it (the booking itself travels in the bookings bucket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_until_us: Option<u64>,
    /// The publisher dropped the binding (a refused booking): a tombstone rather than a deleted
    /// key, so that the publisher can tell its own drop from another replica's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dropped: bool,
}

/// A worker's catalog entry: the record as `GET /workers` shows it, and which replica wrote it
/// (with `--nats-relay-events`, that replica consumes the worker's KV events).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CatalogMessage {
    #[serde(flatten)]
    pub origin: Origin,
    pub worker: serde_json::Value,
}

/// One decoded event, as relayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventMessage {
    /// `[engine hash, local hash]` pairs.
    Stored {
        parent: Option<u64>,
        blocks: Vec<[u64; 2]>,
        tier: u8,
    },
    Removed {
        hashes: Vec<u64>,
        tier: u8,
    },
    Cleared,
}

fn tier_code(tier: Tier) -> u8 {
    match tier {
        Tier::Device => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
    }
}

fn tier_of(code: u8) -> Option<Tier> {
    match code {
        0 => Some(Tier::Device),
        1 => Some(Tier::Host),
        2 => Some(Tier::Disk),
        _ => None,
    }
}

impl EventMessage {
    pub fn new(event: &KvEvent) -> Self {
        match event {
            KvEvent::Stored {
                parent,
                blocks,
                tier,
            } => EventMessage::Stored {
                parent: *parent,
                blocks: blocks
                    .iter()
                    .map(|b| [b.engine_hash, b.local_hash])
                    .collect(),
                tier: tier_code(*tier),
            },
            KvEvent::Removed {
                engine_hashes,
                tier,
            } => EventMessage::Removed {
                hashes: engine_hashes.clone(),
                tier: tier_code(*tier),
            },
            KvEvent::Cleared => EventMessage::Cleared,
        }
    }

    /// The event; `None` for an unknown tier.
    pub fn event(&self) -> Option<KvEvent> {
        Some(match self {
            EventMessage::Stored {
                parent,
                blocks,
                tier,
            } => KvEvent::Stored {
                parent: *parent,
                blocks: blocks
                    .iter()
                    .map(|&[engine_hash, local_hash]| StoredBlock {
                        engine_hash,
                        local_hash,
                    })
                    .collect(),
                tier: tier_of(*tier)?,
            },
            EventMessage::Removed { hashes, tier } => KvEvent::Removed {
                engine_hashes: hashes.clone(),
                tier: tier_of(*tier)?,
            },
            EventMessage::Cleared => KvEvent::Cleared,
        })
    }
}

/// A batch of one rank's events, relayed on `{prefix}.events.{replica}.{worker}.{rank}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsMessage {
    #[serde(flatten)]
    pub origin: Origin,
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub events: Vec<EventMessage>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booking_keys_round_trip_any_id() {
        let partition = PartitionKey::new("llama 3.1", "");
        for id in ["a", "req-1", "with.dots and spaces/é", ""] {
            let key = booking_key(&partition, "replica-1", id);
            assert!(
                key.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-/_=.".contains(&b))
            );
            assert_eq!(parse_booking_key(&key), Some(("replica-1", id.to_string())));
        }
        assert_eq!(parse_booking_key("p_.r1.rzz"), None);
        for id in ["", "s", "with.dots and spaces/é"] {
            let session = SessionKey::new(&partition, id);
            let key = session_key(&session);
            assert!(
                key.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-/_=.".contains(&b))
            );
            assert_eq!(parse_session_key(&key), Some(session));
        }
        assert_eq!(parse_session_key("p_.szz"), None);
        assert_eq!(parse_session_key("nope"), None);
        assert_eq!(parse_booking_key("p_.bad*replica.r61"), None);
        assert_eq!(parse_worker_key(&worker_key(42)), Some(42));
    }

    #[test]
    fn replica_ids_are_subject_tokens() {
        assert!(check_replica_id("replica-A_1").is_ok());
        for bad in ["", "a.b", "a b", "*", &"x".repeat(65)] {
            assert!(check_replica_id(bad).unwrap_err().contains("--replica-id"));
        }
    }

    /// A worker as the catalog bucket carries it (its record's JSON, read back as a `POST
    /// /workers` body) is the same worker on the other replica: routing constraints included.
    #[test]
    fn catalog_entries_carry_the_whole_worker() {
        use crate::types::{WorkerBody, worker_json};
        use kvroute_core::selector::{KvTransferEnforcement, Lifecycle, WorkerRecord, WorkerSpec};
        let spec = WorkerSpec {
            worker_id: 5,
            model_name: "m".into(),
            routing_group: "g".into(),
            endpoint: Some("http://w5".into()),
            block_size: Some(16),
            data_parallel_size: Some(2),
            kv_events_endpoints: [(0, "tcp://h:1".into()), (1, "tcp://h:2".into())].into(),
            taints: ["gpu=h100".to_string(), "a".to_string()].into(),
            topology_domains: [("zone".to_string(), "a".to_string())].into(),
            kv_transfer_domain: Some("zone".into()),
            kv_transfer_enforcement: Some(KvTransferEnforcement::Preferred),
            kv_transfer_preferred_weight: Some(0.85),
            ..WorkerSpec::default()
        };
        let record = WorkerRecord {
            spec: spec.clone(),
            lifecycle: Lifecycle::Schedulable,
            not_schedulable_reasons: Vec::new(),
        };
        let message = CatalogMessage {
            origin: Origin::new("r1", 1),
            worker: worker_json(&record),
        };
        let bytes = serde_json::to_vec(&message).unwrap();
        let back: CatalogMessage = serde_json::from_slice(&bytes).unwrap();
        let body: WorkerBody = serde_json::from_value(back.worker).unwrap();
        assert_eq!(body.into_spec().unwrap(), spec);
    }

    #[test]
    fn messages_round_trip() {
        let state = SyncedBooking {
            worker_id: 7,
            dp_rank: 1,
            block_size: 16,
            sequence_hashes: Arc::from(vec![u64::MAX, 3]),
            isl_tokens: 40,
            effective_prefill_tokens: 8,
            expected_output_tokens: Some(100),
            track_prefill_tokens: true,
            prefill_complete: true,
            output_blocks: 2,
            decode_blocks: 5,
            session_id: Some("s-1".into()),
        };
        let message = BookingMessage::new(Origin::new("r1", 9), &state);
        let bytes = serde_json::to_vec(&message).unwrap();
        let back: BookingMessage = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back.state(), state);
        assert_eq!(back.origin.replica, "r1");
        let events = vec![
            KvEvent::Stored {
                parent: Some(1),
                blocks: vec![StoredBlock {
                    engine_hash: 2,
                    local_hash: 3,
                }],
                tier: Tier::Host,
            },
            KvEvent::Removed {
                engine_hashes: vec![2],
                tier: Tier::Disk,
            },
            KvEvent::Cleared,
        ];
        let relayed: Vec<KvEvent> = events
            .iter()
            .map(EventMessage::new)
            .map(|m| serde_json::to_string(&m).unwrap())
            .map(|s| serde_json::from_str::<EventMessage>(&s).unwrap())
            .filter_map(|m| m.event())
            .collect();
        assert_eq!(relayed, events);
    }
}
