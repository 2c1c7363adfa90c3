//! Predict-on-route (`selector/predict.rs`): a booking's prompt held on the chosen rank until the
//! rank's events confirm or withdraw it, or its TTL passes; never counted twice; bounded.

use super::*;
use std::sync::Arc;

const TTL: Duration = DEFAULT_PREDICTED_TTL;

/// A selector with `config` whose workers publish KV events.
fn events_selector_with(config: SelectorConfig, workers: &[WorkerId]) -> Selector {
    let mut s = Selector::new(config);
    for &w in workers {
        s.upsert_worker(WorkerSpec {
            kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", 5000 + w)),
            ..spec(w)
        })
        .expect("upsert");
    }
    s
}

fn hashes(prompt: &[u32]) -> PromptHashes {
    PromptHashes::from_tokens(prompt, BS as usize, crate::hash::BASE_SEED)
}

/// The engine's own (opaque) id of a block: anything but kvroute's hashes.
fn engine(sequence_hash: u64) -> u64 {
    !sequence_hash
}

/// The engine's `Stored` of the prompt's blocks `from..to`, chained under block `from - 1`.
fn stored(prompt: &[u32], from: usize, to: usize, tier: Tier) -> KvEvent {
    let h = hashes(prompt);
    KvEvent::Stored {
        parent: from.checked_sub(1).map(|p| engine(h.sequence[p])),
        blocks: (from..to)
            .map(|i| StoredBlock {
                engine_hash: engine(h.sequence[i]),
                local_hash: h.local[i],
            })
            .collect(),
        tier,
    }
}

/// The engine's `Removed` of the prompt's blocks `from..to`.
fn removed(prompt: &[u32], from: usize, to: usize, tier: Tier) -> KvEvent {
    let h = hashes(prompt);
    KvEvent::Removed {
        engine_hashes: (from..to).map(|i| engine(h.sequence[i])).collect(),
        tier,
    }
}

fn apply(s: &mut Selector, worker_id: WorkerId, event: KvEvent) -> crate::index::ApplyOutcome {
    s.apply_events(worker_id, 0, &[event])
        .expect("known worker")
}

/// `(device, host_pinned)` overlap blocks of a worker's rank 0.
fn overlap(s: &Selector, worker_id: WorkerId, prompt: &[u32]) -> (u32, u32) {
    s.overlap_scores(&partition(), tokens_prompt(prompt))
        .unwrap()
        .workers
        .iter()
        .find(|w| w.worker_id == worker_id)
        .map_or((0, 0), |w| (w.device_blocks, w.host_pinned_blocks))
}

/// Books `prompt` explicitly on `worker_id` under `id`.
/// Books the prompt on the worker and completes its prefill, so the next booking there queues
/// behind no prefill and its prediction's TTL runs from its booking.
fn book(s: &mut Selector, id: &str, worker_id: WorkerId, prompt: &[u32], now: Instant) {
    book_queued(s, id, worker_id, prompt, now);
    s.prefill_complete(id, now).unwrap();
}

/// Books the prompt on the worker, its prefill left running.
fn book_queued(s: &mut Selector, id: &str, worker_id: WorkerId, prompt: &[u32], now: Instant) {
    let p = partition();
    let req = ReservationRequest {
        worker_id: Some(worker_id),
        reservation_id: Some(id),
        prompt: Some(tokens_prompt(prompt)),
        ..ReservationRequest::replay(&p, id)
    };
    s.create_reservation(&req, now).unwrap();
}

fn counters(predicted: u64, confirmed: u64, expired: u64, withdrawn: u64) -> PredictionCounters {
    PredictionCounters {
        predicted,
        confirmed,
        expired,
        withdrawn,
    }
}

/// The index sizes `(blocks, (block, rank) pairs)` of the partition.
fn sizes(s: &Selector) -> (usize, usize) {
    let all = s.index_sizes();
    all.first()
        .map_or((0, 0), |&(_, blocks, pairs)| (blocks, pairs))
}

