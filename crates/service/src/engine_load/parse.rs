//! Reading an engine's load from its Prometheus text exposition (`GET /metrics`).
//!
//! The gauges read (names as vLLM and SGLang publish them):
//!
//! | engine | running | waiting | KV usage (fraction 0..1) |
//! |---|---|---|---|
//! | vLLM | `vllm:num_requests_running` | `vllm:num_requests_waiting` | `vllm:kv_cache_usage_perc` (V1), `vllm:gpu_cache_usage_perc` (V0) |
//! | SGLang | `sglang:num_running_reqs` | `sglang:num_queue_reqs` | `sglang:token_usage` |
//!
//! Samples are grouped by data-parallel engine: vLLM labels each engine core `engine="i"`,
//! SGLang labels `dp_rank="i"`; a body without either label describes one engine. Within one
//! engine the largest sample of a gauge is kept, not the sum: tensor-parallel ranks
//! (`tp_rank`) may each repeat the engine's value. Comments, `HELP`/`TYPE` lines, other metrics
//! and samples that are not finite non-negative numbers are skipped; a line that is not a sample
//! at all is counted. A body with none of the gauges is an error, never a panic.

use kvroute_core::selector::EngineLoad;
use std::collections::BTreeMap;

/// Which load gauge a metric name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gauge {
    Running,
    Waiting,
    KvUsage,
}

fn gauge(name: &str) -> Option<Gauge> {
    match name {
        "vllm:num_requests_running" | "sglang:num_running_reqs" => Some(Gauge::Running),
        "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => Some(Gauge::Waiting),
        "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
            Some(Gauge::KvUsage)
        }
        _ => None,
    }
}

/// The labels naming a data-parallel engine (vLLM, SGLang).
const ENGINE_LABELS: [&str; 2] = ["engine", "dp_rank"];

/// What one `/metrics` body says.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineMetrics {
    /// Load per data-parallel engine index (`None`: the body names no engine).
    pub engines: BTreeMap<Option<u32>, EngineLoad>,
    /// Lines that were neither comments nor samples.
    pub garbage_lines: usize,
}

/// Why a body gave no load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    /// Not one line of the body was a sample: not a Prometheus exposition.
    Garbage,
    /// Samples, but none of the load gauges with a usable value.
    NoLoadMetrics,
}

impl ParseError {
    /// The `reason` label of the poll-error counter.
    pub fn reason(self) -> &'static str {
        match self {
            ParseError::Garbage => "parse",
            ParseError::NoLoadMetrics => "no_load_metrics",
        }
    }
}

/// One sample line: name, labels (raw, between the braces) and value.
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = open + line[open..].rfind('}')?;
            (&line[..open], &line[open + 1..close], &line[close + 1..])
        }
        None => {
            let space = line.find(char::is_whitespace)?;
            (&line[..space], "", &line[space..])
        }
    };
    let is_name = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if !is_name {
        return None;
    }
    // The value, then an optional timestamp.
    let value = match rest.split_whitespace().next()? {
        "NaN" => f64::NAN,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, labels, value))
}

/// The value of `label` in a raw label set (`a="x",b="y"`), unescaping nothing: the engine
/// labels read here hold digits.
fn label<'a>(labels: &'a str, wanted: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        let eq = rest.find('=')?;
        let key = rest[..eq].trim();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        // The closing quote: the first not escaped by a backslash.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let end = end?;
        if key == wanted {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
}

