//! `kvroute.RadixIndex` (the core's radix index on its own) and `kvroute.block_hashes`.

use crate::convert::to_py;
use crate::events;
use kvroute_core::event::{KvEvent, Rank};
use kvroute_core::hash::{BlockExtras, BlockMmInfo, PromptHashes, seed_for};
use kvroute_core::index::{DEFAULT_MAX_BLOCKS, IndexConfig, Matches, RadixIndex as CoreIndex};
use kvroute_service::http::types::{BlockMmInfoBody, mm_infos_into_core};
use kvroute_wire::Conversion;
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};
use serde_json::{Value, json};

/// Reads a sequence of 64-bit hashes (signed or unsigned) from Python.
fn hash_list(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<u64>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{field} must be a sequence of integers"
        )));
    }
    obj.try_iter()?
        .enumerate()
        .map(|(i, item)| {
            let item = item?;
            item.extract::<i64>()
                .map(|h| h as u64)
                .or_else(|_| item.extract::<u64>())
                .map_err(|_| {
                    PyValueError::new_err(format!(
                        "{field}[{i}]: expected a 64-bit hash (signed or unsigned), got {item}"
                    ))
                })
        })
        .collect()
}

/// Reads token ids (u32) from Python.
fn token_list(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{field} must be a sequence of integers"
        )));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(token(&item, field, i)?);
        }
        return Ok(out);
    }
    obj.try_iter()?
        .enumerate()
        .map(|(i, item)| token(&item?, field, i))
        .collect()
}

fn token(item: &Bound<'_, PyAny>, field: &str, i: usize) -> PyResult<u32> {
    item.extract::<u32>().map_err(|_| {
        PyValueError::new_err(format!(
            "{field}[{i}]: expected a token id (an integer between 0 and 4294967295), got {item}"
        ))
    })
}

/// Reads Dynamo's `block_mm_infos` (`None`, or per block `None` or `{"mm_objects": [{"mm_hash":
/// int, "offsets": [[start, end], ...]}]}`), rejecting what the HTTP service rejects.
fn mm_infos(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<BlockMmInfo>>> {
    match obj.filter(|o| !o.is_none()) {
        None => Ok(Vec::new()),
        Some(obj) => {
            let infos: Vec<Option<BlockMmInfoBody>> =
                crate::convert::value_at(obj, "block_mm_infos")?;
            Ok(mm_infos_into_core(infos))
        }
    }
}

fn matches_json(matches: &Matches) -> Value {
    let mut ranks = matches.ranks.clone();
    ranks.sort_by_key(|r| r.rank);
    Value::Array(
        ranks
            .iter()
            .map(|r| {
                json!({
                    "worker_id": r.rank.worker_id,
                    "dp_rank": r.rank.dp_rank,
                    "device_blocks": r.device_blocks,
                    "host_pinned_blocks": r.host_blocks,
                    "disk_blocks": r.disk_blocks,
                })
            })
            .collect(),
    )
}

/// The local and sequence hashes of a token prompt (SPEC §2, Dynamo-compatible): one per full
/// block of ``block_size`` tokens; a trailing partial block is not hashed.
///
/// Returns ``{"local_hashes": [...], "sequence_hashes": [...]}`` as **signed** 64-bit integers
/// (the 64 bits reinterpreted, as the HTTP API and Dynamo render them; ``h & (2**64 - 1)`` gives
/// the unsigned value). ``lora_name`` and ``cache_salt`` salt the hashes as engines do (an empty
/// string counts as absent). ``block_mm_infos`` (per block ``None`` or ``{"mm_objects":
/// [{"mm_hash": int, "offsets": [[start, end], ...]}]}``) adds each block's multimodal objects
/// and ``is_eagle=True`` makes each block's hash cover the next token too, as Dynamo's
/// ``compute_block_hash_for_seq`` does. Pass them to ``select`` as ``block_hashes`` /
/// ``sequence_hashes`` with ``isl_tokens = len(tokens)``.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, lora_name=None, cache_salt=None, block_mm_infos=None, is_eagle=None))]
pub fn block_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: u32,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    block_mm_infos: Option<&Bound<'py, PyAny>>,
    is_eagle: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be greater than 0"));
    }
    let tokens = token_list(tokens, "tokens")?;
    let block_mm_infos = mm_infos(block_mm_infos)?;
    let hashes = py.detach(|| {
        PromptHashes::from_tokens_with(
            &tokens,
            block_size as usize,
            seed_for(lora_name.as_deref(), cache_salt.as_deref()),
            BlockExtras {
                is_eagle: is_eagle.unwrap_or(false),
                block_mm_infos: &block_mm_infos,
            },
        )
    });
    let signed = |v: &[u64]| v.iter().map(|&h| h as i64).collect::<Vec<_>>();
    to_py(
        py,
        &json!({
            "local_hashes": signed(&hashes.local),
            "sequence_hashes": signed(&hashes.sequence),
        }),
    )
}