#[test]
fn a_booking_predicts_its_blocks_for_the_next_select() {
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2, 3]);
    let p = partition();
    let now = Instant::now();
    let prompt = tokens(17);
    let (first, _) = s
        .select_and_reserve(&select_req(&p, &prompt, None), Some("a"), now, &mut rng())
        .unwrap();
    assert_eq!(s.predicted_blocks(), 4, "the prompt's four full blocks");
    // Its prefill is done but no engine event has come yet: the next select sees the prompt on
    // the booked worker.
    s.prefill_complete("a", now).unwrap();
    let next = s
        .select(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(
        next.best_gpu_overlap, 16,
        "the index sees the predicted blocks"
    );
    // (Saving 16 tokens is not worth joining a running request: the pick may be elsewhere.)
    let only = [first.worker_id];
    let next = s
        .select(
            &SelectRequest {
                allowed_worker_ids: Some(&only),
                ..select_req(&p, &prompt, None)
            },
            now,
            &mut rng(),
        )
        .unwrap();
    assert_eq!(next.overlap.gpu, 16);
    assert_eq!(next.effective_prefill_tokens, 1);
    assert_eq!(overlap(&s, first.worker_id, &prompt), (4, 4));
    // A plain select, even one cached for a replay, books and predicts nothing.
    let other = (100..120).collect::<Vec<u32>>();
    s.select(&select_req(&p, &other, Some("later")), now, &mut rng())
        .unwrap();
    assert_eq!(s.predicted_blocks(), 4);
    assert_eq!(s.prediction_counters(), counters(4, 0, 0, 0));
    // Freeing the booking keeps the prediction: the engine keeps what it cached.
    s.free("a", now).unwrap();
    assert_eq!(overlap(&s, first.worker_id, &prompt), (4, 4));
}

#[test]
fn replays_and_explicit_bookings_predict_and_shared_replays_queue_until_a_writer_records() {
    let p = partition();
    let now = Instant::now();
    let prompt = tokens(16);
    // Explicit booking.
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    book(&mut s, "x", 2, &prompt, now);
    assert_eq!(overlap(&s, 2, &prompt), (4, 4));

    // A replay under a shared borrow queues; the next exclusive holder records it first.
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    let chosen = s
        .select(&select_req(&p, &prompt, Some("r")), now, &mut rng())
        .unwrap()
        .worker_id;
    let replay = ReservationRequest::replay(&p, "r");
    assert!(s.create_reservation_shared(&replay, now).unwrap().is_some());
    assert!(s.has_queued_predictions());
    assert_eq!(s.predicted_blocks(), 0, "not yet recorded");
    assert_eq!(overlap(&s, chosen, &prompt), (0, 0));
    // Events of another worker: recorded before they are applied.
    let other = 3 - chosen;
    apply(&mut s, other, stored(&tokens(8), 0, 2, Tier::Device));
    assert!(!s.has_queued_predictions());
    assert_eq!(overlap(&s, chosen, &prompt), (4, 4));

    // Through a lock, a replay records at once when the write lock is free.
    let lock = parking_lot::RwLock::new(events_selector_with(SelectorConfig::default(), &[1, 2]));
    let chosen = lock
        .read()
        .select(&select_req(&p, &prompt, Some("r")), now, &mut rng())
        .unwrap()
        .worker_id;
    lock.create_reservation(&replay, now).unwrap();
    let s = lock.read();
    assert!(!s.has_queued_predictions());
    assert_eq!(overlap(&s, chosen, &prompt), (4, 4));
}

