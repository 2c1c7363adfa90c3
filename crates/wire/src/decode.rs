//! Decoding a KV-event batch payload, in either encoding, into [`EventBatch`].
//!
//! Fields are taken by position (array form) or by name (map form); unknown trailing elements
//! and unknown keys are skipped (after checking they are well-formed msgpack), so newer engines
//! that append fields still decode. Required fields: `block_hashes`, `token_ids` and
//! `block_size` of a `BlockStored` (and `parent_block_hash`, which the array form always
//! carries), `block_hashes` of a `BlockRemoved`; everything else defaults to `None`.
//!
//! As Dynamo 1.6.1 does, a `BlockStored`'s `token_ids` may also be SGLang's EAGLE bigram pairs
//! (`[[t0, t1], [t1, t2], ...]`, flattened into [`RawStored::token_ids`] with `is_eagle` set),
//! and Dynamo's own publishers may add `block_mm_infos` (`{"mm_objects": [{"mm_hash": u64,
//! "offsets": [[start, end], ...]}]}` or `nil` per block, either struct also as an array of its
//! fields in order): the map form as a key (with `cache_salt`), the array form as a list after
//! `extra_keys` (position 9, where vLLM has the integer `group_idx`).

use crate::error::WireError;
use crate::event::{EventBatch, ExtraKey, RawEvent, RawRemoved, RawStored};
use crate::msgpack::Reader;
use kvroute_core::hash::{BlockMmInfo, MmObject};

/// Decodes one msgpack payload (the third frame of a live message) into a batch.
///
/// Never panics; any malformed input (truncated, wrong types, nesting deeper than
/// [`crate::MAX_DEPTH`], trailing bytes) is a [`WireError`]. Work and memory are linear in
/// `payload.len()`.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, WireError> {
    let mut r = Reader::new(payload);
    let batch = match r.peek_container()? {
        Some(true) => array_batch(&mut r)?,
        Some(false) => map_batch(&mut r)?,
        None => {
            return Err(WireError::UnexpectedType {
                field: "batch",
                expected: "array or map",
                found: crate::msgpack::marker_name(r.peek()?),
                offset: 0,
            });
        }
    };
    if r.remaining() != 0 {
        return Err(WireError::TrailingBytes {
            trailing: r.remaining(),
        });
    }
    Ok(batch)
}

/// `[ts, events]` or `[ts, events, data_parallel_rank, ...]`.
fn array_batch(r: &mut Reader<'_>) -> Result<EventBatch, WireError> {
    let len = r.array_len("batch")?;
    if len < 2 {
        return Err(WireError::MissingField {
            context: "batch",
            field: if len == 0 { "ts" } else { "events" },
        });
    }
    let ts = r.f64("ts")?;
    let events = events(r)?;
    let data_parallel_rank = if len >= 3 {
        r.opt_u32("data_parallel_rank")?
    } else {
        None
    };
    for _ in 3..len {
        r.skip(2)?;
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// `{"ts": ..., "events": [...], "data_parallel_rank": ...}`; `dp_rank` is accepted as an alias
/// (as Dynamo does).
fn map_batch(r: &mut Reader<'_>) -> Result<EventBatch, WireError> {
    let len = r.map_len("batch")?;
    let mut ts = None;
    let mut events_seen = None;
    let mut data_parallel_rank = None;
    for _ in 0..len {
        match r.str("batch key")? {
            "ts" => ts = Some(r.f64("ts")?),
            "events" => events_seen = Some(events(r)?),
            "data_parallel_rank" | "dp_rank" => {
                data_parallel_rank = r.opt_u32("data_parallel_rank")?;
            }
            _ => r.skip(2)?,
        }
    }
    Ok(EventBatch {
        ts: ts.ok_or(WireError::MissingField {
            context: "batch",
            field: "ts",
        })?,
        events: events_seen.ok_or(WireError::MissingField {
            context: "batch",
            field: "events",
        })?,
        data_parallel_rank,
    })
}

fn events(r: &mut Reader<'_>) -> Result<Vec<RawEvent>, WireError> {
    let len = r.array_len("events")?;
    let mut out = Vec::with_capacity(r.capacity(len));
    for _ in 0..len {
        out.push(event(r)?);
    }
    Ok(out)
}

fn event(r: &mut Reader<'_>) -> Result<RawEvent, WireError> {
    match r.peek_container()? {
        Some(true) => array_event(r),
        Some(false) => map_event(r),
        None => Err(WireError::UnexpectedType {
            field: "event",
            expected: "array or map",
            found: crate::msgpack::marker_name(r.peek()?),
            offset: r.offset(),
        }),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown(String),
}

impl Tag {
    fn parse(tag: &str) -> Tag {
        match tag {
            "BlockStored" => Tag::Stored,
            "BlockRemoved" => Tag::Removed,
            "AllBlocksCleared" => Tag::Cleared,
            other => Tag::Unknown(other.to_owned()),
        }
    }
}

/// The fields of every event type, by wire name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    /// Map form only (Dynamo's own publishers).
    CacheSalt,
    /// Map form only (Dynamo's own publishers).
    BlockMmInfos,
}

/// `BlockStored` fields in vLLM's declaration order (the array form's positions after the tag).
const STORED_FIELDS: [Field; 11] = [
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::KvCacheSpecKind,
    Field::KvCacheSpecSlidingWindow,
];

/// `BlockRemoved` fields in vLLM's declaration order.
const REMOVED_FIELDS: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];

impl Field {
    fn by_name(name: &str) -> Option<Field> {
        Some(match name {
            "block_hashes" => Field::BlockHashes,
            "parent_block_hash" => Field::ParentBlockHash,
            "token_ids" => Field::TokenIds,
            "block_size" => Field::BlockSize,
            "lora_id" => Field::LoraId,
            "medium" => Field::Medium,
            "lora_name" => Field::LoraName,
            "extra_keys" => Field::ExtraKeys,
            "group_idx" => Field::GroupIdx,
            "kv_cache_spec_kind" => Field::KvCacheSpecKind,
            "kv_cache_spec_sliding_window" => Field::KvCacheSpecSlidingWindow,
            "cache_salt" => Field::CacheSalt,
            "block_mm_infos" => Field::BlockMmInfos,
            _ => return None,
        })
    }
}

/// Fields seen so far; `None` means absent (or nil for optional fields).
#[derive(Debug, Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent_seen: bool,
    parent_block_hash: Option<u64>,
    token_ids: Option<Vec<u32>>,
    is_eagle: bool,
    block_size: Option<u32>,
    lora_id: Option<u64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<String>,
    kv_cache_spec_sliding_window: Option<u64>,
    cache_salt: Option<String>,
    block_mm_infos: Option<Vec<Option<BlockMmInfo>>>,
}

