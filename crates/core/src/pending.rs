//! Pending-selection cache (SPEC §8).
//!
//! `select` with a `selection_id` stores the booking inputs it computed (chosen rank, sequence
//! hashes, token counts, LoRA name: the caller's `V`) here, so that a later replay reservation can
//! book exactly that without the prompt being sent or hashed again. The cache is generic over the
//! cached value `V` (shared as `Arc<V>`) and the key `K` (by default [`PendingKey`]: the partition
//! and the selection id).
//!
//! # Invariants
//! - Every entry carries `inserted_at` (the `now` of its insert), a `generation` drawn from a
//!   cache-wide counter that starts at 1 and only increases (never reused, also across keys), and
//!   its approximate size in bytes, computed by the caller ([`PendingKey::approximate_entry_bytes`]).
//! - The order index, ordered by `(inserted_at, generation)`, holds exactly one element per map
//!   entry: replace, remove, discard, sweep and eviction unlink both sides at once. There are no
//!   lazy tombstones, so heavy insert/consume traffic cannot grow it beyond the live entries.
//! - After every insert, `len() <= max_entries` and `bytes() <= max_bytes`.
//! - An entry is expired once `now - inserted_at >= ttl` (a `now` earlier than `inserted_at` counts
//!   as age zero). [`PendingCache::peek`] never returns an expired entry.
//!
//! # Bounds, without a background task
//! Each [`PendingCache::insert`] first sweeps expired entries from the oldest end of the order
//! index, then replaces any entry under the same key (a newer select wins), then evicts the oldest
//! entries until the new one fits under the entry cap and the byte budget. An entry that can never
//! fit (larger than the whole byte budget, or an entry cap of 0) evicts itself instead: it is not
//! stored, nothing else is evicted for it, and the outcome reports it. Evicting before storing
//! means the entry just inserted is never evicted to make room for itself, even when the caller's
//! `now` runs slightly behind an earlier insert's.
//!
//! `peek` takes `&self`, so it can run under a shared lock: it refuses an expired entry but
//! leaves it in place for the next sweep (any insert, or [`PendingCache::purge_expired`]). Until
//! then [`PendingCache::len`] and [`PendingCache::bytes`] still count it; they stay within the caps
//! regardless.
//!
//! # Complexity
//! `n` entries: `peek` is O(1) expected; `remove` and `discard` are O(log n); `insert` is amortized
//! O(log n): beyond its own O(log n) index insert, each entry is swept or evicted at most once, at
//! O(log n) apiece. Memory is one map slot and one index node per entry; the key is allocated once
//! (an `Arc<K>` shared by the map and the index).
//!
//! The edge turns [`InsertOutcome`] and the cumulative [`PendingCounters`] into the metrics of
//! SPEC §12 (cache size, bytes, evictions by cause).

use std::collections::BTreeMap;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;

/// Default time a pending selection stays bookable (`--selection-cache-ttl-secs`).
pub const DEFAULT_TTL: Duration = Duration::from_secs(120);
/// Default entry cap (`--selection-cache-max-entries`).
pub const DEFAULT_MAX_ENTRIES: usize = 4096;
/// Default byte budget, 256 MiB of approximate entry bytes (`--selection-cache-max-bytes`).
pub const DEFAULT_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// Bounds of a [`PendingCache`]. A cap of 0 entries (or 0 bytes for any non-empty entry) means
/// nothing is retained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingConfig {
    /// How long after its insert an entry may still be peeked.
    pub ttl: Duration,
    /// At most this many entries are held.
    pub max_entries: usize,
    /// At most this many approximate bytes are held (sum of the sizes passed to `insert`).
    pub max_bytes: u64,
}

impl Default for PendingConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            max_entries: DEFAULT_MAX_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }
}

/// The key of a pending selection: its partition `(model_name, routing_group)` and its
/// `selection_id`. The same selection id in another partition is another entry.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PendingKey {
    pub model_name: String,
    pub routing_group: String,
    pub selection_id: String,
}

impl PendingKey {
    pub fn new(
        model_name: impl Into<String>,
        routing_group: impl Into<String>,
        selection_id: impl Into<String>,
    ) -> Self {
        Self {
            model_name: model_name.into(),
            routing_group: routing_group.into(),
            selection_id: selection_id.into(),
        }
    }

