//! Aggregated against disaggregated fleets of the same size, and P/D policies against each
//! other (`kvroute sim --pd`, `kvroute sim --suite-pd`).
//!
//! An **entry** is a fleet and a policy: `8 agg / kvroute`, `2P+6D / pd-round-robin`, ... A
//! **cell** is (engine model, suite shape, load); every entry runs in every cell on the same
//! workload. For each metric (TTFT mean, TTFT p99, ITL p99, E2E p99) an entry's ratio in a cell
//! is its figure over the best entry's, so the best scores 1; the summary is each entry's
//! geometric mean and worst ratio over the cells.

use super::routers::{KvroutePd, Pair, PdRouter, Whole};
use super::{PdConfig, PdRun, run_pd};
use crate::SimError;
use crate::policy::{Policy, SelectorPolicy, resolve};
use crate::report::percentile;
use crate::suite::{Shape, shape_workload};
use crate::timing::EngineModel;
use crate::workload::Workload;
use serde::Serialize;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// The loads the P/D suite runs unless told otherwise: where a fleet is busy enough for the
/// split to matter.
pub const DEFAULT_PD_LOADS: [f64; 2] = [2.0, 4.0];

/// The P/D splits of the default comparison, for a fleet of 8 engines.
pub const DEFAULT_SPLITS: [(usize, usize); 2] = [(2, 6), (3, 5)];

/// How an entry routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdPolicy {
    /// An aggregated policy of [`crate::policy::catalog`] (aggregated fleets only).
    Aggregated(&'static str),
    /// Round robin over each pool.
    RoundRobinPairs,
    /// `cache_aware` over the prefill pool, `least_loaded` over the decode pool.
    CacheAwarePrefill,
    /// kvroute's selector: `select_and_reserve_disaggregated` ([`super::routers::KvroutePd`]).
    Kvroute,
}

impl PdPolicy {
    pub fn name(self) -> &'static str {
        match self {
            Self::Aggregated(name) => name,
            Self::RoundRobinPairs => "pd-round-robin",
            Self::CacheAwarePrefill => "pd-cache-aware",
            Self::Kvroute => "kvroute-pd",
        }
    }

    /// The P/D policies, for a P/D fleet.
    pub fn disaggregated() -> Vec<PdPolicy> {
        vec![
            Self::RoundRobinPairs,
            Self::CacheAwarePrefill,
            Self::Kvroute,
        ]
    }
}

/// A fleet and the policy that routes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdEntry {
    /// 0 for an aggregated fleet.
    pub prefill_engines: usize,
    pub decode_engines: usize,
    pub policy: PdPolicy,
}

impl PdEntry {
    /// `8 agg / kvroute`.
    pub fn name(&self) -> String {
        format!("{} / {}", self.fleet().fleet_name(), self.policy.name())
    }

    fn fleet(&self) -> PdConfig {
        PdConfig {
            prefill_engines: self.prefill_engines,
            decode_engines: self.decode_engines,
            ..PdConfig::default()
        }
    }

    /// The run's configuration: `base`'s engines, transfer, delay and seed, this fleet.
    pub fn config(&self, base: &PdConfig) -> PdConfig {
        PdConfig {
            prefill_engines: self.prefill_engines,
            decode_engines: self.decode_engines,
            ..*base
        }
    }

