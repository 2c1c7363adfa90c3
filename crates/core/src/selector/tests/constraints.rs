//! Routing constraints through the whole selector: required taints narrow the candidates (with
//! pins and allowed lists, on select and select_and_reserve), preferred taints tilt the cost
//! under each router profile.

use super::*;
use crate::schedule::RouterProfile;

fn tainted(worker_id: WorkerId, taints: &[&str]) -> WorkerSpec {
    WorkerSpec {
        taints: taints.iter().map(|t| t.to_string()).collect(),
        ..spec(worker_id)
    }
}

/// Dynamo's recorded fleet: worker 1 (no taints) holds 16 of the 17 prompt tokens, 2 and 3
/// hold nothing and carry taints.
fn fleet(profile: RouterProfile) -> Selector {
    fleet_caching(profile, 16)
}

/// Workers 1, 2 (`gpu=h100`, `pref`, zone a) and 3 (`gpu=a100`, `other`); worker 1 caches the
/// first `cached_tokens` of `tokens(..)`.
fn fleet_caching(profile: RouterProfile, cached_tokens: u32) -> Selector {
    let mut s = Selector::new(SelectorConfig::for_profile(profile));
    s.upsert_worker(spec(1)).unwrap();
    let mut zoned = tainted(2, &["gpu=h100", "pref"]);
    zoned.topology_domains.insert("zone".into(), "a".into());
    s.upsert_worker(zoned).unwrap();
    s.upsert_worker(tainted(3, &["gpu=a100", "other"])).unwrap();
    store_prompt(&mut s, 1, &tokens(cached_tokens), Tier::Device);
    s
}

fn required(taints: &[&str]) -> RoutingConstraints {
    RoutingConstraints {
        required_taints: taints.iter().map(|t| t.to_string()).collect(),
        ..RoutingConstraints::default()
    }
}

fn preferred(weights: &[(&str, f32)]) -> RoutingConstraints {
    RoutingConstraints {
        preferred_taints: weights.iter().map(|&(t, w)| (t.to_string(), w)).collect(),
        ..RoutingConstraints::default()
    }
}

fn constrained<'a>(
    p: &'a PartitionKey,
    prompt: &'a [u32],
    constraints: &'a RoutingConstraints,
) -> SelectRequest<'a> {
    SelectRequest {
        routing_constraints: Some(constraints),
        ..select_req(p, prompt, None)
    }
}

/// The worker a select picks, or its error.
fn pick_of(s: &Selector, req: &SelectRequest<'_>) -> Result<WorkerId, Error> {
    s.select(req, Instant::now(), &mut rng())
        .map(|sel| sel.worker_id)
}

#[test]
fn required_taints_keep_only_the_workers_carrying_every_one() {
    let s = fleet(RouterProfile::Dynamo);
    let (p, prompt) = (partition(), tokens(17));
    assert_eq!(pick_of(&s, &select_req(&p, &prompt, None)), Ok(1));
    for (taints, want) in [
        (&["gpu=h100"][..], Ok(2)),
        (&["gpu=a100"], Ok(3)),
        (&["gpu=h100", "pref"], Ok(2)),
        (&[], Ok(1)),
        (&["gpu=h100", "gpu=a100"], Err(Error::NoEndpointsAvailable)),
        (&["nope"], Err(Error::NoEndpointsAvailable)),
        // Topology domains are not taints.
        (
            &["dynamo.topology/zone=a"],
            Err(Error::NoEndpointsAvailable),
        ),
    ] {
        let c = required(taints);
        assert_eq!(
            pick_of(&s, &constrained(&p, &prompt, &c)),
            want,
            "{taints:?}"
        );
    }
    // Worker 1's cache was not on offer: the decision quality does not count it.
    let c = required(&["gpu=h100"]);
    let sel = s
        .select(&constrained(&p, &prompt, &c), Instant::now(), &mut rng())
        .unwrap();
    assert_eq!((sel.overlap.gpu, sel.best_gpu_overlap), (0, 0));
}

