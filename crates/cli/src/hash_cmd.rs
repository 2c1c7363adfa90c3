//! `kvroute hash`: print the local and sequence hashes of a token prompt, so an operator can check
//! that kvroute, an engine and Dynamo agree on them.

use clap::Args;
use kvroute_core::hash::{BlockExtras, BlockMmInfo, PromptHashes, seed_for};
use kvroute_service::http::types::{BlockMmInfoBody, mm_infos_into_core};
use std::io::Read;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct HashArgs {
    /// Tokens per KV block (the engine's block size).
    #[arg(long)]
    pub block_size: u32,
    /// LoRA adapter name that salts the hashes.
    #[arg(long)]
    pub lora_name: Option<String>,
    /// Cache salt that salts the hashes.
    #[arg(long)]
    pub cache_salt: Option<String>,
    /// Eagle speculative decoding: each block's hash also covers the next token.
    #[arg(long)]
    pub eagle: bool,
    /// Per block, `null` or its multimodal objects, as Dynamo's `block_mm_infos`:
    /// `[null, {"mm_objects": [{"mm_hash": 42, "offsets": [[0, 8]]}]}]`.
    #[arg(long, value_name = "JSON")]
    pub block_mm_infos: Option<String>,
}

/// Parses `--block-mm-infos`.
fn parse_mm_infos(json: &str) -> Result<Vec<Option<BlockMmInfo>>, String> {
    serde_json::from_str::<Vec<Option<BlockMmInfoBody>>>(json)
        .map(mm_infos_into_core)
        .map_err(|e| format!("--block-mm-infos: {e}"))
}

/// Parses the tokens: a JSON array of integers in `0..2^32`.
pub fn parse_tokens(input: &str) -> Result<Vec<u32>, String> {
    let value: serde_json::Value =
        serde_json::from_str(input).map_err(|e| format!("tokens on stdin are not JSON: {e}"))?;
    let serde_json::Value::Array(items) = value else {
        return Err("tokens on stdin must be a JSON array of integers".to_string());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    format!("token {i} ({item}) is not an integer between 0 and 4294967295")
                })
        })
        .collect()
}

/// Renders the hashes as the JSON line the command prints (signed i64, as on Dynamo's wire).
pub fn render(tokens: &[u32], args: &HashArgs) -> Result<String, String> {
    if args.block_size == 0 {
        return Err("--block-size must be greater than 0".to_string());
    }
    let seed = seed_for(args.lora_name.as_deref(), args.cache_salt.as_deref());
    let block_mm_infos = match &args.block_mm_infos {
        Some(json) => parse_mm_infos(json)?,
        None => Vec::new(),
    };
    let extras = BlockExtras {
        is_eagle: args.eagle,
        block_mm_infos: &block_mm_infos,
    };
    let hashes = PromptHashes::from_tokens_with(tokens, args.block_size as usize, seed, extras);
    let signed = |v: &[u64]| v.iter().map(|&h| h as i64).collect::<Vec<i64>>();
    let out = serde_json::json!({
        "local_hashes": signed(&hashes.local),
        "sequence_hashes": signed(&hashes.sequence),
    });
    Ok(out.to_string())
}

pub fn run(args: &HashArgs) -> ExitCode {
    let mut input = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut input) {
        eprintln!("kvroute hash: cannot read stdin: {e}");
        return ExitCode::from(2);
    }
    match parse_tokens(&input).and_then(|tokens| render(&tokens, args)) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("kvroute hash: {message}");
            ExitCode::from(2)
        }
    }
}
