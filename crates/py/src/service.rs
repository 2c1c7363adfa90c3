//! `kvroute.SelectionService`: the selection service in process.
//!
//! Every request method converts its dict to the HTTP body type (so the same JSON rules apply),
//! calls the operation on the service's in-process handle (`kvroute_service::Service`, the same
//! functions as the HTTP handlers), and renders its typed result as a dict (`crate::render`):
//! Python and HTTP cannot diverge.
//!
//! Threads: each service owns a small tokio runtime on which the periodic housekeeping (expiry
//! of idle bookings) runs; its KV-event listeners run on the ingest runtime and the applier
//! thread that `AppState` starts, as in `kvroute serve`. Every core operation runs with the GIL
//! released and inside the service runtime's context. Awaitable methods return an `asyncio.Future`: resolved on the spot
//! when the selector lock is free, or completed from `pyo3-async-runtimes`' tokio runtime when a
//! writer holds the lock (see [`Core::call`]).

use crate::convert::{self, to_py};
use crate::errors::{api_error, service_error};
use crate::events;
use crate::render;
use kvroute_service::api::{Admission, Routed};
use kvroute_service::config::{ApproximatePolicy, SessionAffinityMode};
use kvroute_service::http::error::ApiError;
use kvroute_service::http::types::{PromptRouteBody, ReservationBody, SelectBody, WorkerBody};
use kvroute_service::{AppState, ServeConfig, Service};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyTuple};
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::runtime::{Handle, Runtime};

/// What an awaitable resolves to, converted to Python on the event loop's side.
pub enum Reply {
    /// A JSON body, as a dict or list.
    Json(Value),
    /// `()`, as Dynamo's `prefill_complete`, `free_reservation` and `shutdown_async` give.
    Done,
    /// A failure, raised as the exception `errors` maps it to.
    Failed(ApiError),
}

impl Reply {
    /// A typed result, rendered as the HTTP body would be.
    fn rendered<T>(result: Result<T, ApiError>, render: impl FnOnce(&T) -> Value) -> Self {
        match result {
            Ok(v) => Reply::Json(render(&v)),
            Err(e) => Reply::Failed(e),
        }
    }

    /// `()` for a result that carries nothing.
    fn done(result: Result<(), ApiError>) -> Self {
        match result {
            Ok(()) => Reply::Done,
            Err(e) => Reply::Failed(e),
        }
    }
}

impl<'py> IntoPyObject<'py> for Reply {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        match self {
            Reply::Json(v) => to_py(py, &v),
            Reply::Done => Ok(PyTuple::empty(py).into_any()),
            Reply::Failed(e) => Err(api_error(py, e)),
        }
    }
}

/// How an operation takes the selector lock, to tell whether it would wait.
#[derive(Clone, Copy)]
enum Access {
    Read,
    Write,
}

/// The state an operation needs, cheap to clone into a future.
#[derive(Clone)]
struct Core {
    service: Service,
    runtime: Handle,
    /// Test hook: always take the offloaded path of [`Core::call`].
    always_offload: Arc<AtomicBool>,
}

impl Core {
    /// Runs an operation inside the service runtime's context.
    fn run<T>(&self, op: impl FnOnce(&Service) -> T) -> T {
        let _context = self.runtime.enter();
        op(&self.service)
    }

    /// An awaitable resolving to `op`'s reply.
    ///
    /// When the selector lock is free, `op` runs right here with the GIL released and the
    /// awaitable is an already-resolved `asyncio.Future`: the core work takes microseconds, and
    /// handing it to another thread would cost several times that (measured in
    /// `bench/select_overhead.py`). When a writer (e.g. a burst of engine events) holds the lock,
    /// `op` is handed to `pyo3-async-runtimes`' tokio runtime instead, so the event loop never
    /// waits behind it. Either way the result or exception arrives when the caller awaits.
    fn call<'py>(
        &self,
        py: Python<'py>,
        access: Access,
        op: impl FnOnce(&Service) -> Reply + Send + 'static,
    ) -> PyResult<Bound<'py, PyAny>> {
        let contended = self.service.selector_busy(matches!(access, Access::Write))
            || self.always_offload.load(Ordering::Relaxed);
        if contended {
            let core = self.clone();
            return pyo3_async_runtimes::tokio::future_into_py(py, async move { Ok(core.run(op)) });
        }
        // Fails (RuntimeError) outside a running event loop, before anything runs.
        let event_loop = pyo3_async_runtimes::get_running_loop(py)?;
        let reply = py.detach(|| self.run(op));
        let future = event_loop.call_method0(pyo3::intern!(py, "create_future"))?;
        match reply.into_pyobject(py) {
            Ok(value) => future.call_method1(pyo3::intern!(py, "set_result"), (value,))?,
            Err(e) => {
                future.call_method1(pyo3::intern!(py, "set_exception"), (e.into_value(py),))?
            }
        };
        Ok(future)
    }
}

