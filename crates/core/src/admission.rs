//! Admission control: the router-side queue that holds selections while every
//! candidate rank of their partition is over the queue threshold, in the order of a
//! [`QueuePolicy`], shared fairly between tenants.
//!
//! The queue is a plain data structure, generic over what a waiting request carries (`T`: the
//! service's reply channel, the simulator's request id). Its edges decide when to queue
//! ([`over_threshold`]) and when to take the next request out (after a booking's prefill
//! completes or it is freed); the queue decides which one.
//!
//! - **Order inside a tenant**, as Dynamo 1.6.1 orders its queue (recorded in
//!   `crates/service/tests/fixtures/dynamo/queue.json`): `strict_priority` first (higher
//!   first), then the policy's score (higher first, [`QueuePolicy`]), then enqueue order. A
//!   negative `priority_jump` counts as 0.
//! - **Aging** (kvroute's addition): a request that has waited `max_wait_before_promotion` is
//!   taken before its tenant's others, oldest first, whatever its order: no policy or priority
//!   starves a request (Dynamo's `wspt` can hold a long prompt forever).
//! - **Between tenants**: deficit round robin over prompt tokens. Each tenant with waiting
//!   requests gets `weight × quantum_tokens` of credit per round and sends requests while its
//!   credit covers their prompts, so a tenant flooding the queue gets its weight's share of the
//!   admitted prefill and no more, and a light tenant's requests wait at most about one round.
//! - **Bounds**: at most `max_requests` wait (beyond: [`QueueError::Full`]); a request waits at
//!   most its timeout ([`AdmissionQueue::expire`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// The order of waiting requests inside a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QueuePolicy {
    /// First come, first served: score `priority_jump − arrival` (seconds).
    #[default]
    Fcfs,
    /// Last come, first served: score `priority_jump + arrival`.
    Lcfs,
    /// Weighted shortest processing time: score `(1 + priority_jump) ÷ max(uncached tokens, 1)`,
    /// the prompt's tokens not cached on its best rank when it was queued.
    Wspt,
}

impl QueuePolicy {
    pub const ALL: [QueuePolicy; 3] = [QueuePolicy::Fcfs, QueuePolicy::Lcfs, QueuePolicy::Wspt];

    pub fn name(self) -> &'static str {
        match self {
            QueuePolicy::Fcfs => "fcfs",
            QueuePolicy::Lcfs => "lcfs",
            QueuePolicy::Wspt => "wspt",
        }
    }
}

impl fmt::Display for QueuePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for QueuePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        QueuePolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown queue policy {s:?} (known: fcfs, lcfs, wspt)"))
    }
}

/// The queue's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueConfig {
    /// A rank is full when its active prefill tokens exceed this × its `max_num_batched_tokens`;
    /// `None`: never queue (the default, as Dynamo's).
    pub threshold: Option<f64>,
    pub policy: QueuePolicy,
    /// At most this many requests wait (all partitions and tenants together).
    pub max_requests: usize,
    /// How long a request may wait unless it says otherwise; `None`: until decided.
    pub timeout: Option<Duration>,
    /// A request that has waited this long goes before its tenant's others (oldest first).
    pub max_wait_before_promotion: Duration,
    /// Deficit round robin credit per round and unit of weight, in prompt tokens.
    pub quantum_tokens: u64,
    /// Tenants' weights (absent: [`QueueConfig::default_weight`]).
    pub tenant_weights: BTreeMap<String, u32>,
    pub default_weight: u32,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            threshold: None,
            policy: QueuePolicy::Fcfs,
            max_requests: 10_000,
            timeout: None,
            max_wait_before_promotion: Duration::from_secs(10),
            // A turn's credit covers one prompt of a 64k-token context, so every turn admits
            // something and a light tenant's burst waits a few turns, not one per 8k tokens.
            quantum_tokens: 65_536,
            tenant_weights: BTreeMap::new(),
            default_weight: 1,
        }
    }
}

/// Whether a rank with `active_prefill_tokens` is over the queue threshold.
pub fn over_threshold(
    threshold: f64,
    active_prefill_tokens: u64,
    max_num_batched_tokens: Option<u64>,
) -> bool {
    let capacity = max_num_batched_tokens.unwrap_or(crate::selector::UNKNOWN_PREFILL_CAPACITY);
    active_prefill_tokens as f64 > threshold * capacity as f64
}

