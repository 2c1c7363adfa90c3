//! Session affinity: the requests of one session (a conversation, an agent's run) go
//! to the rank its bookings went to, where its growing prompt is cached.
//!
//! ## Bindings
//! A binding maps a session — `(partition, session_id)`, so each partition has its own table —
//! to a rank. Only a *booking* binds: `select_and_reserve`, the replay of a `select` that carried
//! the session, or an explicit booking of an unbound session. A plain `select` only reads the
//! binding. A session's booking keeps its binding alive (it *holds* it); once its last booking
//! ends, the binding lives `ttl` longer, and a later booking holds it again. A `select` never
//! refreshes it. All of this is Dynamo 1.6.1's behaviour, recorded in
//! `crates/service/tests/fixtures/dynamo/sessions.json`.
//!
//! ## The pick
//! [`Selector::preferred_candidate`] runs before the scoring, after `pinned_worker` (which always
//! wins): an `affinity_target` (with or without a session) takes its rank, or the cheapest of its
//! worker's ranks, whatever their load; else a bound session's rank, when it is a candidate:
//! - [`SessionMode::Hard`] (Dynamo): always, busy or not;
//! - [`SessionMode::Soft`]: unless it is busy or its cost exceeds `soft_factor` × the cheapest
//!   non-busy rank's. A booking that leaves it rebinds the session where it went: the session's
//!   prompt is cached there now.
//!
//! What a booking then does to the binding is the selection's [`SessionChoice`]: a session sent
//! elsewhere by `pinned_worker` or `affinity_target` keeps its binding, as does one whose bound
//! rank `allowed_worker_ids` excludes on a `select`; on a booking that exclusion is a 400 that
//! drops the binding. A bound rank that is gone (worker deleted, incomplete, rank removed) is
//! skipped; the next booking rebinds, and the binding stays until then.
//!
//! ## State and cost
//! [`SessionTable`] sits behind a mutex of its own (after the pending cache in the lock order),
//! so a replay under the shared lock binds. It holds at most `max_sessions` bindings (the least
//! recently booked is evicted beyond), an index of idle bindings by expiry (the tick pops the due
//! ones: O(log n) each), and the live bookings of each session: the local ones and, with replica
//! sync, the other replicas' (their bookings carry their session), so a session is held while a
//! booking on any replica holds it. Every operation is O(log n) in the bindings; nothing is taken
//! when sessions are off or the request has no session.

use super::{PendingSelection, SelectRequest, Selector, WorkerRecord, exclusive, locked, sync};
use crate::error::{Error, PartitionKey};
use crate::event::{Rank, WorkerId};
use crate::schedule::{Candidate, SchedulerConfig};
use hashbrown::HashMap;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Longest session id accepted (as Dynamo).
pub const MAX_SESSION_ID_BYTES: usize = 256;
/// Default cap on bindings.
pub const DEFAULT_MAX_SESSIONS: usize = 1 << 18;
/// Default factor of soft mode (measured with `kvroute sim`, `crates/sim/README.md`).
pub const DEFAULT_SOFT_FACTOR: f64 = 3.0;
/// Sessions changed locally and not yet taken by the publisher, at most (beyond, the publisher's
/// periodic reconciliation catches up).
const MAX_RECORDED_CHANGES: usize = 65_536;

/// How strongly a binding holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SessionMode {
    /// The bound rank always wins (Dynamo 1.6.1).
    #[default]
    Hard,
    /// The bound rank wins unless busy or costlier than `soft_factor` × the best.
    Soft,
}

impl SessionMode {
    pub fn name(self) -> &'static str {
        match self {
            SessionMode::Hard => "hard",
            SessionMode::Soft => "soft",
        }
    }
}

impl std::str::FromStr for SessionMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hard" => Ok(SessionMode::Hard),
            "soft" => Ok(SessionMode::Soft),
            other => Err(format!(
                "unknown session affinity mode `{other}` (hard, soft)"
            )),
        }
    }
}

