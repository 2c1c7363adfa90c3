//! The agentic workload (`--synthetic agentic`): tenants, multi-turn tool-using
//! sessions, fan-out bursts and one-shot requests, seeded.
//!
//! - **Tenants** (`tenants`, 8): each has its own system prompt, of a length drawn once per tenant
//!   from `system` (2,048–8,192 tokens). Every request of a tenant starts with it.
//! - **Sessions** (`sessions`, 256): each belongs to a tenant drawn uniformly, starts with a
//!   `user`-token (512) first message and runs a number of turns drawn from `turns` (2–12). Turn
//!   *k + 1*'s prompt is turn *k*'s prompt, then the assistant's output of turn *k* (its
//!   `output_tokens`), then a tool output of `tool` tokens (128–4,096), so the context grows with
//!   every turn and each prompt extends the previous one. A session ends early once its context
//!   would pass `max-context` tokens (65,536).
//! - **Fan-out** (`fanout-p`, 0.1; `fanout`, 2–8): a turn is, with that probability, a burst of
//!   siblings that arrive together and share all but the last block of their prompts (each adds
//!   its own tail that completes the context's last block, or fills a new one when the context is
//!   block-aligned). The session continues from the first sibling.
//! - **One-shot requests** (`one-shot`, 0.2 of all requests): a tenant's system prompt and a
//!   `user`-token question of their own, one turn; they arrive as a Poisson process over the same
//!   span as the session starts.
//! - **Output** (`output`, 32–512 tokens), drawn per request.
//! - **Arrivals**: sessions start as a Poisson process at `session-rate` (1 session/s) ×
//!   `--arrival-speedup` (or `--rate` sessions/s); the speed-up only makes sessions denser, it
//!   does not shorten think times. The simulator replays precomputed arrival times (it has no
//!   closed-loop follow-ups), so a turn arrives at the previous turn's arrival + an *estimated*
//!   service time + a think time: the estimate is the turn's new prompt tokens at
//!   `est-prefill-tokens-per-ms` (40) plus its largest output at `est-ms-per-token` (20 ms) —
//!   about a loaded engine's pace; a turn can still arrive before its predecessor finishes when the
//!   fleet is slower than that. Think times are exponential with mean `think-ms` (1,500 ms).
//!
//! Every request carries its session id: sessions are `0..sessions`, one-shot requests take the
//! ids after them. Lengths are drawn uniformly from their inclusive ranges. The same spec and seed
//! give the same workload.
//!
//! Spec syntax: `agentic` or `agentic:key=value,...`, ranges as `MIN-MAX` or a single number, e.g.
//! `agentic:sessions=64,turns=4-20,fanout-p=0.3`.

use super::{
    ArrivalOptions, SYSTEM_SEGMENT, SimRequest, Workload, mix64, push_segment, validate_block_size,
};
use crate::SimError;
use crate::timing::Nanos;
use kvroute_core::hash::{BASE_SEED, PromptHashes};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Segment keys of the agentic workload: never equal to another workload's (see `workload`).
const AGENTIC_SEGMENT: u64 = 5 << 60;

/// An inclusive range of lengths.
pub type Span = (usize, usize);

/// The agentic workload's parameters (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AgenticSpec {
    pub tenants: usize,
    pub sessions: usize,
    /// Turns per session.
    pub turns: Span,
    /// System prompt tokens, drawn once per tenant.
    pub system_tokens: Span,
    /// Tokens of a session's first message and of a one-shot question.
    pub user_tokens: usize,
    /// Tokens a tool output adds to the context after each turn.
    pub tool_tokens: Span,
    /// Output tokens per request.
    pub output_tokens: Span,
    /// Mean think time between a turn's (estimated) completion and the next turn, ms.
    pub think_ms: f64,
    /// Probability that a turn is a fan-out burst.
    pub fanout_probability: f64,
    /// Siblings in a burst.
    pub fanout: Span,
    /// Share of all requests that are one-shot (0 ≤ share < 1).
    pub one_shot_share: f64,
    /// Session starts per second (before the arrival options).
    pub session_rate: f64,
    /// A session stops before its context passes this many tokens.
    pub max_context_tokens: usize,
    /// Estimated prefill pace for the turn arrivals, new prompt tokens per ms.
    pub est_prefill_tokens_per_ms: f64,
    /// Estimated decode pace for the turn arrivals, ms per output token.
    pub est_ms_per_token: f64,
    /// Tenant 0 starts this many times as many sessions (and one-shot requests) as each other
    /// tenant (1: all alike), for the router queue's fairness experiments.
    pub tenant_skew: f64,
    pub seed: u64,
}

