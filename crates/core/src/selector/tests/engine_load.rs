//! Engine-reported load (`engine_load.rs`): fresh reports raise the booked load, stale ones and
//! bad ones do not, and reports go with their worker.

use super::*;
use crate::schedule::Candidate;
use crate::selector::engine_load::correct;

const TOTAL_KV_BLOCKS: u64 = 1000;

/// Workers 1 and 2, with the prompt cached on worker 1 (so the booked load alone picks it).
fn two_workers_prompt_on_1() -> (Selector, Vec<u32>) {
    let mut s = Selector::default();
    for w in [1, 2] {
        s.upsert_worker(WorkerSpec {
            total_kv_blocks: Some(TOTAL_KV_BLOCKS),
            ..spec(w)
        })
        .unwrap();
    }
    let prompt = tokens(17);
    store_prompt(&mut s, 1, &prompt, Tier::Device);
    (s, prompt)
}

fn heavy() -> EngineLoad {
    EngineLoad {
        running: 60,
        waiting: 40,
        kv_usage: Some(0.9),
    }
}

fn picked(s: &Selector, prompt: &[u32], now: Instant) -> WorkerId {
    let p = partition();
    s.select(&select_req(&p, prompt, None), now, &mut rng())
        .unwrap()
        .worker_id
}

#[test]
fn a_fresh_report_moves_the_pick_off_a_rank_the_router_did_not_book() {
    let (s, prompt) = two_workers_prompt_on_1();
    let t0 = Instant::now();
    assert_eq!(
        picked(&s, &prompt, t0),
        1,
        "the cached rank, with no load booked"
    );
    s.report_engine_load(Rank::new(1, 0), heavy(), t0).unwrap();
    assert_eq!(picked(&s, &prompt, t0 + Duration::from_secs(1)), 2);
    // The booked load is untouched: only the candidates see the report.
    assert_eq!(
        s.load_tracker().rank_load(Rank::new(1, 0)).active_requests,
        0
    );
}

#[test]
fn a_stale_report_is_ignored() {
    let (s, prompt) = two_workers_prompt_on_1();
    let t0 = Instant::now();
    s.report_engine_load(Rank::new(1, 0), heavy(), t0).unwrap();
    let max_age = s.config().engine_load_max_age;
    assert_eq!(max_age, DEFAULT_ENGINE_LOAD_MAX_AGE);
    assert_eq!(
        picked(&s, &prompt, t0 + max_age),
        2,
        "at the max age: fresh"
    );
    let later = t0 + max_age + Duration::from_millis(1);
    assert_eq!(picked(&s, &prompt, later), 1);
    assert_eq!(s.engine_load(Rank::new(1, 0), later), None);
    assert_eq!(s.engine_load(Rank::new(1, 0), t0), Some(heavy()));
}

#[test]
fn bad_reports_are_refused_naming_the_field() {
    let (s, _) = two_workers_prompt_on_1();
    let now = Instant::now();
    for usage in [f64::NAN, f64::INFINITY, 1.5, -0.1] {
        let load = EngineLoad {
            kv_usage: Some(usage),
            ..EngineLoad::default()
        };
        let err = s
            .report_engine_load(Rank::new(1, 0), load, now)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidField {
                    field: "kv_usage",
                    ..
                }
            ),
            "{usage}: {err}"
        );
        assert_eq!(err.status(), 400);
    }
    let err = s
        .report_engine_load(Rank::new(9, 0), EngineLoad::default(), now)
        .unwrap_err();
    assert!(matches!(err, Error::WorkerNotFound { worker_id: 9 }));
    let err = s
        .report_engine_load(Rank::new(1, 3), EngineLoad::default(), now)
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidField {
            field: "dp_rank",
            ..
        }
    ));
    assert_eq!(s.engine_load_count(), 0);
}

#[test]
fn reports_go_with_their_worker_and_ranks() {
    let (mut s, _) = two_workers_prompt_on_1();
    let now = Instant::now();
    s.report_engine_load(Rank::new(1, 0), heavy(), now).unwrap();
    s.report_engine_load(Rank::new(2, 0), heavy(), now).unwrap();
    // A second report replaces the first.
    s.report_engine_load(Rank::new(2, 0), EngineLoad::default(), now)
        .unwrap();
    assert_eq!(s.engine_load_count(), 2);
    s.delete_worker(1).unwrap();
    assert_eq!(s.engine_load_count(), 1);
    assert_eq!(s.engine_load(Rank::new(1, 0), now), None);
    // Worker 2 moves to ranks 4..6: its rank 0 report goes.
    s.upsert_worker(WorkerSpec {
        data_parallel_start_rank: Some(4),
        data_parallel_size: Some(2),
        ..spec(2)
    })
    .unwrap();
    assert_eq!(s.engine_load_count(), 0);
}

fn candidate(active_requests: u64, active_decode_blocks: u64, total: Option<u64>) -> Candidate {
    Candidate {
        rank: Rank::new(1, 0),
        device_blocks: 0,
        host_blocks: 0,
        disk_blocks: 0,
        active_prefill_tokens: 0,
        active_decode_blocks,
        potential_decode_blocks: active_decode_blocks + 5,
        active_requests,
        total_kv_blocks: total,
        max_num_batched_tokens: None,
        speeds: crate::speed::EngineSpeeds::default(),
    }
}

#[test]
fn a_report_raises_the_booked_load_and_never_lowers_it() {
    let report = EngineLoad {
        running: 3,
        waiting: 2,
        kv_usage: Some(0.25),
    };
    let mut c = candidate(1, 10, Some(200));
    correct(&mut c, &report);
    assert_eq!(
        (
            c.active_requests,
            c.active_decode_blocks,
            c.potential_decode_blocks
        ),
        (5, 50, 55)
    );
    let mut c = candidate(9, 80, Some(200));
    correct(&mut c, &report);
    assert_eq!(
        (
            c.active_requests,
            c.active_decode_blocks,
            c.potential_decode_blocks
        ),
        (9, 80, 85)
    );
    // Without the worker's KV size the usage cannot be turned into blocks.
    let mut c = candidate(0, 10, None);
    correct(&mut c, &report);
    assert_eq!((c.active_requests, c.active_decode_blocks), (5, 10));
}
