//! Admission control (issue 31): the router-side queue that holds selections while every
//! candidate rank of their partition is over the queue threshold, in the order of a
//! [`QueuePolicy`], shared fairly between tenants.
//!
//! The queue is a plain data structure, generic over what a waiting request carries (`T`: the
//! service's reply channel, the simulator's request id). Its edges decide when to queue
//! ([`over_threshold`]) and when to take the next request out (after a booking's prefill
//! completes or it is freed); the queue decides which one.
//!
//! - **Order inside a tenant**: a static key per request, smaller first ([`QueuePolicy`]); ties
//!   by arrival order. `priority_jump` (seconds) counts a request as having arrived that much
//!   earlier (`fcfs`, `wspt`) or later (`lcfs`).
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
    /// First come, first served: by arrival (minus `priority_jump`).
    #[default]
    Fcfs,
    /// Last come, first served: the newest (plus `priority_jump`) first.
    Lcfs,
    /// Weighted shortest processing time: shorter prompts first, with aging: a prompt's key is
    /// its arrival plus `wspt_aging_per_token` per prompt token, so a long prompt is passed only
    /// by requests that arrived less than its length's worth of aging after it, and never
    /// starves.
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
    /// `wspt`'s aging: the waiting one prompt token is worth.
    pub wspt_aging_per_token: Duration,
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
            // 10 µs a token: a 10,000-token prompt yields to prompts arriving up to 0.1 s after it.
            wspt_aging_per_token: Duration::from_micros(10),
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
    pub isl_tokens: u64,
    /// Seconds to move the request ahead (`priority_jump`); negative moves it back.
    pub priority_jump: f64,
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
    order: QueueOrder,
    deadline: Option<Instant>,
    payload: T,
}

/// Nanoseconds relative to the queue's first arrival: the static sort key.
type Key = i128;

#[derive(Debug, Default)]
struct Tenant {
    entries: BTreeSet<(Key, Ticket)>,
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
        let since = |t: Instant| -> i128 {
            if t >= origin {
                t.duration_since(origin).as_nanos() as i128
            } else {
                -(origin.duration_since(t).as_nanos() as i128)
            }
        };
        let jump = if order.priority_jump.is_finite() {
            (order.priority_jump * 1e9) as i128
        } else {
            0
        };
        let arrived = since(order.arrived);
        match self.config.policy {
            QueuePolicy::Fcfs => arrived - jump,
            QueuePolicy::Lcfs => -(arrived + jump),
            QueuePolicy::Wspt => {
                let aging = self.config.wspt_aging_per_token.as_nanos() as i128;
                arrived - jump + aging * i128::from(order.isl_tokens)
            }
        }
    }

    /// Queues a request of `tenant`. Full → [`QueueError::Full`] and nothing changes.
    pub fn push(
        &mut self,
        tenant: &str,
        order: QueueOrder,
        payload: T,
    ) -> Result<Ticket, QueueError> {
        if self.waiting.len() >= self.config.max_requests {
            return Err(QueueError::Full {
                max: self.config.max_requests,
            });
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
        self.isl_tokens += order.isl_tokens;
        self.waiting.insert(
            ticket,
            Waiting {
                tenant: tenant.to_string(),
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

    /// Takes the next request out: the tenant whose turn it is in the deficit round robin, and
    /// its first request in the policy's order.
    pub fn pop(&mut self) -> Option<Dequeued<T>> {
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
            let &(_, ticket) = tenant.entries.first()?;
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
            tenant.entries.retain(|&(_, t)| t != ticket);
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
            priority_jump: 0.0,
            timeout: None,
        }
    }

    fn queue(policy: QueuePolicy) -> AdmissionQueue<&'static str> {
        AdmissionQueue::new(QueueConfig {
            policy,
            ..QueueConfig::default()
        })
    }

    fn drain_names(q: &mut AdmissionQueue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.pop().map(|d| d.payload)).collect()
    }

    #[test]
    fn each_policy_orders_one_tenant() {
        let t0 = Instant::now();
        for (policy, want) in [
            (QueuePolicy::Fcfs, vec!["a", "b", "c", "d"]),
            (QueuePolicy::Lcfs, vec!["d", "c", "b", "a"]),
            // Aging 10 µs a token: 100,000 tokens are worth 1 s, so d (short, 3 ms after a)
            // passes a and b, not c, which arrived 2 ms after a with 100 tokens.
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
    fn wspt_aging_lets_a_long_prompt_pass_later_short_ones() {
        let t0 = Instant::now();
        let mut q = queue(QueuePolicy::Wspt);
        // 10,000 tokens age for 100 ms: short prompts arriving 200 ms later go after it.
        q.push("t", order(t0, 0, 10_000), "long").unwrap();
        q.push("t", order(t0, 50, 10), "early-short").unwrap();
        q.push("t", order(t0, 200, 10), "late-short").unwrap();
        assert_eq!(
            drain_names(&mut q),
            vec!["early-short", "long", "late-short"]
        );
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
        assert_eq!(drain_names(&mut q), vec!["jumped", "first", "second"]);
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
            Err(QueueError::Full { max: 3 })
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
        assert_eq!(q.pop(), None);
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