impl Default for AgenticSpec {
    fn default() -> Self {
        Self {
            tenants: 8,
            sessions: 256,
            turns: (2, 12),
            system_tokens: (2_048, 8_192),
            user_tokens: 512,
            tool_tokens: (128, 4_096),
            output_tokens: (32, 512),
            think_ms: 1_500.0,
            fanout_probability: 0.1,
            fanout: (2, 8),
            one_shot_share: 0.2,
            session_rate: 1.0,
            max_context_tokens: 65_536,
            tenant_skew: 1.0,
            est_prefill_tokens_per_ms: 40.0,
            est_ms_per_token: 20.0,
            seed: 0,
        }
    }
}

fn parse_span(key: &str, value: &str) -> Result<Span, SimError> {
    let bad = || {
        SimError::invalid(
            "synthetic",
            format!("agentic `{key}`: expected N or MIN-MAX, got `{value}`"),
        )
    };
    let (lo, hi) = value.split_once('-').unwrap_or((value, value));
    let lo: usize = lo.trim().parse().map_err(|_| bad())?;
    let hi: usize = hi.trim().parse().map_err(|_| bad())?;
    if lo > hi {
        return Err(bad());
    }
    Ok((lo, hi))
}

fn parse_number<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, SimError> {
    value.trim().parse().map_err(|_| {
        SimError::invalid(
            "synthetic",
            format!("agentic `{key}`: not a number: `{value}`"),
        )
    })
}

impl AgenticSpec {
    /// Parses `agentic` or `agentic:key=value,...`; `None` when `text` is not an agentic spec.
    pub fn parse(text: &str, seed: u64) -> Option<Result<Self, SimError>> {
        let rest = text.trim().strip_prefix("agentic")?;
        let mut spec = Self {
            seed,
            ..Self::default()
        };
        let options = match rest.strip_prefix(':') {
            Some(options) => options,
            None if rest.is_empty() => "",
            None => return None,
        };
        for item in options.split(',').filter(|s| !s.trim().is_empty()) {
            let Some((key, value)) = item.split_once('=') else {
                return Some(Err(SimError::invalid(
                    "synthetic",
                    format!("agentic: expected key=value, got `{item}`"),
                )));
            };
            let key = key.trim();
            let result = match key {
                "tenants" => parse_number(key, value).map(|v| spec.tenants = v),
                "sessions" => parse_number(key, value).map(|v| spec.sessions = v),
                "turns" => parse_span(key, value).map(|v| spec.turns = v),
                "system" => parse_span(key, value).map(|v| spec.system_tokens = v),
                "user" => parse_number(key, value).map(|v| spec.user_tokens = v),
                "tool" => parse_span(key, value).map(|v| spec.tool_tokens = v),
                "output" => parse_span(key, value).map(|v| spec.output_tokens = v),
                "think-ms" => parse_number(key, value).map(|v| spec.think_ms = v),
                "fanout-p" => parse_number(key, value).map(|v| spec.fanout_probability = v),
                "fanout" => parse_span(key, value).map(|v| spec.fanout = v),
                "one-shot" => parse_number(key, value).map(|v| spec.one_shot_share = v),
                "session-rate" => parse_number(key, value).map(|v| spec.session_rate = v),
                "max-context" => parse_number(key, value).map(|v| spec.max_context_tokens = v),
                "est-prefill-tokens-per-ms" => {
                    parse_number(key, value).map(|v| spec.est_prefill_tokens_per_ms = v)
                }
                "est-ms-per-token" => parse_number(key, value).map(|v| spec.est_ms_per_token = v),
                "tenant-skew" => parse_number(key, value).map(|v| spec.tenant_skew = v),
                _ => Err(SimError::invalid(
                    "synthetic",
                    format!("agentic: unknown key `{key}`"),
                )),
            };
            if let Err(e) = result {
                return Some(Err(e));
            }
        }
        Some(spec.validate().map(|()| spec))
    }

