use super::*;

fn roundtrip_int(value: i64) -> Int {
    let mut buf = Vec::new();
    Writer::new(&mut buf).int(value);
    let mut r = Reader::new(&buf);
    let out = r.int("x").unwrap();
    assert_eq!(r.remaining(), 0);
    out
}

#[test]
fn integers_round_trip_in_every_width() {
    for v in [
        0,
        1,
        127,
        128,
        255,
        256,
        65535,
        65536,
        u32::MAX as i64,
        u32::MAX as i64 + 1,
        i64::MAX,
    ] {
        assert_eq!(roundtrip_int(v), Int::Unsigned(v as u64));
    }
    for v in [
        -1,
        -32,
        -33,
        -128,
        -129,
        -32768,
        -32769,
        i32::MIN as i64,
        i32::MIN as i64 - 1,
        i64::MIN,
    ] {
        assert_eq!(roundtrip_int(v), Int::Negative(v));
    }
}

#[test]
fn shortest_integer_forms_match_msgspec() {
    let mut buf = Vec::new();
    let mut w = Writer::new(&mut buf);
    w.uint(5);
    w.uint(200);
    w.int(-5);
    w.uint(u64::MAX);
    assert_eq!(
        buf,
        [
            0x05, 0xcc, 200, 0xfb, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff
        ]
    );
}

#[test]
fn bin_hashes_keep_the_last_eight_bytes_big_endian() {
    let mut digest = vec![0xaa; 24];
    digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let mut buf = Vec::new();
    Writer::new(&mut buf).bin(&digest);
    assert_eq!(
        Reader::new(&buf).block_hash("h").unwrap(),
        0x0102_0304_0506_0708
    );
    let mut short = Vec::new();
    Writer::new(&mut short).bin(&[0x01, 0x02]);
    assert_eq!(Reader::new(&short).block_hash("h").unwrap(), 0x0102);
    let mut empty = Vec::new();
    Writer::new(&mut empty).bin(&[]);
    assert_eq!(Reader::new(&empty).block_hash("h").unwrap(), 0);
}

#[test]
fn negative_hashes_are_reinterpreted_as_unsigned() {
    let mut buf = Vec::new();
    Writer::new(&mut buf).int(-2);
    assert_eq!(Reader::new(&buf).block_hash("h").unwrap(), u64::MAX - 1);
}

#[test]
fn huge_claimed_lengths_do_not_preallocate() {
    // array32 claiming 4 billion elements, followed by nothing.
    let buf = [0xdd, 0xff, 0xff, 0xff, 0xff];
    let mut r = Reader::new(&buf);
    let err = r.token_ids("token_ids").unwrap_err();
    assert!(matches!(err, WireError::Truncated { .. }), "{err}");
}

#[test]
fn deep_nesting_is_rejected_not_overflowed() {
    let buf = vec![0x91; 100_000];
    let err = Reader::new(&buf).skip(0).unwrap_err();
    assert!(matches!(err, WireError::TooDeep { .. }), "{err}");
    let err = Reader::new(&buf).extra_key(0).unwrap_err();
    assert!(matches!(err, WireError::TooDeep { .. }), "{err}");
}

#[test]
fn skip_consumes_exactly_one_value_of_each_kind() {
    let mut buf = Vec::new();
    let mut w = Writer::new(&mut buf);
    let tree = ExtraKey::Array(vec![
        ExtraKey::Nil,
        ExtraKey::Bool(true),
        ExtraKey::Int(-70000),
        ExtraKey::UInt(1 << 40),
        ExtraKey::Float(0.5),
        ExtraKey::Str("x".repeat(300)),
        ExtraKey::Bytes(vec![1; 70000]),
        ExtraKey::Ext {
            kind: 5,
            data: vec![1, 2, 3],
        },
        ExtraKey::Ext {
            kind: -1,
            data: vec![0; 8],
        },
        ExtraKey::Map(vec![(ExtraKey::Str("k".into()), ExtraKey::UInt(1))]),
    ]);
    w.extra_key(&tree);
    w.nil();
    let mut r = Reader::new(&buf);
    r.skip(0).unwrap();
    assert_eq!(r.remaining(), 1);
    let mut r = Reader::new(&buf);
    assert_eq!(r.extra_key(0).unwrap(), tree);
    assert_eq!(r.remaining(), 1);
}

/// Every width boundary of a `u32`, in runs long enough for the word-at-a-time paths and
/// short enough for the byte-wise tail.
fn width_boundary_tokens() -> Vec<u32> {
    let edges = [
        0u32,
        1,
        0x7f,
        0x80,
        0xff,
        0x100,
        0xffff,
        0x1_0000,
        151_935,
        0xffff_ffff,
    ];
    (0..300).map(|i| edges[(i * 7) % edges.len()]).collect()
}

/// What the general writer produces for a token list: the reference encoding.
fn token_ids_one_by_one(tokens: &[u32]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = Writer::new(&mut buf);
    w.array_len(tokens.len());
    for &t in tokens {
        w.uint(u64::from(t));
    }
    buf
}

#[test]
fn token_ids_encode_as_the_general_writer_does_and_decode_back() {
    let all = width_boundary_tokens();
    for len in [0, 1, 2, 3, 7, 8, 9, 255, 256, 257, 300] {
        let tokens = &all[..len];
        let mut fast = Vec::new();
        Writer::new(&mut fast).token_ids(tokens);
        assert_eq!(fast, token_ids_one_by_one(tokens), "{len} tokens");
        let mut r = Reader::new(&fast);
        assert_eq!(r.token_ids("token_ids").unwrap(), tokens, "{len} tokens");
        assert_eq!(r.remaining(), 0);
    }
}

