//! JSON request and response bodies, shaped like Dynamo's selection service (field names,
//! defaults, nesting), plus kvroute's additions (`reservation_id`, `tenant_id` alias).

use kvroute_core::error::{Error, PartitionKey, check_id};
use kvroute_core::hash::{BlockExtras, BlockMmInfo, MmObject, PromptHashes};
use kvroute_core::schedule::Overrides;
use kvroute_core::selector::{
    KvTransferEnforcement, PinnedWorker, WorkerRecord, WorkerRole, WorkerSpec,
};
use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};

fn default_name() -> String {
    "default".to_string()
}

/// A block hash on the wire: signed (Dynamo) or unsigned; both map to the same 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireHash(pub u64);

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = WireHash;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a 64-bit integer hash (signed or unsigned)")
            }
            fn visit_i64<E>(self, v: i64) -> Result<WireHash, E> {
                Ok(WireHash(v as u64))
            }
            fn visit_u64<E>(self, v: u64) -> Result<WireHash, E> {
                Ok(WireHash(v))
            }
        }
        d.deserialize_any(V)
    }
}

fn hashes(v: &[WireHash]) -> Vec<u64> {
    v.iter().map(|h| h.0).collect()
}

/// Hashes as Dynamo renders them: signed i64.
pub fn signed(v: &[u64]) -> Vec<i64> {
    v.iter().map(|&h| h as i64).collect()
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct OverrideBody {
    pub overlap_score_credit: Option<f64>,
    pub prefill_load_scale: Option<f64>,
    pub router_temperature: Option<f64>,
    pub track_prefill_tokens: Option<bool>,
}

impl OverrideBody {
    pub fn to_overrides(&self) -> Result<Overrides, Error> {
        for (field, v) in [
            ("overlap_score_credit", self.overlap_score_credit),
            ("prefill_load_scale", self.prefill_load_scale),
            ("router_temperature", self.router_temperature),
        ] {
            if let Some(v) = v
                && !(v.is_finite() && v >= 0.0)
            {
                return Err(Error::InvalidField {
                    field,
                    message: format!("router_config_override.{field} must be a finite number ≥ 0"),
                });
            }
        }
        Ok(Overrides {
            overlap_score_credit: self.overlap_score_credit,
            prefill_load_scale: self.prefill_load_scale,
            router_temperature: self.router_temperature,
            track_prefill_tokens: self.track_prefill_tokens,
        })
    }
}

/// A token range of a multimodal object: `[start, end]`, exactly two non-negative integers
/// (rejected with serde's words for a tuple, as Dynamo's `(usize, usize)` is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffsetPair(pub usize, pub usize);

impl<'de> Deserialize<'de> for OffsetPair {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OffsetPair;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a tuple of size 2")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<OffsetPair, A::Error> {
                use serde::de::Error;
                let Some(start) = seq.next_element::<usize>()? else {
                    return Err(A::Error::invalid_length(0, &self));
                };
                let Some(end) = seq.next_element::<usize>()? else {
                    return Err(A::Error::invalid_length(1, &self));
                };
                let mut len = 2;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    len += 1;
                }
                if len > 2 {
                    return Err(A::Error::invalid_length(len, &"2 elements in sequence"));
                }
                Ok(OffsetPair(start, end))
            }
        }
        d.deserialize_seq(V)
    }
}

/// One multimodal object of a block, as Dynamo's `BlockMmObjectInfo`: `{"mm_hash": u64,
/// "offsets": [[start, end], ...]}`. Only `mm_hash` enters the block hash.
#[derive(Debug, Clone, Deserialize)]
pub struct MmObjectBody {
    pub mm_hash: u64,
    pub offsets: Vec<OffsetPair>,
}

/// One block's multimodal objects, as Dynamo's `BlockExtraInfo`: `{"mm_objects": [...]}`.
#[derive(Debug, Clone, Deserialize)]
pub struct BlockMmInfoBody {
    pub mm_objects: Vec<MmObjectBody>,
}

impl BlockMmInfoBody {
    fn into_core(self) -> BlockMmInfo {
        BlockMmInfo {
            mm_objects: self
                .mm_objects
                .into_iter()
                .map(|o| MmObject {
                    mm_hash: o.mm_hash,
                    offsets: o
                        .offsets
                        .into_iter()
                        .map(|p| (p.0 as u64, p.1 as u64))
                        .collect(),
                })
                .collect(),
        }
    }
}

