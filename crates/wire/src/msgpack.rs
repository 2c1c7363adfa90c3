//! A small msgpack reader and writer, just what the KV-event format needs.
//!
//! The reader works on a borrowed slice and never trusts a length from a header: a collection
//! of `n` elements preallocates at most `min(n, bytes left)` slots (every element takes at least
//! one byte), and nesting is bounded by [`MAX_DEPTH`]. Skipping a value is iterative over
//! siblings and recursive only into children, so the stack depth is bounded too.
//!
//! The writer emits the shortest encoding of every integer, as msgspec does.

use crate::error::WireError;
use crate::event::ExtraKey;

/// The deepest nesting of arrays and maps accepted anywhere in a payload. The real format needs
/// 6 (batch → events → event → extra_keys → block tuple → multimodal tuple).
pub const MAX_DEPTH: usize = 32;

/// A msgpack integer of either sign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    /// A value `>= 0`.
    Unsigned(u64),
    /// A value `< 0`.
    Negative(i64),
}

impl Int {
    fn render(self) -> String {
        match self {
            Int::Unsigned(v) => v.to_string(),
            Int::Negative(v) => v.to_string(),
        }
    }
}

/// Reads msgpack values from a borrowed buffer (a clone reads ahead without moving the
/// original).
#[derive(Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A short name of the msgpack type a marker byte starts, for error messages.
pub(crate) fn marker_name(marker: u8) -> &'static str {
    match marker {
        0x00..=0x7f | 0xcc..=0xcf => "unsigned int",
        0xe0..=0xff | 0xd0..=0xd3 => "int",
        0x80..=0x8f | 0xde | 0xdf => "map",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xc0 => "nil",
        0xc1 => "reserved marker 0xc1",
        0xc2 | 0xc3 => "bool",
        0xc4..=0xc6 => "bin",
        0xc7..=0xc9 | 0xd4..=0xd8 => "ext",
        0xca | 0xcb => "float",
    }
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn offset(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn truncated(&self, needed: usize) -> WireError {
        WireError::Truncated {
            offset: self.pos,
            needed: needed.saturating_sub(self.remaining()),
        }
    }

    /// The next marker byte, not consumed.
    pub(crate) fn peek(&self) -> Result<u8, WireError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.truncated(1))
    }

    fn byte(&mut self) -> Result<u8, WireError> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.remaining() {
            return Err(self.truncated(n));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        self.byte()
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn unexpected(&self, field: &'static str, expected: &'static str, marker: u8) -> WireError {
        WireError::UnexpectedType {
            field,
            expected,
            found: marker_name(marker),
            offset: self.pos,
        }
    }

    /// Consumes a nil if one is next; returns whether it did.
    pub(crate) fn nil(&mut self) -> Result<bool, WireError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Whether the next value is an array (`Some(true)`), a map (`Some(false)`), or neither.
    pub(crate) fn peek_container(&self) -> Result<Option<bool>, WireError> {
        Ok(match self.peek()? {
            0x90..=0x9f | 0xdc | 0xdd => Some(true),
            0x80..=0x8f | 0xde | 0xdf => Some(false),
            _ => None,
        })
    }

    /// Reads an array header; the length is only a claim, see the module doc.
    pub(crate) fn array_len(&mut self, field: &'static str) -> Result<usize, WireError> {
        let marker = self.peek()?;
        let len = match marker {
            0x90..=0x9f => {
                self.pos += 1;
                usize::from(marker & 0x0f)
            }
            0xdc => {
                self.pos += 1;
                usize::from(self.u16()?)
            }
            0xdd => {
                self.pos += 1;
                self.u32()? as usize
            }
            _ => return Err(self.unexpected(field, "array", marker)),
        };
        Ok(len)
    }

    /// Reads a map header (the number of key/value pairs).
    pub(crate) fn map_len(&mut self, field: &'static str) -> Result<usize, WireError> {
        let marker = self.peek()?;
        let len = match marker {
            0x80..=0x8f => {
                self.pos += 1;
                usize::from(marker & 0x0f)
            }
            0xde => {
                self.pos += 1;
                usize::from(self.u16()?)
            }
            0xdf => {
                self.pos += 1;
                self.u32()? as usize
            }
            _ => return Err(self.unexpected(field, "map", marker)),
        };
        Ok(len)
    }

    /// A capacity for `claimed` elements that the remaining input could actually hold.
    pub(crate) fn capacity(&self, claimed: usize) -> usize {
        claimed.min(self.remaining())
    }

    /// The raw bytes of a str value, without the UTF-8 check.
    fn str_bytes(&mut self, field: &'static str) -> Result<&'a [u8], WireError> {
        let marker = self.peek()?;
        let len = match marker {
            0xa0..=0xbf => {
                self.pos += 1;
                usize::from(marker & 0x1f)
            }
            0xd9 => {
                self.pos += 1;
                usize::from(self.u8()?)
            }
            0xda => {
                self.pos += 1;
                usize::from(self.u16()?)
            }
            0xdb => {
                self.pos += 1;
                self.u32()? as usize
            }
            _ => return Err(self.unexpected(field, "str", marker)),
        };
        self.take(len)
    }

    pub(crate) fn str(&mut self, field: &'static str) -> Result<&'a str, WireError> {
        let bytes = self.str_bytes(field)?;
        std::str::from_utf8(bytes).map_err(|_| WireError::InvalidUtf8 {
            field,
            offset: self.pos - bytes.len(),
        })
    }

    pub(crate) fn opt_str(&mut self, field: &'static str) -> Result<Option<&'a str>, WireError> {
        if self.nil()? {
            Ok(None)
        } else {
            self.str(field).map(Some)
        }
    }

    /// Reads a bin value, if one is next.
    fn bin_body(&mut self, marker: u8) -> Result<&'a [u8], WireError> {
        self.pos += 1;
        let len = match marker {
            0xc4 => usize::from(self.u8()?),
            0xc5 => usize::from(self.u16()?),
            _ => self.u32()? as usize,
        };
        self.take(len)
    }

    pub(crate) fn int(&mut self, field: &'static str) -> Result<Int, WireError> {
        let marker = self.peek()?;
        let value = match marker {
            0x00..=0x7f => {
                self.pos += 1;
                Int::Unsigned(u64::from(marker))
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::Negative(i64::from(marker as i8))
            }
            0xcc => {
                self.pos += 1;
                Int::Unsigned(u64::from(self.u8()?))
            }
            0xcd => {
                self.pos += 1;
                Int::Unsigned(u64::from(self.u16()?))
            }
            0xce => {
                self.pos += 1;
                Int::Unsigned(u64::from(self.u32()?))
            }
            0xcf => {
                self.pos += 1;
                Int::Unsigned(self.u64()?)
            }
            0xd0 => {
                self.pos += 1;
                signed(i64::from(self.u8()? as i8))
            }
            0xd1 => {
                self.pos += 1;
                signed(i64::from(self.u16()? as i16))
            }
            0xd2 => {
                self.pos += 1;
                signed(i64::from(self.u32()? as i32))
            }
            0xd3 => {
                self.pos += 1;
                signed(self.u64()? as i64)
            }
            _ => return Err(self.unexpected(field, "int", marker)),
        };
        Ok(value)
    }

    /// A non-negative integer that fits `u64`.
    pub(crate) fn uint(&mut self, field: &'static str) -> Result<u64, WireError> {
        match self.int(field)? {
            Int::Unsigned(v) => Ok(v),
            negative => Err(WireError::InvalidValue {
                field,
                value: negative.render(),
                reason: "must not be negative",
            }),
        }
    }

    /// A non-negative integer that fits `u32`.
    pub(crate) fn u32_value(&mut self, field: &'static str) -> Result<u32, WireError> {
        let value = self.int(field)?;
        match value {
            Int::Unsigned(v) => u32::try_from(v).map_err(|_| WireError::InvalidValue {
                field,
                value: value.render(),
                reason: "does not fit in 32 bits",
            }),
            Int::Negative(_) => Err(WireError::InvalidValue {
                field,
                value: value.render(),
                reason: "must not be negative",
            }),
        }
    }

    pub(crate) fn opt_u32(&mut self, field: &'static str) -> Result<Option<u32>, WireError> {
        if self.nil()? {
            Ok(None)
        } else {
            self.u32_value(field).map(Some)
        }
    }

    pub(crate) fn opt_uint(&mut self, field: &'static str) -> Result<Option<u64>, WireError> {
        if self.nil()? {
            Ok(None)
        } else {
            self.uint(field).map(Some)
        }
    }

    /// A float; integers are accepted too (a producer may send a whole-second timestamp).
    pub(crate) fn f64(&mut self, field: &'static str) -> Result<f64, WireError> {
        let marker = self.peek()?;
        match marker {
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(self.u32()?)))
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_bits(self.u64()?))
            }
            _ => match self.int(field) {
                Ok(Int::Unsigned(v)) => Ok(v as f64),
                Ok(Int::Negative(v)) => Ok(v as f64),
                Err(_) => Err(self.unexpected(field, "float", marker)),
            },
        }
    }

    /// An engine block hash: an int of either sign (a negative one is reinterpreted as `u64`),
    /// or bin whose last 8 bytes are read big-endian (a shorter bin is zero-padded on the left),
    /// which is what vLLM's `maybe_convert_block_hash` keeps of a digest.
    pub(crate) fn block_hash(&mut self, field: &'static str) -> Result<u64, WireError> {
        let marker = self.peek()?;
        match marker {
            0xc4..=0xc6 => {
                let bytes = self.bin_body(marker)?;
                let tail = &bytes[bytes.len().saturating_sub(8)..];
                let mut be = [0u8; 8];
                be[8 - tail.len()..].copy_from_slice(tail);
                Ok(u64::from_be_bytes(be))
            }
            0x00..=0x7f | 0xcc..=0xcf | 0xd0..=0xd3 | 0xe0..=0xff => match self.int(field)? {
                Int::Unsigned(v) => Ok(v),
                Int::Negative(v) => Ok(v as u64),
            },
            _ => Err(self.unexpected(field, "int or bin", marker)),
        }
    }

    pub(crate) fn opt_block_hash(&mut self, field: &'static str) -> Result<Option<u64>, WireError> {
        if self.nil()? {
            Ok(None)
        } else {
            self.block_hash(field).map(Some)
        }
    }

    /// A list of block hashes.
    pub(crate) fn block_hashes(&mut self, field: &'static str) -> Result<Vec<u64>, WireError> {
        let len = self.array_len(field)?;
        let mut out = Vec::with_capacity(self.capacity(len));
        for _ in 0..len {
            out.push(self.block_hash(field)?);
        }
        Ok(out)
    }

    /// A list of token ids (`u32`). The forms msgspec uses for token ids (positive fixint,
    /// `uint8`, `uint16`, `uint32`) are read straight from the slice, eight bytes at a time and
    /// without a branch on the form (in a real vocabulary `uint16` and `uint32` ids alternate at
    /// random, which would mispredict about every other id); anything else, and the last few
    /// bytes of the payload, go through the general integer reader, which also produces the
    /// errors.
    pub(crate) fn token_ids(&mut self, field: &'static str) -> Result<Vec<u32>, WireError> {
        let len = self.array_len(field)?;
        let mut out = Vec::with_capacity(self.capacity(len));
        let buf = self.buf;
        let mut pos = self.pos;
        // With AVX-512 VBMI, 32 ids a window while that many are still to come (module
        // `msgpack_avx512`); it leaves to the loops below the tail and any window it cannot take.
        #[cfg(target_arch = "x86_64")]
        crate::msgpack_avx512::read_ids(buf, &mut pos, &mut out, len);
        // 64 bytes at a time while at least 64 ids are still to come: the width of a form
        // starting at each of the window's bytes is computed for all of them at once, so going
        // from one id to the next is one load from that table (a shorter chain than the marker's
        // load followed by its form's). A window with a marker that is not a token form (only
        // found once walked to) is dropped and left to the loops below.
        let mut widths = [0u8; WINDOW];
        while len - out.len() >= WINDOW {
            let Some(window) = buf
                .get(pos..)
                .and_then(|rest| rest.first_chunk::<{ WINDOW + 8 }>())
            else {
                break;
            };
            for (w, word) in widths.chunks_exact_mut(8).zip(window.chunks_exact(8)) {
                let word = u64::from_le_bytes(word.try_into().unwrap_or_default());
                w.copy_from_slice(&form_widths(word).to_le_bytes());
            }
            let start = out.len();
            let mut at = 0;
            let mut odd = false;
            while at < WINDOW {
                let Some(&bytes) = window.get(at..).and_then(|rest| rest.first_chunk::<8>()) else {
                    break;
                };
                let form = TOKEN_FORMS[usize::from(bytes[0])];
                odd |= form.width == 0;
                let word = u64::from_be_bytes(bytes);
                out.push(((word >> form.shift) as u32) & form.mask);
                at += usize::from(widths[at]);
            }
            if odd {
                out.truncate(start);
                break;
            }
            pos += at;
        }
        while out.len() < len {
            let Some(&bytes) = buf.get(pos..).and_then(|rest| rest.first_chunk::<8>()) else {
                break;
            };
            // One table lookup per id: its width (0: not a token form), and where its payload
            // sits in the big-endian word starting at its marker.
            let form = TOKEN_FORMS[usize::from(bytes[0])];
            if form.width == 0 {
                break;
            }
            let word = u64::from_be_bytes(bytes);
            out.push(((word >> form.shift) as u32) & form.mask);
            pos += usize::from(form.width);
        }
        self.pos = pos;
        while out.len() < len {
            let pos = self.pos;
            let (token, width) = match buf.get(pos..) {
                Some(&[marker @ 0x00..=0x7f, ..]) => (u32::from(marker), 1),
                Some(&[0xcc, b, ..]) => (u32::from(b), 2),
                Some(&[0xcd, b0, b1, ..]) => (u32::from(u16::from_be_bytes([b0, b1])), 3),
                Some(&[0xce, b0, b1, b2, b3, ..]) => (u32::from_be_bytes([b0, b1, b2, b3]), 5),
                _ => {
                    out.push(self.u32_value(field)?);
                    continue;
                }
            };
            self.pos = pos + width;
            out.push(token);
        }
        Ok(out)
    }

    /// Skips one value of any type, checking that it is complete and well-formed.
    pub(crate) fn skip(&mut self, depth: usize) -> Result<(), WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep {
                max_depth: MAX_DEPTH,
                offset: self.pos,
            });
        }
        let marker = self.peek()?;
        match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => self.pos += 1,
            0xc1 => return Err(self.unexpected("value", "a msgpack value", marker)),
            0xcc..=0xd3 => {
                self.int("value")?;
            }
            0xca | 0xcb => {
                self.f64("value")?;
            }
            0xa0..=0xbf | 0xd9..=0xdb => {
                // No UTF-8 check: an unknown field's content is not ours to judge.
                self.str_bytes("value")?;
            }
            0xc4..=0xc6 => {
                self.bin_body(marker)?;
            }
            0xc7..=0xc9 | 0xd4..=0xd8 => {
                self.ext_body(marker)?;
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let len = self.array_len("value")?;
                for _ in 0..len {
                    self.skip(depth + 1)?;
                }
            }
            0x80..=0x8f | 0xde | 0xdf => {
                let len = self.map_len("value")?;
                for _ in 0..len {
                    self.skip(depth + 1)?;
                    self.skip(depth + 1)?;
                }
            }
        }
        Ok(())
    }

    fn ext_body(&mut self, marker: u8) -> Result<(i8, &'a [u8]), WireError> {
        self.pos += 1;
        let len = match marker {
            0xd4 => 1,
            0xd5 => 2,
            0xd6 => 4,
            0xd7 => 8,
            0xd8 => 16,
            0xc7 => usize::from(self.u8()?),
            0xc8 => usize::from(self.u16()?),
            _ => self.u32()? as usize,
        };
        let kind = self.u8()? as i8;
        Ok((kind, self.take(len)?))
    }

    /// Reads any value as an [`ExtraKey`] tree, bounded by [`MAX_DEPTH`].
    pub(crate) fn extra_key(&mut self, depth: usize) -> Result<ExtraKey, WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep {
                max_depth: MAX_DEPTH,
                offset: self.pos,
            });
        }
        let marker = self.peek()?;
        Ok(match marker {
            0xc0 => {
                self.pos += 1;
                ExtraKey::Nil
            }
            0xc2 | 0xc3 => {
                self.pos += 1;
                ExtraKey::Bool(marker == 0xc3)
            }
            0x00..=0x7f | 0xcc..=0xcf | 0xd0..=0xd3 | 0xe0..=0xff => {
                match self.int("extra_keys")? {
                    Int::Unsigned(v) => ExtraKey::UInt(v),
                    Int::Negative(v) => ExtraKey::Int(v),
                }
            }
            0xca | 0xcb => ExtraKey::Float(self.f64("extra_keys")?),
            0xa0..=0xbf | 0xd9..=0xdb => ExtraKey::Str(self.str("extra_keys")?.to_owned()),
            0xc4..=0xc6 => ExtraKey::Bytes(self.bin_body(marker)?.to_vec()),
            0xc7..=0xc9 | 0xd4..=0xd8 => {
                let (kind, data) = self.ext_body(marker)?;
                ExtraKey::Ext {
                    kind,
                    data: data.to_vec(),
                }
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let len = self.array_len("extra_keys")?;
                let mut items = Vec::with_capacity(self.capacity(len));
                for _ in 0..len {
                    items.push(self.extra_key(depth + 1)?);
                }
                ExtraKey::Array(items)
            }
            0x80..=0x8f | 0xde | 0xdf => {
                let len = self.map_len("extra_keys")?;
                let mut pairs = Vec::with_capacity(self.capacity(len) / 2);
                for _ in 0..len {
                    let key = self.extra_key(depth + 1)?;
                    let value = self.extra_key(depth + 1)?;
                    pairs.push((key, value));
                }
                ExtraKey::Map(pairs)
            }
            0xc1 => return Err(self.unexpected("extra_keys", "a msgpack value", marker)),
        })
    }
}

