//! Bookings shared between replicas (SPEC §10): the pure half of replica sync.
//!
//! Several kvroute replicas behind a load balancer must see each other's load or they herd onto
//! the same "best" rank. The service publishes the *state* of each of its own bookings
//! ([`SyncedBooking`]: what was booked where, whether prefill completed, the output blocks and
//! the booking's own decode contribution) and the other replicas apply it here, to the load
//! tracker only: never to the pending-selection cache, nor to the approximate cache models.
//!
//! - A remote booking lives in the same [`LoadTracker`](crate::load::LoadTracker) as local ones,
//!   under the key `"\0{replica}\0{reservation_id}"`, so `/loads`, scheduling and the
//!   `active_request_expiry` sweep of [`Selector::tick`] treat it exactly like a local booking
//!   (a replica that died without freeing its bookings cannot pin load forever). Local ids
//!   starting with U+0000 are refused (400), so the two can never collide, and a client cannot
//!   free another replica's booking.
//! - Applying a state is idempotent: the same state twice changes nothing (not even the expiry
//!   clock), and a state never goes through the local lifecycle calls, so the order of
//!   duplicates does not matter either.
//! - [`BookingOwner::Local`] restores one of this replica's own bookings after a restart, under
//!   its plain id, so the client's later lifecycle calls find it.
//! - A booking naming a worker or rank this replica does not know (or not as schedulable) is
//!   refused with [`SyncApplyError::UnknownRank`]; the edge counts and drops it.

use super::{Lifecycle, Selector, exclusive, locked};
use crate::error::{Error, check_id};
use crate::event::{Rank, WorkerId};
use crate::load::{Booking, BookingView, LoadError};
use std::sync::Arc;
use std::time::Instant;

/// The first character of every remote booking's key; refused at the start of local ids.
const REMOTE_MARK: char = '\0';

/// Checks a local booking id: at most 1,024 bytes and not in the remote namespace.
pub(super) fn check_booking_id(field: &'static str, value: &str) -> Result<(), Error> {
    check_id(field, value)?;
    if value.starts_with(REMOTE_MARK) {
        return Err(Error::InvalidField {
            field,
            message: format!("{field} must not start with U+0000 (reserved for replica sync)"),
        });
    }
    Ok(())
}

/// One booking's state as replicas exchange it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncedBooking {
    pub worker_id: WorkerId,
    pub dp_rank: u32,
    pub block_size: u32,
    /// Sequence hashes of the prompt's full blocks (they carry the block sharing of §5).
    pub sequence_hashes: Arc<[u64]>,
    pub isl_tokens: u64,
    pub effective_prefill_tokens: u64,
    pub expected_output_tokens: Option<u64>,
    pub track_prefill_tokens: bool,
    pub prefill_complete: bool,
    pub output_blocks: u64,
    /// The booking's own decode contribution ([`BookingView::decode_blocks`]).
    pub decode_blocks: u64,
    /// The session the booking holds (in its worker's partition), with session affinity on.
    pub session_id: Option<String>,
}

impl SyncedBooking {
    pub fn from_view(view: &BookingView) -> Self {
        Self {
            worker_id: view.rank.worker_id,
            dp_rank: view.rank.dp_rank,
            block_size: view.block_size,
            sequence_hashes: Arc::clone(&view.sequence_hashes),
            isl_tokens: view.isl_tokens,
            effective_prefill_tokens: view.effective_prefill_tokens,
            expected_output_tokens: view.expected_output_tokens,
            track_prefill_tokens: view.track_prefill_tokens,
            prefill_complete: view.prefill_complete,
            output_blocks: view.output_blocks,
            decode_blocks: view.decode_blocks,
            session_id: None,
        }
    }

    fn rank(&self) -> Rank {
        Rank::new(self.worker_id, self.dp_rank)
    }

    /// Whether `view` is the same booking (possibly at another point of its lifecycle).
    fn same_booking(&self, view: &BookingView) -> bool {
        view.rank == self.rank()
            && view.block_size == self.block_size
            && view.sequence_hashes == self.sequence_hashes
            && view.isl_tokens == self.isl_tokens
            && view.effective_prefill_tokens == self.effective_prefill_tokens
            && view.expected_output_tokens == self.expected_output_tokens
            && view.track_prefill_tokens == self.track_prefill_tokens
    }
}

/// Whose booking a synced state is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BookingOwner<'a> {
    /// This replica's own booking, restored after a restart under its plain id.
    Local,
    /// Another replica's booking.
    Remote(&'a str),
}

