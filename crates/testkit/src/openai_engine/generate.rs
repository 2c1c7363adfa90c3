//! `POST /v1/completions` and `POST /v1/chat/completions`: the prompt's tokens go to the engine
//! loop with the answer's (decided now, see [`super::tokenizer`]); its news come back as SSE
//! chunks as each step ends, or as one JSON answer at the end.
//!
//! A stream is `data: {chunk}\n\n` per token (a chat stream first sends the assistant role),
//! the last token's chunk with `finish_reason: "length"`, then with
//! `stream_options.include_usage` a chunk with no choices and the usage, then `data: [DONE]`.
//! If the engine stops first, an error chunk precedes `[DONE]`; if the client goes away, the
//! engine aborts the request at its next step.

use super::disagg::{self, Leg, TransferKey};
use super::engine_loop::{Command, Progress, Submission};
use super::http::{check_model, read_body};
use super::protocol::{
    ApiError, ChatChoice, ChatChunkChoice, ChatMessageOut, ChatRequest, CompletionRequest, Delta,
    Envelope, MessageIn, PromptIn, StreamOptions, TextChoice, Usage, content_text, json_response,
    parse,
};
use super::tokenizer::{ChatMessage, render_chat};
use super::{AppState, InFlight, ServedRequest, unix_secs};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use kvroute_sim::SimRequest;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Completion,
    Chat,
}

/// A generation request, checked.
struct Job {
    route: Route,
    id: String,
    created: u64,
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    /// Its part in a disaggregated request, if any.
    leg: Leg,
}

pub(crate) async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let arrived = Instant::now();
    let job = async {
        let body = read_body(body).await?;
        let request: CompletionRequest = parse(&body)?;
        check_model(&state, request.model.as_deref())?;
        check_n(request.n)?;
        let (stream, include_usage) = streaming(request.stream, request.stream_options.as_ref())?;
        let leg = disagg::leg(&state, &request.pd)?;
        let max_tokens = max_tokens(request.max_tokens, state.default_max_tokens, &leg)?;
        let prompt = match PromptIn::from_value(request.prompt)? {
            PromptIn::Tokens(ids) => ids,
            PromptIn::Text(text) => state
                .tokenizer
                .encode(&text, request.add_special_tokens.unwrap_or(true))
                .map_err(ApiError::bad_request)?,
        };
        Ok::<_, ApiError>(Job {
            route: Route::Completion,
            id: state.shared.request_id("cmpl"),
            created: unix_secs(),
            prompt,
            max_tokens,
            stream,
            include_usage,
            leg,
        })
    }
    .await;
    match job {
        Ok(job) => run(state, job, arrived).await,
        Err(error) => error.into_response(),
    }
}

pub(crate) async fn chat_completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let arrived = Instant::now();
    let job = async {
        let body = read_body(body).await?;
        let request: ChatRequest = parse(&body)?;
        check_model(&state, request.model.as_deref())?;
        check_n(request.n)?;
        let (stream, include_usage) = streaming(request.stream, request.stream_options.as_ref())?;
        let leg = disagg::leg(&state, &request.pd)?;
        let max_tokens = max_tokens(
            request.max_completion_tokens.or(request.max_tokens),
            state.default_max_tokens,
            &leg,
        )?;
        let prompt = chat_prompt(
            &state,
            &request.messages,
            request.add_generation_prompt.unwrap_or(true),
            request.add_special_tokens.unwrap_or(false),
        )?;
        Ok::<_, ApiError>(Job {
            route: Route::Chat,
            id: state.shared.request_id("chatcmpl"),
            created: unix_secs(),
            prompt,
            max_tokens,
            stream,
            include_usage,
            leg,
        })
    }
    .await;
    match job {
        Ok(job) => run(state, job, arrived).await,
        Err(error) => error.into_response(),
    }
}

/// The token ids of chat messages, rendered with the built-in template: what the chat route
/// generates from and what `/tokenize` answers for the same messages.
pub(crate) fn chat_prompt(
    state: &AppState,
    messages: &[MessageIn],
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty"));
    }
    let messages = messages
        .iter()
        .map(|m| {
            Ok(ChatMessage {
                role: m.role.clone(),
                content: content_text(&m.content)?,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let text = render_chat(&messages, add_generation_prompt);
    state
        .tokenizer
        .encode(&text, add_special_tokens)
        .map_err(ApiError::bad_request)
}

fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::bad_request(format!(
            "the mock engine generates one choice per request (n = 1), got n = {n}"
        ))),
    }
}

