//! ZMQ multipart frame layouts of vLLM's `ZmqEventPublisher`, as pure functions over frames
//! (no sockets; the service's listener and the fake engine do the I/O).
//!
//! - Live (PUB → SUB): `[topic, seq, payload]`, `seq` 8 bytes big-endian, from 0 per publisher
//!   process, +1 per batch.
//! - Replay request (DEALER → ROUTER): `[b"", start_seq]`; the ROUTER sees `[identity, b"",
//!   start_seq]`.
//! - Replay replies (ROUTER → DEALER, as the DEALER receives them): `[b"", seq, payload]` (older
//!   vLLM) or `[b"", topic, seq, payload]` (vLLM ≥ 0.26), one per buffered batch with
//!   `seq >= start_seq`, then the end marker: the same layout with seq `-1` (`ff` × 8) and an
//!   empty payload. A ROUTER sends each of these prefixed with the client's identity
//!   ([`routed`]).

use crate::error::WireError;

/// The sequence number of the end-of-replay marker.
pub const END_SEQ: i64 = -1;

/// A sequence number as its 8-byte big-endian frame.
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Reads an 8-byte big-endian sequence frame as a signed number (the end marker is `-1`).
pub fn parse_seq(frame: &[u8], message: &'static str) -> Result<i64, WireError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| WireError::BadFrame {
        message,
        frame: "seq",
        reason: format!("{} bytes, expected 8", frame.len()),
    })?;
    Ok(i64::from_be_bytes(bytes))
}

fn non_negative_seq(frame: &[u8], message: &'static str) -> Result<u64, WireError> {
    let seq = parse_seq(frame, message)?;
    u64::try_from(seq).map_err(|_| WireError::BadFrame {
        message,
        frame: "seq",
        reason: format!("negative sequence number {seq}"),
    })
}

fn empty_delimiter(frame: &[u8], message: &'static str) -> Result<(), WireError> {
    if frame.is_empty() {
        Ok(())
    } else {
        Err(WireError::BadFrame {
            message,
            frame: "delimiter",
            reason: format!("{} bytes, expected an empty frame", frame.len()),
        })
    }
}

/// A live message `[topic, seq, payload]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// Builds the frames of a live message.
pub fn live_message(topic: &[u8], seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
    vec![topic.to_vec(), seq_frame(seq).to_vec(), payload]
}

/// Splits a live message into topic, sequence number and payload.
pub fn parse_live_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<LiveMessage<'_>, WireError> {
    const MESSAGE: &str = "live message";
    let [topic, seq, payload] = frames else {
        return Err(WireError::FrameCount {
            message: MESSAGE,
            expected: "3",
            found: frames.len(),
        });
    };
    Ok(LiveMessage {
        topic: topic.as_ref(),
        seq: non_negative_seq(seq.as_ref(), MESSAGE)?,
        payload: payload.as_ref(),
    })
}

/// The frames a DEALER sends to ask for every buffered batch from `start_seq` on.
pub fn replay_request(start_seq: u64) -> Vec<Vec<u8>> {
    vec![Vec::new(), seq_frame(start_seq).to_vec()]
}

/// A parsed replay request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayRequest<'a> {
    /// The client's identity, when parsed from the ROUTER side.
    pub identity: Option<&'a [u8]>,
    pub start_seq: u64,
}

/// Parses a replay request as sent by a DEALER (`[b"", start_seq]`) or as received by a ROUTER
/// (`[identity, b"", start_seq]`).
pub fn parse_replay_request<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayRequest<'_>, WireError> {
    const MESSAGE: &str = "replay request";
    let (identity, delimiter, seq) = match frames {
        [delimiter, seq] => (None, delimiter, seq),
        [identity, delimiter, seq] => (Some(identity.as_ref()), delimiter, seq),
        _ => {
            return Err(WireError::FrameCount {
                message: MESSAGE,
                expected: "2 or 3",
                found: frames.len(),
            });
        }
    };
    empty_delimiter(delimiter.as_ref(), MESSAGE)?;
    Ok(ReplayRequest {
        identity,
        start_seq: non_negative_seq(seq.as_ref(), MESSAGE)?,
    })
}

/// One replay reply, as the DEALER receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch.
    Batch {
        /// Present in the vLLM ≥ 0.26 layout.
        topic: Option<&'a [u8]>,
        seq: u64,
        payload: &'a [u8],
    },
    /// The end marker (seq `-1`): the replay is complete.
    End,
}

/// Builds a replay reply carrying one buffered batch, in the layout with a topic frame when
/// `topic` is given.
pub fn replay_reply(topic: Option<&[u8]>, seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
    let mut frames = Vec::with_capacity(4);
    frames.push(Vec::new());
    if let Some(topic) = topic {
        frames.push(topic.to_vec());
    }
    frames.push(seq_frame(seq).to_vec());
    frames.push(payload);
    frames
}

