//! The suite's figures, its summary and the `kvroute` policy's targets.
//!
//! For each metric (TTFT mean, TTFT p99, E2E p99) a policy's **ratio** in a cell is its figure
//! over the best (lowest) figure of any policy in that cell, so the best policy scores 1. Per
//! engine model, each policy gets its **worst** ratio over the cells and the **geometric mean** of
//! its ratios. The targets of the judged policy (`kvroute`), against the best *baseline* (every
//! other policy) of each cell:
//! - TTFT p99 and E2E p99 at most 1.05 × the best baseline's, in every cell;
//! - TTFT mean at most the best baseline's, in every cell;
//! - the geometric mean of its TTFT-mean ratios at most 0.85 × the lowest geometric mean of any
//!   single baseline.

use crate::report::PolicyReport;
use serde::Serialize;

/// One policy's figures in one cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellFigures {
    pub policy: String,
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p99_ms: f64,
    pub hit_rate: f64,
    /// The most requests a worker got over the mean per worker.
    pub request_imbalance: f64,
    pub preemptions: u64,
    pub completed: u64,
}

impl CellFigures {
    pub fn from_report(p: &PolicyReport) -> Self {
        Self {
            policy: p.name.clone(),
            ttft_mean_ms: p.ttft_ms.mean,
            ttft_p99_ms: p.ttft_ms.p99,
            e2e_p99_ms: p.e2e_ms.p99,
            hit_rate: p.prefix_hit_rate,
            request_imbalance: p.request_imbalance,
            preemptions: p.preemptions,
            completed: p.completed,
        }
    }

    /// The figure of `metric`.
    pub fn get(&self, metric: Metric) -> f64 {
        match metric {
            Metric::TtftMean => self.ttft_mean_ms,
            Metric::TtftP99 => self.ttft_p99_ms,
            Metric::E2eP99 => self.e2e_p99_ms,
        }
    }
}

/// Every policy's figures in one cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellResult {
    pub engine: String,
    pub shape: String,
    pub load: f64,
    pub replicas: usize,
    pub requests: usize,
    pub prompt_tokens: u64,
    pub policies: Vec<CellFigures>,
}

impl CellResult {
    /// `batch / hot_prompts / 2x / 1 replica`.
    pub fn label(&self) -> String {
        format!(
            "{} / {} / {}x / {} replica{}",
            self.engine,
            self.shape,
            self.load,
            self.replicas,
            if self.replicas == 1 { "" } else { "s" }
        )
    }

    /// The lowest figure of `metric` among the policies `include` accepts (`None`: none).
    fn best(&self, metric: Metric, include: impl Fn(&str) -> bool) -> Option<f64> {
        self.policies
            .iter()
            .filter(|p| include(&p.policy))
            .map(|p| p.get(metric))
            .min_by(f64::total_cmp)
    }

    fn figures(&self, policy: &str) -> Option<&CellFigures> {
        self.policies.iter().find(|p| p.policy == policy)
    }
}

/// The latencies the summary compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    TtftMean,
    TtftP99,
    E2eP99,
}

impl Metric {
    pub const ALL: [Metric; 3] = [Metric::TtftMean, Metric::TtftP99, Metric::E2eP99];

    pub fn label(self) -> &'static str {
        match self {
            Metric::TtftMean => "TTFT mean",
            Metric::TtftP99 => "TTFT p99",
            Metric::E2eP99 => "E2E p99",
        }
    }
}

/// `value / best`; 1 when both are 0 (a cell where nothing waited), so an empty figure cannot
/// make a policy look infinitely good or bad.
pub fn ratio(value: f64, best: f64) -> f64 {
    if best > 0.0 {
        value / best
    } else if value <= 0.0 {
        1.0
    } else {
        f64::INFINITY
    }
}

/// The geometric mean of positive ratios (1 for none).
pub fn geomean(ratios: &[f64]) -> f64 {
    if ratios.is_empty() {
        return 1.0;
    }
    (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp()
}

/// One policy's score over an engine model's cells, per metric in [`Metric::ALL`] order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyScore {
    pub policy: String,
    /// The largest ratio to the cell's best policy.
    pub worst: [f64; 3],
    /// The cell where it was largest.
    pub worst_cell: [String; 3],
    /// The geometric mean of the ratios over the cells.
    pub geomean: [f64; 3],
}