impl Fields {
    fn read(&mut self, r: &mut Reader<'_>, field: Field) -> Result<(), WireError> {
        match field {
            Field::BlockHashes => self.block_hashes = Some(r.block_hashes("block_hashes")?),
            Field::ParentBlockHash => {
                self.parent_seen = true;
                self.parent_block_hash = r.opt_block_hash("parent_block_hash")?;
            }
            Field::TokenIds => {
                let (tokens, is_eagle) = token_ids(r)?;
                self.token_ids = Some(tokens);
                self.is_eagle = is_eagle;
            }
            Field::BlockSize => self.block_size = Some(r.u32_value("block_size")?),
            Field::LoraId => self.lora_id = r.opt_uint("lora_id")?,
            Field::Medium => self.medium = r.opt_str("medium")?.map(str::to_owned),
            Field::LoraName => self.lora_name = r.opt_str("lora_name")?.map(str::to_owned),
            Field::ExtraKeys => self.extra_keys = extra_keys(r)?,
            Field::GroupIdx => self.group_idx = r.opt_u32("group_idx")?,
            Field::KvCacheSpecKind => {
                self.kv_cache_spec_kind = r.opt_str("kv_cache_spec_kind")?.map(str::to_owned);
            }
            Field::KvCacheSpecSlidingWindow => {
                self.kv_cache_spec_sliding_window = r.opt_uint("kv_cache_spec_sliding_window")?;
            }
            Field::CacheSalt => self.cache_salt = r.opt_str("cache_salt")?.map(str::to_owned),
            Field::BlockMmInfos => self.block_mm_infos = block_mm_infos(r)?,
        }
        Ok(())
    }

    fn into_event(self, tag: Tag) -> Result<RawEvent, WireError> {
        Ok(match tag {
            Tag::Stored => RawEvent::Stored(RawStored {
                block_hashes: self.block_hashes.ok_or(WireError::MissingField {
                    context: "BlockStored",
                    field: "block_hashes",
                })?,
                parent_block_hash: self.parent_block_hash,
                token_ids: self.token_ids.ok_or(WireError::MissingField {
                    context: "BlockStored",
                    field: "token_ids",
                })?,
                block_size: self.block_size.ok_or(WireError::MissingField {
                    context: "BlockStored",
                    field: "block_size",
                })?,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                extra_keys: self.extra_keys,
                group_idx: self.group_idx,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window,
                is_eagle: self.is_eagle,
                cache_salt: self.cache_salt,
                block_mm_infos: self.block_mm_infos,
            }),
            Tag::Removed => RawEvent::Removed(RawRemoved {
                block_hashes: self.block_hashes.ok_or(WireError::MissingField {
                    context: "BlockRemoved",
                    field: "block_hashes",
                })?,
                medium: self.medium,
                group_idx: self.group_idx,
            }),
            Tag::Cleared => RawEvent::Cleared,
            Tag::Unknown(tag) => RawEvent::Unknown { tag },
        })
    }
}

