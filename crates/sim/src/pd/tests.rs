use super::compare::{PdEntry, PdPolicy, compare, default_entries};
use super::*;
use crate::policy::{catalog, kvroute_policy};
use crate::sim::{SimConfig, run_policy};
use crate::suite::{Shape, shape_workload, shapes};
use crate::timing::{DecodeBatch, TimingModel};
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use rand::SeedableRng;
use rand::rngs::SmallRng;

/// A small, busy workload of shared-prefix prompts (the suite's `small_groups` at 4×, first
/// 150 requests).
fn workload() -> Workload {
    let shape = shapes()
        .into_iter()
        .find(|s| s.name() == "small_groups")
        .unwrap();
    let mut w = shape_workload(shape.as_ref(), 4.0, 1, 64).unwrap();
    w.requests.truncate(150);
    w
}

fn entry(p: usize, d: usize, policy: PdPolicy) -> PdEntry {
    PdEntry {
        prefill_engines: p,
        decode_engines: d,
        policy,
    }
}

fn run(w: &Workload, e: PdEntry, base: &PdConfig) -> PdRun {
    let config = e.config(base);
    let mut router = e.router(&config, kvroute_policy()).unwrap();
    run_pd(w, &config, router.as_mut(), Instant::now()).unwrap()
}

/// The aggregated case of the P/D loop is the simulator's own loop: same picks, same first
/// tokens, same ends, request by request, for a policy without and one with bookings.
#[test]
fn an_aggregated_fleet_runs_as_the_simulator_does() {
    let w = workload();
    for name in ["round_robin", "cache_aware", "kvroute"] {
        for delay_ms in [0, 20] {
            let sim = SimConfig {
                workers: 4,
                event_delay: Duration::from_millis(delay_ms),
                ..SimConfig::default()
            };
            let policy = catalog(kvroute_policy())
                .into_iter()
                .find(|p| p.name == name)
                .unwrap();
            let reference = run_policy(&w, &sim, &policy, Instant::now(), &mut |_| {}).unwrap();
            let base = PdConfig {
                event_delay: sim.event_delay,
                ..PdConfig::aggregated(4, sim.engine)
            };
            let pd = run(&w, entry(0, 4, PdPolicy::Aggregated(name)), &base);
            for (a, b) in reference.requests.iter().zip(&pd.requests) {
                assert_eq!(a.worker, b.decode_engine, "{name}");
                assert_eq!(a.first_token, b.first_token, "{name}");
                assert_eq!(a.finished, b.finished, "{name}");
                assert_eq!(a.cached_tokens, b.cached_tokens, "{name}");
            }
            assert_eq!(reference.engines, pd.engines, "{name}");
            assert!(pd.requests.iter().all(|r| r.prefill_engine.is_none()));
        }
    }
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let w = workload();
    let base = PdConfig {
        event_delay: Duration::from_millis(20),
        ..PdConfig::default()
    };
    for e in default_entries(8, &[(2, 6), (3, 5)]) {
        let a = run(&w, e, &base);
        assert_eq!(a, run(&w, e, &base), "{}", e.name());
        assert!(!a.token_gaps.is_empty());
    }
    // Another seed changes the random choices (cache_aware breaks ties at random).
    let e = entry(2, 6, PdPolicy::CacheAwarePrefill);
    let other = PdConfig { seed: 9, ..base };
    assert_ne!(run(&w, e, &base).requests, run(&w, e, &other).requests);
}

#[test]
fn every_request_completes_through_both_legs() {
    let w = workload();
    let base = PdConfig::default();
    for e in default_entries(8, &[(2, 6), (3, 5)]) {
        let r = run(&w, e, &base);
        assert_eq!(r.bookings_left, 0, "{}", e.name());
        for (i, o) in r.requests.iter().enumerate() {
            assert!(o.finished.is_some(), "{}: request {i}", e.name());
            let first = o.first_token.unwrap();
            assert!(o.arrival <= first && first <= o.finished.unwrap());
            match o.prefill_engine {
                Some(p) => {
                    assert!((p as usize) < e.prefill_engines);
                    let done = o.prefill_done.unwrap();
                    assert!(o.arrival < done && done + o.transfer_nanos < first);
                }
                None => assert!(
                    o.prefill_done.is_none() && (e.prefill_engines == 0 || o.bypass.is_some())
                ),
            }
        }
        // Every engine stepped: prefill engines ran prompts, decode engines the outputs.
        assert!(r.engines.iter().all(|c| c.steps > 0), "{}", e.name());
        let tokens: u64 = w.requests.iter().map(|q| q.output_tokens.max(1) - 1).sum();
        assert_eq!(
            r.token_gaps.len() as u64,
            tokens,
            "{}: one gap a token",
            e.name()
        );
    }
}

