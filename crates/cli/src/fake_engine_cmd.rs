//! `kvroute fake-engine`: publish KV events exactly like a vLLM engine (ZMQ PUB, optional ROUTER
//! replay socket), from a JSONL script or synthetic prompts, for demos and manual tests of
//! `kvroute serve`.
//!
//! Each line of `--events FILE.jsonl` is one event, published as one batch (format:
//! [`kvroute_testkit::fake_engine::ScriptEvent`]):
//! ```json
//! {"type": "stored", "token_ids": [1, 2, 3, 4], "parent": null, "medium": "GPU"}
//! {"type": "removed", "token_ids": [1, 2, 3, 4]}
//! {"type": "removed", "block_hashes": [-3803038269031200164]}
//! {"type": "cleared"}
//! ```
//! `--prompts N --prompt-tokens T` instead publishes one `stored` batch per synthetic prompt,
//! prompts sharing prefixes by group. Publishing is bounded by `--max-batches` and `--duration`.
//!
//! `--openai --port P` is a whole mock engine instead ([`openai`]): vLLM's OpenAI routes over
//! the simulator's engine model, publishing its own KV events on `--bind`.

mod openai;

use clap::{Args, ValueEnum};
use kvroute_testkit::fake_engine::{
    FakeEngine, ScriptEvent, StoredBlocks, SyntheticPrompts, stored_event,
};
use kvroute_wire::{Encoding, RawEvent};
use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EncodingArg {
    /// `["BlockStored", ...]` (vLLM before mid-2026).
    Array,
    /// `{"type": "BlockStored", ...}` (newer vLLM).
    Map,
}

impl EncodingArg {
    pub fn wire(self) -> Encoding {
        match self {
            EncodingArg::Array => Encoding::Array,
            EncodingArg::Map => Encoding::Map,
        }
    }
}

#[derive(Args, Debug)]
pub struct FakeEngineArgs {
    /// ZMQ address of the PUB socket (what workers register as `kv_events_endpoint`).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub bind: String,
    /// ZMQ address of a ROUTER socket answering replay requests (the `replay_endpoint`).
    #[arg(long)]
    pub replay: Option<String>,
    /// Event encoding (`--openai` engines' events too).
    #[arg(long, value_enum, default_value_t = EncodingArg::Array)]
    pub encoding: EncodingArg,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// JSONL file of events to publish, one batch per line (`-` reads stdin).
    #[arg(
        long,
        required_unless_present_any = ["prompts", "openai"],
        conflicts_with = "prompts"
    )]
    pub events: Option<PathBuf>,
    /// Number of synthetic prompts to publish as stored blocks.
    #[arg(long, requires = "prompt_tokens")]
    pub prompts: Option<usize>,
    /// Tokens per synthetic prompt.
    #[arg(long, requires = "prompts")]
    pub prompt_tokens: Option<usize>,
    /// Synthetic prompts fall into this many groups sharing a prefix.
    #[arg(long, default_value_t = 4)]
    pub prefix_groups: usize,
    /// Share of each synthetic prompt taken by its group's prefix, in [0, 1].
    #[arg(long, default_value_t = 0.5)]
    pub shared_fraction: f64,
    /// Batches per second (default: as fast as possible).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Stop after this many seconds in all (waiting, publishing and lingering).
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    /// Stop after this many batches.
    #[arg(long, default_value_t = 100_000)]
    pub max_batches: u64,
    /// `data_parallel_rank` written into every batch (default: omitted).
    #[arg(long)]
    pub dp_rank: Option<u32>,
    /// Wait up to this many seconds for a subscriber before publishing (0: do not wait).
    #[arg(long, default_value_t = 10.0)]
    pub wait_subscriber_secs: f64,
    /// Keep serving replays this many seconds after the last batch.
    #[arg(long, default_value_t = 1.0)]
    pub linger_secs: f64,
    #[command(flatten)]
    pub openai: openai::OpenAiArgs,
}

/// Prompts longer than this are refused (a demo tool should not allocate without bound).
const MAX_PROMPT_TOKENS: usize = 1 << 20;

fn seconds(name: &str, value: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| format!("--{name} must be a non-negative number of seconds, got {value}"))
}

/// The validated plan of a run.
struct Plan {
    duration: Duration,
    period: Option<Duration>,
    wait_subscriber: Duration,
    linger: Duration,
}