/// Session affinity's settings; off (`ttl: None`) by default, when session fields are ignored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SessionConfig {
    /// How long a binding outlives its session's last booking; `None`: sessions are ignored.
    pub ttl: Option<Duration>,
    pub mode: SessionMode,
    /// Soft mode: the bound rank is left when its cost exceeds this × the cheapest rank's.
    pub soft_factor: f64,
    /// Most bindings kept; the least recently booked is evicted beyond.
    pub max_sessions: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            ttl: None,
            mode: SessionMode::Hard,
            soft_factor: DEFAULT_SOFT_FACTOR,
            max_sessions: DEFAULT_MAX_SESSIONS,
        }
    }
}

impl SessionConfig {
    pub fn enabled(&self) -> bool {
        self.ttl.is_some()
    }
}

/// A session: its partition and id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey {
    pub partition: PartitionKey,
    pub session_id: String,
}

impl SessionKey {
    pub fn new(partition: &PartitionKey, session_id: &str) -> Self {
        Self {
            partition: partition.clone(),
            session_id: session_id.to_string(),
        }
    }
}

/// What booking a selection does to its session's binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionChoice {
    /// Bind (or rebind) the session to the chosen rank.
    Bind,
    /// Leave the binding as it is: the chosen rank is the bound one, or the request sent the
    /// session elsewhere (`pinned_worker`, `affinity_target`; `allowed_worker_ids` on a select).
    Keep,
    /// `allowed_worker_ids` excludes the bound rank, which is available: a booking is refused.
    Conflict { bound_worker: WorkerId },
}

/// A selection's session and what booking it does to the binding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionSelection {
    pub key: SessionKey,
    pub choice: SessionChoice,
}

/// A binding as replicas exchange it: the rank, and when it expires unless held (`None`: a
/// booking holds it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncedBinding {
    pub rank: Rank,
    pub idle_until: Option<Instant>,
}

/// Running counters of the session table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionCounters {
    /// Sessions bound for the first time, or again after expiry or a drop.
    pub bound: u64,
    /// Bindings moved to another rank.
    pub rebound: u64,
    /// Bindings that outlived their TTL.
    pub expired: u64,
    /// Bindings evicted by the cap.
    pub evicted: u64,
    /// Bindings dropped by a refused booking (or another replica's drop).
    pub dropped: u64,
}

#[derive(Debug, Clone, Copy)]
struct Binding {
    rank: Rank,
    /// Its key in `by_age`: the order of the last booking.
    age: u64,
    /// `None` while a booking holds it; else its expiry, also in `idle`.
    idle_until: Option<Instant>,
    /// This replica made its last change (a booking bound it, or its last local booking
    /// ended): replica sync publishes it.
    local: bool,
}

/// The bindings, bounded, with their expiry and their sessions' live bookings. Pure data: time
/// comes in as `now`.
#[derive(Debug)]
pub struct SessionTable {
    ttl: Duration,
    max_sessions: usize,
    bindings: HashMap<SessionKey, Binding>,
    /// Bindings by age (the order of their last booking), oldest first: the eviction order.
    by_age: BTreeMap<u64, SessionKey>,
    /// Idle bindings by expiry, as `(idle_until, age)`.
    idle: BTreeSet<(Instant, u64)>,
    /// Live bookings per session (local and other replicas').
    holders: HashMap<SessionKey, u32>,
    /// The session of each live booking that has one, by its load-tracker key.
    held_by: HashMap<String, SessionKey>,
    next_age: u64,
    /// The latest `now` the table was given: the time of releases that come without one.
    latest: Option<Instant>,
    /// Sessions whose binding this replica changed (bound, rebound, dropped, idle after a local
    /// release), for replica sync; `None` when nobody takes them.
    changes: Option<Vec<SessionKey>>,
    counters: SessionCounters,
}

impl SessionTable {
    pub fn new(ttl: Duration, max_sessions: usize) -> Self {
        Self {
            ttl,
            max_sessions: max_sessions.max(1),
            bindings: HashMap::new(),
            by_age: BTreeMap::new(),
            idle: BTreeSet::new(),
            holders: HashMap::new(),
            held_by: HashMap::new(),
            next_age: 0,
            latest: None,
            changes: None,
            counters: SessionCounters::default(),
        }
    }

