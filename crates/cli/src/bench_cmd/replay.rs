//! The timed replay: threads against one `RwLock<Selector>`, as in the service.
//!
//! - **Events** (the applier's part): at each batch's deadline, or at once when behind, the
//!   thread takes the write lock and applies the due batches through `Selector::apply_events`,
//!   up to [`BLOCKS_PER_HOLD`] blocks a hold (one larger batch goes whole), then unlocks fairly.
//!   The queue is implicit: a batch is due from its deadline, and waits until the thread gets to
//!   it. Unlike the service's applier there is no lock budget (a cap on the write lock's share of
//!   time), so the bench measures what the index can apply, not the budget.
//! - **Lookups** (a select's index walk), on `lookup_threads` threads (the service's HTTP
//!   runtime has one a core), lookups dealt round robin: at each lookup's deadline, or at once
//!   when behind, a thread takes the read lock and runs `Selector::index_walk`, the walk
//!   `select` runs before scoring.
//!
//! Every operation is issued at an absolute deadline from one start instant, whatever happened
//! before it (open loop), and the clock stops when the last operation of either thread is done
//! (drain-inclusive).

use super::verify::VerifyReport;
use kvroute_core::error::PartitionKey;
use kvroute_core::event::KvEvent;
use kvroute_core::selector::Selector;
use kvroute_sim::index_bench::{IndexSchedule, OpKind, ScheduledOp};
use parking_lot::{RwLock, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Blocks applied per write-lock hold: the service applier's `APPLY_BLOCKS_PER_LOCK`.
const BLOCKS_PER_HOLD: u64 = 256;

/// A latency distribution in nanoseconds.
#[derive(Debug, Clone, Default)]
pub struct Latencies(Vec<u64>);

impl Latencies {
    fn push(&mut self, d: Duration) {
        self.0.push(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    fn sort(&mut self) {
        self.0.sort_unstable();
    }

    /// The `q` quantile (sorted first), in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        let i = ((self.0.len() - 1) as f64 * q).round() as usize;
        self.0[i.min(self.0.len() - 1)] as f64 / 1e3
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.0.len(),
            "p50_us": self.quantile_us(0.5),
            "p90_us": self.quantile_us(0.9),
            "p99_us": self.quantile_us(0.99),
            "p999_us": self.quantile_us(0.999),
            "max_us": self.quantile_us(1.0),
        })
    }
}

/// What the replay measured.
#[derive(Debug, Clone, Default)]
pub struct ReplayReport {
    /// From the start instant to the last completion.
    pub wall: Duration,
    /// The schedule's span (its last deadline is at most this).
    pub span: Duration,
    /// Lookups: the walk under the read lock.
    pub lookup_service: Latencies,
    /// Lookups: from the deadline to the answer (issue lag and lock wait included).
    pub lookup_scheduled_to_done: Latencies,
    /// Lookups: from the deadline to asking for the read lock (a thread still busy with earlier
    /// lookups, or woken late, comes late).
    pub lookup_issue_lag: Latencies,
    /// Lookups: from asking for the read lock to holding it.
    pub lookup_lock_wait: Latencies,
    /// Event batches: from the deadline to the end of the hold that applied it.
    pub apply_scheduled_to_done: Latencies,
    /// Write-lock holds, from asking for the lock to releasing it.
    pub hold: Latencies,
    /// Ranks listed in the answers, summed over the lookups (what the walks returned).
    pub matched_ranks: u64,
    /// Members of the answers' floors, summed over the lookups (ranks that matched alike, not
    /// listed one by one).
    pub floor_members: u64,
    /// When each thread finished, from the start.
    pub lookups_done: Duration,
    pub events_done: Duration,
    /// `(block, rank)` pairs and distinct blocks indexed at the end, and the index's estimate
    /// of its bytes.
    pub held_pairs: usize,
    pub indexed_blocks: usize,
    pub index_bytes: usize,
    /// CPU time the process used during the replay (all threads), when known.
    pub cpu_secs: Option<f64>,
    /// After the replay: deleting worker 0 (its blocks leave the index), the write-lock hold a
    /// deregistration or an engine's `Cleared` costs at this size.
    pub delete_worker: Duration,
}

