use super::*;
use crate::approx::CachePolicy;
use crate::error::PartitionKey;
use crate::event::{KvEvent, Rank};
use crate::event::{StoredBlock, Tier};
use crate::hash::PromptHashes;
use crate::load::RankLoad;
use crate::schedule::Overrides;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use std::thread;

const BS: u32 = 4;

fn partition() -> PartitionKey {
    PartitionKey::new("m", "g")
}

fn spec(worker_id: WorkerId) -> WorkerSpec {
    WorkerSpec {
        worker_id,
        model_name: "m".into(),
        routing_group: "g".into(),
        endpoint: Some(format!("http://w{worker_id}")),
        block_size: Some(BS),
        ..WorkerSpec::default()
    }
}

fn tokens(n: u32) -> Vec<u32> {
    (1..=n).collect()
}

fn rng() -> SmallRng {
    SmallRng::seed_from_u64(3)
}

fn selector_with(workers: &[WorkerId]) -> Selector {
    let mut s = Selector::default();
    for &w in workers {
        let outcome = s.upsert_worker(spec(w)).expect("upsert");
        assert_eq!(outcome.record.lifecycle, Lifecycle::Schedulable);
    }
    s
}

/// A `Stored` event of a prompt's blocks from the first, engine hashes its sequence hashes.
pub(super) fn stored_event(hashes: &PromptHashes, tier: Tier) -> KvEvent {
    let blocks = hashes
        .local
        .iter()
        .zip(&hashes.sequence)
        .map(|(&local_hash, &engine_hash)| StoredBlock {
            engine_hash,
            local_hash,
        })
        .collect();
    KvEvent::Stored {
        parent: None,
        blocks,
        tier,
    }
}

/// Publishes the prompt's full blocks as stored on the worker's rank 0.
fn store_prompt(s: &mut Selector, worker_id: WorkerId, prompt: &[u32], tier: Tier) {
    let hashes = PromptHashes::from_tokens(prompt, BS as usize, crate::hash::BASE_SEED);
    s.apply_events(worker_id, 0, &[stored_event(&hashes, tier)])
        .expect("known worker");
}

fn tokens_prompt(t: &[u32]) -> Prompt<'_> {
    Prompt::Tokens {
        tokens: t,
        lora_name: None,
        cache_salt: None,
        extras: crate::hash::BlockExtras::default(),
    }
}

fn select_req<'a>(p: &'a PartitionKey, t: &'a [u32], id: Option<&'a str>) -> SelectRequest<'a> {
    SelectRequest {
        selection_id: id,
        ..SelectRequest::new(p, tokens_prompt(t))
    }
}

