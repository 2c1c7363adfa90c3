//! Encoding batches exactly as vLLM's msgspec publisher does, for fake engines, the simulator and
//! tests.
//!
//! - [`Encoding::Array`] mirrors the older `array_like=True` classes. msgspec ignores
//!   `omit_defaults` for array-like structs (jcrist/msgspec#720), so every field is written,
//!   `nil` included: a `BlockStored` is always 12 elements, a `BlockRemoved` 4, and the batch 3.
//! - [`Encoding::Map`] mirrors the newer map classes: required fields are always written (nil
//!   included), defaulted ones (`extra_keys`, `group_idx`, `kv_cache_spec_kind`,
//!   `kv_cache_spec_sliding_window`, the batch's `data_parallel_rank`) only when set.
//!
//! Keys and elements come in vLLM's declaration order. An Eagle event
//! ([`RawStored::is_eagle`]) writes its `token_ids` as SGLang does, as `[token, next token]`
//! pairs; `cache_salt` and `block_mm_infos` have no place in vLLM's array layout and are
//! written by the map form only, after vLLM's keys.

use crate::event::{EventBatch, RawEvent, RawRemoved, RawStored};
use crate::msgpack::Writer;
use kvroute_core::hash::BlockMmInfo;

/// The layout of structs on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// `["BlockStored", ...]` inside `[ts, events, dp_rank]` (vLLM before mid-2026).
    #[default]
    Array,
    /// `{"type": "BlockStored", ...}` inside `{"ts": ..., "events": ..., ...}` (newer vLLM).
    Map,
}

/// How block hashes are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashEncoding {
    /// As a non-negative int (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`: the digest's low
    /// 64 bits), so ids above `i64::MAX` use msgpack `uint64`.
    #[default]
    Unsigned,
    /// As the `i64` with the same bits (older engines that published Python `hash()` values),
    /// so ids above `i64::MAX` are negative `int64`.
    Signed,
    /// As a 32-byte bin whose last 8 bytes are the id big-endian (vLLM's default: raw digest
    /// bytes).
    Bytes,
}

/// How to encode a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EncodeOptions {
    pub encoding: Encoding,
    pub hashes: HashEncoding,
}

/// Encodes a batch into a new buffer.
pub fn encode_batch(batch: &EventBatch, options: EncodeOptions) -> Vec<u8> {
    let mut out = Vec::with_capacity(estimated_size(batch));
    encode_batch_into(batch, options, &mut out);
    out
}

/// Appends the encoding of a batch to `out` (reuse one buffer across batches).
pub fn encode_batch_into(batch: &EventBatch, options: EncodeOptions, out: &mut Vec<u8>) {
    encode_with_tokens(batch, options, &[], out);
}

