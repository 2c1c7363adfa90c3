use super::*;
use proptest::prelude::*;

const CHAT_STREAM: &str = concat!(
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo \\\"x\\\"\"}}]}\n\n",
    ": a comment\n",
    "event: message\n",
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n",
    "data: [DONE]\n\n",
);

#[test]
fn chat_chunks_count_content_not_roles_or_finishes() {
    let mut scanner = SseScanner::new();
    let outcome = scanner.scan(CHAT_STREAM.as_bytes());
    assert_eq!(
        outcome,
        ScanOutcome {
            tokens: 2,
            usage_completion_tokens: Some(2),
            usage_prompt: Some(PromptUsage {
                prompt_tokens: 5,
                cached_tokens: Some(3),
            }),
            done: true,
            error: false,
        }
    );
}

#[test]
fn completion_chunks_count_text_and_token_ids() {
    let info = chunk_info(br#"{"choices":[{"index":0,"text":"a","logprobs":null}]}"#);
    assert_eq!(info.tokens, 1);
    let info = chunk_info(br#"{"choices":[{"index":0,"text":""}]}"#);
    assert_eq!(info.tokens, 0);
    let info = chunk_info(br#"{"choices":[{"text":"ab","token_ids":[5,6,7]}]}"#);
    assert_eq!(info.tokens, 3);
    let info = chunk_info(br#"{"choices":[{"text":"a"},{"text":"b"}]}"#);
    assert_eq!(info.tokens, 2, "one token per choice (n > 1)");
    let info = chunk_info(br#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#);
    assert_eq!(info.tokens, 1);
    let info = chunk_info(br#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#);
    assert_eq!(info.tokens, 1);
    let info = chunk_info(br#"{"error":{"message":"boom","code":500}}"#);
    assert!(info.error);
    assert_eq!(chunk_info(b"not json"), ChunkInfo::default());
    assert!(chunk_info(b" [DONE] ").done);
}

#[test]
fn a_responses_stream_counts_deltas_and_ends_at_completed() {
    let stream = concat!(
        "event: response.created\n",
        "data: {\"type\":\"response.created\",\"response\":{\"id\":\"r1\",\"status\":\"in_progress\",\"usage\":null}}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"item_id\":\"m1\",\"delta\":\"Hel\"}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"delta\":\"\"}\n\n",
        "data: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{\\\"a\"}\n\n",
        "data: {\"type\":\"response.output_text.done\",\"text\":\"Hello\"}\n\n",
        "event: response.completed\n",
        "data: {\"type\":\"response.completed\",\"response\":{\"output\":[{\"type\":\"message\"}],",
        "\"usage\":{\"input_tokens\":5,\"output_tokens\":7,\"total_tokens\":12}}}\n\n",
    );
    let outcome = SseScanner::new().scan(stream.as_bytes());
    assert_eq!(
        outcome,
        ScanOutcome {
            tokens: 2,
            usage_completion_tokens: Some(7),
            usage_prompt: None,
            done: true,
            error: false,
        }
    );
    let failed = chunk_info(br#"{"type":"response.failed","response":{"usage":null}}"#);
    assert!(failed.done && failed.error);
    assert!(chunk_info(br#"{"type":"error","message":"boom"}"#).error);
}

#[test]
fn crlf_lines_and_lines_without_a_space_are_read() {
    let mut scanner = SseScanner::new();
    let outcome =
        scanner.scan(b"data:{\"choices\":[{\"text\":\"a\"}]}\r\n\r\ndata: [DONE]\r\n\r\n");
    assert_eq!((outcome.tokens, outcome.done), (1, true));
}

#[test]
fn an_overlong_line_is_skipped_and_the_next_read() {
    let mut scanner = SseScanner::new();
    let big = vec![b'x'; MAX_LINE_BYTES + 10];
    assert_eq!(scanner.scan(b"data: "), ScanOutcome::default());
    assert_eq!(scanner.scan(&big), ScanOutcome::default());
    assert_eq!(scanner.scan(b"yy\n"), ScanOutcome::default());
    assert!(scanner.partial.is_empty());
    let outcome = scanner.scan(b"data: {\"choices\":[{\"text\":\"a\"}]}\n");
    assert_eq!(outcome.tokens, 1);
}

proptest! {
    /// However the stream is cut into frames, the scanner counts what it counts whole.
    #[test]
    fn frame_cuts_do_not_change_the_count(cuts in proptest::collection::vec(0usize..CHAT_STREAM.len(), 0..12)) {
        let bytes = CHAT_STREAM.as_bytes();
        let mut cuts = cuts;
        cuts.sort_unstable();
        let mut scanner = SseScanner::new();
        let mut total = ScanOutcome::default();
        let mut at = 0;
        for cut in cuts.into_iter().chain([bytes.len()]) {
            let part = scanner.scan(&bytes[at..cut.max(at)]);
            total.tokens += part.tokens;
            total.usage_completion_tokens = total.usage_completion_tokens.max(part.usage_completion_tokens);
            total.usage_prompt = part.usage_prompt.or(total.usage_prompt);
            total.done |= part.done;
            at = cut.max(at);
        }
        prop_assert_eq!(total, SseScanner::new().scan(bytes));
    }
}