/// Per block, `null` or its multimodal objects, as the core hashes them.
pub fn mm_infos_into_core(infos: Vec<Option<BlockMmInfoBody>>) -> Vec<Option<BlockMmInfo>> {
    infos
        .into_iter()
        .map(|info| info.map(BlockMmInfoBody::into_core))
        .collect()
}

/// Dynamo's `mm_routing_info`: the tokens to route on (images expanded to their placeholder
/// tokens) and their blocks' multimodal objects. When `routing_token_ids` is not empty it
/// replaces `token_ids` and `block_mm_infos`.
#[derive(Debug, Clone, Deserialize)]
pub struct MmRoutingInfoBody {
    pub routing_token_ids: Vec<u32>,
    #[serde(default)]
    pub block_mm_infos: Vec<Option<BlockMmInfoBody>>,
}

/// The prompt fields every prompt route accepts.
#[derive(Debug, Clone, Default)]
pub struct PromptBody {
    pub token_ids: Option<Vec<u32>>,
    pub block_hashes: Option<Vec<WireHash>>,
    pub sequence_hashes: Option<Vec<WireHash>>,
    pub isl_tokens: Option<u64>,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub block_mm_infos: Option<Vec<Option<BlockMmInfoBody>>>,
    pub mm_routing_info: Option<MmRoutingInfoBody>,
    pub is_eagle: Option<bool>,
}

/// A token prompt to hash: its tokens and what else enters its block hashes.
#[derive(Debug, Clone, Default)]
pub struct TokenPrompt {
    pub tokens: Vec<u32>,
    pub block_mm_infos: Vec<Option<BlockMmInfo>>,
    pub is_eagle: bool,
}

impl TokenPrompt {
    /// The Eagle and multimodal options of [`kvroute_core::hash::local_hashes_with`].
    pub fn extras(&self) -> BlockExtras<'_> {
        BlockExtras {
            is_eagle: self.is_eagle,
            block_mm_infos: &self.block_mm_infos,
        }
    }
}

/// A prompt after validation: token ids to hash, or client-supplied hashes.
pub enum PromptInput {
    Tokens(TokenPrompt),
    Hashes(PromptHashes),
}

impl PromptBody {
    /// `missing` names the field reported when no prompt is given (`block_hashes` on select
    /// routes, `sequence_hashes` on reservations, where block hashes are optional).
    ///
    /// As Dynamo does, `mm_routing_info` with routing tokens wins over `token_ids` and
    /// `block_mm_infos`; `is_eagle` and the multimodal infos apply to token prompts only.
    pub fn resolve(&mut self, missing: &'static str) -> Result<PromptInput, Error> {
        let is_eagle = self.is_eagle.unwrap_or(false);
        if let Some(routing) = self
            .mm_routing_info
            .take()
            .filter(|r| !r.routing_token_ids.is_empty())
        {
            return Ok(PromptInput::Tokens(TokenPrompt {
                tokens: routing.routing_token_ids,
                block_mm_infos: mm_infos_into_core(routing.block_mm_infos),
                is_eagle,
            }));
        }
        if let Some(tokens) = self.token_ids.take() {
            if tokens.is_empty() {
                return Err(Error::EmptyTokenIds);
            }
            return Ok(PromptInput::Tokens(TokenPrompt {
                tokens,
                block_mm_infos: mm_infos_into_core(self.block_mm_infos.take().unwrap_or_default()),
                is_eagle,
            }));
        }
        let sequence = match (&self.block_hashes, &self.sequence_hashes, missing) {
            (None, _, "block_hashes") => {
                return Err(Error::MissingPrompt {
                    field: "block_hashes",
                });
            }
            (_, None, _) => {
                return Err(Error::MissingPrompt {
                    field: "sequence_hashes",
                });
            }
            (_, Some(s), _) => hashes(s),
        };
        let local = match &self.block_hashes {
            Some(b) => hashes(b),
            // Bookings need only sequence hashes.
            None => sequence.clone(),
        };
        let Some(isl_tokens) = self.isl_tokens else {
            return Err(Error::InvalidField {
                field: "isl_tokens",
                message: "isl_tokens is required without token_ids".to_string(),
            });
        };
        let prompt = PromptHashes {
            local,
            sequence,
            isl_tokens,
        };
        kvroute_core::selector::validate_hashes(&prompt)?;
        Ok(PromptInput::Hashes(prompt))
    }
}