    /// A fresh router for this entry.
    pub fn router(
        &self,
        config: &PdConfig,
        kvroute: SelectorPolicy,
    ) -> Result<Box<dyn PdRouter>, SimError> {
        let policy = |name: &str| -> Result<Policy, SimError> {
            resolve(name, kvroute)?
                .pop()
                .ok_or_else(|| SimError::Internal(format!("no policy {name}")))
        };
        let (p, d) = (config.prefill_engines, config.decode_engines);
        let (pe, de) = (&config.prefill_engine, &config.decode_engine);
        Ok(match self.policy {
            PdPolicy::Aggregated(name) => {
                if p != 0 {
                    return Err(SimError::invalid(
                        "prefill-engines",
                        format!("the aggregated policy {name} needs an aggregated fleet"),
                    ));
                }
                Box::new(Whole::new(&policy(name)?, d, de)?)
            }
            PdPolicy::RoundRobinPairs | PdPolicy::CacheAwarePrefill | PdPolicy::Kvroute
                if p == 0 =>
            {
                return Err(SimError::invalid(
                    "prefill-engines",
                    format!("{} needs prefill engines", self.policy.name()),
                ));
            }
            PdPolicy::RoundRobinPairs => {
                let rr = policy("round_robin")?;
                Box::new(Pair::new(self.policy.name(), (&rr, p, pe), (&rr, d, de))?)
            }
            PdPolicy::CacheAwarePrefill => Box::new(Pair::new(
                self.policy.name(),
                (&policy("cache_aware")?, p, pe),
                (&policy("least_loaded")?, d, de),
            )?),
            PdPolicy::Kvroute => Box::new(KvroutePd::new(config, kvroute, config.bypass_tokens)?),
        })
    }
}

/// The default entries for a fleet of `engines` engines: the aggregated `round_robin`,
/// `cache_aware` and `kvroute`, then every P/D policy on each split of `splits` that adds up to
/// `engines`.
pub fn default_entries(engines: usize, splits: &[(usize, usize)]) -> Vec<PdEntry> {
    let mut entries: Vec<PdEntry> = ["round_robin", "cache_aware", "kvroute"]
        .into_iter()
        .map(|name| PdEntry {
            prefill_engines: 0,
            decode_engines: engines,
            policy: PdPolicy::Aggregated(name),
        })
        .collect();
    for &(p, d) in splits {
        for policy in PdPolicy::disaggregated() {
            entries.push(PdEntry {
                prefill_engines: p,
                decode_engines: d,
                policy,
            });
        }
    }
    entries
}

/// One entry's figures in one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdFigures {
    pub entry: String,
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
    /// 99th percentile of the gaps between consecutive output tokens.
    pub itl_p99_ms: f64,
    pub e2e_p99_ms: f64,
    /// Prompt tokens found cached where they were computed.
    pub hit_rate: f64,
    /// Σ chosen ÷ Σ best resident prefix over the pool each prompt was computed in (1 when
    /// nothing was resident anywhere): how much of the cache on offer the router used.
    pub decision_quality: f64,
    /// The most requests an engine computed a prompt for, over the mean of its pool (the prefill
    /// pool of a P/D fleet, the whole fleet otherwise).
    pub prefill_request_imbalance: f64,
    /// The same ratio as the router's index saw it at each selection (selector-backed
    /// routers only): below `decision_quality` when the index missed blocks the pools held.
    pub selector_decision_quality: Option<f64>,
    pub completed: u64,
    pub rejected: u64,
    /// Requests run in two legs, and whole on a decode engine by the router's choice.
    pub two_leg: u64,
    pub bypassed: u64,
    /// Mean transfer time of the two-leg requests.
    pub transfer_mean_ms: f64,
    /// Mean TTFT parts of the two-leg requests: arrival to prefill done, the transfer, and
    /// from the copy's arrival to the first token (decode queue and first step).
    pub prefill_leg_mean_ms: f64,
    pub decode_first_step_mean_ms: f64,
    /// Busy time over the run's span, averaged over each pool's engines (`None` for the prefill
    /// pool of an aggregated fleet).
    pub prefill_busy: Option<f64>,
    pub decode_busy: f64,
    /// Bookings the router still held at the end.
    pub bookings_left: usize,
}

fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    let r = (x * scale).round() / scale;
    if r.is_finite() { r } else { 0.0 }
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

const MS: f64 = 1e6;