/// `token_ids`: a list of ids, or SGLang's EAGLE bigram pairs `[[t0, t1], [t1, t2], ...]`,
/// flattened as Dynamo does (each pair's first id, then the last pair's second) with `true`.
/// An empty list is plain.
fn token_ids(r: &mut Reader<'_>) -> Result<(Vec<u32>, bool), WireError> {
    let mut probe = r.clone();
    let pairs = probe.array_len("token_ids")?;
    if pairs == 0 || probe.peek_container()? != Some(true) {
        return Ok((r.token_ids("token_ids")?, false));
    }
    let pairs = r.array_len("token_ids")?;
    let mut out = Vec::with_capacity(r.capacity(pairs) + 1);
    let mut last = 0;
    for _ in 0..pairs {
        if r.array_len("token_ids")? != 2 {
            return Err(WireError::InvalidValue {
                field: "token_ids",
                value: "a bigram that is not 2 ids".to_string(),
                reason: "EAGLE token ids are [token, next token] pairs",
            });
        }
        out.push(r.u32_value("token_ids")?);
        last = r.u32_value("token_ids")?;
    }
    out.push(last);
    Ok((out, true))
}

/// `block_mm_infos`: `nil`, or one `nil` or `BlockExtraInfo` per block.
fn block_mm_infos(r: &mut Reader<'_>) -> Result<Option<Vec<Option<BlockMmInfo>>>, WireError> {
    if r.nil()? {
        return Ok(None);
    }
    let blocks = r.array_len("block_mm_infos")?;
    let mut out = Vec::with_capacity(r.capacity(blocks));
    for _ in 0..blocks {
        if r.nil()? {
            out.push(None);
            continue;
        }
        let mm_objects = struct_fields(r, "block_mm_infos", &["mm_objects"], |r, _| {
            let objects = r.array_len("mm_objects")?;
            let mut out = Vec::with_capacity(r.capacity(objects));
            for _ in 0..objects {
                out.push(mm_object(r)?);
            }
            Ok(out)
        })?;
        let [Some(mm_objects)] = mm_objects else {
            return Err(WireError::MissingField {
                context: "block_mm_infos",
                field: "mm_objects",
            });
        };
        out.push(Some(BlockMmInfo { mm_objects }));
    }
    Ok(Some(out))
}