#[test]
fn select_follows_the_cached_prefix_and_books_nothing() {
    let mut s = selector_with(&[1, 2, 3]);
    let prompt = tokens(17);
    store_prompt(&mut s, 2, &prompt, Tier::Device);
    let p = partition();
    let now = Instant::now();
    let sel = s
        .select(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(sel.worker_id, 2);
    assert_eq!(sel.overlap.gpu, 16);
    assert_eq!(sel.overlap.longest_matched, 16);
    assert_eq!(sel.effective_prefill_tokens, 1);
    assert_eq!(sel.potential_decode_blocks, 5, "ceil(17/4)");
    assert_eq!(sel.overlap.dp, vec![(0, 16)]);
    assert!(s.load_tracker().is_empty(), "select books nothing");
    assert_eq!(s.pending_stats().0, 0, "no selection_id, nothing cached");
}

#[test]
fn host_tier_overlap_is_credited_at_its_weight() {
    let mut s = selector_with(&[1]);
    let prompt = tokens(17);
    store_prompt(&mut s, 1, &prompt[..8], Tier::Device);
    // Blocks 3-4 on the host, chained under block 2.
    let hashes = PromptHashes::from_tokens(&prompt, BS as usize, crate::hash::BASE_SEED);
    s.apply_events(
        1,
        0,
        &[KvEvent::Stored {
            parent: Some(hashes.sequence[1]),
            blocks: (2..4)
                .map(|i| StoredBlock {
                    engine_hash: hashes.sequence[i],
                    local_hash: hashes.local[i],
                })
                .collect(),
            tier: Tier::Host,
        }],
    );
    let p = partition();
    let sel = s
        .select(&select_req(&p, &prompt, None), Instant::now(), &mut rng())
        .unwrap();
    assert_eq!(
        (sel.overlap.gpu, sel.overlap.cpu, sel.overlap.disk),
        (8, 16, 16)
    );
    // Dynamo's recorded answer for the same situation: 17 − ⌊4 × 3.5⌋ = 3.
    assert_eq!(sel.effective_prefill_tokens, 3);
}

#[test]
fn replay_books_the_cached_selection_and_consumes_it() {
    let mut s = selector_with(&[1, 2]);
    let prompt = tokens(17);
    store_prompt(&mut s, 1, &prompt, Tier::Device);
    let p = partition();
    let now = Instant::now();
    let sel = s
        .select(&select_req(&p, &prompt, Some("s1")), now, &mut rng())
        .unwrap();
    assert_eq!(s.pending_stats().0, 1);
    // The reservation's own fields are ignored on replay.
    let other = tokens(40);
    let req = ReservationRequest {
        dp_rank: Some(3),
        prompt: Some(tokens_prompt(&other)),
        effective_prefill_tokens: Some(40),
        expected_output_tokens: Some(999),
        ..ReservationRequest::replay(&p, "s1")
    };
    let r = s.create_reservation(&req, now).unwrap();
    assert_eq!((r.worker_id, r.dp_rank), (sel.worker_id, sel.dp_rank));
    assert_eq!(r.reservation_id, "s1");
    let booking = s.load_tracker().booking("s1").cloned().expect("booked");
    assert_eq!(booking.isl_tokens, 17);
    assert_eq!(
        booking.effective_prefill_tokens,
        sel.effective_prefill_tokens
    );
    assert_eq!(booking.expected_output_tokens, None);
    assert_eq!(s.pending_stats().0, 0, "consumed");
    // A second replay finds nothing.
    let again = s.create_reservation(&ReservationRequest::replay(&p, "s1"), now);
    assert!(matches!(again, Err(Error::NoPendingSelection { .. })));
    // Lifecycle uses the booking id.
    s.prefill_complete("s1", now).unwrap();
    s.output_block("s1", None, now).unwrap();
    s.free("s1", now).unwrap();
    assert!(matches!(
        s.free("s1", now),
        Err(Error::ReservationNotFound { .. })
    ));
}

#[test]
fn reservation_id_names_the_booking_and_defaults_to_selection_id() {
    let mut s = selector_with(&[1]);
    let prompt = tokens(9);
    let p = partition();
    let now = Instant::now();
    s.select(&select_req(&p, &prompt, Some("sel")), now, &mut rng())
        .unwrap();
    let req = ReservationRequest {
        reservation_id: Some("res"),
        ..ReservationRequest::replay(&p, "sel")
    };
    let r = s.create_reservation(&req, now).unwrap();
    assert_eq!(r.reservation_id, "res");
    assert_eq!(r.selection_id.as_deref(), Some("sel"));
    assert!(s.load_tracker().booking("res").is_some());
    assert!(s.load_tracker().booking("sel").is_none());
    assert!(matches!(
        s.free("sel", now),
        Err(Error::ReservationNotFound { .. })
    ));
    s.free("res", now).unwrap();
}

#[test]
fn select_with_a_newer_selection_replaces_the_cached_entry() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    s.select(&select_req(&p, &tokens(9), Some("x")), now, &mut rng())
        .unwrap();
    s.select(&select_req(&p, &tokens(13), Some("x")), now, &mut rng())
        .unwrap();
    assert_eq!(s.pending_stats().0, 1);
    s.create_reservation(&ReservationRequest::replay(&p, "x"), now)
        .unwrap();
    assert_eq!(s.load_tracker().booking("x").unwrap().isl_tokens, 13);
}

