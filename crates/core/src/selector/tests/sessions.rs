//! Session affinity (`selector/sessions.rs`): when a booking binds a session, how long the
//! binding lives, what a bound session's requests choose (hard and soft), the bound worker gone,
//! requests that exclude it, `affinity_target`, the bound, and replicas' bookings.

use super::*;
use std::sync::Arc;

const TTL: Duration = Duration::from_secs(2);

fn config(mode: SessionMode) -> SelectorConfig {
    SelectorConfig {
        sessions: SessionConfig {
            ttl: Some(TTL),
            mode,
            ..SessionConfig::default()
        },
        ..SelectorConfig::for_profile(crate::schedule::RouterProfile::Dynamo)
    }
}

/// Workers 1..=3 of partition `m/g` with capacities (so they can be busy); worker 1 holds the
/// 17-token prompt's 4 blocks, so it is every unbound request's natural choice.
fn sessions_selector(config: SelectorConfig) -> (Selector, Vec<u32>) {
    let mut s = Selector::new(config);
    for w in 1..=3 {
        s.upsert_worker(WorkerSpec {
            kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", 6000 + w)),
            total_kv_blocks: Some(1000),
            max_num_batched_tokens: Some(1000),
            ..spec(w)
        })
        .expect("upsert");
    }
    let prompt = tokens(17);
    store_prompt(&mut s, 1, &prompt, Tier::Device);
    (s, prompt)
}

fn with_session<'a>(req: SelectRequest<'a>, session: &'a str) -> SelectRequest<'a> {
    SelectRequest {
        session_id: Some(session),
        ..req
    }
}

/// The worker a `select` of `prompt` in `session` chooses.
fn chosen(s: &Selector, prompt: &[u32], session: Option<&str>, now: Instant) -> WorkerId {
    let p = partition();
    let req = SelectRequest {
        session_id: session,
        ..select_req(&p, prompt, None)
    };
    s.select(&req, now, &mut rng()).expect("select").worker_id
}

/// Books `prompt` in `session` with `select_and_reserve` under `id`; the worker it went to.
fn book(
    s: &mut Selector,
    prompt: &[u32],
    session: &str,
    id: &str,
    allowed: Option<&[WorkerId]>,
    now: Instant,
) -> Result<WorkerId, Error> {
    let p = partition();
    let req = SelectRequest {
        allowed_worker_ids: allowed,
        ..with_session(select_req(&p, prompt, None), session)
    };
    s.select_and_reserve(&req, Some(id), now, &mut rng())
        .map(|(sel, _)| sel.worker_id)
}

#[test]
fn only_a_booking_binds_and_a_select_reads_the_binding() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    let now = Instant::now();
    let p = partition();
    // A select that went to worker 2 binds nothing.
    let req = SelectRequest {
        allowed_worker_ids: Some(&[2]),
        ..with_session(select_req(&p, &prompt, None), "q")
    };
    assert_eq!(s.select(&req, now, &mut rng()).unwrap().worker_id, 2);
    assert_eq!(chosen(&s, &prompt, Some("q"), now), 1);
    // A booking does, and the next requests of the session follow it despite worker 1's cache.
    assert_eq!(book(&mut s, &prompt, "b", "b-1", Some(&[2]), now), Ok(2));
    assert_eq!(chosen(&s, &prompt, Some("b"), now), 2);
    assert_eq!(
        chosen(&s, &prompt, None, now),
        1,
        "no session: the cache wins"
    );
    assert_eq!(book(&mut s, &prompt, "b", "b-2", None, now), Ok(2));
    // Sessions are per partition.
    assert_eq!(
        s.session_binding(&SessionKey::new(&p, "b"), now)
            .map(|b| b.rank),
        Some(Rank::new(2, 0))
    );
    assert_eq!(
        s.session_binding(&SessionKey::new(&PartitionKey::new("m", "other"), "b"), now),
        None
    );
    // Replaying a select that carried the session binds it.
    let req = SelectRequest {
        allowed_worker_ids: Some(&[3]),
        ..with_session(select_req(&p, &prompt, Some("rp-1")), "rp")
    };
    assert_eq!(s.select(&req, now, &mut rng()).unwrap().worker_id, 3);
    assert_eq!(
        chosen(&s, &prompt, Some("rp"), now),
        1,
        "not bound before the replay"
    );
    s.create_reservation(&ReservationRequest::replay(&p, "rp-1"), now)
        .unwrap();
    assert_eq!(chosen(&s, &prompt, Some("rp"), now), 3);
}