impl Core {
    /// A select through the admission queue: decided at once like [`Core::call`]; a request
    /// that waits resolves on the runtime when it is decided, and cancelling the awaitable takes
    /// it out of the queue (its future, holding the waiter, is dropped).
    fn admit<'py, T: Routed + Send + 'static>(
        &self,
        py: Python<'py>,
        access: Access,
        admit: fn(&Service, SelectBody, Option<&str>) -> Admission<T>,
        render: fn(&T) -> Value,
        body: SelectBody,
        tenant: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if !self.service.queues_requests() {
            return self.call(py, access, move |service| {
                admit(service, body, tenant.as_deref())
                    .decided()
                    .map_or(Reply::Done, |result| Reply::rendered(result, render))
            });
        }
        // Fails (RuntimeError) outside a running event loop, before anything runs.
        let event_loop = pyo3_async_runtimes::get_running_loop(py)?;
        let admission = py.detach(|| self.run(|service| admit(service, body, tenant.as_deref())));
        match admission {
            Admission::Waiting(waiter) => {
                pyo3_async_runtimes::tokio::future_into_py(py, async move {
                    Ok(Reply::rendered(waiter.wait().await, render))
                })
            }
            Admission::Decided(result) => {
                let future = event_loop.call_method0(pyo3::intern!(py, "create_future"))?;
                match Reply::rendered(result, render).into_pyobject(py) {
                    Ok(value) => future.call_method1(pyo3::intern!(py, "set_result"), (value,))?,
                    Err(e) => future
                        .call_method1(pyo3::intern!(py, "set_exception"), (e.into_value(py),))?,
                };
                Ok(future)
            }
        }
    }
}

/// The knobs of `kvroute serve` that apply in process (the HTTP-only ones — bind, port, API key,
/// body limit — do not).
const KNOBS: &[&str] = &[
    "profile",
    "selection_cache_ttl_secs",
    "selection_cache_max_entries",
    "selection_cache_max_bytes",
    "overlap_score_credit",
    "prefill_load_scale",
    "host_cache_hit_weight",
    "disk_cache_hit_weight",
    "decode_active_request_weight",
    "router_temperature",
    "track_prefill_tokens",
    "busy_decode_fraction",
    "busy_prefill_tokens",
    "busy_prefill_fraction",
    "active_request_expiry_secs",
    "max_indexed_blocks",
    "predicted_ttl_secs",
    "no_kv_events",
    "approximate_cache_policy",
    "session_affinity_ttl_secs",
    "session_affinity_mode",
    "session_affinity_soft_factor",
    "session_affinity_max_sessions",
    "queue_threshold",
    "queue_policy",
    "queue_max_requests",
    "queue_timeout_ms",
    "queue_promotion_ms",
    "queue_quantum_tokens",
    "tenant_weights",
];

/// Dynamo's constructor keywords, accepted so that its callers work unchanged.
const DYNAMO_KEYWORDS: &[&str] = &[
    "selection_cache",
    "indexer_threads",
    "indexer_peers",
    "replica_sync_port",
    "replica_sync_peers",
];

fn knob_type_error(name: &str, expected: &str, value: &Bound<'_, PyAny>) -> PyErr {
    let got = value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    PyTypeError::new_err(format!("{name} must be {expected}, got {got}"))
}

fn float_knob(name: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    if value.is_instance_of::<PyBool>() {
        return Err(knob_type_error(name, "a number", value));
    }
    value
        .extract::<f64>()
        .map_err(|_| knob_type_error(name, "a number", value))
}

fn int_knob<T: for<'a, 'py> FromPyObject<'a, 'py>>(
    name: &str,
    value: &Bound<'_, PyAny>,
) -> PyResult<T> {
    if value.is_instance_of::<PyBool>() {
        return Err(knob_type_error(name, "an integer", value));
    }
    value.extract::<T>().map_err(|_| {
        if value.is_instance_of::<pyo3::types::PyInt>() {
            PyValueError::new_err(format!("{name} is out of range (got {value})"))
        } else {
            knob_type_error(name, "an integer", value)
        }
    })
}