#[test]
fn select_and_reserve_never_touches_the_pending_cache() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    s.select(&select_req(&p, &tokens(9), Some("x")), now, &mut rng())
        .unwrap();
    let (sel, r) = s
        .select_and_reserve(
            &select_req(&p, &tokens(5), Some("x")),
            None,
            now,
            &mut rng(),
        )
        .unwrap();
    assert_eq!(r.reservation_id, "x");
    assert_eq!(sel.isl_tokens, 5);
    assert_eq!(s.pending_stats().0, 1, "the cached select is untouched");
    let (_, generated) = s
        .select_and_reserve(&select_req(&p, &tokens(5), None), None, now, &mut rng())
        .unwrap();
    assert_eq!(generated.reservation_id.len(), 36);
    assert_eq!(&generated.reservation_id[14..15], "4", "UUID v4");
}

#[test]
fn explicit_form_wins_and_discards_the_cached_selection() {
    let mut s = selector_with(&[1, 2]);
    let p = partition();
    let now = Instant::now();
    s.select(&select_req(&p, &tokens(9), Some("s")), now, &mut rng())
        .unwrap();
    let prompt = tokens(12);
    let req = ReservationRequest {
        worker_id: Some(2),
        prompt: Some(tokens_prompt(&prompt)),
        ..ReservationRequest::replay(&p, "s")
    };
    let r = s.create_reservation(&req, now).unwrap();
    assert_eq!(r.worker_id, 2);
    assert_eq!(s.pending_stats().0, 0, "the cached selection is gone");
    let b = s.load_tracker().booking("s").cloned().unwrap();
    assert_eq!((b.isl_tokens, b.effective_prefill_tokens), (12, 12));
    // Discarded even when the explicit booking then fails.
    s.select(&select_req(&p, &tokens(9), Some("t")), now, &mut rng())
        .unwrap();
    let bad = ReservationRequest {
        worker_id: Some(77),
        prompt: Some(tokens_prompt(&prompt)),
        ..ReservationRequest::replay(&p, "t")
    };
    assert!(matches!(
        s.create_reservation(&bad, now),
        Err(Error::WorkerNotSchedulable { worker_id: 77, .. })
    ));
    assert!(matches!(
        s.create_reservation(&ReservationRequest::replay(&p, "t"), now),
        Err(Error::NoPendingSelection { .. })
    ));
}

#[test]
fn explicit_form_computes_effective_prefill_from_the_index() {
    let mut s = selector_with(&[1]);
    let prompt = tokens(17);
    store_prompt(&mut s, 1, &prompt, Tier::Device);
    let p = partition();
    let req = ReservationRequest {
        worker_id: Some(1),
        reservation_id: Some("e"),
        prompt: Some(tokens_prompt(&prompt)),
        ..ReservationRequest::replay(&p, "unused")
    };
    let req = ReservationRequest {
        selection_id: None,
        ..req
    };
    s.create_reservation(&req, Instant::now()).unwrap();
    assert_eq!(
        s.load_tracker()
            .booking("e")
            .unwrap()
            .effective_prefill_tokens,
        1
    );
}

