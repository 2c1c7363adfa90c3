//! Rust mirrors of vLLM's msgspec event classes, with every field the wire carries.
//!
//! These are *raw* values: exactly what the engine said, before kvroute's own hashing and
//! filtering ([`crate::convert`]) turns them into [`kvroute_core::event::KvEvent`]s.

use kvroute_core::hash::{BlockMmInfo, MmObject};
use std::borrow::Cow;

/// A decoded `KVEventBatch`: `[ts, events, data_parallel_rank]` or `{ts, events,
/// data_parallel_rank}`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    /// Seconds since the epoch at which the engine built the batch.
    pub ts: f64,
    /// The batch's events, in engine order.
    pub events: Vec<RawEvent>,
    /// The publishing rank, when the batch names one; it overrides the rank the endpoint was
    /// registered for (SPEC §3.1).
    pub data_parallel_rank: Option<u32>,
}

/// One `KVCacheEvent`.
#[derive(Debug, Clone, PartialEq)]
pub enum RawEvent {
    /// `BlockStored`.
    Stored(RawStored),
    /// `BlockRemoved`.
    Removed(RawRemoved),
    /// `AllBlocksCleared`.
    Cleared,
    /// An event whose tag this crate does not know (a newer engine). Decoding keeps going; the
    /// conversion counts it and drops it.
    Unknown { tag: String },
}

/// `BlockStored`: new full blocks, chained under `parent_block_hash`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RawStored {
    /// The engine's ids of the new blocks, in prompt order.
    pub block_hashes: Vec<u64>,
    /// The engine id of the block the new ones follow, or `None` at the start of a prompt.
    pub parent_block_hash: Option<u64>,
    /// The tokens of the new blocks: `block_hashes.len() * block_size` of them (one more with
    /// `is_eagle`).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated LoRA adapter id (vLLM keeps it for compatibility); not used for hashing.
    pub lora_id: Option<u64>,
    /// Where the blocks live (`"GPU"`, `"CPU"`, ...); `None` means the device.
    pub medium: Option<String>,
    /// LoRA adapter name; enters the local-hash seed (SPEC §2).
    pub lora_name: Option<String>,
    /// vLLM's per-block extra hash keys: one entry per block, `None` for a block without any.
    /// See [`RawStored::cache_salt`] for the layout.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// The KV cache group (hybrid models); `None` on engines without groups.
    pub group_idx: Option<u32>,
    /// The group's cache spec kind (`"full_attention"`, `"sliding_window"`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// The sliding window of a sliding-window group, in tokens.
    pub kv_cache_spec_sliding_window: Option<u64>,
    /// SGLang's EAGLE layout: `token_ids` came as `[token, next token]` bigram pairs, kept here
    /// flattened as Dynamo does (each pair's first token, then the last pair's second), so
    /// each block's local hash covers its `block_size` tokens and the next one.
    pub is_eagle: bool,
    /// A top-level `cache_salt` key (map form only; Dynamo reads it before `extra_keys`).
    pub cache_salt: Option<String>,
    /// A top-level `block_mm_infos` key (map form only): per block, its multimodal objects.
    /// Dynamo reads it before the multimodal markers of `extra_keys`.
    pub block_mm_infos: Option<Vec<Option<BlockMmInfo>>>,
}

/// `BlockRemoved`: blocks that left the given medium.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RawRemoved {
    /// The engine ids of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// Where the blocks were; `None` means the device.
    pub medium: Option<String>,
    /// The KV cache group (hybrid models).
    pub group_idx: Option<u32>,
}

/// One item of a block's extra keys: any msgpack value (vLLM puts strings, bytes, ints and
/// `(identifier, offset)` tuples there).
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    Nil,
    Bool(bool),
    /// A negative integer (non-negative ones decode as [`ExtraKey::UInt`]).
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Ext {
        kind: i8,
        data: Vec<u8>,
    },
    Array(Vec<ExtraKey>),
    Map(Vec<(ExtraKey, ExtraKey)>),
}