/// A lone request's TTFT is its prefill step, the copy, and one decode step, exactly.
#[test]
fn the_transfer_is_part_of_ttft() {
    let tokens: Vec<u32> = (0..1000).collect();
    let request = SimRequest {
        arrival_nanos: 5,
        prompt: PromptHashes::from_tokens(&tokens, 64, BASE_SEED),
        output_tokens: 3,
        session_id: None,
        tenant: None,
    };
    let w = Workload {
        name: "one".into(),
        block_size: 64,
        requests: vec![request],
    };
    let timing = TimingModel::default();
    let kv_blocks = PdConfig::default().decode_engine.kv_blocks.unwrap() as f64;
    let prefill = timing.step_nanos(1000, DecodeBatch::default(), 16.0 / kv_blocks);
    let decode = timing.step_nanos(
        0,
        DecodeBatch {
            sequences: 1,
            context_tokens: 1000,
        },
        16.0 / kv_blocks,
    );
    for gbps in [1.0, 50.0] {
        let base = PdConfig {
            transfer: TransferModel {
                bytes_per_sec: gbps * 1e9,
                ..TransferModel::default()
            },
            ..PdConfig::default()
        };
        let r = run(&w, entry(1, 1, PdPolicy::RoundRobinPairs), &base);
        let o = r.requests[0];
        // 1,000 tokens: 16 blocks (the last one partial) of 64 × 64 KiB.
        let transfer = (16.0 * 64.0 * 65536.0 / (gbps * 1e9) * 1e9_f64).round() as u64;
        assert_eq!((o.transferred_blocks, o.transfer_nanos), (16, transfer));
        assert_eq!(o.prefill_done, Some(5 + prefill));
        assert_eq!(
            o.first_token,
            Some(5 + prefill + transfer + decode),
            "{gbps}"
        );
        // The decode engine held the copy: it computed no prompt token.
        assert_eq!(r.engines[1].steps, 3);
    }
}

/// A decode engine that already holds the prompt's prefix receives only the rest.
#[test]
fn only_blocks_the_decode_engine_lacks_are_copied() {
    let w = workload();
    let r = run(
        &w,
        entry(1, 1, PdPolicy::RoundRobinPairs),
        &PdConfig::default(),
    );
    let block_tokens = 64;
    let mut partial = 0;
    for (o, q) in r.requests.iter().zip(&w.requests) {
        let blocks = q.prompt.isl_tokens.div_ceil(block_tokens);
        assert!(o.transferred_blocks <= blocks);
        if o.transferred_blocks < blocks {
            partial += 1;
        }
    }
    // A group's later requests find its system prompt on the lone decode engine (unless they
    // overlap the first one's copy).
    let mut seen = std::collections::HashSet::new();
    let repeats = w
        .requests
        .iter()
        .filter(|q| !seen.insert(q.prompt.sequence[0]))
        .count();
    assert!(
        repeats > 20 && partial * 2 > repeats,
        "{partial} of {repeats}"
    );
}

#[test]
fn the_comparison_names_fleets_and_rejects_mismatches() {
    let w = workload();
    let entries = default_entries(8, &[(2, 6)]);
    let names: Vec<String> = entries.iter().map(PdEntry::name).collect();
    assert_eq!(
        names,
        [
            "8 agg / round_robin",
            "8 agg / cache_aware",
            "8 agg / kvroute",
            "2P+6D / pd-round-robin",
            "2P+6D / pd-cache-aware",
            "2P+6D / kvroute-pd"
        ]
    );
    let base = PdConfig::default();
    let one = compare(&w, &base, &entries, kvroute_policy(), 1, Instant::now()).unwrap();
    let two = compare(&w, &base, &entries, kvroute_policy(), 3, Instant::now()).unwrap();
    assert_eq!(one, two);
    assert!(one[0].0.prefill_busy.is_none() && one[3].0.prefill_busy.is_some());
    let bad = entry(2, 6, PdPolicy::Aggregated("kvroute"));
    assert!(bad.router(&bad.config(&base), kvroute_policy()).is_err());
    let bad = entry(0, 8, PdPolicy::RoundRobinPairs);
    assert!(bad.router(&bad.config(&base), kvroute_policy()).is_err());
    let zero = PdConfig {
        decode_engines: 0,
        ..base
    };
    assert!(zero.validate().is_err());
}