#[test]
fn the_ranks_stored_events_confirm_and_each_block_is_counted_once() {
    let now = Instant::now();
    let prompt = tokens(16);
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    // What the index holds when the engine's events are the only source.
    let mut reference = events_selector_with(
        SelectorConfig {
            predict: PredictConfig {
                ttl: Duration::ZERO,
                ..PredictConfig::default()
            },
            ..SelectorConfig::default()
        },
        &[1, 2],
    );
    book(&mut s, "a", 1, &prompt, now);
    book(&mut reference, "a", 1, &prompt, now);
    assert_eq!(sizes(&s), (4, 4));
    assert_eq!(sizes(&reference), (0, 0));

    // The engine reports the first two blocks: those are confirmed, the rest still predicted.
    for sel in [&mut s, &mut reference] {
        apply(sel, 1, stored(&prompt, 0, 2, Tier::Device));
    }
    assert_eq!(s.prediction_counters(), counters(4, 2, 0, 0));
    assert_eq!(s.predicted_blocks(), 2);
    assert_eq!(overlap(&s, 1, &prompt), (4, 4));
    assert_eq!(sizes(&s), (4, 4), "two real, two predicted, none twice");
    // Then the rest, chained under the engine's own hash of block 2.
    for sel in [&mut s, &mut reference] {
        apply(sel, 1, stored(&prompt, 2, 4, Tier::Device));
    }
    assert_eq!(s.prediction_counters(), counters(4, 4, 0, 0));
    assert_eq!(s.predicted_blocks(), 0);
    assert_eq!(overlap(&s, 1, &prompt), overlap(&reference, 1, &prompt));
    assert_eq!(sizes(&s), sizes(&reference));
    assert_eq!(s.dump(), reference.dump());

    // The engine's removal of the real blocks drops them: nothing of the prediction is left.
    for sel in [&mut s, &mut reference] {
        let outcome = apply(sel, 1, removed(&prompt, 0, 4, Tier::Device));
        assert_eq!(outcome.removed_blocks, 4);
        assert_eq!(outcome.unknown_removed_blocks, 0);
    }
    assert_eq!(overlap(&s, 1, &prompt), (0, 0));
    assert_eq!(sizes(&s), (0, 0));
    // Nothing left to expire, and the engine's events were counted as its own.
    s.tick(now + TTL);
    assert_eq!(s.prediction_counters(), counters(4, 4, 0, 0));
}

#[test]
fn another_ranks_events_confirm_nothing() {
    let now = Instant::now();
    let prompt = tokens(16);
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    book(&mut s, "a", 1, &prompt, now);
    apply(&mut s, 2, stored(&prompt, 0, 4, Tier::Device));
    assert_eq!(s.prediction_counters(), counters(4, 0, 0, 0));
    assert_eq!(overlap(&s, 1, &prompt), (4, 4));
    assert_eq!(overlap(&s, 2, &prompt), (4, 4));
    // Nor does worker 2's removal withdraw worker 1's prediction.
    apply(&mut s, 2, removed(&prompt, 0, 4, Tier::Device));
    assert_eq!(overlap(&s, 1, &prompt), (4, 4));
    assert_eq!(s.predicted_blocks(), 4);
}

#[test]
fn predictions_expire_at_their_ttl() {
    let now = Instant::now();
    let prompt = tokens(16);
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    book(&mut s, "a", 1, &prompt, now);
    s.tick(now + TTL - Duration::from_millis(1));
    assert_eq!(overlap(&s, 1, &prompt), (4, 4));
    s.tick(now + TTL);
    assert_eq!(s.prediction_counters(), counters(4, 0, 4, 0));
    assert_eq!(overlap(&s, 1, &prompt), (0, 0));
    assert_eq!(sizes(&s), (0, 0));
    // The engine's events after the TTL are its own: nothing left to confirm.
    apply(&mut s, 1, stored(&prompt, 0, 4, Tier::Device));
    assert_eq!(s.prediction_counters(), counters(4, 0, 4, 0));
    assert_eq!(sizes(&s), (4, 4));

    // An exclusive booking expires what is due lazily, at its own time, before it picks.
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    let p = partition();
    book(&mut s, "a", 1, &prompt, now);
    let later = now + TTL;
    let other = (100..116).collect::<Vec<u32>>();
    s.select_and_reserve(&select_req(&p, &other, None), Some("b"), later, &mut rng())
        .unwrap();
    s.prefill_complete("b", later).unwrap();
    assert_eq!(overlap(&s, 1, &prompt), (0, 0));
    assert_eq!(s.prediction_counters(), counters(8, 0, 4, 0));
    // A booking of the same prompt later predicts afresh, with its own TTL.
    book(&mut s, "c", 2, &prompt, later);
    assert_eq!(overlap(&s, 2, &prompt), (4, 4));
    s.tick(later + TTL);
    assert_eq!(s.predicted_blocks(), 0);
}