    pub fn validate(&self) -> Result<(), SimError> {
        let bad =
            |reason: String| Err(SimError::invalid("synthetic", format!("agentic: {reason}")));
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if self.tenants == 0 {
            return bad("tenants must be at least 1".into());
        }
        if !(self.tenant_skew.is_finite() && self.tenant_skew > 0.0) {
            return bad(format!(
                "tenant-skew must be a positive number, got {}",
                self.tenant_skew
            ));
        }
        if self.turns.0 == 0 || self.fanout.0 == 0 {
            return bad("turns and fanout must be at least 1".into());
        }
        for (name, span) in [
            ("turns", self.turns),
            ("system", self.system_tokens),
            ("tool", self.tool_tokens),
            ("output", self.output_tokens),
            ("fanout", self.fanout),
        ] {
            if span.0 > span.1 {
                return bad(format!("{name}: MIN must not exceed MAX"));
            }
        }
        if self.system_tokens.0 + self.user_tokens == 0 {
            return bad("system prompt and user message cannot both be empty".into());
        }
        if !(0.0..=1.0).contains(&self.fanout_probability) {
            return bad(format!(
                "fanout-p must be in [0, 1], got {}",
                self.fanout_probability
            ));
        }
        if !(0.0..1.0).contains(&self.one_shot_share) {
            return bad(format!(
                "one-shot must be in [0, 1), got {}",
                self.one_shot_share
            ));
        }
        if !(self.think_ms.is_finite() && self.think_ms >= 0.0) {
            return bad(format!("think-ms must be ≥ 0, got {}", self.think_ms));
        }
        for (name, x) in [
            ("session-rate", self.session_rate),
            ("est-prefill-tokens-per-ms", self.est_prefill_tokens_per_ms),
            ("est-ms-per-token", self.est_ms_per_token),
        ] {
            if !positive(x) {
                return bad(format!("{name} must be a positive number, got {x}"));
            }
        }
        if self.sessions == 0 && self.one_shot_share == 0.0 {
            return bad("no sessions and no one-shot requests".into());
        }
        Ok(())
    }

    /// A one-line description for the report.
    pub fn describe(&self, session_rate: f64) -> String {
        let skew = if self.tenant_skew == 1.0 {
            String::new()
        } else {
            format!(" (tenant 0 ×{})", self.tenant_skew)
        };
        format!(
            "synthetic agentic ({} tenants{skew}, {} sessions of {}-{} turns, fan-out p {} of {}-{}, \
             one-shot {}, {} sessions/s, seed {})",
            self.tenants,
            self.sessions,
            self.turns.0,
            self.turns.1,
            self.fanout_probability,
            self.fanout.0,
            self.fanout.1,
            self.one_shot_share,
            session_rate,
            self.seed
        )
    }
}

/// One generated request before hashing, with where it sits in its session.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AgenticItem {
    pub arrival_ms: f64,
    pub session: u64,
    pub tenant: usize,
    /// Turn index in the session (0 for one-shot requests).
    pub turn: usize,
    /// Index in a fan-out burst (0 when the turn is a single request).
    pub sibling: usize,
    /// Size of the burst (1 when the turn is a single request); `None` for one-shot requests.
    pub burst: Option<usize>,
    pub tokens: Vec<u32>,
    pub output_tokens: u64,
}

fn draw(rng: &mut SmallRng, span: Span) -> usize {
    rng.random_range(span.0..=span.1)
}

/// A tenant: uniform, or tenant 0 `tenant_skew` times as likely as each other one.
fn draw_tenant(rng: &mut SmallRng, spec: &AgenticSpec) -> usize {
    if spec.tenant_skew == 1.0 || spec.tenants == 1 {
        return rng.random_range(0..spec.tenants);
    }
    let total = spec.tenant_skew + (spec.tenants - 1) as f64;
    let x = rng.random::<f64>() * total;
    if x < spec.tenant_skew {
        0
    } else {
        (1 + ((x - spec.tenant_skew) as usize)).min(spec.tenants - 1)
    }
}

fn exponential(rng: &mut SmallRng, mean: f64) -> f64 {
    let u: f64 = rng.random();
    -(1.0 - u).ln() * mean
}

/// A segment key unique to `(session, turn, kind, index)`.
fn key(session: u64, turn: usize, kind: u64, index: usize) -> u64 {
    AGENTIC_SEGMENT
        | (mix64(session ^ mix64((turn as u64) << 8 | kind) ^ mix64(index as u64 + 1))
            & ((1 << 60) - 1))
}

