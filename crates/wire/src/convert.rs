//! Turning raw engine events into kvroute's [`KvEvent`]s (SPEC §3.1).
//!
//! For a `BlockStored`, kvroute recomputes each block's local hash from the event's tokens:
//! `token_ids` in chunks of the event's `block_size`, seeded with
//! `seed_for(lora_name, cache_salt)` ([`kvroute_core::hash::seed_for`]), where the salt comes
//! from block 0's extra keys ([`RawStored::cache_salt`]), exactly as a request with the same
//! tokens is hashed. As Dynamo does, an Eagle event's blocks (SGLang's bigram `token_ids`,
//! [`RawStored::is_eagle`]) each also cover the next token, and a block's multimodal objects
//! ([`RawStored::mm_infos`]: the `block_mm_infos` key, or Dynamo's markers in the extra keys)
//! enter its hash ([`kvroute_core::hash::local_hashes_with`]). The engine's own hashes are kept
//! as opaque ids for removal and parent lookup.
//!
//! An event is dropped (and counted in [`ConversionOutcome`]) when
//! - it belongs to a KV cache group that is not full attention: its `kv_cache_spec_kind` is set
//!   and is not one of [`FULL_ATTENTION_KINDS`], or the kind is absent and `group_idx` is set
//!   and not 0;
//! - its `medium` is not one [`Tier::from_medium`] knows (an empty `medium` counts as absent,
//!   i.e. the device, as Dynamo does);
//! - a `BlockStored` has `block_size == 0`, or `block_hashes.len() != token_ids.len() /
//!   block_size` (`(token_ids.len() - 1) / block_size` for an Eagle event);
//! - its type is unknown.
//!
//! Known gap: vLLM puts the cache salt only in the extra keys of the block starting at token 0,
//! so an event that continues a salted prompt (`parent_block_hash` set) carries no salt and is
//! hashed with the LoRA-only seed. An edge that needs exact salted continuations can remember
//! the seed per parent engine hash and call [`convert_stored_with_seed`].

use kvroute_core::event::{KvEvent, StoredBlock, Tier};
use kvroute_core::hash::{BlockExtras, block_count, block_hash, local_hashes_with, seed_for};

use crate::event::{EventBatch, RawEvent, RawRemoved, RawStored};

/// The `kv_cache_spec_kind` values whose events feed the prefix index (SPEC §3.1).
/// SPEC §3.1 names `full_attention`; vLLM's `KVCacheSpecKind` also reports MLA (DeepSeek-style)
/// and attention-sink models, whose KV cache is a full-prefix cache all the same. Dropping their
/// events would leave such fleets without prefix routing, so they feed the index too.
pub const FULL_ATTENTION_KINDS: &[&str] =
    &["full_attention", "mla_attention", "sink_full_attention"];

/// Why one event was not turned into a [`KvEvent`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DropReason {
    /// A hybrid model's non-full-attention group (sliding window, mamba, ...).
    #[error("event for KV cache group {group_idx:?} of kind {kind:?} is not full attention")]
    NotFullAttention {
        kind: Option<String>,
        group_idx: Option<u32>,
    },
    /// A `medium` with no tier.
    #[error("unknown medium {medium:?}")]
    UnknownMedium { medium: String },
    /// `block_size` 0.
    #[error("block size is 0")]
    ZeroBlockSize,
    /// The tokens do not make the announced number of blocks.
    #[error("{blocks} block hash(es) but {tokens} tokens at block size {block_size}")]
    BlockCountMismatch {
        blocks: usize,
        tokens: usize,
        block_size: u32,
    },
    /// An event type this crate does not know.
    #[error("unknown event type {tag:?}")]
    UnknownEventType { tag: String },
}

/// What happened to a batch's events, for metrics. Counts are per event unless named `_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConversionOutcome {
    pub stored_events: u32,
    pub stored_blocks: u64,
    pub removed_events: u32,
    pub removed_blocks: u64,
    pub cleared_events: u32,
    /// Dropped: non-full-attention group of a hybrid model.
    pub ignored_not_full_attention: u32,
    /// Dropped: unknown `medium`.
    pub unknown_medium: u32,
    /// Dropped: `block_size` 0.
    pub zero_block_size: u32,
    /// Dropped: block hashes and tokens disagree.
    pub block_count_mismatch: u32,
    /// Dropped: unknown event type.
    pub unknown_event_type: u32,
}