#[test]
fn error_rows_of_the_spec() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    let prompt = tokens(8);
    let none = ReservationRequest {
        selection_id: None,
        ..ReservationRequest::replay(&p, "")
    };
    assert_eq!(
        s.create_reservation(&none, now).unwrap_err().to_string(),
        "include selection_id to replay a cached selection, or worker_id with the prompt for a self-contained booking"
    );
    let unnamed = ReservationRequest {
        worker_id: Some(1),
        prompt: Some(tokens_prompt(&prompt)),
        ..none
    };
    assert_eq!(
        s.create_reservation(&unnamed, now).unwrap_err().to_string(),
        "reservation_id or selection_id is required to name the booking"
    );
    let too_much = ReservationRequest {
        reservation_id: Some("r"),
        effective_prefill_tokens: Some(9),
        ..unnamed
    };
    assert_eq!(
        s.create_reservation(&too_much, now)
            .unwrap_err()
            .to_string(),
        "effective_prefill_tokens (9) must not exceed isl_tokens (8)"
    );
    let no_prompt = ReservationRequest {
        reservation_id: Some("r"),
        worker_id: Some(1),
        ..none
    };
    assert_eq!(
        s.create_reservation(&no_prompt, now)
            .unwrap_err()
            .to_string(),
        "sequence_hashes is required without token_ids"
    );
    let other = PartitionKey::new("m", "other");
    assert_eq!(
        s.select(&select_req(&other, &prompt, None), now, &mut rng())
            .unwrap_err()
            .to_string(),
        "no schedulable workers for model=m routing_group=other"
    );
    // Replay in a partition without workers: the missing entry is reported first.
    assert!(matches!(
        s.create_reservation(&ReservationRequest::replay(&other, "zz"), now),
        Err(Error::NoPendingSelection { .. })
    ));
    let empty: Vec<u32> = vec![];
    assert_eq!(
        s.select(&select_req(&p, &empty, None), now, &mut rng())
            .unwrap_err()
            .to_string(),
        "token_ids must not be empty"
    );
    let mismatched = PromptHashes {
        local: vec![1, 2],
        sequence: vec![1],
        isl_tokens: 8,
    };
    assert!(matches!(
        s.select(
            &SelectRequest::new(&p, Prompt::Hashes(&mismatched)),
            now,
            &mut rng()
        ),
        Err(Error::HashLengthMismatch {
            block_hashes: 2,
            sequence_hashes: 1
        })
    ));
    let zero = PromptHashes {
        local: vec![],
        sequence: vec![],
        isl_tokens: 0,
    };
    assert!(matches!(
        s.select(
            &SelectRequest::new(&p, Prompt::Hashes(&zero)),
            now,
            &mut rng()
        ),
        Err(Error::ZeroIsl)
    ));
    let pinned = SelectRequest {
        pinned_worker: Some(PinnedWorker {
            worker_id: 9,
            dp_rank: None,
        }),
        ..select_req(&p, &prompt, None)
    };
    assert!(matches!(
        s.select(&pinned, now, &mut rng()),
        Err(Error::NoEndpointsAvailable)
    ));
    let long = "x".repeat(1025);
    assert_eq!(
        s.select(&select_req(&p, &prompt, Some(&long)), now, &mut rng())
            .unwrap_err()
            .to_string(),
        "selection_id must be at most 1024 bytes"
    );
    assert!(matches!(
        s.output_block("nope", None, now),
        Err(Error::ReservationNotFound { .. })
    ));
    assert!(matches!(
        s.delete_worker(5),
        Err(Error::WorkerNotFound { worker_id: 5 })
    ));
}

#[test]
fn duplicate_booking_id_is_refused_naming_the_worker() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    let prompt = tokens(8);
    s.select(&select_req(&p, &prompt, Some("d")), now, &mut rng())
        .unwrap();
    s.create_reservation(&ReservationRequest::replay(&p, "d"), now)
        .unwrap();
    s.select(&select_req(&p, &prompt, Some("d")), now, &mut rng())
        .unwrap();
    let err = s
        .create_reservation(&ReservationRequest::replay(&p, "d"), now)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "Request d already exists (assigned to worker 1)"
    );
    assert_eq!(err.status(), 409);
    assert_eq!(s.pending_stats().0, 1, "a failed replay keeps its entry");
}

#[test]
fn replay_after_the_worker_left_is_retryable_once_it_returns() {
    let mut s = selector_with(&[1, 2]);
    let p = partition();
    let now = Instant::now();
    let prompt = tokens(8);
    let sel = s
        .select(
            &SelectRequest {
                pinned_worker: Some(PinnedWorker {
                    worker_id: 2,
                    dp_rank: None,
                }),
                ..select_req(&p, &prompt, Some("r"))
            },
            now,
            &mut rng(),
        )
        .unwrap();
    assert_eq!(sel.worker_id, 2);
    s.delete_worker(2).unwrap();
    let err = s
        .create_reservation(&ReservationRequest::replay(&p, "r"), now)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "schedulable worker 2 not found for model=m routing_group=g"
    );
    // An unschedulable re-registration is still "not found".
    s.upsert_worker(WorkerSpec {
        block_size: Some(0),
        ..spec(2)
    })
    .unwrap();
    assert!(
        s.create_reservation(&ReservationRequest::replay(&p, "r"), now)
            .is_err()
    );
    s.upsert_worker(spec(2)).unwrap();
    let r = s
        .create_reservation(&ReservationRequest::replay(&p, "r"), now)
        .unwrap();
    assert_eq!(r.worker_id, 2);
}

