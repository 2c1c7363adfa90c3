//! `dynamo`, `kvroute` and their variants: kvroute's [`Selector`], driven as the HTTP service
//! drives it. Workers are registered with `upsert_worker`, the engines' KV events go through
//! `apply_events`, each request is booked with `select_and_reserve` (the pick is the selector's
//! cost, by the policy's profile), and the engine drives `prefill_complete` (first token),
//! `output_block` (each new output block) and `free` (last token).

use super::*;

pub(super) struct SelectorRouter {
    pub(super) selector: Selector,
    pub(super) partition: PartitionKey,
    pub(super) config: SelectorPolicy,
    pub(super) ids: HashMap<RequestId, String>,
    pub(super) diagnostics: RouterDiagnostics,
    /// When the selector's housekeeping (TTL expiry, lease reaper) last ran.
    pub(super) last_tick: Option<Instant>,
    pub(super) overlap: OverlapTotals,
}

impl SelectorRouter {
    pub(super) fn new(
        workers: usize,
        engine: &EngineConfig,
        config: SelectorPolicy,
        replica: Option<usize>,
    ) -> Result<Self, SimError> {
        let mut selector = Selector::new(SelectorConfig {
            scheduler: config.scheduler,
            approximate_policy: config.approximate_policy,
            predict: PredictConfig {
                ttl: config.predicted_ttl,
                ..PredictConfig::default()
            },
            sessions: config.sessions,
            ..SelectorConfig::default()
        });
        selector.set_replica_id(replica.map(replica_name).as_deref());
        let partition = PartitionKey::new("sim", "default");
        for w in 0..workers {
            let id = worker_id(w);
            let outcome = selector.upsert_worker(WorkerSpec {
                worker_id: id,
                model_name: partition.model_name.clone(),
                routing_group: partition.routing_group.clone(),
                endpoint: Some(format!("sim://worker-{id}")),
                block_size: Some(engine.block_size),
                total_kv_blocks: engine.kv_blocks,
                max_num_batched_tokens: Some(engine.max_num_batched_tokens),
                // The address only marks the worker as publishing events: the simulator hands
                // them over in process.
                kv_events_endpoint: config.kv_events.then(|| "tcp://127.0.0.1:1".to_string()),
                ..WorkerSpec::default()
            })?;
            if !outcome.record.not_schedulable_reasons.is_empty() {
                return Err(SimError::Internal(format!(
                    "worker {id} is not schedulable: {}",
                    outcome.record.not_schedulable_reasons.join("; ")
                )));
            }
        }
        Ok(Self {
            selector,
            partition,
            config,
            ids: HashMap::new(),
            diagnostics: RouterDiagnostics::default(),
            last_tick: None,
            overlap: OverlapTotals::default(),
        })
    }

    fn apply(&mut self, worker: usize, events: &[KvEvent]) {
        if let Some(outcome) = self.selector.apply_events(worker_id(worker), 0, events) {
            self.diagnostics.parent_block_not_found += outcome.parent_block_not_found;
            self.diagnostics.unknown_removed_blocks += outcome.unknown_removed_blocks;
        }
    }

    fn reservation_id(&self, id: RequestId) -> Result<&str, SimError> {
        self.ids
            .get(&id)
            .map(String::as_str)
            .ok_or_else(|| SimError::Internal(format!("request {id} was never booked")))
    }
}

impl Router for SelectorRouter {
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        tick_each_second(&mut self.selector, &mut self.last_tick, now);
        let reservation_id = format!("r{id}");
        let session = session.map(|s| s.to_string());
        let request = SelectRequest {
            session_id: session.as_deref(),
            ..SelectRequest::new(&self.partition, Prompt::Hashes(prompt))
        };
        let (selection, _) =
            self.selector
                .select_and_reserve(&request, Some(&reservation_id), now, rng)?;
        let worker = usize::try_from(selection.worker_id.saturating_sub(1))
            .map_err(|_| SimError::Internal("worker id out of range".into()))?;
        self.ids.insert(id, reservation_id);
        self.overlap.chosen_tokens += selection.overlap.gpu;
        self.overlap.best_tokens += selection.best_gpu_overlap;
        Ok(worker)
    }

    fn on_kv_events(&mut self, worker: usize, events: &[KvEvent]) {
        if self.config.kv_events {
            self.apply(worker, events);
        }
    }

    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let rid = self.reservation_id(id)?.to_string();
        Ok(self.selector.prefill_complete(&rid, now)?)
    }

    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let rid = self.reservation_id(id)?.to_string();
        Ok(self.selector.output_block(&rid, None, now)?)
    }

    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        let Some(rid) = self.ids.remove(&id) else {
            return Err(SimError::Internal(format!("request {id} was never booked")));
        };
        Ok(self.selector.free(&rid, now)?)
    }

    fn diagnostics(&self) -> RouterDiagnostics {
        self.diagnostics
    }

    fn selector_overlap(&self) -> Option<OverlapTotals> {
        Some(self.overlap)
    }

    fn shares_bookings(&self) -> bool {
        true
    }

    fn export_booking(&self, id: RequestId) -> Option<SyncedBooking> {
        let rid = self.ids.get(&id)?;
        self.selector.synced_booking(rid)
    }

    fn import_booking(
        &mut self,
        from: usize,
        id: RequestId,
        state: Option<&SyncedBooking>,
        now: Instant,
    ) -> Result<(), SimError> {
        let replica = replica_name(from);
        let rid = format!("r{id}");
        match state {
            Some(state) => {
                self.selector
                    .apply_synced_booking(BookingOwner::Remote(&replica), &rid, state, now)
                    .map_err(|e| SimError::Internal(format!("replica sync of {rid}: {e}")))?;
            }
            None => {
                self.selector.remove_remote_booking(&replica, &rid);
            }
        }
        Ok(())
    }
}

/// The service ticks its selector once a second; so does a simulated router (both the
/// aggregated and the P/D one).
pub(crate) fn tick_each_second(
    selector: &mut Selector,
    last_tick: &mut Option<Instant>,
    now: Instant,
) {
    if last_tick.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
        selector.tick(now);
        *last_tick = Some(now);
    }
}