fn signed(v: i64) -> Int {
    if v >= 0 {
        Int::Unsigned(v as u64)
    } else {
        Int::Negative(v)
    }
}

/// Bytes of a window of [`Reader::token_ids`]' fast path (at most as many ids).
const WINDOW: usize = 64;

/// For each byte of `word` (little-endian: byte `i` of the slice it was read from is byte `i`),
/// the width of the token form it would start: 1 for a positive fixint, 2, 3 and 5 for the
/// `uint8`, `uint16` and `uint32` markers. Other bytes of 0x80 and up get 2 to 6: never used,
/// since the walk checks each marker it reaches against [`TOKEN_FORMS`].
#[inline]
fn form_widths(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    // Per byte: 1 where the byte is 0x80 or more.
    let high = (word >> 7) & ONES;
    // Markers 0xcc, 0xcd, 0xce: low bits 0, 1, 2 -> 2, 3, 5 (no carry: every byte stays <= 6).
    let low = word & (3 * ONES);
    let marker_width = 2 * ONES + low + ((low >> 1) & ONES);
    let mask = high * 0xff;
    (marker_width & mask) | (ONES & !mask)
}

/// How a token id whose first byte is a given marker is laid out: `width` bytes in all (0: not a
/// form an unsigned 32-bit id takes), the value being `(big-endian word at the marker >> shift)
/// & mask` (a positive fixint is its own marker).
#[derive(Clone, Copy)]
struct TokenForm {
    width: u8,
    shift: u8,
    mask: u32,
}

