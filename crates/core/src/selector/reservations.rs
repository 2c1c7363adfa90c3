//! Bookings and their lifecycle calls (SPEC §7.3–§7.6): a reservation replays a cached selection
//! or books an explicit worker and prompt; `prefill_complete`, `output_block` and `free` follow
//! the request through the engine.
//!
//! Each lifecycle call is one method of [`LifecycleCalls`], whatever holds the selector. Its body
//! comes in two parts: a fast path under a shared borrow (the edge's read lock), which books
//! through the inner mutexes and answers `None`, having changed nothing, when the call would
//! change an approximate cache model's blocks; and the exclusive form that does everything. The
//! one place that chooses between them is the [`hold::Hold`] impl of each holder.

use super::{Lifecycle, PendingSelection, Reservation, ReservationRequest, WorkerRecord};
use super::{Selector, exclusive, locked, sync};
use crate::approx::LruModel;
use crate::error::{Error, PartitionKey};
use crate::event::{Rank, WorkerId};
use crate::load::{Booking, LoadTracker};
use crate::pending::PendingKey;
use std::sync::Arc;
use std::time::Instant;

/// The lifecycle calls of a booking, one method each, on whatever holds the selector: a
/// `&mut Selector` (the simulator, tests) or the `parking_lot::RwLock<Selector>` through which an
/// edge serves concurrent requests. Under the lock, a call runs under the read lock and takes the
/// write lock only when it must change an approximate cache model's blocks (a rank without KV
/// events): see the [module documentation](super#lock-discipline).
pub trait LifecycleCalls: hold::Hold + Sized {
    /// `POST /reservations`: books load, either replaying a cached selection or from an explicit
    /// worker and prompt (SPEC §7.3).
    fn create_reservation(
        self,
        req: &ReservationRequest<'_>,
        now: Instant,
    ) -> Result<Reservation, Error> {
        self.run(
            |s| s.create_reservation_shared(req, now),
            |s| s.create_reservation_exclusive(req, now),
        )
    }

    /// `POST /reservations/{id}/prefill_complete`: the booking's prefill tokens are done.
    fn prefill_complete(self, reservation_id: &str, now: Instant) -> Result<(), Error> {
        self.run(
            |s| s.prefill_complete_shared(reservation_id, now).map(Some),
            |s| s.prefill_complete_shared(reservation_id, now),
        )
    }

    /// `POST /reservations/{id}/output_block`: one more output block (optionally decayed).
    fn output_block(
        self,
        reservation_id: &str,
        decay_fraction: Option<f64>,
        now: Instant,
    ) -> Result<(), Error> {
        self.run(
            |s| s.output_block_shared(reservation_id, decay_fraction, now),
            |s| s.output_block_exclusive(reservation_id, decay_fraction, now),
        )
    }

    /// `DELETE /reservations/{id}`: the request ended; its load and its modelled cache lease go.
    /// `now` starts the idle time of the booking's session (`sessions.rs`).
    fn free(self, reservation_id: &str, now: Instant) -> Result<(), Error> {
        self.run(
            |s| s.free_shared(reservation_id, now),
            |s| s.free_exclusive(reservation_id, now),
        )
    }
}

impl<H: hold::Hold> LifecycleCalls for H {}

mod hold {
    use super::{Error, Selector};

    /// Where a selector is held. Sealed: this module's two impls are the only holders.
    pub trait Hold {
        /// Runs `shared` under a shared borrow and, when it answers `None` (it would change a
        /// cache model and changed nothing), `exclusive` under an exclusive borrow.
        fn run<T>(
            self,
            shared: impl FnOnce(&Selector) -> Result<Option<T>, Error>,
            exclusive: impl FnOnce(&mut Selector) -> Result<T, Error>,
        ) -> Result<T, Error>;
    }

    /// A prediction the shared part queued is recorded at once.
    impl Hold for &mut Selector {
        fn run<T>(
            self,
            shared: impl FnOnce(&Selector) -> Result<Option<T>, Error>,
            exclusive: impl FnOnce(&mut Selector) -> Result<T, Error>,
        ) -> Result<T, Error> {
            let done = match shared(self)? {
                Some(done) => done,
                None => exclusive(self)?,
            };
            self.settle_predictions();
            Ok(done)
        }
    }