/// Whether the judged policy meets its targets ([module docs](self)).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TargetCheck {
    pub policy: String,
    /// Cells where a per-cell target failed, with what failed.
    pub failures: Vec<String>,
    /// The judged policy's TTFT-mean geometric mean...
    pub ttft_mean_geomean: f64,
    /// ...and the lowest of any single baseline's, with its name.
    pub best_baseline_geomean: f64,
    pub best_baseline: String,
    pub geomean_ok: bool,
}

impl TargetCheck {
    pub fn passed(&self) -> bool {
        self.failures.is_empty() && self.geomean_ok
    }
}

/// The summary of one engine model's cells.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineSummary {
    pub engine: String,
    pub cells: usize,
    pub policies: Vec<PolicyScore>,
    /// `None` when the judged policy or every baseline is missing.
    pub targets: Option<TargetCheck>,
}

/// The judged policy.
pub const JUDGED_POLICY: &str = "kvroute";
/// Tail latencies may exceed the best baseline's by this factor.
pub const TAIL_TOLERANCE: f64 = 1.05;
/// The judged policy's TTFT-mean geometric mean must be at most this × the best baseline's.
pub const MEAN_GEOMEAN_TARGET: f64 = 0.85;

/// Summarises `cells` (all of one engine model) for the policies of the first cell, in order.
pub fn summarize(engine: &str, cells: &[&CellResult]) -> EngineSummary {
    let names: Vec<String> = cells
        .first()
        .map(|c| c.policies.iter().map(|p| p.policy.clone()).collect())
        .unwrap_or_default();
    let policies: Vec<PolicyScore> = names
        .iter()
        .map(|name| {
            let mut score = PolicyScore {
                policy: name.clone(),
                worst: [0.0; 3],
                worst_cell: Default::default(),
                geomean: [1.0; 3],
            };
            for (m, metric) in Metric::ALL.into_iter().enumerate() {
                let mut ratios = Vec::new();
                for cell in cells {
                    let (Some(figures), Some(best)) =
                        (cell.figures(name), cell.best(metric, |_| true))
                    else {
                        continue;
                    };
                    let r = ratio(figures.get(metric), best);
                    if r > score.worst[m] {
                        score.worst[m] = r;
                        score.worst_cell[m] = cell.label();
                    }
                    ratios.push(r);
                }
                score.geomean[m] = geomean(&ratios);
            }
            score
        })
        .collect();
    let targets = check_targets(cells, &policies);
    EngineSummary {
        engine: engine.to_string(),
        cells: cells.len(),
        policies,
        targets,
    }
}

fn check_targets(cells: &[&CellResult], scores: &[PolicyScore]) -> Option<TargetCheck> {
    let judged = scores.iter().find(|s| s.policy == JUDGED_POLICY)?;
    let best_baseline = scores
        .iter()
        .filter(|s| s.policy != JUDGED_POLICY)
        .min_by(|a, b| a.geomean[0].total_cmp(&b.geomean[0]))?;
    let is_baseline = |name: &str| name != JUDGED_POLICY;
    let mut failures = Vec::new();
    for cell in cells {
        let Some(figures) = cell.figures(JUDGED_POLICY) else {
            continue;
        };
        let mut failed = Vec::new();
        for metric in Metric::ALL {
            let Some(best) = cell.best(metric, is_baseline) else {
                continue;
            };
            let limit = match metric {
                Metric::TtftMean => best,
                Metric::TtftP99 | Metric::E2eP99 => TAIL_TOLERANCE * best,
            };
            let value = figures.get(metric);
            if value > limit {
                failed.push(format!(
                    "{} {:.1} ms > {:.1} ms ({:.2}x the best baseline)",
                    metric.label(),
                    value,
                    limit,
                    ratio(value, best)
                ));
            }
        }
        if !failed.is_empty() {
            failures.push(format!("{}: {}", cell.label(), failed.join(", ")));
        }
    }
    Some(TargetCheck {
        policy: JUDGED_POLICY.to_string(),
        failures,
        ttft_mean_geomean: judged.geomean[0],
        best_baseline_geomean: best_baseline.geomean[0],
        best_baseline: best_baseline.policy.clone(),
        geomean_ok: judged.geomean[0] <= MEAN_GEOMEAN_TARGET * best_baseline.geomean[0],
    })
}

/// The whole suite's result: every cell, and a summary per engine model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SuiteReport {
    pub cells: Vec<CellResult>,
    pub summaries: Vec<EngineSummary>,
}

