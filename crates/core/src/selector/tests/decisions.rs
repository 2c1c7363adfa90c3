//! Routing decisions: effective prefill under each router profile, and the decision quality a
//! selection reports.

use super::*;

/// Profiles: with `overlap_score_credit` 3, a prompt with 2 uncached tokens reports and books 2
/// effective prefill tokens under the default profile, and 0 (Dynamo's formula) under `dynamo`.
#[test]
fn routing_credit_leaks_into_effective_prefill_only_under_the_dynamo_profile() {
    use crate::schedule::RouterProfile;
    for (profile, want) in [(RouterProfile::Kvroute, 2), (RouterProfile::Dynamo, 0)] {
        let mut config = SelectorConfig::for_profile(profile);
        config.scheduler.overlap_score_credit = 3.0;
        let mut s = Selector::new(config);
        s.upsert_worker(spec(1)).unwrap();
        let prompt = tokens(18);
        store_prompt(&mut s, 1, &prompt[..16], Tier::Device);
        let p = partition();
        let now = Instant::now();
        let potential = s
            .potential_loads(&p, tokens_prompt(&prompt), &Overrides::default())
            .unwrap();
        assert_eq!(potential[0].potential_prefill_tokens, want, "{profile}");
        let sel = s
            .select(&select_req(&p, &prompt, Some("replayed")), now, &mut rng())
            .unwrap();
        assert_eq!(sel.overlap.gpu, 16);
        assert_eq!(sel.effective_prefill_tokens, want, "{profile}: select");
        s.create_reservation(&ReservationRequest::replay(&p, "replayed"), now)
            .unwrap();
        s.select_and_reserve(
            &select_req(&p, &prompt, None),
            Some("atomic"),
            now,
            &mut rng(),
        )
        .unwrap();
        let explicit = ReservationRequest {
            worker_id: Some(1),
            reservation_id: Some("explicit"),
            selection_id: None,
            prompt: Some(tokens_prompt(&prompt)),
            ..ReservationRequest::replay(&p, "unused")
        };
        s.create_reservation(&explicit, now).unwrap();
        for id in ["replayed", "atomic", "explicit"] {
            let booked = s
                .load_tracker()
                .booking(id)
                .unwrap()
                .effective_prefill_tokens;
            assert_eq!(booked, want, "{profile}: {id} books");
        }
        assert_eq!(
            s.loads(Some("m"), None)[0].loads[0].potential_prefill_tokens,
            3 * want
        );
    }
}

