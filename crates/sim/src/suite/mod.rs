//! The workload suite (`kvroute sim --suite`): every policy on several traffic shapes, at 1×, 2×,
//! 4× and 8× load, with one and two router replicas, under both engine models, then one summary
//! of how far each policy is from the best one of each cell.
//!
//! - A **shape** ([`Shape`]) generates a workload at 1× load: a load at which the fleet is
//!   moderately used (round robin keeps engines well below saturation, nothing is preempted).
//!   [`shape_workload`] makes it `load`× by dividing every arrival time by `load`, so the requests
//!   stay the same and only the arrival rate changes. Each shape lives in one file of this folder
//!   and is listed once in [`shapes`]; adding a shape is one new file and one line there.
//! - A **cell** is (engine model, shape, load, router replicas); every policy runs in every cell
//!   on the same workload ([`run_suite`]), jobs spread over threads, results in a fixed order.
//! - The **summary** ([`summary`]) divides each policy's TTFT mean, TTFT p99 and E2E p99 by the
//!   best policy's in the cell and reports the worst ratio and the geometric mean over the cells,
//!   then checks the `kvroute` policy's targets.
//!
//! Runs are bounded: each shape caps its requests (≤ [`MAX_REQUESTS`]), so a full suite takes a
//! few minutes in a release build.

use crate::SimError;
use crate::policy::Policy;
use crate::report::build_report;
use crate::sim::{SimConfig, run_policy};
use crate::timing::{EngineModel, Nanos};
use crate::workload::{SimRequest, Workload, mix64, push_segment};
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

mod agentic;
mod conversation;
mod hot_prompts;
mod long_docs;
mod no_reuse;
mod small_groups;
pub mod summary;
mod trace;

pub use summary::{
    CellFigures, CellResult, EngineSummary, Metric, PolicyScore, SuiteReport, TargetCheck,
};
pub use trace::TraceShape;

/// Most requests a shape generates: bounds each run's time.
pub const MAX_REQUESTS: usize = 1_000;

/// The loads the suite runs unless told otherwise.
pub const DEFAULT_LOADS: [f64; 4] = [1.0, 2.0, 4.0, 8.0];

/// The policies the suite compares unless told otherwise; the last one is judged against the
/// others ([`summary::TargetCheck`]).
pub const DEFAULT_POLICIES: &str = "round_robin,least_loaded,cache_aware,dynamo,kvroute";

/// A traffic shape of the suite.
pub trait Shape: Send + Sync {
    /// Short name, used by `--suite-shapes` and in the tables (`[a-z_]+`).
    fn name(&self) -> &str;
    /// One line: what the traffic is.
    fn description(&self) -> String;
    /// The requests at 1× load, in arrival order, hashed with `block_size`-token blocks; the same
    /// seed gives the same requests. At most [`MAX_REQUESTS`].
    fn generate(&self, seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError>;
}

/// Every built-in shape, in the order the suite runs them. Add a shape here.
pub fn shapes() -> Vec<Box<dyn Shape>> {
    vec![
        Box::new(conversation::Conversation),
        Box::new(agentic::Agentic),
        Box::new(hot_prompts::HotPrompts),
        Box::new(small_groups::SmallGroups),
        Box::new(long_docs::LongDocs),
        Box::new(no_reuse::NoReuse),
    ]
}

/// The workload of `shape` at `load`× its 1× arrival rate.
pub fn shape_workload(
    shape: &dyn Shape,
    load: f64,
    seed: u64,
    block_size: u32,
) -> Result<Workload, SimError> {
    if !(load.is_finite() && load > 0.0) {
        return Err(SimError::invalid(
            "suite-loads",
            format!("a load must be a positive number, got {load}"),
        ));
    }
    if block_size == 0 {
        return Err(SimError::invalid("block-size", "must be greater than 0"));
    }
    let mut requests = shape.generate(seed, block_size)?;
    requests.truncate(MAX_REQUESTS);
    for r in &mut requests {
        r.arrival_nanos = (r.arrival_nanos as f64 / load).round() as Nanos;
    }
    Ok(Workload {
        name: format!("{} at {load}x", shape.name()),
        block_size,
        requests,
    })
}

/// Random draws and prompt building for shape generators: one seeded stream per shape and seed.
pub struct ShapeRng {
    rng: SmallRng,
    shape_key: u64,
}

impl ShapeRng {
    /// A stream for `shape` (its name keys the stream and the prompt segments) and `seed`.
    pub fn new(shape: &str, seed: u64) -> Self {
        let shape_key = shape.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        Self {
            rng: SmallRng::seed_from_u64(mix64(shape_key ^ mix64(seed))),
            shape_key,
        }
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random()
    }