/// What a waiting request is ordered by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueOrder {
    pub arrived: Instant,
    /// The prompt's tokens (`pending_isl_tokens`, the round-robin cost)...
    pub isl_tokens: u64,
    /// ...and those not cached on its best rank when queued (`wspt`).
    pub uncached_tokens: u64,
    /// Seconds to move the request ahead (`priority_jump`); below 0 counts as 0.
    pub priority_jump: f64,
    /// Higher goes first, before any score (`strict_priority`).
    pub strict_priority: u32,
    /// Its own wait bound (`None`: the queue's).
    pub timeout: Option<Duration>,
}

/// A request's place in the queue, to take it out again ([`AdmissionQueue::remove`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error("the selection queue is full ({max} requests wait); retry later")]
    Full { max: usize },
}

/// A request taken out of the queue.
#[derive(Debug, PartialEq)]
pub struct Dequeued<T> {
    pub ticket: Ticket,
    pub tenant: String,
    pub order: QueueOrder,
    pub payload: T,
}

#[derive(Debug)]
struct Waiting<T> {
    tenant: String,
    key: Key,
    order: QueueOrder,
    deadline: Option<Instant>,
    payload: T,
}

/// The sort key, smaller first: `strict_priority` reversed, then the score reversed.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key {
    strict: std::cmp::Reverse<u32>,
    score: f64,
}

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.strict
            .cmp(&other.strict)
            .then_with(|| other.score.total_cmp(&self.score))
    }
}

#[derive(Debug, Default)]
struct Tenant {
    entries: BTreeSet<(Key, Ticket)>,
    /// The same requests by arrival, for aging.
    by_arrival: BTreeSet<(Instant, Ticket)>,
    deficit: u64,
}

/// One partition's waiting requests. See the module documentation.
#[derive(Debug)]
pub struct AdmissionQueue<T> {
    config: QueueConfig,
    origin: Option<Instant>,
    waiting: HashMap<Ticket, Waiting<T>>,
    tenants: BTreeMap<String, Tenant>,
    /// Tenants with waiting requests, in round-robin order.
    rounds: VecDeque<String>,
    /// (deadline, ticket) of requests that can time out.
    deadlines: BTreeSet<(Instant, Ticket)>,
    /// Whether the tenant at the front of `rounds` has had this turn's credit.
    turn_granted: bool,
    next_ticket: u64,
    isl_tokens: u64,
}

impl<T> AdmissionQueue<T> {
    pub fn new(config: QueueConfig) -> Self {
        Self {
            config,
            origin: None,
            waiting: HashMap::new(),
            tenants: BTreeMap::new(),
            rounds: VecDeque::new(),
            deadlines: BTreeSet::new(),
            turn_granted: false,
            next_ticket: 0,
            isl_tokens: 0,
        }
    }

    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Prompt tokens of the waiting requests (`pending_isl_tokens`).
    pub fn isl_tokens(&self) -> u64 {
        self.isl_tokens
    }

    /// Waiting requests per tenant.
    pub fn tenant_lengths(&self) -> impl Iterator<Item = (&str, usize)> {
        self.tenants
            .iter()
            .map(|(name, t)| (name.as_str(), t.entries.len()))
    }

    fn key(&mut self, order: &QueueOrder) -> Key {
        let origin = *self.origin.get_or_insert(order.arrived);
        let arrived = if order.arrived >= origin {
            order.arrived.duration_since(origin).as_secs_f64()
        } else {
            -origin.duration_since(order.arrived).as_secs_f64()
        };
        let jump = if order.priority_jump.is_finite() {
            order.priority_jump.max(0.0)
        } else {
            0.0
        };
        let score = match self.config.policy {
            QueuePolicy::Fcfs => jump - arrived,
            QueuePolicy::Lcfs => jump + arrived,
            QueuePolicy::Wspt => (1.0 + jump) / order.uncached_tokens.max(1) as f64,
        };
        Key {
            strict: std::cmp::Reverse(order.strict_priority),
            score,
        }
    }