#[test]
fn a_removed_or_a_store_on_another_tier_withdraws_the_prediction() {
    let now = Instant::now();
    let prompt = tokens(16);
    let mut s = events_selector_with(SelectorConfig::default(), &[1]);
    // The rank holds the prompt on its host tier only: the booking predicts the device copy.
    apply(&mut s, 1, stored(&prompt, 0, 4, Tier::Host));
    assert_eq!(overlap(&s, 1, &prompt), (0, 4));
    book(&mut s, "a", 1, &prompt, now);
    assert_eq!(s.predicted_blocks(), 4);
    assert_eq!(overlap(&s, 1, &prompt), (4, 4));
    // The engine drops the host copy of blocks 3 and 4: their prediction goes with it.
    let outcome = apply(&mut s, 1, removed(&prompt, 2, 4, Tier::Host));
    assert_eq!(
        outcome.removed_blocks, 2,
        "the engine's removal, counted as its own"
    );
    assert_eq!(s.prediction_counters(), counters(4, 0, 0, 2));
    assert_eq!(overlap(&s, 1, &prompt), (2, 2));
    assert_eq!(sizes(&s), (2, 4), "blocks 1-2: one node each, held twice");

    // A store of a predicted block on another tier withdraws it too.
    let mut s = events_selector_with(SelectorConfig::default(), &[1]);
    book(&mut s, "a", 1, &prompt, now);
    apply(&mut s, 1, stored(&prompt, 0, 1, Tier::Disk));
    assert_eq!(s.prediction_counters(), counters(4, 0, 0, 1));
    let scores = s
        .overlap_scores(&partition(), tokens_prompt(&prompt))
        .unwrap();
    let w = &scores.workers[0];
    assert_eq!(
        (w.device_blocks, w.disk_blocks),
        (0, 4),
        "block 1 on disk only"
    );
}

#[test]
fn an_engine_restart_withdraws_every_prediction_of_the_rank() {
    let now = Instant::now();
    let a = tokens(16);
    let b = (100..116).collect::<Vec<u32>>();
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    book(&mut s, "a", 1, &a, now);
    book(&mut s, "b", 2, &b, now);
    let outcome = apply(&mut s, 1, KvEvent::Cleared);
    assert_eq!(outcome.cleared_ranks, 1);
    assert_eq!(s.prediction_counters(), counters(8, 0, 0, 4));
    assert_eq!(overlap(&s, 1, &a), (0, 0));
    assert_eq!(overlap(&s, 2, &b), (4, 4), "another rank's restart");
    assert_eq!(sizes(&s), (4, 4));
    // The restarted engine's stores are its own; nothing of the old prediction is left.
    apply(&mut s, 1, stored(&a, 0, 4, Tier::Device));
    assert_eq!(s.prediction_counters(), counters(8, 0, 0, 4));
    s.tick(now + TTL);
    assert_eq!(s.prediction_counters(), counters(8, 0, 4, 4));
    assert_eq!(overlap(&s, 1, &a), (4, 4));
    assert_eq!(sizes(&s), (4, 4));
}

#[test]
fn deleting_or_rewiring_a_worker_withdraws_its_predictions() {
    let now = Instant::now();
    let prompt = tokens(16);
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    book(&mut s, "a", 1, &prompt, now);
    book(&mut s, "b", 2, &prompt, now);
    s.delete_worker(1).unwrap();
    assert_eq!(s.prediction_counters(), counters(8, 0, 0, 4));
    // Re-registered with another event endpoint: its blocks start over, predictions too.
    s.upsert_worker(WorkerSpec {
        kv_events_endpoint: Some("tcp://127.0.0.1:6002".into()),
        ..spec(2)
    })
    .unwrap();
    assert_eq!(s.prediction_counters(), counters(8, 0, 0, 8));
    assert_eq!(sizes(&s), (0, 0));
    // An unchanged re-registration keeps them.
    book(&mut s, "c", 2, &prompt, now);
    s.upsert_worker(WorkerSpec {
        kv_events_endpoint: Some("tcp://127.0.0.1:6002".into()),
        ..spec(2)
    })
    .unwrap();
    assert_eq!(s.predicted_blocks(), 4);
}