#[test]
fn token_ids_in_non_shortest_forms_still_decode() {
    // msgpack allows wider forms than needed (uint64 for a small id, uint32 for 7); the word
    // path hands them to the general reader and goes on.
    let mut buf = vec![0xdc, 0x00, 0x04];
    buf.extend_from_slice(&[0xce, 0, 0, 0, 7]);
    buf.extend_from_slice(&[0xcf, 0, 0, 0, 0, 0, 0, 1, 0]);
    buf.extend_from_slice(&[0xd0, 0x05]);
    buf.push(0x09);
    let mut r = Reader::new(&buf);
    assert_eq!(r.token_ids("token_ids").unwrap(), [7, 256, 5, 9]);
    assert_eq!(r.remaining(), 0);
}

/// The odd id (a non-shortest uint64, an int8, a negative value) at every position of
/// `tokens`, followed by `after` (the rest of an event): the list decodes, or fails, as the
/// one-by-one reader would, whichever path (windows, words, bytes) meets it.
fn odd_form_anywhere_decodes_or_fails_as_one_by_one(tokens: &[u32], after: &[u8]) {
    for at in 0..tokens.len() {
        for (odd, value) in [
            (vec![0xcf, 0, 0, 0, 0, 0, 0, 1, 0], Some(256)),
            (vec![0xd0, 0x05], Some(5)),
            (vec![0xff], None),
        ] {
            let mut buf = Vec::new();
            Writer::new(&mut buf).array_len(tokens.len());
            let mut expected = Vec::new();
            for (i, &t) in tokens.iter().enumerate() {
                if i == at {
                    buf.extend_from_slice(&odd);
                    expected.extend(value);
                } else {
                    Writer::new(&mut buf).uint(u64::from(t));
                    expected.push(t);
                }
            }
            buf.extend_from_slice(after);
            let mut r = Reader::new(&buf);
            match value {
                Some(_) => {
                    assert_eq!(
                        r.token_ids("token_ids").unwrap(),
                        expected,
                        "odd id at {at}"
                    );
                    assert_eq!(r.remaining(), after.len());
                }
                None => assert!(
                    matches!(
                        r.token_ids("token_ids"),
                        Err(WireError::InvalidValue { .. })
                    ),
                    "negative id at {at}"
                ),
            }
        }
    }
}

#[test]
fn token_ids_with_an_odd_form_anywhere_in_a_long_list_decode_or_fail_as_one_by_one() {
    // Meets the word path at the start, in the middle and in the last few bytes.
    let tokens: Vec<u32> = (0..48u32)
        .map(|i| [5, 200, 40_000, 151_000][i as usize % 4] + i)
        .collect();
    odd_form_anywhere_decodes_or_fails_as_one_by_one(&tokens, &[]);
}

#[test]
fn token_ids_with_an_odd_form_anywhere_in_a_list_of_windows_decode_or_fail_as_one_by_one() {
    // Long enough for several 64-byte windows of the fast path, with something after the
    // list as in a real event.
    let tokens: Vec<u32> = (0..300u32)
        .map(|i| [5, 200, 40_000, 151_000][(i as usize * 7) % 4] + i)
        .collect();
    odd_form_anywhere_decodes_or_fails_as_one_by_one(&tokens, &[0xcd, 0x00, 0x40]);
}

#[test]
fn form_widths_agree_with_the_token_forms() {
    for marker in 0..=255u8 {
        let width = u64::from(TOKEN_FORMS[usize::from(marker)].width);
        for place in 0..8 {
            let word = u64::from(marker) << (8 * place) | 0xcd << (8 * ((place + 1) % 8));
            let got = (form_widths(word) >> (8 * place)) & 0xff;
            if width != 0 {
                assert_eq!(got, width, "marker {marker:#x} at byte {place}");
            } else {
                assert!((2..=6).contains(&got), "marker {marker:#x} at byte {place}");
            }
        }
    }
}

#[test]
fn token_ids_truncated_in_the_word_path_is_an_error() {
    let mut buf = Vec::new();
    Writer::new(&mut buf).token_ids(&[0x1_0000; 20]);
    buf.truncate(buf.len() - 3);
    assert!(matches!(
        Reader::new(&buf).token_ids("token_ids"),
        Err(WireError::Truncated { .. })
    ));
}

proptest::proptest! {
    #[test]
    fn token_ids_round_trip(tokens in proptest::collection::vec(proptest::num::u32::ANY, 0..600),
                            small in proptest::collection::vec(0u32..0x200, 0..600)) {
        for list in [&tokens, &small] {
            let mut fast = Vec::new();
            Writer::new(&mut fast).token_ids(list);
            proptest::prop_assert_eq!(&fast, &token_ids_one_by_one(list));
            let mut r = Reader::new(&fast);
            proptest::prop_assert_eq!(&r.token_ids("token_ids").unwrap(), list);
        }
    }
}

#[test]
fn token_ids_reject_negative_and_oversized_values() {
    let mut buf = Vec::new();
    let mut w = Writer::new(&mut buf);
    w.array_len(1);
    w.int(-1);
    assert!(matches!(
        Reader::new(&buf).token_ids("token_ids"),
        Err(WireError::InvalidValue { .. })
    ));
    let mut buf = Vec::new();
    let mut w = Writer::new(&mut buf);
    w.array_len(2);
    w.uint(7);
    w.uint(u64::from(u32::MAX) + 1);
    assert!(matches!(
        Reader::new(&buf).token_ids("token_ids"),
        Err(WireError::InvalidValue { .. })
    ));
}