fn bool_knob(name: &str, value: &Bound<'_, PyAny>) -> PyResult<bool> {
    value
        .cast::<PyBool>()
        .map(|b| b.is_true())
        .map_err(|_| knob_type_error(name, "a bool", value))
}

/// A cost weight: a number, or None for the profile's value.
fn weight_knob(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    optional(value).map(|v| float_knob(name, v)).transpose()
}

fn optional<'a, 'py>(value: &'a Bound<'py, PyAny>) -> Option<&'a Bound<'py, PyAny>> {
    (!value.is_none()).then_some(value)
}

/// Reads one attribute or key of Dynamo's `selection_cache` argument (a `SelectionCacheConfig`
/// or a dict with the same fields).
fn cache_field<'py>(cache: &Bound<'py, PyAny>, field: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let value = if let Ok(dict) = cache.cast::<PyDict>() {
        dict.get_item(field)?
    } else {
        cache.getattr(field).ok()
    };
    Ok(value.filter(|v| !v.is_none()))
}

/// Applies one keyword to the configuration.
fn apply_knob(config: &mut ServeConfig, name: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
    match name {
        "selection_cache_ttl_secs" => config.selection_cache_ttl_secs = float_knob(name, value)?,
        "selection_cache_max_entries" => {
            config.selection_cache_max_entries = int_knob(name, value)?
        }
        "selection_cache_max_bytes" => config.selection_cache_max_bytes = int_knob(name, value)?,
        "profile" => {
            let profile: String = value
                .extract()
                .map_err(|_| knob_type_error(name, "a str ('kvroute' or 'dynamo')", value))?;
            config.router_profile = profile.parse().map_err(|_| {
                PyValueError::new_err(format!(
                    "profile must be 'kvroute' or 'dynamo' (got {profile:?})"
                ))
            })?;
        }
        // The weights: None (or leaving one out) keeps the profile's value.
        "overlap_score_credit" => config.overlap_score_credit = weight_knob(name, value)?,
        "prefill_load_scale" => config.prefill_load_scale = weight_knob(name, value)?,
        "host_cache_hit_weight" => config.host_cache_hit_weight = weight_knob(name, value)?,
        "disk_cache_hit_weight" => config.disk_cache_hit_weight = weight_knob(name, value)?,
        "decode_active_request_weight" => {
            config.decode_active_request_weight = weight_knob(name, value)?
        }
        "router_temperature" => config.router_temperature = float_knob(name, value)?,
        "track_prefill_tokens" => config.track_prefill_tokens = bool_knob(name, value)?,
        "busy_decode_fraction" => {
            config.busy_decode_fraction =
                optional(value).map(|v| float_knob(name, v)).transpose()?
        }
        "busy_prefill_tokens" => {
            config.busy_prefill_tokens = optional(value).map(|v| int_knob(name, v)).transpose()?
        }
        "busy_prefill_fraction" => {
            config.busy_prefill_fraction =
                optional(value).map(|v| float_knob(name, v)).transpose()?
        }
        "active_request_expiry_secs" => {
            config.active_request_expiry_secs = float_knob(name, value)?
        }
        "max_indexed_blocks" => config.max_indexed_blocks = int_knob(name, value)?,
        "predicted_ttl_secs" => config.predicted_ttl_secs = Some(float_knob(name, value)?),
        // Dynamo's keyword: None (the default) leaves session affinity off.
        "session_affinity_ttl_secs" => {
            config.session_affinity_ttl_secs =
                optional(value).map(|v| float_knob(name, v)).transpose()?
        }
        "session_affinity_mode" => {
            let mode: String = value
                .extract()
                .map_err(|_| knob_type_error(name, "a str ('hard' or 'soft')", value))?;
            config.session_affinity_mode = match mode.as_str() {
                "hard" => SessionAffinityMode::Hard,
                "soft" => SessionAffinityMode::Soft,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "session_affinity_mode must be 'hard' or 'soft' (got {mode:?})"
                    )));
                }
            };
        }
        "session_affinity_soft_factor" => {
            config.session_affinity_soft_factor = float_knob(name, value)?
        }
        "session_affinity_max_sessions" => {
            config.session_affinity_max_sessions = int_knob(name, value)?
        }
        "queue_threshold" => {
            config.queue_threshold = optional(value).map(|v| float_knob(name, v)).transpose()?
        }
        "queue_policy" => {
            let policy: String = value
                .extract()
                .map_err(|_| knob_type_error(name, "a str ('fcfs', 'lcfs' or 'wspt')", value))?;
            config.queue_policy = Some(policy.parse().map_err(|_| {
                PyValueError::new_err(format!(
                    "queue_policy must be 'fcfs', 'lcfs' or 'wspt' (got {policy:?})"
                ))
            })?);
        }
        "queue_max_requests" => config.queue_max_requests = int_knob(name, value)?,
        "queue_timeout_ms" => {
            config.queue_timeout_ms = optional(value).map(|v| int_knob(name, v)).transpose()?
        }
        "queue_promotion_ms" => config.queue_promotion_ms = int_knob(name, value)?,
        "queue_quantum_tokens" => config.queue_quantum_tokens = int_knob(name, value)?,
        "tenant_weights" => {
            let weights: std::collections::BTreeMap<String, u32> =
                value.extract().map_err(|_| {
                    knob_type_error(name, "a dict of tenant names to weights ≥ 1", value)
                })?;
            if let Some((t, _)) = weights.iter().find(|(_, w)| **w == 0) {
                return Err(PyValueError::new_err(format!(
                    "tenant_weights: the weight of {t:?} must be at least 1"
                )));
            }
            config.tenant_weights = weights.into_iter().collect();
        }
        "no_kv_events" => config.no_kv_events = bool_knob(name, value)?,
        "approximate_cache_policy" => {
            let policy: String = value
                .extract()
                .map_err(|_| knob_type_error(name, "a str ('ttl' or 'lru')", value))?;
            config.approximate_cache_policy = match policy.as_str() {
                "ttl" => ApproximatePolicy::Ttl,
                "lru" => ApproximatePolicy::Lru,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "approximate_cache_policy must be 'ttl' or 'lru' (got {policy:?})"
                    )));
                }
            };
        }
        _ => {
            return Err(PyTypeError::new_err(format!(
                "SelectionService() got an unexpected keyword argument '{name}' (valid: {})",
                KNOBS.join(", ")
            )));
        }
    }
    Ok(())
}