    fn note(&mut self, now: Instant) {
        self.latest = Some(self.latest.map_or(now, |t| t.max(now)));
    }

    /// The latest time the table was given.
    pub fn latest(&self) -> Option<Instant> {
        self.latest
    }

    pub fn len(&self) -> usize {
        self.bindings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }

    pub fn counters(&self) -> SessionCounters {
        self.counters
    }

    /// The rank `key` is bound to, if its binding is alive at `now`.
    pub fn bound(&self, key: &SessionKey, now: Instant) -> Option<Rank> {
        self.bindings
            .get(key)
            .filter(|b| b.idle_until.is_none_or(|t| t > now))
            .map(|b| b.rank)
    }

    /// The binding of `key` as replicas exchange it, if alive at `now`.
    pub fn view(&self, key: &SessionKey, now: Instant) -> Option<SyncedBinding> {
        self.bindings
            .get(key)
            .filter(|b| b.idle_until.is_none_or(|t| t > now))
            .map(|b| SyncedBinding {
                rank: b.rank,
                idle_until: b.idle_until,
            })
    }

    /// The session a live booking holds.
    pub fn session_of(&self, booking: &str) -> Option<&SessionKey> {
        self.held_by.get(booking)
    }

    /// Starts recording locally changed sessions (replica sync takes them).
    pub fn record_changes(&mut self) {
        self.changes.get_or_insert_with(Vec::new);
    }

    /// The sessions changed since the last call, each once.
    pub fn take_changes(&mut self) -> Vec<SessionKey> {
        let Some(changes) = self.changes.as_mut() else {
            return Vec::new();
        };
        let mut taken = std::mem::take(changes);
        taken.sort_unstable();
        taken.dedup();
        taken
    }

    fn changed(&mut self, key: &SessionKey) {
        if let Some(changes) = self.changes.as_mut()
            && changes.len() < MAX_RECORDED_CHANGES
        {
            changes.push(key.clone());
        }
    }

    fn remove_binding(&mut self, key: &SessionKey) -> Option<Binding> {
        let binding = self.bindings.remove(key)?;
        self.by_age.remove(&binding.age);
        if let Some(t) = binding.idle_until {
            self.idle.remove(&(t, binding.age));
        }
        Some(binding)
    }

    /// Sets `key`'s binding to `rank` (new, or moved), as the newest, held if a booking holds the
    /// session, else idle until `idle_until`. Evicts the oldest beyond the cap. Whether the rank
    /// changed (or the binding is new).
    fn put(&mut self, key: &SessionKey, rank: Rank, idle_until: Instant, local: bool) -> bool {
        let previous = self.remove_binding(key);
        match previous {
            None => self.counters.bound += 1,
            Some(b) if b.rank != rank => self.counters.rebound += 1,
            Some(_) => {}
        }
        let changed = previous.is_none_or(|b| b.rank != rank);
        // A local refresh of an unchanged binding is nothing to publish.
        let local = if changed || !local {
            local
        } else {
            previous.is_some_and(|b| b.local)
        };
        let age = self.next_age;
        self.next_age += 1;
        let idle_until = (!self.holders.contains_key(key)).then_some(idle_until);
        if let Some(t) = idle_until {
            self.idle.insert((t, age));
        }
        self.bindings.insert(
            key.clone(),
            Binding {
                rank,
                age,
                idle_until,
                local,
            },
        );
        self.by_age.insert(age, key.clone());
        while self.bindings.len() > self.max_sessions {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            if let Some(b) = self.bindings.remove(&oldest)
                && let Some(t) = b.idle_until
            {
                self.idle.remove(&(t, b.age));
            }
            self.counters.evicted += 1;
        }
        changed
    }

    /// A booking of session `key` landed on `rank`: it holds the session, and binds it there
    /// when `bind` (or when the session has no live binding). A booking already holding a
    /// session is released from it first.
    pub fn hold(&mut self, key: &SessionKey, booking: &str, rank: Rank, bind: bool, now: Instant) {
        self.note(now);
        self.release(booking, true, now);
        self.held_by.insert(booking.to_string(), key.clone());
        *self.holders.entry(key.clone()).or_insert(0) += 1;
        let alive = self.bound(key, now);
        let rank = match (bind, alive) {
            (true, _) | (false, None) => rank,
            (false, Some(bound)) => bound,
        };
        if self.put(key, rank, now + self.ttl, true) {
            self.changed(key);
        }
    }