#[test]
fn replay_in_an_emptied_partition_is_503_and_keeps_the_entry() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    s.select(&select_req(&p, &tokens(8), Some("q")), now, &mut rng())
        .unwrap();
    s.delete_worker(1).unwrap();
    let err = s
        .create_reservation(&ReservationRequest::replay(&p, "q"), now)
        .unwrap_err();
    assert_eq!(err.status(), 503);
    s.upsert_worker(spec(1)).unwrap();
    assert!(
        s.create_reservation(&ReservationRequest::replay(&p, "q"), now)
            .is_ok()
    );
}

#[test]
fn an_expired_selection_cannot_be_replayed() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    s.select(&select_req(&p, &tokens(8), Some("old")), now, &mut rng())
        .unwrap();
    let later = now + Duration::from_secs(121);
    assert!(matches!(
        s.create_reservation(&ReservationRequest::replay(&p, "old"), later),
        Err(Error::NoPendingSelection { .. })
    ));
}

#[test]
fn a_selection_from_another_partition_is_not_found() {
    let mut s = selector_with(&[1]);
    let mut w2 = spec(2);
    w2.routing_group = "h".into();
    s.upsert_worker(w2).unwrap();
    let p = partition();
    let now = Instant::now();
    s.select(&select_req(&p, &tokens(8), Some("a")), now, &mut rng())
        .unwrap();
    let h = PartitionKey::new("m", "h");
    assert!(matches!(
        s.create_reservation(&ReservationRequest::replay(&h, "a"), now),
        Err(Error::NoPendingSelection { .. })
    ));
}

#[test]
fn load_steers_away_from_a_busy_worker() {
    let mut s = selector_with(&[1, 2]);
    let p = partition();
    let now = Instant::now();
    let prompt = tokens(64);
    let first = s
        .select_and_reserve(&select_req(&p, &prompt, None), Some("a"), now, &mut rng())
        .unwrap()
        .0;
    let other: Vec<u32> = (1000..1064).collect();
    let second = s
        .select(&select_req(&p, &other, None), now, &mut rng())
        .unwrap();
    assert_ne!(first.worker_id, second.worker_id);
}

#[test]
fn busy_thresholds_answer_429() {
    let mut config = SelectorConfig::default();
    config.scheduler.busy_prefill_tokens = Some(10);
    let mut s = Selector::new(config);
    s.upsert_worker(spec(1)).unwrap();
    let p = partition();
    let now = Instant::now();
    s.select_and_reserve(
        &select_req(&p, &tokens(20), None),
        Some("a"),
        now,
        &mut rng(),
    )
    .unwrap();
    let err = s
        .select(&select_req(&p, &tokens(20), None), now, &mut rng())
        .unwrap_err();
    assert_eq!(
        (err.status(), err.to_string().as_str()),
        (429, "all eligible workers are overloaded")
    );
}

#[test]
fn allowed_workers_restrict_the_choice() {
    let mut s = selector_with(&[1, 2, 3]);
    let prompt = tokens(17);
    store_prompt(&mut s, 2, &prompt, Tier::Device);
    let p = partition();
    let allowed = [3u64];
    let req = SelectRequest {
        allowed_worker_ids: Some(&allowed),
        ..select_req(&p, &prompt, None)
    };
    assert_eq!(
        s.select(&req, Instant::now(), &mut rng())
            .unwrap()
            .worker_id,
        3
    );
    let none: [u64; 0] = [];
    let req = SelectRequest {
        allowed_worker_ids: Some(&none),
        ..select_req(&p, &prompt, None)
    };
    assert!(matches!(
        s.select(&req, Instant::now(), &mut rng()),
        Err(Error::NoEndpointsAvailable)
    ));
}

