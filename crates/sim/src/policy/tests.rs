//! The policies' unit tests.

use super::*;
use kvroute_core::event::StoredBlock;
use kvroute_core::hash::BASE_SEED;
use rand::SeedableRng;

fn prompt(tokens: std::ops::Range<u32>) -> PromptHashes {
    PromptHashes::from_tokens(&tokens.collect::<Vec<u32>>(), 64, BASE_SEED)
}

#[test]
fn resolve_accepts_all_and_lists_and_names_unknown_policies() {
    let all = resolve("all", kvroute_policy()).unwrap();
    assert_eq!(
        all.iter().map(|p| p.name).collect::<Vec<_>>(),
        vec![
            "round_robin",
            "random",
            "least_loaded",
            "cache_aware",
            "dynamo",
            "kvroute",
            "kvroute-approx-ttl",
            "kvroute-approx-lru",
            "kvroute-session-hard",
            "kvroute-session-soft"
        ]
    );
    let some = resolve("dynamo, round_robin,dynamo", kvroute_policy()).unwrap();
    assert_eq!(
        some.iter().map(|p| p.name).collect::<Vec<_>>(),
        vec!["dynamo", "round_robin"]
    );
    let err = resolve("dynamo,fastest", kvroute_policy()).unwrap_err();
    assert!(err.to_string().contains("`fastest`"), "{err}");
    assert!(err.to_string().contains("cache_aware"), "{err}");
}

