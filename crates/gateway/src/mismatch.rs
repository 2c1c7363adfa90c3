//! Whether each engine counts what the gateway counts: a router whose tokens or blocks are not
//! the engine's routes blind, with nothing failing.
//!
//! Every answer whose `usage` the gateway reads (a whole document's; a stream's usage chunk,
//! when the client asked for one) is held against what the gateway knew when it booked:
//!
//! - **Prompt tokens**: its own token count of the prompt (when it tokenized it) against
//!   `usage.prompt_tokens`. Off when they differ by more than [`TOKEN_SLACK`] tokens and
//!   [`TOKEN_SLACK_SHARE`] of the larger: a template or special tokens (a BOS, an end-of-turn)
//!   may add a few tokens on either side without changing the prompt's blocks, while another
//!   tokenizer changes the count by a share of the prompt, however long.
//! - **Cached tokens**: the overlap the router predicted on the booked rank against
//!   `usage.prompt_tokens_details.cached_tokens` (only when the engine reports it). Off when the
//!   engine's count lies outside the predicted range (device overlap to the longest match of
//!   any tier) by more than two blocks and [`CACHE_SLACK_SHARE`] of the prompt: vLLM recomputes
//!   a fully cached prompt's last token (one block less), and an eviction or a concurrent
//!   twin between the booking and the run moves a few blocks; a router that cannot see the
//!   engine's cache misses by whole prompts.
//!
//! One answer off proves nothing, so each worker keeps its last [`WINDOW`] verdicts per check:
//! the reason is raised when at least [`RAISE_AT`] of them are off, and cleared when at most
//! [`CLEAR_AT`] are (hysteresis: a worker near the line does not flap). The reasons go to the
//! service's registry (`tokenizer_mismatch`, `cache_mismatch`), which makes them the gauge, the
//! warning, the `/loads` field and the status page's banner.

use crate::booking::ServiceLink;
use crate::usage::{self, PromptUsage};
use kvroute_service::degraded::Reason;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Verdicts kept per worker and check.
pub const WINDOW: usize = 16;
/// Off verdicts in the window that raise the reason.
pub const RAISE_AT: usize = 8;
/// Off verdicts in the window at or below which a raised reason clears.
pub const CLEAR_AT: usize = 2;
/// Prompt tokens the two counts may differ by whatever the prompt's length.
pub const TOKEN_SLACK: u64 = 8;
/// The share of the larger count they may differ by.
pub const TOKEN_SLACK_SHARE: f64 = 0.02;
/// Blocks the cached count may lie outside the predicted range by.
pub const CACHE_SLACK_BLOCKS: u64 = 2;
/// The share of the prompt it may lie outside by.
pub const CACHE_SLACK_SHARE: f64 = 0.1;
/// The most bytes of a whole answer kept to find its `usage` (its end).
pub const DOCUMENT_TAIL_BYTES: usize = 64 << 10;

/// What the gateway knew of a request when it booked it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    /// Its token count of the prompt; `None` when it only estimated it.
    pub prompt_tokens: Option<u64>,
    /// The device overlap the router predicted on the booked rank, in tokens.
    pub cached_tokens: u64,
    /// The longest overlap on any tier of it, in tokens (≥ `cached_tokens`).
    pub cached_tokens_max: u64,
    pub block_size: u64,
}

/// Whether two prompt-token counts disagree past the slack.
pub fn tokens_off(ours: u64, theirs: u64) -> bool {
    let slack = TOKEN_SLACK.max((TOKEN_SLACK_SHARE * ours.max(theirs) as f64) as u64);
    ours.abs_diff(theirs) > slack
}

/// Whether the engine's cached count lies outside the predicted range past the slack.
pub fn cache_off(expected: &Expected, prompt_tokens: u64, cached: u64) -> bool {
    let slack = (CACHE_SLACK_BLOCKS * expected.block_size)
        .max((CACHE_SLACK_SHARE * prompt_tokens as f64) as u64);
    let low = expected.cached_tokens;
    let high = expected.cached_tokens_max.max(low);
    cached + slack < low || cached > high + slack
}

/// One check's last verdicts of one worker.
#[derive(Debug, Default)]
struct Window {
    verdicts: VecDeque<bool>,
    raised: bool,
}