#[test]
fn worker_catalog_validation_and_lifecycle() {
    let mut s = Selector::default();
    let bad = s
        .upsert_worker(WorkerSpec {
            endpoint: None,
            block_size: Some(0),
            kv_events_endpoint: Some("localhost:5557".into()),
            ..spec(1)
        })
        .unwrap()
        .record;
    assert_eq!(bad.lifecycle, Lifecycle::Incomplete);
    assert_eq!(
        bad.not_schedulable_reasons,
        vec![
            "endpoint is required".to_string(),
            "block_size must be greater than 0".to_string(),
            "invalid kv_events endpoint for worker 1 dp_rank 0: invalid ZMQ endpoint `localhost:5557`: missing scheme".to_string(),
        ]
    );
    s.upsert_worker(spec(2)).unwrap();
    let mismatch = s
        .upsert_worker(WorkerSpec {
            block_size: Some(16),
            ..spec(3)
        })
        .unwrap()
        .record;
    assert_eq!(
        mismatch.not_schedulable_reasons,
        vec![
            "block_size mismatch for model=m routing_group=g: existing=4 requested=16".to_string()
        ]
    );
    let ready = s.ready();
    assert_eq!(
        (ready.ready, ready.schedulable_workers, ready.workers.len()),
        (true, 1, 3)
    );
    // dp ranks with an endpoint map must cover every rank.
    let dp = s
        .upsert_worker(WorkerSpec {
            data_parallel_size: Some(2),
            kv_events_endpoints: [(0, "tcp://127.0.0.1:5557".to_string())].into(),
            ..spec(4)
        })
        .unwrap()
        .record;
    assert_eq!(
        dp.not_schedulable_reasons,
        vec!["kv_events endpoint is required for dp_rank 1".to_string()]
    );
}

#[test]
fn reposting_an_unchanged_worker_keeps_bookings_and_index() {
    let mut s = selector_with(&[1]);
    let prompt = tokens(17);
    store_prompt(&mut s, 1, &prompt, Tier::Device);
    let p = partition();
    let now = Instant::now();
    s.select_and_reserve(&select_req(&p, &prompt, None), Some("k"), now, &mut rng())
        .unwrap();
    let outcome = s.upsert_worker(spec(1)).unwrap();
    assert!(!outcome.events_changed);
    assert!(s.load_tracker().booking("k").is_some());
    let scores = s.overlap_scores(&p, tokens_prompt(&prompt)).unwrap();
    assert_eq!(scores.workers[0].device_blocks, 4);
    // Changing the event endpoint drops the index (the listener starts over).
    let outcome = s
        .upsert_worker(WorkerSpec {
            kv_events_endpoint: Some("tcp://127.0.0.1:5999".into()),
            ..spec(1)
        })
        .unwrap();
    assert!(outcome.events_changed);
    let scores = s.overlap_scores(&p, tokens_prompt(&prompt)).unwrap();
    assert_eq!(scores.workers[0].device_blocks, 0);
    assert!(s.load_tracker().booking("k").is_some(), "bookings survive");
}

#[test]
fn deleting_a_worker_frees_its_bookings_and_drops_an_empty_partition() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    s.select_and_reserve(
        &select_req(&p, &tokens(8), None),
        Some("k"),
        now,
        &mut rng(),
    )
    .unwrap();
    let record = s.delete_worker(1).unwrap();
    assert_eq!(record.lifecycle, Lifecycle::Unschedulable);
    assert!(s.load_tracker().booking("k").is_none());
    assert!(s.loads(None, None).is_empty());
    assert!(s.dump().is_empty());
    // The id is free again.
    s.upsert_worker(spec(1)).unwrap();
    s.select_and_reserve(
        &select_req(&p, &tokens(8), None),
        Some("k"),
        now,
        &mut rng(),
    )
    .unwrap();
}

