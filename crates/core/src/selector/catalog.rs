//! The worker catalog: registration (with the reasons a worker is not schedulable), deletion,
//! listings, readiness and the block size each partition hashes prompts with.

use super::{Lifecycle, Partition, Selector, UpsertOutcome, WorkerRecord, WorkerSpec, exclusive};
use super::{ReadyState, TtlModel};
use crate::error::{Error, PartitionKey, check_id};
use crate::event::{Rank, WorkerId};
use crate::index::RadixIndex;
use std::collections::BTreeSet;

/// Checks a ZMQ address: `tcp://host:port`, `ipc://path` or `inproc://name`.
pub fn check_zmq_endpoint(addr: &str) -> Result<(), String> {
    let Some((scheme, rest)) = addr.split_once("://") else {
        return Err(format!("invalid ZMQ endpoint `{addr}`: missing scheme"));
    };
    match scheme {
        "tcp" => {
            let Some((host, port)) = rest.rsplit_once(':') else {
                return Err(format!("invalid ZMQ endpoint `{addr}`: missing port"));
            };
            if host.is_empty() {
                return Err(format!("invalid ZMQ endpoint `{addr}`: missing host"));
            }
            if port != "*" && port.parse::<u16>().is_err() {
                return Err(format!(
                    "invalid ZMQ endpoint `{addr}`: invalid port `{port}`"
                ));
            }
            Ok(())
        }
        "ipc" | "inproc" if !rest.is_empty() => Ok(()),
        "ipc" | "inproc" => Err(format!("invalid ZMQ endpoint `{addr}`: missing path")),
        other => Err(format!(
            "invalid ZMQ endpoint `{addr}`: unsupported scheme `{other}`"
        )),
    }
}

impl Selector {
    pub(super) fn reasons_for(&self, spec: &WorkerSpec) -> Vec<String> {
        let mut reasons = Vec::new();
        if spec.endpoint.as_deref().is_none_or(str::is_empty) {
            reasons.push("endpoint is required".to_string());
        }
        match spec.block_size {
            None | Some(0) => reasons.push("block_size must be greater than 0".to_string()),
            Some(bs) => {
                let partition = spec.partition();
                if let Some(existing) =
                    self.partition_block_size_excluding(&partition, spec.worker_id)
                    && existing != bs
                {
                    reasons.push(format!(
                        "block_size mismatch for {partition}: existing={existing} requested={bs}"
                    ));
                }
            }
        }
        if spec.dp_size() == 0 {
            reasons.push("data_parallel_size must be greater than 0".to_string());
        }
        if self.config.queue_threshold.is_some() && spec.max_num_batched_tokens.is_none() {
            reasons
                .push("max_num_batched_tokens is required while queueing is enabled".to_string());
        }
        let ranks = spec.dp_ranks();
        if spec.kv_events_endpoints.is_empty() {
            if let Some(addr) = spec.kv_events_endpoint.as_deref().filter(|a| !a.is_empty()) {
                if spec.dp_size() > 1 {
                    for r in ranks.clone().skip(1) {
                        reasons.push(format!("kv_events endpoint is required for dp_rank {r}"));
                    }
                }
                if let Err(e) = check_zmq_endpoint(addr) {
                    reasons.push(format!(
                        "invalid kv_events endpoint for worker {} dp_rank {}: {e}",
                        spec.worker_id,
                        spec.dp_start()
                    ));
                }
            }
        } else {
            for r in ranks.clone() {
                if !spec.kv_events_endpoints.contains_key(&r) {
                    reasons.push(format!("kv_events endpoint is required for dp_rank {r}"));
                }
            }
            for (r, addr) in &spec.kv_events_endpoints {
                if !ranks.contains(r) {
                    reasons.push(format!(
                        "kv_events endpoint for dp_rank {r} is outside the worker's ranks {}..{}",
                        ranks.start, ranks.end
                    ));
                } else if let Err(e) = check_zmq_endpoint(addr) {
                    reasons.push(format!(
                        "invalid kv_events endpoint for worker {} dp_rank {r}: {e}",
                        spec.worker_id
                    ));
                }
            }
        }
        if let Some(replay) = spec.replay_endpoint.as_deref().filter(|a| !a.is_empty()) {
            if spec.dp_size() > 1 {
                reasons
                    .push("replay_endpoint is supported only for data_parallel_size 1".to_string());
            }
            if let Err(e) = check_zmq_endpoint(replay) {
                reasons.push(format!(
                    "invalid replay_endpoint for worker {}: {e}",
                    spec.worker_id
                ));
            }
        }
        reasons
    }