/// Dynamo's `routing_constraints`, named as Dynamo's type is, for serde's messages (`expected
/// struct RoutingConstraints`). As any derived struct it is also accepted as a sequence of its
/// fields (`[["gpu=h100"]]`); `null` is not.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RoutingConstraints {
    #[serde(default)]
    pub required_taints: Vec<String>,
    #[serde(default)]
    pub preferred_taints: BTreeMap<String, f32>,
}

impl RoutingConstraints {
    /// The constraints, `None` when they name no taint (nothing to check per candidate).
    pub fn take(&mut self) -> Option<kvroute_core::selector::RoutingConstraints> {
        let constraints = kvroute_core::selector::RoutingConstraints {
            required_taints: std::mem::take(&mut self.required_taints)
                .into_iter()
                .collect(),
            preferred_taints: std::mem::take(&mut self.preferred_taints),
        };
        (!constraints.is_empty()).then_some(constraints)
    }
}

/// For optional fields that may be absent but not `null` (Dynamo's defaulted fields): absent is
/// `None` (with `#[serde(default)]`), `null` is the inner type's error.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

#[derive(Debug, Clone, Deserialize)]
pub struct PinnedBody {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

/// `affinity_target`: a worker (and rank) preferred over any load. Named as Dynamo's type, which
/// its 422 texts name (`expected struct WorkerAffinityTarget`).
#[derive(Debug, Clone, Deserialize)]
pub struct WorkerAffinityTarget {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

/// What started a session's request (accepted, not used: Dynamo 1.6.1 does not either).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputTrigger {
    UserMessage,
    ToolResult,
    Other,
}

/// `session_context`: the session the request belongs to. Only `session_id` is used; the rest is
/// type-checked and ignored, as in Dynamo 1.6.1, whose type (and 422 texts) this is named after.
#[derive(Debug, Clone, Deserialize)]
pub struct SelectionSessionContext {
    pub session_id: String,
    pub parent_session_id: Option<String>,
    pub session_final: Option<bool>,
    pub input_trigger: Option<InputTrigger>,
}

/// The session of a request: `session_context.session_id`, else `session_id`.
fn session_of<'a>(
    session_id: &'a Option<String>,
    context: &'a Option<SelectionSessionContext>,
) -> Option<&'a str> {
    context
        .as_ref()
        .map(|c| c.session_id.as_str())
        .or(session_id.as_deref())
}

fn partition_key(model_name: &str, routing_group: &Option<String>) -> Result<PartitionKey, Error> {
    let group = routing_group.clone().unwrap_or_else(default_name);
    check_id("model_name", model_name)?;
    check_id("routing_group", &group)?;
    Ok(PartitionKey::new(model_name, group))
}

// The bodies below list their fields directly (no `#[serde(flatten)]`): flattening would buffer
// large token arrays element by element before typing them.

macro_rules! prompt_accessors {
    () => {
        pub fn key(&self) -> Result<PartitionKey, Error> {
            partition_key(&self.model_name, &self.routing_group)
        }

        /// Moves the prompt fields out.
        pub fn take_prompt(&mut self) -> PromptBody {
            PromptBody {
                token_ids: self.token_ids.take(),
                block_hashes: self.block_hashes.take(),
                sequence_hashes: self.sequence_hashes.take(),
                isl_tokens: self.isl_tokens,
                lora_name: self.lora_name.clone(),
                cache_salt: self.cache_salt.clone(),
                block_mm_infos: self.block_mm_infos.take(),
                mm_routing_info: self.mm_routing_info.take(),
                is_eagle: self.is_eagle,
            }
        }

        pub fn overrides(&self) -> Result<Overrides, Error> {
            self.router_config_override
                .as_ref()
                .map_or(Ok(Overrides::default()), OverrideBody::to_overrides)
        }
    };
}