#[test]
fn blocks_the_rank_holds_are_not_predicted_again() {
    let now = Instant::now();
    let prompt = tokens(16);
    let mut s = events_selector_with(SelectorConfig::default(), &[1]);
    apply(&mut s, 1, stored(&prompt, 0, 2, Tier::Device));
    book(&mut s, "a", 1, &prompt, now);
    assert_eq!(
        s.prediction_counters(),
        counters(2, 0, 0, 0),
        "blocks 3 and 4"
    );
    assert_eq!(overlap(&s, 1, &prompt), (4, 4));
    assert_eq!(sizes(&s), (4, 4));
    // A second booking of the prompt finds every block held.
    book(&mut s, "b", 1, &prompt, now);
    assert_eq!(s.prediction_counters(), counters(2, 0, 0, 0));
    // Blocks 3-4 reported under the engine's hash of block 2 confirm the prediction.
    apply(&mut s, 1, stored(&prompt, 2, 4, Tier::Device));
    assert_eq!(s.prediction_counters(), counters(2, 2, 0, 0));
    assert_eq!(sizes(&s), (4, 4));
    // No predicted entry shows in the dump, before or after.
    let dumped: Vec<u64> = s
        .dump()
        .into_iter()
        .flat_map(|d| d.events)
        .flat_map(|(_, e)| match e {
            KvEvent::Stored { blocks, .. } => blocks,
            _ => Vec::new(),
        })
        .map(|b| b.engine_hash)
        .collect();
    let h = hashes(&prompt);
    assert_eq!(
        dumped,
        h.sequence.iter().map(|&x| engine(x)).collect::<Vec<_>>()
    );
    book(&mut s, "c", 1, &tokens(24), now);
    assert_eq!(s.predicted_blocks(), 2, "blocks 5 and 6");
    let dumped = s.dump().into_iter().flat_map(|d| d.events).count();
    assert_eq!(dumped, 4, "the engine's four blocks only");
    assert_eq!(overlap(&s, 1, &tokens(24)), (6, 6));
}

#[test]
fn predicted_blocks_are_bounded_and_the_oldest_expire_first() {
    let now = Instant::now();
    let config = SelectorConfig {
        predict: PredictConfig {
            max_blocks: 6,
            ..PredictConfig::default()
        },
        ..SelectorConfig::default()
    };
    let mut s = events_selector_with(config, &[1, 2]);
    let a = tokens(16);
    let b = (100..116).collect::<Vec<u32>>();
    book(&mut s, "a", 1, &a, now);
    book(&mut s, "b", 2, &b, now + Duration::from_millis(1));
    assert_eq!(s.predicted_blocks(), 6);
    assert_eq!(s.prediction_counters(), counters(8, 0, 2, 0));
    // The oldest went: `a`'s first two blocks, so nothing of `a` matches any more.
    assert_eq!(overlap(&s, 1, &a), (0, 0));
    assert_eq!(overlap(&s, 2, &b), (4, 4));
    assert_eq!(sizes(&s), (6, 6));

    // However many bookings, never more than the cap, in the records or the index.
    for i in 0..500u32 {
        let prompt: Vec<u32> = (i * 1000..i * 1000 + 16).collect();
        let worker = 1 + WorkerId::from(i % 2);
        book(&mut s, &format!("m{i}"), worker, &prompt, now);
        assert!(s.predicted_blocks() <= 6);
        assert!(sizes(&s).1 <= 6);
    }
    let c = s.prediction_counters();
    assert_eq!(c.predicted, 8 + 500 * 4);
    assert_eq!(c.predicted, c.confirmed + c.expired + c.withdrawn + 6);
    s.tick(now + TTL + Duration::from_millis(1));
    assert_eq!(s.predicted_blocks(), 0);
    assert_eq!(sizes(&s), (0, 0));
}