/// Reads one struct written as a map (by name, unknown keys skipped) or as an array (by
/// position, extra elements skipped), calling `read(r, index)` for each of `names`' fields.
/// Every field is required.
fn struct_fields<T, const N: usize>(
    r: &mut Reader<'_>,
    context: &'static str,
    names: &[&'static str; N],
    mut read: impl FnMut(&mut Reader<'_>, usize) -> Result<T, WireError>,
) -> Result<[Option<T>; N], WireError> {
    let mut values: [Option<T>; N] = std::array::from_fn(|_| None);
    match r.peek_container()? {
        Some(true) => {
            let len = r.array_len(context)?;
            for position in 0..len {
                match values.get_mut(position) {
                    Some(slot) => *slot = Some(read(r, position)?),
                    None => r.skip(4)?,
                }
            }
        }
        Some(false) => {
            let len = r.map_len(context)?;
            for _ in 0..len {
                let key = r.str(context)?;
                match names.iter().position(|&name| name == key) {
                    Some(index) => values[index] = Some(read(r, index)?),
                    None => r.skip(4)?,
                }
            }
        }
        None => {
            return Err(WireError::UnexpectedType {
                field: context,
                expected: "map or array",
                found: crate::msgpack::marker_name(r.peek()?),
                offset: r.offset(),
            });
        }
    }
    if let Some(missing) = values.iter().position(Option::is_none) {
        return Err(WireError::MissingField {
            context,
            field: names[missing],
        });
    }
    Ok(values)
}

/// One `BlockMmObjectInfo`: `{"mm_hash": u64, "offsets": [[start, end], ...]}`.
fn mm_object(r: &mut Reader<'_>) -> Result<MmObject, WireError> {
    enum Part {
        Hash(u64),
        Offsets(Vec<(u64, u64)>),
    }
    let parts = struct_fields(r, "mm_objects", &["mm_hash", "offsets"], |r, index| {
        if index == 0 {
            return Ok(Part::Hash(r.uint("mm_hash")?));
        }
        let pairs = r.array_len("offsets")?;
        let mut out = Vec::with_capacity(r.capacity(pairs));
        for _ in 0..pairs {
            if r.array_len("offsets")? != 2 {
                return Err(WireError::InvalidValue {
                    field: "offsets",
                    value: "an offset that is not 2 numbers".to_string(),
                    reason: "offsets are [start, end] pairs",
                });
            }
            out.push((r.uint("offsets")?, r.uint("offsets")?));
        }
        Ok(Part::Offsets(out))
    })?;
    match parts {
        [Some(Part::Hash(mm_hash)), Some(Part::Offsets(offsets))] => {
            Ok(MmObject { mm_hash, offsets })
        }
        _ => Err(WireError::MissingField {
            context: "mm_objects",
            field: "mm_hash",
        }),
    }
}

/// `list[tuple[Any, ...] | None] | None`.
fn extra_keys(r: &mut Reader<'_>) -> Result<Option<Vec<Option<Vec<ExtraKey>>>>, WireError> {
    if r.nil()? {
        return Ok(None);
    }
    let blocks = r.array_len("extra_keys")?;
    let mut out = Vec::with_capacity(r.capacity(blocks));
    for _ in 0..blocks {
        if r.nil()? {
            out.push(None);
            continue;
        }
        let items = r.array_len("extra_keys")?;
        let mut keys = Vec::with_capacity(r.capacity(items));
        for _ in 0..items {
            keys.push(r.extra_key(6)?);
        }
        out.push(Some(keys));
    }
    Ok(Some(out))
}

/// `["BlockStored", block_hashes, parent_block_hash, ...]`: msgspec's `array_like=True,
/// tag=True` layout, tag first, then fields in declaration order.
fn array_event(r: &mut Reader<'_>) -> Result<RawEvent, WireError> {
    let len = r.array_len("event")?;
    if len == 0 {
        return Err(WireError::MissingField {
            context: "event",
            field: "type",
        });
    }
    let tag = Tag::parse(r.str("event type")?);
    let layout: &[Field] = match tag {
        Tag::Stored => &STORED_FIELDS,
        Tag::Removed => &REMOVED_FIELDS,
        Tag::Cleared | Tag::Unknown(_) => &[],
    };
    let mut fields = Fields::default();
    for position in 1..len {
        // Dynamo's own publishers append `block_mm_infos` after `extra_keys` (position 9, where
        // vLLM has `group_idx`); a list there or later is that, as Dynamo 1.6.1 reads it.
        if tag == Tag::Stored && position > 8 && r.peek_container()? == Some(true) {
            fields.read(r, Field::BlockMmInfos)?;
            continue;
        }
        match layout.get(position - 1) {
            Some(&field) => fields.read(r, field)?,
            None => r.skip(4)?,
        }
    }
    if tag == Tag::Stored && !fields.parent_seen && fields.block_hashes.is_some() {
        return Err(WireError::MissingField {
            context: "BlockStored",
            field: "parent_block_hash",
        });
    }
    fields.into_event(tag)
}

/// `{"type": "BlockStored", "block_hashes": [...], ...}`: msgspec's `tag=True` map layout. The
/// tag is looked up by name, so key order does not matter; once an unknown tag is seen the
/// remaining values are skipped unread.
fn map_event(r: &mut Reader<'_>) -> Result<RawEvent, WireError> {
    let len = r.map_len("event")?;
    let mut tag = None;
    let mut fields = Fields::default();
    for _ in 0..len {
        let key = r.str("event key")?;
        if key == "type" {
            tag = Some(Tag::parse(r.str("event type")?));
            continue;
        }
        let known = Field::by_name(key);
        match (known, &tag) {
            (Some(field), None | Some(Tag::Stored | Tag::Removed)) => fields.read(r, field)?,
            _ => r.skip(4)?,
        }
    }
    let tag = tag.ok_or(WireError::MissingField {
        context: "event",
        field: "type",
    })?;
    fields.into_event(tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_that_is_neither_array_nor_map_is_rejected() {
        assert!(matches!(
            decode_batch(&[0xc0]),
            Err(WireError::UnexpectedType { field: "batch", .. })
        ));
        assert!(matches!(
            decode_batch(&[]),
            Err(WireError::Truncated { .. })
        ));
    }

    #[test]
    fn short_batches_name_the_missing_field() {
        assert_eq!(
            decode_batch(&[0x91, 0x00]),
            Err(WireError::MissingField {
                context: "batch",
                field: "events"
            })
        );
        // {"ts": 1} without events.
        assert_eq!(
            decode_batch(&[0x81, 0xa2, b't', b's', 0x01]),
            Err(WireError::MissingField {
                context: "batch",
                field: "events"
            })
        );
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        // [0, []] then a stray nil.
        assert_eq!(
            decode_batch(&[0x92, 0x00, 0x90, 0xc0]),
            Err(WireError::TrailingBytes { trailing: 1 })
        );
    }

    #[test]
    fn an_empty_batch_decodes() {
        let batch = decode_batch(&[0x92, 0x00, 0x90]).unwrap();
        assert_eq!(batch.events, vec![]);
        assert_eq!(batch.data_parallel_rank, None);
    }
}