/// `Default` is for callers in process (the gateway) that name only the fields they set.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SelectBody {
    #[serde(default = "default_name")]
    pub model_name: String,
    #[serde(default, alias = "tenant_id")]
    pub routing_group: Option<String>,
    pub selection_id: Option<String>,
    pub reservation_id: Option<String>,
    pub token_ids: Option<Vec<u32>>,
    pub block_hashes: Option<Vec<WireHash>>,
    pub sequence_hashes: Option<Vec<WireHash>>,
    pub isl_tokens: Option<u64>,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub block_mm_infos: Option<Vec<Option<BlockMmInfoBody>>>,
    pub mm_routing_info: Option<MmRoutingInfoBody>,
    pub is_eagle: Option<bool>,
    pub expected_output_tokens: Option<u64>,
    #[serde(default)]
    pub router_config_override: Option<OverrideBody>,
    pub pinned_worker: Option<PinnedBody>,
    pub allowed_worker_ids: Option<Vec<u64>>,
    #[serde(default)]
    pub routing_constraints: RoutingConstraints,
    #[serde(default)]
    pub advisory: bool,
    pub session_id: Option<String>,
    pub session_context: Option<SelectionSessionContext>,
    pub affinity_target: Option<WorkerAffinityTarget>,
    /// Seconds to move ahead in the admission queue (Dynamo's field; below 0 counts as 0).
    pub priority_jump: Option<f64>,
    /// Higher goes first in the admission queue, before any other order (Dynamo's field).
    pub strict_priority: Option<u32>,
    /// The longest this request may wait in the admission queue, in milliseconds (kvroute's;
    /// default `--queue-timeout-ms`).
    pub queue_timeout_ms: Option<u64>,
    /// Pick a prefill and a decode worker (SPEC §6.1; kvroute's field).
    #[serde(default)]
    pub disaggregated: bool,
    /// Whether a `decode` worker may run the request whole (default true; false for SGLang
    /// decode engines, which need a prefill peer): SPEC §6.1, kvroute's field.
    pub decode_runs_whole: Option<bool>,
}

impl SelectBody {
    prompt_accessors!();

    pub fn pinned(&self) -> Option<PinnedWorker> {
        self.pinned_worker.as_ref().map(|p| PinnedWorker {
            worker_id: p.worker_id,
            dp_rank: p.dp_rank,
        })
    }

    pub fn affinity(&self) -> Option<PinnedWorker> {
        self.affinity_target.as_ref().map(|t| PinnedWorker {
            worker_id: t.worker_id,
            dp_rank: t.dp_rank,
        })
    }

