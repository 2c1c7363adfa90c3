//! Disaggregated prefill and decode (`disagg.rs`, SPEC §6.1): roles keep plain selects off the
//! prefill workers, each leg is picked on its own pool by its own cost, bypasses, and both legs
//! booked or neither.

use super::*;
use crate::selector::{DECODE_LEG_SUFFIX, PREFILL_LEG_SUFFIX};

/// Prefill workers 1 and 2, decode workers 3 and 4.
fn pd_fleet(config: SelectorConfig) -> Selector {
    let mut s = Selector::new(config);
    for (w, role) in [
        (1, WorkerRole::Prefill),
        (2, WorkerRole::Prefill),
        (3, WorkerRole::Decode),
        (4, WorkerRole::Decode),
    ] {
        let outcome = s.upsert_worker(WorkerSpec { role, ..spec(w) }).unwrap();
        assert_eq!(outcome.record.lifecycle, Lifecycle::Schedulable);
    }
    s
}

/// Books `requests` requests of `tokens` uncached tokens on `worker` (its load, nothing else).
fn load_worker(s: &mut Selector, worker: WorkerId, requests: u32, tokens: u64, now: Instant) {
    let p = partition();
    for i in 0..requests {
        let prompt = tokens_vec(tokens);
        s.create_reservation(
            &ReservationRequest {
                reservation_id: Some(&format!("load-{worker}-{i}")),
                worker_id: Some(worker),
                dp_rank: Some(0),
                effective_prefill_tokens: Some(tokens),
                prompt: Some(tokens_prompt(&prompt)),
                ..explicit(&p)
            },
            now,
        )
        .unwrap();
    }
}

/// An explicit booking's request (no selection to replay).
fn explicit(p: &PartitionKey) -> ReservationRequest<'_> {
    ReservationRequest {
        selection_id: None,
        ..ReservationRequest::replay(p, "")
    }
}

fn tokens_vec(n: u64) -> Vec<u32> {
    // Disjoint from `tokens(n)`'s prompts: nothing of it is cached anywhere.
    (0..n as u32).map(|t| 1_000_000 + t).collect()
}

