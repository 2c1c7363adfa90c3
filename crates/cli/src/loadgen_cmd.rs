//! `kvroute loadgen`: drives any server with the selection API (kvroute or Dynamo's) in a closed
//! loop at a fixed concurrency for a bounded time, and reports throughput and latency per route.
//!
//! Per request, in `cycle` mode: `POST /select` (with a `selection_id` and token ids) →
//! `POST /reservations` (replay) → `POST /reservations/{id}/prefill_complete` →
//! `DELETE /reservations/{id}`; in `reserve` mode `POST /select_and_reserve` → `DELETE
//! /reservations/{id}`; in `select` mode only the select. Prompts come from a Mooncake
//! trace (hash ids expanded into token ids, 512 tokens per id) or a synthetic shared-prefix set.

use clap::{Args, ValueEnum};
use hashbrown::HashMap;
use hashbrown::hash_map::Entry;
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use kvroute_service::courtesy;
use kvroute_service::ingest::{idle_current_thread, lower_current_thread_priority};
use kvroute_testkit::client::HttpClient;
use kvroute_testkit::fake_engine::{
    FakeEngine, StoredBlocks, removed_event, stored_event_packed, stored_event_with_hashes,
};
use kvroute_wire::{Encoding, PackedRun, PackedTokens, RawEvent};
use serde_json::json;
use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Only `POST /select`.
    Select,
    /// select → reservations (replay) → prefill_complete → free.
    Cycle,
    /// select_and_reserve → free.
    Reserve,
}

#[derive(Args, Debug, Clone)]
pub struct LoadgenArgs {
    /// Base URL of the service, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub url: String,
    /// Workers in the fleet (ids 1..=N), registered at the start unless --skip-register.
    #[arg(long, default_value_t = 64)]
    pub workers: u64,
    /// Do not register the workers (a previous run did).
    #[arg(long, default_value_t = false)]
    pub skip_register: bool,
    /// KV-event endpoint base port: worker i gets a fake engine publishing on
    /// tcp://127.0.0.1:(base+i), registered as its kv_events_endpoint. After each booking the
    /// engine publishes the prompt's blocks as stored (evicting its oldest past
    /// --engine-kv-blocks), so the index fills as in production.
    #[arg(long)]
    pub events_base_port: Option<u16>,
    /// KV capacity of each fake engine, in blocks.
    #[arg(long, default_value_t = 16_384)]
    pub engine_kv_blocks: usize,
    /// Fake engines also publish stored/removed events of random prompts as fast as they can
    /// for the whole run (an event storm).
    #[arg(long, default_value_t = false)]
    pub event_storm: bool,

    /// Niceness (0–19) of the fake engines' thread. 0 lets them compete for the CPU like any
    /// process; 19 stands in for engines on other hosts, whose publishing costs the router's
    /// machine nothing: they then use only the CPU the service and the clients leave (at most
    /// 256 routed prompts wait to be published; beyond that the clients wait for the engines).
    #[arg(long, default_value_t = 0)]
    pub engine_nice: u8,
    /// Run the fake engines' thread under Linux's `SCHED_IDLE` instead (`--engine-nice` is then
    /// ignored): it gets a core only when no thread of the service or the clients wants one,
    /// and gives it up as soon as one wakes. Closer to engines on other hosts than nice 19,
    /// which still takes its slice of a core (over a millisecond) once the scheduler picks it.
    #[arg(long, default_value_t = false)]
    pub engine_idle: bool,
    /// How long each fake engine waits, before the run, for the service to subscribe to it
    /// (0: publish at once, e.g. to engines nobody subscribes to).
    #[arg(long, default_value_t = 5)]
    pub subscriber_wait_secs: u64,
    /// Concurrent keep-alive connections (closed loop).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 20.0)]
    pub duration_secs: f64,
    /// Stop after this many requests (cycles) in all.
    #[arg(long, default_value_t = 10_000_000)]
    pub max_requests: u64,
    #[arg(long, value_enum, default_value_t = Mode::Cycle)]
    pub mode: Mode,
    /// Mooncake JSONL trace to take prompts from (default: a synthetic shared-prefix set).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Cap on prompt length in tokens.
    #[arg(long, default_value_t = 16_384)]
    pub max_prompt_tokens: usize,
    /// Block size the workers are registered with.
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,
    /// Write the report as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// A name for this run in the report.
    #[arg(long, default_value = "run")]
    pub label: String,
}

fn resolve(url: &str) -> Result<SocketAddr, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("--url must start with http:// (got {url})"))?;
    let host_port = rest.trim_end_matches('/');
    host_port
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host_port}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host_port} resolves to no address"))
}