/// Returns at `deadline`: sleeping, then with `spin` spinning through the last 200 µs so the
/// operation is issued on time rather than when the scheduler wakes the thread (tens of µs late).
/// The events thread does not spin: at tens of thousands of batches a second it would spin
/// nearly all the time, taking a core from the lookups, where the service's applier sleeps on
/// its queue; its batches come the oversleep late instead (in `apply_scheduled_to_done`).
fn wait_until(deadline: Instant, spin: bool) {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if !spin {
            std::thread::sleep(left);
        } else if left > Duration::from_micros(200) {
            std::thread::sleep(left - Duration::from_micros(100));
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Takes the read lock, spinning rather than sleeping while a write hold (tens of microseconds)
/// ends: a thread put to sleep waits for the scheduler to wake it, which on a busy host costs
/// more than the hold and would measure the kernel, not the index. Past a bound it sleeps.
fn read_spinning(lock: &RwLock<Selector>) -> parking_lot::RwLockReadGuard<'_, Selector> {
    let until = Instant::now() + Duration::from_micros(500);
    loop {
        if let Some(guard) = lock.try_read() {
            return guard;
        }
        if Instant::now() > until {
            return lock.read();
        }
        std::hint::spin_loop();
    }
}

/// Replays the schedule into `selector` (its workers registered). See the module documentation.
pub fn replay(
    schedule: &IndexSchedule,
    selector: Selector,
    partition: &PartitionKey,
    lookup_threads: usize,
) -> Result<ReplayReport, String> {
    let lookup_threads = lookup_threads.max(1);
    let batch_blocks: Vec<u64> = schedule.batches.iter().map(|b| blocks_of(b)).collect();
    let (lookups, events): (Vec<&ScheduledOp>, Vec<&ScheduledOp>) = schedule
        .ops
        .iter()
        .partition(|op| matches!(op.kind, OpKind::Lookup { .. }));
    let lock = RwLock::new(selector);
    // Warm the prompts' pages before the clock starts, as the engines' memory would be.
    let warm: u64 = schedule
        .prompts
        .iter()
        .map(|p| p.first().copied().unwrap_or(0))
        .fold(0, |a, b| a ^ b);
    std::hint::black_box(warm);
    let start = Instant::now() + Duration::from_millis(20);
    let mut report = ReplayReport {
        span: Duration::from_nanos(schedule.span_nanos),
        ..ReplayReport::default()
    };
    std::thread::scope(|scope| {
        let lock = &lock;
        let batch_blocks = &batch_blocks;
        let events_thread = scope.spawn(move || {
            let mut apply = Latencies::default();
            let mut hold = Latencies::default();
            let mut i = 0;
            while i < events.len() {
                wait_until(
                    start + Duration::from_nanos(events[i].deadline_nanos),
                    false,
                );
                let asked = Instant::now();
                let mut guard = lock.write();
                let first = i;
                let mut blocks = 0;
                while let Some(op) = events.get(i) {
                    if i > first
                        && (blocks >= BLOCKS_PER_HOLD
                            || start + Duration::from_nanos(op.deadline_nanos) > asked)
                    {
                        break;
                    }
                    if let OpKind::Events { batch } = op.kind {
                        let batch = batch as usize;
                        guard.apply_events(op.worker_id, 0, &schedule.batches[batch]);
                        blocks += batch_blocks[batch];
                    }
                    i += 1;
                }
                RwLockWriteGuard::unlock_fair(guard);
                let done = Instant::now();
                hold.push(done - asked);
                for op in &events[first..i] {
                    apply.push(done - (start + Duration::from_nanos(op.deadline_nanos)));
                }
            }
            (apply, hold, start.elapsed())
        });
        let lanes: Vec<_> = (0..lookup_threads)
            .map(|lane| {
                let lookups = &lookups;
                scope.spawn(move || {
                    let mut service = Latencies::default();
                    let mut scheduled = Latencies::default();
                    let mut lag = Latencies::default();
                    let mut lock_wait = Latencies::default();
                    let mut matched = 0u64;
                    let mut floor_members = 0u64;
                    for op in lookups.iter().skip(lane).step_by(lookup_threads) {
                        let OpKind::Lookup { prompt } = op.kind else {
                            continue;
                        };
                        let deadline = start + Duration::from_nanos(op.deadline_nanos);
                        wait_until(deadline, true);
                        let asked = Instant::now();
                        let guard = read_spinning(lock);
                        let began = Instant::now();
                        lag.push(asked - deadline);
                        lock_wait.push(began - asked);
                        let answer =
                            guard.index_walk(partition, &schedule.prompts[prompt as usize]);
                        drop(guard);
                        let done = Instant::now();
                        if let Some(a) = answer {
                            matched += a.listed.len() as u64;
                            floor_members += a.floor.map_or(0, |f| f.count() as u64);
                        }
                        service.push(done - began);
                        scheduled.push(done - deadline);
                    }
                    (
                        service,
                        scheduled,
                        lag,
                        lock_wait,
                        (matched, floor_members),
                        start.elapsed(),
                    )
                })
            })
            .collect();
        let (apply, hold, events_done) = events_thread
            .join()
            .map_err(|_| "the events thread panicked".to_string())?;
        for lane in lanes {
            let (service, scheduled, lag, lock_wait, (matched, floor_members), done) = lane
                .join()
                .map_err(|_| "a lookup thread panicked".to_string())?;
            report.lookup_service.0.extend(service.0);
            report.lookup_scheduled_to_done.0.extend(scheduled.0);
            report.lookup_issue_lag.0.extend(lag.0);
            report.lookup_lock_wait.0.extend(lock_wait.0);
            report.matched_ranks += matched;
            report.floor_members += floor_members;
            report.lookups_done = report.lookups_done.max(done);
        }
        report.apply_scheduled_to_done = apply;
        report.hold = hold;
        report.events_done = events_done;
        Ok::<(), String>(())
    })?;
    report.wall = report.events_done.max(report.lookups_done);
    for l in [
        &mut report.lookup_service,
        &mut report.lookup_scheduled_to_done,
        &mut report.lookup_issue_lag,
        &mut report.lookup_lock_wait,
        &mut report.apply_scheduled_to_done,
        &mut report.hold,
    ] {
        l.sort();
    }
    let selector = lock.into_inner();
    if let Some((_, blocks, pairs)) = selector
        .index_sizes()
        .into_iter()
        .find(|(k, _, _)| k == partition)
    {
        report.indexed_blocks = blocks;
        report.held_pairs = pairs;
    }
    report.index_bytes = selector.index_memory_bytes(partition).unwrap_or(0);
    let mut selector = selector;
    let began = Instant::now();
    selector
        .delete_worker(0)
        .map_err(|e| format!("deleting worker 0: {e}"))?;
    report.delete_worker = began.elapsed();
    Ok(report)
}

fn blocks_of(batch: &[KvEvent]) -> u64 {
    batch
        .iter()
        .map(|e| match e {
            KvEvent::Stored { blocks, .. } => blocks.len() as u64,
            KvEvent::Removed { engine_hashes, .. } => engine_hashes.len() as u64,
            KvEvent::Cleared => 0,
        })
        .sum()
}

impl ReplayReport {
    /// Time after the schedule's span until the last completion.
    pub fn drain(&self) -> Duration {
        self.wall.saturating_sub(self.span)
    }

    /// Whether replay plus drain took at most 1.10 × the span.
    pub fn kept_up(&self) -> bool {
        self.wall.as_secs_f64() <= 1.10 * self.span.as_secs_f64()
    }

    fn rate(&self, ops: u64, over: Duration) -> f64 {
        ops as f64 / over.as_secs_f64().max(1e-9)
    }

    pub fn bytes_per_pair(&self) -> f64 {
        self.index_bytes as f64 / (self.held_pairs.max(1)) as f64
    }

    pub fn to_json(
        &self,
        schedule: &IndexSchedule,
        config: serde_json::Value,
        memory: serde_json::Value,
        verify: Option<&VerifyReport>,
    ) -> serde_json::Value {
        let c = schedule.counts;
        serde_json::json!({
            "config": config,
            "denominators": {
                "logical_ops": c.logical_ops(),
                "lookups": c.lookups,
                "stored_events": c.stored_events,
                "removed_events": c.removed_events,
                "cleared_events": c.cleared_events,
                "block_ops": c.block_ops(),
                "lookup_blocks": c.lookup_blocks,
                "stored_blocks": c.stored_blocks,
                "removed_blocks": c.removed_blocks,
                "batches": c.batches,
            },
            "span_secs": self.span.as_secs_f64(),
            "wall_secs": self.wall.as_secs_f64(),
            "drain_secs": self.drain().as_secs_f64(),
            "kept_up": self.kept_up(),
            "replay_cpu_secs": self.cpu_secs,
            "offered_ops_per_sec": self.rate(c.logical_ops(), self.span),
            "achieved_ops_per_sec": self.rate(c.logical_ops(), self.wall),
            "offered_block_ops_per_sec": self.rate(c.block_ops(), self.span),
            "achieved_block_ops_per_sec": self.rate(c.block_ops(), self.wall),
            "lookup_service": self.lookup_service.json(),
            "lookup_scheduled_to_done": self.lookup_scheduled_to_done.json(),
            "lookup_issue_lag": self.lookup_issue_lag.json(),
            "lookup_lock_wait": self.lookup_lock_wait.json(),
            "apply_scheduled_to_done": self.apply_scheduled_to_done.json(),
            "write_hold": self.hold.json(),
            "delete_worker_us": self.delete_worker.as_secs_f64() * 1e6,
            "mean_listed_ranks": self.matched_ranks as f64 / c.lookups.max(1) as f64,
            "mean_floor_members": self.floor_members as f64 / c.lookups.max(1) as f64,
            "index": {
                "indexed_blocks": self.indexed_blocks,
                "held_pairs": self.held_pairs,
                "estimated_bytes": self.index_bytes,
                "bytes_per_pair": self.bytes_per_pair(),
            },
            "memory": memory,
            "verify": verify.map(|v| serde_json::json!({
                "checked": v.checked,
                "mismatches": v.mismatches,
                "nonempty_answers": v.nonempty,
            })),
        })
    }

    /// The human-readable report.
    pub fn render(
        &self,
        schedule: &IndexSchedule,
        peak_rss: Option<u64>,
        verify: Option<&VerifyReport>,
    ) -> String {
        let c = schedule.counts;
        let mut out = String::new();
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        out += &format!(
            "workers {}  ops {} (lookups {}, stored {}, removed {}, cleared {})  blocks {} (lookup {}, stored {}, removed {})\n",
            schedule.total_workers,
            c.logical_ops(),
            c.lookups,
            c.stored_events,
            c.removed_events,
            c.cleared_events,
            c.block_ops(),
            c.lookup_blocks,
            c.stored_blocks,
            c.removed_blocks,
        );
        out += &format!(
            "span {:.2} s  wall {:.3} s  drain {:.3} s  kept_up {}\n",
            self.span.as_secs_f64(),
            self.wall.as_secs_f64(),
            self.drain().as_secs_f64(),
            self.kept_up(),
        );
        if let Some(cpu) = self.cpu_secs {
            out += &format!(
                "replay CPU {cpu:.2} s ({:.2} cores busy on average)\n",
                cpu / self.wall.as_secs_f64().max(1e-9)
            );
        }
        out += &format!(
            "ops/s offered {:.0} achieved {:.0}   block ops/s offered {:.0} achieved {:.0}\n",
            self.rate(c.logical_ops(), self.span),
            self.rate(c.logical_ops(), self.wall),
            self.rate(c.block_ops(), self.span),
            self.rate(c.block_ops(), self.wall),
        );
        let line = |name: &str, l: &Latencies| {
            format!(
                "{name:<26} p50 {:>9.1} us  p99 {:>9.1} us  p99.9 {:>9.1} us  max {:>9.1} us\n",
                l.quantile_us(0.5),
                l.quantile_us(0.99),
                l.quantile_us(0.999),
                l.quantile_us(1.0)
            )
        };
        out += &line("lookup service", &self.lookup_service);
        out += &line("lookup scheduled-to-done", &self.lookup_scheduled_to_done);
        out += &line("  of which issue lag", &self.lookup_issue_lag);
        out += &line("  of which lock wait", &self.lookup_lock_wait);
        out += &line("apply scheduled-to-done", &self.apply_scheduled_to_done);
        out += &line("write-lock hold", &self.hold);
        let lookups = c.lookups.max(1) as f64;
        out += &format!(
            "answers: {:.1} ranks listed, {:.1} in the floor on average\n",
            self.matched_ranks as f64 / lookups,
            self.floor_members as f64 / lookups,
        );
        out += &format!(
            "deleting one worker afterwards: {:.1} ms\n",
            self.delete_worker.as_secs_f64() * 1e3
        );
        out += &format!(
            "index: {} blocks, {} (block, worker) pairs, {:.1} MiB estimated, {:.1} bytes/pair; peak RSS {}\n",
            self.indexed_blocks,
            self.held_pairs,
            mib(self.index_bytes as u64),
            self.bytes_per_pair(),
            peak_rss.map_or("n/a".to_string(), |b| format!("{:.1} MiB", mib(b))),
        );
        if let Some(v) = verify {
            out += &format!(
                "verify: {} sampled lookups ({} non-empty), {} differ from the reference\n",
                v.checked, v.nonempty, v.mismatches
            );
        }
        out
    }
}