/// A KV-cache radix index on its own: which (worker, dp rank) holds which prompt prefix, on
/// which tier — the structure ``SelectionService`` keeps per partition, without workers, loads
/// or scheduling.
///
/// Feed it engine events (``apply_batch`` for vLLM/SGLang msgpack payloads as received on the
/// engine's ZMQ socket, ``apply_events`` for dicts) and ask ``find_matches`` how many leading
/// blocks of a prompt each rank holds. ``max_blocks`` caps the distinct blocks indexed; the
/// oldest are evicted beyond it. Thread-safe; the GIL is released while it works.
#[pyclass(module = "kvroute", name = "RadixIndex", frozen)]
pub struct RadixIndex {
    inner: Mutex<CoreIndex>,
}

impl RadixIndex {
    fn apply(&self, worker_id: u64, conversion: Conversion, dp_rank: u32) -> Value {
        let rank = conversion.data_parallel_rank.unwrap_or(dp_rank);
        let applied = self
            .inner
            .lock()
            .apply_all(Rank::new(worker_id, rank), &conversion.events);
        events::outcome_json(&applied, &conversion.outcome, rank)
    }
}

#[pymethods]
impl RadixIndex {
    #[new]
    #[pyo3(
        signature = (*, max_blocks=DEFAULT_MAX_BLOCKS),
        text_signature = "(*, max_blocks=4194304)"
    )]
    fn new(max_blocks: usize) -> PyResult<Self> {
        if max_blocks == 0 {
            return Err(PyValueError::new_err("max_blocks must be at least 1"));
        }
        Ok(Self {
            inner: Mutex::new(CoreIndex::new(IndexConfig { max_blocks })),
        })
    }

    /// Apply one vLLM/SGLang KV-event batch — the msgpack ``payload`` frame of a live ZMQ message
    /// ``[topic, seq, payload]``, in either encoding — to a worker's rank. The batch's
    /// ``data_parallel_rank``, when present, overrides ``dp_rank``. Local hashes are computed from
    /// the events' tokens. Returns counts of what was applied and dropped; a payload that does
    /// not decode raises ``ValueError``.
    #[pyo3(signature = (worker_id, payload, *, dp_rank=0))]
    fn apply_batch<'py>(
        &self,
        py: Python<'py>,
        worker_id: u64,
        payload: &Bound<'py, PyBytes>,
        dp_rank: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let payload = payload.as_bytes();
        let outcome = py
            .detach(|| events::from_batch(payload).map(|c| self.apply(worker_id, c, dp_rank)))
            .map_err(|e| PyValueError::new_err(format!("payload: {e}")))?;
        to_py(py, &outcome)
    }

    /// Apply event dicts, in order, to a worker's rank. vLLM form (tokens):
    /// ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": None, "token_ids":
    /// [...], "block_size": 16, "medium": "GPU", "lora_name": None, "cache_salt": None}``,
    /// ``{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}``,
    /// ``{"type": "AllBlocksCleared"}``. kvroute form (hashed, as ``dump()`` returns):
    /// ``{"type": "stored", "parent": None, "blocks": [{"engine_hash": h, "local_hash": h}],
    /// "tier": "device"}``, ``{"type": "removed", "engine_hashes": [...], "tier": "host"}``,
    /// ``{"type": "cleared"}``. Returns counts of what was applied and dropped.
    #[pyo3(signature = (worker_id, events, *, dp_rank=0))]
    fn apply_events<'py>(
        &self,
        py: Python<'py>,
        worker_id: u64,
        events: &Bound<'py, PyAny>,
        dp_rank: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let items = events::event_list(events)?;
        let (events, outcome) = events::from_dicts(&items)?;
        let conversion = Conversion {
            data_parallel_rank: None,
            events,
            outcome,
        };
        let result = py.detach(|| self.apply(worker_id, conversion, dp_rank));
        to_py(py, &result)
    }

    /// ``apply_events`` for one event dict.
    #[pyo3(signature = (worker_id, event, *, dp_rank=0))]
    fn apply_event<'py>(
        &self,
        py: Python<'py>,
        worker_id: u64,
        event: &Bound<'py, PyAny>,
        dp_rank: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let list = PyList::new(py, [event])?;
        self.apply_events(py, worker_id, list.as_any(), dp_rank)
    }

    /// How many leading blocks of a prompt each rank holds, per cumulative tier: a list of
    /// ``{"worker_id", "dp_rank", "device_blocks", "host_pinned_blocks", "disk_blocks"}`` for
    /// every rank with a non-zero overlap, sorted by rank. ``sequence_hashes`` as returned by
    /// ``block_hashes(...)["sequence_hashes"]``.
    fn find_matches<'py>(
        &self,
        py: Python<'py>,
        sequence_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let hashes = hash_list(sequence_hashes, "sequence_hashes")?;
        let matches = py.detach(|| matches_json(&self.inner.lock().find_matches(&hashes)));
        to_py(py, &matches)
    }

    /// ``find_matches`` for a token prompt, hashed with ``block_size`` (and the LoRA name, cache
    /// salt, multimodal infos and Eagle flag, as ``block_hashes`` takes them).
    #[pyo3(signature = (tokens, block_size, *, lora_name=None, cache_salt=None, block_mm_infos=None, is_eagle=None))]
    #[allow(clippy::too_many_arguments)]
    fn find_matches_for_tokens<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        block_size: u32,
        lora_name: Option<String>,
        cache_salt: Option<String>,
        block_mm_infos: Option<&Bound<'py, PyAny>>,
        is_eagle: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be greater than 0"));
        }
        let tokens = token_list(tokens, "tokens")?;
        let block_mm_infos = mm_infos(block_mm_infos)?;
        let matches = py.detach(|| {
            let hashes = PromptHashes::from_tokens_with(
                &tokens,
                block_size as usize,
                seed_for(lora_name.as_deref(), cache_salt.as_deref()),
                BlockExtras {
                    is_eagle: is_eagle.unwrap_or(false),
                    block_mm_infos: &block_mm_infos,
                },
            );
            matches_json(&self.inner.lock().find_matches(&hashes.sequence))
        });
        to_py(py, &matches)
    }

    /// Remove every block of every rank of a worker; returns how many (rank, block) entries went.
    fn remove_worker(&self, py: Python<'_>, worker_id: u64) -> usize {
        py.detach(|| self.inner.lock().remove_worker(worker_id))
    }

    /// Remove every block of one rank; returns how many went.
    #[pyo3(signature = (worker_id, dp_rank=0))]
    fn remove_rank(&self, py: Python<'_>, worker_id: u64, dp_rank: u32) -> usize {
        py.detach(|| self.inner.lock().remove_rank(Rank::new(worker_id, dp_rank)))
    }

    /// The index as kvroute-form ``stored`` event dicts, each with its ``worker_id`` and
    /// ``dp_rank`` (parents before children), for recovery: applying them to an empty index
    /// rebuilds the same overlaps.
    fn dump<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let dumped = py.detach(|| {
            let events: Vec<(Rank, KvEvent)> = self.inner.lock().dump();
            Value::Array(
                events
                    .iter()
                    .map(|(rank, event)| events::event_json(rank.worker_id, rank.dp_rank, event))
                    .collect(),
            )
        });
        to_py(py, &dumped)
    }

    /// The ranks holding at least one block, as ``(worker_id, dp_rank)`` tuples.
    fn ranks(&self) -> Vec<(u64, u32)> {
        let mut ranks: Vec<(u64, u32)> = self
            .inner
            .lock()
            .ranks()
            .iter()
            .map(|r| (r.worker_id, r.dp_rank))
            .collect();
        ranks.sort_unstable();
        ranks
    }

    /// Distinct blocks indexed.
    #[getter]
    fn block_count(&self) -> usize {
        self.inner.lock().block_count()
    }

    fn __len__(&self) -> usize {
        self.inner.lock().block_count()
    }

    fn __repr__(&self) -> String {
        let index = self.inner.lock();
        format!(
            "<kvroute.RadixIndex blocks={} ranks={}>",
            index.block_count(),
            index.ranks().len()
        )
    }
}