/// Token ids for each prompt of a Mooncake trace: each 512-token hash id becomes 512
/// deterministic tokens (equal ids give equal tokens), cut to `input_length` and the cap.
fn trace_prompts(path: &PathBuf, cap: usize) -> Result<Vec<Vec<u32>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path:?}: {e}"))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{path:?} line {}: {e}", i + 1))?;
        let input = v["input_length"].as_u64().unwrap_or(0) as usize;
        let ids: Vec<u64> = v["hash_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        let len = input.min(cap).min(ids.len() * 512);
        // Each 512-token hash id becomes its own 512 pseudo-random ids in a real vocabulary's
        // range (Qwen2's 151,936 tokens), so equal hash ids give equal tokens and different ones
        // differ, and bodies are as long as a real prompt's.
        let tokens: Vec<u32> = (0..len)
            .map(|t| {
                let id = ids[t / 512];
                (splitmix64(id * 512 + (t % 512) as u64) % VOCAB) as u32
            })
            .collect();
        if !tokens.is_empty() {
            prompts.push(tokens);
        }
    }
    if prompts.is_empty() {
        return Err(format!("{path:?} has no prompts"));
    }
    Ok(prompts)
}

/// A prompt's select-body tail, its block hashes and its packed ids (when asked for).
type Prepared = (String, Vec<u64>, Option<PackedTokens>);

/// Each prompt's select-body tail (its token array and the closing brace), its block hashes and,
/// with `pack`, its packed ids, in prompt order, prepared on all available cores.
fn prepare_prompts(
    prompts: &[Vec<u32>],
    block_size: usize,
    pack: bool,
) -> Result<PreparedPrompts, String> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 8);
    let chunk = prompts.len().div_ceil(threads).max(1);
    let prepare = |part: &[Vec<u32>]| -> Vec<Prepared> {
        part.iter()
            .map(|p| {
                let hashes = PromptHashes::from_tokens(p, block_size, BASE_SEED).sequence;
                let packed = pack.then(|| PackedTokens::new(p, block_size as u32));
                (token_array_tail(p), hashes, packed)
            })
            .collect()
    };
    let parts: Result<Vec<Vec<Prepared>>, String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .chunks(chunk)
            .map(|part| scope.spawn(move || prepare(part)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| "preparing the prompts failed".to_string())
            })
            .collect()
    });
    let mut prepared = PreparedPrompts::default();
    for (body, hashes, packed) in parts?.into_iter().flatten() {
        prepared.bodies.push(body);
        prepared.sequences.push(hashes);
        prepared.packed.extend(packed);
    }
    Ok(prepared)
}

/// What [`prepare_prompts`] makes of each prompt.
#[derive(Default)]
struct PreparedPrompts {
    /// The select body's token array and closing brace.
    bodies: Vec<String>,
    /// The engines' block hashes.
    sequences: Vec<Vec<u64>>,
    /// The ids packed for the fake engines' events (empty when there are no engines).
    packed: Vec<PackedTokens>,
}

/// This process's user and system CPU seconds so far (all threads), from `/proc/self/stat`; `None`
/// where there is no such file. The kernel reports them in `USER_HZ` ticks, 100 a second on Linux.
fn process_cpu_s() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (in parentheses, which may contain spaces): utime and stime
    // are the 12th and 13th of them.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some((ticks(11)? / 100.0, ticks(12)? / 100.0))
}