/// What applying a synced state did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncApplyOutcome {
    /// The booking was new here and is now booked.
    Booked,
    /// The booking was known; its lifecycle state moved.
    Updated,
    /// The booking was known in exactly this state.
    Unchanged,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SyncApplyError {
    /// The worker or rank is not in this replica's catalog (or not schedulable).
    #[error("unknown rank {worker_id}/{dp_rank}")]
    UnknownRank { worker_id: WorkerId, dp_rank: u32 },
    /// The state itself is invalid (block size 0).
    #[error(transparent)]
    Invalid(#[from] LoadError),
}

/// Whether a load-tracker key is another replica's booking.
pub(super) fn is_remote_key(key: &str) -> bool {
    key.starts_with(REMOTE_MARK)
}

fn remote_key(replica: &str, reservation_id: &str) -> String {
    format!("{REMOTE_MARK}{replica}{REMOTE_MARK}{reservation_id}")
}

/// The `(replica, reservation id)` of a remote booking's key.
fn split_remote_key(key: &str) -> Option<(&str, &str)> {
    key.strip_prefix(REMOTE_MARK)?.split_once(REMOTE_MARK)
}

/// This router is replica `index` of `replicas` routing the same workers, each hearing of the
/// others' bookings late (over NATS, after a few milliseconds).
///
/// Replicas with the same view pick the same rank: two that have not yet heard of each other's
/// last bookings send a burst's requests to the same "best" ranks and queue them there. So among
/// the ranks whose cost is within what the request itself adds to a rank (its uncached prefill
/// there, weighted as the cost weighs it) of the cheapest, each replica takes the cheapest of
/// its own share of the candidates (those at a position ≡ `index` modulo `replicas`), when it has
/// one: the replicas' picks from one view then differ, while a prefix's holder, cheaper than the
/// others by more than that, still wins on every replica. Alone, a router picks the cheapest;
/// under the `dynamo` router profile every replica does (Dynamo 1.6.1 does not spread).
///
/// The replicas are the ones with live bookings here plus this one, ordered by id, so every
/// replica computes the same order; [`Selector::tick`] refreshes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaSpread {
    pub index: u32,
    pub replicas: u32,
}

impl ReplicaSpread {
    /// The candidate to take (an index into the candidates): among `free` (candidate indices)
    /// with `costs`, where `picked` is the cheapest's position, the cheapest of this replica's
    /// share that costs at most `own` more than it, else the cheapest.
    pub(super) fn pick(&self, free: &[usize], costs: &[f64], picked: usize, own: f64) -> usize {
        let limit = costs[picked] + own;
        let share = |j: &usize| free[*j] % self.replicas as usize == self.index as usize;
        (0..free.len())
            .filter(share)
            .filter(|&j| costs[j] <= limit)
            .min_by(|&a, &b| costs[a].total_cmp(&costs[b]))
            .map_or(free[picked], |j| free[j])
    }
}

impl Selector {
    /// Names this selector as replica `id` among replicas sharing bookings (`None`: alone). Its
    /// place among them ([`ReplicaSpread`]) is refreshed now and by every [`Selector::tick`].
    pub fn set_replica_id(&mut self, id: Option<&str>) {
        self.replica = id.map(|id| (id.to_string(), None));
        self.refresh_replica_spread();
    }

    /// This replica's place among the live replicas, when there are others.
    pub fn replica_spread(&self) -> Option<ReplicaSpread> {
        self.replica.as_ref().and_then(|(_, spread)| *spread)
    }

    /// Recomputes [`Selector::replica_spread`] from the replicas with live bookings here. O(n).
    pub(super) fn refresh_replica_spread(&mut self) {
        let Some((own, _)) = &self.replica else {
            return;
        };
        // The distinct replica ids of the live remote bookings, without copying each booking's.
        let spread = {
            let load = locked(&self.load);
            let mut ids: std::collections::BTreeSet<&str> = load
                .iter()
                .filter_map(|(id, _)| split_remote_key(id).map(|(replica, _)| replica))
                .collect();
            ids.insert(own.as_str());
            let index = ids.range(..own.as_str()).count();
            (ids.len() > 1).then(|| ReplicaSpread {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                replicas: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            })
        };
        if let Some((_, current)) = &mut self.replica {
            *current = spread;
        }
    }