/// The configuration from keywords, validated; errors name the keyword.
fn config_from(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<(ServeConfig, usize)> {
    let mut config = ServeConfig::defaults();
    let mut threads = DEFAULT_INGEST_THREADS;
    let Some(kwargs) = kwargs else {
        return Ok((config, threads));
    };
    for (key, value) in kwargs.iter() {
        let name: String = key.extract()?;
        if !DYNAMO_KEYWORDS.contains(&name.as_str()) {
            apply_knob(&mut config, &name, &value)?;
            continue;
        }
        match name.as_str() {
            "selection_cache" => {
                if value.is_none() {
                    continue;
                }
                for (field, knob) in [
                    ("ttl_secs", "selection_cache_ttl_secs"),
                    ("max_entries", "selection_cache_max_entries"),
                    ("max_bytes", "selection_cache_max_bytes"),
                ] {
                    if let Some(v) = cache_field(&value, field)? {
                        apply_knob(&mut config, knob, &v)?;
                    }
                }
            }
            "indexer_threads" => {
                threads = int_knob::<usize>(&name, &value)?;
                if threads == 0 {
                    return Err(PyValueError::new_err("indexer_threads must be at least 1"));
                }
            }
            _ if value.is_none() => {}
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{name} is not supported in process (replica sync is not part of \
                     kvroute's Python API); pass None or leave it out"
                )));
            }
        }
    }
    config.validate().map_err(|message| {
        // "--router-temperature must be …" → "router_temperature must be …".
        let message = message.strip_prefix("--").unwrap_or(&message);
        let (flag, rest) = message.split_once(' ').unwrap_or((message, ""));
        PyValueError::new_err(format!("{} {rest}", flag.replace('-', "_")))
    })?;
    Ok((config, threads))
}

/// An awaitable failing as Dynamo's replica calls do when replica sync is off.
fn replica_sync_disabled(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    pyo3_async_runtimes::tokio::future_into_py(py, async {
        Err::<(), _>(pyo3::exceptions::PyException::new_err(
            "replica sync is disabled",
        ))
    })
}

/// Worker threads of a service's runtime (KV-event listeners and housekeeping).
const DEFAULT_INGEST_THREADS: usize = 2;