    /// The block size of the schedulable workers of a partition other than `worker_id`.
    pub(super) fn partition_block_size_excluding(
        &self,
        partition: &PartitionKey,
        worker_id: WorkerId,
    ) -> Option<u32> {
        let p = self.partitions.get(partition)?;
        p.workers
            .iter()
            .filter(|&&w| w != worker_id)
            .filter_map(|w| self.workers.get(w))
            .filter(|r| r.lifecycle == Lifecycle::Schedulable)
            .find_map(|r| r.spec.block_size)
    }

    /// Registers or updates a worker (`POST /workers`). Live bookings are kept; the worker's
    /// index entries are kept when its event endpoints, ranks and partition are unchanged.
    pub fn upsert_worker(&mut self, spec: WorkerSpec) -> Result<UpsertOutcome, Error> {
        self.check_running()?;
        check_id("model_name", &spec.model_name)?;
        check_id("routing_group", &spec.routing_group)?;
        // Bookings queued before the change predict on the worker as it was.
        self.settle_predictions();
        self.catalog_version += 1;
        let reasons = self.reasons_for(&spec);
        let lifecycle = if reasons.is_empty() {
            Lifecycle::Schedulable
        } else {
            Lifecycle::Incomplete
        };
        let partition = spec.partition();
        // Reports of ranks the worker no longer has go (`engine_load.rs`).
        self.forget_engine_loads(spec.worker_id, spec.dp_ranks());
        let previous = self.workers.get(&spec.worker_id).cloned();
        let events_changed = match &previous {
            None => true,
            Some(old) => {
                old.spec.partition() != partition
                    || old.spec.event_endpoints() != spec.event_endpoints()
                    || old.spec.replay_endpoint != spec.replay_endpoint
                    || old.spec.dp_ranks() != spec.dp_ranks()
                    || old.spec.block_size != spec.block_size
                    || old.lifecycle != lifecycle
            }
        };
        if let Some(old) = &previous {
            let old_partition = old.spec.partition();
            if events_changed {
                if let Some(p) = self.partitions.get_mut(&old_partition) {
                    p.index.remove_worker(spec.worker_id);
                }
                self.forget_worker_predictions(spec.worker_id);
            }
            if old_partition != partition {
                self.detach_from_partition(&old_partition, spec.worker_id);
            }
        }
        let index_config = self.config.index;
        let ttl_config = self.config.ttl;
        self.partitions
            .entry(partition)
            .or_insert_with(|| Partition {
                index: RadixIndex::new(index_config),
                workers: BTreeSet::new(),
                ttl: TtlModel::new(ttl_config),
            })
            .workers
            .insert(spec.worker_id);
        let record = WorkerRecord {
            spec,
            lifecycle,
            not_schedulable_reasons: reasons,
        };
        self.workers.insert(record.spec.worker_id, record.clone());
        self.sync_cache_models(&record, previous.as_ref(), events_changed);
        Ok(UpsertOutcome {
            record,
            events_changed,
        })
    }

    pub(super) fn detach_from_partition(&mut self, partition: &PartitionKey, worker_id: WorkerId) {
        let ranks: Vec<Rank> = exclusive(&mut self.lru)
            .ranks()
            .filter(|r| r.worker_id == worker_id)
            .collect();
        for rank in ranks {
            exclusive(&mut self.lru).remove_rank(rank);
        }
        if let Some(p) = self.partitions.get_mut(partition) {
            for rank in p
                .index
                .ranks()
                .into_iter()
                .filter(|r| r.worker_id == worker_id)
            {
                p.ttl.remove_rank(rank);
            }
            p.workers.remove(&worker_id);
            p.index.remove_worker(worker_id);
            if p.workers.is_empty() {
                self.partitions.remove(partition);
            }
        }
    }

