//! Routing decisions: effective prefill under each router profile, and the decision quality a
//! selection reports.

use super::*;

/// Issue 29: with `overlap_score_credit` 3, a prompt with 2 uncached tokens reports and books 2
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
