//! `kvroute fake-engine --openai --port P`: a mock OpenAI-compatible engine
//! ([`kvroute_testkit::openai_engine::MockEngine`]): vLLM's routes (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/responses`, `/tokenize`, `/health`, `/v1/models`) over the
//! simulator's engine model, streaming at its modelled pace and publishing its KV events on
//! `--bind`. It serves until SIGINT or SIGTERM (`--duration` and the script flags do not apply).

use super::FakeEngineArgs;
use crate::serve_cmd::shutdown_signal;
use clap::Args;
use kvroute_sim::EngineConfig;
use kvroute_testkit::openai_engine::{
    DEFAULT_BOOTSTRAP_PORT, DEFAULT_KV_BLOCKS, DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_KV_TRANSFER_GBPS, MockEngine, MockEngineConfig, PdConfig, PdProtocol, PdRole,
};
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
    /// Tokens put before every prompt the engine generates from (not in /tokenize), as a chat
    /// template the router does not know would: a way to see the router report
    /// `tokenizer_mismatch`.
    #[arg(long, default_value_t = 0)]
    pub prompt_prefix_tokens: u32,
    /// Answer `usage.prompt_tokens_details: null`, as vLLM does without
    /// --enable-prompt-tokens-details (by default the mock reports `cached_tokens`).
    #[arg(long)]
    pub no_prompt_tokens_details: bool,
    /// Disaggregated prefill/decode role: `prefill` computes prompts and holds their KV for a
    /// decode engine, `decode` pulls it before decoding, `both` runs whole requests.
    #[arg(long, value_enum, default_value_t = RoleArg::Both)]
    pub role: RoleArg,
    /// The P/D protocol of a prefill or decode engine: vLLM's NixlConnector
    /// (`kv_transfer_params`) or SGLang's bootstrap rooms.
    #[arg(long, value_enum)]
    pub pd_protocol: Option<ProtocolArg>,
    /// KV transfer bandwidth in Gbit/s: a transfer lasts its bytes over this.
    #[arg(long, default_value_t = DEFAULT_KV_TRANSFER_GBPS)]
    pub kv_transfer_gbps: f64,
    /// KV bytes per token (default: Llama-3-8B in bf16, 32 layers x 8 KV heads x 128 x 2 x 2).
    #[arg(long, default_value_t = DEFAULT_KV_BYTES_PER_TOKEN)]
    pub kv_bytes_per_token: u64,
    /// Seconds a prefill engine holds KV blocks no decode engine pulls.
    #[arg(long, default_value_t = 480.0)]
    pub kv_hold_timeout_secs: f64,
    /// The SGLang prefill engine's bootstrap server port (0 picks one; the address is printed).
    #[arg(long, default_value_t = DEFAULT_BOOTSTRAP_PORT)]
    pub bootstrap_port: u16,
    /// Hold every generation request this many milliseconds before the engine takes it: a slow
    /// first token on demand (the gateway's tests use it to keep a booking in prefill).
    #[arg(long, default_value_t = 0)]
    pub first_token_delay_ms: u64,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleArg {
    Both,
    Prefill,
    Decode,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtocolArg {
    Vllm,
    Sglang,
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
    let role = match openai.role {
        RoleArg::Both => PdRole::Both,
        RoleArg::Prefill => PdRole::Prefill,
        RoleArg::Decode => PdRole::Decode,
    };
    let protocol = openai.pd_protocol.map(|p| match p {
        ProtocolArg::Vllm => PdProtocol::Vllm,
        ProtocolArg::Sglang => PdProtocol::Sglang,
    });
    if role != PdRole::Both && protocol.is_none() {
        return Err(format!(
            "--role {} needs --pd-protocol vllm or sglang",
            role.as_str()
        ));
    }
    let hold_timeout = super::seconds("kv-hold-timeout-secs", openai.kv_hold_timeout_secs)?;
    if !(openai.kv_transfer_gbps.is_finite() && openai.kv_transfer_gbps > 0.0) {
        return Err(format!(
            "--kv-transfer-gbps must be a positive number, got {}",
            openai.kv_transfer_gbps
        ));
    }
    if openai.kv_bytes_per_token == 0 {
        return Err("--kv-bytes-per-token must be greater than 0".to_string());
    }
    let defaults = MockEngineConfig::default();
    let config = MockEngineConfig {
        model: openai.model.clone(),
        block_size: args.block_size,
        tokenizer: openai.tokenizer.clone(),
        events_bind: Some(args.bind.clone()),
        events_encoding: args.encoding.wire(),
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
        prompt_prefix_tokens: openai.prompt_prefix_tokens,
        prompt_tokens_details: !openai.no_prompt_tokens_details,
        pd: PdConfig {
            role,
            protocol,
            kv_transfer_gbps: openai.kv_transfer_gbps,
            kv_bytes_per_token: openai.kv_bytes_per_token,
            hold_timeout,
            bootstrap_port: openai.bootstrap_port,
            ..PdConfig::default()
        },
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
    let role = config.pd.role;
    let protocol = config.pd.protocol;
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
    if let Some(protocol) = protocol
        && role != PdRole::Both
    {
        let bootstrap = engine
            .bootstrap_addr()
            .map(|a| format!(", bootstrap server on {a}"))
            .unwrap_or_default();
        println!(
            "role {} ({} P/D protocol), engine id {}{bootstrap}",
            role.as_str(),
            protocol.as_str(),
            engine.engine_id()
        );
    }
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
        assert!(bad(&["--role", "prefill"]).contains("--pd-protocol"));
        assert!(bad(&["--kv-transfer-gbps", "0"]).contains("--kv-transfer-gbps"));
        assert!(bad(&["--kv-bytes-per-token", "0"]).contains("--kv-bytes-per-token"));
        assert!(bad(&["--kv-hold-timeout-secs=-1"]).contains("--kv-hold-timeout-secs"));
    }

    #[test]
    fn roles_and_protocols_reach_the_engine() {
        let args = parse(&[
            "--openai",
            "--port",
            "0",
            "--role",
            "prefill",
            "--pd-protocol",
            "sglang",
            "--bootstrap-port",
            "9001",
            "--kv-transfer-gbps",
            "25",
        ])
        .unwrap();
        let (config, _) = plan(&args).unwrap();
        assert_eq!(config.pd.role, PdRole::Prefill);
        assert_eq!(config.pd.protocol, Some(PdProtocol::Sglang));
        assert_eq!(config.pd.bootstrap_port, 9001);
        assert_eq!(config.pd.kv_transfer_gbps, 25.0);
        let (config, _) = plan(&parse(&["--openai", "--port", "0"]).unwrap()).unwrap();
        assert_eq!(config.pd.role, PdRole::Both, "today's behaviour by default");
    }
}