/// Reservation id from the positional argument or Dynamo's `selection_id=` keyword.
fn booking_id(
    method: &str,
    positional: Option<String>,
    keyword: Option<String>,
) -> PyResult<String> {
    match (positional, keyword) {
        (Some(id), None) | (None, Some(id)) => Ok(id),
        (None, None) => Err(PyTypeError::new_err(format!(
            "{method}() missing 1 required argument: 'reservation_id'"
        ))),
        (Some(_), Some(_)) => Err(PyTypeError::new_err(format!(
            "{method}() got both reservation_id and selection_id; pass one"
        ))),
    }
}

/// In-process KV-cache-aware worker selection: the operations of `kvroute serve`'s HTTP API,
/// without a network hop. A drop-in for Dynamo's ``dynamo.llm.SelectionService``.
///
/// Requests and results are dicts and lists shaped exactly like the HTTP JSON bodies (see the
/// kvroute README and ``GET /openapi.json``). Block hashes are signed 64-bit integers, as on the
/// HTTP API; both signs are accepted on input.
///
/// Keyword arguments are the knobs of ``kvroute serve`` (defaults in brackets):
/// ``profile`` ['kvroute' | 'dynamo': the weights' defaults, as ``--router-profile``; 'dynamo'
/// gives Dynamo 1.6.1's decisions], ``selection_cache_ttl_secs`` [120],
/// ``selection_cache_max_entries`` [4096], ``selection_cache_max_bytes`` [256 MiB], and over the
/// profile's weights ``overlap_score_credit`` [1], ``prefill_load_scale`` [32; dynamo
/// 1], ``host_cache_hit_weight`` [0.75], ``disk_cache_hit_weight`` [0.25],
/// ``decode_active_request_weight`` [0] (None: the profile's); ``router_temperature`` [0],
/// ``track_prefill_tokens`` [True], ``busy_decode_fraction``, ``busy_prefill_tokens``,
/// ``busy_prefill_fraction`` [None], ``active_request_expiry_secs`` [300],
/// ``max_indexed_blocks`` [2**22 per partition], ``predicted_ttl_secs`` [2; 0 turns
/// predict-on-route off], ``no_kv_events`` [False],
/// ``approximate_cache_policy`` ['ttl' | 'lru'], ``session_affinity_ttl_secs`` [None: session
/// affinity off; 1 to 31536000, as Dynamo's keyword], ``session_affinity_mode`` ['hard' |
/// 'soft'], ``session_affinity_soft_factor`` [3], ``session_affinity_max_sessions`` [2**18].
/// Sessions are this process's own (no replica sync). Dynamo's ``selection_cache=SelectionCacheConfig(
/// ttl_secs=, max_entries=, max_bytes=)`` and ``indexer_threads`` (threads of the KV-event
/// runtime, default 2) are accepted too. An invalid value raises ``ValueError`` naming it.
///
/// Awaitable (call from a running asyncio loop): ``upsert_worker``, ``patch_worker``,
/// ``delete_worker``, ``select``, ``select_and_reserve``, ``create_reservation``,
/// ``prefill_complete``, ``free_reservation``, ``overlap_scores``, ``potential_loads``,
/// ``indexer_snapshot``, ``shutdown_async``. Synchronous: ``list_workers``, ``ready``, ``loads``,
/// ``add_output_block``, ``apply_kv_events``, ``metrics``, ``shutdown``.
///
/// Failures raise ``SelectionServiceError`` with ``.status_code`` and ``.kind``, and ``str(e)``
/// equal to the HTTP ``error`` text; a 400 raises its subclass ``InvalidRequestError``, which is
/// also a ``ValueError``. A malformed request (wrong type, missing field) raises ``ValueError``
/// (``TypeError`` when the argument is not a dict) naming the field, before anything runs.
///
/// Workers registered with ``kv_events_endpoint(s)`` are subscribed to from this process on a
/// runtime the service owns; bookings with no lifecycle call for ``active_request_expiry_secs``
/// are freed by a periodic sweep on it. Dynamo's replica-sync calls answer as Dynamo does with
/// replica sync disabled.
///
/// Example (inside ``async def``):
///
/// ```python
/// svc = kvroute.SelectionService()
/// await svc.upsert_worker({"worker_id": 1, "endpoint": "http://gpu-1:8000", "block_size": 16})
/// choice = await svc.select({"token_ids": prompt, "selection_id": "req-1"})
/// await svc.create_reservation({"selection_id": "req-1"})  # book what select chose
/// await svc.prefill_complete("req-1")
/// svc.add_output_block("req-1")                             # per output block
/// await svc.free_reservation("req-1")                       # the request finished
/// ```
#[pyclass(module = "kvroute", name = "SelectionService", frozen)]
pub struct SelectionService {
    core: Core,
    /// Taken when the service is dropped.
    runtime: Mutex<Option<Runtime>>,
}