    /// Queues a request of `tenant`. Full → [`QueueError::Full`] with the payload back, and
    /// nothing changes.
    pub fn push(
        &mut self,
        tenant: &str,
        order: QueueOrder,
        payload: T,
    ) -> Result<Ticket, (QueueError, T)> {
        if self.waiting.len() >= self.config.max_requests {
            let full = QueueError::Full {
                max: self.config.max_requests,
            };
            return Err((full, payload));
        }
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        let key = self.key(&order);
        let deadline = order
            .timeout
            .or(self.config.timeout)
            .and_then(|t| order.arrived.checked_add(t));
        if let Some(d) = deadline {
            self.deadlines.insert((d, ticket));
        }
        let entry = self.tenants.entry(tenant.to_string()).or_default();
        if entry.entries.is_empty() {
            entry.deficit = 0;
            self.rounds.push_back(tenant.to_string());
        }
        entry.entries.insert((key, ticket));
        entry.by_arrival.insert((order.arrived, ticket));
        self.isl_tokens += order.isl_tokens;
        self.waiting.insert(
            ticket,
            Waiting {
                tenant: tenant.to_string(),
                key,
                order,
                deadline,
                payload,
            },
        );
        Ok(ticket)
    }

    fn weight(&self, tenant: &str) -> u64 {
        u64::from(
            self.config
                .tenant_weights
                .get(tenant)
                .copied()
                .unwrap_or(self.config.default_weight)
                .max(1),
        )
    }

    /// Takes the next request out at `now`: the tenant whose turn it is in the deficit round
    /// robin, and its oldest request if that one has waited `max_wait_before_promotion`, else
    /// its first in the policy's order.
    pub fn pop(&mut self, now: Instant) -> Option<Dequeued<T>> {
        let promote_after = self.config.max_wait_before_promotion;
        // Each turn adds a round's credit; a head costing more than that is sent once the
        // credit of several turns covers it, so this ends.
        loop {
            let name = self.rounds.front()?.clone();
            let grant = self.weight(&name) * self.config.quantum_tokens.max(1);
            let granted = self.turn_granted;
            let tenant = self.tenants.get_mut(&name)?;
            if !granted {
                tenant.deficit = tenant.deficit.saturating_add(grant);
                self.turn_granted = true;
            }
            let &(oldest, aged) = tenant.by_arrival.first()?;
            let ticket = if now.saturating_duration_since(oldest) >= promote_after {
                aged
            } else {
                tenant.entries.first()?.1
            };
            let cost = self.waiting.get(&ticket)?.order.isl_tokens.max(1);
            let tenant = self.tenants.get_mut(&name)?;
            if tenant.deficit >= cost {
                tenant.deficit -= cost;
                return self.take(ticket);
            }
            // Its credit is spent: the next tenant's turn (this one keeps what is left).
            self.rounds.rotate_left(1);
            self.turn_granted = false;
        }
    }

    /// The request [`AdmissionQueue::pop`] would take out at `now`, without taking it: the
    /// service looks at it first, to leave it waiting while its own ranks are all full.
    ///
    /// The deficit round robin visits tenants turn by turn; a tenant can send its request at the
    /// first turn where its credit plus the turns' grants covers the request's prompt, so the
    /// request taken is the one whose tenant gets there first (fewest rounds, then its place in
    /// the round).
    pub fn peek(&self, now: Instant) -> Option<Ticket> {
        let promote_after = self.config.max_wait_before_promotion;
        let mut best: Option<((u64, usize), Ticket)> = None;
        for (place, name) in self.rounds.iter().enumerate() {
            let tenant = self.tenants.get(name)?;
            let &(oldest, aged) = tenant.by_arrival.first()?;
            let ticket = if now.saturating_duration_since(oldest) >= promote_after {
                aged
            } else {
                tenant.entries.first()?.1
            };
            let cost = self.waiting.get(&ticket)?.order.isl_tokens.max(1);
            let grant = self.weight(name) * self.config.quantum_tokens.max(1);
            // Credit at its first visit (the front tenant may have had this turn's grant).
            let first = if place == 0 && self.turn_granted {
                tenant.deficit
            } else {
                tenant.deficit.saturating_add(grant)
            };
            let rounds = cost.saturating_sub(first).div_ceil(grant);
            let at = (rounds, place);
            if best.is_none_or(|(b, _)| at < b) {
                best = Some((at, ticket));
            }
        }
        best.map(|(_, t)| t)
    }

    /// What a waiting request carries.
    pub fn get(&self, ticket: Ticket) -> Option<&T> {
        self.waiting.get(&ticket).map(|w| &w.payload)
    }

    /// A waiting request's order and tenant.
    pub fn order_of(&self, ticket: Ticket) -> Option<(&str, &QueueOrder)> {
        self.waiting
            .get(&ticket)
            .map(|w| (w.tenant.as_str(), &w.order))
    }