    /// The read lock is released before the write lock is taken. A prediction the shared part
    /// queued is recorded if the write lock is free at once, else by its next holder; under the
    /// write lock, after the call.
    impl Hold for &parking_lot::RwLock<Selector> {
        fn run<T>(
            self,
            shared: impl FnOnce(&Selector) -> Result<Option<T>, Error>,
            exclusive: impl FnOnce(&mut Selector) -> Result<T, Error>,
        ) -> Result<T, Error> {
            let (done, queued) = {
                let selector = self.read();
                (shared(&selector)?, selector.has_queued_predictions())
            };
            match done {
                Some(done) => {
                    if queued && let Some(mut selector) = self.try_write() {
                        selector.settle_predictions();
                    }
                    Ok(done)
                }
                None => {
                    let mut selector = self.write();
                    let done = exclusive(&mut selector)?;
                    selector.settle_predictions();
                    Ok(done)
                }
            }
        }
    }
}

/// A replay checked and ready to book ([`Selector::plan_replay`]).
struct ReplayPlan {
    booking: Booking,
    reservation: Reservation,
    /// The rank's cache is modelled (no KV events): booking it changes the model too.
    modelled: bool,
    rank: Rank,
    key: PendingKey,
    generation: u64,
    entry: Arc<PendingSelection>,
}

/// The booking ids a reservation request names, checked as ids before anything else.
fn check_reservation_ids(req: &ReservationRequest<'_>) -> Result<(), Error> {
    for (field, value) in [
        ("selection_id", req.selection_id),
        ("reservation_id", req.reservation_id),
    ] {
        if let Some(v) = value {
            sync::check_booking_id(field, v)?;
        }
    }
    Ok(())
}

impl Selector {
    /// The schedulable record of `worker_id` in `partition` with `dp_rank` among its ranks.
    fn schedulable_rank(
        &self,
        partition: &PartitionKey,
        worker_id: WorkerId,
        dp_rank: Option<u32>,
    ) -> Result<(&WorkerRecord, u32), Error> {
        let not_found = || Error::WorkerNotSchedulable {
            worker_id,
            partition: partition.clone(),
        };
        let record = self
            .workers
            .get(&worker_id)
            .filter(|r| r.lifecycle == Lifecycle::Schedulable && r.spec.partition() == *partition)
            .ok_or_else(not_found)?;
        let dp_rank = dp_rank.unwrap_or(record.spec.dp_start());
        if !record.spec.dp_ranks().contains(&dp_rank) {
            return Err(not_found());
        }
        Ok((record, dp_rank))
    }

    /// [`LifecycleCalls::create_reservation`] under an exclusive borrow.
    pub(super) fn create_reservation_exclusive(
        &mut self,
        req: &ReservationRequest<'_>,
        now: Instant,
    ) -> Result<Reservation, Error> {
        self.check_running()?;
        check_reservation_ids(req)?;
        self.expire_predictions(now);
        match (req.worker_id, req.selection_id) {
            (Some(worker_id), _) => self.book_explicit(req, worker_id, now),
            (None, Some(selection_id)) => self.book_replay(req, selection_id, now),
            (None, None) => Err(Error::MissingSelectionOrWorker),
        }
    }

    /// Everything a replay books, checked but not yet booked: the pending entry (peeked), the
    /// worker and rank, and whether that rank's cache is modelled. Call it while holding the
    /// load tracker's mutex and book under the same hold, so that two replays of one selection
    /// book at most once.
    fn plan_replay(
        &self,
        req: &ReservationRequest<'_>,
        selection_id: &str,
        now: Instant,
    ) -> Result<ReplayPlan, Error> {
        let key = PendingKey::new(
            &req.partition.model_name,
            &req.partition.routing_group,
            selection_id,
        );
        let Some((entry, generation)) = self.pending().peek(&key, now) else {
            return Err(Error::NoPendingSelection {
                selection_id: selection_id.to_string(),
                partition: req.partition.clone(),
            });
        };
        self.schedulable_partition(req.partition)?;
        let (record, dp_rank) =
            self.schedulable_rank(req.partition, entry.worker_id, Some(entry.dp_rank))?;
        let reservation_id = req.reservation_id.unwrap_or(selection_id).to_string();
        let rank = Rank::new(entry.worker_id, dp_rank);
        Ok(ReplayPlan {
            booking: Booking {
                reservation_id: reservation_id.clone(),
                rank,
                block_size: record.spec.block_size.unwrap_or(1),
                sequence_hashes: Arc::clone(&entry.sequence_hashes),
                isl_tokens: entry.isl_tokens,
                effective_prefill_tokens: entry.effective_prefill_tokens,
                expected_output_tokens: entry.expected_output_tokens,
                track_prefill_tokens: entry.track_prefill_tokens,
            },
            reservation: Reservation {
                reservation_id,
                selection_id: Some(selection_id.to_string()),
                partition: req.partition.clone(),
                worker_id: entry.worker_id,
                dp_rank,
                endpoint: record.spec.endpoint.clone().unwrap_or_default(),
            },
            modelled: self.model_of(record).is_some(),
            rank,
            key,
            generation,
            entry,
        })
    }