impl RawStored {
    /// The cache salt the blocks are hashed with.
    ///
    /// In Dynamo 1.6.1's order: the top-level `cache_salt` key when present, else, when this
    /// event starts a prompt, the salt in block 0's extra keys.
    ///
    /// vLLM (`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`) builds each
    /// block's extra keys as `lora_extra_keys + mm_extra_keys + cache_salt_keys +
    /// prompt_embeds_keys`, where
    /// - `lora_extra_keys` is `[lora_name]` (a str; very old releases put the int LoRA id),
    /// - `mm_extra_keys` are `(identifier, offset)` tuples, or in older releases bare
    ///   multimodal hash strings (64 hex digits),
    /// - `cache_salt_keys` is `[cache_salt]` **only for the block starting at token 0**,
    /// - `prompt_embeds_keys` are bytes.
    ///
    /// Dynamo's vLLM workers hand vLLM the salt as `"dynamo-cache-salt:" + salt`, and Dynamo
    /// reads only that form: the first str item of block 0 with the prefix (not counting item 0
    /// when it equals `lora_name`) gives the salt after the prefix. kvroute does the same, and
    /// for engines run without Dynamo (whose salt is the bare string) falls back to the last
    /// str item that is not the LoRA name (item 0), not a Dynamo multimodal marker
    /// ([`dynamo_mm_hash`]) and, when the tuple has no array item (the older multimodal layout),
    /// not a bare 64-hex-digit hash. A bare salt that is itself 64 hex digits is therefore
    /// missed on engines using that older layout.
    ///
    /// vLLM does not repeat the salt on later blocks, so an event that continues a salted
    /// prompt (`parent_block_hash` set) carries no salt; see [`crate::convert`].
    pub fn cache_salt(&self) -> Option<&str> {
        if let Some(salt) = &self.cache_salt {
            return Some(salt);
        }
        if self.parent_block_hash.is_some() {
            return None;
        }
        let keys = self.extra_keys.as_ref()?.first()?.as_ref()?;
        let lora_name = self.lora_name.as_deref();
        let strings = || {
            keys.iter()
                .enumerate()
                .filter_map(|(i, key)| match key {
                    ExtraKey::Str(s) => Some((i, s.as_str())),
                    _ => None,
                })
                .filter(move |&(i, s)| !(i == 0 && lora_name == Some(s)))
        };
        let tagged = strings()
            .filter_map(|(_, s)| s.strip_prefix(DYNAMO_CACHE_SALT_PREFIX))
            .find(|salt| !salt.is_empty());
        if tagged.is_some() {
            return tagged;
        }
        let old_multimodal_layout = !keys.iter().any(|k| matches!(k, ExtraKey::Array(_)));
        strings()
            .filter(|&(_, s)| dynamo_mm_hash(s).is_none())
            .filter(|&(_, s)| !(old_multimodal_layout && is_multimodal_hash(s)))
            .map(|(_, s)| s)
            .next_back()
    }

    /// The blocks' multimodal objects for hashing: the `block_mm_infos` key when present, else
    /// the Dynamo multimodal markers of each block's extra keys ([`dynamo_mm_hash`], as a bare
    /// str item or as the identifier of an `(identifier, offset)` tuple), with no offsets.
    /// Empty when no block has any. vLLM's own multimodal identifiers are not Dynamo's hashes
    /// and are ignored, as Dynamo 1.6.1 does.
    pub fn mm_infos(&self) -> Cow<'_, [Option<BlockMmInfo>]> {
        if let Some(infos) = &self.block_mm_infos {
            return Cow::Borrowed(infos);
        }
        let Some(blocks) = &self.extra_keys else {
            return Cow::Borrowed(&[]);
        };
        let marker = |key: &ExtraKey| match key {
            ExtraKey::Str(s) => dynamo_mm_hash(s),
            ExtraKey::Array(items) => match items.as_slice() {
                [ExtraKey::Str(s), ExtraKey::Int(_) | ExtraKey::UInt(_)] => dynamo_mm_hash(s),
                _ => None,
            },
            _ => None,
        };
        if !blocks
            .iter()
            .flatten()
            .flatten()
            .any(|key| marker(key).is_some())
        {
            return Cow::Borrowed(&[]);
        }
        Cow::Owned(
            blocks
                .iter()
                .map(|keys| {
                    let mm_objects: Vec<MmObject> = keys
                        .iter()
                        .flatten()
                        .filter_map(marker)
                        .map(|mm_hash| MmObject {
                            mm_hash,
                            offsets: Vec::new(),
                        })
                        .collect();
                    (!mm_objects.is_empty()).then_some(BlockMmInfo { mm_objects })
                })
                .collect(),
        )
    }
}

