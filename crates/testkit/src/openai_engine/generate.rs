//! `POST /v1/completions`, `POST /v1/chat/completions` and `POST /v1/responses`: the prompt's
//! tokens go to the engine loop with the answer's (decided now, see [`super::tokenizer`]); its
//! news come back as SSE chunks as each step ends, or as one JSON answer at the end.
//!
//! A stream is `data: {chunk}\n\n` per token and choice (a chat stream first sends each
//! choice's assistant role), the last token's chunks with `finish_reason: "length"`, then with
//! `stream_options.include_usage` a chunk with no choices and the usage, then `data: [DONE]`.
//! If the engine stops first, an error chunk precedes `[DONE]`; if the client goes away, the
//! engine aborts the request at its next step. A response's stream has its own events
//! (`super::responses`).
//!
//! `n` choices share one generation: each choice carries the same text, and the usage counts
//! `n` times its tokens (the engine model decodes one sequence). `ignore_eos` and `min_tokens`
//! (at most the maximum) are accepted: every answer is the maximum long already.

use super::disagg::{self, Leg, TransferKey};
use super::engine_loop::{Command, Progress, Submission};
use super::http::{check_model, read_body};
use super::protocol::{
    ApiError, ChatChoice, ChatChunkChoice, ChatMessageOut, ChatRequest, CompletionRequest, Delta,
    Envelope, MessageIn, PromptIn, StreamOptions, TextChoice, Usage, content_text, json_response,
    parse,
};
use super::responses::{self, EventWriter, ResponseMeta, ResponsesRequest};
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
    Responses,
}

/// A generation request, checked.
struct Job {
    route: Route,
    id: String,
    created: u64,
    prompt: Vec<u32>,
    max_tokens: u32,
    /// Choices (`n`), each the same text.
    n: u32,
    stream: bool,
    include_usage: bool,
    /// Its part in a disaggregated request, if any.
    leg: Leg,
    /// The usage so far on every token's chunk (`stream_options.continuous_usage_stats`).
    continuous_usage: bool,
    /// A response's `instructions`, echoed in its object.
    instructions: Option<String>,
}

pub(crate) async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let arrived = Instant::now();
    let job = async {
        let body = read_body(body).await?;
        let request: CompletionRequest = parse(&body)?;
        check_model(&state, request.model.as_deref())?;
        let n = choices(request.n)?;
        let (stream, include_usage, continuous_usage) =
            streaming(request.stream, request.stream_options.as_ref())?;
        let leg = disagg::leg(&state, &request.pd)?;
        let max_tokens = max_tokens(request.max_tokens, state.default_max_tokens, &leg)?;
        check_min_tokens(request.min_tokens, max_tokens)?;
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
            n,
            stream,
            include_usage,
            leg,
            continuous_usage,
            instructions: None,
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
        let n = choices(request.n)?;
        let (stream, include_usage, continuous_usage) =
            streaming(request.stream, request.stream_options.as_ref())?;
        let leg = disagg::leg(&state, &request.pd)?;
        let max_tokens = max_tokens(
            request.max_completion_tokens.or(request.max_tokens),
            state.default_max_tokens,
            &leg,
        )?;
        check_min_tokens(request.min_tokens, max_tokens)?;
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
            n,
            stream,
            include_usage,
            leg,
            continuous_usage,
            instructions: None,
        })
    }
    .await;
    match job {
        Ok(job) => run(state, job, arrived).await,
        Err(error) => error.into_response(),
    }
}