/// What a verdict changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Turn {
    Raised,
    Cleared,
}

impl Window {
    fn push(&mut self, off: bool) -> Option<Turn> {
        if self.verdicts.len() == WINDOW {
            self.verdicts.pop_front();
        }
        self.verdicts.push_back(off);
        let offs = self.verdicts.iter().filter(|&&v| v).count();
        if !self.raised && offs >= RAISE_AT {
            self.raised = true;
            return Some(Turn::Raised);
        }
        if self.raised && offs <= CLEAR_AT {
            self.raised = false;
            return Some(Turn::Cleared);
        }
        None
    }

    fn offs(&self) -> usize {
        self.verdicts.iter().filter(|&&v| v).count()
    }
}

#[derive(Debug, Default)]
struct Worker {
    tokens: Window,
    cache: Window,
}

/// Every worker's windows, and the door to the service's registry.
#[derive(Debug)]
pub struct MismatchWatch {
    link: ServiceLink,
    workers: Mutex<HashMap<u64, Worker>>,
}

impl MismatchWatch {
    pub fn new(link: ServiceLink) -> Arc<Self> {
        Arc::new(Self {
            link,
            workers: Mutex::new(HashMap::new()),
        })
    }

    /// One answer of `worker_id`: its usage against what was expected.
    pub fn observe(&self, worker_id: u64, expected: &Expected, usage: &PromptUsage) {
        let mut reports = Vec::new();
        {
            let mut workers = self.workers.lock();
            let worker = workers.entry(worker_id).or_default();
            if let Some(ours) = expected.prompt_tokens {
                let turn = worker.tokens.push(tokens_off(ours, usage.prompt_tokens));
                let message = format!(
                    "worker {worker_id}: in {offs} of its last {n} answers the engine counted \
                     other prompt tokens than the gateway (last: gateway {ours}, engine {theirs}): \
                     give the gateway the engine's tokenizer and chat template (--tokenizer \
                     MODEL=PATH of the model the engine serves, or --tokenize remote), and check \
                     that the engine adds no template or system prompt of its own",
                    offs = worker.tokens.offs(),
                    n = worker.tokens.verdicts.len(),
                    theirs = usage.prompt_tokens,
                );
                reports.push((Reason::TokenizerMismatch, turn, message));
            }
            if let Some(cached) = usage.cached_tokens {
                let turn = worker
                    .cache
                    .push(cache_off(expected, usage.prompt_tokens, cached));
                let message = format!(
                    "worker {worker_id}: in {offs} of its last {n} answers the engine's cached \
                     prompt tokens disagreed with the overlap the router predicted (last: \
                     predicted {predicted}, engine cached {cached}): check that the worker's \
                     block_size is the engine's --block-size, that its KV events reach the \
                     router, and that the gateway tokenizes as the engine does",
                    offs = worker.cache.offs(),
                    n = worker.cache.verdicts.len(),
                    predicted = expected.cached_tokens,
                );
                reports.push((Reason::CacheMismatch, turn, message));
            }
        }
        for (reason, turn, message) in reports {
            match turn {
                Some(Turn::Raised) => self.link.report_degraded(worker_id, reason, Some(message)),
                Some(Turn::Cleared) => self.link.report_degraded(worker_id, reason, None),
                None => {}
            }
        }
    }

    /// A probe for one answer, to hand to its body.
    pub fn probe(self: &Arc<Self>, worker_id: u64, expected: Expected) -> UsageProbe {
        UsageProbe {
            watch: Arc::clone(self),
            worker_id,
            expected,
            usage: None,
            tail: Vec::new(),
        }
    }
}

/// Collects one answer's usage as its body passes, and hands it over at the end.
#[derive(Debug)]
pub struct UsageProbe {
    watch: Arc<MismatchWatch>,
    worker_id: u64,
    expected: Expected,
    /// A stream's usage chunk.
    usage: Option<PromptUsage>,
    /// A whole answer's last [`DOCUMENT_TAIL_BYTES`].
    tail: Vec<u8>,
}

impl UsageProbe {
    /// A stream's usage chunk was read.
    pub fn stream_usage(&mut self, usage: PromptUsage) {
        self.usage = Some(usage);
    }

