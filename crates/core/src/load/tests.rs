use super::*;

use proptest::prelude::*;

const BLOCK_SIZE: u32 = 4;

fn rank(worker_id: u64, dp_rank: u32) -> Rank {
    Rank::new(worker_id, dp_rank)
}

fn booking(id: &str, rank: Rank, hashes: &[u64], isl_tokens: u64) -> Booking {
    Booking {
        reservation_id: id.to_owned(),
        rank,
        block_size: BLOCK_SIZE,
        sequence_hashes: Arc::from(hashes),
        isl_tokens,
        effective_prefill_tokens: isl_tokens,
        expected_output_tokens: None,
        track_prefill_tokens: true,
    }
}

/// A prompt of `blocks` full blocks (`isl` = `blocks × BLOCK_SIZE`) with hashes `first..`.
fn full_prompt(id: &str, rank: Rank, first: u64, blocks: u64) -> Booking {
    let hashes: Vec<u64> = (first..first + blocks).collect();
    booking(id, rank, &hashes, blocks * u64::from(BLOCK_SIZE))
}

fn decode_blocks(tracker: &LoadTracker, rank: Rank) -> u64 {
    tracker.rank_load(rank).active_decode_blocks
}

fn snapshot(tracker: &LoadTracker) -> Vec<(Rank, RankLoad)> {
    let mut ranks: Vec<_> = tracker.ranks().collect();
    ranks.sort_by_key(|(rank, _)| *rank);
    ranks
}

#[test]
fn errors_render_spec_messages_verbatim() {
    let duplicate = LoadError::Duplicate {
        reservation_id: "r1".into(),
        worker_id: 7,
    };
    assert_eq!(
        duplicate.to_string(),
        "Request r1 already exists (assigned to worker 7)"
    );
    let not_found = LoadError::NotFound {
        reservation_id: "r1".into(),
    };
    assert_eq!(not_found.to_string(), "reservation r1 not found");
    let bad = LoadError::BadDecayFraction {
        decay_fraction: 2.0,
    };
    assert_eq!(
        bad.to_string(),
        "decay_fraction must be between 0.0 and 1.0"
    );
}

#[test]
fn shared_prefix_counts_once_per_rank_and_not_across_ranks() {
    let now = Instant::now();
    let (a, b) = (rank(1, 0), rank(2, 0));
    let mut tracker = LoadTracker::new();
    // Two prompts sharing blocks 0..6, then 4 blocks each of their own.
    let first: Vec<u64> = (0..10).collect();
    let second: Vec<u64> = (0..6).chain(100..104).collect();
    let outcome = tracker.book(booking("r1", a, &first, 40), now).unwrap();
    assert_eq!(outcome.shared_blocks, 0);
    let outcome = tracker.book(booking("r2", a, &second, 40), now).unwrap();
    assert_eq!((outcome.prompt_blocks, outcome.shared_blocks), (10, 6));
    assert_eq!(decode_blocks(&tracker, a), 14);
    assert_eq!(tracker.rank_load(a).active_requests, 2);

    // The same prompt on another rank counts in full there.
    tracker.book(booking("r3", b, &second, 40), now).unwrap();
    assert_eq!(decode_blocks(&tracker, b), 10);
    assert_eq!(decode_blocks(&tracker, a), 14);

    // Freeing one sharer keeps the shared blocks counted for the other.
    tracker.free("r1").unwrap();
    assert_eq!(decode_blocks(&tracker, a), 10);
    tracker.free("r2").unwrap();
    assert_eq!(tracker.rank_load(a), RankLoad::default());
    assert_eq!(tracker.bookings_of(a), 0);
    assert_eq!(decode_blocks(&tracker, b), 10);
}

#[test]
fn trailing_partial_block_counts_as_its_own_block() {
    let now = Instant::now();
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    // 10 tokens at block size 4: two full blocks and one partial.
    let outcome = tracker.book(booking("r1", a, &[1, 2], 10), now).unwrap();
    assert_eq!(outcome.prompt_blocks, 3);
    assert_eq!(decode_blocks(&tracker, a), 3);
    // The same prompt again shares the full blocks but not the partial one.
    tracker.book(booking("r2", a, &[1, 2], 10), now).unwrap();
    assert_eq!(decode_blocks(&tracker, a), 4);
    // Prompt shorter than one block: only the partial block.
    tracker.book(booking("r3", a, &[], 3), now).unwrap();
    assert_eq!(decode_blocks(&tracker, a), 5);
    assert_eq!(
        tracker.potential_decode_blocks(a, &[1, 2], 10, BLOCK_SIZE),
        6
    );
    assert_eq!(
        tracker.potential_decode_blocks(a, &[1, 2], 8, BLOCK_SIZE),
        5
    );
}