const USER: u64 = 1;
const OUTPUT: u64 = 2;
const TOOL: u64 = 3;
const TAIL: u64 = 4;
const ONE_SHOT: u64 = 5;

/// Generates the requests (unsorted), arrivals in ms at `session_rate` sessions per second.
pub(crate) fn generate(
    spec: &AgenticSpec,
    block_size: usize,
    session_rate: f64,
) -> Vec<AgenticItem> {
    let mut rng = SmallRng::seed_from_u64(spec.seed ^ 0x4147_454e_5449_4321);
    let system: Vec<usize> = (0..spec.tenants)
        .map(|_| draw(&mut rng, spec.system_tokens))
        .collect();
    let system_of = |tenant: usize| {
        let mut tokens = Vec::with_capacity(system[tenant]);
        push_segment(
            &mut tokens,
            SYSTEM_SEGMENT | 1 << 40 | tenant as u64,
            system[tenant],
        );
        tokens
    };
    let mut items = Vec::new();
    let mut start_ms = 0.0f64;
    for s in 0..spec.sessions {
        if s > 0 {
            start_ms += exponential(&mut rng, 1e3 / session_rate);
        }
        let session = s as u64;
        let tenant = draw_tenant(&mut rng, spec);
        let turns = draw(&mut rng, spec.turns);
        let mut context = system_of(tenant);
        push_segment(&mut context, key(session, 0, USER, 0), spec.user_tokens);
        let mut arrival_ms = start_ms;
        let mut new_tokens = context.len();
        for turn in 0..turns {
            let burst = if rng.random_bool(spec.fanout_probability) {
                draw(&mut rng, spec.fanout)
            } else {
                1
            };
            let mut longest_output = 0u64;
            let mut first: Option<(Vec<u32>, u64)> = None;
            for sibling in 0..burst {
                let mut tokens = context.clone();
                if burst > 1 {
                    // Complete the context's last block (or fill a new one): every sibling's
                    // prompt shares all its blocks but the last.
                    let tail = block_size - context.len() % block_size;
                    push_segment(&mut tokens, key(session, turn, TAIL, sibling), tail);
                }
                let output_tokens = draw(&mut rng, spec.output_tokens) as u64;
                longest_output = longest_output.max(output_tokens);
                if sibling == 0 {
                    first = Some((tokens.clone(), output_tokens));
                }
                items.push(AgenticItem {
                    arrival_ms,
                    session,
                    tenant,
                    turn,
                    sibling,
                    burst: Some(burst),
                    tokens,
                    output_tokens,
                });
            }
            let Some((mut next, output_tokens)) = first else {
                break;
            };
            let tool = draw(&mut rng, spec.tool_tokens);
            let before = context.len();
            push_segment(
                &mut next,
                key(session, turn, OUTPUT, 0),
                output_tokens as usize,
            );
            push_segment(&mut next, key(session, turn, TOOL, 0), tool);
            if next.len() > spec.max_context_tokens {
                break;
            }
            let service_ms = new_tokens as f64 / spec.est_prefill_tokens_per_ms
                + longest_output as f64 * spec.est_ms_per_token;
            arrival_ms += service_ms + exponential(&mut rng, spec.think_ms);
            new_tokens = next.len() - before;
            context = next;
        }
    }
    // One-shot requests: `share` of all requests, Poisson over the sessions' start span.
    let one_shots = if spec.one_shot_share > 0.0 {
        let share = spec.one_shot_share;
        ((items.len() as f64 * share / (1.0 - share)).round() as usize)
            .max(usize::from(items.is_empty()))
    } else {
        0
    };
    let span_ms = start_ms.max(1e3 / session_rate);
    let mut one_shot_ms = 0.0f64;
    for j in 0..one_shots {
        if j > 0 {
            one_shot_ms += exponential(&mut rng, span_ms / one_shots as f64);
        }
        let tenant = draw_tenant(&mut rng, spec);
        let session = (spec.sessions + j) as u64;
        let mut tokens = system_of(tenant);
        push_segment(&mut tokens, key(session, 0, ONE_SHOT, 0), spec.user_tokens);
        items.push(AgenticItem {
            arrival_ms: one_shot_ms,
            session,
            tenant,
            turn: 0,
            sibling: 0,
            burst: None,
            tokens,
            output_tokens: draw(&mut rng, spec.output_tokens) as u64,
        });
    }
    items
}