/// `[1,2,3]}`: a prompt's token ids as a JSON array, and the brace that closes the body.
fn token_array_tail(tokens: &[u32]) -> String {
    // Vocabulary ids have at most six digits; one more byte for the comma.
    let mut out: Vec<u8> = Vec::with_capacity(tokens.len() * 7 + 3);
    out.push(b'[');
    for (k, &token) in tokens.iter().enumerate() {
        if k > 0 {
            out.push(b',');
        }
        let mut digits = [0u8; 10];
        let mut at = digits.len();
        let mut rest = token;
        loop {
            at -= 1;
            digits[at] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        out.extend_from_slice(&digits[at..]);
    }
    out.extend_from_slice(b"]}");
    // Only ASCII digits, commas and brackets were written.
    String::from_utf8(out).unwrap_or_default()
}

/// Token ids are drawn from a vocabulary of this size.
const VOCAB: u64 = 151_936;

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64 groups sharing a 2,048-token system prompt, each request adding 512 tokens of its own.
fn synthetic_prompts(cap: usize) -> Vec<Vec<u32>> {
    (0..1024u32)
        .map(|i| {
            let group = i % 64;
            let mut t: Vec<u32> = (0..2048).map(|k| group * 100_000 + k).collect();
            t.extend((0..512).map(|k| 10_000_000 + i * 1000 + k));
            t.truncate(cap);
            t
        })
        .collect()
}

/// A fake engine and the blocks it holds (oldest first), to publish only new blocks under the
/// right parent and evict like a full KV pool.
struct Engine {
    engine: FakeEngine,
    /// Blocks, each with its position in the order of insertion: held when the position is not
    /// below `evicted`. Evicted entries stay until the map has twice the capacity and is pruned
    /// in one pass: removing each as it is evicted cost a cache miss per block (the oldest
    /// entries are the coldest), a sixth of the fake engines' CPU.
    held: HashMap<u64, u64>,
    /// Held blocks, oldest first; evicting takes from the front.
    order: VecDeque<u64>,
    /// Blocks inserted at positions below this have been evicted.
    evicted: u64,
    /// Position the next inserted block gets.
    next_position: u64,
    /// Per prompt (index), the oldest position among its blocks when it was last cached whole:
    /// while nothing at or after it was evicted, the engine still holds the whole prompt, which
    /// answers the common repeat without looking up each of its blocks.
    cached_from: HashMap<usize, u64>,
    capacity: usize,
    block_size: u32,
}

impl Engine {
    /// Whether the engine certainly holds every block of prompt `prompt` (false: look closer).
    fn holds_prompt(&self, prompt: usize) -> bool {
        self.cached_from
            .get(&prompt)
            .is_some_and(|&oldest| oldest >= self.evicted)
    }

    /// Caches a prompt whose block sequence hashes are `sequence` (the engine hashes too) and
    /// returns the events that says: the blocks it did not hold, and the ones that makes it
    /// evict. `prompt` names a prompt that may come again (remembered), `None` a one-off.
    fn cache_prompt<'t>(
        &mut self,
        prompt: Option<usize>,
        tokens: PromptTokens<'t>,
        sequence: &[u64],
        step: &mut Step<'t>,
    ) {
        if prompt.is_some_and(|p| self.holds_prompt(p)) {
            return;
        }
        let mut oldest = u64::MAX;
        let mut have = 0;
        for h in sequence {
            let Some(&position) = self.held.get(h).filter(|&&p| p >= self.evicted) else {
                break;
            };
            oldest = oldest.min(position);
            have += 1;
        }
        if have < sequence.len() {
            let parent = have.checked_sub(1).map(|i| sequence[i]);
            let start = have * self.block_size as usize;
            let end = sequence.len() * self.block_size as usize;
            let (token_ids, packed) = match tokens {
                PromptTokens::Plain(tokens) => (&tokens[start..end], None),
                PromptTokens::Packed(packed) => (&[][..], packed.blocks(have, sequence.len())),
            };
            let blocks = StoredBlocks {
                parent,
                token_ids,
                block_size: self.block_size,
                ..StoredBlocks::default()
            };
            for &h in &sequence[have..] {
                // A hash repeated inside the prompt, or held past a missing one, keeps its place;
                // an evicted one (already out of `order`) comes back at the end.
                let position = match self.held.entry(h) {
                    Entry::Occupied(held) if *held.get() >= self.evicted => *held.get(),
                    entry => {
                        let position = self.next_position;
                        entry.insert(position);
                        self.order.push_back(h);
                        self.next_position += 1;
                        position
                    }
                };
                oldest = oldest.min(position);
            }
            let mut evicted = Vec::new();
            // `order` holds positions `evicted..next_position` in order: its front is the oldest.
            while self.order.len() > self.capacity {
                if let Some(h) = self.order.pop_front() {
                    self.evicted += 1;
                    evicted.push(h);
                }
            }
            if self.held.len() > 2 * self.capacity {
                let horizon = self.evicted;
                self.held.retain(|_, position| *position >= horizon);
            }
            let hashes = sequence[have..].to_vec();
            match packed {
                Some(run) => {
                    step.events.push(stored_event_packed(&blocks, hashes));
                    step.packed.push(Some(run));
                }
                None => {
                    step.events
                        .push(stored_event_with_hashes(&blocks, hashes).0);
                    step.packed.push(None);
                }
            }
            if !evicted.is_empty() {
                step.events.push(removed_event(&evicted, None));
                step.packed.push(None);
            }
        }
        if let Some(prompt) = prompt {
            self.cached_from.insert(prompt, oldest);
        }
    }

    /// Publishes one step's events in one batch, as vLLM does. (A failed publish, only seen at
    /// shutdown, leaves the books as if it had gone out.)
    async fn publish(&mut self, step: Step<'_>) {
        if !step.events.is_empty() {
            let _ = self
                .engine
                .publish_events_packed(step.events, &step.packed)
                .await;
        }
    }
}

/// A prompt's token ids as an engine publishes them: as they are, or packed once for a prompt
/// that comes again and again (then publishing its blocks copies bytes, as a real engine's
/// publisher on another host costs this machine nothing).
#[derive(Clone, Copy)]
enum PromptTokens<'a> {
    Plain(&'a [u32]),
    Packed(&'a PackedTokens),
}

/// The events of one engine step, each with its packed token ids if it has them.
#[derive(Default)]
struct Step<'a> {
    events: Vec<RawEvent>,
    packed: Vec<Option<PackedRun<'a>>>,
}