static TOKEN_FORMS: [TokenForm; 256] = {
    let mut forms = [TokenForm {
        width: 0,
        shift: 0,
        mask: 0,
    }; 256];
    let mut marker = 0;
    while marker < 0x80 {
        forms[marker] = TokenForm {
            width: 1,
            shift: 56,
            mask: 0x7f,
        };
        marker += 1;
    }
    forms[0xcc] = TokenForm {
        width: 2,
        shift: 48,
        mask: 0xff,
    };
    forms[0xcd] = TokenForm {
        width: 3,
        shift: 40,
        mask: 0xffff,
    };
    forms[0xce] = TokenForm {
        width: 5,
        shift: 24,
        mask: 0xffff_ffff,
    };
    forms
};

/// One token id in its shortest msgpack form, as the bytes of a little-endian word (marker
/// first), and how many of them it takes. No branch on the form: the form of the next id in a
/// prompt is unpredictable.
#[inline]
fn token_word(token: u32) -> (u64, usize) {
    // 0: fixint, 1: uint8, 2: uint16, 3: uint32.
    let class =
        usize::from(token >= 0x80) + usize::from(token >= 0x100) + usize::from(token >= 0x1_0000);
    const MARKER: [u64; 4] = [0, 0xcc, 0xcd, 0xce];
    // Keeps the low 1, 2 or 4 bytes of the big-endian id.
    const PAYLOAD_SHIFT: [u32; 4] = [0, 24, 16, 0];
    let payload = u64::from(token.swap_bytes() >> PAYLOAD_SHIFT[class]);
    let word = if class == 0 {
        u64::from(token)
    } else {
        MARKER[class] | (payload << 8)
    };
    // 1, 2, 3, 5 bytes, computed rather than looked up: the next id's position depends on it.
    (word, class + 1 + usize::from(class == 3))
}