#[test]
fn a_plain_select_never_picks_a_prefill_worker() {
    let mut s = pd_fleet(SelectorConfig::default());
    let prompt = tokens(64);
    // The prefill worker holds the whole prompt: still not a candidate for a whole request.
    store_prompt(&mut s, 1, &prompt, Tier::Device);
    let p = partition();
    let now = Instant::now();
    for seed in 0..20 {
        let sel = s
            .select(
                &select_req(&p, &prompt, None),
                now,
                &mut SmallRng::seed_from_u64(seed),
            )
            .unwrap();
        assert!([3, 4].contains(&sel.worker_id), "picked {}", sel.worker_id);
    }
    // Prefill workers alone cannot serve a plain request.
    let mut only_prefill = Selector::default();
    only_prefill
        .upsert_worker(WorkerSpec {
            role: WorkerRole::Prefill,
            ..spec(1)
        })
        .unwrap();
    let err = only_prefill
        .select(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap_err();
    assert!(matches!(err, Error::NoEndpointsAvailable), "{err:?}");
}

#[test]
fn prefill_follows_the_cache_and_decode_the_load() {
    let mut s = pd_fleet(SelectorConfig::default());
    let prompt = tokens(64);
    store_prompt(&mut s, 2, &prompt, Tier::Device);
    let now = Instant::now();
    load_worker(&mut s, 3, 4, 16, now);
    let p = partition();
    let picks = s
        .select_disaggregated(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(picks.bypass, None);
    let prefill = picks.prefill.expect("a prefill pick");
    assert_eq!(
        prefill.worker_id, 2,
        "the prefill worker holding the prompt"
    );
    assert_eq!(prefill.overlap.gpu, 64);
    assert_eq!(picks.decode.worker_id, 4, "the idle decode worker");
    // The decode leg computes nothing and credits only what it holds itself (nothing).
    assert_eq!(picks.decode.effective_prefill_tokens, 0);
    assert!(!picks.decode.track_prefill_tokens);
    assert_eq!(picks.decode.overlap.gpu, 0);
}

#[test]
fn a_decode_worker_holding_part_of_the_prompt_is_preferred() {
    let mut s = pd_fleet(SelectorConfig::default());
    let prompt = tokens(64);
    // Decode worker 3 holds the first half (less KV to move in); 32 tokens stay uncached, so
    // there is no bypass.
    store_prompt(&mut s, 3, &prompt[..32], Tier::Device);
    let p = partition();
    let picks = s
        .select_disaggregated(&select_req(&p, &prompt, None), Instant::now(), &mut rng())
        .unwrap();
    assert_eq!(picks.bypass, None);
    assert_eq!(picks.decode.worker_id, 3);
    assert_eq!(picks.decode.overlap.gpu, 32);
}

#[test]
fn a_prompt_cached_on_a_decode_worker_bypasses_the_prefill_pool() {
    let mut s = pd_fleet(SelectorConfig::default());
    let prompt = tokens(17);
    store_prompt(&mut s, 4, &prompt, Tier::Device);
    let p = partition();
    let picks = s
        .select_disaggregated(&select_req(&p, &prompt, None), Instant::now(), &mut rng())
        .unwrap();
    assert_eq!(picks.bypass, Some(PdBypass::SmallUncached));
    assert!(picks.prefill.is_none());
    assert_eq!(picks.decode.worker_id, 4);
    // A whole request: the engine computes the one uncached token itself.
    assert_eq!(picks.decode.effective_prefill_tokens, 1);

    // With the threshold at 0, one uncached token goes through a prefill worker.
    let mut strict = pd_fleet(SelectorConfig {
        pd_bypass_tokens: 0,
        ..SelectorConfig::default()
    });
    store_prompt(&mut strict, 4, &prompt, Tier::Device);
    let picks = strict
        .select_disaggregated(&select_req(&p, &prompt, None), Instant::now(), &mut rng())
        .unwrap();
    assert_eq!(picks.bypass, None);
    assert!(picks.prefill.is_some());
}

#[test]
fn no_prefill_worker_or_a_saturated_pool_runs_the_request_whole() {
    let p = partition();
    let prompt = tokens(64);
    let now = Instant::now();
    // Decode and both workers only.
    let mut s = Selector::default();
    s.upsert_worker(WorkerSpec {
        role: WorkerRole::Decode,
        ..spec(3)
    })
    .unwrap();
    s.upsert_worker(spec(5)).unwrap();
    let picks = s
        .select_disaggregated(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(picks.bypass, Some(PdBypass::NoPrefillWorkers));
    assert_eq!(picks.decode.effective_prefill_tokens, 64);

    // Both prefill workers over the busy threshold.
    let mut config = SelectorConfig::default();
    config.scheduler.busy_prefill_tokens = Some(100);
    let mut s = pd_fleet(config);
    load_worker(&mut s, 1, 1, 200, now);
    load_worker(&mut s, 2, 1, 200, now);
    let picks = s
        .select_disaggregated(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(picks.bypass, Some(PdBypass::PrefillSaturated));
    assert!([3, 4].contains(&picks.decode.worker_id));
}

#[test]
fn pinning_a_disaggregated_request_is_refused() {
    let s = pd_fleet(SelectorConfig::default());
    let p = partition();
    let prompt = tokens(64);
    let req = SelectRequest {
        pinned_worker: Some(PinnedWorker {
            worker_id: 3,
            dp_rank: None,
        }),
        ..select_req(&p, &prompt, None)
    };
    let err = s
        .select_disaggregated(&req, Instant::now(), &mut rng())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidField {
                field: "pinned_worker",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn select_and_reserve_books_each_leg_under_its_own_id() {
    let mut s = pd_fleet(SelectorConfig::default());
    let prompt = tokens(64);
    let p = partition();
    let now = Instant::now();
    let (picks, booked) = s
        .select_and_reserve_disaggregated(
            &select_req(&p, &prompt, None),
            Some("r"),
            now,
            &mut rng(),
        )
        .unwrap();
    let prefill = booked.prefill.expect("a prefill booking");
    assert_eq!(prefill.reservation_id, format!("r{PREFILL_LEG_SUFFIX}"));
    assert_eq!(
        booked.decode.reservation_id,
        format!("r{DECODE_LEG_SUFFIX}")
    );
    let prefill_rank = Rank::new(prefill.worker_id, 0);
    let decode_rank = Rank::new(booked.decode.worker_id, 0);
    assert_eq!(prefill.worker_id, picks.prefill.unwrap().worker_id);
    {
        let load = s.load_tracker();
        let on_prefill = load.rank_load(prefill_rank);
        assert_eq!(on_prefill.active_prefill_tokens, 64);
        let prefill_view = load.booking("r.prefill").unwrap();
        assert_eq!(prefill_view.expected_output_tokens, Some(1));
        let on_decode = load.rank_load(decode_rank);
        assert_eq!(
            on_decode.active_prefill_tokens, 0,
            "the decode leg computes no prompt"
        );
        assert_eq!(on_decode.active_decode_blocks, 16, "but holds its KV");
        assert_eq!(on_decode.active_requests, 1);
    }
    // The prefill leg ends first; the decode booking lives on.
    s.free("r.prefill", now).unwrap();
    assert_eq!(
        s.load_tracker().rank_load(prefill_rank),
        RankLoad::default()
    );
    assert_eq!(s.load_tracker().rank_load(decode_rank).active_requests, 1);
    s.free("r.decode", now).unwrap();
    assert_eq!(s.load_tracker().rank_load(decode_rank), RankLoad::default());
}

#[test]
fn both_legs_are_booked_or_neither() {
    let mut s = pd_fleet(SelectorConfig::default());
    let prompt = tokens(64);
    let p = partition();
    let now = Instant::now();
    // `x.decode` is taken: the decode booking is refused, so the prefill one must not stay.
    s.create_reservation(
        &ReservationRequest {
            reservation_id: Some("x.decode"),
            worker_id: Some(4),
            dp_rank: Some(0),
            effective_prefill_tokens: Some(0),
            prompt: Some(tokens_prompt(&prompt)),
            ..explicit(&p)
        },
        now,
    )
    .unwrap();
    let err = s
        .select_and_reserve_disaggregated(
            &select_req(&p, &prompt, None),
            Some("x"),
            now,
            &mut rng(),
        )
        .unwrap_err();
    assert!(matches!(err, Error::DuplicateReservation { .. }), "{err:?}");
    assert!(s.load_tracker().booking("x.prefill").is_none());
    for w in [1, 2] {
        assert_eq!(
            s.load_tracker().rank_load(Rank::new(w, 0)),
            RankLoad::default()
        );
    }
}

#[test]
fn a_cached_disaggregated_selection_replays_leg_by_leg() {
    let mut s = pd_fleet(SelectorConfig::default());
    let prompt = tokens(64);
    store_prompt(&mut s, 1, &prompt, Tier::Device);
    let p = partition();
    let now = Instant::now();
    let picks = s
        .select_disaggregated(&select_req(&p, &prompt, Some("sel")), now, &mut rng())
        .unwrap();
    assert_eq!(
        picks.prefill.as_ref().unwrap().selection_id.as_deref(),
        Some("sel.prefill")
    );
    assert_eq!(picks.decode.selection_id.as_deref(), Some("sel.decode"));
    let prefill = s
        .create_reservation(&ReservationRequest::replay(&p, "sel.prefill"), now)
        .unwrap();
    assert_eq!(prefill.worker_id, 1);
    let decode = s
        .create_reservation(&ReservationRequest::replay(&p, "sel.decode"), now)
        .unwrap();
    assert_eq!(decode.worker_id, picks.decode.worker_id);
    let load = s.load_tracker();
    assert_eq!(
        load.booking("sel.prefill").unwrap().expected_output_tokens,
        Some(1)
    );
    assert_eq!(
        load.booking("sel.decode").unwrap().effective_prefill_tokens,
        0
    );
}

#[test]
fn decode_workers_that_cannot_run_whole_requests_never_take_a_bypass() {
    let mut s = pd_fleet(SelectorConfig::default());
    let prompt = tokens(17);
    // Decode worker 4 holds the prompt: a bypass, unless decode workers cannot run it whole
    // (SGLang), when both legs run as usual.
    store_prompt(&mut s, 4, &prompt, Tier::Device);
    let p = partition();
    let now = Instant::now();
    let vllm = s
        .select_disaggregated(&select_req(&p, &prompt, None), now, &mut rng())
        .unwrap();
    assert_eq!(vllm.bypass, Some(PdBypass::SmallUncached));
    let sglang = SelectRequest {
        decode_runs_whole: false,
        ..select_req(&p, &prompt, None)
    };
    let picks = s.select_disaggregated(&sglang, now, &mut rng()).unwrap();
    assert_eq!(picks.bypass, None);
    assert!(picks.prefill.is_some());
    assert_eq!(
        picks.decode.worker_id, 4,
        "the decode worker holding the prompt"
    );
    // A plain select of such a request has no worker at all here.
    let err = s.select(&sglang, now, &mut rng()).unwrap_err();
    assert!(matches!(err, Error::NoEndpointsAvailable), "{err:?}");
    // A `both` worker takes the bypass.
    s.upsert_worker(spec(5)).unwrap();
    store_prompt(&mut s, 5, &prompt, Tier::Device);
    let picks = s.select_disaggregated(&sglang, now, &mut rng()).unwrap();
    assert_eq!(picks.bypass, Some(PdBypass::SmallUncached));
    assert_eq!(picks.decode.worker_id, 5);
}