#[test]
fn prefill_tokens_tracked_only_when_requested() {
    let now = Instant::now();
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    let mut tracked = booking("tracked", a, &[1, 2], 8);
    tracked.effective_prefill_tokens = 5;
    let mut untracked = booking("untracked", a, &[3, 4], 8);
    untracked.track_prefill_tokens = false;
    assert_eq!(tracker.book(tracked, now).unwrap().prefill_tokens, 5);
    assert_eq!(tracker.book(untracked, now).unwrap().prefill_tokens, 0);
    assert_eq!(tracker.rank_load(a).active_prefill_tokens, 5);
    tracker.prefill_complete("untracked", now).unwrap();
    assert_eq!(tracker.rank_load(a).active_prefill_tokens, 5);
    tracker.free("tracked").unwrap();
    assert_eq!(tracker.rank_load(a).active_prefill_tokens, 0);
}

#[test]
fn prefill_complete_is_idempotent() {
    let now = Instant::now();
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    tracker.book(booking("r1", a, &[1], 4), now).unwrap();
    tracker.book(booking("r2", a, &[2], 6), now).unwrap();
    assert_eq!(tracker.rank_load(a).active_prefill_tokens, 10);
    for _ in 0..3 {
        tracker.prefill_complete("r1", now).unwrap();
        assert_eq!(tracker.rank_load(a).active_prefill_tokens, 6);
    }
    assert!(tracker.booking("r1").unwrap().prefill_complete);
    // Freeing after prefill completed releases nothing twice.
    tracker.free("r1").unwrap();
    assert_eq!(tracker.rank_load(a).active_prefill_tokens, 6);
    assert_eq!(
        tracker.prefill_complete("r1", now),
        Err(LoadError::NotFound {
            reservation_id: "r1".into()
        })
    );
}

#[test]
fn decay_example_contributes_11_12_7_8_15() {
    let now = Instant::now();
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("r1", a, 0, 10), now).unwrap();
    assert_eq!(decode_blocks(&tracker, a), 10);
    let calls = [None, None, Some(0.5), None, Some(1.0)];
    let mut seen = Vec::new();
    for decay_fraction in calls {
        tracker.output_block("r1", decay_fraction, now).unwrap();
        seen.push(decode_blocks(&tracker, a));
        assert_eq!(
            tracker.booking("r1").unwrap().decode_blocks,
            decode_blocks(&tracker, a)
        );
    }
    assert_eq!(seen, [11, 12, 7, 8, 15]);
    assert_eq!(tracker.booking("r1").unwrap().output_blocks, 5);
    tracker.free("r1").unwrap();
    assert_eq!(tracker.rank_load(a), RankLoad::default());
}

#[test]
fn decay_below_a_shared_prefix_clamps_rank_at_zero() {
    let now = Instant::now();
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("r1", a, 0, 10), now).unwrap();
    tracker.book(full_prompt("r2", a, 0, 10), now).unwrap();
    tracker.output_block("r1", Some(0.0), now).unwrap();
    assert_eq!(decode_blocks(&tracker, a), 0);
    tracker.output_block("r2", Some(0.0), now).unwrap();
    assert_eq!(decode_blocks(&tracker, a), 0);
    assert_eq!(tracker.potential_decode_blocks(a, &[50], 4, BLOCK_SIZE), 0);
    tracker.free("r1").unwrap();
    assert_eq!(decode_blocks(&tracker, a), 0);
    tracker.free("r2").unwrap();
    assert_eq!(tracker.rank_load(a), RankLoad::default());
}

