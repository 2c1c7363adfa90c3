//! Per-endpoint sequence tracking (SPEC §3.1), without I/O: the listener asks what a sequence
//! number means, acts on the answer, then records the message as received.

/// What a message's sequence number says, relative to what the endpoint delivered before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The next message in order, or the first one when nothing is expected yet.
    InOrder,
    /// `missed` messages starting at `first_missing` never arrived; this one follows them.
    Gap { first_missing: u64, missed: u64 },
    /// The same number as the last message received.
    Duplicate,
    /// Lower than the last message received: on the live stream the engine restarted; for a
    /// replayed or buffered message, it was already covered.
    Behind,
}

/// The last sequence number received on one endpoint, or the one expected next.
///
/// `next` is `None` until the endpoint delivered something or a replay fixed where the stream
/// starts; the first message then is in order whatever its number (a listener without replay
/// joins a running engine mid-stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SequenceTracker {
    next: Option<u64>,
}

impl SequenceTracker {
    /// Where a replay must start to deliver everything not yet received: `last + 1`, or 0.
    pub fn replay_start(&self) -> u64 {
        self.next.unwrap_or(0)
    }

    /// Whether a message was received (or a replay fixed the expected start).
    pub fn has_position(&self) -> bool {
        self.next.is_some()
    }

    pub fn classify(&self, seq: u64) -> SeqVerdict {
        let Some(next) = self.next else {
            return SeqVerdict::InOrder;
        };
        match seq.cmp(&next) {
            std::cmp::Ordering::Equal => SeqVerdict::InOrder,
            std::cmp::Ordering::Greater => SeqVerdict::Gap {
                first_missing: next,
                missed: seq - next,
            },
            std::cmp::Ordering::Less if seq + 1 == next => SeqVerdict::Duplicate,
            std::cmp::Ordering::Less => SeqVerdict::Behind,
        }
    }

    /// Records `seq` as received. Never moves backwards (use [`restart`](Self::restart)).
    pub fn record(&mut self, seq: u64) {
        // Live and replayed sequence numbers come from an 8-byte signed frame and are
        // non-negative, so `seq + 1` cannot overflow; saturate anyway.
        let after = seq.saturating_add(1);
        if self.next.is_none_or(|next| after > next) {
            self.next = Some(after);
        }
    }

    /// Expects the stream to continue at `seq` (after a replay that delivered nothing past it).
    pub fn expect_from(&mut self, seq: u64) {
        if self.next.is_none_or(|next| seq > next) {
            self.next = Some(seq);
        }
    }

    /// The engine restarted: its numbering starts over at 0.
    pub fn restart(&mut self) {
        self.next = Some(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_message_is_in_order_whatever_its_number() {
        let t = SequenceTracker::default();
        assert_eq!(t.classify(0), SeqVerdict::InOrder);
        assert_eq!(t.classify(41), SeqVerdict::InOrder);
        assert_eq!(t.replay_start(), 0);
        assert!(!t.has_position());
    }

    #[test]
    fn in_order_duplicate_gap_and_behind() {
        let mut t = SequenceTracker::default();
        t.record(5);
        assert_eq!(t.replay_start(), 6);
        assert_eq!(t.classify(6), SeqVerdict::InOrder);
        assert_eq!(t.classify(5), SeqVerdict::Duplicate);
        assert_eq!(t.classify(4), SeqVerdict::Behind);
        assert_eq!(t.classify(0), SeqVerdict::Behind);
        assert_eq!(
            t.classify(9),
            SeqVerdict::Gap {
                first_missing: 6,
                missed: 3
            }
        );
    }

    #[test]
    fn record_never_moves_backwards() {
        let mut t = SequenceTracker::default();
        t.record(7);
        t.record(3);
        assert_eq!(t.replay_start(), 8);
        t.expect_from(4);
        assert_eq!(t.replay_start(), 8);
        t.expect_from(10);
        assert_eq!(t.classify(10), SeqVerdict::InOrder);
    }

    #[test]
    fn an_empty_replay_fixes_the_start() {
        let mut t = SequenceTracker::default();
        t.expect_from(0);
        assert!(t.has_position());
        // Message 0 was published before the subscription took effect and is lost.
        assert_eq!(
            t.classify(1),
            SeqVerdict::Gap {
                first_missing: 0,
                missed: 1
            }
        );
    }

    #[test]
    fn restart_starts_over_at_zero() {
        let mut t = SequenceTracker::default();
        t.record(100);
        assert_eq!(t.classify(2), SeqVerdict::Behind);
        t.restart();
        assert_eq!(t.classify(0), SeqVerdict::InOrder);
        assert_eq!(
            t.classify(2),
            SeqVerdict::Gap {
                first_missing: 0,
                missed: 2
            }
        );
    }

    #[test]
    fn largest_sequence_number_does_not_overflow() {
        let mut t = SequenceTracker::default();
        t.record(u64::MAX);
        assert_eq!(t.replay_start(), u64::MAX);
    }
}
