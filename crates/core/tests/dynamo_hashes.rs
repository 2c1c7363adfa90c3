//! kvroute's local block hashes against fixtures generated once from Dynamo 1.6.1's own
//! `compute_block_hash_for_seq` (`bench/dynamo/gen_hash_fixtures.py`): random prompts across
//! block sizes, with and without a LoRA name, a cache salt, Eagle and multimodal infos.

// Test helpers outside #[test] functions may panic: a failure there is a failed test.
#![allow(clippy::expect_used)]

use kvroute_core::hash::{BlockExtras, BlockMmInfo, MmObject, local_hashes_with, seed_for};
use serde_json::Value;

const FIXTURES: &str = include_str!("fixtures/dynamo_block_hashes.json");

fn u64s(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .expect("an array")
        .iter()
        .map(|v| v.as_u64().expect("an unsigned 64-bit integer"))
        .collect()
}

/// A fixture's `block_mm_infos` (`null` or a list of `null` / `{"mm_objects": [...]}`).
fn mm_infos(value: &Value) -> Vec<Option<BlockMmInfo>> {
    let Some(blocks) = value.as_array() else {
        return Vec::new();
    };
    blocks
        .iter()
        .map(|block| {
            let objects = block.get("mm_objects")?.as_array().expect("mm_objects");
            Some(BlockMmInfo {
                mm_objects: objects
                    .iter()
                    .map(|o| MmObject {
                        mm_hash: o["mm_hash"].as_u64().expect("mm_hash"),
                        offsets: o["offsets"]
                            .as_array()
                            .expect("offsets")
                            .iter()
                            .map(|pair| {
                                let pair = u64s(pair);
                                (pair[0], pair[1])
                            })
                            .collect(),
                    })
                    .collect(),
            })
        })
        .collect()
}

#[test]
fn local_hashes_equal_dynamos_for_every_fixture() {
    let fixtures: Value = serde_json::from_str(FIXTURES).expect("fixture JSON");
    assert_eq!(fixtures["dynamo_version"], "1.6.1");
    let cases = fixtures["cases"].as_array().expect("cases");
    assert!(cases.len() >= 200, "{} cases", cases.len());
    let mut seen = [false; 4];
    for (i, case) in cases.iter().enumerate() {
        let tokens: Vec<u32> = u64s(&case["tokens"])
            .into_iter()
            .map(|t| u32::try_from(t).expect("a u32 token"))
            .collect();
        let block_size = case["block_size"].as_u64().expect("block_size") as usize;
        let lora_name = case["lora_name"].as_str();
        let cache_salt = case["cache_salt"].as_str();
        let is_eagle = case["is_eagle"].as_bool() == Some(true);
        let infos = mm_infos(&case["block_mm_infos"]);
        seen[0] |= lora_name.is_some_and(|l| !l.is_empty());
        seen[1] |= cache_salt.is_some_and(|s| !s.is_empty());
        seen[2] |= is_eagle;
        seen[3] |= infos
            .iter()
            .flatten()
            .any(|info| !info.mm_objects.is_empty());
        let extras = BlockExtras {
            is_eagle,
            block_mm_infos: &infos,
        };
        let local = local_hashes_with(&tokens, block_size, seed_for(lora_name, cache_salt), extras);
        assert_eq!(
            local,
            u64s(&case["hashes"]),
            "case {i}: {} tokens, block size {block_size}, lora {lora_name:?}, salt \
             {cache_salt:?}, eagle {is_eagle}, mm {}",
            tokens.len(),
            case["block_mm_infos"]
        );
    }
    assert_eq!(
        seen, [true; 4],
        "LoRA, salt, Eagle and multimodal cases all present"
    );
}