impl ConversionOutcome {
    /// Counts one event's fate.
    pub fn record(&mut self, result: &Result<KvEvent, DropReason>) {
        match result {
            Ok(KvEvent::Stored { blocks, .. }) => {
                self.stored_events += 1;
                self.stored_blocks += blocks.len() as u64;
            }
            Ok(KvEvent::Removed { engine_hashes, .. }) => {
                self.removed_events += 1;
                self.removed_blocks += engine_hashes.len() as u64;
            }
            Ok(KvEvent::Cleared) => self.cleared_events += 1,
            Err(DropReason::NotFullAttention { .. }) => self.ignored_not_full_attention += 1,
            Err(DropReason::UnknownMedium { .. }) => self.unknown_medium += 1,
            Err(DropReason::ZeroBlockSize) => self.zero_block_size += 1,
            Err(DropReason::BlockCountMismatch { .. }) => self.block_count_mismatch += 1,
            Err(DropReason::UnknownEventType { .. }) => self.unknown_event_type += 1,
        }
    }

    /// Events that did not become a [`KvEvent`].
    pub fn dropped(&self) -> u32 {
        self.ignored_not_full_attention
            + self.unknown_medium
            + self.zero_block_size
            + self.block_count_mismatch
            + self.unknown_event_type
    }
}

/// A batch converted for the index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Conversion {
    /// The batch's `data_parallel_rank`, which overrides the endpoint's registered rank.
    pub data_parallel_rank: Option<u32>,
    /// The events that feed the index, in batch order.
    pub events: Vec<KvEvent>,
    pub outcome: ConversionOutcome,
}

/// Converts every event of a batch, keeping order and counting what was dropped.
pub fn to_kv_events(batch: &EventBatch) -> Conversion {
    let mut conversion = Conversion {
        data_parallel_rank: batch.data_parallel_rank,
        events: Vec::with_capacity(batch.events.len()),
        outcome: ConversionOutcome::default(),
    };
    for event in &batch.events {
        let result = convert_event(event);
        conversion.outcome.record(&result);
        if let Ok(event) = result {
            conversion.events.push(event);
        }
    }
    conversion
}

/// Converts one event.
pub fn convert_event(event: &RawEvent) -> Result<KvEvent, DropReason> {
    match event {
        RawEvent::Stored(stored) => convert_stored(stored),
        RawEvent::Removed(removed) => convert_removed(removed),
        RawEvent::Cleared => Ok(KvEvent::Cleared),
        RawEvent::Unknown { tag } => Err(DropReason::UnknownEventType { tag: tag.clone() }),
    }
}

/// The local-hash seed of a stored event's blocks: its LoRA name and, when it starts a prompt,
/// the cache salt of block 0.
pub fn stored_seed(stored: &RawStored) -> u64 {
    seed_for(stored.lora_name.as_deref(), stored.cache_salt())
}

/// Converts a `BlockStored` with the seed from [`stored_seed`].
pub fn convert_stored(stored: &RawStored) -> Result<KvEvent, DropReason> {
    convert_stored_with_seed(stored, stored_seed(stored))
}

/// Converts a `BlockStored`, hashing its blocks with the given seed.
pub fn convert_stored_with_seed(stored: &RawStored, seed: u64) -> Result<KvEvent, DropReason> {
    check_group(stored.kv_cache_spec_kind.as_deref(), stored.group_idx)?;
    let tier = tier(stored.medium.as_deref())?;
    let block_size = stored.block_size as usize;
    if block_size == 0 {
        return Err(DropReason::ZeroBlockSize);
    }
    if stored.block_hashes.len() != block_count(stored.token_ids.len(), block_size, stored.is_eagle)
    {
        return Err(DropReason::BlockCountMismatch {
            blocks: stored.block_hashes.len(),
            tokens: stored.token_ids.len(),
            block_size: stored.block_size,
        });
    }
    let mm_infos = stored.mm_infos();
    let extras = BlockExtras {
        is_eagle: stored.is_eagle,
        block_mm_infos: &mm_infos,
    };
    let blocks = if extras.is_plain() {
        stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(block_size))
            .map(|(&engine_hash, tokens)| StoredBlock {
                engine_hash,
                local_hash: block_hash(tokens, seed),
            })
            .collect()
    } else {
        stored
            .block_hashes
            .iter()
            .zip(local_hashes_with(
                &stored.token_ids,
                block_size,
                seed,
                extras,
            ))
            .map(|(&engine_hash, local_hash)| StoredBlock {
                engine_hash,
                local_hash,
            })
            .collect()
    };
    Ok(KvEvent::Stored {
        parent: stored.parent_block_hash,
        blocks,
        tier,
    })
}