    fn book_replay(
        &mut self,
        req: &ReservationRequest<'_>,
        selection_id: &str,
        now: Instant,
    ) -> Result<Reservation, Error> {
        let plan = {
            let mut load = locked(&self.load);
            let plan = self.plan_replay(req, selection_id, now)?;
            load.book(plan.booking.clone(), now)?;
            self.pending().remove(&plan.key, plan.generation);
            plan
        };
        let session = plan.entry.session_selection();
        let id = &plan.reservation.reservation_id;
        self.hold_session(session.as_ref(), id, plan.rank, now);
        self.model_booking(
            &plan.reservation.reservation_id,
            plan.rank,
            &plan.entry.local_hashes,
            &plan.entry.sequence_hashes,
            plan.entry.isl_tokens,
            now,
        );
        self.predict_booking(
            plan.rank,
            &plan.entry.local_hashes,
            &plan.entry.sequence_hashes,
            &plan.reservation.reservation_id,
            now,
        );
        Ok(plan.reservation)
    }

    /// [`LifecycleCalls::create_reservation`] under the shared lock: a replay onto a rank whose
    /// cache is known from KV events books here and queues its prediction (`predict.rs`); the
    /// explicit form and a replay onto a modelled rank answer `None` having changed nothing (the
    /// explicit form discards the cached selection, which the exclusive call does again first).
    pub(super) fn create_reservation_shared(
        &self,
        req: &ReservationRequest<'_>,
        now: Instant,
    ) -> Result<Option<Reservation>, Error> {
        self.check_running()?;
        check_reservation_ids(req)?;
        let (None, Some(selection_id)) = (req.worker_id, req.selection_id) else {
            return Ok(None);
        };
        let (reservation, rank, entry) = {
            let mut load = locked(&self.load);
            let plan = self.plan_replay(req, selection_id, now)?;
            if plan.modelled {
                return Ok(None);
            }
            load.book(plan.booking, now)?;
            self.pending().remove(&plan.key, plan.generation);
            (plan.reservation, plan.rank, plan.entry)
        };
        let session = entry.session_selection();
        self.hold_session(session.as_ref(), &reservation.reservation_id, rank, now);
        self.queue_prediction(
            rank,
            &entry.local_hashes,
            &entry.sequence_hashes,
            &reservation.reservation_id,
            now,
        );
        Ok(Some(reservation))
    }

    fn book_explicit(
        &mut self,
        req: &ReservationRequest<'_>,
        worker_id: WorkerId,
        now: Instant,
    ) -> Result<Reservation, Error> {
        let Some(name) = req.reservation_id.or(req.selection_id) else {
            return Err(Error::MissingBookingName);
        };
        // A delayed replay must never book stale state: the explicit form discards the cached
        // selection before anything else can fail.
        let cached = req.selection_id.or(req.reservation_id).unwrap_or(name);
        self.pending().discard(&PendingKey::new(
            &req.partition.model_name,
            &req.partition.routing_group,
            cached,
        ));
        let Some(prompt) = req.prompt else {
            return Err(Error::MissingPrompt {
                field: "sequence_hashes",
            });
        };
        if let (true, Some(id)) = (self.config.sessions.enabled(), req.session_id) {
            super::sessions::session_key(req.partition, id)?;
        }
        let p = self.schedulable_partition(req.partition)?;
        let (record, dp_rank) = self.schedulable_rank(req.partition, worker_id, req.dp_rank)?;
        let block_size = record.spec.block_size.unwrap_or(1);
        let hashes = prompt.hash(block_size)?;
        let config = self.config.scheduler.with(&req.overrides);
        let effective = match req.effective_prefill_tokens {
            Some(n) if n > hashes.isl_tokens => {
                return Err(Error::EffectivePrefillExceedsIsl {
                    effective_prefill_tokens: n,
                    isl_tokens: hashes.isl_tokens,
                });
            }
            Some(n) => n,
            None => {
                let overlap = Self::overlaps(p, &hashes).get(&Rank::new(worker_id, dp_rank));
                let (device, host, disk) = overlap.map_or((0, 0, 0), |o| {
                    (o.device_blocks, o.host_blocks, o.disk_blocks)
                });
                config.effective_prefill_tokens(hashes.isl_tokens, block_size, device, host, disk)
            }
        };
        let endpoint = record.spec.endpoint.clone().unwrap_or_default();
        let sequence: Arc<[u64]> = Arc::from(hashes.sequence.as_slice());
        let booking = Booking {
            reservation_id: name.to_string(),
            rank: Rank::new(worker_id, dp_rank),
            block_size,
            sequence_hashes: Arc::clone(&sequence),
            isl_tokens: hashes.isl_tokens,
            effective_prefill_tokens: effective,
            expected_output_tokens: req.expected_output_tokens,
            track_prefill_tokens: req
                .track_prefill_tokens
                .unwrap_or(config.track_prefill_tokens),
        };
        exclusive(&mut self.load).book(booking, now)?;
        let rank = Rank::new(worker_id, dp_rank);
        self.hold_explicit_session(req.partition, req.session_id, name, rank, now);
        self.model_booking(
            name,
            Rank::new(worker_id, dp_rank),
            &hashes.local,
            &hashes.sequence,
            hashes.isl_tokens,
            now,
        );
        if self.config.predict.enabled() {
            let local: Arc<[u64]> = Arc::from(hashes.local.as_slice());
            let rank = Rank::new(worker_id, dp_rank);
            self.predict_booking(rank, &local, &sequence, name, now);
        }
        Ok(Reservation {
            reservation_id: name.to_string(),
            selection_id: req.selection_id.map(str::to_string),
            partition: req.partition.clone(),
            worker_id,
            dp_rank,
            endpoint,
        })
    }