#[test]
fn free_twice_is_not_found() {
    let now = Instant::now();
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("r1", a, 0, 3), now).unwrap();
    let freed = tracker.free("r1").unwrap();
    assert_eq!(&*freed.reservation_id, "r1");
    assert_eq!(freed.booking.rank, a);
    assert_eq!(
        tracker.free("r1"),
        Err(LoadError::NotFound {
            reservation_id: "r1".into()
        })
    );
    assert!(tracker.is_empty());
    assert_eq!(tracker.rank_load(a), RankLoad::default());
}

#[test]
fn lifecycle_calls_on_unknown_id_are_not_found() {
    let now = Instant::now();
    let mut tracker = LoadTracker::new();
    let not_found = Err(LoadError::NotFound {
        reservation_id: "nope".into(),
    });
    assert_eq!(tracker.prefill_complete("nope", now), not_found);
    assert_eq!(tracker.output_block("nope", None, now), not_found);
    assert_eq!(tracker.output_block("nope", Some(0.5), now), not_found);
    assert!(tracker.free("nope").is_err());
}

#[test]
fn duplicate_book_names_the_worker_and_leaves_state_unchanged() {
    let now = Instant::now();
    let (a, b) = (rank(7, 1), rank(9, 0));
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("r1", a, 0, 4), now).unwrap();
    let before = snapshot(&tracker);
    let view_before = tracker.booking("r1").cloned();
    let later = now + Duration::from_secs(5);
    let error = tracker
        .book(full_prompt("r1", b, 100, 8), later)
        .unwrap_err();
    assert_eq!(
        error,
        LoadError::Duplicate {
            reservation_id: "r1".into(),
            worker_id: 7
        }
    );
    assert_eq!(
        error.to_string(),
        "Request r1 already exists (assigned to worker 7)"
    );
    assert_eq!(snapshot(&tracker), before);
    assert_eq!(tracker.booking("r1").cloned(), view_before);
    assert_eq!(tracker.rank_load(b), RankLoad::default());
    // Not a lifecycle call: the original booking still expires on its own schedule.
    assert_eq!(
        tracker
            .expire(now + Duration::from_secs(10), Duration::from_secs(10))
            .len(),
        1
    );
}

#[test]
fn zero_block_size_is_rejected() {
    let mut tracker = LoadTracker::new();
    let mut zero = full_prompt("r1", rank(1, 0), 0, 2);
    zero.block_size = 0;
    assert_eq!(
        tracker.book(zero, Instant::now()),
        Err(LoadError::ZeroBlockSize)
    );
    assert!(tracker.is_empty());
}

#[test]
fn expire_frees_only_idle_bookings() {
    let start = Instant::now();
    let secs = |s: u64| start + Duration::from_secs(s);
    let max_idle = Duration::from_secs(300);
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("old", a, 0, 2), secs(0)).unwrap();
    tracker
        .book(full_prompt("touched", a, 10, 2), secs(0))
        .unwrap();
    tracker
        .book(full_prompt("young", a, 20, 2), secs(100))
        .unwrap();
    // Each lifecycle call restarts the idle clock.
    tracker.output_block("touched", None, secs(250)).unwrap();
    tracker.prefill_complete("touched", secs(350)).unwrap();

    assert!(tracker.expire(secs(299), max_idle).is_empty());
    let freed = tracker.expire(secs(300), max_idle);
    let ids: Vec<&str> = freed.iter().map(|f| &*f.reservation_id).collect();
    assert_eq!(ids, ["old"]);
    assert_eq!(tracker.len(), 2);
    assert_eq!(decode_blocks(&tracker, a), 5);

    let freed = tracker.expire(secs(400), max_idle);
    let ids: Vec<&str> = freed.iter().map(|f| &*f.reservation_id).collect();
    assert_eq!(ids, ["young"]);
    // A `now` before the last touch counts as not idle at all.
    assert!(tracker.expire(secs(0), max_idle).is_empty());
    let freed = tracker.expire(secs(650), max_idle);
    assert_eq!(freed.len(), 1);
    assert!(tracker.is_empty());
    assert_eq!(tracker.rank_load(a), RankLoad::default());
}