fn convert_removed(removed: &RawRemoved) -> Result<KvEvent, DropReason> {
    check_group(None, removed.group_idx)?;
    let tier = tier(removed.medium.as_deref())?;
    Ok(KvEvent::Removed {
        engine_hashes: removed.block_hashes.clone(),
        tier,
    })
}

/// Whether an event of this KV cache group feeds the prefix index (SPEC §3.1).
pub fn feeds_index(kv_cache_spec_kind: Option<&str>, group_idx: Option<u32>) -> bool {
    match kv_cache_spec_kind {
        Some(kind) => FULL_ATTENTION_KINDS.contains(&kind),
        None => group_idx.unwrap_or(0) == 0,
    }
}

fn check_group(kind: Option<&str>, group_idx: Option<u32>) -> Result<(), DropReason> {
    if feeds_index(kind, group_idx) {
        Ok(())
    } else {
        Err(DropReason::NotFullAttention {
            kind: kind.map(str::to_owned),
            group_idx,
        })
    }
}

fn tier(medium: Option<&str>) -> Result<Tier, DropReason> {
    let medium = medium.filter(|m| !m.is_empty());
    Tier::from_medium(medium).ok_or_else(|| DropReason::UnknownMedium {
        medium: medium.unwrap_or_default().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::hash::{BASE_SEED, BlockMmInfo, MmObject, local_hashes};

    fn stored(tokens: Vec<u32>, block_size: u32, hashes: Vec<u64>) -> RawStored {
        RawStored {
            block_hashes: hashes,
            token_ids: tokens,
            block_size,
            medium: Some("GPU".into()),
            ..RawStored::default()
        }
    }

    #[test]
    fn stored_blocks_get_local_hashes_of_their_tokens() {
        let tokens: Vec<u32> = (1..=16).collect();
        let event = convert_event(&RawEvent::Stored(stored(
            tokens.clone(),
            4,
            vec![10, 11, 12, 13],
        )))
        .unwrap();
        let expected = local_hashes(&tokens, 4, BASE_SEED);
        let KvEvent::Stored {
            parent,
            blocks,
            tier,
        } = event
        else {
            panic!("not stored: {event:?}");
        };
        assert_eq!(parent, None);
        assert_eq!(tier, Tier::Device);
        assert_eq!(
            blocks.iter().map(|b| b.engine_hash).collect::<Vec<_>>(),
            [10, 11, 12, 13]
        );
        assert_eq!(
            blocks.iter().map(|b| b.local_hash).collect::<Vec<_>>(),
            expected
        );
        // SPEC §2 vector: tokens 1..=17, block size 4, first local hash.
        assert_eq!(blocks[0].local_hash, 14643705804678351452);
    }

    #[test]
    fn lora_and_salt_enter_the_seed() {
        let tokens: Vec<u32> = (1..=8).collect();
        let mut event = stored(tokens, 4, vec![1, 2]);
        event.lora_name = Some("adapter-a".into());
        let KvEvent::Stored { blocks, .. } = convert_stored(&event).unwrap() else {
            panic!()
        };
        assert_eq!(blocks[0].local_hash, 11381080598872079209);
        assert_eq!(blocks[1].local_hash, 5698110331184095209);

        event.lora_name = None;
        event.extra_keys = crate::event::vllm_extra_keys(2, None, Some("salt-1"));
        let KvEvent::Stored { blocks, .. } = convert_stored(&event).unwrap() else {
            panic!()
        };
        assert_eq!(blocks[0].local_hash, 914885034549397476);
        assert_eq!(blocks[1].local_hash, 3069815956657004924);
    }

    /// Dynamo's local hashes of `tokens` in blocks of 4 with these multimodal infos.
    fn mm_local_hashes(tokens: &[u32], infos: &[Option<BlockMmInfo>]) -> Vec<u64> {
        let extras = BlockExtras {
            is_eagle: false,
            block_mm_infos: infos,
        };
        local_hashes_with(tokens, 4, BASE_SEED, extras)
    }

    fn local_of(event: &RawStored) -> Vec<u64> {
        match convert_stored(event) {
            Ok(KvEvent::Stored { blocks, .. }) => blocks.iter().map(|b| b.local_hash).collect(),
            other => panic!("not stored: {other:?}"),
        }
    }

    fn mm(hashes: &[u64]) -> Option<BlockMmInfo> {
        Some(BlockMmInfo {
            mm_objects: hashes
                .iter()
                .map(|&mm_hash| MmObject {
                    mm_hash,
                    offsets: Vec::new(),
                })
                .collect(),
        })
    }

    #[test]
    fn eagle_events_hash_each_block_with_the_next_token() {
        // SGLang's pairs (1,2) .. (8,9), flattened: 1..=9, two blocks of 4 plus one token.
        let mut event = stored((1..=9).collect(), 4, vec![10, 11]);
        event.is_eagle = true;
        let expected = local_hashes_with(
            &event.token_ids,
            4,
            BASE_SEED,
            BlockExtras {
                is_eagle: true,
                block_mm_infos: &[],
            },
        );
        assert_eq!(local_of(&event), expected);
        assert_eq!(expected[0], block_hash(&[1, 2, 3, 4, 5], BASE_SEED));
        assert_ne!(expected, local_hashes(&event.token_ids, 4, BASE_SEED));
        // Eight flattened tokens make only one Eagle block.
        event.token_ids.pop();
        assert_eq!(
            convert_stored(&event),
            Err(DropReason::BlockCountMismatch {
                blocks: 2,
                tokens: 8,
                block_size: 4
            })
        );
    }

    #[test]
    fn dynamo_multimodal_markers_in_extra_keys_enter_the_hashes() {
        use crate::event::{ExtraKey, dynamo_mm_marker};
        let tokens: Vec<u32> = (1..=12).collect();
        let native_vllm_hash = "ab".repeat(32);
        let mut event = stored(tokens.clone(), 4, vec![1, 2, 3]);
        event.extra_keys = Some(vec![
            Some(vec![ExtraKey::Str(dynamo_mm_marker(7))]),
            Some(vec![ExtraKey::Array(vec![
                ExtraKey::Str(native_vllm_hash.clone()),
                ExtraKey::UInt(0),
            ])]),
            Some(vec![
                ExtraKey::Array(vec![ExtraKey::Str(dynamo_mm_marker(9)), ExtraKey::Int(-2)]),
                ExtraKey::Str(dynamo_mm_marker(5)),
            ]),
        ]);
        let infos = [mm(&[7]), None, mm(&[5, 9])];
        let expected = mm_local_hashes(&tokens, &infos);
        assert_eq!(local_of(&event), expected);
        let plain = local_hashes(&tokens, 4, BASE_SEED);
        assert_ne!(expected[0], plain[0]);
        // vLLM's own identifier is not Dynamo's hash: block 1 hashes as plain tokens.
        assert_eq!(expected[1], plain[1]);
        // Only vLLM's identifiers: no multimodal hashing at all.
        event.extra_keys = Some(vec![
            Some(vec![ExtraKey::Str(native_vllm_hash)]),
            None,
            None,
        ]);
        assert_eq!(local_of(&event), plain);
        // A `block_mm_infos` key wins over the extra keys.
        event.extra_keys = Some(vec![
            Some(vec![ExtraKey::Str(dynamo_mm_marker(7))]),
            None,
            None,
        ]);
        event.block_mm_infos = Some(vec![None, None, mm(&[5, 9])]);
        let infos = [None, None, mm(&[5, 9])];
        let expected = mm_local_hashes(&tokens, &infos);
        assert_eq!(local_of(&event), expected);
        assert_eq!(expected[0], plain[0]);
    }

    #[test]
    fn dynamo_tagged_salts_and_the_cache_salt_key_salt_the_hashes() {
        use crate::event::ExtraKey;
        let tokens: Vec<u32> = (1..=8).collect();
        let salted = local_hashes(&tokens, 4, seed_for(Some("adapter"), Some("tenant-a")));
        let mut event = stored(tokens, 4, vec![1, 2]);
        event.lora_name = Some("adapter".into());
        event.extra_keys = Some(vec![
            Some(vec![
                ExtraKey::Str("adapter".into()),
                ExtraKey::Str("dynamo-cache-salt:tenant-a".into()),
            ]),
            Some(vec![ExtraKey::Str("adapter".into())]),
        ]);
        assert_eq!(local_of(&event), salted);
        // The map form's `cache_salt` key comes first.
        event.cache_salt = Some("tenant-a".into());
        event.extra_keys = None;
        assert_eq!(local_of(&event), salted);
    }

    #[test]
    fn block_count_must_match_tokens() {
        let event = stored((0..12).collect(), 4, vec![1, 2]);
        assert_eq!(
            convert_stored(&event),
            Err(DropReason::BlockCountMismatch {
                blocks: 2,
                tokens: 12,
                block_size: 4
            })
        );
        let event = stored((0..8).collect(), 0, vec![1, 2]);
        assert_eq!(convert_stored(&event), Err(DropReason::ZeroBlockSize));
    }

    #[test]
    fn hybrid_groups_follow_the_spec_rule() {
        assert!(feeds_index(None, None));
        assert!(feeds_index(None, Some(0)));
        assert!(!feeds_index(None, Some(1)));
        assert!(feeds_index(Some("full_attention"), Some(3)));
        assert!(!feeds_index(Some("sliding_window"), Some(0)));
        assert!(feeds_index(Some("mla_attention"), Some(0)));
        assert!(feeds_index(Some("sink_full_attention"), Some(2)));
        assert!(!feeds_index(Some("mamba"), None));
    }

    #[test]
    fn media_map_to_tiers_and_unknown_media_drop() {
        let mut removed = RawRemoved {
            block_hashes: vec![5],
            medium: Some("CPU".into()),
            group_idx: None,
        };
        assert_eq!(
            convert_event(&RawEvent::Removed(removed.clone())),
            Ok(KvEvent::Removed {
                engine_hashes: vec![5],
                tier: Tier::Host
            })
        );
        removed.medium = Some(String::new());
        assert_eq!(
            convert_event(&RawEvent::Removed(removed.clone())),
            Ok(KvEvent::Removed {
                engine_hashes: vec![5],
                tier: Tier::Device
            })
        );
        removed.medium = Some("TAPE".into());
        assert_eq!(
            convert_event(&RawEvent::Removed(removed)),
            Err(DropReason::UnknownMedium {
                medium: "TAPE".into()
            })
        );
    }

    #[test]
    fn a_batch_converts_in_order_with_counts() {
        let batch = EventBatch {
            ts: 1.0,
            data_parallel_rank: Some(2),
            events: vec![
                RawEvent::Stored(stored((0..8).collect(), 4, vec![1, 2])),
                RawEvent::Removed(RawRemoved {
                    block_hashes: vec![1],
                    medium: None,
                    group_idx: Some(1),
                }),
                RawEvent::Unknown {
                    tag: "Snapshot".into(),
                },
                RawEvent::Cleared,
            ],
        };
        let conversion = to_kv_events(&batch);
        assert_eq!(conversion.data_parallel_rank, Some(2));
        assert_eq!(conversion.events.len(), 2);
        assert_eq!(conversion.events[1], KvEvent::Cleared);
        assert_eq!(
            conversion.outcome,
            ConversionOutcome {
                stored_events: 1,
                stored_blocks: 2,
                cleared_events: 1,
                ignored_not_full_attention: 1,
                unknown_event_type: 1,
                ..ConversionOutcome::default()
            }
        );
        assert_eq!(conversion.outcome.dropped(), 2);
    }
}
