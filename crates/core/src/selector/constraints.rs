//! Routing constraints: a request's required and preferred worker taints (Dynamo 1.6.1's
//! `routing_constraints`), matched against each worker's [`WorkerSpec::taints`].
//!
//! - **Required taints** are a hard filter: a worker is a candidate only when it carries every
//!   one. The filter narrows what `pinned_worker` / `allowed_worker_ids` left, so a pinned or
//!   allowed worker without them leaves no candidate: `NoEndpointsAvailable` (503), Dynamo's
//!   answer too.
//! - **Preferred taints** map a taint to a signed weight. A candidate's cost is multiplied by
//!   `exp(−tanh(s))`, where `s` is the sum of the weights of the taints its worker carries. The
//!   multiplier is 1 when nothing matches or the weights cancel, falls towards e⁻¹ ≈ 0.37 for a
//!   preferred worker and rises towards e ≈ 2.72 for an avoided one: equal and opposite weights
//!   have reciprocal effects, and a preference tilts the choice without ever overriding cache
//!   and load completely. A sum that is not a number (`+inf` and `-inf` weights) counts as 0.
//!
//! The multiplier scales the whole cost (prefill and decode terms), under every router profile,
//! as Dynamo scales its own: the decisions Dynamo recorded replay under `--router-profile
//! dynamo`. A cost of 0 stays 0, as in Dynamo. It takes a rank with no decode blocks — not even
//! the prompt's own, which a rank's live bookings hold but `output_block` decayed to nothing —
//! and, under the default profile, a prompt its cache credit covers; rare enough that the
//! default profile keeps Dynamo's rule rather than one of its own.
//!
//! Taints are plain strings compared exactly. A worker's `topology_domains` do not become
//! `dynamo.topology/{domain}={value}` taints (Dynamo 1.6.1's selection service does not turn
//! them into any either), so a caller's taint with that prefix matches only a worker that lists
//! it literally.

use super::{WorkerRecord, WorkerSpec};
use std::collections::{BTreeMap, BTreeSet};

/// A request's taint constraints.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingConstraints {
    /// Taints a worker must all carry to be a candidate.
    pub required_taints: BTreeSet<String>,
    /// Taint → signed weight: positive prefers the workers that carry it, negative avoids them.
    pub preferred_taints: BTreeMap<String, f32>,
}

impl RoutingConstraints {
    /// Whether the constraints change nothing (no taint named).
    pub fn is_empty(&self) -> bool {
        self.required_taints.is_empty() && self.preferred_taints.is_empty()
    }

    /// Whether a worker carries every required taint.
    pub fn admits(&self, worker: &WorkerSpec) -> bool {
        self.required_taints.is_subset(&worker.taints)
    }

    /// The factor of a worker's cost: `exp(−tanh(s))`, `s` the summed weights of the preferred
    /// taints it carries; exactly 1 without preferred taints.
    pub fn cost_multiplier(&self, worker: &WorkerSpec) -> f64 {
        if self.preferred_taints.is_empty() {
            return 1.0;
        }
        let sum: f64 = self
            .preferred_taints
            .iter()
            .filter(|(taint, _)| worker.taints.contains(*taint))
            .map(|(_, &weight)| f64::from(weight))
            .sum();
        if sum.is_nan() {
            return 1.0;
        }
        (-sum.tanh()).exp()
    }
}

/// Drops the workers that lack a required taint (none without constraints).
pub(super) fn retain_admitted(
    workers: &mut Vec<&WorkerRecord>,
    constraints: Option<&RoutingConstraints>,
) {
    if let Some(c) = constraints.filter(|c| !c.required_taints.is_empty()) {
        workers.retain(|record| c.admits(&record.spec));
    }
}

