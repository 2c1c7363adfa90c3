//! The selector's request and reply types: what the edges build from a request body and turn
//! back into a response. Plain data; the behaviour lives in the sibling modules.

use super::constraints::RoutingConstraints;
use crate::approx::LruStats;
use crate::error::{Error, PartitionKey};
use crate::event::{KvEvent, Rank, WorkerId};
use crate::hash::{BlockExtras, PromptHashes, seed_for};
use crate::schedule::Overrides;
use crate::selector::sessions::{SessionKey, SessionSelection};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

// `PartialEq` only (no `Eq`): `kv_transfer_preferred_weight` is a float.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WorkerSpec {
    pub worker_id: WorkerId,
    pub model_name: String,
    pub routing_group: String,
    pub endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub total_kv_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub kv_events_endpoint: Option<String>,
    /// Global dp rank → ZMQ address.
    pub kv_events_endpoints: BTreeMap<u32, String>,
    pub replay_endpoint: Option<String>,
    /// Labels a request's [`RoutingConstraints`] match, as plain strings (a set).
    pub taints: BTreeSet<String>,
    /// Logical topology domain → this worker's value in it (`{"zone": "a"}`). Kept and echoed;
    /// as in Dynamo 1.6.1 they do not become taints and do not steer routing.
    pub topology_domains: BTreeMap<String, String>,
    /// Dynamo's KV-transfer policy for disaggregated prefill/decode: kept and echoed, not used
    /// (kvroute selects one worker per request; Dynamo 1.6.1's selection service does not apply
    /// them either).
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Option<KvTransferEnforcement>,
    pub kv_transfer_preferred_weight: Option<f32>,
    /// What the worker runs in a disaggregated fleet (SPEC §6.1): whole requests (`both`, the
    /// default), prefill legs or decode legs.
    pub role: WorkerRole,
    /// An SGLang prefill worker's bootstrap server port, handed to the caller with a prefill
    /// pick so it can tell the decode worker where to fetch the KV from.
    pub bootstrap_port: Option<u16>,
}

/// A worker's part in disaggregated prefill/decode (SPEC §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum WorkerRole {
    /// Runs whole requests, and decode legs.
    #[default]
    Both,
    /// Runs prefill legs only: never picked for a whole request.
    Prefill,
    /// Runs decode legs, and whole requests (a bypass, or a plain select).
    Decode,
}

impl WorkerRole {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Both => "both",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

impl std::str::FromStr for WorkerRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "both" => Ok(WorkerRole::Both),
            "prefill" => Ok(WorkerRole::Prefill),
            "decode" => Ok(WorkerRole::Decode),
            other => Err(format!(
                "role must be `both`, `prefill` or `decode`, not `{other}`"
            )),
        }
    }
}

/// Whether a KV transfer must stay within the worker's `kv_transfer_domain` or only prefers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvTransferEnforcement {
    Required,
    Preferred,
}

impl KvTransferEnforcement {
    pub fn as_str(self) -> &'static str {
        match self {
            KvTransferEnforcement::Required => "required",
            KvTransferEnforcement::Preferred => "preferred",
        }
    }
}

impl WorkerSpec {
    pub fn partition(&self) -> PartitionKey {
        PartitionKey::new(&self.model_name, &self.routing_group)
    }

    pub fn dp_start(&self) -> u32 {
        self.data_parallel_start_rank.unwrap_or(0)
    }

    pub fn dp_size(&self) -> u32 {
        self.data_parallel_size.unwrap_or(1)
    }

    /// The worker's dp ranks.
    pub fn dp_ranks(&self) -> std::ops::Range<u32> {
        let start = self.dp_start();
        start..start.saturating_add(self.dp_size())
    }