/// `(stream, include_usage)`; stream options without streaming are vLLM's 400.
fn streaming(
    stream: Option<bool>,
    options: Option<&StreamOptions>,
) -> Result<(bool, bool), ApiError> {
    let stream = stream.unwrap_or(false);
    if options.is_some() && !stream {
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let include_usage = options.and_then(|o| o.include_usage).unwrap_or(false);
    Ok((stream, include_usage))
}

/// A prefill leg makes one token, whatever the request says (vLLM's and SGLang's prefill
/// engines stop after the first token).
fn max_tokens(requested: Option<i64>, default: u32, leg: &Leg) -> Result<u32, ApiError> {
    match requested {
        Some(n) if n >= 1 && leg.is_prefill() => Ok(1),
        None if leg.is_prefill() => Ok(1),
        None => Ok(default),
        Some(n) if n < 1 => Err(ApiError::bad_request(format!(
            "max_tokens must be at least 1, got {n}."
        ))),
        // Beyond u32, the context-length check refuses it.
        Some(n) => Ok(u32::try_from(n).unwrap_or(u32::MAX)),
    }
}

/// Checks the job against the engine, hands it over and answers.
async fn run(state: Arc<AppState>, mut job: Job, arrived: Instant) -> Response {
    let prefix = state.shared.prompt_prefix_tokens() as usize;
    if prefix > 0 {
        // Ids of the engine's own output: valid for any tokenizer.
        let ids = state.tokenizer.output_ids(prefix);
        job.prompt.splice(0..0, ids);
    }
    let prompt_tokens = job.prompt.len();
    if prompt_tokens as u64 + u64::from(job.max_tokens) > u64::from(state.max_model_len) {
        return ApiError::too_long(state.max_model_len, prompt_tokens, job.max_tokens)
            .into_response();
    }
    let mut tokens = job.prompt.clone();
    tokens.extend(state.tokenizer.output_ids(job.max_tokens as usize));
    let mut hashes = PromptHashes::from_tokens(&tokens, state.block_size as usize, BASE_SEED);
    hashes.isl_tokens = prompt_tokens as u64;
    let request = SimRequest {
        arrival_nanos: 0,
        prompt: hashes,
        output_tokens: u64::from(job.max_tokens),
        session_id: None,
        tenant: None,
    };
    if !state.engine.fits(&request) {
        return ApiError::bad_request(format!(
            "the prompt and completion need {} KV blocks; the engine has {}",
            state.engine.blocks_needed(&request),
            state.engine.kv_blocks.unwrap_or(u64::MAX)
        ))
        .into_response();
    }
    let in_flight = InFlight::new(&state.shared);
    let delay = state.shared.first_token_delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let full_prompt_blocks = prompt_tokens / state.block_size as usize;
    let import_blocks = match &job.leg {
        Leg::Decode(source) => match receive(&state, source, &request.prompt.sequence).await {
            Ok(blocks) => blocks,
            Err(error) => return error.into_response(),
        },
        _ => 0,
    };
    let hold_blocks = job.leg.is_prefill().then_some(full_prompt_blocks);
    let held_candidates = request.prompt.sequence[..hold_blocks.unwrap_or(0)].to_vec();
    let (progress, news) = mpsc::unbounded_channel();
    let submission = Submission {
        request,
        tokens: tokens.into(),
        progress,
        hold_blocks,
        import_blocks,
    };
    if state.submissions.send(Command::Submit(submission)).is_err() {
        return ApiError::internal("the engine has stopped").into_response();
    }
    let answer = Answer {
        state,
        job,
        news,
        arrived,
        produced: 0,
        cached_tokens: 0,
        first_token: None,
        done: false,
        held_candidates,
        kv_transfer_params: None,
        _in_flight: in_flight,
    };
    if answer.job.stream {
        stream_response(answer)
    } else {
        answer.collect().await
    }
}

/// A decode leg's KV: pulled from the prefill engine, checked to be this prompt's, then the
/// transfer time waited. Returns how many leading prompt blocks were received.
async fn receive(
    state: &AppState,
    source: &disagg::Source,
    prompt_blocks: &[u64],
) -> Result<usize, ApiError> {
    let received = disagg::fetch(state, source).await?;
    let matching = received
        .iter()
        .zip(prompt_blocks)
        .take_while(|(a, b)| a == b)
        .count();
    if matching != received.len() {
        return Err(ApiError::bad_request(format!(
            "the KV blocks received are not this prompt's (block {matching} of {} differs): \
             the prefill and decode legs were sent different prompts",
            received.len()
        )));
    }
    let transfer = state
        .pd
        .config
        .transfer_time(received.len(), state.block_size)
        .mul_f64(state.time_scale);
    if !transfer.is_zero() {
        tokio::time::sleep(transfer).await;
    }
    Ok(received.len())
}

/// A request handed to the engine, and what it has produced so far.
struct Answer {
    state: Arc<AppState>,
    job: Job,
    news: mpsc::UnboundedReceiver<Progress>,
    arrived: Instant,
    produced: u32,
    cached_tokens: u64,
    first_token: Option<Duration>,
    done: bool,
    /// A prefill leg's full prompt blocks, the first `Progress::Held` of which are held.
    held_candidates: Vec<u64>,
    /// A vLLM prefill leg's answer for the decode leg.
    kv_transfer_params: Option<serde_json::Value>,
    _in_flight: InFlight,
}

impl Drop for Answer {
    /// Blocks held for a prefill whose news was never read (its client left) are released.
    fn drop(&mut self) {
        self.news.close();
        while let Ok(news) = self.news.try_recv() {
            if let Progress::Held { blocks } = news {
                let held = self.held_candidates[..blocks.min(self.held_candidates.len())].to_vec();
                let _ = self.state.submissions.send(Command::Release(held));
            }
        }
    }
}

impl Answer {
    fn model(&self) -> &str {
        &self.state.model
    }

    fn usage(&self) -> Usage {
        Usage {
            kvroute_engine_ttft_us: self
                .first_token
                .map(|t| u64::try_from(t.as_micros()).unwrap_or(u64::MAX)),
            ..Usage::new(
                self.job.prompt.len() as u64,
                u64::from(self.produced),
                self.state
                    .prompt_tokens_details
                    .then_some(self.cached_tokens),
            )
        }
    }

    /// Takes the next piece of news into account and returns it; `None` if the engine stopped
    /// (never, when it was killed: the connection is dropped instead).
    async fn next(&mut self) -> Option<Progress> {
        let Some(news) = self.news.recv().await else {
            if self.state.shared.killed.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            return None;
        };
        match news {
            Progress::Admitted { cached_tokens } => self.cached_tokens = cached_tokens,
            Progress::Token => {
                self.produced += 1;
                if self.first_token.is_none() {
                    self.first_token = Some(self.arrived.elapsed());
                }
            }
            Progress::Held { blocks } => {
                let held = self.held_candidates[..blocks.min(self.held_candidates.len())].to_vec();
                let key = match self.job.leg {
                    Leg::PrefillRoom(room) => TransferKey::Room(room),
                    _ => TransferKey::Request(self.job.id.clone()),
                };
                if let Some(block_ids) = disagg::hold(&self.state, key, held)
                    && self.job.leg == Leg::PrefillVllm
                {
                    self.kv_transfer_params = Some(disagg::vllm_answer_params(
                        &self.state,
                        &self.job.id,
                        &block_ids,
                    ));
                }
            }
            Progress::Finished => {
                self.state.shared.record(ServedRequest {
                    id: self.job.id.clone(),
                    prompt_tokens: self.job.prompt.len() as u64,
                    cached_tokens: self.cached_tokens,
                    completion_tokens: u64::from(self.produced),
                    time_to_first_token: self.first_token.unwrap_or_default(),
                    latency: self.arrived.elapsed(),
                });
            }
        }
        Some(news)
    }

    /// Waits for the whole answer.
    async fn collect(mut self) -> Response {
        loop {
            match self.next().await {
                Some(Progress::Finished) => break,
                Some(_) => {}
                None => {
                    return ApiError::internal("the engine stopped before the request finished")
                        .into_response();
                }
            }
        }
        let text: String = (0..self.produced as usize)
            .map(|i| self.state.tokenizer.output_token(i).1)
            .collect();
        let finish_reason = Some("length");
        let usage = Some(self.usage());
        let body = match self.job.route {
            Route::Completion => serde_json::to_vec(&Envelope {
                id: &self.job.id,
                object: "text_completion",
                created: self.job.created,
                model: self.model(),
                choices: [TextChoice {
                    index: 0,
                    text: &text,
                    logprobs: None,
                    finish_reason,
                    stop_reason: None,
                }],
                usage,
                kv_transfer_params: self.kv_transfer_params.as_ref(),
            }),
            Route::Chat => serde_json::to_vec(&Envelope {
                id: &self.job.id,
                object: "chat.completion",
                created: self.job.created,
                model: self.model(),
                choices: [ChatChoice {
                    index: 0,
                    message: ChatMessageOut {
                        role: "assistant",
                        content: &text,
                        tool_calls: [],
                    },
                    logprobs: None,
                    finish_reason,
                    stop_reason: None,
                }],
                usage,
                kv_transfer_params: self.kv_transfer_params.as_ref(),
            }),
        };
        json_response(body.unwrap_or_default())
    }

    /// The next bytes of the stream, `None` after `[DONE]`.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        loop {
            match self.next().await {
                Some(Progress::Token) => return Some(self.token_chunk()),
                Some(Progress::Admitted { .. } | Progress::Held { .. }) => {}
                Some(Progress::Finished) => {
                    self.done = true;
                    let mut out = Vec::new();
                    if self.job.include_usage {
                        self.push_usage_chunk(&mut out);
                    }
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    return Some(out.into());
                }
                None => {
                    self.done = true;
                    let error =
                        ApiError::internal("the engine stopped before the request finished");
                    let mut out = b"data: ".to_vec();
                    out.extend(error.body());
                    out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
                    return Some(out.into());
                }
            }
        }
    }

    /// The chunk of the token just produced (after the role chunk, for a chat's first).
    fn token_chunk(&self) -> Bytes {
        let index = self.produced as usize - 1;
        let piece = self.state.tokenizer.output_token(index).1;
        let finish_reason = (self.produced >= self.job.max_tokens).then_some("length");
        let mut out = Vec::with_capacity(256);
        match self.job.route {
            Route::Completion => push_event(
                &mut out,
                &Envelope {
                    id: &self.job.id,
                    object: "text_completion",
                    created: self.job.created,
                    model: self.model(),
                    choices: [TextChoice {
                        index: 0,
                        text: piece,
                        logprobs: None,
                        finish_reason,
                        stop_reason: None,
                    }],
                    usage: None,
                    kv_transfer_params: None,
                },
            ),
            Route::Chat => {
                if index == 0 {
                    push_event(&mut out, &self.chat_chunk(Some("assistant"), "", None));
                }
                push_event(&mut out, &self.chat_chunk(None, piece, finish_reason));
            }
        }
        out.into()
    }

    fn chat_chunk<'a>(
        &'a self,
        role: Option<&'static str>,
        content: &'a str,
        finish_reason: Option<&'static str>,
    ) -> Envelope<'a, [ChatChunkChoice<'a>; 1]> {
        Envelope {
            id: &self.job.id,
            object: "chat.completion.chunk",
            created: self.job.created,
            model: self.model(),
            choices: [ChatChunkChoice {
                index: 0,
                delta: Delta { role, content },
                logprobs: None,
                finish_reason,
            }],
            usage: None,
            kv_transfer_params: None,
        }
    }

    fn push_usage_chunk(&self, out: &mut Vec<u8>) {
        let object = match self.job.route {
            Route::Completion => "text_completion",
            Route::Chat => "chat.completion.chunk",
        };
        let no_choices: [(); 0] = [];
        push_event(
            out,
            &Envelope {
                id: &self.job.id,
                object,
                created: self.job.created,
                model: self.model(),
                choices: no_choices,
                usage: Some(self.usage()),
                kv_transfer_params: None,
            },
        );
    }
}

/// `data: JSON\n\n`.
fn push_event(out: &mut Vec<u8>, value: &impl serde::Serialize) {
    out.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut *out, value).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
}

fn stream_response(answer: Answer) -> Response {
    let chunks = futures::stream::unfold(answer, |mut answer| async move {
        let chunk = answer.next_chunk().await?;
        Some((Ok::<_, Infallible>(chunk), answer))
    });
    let mut response = Body::from_stream(chunks).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
}