    /// Uniform integer in `lo..=hi`.
    pub fn between(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            lo
        } else {
            self.rng.random_range(lo..=hi)
        }
    }

    /// Exponential with mean `mean` (Poisson inter-arrival gaps, think times).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -(1.0 - self.uniform()).ln() * mean
    }

    /// Log-normal with median `median` and log-space deviation `sigma`, rounded and clamped to
    /// `min..=max`: the long-tailed lengths of real prompts and outputs.
    pub fn lognormal(&mut self, median: f64, sigma: f64, min: usize, max: usize) -> usize {
        // Box–Muller: a standard normal from two uniforms.
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let x = (median * (sigma * z).exp()).round();
        if x.is_finite() {
            (x.max(0.0) as usize).clamp(min, max)
        } else {
            max
        }
    }

    /// A Zipf-distributed rank in `0..n` (rank `k` has weight `1 / (k + 1)^s`).
    pub fn zipf(&mut self, n: usize, s: f64) -> usize {
        let weights: Vec<f64> = (0..n).map(|k| ((k + 1) as f64).powf(-s)).collect();
        let total: f64 = weights.iter().sum();
        let mut x = self.uniform() * total;
        for (k, w) in weights.iter().enumerate() {
            if x < *w {
                return k;
            }
            x -= w;
        }
        n.saturating_sub(1)
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.rng.random_range(0..=i);
            items.swap(i, j);
        }
    }

    /// Appends `len` tokens of the segment `(kind, id)`: equal segments give equal tokens, so
    /// prompts that share segments share their prefix blocks.
    pub fn push_segment(&self, tokens: &mut Vec<u32>, kind: u64, id: u64, len: usize) {
        push_segment(tokens, mix64(self.shape_key ^ mix64(kind << 48 ^ id)), len);
    }
}

/// A request arriving `arrival_secs` after the start, with prompt `tokens`.
pub fn request(
    arrival_secs: f64,
    tokens: &[u32],
    output_tokens: usize,
    session_id: Option<u64>,
    block_size: u32,
) -> SimRequest {
    SimRequest {
        arrival_nanos: (arrival_secs.max(0.0) * 1e9).round() as Nanos,
        prompt: PromptHashes::from_tokens(tokens, block_size as usize, BASE_SEED),
        output_tokens: output_tokens.max(1) as u64,
        session_id,
        tenant: None,
    }
}

/// Groups of prompts sharing a system prompt: `per_group` requests of each group (`g`'s system
/// prompt of `system_tokens[g]` tokens, then a question of its own of `question_tokens()`
/// tokens), groups interleaved at random, Poisson arrivals at `rate_rps`, log-normal outputs
/// (median 180 tokens).
pub fn grouped_prompts(
    rng: &mut ShapeRng,
    system_tokens: &[usize],
    per_group: usize,
    rate_rps: f64,
    mut question_tokens: impl FnMut(&mut ShapeRng) -> usize,
    block_size: u32,
) -> Vec<SimRequest> {
    const SYSTEM: u64 = 1;
    const QUESTION: u64 = 2;
    let mut order: Vec<usize> = (0..system_tokens.len())
        .flat_map(|g| std::iter::repeat_n(g, per_group))
        .collect();
    rng.shuffle(&mut order);
    let mut at = 0.0;
    let mut requests = Vec::with_capacity(order.len());
    for (i, &group) in order.iter().enumerate() {
        if i > 0 {
            at += rng.exponential(1.0 / rate_rps);
        }
        let mut tokens = Vec::new();
        rng.push_segment(&mut tokens, SYSTEM, group as u64, system_tokens[group]);
        let question = question_tokens(rng);
        rng.push_segment(&mut tokens, QUESTION, i as u64, question);
        let output = rng.lognormal(180.0, 0.9, 8, 2_048);
        requests.push(request(at, &tokens, output, None, block_size));
    }
    requests
}

/// Sorts requests by arrival (stable, so equal times keep their generation order) and keeps the
/// first `max`.
pub fn in_arrival_order(mut requests: Vec<SimRequest>, max: usize) -> Vec<SimRequest> {
    requests.sort_by_key(|r| r.arrival_nanos);
    requests.truncate(max);
    requests
}

/// One cell's coordinates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CellKey {
    /// Index into [`SuiteOptions::engines`].
    pub engine: usize,
    /// Index into [`SuiteOptions::shapes`].
    pub shape: usize,
    /// Index into [`SuiteOptions::loads`].
    pub load: usize,
    pub replicas: usize,
}