    /// The KV-event endpoint of each rank that publishes events.
    pub fn event_endpoints(&self) -> Vec<(u32, String)> {
        if !self.kv_events_endpoints.is_empty() {
            return self
                .kv_events_endpoints
                .iter()
                .map(|(&r, a)| (r, a.clone()))
                .collect();
        }
        match &self.kv_events_endpoint {
            Some(addr) if !addr.is_empty() => vec![(self.dp_start(), addr.clone())],
            _ => Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    Schedulable,
    Incomplete,
    Unschedulable,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Schedulable => "schedulable",
            Lifecycle::Incomplete => "incomplete",
            Lifecycle::Unschedulable => "unschedulable",
        }
    }
}

/// A catalog record: the spec plus whether the worker can take work, and why not.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerRecord {
    pub spec: WorkerSpec,
    pub lifecycle: Lifecycle,
    pub not_schedulable_reasons: Vec<String>,
}

/// What an upsert changed, so the edge can (re)start or stop KV-event listeners.
#[derive(Debug, Clone, PartialEq)]
pub struct UpsertOutcome {
    pub record: WorkerRecord,
    /// The worker's event endpoints, ranks, partition or lifecycle changed (or it is new): its
    /// listeners must be restarted and its index entries were dropped.
    pub events_changed: bool,
}

/// A prompt as a request carries it.
#[derive(Debug, Clone, Copy)]
pub enum Prompt<'a> {
    /// Token ids, hashed with the partition's (or worker's) block size.
    Tokens {
        tokens: &'a [u32],
        lora_name: Option<&'a str>,
        cache_salt: Option<&'a str>,
        /// Eagle and multimodal hashing (`BlockExtras::default()` for a plain prompt).
        extras: BlockExtras<'a>,
    },
    /// Already hashed (by the client, or by the edge before taking the lock).
    Hashes(&'a PromptHashes),
}

impl Prompt<'_> {
    pub(super) fn hash(
        &self,
        block_size: u32,
    ) -> Result<std::borrow::Cow<'_, PromptHashes>, Error> {
        match *self {
            Prompt::Tokens {
                tokens,
                lora_name,
                cache_salt,
                extras,
            } => {
                if tokens.is_empty() {
                    return Err(Error::EmptyTokenIds);
                }
                Ok(std::borrow::Cow::Owned(PromptHashes::from_tokens_with(
                    tokens,
                    block_size as usize,
                    seed_for(lora_name, cache_salt),
                    extras,
                )))
            }
            Prompt::Hashes(h) => {
                validate_hashes(h)?;
                Ok(std::borrow::Cow::Borrowed(h))
            }
        }
    }
}