#[test]
fn a_hard_binding_holds_while_its_worker_grows_busy() {
    let mut config = config(SessionMode::Hard);
    config.scheduler.busy_decode_fraction = Some(0.5);
    config.scheduler.busy_prefill_fraction = Some(0.5);
    let (mut s, prompt) = sessions_selector(config);
    let now = Instant::now();
    assert_eq!(book(&mut s, &prompt, "b", "b-1", Some(&[2]), now), Ok(2));
    // Load worker 2 past both busy thresholds with a big explicit booking.
    let p = partition();
    load_worker_2(&mut s, &p, now);
    let req = SelectRequest {
        allowed_worker_ids: Some(&[2, 3]),
        ..select_req(&p, &prompt, None)
    };
    assert_eq!(s.select(&req, now, &mut rng()).unwrap().worker_id, 3);
    for i in 0..3 {
        assert_eq!(chosen(&s, &prompt, Some("b"), now), 2, "select {i}");
        let id = format!("b-more-{i}");
        assert_eq!(book(&mut s, &prompt, "b", &id, None, now), Ok(2));
    }
    // Every other rank busy too: the bound one is still served, not a 429.
    let req = SelectRequest {
        allowed_worker_ids: Some(&[2]),
        ..with_session(select_req(&p, &prompt, None), "b")
    };
    assert_eq!(s.select(&req, now, &mut rng()).unwrap().worker_id, 2);
}

#[test]
fn the_ttl_runs_from_the_last_release_and_only_bookings_refresh() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    let t0 = Instant::now();
    let at = |secs: f64| t0 + Duration::from_secs_f64(secs);
    assert_eq!(book(&mut s, &prompt, "k", "k-1", Some(&[2]), t0), Ok(2));
    // A live booking holds the binding past the TTL, ticks included.
    s.tick(at(3.0));
    assert_eq!(chosen(&s, &prompt, Some("k"), at(3.0)), 2);
    s.free("k-1", at(3.0)).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("k"), at(4.0)), 2, "a select");
    assert_eq!(chosen(&s, &prompt, Some("k"), at(4.9)), 2);
    assert_eq!(
        chosen(&s, &prompt, Some("k"), at(5.0)),
        1,
        "the select at 4 s did not refresh it"
    );
    s.tick(at(5.5));
    assert_eq!(s.session_stats().1.expired, 1);
    assert_eq!(s.session_stats().0, 0);
    // A booking refreshes it: the TTL runs from the last release.
    assert_eq!(
        book(&mut s, &prompt, "m", "m-1", Some(&[2]), at(10.0)),
        Ok(2)
    );
    s.free("m-1", at(10.0)).unwrap();
    assert_eq!(book(&mut s, &prompt, "m", "m-2", None, at(11.0)), Ok(2));
    s.free("m-2", at(11.0)).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("m"), at(12.5)), 2);
    assert_eq!(chosen(&s, &prompt, Some("m"), at(13.0)), 1, "expired");
    // After expiry the next booking binds anew, where the cache is.
    assert_eq!(book(&mut s, &prompt, "m", "m-3", None, at(13.0)), Ok(1));
    assert_eq!(chosen(&s, &prompt, Some("m"), at(13.0)), 1);
    // A session's bookings on two ranks: the binding waits for the last one.
    assert_eq!(
        book(&mut s, &prompt, "f", "f-1", Some(&[3]), at(20.0)),
        Ok(3)
    );
    assert_eq!(book(&mut s, &prompt, "f", "f-2", None, at(20.0)), Ok(3));
    s.free("f-2", at(20.0)).unwrap();
    assert_eq!(
        chosen(&s, &prompt, Some("f"), at(30.0)),
        3,
        "f-1 still holds it"
    );
    s.free("f-1", at(30.0)).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("f"), at(31.9)), 3);
    assert_eq!(chosen(&s, &prompt, Some("f"), at(32.0)), 1);
}