#[test]
fn free_worker_releases_ids_for_rebooking() {
    let now = Instant::now();
    let (w1r0, w1r1, w2r0) = (rank(1, 0), rank(1, 1), rank(2, 0));
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("a", w1r0, 0, 4), now).unwrap();
    tracker.book(full_prompt("b", w1r1, 0, 4), now).unwrap();
    tracker.book(full_prompt("c", w2r0, 0, 4), now).unwrap();
    let mut freed: Vec<String> = tracker
        .free_worker(1)
        .into_iter()
        .map(|f| f.reservation_id.to_string())
        .collect();
    freed.sort();
    assert_eq!(freed, ["a", "b"]);
    assert_eq!(tracker.rank_load(w1r0), RankLoad::default());
    assert_eq!(tracker.rank_load(w1r1), RankLoad::default());
    assert_eq!(decode_blocks(&tracker, w2r0), 4);
    assert!(tracker.free("a").is_err());
    // The released ids can be booked again, on any rank.
    tracker.book(full_prompt("a", w2r0, 0, 4), now).unwrap();
    tracker.book(full_prompt("b", w1r0, 50, 2), now).unwrap();
    assert_eq!(decode_blocks(&tracker, w2r0), 4);
    assert_eq!(tracker.bookings_of(w2r0), 2);
    assert_eq!(decode_blocks(&tracker, w1r0), 2);
}

#[test]
fn free_rank_drops_only_that_rank() {
    let now = Instant::now();
    let (w1r0, w1r1) = (rank(1, 0), rank(1, 1));
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("a", w1r0, 0, 4), now).unwrap();
    tracker.book(full_prompt("b", w1r1, 0, 4), now).unwrap();
    let freed = tracker.free_rank(w1r0);
    assert_eq!(freed.len(), 1);
    assert_eq!(&*freed[0].reservation_id, "a");
    assert_eq!(tracker.rank_load(w1r0), RankLoad::default());
    assert_eq!(tracker.bookings_of(w1r1), 1);
    assert!(tracker.free_rank(w1r0).is_empty());
    assert_eq!(snapshot(&tracker).len(), 1);
}

#[test]
fn bad_decay_fraction_rejected_without_state_change() {
    let start = Instant::now();
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("r1", a, 0, 10), start).unwrap();
    tracker.output_block("r1", None, start).unwrap();
    let before = snapshot(&tracker);
    let view_before = tracker.booking("r1").cloned();
    let later = start + Duration::from_secs(60);
    for bad in [-0.1, 1.000_001, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let error = tracker.output_block("r1", Some(bad), later).unwrap_err();
        assert!(matches!(error, LoadError::BadDecayFraction { .. }));
        assert_eq!(
            error.to_string(),
            "decay_fraction must be between 0.0 and 1.0"
        );
    }
    // Validated before the lookup, too.
    assert!(matches!(
        tracker.output_block("missing", Some(2.0), later),
        Err(LoadError::BadDecayFraction { .. })
    ));
    assert_eq!(snapshot(&tracker), before);
    assert_eq!(tracker.booking("r1").cloned(), view_before);
    // The rejected calls did not touch the booking either.
    assert_eq!(
        tracker
            .expire(start + Duration::from_secs(60), Duration::from_secs(60))
            .len(),
        1
    );
}

#[test]
fn potential_equals_load_after_booking() {
    let now = Instant::now();
    let a = rank(1, 0);
    let mut tracker = LoadTracker::new();
    tracker.book(full_prompt("r1", a, 0, 8), now).unwrap();
    tracker.output_block("r1", None, now).unwrap();
    // Shares 5 blocks, brings 3 new ones, a partial block, and a repeated hash.
    let prompt = [0, 1, 2, 3, 4, 40, 41, 41, 42];
    let isl = 9 * u64::from(BLOCK_SIZE) + 1;
    let predicted = tracker.potential_decode_blocks(a, &prompt, isl, BLOCK_SIZE);
    assert_eq!(predicted, 9 + 3 + 1);
    assert_eq!(
        tracker.potential_decode(&prompt, isl, BLOCK_SIZE).blocks(a),
        predicted
    );
    assert_eq!(
        tracker
            .potential_decode(&prompt, isl, BLOCK_SIZE)
            .blocks(rank(5, 0)),
        8 + 1,
        "an empty rank counts the 8 distinct full blocks and the partial one"
    );
    tracker.book(booking("r2", a, &prompt, isl), now).unwrap();
    assert_eq!(decode_blocks(&tracker, a), predicted);
}