impl SuiteReport {
    /// Summarises `cells` per engine model, in the order the models first appear.
    pub fn new(cells: Vec<CellResult>) -> Self {
        let mut engines: Vec<String> = Vec::new();
        for c in &cells {
            if !engines.contains(&c.engine) {
                engines.push(c.engine.clone());
            }
        }
        let summaries = engines
            .iter()
            .map(|engine| {
                let of_engine: Vec<&CellResult> =
                    cells.iter().filter(|c| &c.engine == engine).collect();
                summarize(engine, &of_engine)
            })
            .collect();
        Self { cells, summaries }
    }

    /// Markdown: a table per cell, then the summary of each engine model.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        for cell in &self.cells {
            out.push_str(&cell_table(cell));
            out.push('\n');
        }
        for summary in &self.summaries {
            out.push_str(&summary_table(summary));
            out.push('\n');
        }
        out
    }
}

/// A cell's table.
pub fn cell_table(cell: &CellResult) -> String {
    let mut out = format!(
        "#### {} ({} requests, {} prompt tokens)\n\n\
         | policy | TTFT mean ms | TTFT p99 ms | E2E p99 ms | hit rate | req imbalance | preempted |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        cell.label(),
        cell.requests,
        cell.prompt_tokens
    );
    for p in &cell.policies {
        out.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.0} | {:.1}% | {:.2} | {} |\n",
            p.policy,
            p.ttft_mean_ms,
            p.ttft_p99_ms,
            p.e2e_p99_ms,
            p.hit_rate * 100.0,
            p.request_imbalance,
            p.preemptions
        ));
    }
    out
}