fn validate(args: &FakeEngineArgs) -> Result<Plan, String> {
    if args.block_size == 0 {
        return Err("--block-size must be greater than 0".to_string());
    }
    if let Some(tokens) = args.prompt_tokens
        && !(1..=MAX_PROMPT_TOKENS).contains(&tokens)
    {
        return Err(format!(
            "--prompt-tokens must be between 1 and {MAX_PROMPT_TOKENS}"
        ));
    }
    if !(0.0..=1.0).contains(&args.shared_fraction) {
        return Err("--shared-fraction must be between 0 and 1".to_string());
    }
    let period = match args.rate {
        None => None,
        Some(rate) if rate.is_finite() && rate > 0.0 => Some(seconds("rate", 1.0 / rate)?),
        Some(rate) => return Err(format!("--rate must be a positive number, got {rate}")),
    };
    Ok(Plan {
        duration: seconds("duration", args.duration)?,
        period,
        wait_subscriber: seconds("wait-subscriber-secs", args.wait_subscriber_secs)?,
        linger: seconds("linger-secs", args.linger_secs)?,
    })
}

/// Where the events come from.
enum Source {
    Script {
        name: String,
        lines: Box<dyn BufRead>,
        line: usize,
    },
    Synthetic {
        prompts: SyntheticPrompts,
        next: usize,
    },
}

impl Source {
    fn open(args: &FakeEngineArgs) -> Result<Self, String> {
        if let (Some(prompts), Some(prompt_tokens)) = (args.prompts, args.prompt_tokens) {
            return Ok(Source::Synthetic {
                prompts: SyntheticPrompts {
                    prompts,
                    prompt_tokens,
                    prefix_groups: args.prefix_groups,
                    shared_fraction: args.shared_fraction,
                },
                next: 0,
            });
        }
        let Some(path) = &args.events else {
            return Err("give --events FILE.jsonl or --prompts N --prompt-tokens T".to_string());
        };
        let lines: Box<dyn BufRead> = if path.as_os_str() == "-" {
            Box::new(std::io::BufReader::new(std::io::stdin()))
        } else {
            let file = std::fs::File::open(path)
                .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            Box::new(std::io::BufReader::new(file))
        };
        Ok(Source::Script {
            name: path.display().to_string(),
            lines,
            line: 0,
        })
    }

    /// The next event, `Ok(None)` at the end.
    fn next_event(&mut self, block_size: u32) -> Result<Option<RawEvent>, String> {
        match self {
            Source::Synthetic { prompts, next } => {
                if *next >= prompts.prompts {
                    return Ok(None);
                }
                let tokens = prompts.prompt(*next);
                *next += 1;
                let (event, _) = stored_event(&StoredBlocks {
                    token_ids: &tokens,
                    block_size,
                    ..StoredBlocks::default()
                });
                Ok(Some(event))
            }
            Source::Script { name, lines, line } => loop {
                let mut text = String::new();
                let read = lines
                    .read_line(&mut text)
                    .map_err(|e| format!("cannot read {name}: {e}"))?;
                if read == 0 {
                    return Ok(None);
                }
                *line += 1;
                match ScriptEvent::parse_line(&text) {
                    Ok(Some(event)) => return Ok(Some(event.to_raw(block_size))),
                    Ok(None) => {}
                    Err(e) => return Err(format!("{name}:{line}: {e}")),
                }
            },
        }
    }
}