#[test]
fn potential_decode_matches_naive_on_many_ranks() {
    let now = Instant::now();
    let mut tracker = LoadTracker::new();
    // 40 ranks; rank i holds a shared 16-block system prefix plus (i % 5) × 4 blocks of a
    // prompt family, and some ranks hold unrelated prompts.
    let system: Vec<u64> = (0..16).collect();
    for i in 0..40u64 {
        let r = rank(i / 4, (i % 4) as u32);
        let tail = (i % 5) * 4;
        let hashes: Vec<u64> = system.iter().copied().chain(1000..1000 + tail).collect();
        let isl = hashes.len() as u64 * u64::from(BLOCK_SIZE) + i % 3;
        tracker
            .book(booking(&format!("p{i}"), r, &hashes, isl), now)
            .unwrap();
        if i % 3 == 0 {
            tracker
                .book(full_prompt(&format!("u{i}"), r, 5000 + i * 100, 7), now)
                .unwrap();
        }
    }
    let probe: Vec<u64> = system
        .iter()
        .copied()
        .chain(1000..1010)
        .chain(9000..9005)
        .collect();
    let isl = probe.len() as u64 * u64::from(BLOCK_SIZE) + 2;
    let batch = tracker.potential_decode(&probe, isl, BLOCK_SIZE);
    for i in 0..44u64 {
        let r = rank(i / 4, (i % 4) as u32);
        // Naive: rebuild the rank's block set from its bookings.
        let mut held: HashSet<u64> = HashSet::new();
        let mut private: i128 = 0;
        for id in [format!("p{i}"), format!("u{i}")] {
            if let Some(view) = tracker.booking(&id) {
                held.extend(view.sequence_hashes.iter().copied());
                private += i128::from(view.prompt_blocks - view.sequence_hashes.len() as u64);
            }
        }
        held.extend(probe.iter().copied());
        let naive = held.len() as u64 + private as u64 + 1;
        assert_eq!(
            tracker.potential_decode_blocks(r, &probe, isl, BLOCK_SIZE),
            naive
        );
        assert_eq!(batch.blocks(r), naive);
    }
}

// ---- property test against a naive model ------------------------------------------------

/// A live booking as the model keeps it: no indexes, everything recomputed on demand.
#[derive(Debug, Clone)]
struct ModelBooking {
    id: String,
    rank: Rank,
    hashes: Vec<u64>,
    prompt_blocks: u64,
    prefill_tokens: u64,
    outputs: u64,
    /// Its decode blocks were it alone on the rank.
    contribution: i128,
    last_touched: Instant,
}

#[derive(Debug, Default)]
struct Model {
    bookings: Vec<ModelBooking>,
}

impl Model {
    fn find(&mut self, id: &str) -> Option<&mut ModelBooking> {
        self.bookings.iter_mut().find(|b| b.id == id)
    }

    fn rank_load(&self, rank: Rank) -> RankLoad {
        let mine: Vec<&ModelBooking> = self.bookings.iter().filter(|b| b.rank == rank).collect();
        let held: HashSet<u64> = mine.iter().flat_map(|b| b.hashes.iter().copied()).collect();
        let private: i128 = mine
            .iter()
            .map(|b| b.contribution - b.hashes.len() as i128)
            .sum();
        RankLoad {
            active_prefill_tokens: mine.iter().map(|b| b.prefill_tokens).sum(),
            active_decode_blocks: (held.len() as i128 + private).max(0) as u64,
            active_requests: mine.len() as u64,
        }
    }

    fn potential(&self, rank: Rank, probe: &[u64], isl: u64, block_size: u32) -> u64 {
        let mine: Vec<&ModelBooking> = self.bookings.iter().filter(|b| b.rank == rank).collect();
        let mut held: HashSet<u64> = mine.iter().flat_map(|b| b.hashes.iter().copied()).collect();
        held.extend(probe.iter().copied());
        let private: i128 = mine
            .iter()
            .map(|b| b.contribution - b.hashes.len() as i128)
            .sum();
        let partial = isl
            .div_ceil(u64::from(block_size))
            .saturating_sub(probe.len() as u64);
        (held.len() as i128 + private + i128::from(partial)).max(0) as u64
    }
}