pub(crate) async fn responses(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let arrived = Instant::now();
    let job = async {
        let body = read_body(body).await?;
        let request: ResponsesRequest = parse(&body)?;
        check_model(&state, request.model.as_deref())?;
        let max_tokens = max_tokens(
            request.max_output_tokens,
            state.default_max_tokens,
            &Leg::Whole,
        )?;
        let messages = responses::input_messages(request.instructions.as_deref(), &request.input)?;
        let prompt = chat_prompt(&state, &messages, true, false)?;
        Ok::<_, ApiError>(Job {
            route: Route::Responses,
            id: state.shared.request_id("resp"),
            created: unix_secs(),
            prompt,
            max_tokens,
            n: 1,
            stream: request.stream.unwrap_or(false),
            include_usage: false,
            leg: Leg::Whole,
            continuous_usage: false,
            instructions: request.instructions,
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

/// The most choices a request may ask for.
const MAX_CHOICES: i64 = 128;

fn choices(n: Option<i64>) -> Result<u32, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if n < 1 => Err(ApiError::bad_request(format!(
            "n must be at least 1, got {n}."
        ))),
        Some(n) if n > MAX_CHOICES => Err(ApiError::bad_request(format!(
            "n must be at most {MAX_CHOICES}, got {n}."
        ))),
        // In 1..=128.
        Some(n) => Ok(n as u32),
    }
}

/// `min_tokens` as vLLM checks it: not negative, not above the maximum.
fn check_min_tokens(min_tokens: Option<i64>, max_tokens: u32) -> Result<(), ApiError> {
    match min_tokens {
        Some(min) if min < 0 => Err(ApiError::bad_request(format!(
            "min_tokens must be greater than or equal to 0, got {min}."
        ))),
        Some(min) if min > i64::from(max_tokens) => Err(ApiError::bad_request(format!(
            "min_tokens must be less than or equal to max_tokens={max_tokens}, got {min}."
        ))),
        _ => Ok(()),
    }
}

/// `(stream, include_usage, continuous_usage)`; stream options without streaming are vLLM's
/// 400.
fn streaming(
    stream: Option<bool>,
    options: Option<&StreamOptions>,
) -> Result<(bool, bool, bool), ApiError> {
    let stream = stream.unwrap_or(false);
    if options.is_some() && !stream {
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let include_usage = options.and_then(|o| o.include_usage).unwrap_or(false);
    let continuous = options
        .and_then(|o| o.continuous_usage_stats)
        .unwrap_or(false);
    Ok((stream, include_usage, continuous))
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
        events: EventWriter::default(),
        opened: false,
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
    /// A response's stream: its events' numbering, and whether its opening events went out.
    events: EventWriter,
    opened: bool,
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
                u64::from(self.produced) * u64::from(self.job.n),
                self.state
                    .prompt_tokens_details
                    .then_some(self.cached_tokens),
            )
        }
    }

    /// A response's usage, in the Responses API's shape.
    fn response_usage(&self) -> serde_json::Value {
        responses::usage(
            self.job.prompt.len() as u64,
            u64::from(self.produced),
            self.cached_tokens,
        )
    }

    /// The text generated so far.
    fn text(&self) -> String {
        (0..self.produced as usize)
            .map(|i| self.state.tokenizer.output_token(i).1)
            .collect()
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
        let text = self.text();
        let finish_reason = Some("length");
        let usage = Some(self.usage());
        let body = match self.job.route {
            Route::Completion => serde_json::to_vec(&Envelope {
                id: &self.job.id,
                object: "text_completion",
                created: self.job.created,
                model: self.model(),
                choices: (0..self.job.n)
                    .map(|index| TextChoice {
                        index,
                        text: &text,
                        logprobs: None,
                        finish_reason,
                        stop_reason: None,
                    })
                    .collect::<Vec<_>>(),
                usage,
                kv_transfer_params: self.kv_transfer_params.as_ref(),
            }),
            Route::Chat => serde_json::to_vec(&Envelope {
                id: &self.job.id,
                object: "chat.completion",
                created: self.job.created,
                model: self.model(),
                choices: (0..self.job.n)
                    .map(|index| ChatChoice {
                        index,
                        message: ChatMessageOut {
                            role: "assistant",
                            content: &text,
                            tool_calls: [],
                        },
                        logprobs: None,
                        finish_reason,
                        stop_reason: None,
                    })
                    .collect::<Vec<_>>(),
                usage,
                kv_transfer_params: self.kv_transfer_params.as_ref(),
            }),
            Route::Responses => Ok(responses::document(
                &response_meta(&self.job, &self.state.model),
                &text,
                self.response_usage(),
            )),
        };
        json_response(body.unwrap_or_default())
    }

    /// The next bytes of the stream, `None` after `[DONE]`.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        if self.job.route == Route::Responses && !self.opened {
            // A response's stream opens at once, before its first token.
            self.opened = true;
            let meta = response_meta(&self.job, &self.state.model);
            let opening = self.events.opening(&meta);
            return Some(opening.into());
        }
        loop {
            match self.next().await {
                Some(Progress::Token) => return Some(self.token_chunk()),
                Some(Progress::Admitted { .. } | Progress::Held { .. }) => {}
                Some(Progress::Finished) if self.job.route == Route::Responses => {
                    self.done = true;
                    let (text, usage) = (self.text(), self.response_usage());
                    let meta = response_meta(&self.job, &self.state.model);
                    let closing = self.events.closing(&meta, &text, usage);
                    return Some(closing.into());
                }
                None if self.job.route == Route::Responses => {
                    self.done = true;
                    let error = self
                        .events
                        .error("the engine stopped before the request finished");
                    return Some(error.into());
                }
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

    /// The chunks of the token just produced, one per choice (after the role chunk, for a
    /// chat's first).
    fn token_chunk(&mut self) -> Bytes {
        let index = self.produced as usize - 1;
        let piece = self.state.tokenizer.output_token(index).1;
        let finish_reason = (self.produced >= self.job.max_tokens).then_some("length");
        let mut out = Vec::with_capacity(256 * self.job.n as usize);
        for choice in 0..self.job.n {
            match self.job.route {
                Route::Completion => push_event(
                    &mut out,
                    &Envelope {
                        id: &self.job.id,
                        object: "text_completion",
                        created: self.job.created,
                        model: self.model(),
                        choices: [TextChoice {
                            index: choice,
                            text: piece,
                            logprobs: None,
                            finish_reason,
                            stop_reason: None,
                        }],
                        usage: self.chunk_usage(),
                        kv_transfer_params: None,
                    },
                ),
                Route::Chat => {
                    if index == 0 {
                        let role = self.chat_chunk(choice, Some("assistant"), "", None);
                        push_event(&mut out, &role);
                    }
                    push_event(
                        &mut out,
                        &self.chat_chunk(choice, None, piece, finish_reason),
                    );
                }
                Route::Responses => {
                    let meta = response_meta(&self.job, &self.state.model);
                    let delta = self.events.delta(&meta, piece);
                    out.extend(delta);
                }
            }
        }
        out.into()
    }

    fn chat_chunk<'a>(
        &'a self,
        index: u32,
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
                index,
                delta: Delta { role, content },
                logprobs: None,
                finish_reason,
            }],
            usage: self.chunk_usage(),
            kv_transfer_params: None,
        }
    }

    /// A token's chunk's usage: the usage so far with `continuous_usage_stats`, else none.
    fn chunk_usage(&self) -> Option<Usage> {
        self.job.continuous_usage.then(|| self.usage())
    }

    fn push_usage_chunk(&self, out: &mut Vec<u8>) {
        let object = match self.job.route {
            Route::Completion => "text_completion",
            Route::Chat | Route::Responses => "chat.completion.chunk",
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

/// What a response's renderings share (a function of the fields, so that the event writer,
/// another field, can be borrowed beside it).
fn response_meta<'a>(job: &'a Job, model: &'a str) -> ResponseMeta<'a> {
    ResponseMeta {
        id: &job.id,
        created: job.created,
        model,
        instructions: job.instructions.as_deref(),
        max_output_tokens: job.max_tokens,
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
