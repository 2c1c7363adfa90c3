//! `kvroute sim --pd` and `kvroute sim --suite-pd`: aggregated against disaggregated
//! prefill/decode fleets of the same size (`kvroute_sim::pd`).
//!
//! `--pd` (or `--prefill-engines N` / `--decode-engines M`) runs one workload on an aggregated
//! fleet of N + M engines under the aggregated policies and on the N P + M D fleet under the
//! P/D policies, and prints one line each. `--suite-pd` runs the suite's shapes at 2× and 4×
//! load on `--workers` engines, aggregated and split as `--pd-splits` says, and prints each
//! entry's ratio to the best of each cell.

use crate::sim_cmd::{
    SimArgs, engine_model, kvroute_settings, list, load_workload, sim_config, suite_jobs,
    suite_progress, suite_shapes,
};
use clap::Args;
use kvroute_sim::pd::compare::{
    PdEntry, PdSuiteOptions, compare, default_entries, run_pd_suite, suite_markdown, table,
};
use kvroute_sim::pd::{
    DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_TRANSFER_BYTES_PER_SEC, PdConfig, TransferModel,
};
use kvroute_sim::{SimConfig, Workload};
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct PdArgs {
    /// Compare an aggregated fleet with a disaggregated prefill/decode one of the same size on
    /// the workload (--prefill-engines, --decode-engines; see crates/sim/README.md).
    #[arg(long, conflicts_with_all = ["suite", "suite_pd"])]
    pub pd: bool,
    /// Prefill engines of the P/D fleet (implies --pd; default 2).
    #[arg(long, conflicts_with_all = ["suite", "suite_pd"])]
    pub prefill_engines: Option<usize>,
    /// Decode engines of the P/D fleet (implies --pd; default --workers minus the prefill
    /// engines).
    #[arg(long, conflicts_with_all = ["suite", "suite_pd"])]
    pub decode_engines: Option<usize>,
    /// Bandwidth of a KV transfer from a prefill to a decode engine, GB/s.
    #[arg(long, default_value_t = DEFAULT_TRANSFER_BYTES_PER_SEC / 1e9)]
    pub pd_transfer_gbps: f64,
    /// KV bytes per token (all layers, K and V): a block is this × --block-size bytes.
    #[arg(long, default_value_t = DEFAULT_KV_BYTES_PER_TOKEN)]
    pub pd_kv_bytes_per_token: u64,
    /// `kvroute-pd`: a request whose best decode engine lacks at most this many of its prompt's
    /// tokens runs there whole, without a prefill engine.
    #[arg(long, default_value_t = kvroute_core::selector::DEFAULT_PD_BYPASS_TOKENS)]
    pub pd_bypass_tokens: u64,
    /// Run the suite's shapes on aggregated and P/D fleets of --workers engines instead of one
    /// workload.
    #[arg(long, conflicts_with_all = ["trace", "synthetic", "out"])]
    pub suite_pd: bool,
    /// With --suite-pd: these load multipliers, comma-separated.
    #[arg(long, requires = "suite_pd", default_value = "2,4")]
    pub suite_pd_loads: String,
    /// With --suite-pd: the P/D splits, `P+D` comma-separated, each adding up to --workers.
    #[arg(long, requires = "suite_pd", default_value = "2+6,3+5")]
    pub pd_splits: String,
}

impl PdArgs {
    /// Whether a single-workload P/D comparison was asked for.
    pub fn wanted(&self) -> bool {
        self.pd || self.prefill_engines.is_some() || self.decode_engines.is_some()
    }
}

/// The P/D run's base configuration: the simulator's engine for both pools, the transfer flags.
fn base_config(args: &SimArgs, sim: &SimConfig) -> Result<PdConfig, String> {
    let gbps = args.pd.pd_transfer_gbps;
    if !(gbps.is_finite() && gbps > 0.0) {
        return Err(format!(
            "invalid --pd-transfer-gbps: must be a positive number, got {gbps}"
        ));
    }
    if args.pd.pd_kv_bytes_per_token == 0 {
        return Err("invalid --pd-kv-bytes-per-token: must be greater than 0".into());
    }
    Ok(PdConfig {
        prefill_engines: 0,
        decode_engines: sim.workers,
        prefill_engine: sim.engine,
        decode_engine: sim.engine,
        transfer: TransferModel {
            kv_bytes_per_token: args.pd.pd_kv_bytes_per_token,
            bytes_per_sec: gbps * 1e9,
        },
        event_delay: sim.event_delay,
        seed: sim.seed,
        bypass_tokens: args.pd.pd_bypass_tokens,
    })
}

/// The split `--prefill-engines` / `--decode-engines` name (with `--workers` for the missing
/// one).
pub fn split(args: &SimArgs) -> Result<(usize, usize), String> {
    let prefill = args.pd.prefill_engines.unwrap_or(2);
    let decode = match args.pd.decode_engines {
        Some(d) => d,
        None => args
            .workers
            .checked_sub(prefill)
            .filter(|d| *d > 0)
            .ok_or_else(|| {
                format!(
                    "invalid --prefill-engines: {prefill} leaves no decode engine of --workers {}",
                    args.workers
                )
            })?,
    };
    if prefill == 0 || decode == 0 {
        return Err(format!(
            "invalid --prefill-engines/--decode-engines: both must be at least 1, got {prefill} and {decode}"
        ));
    }
    Ok((prefill, decode))
}