    /// More bytes of a whole answer.
    pub fn document_bytes(&mut self, bytes: &[u8]) {
        if bytes.len() >= DOCUMENT_TAIL_BYTES {
            self.tail.clear();
            self.tail
                .extend_from_slice(&bytes[bytes.len() - DOCUMENT_TAIL_BYTES..]);
            return;
        }
        let over = (self.tail.len() + bytes.len()).saturating_sub(DOCUMENT_TAIL_BYTES);
        self.tail.drain(..over);
        self.tail.extend_from_slice(bytes);
    }

    /// The answer ended complete: its usage, if it had one, is observed.
    pub fn finish(self) {
        let usage = self.usage.or_else(|| usage::document_usage(&self.tail));
        if let Some(usage) = usage {
            self.watch.observe(self.worker_id, &self.expected, &usage);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected(cached: u64, max: u64) -> Expected {
        Expected {
            prompt_tokens: Some(1000),
            cached_tokens: cached,
            cached_tokens_max: max,
            block_size: 16,
        }
    }

    #[test]
    fn token_counts_may_differ_by_a_few_tokens_or_a_small_share() {
        assert!(!tokens_off(100, 100));
        assert!(!tokens_off(100, 108), "a template's few tokens");
        assert!(tokens_off(100, 109));
        assert!(!tokens_off(10_000, 10_190), "2 % of a long prompt");
        assert!(tokens_off(10_000, 10_300));
        assert!(tokens_off(1000, 700), "another tokenizer");
        assert!(tokens_off(700, 1000));
    }

    #[test]
    fn cached_counts_may_miss_the_prediction_by_two_blocks_or_a_tenth() {
        // vLLM's fully cached prompt: the last block recomputed.
        assert!(!cache_off(&expected(992, 992), 1000, 976));
        assert!(!cache_off(&expected(0, 0), 1000, 0));
        // A tenth of the prompt (100 tokens) either way.
        assert!(!cache_off(&expected(0, 0), 1000, 96));
        assert!(
            cache_off(&expected(0, 0), 1000, 112),
            "the router saw nothing"
        );
        assert!(
            cache_off(&expected(992, 992), 1000, 0),
            "the engine had nothing"
        );
        // Host or disk hits count up to the longest match.
        assert!(!cache_off(&expected(320, 992), 1000, 992));
        // A short prompt: two blocks of slack.
        assert!(!cache_off(&expected(0, 0), 40, 32));
        assert!(cache_off(&expected(0, 0), 80, 64));
    }

    #[test]
    fn a_window_raises_at_half_off_and_clears_near_none() {
        let mut w = Window::default();
        for _ in 0..7 {
            assert_eq!(w.push(true), None);
        }
        assert_eq!(w.push(true), Some(Turn::Raised));
        assert_eq!(w.push(true), None, "raised once");
        // Good answers push the bad ones out: 9 off of 16 until 14 good came.
        let mut cleared_after = None;
        for i in 1..=20 {
            if w.push(false) == Some(Turn::Cleared) {
                cleared_after = Some(i);
                break;
            }
        }
        assert_eq!(cleared_after, Some(14));
        // Alternating (half off) raises again, and a flapping worker stays raised.
        let mut turns = Vec::new();
        for i in 0..64 {
            if let Some(t) = w.push(i % 2 == 0) {
                turns.push(t);
            }
        }
        assert_eq!(turns, vec![Turn::Raised]);
    }

    #[test]
    fn a_documents_tail_is_bounded_and_keeps_the_end() {
        let watch = MismatchWatch::new(ServiceLink::new(
            kvroute_service::AppState::new(kvroute_service::ServeConfig::defaults()).unwrap(),
        ));
        let mut probe = watch.probe(1, expected(0, 0));
        probe.document_bytes(&vec![b' '; DOCUMENT_TAIL_BYTES - 10]);
        probe.document_bytes(br#"{"usage":{"prompt_tokens":7}}"#);
        assert_eq!(probe.tail.len(), DOCUMENT_TAIL_BYTES);
        assert!(probe.tail.ends_with(b"7}}"));
        probe.document_bytes(&vec![b'x'; DOCUMENT_TAIL_BYTES * 2]);
        assert_eq!(probe.tail.len(), DOCUMENT_TAIL_BYTES);
    }
}