    /// The approximate size of an entry under this key, as SPEC §8 defines it:
    /// `8 × hashes + len(id) + len(model) + len(group) + len(lora)`.
    pub fn approximate_entry_bytes(
        &self,
        sequence_hash_count: usize,
        lora_name: Option<&str>,
    ) -> u64 {
        let lengths = [
            self.selection_id.len(),
            self.model_name.len(),
            self.routing_group.len(),
            lora_name.map_or(0, str::len),
        ];
        let hash_bytes = (sequence_hash_count as u64).saturating_mul(8);
        lengths
            .iter()
            .fold(hash_bytes, |total, &len| total.saturating_add(len as u64))
    }
}

/// What one [`PendingCache::insert`] did. Eviction counts include the new entry itself when it
/// could not be retained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InsertOutcome {
    /// The generation of the new entry; pass it to [`PendingCache::remove`].
    pub generation: u64,
    /// Whether the new entry is held by the cache (false when it evicted itself).
    pub retained: bool,
    /// Whether a live (unswept) entry under the same key was replaced.
    pub replaced: bool,
    /// Entries swept because their TTL had run out.
    pub evicted_expired: usize,
    /// Entries evicted, oldest first, to stay within `max_entries`.
    pub evicted_for_entries: usize,
    /// Entries evicted, oldest first, to stay within `max_bytes`.
    pub evicted_for_bytes: usize,
}

/// Cumulative counts since the cache was created, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingCounters {
    /// Calls to `insert`, retained or not.
    pub inserted: u64,
    /// Inserts that replaced an entry under the same key.
    pub replaced: u64,
    /// Entries swept because their TTL had run out (by `insert` or `purge_expired`).
    pub evicted_expired: u64,
    /// Entries evicted for the entry cap (including new entries under a cap of 0).
    pub evicted_for_entries: u64,
    /// Entries evicted for the byte budget (including new entries larger than the budget).
    pub evicted_for_bytes: u64,
    /// Entries consumed by a `remove` whose generation matched.
    pub removed: u64,
    /// Entries dropped by `discard`.
    pub discarded: u64,
}

/// One cached selection.
struct PendingEntry<V> {
    value: Arc<V>,
    inserted_at: Instant,
    generation: u64,
    bytes: u64,
}

impl<V> PendingEntry<V> {
    fn order_key(&self) -> (Instant, u64) {
        (self.inserted_at, self.generation)
    }
}

/// A bounded, TTL-limited map from a selection key to its cached booking inputs. See the module
/// documentation for the invariants and the complexity.
pub struct PendingCache<V, K = PendingKey> {
    config: PendingConfig,
    entries: HashMap<Arc<K>, PendingEntry<V>>,
    /// Oldest first; exactly one element per entry of `entries`.
    order: BTreeMap<(Instant, u64), Arc<K>>,
    bytes: u64,
    next_generation: u64,
    counters: PendingCounters,
}

impl<V, K> Default for PendingCache<V, K>
where
    K: Hash + Eq,
{
    fn default() -> Self {
        Self::new(PendingConfig::default())
    }
}

impl<V, K> fmt::Debug for PendingCache<V, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingCache")
            .field("config", &self.config)
            .field("len", &self.entries.len())
            .field("bytes", &self.bytes)
            .field("next_generation", &self.next_generation)
            .field("counters", &self.counters)
            .finish()
    }
}

