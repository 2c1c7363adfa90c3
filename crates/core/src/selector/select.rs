//! Selection: the candidates of a partition with their overlap and load, the cost of each, and
//! the pick (SPEC §6); `select` caches what a replay will book, `select_and_reserve` books.
//! Their disaggregated variants, `select_disaggregated` and `select_and_reserve_disaggregated`,
//! pick each leg here (`Leg`) and live in `disagg.rs`.

use super::*;
use crate::error::check_id;
use crate::event::Rank;
use crate::hash::PromptHashes;
use crate::index::{CompactMatches, Floor, RankOverlap};
use crate::load::Booking;
use crate::pending::PendingKey;
use crate::schedule::{Candidate, Leg, RouterProfile, pick};
use crate::selector::fleet::CandidateInputs;
use crate::selector::sessions::{self, SessionLookup};
use std::sync::Arc;

/// Ranks with a non-zero overlap, sorted by rank for lookups by binary search (cheaper than
/// building a hash map of up to every rank on every select).
/// A prompt's overlaps from one index walk: the compact answer and the index that gave it.
pub(super) struct Overlaps<'a> {
    answer: CompactMatches,
    index: &'a RadixIndex,
}

impl<'a> Overlaps<'a> {
    pub(super) fn get(&self, rank: &Rank) -> Option<RankOverlap> {
        self.answer.get(self.index, *rank)
    }

    /// The ranks listed: every rank with an overlap but the floor's members not listed.
    pub(super) fn listed(&self) -> impl Iterator<Item = &RankOverlap> {
        self.answer.listed.iter()
    }

    /// The floor, with the index whose rank slots it names.
    pub(super) fn floor(&self) -> Option<(&Floor, &'a RadixIndex)> {
        self.answer.floor.as_ref().map(|f| (f, self.index))
    }
}

impl Selector {
    pub(super) fn candidates<'w>(
        &self,
        workers: &[&'w WorkerRecord],
        overlaps: &Overlaps,
        hashes: &PromptHashes,
        block_size: u32,
        expected_output_tokens: Option<u64>,
        engine_load_at: Option<Instant>,
    ) -> Vec<(Candidate, &'w WorkerRecord)> {
        let load = locked(&self.load);
        // Taken after the load tracker (the module's lock order); only when asked for.
        let engine_loads = engine_load_at
            .filter(|_| {
                self.engine_loads_reported
                    .load(std::sync::atomic::Ordering::Acquire)
            })
            .map(|now| (now, locked(&self.engine_loads)));
        let inputs = CandidateInputs {
            speeds: load.speeds(expected_output_tokens),
            potential: load.potential_decode(&hashes.sequence, hashes.isl_tokens, block_size),
            load: &load,
        };
        // One rank per worker is the common case.
        let mut out = Vec::with_capacity(workers.len());
        for &record in workers {
            for dp_rank in record.spec.dp_ranks() {
                let rank = Rank::new(record.spec.worker_id, dp_rank);
                let mut candidate = inputs.candidate(rank, record, overlaps);
                if let Some((now, reports)) = &engine_loads
                    && let Some((report, at)) = reports.get(&rank)
                    && now.saturating_duration_since(*at) <= self.config.engine_load_max_age
                {
                    engine_load::correct(&mut candidate, report);
                }
                out.push((candidate, record));
            }
        }
        out
    }