#[derive(Debug, Clone)]
enum Op {
    Book {
        id: u8,
        rank: Rank,
        hashes: Vec<u64>,
        isl_tokens: u64,
        block_size: u32,
        prefill: u64,
        track: bool,
        at: u64,
    },
    PrefillComplete {
        id: u8,
        at: u64,
    },
    OutputBlock {
        id: u8,
        decay_fraction: Option<f64>,
        at: u64,
    },
    Free {
        id: u8,
    },
    Expire {
        at: u64,
        max_idle: u64,
    },
    FreeRank {
        rank: Rank,
    },
    FreeWorker {
        worker_id: u64,
    },
}

fn rank_strategy() -> impl Strategy<Value = Rank> {
    (0u64..3, 0u32..2).prop_map(|(w, d)| rank(w, d))
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let book = (
        0u8..8,
        rank_strategy(),
        // Sometimes longer than a free's lookup chunk.
        prop_oneof![
            4 => prop::collection::vec(0u64..16, 0..8),
            1 => prop::collection::vec(0u64..48, FREE_CHUNK + 1..FREE_CHUNK * 2 + 8),
        ],
        prop_oneof![Just(1u32), Just(4u32)],
        0u64..8,
        0u64..40,
        any::<bool>(),
        0u64..60,
    )
        .prop_map(
            |(id, rank, hashes, block_size, extra, prefill, track, at)| {
                // Mostly consistent (full blocks + a partial), sometimes fewer tokens than
                // hashes or more tokens than hashes cover.
                let isl_tokens = (hashes.len() as u64 * u64::from(block_size) + extra)
                    .saturating_sub(if extra == 7 { 9 } else { 0 });
                Op::Book {
                    id,
                    rank,
                    hashes,
                    isl_tokens,
                    block_size,
                    prefill,
                    track,
                    at,
                }
            },
        );
    let decay = prop_oneof![
        4 => Just(None),
        1 => Just(Some(0.5)),
        1 => Just(Some(0.0)),
        1 => Just(Some(1.0)),
        2 => (0.0f64..=1.0).prop_map(Some),
        1 => prop_oneof![Just(-0.5), Just(1.5), Just(f64::NAN)].prop_map(Some),
    ];
    prop_oneof![
        4 => book,
        2 => (0u8..8, 0u64..60).prop_map(|(id, at)| Op::PrefillComplete { id, at }),
        4 => (0u8..8, decay, 0u64..60).prop_map(|(id, decay_fraction, at)| Op::OutputBlock {
            id,
            decay_fraction,
            at
        }),
        2 => (0u8..8).prop_map(|id| Op::Free { id }),
        1 => (0u64..80, 0u64..40).prop_map(|(at, max_idle)| Op::Expire { at, max_idle }),
        1 => rank_strategy().prop_map(|rank| Op::FreeRank { rank }),
        1 => (0u64..3).prop_map(|worker_id| Op::FreeWorker { worker_id }),
    ]
}

fn sorted_ids(freed: Vec<FreedBooking>) -> Vec<String> {
    let mut ids: Vec<String> = freed.iter().map(|f| f.reservation_id.to_string()).collect();
    ids.sort();
    ids
}