    /// Deletes a worker: frees its bookings (their ids may be booked again), drops its blocks and
    /// returns its record with lifecycle `unschedulable`.
    pub fn delete_worker(&mut self, worker_id: WorkerId) -> Result<WorkerRecord, Error> {
        self.check_running()?;
        self.settle_predictions();
        let Some(mut record) = self.workers.remove(&worker_id) else {
            return Err(Error::WorkerNotFound { worker_id });
        };
        self.catalog_version += 1;
        self.forget_worker_predictions(worker_id);
        self.forget_engine_loads(worker_id, 0..0);
        let freed = exclusive(&mut self.load).free_worker(worker_id);
        for booking in &freed {
            exclusive(&mut self.lru).release(&*booking.reservation_id);
        }
        self.release_sessions_untimed(freed.iter().map(|b| &*b.reservation_id));
        self.detach_from_partition(&record.spec.partition(), worker_id);
        record.lifecycle = Lifecycle::Unschedulable;
        record.not_schedulable_reasons = Vec::new();
        Ok(record)
    }

    pub fn worker(&self, worker_id: WorkerId) -> Option<&WorkerRecord> {
        self.workers.get(&worker_id)
    }

    /// Workers, optionally filtered, sorted by (model, group, id).
    pub fn list_workers(
        &self,
        model_name: Option<&str>,
        routing_group: Option<&str>,
    ) -> Vec<WorkerRecord> {
        let mut out: Vec<WorkerRecord> = self
            .workers
            .values()
            .filter(|r| model_name.is_none_or(|m| r.spec.model_name == m))
            .filter(|r| routing_group.is_none_or(|g| r.spec.routing_group == g))
            .cloned()
            .collect();
        out.sort_by(|a, b| {
            (&a.spec.model_name, &a.spec.routing_group, a.spec.worker_id).cmp(&(
                &b.spec.model_name,
                &b.spec.routing_group,
                b.spec.worker_id,
            ))
        });
        out
    }

    pub fn ready(&self) -> ReadyState {
        let workers = self.list_workers(None, None);
        let schedulable_workers = workers
            .iter()
            .filter(|r| r.lifecycle == Lifecycle::Schedulable)
            .count();
        ReadyState {
            ready: schedulable_workers > 0 && !self.shutting_down,
            schedulable_workers,
            workers,
        }
    }

    pub(super) fn schedulable_workers<'s>(
        &'s self,
        partition: &PartitionKey,
    ) -> Result<(&'s Partition, Vec<&'s WorkerRecord>), Error> {
        let no_workers = || Error::NoSchedulableWorkers {
            partition: partition.clone(),
        };
        let p = self.partitions.get(partition).ok_or_else(no_workers)?;
        let workers: Vec<&WorkerRecord> = self.schedulable_in(p).collect();
        if workers.is_empty() {
            return Err(no_workers());
        }
        Ok((p, workers))
    }

    /// The partition, when it has a schedulable worker (the error of
    /// [`schedulable_workers`](Self::schedulable_workers) otherwise), without listing them all.
    pub(super) fn schedulable_partition(
        &self,
        partition: &PartitionKey,
    ) -> Result<&Partition, Error> {
        self.partitions
            .get(partition)
            .filter(|p| self.schedulable_in(p).next().is_some())
            .ok_or_else(|| Error::NoSchedulableWorkers {
                partition: partition.clone(),
            })
    }

    /// The partition's schedulable workers, in the order [`schedulable_workers`] lists them.
    ///
    /// [`schedulable_workers`]: Self::schedulable_workers
    pub(super) fn schedulable_in<'s>(
        &'s self,
        p: &'s Partition,
    ) -> impl Iterator<Item = &'s WorkerRecord> {
        p.workers
            .iter()
            .filter_map(|w| self.workers.get(w))
            .filter(|r| r.lifecycle == Lifecycle::Schedulable)
    }

    /// The block size prompts of this partition are hashed with (503 without schedulable
    /// workers). Edges call it to hash token prompts before taking a write lock.
    pub fn block_size_for(&self, partition: &PartitionKey) -> Result<u32, Error> {
        // The first schedulable worker, without building the whole list.
        self.partitions
            .get(partition)
            .and_then(|p| self.schedulable_in(p).next())
            .map(|r| r.spec.block_size.unwrap_or(1))
            .ok_or_else(|| Error::NoSchedulableWorkers {
                partition: partition.clone(),
            })
    }

    /// The block size of one worker (for explicit bookings with token ids).
    pub fn worker_block_size(&self, worker_id: WorkerId) -> Option<u32> {
        self.workers.get(&worker_id).and_then(|r| r.spec.block_size)
    }
}