impl PdFigures {
    pub fn from_run(entry: String, run: &PdRun) -> Self {
        let requests = &run.requests;
        let mut ttfts: Vec<f64> = requests
            .iter()
            .filter_map(|r| {
                r.first_token
                    .map(|t| t.saturating_sub(r.arrival) as f64 / MS)
            })
            .collect();
        ttfts.sort_by(f64::total_cmp);
        let mut e2e: Vec<f64> = requests
            .iter()
            .filter_map(|r| r.finished.map(|t| t.saturating_sub(r.arrival) as f64 / MS))
            .collect();
        e2e.sort_by(f64::total_cmp);
        let gaps: Vec<f64> = run.token_gaps.iter().map(|&g| g as f64 / MS).collect();
        let completed: Vec<_> = requests.iter().filter(|r| r.finished.is_some()).collect();
        let prompt: u64 = completed.iter().map(|r| r.prompt_tokens).sum();
        let cached: u64 = completed.iter().map(|r| r.cached_tokens).sum();
        let two_leg: Vec<_> = completed
            .iter()
            .filter(|r| r.prefill_engine.is_some())
            .collect();
        let first_arrival = requests.iter().map(|r| r.arrival).min().unwrap_or(0);
        let last_finish = completed
            .iter()
            .filter_map(|r| r.finished)
            .max()
            .unwrap_or(0);
        let span = last_finish.saturating_sub(first_arrival).max(1) as f64;
        let (prefill_pool, decode_pool) = run.engines.split_at(run.prefill_engines);
        let busy = |pool: &[crate::engine::EngineCounters]| {
            round(mean(pool.iter().map(|e| e.busy_nanos as f64 / span)), 4)
        };
        Self {
            entry,
            ttft_mean_ms: round(mean(ttfts.iter().copied()), 3),
            ttft_p99_ms: round(percentile(&ttfts, 99.0), 3),
            itl_p99_ms: round(percentile(&gaps, 99.0), 3),
            e2e_p99_ms: round(percentile(&e2e, 99.0), 3),
            hit_rate: if prompt == 0 {
                0.0
            } else {
                round(cached as f64 / prompt as f64, 6)
            },
            decision_quality: {
                let chosen: u64 = requests.iter().map(|r| r.chosen_overlap_tokens).sum();
                let best: u64 = requests.iter().map(|r| r.best_overlap_tokens).sum();
                if best == 0 {
                    1.0
                } else {
                    round(chosen as f64 / best as f64, 4)
                }
            },
            prefill_request_imbalance: {
                let pool = if run.prefill_engines > 0 {
                    run.prefill_engines
                } else {
                    run.engines.len()
                };
                let mut counts = vec![0u64; pool.max(1)];
                for r in requests {
                    let engine = if run.prefill_engines > 0 {
                        r.prefill_engine
                    } else {
                        r.decode_engine
                    };
                    if let Some(c) = engine.and_then(|e| counts.get_mut(e as usize)) {
                        *c += 1;
                    }
                }
                let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
                let max = counts.iter().copied().max().unwrap_or(0) as f64;
                if mean > 0.0 {
                    round(max / mean, 3)
                } else {
                    1.0
                }
            },
            selector_decision_quality: run.selector_overlap.map(|(chosen, best)| {
                if best == 0 {
                    1.0
                } else {
                    round(chosen as f64 / best as f64, 4)
                }
            }),
            completed: completed.len() as u64,
            rejected: requests.iter().filter(|r| r.rejected).count() as u64,
            two_leg: two_leg.len() as u64,
            bypassed: requests.iter().filter(|r| r.bypass.is_some()).count() as u64,
            transfer_mean_ms: round(
                mean(two_leg.iter().map(|r| r.transfer_nanos as f64 / MS)),
                3,
            ),
            prefill_leg_mean_ms: round(
                mean(two_leg.iter().filter_map(|r| {
                    r.prefill_done
                        .map(|p| p.saturating_sub(r.arrival) as f64 / MS)
                })),
                3,
            ),
            decode_first_step_mean_ms: round(
                mean(two_leg.iter().filter_map(|r| {
                    let copied = r.prefill_done?.saturating_add(r.transfer_nanos);
                    r.first_token.map(|t| t.saturating_sub(copied) as f64 / MS)
                })),
                3,
            ),
            prefill_busy: (!prefill_pool.is_empty()).then(|| busy(prefill_pool)),
            decode_busy: busy(decode_pool),
            bookings_left: run.bookings_left,
        }
    }