fn apply(tracker: &mut LoadTracker, model: &mut Model, op: Op, start: Instant) {
    let at = |secs: u64| start + Duration::from_secs(secs);
    match op {
        Op::Book {
            id,
            rank,
            hashes,
            isl_tokens,
            block_size,
            prefill,
            track,
            at: secs,
        } => {
            let id = format!("r{id}");
            let result = tracker.book(
                Booking {
                    reservation_id: id.clone(),
                    rank,
                    block_size,
                    sequence_hashes: Arc::from(hashes.as_slice()),
                    isl_tokens,
                    effective_prefill_tokens: prefill,
                    expected_output_tokens: Some(3),
                    track_prefill_tokens: track,
                },
                at(secs),
            );
            if let Some(existing) = model.find(&id) {
                assert_eq!(
                    result,
                    Err(LoadError::Duplicate {
                        reservation_id: id,
                        worker_id: existing.rank.worker_id
                    })
                );
                return;
            }
            let prompt_blocks = isl_tokens
                .div_ceil(u64::from(block_size))
                .max(hashes.len() as u64);
            assert_eq!(result.map(|o| o.prompt_blocks), Ok(prompt_blocks));
            model.bookings.push(ModelBooking {
                id,
                rank,
                hashes,
                prompt_blocks,
                prefill_tokens: if track { prefill } else { 0 },
                outputs: 0,
                contribution: i128::from(prompt_blocks),
                last_touched: at(secs),
            });
        }
        Op::PrefillComplete { id, at: secs } => {
            let id = format!("r{id}");
            let result = tracker.prefill_complete(&id, at(secs));
            match model.find(&id) {
                Some(b) => {
                    assert_eq!(result, Ok(()));
                    b.prefill_tokens = 0;
                    b.last_touched = at(secs);
                }
                None => assert_eq!(result, Err(not_found(&id))),
            }
        }
        Op::OutputBlock {
            id,
            decay_fraction,
            at: secs,
        } => {
            let id = format!("r{id}");
            let result = tracker.output_block(&id, decay_fraction, at(secs));
            if let Some(f) = decay_fraction
                && !(0.0..=1.0).contains(&f)
            {
                assert!(matches!(result, Err(LoadError::BadDecayFraction { .. })));
                return;
            }
            match model.find(&id) {
                Some(b) => {
                    assert_eq!(result, Ok(()));
                    b.outputs += 1;
                    b.contribution = match decay_fraction {
                        None => b.contribution + 1,
                        Some(f) => (f * (b.prompt_blocks + b.outputs) as f64).round() as i128,
                    };
                    b.last_touched = at(secs);
                }
                None => assert_eq!(result, Err(not_found(&id))),
            }
        }
        Op::Free { id } => {
            let id = format!("r{id}");
            let result = tracker.free(&id).map(|f| f.reservation_id.to_string());
            match model.bookings.iter().position(|b| b.id == id) {
                Some(index) => {
                    model.bookings.remove(index);
                    assert_eq!(result, Ok(id));
                }
                None => assert_eq!(result, Err(not_found(&id))),
            }
        }
        Op::Expire { at: secs, max_idle } => {
            let now = at(secs);
            let max_idle = Duration::from_secs(max_idle);
            let freed = sorted_ids(tracker.expire(now, max_idle));
            let (expired, live): (Vec<_>, Vec<_>) = model
                .bookings
                .drain(..)
                .partition(|b| now.saturating_duration_since(b.last_touched) >= max_idle);
            model.bookings = live;
            let mut expected: Vec<String> = expired.into_iter().map(|b| b.id).collect();
            expected.sort();
            assert_eq!(freed, expected);
        }
        Op::FreeRank { rank } => {
            let freed = sorted_ids(tracker.free_rank(rank));
            let mut expected: Vec<String> = model
                .bookings
                .iter()
                .filter(|b| b.rank == rank)
                .map(|b| b.id.clone())
                .collect();
            expected.sort();
            model.bookings.retain(|b| b.rank != rank);
            assert_eq!(freed, expected);
        }
        Op::FreeWorker { worker_id } => {
            let freed = sorted_ids(tracker.free_worker(worker_id));
            let mut expected: Vec<String> = model
                .bookings
                .iter()
                .filter(|b| b.rank.worker_id == worker_id)
                .map(|b| b.id.clone())
                .collect();
            expected.sort();
            model.bookings.retain(|b| b.rank.worker_id != worker_id);
            assert_eq!(freed, expected);
        }
    }
}