    /// The state of this replica's own booking `reservation_id`, if live.
    pub fn synced_booking(&self, reservation_id: &str) -> Option<SyncedBooking> {
        if reservation_id.starts_with(REMOTE_MARK) {
            return None;
        }
        let mut state = locked(&self.load)
            .booking(reservation_id)
            .map(SyncedBooking::from_view)?;
        state.session_id = self.session_of_booking(reservation_id);
        Some(state)
    }

    /// Every live booking of this replica (not the remote ones), in no particular order. O(n).
    pub fn local_bookings(&self) -> Vec<(Arc<str>, SyncedBooking)> {
        let mut bookings: Vec<(Arc<str>, SyncedBooking)> = locked(&self.load)
            .iter()
            .filter(|(id, _)| !id.starts_with(REMOTE_MARK))
            .map(|(id, view)| (Arc::clone(id), SyncedBooking::from_view(view)))
            .collect();
        if self.config.sessions.enabled() {
            let sessions = self.sessions();
            for (id, state) in &mut bookings {
                state.session_id = sessions.session_of(id).map(|k| k.session_id.clone());
            }
        }
        bookings
    }

    /// Live bookings of other replicas: `(replica, reservation id)`. O(n).
    pub fn remote_bookings(&self) -> Vec<(String, String)> {
        locked(&self.load)
            .iter()
            .filter_map(|(id, _)| split_remote_key(id))
            .map(|(replica, id)| (replica.to_string(), id.to_string()))
            .collect()
    }

    /// Applies a booking's state (see the module docs). Idempotent.
    pub fn apply_synced_booking(
        &mut self,
        owner: BookingOwner<'_>,
        reservation_id: &str,
        state: &SyncedBooking,
        now: Instant,
    ) -> Result<SyncApplyOutcome, SyncApplyError> {
        let known = self.workers.get(&state.worker_id).is_some_and(|record| {
            record.lifecycle == Lifecycle::Schedulable
                && record.spec.dp_ranks().contains(&state.dp_rank)
        });
        if !known {
            return Err(SyncApplyError::UnknownRank {
                worker_id: state.worker_id,
                dp_rank: state.dp_rank,
            });
        }
        if state.block_size == 0 {
            return Err(LoadError::ZeroBlockSize.into());
        }
        let key = match owner {
            BookingOwner::Local => reservation_id.to_string(),
            BookingOwner::Remote(replica) => remote_key(replica, reservation_id),
        };
        let mut outcome = SyncApplyOutcome::Unchanged;
        match exclusive(&mut self.load).booking(&key) {
            Some(view) if state.same_booking(view) => {}
            existing => {
                if existing.is_some() {
                    // The same id now names another booking (freed and booked again meanwhile).
                    exclusive(&mut self.load).free(&key)?;
                    self.release_sessions_untimed(std::iter::once(key.as_str()));
                }
                exclusive(&mut self.load).book(
                    Booking {
                        reservation_id: key.clone(),
                        rank: state.rank(),
                        block_size: state.block_size,
                        sequence_hashes: Arc::clone(&state.sequence_hashes),
                        isl_tokens: state.isl_tokens,
                        effective_prefill_tokens: state.effective_prefill_tokens,
                        expected_output_tokens: state.expected_output_tokens,
                        track_prefill_tokens: state.track_prefill_tokens,
                    },
                    now,
                )?;
                let partition = self
                    .workers
                    .get(&state.worker_id)
                    .map(|r| r.spec.partition());
                if let Some(partition) = partition {
                    self.hold_synced_session(&partition, state.session_id.as_deref(), &key, now);
                }
                outcome = SyncApplyOutcome::Booked;
            }
        }
        let prefill_pending = exclusive(&mut self.load)
            .booking(&key)
            .is_some_and(|view| !view.prefill_complete);
        if state.prefill_complete && prefill_pending {
            exclusive(&mut self.load).prefill_complete(&key, now)?;
            outcome = outcome.max_with(SyncApplyOutcome::Updated);
        }
        if exclusive(&mut self.load).set_output_state(
            &key,
            state.output_blocks,
            state.decode_blocks,
            now,
        )? {
            outcome = outcome.max_with(SyncApplyOutcome::Updated);
        }
        Ok(outcome)
    }

    /// Removes another replica's booking (it was freed there). False when it was not live here.
    pub fn remove_remote_booking(&mut self, replica: &str, reservation_id: &str) -> bool {
        let key = remote_key(replica, reservation_id);
        let freed = exclusive(&mut self.load).free(&key).is_ok();
        if freed {
            self.release_sessions_untimed(std::iter::once(key.as_str()));
        }
        freed
    }