    pub fn get(&self, metric: PdMetric) -> f64 {
        match metric {
            PdMetric::TtftMean => self.ttft_mean_ms,
            PdMetric::TtftP99 => self.ttft_p99_ms,
            PdMetric::ItlP99 => self.itl_p99_ms,
            PdMetric::E2eP99 => self.e2e_p99_ms,
        }
    }
}

/// The latencies the comparison ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PdMetric {
    TtftMean,
    TtftP99,
    ItlP99,
    E2eP99,
}

impl PdMetric {
    pub const ALL: [PdMetric; 4] = [
        PdMetric::TtftMean,
        PdMetric::TtftP99,
        PdMetric::ItlP99,
        PdMetric::E2eP99,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::TtftMean => "TTFT mean",
            Self::TtftP99 => "TTFT p99",
            Self::ItlP99 => "ITL p99",
            Self::E2eP99 => "E2E p99",
        }
    }
}

/// Runs every entry on one workload (on up to `jobs` threads); figures in the entries' order.
pub fn compare(
    workload: &Workload,
    base: &PdConfig,
    entries: &[PdEntry],
    kvroute: SelectorPolicy,
    jobs: usize,
    origin: Instant,
) -> Result<Vec<(PdFigures, PdRun)>, SimError> {
    let runs = parallel(entries.len(), jobs, &|i| {
        let config = entries[i].config(base);
        let mut router = entries[i].router(&config, kvroute)?;
        let run = run_pd(workload, &config, router.as_mut(), origin)?;
        Ok((PdFigures::from_run(entries[i].name(), &run), run))
    })?;
    Ok(runs)
}

/// `job(i)` for every `i < total` on up to `jobs` threads; results in index order.
fn parallel<T: Send>(
    total: usize,
    jobs: usize,
    job: &(dyn Fn(usize) -> Result<T, SimError> + Sync),
) -> Result<Vec<T>, SimError> {
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<Result<T, SimError>>>> =
        Mutex::new((0..total).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, total.max(1)) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let result = job(i);
                    slots.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(result);
                }
            });
        }
    });
    slots
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|s| s.unwrap_or_else(|| Err(SimError::Internal("a P/D run did not finish".into()))))
        .collect()
}

/// What the P/D suite runs.
pub struct PdSuiteOptions {
    pub shapes: Vec<Box<dyn Shape>>,
    pub loads: Vec<f64>,
    pub engines: Vec<EngineModel>,
    pub entries: Vec<PdEntry>,
    /// Engines, transfer, event delay and seed; each cell sets the engine model, each entry the
    /// fleet.
    pub base: PdConfig,
    pub kvroute: SelectorPolicy,
}

/// Every entry's figures in one cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdCell {
    pub engine: String,
    pub shape: String,
    pub load: f64,
    pub requests: usize,
    pub entries: Vec<PdFigures>,
}

impl PdCell {
    fn best(&self, metric: PdMetric) -> f64 {
        self.entries
            .iter()
            .map(|e| e.get(metric))
            .min_by(f64::total_cmp)
            .unwrap_or(0.0)
    }

    /// Each entry's figure over the cell's best (1 when both are 0).
    pub fn ratios(&self, metric: PdMetric) -> Vec<f64> {
        let best = self.best(metric);
        self.entries
            .iter()
            .map(|e| crate::suite::summary::ratio(e.get(metric), best))
            .collect()
    }
}