/// Suite shapes are usable here as they are in the suite.
#[test]
fn a_shape_runs_on_a_pd_fleet() {
    let shape: Box<dyn Shape> = shapes().into_iter().next().unwrap();
    let mut w = shape_workload(shape.as_ref(), 2.0, 0, 64).unwrap();
    w.requests.truncate(60);
    let r = run(
        &w,
        entry(3, 5, PdPolicy::CacheAwarePrefill),
        &PdConfig::default(),
    );
    assert!(
        r.requests
            .iter()
            .all(|o| o.finished.is_some() || o.rejected)
    );
}

fn prompt_request(arrival_secs: u64, first_token: u32, len: u32) -> SimRequest {
    let tokens: Vec<u32> = (first_token..first_token + len).collect();
    SimRequest {
        arrival_nanos: arrival_secs * 1_000_000_000,
        prompt: PromptHashes::from_tokens(&tokens, 64, BASE_SEED),
        output_tokens: 20,
        session_id: None,
        tenant: None,
    }
}

/// A prompt the decode engine already holds skips the prefill engine; one it lacks does not.
#[test]
fn kvroute_pd_bypasses_when_little_is_uncached() {
    let kvroute = entry(1, 2, PdPolicy::Kvroute);
    // Prompt A twice (the second long after the first ended), then prompt B.
    let w = |len_a: u32| Workload {
        name: "bypass".into(),
        block_size: 64,
        requests: vec![
            prompt_request(0, 0, len_a),
            prompt_request(10, 0, len_a),
            prompt_request(20, 50_000, 1024),
        ],
    };
    let r = run(&w(1024), kvroute, &PdConfig::default());
    let o = &r.requests;
    assert!(o[0].bypass.is_none() && o[0].prefill_engine.is_some());
    // The decode engine that received A's copy holds all 16 of its blocks.
    assert_eq!(o[1].bypass, Some(PdBypassReason::SmallUncached));
    assert_eq!(
        (o[1].prefill_engine, o[1].decode_engine),
        (None, o[0].decode_engine)
    );
    assert_eq!(
        o[1].cached_tokens, 960,
        "every block but the one it computes"
    );
    assert!(o[2].bypass.is_none() && o[2].prefill_engine.is_some());
    assert_eq!(r.bookings_left, 0);
    // 1,000 tokens leave 40 in a partial block the decode engine never stored: above a
    // threshold of 8, so both legs run; at a threshold of 40 it bypasses.
    let r = run(&w(1000), kvroute, &PdConfig::default());
    assert!(r.requests[1].bypass.is_none() && r.requests[1].prefill_engine.is_some());
    let lenient = PdConfig {
        bypass_tokens: 40,
        ..PdConfig::default()
    };
    let r = run(&w(1000), kvroute, &lenient);
    assert_eq!(r.requests[1].bypass, Some(PdBypassReason::SmallUncached));
}

/// The prefill booking goes when the prefill leg ends; the decode booking lives to the last
/// token.
#[test]
fn kvroute_pd_frees_each_leg_when_it_ends() {
    use super::routers::KvroutePd;
    let config = PdConfig {
        prefill_engines: 1,
        decode_engines: 1,
        ..PdConfig::default()
    };
    let mut router = KvroutePd::new(&config, kvroute_policy(), 8).unwrap();
    let request = prompt_request(0, 0, 2000);
    let now = Instant::now();
    let mut rng = SmallRng::seed_from_u64(0);
    let route = router
        .route(7, &request.prompt, None, now, &mut rng)
        .unwrap();
    assert_eq!(
        (route.prefill, route.decode, route.bypass),
        (Some(0), 0, None)
    );
    assert_eq!(router.active_requests(), vec![1, 1]);
    router.on_prefill_done(7, now).unwrap();
    assert_eq!(router.active_requests(), vec![0, 1]);
    router.on_first_token(7, now).unwrap();
    router.on_output_block(7, now).unwrap();
    assert_eq!(router.bookings_left(), 1);
    router.on_finished(7, now).unwrap();
    assert_eq!(router.active_requests(), vec![0, 0]);
    assert_eq!(router.bookings_left(), 0);
    assert!(router.on_finished(7, now).is_err(), "freed once");
}