pub fn run_pd_cmd(args: &SimArgs) -> Result<(), String> {
    let started = Instant::now();
    let sim = sim_config(args)?;
    if sim.router_replicas > 1 || sim.queue.is_some() {
        return Err(
            "invalid --pd: router replicas and the router queue are not simulated on P/D fleets"
                .into(),
        );
    }
    let (prefill, decode) = split(args)?;
    let base = base_config(args, &sim)?;
    let entries = default_entries(prefill + decode, &[(prefill, decode)]);
    let workload: Workload = load_workload(args)?;
    let kvroute = kvroute_settings(args)?;
    let runs = compare(
        &workload,
        &base,
        &entries,
        kvroute,
        suite_jobs(args),
        Instant::now(),
    )
    .map_err(|e| e.to_string())?;
    println!(
        "workload: {} — {} requests, {} prompt tokens; {} engines ({} aggregated, or {}P+{}D), \
         KV transfer {} GB/s at {} bytes a token, event delay {} ms, seed {}",
        workload.name,
        workload.requests.len(),
        workload.prompt_tokens(),
        prefill + decode,
        prefill + decode,
        prefill,
        decode,
        args.pd.pd_transfer_gbps,
        args.pd.pd_kv_bytes_per_token,
        sim.event_delay.as_secs_f64() * 1e3,
        sim.seed
    );
    let figures: Vec<_> = runs.into_iter().map(|(f, _)| f).collect();
    print!("{}", table(&figures));
    eprintln!(
        "simulated {} fleets and policies in {:.1} s",
        figures.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The P/D suite the flags describe.
pub fn suite_pd_options(args: &SimArgs) -> Result<PdSuiteOptions, String> {
    let sim = sim_config(args)?;
    let loads = list("suite-pd-loads", &args.pd.suite_pd_loads, |l| {
        match l.parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(format!("a load must be a positive number, got `{l}`")),
        }
    })?;
    let splits = list("pd-splits", &args.pd.pd_splits, |s| {
        let parsed = s
            .split_once('+')
            .and_then(|(p, d)| Some((p.trim().parse().ok()?, d.trim().parse().ok()?)));
        match parsed {
            Some((p, d)) if p > 0 && d > 0 && p + d == sim.workers => Ok((p, d)),
            _ => Err(format!(
                "expected P+D (both at least 1) adding up to --workers {}, got `{s}`",
                sim.workers
            )),
        }
    })?;
    Ok(PdSuiteOptions {
        shapes: suite_shapes(args)?,
        loads,
        engines: list("suite-engines", &args.suite_engines, |e| {
            engine_model(e, args)
        })?,
        entries: default_entries(sim.workers, &splits),
        base: base_config(args, &sim)?,
        kvroute: kvroute_settings(args)?,
    })
}

pub fn run_suite_pd_cmd(args: &SimArgs) -> Result<(), String> {
    let started = Instant::now();
    let options = suite_pd_options(args)?;
    let jobs = suite_jobs(args);
    let total =
        options.engines.len() * options.shapes.len() * options.loads.len() * options.entries.len();
    let bar = suite_progress("suite-pd", total, args);
    let cells = run_pd_suite(&options, jobs, Instant::now(), &|done, _| {
        bar.set_position(done as u64)
    })
    .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
    let base = &options.base;
    let mut md = format!(
        "P/D suite: {} engines, aggregated or split {}; {} KV blocks of {} tokens each, KV \
         transfer {} GB/s at {} bytes a token, event delay {} ms, seed {}; loads {:?}.\n",
        base.decode_engines,
        args.pd.pd_splits,
        base.decode_engine
            .kv_blocks
            .map_or_else(|| "unlimited".to_string(), |b| b.to_string()),
        base.decode_engine.block_size,
        base.transfer.bytes_per_sec / 1e9,
        base.transfer.kv_bytes_per_token,
        base.event_delay.as_secs_f64() * 1e3,
        base.seed,
        options.loads,
    );
    md.push_str(&suite_markdown(&cells));
    print!("{md}");
    if let Some(dir) = &args.suite_out {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create --suite-out {}: {e}", dir.display()))?;
        let names: Vec<String> = options.entries.iter().map(PdEntry::name).collect();
        let json = serde_json::json!({
            "settings": {
                "engines": base.decode_engines,
                "entries": names,
                "loads": options.loads,
                "transfer_bytes_per_sec": base.transfer.bytes_per_sec,
                "kv_bytes_per_token": base.transfer.kv_bytes_per_token,
                "event_delay_ms": base.event_delay.as_secs_f64() * 1e3,
                "seed": base.seed,
            },
            "cells": cells,
        });
        let mut text = serde_json::to_string_pretty(&json)
            .map_err(|e| format!("cannot serialise the P/D suite: {e}"))?;
        text.push('\n');
        let (json_path, md_path) = (dir.join("pd.json"), dir.join("pd.md"));
        std::fs::write(&json_path, text)
            .map_err(|e| format!("cannot write {}: {e}", json_path.display()))?;
        std::fs::write(&md_path, &md)
            .map_err(|e| format!("cannot write {}: {e}", md_path.display()))?;
        println!("wrote {} and {}", json_path.display(), md_path.display());
    }
    eprintln!(
        "suite-pd: {} runs in {:.1} s on {} threads",
        total,
        started.elapsed().as_secs_f64(),
        jobs.clamp(1, total.max(1))
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn args(line: &[&str]) -> Result<SimArgs, clap::Error> {
        let mut argv = vec!["sim"];
        argv.extend_from_slice(line);
        Cli::try_parse_from(argv).map(|c| c.sim)
    }

    #[test]
    fn pd_flags_pick_the_split_and_the_transfer() {
        let a = args(&["--pd"]).unwrap();
        assert!(a.pd.wanted());
        assert_eq!(split(&a).unwrap(), (2, 6));
        let a = args(&["--prefill-engines", "3", "--workers", "8"]).unwrap();
        assert!(a.pd.wanted());
        assert_eq!(split(&a).unwrap(), (3, 5));
        let a = args(&["--prefill-engines", "1", "--decode-engines", "2"]).unwrap();
        assert_eq!(split(&a).unwrap(), (1, 2));
        assert!(!args(&[]).unwrap().pd.wanted());
        for bad in [
            vec!["--prefill-engines", "8"],
            vec!["--prefill-engines", "0"],
            vec!["--decode-engines", "0"],
        ] {
            let err = split(&args(&bad).unwrap()).unwrap_err();
            assert!(err.contains("--prefill-engines"), "{err}");
        }
        let a = args(&["--pd", "--pd-transfer-gbps", "0"]).unwrap();
        let err = base_config(&a, &sim_config(&a).unwrap()).unwrap_err();
        assert!(err.contains("--pd-transfer-gbps"), "{err}");
        let a = args(&["--pd", "--pd-transfer-gbps", "25"]).unwrap();
        let c = base_config(&a, &sim_config(&a).unwrap()).unwrap();
        assert_eq!(c.transfer.bytes_per_sec, 25e9);
        assert!(args(&["--pd", "--suite"]).is_err());
    }

    #[test]
    fn suite_pd_flags_select_cells_and_splits() {
        let o = suite_pd_options(&args(&["--suite-pd"]).unwrap()).unwrap();
        assert_eq!(o.loads, vec![2.0, 4.0]);
        assert_eq!(o.shapes.len(), 6);
        assert_eq!(o.engines.len(), 2);
        assert_eq!(o.entries.len(), 3 + 2 * 3);
        let o = suite_pd_options(
            &args(&[
                "--suite-pd",
                "--workers",
                "4",
                "--pd-splits",
                "1+3",
                "--suite-shapes",
                "no_reuse",
                "--suite-engines",
                "fitted",
            ])
            .unwrap(),
        )
        .unwrap();
        assert_eq!(o.entries.len(), 3 + 3);
        assert_eq!(o.entries[3].name(), "1P+3D / pd-round-robin");
        for bad in [
            vec!["--pd-splits", "2+5"],
            vec!["--pd-splits", "0+8"],
            vec!["--pd-splits", "x"],
            vec!["--suite-pd-loads", "0"],
        ] {
            let mut line = vec!["--suite-pd"];
            line.extend(bad);
            let err = suite_pd_options(&args(&line).unwrap()).err().unwrap();
            assert!(
                err.contains("--pd-splits") || err.contains("--suite-pd-loads"),
                "{err}"
            );
        }
        // The suite's flags work with either suite; the P/D suite's only with it.
        assert!(args(&["--suite-pd", "--suite-shapes", "no_reuse"]).is_ok());
        assert!(args(&["--suite", "--suite-pd-loads", "2"]).is_err());
        assert!(args(&["--suite-pd", "--synthetic", "2x2"]).is_err());
    }

    #[test]
    fn a_pd_suite_run_writes_its_tables() {
        let dir = std::env::temp_dir().join(format!("kvroute-pd-suite-{}", std::process::id()));
        let a = args(&[
            "--suite-pd",
            "--suite-shapes",
            "no_reuse",
            "--suite-pd-loads",
            "4",
            "--suite-engines",
            "fitted",
            "--workers",
            "4",
            "--pd-splits",
            "1+3",
            "--no-progress",
            "--suite-out",
            dir.to_str().unwrap(),
        ])
        .unwrap();
        run_suite_pd_cmd(&a).unwrap();
        let md = std::fs::read_to_string(dir.join("pd.md")).unwrap();
        assert!(md.contains("ITL p99 ÷ best of the cell"), "{md}");
        assert!(md.contains("1P+3D / kvroute-pd"), "{md}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("pd.json")).unwrap()).unwrap();
        let cells = json["cells"].as_array().unwrap();
        assert_eq!(cells.len(), 1);
        assert_eq!(cells[0]["entries"].as_array().unwrap().len(), 6);
        std::fs::remove_dir_all(&dir).ok();
    }
}