/// Runs every entry in every (engine model, shape, load) cell on up to `jobs` threads; cells
/// in that order (engine model outermost), each entry's figures in the entries' order. The
/// result does not depend on `jobs`.
pub fn run_pd_suite(
    options: &PdSuiteOptions,
    jobs: usize,
    origin: Instant,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Vec<PdCell>, SimError> {
    if options.shapes.is_empty() || options.loads.is_empty() || options.engines.is_empty() {
        return Err(SimError::invalid(
            "suite-pd",
            "no shape, load or engine model to run",
        ));
    }
    if options.entries.is_empty() {
        return Err(SimError::invalid("suite-pd", "no fleet and policy to run"));
    }
    let block_size = options.base.decode_engine.block_size;
    let mut workloads = Vec::new();
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
    let cells: Vec<(usize, usize)> = (0..options.engines.len())
        .flat_map(|e| (0..workloads.len()).map(move |w| (e, w)))
        .collect();
    let per_cell = options.entries.len();
    let total = cells.len() * per_cell;
    let done = AtomicUsize::new(0);
    let figures = parallel(total, jobs, &|job| {
        let (engine, w) = cells[job / per_cell];
        let entry = &options.entries[job % per_cell];
        let mut base = options.base;
        base.prefill_engine.timing.engine_model = options.engines[engine];
        base.decode_engine.timing.engine_model = options.engines[engine];
        let config = entry.config(&base);
        let mut router = entry.router(&config, options.kvroute)?;
        let run = run_pd(&workloads[w], &config, router.as_mut(), origin)?;
        progress(done.fetch_add(1, Ordering::Relaxed) + 1, total);
        Ok(PdFigures::from_run(entry.name(), &run))
    })?;
    let mut figures = figures.into_iter();
    Ok(cells
        .iter()
        .map(|&(engine, w)| PdCell {
            engine: options.engines[engine].name().to_string(),
            shape: options.shapes[w / options.loads.len()].name().to_string(),
            load: options.loads[w % options.loads.len()],
            requests: workloads[w].requests.len(),
            entries: figures.by_ref().take(per_cell).collect(),
        })
        .collect())
}

/// One entry's summary over the cells of one engine model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdScore {
    pub entry: String,
    pub metric: PdMetric,
    pub geomean: f64,
    pub worst: f64,
}

/// The summary of every entry and metric, per engine model.
pub fn scores(cells: &[PdCell], engine: &str) -> Vec<PdScore> {
    let cells: Vec<&PdCell> = cells.iter().filter(|c| c.engine == engine).collect();
    let Some(first) = cells.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for metric in PdMetric::ALL {
        let ratios: Vec<Vec<f64>> = cells.iter().map(|c| c.ratios(metric)).collect();
        for (i, e) in first.entries.iter().enumerate() {
            let column: Vec<f64> = ratios.iter().filter_map(|r| r.get(i).copied()).collect();
            let log_mean = mean(column.iter().map(|r| r.max(1e-12).ln()));
            out.push(PdScore {
                entry: e.entry.clone(),
                metric,
                geomean: round(log_mean.exp(), 3),
                worst: round(column.iter().copied().fold(0.0, f64::max), 3),
            });
        }
    }
    out
}