    /// Takes a request out by its ticket (its client left). `None` when it is not waiting.
    pub fn remove(&mut self, ticket: Ticket) -> Option<Dequeued<T>> {
        self.take(ticket)
    }

    fn take(&mut self, ticket: Ticket) -> Option<Dequeued<T>> {
        let w = self.waiting.remove(&ticket)?;
        self.isl_tokens -= w.order.isl_tokens;
        if let Some(d) = w.deadline {
            self.deadlines.remove(&(d, ticket));
        }
        if let Some(tenant) = self.tenants.get_mut(&w.tenant) {
            tenant.by_arrival.remove(&(w.order.arrived, ticket));
            tenant.entries.remove(&(w.key, ticket));
            if tenant.entries.is_empty() {
                self.tenants.remove(&w.tenant);
                if self.rounds.front() == Some(&w.tenant) {
                    self.turn_granted = false;
                }
                self.rounds.retain(|n| n != &w.tenant);
            }
        }
        Some(Dequeued {
            ticket,
            tenant: w.tenant,
            order: w.order,
            payload: w.payload,
        })
    }

    /// Takes out every request whose wait bound has passed by `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Dequeued<T>> {
        let due: Vec<Ticket> = self
            .deadlines
            .iter()
            .take_while(|(d, _)| *d <= now)
            .map(|&(_, t)| t)
            .collect();
        due.into_iter().filter_map(|t| self.take(t)).collect()
    }

    /// The earliest deadline of a waiting request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|&(d, _)| d)
    }

    /// Takes out every waiting request (shutdown), in ticket order.
    pub fn drain(&mut self) -> Vec<Dequeued<T>> {
        let mut tickets: Vec<Ticket> = self.waiting.keys().copied().collect();
        tickets.sort_unstable();
        tickets.into_iter().filter_map(|t| self.take(t)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(at: Instant, ms: u64, isl: u64) -> QueueOrder {
        QueueOrder {
            arrived: at + Duration::from_millis(ms),
            isl_tokens: isl,
            uncached_tokens: isl,
            priority_jump: 0.0,
            strict_priority: 0,
            timeout: None,
        }
    }

    /// Pops at the time of the last arrival used in these tests (no request is aged).
    fn soon(q: &AdmissionQueue<&'static str>) -> Instant {
        q.origin
            .map_or_else(Instant::now, |o| o + Duration::from_secs(1))
    }

    fn queue(policy: QueuePolicy) -> AdmissionQueue<&'static str> {
        AdmissionQueue::new(QueueConfig {
            policy,
            ..QueueConfig::default()
        })
    }

    fn drain_names(q: &mut AdmissionQueue<&'static str>) -> Vec<&'static str> {
        let now = soon(q);
        std::iter::from_fn(|| q.pop(now).map(|d| d.payload)).collect()
    }

    #[test]
    fn each_policy_orders_one_tenant() {
        let t0 = Instant::now();
        for (policy, want) in [
            (QueuePolicy::Fcfs, vec!["a", "b", "c", "d"]),
            (QueuePolicy::Lcfs, vec!["d", "c", "b", "a"]),
            (QueuePolicy::Wspt, vec!["c", "d", "b", "a"]),
        ] {
            let mut q = queue(policy);
            q.push("t", order(t0, 0, 100_000), "a").unwrap();
            q.push("t", order(t0, 1, 50_000), "b").unwrap();
            q.push("t", order(t0, 2, 100), "c").unwrap();
            q.push("t", order(t0, 3, 1_000), "d").unwrap();
            assert_eq!(q.isl_tokens(), 151_100);
            assert_eq!(drain_names(&mut q), want, "{policy}");
            assert_eq!((q.len(), q.isl_tokens()), (0, 0));
        }
    }

    #[test]
    fn a_request_waiting_past_the_promotion_bound_goes_first() {
        let t0 = Instant::now();
        let mut q = queue(QueuePolicy::Wspt);
        q.push("t", order(t0, 0, 10_000), "long").unwrap();
        q.push("t", order(t0, 50, 10), "short-1").unwrap();
        q.push("t", order(t0, 9_000, 10), "short-2").unwrap();
        // At 9.5 s nothing has waited 10 s: the shortest first.
        assert_eq!(
            q.pop(t0 + Duration::from_millis(9_500)).map(|d| d.payload),
            Some("short-1")
        );
        // At 10 s the long prompt has waited its bound: it passes the shorter one.
        assert_eq!(
            q.pop(t0 + Duration::from_secs(10)).map(|d| d.payload),
            Some("long")
        );
        assert_eq!(
            q.pop(t0 + Duration::from_secs(10)).map(|d| d.payload),
            Some("short-2")
        );
    }

    #[test]
    fn peek_names_what_pop_takes_out() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let t0 = Instant::now();
        for policy in QueuePolicy::ALL {
            let mut q: AdmissionQueue<u32> = AdmissionQueue::new(QueueConfig {
                policy,
                quantum_tokens: 1_000,
                tenant_weights: [("b".to_string(), 3)].into_iter().collect(),
                ..QueueConfig::default()
            });
            let mut now = t0;
            let mut popped = 0;
            for i in 0..2_000u32 {
                now += Duration::from_millis(rng.random_range(0..40));
                if rng.random_bool(0.55) {
                    let tenant = ["a", "b", "c"][rng.random_range(0..3)];
                    let isl = rng.random_range(1..5_000);
                    let mut o = order(t0, 0, isl);
                    o.arrived = now;
                    o.strict_priority = rng.random_range(0..2);
                    q.push(tenant, o, i).unwrap();
                } else {
                    let peeked = q.peek(now);
                    let taken = q.pop(now).map(|d| d.ticket);
                    assert_eq!(peeked, taken, "{policy} step {i}");
                    popped += usize::from(taken.is_some());
                }
            }
            assert!(popped > 500, "{popped}");
        }
    }

    /// Dynamo 1.6.1's release orders, recorded from its select service
    /// (`crates/service/tests/fixtures/dynamo/queue.json`, `orders`): each round's requests are
    /// queued as sent and taken out one step at a time; a step that released several is
    /// compared as a set.
    #[test]
    fn dynamo_release_orders_replay() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../service/tests/fixtures/dynamo/queue.json"
        );
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let rounds = doc["orders"].as_array().unwrap();
        assert!(rounds.len() >= 10);
        for round in rounds {
            let name = round["name"].as_str().unwrap();
            let policy: QueuePolicy = round["policy"].as_str().unwrap().parse().unwrap();
            let mut q: AdmissionQueue<String> = AdmissionQueue::new(QueueConfig {
                policy,
                ..QueueConfig::default()
            });
            let t0 = Instant::now();
            for sent in round["sent"].as_array().unwrap() {
                let isl = sent["isl_tokens"].as_u64().unwrap_or(16);
                let cached = sent["cached_tokens"].as_u64().unwrap_or(0);
                let order = QueueOrder {
                    arrived: t0 + Duration::from_millis(sent["t_ms"].as_u64().unwrap()),
                    isl_tokens: isl,
                    uncached_tokens: isl - cached,
                    priority_jump: sent["priority_jump"].as_f64().unwrap_or(0.0),
                    strict_priority: sent["strict_priority"].as_u64().unwrap_or(0) as u32,
                    timeout: None,
                };
                q.push("default", order, sent["name"].as_str().unwrap().to_string())
                    .unwrap();
            }
            assert_eq!(
                q.isl_tokens(),
                round["pending_isl_tokens"].as_u64().unwrap(),
                "{name}"
            );
            let now = t0 + Duration::from_secs(3);
            for step in round["steps"].as_array().unwrap() {
                let mut want: Vec<String> = step["completed"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c["name"].as_str().unwrap().to_string())
                    .collect();
                let mut got: Vec<String> = (0..want.len())
                    .map(|_| q.pop(now).unwrap().payload)
                    .collect();
                want.sort();
                got.sort();
                assert_eq!(got, want, "{name}");
                assert_eq!(
                    q.len() as u64,
                    step["pending_count_after"].as_u64().unwrap(),
                    "{name}"
                );
            }
            assert!(q.is_empty(), "{name}");
        }
    }

    #[test]
    fn priority_jump_moves_a_request_ahead_by_its_seconds() {
        let t0 = Instant::now();
        let mut q = queue(QueuePolicy::Fcfs);
        q.push("t", order(t0, 0, 10), "first").unwrap();
        q.push("t", order(t0, 500, 10), "second").unwrap();
        let jumped = QueueOrder {
            priority_jump: 1.0,
            ..order(t0, 900, 10)
        };
        q.push("t", jumped, "jumped").unwrap();
        // A negative jump counts as 0; a strict priority goes before every score.
        let back = QueueOrder {
            priority_jump: -5.0,
            ..order(t0, 950, 10)
        };
        q.push("t", back, "back").unwrap();
        let strict = QueueOrder {
            strict_priority: 1,
            ..order(t0, 990, 10)
        };
        q.push("t", strict, "strict").unwrap();
        assert_eq!(
            drain_names(&mut q),
            vec!["strict", "jumped", "first", "second", "back"]
        );
    }

    #[test]
    fn tenants_share_admitted_tokens_by_weight() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(QueueConfig {
            quantum_tokens: 1_000,
            tenant_weights: [("big".to_string(), 1), ("small".to_string(), 1)]
                .into_iter()
                .collect(),
            ..QueueConfig::default()
        });
        // The big tenant floods first; the small one's requests come after all of them.
        for i in 0..40 {
            q.push("big", order(t0, i, 1_000), "big").unwrap();
        }
        for i in 0..10 {
            q.push("small", order(t0, 100 + i, 1_000), "small").unwrap();
        }
        let first_20 = drain_names(&mut q)[..20].to_vec();
        let small = first_20.iter().filter(|n| **n == "small").count();
        assert_eq!(small, 10, "equal weights alternate: {first_20:?}");

        // Weight 3 : 1 → three big requests per small one.
        let mut q = AdmissionQueue::new(QueueConfig {
            quantum_tokens: 1_000,
            tenant_weights: [("big".to_string(), 3)].into_iter().collect(),
            ..QueueConfig::default()
        });
        for i in 0..30 {
            q.push("big", order(t0, i, 1_000), "big").unwrap();
        }
        for i in 0..10 {
            q.push("small", order(t0, 100 + i, 1_000), "small").unwrap();
        }
        let first_16 = drain_names(&mut q)[..16].to_vec();
        assert_eq!(first_16.iter().filter(|n| **n == "small").count(), 4);
    }

    #[test]
    fn a_prompt_larger_than_a_round_is_sent_once_its_credit_suffices() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(QueueConfig {
            quantum_tokens: 100,
            ..QueueConfig::default()
        });
        q.push("a", order(t0, 0, 1_000), "huge").unwrap();
        q.push("b", order(t0, 1, 50), "b1").unwrap();
        q.push("b", order(t0, 2, 50), "b2").unwrap();
        let names = drain_names(&mut q);
        assert_eq!(names.len(), 3);
        assert!(names.contains(&"huge"));
    }

    #[test]
    fn bound_removal_expiry_and_drain() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(QueueConfig {
            max_requests: 3,
            timeout: Some(Duration::from_millis(100)),
            ..QueueConfig::default()
        });
        let a = q.push("t", order(t0, 0, 10), "a").unwrap();
        let short = QueueOrder {
            timeout: Some(Duration::from_millis(10)),
            ..order(t0, 1, 20)
        };
        q.push("t", short, "short").unwrap();
        q.push("u", order(t0, 2, 30), "c").unwrap();
        assert_eq!(
            q.push("t", order(t0, 3, 40), "d"),
            Err((QueueError::Full { max: 3 }, "d"))
        );
        assert_eq!(q.next_deadline(), Some(t0 + Duration::from_millis(11)));
        let expired: Vec<_> = q
            .expire(t0 + Duration::from_millis(50))
            .into_iter()
            .map(|d| d.payload)
            .collect();
        assert_eq!(expired, vec!["short"]);
        assert_eq!(q.remove(a).map(|d| d.payload), Some("a"));
        assert_eq!(q.remove(a), None, "removed once");
        assert_eq!((q.len(), q.isl_tokens()), (1, 30));
        assert_eq!(
            q.drain().into_iter().map(|d| d.payload).collect::<Vec<_>>(),
            vec!["c"]
        );
        assert!(q.is_empty());
        assert_eq!(q.pop(t0), None);
    }

    #[test]
    fn the_threshold_is_a_share_of_the_batch_budget() {
        assert!(!over_threshold(1.0, 8_192, Some(8_192)));
        assert!(over_threshold(1.0, 8_193, Some(8_192)));
        assert!(over_threshold(0.5, 4_097, Some(8_192)));
        assert!(
            !over_threshold(1.0, 8_193, None),
            "unknown capacity is Dynamo's 10 M tokens"
        );
    }
}