/// One fake engine with the prompts routed to it and not yet cached. Its flusher takes them all
/// at once and publishes them as one step, so an engine that fell behind catches up in few
/// messages, as a real engine's scheduler batches the requests of one step.
struct EngineSlot {
    engine: Mutex<Engine>,
    /// Routed prompts (by index), each with its place in the backlog.
    queue: std::sync::Mutex<Vec<(usize, tokio::sync::OwnedSemaphorePermit)>>,
    routed: tokio::sync::Notify,
}

impl EngineSlot {
    fn route(&self, prompt: usize, permit: tokio::sync::OwnedSemaphorePermit) {
        if let Ok(mut queue) = self.queue.lock() {
            queue.push((prompt, permit));
        }
        self.routed.notify_one();
    }

    /// Publishes what is routed to the engine until the run ends.
    /// `courteous`: yield the engines' thread after each stretch of work (see `engine_idle`).
    async fn flush_forever(
        &self,
        packed: &[PackedTokens],
        sequences: &[Vec<u64>],
        courteous: bool,
    ) {
        loop {
            self.routed.notified().await;
            let batch = self
                .queue
                .lock()
                .map(|mut queue| std::mem::take(&mut *queue))
                .unwrap_or_default();
            if batch.is_empty() {
                continue;
            }
            let mut engine = self.engine.lock().await;
            let mut step = Step::default();
            for &(prompt, _) in &batch {
                if let (Some(tokens), Some(sequence)) = (packed.get(prompt), sequences.get(prompt))
                {
                    engine.cache_prompt(
                        Some(prompt),
                        PromptTokens::Packed(tokens),
                        sequence,
                        &mut step,
                    );
                }
            }
            engine.publish(step).await;
            // The permits go back to the backlog with the batch.
            drop(batch);
            drop(engine);
            if courteous {
                courtesy::after_work(courtesy::STRETCH);
            }
        }
    }
}

type Engines = Arc<Vec<EngineSlot>>;

async fn start_engines(args: &LoadgenArgs) -> Result<Option<Engines>, String> {
    let Some(base) = args.events_base_port else {
        return Ok(None);
    };
    if args.workers == 0 {
        return Ok(None);
    }
    let mut engines = Vec::new();
    for id in 1..=args.workers {
        let address = format!("tcp://127.0.0.1:{}", u64::from(base) + id);
        let engine = FakeEngine::bind(&address, None, Encoding::Array)
            .await
            .map_err(|e| format!("fake engine for worker {id}: {e}"))?;
        engines.push(EngineSlot {
            engine: Mutex::new(Engine {
                engine,
                held: HashMap::new(),
                order: VecDeque::new(),
                evicted: 0,
                next_position: 0,
                cached_from: HashMap::new(),
                capacity: args.engine_kv_blocks.max(1),
                block_size: args.block_size,
            }),
            queue: std::sync::Mutex::new(Vec::new()),
            routed: tokio::sync::Notify::new(),
        });
    }
    Ok(Some(Arc::new(engines)))
}

#[cfg(test)]
mod tests {
    use super::{Engine, PackedTokens, PromptTokens, Step};
    use kvroute_wire::RawEvent;

