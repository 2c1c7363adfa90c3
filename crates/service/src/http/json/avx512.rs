//! Token-id lists read 64 bytes at a time with AVX-512 (VBMI2), where the CPU has it.
//!
//! The portable reader ([`super::parse_token_array_portable`]) takes one id per step, ~35
//! instructions each. Here one window of 64 bytes, starting at an id, is classified with three
//! compares; the positions of its commas are packed into one vector (`vpcompressb`), and its
//! complete ids are gathered eight at a time into 64-bit lanes, right-aligned (`vpermb`), and
//! converted with three multiply-adds: a dozen vector instructions for eight ids.
//!
//! Only plain lists are taken: ids of 1 to 8 digits without leading zeros, separated by a comma
//! or a comma and one space (`json.dumps`' default), no other whitespace. Anything else returns
//! `None` and the caller reads the list the portable way, which also decides what is an error.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

/// Defines, from one list of the CPU features the reader needs, `available` and (for the
/// tests) `missing`.
macro_rules! needs_features {
    ($($feature:tt),+) => {
        /// Whether this CPU has every feature the reader needs (checked once by `std`, then
        /// cached).
        pub(super) fn available() -> bool {
            $(is_x86_feature_detected!($feature))&&+
        }

        /// The features the reader needs that this CPU lacks.
        #[cfg(test)]
        fn missing() -> Vec<&'static str> {
            [$(($feature, is_x86_feature_detected!($feature))),+]
                .into_iter()
                .filter(|&(_, has)| !has)
                .map(|(feature, _)| feature)
                .collect()
        }
    };
}

needs_features!(
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vbmi",
    "avx512vbmi2",
    "popcnt",
    "lzcnt"
);

/// The ids of a list's contents (between the brackets) holding `total` ids (one more than its
/// commas), or `None` when the CPU lacks AVX-512 VBMI2 or the list is not plain.
pub(super) fn token_list(body: &[u8], total: usize) -> Option<Vec<u32>> {
    if !available() {
        return None;
    }
    // SAFETY: the CPU has every feature `token_list_avx512` is compiled for (checked above).
    unsafe { token_list_avx512(body, total) }
}

/// Where a list that starts at `bytes` (just after its `[`) ends, read 64 bytes at a time: the
/// index of the first `]` and the number of commas before it. One pass instead of a search for
/// the `]` and a count of the commas (two passes over a prompt's ~80 KB). `None` when the CPU
/// lacks the features or there is no `]`.
pub(super) fn list_extent(bytes: &[u8]) -> Option<(usize, usize)> {
    if !available() {
        return None;
    }
    // SAFETY: the CPU has every feature `list_extent_avx512` is compiled for (checked above).
    unsafe { list_extent_avx512(bytes) }
}

#[target_feature(enable = "avx512f,avx512bw,popcnt")]
fn list_extent_avx512(bytes: &[u8]) -> Option<(usize, usize)> {
    let comma = _mm512_set1_epi8(b',' as i8);
    let close = _mm512_set1_epi8(b']' as i8);
    let mut commas = 0usize;
    let mut pos = 0usize;
    while pos + 64 <= bytes.len() {
        // SAFETY: `pos + 64 <= bytes.len()`: the 64 bytes read lie inside `bytes`.
        let v = unsafe { _mm512_loadu_si512(bytes.as_ptr().add(pos).cast()) };
        let window_commas = _mm512_cmpeq_epi8_mask(v, comma);
        let closes = _mm512_cmpeq_epi8_mask(v, close);
        if closes != 0 {
            let at = closes.trailing_zeros() as usize;
            // `at < 64`: the commas before the `]`.
            let before = window_commas & ((1u64 << at) - 1);
            return Some((pos + at, commas + before.count_ones() as usize));
        }
        commas += window_commas.count_ones() as usize;
        pos += 64;
    }
    let rest = &bytes[pos..];
    let end = memchr::memchr(b']', rest)?;
    let tail = rest[..end].iter().filter(|&&b| b == b',').count();
    Some((pos + end, commas + tail))
}

/// Slack after the last id: groups of eight are stored whole, at least two per window, before
/// the count is cut back.
const SLACK: usize = 16;