/// The prefix Dynamo's vLLM workers put before a request's cache salt in vLLM's extra keys.
pub const DYNAMO_CACHE_SALT_PREFIX: &str = "dynamo-cache-salt:";

/// The multimodal hash in Dynamo's extra-key marker: 64 characters, the hash as 16 hex digits
/// followed by 48 `'0'`s (what Dynamo's workers hand vLLM as a multimodal identifier).
pub fn dynamo_mm_hash(s: &str) -> Option<u64> {
    let bytes = s.as_bytes();
    if bytes.len() != 64
        || !bytes[..16].iter().all(u8::is_ascii_hexdigit)
        || !bytes[16..].iter().all(|&b| b == b'0')
    {
        return None;
    }
    u64::from_str_radix(&s[..16], 16).ok()
}

/// The marker [`dynamo_mm_hash`] reads: `mm_hash` as 16 lowercase hex digits and 48 `'0'`s.
pub fn dynamo_mm_marker(mm_hash: u64) -> String {
    format!("{mm_hash:016x}{}", "0".repeat(48))
}

/// A bare vLLM multimodal hash: 64 hex digits.
fn is_multimodal_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The extra keys vLLM would attach to `num_blocks` blocks of one request starting at token 0:
/// `lora_name` on every block, then `cache_salt` on block 0 only; `None` when neither applies
/// (vLLM sends `extra_keys = None` when no block has any). Empty strings count as absent.
pub fn vllm_extra_keys(
    num_blocks: usize,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Option<Vec<Option<Vec<ExtraKey>>>> {
    let lora_name = lora_name.filter(|s| !s.is_empty());
    let cache_salt = cache_salt.filter(|s| !s.is_empty());
    if lora_name.is_none() && cache_salt.is_none() {
        return None;
    }
    let blocks = (0..num_blocks)
        .map(|i| {
            let mut keys = Vec::new();
            if let Some(lora) = lora_name {
                keys.push(ExtraKey::Str(lora.to_owned()));
            }
            if let (0, Some(salt)) = (i, cache_salt) {
                keys.push(ExtraKey::Str(salt.to_owned()));
            }
            (!keys.is_empty()).then_some(keys)
        })
        .collect();
    Some(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(extra: Vec<ExtraKey>, lora: Option<&str>) -> RawStored {
        RawStored {
            lora_name: lora.map(str::to_owned),
            extra_keys: Some(vec![Some(extra), None]),
            ..RawStored::default()
        }
    }

    fn s(v: &str) -> ExtraKey {
        ExtraKey::Str(v.to_owned())
    }

    #[test]
    fn salt_is_the_last_string_of_block_zero() {
        assert_eq!(stored(vec![s("salt-1")], None).cache_salt(), Some("salt-1"));
        assert_eq!(
            stored(vec![s("adapter"), s("salt-1")], Some("adapter")).cache_salt(),
            Some("salt-1")
        );
        assert_eq!(
            stored(vec![s("adapter")], Some("adapter")).cache_salt(),
            None
        );
        // Same string for adapter and salt: item 0 is the adapter, item 1 the salt.
        assert_eq!(
            stored(vec![s("x"), s("x")], Some("x")).cache_salt(),
            Some("x")
        );
    }

    #[test]
    fn multimodal_items_and_prompt_embeds_are_not_the_salt() {
        let mm = ExtraKey::Array(vec![s(&"ab".repeat(32)), ExtraKey::UInt(3)]);
        let embeds = ExtraKey::Bytes(vec![7; 32]);
        assert_eq!(
            stored(
                vec![s("lora"), mm.clone(), s("salt"), embeds.clone()],
                Some("lora")
            )
            .cache_salt(),
            Some("salt")
        );
        assert_eq!(stored(vec![mm, embeds], None).cache_salt(), None);
        // Older layout: a bare multimodal hash string.
        assert_eq!(stored(vec![s(&"0f".repeat(32))], None).cache_salt(), None);
        assert_eq!(
            stored(vec![s(&"0f".repeat(32)), s("salt")], None).cache_salt(),
            Some("salt")
        );
        // Very old layout: an int LoRA id first.
        assert_eq!(
            stored(vec![ExtraKey::UInt(1), s("salt")], None).cache_salt(),
            Some("salt")
        );
    }

    #[test]
    fn dynamo_tagged_salts_come_first_and_markers_are_never_salts() {
        assert_eq!(
            stored(vec![s("dynamo-cache-salt:tenant-a")], None).cache_salt(),
            Some("tenant-a")
        );
        assert_eq!(
            stored(vec![s("dynamo-cache-salt:t"), s("bare")], None).cache_salt(),
            Some("t")
        );
        // Item 0 is the LoRA name even when it looks like a tagged salt.
        assert_eq!(
            stored(
                vec![s("dynamo-cache-salt:a"), s("dynamo-cache-salt:b")],
                Some("dynamo-cache-salt:a")
            )
            .cache_salt(),
            Some("b")
        );
        let marker = dynamo_mm_marker(7);
        assert_eq!(stored(vec![s(&marker)], None).cache_salt(), None);
        let tuple = ExtraKey::Array(vec![s("image-0"), ExtraKey::UInt(0)]);
        assert_eq!(stored(vec![tuple, s(&marker)], None).cache_salt(), None);
        // The map form's key wins, even on a continuation event.
        let mut event = stored(vec![s("dynamo-cache-salt:t")], None);
        event.cache_salt = Some("top".into());
        event.parent_block_hash = Some(1);
        assert_eq!(event.cache_salt(), Some("top"));
    }

    #[test]
    fn dynamo_markers_carry_a_u64_in_16_hex_digits_and_48_zeros() {
        assert_eq!(dynamo_mm_marker(0x0123_4567_89ab_cdef).len(), 64);
        assert_eq!(
            dynamo_mm_hash(&dynamo_mm_marker(0x0123_4567_89ab_cdef)),
            Some(0x0123_4567_89ab_cdef)
        );
        assert_eq!(dynamo_mm_hash(&dynamo_mm_marker(u64::MAX)), Some(u64::MAX));
        assert_eq!(
            dynamo_mm_hash(&format!("0123456789ABCDEF{}", "0".repeat(48))),
            Some(0x0123_4567_89ab_cdef)
        );
        // vLLM's own 64-hex-digit hashes are not markers.
        assert_eq!(
            dynamo_mm_hash("0123456789abcdef00112233445566778899aabbccddeefffedcba9876543210"),
            None
        );
        assert_eq!(dynamo_mm_hash("123"), None);
        assert_eq!(
            dynamo_mm_hash(&format!("+123456789abcdef{}", "0".repeat(48))),
            None
        );
        let event = RawStored {
            extra_keys: Some(vec![
                None,
                Some(vec![
                    s("lora"),
                    ExtraKey::Array(vec![s(&dynamo_mm_marker(4)), ExtraKey::Int(-1)]),
                    s(&dynamo_mm_marker(2)),
                ]),
            ]),
            ..RawStored::default()
        };
        let infos = event.mm_infos();
        assert_eq!(infos.len(), 2);
        assert_eq!(infos[0], None);
        let hashes: Vec<u64> = infos[1]
            .iter()
            .flat_map(|i| i.mm_objects.iter().map(|o| o.mm_hash))
            .collect();
        assert_eq!(hashes, [4, 2]);
        assert!(RawStored::default().mm_infos().is_empty());
    }

    #[test]
    fn continuation_events_carry_no_salt() {
        let mut event = stored(vec![s("salt-1")], None);
        event.parent_block_hash = Some(9);
        assert_eq!(event.cache_salt(), None);
        let mut none = stored(vec![], None);
        none.extra_keys = Some(vec![None]);
        assert_eq!(none.cache_salt(), None);
    }

    #[test]
    fn vllm_extra_keys_put_the_salt_on_block_zero_only() {
        assert_eq!(vllm_extra_keys(3, None, None), None);
        assert_eq!(vllm_extra_keys(3, Some(""), Some("")), None);
        assert_eq!(
            vllm_extra_keys(2, None, Some("salt")),
            Some(vec![Some(vec![s("salt")]), None])
        );
        assert_eq!(
            vllm_extra_keys(2, Some("lora"), Some("salt")),
            Some(vec![
                Some(vec![s("lora"), s("salt")]),
                Some(vec![s("lora")])
            ])
        );
    }
}
