//! `kvroute fake-engine --openai --port P`: a mock OpenAI-compatible engine
//! ([`kvroute_testkit::openai_engine::MockEngine`]): vLLM's routes (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/responses`, `/tokenize`, `/health`, `/v1/models`) over the
//! simulator's engine model, streaming at its modelled pace and publishing its KV events on
//! `--bind`. It serves until SIGINT or SIGTERM (`--duration` and the script flags do not apply).

use super::FakeEngineArgs;
use crate::serve_cmd::shutdown_signal;
use clap::Args;
use kvroute_sim::EngineConfig;
use kvroute_testkit::openai_engine::{DEFAULT_KV_BLOCKS, MockEngine, MockEngineConfig};
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
#[command(next_help_heading = "Mock OpenAI engine (--openai)")]
pub struct OpenAiArgs {
    /// Serve a mock OpenAI-compatible engine (vLLM's routes) on --host:--port, publishing its
    /// KV events on --bind with --block-size, instead of publishing a script.
    #[arg(long, requires = "port", conflicts_with_all = ["events", "prompts", "replay"])]
    pub openai: bool,
    /// HTTP port (0 picks a free one; the address is printed).
    #[arg(long, requires = "openai")]
    pub port: Option<u16>,
    /// HTTP address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The served model name.
    #[arg(long, default_value = "default")]
    pub model: String,
    /// A HuggingFace tokenizer.json (default: the built-in byte-level tokenizer).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// KV blocks of the engine's pool.
    #[arg(long, default_value_t = DEFAULT_KV_BLOCKS)]
    pub kv_blocks: u64,
    /// Real seconds per modelled second (1: the modelled pace; 0.1: ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Context length: longer requests get a 400.
    #[arg(long, default_value_t = 32_768)]
    pub max_model_len: u32,
    /// Token budget of one engine step (chunked prefill).
    #[arg(long, default_value_t = 8_192)]
    pub max_num_batched_tokens: u64,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Hold every generation request this many milliseconds before the engine takes it: a slow
    /// first token on demand (the gateway's tests use it to keep a booking in prefill).
    #[arg(long, default_value_t = 0)]
    pub first_token_delay_ms: u64,
}

/// The engine's configuration and HTTP address, or what is wrong.
fn plan(args: &FakeEngineArgs) -> Result<(MockEngineConfig, SocketAddr), String> {
    let openai = &args.openai;
    let port = openai.port.ok_or("--openai needs --port")?;
    let addr = (openai.host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("--host {}: {e}", openai.host))?
        .next()
        .ok_or_else(|| format!("--host {} has no address", openai.host))?;
    if openai.kv_blocks == 0 {
        return Err("--kv-blocks must be greater than 0".to_string());
    }
    let defaults = MockEngineConfig::default();
    let config = MockEngineConfig {
        model: openai.model.clone(),
        block_size: args.block_size,
        tokenizer: openai.tokenizer.clone(),
        events_bind: Some(args.bind.clone()),
        engine: EngineConfig {
            block_size: args.block_size,
            kv_blocks: Some(openai.kv_blocks),
            nominal_kv_blocks: openai.kv_blocks,
            max_num_batched_tokens: openai.max_num_batched_tokens,
            max_num_seqs: openai.max_num_seqs,
            ..defaults.engine
        },
        time_scale: openai.time_scale,
        max_model_len: openai.max_model_len,
        ..defaults
    };
    config
        .validated_engine()
        .map_err(|reason| format!("invalid engine settings: {reason}"))?;
    Ok((config, addr))
}

pub fn run(args: &FakeEngineArgs) -> ExitCode {
    let (config, addr) = match plan(args) {
        Ok(plan) => plan,
        Err(message) => {
            eprintln!("kvroute fake-engine: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("kvroute fake-engine: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let delay = Duration::from_millis(args.openai.first_token_delay_ms);
    runtime.block_on(serve(config, addr, delay))
}

async fn serve(
    config: MockEngineConfig,
    addr: SocketAddr,
    first_token_delay: Duration,
) -> ExitCode {
    let block_size = config.block_size;
    let engine = match MockEngine::start_on(config, addr).await {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("kvroute fake-engine: cannot start the mock engine on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    engine.set_first_token_delay(first_token_delay);
    println!(
        "kvroute fake-engine serving model {} on {} (OpenAI routes), KV events on {} (block size {block_size})",
        engine.model(),
        engine.url(),
        engine.events_endpoint().unwrap_or_default(),
    );
    // The line tells a script the ports (with --port 0 or a port-0 --bind): out at once.
    let _ = std::io::stdout().flush();
    shutdown_signal().await;
    engine.shutdown().await;
    println!("kvroute fake-engine stopped");
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_engine_cmd::tests::parse;

    #[test]
    fn openai_mode_needs_a_port_and_no_script() {
        assert!(parse(&["--openai"]).is_err(), "--port is required");
        assert!(parse(&["--port", "8100"]).is_err(), "--port needs --openai");
        assert!(parse(&["--openai", "--port", "1", "--events", "x.jsonl"]).is_err());
        assert!(
            parse(&[
                "--openai",
                "--port",
                "1",
                "--prompts",
                "1",
                "--prompt-tokens",
                "1"
            ])
            .is_err()
        );
        let args = parse(&["--openai", "--port", "8100"]).unwrap();
        let (config, addr) = plan(&args).unwrap();
        assert_eq!(addr, "127.0.0.1:8100".parse().unwrap());
        assert_eq!(config.model, "default");
        assert_eq!(config.block_size, 16);
        assert_eq!(config.events_bind.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(config.engine.kv_blocks, Some(DEFAULT_KV_BLOCKS));
    }

    #[test]
    fn bad_engine_knobs_are_named() {
        let bad = |argv: &[&str]| {
            let mut all = vec!["--openai", "--port", "0"];
            all.extend_from_slice(argv);
            plan(&parse(&all).unwrap()).err().unwrap_or_default()
        };
        assert!(bad(&["--kv-blocks", "0"]).contains("--kv-blocks"));
        assert!(bad(&["--time-scale=-1"]).contains("time scale"));
        assert!(bad(&["--block-size", "0"]).contains("block-size"));
        assert!(bad(&["--max-num-seqs", "0"]).contains("max-num-seqs"));
    }
}