/// Builds the end-of-replay marker in the same layout as [`replay_reply`].
pub fn replay_end(topic: Option<&[u8]>) -> Vec<Vec<u8>> {
    let mut frames = Vec::with_capacity(4);
    frames.push(Vec::new());
    if let Some(topic) = topic {
        frames.push(topic.to_vec());
    }
    frames.push(END_SEQ.to_be_bytes().to_vec());
    frames.push(Vec::new());
    frames
}

/// Prefixes frames with a client identity, as a ROUTER socket sends them.
pub fn routed(identity: &[u8], frames: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(frames.len() + 1);
    out.push(identity.to_vec());
    out.extend(frames);
    out
}

/// Parses a replay reply in either layout. The end marker is recognised by its seq alone (its
/// payload is empty in every vLLM release).
pub fn parse_replay_reply<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayReply<'_>, WireError> {
    const MESSAGE: &str = "replay reply";
    let (delimiter, topic, seq, payload) = match frames {
        [delimiter, seq, payload] => (delimiter, None, seq, payload),
        [delimiter, topic, seq, payload] => (delimiter, Some(topic.as_ref()), seq, payload),
        _ => {
            return Err(WireError::FrameCount {
                message: MESSAGE,
                expected: "3 or 4",
                found: frames.len(),
            });
        }
    };
    empty_delimiter(delimiter.as_ref(), MESSAGE)?;
    if parse_seq(seq.as_ref(), MESSAGE)? == END_SEQ {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch {
        topic,
        seq: non_negative_seq(seq.as_ref(), MESSAGE)?,
        payload: payload.as_ref(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_frames_are_big_endian() {
        assert_eq!(seq_frame(1), [0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(parse_seq(&[0xff; 8], "m"), Ok(-1));
        assert!(matches!(
            parse_seq(&[1, 2, 3], "m"),
            Err(WireError::BadFrame { frame: "seq", .. })
        ));
    }

    #[test]
    fn live_messages_round_trip() {
        let frames = live_message(b"kv", 7, vec![1, 2, 3]);
        assert_eq!(
            parse_live_message(&frames),
            Ok(LiveMessage {
                topic: b"kv",
                seq: 7,
                payload: &[1, 2, 3]
            })
        );
        assert!(matches!(
            parse_live_message(&frames[..2]),
            Err(WireError::FrameCount { found: 2, .. })
        ));
        let negative = vec![b"".to_vec(), vec![0xff; 8], vec![]];
        assert!(matches!(
            parse_live_message(&negative),
            Err(WireError::BadFrame { .. })
        ));
    }

    #[test]
    fn replay_requests_parse_from_either_side() {
        let request = replay_request(42);
        assert_eq!(request, vec![vec![], vec![0, 0, 0, 0, 0, 0, 0, 42]]);
        assert_eq!(
            parse_replay_request(&request),
            Ok(ReplayRequest {
                identity: None,
                start_seq: 42
            })
        );
        let at_router = routed(b"client", request);
        assert_eq!(
            parse_replay_request(&at_router),
            Ok(ReplayRequest {
                identity: Some(b"client"),
                start_seq: 42
            })
        );
        let bad = vec![b"x".to_vec(), seq_frame(1).to_vec()];
        assert!(matches!(
            parse_replay_request(&bad),
            Err(WireError::BadFrame {
                frame: "delimiter",
                ..
            })
        ));
    }

    #[test]
    fn replay_replies_parse_in_both_layouts() {
        for topic in [None, Some(&b"kv-events"[..])] {
            let reply = replay_reply(topic, 3, vec![9]);
            assert_eq!(reply.len(), 3 + usize::from(topic.is_some()));
            assert_eq!(
                parse_replay_reply(&reply),
                Ok(ReplayReply::Batch {
                    topic,
                    seq: 3,
                    payload: &[9]
                })
            );
            let end = replay_end(topic);
            assert_eq!(end[end.len() - 2], vec![0xff; 8]);
            assert!(end[end.len() - 1].is_empty());
            assert_eq!(parse_replay_reply(&end), Ok(ReplayReply::End));
        }
        let five: Vec<Vec<u8>> = vec![vec![]; 5];
        assert!(matches!(
            parse_replay_reply(&five),
            Err(WireError::FrameCount { found: 5, .. })
        ));
        let minus_two = vec![vec![], (-2i64).to_be_bytes().to_vec(), vec![]];
        assert!(matches!(
            parse_replay_reply(&minus_two),
            Err(WireError::BadFrame { .. })
        ));
    }
}