#[test]
fn a_pinned_or_allowed_worker_without_the_required_taints_leaves_no_endpoint() {
    let mut s = fleet(RouterProfile::Dynamo);
    let (p, prompt) = (partition(), tokens(17));
    let h100 = required(&["gpu=h100"]);
    let pinned_to = |worker_id| SelectRequest {
        pinned_worker: Some(PinnedWorker {
            worker_id,
            dp_rank: Some(0),
        }),
        ..constrained(&p, &prompt, &h100)
    };
    assert_eq!(pick_of(&s, &pinned_to(1)), Err(Error::NoEndpointsAvailable));
    assert_eq!(pick_of(&s, &pinned_to(2)), Ok(2));
    let (without, with) = ([1u64, 3], [1u64, 2]);
    for (allowed, want) in [(&without, Err(Error::NoEndpointsAvailable)), (&with, Ok(2))] {
        let req = SelectRequest {
            allowed_worker_ids: Some(allowed),
            ..constrained(&p, &prompt, &h100)
        };
        assert_eq!(pick_of(&s, &req), want, "allowed {allowed:?}");
    }
    // select_and_reserve books only where the constraints allow, and nothing when none does.
    let a100 = required(&["gpu=a100"]);
    let (booked, _) = s
        .select_and_reserve(
            &constrained(&p, &prompt, &a100),
            Some("c-1"),
            Instant::now(),
            &mut rng(),
        )
        .unwrap();
    assert_eq!(booked.worker_id, 3);
    let nope = required(&["nope"]);
    assert_eq!(
        s.select_and_reserve(
            &constrained(&p, &prompt, &nope),
            Some("c-2"),
            Instant::now(),
            &mut rng()
        )
        .map(|(sel, _)| sel.worker_id),
        Err(Error::NoEndpointsAvailable)
    );
    assert!(s.load_tracker().booking("c-2").is_none());
    // A worker's taints change with it.
    s.upsert_worker(tainted(1, &["spot"])).unwrap();
    let spot = required(&["spot"]);
    assert_eq!(pick_of(&s, &constrained(&p, &prompt, &spot)), Ok(1));
    s.upsert_worker(spec(1)).unwrap();
    assert_eq!(
        pick_of(&s, &constrained(&p, &prompt, &spot)),
        Err(Error::NoEndpointsAvailable)
    );
}

/// Dynamo's recorded decisions: worker 1 costs 5.25 (cached), 2 and 3 cost 9.25 (cold).
#[test]
fn preferred_taints_move_the_pick_where_dynamo_moved_it() {
    let mut s = fleet(RouterProfile::Dynamo);
    let (p, prompt) = (partition(), tokens(17));
    for (weights, want) in [
        (&[("pref", 0.5)][..], 1),
        (&[("pref", 1.0)], 2),
        (&[("pref", 5.0)], 2),
        (&[("pref", f32::INFINITY)], 2),
        (&[("pref", -5.0)], 1),
        (&[("pref", 0.0)], 1),
        (&[("nope", 5.0)], 1),
        (&[("pref", 5.0), ("gpu=h100", -5.0)], 1),
    ] {
        let c = preferred(weights);
        assert_eq!(
            pick_of(&s, &constrained(&p, &prompt, &c)),
            Ok(want),
            "{weights:?}"
        );
    }
    let cold = [2u64, 3];
    for (weights, want) in [
        (&[("pref", 1.0), ("other", 2.0)], 3),
        (&[("pref", 2.0), ("other", 1.0)], 2),
    ] {
        let c = preferred(weights);
        let req = SelectRequest {
            allowed_worker_ids: Some(&cold),
            ..constrained(&p, &prompt, &c)
        };
        assert_eq!(pick_of(&s, &req), Ok(want), "{weights:?}");
    }
    // Avoiding the cached worker: 5.25 × e^tanh(0.5) stays under 9.25, × e^tanh(1) does not.
    s.upsert_worker(tainted(1, &["spot"])).unwrap();
    let warm = [1u64, 2];
    for (weight, want) in [(-0.5, 1), (-1.0, 2)] {
        let c = preferred(&[("spot", weight)]);
        let req = SelectRequest {
            allowed_worker_ids: Some(&warm),
            ..constrained(&p, &prompt, &c)
        };
        assert_eq!(pick_of(&s, &req), Ok(want), "spot {weight}");
    }
    // Required and preferred together: the filter first.
    let both = RoutingConstraints {
        required_taints: ["gpu=a100".to_string()].into(),
        preferred_taints: [("pref".to_string(), 5.0)].into(),
    };
    assert_eq!(pick_of(&s, &constrained(&p, &prompt, &both)), Ok(3));
}

/// The same multiplier under the default profile, whose cost is predicted time: the strongest
/// preference (× e⁻¹) decides between cold workers but does not give up a cache hit that saves
/// most of the request's time (16k tokens of prefill).
#[test]
fn under_the_default_profile_a_preference_decides_between_equals_not_against_a_cache_hit() {
    let s = fleet_caching(RouterProfile::Kvroute, 16_384);
    let (p, prompt) = (partition(), tokens(16_385));
    let strongest = preferred(&[("pref", f32::INFINITY)]);
    assert_eq!(pick_of(&s, &constrained(&p, &prompt, &strongest)), Ok(1));
    let cold = [2u64, 3];
    for (taint, want) in [("pref", 2), ("other", 3)] {
        let c = preferred(&[(taint, 0.1)]);
        let req = SelectRequest {
            allowed_worker_ids: Some(&cold),
            ..constrained(&p, &prompt, &c)
        };
        for _ in 0..8 {
            assert_eq!(pick_of(&s, &req), Ok(want), "{taint}");
        }
    }
}