/// Like [`encode_batch`], with the `token_ids` of some `BlockStored` events already packed:
/// `packed[i]`, when given, is written as the token ids of event `i` (whose own `token_ids`
/// are then not looked at); events without an entry write their own.
pub fn encode_batch_packed(
    batch: &EventBatch,
    options: EncodeOptions,
    packed: &[Option<PackedRun<'_>>],
) -> Vec<u8> {
    let extra: usize = packed.iter().flatten().map(|run| run.bytes.len()).sum();
    let mut out = Vec::with_capacity(estimated_size(batch) + extra);
    encode_with_tokens(batch, options, packed, &mut out);
    out
}

fn encode_with_tokens(
    batch: &EventBatch,
    options: EncodeOptions,
    packed: &[Option<PackedRun<'_>>],
    out: &mut Vec<u8>,
) {
    let mut w = Writer::new(out);
    match options.encoding {
        Encoding::Array => {
            w.array_len(3);
            w.f64(batch.ts);
            events(&mut w, batch, options, packed);
            opt_uint(&mut w, batch.data_parallel_rank.map(u64::from));
        }
        Encoding::Map => {
            w.map_len(2 + usize::from(batch.data_parallel_rank.is_some()));
            w.str("ts");
            w.f64(batch.ts);
            w.str("events");
            events(&mut w, batch, options, packed);
            if let Some(rank) = batch.data_parallel_rank {
                w.str("data_parallel_rank");
                w.uint(u64::from(rank));
            }
        }
    }
}

fn estimated_size(batch: &EventBatch) -> usize {
    let per_event: usize = batch
        .events
        .iter()
        .map(|e| match e {
            RawEvent::Stored(s) => 160 + 9 * s.block_hashes.len() + 5 * s.token_ids.len(),
            RawEvent::Removed(r) => 48 + 9 * r.block_hashes.len(),
            RawEvent::Cleared | RawEvent::Unknown { .. } => 24,
        })
        .sum();
    32 + per_event
}

fn events(
    w: &mut Writer<'_>,
    batch: &EventBatch,
    options: EncodeOptions,
    packed: &[Option<PackedRun<'_>>],
) {
    w.array_len(batch.events.len());
    for (i, event) in batch.events.iter().enumerate() {
        match event {
            RawEvent::Stored(stored) => {
                let tokens = packed.get(i).copied().flatten();
                stored_event(w, stored, options, tokens)
            }
            RawEvent::Removed(removed) => removed_event(w, removed, options),
            RawEvent::Cleared => tag_only(w, "AllBlocksCleared", options.encoding),
            RawEvent::Unknown { tag } => tag_only(w, tag, options.encoding),
        }
    }
}

fn tag_only(w: &mut Writer<'_>, tag: &str, encoding: Encoding) {
    match encoding {
        Encoding::Array => w.array_len(1),
        Encoding::Map => {
            w.map_len(1);
            w.str("type");
        }
    }
    w.str(tag);
}

fn hash(w: &mut Writer<'_>, value: u64, hashes: HashEncoding) {
    match hashes {
        HashEncoding::Unsigned => w.uint(value),
        HashEncoding::Signed => w.int(value as i64),
        HashEncoding::Bytes => {
            let mut digest = [0u8; 32];
            digest[24..].copy_from_slice(&value.to_be_bytes());
            w.bin(&digest);
        }
    }
}

fn hash_list(w: &mut Writer<'_>, values: &[u64], hashes: HashEncoding) {
    w.array_len(values.len());
    for &value in values {
        hash(w, value, hashes);
    }
}

fn opt_uint(w: &mut Writer<'_>, value: Option<u64>) {
    match value {
        Some(v) => w.uint(v),
        None => w.nil(),
    }
}

fn opt_str(w: &mut Writer<'_>, value: Option<&str>) {
    match value {
        Some(v) => w.str(v),
        None => w.nil(),
    }
}

/// One field writer per `BlockStored` field, in declaration order.
fn stored_field(
    w: &mut Writer<'_>,
    s: &RawStored,
    index: usize,
    hashes: HashEncoding,
    tokens: Option<PackedRun<'_>>,
) {
    match index {
        0 => hash_list(w, &s.block_hashes, hashes),
        1 => match s.parent_block_hash {
            Some(parent) => hash(w, parent, hashes),
            None => w.nil(),
        },
        2 => match tokens {
            _ if s.is_eagle => eagle_pairs(w, &s.token_ids),
            Some(run) => {
                w.array_len(run.count);
                w.raw(run.bytes);
            }
            None => w.token_ids(&s.token_ids),
        },
        3 => w.uint(u64::from(s.block_size)),
        4 => opt_uint(w, s.lora_id),
        5 => opt_str(w, s.medium.as_deref()),
        6 => opt_str(w, s.lora_name.as_deref()),
        7 => match &s.extra_keys {
            None => w.nil(),
            Some(blocks) => {
                w.array_len(blocks.len());
                for block in blocks {
                    match block {
                        None => w.nil(),
                        Some(keys) => {
                            w.array_len(keys.len());
                            for key in keys {
                                w.extra_key(key);
                            }
                        }
                    }
                }
            }
        },
        8 => opt_uint(w, s.group_idx.map(u64::from)),
        9 => opt_str(w, s.kv_cache_spec_kind.as_deref()),
        _ => opt_uint(w, s.kv_cache_spec_sliding_window),
    }
}

/// SGLang's EAGLE `token_ids`: each id paired with the next (`len - 1` pairs).
fn eagle_pairs(w: &mut Writer<'_>, tokens: &[u32]) {
    w.array_len(tokens.len().saturating_sub(1));
    for pair in tokens.windows(2) {
        w.array_len(2);
        w.uint(u64::from(pair[0]));
        w.uint(u64::from(pair[1]));
    }
}

/// `block_mm_infos` as Dynamo's publishers write it: maps, `nil` for a block without any.
fn mm_infos(w: &mut Writer<'_>, infos: &[Option<BlockMmInfo>]) {
    w.array_len(infos.len());
    for info in infos {
        let Some(info) = info else {
            w.nil();
            continue;
        };
        w.map_len(1);
        w.str("mm_objects");
        w.array_len(info.mm_objects.len());
        for object in &info.mm_objects {
            w.map_len(2);
            w.str("mm_hash");
            w.uint(object.mm_hash);
            w.str("offsets");
            w.array_len(object.offsets.len());
            for &(start, end) in &object.offsets {
                w.array_len(2);
                w.uint(start);
                w.uint(end);
            }
        }
    }
}

const STORED_NAMES: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];

/// Fields 0..7 have no default in vLLM and are always written; 7.. are omitted when `None`.
const STORED_REQUIRED: usize = 7;

fn stored_event(
    w: &mut Writer<'_>,
    s: &RawStored,
    options: EncodeOptions,
    tokens: Option<PackedRun<'_>>,
) {
    match options.encoding {
        Encoding::Array => {
            w.array_len(1 + STORED_NAMES.len());
            w.str("BlockStored");
            for index in 0..STORED_NAMES.len() {
                stored_field(w, s, index, options.hashes, tokens);
            }
        }
        Encoding::Map => {
            let present = [
                s.extra_keys.is_some(),
                s.group_idx.is_some(),
                s.kv_cache_spec_kind.is_some(),
                s.kv_cache_spec_sliding_window.is_some(),
            ];
            let defaulted_present = present.iter().filter(|&&p| p).count();
            let map_only =
                usize::from(s.cache_salt.is_some()) + usize::from(s.block_mm_infos.is_some());
            w.map_len(1 + STORED_REQUIRED + defaulted_present + map_only);
            w.str("type");
            w.str("BlockStored");
            for (index, name) in STORED_NAMES.iter().enumerate() {
                if index >= STORED_REQUIRED && !present[index - STORED_REQUIRED] {
                    continue;
                }
                w.str(name);
                stored_field(w, s, index, options.hashes, tokens);
            }
            if let Some(salt) = &s.cache_salt {
                w.str("cache_salt");
                w.str(salt);
            }
            if let Some(infos) = &s.block_mm_infos {
                w.str("block_mm_infos");
                mm_infos(w, infos);
            }
        }
    }
}

fn removed_event(w: &mut Writer<'_>, r: &RawRemoved, options: EncodeOptions) {
    match options.encoding {
        Encoding::Array => {
            w.array_len(4);
            w.str("BlockRemoved");
            hash_list(w, &r.block_hashes, options.hashes);
            opt_str(w, r.medium.as_deref());
            opt_uint(w, r.group_idx.map(u64::from));
        }
        Encoding::Map => {
            w.map_len(3 + usize::from(r.group_idx.is_some()));
            w.str("type");
            w.str("BlockRemoved");
            w.str("block_hashes");
            hash_list(w, &r.block_hashes, options.hashes);
            w.str("medium");
            opt_str(w, r.medium.as_deref());
            if let Some(group) = r.group_idx {
                w.str("group_idx");
                w.uint(u64::from(group));
            }
        }
    }
}

/// A prompt's token ids written once in their msgpack form, for a publisher that sends the same
/// prompts' blocks again and again (the load generator's fake engines): the ids of any run of
/// whole blocks are then one copy instead of an encoding per id.
#[derive(Debug, Clone, Default)]
pub struct PackedTokens {
    bytes: Vec<u8>,
    /// Byte offset in `bytes` of every `block_size`-th id, then the end.
    block_starts: Vec<usize>,
    block_size: usize,
    len: usize,
}

/// The packed ids of a run of blocks: what [`encode_batch_packed`] writes as `token_ids`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedRun<'a> {
    bytes: &'a [u8],
    count: usize,
}

impl PackedRun<'_> {
    /// Ids in the run.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

impl PackedTokens {
    /// Packs `tokens`, cut in blocks of `block_size` (the last one may be partial).
    pub fn new(tokens: &[u32], block_size: u32) -> Self {
        let block_size = (block_size as usize).max(1);
        let mut bytes = Vec::with_capacity(5 * tokens.len());
        let mut block_starts = Vec::with_capacity(tokens.len().div_ceil(block_size) + 1);
        for block in tokens.chunks(block_size) {
            block_starts.push(bytes.len());
            Writer::new(&mut bytes).token_values(block);
        }
        block_starts.push(bytes.len());
        bytes.shrink_to_fit();
        Self {
            bytes,
            block_starts,
            block_size,
            len: tokens.len(),
        }
    }

    /// Ids packed.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ids of blocks `first..end` (`None` past the last block or when `first > end`).
    pub fn blocks(&self, first: usize, end: usize) -> Option<PackedRun<'_>> {
        let from = *self.block_starts.get(first)?;
        let to = *self.block_starts.get(end)?;
        let bytes = self.bytes.get(from..to)?;
        let count = (end * self.block_size).min(self.len) - (first * self.block_size).min(self.len);
        Some(PackedRun { bytes, count })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(tokens: Vec<u32>, blocks: usize) -> RawEvent {
        RawEvent::Stored(RawStored {
            block_hashes: (0..blocks as u64).map(|b| b * 7 + 1).collect(),
            parent_block_hash: Some(99),
            token_ids: tokens,
            block_size: 4,
            medium: Some("GPU".into()),
            ..RawStored::default()
        })
    }

    #[test]
    fn packed_token_runs_encode_as_the_ids_themselves() {
        // Every width: fixint, uint8, uint16, uint32.
        let tokens: Vec<u32> = (0..30u32)
            .map(|i| [5, 200, 40_000, 151_000, 4_000_000_000][i as usize % 5] + i)
            .collect();
        let packed = PackedTokens::new(&tokens, 4);
        assert_eq!(packed.len(), 30);
        for encoding in [Encoding::Array, Encoding::Map] {
            let options = EncodeOptions {
                encoding,
                ..EncodeOptions::default()
            };
            // Whole blocks from the start, from the middle, and to the partial last block.
            for (first, end) in [(0, 7), (2, 5), (3, 8), (7, 8), (4, 4)] {
                let own = &tokens[first * 4..(end * 4).min(tokens.len())];
                let blocks = own.len() / 4;
                let plain = EventBatch {
                    ts: 1.5,
                    events: vec![stored(own.to_vec(), blocks), RawEvent::Cleared],
                    data_parallel_rank: Some(1),
                };
                let mut light = plain.clone();
                light.events[0] = stored(Vec::new(), blocks);
                let run = packed.blocks(first, end).unwrap();
                assert_eq!(run.len(), own.len());
                assert_eq!(
                    encode_batch_packed(&light, options, &[Some(run)]),
                    encode_batch(&plain, options),
                    "{encoding:?} blocks {first}..{end}"
                );
                // No entry: the event's own ids.
                assert_eq!(
                    encode_batch_packed(&plain, options, &[None]),
                    encode_batch(&plain, options)
                );
            }
        }
        assert!(packed.blocks(0, 9).is_none());
        assert!(packed.blocks(5, 3).is_none());
        assert!(packed.blocks(8, 8).unwrap().is_empty());
        assert!(PackedTokens::new(&[], 4).blocks(0, 0).unwrap().is_empty());
    }
}