#[test]
fn a_gone_bound_worker_is_skipped_and_the_next_booking_rebinds() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    let now = Instant::now();
    // Deleted: its booking goes, requests go elsewhere, a booking rebinds, and re-adding the
    // worker does not move the session back.
    assert_eq!(book(&mut s, &prompt, "d", "d-1", Some(&[3]), now), Ok(3));
    let record = s.worker(3).unwrap().spec.clone();
    s.delete_worker(3).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("d"), now), 1);
    assert_eq!(book(&mut s, &prompt, "d", "d-2", None, now), Ok(1));
    s.upsert_worker(record).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("d"), now), 1);
    // Incomplete: a select goes elsewhere and keeps the binding (the worker comes back, the
    // session with it); a booking meanwhile rebinds.
    assert_eq!(book(&mut s, &prompt, "u", "u-1", Some(&[2]), now), Ok(2));
    assert_eq!(book(&mut s, &prompt, "u2", "u2-1", Some(&[2]), now), Ok(2));
    let healthy = s.worker(2).unwrap().spec.clone();
    s.upsert_worker(WorkerSpec {
        endpoint: Some(String::new()),
        ..healthy.clone()
    })
    .unwrap();
    assert_eq!(chosen(&s, &prompt, Some("u"), now), 1);
    assert_eq!(book(&mut s, &prompt, "u2", "u2-2", None, now), Ok(1));
    s.upsert_worker(healthy).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("u"), now), 2);
    assert_eq!(chosen(&s, &prompt, Some("u2"), now), 1);
}

#[test]
fn a_deleted_workers_bookings_release_their_sessions() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    let t0 = Instant::now();
    assert_eq!(book(&mut s, &prompt, "d", "d-1", Some(&[3]), t0), Ok(3));
    s.tick(t0 + Duration::from_secs(1));
    s.delete_worker(3).unwrap();
    // Released at the table's latest time (the tick at 1 s): expired 2 s later.
    s.tick(t0 + Duration::from_millis(2900));
    assert_eq!(s.session_stats().0, 1);
    s.tick(t0 + Duration::from_secs(3));
    assert_eq!(s.session_stats().0, 0);
}

#[test]
fn requests_excluding_the_bound_worker() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    let now = Instant::now();
    let p = partition();
    assert_eq!(book(&mut s, &prompt, "b", "b-1", Some(&[2]), now), Ok(2));
    // On a select, allowed_worker_ids, pinned_worker and affinity_target elsewhere are
    // served elsewhere and keep the binding.
    let base = with_session(select_req(&p, &prompt, None), "b");
    let other = PinnedWorker {
        worker_id: 1,
        dp_rank: Some(0),
    };
    for req in [
        SelectRequest {
            allowed_worker_ids: Some(&[1]),
            ..base
        },
        SelectRequest {
            pinned_worker: Some(other),
            ..base
        },
        SelectRequest {
            affinity_target: Some(other),
            ..base
        },
    ] {
        assert_eq!(s.select(&req, now, &mut rng()).unwrap().worker_id, 1);
        assert_eq!(chosen(&s, &prompt, Some("b"), now), 2, "kept");
    }
    // A booking pinned elsewhere keeps it too.
    let pinned = SelectRequest {
        pinned_worker: Some(other),
        ..base
    };
    let (sel, _) = s
        .select_and_reserve(&pinned, Some("b-4"), now, &mut rng())
        .unwrap();
    assert_eq!(sel.worker_id, 1);
    assert_eq!(chosen(&s, &prompt, Some("b"), now), 2);
    // A booking whose allowed_worker_ids exclude it is refused, books nothing, and drops the
    // binding.
    assert_eq!(
        book(&mut s, &prompt, "b", "b-5", Some(&[1]), now),
        Err(Error::SessionBound {
            session_id: "b".into(),
            bound_worker: 2,
            selected_worker: 1,
        })
    );
    assert_eq!(
        Error::SessionBound {
            session_id: "b".into(),
            bound_worker: 2,
            selected_worker: 1,
        }
        .to_string(),
        "session b is bound to worker 2, not 1"
    );
    assert!(s.load_tracker().booking("b-5").is_none());
    assert_eq!(chosen(&s, &prompt, Some("b"), now), 1, "dropped");
    assert_eq!(
        book(&mut s, &prompt, "b", "b-6", None, now),
        Ok(1),
        "rebinds"
    );
    assert_eq!(s.session_stats().1.dropped, 1);
}

