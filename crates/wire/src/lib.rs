//! # kvroute-wire
//!
//! The KV-event wire format of vLLM and SGLang engines (SPEC §3.1), decoded and encoded without
//! any I/O: bytes in, plain values out, and back. The service's ZMQ listener calls
//! [`decode_batch`] and [`to_kv_events`] on each message and applies the result to the index; the
//! fake engine and the simulator call [`encode_batch`] and the [`frames`] builders to publish
//! real-format messages.
//!
//! ```
//! use kvroute_wire::{EncodeOptions, EventBatch, RawEvent, RawStored};
//!
//! // A fake engine publishes one stored block...
//! let batch = EventBatch {
//!     ts: 1.0,
//!     events: vec![RawEvent::Stored(RawStored {
//!         block_hashes: vec![u64::MAX],
//!         token_ids: vec![1, 2, 3, 4],
//!         block_size: 4,
//!         medium: Some("GPU".into()),
//!         ..RawStored::default()
//!     })],
//!     data_parallel_rank: Some(0),
//! };
//! let payload = kvroute_wire::encode_batch(&batch, EncodeOptions::default());
//! let frames = kvroute_wire::frames::live_message(b"", 0, payload);
//!
//! // ...and the listener decodes it for the index.
//! let message = kvroute_wire::frames::parse_live_message(&frames)?;
//! let decoded = kvroute_wire::decode_batch(message.payload)?;
//! let conversion = kvroute_wire::to_kv_events(&decoded);
//! assert_eq!(conversion.outcome.stored_blocks, 1);
//! assert_eq!(conversion.data_parallel_rank, Some(0));
//! # Ok::<(), kvroute_wire::WireError>(())
//! ```
//!
//! ## The format, as vLLM defines it
//!
//! Checked against `vllm/distributed/kv_events.py` (vllm-project/vllm):
//! - `EventBatch(msgspec.Struct, omit_defaults=True)`: `ts: float`, `events: list`,
//!   `data_parallel_rank: int | None = None`. Older releases declare it `array_like=True` and
//!   have no rank field (`[ts, events]`); later array releases add the rank (`[ts, events,
//!   rank]`); current releases drop `array_like`, so the batch is a map.
//! - `KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True)`, `array_like=True` in older
//!   releases: a tagged union whose tag is the class name, written as the first array element
//!   or as the `"type"` key.
//! - `BlockStored`: `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`,
//!   `medium`, `lora_name` (no defaults), then `extra_keys`, `group_idx`, `kv_cache_spec_kind`,
//!   `kv_cache_spec_sliding_window` (default `None`). Older releases stop after `lora_id` or
//!   `medium`.
//! - `BlockRemoved`: `block_hashes`, `medium`, `group_idx = None`. `AllBlocksCleared`: no
//!   fields.
//! - Block hashes are `ExternalBlockHash = bytes | int`: `maybe_convert_block_hash`
//!   (`vllm/v1/core/kv_cache_utils.py`) sends the raw digest bytes, or with
//!   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` the int `from_bytes(digest, "big") & (2^64 - 1)`:
//!   the last 8 bytes big-endian, which is what this crate takes from a bin hash, so both forms
//!   of one block give the same id.
//! - `extra_keys` holds one tuple (or `None`) per block: LoRA name, multimodal keys, the cache
//!   salt (block 0 of a prompt only), prompt-embedding digests; see [`RawStored::cache_salt`]
//!   and, for the multimodal hashes Dynamo's workers put there, [`RawStored::mm_infos`].
//! - SGLang with EAGLE speculative decoding sends `token_ids` as `[token, next token]` pairs;
//!   Dynamo's own publishers may add `cache_salt` and `block_mm_infos` keys to a map event
//!   (see `decode`).
//! - msgspec ignores `omit_defaults` for array-like structs (jcrist/msgspec#720), so array
//!   events carry every field of their release, `nil` included; map events omit defaulted
//!   fields that are `None`.
//!
//! ## Invariants
//! - Decoding never panics and never trusts a length from a header: allocation and work are
//!   linear in the payload size, and nesting is bounded by [`MAX_DEPTH`] (fuzzed; see
//!   `fuzz/README.md`).
//! - Decoding is tolerant where engines differ (either encoding, any integer width, int or bin
//!   hashes, missing trailing fields, unknown trailing fields and keys, unknown event types)
//!   and strict where a value is wrong (a negative token id, a string where a list belongs).
//! - [`decode_batch`] of [`encode_batch`] is the identity on every [`EventBatch`] whose floats
//!   are not NaN, whose Eagle events have at least two tokens and, for the array form, whose
//!   events have no `cache_salt` or `block_mm_infos` (which only the map form carries).
//!
//! ## Cost
//! One pass over the payload; a 32-event batch of 16 blocks × 64 tokens (~110 KB) decodes in a
//! few tens of microseconds (`benches/decode.rs`). Hashing in [`to_kv_events`] is linear in the
//! number of tokens.
//!
//! `SPEC §n` in this crate is section n of `docs/SPEC.md`.
// Unsafe only in `msgpack_avx512` (SIMD intrinsics), which allows it for itself.
#![deny(unsafe_code)]

pub mod convert;
mod decode;
mod encode;
mod error;
mod event;
pub mod frames;
mod msgpack;
#[cfg(target_arch = "x86_64")]
mod msgpack_avx512;

pub use convert::{
    Conversion, ConversionOutcome, DropReason, FULL_ATTENTION_KINDS, convert_event, convert_stored,
    convert_stored_with_seed, feeds_index, stored_seed, to_kv_events,
};
pub use decode::decode_batch;
pub use encode::{
    EncodeOptions, Encoding, HashEncoding, PackedRun, PackedTokens, encode_batch,
    encode_batch_into, encode_batch_packed,
};
pub use error::WireError;
pub use event::{
    DYNAMO_CACHE_SALT_PREFIX, EventBatch, ExtraKey, RawEvent, RawRemoved, RawStored,
    dynamo_mm_hash, dynamo_mm_marker, vllm_extra_keys,
};
pub use msgpack::MAX_DEPTH;