    pub(super) fn output_block_exclusive(
        &mut self,
        reservation_id: &str,
        decay_fraction: Option<f64>,
        now: Instant,
    ) -> Result<(), Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        exclusive(&mut self.load).output_block(reservation_id, decay_fraction, now)?;
        if let Some(lease) = exclusive(&mut self.lru).materialize(reservation_id, now) {
            self.apply_rank_events(lease.rank, &lease.events);
        }
        Ok(())
    }

    pub(super) fn free_exclusive(
        &mut self,
        reservation_id: &str,
        now: Instant,
    ) -> Result<(), Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        exclusive(&mut self.load).free(reservation_id)?;
        self.release_lease(reservation_id);
        self.release_session(reservation_id, now);
        Ok(())
    }

    /// [`LifecycleCalls::prefill_complete`] under any borrow: it changes no model's blocks, so it has no exclusive form.
    pub(super) fn prefill_complete_shared(
        &self,
        reservation_id: &str,
        now: Instant,
    ) -> Result<(), Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        let mut load = locked(&self.load);
        load.prefill_complete(reservation_id, now)?;
        locked(&self.lru).touch(reservation_id, now);
        Ok(())
    }

    /// [`LifecycleCalls::output_block`] under the shared lock; `None` for a booking the LRU
    /// model holds a lease for (its output block takes a slot in the modelled cache).
    pub(super) fn output_block_shared(
        &self,
        reservation_id: &str,
        decay_fraction: Option<f64>,
        now: Instant,
    ) -> Result<Option<()>, Error> {
        self.unleased(reservation_id, |load, lru| {
            load.output_block(reservation_id, decay_fraction, now)?;
            // No lease: counted as an ignored command, as the exclusive call does.
            let _ = lru.materialize(reservation_id, now);
            Ok(())
        })
    }

    /// [`LifecycleCalls::free`] under the shared lock; `None` for a booking the LRU model
    /// holds a lease for (its release evicts modelled blocks).
    pub(super) fn free_shared(
        &self,
        reservation_id: &str,
        now: Instant,
    ) -> Result<Option<()>, Error> {
        let freed = self.unleased(reservation_id, |load, lru| {
            load.free(reservation_id)?;
            // No lease: counted as an ignored command, as the exclusive call does.
            let _ = lru.release(reservation_id);
            Ok(())
        })?;
        if freed.is_some() {
            self.release_session(reservation_id, now);
        }
        Ok(freed)
    }

    /// Runs `call` on the load tracker and the LRU model (locked in that order) unless the LRU
    /// model holds a lease for the booking: then `None`, having changed nothing.
    fn unleased(
        &self,
        reservation_id: &str,
        call: impl FnOnce(&mut LoadTracker, &mut LruModel) -> Result<(), Error>,
    ) -> Result<Option<()>, Error> {
        self.check_running()?;
        sync::check_booking_id("reservation_id", reservation_id)?;
        let mut load = locked(&self.load);
        let mut lru = locked(&self.lru);
        if lru.lease(reservation_id).is_some() {
            return Ok(None);
        }
        call(&mut load, &mut lru).map(Some)
    }
}