pub fn run(args: &FakeEngineArgs) -> ExitCode {
    if args.openai.openai {
        return openai::run(args);
    }
    let plan = match validate(args) {
        Ok(plan) => plan,
        Err(message) => {
            eprintln!("kvroute fake-engine: {message}");
            return ExitCode::from(2);
        }
    };
    let mut source = match Source::open(args) {
        Ok(source) => source,
        Err(message) => {
            eprintln!("kvroute fake-engine: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("kvroute fake-engine: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(publish(args, &plan, &mut source))
}

async fn publish(args: &FakeEngineArgs, plan: &Plan, source: &mut Source) -> ExitCode {
    let started = Instant::now();
    let deadline = started + plan.duration;
    let encoding = args.encoding.wire();
    let mut engine = match FakeEngine::bind(&args.bind, args.replay.as_deref(), encoding).await {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("kvroute fake-engine: {e}");
            return ExitCode::FAILURE;
        }
    };
    engine.set_data_parallel_rank(args.dp_rank);
    println!(
        "kvroute fake-engine publishing on {}{} ({:?} encoding, block size {})",
        engine.pub_endpoint(),
        engine
            .replay_endpoint()
            .map(|r| format!(", replay on {r}"))
            .unwrap_or_default(),
        args.encoding,
        args.block_size
    );
    if !plan.wait_subscriber.is_zero() {
        let wait = plan
            .wait_subscriber
            .min(deadline.saturating_duration_since(Instant::now()));
        if !engine.wait_for_subscribers(1, wait).await {
            eprintln!(
                "kvroute fake-engine: no subscriber after {:.1} s; publishing anyway (a PUB socket drops what nobody receives{})",
                wait.as_secs_f64(),
                if engine.replay_endpoint().is_some() {
                    "; replays can still deliver it"
                } else {
                    ""
                }
            );
        }
    }
    let publishing = Instant::now();
    let mut published = 0u64;
    let mut outcome = ExitCode::SUCCESS;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    while published < args.max_batches {
        if let Some(period) = plan.period {
            let due = publishing + period.mul_f64(published as f64);
            if due >= deadline {
                break;
            }
            tokio::select! {
                _ = &mut interrupted => break,
                () = tokio::time::sleep_until(due) => {}
            }
        }
        if Instant::now() >= deadline {
            break;
        }
        let event = match source.next_event(args.block_size) {
            Ok(Some(event)) => event,
            Ok(None) => break,
            Err(message) => {
                eprintln!("kvroute fake-engine: {message}");
                outcome = ExitCode::from(2);
                break;
            }
        };
        if let Err(e) = engine.publish_events(vec![event]).await {
            eprintln!("kvroute fake-engine: {e}");
            outcome = ExitCode::FAILURE;
            break;
        }
        published += 1;
    }
    println!(
        "published {published} batch(es) in {:.2} s",
        publishing.elapsed().as_secs_f64()
    );
    let linger = plan
        .linger
        .min(deadline.saturating_duration_since(Instant::now()));
    if !linger.is_zero() {
        tokio::select! {
            _ = &mut interrupted => {}
            () = tokio::time::sleep(linger) => {}
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: FakeEngineArgs,
    }

    /// `kvroute fake-engine`'s flags from `argv` (also the `--openai` mode's tests).
    pub(super) fn parse(argv: &[&str]) -> Result<FakeEngineArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("fake-engine").chain(argv.iter().copied()))
            .map(|cli| cli.args)
    }

    #[test]
    fn needs_a_source() {
        assert!(parse(&[]).is_err());
        assert!(
            parse(&["--prompts", "3"]).is_err(),
            "--prompt-tokens is required"
        );
        assert!(
            parse(&[
                "--events",
                "x.jsonl",
                "--prompts",
                "3",
                "--prompt-tokens",
                "8"
            ])
            .is_err()
        );
        let args = parse(&["--prompts", "3", "--prompt-tokens", "8"]).unwrap();
        assert_eq!(args.bind, "tcp://127.0.0.1:5557");
        assert!(validate(&args).is_ok());
    }

    #[test]
    fn bad_knobs_are_named() {
        let bad = |argv: &[&str]| validate(&parse(argv).unwrap()).err().unwrap_or_default();
        assert!(bad(&["--prompts", "1", "--prompt-tokens", "0"]).contains("--prompt-tokens"));
        assert!(bad(&["--events", "-", "--block-size", "0"]).contains("--block-size"));
        assert!(bad(&["--events", "-", "--rate", "0"]).contains("--rate"));
        assert!(bad(&["--events", "-", "--duration=-1"]).contains("--duration"));
        assert!(bad(&["--events", "-", "--shared-fraction", "2"]).contains("--shared-fraction"));
    }

    #[test]
    fn synthetic_source_ends_after_n_prompts() {
        let args = parse(&[
            "--prompts",
            "2",
            "--prompt-tokens",
            "40",
            "--block-size",
            "16",
        ])
        .unwrap();
        let mut source = Source::open(&args).unwrap();
        for _ in 0..2 {
            let Some(RawEvent::Stored(stored)) = source.next_event(16).unwrap() else {
                panic!("expected a stored event");
            };
            assert_eq!(stored.block_hashes.len(), 2);
            assert_eq!(stored.token_ids.len(), 32);
        }
        assert!(source.next_event(16).unwrap().is_none());
    }
}