/// Reads the engines' load from a Prometheus text body.
pub fn parse(body: &str) -> Result<EngineMetrics, ParseError> {
    #[derive(Default)]
    struct Seen {
        running: Option<f64>,
        waiting: Option<f64>,
        kv_usage: Option<f64>,
    }
    let mut engines: BTreeMap<Option<u32>, Seen> = BTreeMap::new();
    let mut samples = 0usize;
    let mut garbage_lines = 0usize;
    for line in body.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = sample(line) else {
            garbage_lines += 1;
            continue;
        };
        samples += 1;
        let Some(gauge) = gauge(name) else {
            continue;
        };
        if !(value.is_finite() && value >= 0.0) {
            continue;
        }
        if gauge == Gauge::KvUsage && value > 1.0 {
            continue;
        }
        let engine = ENGINE_LABELS
            .iter()
            .find_map(|l| label(labels, l))
            .and_then(|v| v.parse::<u32>().ok());
        let seen = engines.entry(engine).or_default();
        let slot = match gauge {
            Gauge::Running => &mut seen.running,
            Gauge::Waiting => &mut seen.waiting,
            Gauge::KvUsage => &mut seen.kv_usage,
        };
        *slot = Some(slot.map_or(value, |v| v.max(value)));
    }
    if samples == 0 && garbage_lines > 0 {
        return Err(ParseError::Garbage);
    }
    let engines: BTreeMap<Option<u32>, EngineLoad> = engines
        .into_iter()
        .filter(|(_, s)| s.running.is_some() || s.waiting.is_some() || s.kv_usage.is_some())
        .map(|(engine, s)| {
            // Gauges of request counts are whole; `as` saturates a huge one.
            let count = |v: Option<f64>| v.map_or(0, |v| v.round() as u64);
            let load = EngineLoad {
                running: count(s.running),
                waiting: count(s.waiting),
                kv_usage: s.kv_usage,
            };
            (engine, load)
        })
        .collect();
    if engines.is_empty() {
        return Err(ParseError::NoLoadMetrics);
    }
    Ok(EngineMetrics {
        engines,
        garbage_lines,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(running: u64, waiting: u64, kv_usage: Option<f64>) -> EngineLoad {
        EngineLoad {
            running,
            waiting,
            kv_usage,
        }
    }

    /// As vLLM's V1 engine publishes them, two data-parallel engines, with other metrics around.
    const VLLM_V1: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.4375
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0625
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 8.128902e+06
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 12.0
python_gc_objects_collected_total{generation="0"} 1234.0
"#;

    #[test]
    fn vllm_v1_engines_are_read_per_engine() {
        let m = parse(VLLM_V1).unwrap();
        assert_eq!(m.garbage_lines, 0);
        assert_eq!(
            m.engines.into_iter().collect::<Vec<_>>(),
            vec![
                (Some(0), load(7, 3, Some(0.4375))),
                (Some(1), load(2, 0, Some(0.0625))),
            ]
        );
    }

    #[test]
    fn vllm_v0_without_an_engine_label_is_one_engine() {
        let body = r#"# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-2-7b"} 4.0
vllm:num_requests_swapped{model_name="meta-llama/Llama-2-7b"} 0.0
vllm:num_requests_waiting{model_name="meta-llama/Llama-2-7b"} 1.0
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-2-7b"} 0.25
"#;
        let m = parse(body).unwrap();
        assert_eq!(
            m.engines.into_iter().collect::<Vec<_>>(),
            vec![(None, load(4, 1, Some(0.25)))]
        );
    }

    #[test]
    fn sglang_tensor_parallel_ranks_are_not_summed() {
        let body = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 12.0
sglang:num_running_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="1"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 0.28
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
"#;
        let m = parse(body).unwrap();
        assert_eq!(
            m.engines.into_iter().collect::<Vec<_>>(),
            vec![(None, load(12, 5, Some(0.28)))]
        );
        let dp = "sglang:num_running_reqs{dp_rank=\"1\",tp_rank=\"0\"} 3\n\
                  sglang:num_queue_reqs{dp_rank=\"1\",tp_rank=\"0\"} 1 1700000000000\n";
        let m = parse(dp).unwrap();
        assert_eq!(
            m.engines.into_iter().collect::<Vec<_>>(),
            vec![(Some(1), load(3, 1, None))]
        );
    }

    #[test]
    fn unusable_values_and_garbage_lines_are_skipped() {
        let body = "vllm:num_requests_running{model_name=\"m\"} NaN\n\
                    vllm:num_requests_waiting{model_name=\"m\"} 2\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\"} 45.0\n\
                    this is not a sample\n\
                    vllm:num_requests_running{model_name=\"m\" 3\n\
                    {} 4\n\
                    # a comment 5\n";
        let m = parse(body).unwrap();
        // NaN running and an out-of-range usage (a percentage, not a fraction) are unknown.
        assert_eq!(
            m.engines.into_iter().collect::<Vec<_>>(),
            vec![(None, load(0, 2, None))]
        );
        assert_eq!(m.garbage_lines, 3);
        // Negative and infinite gauges are as unknown as NaN.
        assert_eq!(
            parse("vllm:num_requests_running -1\nvllm:num_requests_waiting +Inf\n"),
            Err(ParseError::NoLoadMetrics)
        );
    }

    #[test]
    fn a_body_without_load_is_an_error_never_a_panic() {
        assert_eq!(
            parse("<html><body>502 Bad Gateway</body></html>\n"),
            Err(ParseError::Garbage)
        );
        assert_eq!(parse("{\"error\":\"nope\"}"), Err(ParseError::Garbage));
        assert_eq!(
            parse("# HELP up whether\nup 1\nprocess_cpu_seconds_total 3.5\n"),
            Err(ParseError::NoLoadMetrics)
        );
        assert_eq!(parse(""), Err(ParseError::NoLoadMetrics));
        assert_eq!(ParseError::Garbage.reason(), "parse");
        // Odd bytes anywhere do not panic.
        for body in [
            "{",
            "}",
            "a{",
            "a{b=\"",
            "a{b=\"\\\"} 1",
            "\u{feff}x 1",
            "é{é=\"é\"} é",
        ] {
            let _ = parse(body);
        }
    }

    #[test]
    fn labels_are_found_past_escaped_quotes() {
        assert_eq!(
            label(r#"model_name="a\"b",engine="3""#, "engine"),
            Some("3")
        );
        assert_eq!(label(r#"model_name="x""#, "engine"), None);
        assert_eq!(label(r#"engine="#, "engine"), None);
    }
}
