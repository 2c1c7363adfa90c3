use super::*;
use std::io::Write;

/// A small Mooncake trace: `sessions` conversations of `turns` turns, each turn extending the
/// previous one, all behind a shared first block.
fn write_trace(sessions: u64, turns: u64) -> tempfile_path::TracePath {
    let path = std::env::temp_dir().join(format!(
        "kvroute-bench-index-{}-{sessions}-{turns}.jsonl",
        std::process::id()
    ));
    let mut file = std::fs::File::create(&path).expect("create trace");
    let mut next_id = 1u64;
    let mut contexts: Vec<Vec<u64>> = vec![vec![0]; sessions as usize];
    let mut t = 0u64;
    for _turn in 0..turns {
        for context in contexts.iter_mut() {
            for _ in 0..3 {
                context.push(next_id);
                next_id += 1;
            }
            t += 50;
            writeln!(
                file,
                r#"{{"timestamp": {t}, "input_length": {}, "output_length": 40, "hash_ids": {:?}}}"#,
                context.len() * 512,
                context
            )
            .expect("write row");
        }
    }
    tempfile_path::TracePath(path)
}

mod tempfile_path {
    /// A trace file removed when dropped.
    pub struct TracePath(pub std::path::PathBuf);
    impl Drop for TracePath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn args(trace: &std::path::Path) -> IndexBenchArgs {
    IndexBenchArgs {
        trace: trace.to_path_buf(),
        workers: 6,
        duplication: 3,
        window_secs: 0.2,
        rate_scale: 1.0,
        block_size: 128,
        // Small pools, so the engines evict and the index sees `Removed` events.
        num_gpu_blocks: 96,
        seed: 3,
        max_requests: None,
        spread_ms: 0.0,
        verify_sample: 10_000,
        lookup_threads: 2,
        json: None,
    }
}

#[test]
fn every_lookup_of_a_small_fleet_equals_the_reference() {
    let trace = write_trace(12, 4);
    let args = args(&trace.0);
    let schedule = schedule_from(&args).expect("schedule");
    assert_eq!(schedule.total_workers, 18);
    assert!(schedule.counts.removed_blocks > 0, "{:?}", schedule.counts);
    let report = verify::verify(&schedule, args.block_size, args.verify_sample).expect("verify");
    // Every lookup was checked, many found cached prefixes, and all equal the reference.
    assert_eq!(report.checked, schedule.counts.lookups);
    assert!(report.nonempty * 2 > report.checked, "{report:?}");
    assert_eq!(report.mismatches, 0, "{report:?}");
}

#[test]
fn the_replay_applies_every_event_and_answers_every_lookup() {
    let trace = write_trace(8, 3);
    let args = args(&trace.0);
    let schedule = schedule_from(&args).expect("schedule");
    let selector = fleet_selector(schedule.total_workers, args.block_size).expect("fleet");
    let report = replay::replay(&schedule, selector, &partition(), 2).expect("replay");
    assert_eq!(
        report.lookup_service.quantile_us(1.0) > 0.0,
        schedule.counts.lookups > 0
    );
    let json = report.to_json(
        &schedule,
        serde_json::Value::Null,
        serde_json::Value::Null,
        None,
    );
    assert_eq!(json["lookup_service"]["count"], schedule.counts.lookups);
    assert_eq!(
        json["apply_scheduled_to_done"]["count"],
        schedule.counts.batches
    );
    // After the whole schedule, the index holds what the engines' pools hold: every duplicate
    // of a worker holds the same blocks.
    assert!(report.held_pairs > 0);
    assert_eq!(report.held_pairs % 3, 0);
}

#[test]
fn a_missing_trace_and_bad_knobs_are_named() {
    let mut a = args(std::path::Path::new("/nonexistent/trace.jsonl"));
    let err = schedule_from(&a).expect_err("no trace");
    assert!(err.contains("cannot open trace"), "{err}");
    let trace = write_trace(2, 1);
    a.trace = trace.0.clone();
    a.window_secs = 0.0;
    let err = schedule_from(&a).expect_err("bad window");
    assert!(err.contains("--window-secs"), "{err}");
    a.window_secs = 1.0;
    a.workers = 0;
    let err = schedule_from(&a).expect_err("no workers");
    assert!(err.contains("workers"), "{err}");
}