    /// Records a booking of another replica (or one restored after a restart) that holds
    /// session `key`, without binding anything.
    pub fn hold_only(&mut self, key: &SessionKey, booking: &str, now: Instant) {
        self.note(now);
        self.release(booking, false, now);
        self.held_by.insert(booking.to_string(), key.clone());
        *self.holders.entry(key.clone()).or_insert(0) += 1;
        if let Some(b) = self.bindings.get_mut(key)
            && let Some(t) = b.idle_until.take()
        {
            self.idle.remove(&(t, b.age));
        }
    }

    /// A booking (`local`: this replica's) ended at `now`. When it was its session's last, the
    /// binding (if any) starts its TTL; returns that session.
    pub fn release(&mut self, booking: &str, local: bool, now: Instant) -> Option<SessionKey> {
        self.note(now);
        let key = self.held_by.remove(booking)?;
        let count = self.holders.get_mut(&key)?;
        *count -= 1;
        if *count > 0 {
            return None;
        }
        self.holders.remove(&key);
        let ttl = self.ttl;
        let binding = self.bindings.get_mut(&key)?;
        let until = now + ttl;
        binding.idle_until = Some(until);
        binding.local |= local;
        self.idle.insert((until, binding.age));
        if local {
            self.changed(&key);
        }
        Some(key)
    }

    /// Drops `key`'s binding (a refused booking); its bookings still hold the session.
    pub fn drop_binding(&mut self, key: &SessionKey) {
        if self.remove_binding(key).is_some() {
            self.counters.dropped += 1;
            self.changed(key);
        }
    }

    /// Removes the bindings whose TTL ran out by `now`; how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        self.note(now);
        let mut expired = 0;
        while let Some(&(until, age)) = self.idle.first() {
            if until > now {
                break;
            }
            self.idle.pop_first();
            if let Some(key) = self.by_age.remove(&age) {
                self.bindings.remove(&key);
                expired += 1;
            }
        }
        self.counters.expired += expired as u64;
        expired
    }

    /// Applies another replica's binding of `key` (`None`: it dropped it). Its expiry counts
    /// only while no booking known here holds the session; one with none (its publisher held
    /// it) expires a TTL from now unless a booking arrives. Not recorded as a local change.
    pub fn apply_synced(&mut self, key: &SessionKey, binding: Option<SyncedBinding>, now: Instant) {
        self.note(now);
        match binding {
            None => {
                if self.remove_binding(key).is_some() {
                    self.counters.dropped += 1;
                }
            }
            Some(b) => {
                let until = b.idle_until.unwrap_or(now + self.ttl);
                if until <= now && !self.holders.contains_key(key) {
                    self.remove_binding(key);
                    return;
                }
                self.put(key, b.rank, until, false);
            }
        }
    }

    /// The live bindings this replica made the last change of (the publisher's
    /// reconciliation).
    pub fn local_bindings(&self, now: Instant) -> Vec<(SessionKey, SyncedBinding)> {
        self.bindings
            .iter()
            .filter(|(_, b)| b.local && b.idle_until.is_none_or(|t| t > now))
            .map(|(k, b)| {
                (
                    k.clone(),
                    SyncedBinding {
                        rank: b.rank,
                        idle_until: b.idle_until,
                    },
                )
            })
            .collect()
    }
}

/// A request's session, looked up before the pick.
#[derive(Debug, Default, Clone)]
pub(super) struct SessionLookup {
    key: Option<SessionKey>,
    /// The live binding's rank.
    bound: Option<Rank>,
}

impl SessionLookup {
    /// Whether the session is bound to a rank, which the pick then prefers.
    pub(super) fn is_bound(&self) -> bool {
        self.bound.is_some()
    }
}