/// Appends msgpack values to a buffer.
pub(crate) struct Writer<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> Writer<'a> {
    pub(crate) fn new(out: &'a mut Vec<u8>) -> Self {
        Self { out }
    }

    pub(crate) fn nil(&mut self) {
        self.out.push(0xc0);
    }

    pub(crate) fn bool(&mut self, value: bool) {
        self.out.push(if value { 0xc3 } else { 0xc2 });
    }

    pub(crate) fn uint(&mut self, value: u64) {
        if value < 0x80 {
            self.out.push(value as u8);
        } else if let Ok(v) = u8::try_from(value) {
            self.out.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(value) {
            self.out.push(0xcd);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(value) {
            self.out.push(0xce);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            self.out.push(0xcf);
            self.out.extend_from_slice(&value.to_be_bytes());
        }
    }

    /// Writes an array of token ids, each in its shortest form (as [`uint`](Self::uint) would),
    /// through a stack buffer: every id is one whole-word store, with no branch on its width.
    pub(crate) fn token_ids(&mut self, tokens: &[u32]) {
        self.array_len(tokens.len());
        self.token_values(tokens);
    }

    /// The elements of [`token_ids`](Self::token_ids) without the array header.
    pub(crate) fn token_values(&mut self, tokens: &[u32]) {
        const CHUNK: usize = 256;
        self.out.reserve(5 * tokens.len());
        let mut buf = [0u8; 5 * CHUNK + 8];
        for chunk in tokens.chunks(CHUNK) {
            let mut n = 0;
            for &token in chunk {
                let (word, width) = token_word(token);
                // n <= 5 * (CHUNK - 1): the eight bytes fit.
                if let Some(slot) = buf.get_mut(n..n + 8) {
                    slot.copy_from_slice(&word.to_le_bytes());
                }
                n += width;
            }
            self.out.extend_from_slice(&buf[..n]);
        }
    }

    /// Appends bytes that already are msgpack values.
    pub(crate) fn raw(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    /// Writes a signed integer in its shortest form (non-negative values as unsigned, as
    /// msgspec does).
    pub(crate) fn int(&mut self, value: i64) {
        if value >= 0 {
            self.uint(value as u64);
        } else if value >= -32 {
            self.out.push(value as i8 as u8);
        } else if let Ok(v) = i8::try_from(value) {
            self.out.extend_from_slice(&[0xd0, v as u8]);
        } else if let Ok(v) = i16::try_from(value) {
            self.out.push(0xd1);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = i32::try_from(value) {
            self.out.push(0xd2);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            self.out.push(0xd3);
            self.out.extend_from_slice(&value.to_be_bytes());
        }
    }

    pub(crate) fn f64(&mut self, value: f64) {
        self.out.push(0xcb);
        self.out.extend_from_slice(&value.to_bits().to_be_bytes());
    }

    fn len_header(&mut self, len: usize, fix_base: u8, fix_max: usize, m16: u8, m32: u8) {
        if len <= fix_max {
            self.out.push(fix_base | len as u8);
        } else if let Ok(v) = u16::try_from(len) {
            self.out.push(m16);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            // Payload pieces above 4 GiB are not representable in msgpack; callers never
            // build them (a batch that large could not be sent as one ZMQ frame either).
            self.out.push(m32);
            self.out
                .extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
        }
    }

    pub(crate) fn array_len(&mut self, len: usize) {
        self.len_header(len, 0x90, 15, 0xdc, 0xdd);
    }

    pub(crate) fn map_len(&mut self, len: usize) {
        self.len_header(len, 0x80, 15, 0xde, 0xdf);
    }

    pub(crate) fn str(&mut self, value: &str) {
        let len = value.len();
        if len <= 31 {
            self.out.push(0xa0 | len as u8);
        } else if let Ok(v) = u8::try_from(len) {
            self.out.extend_from_slice(&[0xd9, v]);
        } else if let Ok(v) = u16::try_from(len) {
            self.out.push(0xda);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            self.out.push(0xdb);
            self.out
                .extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
        }
        self.out.extend_from_slice(value.as_bytes());
    }

    pub(crate) fn bin(&mut self, value: &[u8]) {
        let len = value.len();
        if let Ok(v) = u8::try_from(len) {
            self.out.extend_from_slice(&[0xc4, v]);
        } else if let Ok(v) = u16::try_from(len) {
            self.out.push(0xc5);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            self.out.push(0xc6);
            self.out
                .extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
        }
        self.out.extend_from_slice(value);
    }

    fn ext(&mut self, kind: i8, data: &[u8]) {
        let fixed = match data.len() {
            1 => Some(0xd4),
            2 => Some(0xd5),
            4 => Some(0xd6),
            8 => Some(0xd7),
            16 => Some(0xd8),
            _ => None,
        };
        if let Some(marker) = fixed {
            self.out.push(marker);
        } else if let Ok(v) = u8::try_from(data.len()) {
            self.out.extend_from_slice(&[0xc7, v]);
        } else if let Ok(v) = u16::try_from(data.len()) {
            self.out.push(0xc8);
            self.out.extend_from_slice(&v.to_be_bytes());
        } else {
            self.out.push(0xc9);
            self.out
                .extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
        }
        self.out.push(kind as u8);
        self.out.extend_from_slice(data);
    }

    pub(crate) fn extra_key(&mut self, key: &ExtraKey) {
        match key {
            ExtraKey::Nil => self.nil(),
            ExtraKey::Bool(v) => self.bool(*v),
            ExtraKey::Int(v) => self.int(*v),
            ExtraKey::UInt(v) => self.uint(*v),
            ExtraKey::Float(v) => self.f64(*v),
            ExtraKey::Str(v) => self.str(v),
            ExtraKey::Bytes(v) => self.bin(v),
            ExtraKey::Ext { kind, data } => self.ext(*kind, data),
            ExtraKey::Array(items) => {
                self.array_len(items.len());
                for item in items {
                    self.extra_key(item);
                }
            }
            ExtraKey::Map(pairs) => {
                self.map_len(pairs.len());
                for (k, v) in pairs {
                    self.extra_key(k);
                    self.extra_key(v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