/// Builds the agentic workload. `arrival.speedup` multiplies the session rate, `arrival.rate_rps`
/// (when set) replaces it (sessions per second), `arrival.max_requests` keeps the first N
/// arrivals.
pub fn agentic_workload(
    spec: &AgenticSpec,
    block_size: u32,
    arrival: &ArrivalOptions,
) -> Result<Workload, SimError> {
    arrival.validate()?;
    validate_block_size(block_size)?;
    spec.validate()?;
    let session_rate = arrival
        .rate_rps
        .unwrap_or(spec.session_rate * arrival.speedup);
    let mut items = generate(spec, block_size as usize, session_rate);
    // Arrival order; ties keep the generation order (stable sort).
    items.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    items.truncate(arrival.max_requests.unwrap_or(usize::MAX));
    let requests = items
        .iter()
        .map(|item| SimRequest {
            arrival_nanos: (item.arrival_ms * 1e6).round() as Nanos,
            prompt: PromptHashes::from_tokens(&item.tokens, block_size as usize, BASE_SEED),
            output_tokens: item.output_tokens,
            session_id: Some(item.session),
            tenant: Some(item.tenant as u32),
        })
        .collect();
    Ok(Workload {
        name: spec.describe(session_rate),
        block_size,
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn small() -> AgenticSpec {
        AgenticSpec {
            sessions: 40,
            tenants: 3,
            turns: (3, 6),
            system_tokens: (300, 700),
            user_tokens: 50,
            tool_tokens: (10, 200),
            output_tokens: (5, 80),
            fanout_probability: 0.3,
            seed: 11,
            ..AgenticSpec::default()
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_requests_and_another_seed_others() {
        let a = agentic_workload(&small(), 64, &ArrivalOptions::default()).unwrap();
        let b = agentic_workload(&small(), 64, &ArrivalOptions::default()).unwrap();
        assert_eq!(a, b);
        let other = AgenticSpec {
            seed: 12,
            ..small()
        };
        let c = agentic_workload(&other, 64, &ArrivalOptions::default()).unwrap();
        assert_ne!(a.requests, c.requests);
        assert!(
            a.requests
                .windows(2)
                .all(|p| p[0].arrival_nanos <= p[1].arrival_nanos)
        );
        assert!(a.requests.iter().all(|r| r.session_id.is_some()));
        // One-shot requests are about a fifth of the total.
        let one_shots = a
            .requests
            .iter()
            .filter(|r| r.session_id.unwrap() >= 40)
            .count();
        let share = one_shots as f64 / a.requests.len() as f64;
        assert!((share - 0.2).abs() < 0.02, "{share}");
    }

    #[test]
    fn each_turn_extends_the_previous_one() {
        let items = generate(&small(), 64, 1.0);
        let mut chains: BTreeMap<u64, Vec<&AgenticItem>> = BTreeMap::new();
        for item in items.iter().filter(|i| i.burst.is_some() && i.sibling == 0) {
            chains.entry(item.session).or_default().push(item);
        }
        let mut checked = 0;
        for chain in chains.values() {
            for pair in chain.windows(2) {
                let (prev, next) = (pair[0], pair[1]);
                assert_eq!(next.turn, prev.turn + 1);
                assert!(next.arrival_ms > prev.arrival_ms);
                assert!(next.tokens.len() > prev.tokens.len());
                assert_eq!(next.tokens[..prev.tokens.len()], prev.tokens[..]);
                // Hashed, every full block of the previous turn is a prefix of the next one.
                let hp = PromptHashes::from_tokens(&prev.tokens, 64, BASE_SEED);
                let hn = PromptHashes::from_tokens(&next.tokens, 64, BASE_SEED);
                assert_eq!(hn.sequence[..hp.sequence.len()], hp.sequence[..]);
                checked += 1;
            }
        }
        assert!(checked > 50, "{checked}");
    }

    #[test]
    fn siblings_share_all_but_the_last_block() {
        let items = generate(&small(), 64, 1.0);
        let mut bursts: BTreeMap<(u64, usize), Vec<PromptHashes>> = BTreeMap::new();
        for item in items.iter().filter(|i| i.burst.is_some_and(|b| b > 1)) {
            assert!(item.tokens.len().is_multiple_of(64));
            bursts
                .entry((item.session, item.turn))
                .or_default()
                .push(PromptHashes::from_tokens(&item.tokens, 64, BASE_SEED));
        }
        assert!(bursts.len() > 5, "{}", bursts.len());
        for siblings in bursts.values() {
            assert!((2..=8).contains(&siblings.len()));
            let n = siblings[0].sequence.len();
            let last: std::collections::BTreeSet<u64> =
                siblings.iter().map(|h| h.sequence[n - 1]).collect();
            assert_eq!(last.len(), siblings.len(), "last blocks all differ");
            for h in siblings {
                assert_eq!(h.sequence.len(), n);
                assert_eq!(h.sequence[..n - 1], siblings[0].sequence[..n - 1]);
            }
        }
    }

    #[test]
    fn a_tenants_requests_share_its_system_prompt_and_only_that() {
        let spec = small();
        let items = generate(&spec, 64, 1.0);
        let mut first_blocks: BTreeMap<usize, std::collections::BTreeSet<u64>> = BTreeMap::new();
        let mut system_len: BTreeMap<usize, usize> = BTreeMap::new();
        for item in &items {
            // The tenant's system prompt is at least 300 tokens: 4 full blocks.
            let h = PromptHashes::from_tokens(&item.tokens[..256], 64, BASE_SEED);
            first_blocks
                .entry(item.tenant)
                .or_default()
                .insert(h.sequence[3]);
            // A one-shot request is the system prompt then its own 50-token question.
            if item.burst.is_none() {
                system_len.insert(item.tenant, item.tokens.len() - spec.user_tokens);
            }
        }
        assert_eq!(first_blocks.len(), 3);
        assert!(first_blocks.values().all(|s| s.len() == 1));
        let distinct: std::collections::BTreeSet<u64> = first_blocks
            .values()
            .flat_map(|s| s.iter().copied())
            .collect();
        assert_eq!(distinct.len(), 3, "tenants do not share their prompts");
        // Two requests of a tenant agree on exactly the system prompt (plus chance equal tokens).
        for (&tenant, &len) in &system_len {
            let of_tenant: Vec<&AgenticItem> =
                items.iter().filter(|i| i.tenant == tenant).collect();
            for pair in of_tenant.windows(2) {
                if pair[0].session != pair[1].session {
                    assert_eq!(pair[0].tokens[..len], pair[1].tokens[..len]);
                    assert_ne!(pair[0].tokens[len..len + 8], pair[1].tokens[len..len + 8]);
                }
            }
        }
    }

    #[test]
    fn specs_parse() {
        assert_eq!(
            AgenticSpec::parse("agentic", 3).unwrap().unwrap(),
            AgenticSpec {
                seed: 3,
                ..AgenticSpec::default()
            }
        );
        let s = AgenticSpec::parse("agentic:sessions=5,turns=4-20,fanout-p=0.5,think-ms=0", 0)
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.sessions, s.turns, s.fanout_probability),
            (5, (4, 20), 0.5)
        );
        assert_eq!(s.think_ms, 0.0);
        assert!(AgenticSpec::parse("16x64", 0).is_none());
        assert!(AgenticSpec::parse("agenticx", 0).is_none());
        for bad in [
            "agentic:nope=1",
            "agentic:turns=5-2",
            "agentic:fanout-p=2",
            "agentic:one-shot=1",
            "agentic:tenants=0",
            "agentic:sessions",
        ] {
            assert!(AgenticSpec::parse(bad, 0).unwrap().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_arrival_speedup_makes_sessions_denser() {
        let plain = agentic_workload(&small(), 64, &ArrivalOptions::default()).unwrap();
        let fast = agentic_workload(
            &small(),
            64,
            &ArrivalOptions {
                speedup: 4.0,
                ..ArrivalOptions::default()
            },
        )
        .unwrap();
        assert_eq!(plain.requests.len(), fast.requests.len());
        let last = |w: &Workload| w.requests.last().unwrap().arrival_nanos;
        assert!(last(&fast) < last(&plain));
        let limited = agentic_workload(
            &small(),
            64,
            &ArrivalOptions {
                max_requests: Some(7),
                ..ArrivalOptions::default()
            },
        )
        .unwrap();
        assert_eq!(limited.requests[..], plain.requests[..7]);
    }
}