#[test]
fn an_affinity_target_wins_over_load_and_an_unknown_one_is_ignored() {
    let mut config = config(SessionMode::Hard);
    config.scheduler.busy_decode_fraction = Some(0.5);
    let (mut s, prompt) = sessions_selector(config);
    let now = Instant::now();
    let p = partition();
    load_worker_2(&mut s, &p, now);
    let target = |worker_id, dp_rank| SelectRequest {
        affinity_target: Some(PinnedWorker { worker_id, dp_rank }),
        ..select_req(&p, &prompt, None)
    };
    let pick = |req: SelectRequest<'_>| s.select(&req, now, &mut rng()).unwrap().worker_id;
    assert_eq!(pick(target(2, None)), 2, "busy, still chosen");
    assert_eq!(pick(target(2, Some(0))), 2);
    assert_eq!(pick(target(2, Some(5))), 1, "no such rank: ignored");
    assert_eq!(pick(target(99, None)), 1, "no such worker: ignored");
}

#[test]
fn soft_mode_leaves_a_busy_or_much_costlier_rank_and_rebinds() {
    let mut config = config(SessionMode::Soft);
    config.scheduler.busy_decode_fraction = Some(0.5);
    config.sessions.soft_factor = 3.0;
    let (mut s, prompt) = sessions_selector(config);
    let now = Instant::now();
    let p = partition();
    // Bound to 2 while it is free and about as cheap as the best: kept.
    assert_eq!(book(&mut s, &prompt, "b", "b-1", Some(&[2]), now), Ok(2));
    assert_eq!(chosen(&s, &prompt, Some("b"), now), 2);
    // Worker 2 busy: soft mode leaves it, and the booking rebinds where it went.
    load_worker_2(&mut s, &p, now);
    assert_eq!(chosen(&s, &prompt, Some("b"), now), 1);
    assert_eq!(book(&mut s, &prompt, "b", "b-2", None, now), Ok(1));
    s.free("big", now).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("b"), now), 1, "rebound to 1");
    assert_eq!(s.session_stats().1.rebound, 1);

    // Not busy, but its cost beyond the factor × the best: left as well.
    let mut config = self::config(SessionMode::Soft);
    config.sessions.soft_factor = 1.5;
    let (mut s, prompt) = sessions_selector(config);
    assert_eq!(book(&mut s, &prompt, "c", "c-1", Some(&[2]), now), Ok(2));
    let long = tokens(400);
    assert_eq!(chosen(&s, &long, Some("c"), now), 2, "within the factor");
    store_prompt(&mut s, 3, &long, Tier::Device);
    assert_eq!(
        chosen(&s, &long, Some("c"), now),
        3,
        "worker 3 holds it all"
    );
}