#[pymethods]
impl SelectionService {
    #[new]
    #[pyo3(signature = (**config))]
    fn new(py: Python<'_>, config: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let (config, threads) = config_from(config)?;
        py.detach(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name("kvroute-service")
                .enable_all()
                .build()
                .map_err(|e| {
                    pyo3::exceptions::PyRuntimeError::new_err(format!(
                        "cannot start the service runtime: {e}"
                    ))
                })?;
            let state = {
                let _context = runtime.enter();
                AppState::new(config).map_err(PyValueError::new_err)?
            };
            runtime.spawn(Arc::clone(&state).run_housekeeping());
            Ok(Self {
                core: Core {
                    service: Service::new(state),
                    runtime: runtime.handle().clone(),
                    always_offload: Arc::new(AtomicBool::new(false)),
                },
                runtime: Mutex::new(Some(runtime)),
            })
        })
    }

    // -----------------------------------------------------------------------------------------
    // Catalog

    /// Register or update a worker (dict like the body of ``POST /workers``); resolves to its
    /// catalog record. Subscribes to the worker's KV events when it has ``kv_events_endpoint``
    /// or ``kv_events_endpoints``.
    fn upsert_worker<'py>(
        &self,
        py: Python<'py>,
        worker: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let body: WorkerBody = convert::body(worker, "worker")?;
        self.core.call(py, Access::Write, move |service| {
            Reply::rendered(service.upsert_worker(body), render::worker)
        })
    }

    /// Update the given fields of a worker (``PATCH /workers/{id}``); resolves to its record.
    fn patch_worker<'py>(
        &self,
        py: Python<'py>,
        worker_id: u64,
        patch: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let body: WorkerBody = convert::body(patch, "patch")?;
        self.core.call(py, Access::Write, move |service| {
            Reply::rendered(service.patch_worker(worker_id, body), render::worker)
        })
    }

    /// Remove a worker: frees its reservations, drops its cached blocks, stops its KV-event
    /// listeners. Resolves to its record (lifecycle ``unschedulable``).
    fn delete_worker<'py>(&self, py: Python<'py>, worker_id: u64) -> PyResult<Bound<'py, PyAny>> {
        self.core.call(py, Access::Write, move |service| {
            Reply::rendered(service.delete_worker(worker_id), render::worker)
        })
    }

    /// Catalog records, optionally filtered (``GET /workers``).
    #[pyo3(signature = (*, model_name=None, routing_group=None))]
    fn list_workers<'py>(
        &self,
        py: Python<'py>,
        model_name: Option<String>,
        routing_group: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let value = py.detach(|| {
            self.core.run(|service| {
                render::workers(&service.workers(model_name.as_deref(), routing_group.as_deref()))
            })
        });
        to_py(py, &value)
    }

    /// Readiness (``GET /ready``'s body): ``{"ready", "schedulable_workers", "workers"}``.
    fn ready<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let body = py.detach(|| self.core.run(|service| render::ready(&service.ready())));
        to_py(py, &body)
    }

    // -----------------------------------------------------------------------------------------
    // Selection

    /// Choose a worker and rank for a prompt (dict like ``POST /select``); books nothing. With
    /// ``selection_id`` the booking inputs are cached so ``create_reservation({"selection_id":
    /// ...})`` can book them without the prompt. With ``"disaggregated": True`` the reply is
    /// ``{"disaggregated", "bypass", "prefill", "decode"}``, a pick per leg (never queued).
    #[pyo3(signature = (request, *, tenant=None))]
    fn select<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        tenant: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let body: SelectBody = convert::prompt_body(request, "request")?;
        if body.disaggregated {
            return self.core.call(py, Access::Read, move |service| {
                Reply::rendered(service.select_disaggregated(body), render::disaggregated)
            });
        }
        self.core.admit(
            py,
            Access::Read,
            Service::select,
            render::selection,
            body,
            tenant,
        )
    }

    /// Select and book atomically (``POST /select_and_reserve``); never touches the selection
    /// cache. The reply adds ``reservation_id``, ``sequence_hashes``, ``isl_tokens`` and
    /// ``track_prefill_tokens``.
    #[pyo3(signature = (request, *, tenant=None))]
    fn select_and_reserve<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        tenant: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let body: SelectBody = convert::prompt_body(request, "request")?;
        if body.disaggregated {
            return self.core.call(py, Access::Write, move |service| {
                Reply::rendered(
                    service.select_and_reserve_disaggregated(body),
                    render::disaggregated,
                )
            });
        }
        self.core.admit(
            py,
            Access::Write,
            Service::select_and_reserve,
            render::booked,
            body,
            tenant,
        )
    }

    /// Book load (``POST /reservations``): replay a cached selection with ``selection_id`` (any
    /// prompt, ``dp_rank``, ``effective_prefill_tokens`` or ``expected_output_tokens`` given is
    /// ignored: the cached selection wins), or book explicitly with ``worker_id`` and the prompt.
    /// The booking is named ``reservation_id`` (default: ``selection_id``).
    fn create_reservation<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let body: ReservationBody = convert::prompt_body(request, "request")?;
        self.core.call(py, Access::Write, move |service| {
            Reply::rendered(service.create_reservation(body), render::reservation)
        })
    }

    /// Mark a reservation's prefill complete (idempotent); resolves to ``()``. Dynamo's keyword
    /// ``selection_id=`` is accepted for the id.
    #[pyo3(
        signature = (reservation_id=None, *, selection_id=None),
        text_signature = "($self, reservation_id)"
    )]
    fn prefill_complete<'py>(
        &self,
        py: Python<'py>,
        reservation_id: Option<String>,
        selection_id: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let id = booking_id("prefill_complete", reservation_id, selection_id)?;
        self.core.call(py, Access::Write, move |service| {
            Reply::done(service.prefill_complete(&id))
        })
    }

    /// Record one more output block of a reservation (synchronous). With ``decay_fraction`` in
    /// [0, 1] its decode contribution becomes ``round(f × blocks so far)``.
    #[pyo3(
        signature = (reservation_id=None, *, decay_fraction=None, selection_id=None),
        text_signature = "($self, reservation_id, *, decay_fraction=None)"
    )]
    fn add_output_block(
        &self,
        py: Python<'_>,
        reservation_id: Option<String>,
        decay_fraction: Option<f64>,
        selection_id: Option<String>,
    ) -> PyResult<()> {
        let id = booking_id("add_output_block", reservation_id, selection_id)?;
        py.detach(|| {
            self.core
                .run(|service| service.output_block(&id, decay_fraction))
        })
        .map_err(|e| api_error(py, e))
    }

    /// Free a finished reservation, releasing its load; resolves to ``()``. A second free of the
    /// same id raises ``SelectionServiceError`` (404).
    #[pyo3(
        signature = (reservation_id=None, *, selection_id=None),
        text_signature = "($self, reservation_id)"
    )]
    fn free_reservation<'py>(
        &self,
        py: Python<'py>,
        reservation_id: Option<String>,
        selection_id: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let id = booking_id("free_reservation", reservation_id, selection_id)?;
        self.core.call(py, Access::Write, move |service| {
            Reply::done(service.free_reservation(&id))
        })
    }

    // -----------------------------------------------------------------------------------------
    // Inspection

    /// Per-rank KV overlap of a prompt, in blocks per cumulative tier (``POST /overlap_scores``).
    fn overlap_scores<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let body: PromptRouteBody = convert::prompt_body(request, "request")?;
        self.core.call(py, Access::Read, move |service| {
            Reply::rendered(service.overlap_scores(body), render::overlap_scores)
        })
    }

    /// Per-rank load if this prompt were booked there, without booking
    /// (``POST /potential_loads``).
    fn potential_loads<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let body: PromptRouteBody = convert::prompt_body(request, "request")?;
        self.core.call(py, Access::Read, move |service| {
            Reply::rendered(service.potential_loads(body), |loads| {
                render::potential_loads(loads)
            })
        })
    }

    /// Current booked load per partition (``GET /loads``).
    #[pyo3(signature = (*, model_name=None, routing_group=None))]
    fn loads<'py>(
        &self,
        py: Python<'py>,
        model_name: Option<String>,
        routing_group: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let value = py.detach(|| {
            self.core.run(|service| {
                let loads = service.loads(model_name.as_deref(), routing_group.as_deref());
                render::loads(&loads, &service.degraded())
            })
        });
        to_py(py, &value)
    }

    /// The index as events per partition, in ``GET /dump``'s shape.
    fn indexer_snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.core.call(py, Access::Read, |service| {
            Reply::Json(render::dump(service.dump()))
        })
    }

    /// Apply KV events to a registered worker's rank, as its engine's publisher would — for
    /// callers that receive engine events themselves. ``events`` is a vLLM msgpack batch payload
    /// (``bytes``; its ``data_parallel_rank``, when set, overrides ``dp_rank``) or a list of
    /// event dicts (see ``RadixIndex.apply_events``). Returns what was applied (counts).
    #[pyo3(signature = (worker_id, events, *, dp_rank=0))]
    fn apply_kv_events<'py>(
        &self,
        py: Python<'py>,
        worker_id: u64,
        events: &Bound<'py, PyAny>,
        dp_rank: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let conversion = if let Ok(bytes) = events.cast::<PyBytes>() {
            let payload = bytes.as_bytes().to_vec();
            py.detach(|| events::from_batch(&payload))
                .map_err(|e| PyValueError::new_err(format!("events: {e}")))?
        } else {
            let items = events::event_list(events)?;
            let (events, outcome) = events::from_dicts(&items)?;
            kvroute_wire::Conversion {
                data_parallel_rank: None,
                events,
                outcome,
            }
        };
        let rank = conversion.data_parallel_rank.unwrap_or(dp_rank);
        let applied = py.detach(|| {
            self.core
                .service
                .apply_kv_events(worker_id, rank, &conversion.events)
        });
        let Some(applied) = applied else {
            return Err(service_error(
                py,
                404,
                &format!("worker {worker_id} not found"),
            ));
        };
        to_py(
            py,
            &events::outcome_json(&applied, &conversion.outcome, rank),
        )
    }

    /// Test hook: run every awaitable on the tokio runtime, as when the selector lock is busy.
    fn _set_always_offload(&self, always: bool) {
        self.core.always_offload.store(always, Ordering::Relaxed);
    }

    /// KV-event listener tasks running in this service.
    fn active_listeners(&self) -> usize {
        self.core.service.active_listeners()
    }

    /// The service's Prometheus metrics, as ``GET /metrics`` renders them.
    fn metrics(&self, py: Python<'_>) -> String {
        py.detach(|| self.core.service.render_metrics())
    }

    // -----------------------------------------------------------------------------------------
    // Lifecycle

    /// Stop: KV-event listeners end and every later request raises ``SelectionServiceError``
    /// ("selection service is shutting down", 503); ``ready()`` still answers. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| self.core.run(Service::begin_shutdown));
    }

    /// ``shutdown()`` as an awaitable resolving to ``()`` (Dynamo's ``shutdown_async``).
    fn shutdown_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.core.call(py, Access::Write, |service| {
            service.begin_shutdown();
            Reply::Done
        })
    }

    // -----------------------------------------------------------------------------------------
    // Dynamo's replica-sync calls. Replicas of kvroute share state through `kvroute serve`
    // (SPEC §10), not in process: these answer as Dynamo does with replica sync disabled.

    /// Replica peers: always ``[]`` (replica sync is disabled in process).
    fn list_replica_peers(&self) -> Vec<String> {
        Vec::new()
    }

    /// Raises ``Exception("replica sync is disabled")``, as Dynamo does without replica sync.
    fn register_replica_peer<'py>(
        &self,
        py: Python<'py>,
        endpoint: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = endpoint;
        replica_sync_disabled(py)
    }

    /// Raises ``Exception("replica sync is disabled")``, as Dynamo does without replica sync.
    fn deregister_replica_peer<'py>(
        &self,
        py: Python<'py>,
        endpoint: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = endpoint;
        replica_sync_disabled(py)
    }

    /// Raises ``Exception("replica sync is disabled")``: an in-process index is recovered from
    /// engine replays (``replay_endpoint``) or ``apply_kv_events``, not from peers.
    fn recover_indexer_from_peers<'py>(
        &self,
        py: Python<'py>,
        peers: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = peers;
        replica_sync_disabled(py)
    }

    fn __repr__(&self) -> String {
        let ready = self.core.service.ready();
        format!(
            "<kvroute.SelectionService workers={} schedulable={}{}>",
            ready.workers.len(),
            ready.schedulable_workers,
            if self.core.service.is_shutting_down() {
                " shut down"
            } else {
                ""
            }
        )
    }
}

impl Drop for SelectionService {
    fn drop(&mut self) {
        self.core.service.begin_shutdown();
        // Does not wait for the runtime's threads, so it is safe wherever the last reference
        // goes away (including inside another runtime).
        if let Some(runtime) = self.runtime.lock().take() {
            runtime.shutdown_background();
        }
    }
}
