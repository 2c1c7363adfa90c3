//! The gateway's per-chunk cost on a stream: scanning vLLM-shaped SSE chunks for their tokens
//! (what `ProxyBody` does to every frame it forwards).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute_gateway::sse::SseScanner;
use std::hint::black_box;

/// `tokens` chunks as vLLM streams a completion, one token per chunk, then `[DONE]`.
fn completion_stream(tokens: usize) -> Vec<Vec<u8>> {
    let mut chunks: Vec<Vec<u8>> = (0..tokens)
        .map(|i| {
            format!(
                "data: {{\"id\":\"cmpl-8c1f4e\",\"object\":\"text_completion\",\"created\":1733000000,\
                 \"model\":\"llama\",\"choices\":[{{\"index\":0,\"text\":\" word{i}\",\"logprobs\":null,\
                 \"finish_reason\":null,\"stop_reason\":null}}]}}\n\n"
            )
            .into_bytes()
        })
        .collect();
    chunks.push(b"data: [DONE]\n\n".to_vec());
    chunks
}

fn scan(c: &mut Criterion) {
    let mut group = c.benchmark_group("sse_scan");
    for tokens in [16usize, 256] {
        let chunks = completion_stream(tokens);
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_function(format!("completion_{tokens}_chunks_one_per_frame"), |b| {
            b.iter(|| {
                let mut scanner = SseScanner::new();
                let mut total = 0;
                for chunk in &chunks {
                    total += scanner.scan(black_box(chunk)).tokens;
                }
                total
            })
        });
        // The same bytes cut into 7-byte frames: every event split across frames.
        let joined: Vec<u8> = chunks.concat();
        group.bench_function(
            format!("completion_{tokens}_chunks_in_7_byte_frames"),
            |b| {
                b.iter(|| {
                    let mut scanner = SseScanner::new();
                    let mut total = 0;
                    for frame in joined.chunks(7) {
                        total += scanner.scan(black_box(frame)).tokens;
                    }
                    total
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, scan);
criterion_main!(benches);