// `popcnt` and `lzcnt`: without them each window's count of commas and last comma take a
// dozen scalar instructions each.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi,avx512vbmi2,popcnt,lzcnt")]
fn token_list_avx512(body: &[u8], total: usize) -> Option<Vec<u32>> {
    // Written through a pointer up to its capacity, without zeroing it first: every id below
    // `filled` is stored before the length covers it.
    let mut out: Vec<u32> = Vec::with_capacity(total + SLACK);
    let iota = iota();
    // Byte 8j+k of group g's index: 8g+j (id j of the group, for each of its lane's bytes).
    let spread = spread();
    // Byte k of each lane: k - 8 (the lane's bytes end just before the comma).
    let back = _mm512_set1_epi64(i64::from_le_bytes([
        0xf8, 0xf9, 0xfa, 0xfb, 0xfc, 0xfd, 0xfe, 0xff,
    ]));
    let digit_pairs = _mm512_set1_epi16(0x010a); // bytes 10, 1
    let pair_pairs = _mm512_set1_epi32(0x0001_0064); // words 100, 1
    let quad_pairs = _mm256_set1_epi32(0x0001_2710); // words 10000, 1
    let comma = _mm512_set1_epi8(b',' as i8);
    let space = _mm512_set1_epi8(b' ' as i8);
    let zero = _mm512_set1_epi8(b'0' as i8);
    let nine = _mm512_set1_epi8(9);

    let mut pos = 0usize;
    let mut filled = 0usize;
    while pos + 64 <= body.len() {
        // SAFETY: `pos + 64 <= body.len()`: the 64 bytes read lie inside `body`.
        let v = unsafe { _mm512_loadu_si512(body.as_ptr().add(pos).cast()) };
        let commas = _mm512_cmpeq_epi8_mask(v, comma);
        let spaces = _mm512_cmpeq_epi8_mask(v, space);
        let values = _mm512_sub_epi8(v, zero);
        let digits = _mm512_cmple_epu8_mask(values, nine);
        // Digits, commas and single spaces after commas (Python's default `", "`); an id first.
        if commas | digits | spaces != u64::MAX
            || spaces & !(commas << 1) != 0
            || commas == 0
            || digits & 1 == 0
        {
            return None;
        }
        // The window's complete ids end at its commas; the bytes after the last one start the
        // next window.
        let last = 63 - commas.leading_zeros() as usize;
        let considered = if last == 63 {
            u64::MAX
        } else {
            (1u64 << (last + 1)) - 1
        };
        // Each id's first digit. With one per comma, every comma closes exactly one id: two
        // in a gap would need something else between them.
        let starts = digits & !(digits << 1) & considered;
        // An empty id; nine digits in a row; a leading zero.
        let nine_digits = {
            let two = digits & (digits >> 1);
            let four = two & (two >> 2);
            (four & (four >> 4)) & (digits >> 8)
        };
        let zeros = _mm512_cmpeq_epi8_mask(v, zero);
        if starts.count_ones() != commas.count_ones()
            || nine_digits & considered != 0
            || starts & zeros & (digits >> 1) != 0
        {
            return None;
        }
        let ids = commas.count_ones() as usize;
        // Two groups always (a window of ids of typical length holds 8 to 16: no branch on
        // how many), more for short ids.
        let groups = ids.div_ceil(8).max(2);
        if filled + 8 * groups > out.capacity() {
            return None;
        }
        // Comma positions packed from byte 0, and each id's first byte.
        let ends = _mm512_maskz_compress_epi8(commas, iota);
        let firsts = _mm512_maskz_compress_epi8(starts, iota);
        for group in 0..groups {
            let select = _mm512_add_epi8(spread, _mm512_set1_epi8((8 * group) as i8));
            let end = _mm512_permutexvar_epi8(select, ends);
            let first = _mm512_permutexvar_epi8(select, firsts);
            // Byte k of lane j reads `end_j - 8 + k`, kept from the id's first byte on: the id
            // right-aligned, zeros before it.
            let index = _mm512_add_epi8(end, back);
            let keep = _mm512_cmpge_epi8_mask(index, first);
            let lanes = _mm512_maskz_permutexvar_epi8(keep, index, values);
            let pairs = _mm512_maddubs_epi16(lanes, digit_pairs);
            // Each lane's two halves of four digits (each below 10^4) as words, then joined
            // by one more multiply-add (a 64-bit multiply would take three times as long).
            let quads = _mm512_madd_epi16(pairs, pair_pairs);
            let ids8 = _mm256_madd_epi16(_mm512_cvtepi32_epi16(quads), quad_pairs);
            // SAFETY: `filled + 8 * groups <= out.capacity()` (checked above): the eight u32
            // written lie inside `out`'s allocation.
            unsafe {
                _mm256_storeu_si256(out.as_mut_ptr().add(filled + 8 * group).cast(), ids8);
            }
        }
        filled += ids;
        pos += last + 1;
        if body.get(pos) == Some(&b' ') {
            pos += 1;
        }
    }
    if filled >= total {
        return None;
    }
    // SAFETY: ids `0..filled` were stored above (each window's ids right after the previous
    // window's), and `filled < total <= capacity`.
    unsafe { out.set_len(filled) };
    out.resize(total, 0);
    // The rest, fewer than 64 bytes and the last id, the portable way.
    let mut tail = super::Cursor::new(&body[pos..], &mut out[filled..total]);
    tail.finish()?;
    out.truncate(total);
    Some(out)
}

#[target_feature(enable = "avx512f,avx512bw")]
fn iota() -> __m512i {
    let bytes: [u8; 64] = std::array::from_fn(|i| i as u8);
    // SAFETY: reads the 64 bytes of `bytes`.
    unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
}

