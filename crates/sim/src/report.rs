//! Reports: per-policy figures as a JSON document, a text table and an SVG chart.
//!
//! - `prefix_hit_rate`: prompt tokens served from the engines' prefix caches (at each request's
//!   first admission; only full blocks can hit) ÷ all prompt tokens of completed requests.
//! - `ttft_ms`, `e2e_ms`: time to first token and end-to-end latency from arrival, virtual
//!   milliseconds; percentiles by nearest rank.
//! - `throughput_rps`: completed requests ÷ (last completion − first arrival).
//! - Imbalance, each max ÷ mean over the workers (1.0 is perfectly even; the worst is the number
//!   of workers, everything on one):
//!   - `load_imbalance` (`imbalance` in the table): of the workers' busy time (time in steps);
//!   - `request_imbalance` (`req imb`): of the requests routed to each worker;
//!   - `prefill_imbalance` (`pf imb`): of the prompt tokens each worker had to compute (prompt −
//!     cached at first admission, completed requests), the load a cache-aware router piles up
//!     when it herds requests onto the holder of a prefix.
//! - `preemptions`: requests the engines evicted from their running batch for lack of KV blocks.
//! - `decision_quality`: Σ over routed requests of the prefix the chosen engine held
//!   cached at the request's arrival ÷ Σ of the longest prefix any engine held then (every engine
//!   is a candidate in the simulator), from the engines' real caches, so it is known for every
//!   policy. 1.0 when no engine ever held any of the prompts (nothing better was on offer).
//! - `selector_decision_quality`: the same ratio as the selector's own index saw it at each
//!   selection — what the service's `kvroute_selection_overlap_tokens_total{kind="chosen"}` ÷
//!   `{kind="best"}` would show for this policy (with its predicted blocks and event lag).
//!   Selector-backed policies only; `null` (`—` in the table) for the others, which keep no index
//!   of the engines' caches.
//!
//! Every number is a function of the run alone (no wall-clock time), so the same seed gives a
//! byte-identical JSON document.

use crate::SimError;
use crate::policy::OverlapTotals;
use crate::sim::{DEFAULT_TTFT_TARGET, PolicyRun, RequestOutcome, Shed, SimConfig};
use crate::workload::Workload;
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;
use std::time::Duration;

/// Latency summary, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct LatencyStats {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// Where the mean time to first token went, milliseconds (the three add up to the TTFT mean of
/// the requests that produced a first token).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct TtftParts {
    /// The rest of the step the chosen engine was running when the request arrived: no queue
    /// and no policy avoids it on that engine (0 when it was idle).
    pub step_in_flight: f64,
    /// Waiting behind other requests beyond that step, until the request was first admitted.
    pub queued: f64,
    /// From the start of its first step to its first token: its own prefill (the uncached
    /// tokens, in chunks) in steps shared with the engine's other work.
    pub prefill: f64,
}

/// One policy's line of the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    pub name: String,
    pub prefix_hit_rate: f64,
    pub ttft_ms: LatencyStats,
    pub ttft_parts_ms: TtftParts,
    pub e2e_ms: LatencyStats,
    pub throughput_rps: f64,
    pub load_imbalance: f64,
    pub request_imbalance: f64,
    pub prefill_imbalance: f64,
    pub preemptions: u64,
    pub decision_quality: f64,
    pub chosen_overlap_tokens: u64,
    pub best_overlap_tokens: u64,
    pub selector_decision_quality: Option<f64>,
    pub completed: u64,
    pub rejected: u64,
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
    pub evicted_blocks: u64,
    /// Events the router's index could not apply (a simulator bug when non-zero).
    pub index_parent_not_found: u64,
    /// The router-side queue (admission control): requests dropped because it was full...
    pub shed_queue_full: u64,
    /// ...or because they waited too long...
    pub shed_timed_out: u64,
    /// ...and the wait of the routed ones, ms (0 for those routed at arrival).
    pub queue_wait_ms: LatencyStats,
    /// Requests (of all that fit an engine) whose TTFT met the target, and their share.
    pub goodput_requests: u64,
    pub goodput_share: f64,
    /// Per tenant, when the workload has more than one.
    pub tenants: Vec<TenantReport>,
    /// Jain's fairness index of the tenants' goodput, in requests that met the target (1: equal;
    /// the simulator's tenants have equal weights), `null` for one tenant.
    pub tenant_fairness: Option<f64>,
}