#[test]
fn a_ttl_of_zero_disables_prediction_and_modelled_ranks_never_predict() {
    let now = Instant::now();
    let prompt = tokens(16);
    let p = partition();
    let off = SelectorConfig {
        predict: PredictConfig {
            ttl: Duration::ZERO,
            ..PredictConfig::default()
        },
        ..SelectorConfig::default()
    };
    let mut s = events_selector_with(off, &[1, 2]);
    book(&mut s, "a", 1, &prompt, now);
    s.select_and_reserve(&select_req(&p, &prompt, None), Some("b"), now, &mut rng())
        .unwrap();
    s.select(&select_req(&p, &prompt, Some("c")), now, &mut rng())
        .unwrap();
    s.create_reservation(&ReservationRequest::replay(&p, "c"), now)
        .unwrap();
    assert!(!s.has_queued_predictions());
    assert_eq!(s.prediction_counters(), PredictionCounters::default());
    assert_eq!(sizes(&s), (0, 0));

    // A worker without events has its cache modelled (SPEC §9) instead.
    let mut s = selector_with(&[1]);
    book(&mut s, "a", 1, &prompt, now);
    assert_eq!(s.prediction_counters(), PredictionCounters::default());
    assert_eq!(
        overlap(&s, 1, &prompt),
        (4, 4),
        "the TTL model's prediction"
    );
}

#[test]
fn another_replicas_booking_counts_as_load_only() {
    let now = Instant::now();
    let prompt = tokens(16);
    let mut s = events_selector_with(SelectorConfig::default(), &[1]);
    let state = SyncedBooking {
        worker_id: 1,
        dp_rank: 0,
        block_size: BS,
        sequence_hashes: Arc::from(hashes(&prompt).sequence),
        isl_tokens: 16,
        effective_prefill_tokens: 16,
        expected_output_tokens: None,
        track_prefill_tokens: true,
        prefill_complete: false,
        output_blocks: 0,
        decode_blocks: 4,
        session_id: None,
    };
    s.apply_synced_booking(BookingOwner::Remote("r2"), "a", &state, now)
        .unwrap();
    assert_eq!(s.load_tracker().len(), 1);
    assert_eq!(s.prediction_counters(), PredictionCounters::default());
    assert_eq!(overlap(&s, 1, &prompt), (0, 0));
}

#[test]
fn concurrent_replays_through_a_lock_predict_every_block_once() {
    let p = partition();
    let now = Instant::now();
    let lock = parking_lot::RwLock::new(events_selector_with(SelectorConfig::default(), &[1, 2]));
    thread::scope(|scope| {
        for t in 0..4u32 {
            let (lock, p) = (&lock, &p);
            scope.spawn(move || {
                for i in 0..50u32 {
                    let prompt: Vec<u32> = ((t * 50 + i) * 100..(t * 50 + i) * 100 + 16).collect();
                    let id = format!("t{t}-{i}");
                    let mut rng = SmallRng::seed_from_u64(u64::from(t * 50 + i));
                    lock.read()
                        .select(&select_req(p, &prompt, Some(&id)), now, &mut rng)
                        .unwrap();
                    lock.create_reservation(&ReservationRequest::replay(p, &id), now)
                        .unwrap();
                }
            });
        }
    });
    let mut s = lock.write();
    s.settle_predictions();
    assert_eq!(s.predicted_blocks(), 4 * 50 * 4);
    assert_eq!(s.prediction_counters(), counters(800, 0, 0, 0));
    assert_eq!(sizes(&s), (800, 800));
    // 100 prefills queued on each rank: the last ones' TTLs start once those ahead are done.
    s.tick(now + TTL + Duration::from_secs(60));
    assert_eq!(sizes(&s), (0, 0));
}

