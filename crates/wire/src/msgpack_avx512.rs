//! Token-id lists read with AVX-512 VBMI, where the CPU has it.
//!
//! The portable reader ([`crate::msgpack`]'s `token_ids`) goes from one id to the next with a
//! table load: a chain of ~10 cycles per id. Here a window of 64 bytes starting at an id is
//! resolved at once:
//! - each byte's width if it started a form (1 for a positive fixint, 2, 3, 5 for the `uint8`,
//!   `uint16` and `uint32` markers; anything else is "odd") gives a successor table `N`
//!   (position → position of the next id; odd → a sentinel that stays put);
//! - squaring it five times (`vpermi2b`, positions past the window map to themselves) gives
//!   `N³²`: `N³²(0)` is where the next window starts (the sentinel if an odd byte is on the way),
//!   the only result the next window waits for;
//! - the positions of the window's first 32 ids, `Nᵏ(0)`, come from five masked permutes of the
//!   powers, and their values are gathered sixteen at a time into 32-bit lanes, big-endian
//!   payload bytes reversed, by one more permute each.
//!
//! A window whose walk meets an odd byte is left to the portable reader, which also decides what
//! is an error, so both readers return the same ids and the same errors.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

/// Defines, from one list of the CPU features the reader needs, `available` and (for the
/// tests) `missing`.
macro_rules! needs_features {
    ($($feature:tt),+) => {
        /// Whether this CPU has every feature the reader needs (checked once by `std`, then
        /// cached).
        fn available() -> bool {
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

needs_features!("avx512f", "avx512bw", "avx512vbmi", "popcnt");

/// Ids per window: the orbit is computed for this many steps.
const IDS: usize = 32;
/// Bytes the window reads (two registers: the ids start in the first, may end in the second).
const READ: usize = 128;
/// The successor of a byte that starts no token form: stays put (it is in the identity half).
const ODD: i8 = 127;

/// Reads ids of `buf` from `*pos` into `out` while at least [`IDS`] of the `len` are still to
/// come and [`READ`] bytes are left, advancing `*pos`. Stops early (leaving the rest to the
/// portable reader) at a window whose walk meets a byte that starts no token form.
pub(crate) fn read_ids(buf: &[u8], pos: &mut usize, out: &mut Vec<u32>, len: usize) {
    if len.saturating_sub(out.len()) < IDS || !available() {
        return;
    }
    // SAFETY: the CPU has every feature `read_ids_avx512` is compiled for (checked above).
    unsafe { read_ids_avx512(buf, pos, out, len) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,popcnt")]
fn read_ids_avx512(buf: &[u8], pos: &mut usize, out: &mut Vec<u32>, len: usize) {
    let iota = _mm512_set_epi8(
        63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41,
        40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,
        17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
    );
    // The second half of every successor table: positions 64..127 map to themselves.
    let beyond = _mm512_add_epi8(iota, _mm512_set1_epi8(64));
    let ones = _mm512_set1_epi8(1);
    // For each output byte (lane t of sixteen, byte b): the id it belongs to (t, plus 16 for the
    // second group) and b itself.
    let id_of_byte = _mm512_set_epi32(
        0x0f0f_0f0f,
        0x0e0e_0e0e,
        0x0d0d_0d0d,
        0x0c0c_0c0c,
        0x0b0b_0b0b,
        0x0a0a_0a0a,
        0x0909_0909,
        0x0808_0808,
        0x0707_0707,
        0x0606_0606,
        0x0505_0505,
        0x0404_0404,
        0x0303_0303,
        0x0202_0202,
        0x0101_0101,
        0,
    );
    let second_group = _mm512_add_epi8(id_of_byte, _mm512_set1_epi8(16));
    let byte_of_lane = _mm512_set1_epi32(0x0302_0100);
    // Lanes k with bit j of k set, j = 0..4 (only the first 32 lanes are used).
    const STEP_LANES: [u64; 5] = [
        0xaaaa_aaaa_aaaa_aaaa,
        0xcccc_cccc_cccc_cccc,
        0xf0f0_f0f0_f0f0_f0f0,
        0xff00_ff00_ff00_ff00,
        0xffff_0000_ffff_0000,
    ];
    while len - out.len() >= IDS {
        let Some(window) = buf.get(*pos..).and_then(|rest| rest.first_chunk::<READ>()) else {
            return;
        };
        // SAFETY: `window` is READ = 128 readable bytes: two unaligned 64-byte loads.
        let (low, high) = unsafe {
            (
                _mm512_loadu_si512(window.as_ptr().cast()),
                _mm512_loadu_si512(window.as_ptr().add(64).cast()),
            )
        };
        let fixint = !_mm512_movepi8_mask(low);
        let u8_marker = _mm512_cmpeq_epi8_mask(low, _mm512_set1_epi8(0xccu8 as i8));
        let u16_marker = _mm512_cmpeq_epi8_mask(low, _mm512_set1_epi8(0xcdu8 as i8));
        let u32_marker = _mm512_cmpeq_epi8_mask(low, _mm512_set1_epi8(0xceu8 as i8));
        let mut width = _mm512_maskz_mov_epi8(fixint, ones);
        width = _mm512_mask_mov_epi8(width, u8_marker, _mm512_set1_epi8(2));
        width = _mm512_mask_mov_epi8(width, u16_marker, _mm512_set1_epi8(3));
        width = _mm512_mask_mov_epi8(width, u32_marker, _mm512_set1_epi8(5));
        let form = fixint | u8_marker | u16_marker | u32_marker;
        let next = _mm512_mask_mov_epi8(_mm512_set1_epi8(ODD), form, _mm512_add_epi8(iota, width));
        // powers[j] = N^(2^j).
        let mut powers = [next; 6];
        for j in 1..6 {
            powers[j] = _mm512_permutex2var_epi8(powers[j - 1], powers[j - 1], beyond);
        }
        let advance = (_mm_cvtsi128_si32(_mm512_castsi512_si128(powers[5])) & 0xff) as usize;
        if advance == ODD as usize {
            return;
        }
        // Lane k: the position of id k, N^k(0).
        let mut at = _mm512_setzero_si512();
        for (j, &lanes) in STEP_LANES.iter().enumerate() {
            at = _mm512_mask2_permutex2var_epi8(powers[j], at, lanes, beyond);
        }
        let inside = _mm512_cmplt_epu8_mask(at, _mm512_set1_epi8(64)) & 0xffff_ffff;
        let count = inside.count_ones() as usize;
        // The payload of id k ends at `at + width - 1` (the marker itself for a fixint) and has
        // `max(width - 1, 1)` bytes, most significant first.
        let id_width = _mm512_permutexvar_epi8(at, width);
        let last = _mm512_sub_epi8(_mm512_add_epi8(at, id_width), ones);
        let bytes = _mm512_max_epu8(_mm512_sub_epi8(id_width, ones), ones);
        out.reserve(IDS);
        let dst = out.spare_capacity_mut().as_mut_ptr().cast::<u32>();
        for (g, ids) in [id_of_byte, second_group].into_iter().enumerate() {
            let from = _mm512_sub_epi8(_mm512_permutexvar_epi8(ids, last), byte_of_lane);
            let keep = _mm512_cmplt_epu8_mask(byte_of_lane, _mm512_permutexvar_epi8(ids, bytes));
            let values = _mm512_maskz_mov_epi8(keep, _mm512_permutex2var_epi8(low, from, high));
            // SAFETY: `reserve(IDS)` left room for 32 ids past the length: groups 0 and 1.
            unsafe { _mm512_storeu_si512(dst.add(16 * g).cast(), values) };
        }
        // SAFETY: the first `count` ≤ 32 slots past the length were just written.
        unsafe { out.set_len(out.len() + count) };
        *pos += advance;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this CPU lacks features the reader needs: then the calling test is skipped, and
    /// says so on stderr (a pass all the same; shown with `--nocapture`).
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

    /// The ids of `ids` encoded in their shortest forms, then 128 bytes of padding.
    fn encoded(ids: &[u32]) -> Vec<u8> {
        let mut buf = Vec::new();
        for &id in ids {
            match id {
                0..=0x7f => buf.push(id as u8),
                0x80..=0xff => buf.extend_from_slice(&[0xcc, id as u8]),
                0x100..=0xffff => {
                    buf.push(0xcd);
                    buf.extend_from_slice(&(id as u16).to_be_bytes());
                }
                _ => {
                    buf.push(0xce);
                    buf.extend_from_slice(&id.to_be_bytes());
                }
            }
        }
        buf.extend_from_slice(&[0xc0; READ]);
        buf
    }

    #[test]
    fn reads_every_form_at_every_offset() {
        if lacks_features() {
            return;
        }
        let forms = [
            0u32,
            5,
            0x7f,
            0x80,
            0xff,
            0x100,
            0xabcd,
            0xffff,
            0x1_0000,
            151_935,
            u32::MAX,
        ];
        let mut ids = Vec::new();
        let mut z = 0x9e37_79b9u32;
        for i in 0..2000u32 {
            z ^= z << 13;
            z ^= z >> 17;
            z ^= z << 5;
            ids.push(forms[(z as usize + i as usize) % forms.len()] ^ (z & 0x3 & i));
        }
        for start in 0..40 {
            let ids = &ids[start..];
            let buf = encoded(ids);
            let mut pos = 0;
            let mut out = Vec::new();
            read_ids(&buf, &mut pos, &mut out, ids.len());
            assert!(
                ids.len() - out.len() < IDS,
                "stopped early at {}",
                out.len()
            );
            assert_eq!(out, ids[..out.len()], "start {start}");
            assert_eq!(pos, encoded(&ids[..out.len()]).len() - READ);
        }
    }

    #[test]
    fn stops_at_a_window_with_an_odd_byte() {
        if lacks_features() {
            return;
        }
        let ids: Vec<u32> = (0..200).map(|i| i * 1000).collect();
        let mut buf = encoded(&ids);
        // Id 100 becomes a negative fixint: the window holding it is left alone.
        let at = encoded(&ids[..100]).len() - READ;
        buf[at] = 0xff;
        let mut pos = 0;
        let mut out = Vec::new();
        read_ids(&buf, &mut pos, &mut out, ids.len());
        assert!(out.len() <= 100 && out.len() + IDS > 100, "{}", out.len());
        assert_eq!(out, ids[..out.len()]);
        assert_eq!(pos, encoded(&ids[..out.len()]).len() - READ);
    }
}