/// The module's structural invariants, checked from the raw fields.
fn assert_invariants(tracker: &LoadTracker) {
    let table = &tracker.ranks;
    let live_slots = table.slots.iter().flatten().count();
    assert_eq!(table.slot_of.len(), live_slots);
    for (&rank, &slot) in &table.slot_of {
        let state = table.slots[slot]
            .as_ref()
            .expect("slot_of names a live slot");
        assert_eq!(state.rank, rank);
        assert!(state.requests > 0, "a rank without bookings keeps no state");
        let mut refcounts: HashMap<u64, u64> = HashMap::new();
        let mut private = 0i128;
        let mut prefill = 0u128;
        let mut requests = 0u64;
        for booking in tracker.bookings.values().filter(|b| b.view.rank == rank) {
            for &hash in booking.view.sequence_hashes.iter() {
                *refcounts.entry(hash).or_default() += 1;
            }
            private += booking.private_blocks;
            prefill += u128::from(booking.view.active_prefill_tokens);
            requests += 1;
        }
        assert_eq!(
            (private, prefill, requests),
            (state.private_blocks, state.prefill_tokens, state.requests)
        );
        assert_eq!(state.distinct_blocks, refcounts.len() as u64);
        for (hash, count) in &refcounts {
            let list = &table.holders[hash];
            let i = holder_position(list, slot as u32).expect("a held block names its rank");
            assert_eq!(u64::from(holder_count(list[i])), *count);
        }
    }
    for (hash, holders) in &table.holders {
        assert!(!holders.is_empty());
        assert!(
            holders
                .windows(2)
                .all(|w| holder_slot(w[0]) < holder_slot(w[1])),
            "holders of {hash} sorted by slot, no repeats"
        );
        for holder in holders {
            let state = table.slots[holder_slot(*holder) as usize]
                .as_ref()
                .expect("holders name live slots");
            assert!(holder_count(*holder) > 0);
            let occurrences: usize = tracker
                .bookings
                .values()
                .filter(|b| b.view.rank == state.rank)
                .map(|b| b.view.sequence_hashes.iter().filter(|h| *h == hash).count())
                .sum();
            assert_eq!(occurrences as u64, u64::from(holder_count(*holder)));
        }
    }
    assert_eq!(tracker.idle_order.len(), tracker.bookings.len());
    for (id, booking) in &tracker.bookings {
        let key = (booking.view.last_touched, booking.serial);
        assert_eq!(tracker.idle_order.get(&key), Some(id));
    }
}

fn assert_agrees(tracker: &LoadTracker, model: &Model, probes: &[(Vec<u64>, u64)]) {
    assert_invariants(tracker);
    let all_ranks: Vec<Rank> = (0..3)
        .flat_map(|w| (0..2).map(move |d| rank(w, d)))
        .collect();
    let batches: Vec<_> = probes
        .iter()
        .map(|(hashes, isl)| tracker.potential_decode(hashes, *isl, BLOCK_SIZE))
        .collect();
    for &r in &all_ranks {
        let expected = model.rank_load(r);
        assert_eq!(tracker.rank_load(r), expected, "rank {r:?}");
        assert_eq!(tracker.bookings_of(r), expected.active_requests);
        for ((hashes, isl), batch) in probes.iter().zip(&batches) {
            let naive = model.potential(r, hashes, *isl, BLOCK_SIZE);
            assert_eq!(
                tracker.potential_decode_blocks(r, hashes, *isl, BLOCK_SIZE),
                naive,
                "rank {r:?} probe {hashes:?}"
            );
            assert_eq!(batch.blocks(r), naive, "batch rank {r:?} probe {hashes:?}");
        }
    }
    let mut listed: Vec<(Rank, RankLoad)> = tracker.ranks().collect();
    listed.sort_by_key(|(r, _)| *r);
    let expected: Vec<(Rank, RankLoad)> = all_ranks
        .iter()
        .filter(|r| model.bookings.iter().any(|b| b.rank == **r))
        .map(|r| (*r, model.rank_load(*r)))
        .collect();
    assert_eq!(listed, expected);
    assert_eq!(tracker.len(), model.bookings.len());
    for b in &model.bookings {
        let view = tracker.booking(&b.id);
        assert_eq!(
            view.map(|v| (v.rank, v.last_touched)),
            Some((b.rank, b.last_touched))
        );
        assert_eq!(
            view.map(|v| v.decode_blocks),
            Some(b.contribution.max(0) as u64)
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn tracker_matches_naive_model(
        ops in prop::collection::vec(op_strategy(), 1..60),
        probes in prop::collection::vec(
            (prop::collection::vec(0u64..20, 0..8), 0u64..4),
            1..4,
        ),
    ) {
        let probes: Vec<(Vec<u64>, u64)> = probes
            .into_iter()
            .map(|(hashes, extra)| {
                let isl = hashes.len() as u64 * u64::from(BLOCK_SIZE) + extra;
                (hashes, isl)
            })
            .collect();
        let start = Instant::now();
        let mut tracker = LoadTracker::new();
        let mut model = Model::default();
        for op in ops {
            apply(&mut tracker, &mut model, op, start);
            assert_agrees(&tracker, &model, &probes);
        }
    }
}