#[test]
fn sessions_off_ignore_every_session_field() {
    let (mut s, prompt) = sessions_selector(SelectorConfig::for_profile(
        crate::schedule::RouterProfile::Dynamo,
    ));
    let now = Instant::now();
    assert_eq!(book(&mut s, &prompt, "n", "n-1", Some(&[2]), now), Ok(2));
    assert_eq!(chosen(&s, &prompt, Some("n"), now), 1);
    let long = "s".repeat(MAX_SESSION_ID_BYTES + 1);
    assert_eq!(chosen(&s, &prompt, Some(&long), now), 1);
    assert_eq!(s.session_stats().0, 0);
}

#[test]
fn session_ids_are_at_most_256_bytes_and_may_be_empty() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    let now = Instant::now();
    let p = partition();
    let fits = "s".repeat(MAX_SESSION_ID_BYTES);
    assert_eq!(chosen(&s, &prompt, Some(&fits), now), 1);
    let long = "s".repeat(MAX_SESSION_ID_BYTES + 1);
    let req = with_session(select_req(&p, &prompt, None), &long);
    let err = s.select(&req, now, &mut rng()).unwrap_err();
    assert_eq!(err, Error::SessionIdTooLong);
    assert_eq!(
        (err.status(), err.to_string().as_str()),
        (400, "session affinity ID must not exceed 256 bytes")
    );
    assert_eq!(
        book(&mut s, &prompt, &long, "long", None, now),
        Err(Error::SessionIdTooLong)
    );
    assert!(s.load_tracker().booking("long").is_none());
    assert_eq!(book(&mut s, &prompt, "", "e-1", Some(&[3]), now), Ok(3));
    assert_eq!(chosen(&s, &prompt, Some(""), now), 3);
}

#[test]
fn an_explicit_booking_binds_an_unbound_session_only() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    let now = Instant::now();
    let p = partition();
    let explicit = |id: &'static str, worker_id, session: &'static str| ReservationRequest {
        selection_id: None,
        reservation_id: Some(id),
        worker_id: Some(worker_id),
        prompt: Some(tokens_prompt(&prompt)),
        session_id: Some(session),
        ..ReservationRequest::replay(&p, id)
    };
    s.create_reservation(&explicit("e-1", 2, "e"), now).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("e"), now), 2);
    s.create_reservation(&explicit("e-2", 3, "e"), now).unwrap();
    assert_eq!(chosen(&s, &prompt, Some("e"), now), 2, "bound: kept");
}

#[test]
fn the_table_keeps_the_most_recently_booked_sessions() {
    let mut config = config(SessionMode::Hard);
    config.sessions.max_sessions = 2;
    let (mut s, prompt) = sessions_selector(config);
    let now = Instant::now();
    for (session, worker) in [("a", 2), ("b", 3), ("a", 2), ("c", 3)] {
        let id = format!("{session}-{}", s.load_tracker().len());
        let allowed = [worker];
        assert_eq!(
            book(&mut s, &prompt, session, &id, Some(&allowed), now),
            Ok(worker)
        );
    }
    // "b" was the least recently booked.
    assert_eq!(chosen(&s, &prompt, Some("a"), now), 2);
    assert_eq!(chosen(&s, &prompt, Some("b"), now), 1);
    assert_eq!(chosen(&s, &prompt, Some("c"), now), 3);
    assert_eq!(s.session_stats().0, 2);
    assert_eq!(s.session_stats().1.evicted, 1);
}