#[test]
fn best_overlap_equals_the_chosen_one_when_the_holder_is_picked() {
    let mut s = selector_with(&[1, 2, 3]);
    let prompt = tokens(17);
    store_prompt(&mut s, 2, &prompt, Tier::Device);
    store_prompt(&mut s, 3, &prompt[..8], Tier::Device);
    let p = partition();
    let now = Instant::now();
    let sel = s
        .select(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(
        (sel.worker_id, sel.overlap.gpu, sel.best_gpu_overlap),
        (2, 16, 16)
    );
    let (booked, _) = s
        .select_and_reserve(&select_req(&p, &prompt, None), Some("a"), now, &mut rng())
        .unwrap();
    assert_eq!((booked.overlap.gpu, booked.best_gpu_overlap), (16, 16));
    // No rank holds anything of an unrelated prompt: 0 of 0.
    let other: Vec<u32> = (500..517).collect();
    let miss = s
        .select(&select_req(&p, &other, None), now, &mut rng())
        .unwrap();
    assert_eq!((miss.overlap.gpu, miss.best_gpu_overlap), (0, 0));
}

#[test]
fn best_overlap_counts_a_busy_holder_the_selector_passed_over() {
    let mut config = SelectorConfig::default();
    config.scheduler.busy_prefill_tokens = Some(10);
    let mut s = Selector::new(config);
    for w in [1, 2] {
        s.upsert_worker(spec(w)).unwrap();
    }
    let prompt = tokens(17);
    store_prompt(&mut s, 2, &prompt, Tier::Device);
    let p = partition();
    let now = Instant::now();
    // 20 prefill tokens booked on worker 2 make it busy.
    let load: Vec<u32> = (1000..1020).collect();
    let pin = SelectRequest {
        pinned_worker: Some(PinnedWorker {
            worker_id: 2,
            dp_rank: Some(0),
        }),
        ..select_req(&p, &load, None)
    };
    s.select_and_reserve(&pin, Some("busy"), now, &mut rng())
        .unwrap();
    let sel = s
        .select(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(
        (sel.worker_id, sel.overlap.gpu, sel.best_gpu_overlap),
        (1, 0, 16)
    );
    let (booked, _) = s
        .select_and_reserve(&select_req(&p, &prompt, None), Some("b"), now, &mut rng())
        .unwrap();
    assert_eq!(
        (
            booked.worker_id,
            booked.overlap.gpu,
            booked.best_gpu_overlap
        ),
        (1, 0, 16)
    );
}

#[test]
fn best_overlap_counts_a_holder_the_cost_excluded_but_not_one_the_caller_excluded() {
    let mut s = selector_with(&[1, 2]);
    let prompt = tokens(17);
    // Worker 2 holds one block of the prompt but carries 100 blocks of another request.
    store_prompt(&mut s, 2, &prompt[..4], Tier::Device);
    let p = partition();
    let now = Instant::now();
    let big: Vec<u32> = (1000..1400).collect();
    let pin = SelectRequest {
        pinned_worker: Some(PinnedWorker {
            worker_id: 2,
            dp_rank: None,
        }),
        ..select_req(&p, &big, None)
    };
    s.select_and_reserve(&pin, Some("big"), now, &mut rng())
        .unwrap();
    let sel = s
        .select(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(
        (sel.worker_id, sel.overlap.gpu, sel.best_gpu_overlap),
        (1, 0, 4),
        "the cost sends the prompt away from its one cached block"
    );
    // A rank the caller ruled out is no candidate: nothing better was on offer.
    let allowed = [1u64];
    let only_1 = SelectRequest {
        allowed_worker_ids: Some(&allowed),
        ..select_req(&p, &prompt, None)
    };
    let sel = s.select(&only_1, now, &mut rng()).unwrap();
    assert_eq!((sel.overlap.gpu, sel.best_gpu_overlap), (0, 0));
    // Pinned to the holder: it is the only candidate, and the best one.
    let pinned = SelectRequest {
        pinned_worker: Some(PinnedWorker {
            worker_id: 2,
            dp_rank: Some(0),
        }),
        ..select_req(&p, &prompt, None)
    };
    let sel = s.select(&pinned, now, &mut rng()).unwrap();
    assert_eq!((sel.overlap.gpu, sel.best_gpu_overlap), (4, 4));
}

/// Spread: two replicas that hear of each other's bookings late pick from their own share of
/// near-equal ranks, so from one view they pick different ranks; alone they pick the same one;
/// a prefix's holder still wins on both.
#[test]
fn replicas_spread_near_equal_picks_and_keep_the_holder() {
    let now = Instant::now();
    let p = partition();
    let mut a = selector_with(&[1, 2, 3, 4]);
    let mut b = selector_with(&[1, 2, 3, 4]);
    a.set_replica_id(Some("a"));
    b.set_replica_id(Some("b"));
    assert_eq!(a.replica_spread(), None, "no peer known yet");
    // Each books a small prompt and the other hears of it.
    let (small_a, small_b): (Vec<u32>, Vec<u32>) = ((1000..1016).collect(), (2000..2016).collect());
    a.select_and_reserve(&select_req(&p, &small_a, None), Some("x"), now, &mut rng())
        .unwrap();
    b.select_and_reserve(&select_req(&p, &small_b, None), Some("y"), now, &mut rng())
        .unwrap();
    let x = a.synced_booking("x").unwrap();
    let y = b.synced_booking("y").unwrap();
    b.apply_synced_booking(BookingOwner::Remote("a"), "x", &x, now)
        .unwrap();
    a.apply_synced_booking(BookingOwner::Remote("b"), "y", &y, now)
        .unwrap();
    a.tick(now);
    b.tick(now);
    let spread = |index| Some(ReplicaSpread { index, replicas: 2 });
    assert_eq!(
        (a.replica_spread(), b.replica_spread()),
        (spread(0), spread(1))
    );

    // A larger unrelated prompt: every rank is within what it adds of the cheapest.
    let big = tokens(64);
    let picks = |s: &Selector, seed| {
        s.select(
            &select_req(&p, &big, None),
            now,
            &mut SmallRng::seed_from_u64(seed),
        )
        .unwrap()
        .worker_id
    };
    for seed in 0..16 {
        let (wa, wb) = (picks(&a, seed), picks(&b, seed));
        assert!(
            [1, 3].contains(&wa),
            "a's share: positions 0 and 2, got {wa}"
        );
        assert!(
            [2, 4].contains(&wb),
            "b's share: positions 1 and 3, got {wb}"
        );
    }
    // Anonymous (a lone router each), the same view gives the same pick.
    a.set_replica_id(None);
    b.set_replica_id(None);
    assert!((0..16).all(|seed| picks(&a, seed) == picks(&b, seed)));

    // A prefix held by worker 4 (b's share) wins on replica a too.
    a.set_replica_id(Some("a"));
    assert_eq!(a.replica_spread(), spread(0));
    store_prompt(&mut a, 4, &big, Tier::Device);
    assert!((0..16).all(|seed| picks(&a, seed) == 4));
}

/// Under the `dynamo` profile a replica knows its place but picks the cheapest, as Dynamo does.
#[test]
fn replicas_do_not_spread_under_the_dynamo_profile() {
    use crate::schedule::RouterProfile;
    let now = Instant::now();
    let p = partition();
    let mut s = Selector::new(SelectorConfig::for_profile(RouterProfile::Dynamo));
    for w in [1, 2, 3, 4] {
        s.upsert_worker(spec(w)).unwrap();
    }
    s.set_replica_id(Some("b"));
    let mut other = selector_with(&[1, 2, 3, 4]);
    let small: Vec<u32> = (1000..1016).collect();
    other
        .select_and_reserve(&select_req(&p, &small, None), Some("x"), now, &mut rng())
        .unwrap();
    let x = other.synced_booking("x").unwrap();
    s.apply_synced_booking(BookingOwner::Remote("a"), "x", &x, now)
        .unwrap();
    s.tick(now);
    assert_eq!(
        s.replica_spread(),
        Some(ReplicaSpread {
            index: 1,
            replicas: 2
        })
    );
    // Worker 1 holds a prefix of the prompt: the cheapest under Dynamo's weights, and at
    // position 0, not this replica's share.
    let big = tokens(64);
    store_prompt(&mut s, 1, &big[..8], Tier::Device);
    let lone = {
        let mut t = Selector::new(SelectorConfig::for_profile(RouterProfile::Dynamo));
        for w in [1, 2, 3, 4] {
            t.upsert_worker(spec(w)).unwrap();
        }
        t.apply_synced_booking(BookingOwner::Remote("a"), "x", &x, now)
            .unwrap();
        store_prompt(&mut t, 1, &big[..8], Tier::Device);
        t
    };
    for seed in 0..16 {
        let pick = |sel: &Selector| {
            sel.select(
                &select_req(&p, &big, None),
                now,
                &mut SmallRng::seed_from_u64(seed),
            )
            .unwrap()
            .worker_id
        };
        assert_eq!(pick(&s), pick(&lone), "seed {seed}");
    }
}