/// The queue's settings as the report states them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueSettings {
    pub threshold: f64,
    pub policy: String,
    pub max_requests: usize,
    pub timeout_ms: Option<f64>,
}

/// One tenant's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantReport {
    pub tenant: String,
    pub requests: u64,
    pub goodput_share: f64,
    pub ttft_ms: LatencyStats,
    /// The router-side queue's wait of its routed requests.
    pub queue_wait_ms: LatencyStats,
    pub shed: u64,
}

/// Jain's fairness index of `values`: (Σx)² ÷ (n·Σx²), 1 when all are equal (or all 0).
pub fn jain_index(values: &[f64]) -> f64 {
    let sum: f64 = values.iter().sum();
    let squares: f64 = values.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        1.0
    } else {
        round(sum * sum / (values.len() as f64 * squares), 6)
    }
}

/// Goodput, per-tenant figures and queue waits of a run (`target`: the TTFT that counts).
fn queue_figures(run: &PolicyRun, target: Duration) -> (u64, f64, Vec<TenantReport>, Option<f64>) {
    let target_nanos = u64::try_from(target.as_nanos()).unwrap_or(u64::MAX);
    let good = |r: &RequestOutcome| {
        r.first_token
            .is_some_and(|f| f.saturating_sub(r.arrival) <= target_nanos)
    };
    let eligible: Vec<&RequestOutcome> = run.requests.iter().filter(|r| !r.rejected).collect();
    let good_count = eligible.iter().filter(|r| good(r)).count() as u64;
    let share = |good: u64, n: usize| {
        if n == 0 {
            0.0
        } else {
            round(good as f64 / n as f64, 6)
        }
    };
    let mut by_tenant: std::collections::BTreeMap<String, Vec<&RequestOutcome>> =
        std::collections::BTreeMap::new();
    for r in &eligible {
        by_tenant
            .entry(crate::sim::tenant_name(r.tenant))
            .or_default()
            .push(r);
    }
    let tenants: Vec<TenantReport> = if by_tenant.len() > 1 {
        by_tenant
            .into_iter()
            .map(|(tenant, rs)| {
                let mut ttfts: Vec<f64> = rs
                    .iter()
                    .filter_map(|r| {
                        r.first_token
                            .map(|f| f.saturating_sub(r.arrival) as f64 / 1e6)
                    })
                    .collect();
                ttfts.sort_by(f64::total_cmp);
                let mut waits: Vec<f64> = rs
                    .iter()
                    .filter(|r| r.worker.is_some())
                    .map(|r| r.queued as f64 / 1e6)
                    .collect();
                waits.sort_by(f64::total_cmp);
                TenantReport {
                    queue_wait_ms: stats(waits),
                    requests: rs.len() as u64,
                    goodput_share: share(rs.iter().filter(|r| good(r)).count() as u64, rs.len()),
                    ttft_ms: stats(ttfts),
                    shed: rs.iter().filter(|r| r.shed.is_some()).count() as u64,
                    tenant,
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    // Of the tenants' good requests (equal weights: each is owed the same goodput).
    let fairness = (!tenants.is_empty()).then(|| {
        jain_index(
            &tenants
                .iter()
                .map(|t| t.goodput_share * t.requests as f64)
                .collect::<Vec<_>>(),
        )
    });
    (
        good_count,
        share(good_count, eligible.len()),
        tenants,
        fairness,
    )
}

/// A policy that was asked for but cannot run, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UnavailablePolicy {
    pub name: String,
    pub reason: String,
}

/// The whole report (`report.json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub trace: String,
    pub workers: usize,
    pub requests: usize,
    pub block_size: u32,
    /// KV blocks per worker, `null` when unlimited.
    pub kv_blocks: Option<u64>,
    pub speedup: f64,
    pub event_delay_ms: f64,
    /// Routers of each policy (`--router-replicas`) and how late they hear of each other's
    /// bookings.
    pub router_replicas: usize,
    pub sync_delay_ms: f64,
    pub seed: u64,
    /// The router-side queue (admission control), when on.
    pub queue: Option<QueueSettings>,
    /// The TTFT a request must meet to count toward goodput.
    pub ttft_target_ms: f64,
    /// A lower bound of every policy's TTFT ([`ideal_ttft`])...
    pub ideal_ttft_ms: LatencyStats,
    /// ...and the hit rate of its cache, which no policy's exceeds by more than the cache an
    /// evicted-then-recomputed block can add.
    pub ideal_hit_rate: f64,
    pub policies: Vec<PolicyReport>,
    pub unavailable: Vec<UnavailablePolicy>,
}

/// Rounds to `digits` decimals (keeps the JSON readable; deterministic).
fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    let r = (x * scale).round() / scale;
    if r.is_finite() { r } else { 0.0 }
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn stats(mut values: Vec<f64>) -> LatencyStats {
    if values.is_empty() {
        return LatencyStats::default();
    }
    values.sort_by(f64::total_cmp);
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    LatencyStats {
        mean: round(mean, 3),
        p50: round(percentile(&values, 50.0), 3),
        p90: round(percentile(&values, 90.0), 3),
        p99: round(percentile(&values, 99.0), 3),
        max: round(values[values.len() - 1], 3),
    }
}

/// Σ chosen ÷ Σ best overlap, 1.0 when `best` is 0 (no rank ever held anything, so every
/// choice was as good as any).
pub fn decision_quality(totals: OverlapTotals) -> f64 {
    if totals.best_tokens == 0 {
        1.0
    } else {
        round(totals.chosen_tokens as f64 / totals.best_tokens as f64, 6)
    }
}

/// Max ÷ mean of per-worker values, 1.0 when all are 0.
pub fn imbalance(values: &[f64]) -> f64 {
    let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
    let max = values.iter().copied().fold(0.0, f64::max);
    if mean > 0.0 {
        round(max / mean, 4)
    } else {
        1.0
    }
}

/// Time to first token of every completed request, milliseconds, sorted.
pub fn ttfts_ms(run: &PolicyRun) -> Vec<f64> {
    let mut v: Vec<f64> = run
        .requests
        .iter()
        .filter_map(|r| {
            r.first_token
                .map(|t| t.saturating_sub(r.arrival) as f64 / 1e6)
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v
}

/// The mean TTFT of a run split into its parts ([`TtftParts`]).
pub fn ttft_parts(run: &PolicyRun) -> TtftParts {
    let mut sums = [0u64; 3];
    let mut n = 0u64;
    for r in &run.requests {
        let (Some(admitted), Some(first)) = (r.admitted, r.first_token) else {
            continue;
        };
        let waited = admitted.saturating_sub(r.arrival);
        let in_flight = r.step_in_flight_wait.min(waited);
        sums[0] += in_flight;
        sums[1] += waited - in_flight;
        sums[2] += first.saturating_sub(admitted);
        n += 1;
    }
    let mean = |x: u64| {
        if n == 0 {
            0.0
        } else {
            round(x as f64 / n as f64 / 1e6, 3)
        }
    };
    TtftParts {
        step_in_flight: mean(sums[0]),
        queued: mean(sums[1]),
        prefill: mean(sums[2]),
    }
}

/// A lower bound of the time to first token of each request under any policy, milliseconds,
/// sorted: the request alone on an idle engine that holds every prompt block of every request
/// that arrived before it (one unlimited cache shared by the fleet, blocks counted as cached
/// even before they are computed), computing the rest in the fewest, evenly sized chunks the
/// step budget allows, with no decode in its steps and no step in flight at arrival. What a
/// policy loses against it is queueing, steps shared with other work, and cache it missed.
/// Also returns the prefix hit rate of that cache (prompt tokens served from it ÷ all).
pub fn ideal_ttft(workload: &Workload, config: &SimConfig) -> (Vec<f64>, f64) {
    let engine = &config.engine;
    let block_size = u64::from(engine.block_size);
    let budget = engine.max_num_batched_tokens.max(1);
    let mut seen = hashbrown::HashSet::new();
    let mut out: Vec<f64> = Vec::with_capacity(workload.requests.len());
    let (mut hit_tokens, mut prompt_tokens) = (0u64, 0u64);
    for r in &workload.requests {
        if !engine.fits(r) {
            continue;
        }
        let prompt = &r.prompt;
        let max_hit = (prompt.isl_tokens.saturating_sub(1) / block_size.max(1)) as usize;
        let hit = prompt
            .sequence
            .iter()
            .take(max_hit)
            .take_while(|h| seen.contains(*h))
            .count() as u64;
        seen.extend(prompt.sequence.iter().copied());
        let uncached = prompt.isl_tokens.saturating_sub(hit * block_size).max(1);
        hit_tokens += prompt.isl_tokens - uncached;
        prompt_tokens += prompt.isl_tokens;
        let chunks = uncached.div_ceil(budget);
        let ms: f64 = (0..chunks)
            .map(|i| {
                // `uncached` split as evenly as whole tokens allow.
                let size = uncached / chunks + u64::from(i < uncached % chunks);
                engine.timing.prefill_ms(size)
            })
            .sum();
        out.push(ms / engine.timing.speedup);
    }
    out.sort_by(f64::total_cmp);
    let hit_rate = if prompt_tokens == 0 {
        0.0
    } else {
        round(hit_tokens as f64 / prompt_tokens as f64, 6)
    };
    (out, hit_rate)
}

/// Summarises one run, goodput against [`DEFAULT_TTFT_TARGET`].
pub fn summarize(run: &PolicyRun) -> PolicyReport {
    summarize_with(run, DEFAULT_TTFT_TARGET)
}

/// Summarises one run; a request counts toward goodput when its TTFT is at most `ttft_target`.
pub fn summarize_with(run: &PolicyRun, ttft_target: Duration) -> PolicyReport {
    let (goodput_requests, goodput_share, tenants, tenant_fairness) =
        queue_figures(run, ttft_target);
    let mut waits: Vec<f64> = run
        .requests
        .iter()
        .filter(|r| r.worker.is_some())
        .map(|r| r.queued as f64 / 1e6)
        .collect();
    waits.sort_by(f64::total_cmp);
    let completed: Vec<_> = run
        .requests
        .iter()
        .filter(|r| r.finished.is_some())
        .collect();
    let cached_tokens: u64 = completed.iter().map(|r| r.cached_tokens).sum();
    let prompt_tokens: u64 = completed.iter().map(|r| r.prompt_tokens).sum();
    let e2e = completed
        .iter()
        .filter_map(|r| r.finished.map(|f| f.saturating_sub(r.arrival) as f64 / 1e6))
        .collect();
    let first_arrival = run.requests.iter().map(|r| r.arrival).min().unwrap_or(0);
    let last_finish = completed
        .iter()
        .filter_map(|r| r.finished)
        .max()
        .unwrap_or(0);
    let span_secs = last_finish.saturating_sub(first_arrival) as f64 / 1e9;
    let real = OverlapTotals {
        chosen_tokens: run.requests.iter().map(|r| r.chosen_overlap_tokens).sum(),
        best_tokens: run.requests.iter().map(|r| r.best_overlap_tokens).sum(),
    };
    let busy: Vec<f64> = run.engines.iter().map(|e| e.busy_nanos as f64).collect();
    let mut routed = vec![0.0f64; run.engines.len()];
    let mut prefill = vec![0.0f64; run.engines.len()];
    for r in &run.requests {
        if let Some(w) = r.worker.and_then(|w| usize::try_from(w).ok())
            && w < routed.len()
        {
            routed[w] += 1.0;
            if r.finished.is_some() {
                prefill[w] += r.prompt_tokens.saturating_sub(r.cached_tokens) as f64;
            }
        }
    }
    PolicyReport {
        name: run.policy.clone(),
        prefix_hit_rate: if prompt_tokens == 0 {
            0.0
        } else {
            round(cached_tokens as f64 / prompt_tokens as f64, 6)
        },
        ttft_ms: stats(ttfts_ms(run)),
        ttft_parts_ms: ttft_parts(run),
        e2e_ms: stats(e2e),
        throughput_rps: if span_secs > 0.0 {
            round(completed.len() as f64 / span_secs, 4)
        } else {
            0.0
        },
        load_imbalance: imbalance(&busy),
        request_imbalance: imbalance(&routed),
        prefill_imbalance: imbalance(&prefill),
        preemptions: run.engines.iter().map(|e| e.preemptions).sum(),
        decision_quality: decision_quality(real),
        chosen_overlap_tokens: real.chosen_tokens,
        best_overlap_tokens: real.best_tokens,
        selector_decision_quality: run.selector_overlap.map(decision_quality),
        completed: completed.len() as u64,
        rejected: run.requests.iter().filter(|r| r.rejected).count() as u64,
        cached_tokens,
        prompt_tokens,
        evicted_blocks: run.engines.iter().map(|e| e.pool.evicted_blocks).sum(),
        index_parent_not_found: run.router.parent_block_not_found,
        shed_queue_full: count_shed(run, Shed::QueueFull),
        shed_timed_out: count_shed(run, Shed::TimedOut),
        queue_wait_ms: stats(waits),
        goodput_requests,
        goodput_share,
        tenants,
        tenant_fairness,
    }
}

fn count_shed(run: &PolicyRun, why: Shed) -> u64 {
    run.requests.iter().filter(|r| r.shed == Some(why)).count() as u64
}

/// Builds the report of a set of runs.
pub fn build_report(
    workload: &Workload,
    config: &SimConfig,
    runs: &[PolicyRun],
    unavailable: Vec<UnavailablePolicy>,
) -> Report {
    let ideal = ideal_ttft(workload, config);
    Report {
        trace: workload.name.clone(),
        workers: config.workers,
        requests: workload.requests.len(),
        block_size: config.engine.block_size,
        kv_blocks: config.engine.kv_blocks,
        speedup: config.engine.timing.speedup,
        event_delay_ms: round(config.event_delay.as_secs_f64() * 1e3, 6),
        router_replicas: config.router_replicas,
        sync_delay_ms: round(config.sync_delay.as_secs_f64() * 1e3, 6),
        seed: config.seed,
        queue: config.queue.map(|q| QueueSettings {
            threshold: q.threshold,
            policy: q.policy.to_string(),
            max_requests: q.max_requests,
            timeout_ms: q.timeout.map(|t| round(t.as_secs_f64() * 1e3, 3)),
        }),
        ttft_target_ms: round(config.ttft_target.as_secs_f64() * 1e3, 3),
        ideal_ttft_ms: stats(ideal.0),
        ideal_hit_rate: ideal.1,
        policies: runs
            .iter()
            .map(|run| summarize_with(run, config.ttft_target))
            .collect(),
        unavailable,
    }
}

impl Report {
    /// The JSON document, pretty-printed, with a trailing newline.
    pub fn to_json(&self) -> Result<String, SimError> {
        let mut s = serde_json::to_string_pretty(self)
            .map_err(|e| SimError::Internal(format!("cannot serialise the report: {e}")))?;
        s.push('\n');
        Ok(s)
    }

    /// A fixed-width text table, one line per policy, then a line per unavailable policy.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "{:<20} {:>8} {:>7} {:>8} {:>10} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>8} {:>9} {:>7} {:>7} {:>8}\n",
            "policy",
            "hit rate",
            "quality",
            "sel qual",
            "TTFT mean",
            "TTFT p50",
            "TTFT p90",
            "TTFT p99",
            "E2E mean",
            "E2E p50",
            "E2E p99",
            "req/s",
            "imbalance",
            "req imb",
            "pf imb",
            "preempt"
        ));
        for p in &self.policies {
            let selector_quality = p
                .selector_decision_quality
                .map_or_else(|| "—".to_string(), |q| format!("{q:.3}"));
            out.push_str(&format!(
                "{:<20} {:>7.2}% {:>7.3} {:>8} {:>8.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>8.2} {:>9.3} {:>7.3} {:>7.3} {:>8}\n",
                p.name,
                p.prefix_hit_rate * 100.0,
                p.decision_quality,
                selector_quality,
                p.ttft_ms.mean,
                p.ttft_ms.p50,
                p.ttft_ms.p90,
                p.ttft_ms.p99,
                p.e2e_ms.mean,
                p.e2e_ms.p50,
                p.e2e_ms.p99,
                p.throughput_rps,
                p.load_imbalance,
                p.request_imbalance,
                p.prefill_imbalance,
                p.preemptions
            ));
        }
        for u in &self.unavailable {
            out.push_str(&format!("{:<20} unavailable: {}\n", u.name, u.reason));
        }
        let ideal = self.ideal_ttft_ms;
        out.push_str(&format!(
            "{:<20} {:>7.2}% {:>7} {:>8} {:>8.1}ms {:>7.1}ms {:>7.1}ms {:>7.1}ms   (a bound for any policy: one shared unlimited cache, an idle engine)\n",
            "ideal", self.ideal_hit_rate * 100.0, "", "", ideal.mean, ideal.p50, ideal.p90, ideal.p99
        ));
        out.push_str(&format!(
            "\n{:<20} {:>12} {:>9} {:>9}   (mean TTFT, ms: the chosen engine's step in flight at arrival + queued behind others + own prefill)\n",
            "policy", "step in flight", "queued", "prefill"
        ));
        for p in &self.policies {
            let t = p.ttft_parts_ms;
            out.push_str(&format!(
                "{:<20} {:>12.1}ms {:>7.1}ms {:>7.1}ms\n",
                p.name, t.step_in_flight, t.queued, t.prefill
            ));
        }
        let queue = self.queue.as_ref().map_or_else(
            || "no router queue".to_string(),
            |q| {
                format!(
                    "router queue: threshold {} × max_num_batched_tokens, {}, at most {}{}",
                    q.threshold,
                    q.policy,
                    q.max_requests,
                    q.timeout_ms
                        .map_or_else(String::new, |t| format!(", timeout {t} ms"))
                )
            },
        );
        out.push_str(&format!(
            "\n{:<20} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8}   ({queue}; goodput: TTFT ≤ {} ms)\n",
            "policy",
            "queued mean",
            "queued p99",
            "shed full",
            "timed out",
            "goodput",
            "fairness",
            self.ttft_target_ms
        ));
        for p in &self.policies {
            out.push_str(&format!(
                "{:<20} {:>9.1}ms {:>8.1}ms {:>9} {:>9} {:>8.2}% {:>8}\n",
                p.name,
                p.queue_wait_ms.mean,
                p.queue_wait_ms.p99,
                p.shed_queue_full,
                p.shed_timed_out,
                p.goodput_share * 100.0,
                p.tenant_fairness
                    .map_or_else(|| "—".to_string(), |f| format!("{f:.3}"))
            ));
            for t in &p.tenants {
                out.push_str(&format!(
                    "  {:<18} {:>6} requests, goodput {:>6.2}%, TTFT p99 {:>8.1}ms, queued mean {:.1}ms p99 {:.1}ms, shed {}\n",
                    t.tenant,
                    t.requests,
                    t.goodput_share * 100.0,
                    t.ttft_ms.p99,
                    t.queue_wait_ms.mean,
                    t.queue_wait_ms.p99,
                    t.shed
                ));
            }
        }
        out
    }
}

fn plot_error(e: impl std::fmt::Display) -> SimError {
    SimError::Plot(e.to_string())
}

/// Draws the TTFT CDF of each run (log scale) and a bar per policy of its prefix hit rate, as an
/// SVG document.
pub fn render_svg(report: &Report, runs: &[PolicyRun]) -> Result<String, SimError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1280, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let (left, right) = root.split_horizontally(800);
        draw_cdf(&left, report, runs)?;
        draw_hit_rates(&right, report)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

fn draw_cdf(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    report: &Report,
    runs: &[PolicyRun],
) -> Result<(), SimError> {
    let curves: Vec<(String, Vec<f64>)> = runs
        .iter()
        .map(|r| (r.policy.clone(), ttfts_ms(r)))
        .collect();
    let positive = |v: &f64| *v > 0.0;
    let min = curves
        .iter()
        .filter_map(|(_, v)| v.iter().copied().find(positive))
        .fold(f64::INFINITY, f64::min);
    let max = curves
        .iter()
        .filter_map(|(_, v)| v.last().copied())
        .fold(0.0, f64::max);
    let (lo, hi) = if min.is_finite() && max > min {
        (min * 0.9, max * 1.1)
    } else {
        (1.0, 10.0)
    };
    let caption = format!(
        "TTFT CDF — {} workers, {} requests",
        report.workers, report.requests
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(plot_error)?;
    for (i, (name, values)) in curves.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let n = values.len();
        // At most ~400 points per curve keeps the SVG small.
        let step = (n / 400).max(1);
        let points: Vec<(f64, f64)> = values
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k + 1 == n)
            .map(|(k, &v)| (v.max(lo), (k + 1) as f64 / n as f64))
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(plot_error)?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(plot_error)?;
    Ok(())
}

fn draw_hit_rates(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    report: &Report,
) -> Result<(), SimError> {
    let names: Vec<String> = report.policies.iter().map(|p| p.name.clone()).collect();
    // Integer ranges are inclusive in plotters: n policies are the segments 0..=n-1.
    let last = names.len().saturating_sub(1) as i32;
    let mut chart = ChartBuilder::on(area)
        .caption("prefix hit rate (prompt tokens)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(110)
        .build_cartesian_2d(0.0..1.0, (0..last).into_segmented())
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(names.len().max(1))
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => usize::try_from(*i)
                .ok()
                .and_then(|i| names.len().checked_sub(i + 1))
                .and_then(|i| names.get(i))
                .cloned()
                .unwrap_or_default(),
            _ => String::new(),
        })
        .x_desc("hit rate")
        .draw()
        .map_err(plot_error)?;
    chart
        .draw_series(report.policies.iter().enumerate().map(|(i, p)| {
            // The first policy on top, as in the table.
            let i = last - i as i32;
            let mut bar = Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(i)),
                    (p.prefix_hit_rate, SegmentValue::Exact(i + 1)),
                ],
                Palette99::pick((last - i) as usize).to_rgba().filled(),
            );
            bar.set_margin(4, 4, 0, 0);
            bar
        }))
        .map_err(plot_error)?;
    chart
        .draw_series(report.policies.iter().enumerate().map(|(i, p)| {
            Text::new(
                format!("{:.1} %", p.prefix_hit_rate * 100.0),
                (
                    p.prefix_hit_rate + 0.01,
                    SegmentValue::CenterOf(last - i as i32),
                ),
                ("sans-serif", 13),
            )
        }))
        .map_err(plot_error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 90.0), 90.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[7.0], 1.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        let s = stats(vec![3.0, 1.0, 2.0]);
        assert_eq!((s.mean, s.p50, s.max), (2.0, 2.0, 3.0));
    }

    #[test]
    fn decision_quality_is_chosen_over_best_and_1_when_nothing_was_cached() {
        let q = |chosen_tokens, best_tokens| {
            decision_quality(OverlapTotals {
                chosen_tokens,
                best_tokens,
            })
        };
        assert_eq!(q(0, 0), 1.0);
        assert_eq!(q(64, 64), 1.0);
        assert_eq!(q(0, 64), 0.0);
        assert_eq!(q(1, 3), 0.333333);
    }

    #[test]
    fn imbalance_is_max_over_mean() {
        assert_eq!(imbalance(&[1.0, 1.0, 1.0, 1.0]), 1.0);
        assert_eq!(imbalance(&[4.0, 0.0, 0.0, 0.0]), 4.0);
        assert_eq!(imbalance(&[3.0, 1.0]), 1.5);
        assert_eq!(imbalance(&[0.0, 0.0]), 1.0);
        assert_eq!(imbalance(&[]), 1.0);
    }

    #[test]
    fn the_table_shows_every_figure_of_issue_29() {
        use crate::sim::RequestOutcome;
        let outcome = |worker, arrival, first, finished, cached| RequestOutcome {
            worker: Some(worker),
            arrival,
            first_token: Some(first),
            finished: Some(finished),
            cached_tokens: cached,
            prompt_tokens: 100,
            ..RequestOutcome::default()
        };
        let run = PolicyRun {
            policy: "p".into(),
            requests: vec![
                outcome(0, 0, 10_000_000, 50_000_000, 0),
                outcome(0, 0, 20_000_000, 60_000_000, 100),
                outcome(1, 0, 30_000_000, 70_000_000, 50),
            ],
            engines: vec![Default::default(); 3],
            router: Default::default(),
            selector_overlap: None,
        };
        let p = summarize(&run);
        // Workers got 2, 1, 0 requests (mean 1) and computed 100, 50, 0 tokens (mean 50).
        assert_eq!(p.request_imbalance, 2.0);
        assert_eq!(p.prefill_imbalance, 2.0);
        assert_eq!(p.e2e_ms.mean, 60.0);
        assert_eq!(p.ttft_ms.mean, 20.0);
        let report = Report {
            trace: "t".into(),
            workers: 3,
            requests: 3,
            block_size: 64,
            kv_blocks: None,
            speedup: 1.0,
            event_delay_ms: 20.0,
            router_replicas: 1,
            sync_delay_ms: 5.0,
            seed: 0,
            queue: None,
            ttft_target_ms: 2000.0,
            ideal_ttft_ms: LatencyStats::default(),
            ideal_hit_rate: 0.0,
            policies: vec![p],
            unavailable: Vec::new(),
        };
        let table = report.to_table();
        let header = table.lines().next().unwrap();
        for column in [
            "hit rate",
            "quality",
            "TTFT mean",
            "TTFT p50",
            "TTFT p90",
            "TTFT p99",
            "E2E mean",
            "E2E p99",
            "imbalance",
            "req imb",
            "pf imb",
        ] {
            assert!(header.contains(column), "{column}: {header}");
        }
        assert!(table.lines().nth(1).unwrap().contains("60ms"), "{table}");
    }
}