/// The factor of a worker's cost under the constraints (1 without them).
pub(super) fn cost_multiplier(
    constraints: Option<&RoutingConstraints>,
    record: &WorkerRecord,
) -> f64 {
    constraints.map_or(1.0, |c| c.cost_multiplier(&record.spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(taints: &[&str]) -> WorkerSpec {
        WorkerSpec {
            taints: taints.iter().map(|t| t.to_string()).collect(),
            ..WorkerSpec::default()
        }
    }

    fn preferring(weights: &[(&str, f32)]) -> RoutingConstraints {
        RoutingConstraints {
            preferred_taints: weights.iter().map(|&(t, w)| (t.to_string(), w)).collect(),
            ..RoutingConstraints::default()
        }
    }

    #[test]
    fn a_worker_must_carry_every_required_taint() {
        let c = RoutingConstraints {
            required_taints: ["gpu=h100", "pref"].map(String::from).into(),
            ..RoutingConstraints::default()
        };
        assert!(c.admits(&worker(&["pref", "gpu=h100", "extra"])));
        assert!(!c.admits(&worker(&["gpu=h100"])));
        assert!(!c.admits(&worker(&[])));
        assert!(RoutingConstraints::default().admits(&worker(&[])));
        // Matched literally: no prefix, case or topology magic.
        let topology = RoutingConstraints {
            required_taints: ["dynamo.topology/zone=a".to_string()].into(),
            ..RoutingConstraints::default()
        };
        let mut zoned = worker(&["Dynamo.topology/zone=a"]);
        zoned.topology_domains.insert("zone".into(), "a".into());
        assert!(!topology.admits(&zoned));
    }

    #[test]
    fn preferences_multiply_the_cost_by_exp_of_minus_tanh_of_their_sum() {
        let w = worker(&["pref", "gpu=h100"]);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert_eq!(RoutingConstraints::default().cost_multiplier(&w), 1.0);
        assert_eq!(preferring(&[("nope", 5.0)]).cost_multiplier(&w), 1.0);
        assert_eq!(preferring(&[("pref", 0.0)]).cost_multiplier(&w), 1.0);
        assert!(close(
            preferring(&[("pref", 1.0)]).cost_multiplier(&w),
            (-1f64.tanh()).exp()
        ));
        // Summed over the matching taints, the others ignored.
        assert!(close(
            preferring(&[("pref", 0.5), ("gpu=h100", 0.25), ("other", 9.0)]).cost_multiplier(&w),
            (-0.75f64.tanh()).exp()
        ));
        // Opposite weights cancel; equal and opposite sums are reciprocal.
        assert_eq!(
            preferring(&[("pref", 5.0), ("gpu=h100", -5.0)]).cost_multiplier(&w),
            1.0
        );
        let up = preferring(&[("pref", 0.7)]).cost_multiplier(&w);
        let down = preferring(&[("pref", -0.7)]).cost_multiplier(&w);
        assert!(close(up * down, 1.0));
        // Bounded by e^-1 and e, also for infinite weights (1e39 is infinite as an f32).
        assert!(close(
            preferring(&[("pref", f32::INFINITY)]).cost_multiplier(&w),
            (-1f64).exp()
        ));
        assert!(close(
            preferring(&[("pref", f32::NEG_INFINITY)]).cost_multiplier(&w),
            1f64.exp()
        ));
        assert_eq!(
            preferring(&[("pref", f32::INFINITY), ("gpu=h100", f32::NEG_INFINITY)])
                .cost_multiplier(&w),
            1.0
        );
    }

    /// The switch points Dynamo 1.6.1 recorded (`constraints.json`): a worker holding 16 of a
    /// 17-token prompt costs 5.25 under Dynamo's weights, one holding nothing 9.25; the second
    /// wins once its multiplier drops below 5.25 / 9.25, or the first's rises above the inverse.
    #[test]
    fn the_recorded_switch_points_fall_where_dynamo_put_them() {
        let (cached, cold) = (0.25 + 5.0, 4.25 + 5.0);
        let w = worker(&["pref"]);
        let cold_wins =
            |weight: f32| cold * preferring(&[("pref", weight)]).cost_multiplier(&w) < cached;
        let cached_loses =
            |weight: f32| cached * preferring(&[("pref", weight)]).cost_multiplier(&w) > cold;
        assert!(!cold_wins(0.5));
        assert!(cold_wins(1.0));
        assert!(cold_wins(5.0));
        assert!(!cached_loses(-0.5));
        assert!(cached_loses(-1.0));
    }
}