impl Selector {
    /// The session table (held locked while the guard lives).
    pub(super) fn sessions(&self) -> std::sync::MutexGuard<'_, SessionTable> {
        locked(&self.sessions)
    }

    /// The request's session and its live binding; nothing when sessions are off. A session id
    /// over 256 bytes is refused (400) only then, as Dynamo.
    pub(super) fn look_up_session(
        &self,
        req: &SelectRequest<'_>,
        now: Instant,
    ) -> Result<SessionLookup, Error> {
        let (Some(_), Some(id)) = (self.config.sessions.ttl, req.session_id) else {
            return Ok(SessionLookup::default());
        };
        let key = session_key(req.partition, id)?;
        let bound = self.sessions().bound(&key, now);
        Ok(SessionLookup {
            key: Some(key),
            bound,
        })
    }

    /// The candidate an `affinity_target` or a bound session prefers, before any scoring (see
    /// the module documentation); `None`: score as usual.
    pub(super) fn preferred_candidate(
        &self,
        req: &SelectRequest<'_>,
        session: &SessionLookup,
        candidates: &[(Candidate, &WorkerRecord)],
        config: &SchedulerConfig,
        isl_tokens: u64,
        block_size: u32,
    ) -> Option<usize> {
        let cost = |i: usize| config.cost(&candidates[i].0, isl_tokens, block_size);
        if let Some(target) = req.affinity_target {
            let targeted = (0..candidates.len())
                .filter(|&i| candidates[i].0.rank.worker_id == target.worker_id)
                .filter(|&i| {
                    target
                        .dp_rank
                        .is_none_or(|d| candidates[i].0.rank.dp_rank == d)
                })
                .min_by(|&a, &b| cost(a).total_cmp(&cost(b)));
            if targeted.is_some() {
                return targeted;
            }
        }
        let bound = session.bound?;
        let i = candidates.iter().position(|(c, _)| c.rank == bound)?;
        match self.config.sessions.mode {
            SessionMode::Hard => Some(i),
            SessionMode::Soft => {
                if config.is_busy(&candidates[i].0) {
                    return None;
                }
                let best = (0..candidates.len())
                    .filter(|&j| !config.is_busy(&candidates[j].0))
                    .map(cost)
                    .fold(f64::INFINITY, f64::min);
                (cost(i) <= self.config.sessions.soft_factor * best + 1e-9).then_some(i)
            }
        }
    }

    /// What booking the chosen rank does to the request's session (see [`SessionChoice`]).
    pub(super) fn session_choice(
        &self,
        req: &SelectRequest<'_>,
        session: SessionLookup,
        chosen: Rank,
    ) -> Option<SessionSelection> {
        let key = session.key?;
        let choice = match session.bound {
            None => SessionChoice::Bind,
            Some(bound) if bound == chosen => SessionChoice::Keep,
            Some(bound) if !self.rank_available(req.partition, bound) => SessionChoice::Bind,
            Some(_) if req.pinned_worker.is_some() || req.affinity_target.is_some() => {
                SessionChoice::Keep
            }
            // The request excludes the bound worker: by its allowed workers, or by required
            // taints the worker lacks (Dynamo refuses such a booking with 400).
            Some(bound)
                if req
                    .allowed_worker_ids
                    .is_some_and(|allowed| !allowed.contains(&bound.worker_id))
                    || req.routing_constraints.is_some_and(|c| {
                        self.workers
                            .get(&bound.worker_id)
                            .is_some_and(|record| !c.admits(&record.spec))
                    }) =>
            {
                SessionChoice::Conflict {
                    bound_worker: bound.worker_id,
                }
            }
            // Soft mode left it.
            Some(_) => SessionChoice::Bind,
        };
        Some(SessionSelection { key, choice })
    }

    /// Whether `rank` is a rank of a schedulable worker of `partition`.
    fn rank_available(&self, partition: &PartitionKey, rank: Rank) -> bool {
        self.workers.get(&rank.worker_id).is_some_and(|r| {
            r.lifecycle == super::Lifecycle::Schedulable
                && r.spec.partition() == *partition
                && r.spec.dp_ranks().contains(&rank.dp_rank)
        })
    }

    /// A booking refused for its session: `allowed_worker_ids` excludes the rank its session is
    /// bound to. The binding is dropped (the next request selects afresh), as Dynamo does.
    pub(super) fn refuse_session_conflict(
        &self,
        session: Option<&SessionSelection>,
        selected_worker: WorkerId,
    ) -> Result<(), Error> {
        let Some(SessionSelection {
            key,
            choice: SessionChoice::Conflict { bound_worker },
        }) = session
        else {
            return Ok(());
        };
        self.sessions().drop_binding(key);
        Err(Error::SessionBound {
            session_id: key.session_id.clone(),
            bound_worker: *bound_worker,
            selected_worker,
        })
    }

    /// A booking `booking` landed on `rank` for a request with a session: it holds it, and
    /// binds it unless its choice was to keep the binding.
    pub(super) fn hold_session(
        &self,
        session: Option<&SessionSelection>,
        booking: &str,
        rank: Rank,
        now: Instant,
    ) {
        if let Some(s) = session {
            let bind = s.choice == SessionChoice::Bind;
            self.sessions().hold(&s.key, booking, rank, bind, now);
        }
    }

    /// An explicit booking of `rank` with a session (its id checked) holds it and binds it
    /// there unless it has a live binding to an available rank (like a pinned request's).
    pub(super) fn hold_explicit_session(
        &self,
        partition: &PartitionKey,
        session_id: Option<&str>,
        booking: &str,
        rank: Rank,
        now: Instant,
    ) {
        let (Some(_), Some(id)) = (self.config.sessions.ttl, session_id) else {
            return;
        };
        let key = SessionKey::new(partition, id);
        let mut sessions = self.sessions();
        let bind = sessions
            .bound(&key, now)
            .is_none_or(|bound| !self.rank_available(partition, bound));
        sessions.hold(&key, booking, rank, bind, now);
    }

    /// A booking (by load-tracker key) ended at `now`: its session, if any, may start its TTL.
    pub(super) fn release_session(&self, booking: &str, now: Instant) {
        if self.config.sessions.enabled() {
            let local = !sync::is_remote_key(booking);
            self.sessions().release(booking, local, now);
        }
    }

    /// Bookings (by load-tracker key) that ended without a time of their own (a worker's
    /// deletion, another replica's free): their sessions' TTL starts at the latest time the
    /// table was given (a booking's own, at least), which is at most a tick old.
    pub(super) fn release_sessions_untimed<'a>(&mut self, bookings: impl Iterator<Item = &'a str>) {
        if !self.config.sessions.enabled() {
            return;
        }
        let sessions = exclusive(&mut self.sessions);
        // A table that never saw a time holds no booking.
        let Some(now) = sessions.latest() else {
            return;
        };
        for booking in bookings {
            sessions.release(booking, !sync::is_remote_key(booking), now);
        }
    }

    /// The session a live booking holds (replica sync publishes it with the booking).
    pub(super) fn session_of_booking(&self, booking: &str) -> Option<String> {
        if !self.config.sessions.enabled() {
            return None;
        }
        self.sessions()
            .session_of(booking)
            .map(|k| k.session_id.clone())
    }

    /// A synced booking (another replica's, or this one's restored) holds its session.
    pub(super) fn hold_synced_session(
        &mut self,
        partition: &PartitionKey,
        session_id: Option<&str>,
        booking: &str,
        now: Instant,
    ) {
        if let (true, Some(id)) = (self.config.sessions.enabled(), session_id) {
            let key = SessionKey::new(partition, id);
            exclusive(&mut self.sessions).hold_only(&key, booking, now);
        }
    }

    /// The live binding of `key`, as replicas exchange it.
    pub fn session_binding(&self, key: &SessionKey, now: Instant) -> Option<SyncedBinding> {
        self.sessions().view(key, now)
    }

    /// The live bindings this replica made the last change of (replica sync's
    /// reconciliation). O(n).
    pub fn local_session_bindings(&self, now: Instant) -> Vec<(SessionKey, SyncedBinding)> {
        self.sessions().local_bindings(now)
    }

    /// Applies another replica's binding (`None`: it dropped it).
    pub fn apply_synced_binding(
        &mut self,
        key: &SessionKey,
        binding: Option<SyncedBinding>,
        now: Instant,
    ) {
        if self.config.sessions.enabled() {
            exclusive(&mut self.sessions).apply_synced(key, binding, now);
        }
    }

    /// Records the sessions whose binding this replica changes, for
    /// [`Selector::take_session_changes`] (replica sync).
    pub fn record_session_changes(&mut self) {
        exclusive(&mut self.sessions).record_changes();
    }

    /// The sessions whose binding this replica changed since the last call.
    pub fn take_session_changes(&self) -> Vec<SessionKey> {
        if !self.config.sessions.enabled() {
            return Vec::new();
        }
        self.sessions().take_changes()
    }

    /// Live bindings and the table's counters.
    pub fn session_stats(&self) -> (usize, SessionCounters) {
        let sessions = self.sessions();
        (sessions.len(), sessions.counters())
    }
}