    /// The request's session: `session_context.session_id`, else `session_id`.
    pub fn session(&self) -> Option<&str> {
        session_of(&self.session_id, &self.session_context)
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ReservationBody {
    #[serde(default = "default_name")]
    pub model_name: String,
    #[serde(default, alias = "tenant_id")]
    pub routing_group: Option<String>,
    pub selection_id: Option<String>,
    pub reservation_id: Option<String>,
    pub worker_id: Option<u64>,
    pub dp_rank: Option<u32>,
    pub token_ids: Option<Vec<u32>>,
    pub block_hashes: Option<Vec<WireHash>>,
    pub sequence_hashes: Option<Vec<WireHash>>,
    pub isl_tokens: Option<u64>,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub block_mm_infos: Option<Vec<Option<BlockMmInfoBody>>>,
    pub mm_routing_info: Option<MmRoutingInfoBody>,
    pub is_eagle: Option<bool>,
    pub effective_prefill_tokens: Option<u64>,
    pub expected_output_tokens: Option<u64>,
    pub track_prefill_tokens: Option<bool>,
    #[serde(default)]
    pub router_config_override: Option<OverrideBody>,
    /// The explicit form's session (kvroute's addition; a replay books its selection's).
    pub session_id: Option<String>,
    pub session_context: Option<SelectionSessionContext>,
}

impl ReservationBody {
    prompt_accessors!();

    /// The booking's session: `session_context.session_id`, else `session_id`.
    pub fn session(&self) -> Option<&str> {
        session_of(&self.session_id, &self.session_context)
    }

    /// Whether the body carries any prompt field.
    pub fn has_prompt(&self) -> bool {
        self.token_ids.is_some()
            || self.mm_routing_info.is_some()
            || self.sequence_hashes.is_some()
            || self.block_hashes.is_some()
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct PromptRouteBody {
    #[serde(default = "default_name")]
    pub model_name: String,
    #[serde(default, alias = "tenant_id")]
    pub routing_group: Option<String>,
    pub token_ids: Option<Vec<u32>>,
    pub block_hashes: Option<Vec<WireHash>>,
    pub sequence_hashes: Option<Vec<WireHash>>,
    pub isl_tokens: Option<u64>,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub block_mm_infos: Option<Vec<Option<BlockMmInfoBody>>>,
    pub mm_routing_info: Option<MmRoutingInfoBody>,
    pub is_eagle: Option<bool>,
    #[serde(default)]
    pub router_config_override: Option<OverrideBody>,
}

impl PromptRouteBody {
    prompt_accessors!();
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct OutputBlockBody {
    pub decay_fraction: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PartitionQuery {
    pub model_name: Option<String>,
    #[serde(alias = "tenant_id")]
    pub routing_group: Option<String>,
}

/// `POST /workers` and, with every field optional, `PATCH /workers/{id}`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WorkerBody {
    pub worker_id: Option<u64>,
    pub model_name: Option<String>,
    #[serde(alias = "tenant_id")]
    pub routing_group: Option<String>,
    pub endpoint: Option<String>,
    pub block_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    pub data_parallel_size: Option<u32>,
    pub total_kv_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub kv_events_endpoint: Option<String>,
    pub kv_events_endpoints: Option<BTreeMap<String, String>>,
    pub replay_endpoint: Option<String>,
    /// A set: duplicates merge, and records list it sorted.
    #[serde(default, deserialize_with = "present")]
    pub taints: Option<BTreeSet<String>>,
    #[serde(default, deserialize_with = "present")]
    pub topology_domains: Option<BTreeMap<String, String>>,
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: Option<EnforcementBody>,
    pub kv_transfer_preferred_weight: Option<f32>,
    /// `both` (default), `prefill` or `decode` (SPEC §6.1; kvroute's field).
    pub role: Option<RoleBody>,
    /// An SGLang prefill worker's bootstrap server port (kvroute's field).
    pub bootstrap_port: Option<u16>,
}

/// `role`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleBody {
    Both,
    Prefill,
    Decode,
}

impl From<RoleBody> for WorkerRole {
    fn from(r: RoleBody) -> Self {
        match r {
            RoleBody::Both => WorkerRole::Both,
            RoleBody::Prefill => WorkerRole::Prefill,
            RoleBody::Decode => WorkerRole::Decode,
        }
    }
}

/// `kv_transfer_enforcement`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnforcementBody {
    Required,
    Preferred,
}

impl From<EnforcementBody> for KvTransferEnforcement {
    fn from(e: EnforcementBody) -> Self {
        match e {
            EnforcementBody::Required => KvTransferEnforcement::Required,
            EnforcementBody::Preferred => KvTransferEnforcement::Preferred,
        }
    }
}

impl WorkerBody {
    fn endpoints(&self) -> Result<Option<BTreeMap<u32, String>>, Error> {
        let Some(map) = &self.kv_events_endpoints else {
            return Ok(None);
        };
        map.iter()
            .map(|(k, v)| {
                k.parse::<u32>()
                    .map(|rank| (rank, v.clone()))
                    .map_err(|_| Error::InvalidField {
                        field: "kv_events_endpoints",
                        message: format!(
                            "kv_events_endpoints key `{k}` must be a dp rank (an integer between 0 and 4294967295)"
                        ),
                    })
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// A full spec for `POST /workers`.
    pub fn into_spec(self) -> Result<WorkerSpec, Error> {
        let Some(worker_id) = self.worker_id else {
            return Err(Error::InvalidField {
                field: "worker_id",
                message: "worker_id is required".to_string(),
            });
        };
        let endpoints = self.endpoints()?.unwrap_or_default();
        Ok(WorkerSpec {
            worker_id,
            model_name: self.model_name.unwrap_or_else(default_name),
            routing_group: self.routing_group.unwrap_or_else(default_name),
            endpoint: self.endpoint,
            block_size: self.block_size,
            data_parallel_start_rank: self.data_parallel_start_rank,
            data_parallel_size: self.data_parallel_size,
            total_kv_blocks: self.total_kv_blocks,
            max_num_batched_tokens: self.max_num_batched_tokens,
            kv_events_endpoint: self.kv_events_endpoint,
            kv_events_endpoints: endpoints,
            replay_endpoint: self.replay_endpoint,
            taints: self.taints.unwrap_or_default(),
            topology_domains: self.topology_domains.unwrap_or_default(),
            kv_transfer_domain: self.kv_transfer_domain,
            kv_transfer_enforcement: self.kv_transfer_enforcement.map(Into::into),
            kv_transfer_preferred_weight: self.kv_transfer_preferred_weight,
            role: self.role.map(Into::into).unwrap_or_default(),
            bootstrap_port: self.bootstrap_port,
        })
    }

    /// Applies the fields present to an existing spec (`PATCH`); identity fields are ignored.
    pub fn patch(self, mut spec: WorkerSpec) -> Result<WorkerSpec, Error> {
        if let Some(endpoints) = self.endpoints()? {
            spec.kv_events_endpoints = endpoints;
        }
        macro_rules! set {
            ($($field:ident),*) => { $( if self.$field.is_some() { spec.$field = self.$field; } )* };
        }
        set!(
            endpoint,
            block_size,
            data_parallel_start_rank,
            data_parallel_size,
            total_kv_blocks,
            max_num_batched_tokens,
            kv_events_endpoint,
            replay_endpoint,
            kv_transfer_domain,
            kv_transfer_preferred_weight,
            bootstrap_port
        );
        if let Some(role) = self.role {
            spec.role = role.into();
        }
        if let Some(taints) = self.taints {
            spec.taints = taints;
        }
        if let Some(domains) = self.topology_domains {
            spec.topology_domains = domains;
        }
        if let Some(enforcement) = self.kv_transfer_enforcement {
            spec.kv_transfer_enforcement = Some(enforcement.into());
        }
        Ok(spec)
    }
}

/// The `f64` an `f32` reads as: 0.85f32 is 0.8500000238418579 widened, but `0.85` in Dynamo's
/// JSON (serde writes an `f32` in its own shortest form), and here. Infinite stays infinite.
fn f32_as_written(value: f32) -> f64 {
    value.to_string().parse().unwrap_or(f64::from(value))
}

/// The worker record, with Dynamo's fields (`stable_routing_id` and `is_eagle`, which kvroute
/// does not read, are always `null`). `taints` are listed sorted (Dynamo: in no fixed order).
pub fn worker_json(record: &WorkerRecord) -> Value {
    let s = &record.spec;
    let mut v = json!({
        "worker_id": s.worker_id,
        "model_name": s.model_name,
        "routing_group": s.routing_group,
        "lifecycle": record.lifecycle.as_str(),
        "endpoint": s.endpoint,
        "kv_events_endpoint": s.kv_events_endpoint,
        "replay_endpoint": s.replay_endpoint,
        "block_size": s.block_size,
        "data_parallel_start_rank": s.data_parallel_start_rank,
        "data_parallel_size": s.data_parallel_size,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "total_kv_blocks": s.total_kv_blocks,
        "stable_routing_id": null,
        "is_eagle": null,
        "taints": s.taints,
        "topology_domains": s.topology_domains,
        "kv_transfer_domain": s.kv_transfer_domain,
        "kv_transfer_enforcement": s.kv_transfer_enforcement.map(KvTransferEnforcement::as_str),
        "kv_transfer_preferred_weight": s.kv_transfer_preferred_weight.map(f32_as_written),
    });
    if let Some(obj) = v.as_object_mut() {
        if !s.kv_events_endpoints.is_empty() {
            let map: BTreeMap<String, &String> = s
                .kv_events_endpoints
                .iter()
                .map(|(k, a)| (k.to_string(), a))
                .collect();
            obj.insert("kv_events_endpoints".into(), json!(map));
        }
        // Only when not the defaults: Dynamo's record has neither field.
        if s.role != WorkerRole::Both {
            obj.insert("role".into(), json!(s.role.as_str()));
        }
        if let Some(port) = s.bootstrap_port {
            obj.insert("bootstrap_port".into(), json!(port));
        }
        if !record.not_schedulable_reasons.is_empty() {
            obj.insert(
                "not_schedulable_reasons".into(),
                json!(record.not_schedulable_reasons),
            );
        }
    }
    v
}