/// An engine model's summary table and target line.
pub fn summary_table(summary: &EngineSummary) -> String {
    let mut out = format!(
        "### Summary, {} engine model ({} cells): ratio to the cell's best policy\n\n\
         | policy | worst TTFT mean | worst TTFT p99 | worst E2E p99 | geomean TTFT mean | geomean TTFT p99 | geomean E2E p99 |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        summary.engine, summary.cells
    );
    for s in &summary.policies {
        out.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} |\n",
            s.policy, s.worst[0], s.worst[1], s.worst[2], s.geomean[0], s.geomean[1], s.geomean[2]
        ));
    }
    out.push('\n');
    match &summary.targets {
        None => out.push_str(&format!(
            "Targets: not checked (needs `{JUDGED_POLICY}` and at least one baseline).\n"
        )),
        Some(t) => {
            out.push_str(&format!(
                "Targets for `{}` ({} engine model): {}. Per cell: TTFT p99 and E2E p99 ≤ {} × \
                 and TTFT mean ≤ the best baseline's — {} of {} cells fail. TTFT-mean geomean {:.3} \
                 vs {} × {:.3} ({}) = {:.3}: {}.\n",
                t.policy,
                summary.engine,
                if t.passed() { "PASS" } else { "FAIL" },
                TAIL_TOLERANCE,
                t.failures.len(),
                summary.cells,
                t.ttft_mean_geomean,
                MEAN_GEOMEAN_TARGET,
                t.best_baseline_geomean,
                t.best_baseline,
                MEAN_GEOMEAN_TARGET * t.best_baseline_geomean,
                if t.geomean_ok { "met" } else { "missed" }
            ));
            for f in &t.failures {
                out.push_str(&format!("- {f}\n"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(policy: &str, mean: f64, p99: f64, e2e: f64) -> CellFigures {
        CellFigures {
            policy: policy.into(),
            ttft_mean_ms: mean,
            ttft_p99_ms: p99,
            e2e_p99_ms: e2e,
            hit_rate: 0.5,
            request_imbalance: 1.0,
            preemptions: 0,
            completed: 10,
        }
    }

    fn cell(shape: &str, policies: Vec<CellFigures>) -> CellResult {
        CellResult {
            engine: "fitted".into(),
            shape: shape.into(),
            load: 1.0,
            replicas: 1,
            requests: 10,
            prompt_tokens: 100,
            policies,
        }
    }

    /// Two cells, two baselines and the judged policy, figures chosen by hand.
    fn table() -> Vec<CellResult> {
        vec![
            cell(
                "a",
                vec![
                    figures("round_robin", 100.0, 400.0, 1000.0),
                    figures("dynamo", 50.0, 200.0, 2000.0),
                    figures("kvroute", 40.0, 220.0, 1000.0),
                ],
            ),
            cell(
                "b",
                vec![
                    figures("round_robin", 10.0, 100.0, 500.0),
                    figures("dynamo", 40.0, 100.0, 500.0),
                    figures("kvroute", 20.0, 100.0, 520.0),
                ],
            ),
        ]
    }

    #[test]
    fn worst_ratio_and_geomean_follow_the_hand_made_table() {
        let cells = table();
        let refs: Vec<&CellResult> = cells.iter().collect();
        let s = summarize("fitted", &refs);
        let by = |name: &str| {
            s.policies
                .iter()
                .find(|p| p.policy == name)
                .unwrap()
                .clone()
        };
        // TTFT mean ratios: round robin 100/40 = 2.5 and 10/10 = 1; dynamo 1.25 and 4;
        // kvroute 1 and 2.
        let rr = by("round_robin");
        assert!((rr.worst[0] - 2.5).abs() < 1e-12);
        assert!((rr.geomean[0] - (2.5f64).sqrt()).abs() < 1e-12);
        assert_eq!(rr.worst_cell[0], "fitted / a / 1x / 1 replica");
        let dynamo = by("dynamo");
        assert!((dynamo.worst[0] - 4.0).abs() < 1e-12);
        assert!((dynamo.geomean[0] - (1.25f64 * 4.0).sqrt()).abs() < 1e-12);
        assert!((dynamo.worst[2] - 2.0).abs() < 1e-12, "E2E 2000 / 1000");
        let kv = by("kvroute");
        assert!((kv.worst[1] - 1.1).abs() < 1e-12, "TTFT p99 220 / 200");
        assert!((kv.geomean[0] - 2f64.sqrt()).abs() < 1e-12);
        assert!((kv.worst[2] - 1.04).abs() < 1e-12, "E2E p99 520 / 500");

        let t = s.targets.expect("kvroute and baselines are present");
        // Cell a: TTFT p99 220 > 1.05 × 200; cell b: TTFT mean 20 > 10. E2E 520 ≤ 525 passes.
        assert_eq!(t.failures.len(), 2, "{:?}", t.failures);
        assert!(t.failures[0].contains("/ a /") && t.failures[0].contains("TTFT p99"));
        assert!(t.failures[1].contains("/ b /") && t.failures[1].contains("TTFT mean"));
        assert!(!t.failures.iter().any(|f| f.contains("E2E")));
        // Best baseline geomean: round robin √2.5 ≈ 1.581 < dynamo √5; kvroute √2 ≈ 1.414 is
        // above 0.85 × 1.581 ≈ 1.344.
        assert_eq!(t.best_baseline, "round_robin");
        assert!(!t.geomean_ok);
        assert!(!t.passed());
        let text = summary_table(&summarize("fitted", &refs));
        assert!(
            text.contains("FAIL") && text.contains("2 of 2 cells fail"),
            "{text}"
        );
    }

    #[test]
    fn a_policy_best_everywhere_scores_one_and_passes() {
        let cells = [cell(
            "a",
            vec![
                figures("round_robin", 100.0, 400.0, 1000.0),
                figures("kvroute", 50.0, 400.0, 1000.0),
            ],
        )];
        let refs: Vec<&CellResult> = cells.iter().collect();
        let s = summarize("fitted", &refs);
        assert_eq!(s.policies[1].worst, [1.0; 3]);
        assert_eq!(s.policies[1].geomean, [1.0; 3]);
        let t = s.targets.unwrap();
        assert!(t.passed(), "{t:?}");
        // Without the judged policy, nothing is checked.
        let only = [cell("a", vec![figures("round_robin", 1.0, 1.0, 1.0)])];
        let refs: Vec<&CellResult> = only.iter().collect();
        assert!(summarize("fitted", &refs).targets.is_none());
    }

    #[test]
    fn ratios_of_zero_figures_are_neutral() {
        assert_eq!(ratio(0.0, 0.0), 1.0);
        assert_eq!(ratio(3.0, 0.0), f64::INFINITY);
        assert_eq!(ratio(3.0, 1.5), 2.0);
        assert_eq!(geomean(&[]), 1.0);
        assert!((geomean(&[2.0, 8.0]) - 4.0).abs() < 1e-12);
    }

    #[test]
    fn the_report_groups_cells_by_engine_model() {
        let mut cells = table();
        let mut batch = cells[0].clone();
        batch.engine = "batch".into();
        cells.push(batch);
        let report = SuiteReport::new(cells);
        assert_eq!(report.summaries.len(), 2);
        assert_eq!(report.summaries[0].cells, 2);
        assert_eq!(report.summaries[1].engine, "batch");
        assert_eq!(report.summaries[1].cells, 1);
        let md = report.to_markdown();
        assert_eq!(md.matches("#### ").count(), 3);
        assert_eq!(md.matches("### Summary").count(), 2);
    }
}
