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
//!
//! `entry.rs`: a worker, its flags and its registration; `file.rs`: the workers file and its
//! watch.

mod entry;
mod file;

pub use entry::{
    WorkerEntry, check_url, parse_role_flag, parse_worker_flag, register, worker_id_for,
};
pub use file::{FileDefaults, FileWorkers, ReloadOutcome, parse_workers_file};
