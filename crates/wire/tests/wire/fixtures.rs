//! Payloads produced by msgspec with mirrors of vLLM's classes (`tests/fixtures/
//! gen_fixtures.py`), checked against their JSON sidecars.

use std::path::{Path, PathBuf};

use kvroute_wire::{
    ConversionOutcome, EncodeOptions, Encoding, HashEncoding, decode_batch, encode_batch,
    to_kv_events,
};
use serde_json::{Value, json};

use crate::common::{kv_event_json, raw_event_json};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

struct Fixture {
    name: String,
    payload: Vec<u8>,
    expected: Value,
}

fn fixtures() -> Vec<Fixture> {
    let mut names: Vec<String> = std::fs::read_dir(fixture_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "msgpack"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let dir = fixture_dir();
            let payload = std::fs::read(dir.join(format!("{name}.msgpack"))).unwrap();
            let sidecar = std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap();
            Fixture {
                name,
                payload,
                expected: serde_json::from_str(&sidecar).unwrap(),
            }
        })
        .collect()
}

fn outcome_json(outcome: &ConversionOutcome) -> Value {
    json!({
        "stored_events": outcome.stored_events,
        "stored_blocks": outcome.stored_blocks,
        "removed_events": outcome.removed_events,
        "removed_blocks": outcome.removed_blocks,
        "cleared_events": outcome.cleared_events,
        "ignored_not_full_attention": outcome.ignored_not_full_attention,
        "unknown_medium": outcome.unknown_medium,
        "zero_block_size": outcome.zero_block_size,
        "block_count_mismatch": outcome.block_count_mismatch,
        "unknown_event_type": outcome.unknown_event_type,
    })
}

#[test]
fn every_layout_the_generator_covers_is_present() {
    let names: Vec<String> = fixtures().into_iter().map(|f| f.name).collect();
    assert!(
        names.len() >= 17,
        "only {} fixtures: {names:?}",
        names.len()
    );
    for required in [
        "array_v08_no_rank",
        "array_lora_salt",
        "array_bin_hashes",
        "array_wide_hashes",
        "array_hybrid",
        "map_basic",
        "map_no_rank",
        "map_extra_keys",
        "map_future_fields",
    ] {
        assert!(names.iter().any(|n| n == required), "missing {required}");
    }
}

#[test]
fn fixtures_decode_to_their_sidecars() {
    for fixture in fixtures() {
        let batch =
            decode_batch(&fixture.payload).unwrap_or_else(|e| panic!("{}: {e}", fixture.name));
        let expected = &fixture.expected;
        assert_eq!(
            batch.ts,
            expected["ts"].as_f64().unwrap(),
            "{}: ts",
            fixture.name
        );
        assert_eq!(
            batch.data_parallel_rank.map(u64::from),
            expected["data_parallel_rank"].as_u64(),
            "{}: data_parallel_rank",
            fixture.name
        );
        let events: Vec<Value> = batch.events.iter().map(raw_event_json).collect();
        assert_eq!(
            Value::Array(events),
            expected["events"],
            "{}: events",
            fixture.name
        );
    }
}

#[test]
fn fixtures_convert_as_the_spec_says() {
    for fixture in fixtures() {
        let batch = decode_batch(&fixture.payload).unwrap();
        let conversion = to_kv_events(&batch);
        let expected = &fixture.expected["conversion"];
        let events: Vec<Value> = conversion.events.iter().map(kv_event_json).collect();
        assert_eq!(
            Value::Array(events),
            expected["kv_events"],
            "{}: kv events",
            fixture.name
        );
        assert_eq!(
            outcome_json(&conversion.outcome),
            expected["outcome"],
            "{}: outcome",
            fixture.name
        );
    }
}

#[test]
fn our_encoder_reproduces_msgspec_byte_for_byte() {
    let mut checked = 0;
    for fixture in fixtures() {
        let encoding = match fixture.expected["same_bytes_as"].as_str() {
            Some("array") => Encoding::Array,
            Some("map") => Encoding::Map,
            _ => continue,
        };
        let batch = decode_batch(&fixture.payload).unwrap();
        let ours = encode_batch(
            &batch,
            EncodeOptions {
                encoding,
                hashes: HashEncoding::Unsigned,
            },
        );
        assert_eq!(ours, fixture.payload, "{}", fixture.name);
        checked += 1;
    }
    assert!(checked >= 9, "only {checked} byte-for-byte fixtures");
}

#[test]
fn fixtures_survive_re_encoding_in_every_form() {
    for fixture in fixtures() {
        let batch = decode_batch(&fixture.payload).unwrap();
        for encoding in [Encoding::Array, Encoding::Map] {
            for hashes in [
                HashEncoding::Unsigned,
                HashEncoding::Signed,
                HashEncoding::Bytes,
            ] {
                let bytes = encode_batch(&batch, EncodeOptions { encoding, hashes });
                assert_eq!(
                    decode_batch(&bytes).as_ref(),
                    Ok(&batch),
                    "{} as {encoding:?}/{hashes:?}",
                    fixture.name
                );
            }
        }
    }
}

#[test]
fn every_truncation_of_every_fixture_is_an_error() {
    for fixture in fixtures() {
        for len in 0..fixture.payload.len() {
            assert!(
                decode_batch(&fixture.payload[..len]).is_err(),
                "{}: prefix of {len} bytes decoded",
                fixture.name
            );
        }
    }
}