    /// The fake engine's pool against a plain FIFO of held hashes: each prompt stores what the
    /// pool lacks from its first missing block on, and evicts the oldest past the capacity.
    #[tokio::test]
    async fn fake_engine_pools_store_and_evict_as_a_fifo_does() {
        let engine = kvroute_testkit::fake_engine::FakeEngine::bind(
            "tcp://127.0.0.1:0",
            None,
            kvroute_wire::Encoding::Array,
        )
        .await
        .unwrap();
        let capacity = 24;
        let mut pool = Engine {
            engine,
            held: Default::default(),
            order: Default::default(),
            evicted: 0,
            next_position: 0,
            cached_from: Default::default(),
            capacity,
            block_size: 2,
        };
        let mut model: std::collections::VecDeque<u64> = Default::default();
        let mut seed = 7u64;
        for round in 0..3000 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            // Prompts of 1..12 blocks over a small alphabet: shared prefixes and repeats.
            let blocks = (seed >> 33) % 12 + 1;
            let sequence: Vec<u64> = (0..blocks).map(|b| (seed >> (b % 20)) % 40 + 1).collect();
            let tokens: Vec<u32> = (0..2 * blocks as u32).collect();
            let packed = PackedTokens::new(&tokens, 2);
            let mut step = Step::default();
            pool.cache_prompt(None, PromptTokens::Packed(&packed), &sequence, &mut step);

            let have = sequence.iter().take_while(|h| model.contains(h)).count();
            for h in &sequence[have..] {
                if !model.contains(h) {
                    model.push_back(*h);
                }
            }
            let mut evicted = Vec::new();
            while model.len() > capacity {
                evicted.extend(model.pop_front());
            }
            let mut stored = Vec::new();
            let mut removed = Vec::new();
            for event in &step.events {
                match event {
                    RawEvent::Stored(s) => stored.extend_from_slice(&s.block_hashes),
                    RawEvent::Removed(r) => removed.extend_from_slice(&r.block_hashes),
                    _ => {}
                }
            }
            assert_eq!(stored, sequence[have..], "round {round}");
            assert_eq!(removed, evicted, "round {round}");
            let held: Vec<u64> = pool.order.iter().copied().collect();
            assert_eq!(held, Vec::from(model.clone()), "round {round}");
            assert!(pool.held.len() <= 2 * capacity + sequence.len());
        }
    }

    #[test]
    fn prepared_prompts_match_serde_and_the_hashes() {
        let prompts: Vec<Vec<u32>> = (0..37u32)
            .map(|i| {
                (0..(i * 29) % 300)
                    .map(|t| t.wrapping_mul(2_654_435_761) >> (t % 32))
                    .collect()
            })
            .filter(|p: &Vec<u32>| !p.is_empty())
            .collect();
        let prepared = super::prepare_prompts(&prompts, 16, true).unwrap();
        assert_eq!(prepared.bodies.len(), prompts.len());
        assert_eq!(prepared.packed.len(), prompts.len());
        for (i, p) in prompts.iter().enumerate() {
            let body = &prepared.bodies[i];
            assert_eq!(body, &(serde_json::to_string(p).unwrap() + "}"));
            let expected = super::PromptHashes::from_tokens(p, 16, super::BASE_SEED).sequence;
            assert_eq!(prepared.sequences[i], expected);
            assert_eq!(prepared.packed[i].len(), p.len());
        }
        assert!(
            super::prepare_prompts(&prompts, 16, false)
                .unwrap()
                .packed
                .is_empty()
        );
        assert_eq!(
            super::token_array_tail(&[0, 4_294_967_295]),
            "[0,4294967295]}"
        );
    }

    use super::reply_worker_id;

    #[test]
    fn worker_id_is_read_from_either_servers_reply() {
        assert_eq!(
            reply_worker_id(br#"{"reservation_id":"a","worker_id":17,"dp_rank":0}"#),
            Some(17)
        );
        assert_eq!(
            reply_worker_id(br#"{"reservation_id": "a", "worker_id" : 9, "dp_rank": 0}"#),
            Some(9)
        );
        assert_eq!(
            reply_worker_id(br#"{"error":"reservation x not found"}"#),
            None
        );
        assert_eq!(reply_worker_id(br#"{"worker_id":null}"#), None);
    }
}

#[derive(Default)]
struct Samples {
    /// Latencies in microseconds per route.
    routes: BTreeMap<&'static str, Vec<u32>>,
    cycles: Vec<u32>,
    statuses: BTreeMap<u16, u64>,
    transport_errors: u64,
    /// Bookings whose engine backlog was full, and the time they waited for room in it.
    backlog_waits: u64,
    backlog_wait_us: u64,
}

impl Samples {
    fn merge(&mut self, other: Samples) {
        for (route, mut v) in other.routes {
            self.routes.entry(route).or_default().append(&mut v);
        }
        self.cycles.extend(other.cycles);
        for (s, n) in other.statuses {
            *self.statuses.entry(s).or_default() += n;
        }
        self.transport_errors += other.transport_errors;
        self.backlog_waits += other.backlog_waits;
        self.backlog_wait_us += other.backlog_wait_us;
    }
}

/// A place in the engines' backlog, counting in `samples` a wait when the engines are behind
/// (`None` only once the backlog is closed).
async fn backlog_room(
    backlog: &Arc<tokio::sync::Semaphore>,
    samples: &mut Samples,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    if let Ok(permit) = Arc::clone(backlog).try_acquire_owned() {
        return Some(permit);
    }
    let waited = Instant::now();
    let permit = Arc::clone(backlog).acquire_owned().await.ok();
    samples.backlog_waits += 1;
    samples.backlog_wait_us += waited.elapsed().as_micros() as u64;
    permit
}

/// The `worker_id` of a reservation reply, read without parsing the whole document (both
/// servers put it at the top level and no string before it contains the key).
fn reply_worker_id(reply: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"worker_id\"";
    let at = memchr::memmem::find(reply, KEY)? + KEY.len();
    let rest = &reply[at..];
    let rest = &rest[rest.iter().position(|b| !b.is_ascii_whitespace())?..];
    let rest = rest.strip_prefix(b":")?;
    let rest = &rest[rest.iter().position(|b| !b.is_ascii_whitespace())?..];
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(v: &mut [u32], secs: f64) -> serde_json::Value {
    v.sort_unstable();
    json!({
        "count": v.len(),
        "rps": v.len() as f64 / secs,
        "p50_us": percentile(v, 0.5),
        "p90_us": percentile(v, 0.9),
        "p99_us": percentile(v, 0.99),
    })
}

async fn timed(
    client: &mut HttpClient,
    samples: &mut Samples,
    route: &'static str,
    method: &str,
    path: &str,
    body: &[&[u8]],
) -> Option<u16> {
    let start = Instant::now();
    match client.request_parts(method, path, body).await {
        Ok((status, _)) => {
            samples
                .routes
                .entry(route)
                .or_default()
                .push(start.elapsed().as_micros().min(u32::MAX as u128) as u32);
            *samples.statuses.entry(status).or_default() += 1;
            Some(status)
        }
        Err(_) => {
            samples.transport_errors += 1;
            None
        }
    }
}

async fn register(addr: SocketAddr, args: &LoadgenArgs) -> Result<(), String> {
    if args.skip_register {
        return Ok(());
    }
    let mut client = HttpClient::connect(addr)
        .await
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    for id in 1..=args.workers {
        let mut body = json!({
            "worker_id": id,
            "endpoint": format!("http://worker-{id}:8000"),
            "block_size": args.block_size,
        });
        if let Some(base) = args.events_base_port {
            body["kv_events_endpoint"] = json!(format!("tcp://127.0.0.1:{}", u64::from(base) + id));
        }
        let (status, reply) = client
            .request("POST", "/workers", Some(body.to_string().as_bytes()))
            .await
            .map_err(|e| format!("registering worker {id}: {e}"))?;
        if status != 201 && status != 200 {
            return Err(format!(
                "registering worker {id}: status {status}: {}",
                String::from_utf8_lossy(&reply)
            ));
        }
    }
    Ok(())
}

/// Runs a future on the fake engines' runtime and waits for it.
async fn on_engines<T: Send + 'static>(
    engines_rt: &tokio::runtime::Handle,
    task: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    engines_rt.spawn(task).await.ok()
}

async fn run_async(
    args: LoadgenArgs,
    engines_rt: tokio::runtime::Handle,
) -> Result<serde_json::Value, String> {
    let addr = resolve(&args.url)?;
    // The fake engines (stand-ins for engines on other hosts) run on a thread of their own, so
    // publishing never delays this process's clients, whose latencies are the measurement.
    // They bind first: a service that already lists their workers reconnects to them while the
    // prompts are read and prepared below (a second or more), instead of after.
    let engine_args = args.clone();
    let engines = on_engines(
        &engines_rt,
        async move { start_engines(&engine_args).await },
    )
    .await
    .ok_or("the fake engines' runtime stopped")??;
    let prompts = match &args.trace {
        Some(path) => trace_prompts(path, args.max_prompt_tokens)?,
        None => synthetic_prompts(args.max_prompt_tokens),
    };
    // Pre-render the select bodies' token arrays (with the closing brace) so JSON encoding is not
    // measured; each request sends its own short head and this tail without copying it. With
    // the engines' block hashes of every prompt, computed once, not per request; both on every
    // core (a trace's ~100 M tokens take seconds on one).
    let block_size = args.block_size as usize;
    let prepared = prepare_prompts(&prompts, block_size, args.events_base_port.is_some())?;
    let bodies: Arc<Vec<String>> = Arc::new(prepared.bodies);
    let sequences: Arc<Vec<Vec<u64>>> = Arc::new(prepared.sequences);
    let packed: Arc<Vec<PackedTokens>> = Arc::new(prepared.packed);
    let mean_tokens = prompts.iter().map(Vec::len).sum::<usize>() / prompts.len();
    register(addr, &args).await?;
    if let Some(engines) = &engines
        && args.subscriber_wait_secs > 0
    {
        // Let the service's listeners connect before the first events are published (all
        // engines at once: each wait ends with a short pause for the subscription frame).
        let engines = Arc::clone(engines);
        let wait = Duration::from_secs(args.subscriber_wait_secs);
        on_engines(&engines_rt, async move {
            let mut waits = tokio::task::JoinSet::new();
            for at in 0..engines.len() {
                let engines = Arc::clone(&engines);
                waits.spawn(async move {
                    if let Some(e) = engines.get(at) {
                        e.engine
                            .lock()
                            .await
                            .engine
                            .wait_for_subscribers(1, wait)
                            .await;
                    }
                });
            }
            while waits.join_next().await.is_some() {}
        })
        .await;
    }
    let duration = Duration::from_secs_f64(args.duration_secs.clamp(0.1, 3600.0));
    let counter = Arc::new(AtomicU64::new(0));
    // Prompts handed to the engines and not yet published, at most.
    let backlog = Arc::new(tokio::sync::Semaphore::new(256));
    let cpu_before = process_cpu_s();
    let start = Instant::now();
    let mut tasks = Vec::new();
    let prompts = Arc::new(prompts);
    // Engines at SCHED_IDLE stand in for engines on other hosts: besides giving a core up to a
    // thread that wakes, their thread yields after each stretch of work, so a client thread
    // that waits runnable for the core gets it then rather than at the next timer tick.
    let courteous = args.engine_idle;
    if let Some(engines) = &engines {
        for at in 0..engines.len() {
            let engines = Arc::clone(engines);
            let packed = Arc::clone(&packed);
            let sequences = Arc::clone(&sequences);
            engines_rt.spawn(async move {
                engines[at]
                    .flush_forever(&packed, &sequences, courteous)
                    .await
            });
        }
    }
    let mut storm = Vec::new();
    if let (true, Some(engines)) = (args.event_storm, &engines) {
        for (i, _) in engines.iter().enumerate() {
            let engines = Arc::clone(engines);
            let prompts = Arc::clone(&prompts);
            storm.push(engines_rt.spawn(async move {
                let mut n = i;
                while start.elapsed() < duration {
                    // Random-looking prompts the fleet never asks for: pure index churn.
                    let mut tokens = prompts[n % prompts.len()].clone();
                    for t in tokens.iter_mut().take(64) {
                        *t = t.wrapping_add(1 + (n as u32).wrapping_mul(7919));
                    }
                    let sequence =
                        PromptHashes::from_tokens(&tokens, block_size, BASE_SEED).sequence;
                    let mut engine = engines[i].engine.lock().await;
                    let mut step = Step::default();
                    engine.cache_prompt(None, PromptTokens::Plain(&tokens), &sequence, &mut step);
                    engine.publish(step).await;
                    drop(engine);
                    if courteous {
                        courtesy::after_work(courtesy::STRETCH);
                    }
                    n += engines.len();
                    tokio::task::yield_now().await;
                }
                (n - i) / engines.len().max(1)
            }));
        }
    }
    for task in 0..args.concurrency.max(1) {
        let engines = engines.clone();
        let backlog = Arc::clone(&backlog);
        let bodies = Arc::clone(&bodies);
        let counter = Arc::clone(&counter);
        let label = args.label.clone();
        let mode = args.mode;
        let max = args.max_requests;
        tasks.push(tokio::spawn(async move {
            let mut samples = Samples::default();
            let Ok(mut client) = HttpClient::connect(addr).await else {
                samples.transport_errors += 1;
                return samples;
            };
            while start.elapsed() < duration {
                let n = counter.fetch_add(1, Ordering::Relaxed);
                if n >= max {
                    break;
                }
                let id = format!("{label}-{task}-{n}");
                let index = (n as usize) % bodies.len();
                let tokens = &bodies[index];
                let (route, id_field) = match mode {
                    Mode::Reserve => ("select_and_reserve", "reservation_id"),
                    Mode::Select | Mode::Cycle => ("select", "selection_id"),
                };
                let head = format!("{{\"{id_field}\":\"{id}\",\"token_ids\":");
                let cycle_start = Instant::now();
                let status = timed(
                    &mut client,
                    &mut samples,
                    route,
                    "POST",
                    &format!("/{route}"),
                    &[head.as_bytes(), tokens.as_bytes()],
                )
                .await;
                if mode == Mode::Reserve && status == Some(200) {
                    let free = format!("/reservations/{id}");
                    timed(&mut client, &mut samples, "free", "DELETE", &free, &[]).await;
                }
                if mode == Mode::Cycle && status == Some(200) {
                    let reserve = format!("{{\"selection_id\":\"{id}\"}}");
                    let start_booking = Instant::now();
                    let booked = match client
                        .request("POST", "/reservations", Some(reserve.as_bytes()))
                        .await
                    {
                        Ok((status, reply)) => {
                            samples
                                .routes
                                .entry("reservations")
                                .or_default()
                                .push(start_booking.elapsed().as_micros().min(u32::MAX as u128)
                                    as u32);
                            *samples.statuses.entry(status).or_default() += 1;
                            let worker = reply_worker_id(&reply);
                            // The engine that got the request now caches its prompt.
                            // An engine that holds the whole prompt has nothing to publish:
                            // seen from here, without a round trip to the engines' thread.
                            let held = |engines: &Engines, at: usize| {
                                engines.get(at).is_some_and(|e| {
                                    e.engine.try_lock().is_ok_and(|e| e.holds_prompt(index))
                                })
                            };
                            if let (Some(engines), Some(w)) = (&engines, worker)
                                && !held(engines, (w as usize).wrapping_sub(1))
                            {
                                // The engine publishes in the background, as a real one
                                // does while it serves the request; a bounded backlog
                                // makes the clients wait when the engines fall behind.
                                let at = (w as usize).wrapping_sub(1);
                                if let (Some(engine), Some(permit)) =
                                    (engines.get(at), backlog_room(&backlog, &mut samples).await)
                                {
                                    engine.route(index, permit);
                                }
                            }
                            Some(status)
                        }
                        Err(_) => {
                            samples.transport_errors += 1;
                            None
                        }
                    };
                    if booked == Some(201) {
                        let prefill = format!("/reservations/{id}/prefill_complete");
                        timed(
                            &mut client,
                            &mut samples,
                            "prefill_complete",
                            "POST",
                            &prefill,
                            &[b"{}"],
                        )
                        .await;
                        let free = format!("/reservations/{id}");
                        timed(&mut client, &mut samples, "free", "DELETE", &free, &[]).await;
                    }
                }
                if status.is_none() {
                    // The connection is unusable after a transport error: reconnect.
                    match HttpClient::connect(addr).await {
                        Ok(c) => client = c,
                        Err(_) => break,
                    }
                }
                samples
                    .cycles
                    .push(cycle_start.elapsed().as_micros().min(u32::MAX as u128) as u32);
            }
            samples
        }));
    }
    let mut all = Samples::default();
    for t in tasks {
        if let Ok(s) = t.await {
            all.merge(s);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // The load generator's own CPU over the measured loop (clients and fake engines), so that a
    // run can say how much of the machine the harness took per request.
    let cpu = process_cpu_s()
        .zip(cpu_before)
        .map(|((u1, s1), (u0, s0))| json!({"user_s": u1 - u0, "system_s": s1 - s0}));
    let mut storm_prompts = 0;
    for t in storm {
        storm_prompts += t.await.unwrap_or(0);
    }
    let mut routes = serde_json::Map::new();
    for (route, v) in all.routes.iter_mut() {
        routes.insert((*route).to_string(), summary(v, secs));
    }
    let errors: u64 = all
        .statuses
        .iter()
        .filter(|(s, _)| **s >= 400)
        .map(|(_, n)| n)
        .sum::<u64>()
        + all.transport_errors;
    Ok(json!({
        "label": args.label,
        "url": args.url,
        "mode": format!("{:?}", args.mode).to_lowercase(),
        "workers": args.workers,
        "concurrency": args.concurrency,
        "duration_s": secs,
        "prompts": prompts.len(),
        "mean_prompt_tokens": mean_tokens,
        "cycles": summary(&mut all.cycles, secs),
        "routes": routes,
        "statuses": all.statuses.iter().map(|(s, n)| (s.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
        "errors": errors,
        "loadgen_cpu": cpu,
        "engine_backlog_waits": all.backlog_waits,
        "engine_backlog_wait_s": all.backlog_wait_us as f64 / 1e6,
        "events": args.events_base_port.is_some(),
        "event_storm_prompts": storm_prompts,
        "engine_nice": args.engine_nice,
        "engine_idle": args.engine_idle,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    }))
}

fn print_table(report: &serde_json::Value) {
    println!(
        "{} ({} mode, {} workers, concurrency {}, {:.1} s, mean prompt {} tokens): {} errors",
        report["label"].as_str().unwrap_or(""),
        report["mode"].as_str().unwrap_or(""),
        report["workers"],
        report["concurrency"],
        report["duration_s"].as_f64().unwrap_or(0.0),
        report["mean_prompt_tokens"],
        report["errors"]
    );
    println!(
        "{:<18} {:>9} {:>10} {:>9} {:>9} {:>9}",
        "route", "count", "req/s", "p50 µs", "p90 µs", "p99 µs"
    );
    let mut rows: Vec<(String, &serde_json::Value)> = report["routes"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v)).collect())
        .unwrap_or_default();
    rows.push(("cycle".to_string(), &report["cycles"]));
    for (name, r) in rows {
        println!(
            "{:<18} {:>9} {:>10.0} {:>9} {:>9} {:>9}",
            name,
            r["count"],
            r["rps"].as_f64().unwrap_or(0.0),
            r["p50_us"],
            r["p90_us"],
            r["p99_us"]
        );
    }
}

pub fn run(args: LoadgenArgs) -> ExitCode {
    // The clients share one thread: a closed loop of keep-alive connections needs no work
    // stealing, and on a machine shared with the server every wakeup of a second client thread
    // is CPU taken from the server being measured.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute loadgen: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let nice = args.engine_nice.min(19);
    let idle = args.engine_idle;
    let engines_rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("fake-engines")
        .enable_all()
        .on_thread_unpark(courtesy::woke)
        .on_thread_start(move || {
            // Best effort: failing that, the engines publish at normal priority.
            if !idle || idle_current_thread().is_err() {
                let _ = lower_current_thread_priority(nice);
            }
        })
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute loadgen: cannot start the engines' runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let out = args.out.clone();
    let result = runtime.block_on(run_async(args, engines_rt.handle().clone()));
    engines_rt.shutdown_background();
    match result {
        Ok(report) => {
            print_table(&report);
            if let Some(path) = out {
                let text = serde_json::to_string_pretty(&report).unwrap_or_default();
                if let Err(e) = std::fs::write(&path, text) {
                    eprintln!("kvroute loadgen: cannot write {path:?}: {e}");
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("kvroute loadgen: {message}");
            ExitCode::from(2)
        }
    }
}