/// What the suite runs.
pub struct SuiteOptions {
    pub shapes: Vec<Box<dyn Shape>>,
    pub loads: Vec<f64>,
    pub replicas: Vec<usize>,
    pub engines: Vec<EngineModel>,
    pub policies: Vec<Policy>,
    /// Workers, engine, event and sync delays, seed: everything but the engine model and the
    /// replicas, which each cell sets.
    pub base: SimConfig,
}

impl SuiteOptions {
    /// The cells, engine model outermost, then shape, load, replicas.
    pub fn cells(&self) -> Vec<CellKey> {
        let mut cells = Vec::new();
        for engine in 0..self.engines.len() {
            for shape in 0..self.shapes.len() {
                for load in 0..self.loads.len() {
                    for &replicas in &self.replicas {
                        cells.push(CellKey {
                            engine,
                            shape,
                            load,
                            replicas,
                        });
                    }
                }
            }
        }
        cells
    }

    fn validate(&self) -> Result<(), SimError> {
        let empty = |knob, what: &str| Err(SimError::invalid(knob, format!("no {what} to run")));
        if self.shapes.is_empty() {
            return empty("suite-shapes", "shape");
        }
        if self.loads.is_empty() {
            return empty("suite-loads", "load");
        }
        if self.replicas.is_empty() {
            return empty("suite-replicas", "replica count");
        }
        if self.engines.is_empty() {
            return empty("suite-engines", "engine model");
        }
        if self.policies.is_empty() {
            return empty("policies", "policy");
        }
        for &replicas in &self.replicas {
            SimConfig {
                router_replicas: replicas,
                ..self.base
            }
            .validate()
            .map_err(|e| match e {
                SimError::Invalid { reason, .. } => SimError::invalid("suite-replicas", reason),
                other => other,
            })?;
        }
        Ok(())
    }
}