#[test]
fn session_policies_keep_a_session_on_its_worker() {
    let engine = EngineConfig::default();
    let now = Instant::now();
    let mut rng = SmallRng::seed_from_u64(1);
    let workers_used = |name: &str, rng: &mut SmallRng| {
        let policy = &resolve(name, kvroute_policy()).unwrap()[0];
        let mut router = build_router(policy, 4, &engine).unwrap();
        // Eight unrelated prompts of one session, all in flight.
        let used: BTreeSet<usize> = (0..8u32)
            .map(|i| {
                let p = prompt(i * 10_000..i * 10_000 + 640);
                router.route(i, &p, Some(7), now, rng).unwrap()
            })
            .collect();
        used.len()
    };
    assert_eq!(workers_used("kvroute-session-hard", &mut rng), 1);
    assert!(
        workers_used("kvroute", &mut rng) > 1,
        "no session: spread by load"
    );
    match &resolve("kvroute-session-soft", kvroute_policy()).unwrap()[0].kind {
        PolicyKind::Selector(s) => {
            assert_eq!(s.sessions.mode, SessionMode::Soft);
            assert_eq!(s.sessions.ttl, Some(DEFAULT_SESSION_TTL));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn approximate_policies_run_without_kv_events() {
    for (name, policy) in [
        ("kvroute-approx-ttl", CachePolicy::Ttl),
        ("kvroute-approx-lru", CachePolicy::Lru),
    ] {
        let all = resolve(name, kvroute_policy()).unwrap();
        assert!(all[0].unavailable.is_none());
        let PolicyKind::Selector(config) = all[0].kind else {
            panic!("{name} is selector-backed");
        };
        assert!(!config.kv_events);
        assert_eq!(config.approximate_policy, policy);
        assert!(build_router(&all[0], 2, &EngineConfig::default()).is_ok());
    }
}

#[test]
fn round_robin_cycles_and_least_loaded_balances_tokens() {
    let now = Instant::now();
    let mut rng = SmallRng::seed_from_u64(1);
    let catalog = catalog(kvroute_policy());
    let engine = EngineConfig::default();
    let mut rr = build_router(&catalog[0], 3, &engine).unwrap();
    let p = prompt(0..100);
    let picks: Vec<usize> = (0..5)
        .map(|i| rr.route(i, &p, None, now, &mut rng).unwrap())
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1]);

    let mut ll = build_router(&catalog[2], 2, &engine).unwrap();
    let big = prompt(0..1000);
    let small = prompt(0..10);
    let first = ll.route(0, &big, None, now, &mut rng).unwrap();
    let second = ll.route(1, &small, None, now, &mut rng).unwrap();
    assert_ne!(first, second);
    // The small one's worker stays lighter until it grows past 1000 tokens.
    assert_eq!(ll.route(2, &small, None, now, &mut rng).unwrap(), second);
    ll.on_finished(0, now).unwrap();
    assert_eq!(ll.route(3, &small, None, now, &mut rng).unwrap(), first);
}

#[test]
fn cache_aware_follows_its_tree_and_falls_back_to_the_smallest_tree() {
    let now = Instant::now();
    let mut rng = SmallRng::seed_from_u64(1);
    let engine = EngineConfig::default();
    let mut ca = CacheAware::new(3, &engine, CacheAwareConfig::default());
    let a = prompt(0..1000);
    let w = ca.route(0, &a, None, now, &mut rng).unwrap();
    // Same prompt: best match (100 % > 30 %).
    assert_eq!(ca.route(1, &a, None, now, &mut rng).unwrap(), w);
    // An unrelated prompt goes to a worker with an empty tree.
    let b = prompt(5000..6000);
    let other = ca.route(2, &b, None, now, &mut rng).unwrap();
    assert_ne!(other, w);
    // Imbalance: 70 requests on one worker, none elsewhere → least loaded wins.
    ca.in_flight = vec![70, 0, 0];
    let wa = ca.route(3, &a, None, now, &mut rng).unwrap();
    assert_ne!(wa, 0);
}

#[test]
fn selector_router_books_and_follows_events() {
    let now = Instant::now();
    let mut rng = SmallRng::seed_from_u64(3);
    let engine = EngineConfig::default();
    let mut r = SelectorRouter::new(2, &engine, dynamo_policy(), None).unwrap();
    let p = prompt(0..640);
    // Worker 1 (index 1) reports the prompt's 10 blocks: the selector prefers it.
    r.on_kv_events(1, &[stored(&p)]);
    assert_eq!(r.route(0, &p, None, now, &mut rng).unwrap(), 1);
    r.on_first_token(0, now).unwrap();
    r.on_output_block(0, now).unwrap();
    r.on_finished(0, now).unwrap();
    assert!(r.on_finished(0, now).is_err(), "a second free is refused");
    assert_eq!(r.diagnostics(), RouterDiagnostics::default());
}

/// The engine's `Stored` of a prompt's blocks (engine hashes as the simulated engines make
/// them: the sequence hashes).
fn stored(p: &PromptHashes) -> KvEvent {
    KvEvent::Stored {
        parent: None,
        blocks: p
            .sequence
            .iter()
            .zip(&p.local)
            .map(|(&engine_hash, &local_hash)| StoredBlock {
                engine_hash,
                local_hash,
            })
            .collect(),
        tier: kvroute_core::event::Tier::Device,
    }
}

fn device_blocks(r: &SelectorRouter, p: &PromptHashes) -> Vec<u32> {
    let scores = r
        .selector
        .overlap_scores(&r.partition, Prompt::Hashes(p))
        .unwrap();
    let mut blocks: Vec<u32> = scores.workers.iter().map(|s| s.device_blocks).collect();
    blocks.sort_unstable();
    blocks
}

#[test]
fn kvroute_predicts_in_the_core_until_events_confirm_or_the_ttl_passes() {
    let now = Instant::now();
    let mut rng = SmallRng::seed_from_u64(3);
    let engine = EngineConfig::default();
    let mut r = SelectorRouter::new(4, &engine, kvroute_policy(), None).unwrap();
    let p = prompt(0..6400);
    let w = r.route(0, &p, None, now, &mut rng).unwrap();
    r.on_first_token(0, now).unwrap();
    // No engine event yet, but the predicted 100 blocks make `w` a full hit: cost 0 + 100
    // shared decode blocks there, against 100 + 100 elsewhere.
    assert_eq!(r.route(1, &p, None, now, &mut rng).unwrap(), w);
    assert_eq!(r.selector.predicted_blocks(), 100);
    // The engine's events confirm the prediction: the same overlap, now the engine's own.
    r.on_kv_events(w, &[stored(&p)]);
    assert_eq!(r.selector.prediction_counters().confirmed, 100);
    assert_eq!(r.selector.predicted_blocks(), 0);
    assert_eq!(device_blocks(&r, &p), vec![0, 0, 0, 100]);

    // A prompt whose events never come counts as held for the TTL, then not.
    let q = prompt(10_000..16_400);
    let wq = r.route(2, &q, None, now, &mut rng).unwrap();
    assert_eq!(device_blocks(&r, &q), vec![0, 0, 0, 100]);
    let ttl = PredictConfig::default().ttl;
    r.route(3, &prompt(20_000..20_640), None, now + ttl, &mut rng)
        .unwrap();
    assert_eq!(device_blocks(&r, &q), vec![0, 0, 0, 0], "worker {wq}");
    assert_eq!(r.selector.prediction_counters().expired, 100);
    for id in 0..4 {
        r.on_finished(id, now + ttl).unwrap();
    }
    assert_eq!(r.diagnostics(), RouterDiagnostics::default());

    // `dynamo` does not predict (Dynamo 1.6.1's default).
    let mut d = SelectorRouter::new(4, &engine, dynamo_policy(), None).unwrap();
    d.route(0, &p, None, now, &mut rng).unwrap();
    assert_eq!(d.selector.predicted_blocks(), 0);
    assert_eq!(device_blocks(&d, &p), vec![0, 0, 0, 0]);
}