/// Checks client-supplied hashes: equal lengths, `isl_tokens > 0`.
pub fn validate_hashes(h: &PromptHashes) -> Result<(), Error> {
    if h.local.len() != h.sequence.len() {
        return Err(Error::HashLengthMismatch {
            block_hashes: h.local.len(),
            sequence_hashes: h.sequence.len(),
        });
    }
    if h.isl_tokens == 0 {
        return Err(Error::ZeroIsl);
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedWorker {
    pub worker_id: WorkerId,
    pub dp_rank: Option<u32>,
}

/// `POST /select` (and the selection half of `select_and_reserve`).
#[derive(Debug, Clone, Copy)]
pub struct SelectRequest<'a> {
    pub partition: &'a PartitionKey,
    pub selection_id: Option<&'a str>,
    pub prompt: Prompt<'a>,
    /// The LoRA adapter, remembered with a cached selection.
    pub lora_name: Option<&'a str>,
    pub expected_output_tokens: Option<u64>,
    pub overrides: Overrides,
    pub pinned_worker: Option<PinnedWorker>,
    pub allowed_worker_ids: Option<&'a [WorkerId]>,
    /// Required and preferred worker taints (`constraints.rs`).
    pub routing_constraints: Option<&'a RoutingConstraints>,
    pub advisory: bool,
    /// The request's session (`sessions.rs`; ignored while session affinity is off).
    pub session_id: Option<&'a str>,
    /// A worker (and rank) preferred over any load, unless `pinned_worker` names another.
    pub affinity_target: Option<PinnedWorker>,
    /// Whether a `decode` worker may run a request whole (a plain select, or a disaggregated
    /// one's bypass): vLLM's decode engines can, SGLang's cannot (they need a prefill peer), so
    /// with `false` only `both` workers do (SPEC §6.1).
    pub decode_runs_whole: bool,
}

impl<'a> SelectRequest<'a> {
    pub fn new(partition: &'a PartitionKey, prompt: Prompt<'a>) -> Self {
        Self {
            partition,
            selection_id: None,
            prompt,
            lora_name: None,
            expected_output_tokens: None,
            overrides: Overrides::default(),
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: None,
            advisory: false,
            session_id: None,
            affinity_target: None,
            decode_runs_whole: true,
        }
    }
}

/// The chosen rank's overlap, in tokens, per cumulative tier.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OverlapTokens {
    pub longest_matched: u64,
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
    /// Device overlap tokens of every rank of the chosen worker.
    pub dp: Vec<(u32, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerLoad {
    pub active_prefill_tokens: u64,
    pub prefill_token_capacity: u64,
    pub total_kv_blocks: Option<u64>,
}

/// Why a disaggregated select runs the request on one worker instead of a prefill/decode pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdBypass {
    /// The picked decode/both worker already holds all but `pd_bypass_tokens` of the prompt.
    SmallUncached,
    /// Every prefill rank the request may go to is busy.
    PrefillSaturated,
    /// The partition has no schedulable prefill worker the request may go to.
    NoPrefillWorkers,
}

impl PdBypass {
    pub fn as_str(self) -> &'static str {
        match self {
            PdBypass::SmallUncached => "small_uncached",
            PdBypass::PrefillSaturated => "prefill_saturated",
            PdBypass::NoPrefillWorkers => "no_prefill_workers",
        }
    }
}

/// The answer of a disaggregated select: a prefill and a decode pick, or (with a bypass) one
/// whole-request pick in `decode`.
#[derive(Debug, Clone, PartialEq)]
pub struct DisaggSelection {
    pub prefill: Option<Selection>,
    pub decode: Selection,
    pub bypass: Option<PdBypass>,
}

/// The bookings of a disaggregated `select_and_reserve`, one per leg.
#[derive(Debug, Clone, PartialEq)]
pub struct DisaggReservation {
    pub prefill: Option<Reservation>,
    pub decode: Reservation,
}

/// The answer of `select`.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub selection_id: Option<String>,
    pub partition: PartitionKey,
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub endpoint: String,
    /// The worker's SGLang bootstrap port, if it registered one (a prefill pick's caller hands
    /// it to the decode worker).
    pub bootstrap_port: Option<u16>,
    pub block_size: u32,
    pub overlap: OverlapTokens,
    /// The largest device overlap, in tokens, any candidate rank held at this selection
    /// (`overlap.gpu` ≤ this): with `overlap.gpu`, the decision quality in `/metrics`. Not sent in
    /// the JSON answer (Dynamo's has no such field); the service counts it in `/metrics`.
    ///
    /// The candidates are the ranks the selector was allowed to choose from: the partition's
    /// schedulable workers after `pinned_worker` / `allowed_worker_ids` (and a pinned
    /// `dp_rank`) and the required taints, busy ranks included. Ranks the caller excluded are left out, because they
    /// were never the selector's to pick, and counting them would charge the router with the
    /// caller's constraints (a pinned rank would look like a bad choice). Busy ranks stay in: the
    /// busy thresholds and the cost are the selector's own decisions, and a busy rank that holds
    /// the prompt is exactly the cache reuse its load balancing gave up. Computed from the
    /// overlaps the selection walked anyway (no second index lookup).
    pub best_gpu_overlap: u64,
    pub effective_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub worker_load: Option<WorkerLoad>,
    /// Whether a booking of this selection tracks prefill tokens.
    pub track_prefill_tokens: bool,
    pub local_hashes: Arc<[u64]>,
    pub sequence_hashes: Arc<[u64]>,
    pub isl_tokens: u64,
    /// The request's session and what booking this selection does to its binding.
    pub session: Option<SessionSelection>,
}

