//! The crate's one error type: why a payload or a set of frames could not be decoded.

/// A payload or frame set that cannot be decoded. Every variant carries what is needed to log a
/// useful line; the listener counts the message as malformed and drops it (SPEC §3.1).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The input ended inside a value.
    #[error("payload truncated: needed {needed} more byte(s) at offset {offset}")]
    Truncated { offset: usize, needed: usize },
    /// A value of the wrong msgpack type where `field` was expected.
    #[error("{field}: expected {expected}, found {found} at offset {offset}")]
    UnexpectedType {
        field: &'static str,
        expected: &'static str,
        found: &'static str,
        offset: usize,
    },
    /// A value of the right type but out of range (a negative token id, a rank above `u32`).
    #[error("{field}: invalid value {value}: {reason}")]
    InvalidValue {
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    /// A required field is absent (a short array or a map without the key).
    #[error("{context}: missing field {field}")]
    MissingField {
        context: &'static str,
        field: &'static str,
    },
    /// A string that is not UTF-8.
    #[error("{field}: invalid UTF-8 at offset {offset}")]
    InvalidUtf8 { field: &'static str, offset: usize },
    /// Arrays or maps nested deeper than [`crate::MAX_DEPTH`].
    #[error("values nested deeper than {max_depth} levels at offset {offset}")]
    TooDeep { max_depth: usize, offset: usize },
    /// Bytes left over after the batch.
    #[error("{trailing} trailing byte(s) after the batch")]
    TrailingBytes { trailing: usize },
    /// A multipart message with the wrong number of frames.
    #[error("{message}: expected {expected} frames, got {found}")]
    FrameCount {
        message: &'static str,
        expected: &'static str,
        found: usize,
    },
    /// A frame with the wrong content (a sequence number that is not 8 bytes, a non-empty
    /// delimiter).
    #[error("{message}: bad {frame} frame: {reason}")]
    BadFrame {
        message: &'static str,
        frame: &'static str,
        reason: String,
    },
}