impl<V, K> PendingCache<V, K>
where
    K: Hash + Eq,
{
    pub fn new(config: PendingConfig) -> Self {
        Self {
            config,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            bytes: 0,
            next_generation: 1,
            counters: PendingCounters::default(),
        }
    }

    pub fn config(&self) -> &PendingConfig {
        &self.config
    }

    /// Entries held, including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Approximate bytes held (sum of the sizes passed to `insert`), including expired entries
    /// not yet swept.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn counters(&self) -> &PendingCounters {
        &self.counters
    }

    /// Caches `value` under `key` at `now`, replacing any entry under the same key. `bytes` is the
    /// entry's approximate size (see [`PendingKey::approximate_entry_bytes`]).
    pub fn insert(&mut self, key: K, value: Arc<V>, bytes: u64, now: Instant) -> InsertOutcome {
        // 2^64 inserts are out of reach, so the counter never wraps.
        let generation = self.next_generation;
        self.next_generation += 1;
        self.counters.inserted += 1;

        let mut outcome = InsertOutcome {
            generation,
            evicted_expired: self.purge_expired(now),
            ..InsertOutcome::default()
        };
        if let Some(old) = self.entries.remove(&key) {
            self.unlink(&old);
            outcome.replaced = true;
            self.counters.replaced += 1;
        }

        if self.config.max_entries == 0 {
            outcome.evicted_for_entries = 1;
            self.counters.evicted_for_entries += 1;
            return outcome;
        }
        if bytes > self.config.max_bytes {
            outcome.evicted_for_bytes = 1;
            self.counters.evicted_for_bytes += 1;
            return outcome;
        }

        // Make room oldest-first. Terminates: an empty cache has room for this entry, as
        // `max_entries >= 1` and `bytes <= max_bytes`; `self.bytes <= max_bytes` holds throughout.
        loop {
            let over_entries = self.entries.len() >= self.config.max_entries;
            let over_bytes = bytes > self.config.max_bytes - self.bytes;
            if !over_entries && !over_bytes {
                break;
            }
            if self.evict_oldest().is_none() {
                break;
            }
            if over_entries {
                outcome.evicted_for_entries += 1;
                self.counters.evicted_for_entries += 1;
            } else {
                outcome.evicted_for_bytes += 1;
                self.counters.evicted_for_bytes += 1;
            }
        }

        let key = Arc::new(key);
        let entry = PendingEntry {
            value,
            inserted_at: now,
            generation,
            bytes,
        };
        self.order.insert(entry.order_key(), Arc::clone(&key));
        self.entries.insert(key, entry);
        self.bytes += bytes;
        outcome.retained = true;
        outcome
    }

    /// The live entry under `key` and its generation. Re-checks the TTL against `now`: an expired
    /// entry is refused (and left for the next sweep).
    pub fn peek(&self, key: &K, now: Instant) -> Option<(Arc<V>, u64)> {
        let entry = self.entries.get(key)?;
        if self.is_expired(entry.inserted_at, now) {
            return None;
        }
        Some((Arc::clone(&entry.value), entry.generation))
    }

    /// Removes the entry under `key` only if it is still the given `generation`, so a consumer
    /// never removes a newer selection for the same key. Returns whether an entry was removed
    /// (an expired, unswept entry of that generation is removed too).
    pub fn remove(&mut self, key: &K, generation: u64) -> bool {
        let matches = self
            .entries
            .get(key)
            .is_some_and(|entry| entry.generation == generation);
        if !matches {
            return false;
        }
        let removed = self.entries.remove(key);
        if let Some(entry) = &removed {
            self.unlink(entry);
            self.counters.removed += 1;
        }
        removed.is_some()
    }

    /// Removes the entry under `key` whatever its generation. Returns whether there was one
    /// (expired but unswept entries included).
    pub fn discard(&mut self, key: &K) -> bool {
        let removed = self.entries.remove(key);
        if let Some(entry) = &removed {
            self.unlink(entry);
            self.counters.discarded += 1;
        }
        removed.is_some()
    }

    /// Sweeps every entry expired at `now`, oldest first; returns how many. `insert` does this
    /// itself; call it to make `len` and `bytes` exact for a gauge.
    pub fn purge_expired(&mut self, now: Instant) -> usize {
        let mut swept = 0;
        // The index is ordered by `inserted_at`, so the expired entries are exactly a prefix.
        while let Some((&(inserted_at, _), _)) = self.order.first_key_value() {
            if !self.is_expired(inserted_at, now) {
                break;
            }
            if self.evict_oldest().is_none() {
                break;
            }
            swept += 1;
        }
        self.counters.evicted_expired += swept as u64;
        swept
    }

    fn is_expired(&self, inserted_at: Instant, now: Instant) -> bool {
        now.saturating_duration_since(inserted_at) >= self.config.ttl
    }

    /// Drops the oldest entry from both the index and the map.
    fn evict_oldest(&mut self) -> Option<PendingEntry<V>> {
        let (_, key) = self.order.pop_first()?;
        let entry = self.entries.remove(&key)?;
        self.bytes -= entry.bytes;
        Some(entry)
    }

    /// Drops the index element and the bytes of an entry already taken out of the map.
    fn unlink(&mut self, entry: &PendingEntry<V>) {
        self.order.remove(&entry.order_key());
        self.bytes -= entry.bytes;
    }

    /// Checks that the index and the map describe the same entries and that the totals add up.
    #[cfg(test)]
    fn assert_consistent(&self) {
        assert_eq!(self.order.len(), self.entries.len(), "index len == map len");
        let mut total = 0;
        for (order_key, key) in &self.order {
            let entry = &self.entries[key];
            assert_eq!(entry.order_key(), *order_key);
            total += entry.bytes;
        }
        assert_eq!(total, self.bytes, "bytes add up");
        assert!(self.bytes <= self.config.max_bytes);
        assert!(self.entries.len() <= self.config.max_entries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(selection_id: &str) -> PendingKey {
        PendingKey::new("model", "default", selection_id)
    }

    fn cache(ttl_secs: u64, max_entries: usize, max_bytes: u64) -> PendingCache<u32> {
        PendingCache::new(PendingConfig {
            ttl: Duration::from_secs(ttl_secs),
            max_entries,
            max_bytes,
        })
    }

    fn held(cache: &PendingCache<u32>, ids: &[&str], now: Instant) -> Vec<bool> {
        ids.iter()
            .map(|id| cache.peek(&key(id), now).is_some())
            .collect()
    }

    #[test]
    fn default_config_matches_spec() {
        let config = PendingConfig::default();
        assert_eq!(config.ttl, Duration::from_secs(120));
        assert_eq!(config.max_entries, 4096);
        assert_eq!(config.max_bytes, 256 * 1024 * 1024);
    }

    #[test]
    fn approximate_entry_bytes_follows_spec_formula() {
        let key = PendingKey::new("llama", "tenant-a", "sel-123");
        assert_eq!(
            key.approximate_entry_bytes(10, Some("adapter")),
            8 * 10 + 7 + 5 + 8 + 7
        );
        assert_eq!(key.approximate_entry_bytes(0, None), 7 + 5 + 8);
    }

    #[test]
    fn peek_then_remove_consumes_once() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 1 << 20);
        let outcome = cache.insert(key("a"), Arc::new(7), 100, t0);
        assert!(outcome.retained);

        let (value, generation) = cache.peek(&key("a"), t0).unwrap();
        assert_eq!((*value, generation), (7, outcome.generation));
        assert!(cache.remove(&key("a"), generation));
        assert!(!cache.remove(&key("a"), generation), "second consume");
        assert!(cache.peek(&key("a"), t0).is_none());
        assert_eq!((cache.len(), cache.bytes()), (0, 0));
        cache.assert_consistent();
    }

    #[test]
    fn peek_refuses_an_expired_entry() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 1 << 20);
        cache.insert(key("a"), Arc::new(1), 10, t0);
        assert!(
            cache
                .peek(&key("a"), t0 + Duration::from_millis(119_999))
                .is_some()
        );
        assert!(
            cache
                .peek(&key("a"), t0 + Duration::from_secs(120))
                .is_none()
        );
        assert!(
            cache
                .peek(&key("a"), t0 + Duration::from_secs(500))
                .is_none()
        );
        // Left for the next sweep: still counted until then.
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.purge_expired(t0 + Duration::from_secs(120)), 1);
        assert_eq!((cache.len(), cache.bytes()), (0, 0));
    }

    #[test]
    fn insert_sweeps_expired_entries() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 1 << 20);
        cache.insert(key("a"), Arc::new(1), 10, t0);
        cache.insert(key("b"), Arc::new(2), 20, t0 + Duration::from_secs(1));
        cache.insert(key("c"), Arc::new(3), 40, t0 + Duration::from_secs(100));

        let outcome = cache.insert(key("d"), Arc::new(4), 80, t0 + Duration::from_secs(121));
        assert_eq!(outcome.evicted_expired, 2);
        assert_eq!(
            (outcome.evicted_for_entries, outcome.evicted_for_bytes),
            (0, 0)
        );
        assert_eq!((cache.len(), cache.bytes()), (2, 120));
        assert_eq!(cache.counters().evicted_expired, 2);
        cache.assert_consistent();
    }

    #[test]
    fn entry_cap_evicts_oldest_first() {
        let t0 = Instant::now();
        let mut cache = cache(120, 3, 1 << 20);
        for (i, id) in ["a", "b", "c"].into_iter().enumerate() {
            cache.insert(key(id), Arc::new(0), 1, t0 + Duration::from_secs(i as u64));
        }
        let now = t0 + Duration::from_secs(10);
        let outcome = cache.insert(key("d"), Arc::new(0), 1, now);
        assert_eq!(outcome.evicted_for_entries, 1);
        assert_eq!(
            held(&cache, &["a", "b", "c", "d"], now),
            [false, true, true, true]
        );
        let outcome = cache.insert(key("e"), Arc::new(0), 1, now);
        assert_eq!(outcome.evicted_for_entries, 1);
        assert_eq!(
            held(&cache, &["b", "c", "d", "e"], now),
            [false, true, true, true]
        );
        assert_eq!(cache.counters().evicted_for_entries, 2);
        cache.assert_consistent();
    }

    #[test]
    fn byte_budget_evicts_oldest_first() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 100);
        cache.insert(key("a"), Arc::new(0), 40, t0);
        cache.insert(key("b"), Arc::new(0), 40, t0 + Duration::from_secs(1));
        cache.insert(key("c"), Arc::new(0), 20, t0 + Duration::from_secs(2));
        assert_eq!(cache.bytes(), 100);

        let now = t0 + Duration::from_secs(3);
        let outcome = cache.insert(key("d"), Arc::new(0), 50, now);
        assert_eq!(
            (outcome.evicted_for_bytes, outcome.evicted_for_entries),
            (2, 0)
        );
        assert_eq!(
            held(&cache, &["a", "b", "c", "d"], now),
            [false, false, true, true]
        );
        assert_eq!(cache.bytes(), 70);
        cache.assert_consistent();
    }

    #[test]
    fn over_budget_entry_evicts_itself_and_nothing_else() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 100);
        cache.insert(key("a"), Arc::new(0), 60, t0);
        cache.insert(key("b"), Arc::new(1), 10, t0);

        let outcome = cache.insert(key("huge"), Arc::new(2), 101, t0);
        assert!(!outcome.retained);
        assert_eq!(outcome.evicted_for_bytes, 1);
        assert!(cache.peek(&key("huge"), t0).is_none());
        assert_eq!(held(&cache, &["a", "b"], t0), [true, true]);

        // Replacing a key with an over-budget entry still drops the old selection.
        let outcome = cache.insert(key("b"), Arc::new(3), 1_000, t0);
        assert!(outcome.replaced && !outcome.retained);
        assert!(cache.peek(&key("b"), t0).is_none());
        assert_eq!((cache.len(), cache.bytes()), (1, 60));
        assert_eq!(cache.counters().evicted_for_bytes, 2);
        cache.assert_consistent();
    }

    #[test]
    fn zero_entry_cap_retains_nothing() {
        let t0 = Instant::now();
        let mut cache = cache(120, 0, 100);
        let outcome = cache.insert(key("a"), Arc::new(0), 1, t0);
        assert!(!outcome.retained);
        assert_eq!(outcome.evicted_for_entries, 1);
        assert!(cache.is_empty());
        cache.assert_consistent();
    }

    #[test]
    fn remove_with_stale_generation_leaves_newer_selection_alone() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 1 << 20);
        let first = cache.insert(key("a"), Arc::new(1), 10, t0);
        let (_, stale) = cache.peek(&key("a"), t0).unwrap();
        let second = cache.insert(key("a"), Arc::new(2), 10, t0 + Duration::from_secs(1));
        assert!(second.replaced);
        assert!(second.generation > first.generation);

        assert!(!cache.remove(&key("a"), stale));
        let (value, generation) = cache.peek(&key("a"), t0 + Duration::from_secs(1)).unwrap();
        assert_eq!((*value, generation), (2, second.generation));
        assert!(cache.remove(&key("a"), second.generation));
        cache.assert_consistent();
    }

    #[test]
    fn discard_removes_whatever_the_generation() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 1 << 20);
        cache.insert(key("a"), Arc::new(1), 10, t0);
        assert!(cache.discard(&key("a")));
        assert!(!cache.discard(&key("a")));
        assert!(cache.peek(&key("a"), t0).is_none());
        assert_eq!(cache.counters().discarded, 1);
        cache.assert_consistent();
    }

    #[test]
    fn same_selection_id_in_another_partition_is_another_entry() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 1 << 20);
        cache.insert(PendingKey::new("m", "g1", "s"), Arc::new(1), 1, t0);
        let outcome = cache.insert(PendingKey::new("m", "g2", "s"), Arc::new(2), 1, t0);
        assert!(!outcome.replaced);
        let (value, _) = cache.peek(&PendingKey::new("m", "g1", "s"), t0).unwrap();
        assert_eq!(*value, 1);
        assert!(
            cache
                .peek(&PendingKey::new("other", "g1", "s"), t0)
                .is_none()
        );
    }

    #[test]
    fn replacing_a_key_keeps_one_order_index_entry() {
        let t0 = Instant::now();
        let mut cache = cache(120, 16, 1 << 20);
        for i in 0..1_000u64 {
            let outcome = cache.insert(key("a"), Arc::new(0), 8, t0 + Duration::from_millis(i));
            assert_eq!(outcome.replaced, i > 0);
            assert_eq!((cache.order.len(), cache.entries.len()), (1, 1));
        }
        assert_eq!(cache.bytes(), 8);
        cache.assert_consistent();
    }

    #[test]
    fn consume_traffic_behind_a_pinned_entry_keeps_index_at_map_len() {
        let t0 = Instant::now();
        let mut cache = cache(120, 4096, 1 << 30);
        // The pinned entry is never consumed and stays live, so a lazy design would pile up
        // tombstones behind it; this one must not.
        let pinned = cache.insert(key("pinned"), Arc::new(0), 64, t0);
        for i in 0..100_000u64 {
            let now = t0 + Duration::from_micros(i + 1);
            let id = key(&format!("sel-{i}"));
            let outcome = cache.insert(id.clone(), Arc::new(1), 64, now);
            assert_eq!(cache.order.len(), cache.entries.len());
            let (_, generation) = cache.peek(&id, now).unwrap();
            assert_eq!(generation, outcome.generation);
            assert!(cache.remove(&id, generation));
            assert_eq!(cache.order.len(), cache.entries.len());
            assert_eq!(cache.order.len(), 1);
        }
        let end = t0 + Duration::from_millis(100);
        assert_eq!(
            cache.peek(&key("pinned"), end).unwrap().1,
            pinned.generation
        );
        assert_eq!(cache.counters().removed, 100_000);
        cache.assert_consistent();
    }

    #[test]
    fn an_earlier_now_is_ordered_by_inserted_at_and_not_evicted_for_itself() {
        let t0 = Instant::now();
        let mut cache = cache(120, 2, 1 << 20);
        cache.insert(key("a"), Arc::new(0), 1, t0 + Duration::from_secs(10));
        // A caller whose `now` was taken before the previous insert's.
        cache.insert(key("b"), Arc::new(0), 1, t0 + Duration::from_secs(5));
        let now = t0 + Duration::from_secs(11);
        let outcome = cache.insert(key("c"), Arc::new(0), 1, t0 + Duration::from_secs(1));
        assert!(outcome.retained);
        assert_eq!(held(&cache, &["a", "b", "c"], now), [true, false, true]);
        cache.assert_consistent();
    }

    /// One operation of the model-based property test.
    #[derive(Clone, Debug)]
    enum Op {
        Insert {
            key: u8,
            bytes: u64,
        },
        Peek {
            key: u8,
        },
        /// Removes with the generation `back` steps before the next one to be issued.
        Remove {
            key: u8,
            back: u64,
        },
        Discard {
            key: u8,
        },
        Purge,
        /// Moves time forward, or back (a caller's `now` taken slightly before another's).
        Advance {
            millis: i64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..8, 0u64..120).prop_map(|(key, bytes)| Op::Insert { key, bytes }),
            3 => (0u8..8).prop_map(|key| Op::Peek { key }),
            3 => (0u8..8, 1u64..5).prop_map(|(key, back)| Op::Remove { key, back }),
            1 => (0u8..8).prop_map(|key| Op::Discard { key }),
            1 => Just(Op::Purge),
            // Half-second steps, like the TTL, so that ages land exactly on the TTL boundary.
            3 => (-2i64..8).prop_map(|halves| Op::Advance { millis: halves * 500 }),
        ]
    }

    struct ModelEntry {
        key: u8,
        value: u32,
        inserted_at: Instant,
        generation: u64,
        bytes: u64,
    }

    /// The naive reference: a vector scanned linearly, written straight from SPEC §8.
    struct Model {
        config: PendingConfig,
        entries: Vec<ModelEntry>,
        next_generation: u64,
    }

    impl Model {
        fn expired(&self, entry: &ModelEntry, now: Instant) -> bool {
            now.saturating_duration_since(entry.inserted_at) >= self.config.ttl
        }

        fn bytes(&self) -> u64 {
            self.entries.iter().map(|e| e.bytes).sum()
        }

        fn purge(&mut self, now: Instant) -> usize {
            let before = self.entries.len();
            let ttl = self.config.ttl;
            self.entries
                .retain(|e| now.saturating_duration_since(e.inserted_at) < ttl);
            before - self.entries.len()
        }

        fn remove_oldest(&mut self) {
            let oldest = (0..self.entries.len())
                .min_by_key(|&i| (self.entries[i].inserted_at, self.entries[i].generation))
                .unwrap();
            self.entries.remove(oldest);
        }

        fn insert(&mut self, key: u8, value: u32, bytes: u64, now: Instant) -> InsertOutcome {
            let generation = self.next_generation;
            self.next_generation += 1;
            let mut outcome = InsertOutcome {
                generation,
                evicted_expired: self.purge(now),
                ..InsertOutcome::default()
            };
            if let Some(i) = self.entries.iter().position(|e| e.key == key) {
                self.entries.remove(i);
                outcome.replaced = true;
            }
            if self.config.max_entries == 0 {
                outcome.evicted_for_entries = 1;
                return outcome;
            }
            if bytes > self.config.max_bytes {
                outcome.evicted_for_bytes = 1;
                return outcome;
            }
            while self.entries.len() + 1 > self.config.max_entries {
                self.remove_oldest();
                outcome.evicted_for_entries += 1;
            }
            while self.bytes() + bytes > self.config.max_bytes {
                self.remove_oldest();
                outcome.evicted_for_bytes += 1;
            }
            self.entries.push(ModelEntry {
                key,
                value,
                inserted_at: now,
                generation,
                bytes,
            });
            outcome.retained = true;
            outcome
        }

        fn peek(&self, key: u8, now: Instant) -> Option<(u32, u64)> {
            self.entries
                .iter()
                .find(|e| e.key == key && !self.expired(e, now))
                .map(|e| (e.value, e.generation))
        }

        fn remove(&mut self, key: u8, generation: u64) -> bool {
            let found = self
                .entries
                .iter()
                .position(|e| e.key == key && e.generation == generation);
            found.map(|i| self.entries.remove(i)).is_some()
        }

        fn discard(&mut self, key: u8) -> bool {
            let found = self.entries.iter().position(|e| e.key == key);
            found.map(|i| self.entries.remove(i)).is_some()
        }
    }

    fn model_key(key: u8) -> PendingKey {
        PendingKey::new("model", "default", format!("sel-{key}"))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn cache_matches_naive_model(
            ttl_halves in 0u64..10,
            max_entries in 0usize..6,
            max_bytes in 0u64..400,
            ops in proptest::collection::vec(op(), 1..200),
        ) {
            let config = PendingConfig {
                ttl: Duration::from_millis(ttl_halves * 500),
                max_entries,
                max_bytes,
            };
            let mut cache: PendingCache<u32> = PendingCache::new(config);
            let mut model = Model { config, entries: Vec::new(), next_generation: 1 };
            // Start well after the epoch so that stepping back stays representable.
            let epoch = Instant::now();
            let mut offset_millis: i64 = 1_000_000;
            let mut next_value = 0u32;
            for op in ops {
                let now = epoch + Duration::from_millis(offset_millis as u64);
                match op {
                    Op::Insert { key, bytes } => {
                        next_value += 1;
                        let got = cache.insert(model_key(key), Arc::new(next_value), bytes, now);
                        let want = model.insert(key, next_value, bytes, now);
                        prop_assert_eq!(got, want);
                    }
                    Op::Peek { key } => {
                        let got = cache.peek(&model_key(key), now).map(|(v, g)| (*v, g));
                        prop_assert_eq!(got, model.peek(key, now));
                    }
                    Op::Remove { key, back } => {
                        let generation = model.next_generation.saturating_sub(back);
                        let got = cache.remove(&model_key(key), generation);
                        prop_assert_eq!(got, model.remove(key, generation));
                    }
                    Op::Discard { key } => {
                        prop_assert_eq!(cache.discard(&model_key(key)), model.discard(key));
                    }
                    Op::Purge => {
                        prop_assert_eq!(cache.purge_expired(now), model.purge(now));
                    }
                    Op::Advance { millis } => {
                        offset_millis = (offset_millis + millis).max(0);
                    }
                }
                prop_assert_eq!(cache.len(), model.entries.len());
                prop_assert_eq!(cache.bytes(), model.bytes());
                prop_assert!(cache.len() <= max_entries);
                prop_assert!(cache.bytes() <= max_bytes);
                cache.assert_consistent();
            }
        }
    }
}