/// What a selection caches for its replay (SPEC §7.2).
#[derive(Debug, Clone, PartialEq)]
pub struct PendingSelection {
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    /// Local hashes, needed to predict the cache of a rank without KV events.
    pub local_hashes: Arc<[u64]>,
    pub sequence_hashes: Arc<[u64]>,
    pub isl_tokens: u64,
    pub effective_prefill_tokens: u64,
    pub expected_output_tokens: Option<u64>,
    pub track_prefill_tokens: bool,
    pub lora_name: Option<String>,
    /// The selection's session, and whether booking binds it there.
    pub session: Option<(SessionKey, bool)>,
}

/// `POST /reservations`.
#[derive(Debug, Clone, Copy)]
pub struct ReservationRequest<'a> {
    pub partition: &'a PartitionKey,
    pub selection_id: Option<&'a str>,
    pub reservation_id: Option<&'a str>,
    pub worker_id: Option<WorkerId>,
    pub dp_rank: Option<u32>,
    pub prompt: Option<Prompt<'a>>,
    pub effective_prefill_tokens: Option<u64>,
    pub expected_output_tokens: Option<u64>,
    pub track_prefill_tokens: Option<bool>,
    pub overrides: Overrides,
    /// The explicit form's session (a replay books its selection's).
    pub session_id: Option<&'a str>,
}

impl<'a> ReservationRequest<'a> {
    /// A replay of the selection cached under `selection_id`.
    pub fn replay(partition: &'a PartitionKey, selection_id: &'a str) -> Self {
        Self {
            partition,
            selection_id: Some(selection_id),
            reservation_id: None,
            worker_id: None,
            dp_rank: None,
            prompt: None,
            effective_prefill_tokens: None,
            expected_output_tokens: None,
            track_prefill_tokens: None,
            overrides: Overrides::default(),
            session_id: None,
        }
    }
}

/// A booking that landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub reservation_id: String,
    pub selection_id: Option<String>,
    pub partition: PartitionKey,
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub endpoint: String,
}

/// One rank's load as `/loads` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankLoadReport {
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
    /// How the rank's cache is known (in `/loads` only).
    pub cache_model: Option<CacheModelReport>,
}

/// How a rank's cache is known: from its engine's KV events, or predicted (SPEC §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheModelReport {
    /// The engine's KV events feed the index.
    Events,
    /// The TTL model predicts it; `blocks` are currently predicted.
    Ttl { blocks: u64 },
    /// The capacity-bounded LRU model predicts it.
    Lru(LruStats),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionLoads {
    pub partition: PartitionKey,
    pub loads: Vec<RankLoadReport>,
    /// Requests queued by the router. kvroute never queues (busy ranks answer 429), so 0.
    pub pending_count: u64,
    pub pending_isl_tokens: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOverlapScore {
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub device_blocks: u32,
    pub host_pinned_blocks: u32,
    pub disk_blocks: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlapScores {
    pub block_size: u32,
    pub num_blocks: usize,
    pub workers: Vec<RankOverlapScore>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ReadyState {
    pub ready: bool,
    pub schedulable_workers: usize,
    pub workers: Vec<WorkerRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionDump {
    pub partition: PartitionKey,
    pub block_size: Option<u32>,
    pub events: Vec<(Rank, KvEvent)>,
}

/// What a periodic [`Selector::tick`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TickOutcome {
    pub expired_reservations: Vec<String>,
    pub expired_selections: usize,
}

/// What [`Selector::queue_probe`] finds for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueProbe {
    /// Every rank the request may go to is over the queue threshold.
    pub full: bool,
    /// The prompt's tokens.
    pub isl_tokens: u64,
    /// Those not cached on the rank holding most of them.
    pub uncached_tokens: u64,
}