#[test]
fn other_replicas_bookings_hold_their_sessions() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    s.record_session_changes();
    let t0 = Instant::now();
    let p = partition();
    // Another replica bound the session to 3 and its booking holds it.
    bind_remotely(&mut s, &p, &prompt, t0);
    let later = t0 + Duration::from_secs(60);
    assert_eq!(chosen(&s, &prompt, Some("s"), later), 3, "held remotely");
    assert!(s.take_session_changes().is_empty(), "nothing of its own");
    // Freed there: the binding idles from the latest time this replica knew of.
    s.tick(later);
    s.remove_remote_booking("r2", "x");
    assert_eq!(chosen(&s, &prompt, Some("s"), later + TTL / 2), 3);
    assert_eq!(chosen(&s, &prompt, Some("s"), later + TTL), 1);
    // A local booking publishes its binding and its session with its state.
    assert_eq!(book(&mut s, &prompt, "t", "t-1", Some(&[2]), later), Ok(2));
    assert_eq!(s.take_session_changes(), vec![SessionKey::new(&p, "t")]);
    assert_eq!(
        s.synced_booking("t-1").and_then(|b| b.session_id),
        Some("t".to_string())
    );
    assert_eq!(
        s.local_session_bindings(later),
        vec![(
            SessionKey::new(&p, "t"),
            SyncedBinding {
                rank: Rank::new(2, 0),
                idle_until: None,
            }
        )]
    );
    s.free("t-1", later).unwrap();
    assert_eq!(s.take_session_changes(), vec![SessionKey::new(&p, "t")]);
    assert_eq!(
        s.session_binding(&SessionKey::new(&p, "t"), later)
            .and_then(|b| b.idle_until),
        Some(later + TTL)
    );
    // Another replica's drop removes the binding.
    s.apply_synced_binding(&SessionKey::new(&p, "t"), None, later);
    assert_eq!(chosen(&s, &prompt, Some("t"), later), 1);
}

#[test]
fn an_expired_remote_booking_idles_its_session_without_publishing_it() {
    let (mut s, prompt) = sessions_selector(config(SessionMode::Hard));
    s.record_session_changes();
    let t0 = Instant::now();
    let key = bind_remotely(&mut s, &partition(), &prompt, t0);
    // The replica that made it died: its booking expires here, and the session idles.
    let expiry = t0 + s.config().active_request_expiry;
    s.tick(expiry);
    assert!(s.load_tracker().is_empty());
    assert_eq!(
        s.session_binding(&key, expiry).and_then(|b| b.idle_until),
        Some(expiry + TTL)
    );
    assert!(
        s.take_session_changes().is_empty(),
        "another replica's binding"
    );
    assert!(s.local_session_bindings(expiry).is_empty());
}

/// Replica `r2`'s binding of session `s` to worker 3 and its booking `x` of `prompt` there, as
/// replica sync applies them; returns the session's key.
fn bind_remotely(s: &mut Selector, p: &PartitionKey, prompt: &[u32], t0: Instant) -> SessionKey {
    let key = SessionKey::new(p, "s");
    let bound = SyncedBinding {
        rank: Rank::new(3, 0),
        idle_until: None,
    };
    s.apply_synced_binding(&key, Some(bound), t0);
    let hashes = PromptHashes::from_tokens(prompt, BS as usize, crate::hash::BASE_SEED);
    let state = SyncedBooking {
        worker_id: 3,
        dp_rank: 0,
        block_size: BS,
        sequence_hashes: Arc::from(hashes.sequence),
        isl_tokens: prompt.len() as u64,
        effective_prefill_tokens: prompt.len() as u64,
        expected_output_tokens: None,
        track_prefill_tokens: true,
        prefill_complete: false,
        output_blocks: 0,
        decode_blocks: 5,
        session_id: Some("s".into()),
    };
    s.apply_synced_booking(BookingOwner::Remote("r2"), "x", &state, t0)
        .unwrap();
    key
}

/// Books a 4,000-token prompt explicitly on worker 2 (`big`): past the busy thresholds the tests
/// set.
fn load_worker_2(s: &mut Selector, p: &PartitionKey, now: Instant) {
    let big: Vec<u32> = (1000..5000).collect();
    let mut explicit = ReservationRequest::replay(p, "big");
    explicit.selection_id = None;
    explicit.reservation_id = Some("big");
    explicit.worker_id = Some(2);
    explicit.prompt = Some(tokens_prompt(&big));
    s.create_reservation(&explicit, now).unwrap();
}