#[test]
fn loads_and_potential_loads_report_ceil_blocks() {
    let mut s = selector_with(&[1, 2]);
    let p = partition();
    let now = Instant::now();
    let (sel, _) = s
        .select_and_reserve(
            &select_req(&p, &tokens(17), None),
            Some("a"),
            now,
            &mut rng(),
        )
        .unwrap();
    let loads = s.loads(Some("m"), None);
    let rank = loads[0]
        .loads
        .iter()
        .find(|l| l.worker_id == sel.worker_id)
        .unwrap();
    assert_eq!(rank.potential_decode_blocks, 5);
    assert_eq!(rank.potential_prefill_tokens, 17);
    assert_eq!(rank.active_requests, 1);
    let potential = s
        .potential_loads(&p, tokens_prompt(&tokens(17)), &Overrides::default())
        .unwrap();
    let same = potential
        .iter()
        .find(|l| l.worker_id == sel.worker_id)
        .unwrap();
    // The 4 full blocks are shared; each request's partial block is its own: 4 + 1 + 1.
    assert_eq!(
        same.potential_decode_blocks, 6,
        "shared full blocks count once"
    );
    // 17 active + 1: the TTL model predicts the first 16 tokens cached there by the booking.
    assert_eq!(same.potential_prefill_tokens, 18);
    let other = potential
        .iter()
        .find(|l| l.worker_id != sel.worker_id)
        .unwrap();
    assert_eq!(other.potential_decode_blocks, 5);
    assert_eq!(other.potential_prefill_tokens, 17);
}

#[test]
fn expired_bookings_are_freed_by_tick() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    s.select_and_reserve(
        &select_req(&p, &tokens(8), None),
        Some("a"),
        now,
        &mut rng(),
    )
    .unwrap();
    assert!(
        s.tick(now + Duration::from_secs(299))
            .expired_reservations
            .is_empty()
    );
    assert_eq!(
        s.tick(now + Duration::from_secs(300)).expired_reservations,
        vec!["a".to_string()]
    );
}

#[test]
fn shutdown_refuses_every_operation() {
    let mut s = selector_with(&[1]);
    let p = partition();
    let now = Instant::now();
    s.shutdown();
    let prompt = tokens(8);
    assert!(matches!(
        s.select(&select_req(&p, &prompt, None), now, &mut rng()),
        Err(Error::ShuttingDown)
    ));
    assert!(matches!(
        s.create_reservation(&ReservationRequest::replay(&p, "x"), now),
        Err(Error::ShuttingDown)
    ));
    assert!(matches!(s.free("x", now), Err(Error::ShuttingDown)));
    assert!(matches!(s.upsert_worker(spec(2)), Err(Error::ShuttingDown)));
    assert!(!s.ready().ready);
}

fn overlap_blocks(s: &Selector, worker_id: WorkerId, prompt: &[u32]) -> u32 {
    s.overlap_scores(&partition(), tokens_prompt(prompt))
        .unwrap()
        .workers
        .iter()
        .find(|w| w.worker_id == worker_id)
        .map_or(0, |w| w.device_blocks)
}

fn book_and_free(s: &mut Selector, id: &str, worker_id: WorkerId, prompt: &[u32], now: Instant) {
    let p = partition();
    let req = ReservationRequest {
        worker_id: Some(worker_id),
        reservation_id: Some(id),
        selection_id: None,
        prompt: Some(tokens_prompt(prompt)),
        ..ReservationRequest::replay(&p, id)
    };
    s.create_reservation(&req, now).unwrap();
    s.free(id, now).unwrap();
}