#[test]
fn a_prompt_queued_behind_prefill_is_held_until_its_turn_and_then_its_ttl() {
    let now = Instant::now();
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2]);
    // 100,000 tokens of prefill running on rank 1 (about 1.5 s at the prior's speed).
    let long: Vec<u32> = (10_000..110_000).collect();
    book_queued(&mut s, "long", 1, &long, now);
    let prompt = tokens(16);
    book_queued(&mut s, "a", 1, &prompt, now);
    let ahead = s.load_tracker().booking("a").unwrap().prefill_tokens_ahead;
    assert_eq!(ahead, 100_000);
    let wait =
        Duration::from_secs_f64(s.load_tracker().speeds(None).prefill_ms(ahead as f64) / 1000.0);
    assert!(wait > Duration::from_secs(1), "{wait:?}");
    s.tick(now + TTL + wait - Duration::from_millis(1));
    assert_eq!(overlap(&s, 1, &prompt), (4, 4), "still queued: still held");
    s.tick(now + TTL + wait + Duration::from_millis(1));
    assert_eq!(overlap(&s, 1, &prompt), (0, 0));
}

/// A hot system prompt held by one worker: as its requests pile up on the holder, the cost in
/// predicted time seeds other workers (each new holder visible at once, predicted on route);
/// when demand falls and the engines drop the unconfirmed copies, requests go back to the holder
/// without seeding anyone again.
#[test]
fn a_hot_prefix_gains_holders_with_demand_and_loses_them_when_it_falls() {
    let mut s = events_selector_with(SelectorConfig::default(), &[1, 2, 3, 4]);
    let p = partition();
    let start = Instant::now();
    let system: Vec<u32> = tokens(4096);
    apply(
        &mut s,
        1,
        stored(&system, 0, 4096 / BS as usize, Tier::Device),
    );
    let prompt = |i: u32| {
        let mut t = system.clone();
        t.extend((0..768).map(|k| 1_000_000 + i * 1000 + k));
        t
    };
    let mut holders_seen = std::collections::BTreeSet::new();
    let mut picks = Vec::new();
    for i in 0..64u32 {
        let now = start + Duration::from_millis(u64::from(i));
        let t = prompt(i);
        let (sel, _) = s
            .select_and_reserve(
                &select_req(&p, &t, None),
                Some(&format!("r{i}")),
                now,
                &mut rng(),
            )
            .unwrap();
        s.prefill_complete(&format!("r{i}"), now).unwrap();
        picks.push(sel.worker_id);
        if holders_seen.insert(sel.worker_id) && i > 0 {
            // A newly seeded worker holds the system prompt for the next select already.
            assert_eq!(
                overlap(&s, sel.worker_id, &system).0,
                4096 / BS,
                "request {i}"
            );
        }
    }
    assert_eq!(picks[0], 1, "the holder first");
    assert_eq!(
        picks[1], 1,
        "a holder with one request still beats recomputing 4k tokens"
    );
    assert!(holders_seen.len() >= 3, "the hot prefix spread: {picks:?}");
    let per_worker = |w| picks.iter().filter(|&&x| x == w).count();
    assert!(
        per_worker(1) < 40,
        "the holder was not piled onto: {picks:?}"
    );

    // Demand falls: every request ends; the seeded copies were never confirmed by their
    // engines and expire.
    for i in 0..64u32 {
        s.free(&format!("r{i}"), start + Duration::from_secs(1))
            .unwrap();
    }
    let later = start + Duration::from_secs(30);
    s.expire_predictions(later);
    for w in [2, 3, 4] {
        assert_eq!(overlap(&s, w, &system).0, 0, "worker {w} dropped its copy");
    }
    for i in 100..120u32 {
        let now = later + Duration::from_millis(u64::from(i) * 100);
        let t = prompt(i);
        let id = format!("r{i}");
        let (sel, _) = s
            .select_and_reserve(&select_req(&p, &t, None), Some(&id), now, &mut rng())
            .unwrap();
        assert_eq!(
            sel.worker_id, 1,
            "low demand: the one holder serves it (request {i})"
        );
        s.prefill_complete(&id, now).unwrap();
        s.free(&id, now + Duration::from_millis(50)).unwrap();
    }
}