/// Runs every policy in every cell on up to `jobs` threads; `progress(done, total)` is called
/// after each run. The results are in [`SuiteOptions::cells`] order and do not depend on `jobs`.
/// `origin` is the `Instant` virtual time 0 maps to (never compared with the wall clock).
pub fn run_suite(
    options: &SuiteOptions,
    jobs: usize,
    origin: Instant,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Vec<CellResult>, SimError> {
    options.validate()?;
    let block_size = options.base.engine.block_size;
    let mut workloads = Vec::with_capacity(options.shapes.len() * options.loads.len());
    for shape in &options.shapes {
        for &load in &options.loads {
            workloads.push(shape_workload(
                shape.as_ref(),
                load,
                options.base.seed,
                block_size,
            )?);
        }
    }
    let cells = options.cells();
    let policies = &options.policies;
    let total = cells.len() * policies.len();
    let workload_of = |cell: &CellKey| &workloads[cell.shape * options.loads.len() + cell.load];
    let config_of = |cell: &CellKey| {
        let mut config = SimConfig {
            router_replicas: cell.replicas,
            ..options.base
        };
        config.engine.timing.engine_model = options.engines[cell.engine];
        config
    };
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<Result<CellFigures, SimError>>>> =
        Mutex::new((0..total).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, total.max(1)) {
            scope.spawn(|| {
                loop {
                    let job = next.fetch_add(1, Ordering::Relaxed);
                    if job >= total {
                        break;
                    }
                    let cell = &cells[job / policies.len()];
                    let policy = &policies[job % policies.len()];
                    let workload = workload_of(cell);
                    let config = config_of(cell);
                    let figures =
                        run_policy(workload, &config, policy, origin, &mut |_| {}).map(|run| {
                            let report = build_report(workload, &config, &[run], Vec::new());
                            CellFigures::from_report(&report.policies[0])
                        });
                    slots.lock().unwrap_or_else(|e| e.into_inner())[job] = Some(figures);
                    progress(done.fetch_add(1, Ordering::Relaxed) + 1, total);
                }
            });
        }
    });
    let mut slots = slots
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter();
    let mut results = Vec::with_capacity(cells.len());
    for cell in &cells {
        let mut figures = Vec::with_capacity(policies.len());
        for _ in policies {
            let run = slots
                .next()
                .flatten()
                .unwrap_or_else(|| Err(SimError::Internal("a suite run did not finish".into())))?;
            figures.push(run);
        }
        let workload = workload_of(cell);
        results.push(CellResult {
            engine: options.engines[cell.engine].name().to_string(),
            shape: options.shapes[cell.shape].name().to_string(),
            load: options.loads[cell.load],
            replicas: cell.replicas,
            requests: workload.requests.len(),
            prompt_tokens: workload.prompt_tokens(),
            policies: figures,
        });
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{kvroute_policy, resolve};
    use crate::timing::BatchDecode;
    use std::collections::HashSet;

    #[test]
    fn every_shape_is_deterministic_bounded_and_in_arrival_order() {
        let all = shapes();
        let names: HashSet<&str> = all.iter().map(|s| s.name()).collect();
        assert_eq!(names.len(), all.len(), "shape names are unique");
        assert!(all.len() >= 6);
        for shape in &all {
            let a = shape.generate(7, 64).unwrap();
            assert!(!a.is_empty(), "{}", shape.name());
            assert!(a.len() <= MAX_REQUESTS, "{}: {}", shape.name(), a.len());
            assert!(
                a.windows(2)
                    .all(|w| w[0].arrival_nanos <= w[1].arrival_nanos)
            );
            assert!(
                a.iter()
                    .all(|r| r.output_tokens >= 1 && r.prompt.isl_tokens > 0)
            );
            assert_eq!(
                a,
                shape.generate(7, 64).unwrap(),
                "{}: same seed",
                shape.name()
            );
            assert_ne!(
                a,
                shape.generate(8, 64).unwrap(),
                "{}: other seed",
                shape.name()
            );
            // Output lengths vary: decode is part of what the suite judges.
            let outputs: HashSet<u64> = a.iter().map(|r| r.output_tokens).collect();
            assert!(outputs.len() > 10, "{}", shape.name());
            assert!(!shape.description().is_empty());
        }
    }

    #[test]
    fn a_load_multiplier_divides_every_arrival_time() {
        for shape in shapes() {
            let one = shape_workload(shape.as_ref(), 1.0, 3, 64).unwrap();
            let four = shape_workload(shape.as_ref(), 4.0, 3, 64).unwrap();
            assert_eq!(one.requests.len(), four.requests.len());
            for (a, b) in one.requests.iter().zip(&four.requests) {
                assert_eq!(a.prompt, b.prompt);
                assert_eq!(
                    b.arrival_nanos,
                    (a.arrival_nanos as f64 / 4.0).round() as u64
                );
            }
            let span = |w: &Workload| w.requests.last().map_or(0, |r| r.arrival_nanos);
            let rate = |w: &Workload| w.requests.len() as f64 / span(w) as f64;
            let scaled = rate(&four) / rate(&one);
            assert!((scaled - 4.0).abs() < 0.01, "{}: {scaled}", shape.name());
        }
        assert!(shape_workload(&conversation::Conversation, 0.0, 0, 64).is_err());
        assert!(shape_workload(&conversation::Conversation, f64::NAN, 0, 64).is_err());
    }

    /// Share of prompt tokens found in one unlimited cache of every earlier prompt's blocks.
    fn unlimited_cache_reuse(requests: &[SimRequest], block_size: u64) -> f64 {
        let mut seen = HashSet::new();
        let (mut hit, mut total) = (0u64, 0u64);
        for r in requests {
            let hits = r
                .prompt
                .sequence
                .iter()
                .take_while(|h| seen.contains(*h))
                .count() as u64;
            hit += hits * block_size;
            total += r.prompt.isl_tokens;
            seen.extend(r.prompt.sequence.iter().copied());
        }
        hit as f64 / total as f64
    }

    #[test]
    fn conversation_matches_the_mooncake_trace_statistics() {
        let requests = conversation::Conversation.generate(0, 64).unwrap();
        let reuse = unlimited_cache_reuse(&requests, 64);
        assert!((0.30..0.45).contains(&reuse), "reuse {reuse}");
        let mean = requests.iter().map(|r| r.prompt.isl_tokens).sum::<u64>() as f64
            / requests.len() as f64;
        assert!((8_000.0..16_000.0).contains(&mean), "mean prompt {mean}");
        // Every prompt opens with the shared 512-token block.
        let first: HashSet<u64> = requests.iter().map(|r| r.prompt.sequence[7]).collect();
        assert_eq!(first.len(), 1);
        // A later turn extends its session's earlier prompt, cut to whole 512-token blocks.
        let mut last_of_session: hashbrown::HashMap<u64, &SimRequest> = Default::default();
        let mut follow_ups = 0;
        for r in &requests {
            let session = r.session_id.unwrap();
            if let Some(prev) = last_of_session.get(&session) {
                let kept = (prev.prompt.isl_tokens / 512 * 512 / 64) as usize;
                assert_eq!(r.prompt.sequence[..kept], prev.prompt.sequence[..kept]);
                follow_ups += 1;
            }
            last_of_session.insert(session, r);
        }
        assert!(follow_ups > 100, "{follow_ups}");
    }

    #[test]
    fn reuse_differs_by_shape_as_described() {
        let reuse = |shape: &dyn Shape| unlimited_cache_reuse(&shape.generate(1, 64).unwrap(), 64);
        assert_eq!(reuse(&no_reuse::NoReuse), 0.0);
        // 4,096 of 4,864 tokens are shared by all but the first prompt of each group.
        assert!(reuse(&hot_prompts::HotPrompts) > 0.8);
        assert!(reuse(&long_docs::LongDocs) > 0.8);
        assert!(reuse(&small_groups::SmallGroups) > 0.5);
    }

    #[test]
    fn long_doc_popularity_shifts_between_phases() {
        let requests = long_docs::LongDocs.generate(0, 64).unwrap();
        let favourite = |phase: &[SimRequest]| {
            let mut counts: hashbrown::HashMap<u64, usize> = Default::default();
            for r in phase {
                *counts.entry(r.prompt.sequence[0]).or_default() += 1;
            }
            let mut counts: Vec<(u64, usize)> = counts.into_iter().collect();
            counts.sort_by_key(|&(doc, n)| (std::cmp::Reverse(n), doc));
            counts[0].0
        };
        let quarter = requests.len() / 4;
        let favourites: HashSet<u64> = requests.chunks(quarter).take(4).map(favourite).collect();
        assert!(favourites.len() >= 3, "{favourites:?}");
    }

    /// A shape made for the test, as a developer would add one: few, small requests.
    struct Tiny;

    impl Shape for Tiny {
        fn name(&self) -> &str {
            "tiny"
        }
        fn description(&self) -> String {
            "two groups of short prompts".into()
        }
        fn generate(&self, seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError> {
            let mut rng = ShapeRng::new(self.name(), seed);
            let mut at = 0.0;
            Ok((0..24)
                .map(|i| {
                    at += rng.exponential(0.05);
                    let mut tokens = Vec::new();
                    rng.push_segment(&mut tokens, 1, i % 2, 256);
                    let question = rng.between(10, 100);
                    rng.push_segment(&mut tokens, 2, i, question);
                    request(at, &tokens, rng.between(2, 40), None, block_size)
                })
                .collect())
        }
    }

    fn tiny_suite() -> SuiteOptions {
        SuiteOptions {
            shapes: vec![Box::new(Tiny)],
            loads: vec![1.0, 8.0],
            replicas: vec![1, 2],
            engines: vec![
                EngineModel::Fitted,
                EngineModel::Batch(BatchDecode::default()),
            ],
            policies: resolve("round_robin,dynamo,kvroute", kvroute_policy()).unwrap(),
            base: SimConfig {
                workers: 3,
                ..SimConfig::default()
            },
        }
    }

    #[test]
    fn the_suite_runs_every_cell_the_same_on_any_number_of_threads() {
        let options = tiny_suite();
        let origin = Instant::now();
        let calls = AtomicUsize::new(0);
        let serial = run_suite(&options, 1, origin, &|_, total| {
            assert_eq!(total, 8 * 3);
            calls.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(calls.load(Ordering::Relaxed), 24);
        assert_eq!(serial, run_suite(&options, 3, origin, &|_, _| {}).unwrap());
        assert_eq!(serial.len(), 8);
        assert_eq!(serial[0].engine, "fitted");
        assert_eq!(serial[7].engine, "batch");
        assert_eq!((serial[3].load, serial[3].replicas), (8.0, 2));
        for cell in &serial {
            assert_eq!(cell.requests, 24);
            let names: Vec<&str> = cell.policies.iter().map(|p| p.policy.as_str()).collect();
            assert_eq!(names, ["round_robin", "dynamo", "kvroute"]);
            assert!(cell.policies.iter().all(|p| p.completed == 24));
        }
        // The engine model changes the timings, not the workload.
        assert_ne!(
            serial[0].policies[0].e2e_p99_ms,
            serial[4].policies[0].e2e_p99_ms
        );
        let report = summary::SuiteReport::new(serial);
        assert_eq!(report.summaries.len(), 2);
        assert!(report.summaries.iter().all(|s| s.targets.is_some()));
    }

    #[test]
    fn an_empty_selection_is_refused_by_name() {
        let mut options = tiny_suite();
        options.loads.clear();
        let err = run_suite(&options, 1, Instant::now(), &|_, _| {}).unwrap_err();
        assert!(err.to_string().contains("suite-loads"), "{err}");
        let mut options = tiny_suite();
        options.replicas = vec![0];
        let err = run_suite(&options, 1, Instant::now(), &|_, _| {}).unwrap_err();
        assert!(err.to_string().contains("suite-replicas"), "{err}");
    }
}