#[test]
fn ttl_model_credits_a_repeated_prompt_on_a_worker_without_events_until_it_expires() {
    let mut s = selector_with(&[1, 2]);
    let prompt = tokens(17);
    let p = partition();
    let now = Instant::now();
    assert_eq!(overlap_blocks(&s, 1, &prompt), 0);
    let (sel, _) = s
        .select_and_reserve(&select_req(&p, &prompt, None), Some("a"), now, &mut rng())
        .unwrap();
    // Read-your-writes: the prediction is visible to the next request.
    assert_eq!(overlap_blocks(&s, sel.worker_id, &prompt), 4);
    s.free("a", now).unwrap();
    let again = s
        .select(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(
        again.worker_id, sel.worker_id,
        "the predicted cache attracts the prompt"
    );
    assert_eq!(again.overlap.gpu, 16);
    assert!(matches!(
        s.cache_model(Rank::new(sel.worker_id, 0)),
        Some(CacheModelReport::Ttl { blocks: 4 })
    ));
    s.tick(now + Duration::from_secs(121));
    assert_eq!(overlap_blocks(&s, sel.worker_id, &prompt), 0, "expired");
}

#[test]
fn lru_model_keeps_a_prompt_until_other_prompts_push_it_out() {
    let config = SelectorConfig {
        approximate_policy: CachePolicy::Lru,
        ..SelectorConfig::default()
    };
    let mut s = Selector::new(config);
    // A pool of 8 blocks of 4 tokens.
    s.upsert_worker(WorkerSpec {
        total_kv_blocks: Some(8),
        ..spec(1)
    })
    .unwrap();
    let now = Instant::now();
    let a = tokens(16);
    book_and_free(&mut s, "a", 1, &a, now);
    assert_eq!(overlap_blocks(&s, 1, &a), 4, "released blocks stay cached");
    let Some(CacheModelReport::Lru(stats)) = s.cache_model(Rank::new(1, 0)) else {
        panic!("lru model expected");
    };
    assert_eq!((stats.resident_blocks, stats.inactive_blocks), (4, 4));
    let b: Vec<u32> = (100..116).collect();
    book_and_free(&mut s, "b", 1, &b, now);
    assert_eq!(overlap_blocks(&s, 1, &a), 4, "8 blocks fit both prompts");
    let c: Vec<u32> = (200..216).collect();
    book_and_free(&mut s, "c", 1, &c, now);
    assert_eq!(
        overlap_blocks(&s, 1, &a),
        0,
        "the oldest release is evicted first"
    );
    assert_eq!(overlap_blocks(&s, 1, &b), 4);
    assert_eq!(overlap_blocks(&s, 1, &c), 4);
}

#[test]
fn workers_publishing_events_are_not_modelled_unless_events_are_off() {
    let mut s = Selector::default();
    s.upsert_worker(WorkerSpec {
        kv_events_endpoint: Some("tcp://127.0.0.1:5557".into()),
        ..spec(1)
    })
    .unwrap();
    let now = Instant::now();
    let prompt = tokens(16);
    book_and_free(&mut s, "a", 1, &prompt, now);
    assert_eq!(
        overlap_blocks(&s, 1, &prompt),
        4,
        "predicted on route (tests/predict.rs) until its TTL"
    );
    s.tick(now + DEFAULT_PREDICTED_TTL);
    assert_eq!(
        overlap_blocks(&s, 1, &prompt),
        0,
        "then only the engine's events count"
    );
    assert_eq!(
        s.cache_model(Rank::new(1, 0)),
        Some(CacheModelReport::Events)
    );

    let mut off = Selector::new(SelectorConfig {
        no_kv_events: true,
        ..SelectorConfig::default()
    });
    off.upsert_worker(WorkerSpec {
        kv_events_endpoint: Some("tcp://127.0.0.1:5557".into()),
        ..spec(1)
    })
    .unwrap();
    book_and_free(&mut off, "a", 1, &prompt, now);
    assert_eq!(
        overlap_blocks(&off, 1, &prompt),
        4,
        "--no-kv-events models every rank"
    );
}

/// A selector whose workers publish KV events (so the shared lifecycle paths apply).
fn event_selector(workers: &[WorkerId]) -> Selector {
    let mut s = Selector::default();
    for &w in workers {
        s.upsert_worker(WorkerSpec {
            kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", 5000 + w)),
            ..spec(w)
        })
        .expect("upsert");
    }
    s
}

/// Every live booking as `(id, view)` and the load of every rank, sorted.
type LoadState = (
    Vec<(String, crate::load::BookingView)>,
    Vec<(Rank, RankLoad)>,
);

fn load_state(s: &Selector) -> LoadState {
    let load = s.load_tracker();
    let mut bookings: Vec<_> = load
        .iter()
        .map(|(id, view)| (id.to_string(), view.clone()))
        .collect();
    bookings.sort_by(|a, b| a.0.cmp(&b.0));
    let mut ranks: Vec<_> = load.ranks().collect();
    ranks.sort_by_key(|(rank, _)| *rank);
    (bookings, ranks)
}

mod constraints;
mod decisions;
mod disagg;
mod engine_load;
mod predict;
mod sessions;
mod shared_lock;