/// The P/D suite's tables: per engine model and metric, each entry's ratio to the best of each
/// cell, then its geometric mean and worst ratio; then the P/D pools' load and bypasses.
pub fn suite_markdown(cells: &[PdCell]) -> String {
    let mut engines: Vec<&str> = Vec::new();
    for c in cells {
        if !engines.contains(&c.engine.as_str()) {
            engines.push(&c.engine);
        }
    }
    let mut md = String::new();
    for engine in engines {
        let of_engine: Vec<&PdCell> = cells.iter().filter(|c| c.engine == engine).collect();
        let Some(first) = of_engine.first() else {
            continue;
        };
        let names: Vec<&str> = first.entries.iter().map(|e| e.entry.as_str()).collect();
        let scores = scores(cells, engine);
        md.push_str(&format!(
            "\n### {engine} engine model: summary, geomean (worst) of the ratios to the best of each cell\n\n| fleet / policy |"
        ));
        for metric in PdMetric::ALL {
            md.push_str(&format!(" {} |", metric.label()));
        }
        md.push_str(" hit rate |\n|---|---:|---:|---:|---:|---:|\n");
        for (i, name) in names.iter().enumerate() {
            md.push_str(&format!("| {name} |"));
            for metric in PdMetric::ALL {
                if let Some(s) = scores.iter().filter(|s| s.metric == metric).nth(i) {
                    md.push_str(&format!(" {:.2} ({:.2}) |", s.geomean, s.worst));
                }
            }
            let hit = mean(
                of_engine
                    .iter()
                    .filter_map(|c| c.entries.get(i))
                    .map(|e| e.hit_rate),
            );
            md.push_str(&format!(" {:.1} % |\n", hit * 100.0));
        }
        for metric in PdMetric::ALL {
            md.push_str(&format!(
                "\n### {engine} engine model: {} ÷ best of the cell\n\n| cell |",
                metric.label()
            ));
            for n in &names {
                md.push_str(&format!(" {n} |"));
            }
            md.push_str("\n|---|");
            md.push_str(&"---:|".repeat(names.len()));
            md.push('\n');
            for cell in &of_engine {
                md.push_str(&format!("| {} {}x |", cell.shape, cell.load));
                for r in cell.ratios(metric) {
                    md.push_str(&format!(" {r:.2} |"));
                }
                md.push('\n');
            }
            for (label, pick) in [("**geomean**", true), ("worst", false)] {
                md.push_str(&format!("| {label} |"));
                for s in scores.iter().filter(|s| s.metric == metric) {
                    let v = if pick { s.geomean } else { s.worst };
                    if pick {
                        md.push_str(&format!(" **{v:.3}** |"));
                    } else {
                        md.push_str(&format!(" {v:.2} |"));
                    }
                }
                md.push('\n');
            }
        }
        md.push_str(&format!(
            "\n### {engine} engine model: P/D pools (prefill busy / decode busy, bypassed requests)\n\n| cell |"
        ));
        let pd: Vec<usize> = first
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.prefill_busy.is_some())
            .map(|(i, _)| i)
            .collect();
        for &i in &pd {
            md.push_str(&format!(" {} |", names[i]));
        }
        md.push_str("\n|---|");
        md.push_str(&"---:|".repeat(pd.len()));
        md.push('\n');
        for cell in &of_engine {
            md.push_str(&format!("| {} {}x |", cell.shape, cell.load));
            for &i in &pd {
                let e = &cell.entries[i];
                md.push_str(&format!(
                    " {:.0}% / {:.0}%, {} |",
                    e.prefill_busy.unwrap_or(0.0) * 100.0,
                    e.decode_busy * 100.0,
                    e.bypassed
                ));
            }
            md.push('\n');
        }
    }
    md
}

/// One workload's comparison as a text table (`kvroute sim --pd`).
pub fn table(figures: &[PdFigures]) -> String {
    let mut out = format!(
        "{:<28} {:>9} {:>9} {:>8} {:>9} {:>7} {:>7} {:>8} {:>9} {:>9} {:>9}\n",
        "fleet / policy",
        "TTFT mean",
        "TTFT p99",
        "ITL p99",
        "E2E p99",
        "hit",
        "bypass",
        "transfer",
        "prefill",
        "P busy",
        "D busy"
    );
    for f in figures {
        out.push_str(&format!(
            "{:<28} {:>7.1}ms {:>7.1}ms {:>6.1}ms {:>7.0}ms {:>6.1}% {:>7} {:>6.1}ms {:>7.1}ms {:>9} {:>8.0}%\n",
            f.entry,
            f.ttft_mean_ms,
            f.ttft_p99_ms,
            f.itl_p99_ms,
            f.e2e_p99_ms,
            f.hit_rate * 100.0,
            f.bypassed,
            f.transfer_mean_ms,
            f.prefill_leg_mean_ms,
            f.prefill_busy
                .map_or_else(|| "—".to_string(), |b| format!("{:.0}%", b * 100.0)),
            f.decode_busy * 100.0,
        ));
    }
    out
}