/// The key of session `id` in `partition`, its length checked.
pub(super) fn session_key(partition: &PartitionKey, id: &str) -> Result<SessionKey, Error> {
    if id.len() > MAX_SESSION_ID_BYTES {
        return Err(Error::SessionIdTooLong);
    }
    Ok(SessionKey::new(partition, id))
}

/// What a cached selection remembers of its session: the key and whether booking binds it.
pub(super) fn pending_session(selection: Option<&SessionSelection>) -> Option<(SessionKey, bool)> {
    selection.map(|s| (s.key.clone(), s.choice == SessionChoice::Bind))
}

impl PendingSelection {
    /// The session of a cached selection as a booking applies it.
    pub(super) fn session_selection(&self) -> Option<SessionSelection> {
        self.session.as_ref().map(|(key, bind)| SessionSelection {
            key: key.clone(),
            choice: if *bind {
                SessionChoice::Bind
            } else {
                SessionChoice::Keep
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap as Map;

    const TTL: Duration = Duration::from_millis(100);

    fn key(session: u8) -> SessionKey {
        SessionKey::new(&PartitionKey::new("m", "g"), &session.to_string())
    }

    /// The table's behaviour written the obvious way: a list of bindings scanned linearly.
    #[derive(Default)]
    struct Naive {
        /// session → (rank, age, idle_until)
        bindings: Map<u8, (Rank, u64, Option<Instant>)>,
        held_by: Map<u8, u8>,
        next_age: u64,
    }

    impl Naive {
        fn bound(&self, session: u8, now: Instant) -> Option<Rank> {
            let (rank, _, idle) = self.bindings.get(&session)?;
            idle.is_none_or(|t| t > now).then_some(*rank)
        }

        fn held(&self, session: u8) -> bool {
            self.held_by.values().any(|&s| s == session)
        }

        fn release(&mut self, booking: u8, now: Instant) {
            let Some(session) = self.held_by.remove(&booking) else {
                return;
            };
            if !self.held(session)
                && let Some(b) = self.bindings.get_mut(&session)
            {
                b.2 = Some(now + TTL);
            }
        }

        fn hold(
            &mut self,
            session: u8,
            booking: u8,
            rank: Rank,
            bind: bool,
            now: Instant,
            max: usize,
        ) {
            self.release(booking, now);
            self.held_by.insert(booking, session);
            let rank = match self.bound(session, now) {
                Some(bound) if !bind => bound,
                _ => rank,
            };
            self.bindings.insert(session, (rank, self.next_age, None));
            self.next_age += 1;
            while self.bindings.len() > max {
                let oldest = self
                    .bindings
                    .iter()
                    .min_by_key(|(_, b)| b.1)
                    .map(|(s, _)| *s);
                if let Some(s) = oldest {
                    self.bindings.remove(&s);
                }
            }
        }

        fn expire(&mut self, now: Instant) {
            self.bindings.retain(|_, b| b.2.is_none_or(|t| t > now));
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Hold {
            session: u8,
            booking: u8,
            worker: u64,
            bind: bool,
        },
        Release {
            booking: u8,
        },
        Drop {
            session: u8,
        },
        Expire,
        Advance {
            ms: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..5u8, 0..8u8, 1..4u64, any::<bool>())
                .prop_map(|(session, booking, worker, bind)| Op::Hold { session, booking, worker, bind }),
            3 => (0..8u8).prop_map(|booking| Op::Release { booking }),
            1 => (0..5u8).prop_map(|session| Op::Drop { session }),
            1 => Just(Op::Expire),
            2 => (0..150u64).prop_map(|ms| Op::Advance { ms }),
        ]
    }

    proptest! {
        #[test]
        fn the_table_agrees_with_the_naive_model(ops in prop::collection::vec(op(), 1..80), max in 1..5usize) {
            let mut table = SessionTable::new(TTL, max);
            let mut naive = Naive::default();
            let mut now = Instant::now();
            for op in ops {
                match op {
                    Op::Hold { session, booking, worker, bind } => {
                        let rank = Rank::new(worker, 0);
                        table.hold(&key(session), &booking.to_string(), rank, bind, now);
                        naive.hold(session, booking, rank, bind, now, max);
                    }
                    Op::Release { booking } => {
                        table.release(&booking.to_string(), true, now);
                        naive.release(booking, now);
                    }
                    Op::Drop { session } => {
                        table.drop_binding(&key(session));
                        naive.bindings.remove(&session);
                    }
                    Op::Expire => {
                        table.expire(now);
                        naive.expire(now);
                        prop_assert_eq!(table.len(), naive.bindings.len());
                    }
                    Op::Advance { ms } => now += Duration::from_millis(ms),
                }
                for session in 0..5 {
                    prop_assert_eq!(table.bound(&key(session), now), naive.bound(session, now));
                }
                prop_assert!(table.len() <= max);
                prop_assert_eq!(table.by_age.len(), table.bindings.len());
                let idle = table.bindings.values().filter(|b| b.idle_until.is_some()).count();
                prop_assert_eq!(table.idle.len(), idle);
            }
        }
    }

    #[test]
    fn changes_are_recorded_once_each_and_only_when_asked() {
        let mut table = SessionTable::new(TTL, 8);
        let now = Instant::now();
        table.hold(&key(1), "a", Rank::new(1, 0), true, now);
        assert!(table.take_changes().is_empty(), "not recording");
        table.record_changes();
        table.hold(&key(1), "b", Rank::new(2, 0), true, now);
        table.hold(&key(1), "c", Rank::new(2, 0), false, now);
        table.hold(&key(2), "d", Rank::new(2, 0), false, now);
        assert_eq!(table.take_changes(), vec![key(1), key(2)]);
        table.release("a", true, now);
        table.release("b", true, now);
        assert!(table.take_changes().is_empty(), "c still holds 1");
        table.release("c", true, now);
        table.release("d", false, now);
        assert_eq!(
            table.take_changes(),
            vec![key(1)],
            "d was another replica's"
        );
        table.apply_synced(
            &key(3),
            Some(SyncedBinding {
                rank: Rank::new(3, 0),
                idle_until: Some(now + TTL),
            }),
            now,
        );
        assert!(table.take_changes().is_empty());
        assert_eq!(
            table.local_bindings(now).len(),
            2,
            "bound here: 1 and 2, not 3"
        );
        table.drop_binding(&key(3));
        assert_eq!(table.take_changes(), vec![key(3)]);
    }

    #[test]
    fn a_synced_binding_counts_its_expiry_only_when_nothing_holds_it() {
        let mut table = SessionTable::new(TTL, 8);
        let now = Instant::now();
        let at = |rank, idle_until| SyncedBinding {
            rank: Rank::new(rank, 0),
            idle_until,
        };
        table.apply_synced(&key(1), Some(at(1, Some(now))), now);
        assert_eq!(table.len(), 0, "already expired");
        table.apply_synced(&key(1), Some(at(1, None)), now);
        assert_eq!(table.view(&key(1), now), Some(at(1, Some(now + TTL))));
        table.hold_only(&key(1), "\0r2\0x", now);
        table.apply_synced(&key(1), Some(at(2, Some(now + TTL))), now);
        assert_eq!(table.view(&key(1), now), Some(at(2, None)), "held here");
        table.release("\0r2\0x", false, now + TTL);
        assert_eq!(table.bound(&key(1), now + TTL * 2), None);
    }
}