    /// Removes every remote booking for which `keep(replica, reservation id)` is false (a
    /// replica's snapshot replaces what this replica knew of it). Returns how many went. O(n).
    pub fn retain_remote_bookings(&mut self, keep: impl Fn(&str, &str) -> bool) -> usize {
        let gone: Vec<Arc<str>> = exclusive(&mut self.load)
            .iter()
            .filter(|(id, _)| split_remote_key(id).is_some_and(|(r, i)| !keep(r, i)))
            .map(|(id, _)| Arc::clone(id))
            .collect();
        let freed: Vec<Arc<str>> = gone
            .into_iter()
            .filter(|id| exclusive(&mut self.load).free(id).is_ok())
            .collect();
        self.release_sessions_untimed(freed.iter().map(|id| &**id));
        freed.len()
    }
}

impl SyncApplyOutcome {
    /// `Booked` wins over `Updated`, which wins over `Unchanged`.
    fn max_with(self, other: Self) -> Self {
        match (self, other) {
            (SyncApplyOutcome::Booked, _) | (_, SyncApplyOutcome::Booked) => {
                SyncApplyOutcome::Booked
            }
            (SyncApplyOutcome::Updated, _) | (_, SyncApplyOutcome::Updated) => {
                SyncApplyOutcome::Updated
            }
            _ => SyncApplyOutcome::Unchanged,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PartitionKey;
    use crate::selector::{LifecycleCalls, Prompt, ReservationRequest, SelectRequest, WorkerSpec};
    use rand::SeedableRng;
    use rand::rngs::SmallRng;
    use std::time::Duration;

    fn selector_with(workers: &[WorkerId]) -> Selector {
        let mut selector = Selector::default();
        for &worker_id in workers {
            selector
                .upsert_worker(WorkerSpec {
                    worker_id,
                    model_name: "m".into(),
                    routing_group: "g".into(),
                    endpoint: Some(format!("http://w{worker_id}")),
                    block_size: Some(4),
                    ..WorkerSpec::default()
                })
                .unwrap();
        }
        selector
    }

    fn state(worker_id: WorkerId) -> SyncedBooking {
        SyncedBooking {
            worker_id,
            dp_rank: 0,
            block_size: 4,
            sequence_hashes: Arc::from(vec![11, 12, 13]),
            isl_tokens: 14,
            effective_prefill_tokens: 14,
            expected_output_tokens: None,
            track_prefill_tokens: true,
            prefill_complete: false,
            output_blocks: 0,
            decode_blocks: 4,
            session_id: None,
        }
    }

    fn load_of(selector: &Selector, worker_id: WorkerId) -> crate::load::RankLoad {
        selector.load_tracker().rank_load(Rank::new(worker_id, 0))
    }

    #[test]
    fn a_remote_state_applied_twice_counts_once() {
        let mut s = selector_with(&[1]);
        let now = Instant::now();
        let owner = BookingOwner::Remote("r2");
        assert_eq!(
            s.apply_synced_booking(owner, "a", &state(1), now),
            Ok(SyncApplyOutcome::Booked)
        );
        let once = load_of(&s, 1);
        assert_eq!(
            s.apply_synced_booking(owner, "a", &state(1), now),
            Ok(SyncApplyOutcome::Unchanged)
        );
        assert_eq!(load_of(&s, 1), once);
        assert_eq!(once.active_requests, 1);
        assert_eq!(once.active_prefill_tokens, 14);
        assert_eq!(once.active_decode_blocks, 4);
    }

    #[test]
    fn lifecycle_states_move_the_load_and_free_removes_it() {
        let mut s = selector_with(&[1]);
        let now = Instant::now();
        let owner = BookingOwner::Remote("r2");
        s.apply_synced_booking(owner, "a", &state(1), now).unwrap();
        let mut later = state(1);
        later.prefill_complete = true;
        later.output_blocks = 2;
        later.decode_blocks = 6;
        assert_eq!(
            s.apply_synced_booking(owner, "a", &later, now),
            Ok(SyncApplyOutcome::Updated)
        );
        let load = load_of(&s, 1);
        assert_eq!(load.active_prefill_tokens, 0);
        assert_eq!(load.active_decode_blocks, 6);
        // A state seen first in its late form books it directly in that form.
        let mut fresh = selector_with(&[1]);
        fresh.apply_synced_booking(owner, "a", &later, now).unwrap();
        assert_eq!(load_of(&fresh, 1), load);
        assert!(s.remove_remote_booking("r2", "a"));
        assert!(!s.remove_remote_booking("r2", "a"));
        assert_eq!(load_of(&s, 1).active_requests, 0);
    }

    #[test]
    fn remote_ids_never_collide_with_local_ones_and_clients_cannot_touch_them() {
        let mut s = selector_with(&[1]);
        let now = Instant::now();
        s.apply_synced_booking(BookingOwner::Remote("r2"), "a", &state(1), now)
            .unwrap();
        let key = PartitionKey::new("m", "g");
        let tokens: Vec<u32> = (1..=14).collect();
        let mut req = ReservationRequest::replay(&key, "a");
        req.worker_id = Some(1);
        req.prompt = Some(Prompt::Tokens {
            tokens: &tokens,
            lora_name: None,
            cache_salt: None,
            extras: crate::hash::BlockExtras::default(),
        });
        s.create_reservation(&req, now).unwrap();
        assert_eq!(load_of(&s, 1).active_requests, 2);
        assert_eq!(s.local_bookings().len(), 1);
        assert_eq!(s.remote_bookings(), vec![("r2".into(), "a".into())]);
        let remote_key = remote_key("r2", "a");
        assert!(matches!(
            s.free(&remote_key, now),
            Err(Error::InvalidField { .. })
        ));
        let mut req = ReservationRequest::replay(&key, &remote_key);
        req.worker_id = Some(1);
        assert!(matches!(
            s.create_reservation(&req, now),
            Err(Error::InvalidField { .. })
        ));
        s.free("a", now).unwrap();
        assert_eq!(load_of(&s, 1).active_requests, 1);
    }

    #[test]
    fn unknown_ranks_are_refused_and_change_nothing() {
        let mut s = selector_with(&[1]);
        let now = Instant::now();
        let owner = BookingOwner::Remote("r2");
        assert_eq!(
            s.apply_synced_booking(owner, "a", &state(9), now),
            Err(SyncApplyError::UnknownRank {
                worker_id: 9,
                dp_rank: 0
            })
        );
        let mut bad_rank = state(1);
        bad_rank.dp_rank = 3;
        assert!(s.apply_synced_booking(owner, "a", &bad_rank, now).is_err());
        assert!(s.load_tracker().is_empty());
    }

    #[test]
    fn remote_bookings_count_in_scheduling_and_expire_like_local_ones() {
        let mut s = selector_with(&[1, 2]);
        let now = Instant::now();
        for i in 0..3 {
            s.apply_synced_booking(BookingOwner::Remote("r2"), &i.to_string(), &state(1), now)
                .unwrap();
        }
        let key = PartitionKey::new("m", "g");
        let tokens: Vec<u32> = (100..=113).collect();
        let hashes = crate::hash::PromptHashes::from_tokens(&tokens, 4, 0);
        let req = SelectRequest::new(&key, Prompt::Hashes(&hashes));
        let mut rng = SmallRng::seed_from_u64(1);
        let (selection, _) = s.select_and_reserve(&req, None, now, &mut rng).unwrap();
        assert_eq!(selection.worker_id, 2, "the remote load on worker 1 counts");
        let outcome = s.tick(now + Duration::from_secs(301));
        assert_eq!(outcome.expired_reservations.len(), 4);
        assert!(s.remote_bookings().is_empty());
    }

    #[test]
    fn a_snapshot_replaces_what_was_known_of_a_replica() {
        let mut s = selector_with(&[1]);
        let now = Instant::now();
        for (replica, id) in [("r2", "a"), ("r2", "b"), ("r3", "a")] {
            s.apply_synced_booking(BookingOwner::Remote(replica), id, &state(1), now)
                .unwrap();
        }
        let removed = s.retain_remote_bookings(|replica, id| replica != "r2" || id == "b");
        assert_eq!(removed, 1);
        let mut left = s.remote_bookings();
        left.sort();
        assert_eq!(
            left,
            vec![("r2".into(), "b".into()), ("r3".into(), "a".into())]
        );
    }

    #[test]
    fn an_own_booking_restored_after_a_restart_answers_lifecycle_calls() {
        let mut s = selector_with(&[1]);
        let now = Instant::now();
        s.apply_synced_booking(BookingOwner::Local, "mine", &state(1), now)
            .unwrap();
        assert_eq!(s.synced_booking("mine"), Some(state(1)));
        s.prefill_complete("mine", now).unwrap();
        s.free("mine", now).unwrap();
        assert!(s.load_tracker().is_empty());
    }
}