    /// The workers a request may go to for `leg` (prefill workers take prefill legs only, the
    /// others decode legs and whole requests, decode workers the latter unless the request says
    /// they cannot): its pinned worker, else its allowed ones, less those its required taints
    /// exclude.
    pub(super) fn eligible<'w>(
        req: &SelectRequest<'_>,
        mut workers: Vec<&'w WorkerRecord>,
        leg: Leg,
    ) -> Result<Vec<&'w WorkerRecord>, Error> {
        workers.retain(|r| match (leg, r.spec.role) {
            (Leg::Prefill, role) => role == WorkerRole::Prefill,
            (_, WorkerRole::Prefill) => false,
            (Leg::Whole, WorkerRole::Decode) => req.decode_runs_whole,
            (Leg::Whole | Leg::Decode, WorkerRole::Both | WorkerRole::Decode) => true,
        });
        let mut eligible: Vec<&WorkerRecord> = match (req.pinned_worker, req.allowed_worker_ids) {
            (Some(pin), _) => workers
                .into_iter()
                .filter(|r| r.spec.worker_id == pin.worker_id)
                .filter(|r| pin.dp_rank.is_none_or(|d| r.spec.dp_ranks().contains(&d)))
                .collect(),
            (None, Some(allowed)) => workers
                .into_iter()
                .filter(|r| allowed.contains(&r.spec.worker_id))
                .collect(),
            (None, None) => workers,
        };
        constraints::retain_admitted(&mut eligible, req.routing_constraints);
        if eligible.is_empty() {
            return Err(Error::NoEndpointsAvailable);
        }
        Ok(eligible)
    }

    /// The eligible workers' ranks as candidates (only the pinned rank of a pinned worker).
    fn eligible_candidates<'w>(
        &self,
        req: &SelectRequest<'_>,
        eligible: &[&'w WorkerRecord],
        overlaps: &Overlaps,
        hashes: &PromptHashes,
        block_size: u32,
        engine_load_at: Option<Instant>,
    ) -> Vec<(Candidate, &'w WorkerRecord)> {
        let mut candidates = self.candidates(
            eligible,
            overlaps,
            hashes,
            block_size,
            req.expected_output_tokens,
            engine_load_at,
        );
        if let Some(PinnedWorker {
            dp_rank: Some(d), ..
        }) = req.pinned_worker
        {
            candidates.retain(|(c, _)| c.rank.dp_rank == d);
        }
        candidates
    }

    /// Whether a request would wait in the admission queue (`crate::admission`): every rank it
    /// may go to is over `threshold` × its `max_num_batched_tokens` of active prefill. Also the
    /// prompt's tokens not cached on its best such rank (the `wspt` order). An error is what
    /// selecting would answer now (no such worker): the request is decided, not queued.
    pub fn queue_probe(
        &self,
        req: &SelectRequest<'_>,
        threshold: f64,
    ) -> Result<QueueProbe, Error> {
        self.check_running()?;
        let (p, workers) = self.schedulable_workers(req.partition)?;
        let block_size = workers.first().and_then(|r| r.spec.block_size).unwrap_or(1);
        let hashes = req.prompt.hash(block_size)?;
        let eligible = Self::eligible(req, workers, Leg::Whole)?;
        let overlaps = Self::overlaps(p, &hashes);
        // Engines' reports change no prefill tokens, the only load the queue reads.
        let candidates =
            self.eligible_candidates(req, &eligible, &overlaps, &hashes, block_size, None);
        let full = candidates.iter().all(|(c, _)| {
            crate::admission::over_threshold(
                threshold,
                c.active_prefill_tokens,
                c.max_num_batched_tokens,
            )
        });
        let cached = candidates
            .iter()
            .map(|(c, _)| u64::from(c.device_blocks) * u64::from(block_size))
            .max()
            .unwrap_or(0);
        Ok(QueueProbe {
            full,
            isl_tokens: hashes.isl_tokens,
            uncached_tokens: hashes.isl_tokens.saturating_sub(cached),
        })
    }

    pub(super) fn overlaps<'a>(p: &'a Partition, hashes: &PromptHashes) -> Overlaps<'a> {
        // The index lists in rank order, which `Overlaps::get` searches.
        let answer = p.index.find_matches_compact(&hashes.sequence);
        debug_assert!(answer.listed.is_sorted_by_key(|o| o.rank));
        Overlaps {
            answer,
            index: &p.index,
        }
    }

    /// Picks a rank for `leg` of the request (SPEC §6; §6.1 for the legs of a disaggregated
    /// one).
    pub(super) fn compute_selection(
        &self,
        req: &SelectRequest<'_>,
        now: Instant,
        rng: &mut impl Rng,
        leg: Leg,
    ) -> Result<Selection, Error> {
        self.check_running()?;
        if let Some(id) = req.selection_id {
            check_id("selection_id", id)?;
        }
        let session = self.look_up_session(req, now)?;
        let config = self.config.scheduler.with(&req.overrides);
        // The same pick without the scan of every rank, when it provably agrees (`fleet.rs`):
        // a whole request in a partition of `both` workers.
        if leg == Leg::Whole
            && let Some(selection) = self.select_at_fleet_size(req, &session, &config, rng)?
        {
            return Ok(selection);
        }
        let (p, workers) = self.schedulable_workers(req.partition)?;
        let block_size = workers.first().and_then(|r| r.spec.block_size).unwrap_or(1);
        let hashes = req.prompt.hash(block_size)?;

        let eligible = Self::eligible(req, workers, leg)?;
        let overlaps = Self::overlaps(p, &hashes);
        let candidates =
            self.eligible_candidates(req, &eligible, &overlaps, &hashes, block_size, Some(now));
        // Decision quality (`Selection::best_gpu_overlap`): from the overlaps already walked.
        let best_device_blocks = candidates
            .iter()
            .map(|(c, _)| c.device_blocks)
            .max()
            .unwrap_or(0);
        let preferred = || {
            let (isl, bs) = (hashes.isl_tokens, block_size);
            self.preferred_candidate(req, &session, &candidates, &config, isl, bs)
        };
        let chosen = if req.pinned_worker.is_some() {
            // Pinning bypasses scoring: the first (or named) rank of the pinned worker.
            0
        } else if let Some(i) = preferred() {
            // An affinity target or a bound session (`sessions.rs`).
            i
        } else {
            let free: Vec<usize> = (0..candidates.len())
                .filter(|&i| !config.is_busy(&candidates[i].0))
                .collect();
            if free.is_empty() {
                return Err(Error::AllWorkersBusy);
            }
            let costs: Vec<f64> = free
                .iter()
                .map(|&i| {
                    let (candidate, record) = &candidates[i];
                    config.leg_cost(leg, candidate, hashes.isl_tokens, block_size)
                        * constraints::cost_multiplier(req.routing_constraints, record)
                })
                .collect();
            let picked = pick(&costs, config.router_temperature, rng);
            // Dynamo 1.6.1 does not spread: its profile picks the cheapest on every replica.
            let spread = self
                .replica_spread()
                .filter(|_| config.profile == RouterProfile::Kvroute);
            match spread {
                Some(s) => {
                    // What this request adds to the rank it goes to: its own prefill there.
                    let c = &candidates[free[picked]].0;
                    let own = config.own_prefill_cost(c, hashes.isl_tokens, block_size);
                    s.pick(&free, &costs, picked, own)
                }
                None => free[picked],
            }
        };
        let Some(&chosen) = candidates.get(chosen) else {
            return Err(Error::NoEndpointsAvailable);
        };
        Ok(self.selection_for(
            req,
            leg,
            session,
            &config,
            &hashes,
            block_size,
            &overlaps,
            chosen,
            best_device_blocks,
        ))
    }

    /// The reply for the chosen rank.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn selection_for(
        &self,
        req: &SelectRequest<'_>,
        leg: Leg,
        session: SessionLookup,
        config: &SchedulerConfig,
        hashes: &PromptHashes,
        block_size: u32,
        overlaps: &Overlaps,
        (candidate, record): (Candidate, &WorkerRecord),
        best_device_blocks: u32,
    ) -> Selection {
        let bs = u64::from(block_size);
        let dp = record
            .spec
            .dp_ranks()
            .map(|d| {
                let device = overlaps
                    .get(&Rank::new(record.spec.worker_id, d))
                    .map_or(0, |o| o.device_blocks);
                (d, u64::from(device) * bs)
            })
            .collect();
        let worker_load = req.advisory.then(|| WorkerLoad {
            active_prefill_tokens: candidate.active_prefill_tokens,
            prefill_token_capacity: record
                .spec
                .max_num_batched_tokens
                .unwrap_or(UNKNOWN_PREFILL_CAPACITY),
            total_kv_blocks: record.spec.total_kv_blocks,
        });
        // A decode leg computes no prompt: its KV arrives from the prefill worker.
        let (effective_prefill_tokens, track_prefill_tokens) = match leg {
            Leg::Decode => (0, false),
            Leg::Whole | Leg::Prefill => (
                config.effective_prefill_tokens(
                    hashes.isl_tokens,
                    block_size,
                    candidate.device_blocks,
                    candidate.host_blocks,
                    candidate.disk_blocks,
                ),
                config.track_prefill_tokens,
            ),
        };
        Selection {
            selection_id: req.selection_id.map(str::to_string),
            partition: req.partition.clone(),
            worker_id: record.spec.worker_id,
            dp_rank: candidate.rank.dp_rank,
            endpoint: record.spec.endpoint.clone().unwrap_or_default(),
            bootstrap_port: record.spec.bootstrap_port,
            block_size,
            overlap: OverlapTokens {
                longest_matched: u64::from(candidate.disk_blocks) * bs,
                gpu: u64::from(candidate.device_blocks) * bs,
                cpu: u64::from(candidate.host_blocks) * bs,
                disk: u64::from(candidate.disk_blocks) * bs,
                dp,
            },
            best_gpu_overlap: u64::from(best_device_blocks) * bs,
            effective_prefill_tokens,
            potential_decode_blocks: candidate.potential_decode_blocks,
            worker_load,
            track_prefill_tokens,
            local_hashes: Arc::from(hashes.local.as_slice()),
            sequence_hashes: Arc::from(hashes.sequence.as_slice()),
            isl_tokens: hashes.isl_tokens,
            session: self.session_choice(req, session, candidate.rank),
        }
    }

    /// `POST /select`: picks a rank; books nothing. With a `selection_id` the booking inputs are
    /// cached for a replay (a newer select with the same id replaces the entry).
    pub fn select(
        &self,
        req: &SelectRequest<'_>,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Result<Selection, Error> {
        let selection = self.compute_selection(req, now, rng, Leg::Whole)?;
        self.cache_selection(req, &selection, now);
        Ok(selection)
    }

    /// Keeps what a replay of `req.selection_id` will book (nothing without an id).
    pub(super) fn cache_selection(
        &self,
        req: &SelectRequest<'_>,
        selection: &Selection,
        now: Instant,
    ) {
        if let Some(id) = req.selection_id {
            let key = PendingKey::new(&req.partition.model_name, &req.partition.routing_group, id);
            // Local and sequence hashes are both kept.
            let bytes = key
                .approximate_entry_bytes(2 * selection.sequence_hashes.len(), req.lora_name)
                + req.session_id.map_or(0, str::len) as u64;
            let entry = PendingSelection {
                worker_id: selection.worker_id,
                dp_rank: selection.dp_rank,
                local_hashes: Arc::clone(&selection.local_hashes),
                sequence_hashes: Arc::clone(&selection.sequence_hashes),
                isl_tokens: selection.isl_tokens,
                effective_prefill_tokens: selection.effective_prefill_tokens,
                expected_output_tokens: req.expected_output_tokens,
                track_prefill_tokens: selection.track_prefill_tokens,
                lora_name: req.lora_name.map(str::to_string),
                session: sessions::pending_session(selection.session.as_ref()),
            };
            self.pending().insert(key, Arc::new(entry), bytes, now);
        }
    }

    /// `POST /select_and_reserve`: selects and books atomically under `reservation_id` (or the
    /// request's selection id, or a generated UUID), predicting the prompt's blocks on a rank
    /// with KV events (`predict.rs`). Never touches the pending cache.
    pub fn select_and_reserve(
        &mut self,
        req: &SelectRequest<'_>,
        reservation_id: Option<&str>,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Result<(Selection, Reservation), Error> {
        for (field, value) in [
            ("reservation_id", reservation_id),
            ("selection_id", req.selection_id),
        ] {
            if let Some(v) = value {
                sync::check_booking_id(field, v)?;
            }
        }
        // Due predictions go and queued ones are recorded before the pick sees the index.
        self.expire_predictions(now);
        let selection = self.compute_selection(req, now, rng, Leg::Whole)?;
        let id = reservation_id
            .or(req.selection_id)
            .map(str::to_string)
            .unwrap_or_else(|| random_uuid(rng));
        self.book_selection(req, selection, id, now)
    }

    /// Books a computed selection under `id`: its load, its session, its cache model and its
    /// predicted blocks.
    pub(super) fn book_selection(
        &mut self,
        req: &SelectRequest<'_>,
        mut selection: Selection,
        id: String,
        now: Instant,
    ) -> Result<(Selection, Reservation), Error> {
        self.refuse_session_conflict(selection.session.as_ref(), selection.worker_id)?;
        exclusive(&mut self.load).book(
            Booking {
                reservation_id: id.clone(),
                rank: Rank::new(selection.worker_id, selection.dp_rank),
                block_size: selection.block_size,
                sequence_hashes: Arc::clone(&selection.sequence_hashes),
                isl_tokens: selection.isl_tokens,
                effective_prefill_tokens: selection.effective_prefill_tokens,
                expected_output_tokens: req.expected_output_tokens,
                track_prefill_tokens: selection.track_prefill_tokens,
            },
            now,
        )?;
        let rank = Rank::new(selection.worker_id, selection.dp_rank);
        self.hold_session(selection.session.as_ref(), &id, rank, now);
        self.model_booking(
            &id,
            rank,
            &selection.local_hashes,
            &selection.sequence_hashes,
            selection.isl_tokens,
            now,
        );
        self.predict_booking(
            rank,
            &selection.local_hashes,
            &selection.sequence_hashes,
            &id,
            now,
        );
        selection.selection_id = Some(id.clone());
        let reservation = Reservation {
            reservation_id: id.clone(),
            selection_id: Some(id),
            partition: req.partition.clone(),
            worker_id: selection.worker_id,
            dp_rank: selection.dp_rank,
            endpoint: selection.endpoint.clone(),
        };
        Ok((selection, reservation))
    }
}
