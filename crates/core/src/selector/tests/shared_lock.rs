//! The lifecycle calls' fast paths under a shared borrow, and concurrent callers through a lock.

use super::*;

/// `s` after a select that cached the selection `id`.
fn with_pending_selection(s: Selector, p: &PartitionKey, id: &str, now: Instant) -> Selector {
    s.select(&select_req(p, &tokens(12), Some(id)), now, &mut rng())
        .unwrap();
    s
}

#[test]
fn concurrent_replays_of_one_selection_book_exactly_once() {
    use std::sync::RwLock;
    let p = partition();
    for iteration in 0..200 {
        let now = Instant::now();
        let id = format!("c{iteration}");
        let s = RwLock::new(with_pending_selection(selector_with(&[1, 2]), &p, &id, now));
        let successes: usize = thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        let mut guard = s.write().unwrap();
                        guard
                            .create_reservation(&ReservationRequest::replay(&p, &id), now)
                            .is_ok() as usize
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(successes, 1, "iteration {iteration}");
        assert_eq!(s.read().unwrap().load_tracker().len(), 1);
    }
}

#[test]
fn shared_lifecycle_calls_leave_the_state_exclusive_ones_do() {
    let p = partition();
    let now = Instant::now();
    let prompts = [tokens(17), tokens(9), (100..140).collect::<Vec<u32>>()];
    let mut exclusive = event_selector(&[1, 2, 3]);
    let mut shared = event_selector(&[1, 2, 3]);
    let mut outcomes = (Vec::new(), Vec::new());
    for (i, prompt) in prompts.iter().enumerate() {
        let id = format!("r{i}");
        for s in [&exclusive, &shared] {
            s.select(
                &select_req(&p, prompt, Some(&id)),
                now,
                &mut SmallRng::seed_from_u64(i as u64),
            )
            .unwrap();
        }
        let req = ReservationRequest::replay(&p, &id);
        outcomes.0.push(
            exclusive
                .create_reservation(&req, now)
                .map_err(|e| e.to_string()),
        );
        outcomes
            .1
            .push(match shared.create_reservation_shared(&req, now) {
                Ok(Some(r)) => Ok(r),
                Ok(None) => panic!("a replay onto an events rank books shared"),
                Err(e) => Err(e.to_string()),
            });
        // A shared replay queues its prediction on route; the lock's next writer records it.
        shared.settle_predictions();
    }
    assert_eq!(outcomes.0, outcomes.1);
    assert_eq!(load_state(&exclusive), load_state(&shared));
    let later = now + Duration::from_secs(1);
    exclusive.prefill_complete("r0", later).unwrap();
    assert_eq!(shared.prefill_complete_shared("r0", later), Ok(()));
    exclusive.output_block("r1", None, later).unwrap();
    assert_eq!(shared.output_block_shared("r1", None, later), Ok(Some(())));
    exclusive.output_block("r1", Some(0.5), later).unwrap();
    assert_eq!(
        shared.output_block_shared("r1", Some(0.5), later),
        Ok(Some(()))
    );
    exclusive.free("r2", now).unwrap();
    assert_eq!(shared.free_shared("r2", now), Ok(Some(())));
    assert_eq!(load_state(&exclusive), load_state(&shared));
    // The same errors, with the same texts.
    let replayed = ReservationRequest::replay(&p, "r0");
    assert_eq!(
        shared
            .create_reservation_shared(&replayed, now)
            .unwrap_err()
            .to_string(),
        exclusive
            .create_reservation(&replayed, now)
            .unwrap_err()
            .to_string()
    );
    assert_eq!(
        shared.free_shared("r2", now).unwrap_err().to_string(),
        exclusive.free("r2", now).unwrap_err().to_string()
    );
    assert_eq!(
        shared
            .prefill_complete_shared("nope", now)
            .unwrap_err()
            .to_string(),
        "reservation nope not found"
    );
    assert_eq!(
        shared
            .output_block_shared("r1", Some(1.5), now)
            .unwrap_err()
            .to_string(),
        "decay_fraction must be between 0.0 and 1.0"
    );
    assert_eq!(load_state(&exclusive), load_state(&shared));
}

#[test]
fn shared_calls_that_would_change_a_cache_model_change_nothing_and_ask_for_exclusive() {
    let p = partition();
    let now = Instant::now();
    for policy in [CachePolicy::Ttl, CachePolicy::Lru] {
        // Workers without KV events: their caches are modelled.
        let mut s = Selector::new(SelectorConfig {
            approximate_policy: policy,
            ..SelectorConfig::default()
        });
        s.upsert_worker(WorkerSpec {
            total_kv_blocks: Some(64),
            ..spec(1)
        })
        .unwrap();
        let prompt = tokens(17);
        s.select(&select_req(&p, &prompt, Some("m")), now, &mut rng())
            .unwrap();
        let before = load_state(&s);
        let replay = ReservationRequest::replay(&p, "m");
        assert_eq!(s.create_reservation_shared(&replay, now), Ok(None));
        assert_eq!(load_state(&s), before, "{policy:?}: nothing booked");
        assert_eq!(
            s.pending_stats().0,
            1,
            "{policy:?}: the selection stays cached"
        );
        s.create_reservation(&replay, now).unwrap();
        if policy == CachePolicy::Lru {
            assert_eq!(s.free_shared("m", now), Ok(None));
            assert_eq!(s.output_block_shared("m", None, now), Ok(None));
            assert!(s.load_tracker().booking("m").is_some(), "still booked");
        }
        assert_eq!(s.prefill_complete_shared("m", now), Ok(()));
        s.free("m", now).unwrap();
        assert!(s.load_tracker().is_empty());
    }
    // The explicit form always takes the exclusive path.
    let s = event_selector(&[1]);
    let prompt = tokens(8);
    let explicit = ReservationRequest {
        worker_id: Some(1),
        reservation_id: Some("x"),
        prompt: Some(tokens_prompt(&prompt)),
        ..ReservationRequest::replay(&p, "x")
    };
    assert_eq!(s.create_reservation_shared(&explicit, now), Ok(None));
    assert!(s.load_tracker().is_empty());
}

#[test]
fn concurrent_shared_replays_of_one_selection_book_once_and_the_others_find_no_entry() {
    use std::sync::RwLock;
    let p = partition();
    for iteration in 0..200 {
        let now = Instant::now();
        let id = format!("c{iteration}");
        let s = RwLock::new(with_pending_selection(
            event_selector(&[1, 2]),
            &p,
            &id,
            now,
        ));
        let outcomes: Vec<Result<Option<Reservation>, Error>> = thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        s.read()
                            .unwrap()
                            .create_reservation_shared(&ReservationRequest::replay(&p, &id), now)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let booked = outcomes.iter().filter(|o| matches!(o, Ok(Some(_)))).count();
        assert_eq!(booked, 1, "iteration {iteration}: {outcomes:?}");
        for o in &outcomes {
            if let Err(e) = o {
                assert!(
                    matches!(e, Error::NoPendingSelection { .. }),
                    "iteration {iteration}: {e}"
                );
            }
        }
        assert_eq!(s.read().unwrap().load_tracker().len(), 1);
    }
}