#[target_feature(enable = "avx512f,avx512bw")]
fn spread() -> __m512i {
    let bytes: [u8; 64] = std::array::from_fn(|i| (i / 8) as u8);
    // SAFETY: reads the 64 bytes of `bytes`.
    unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this CPU lacks features the reader needs: then the calling test checks only that
    /// the reader declines, and says on stderr that the rest was skipped (a pass all the same;
    /// shown with `--nocapture`).
    fn lacks_features() -> bool {
        let missing = missing();
        if missing.is_empty() {
            return false;
        }
        let thread = std::thread::current();
        eprintln!(
            "{}: skipped: CPU lacks {}",
            thread.name().unwrap_or("avx512 test"),
            missing.join("+")
        );
        true
    }

    /// A xorshift64 generator from `seed` (not 0).
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    fn portable(list: &str) -> Option<Vec<u32>> {
        let text = format!("[{list}]");
        super::super::parse_token_array_portable(text.as_bytes()).map(|(ids, _)| ids)
    }

    fn vector(list: &str) -> Option<Vec<u32>> {
        let total = list.bytes().filter(|&b| b == b',').count() + 1;
        token_list(list.as_bytes(), total)
    }

    #[test]
    fn list_extent_finds_the_first_close_and_the_commas_before_it() {
        let scalar = |bytes: &[u8]| {
            let end = bytes.iter().position(|&b| b == b']')?;
            Some((end, bytes[..end].iter().filter(|&&b| b == b',').count()))
        };
        if lacks_features() {
            assert_eq!(list_extent(b"1,2]"), None);
            return;
        }
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for case in 0..4000 {
            let len = (next() % 300) as usize;
            // Mostly digits and commas; a `]` (or several) somewhere, or none at all.
            let mut bytes: Vec<u8> = (0..len)
                .map(|_| match next() % 16 {
                    0..=3 => b',',
                    4 => b' ',
                    _ => b'0' + (next() % 10) as u8,
                })
                .collect();
            for _ in 0..case % 3 {
                if len > 0 {
                    let at = (next() % len as u64) as usize;
                    bytes[at] = b']';
                }
            }
            assert_eq!(
                list_extent(&bytes),
                scalar(&bytes),
                "case {case}: {bytes:?}"
            );
        }
        // A `]` at each position of the first, a middle and the last window.
        for at in (0..200).chain([255, 256, 257, 511]) {
            let mut bytes = b"12,".repeat(200);
            bytes[at] = b']';
            assert_eq!(list_extent(&bytes), scalar(&bytes), "] at {at}");
        }
    }

    #[test]
    fn plain_lists_read_as_the_portable_reader_does() {
        if lacks_features() {
            // Without the features the reader declines everything.
            assert_eq!(vector(&"1,".repeat(100)[..199]), None);
            return;
        }
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for case in 0..3000 {
            let len = (next() % 400) as usize + 1;
            // Ids of every width up to eight digits, some cases all short or all long.
            let max_digits = [8, 1, 2, 6, 8][case % 5];
            let ids: Vec<u32> = (0..len)
                .map(|_| {
                    let digits = (next() % max_digits + 1) as u32;
                    (next() % 10u64.pow(digits)) as u32
                })
                .collect();
            // `serde_json`'s separators and Python's.
            let separator = if case % 3 == 0 { ", " } else { "," };
            let list = ids
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(separator);
            assert_eq!(
                vector(&list).as_deref(),
                Some(&ids[..]),
                "case {case}: {list}"
            );
            assert_eq!(portable(&list).as_deref(), Some(&ids[..]), "case {case}");
        }
    }

    #[test]
    fn anything_not_plain_is_left_to_the_portable_reader() {
        if lacks_features() {
            assert_eq!(vector("1,2"), None);
            return;
        }
        for separator in [",", ", "] {
            flaws_anywhere(separator);
        }
        let plain = "1,".repeat(100) + "1";
        // Ids of ten digits are not taken (u32 holds some of them, the portable reader decides).
        let long = format!("{plain},4294967295,{plain}");
        assert_eq!(vector(&long), None);
        // A window of 64 digits has no comma.
        assert_eq!(vector(&format!("{},1", "1".repeat(70))), None);
        // Spaces anywhere but one after a comma.
        assert_eq!(vector(&format!("{plain} ,{plain}")), None);
        assert_eq!(vector(&format!("{plain},  {plain}")), None);
        assert_eq!(vector(&format!(" {plain}")), None);
    }

    fn flaws_anywhere(separator: &str) {
        let plain: String = (0..200)
            .map(|i| (i * 7919 % 151_936).to_string())
            .collect::<Vec<_>>()
            .join(separator);
        assert_eq!(vector(&plain), portable(&plain));
        assert!(vector(&plain).is_some());
        // A flaw at every position: a space, a leading zero, an empty id, nine digits, a sign.
        for at in 0..plain.len() {
            for flaw in [" ", "0", ",", "123456789", "-", "a"] {
                let mut bad = plain.clone();
                bad.insert_str(at, flaw);
                let got = vector(&bad);
                if let Some(got) = got {
                    assert_eq!(Some(got), portable(&bad), "{flaw:?} at {at}");
                }
            }
        }
    }
}
