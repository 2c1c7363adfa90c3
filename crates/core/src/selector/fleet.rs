//! The select path at fleet size: the same pick as the full scan of `select.rs`, in time that
//! does not grow with the partition's workers.
//!
//! A rank that holds none of the prompt and has no live booking is *idle* for this request: its
//! candidate has no overlap, no load and the potential decode blocks of an empty rank, so every
//! idle rank costs the same (the cost reads no per-worker field but through the busy thresholds,
//! and with thresholds above zero an unloaded rank is never busy). The pick therefore scores
//! only the *explicit* ranks — the prompt's holders (from the index walk) and the ranks with
//! live bookings (the load tracker) — plus one idle candidate standing for all the others, then
//! counts the ties: the full scan draws its tie-break once over the tied ranks in candidate
//! order (`schedule::tie_index`), so the `k`-th tied rank here is the full scan's choice for the
//! same random source. `tests.rs` compares both on random fleets.
//!
//! A prompt whose first block most ranks hold (a fleet-wide system prompt) comes back from the
//! walk with a *floor* (`index/walk.rs`): the ranks that matched exactly the floor's depth, as a
//! set, with only the others listed. Unlisted, unbooked members cost alike for the same reason
//! idle ranks do (the same overlap, no load). When every rank not scored is a member, one of
//! them stands for them all, as the idle candidate does; otherwise (some ranks hold nothing) the
//! members are scored one by one. Mapping a floor's members to positions is O(W), done once per
//! floor met (`RankOrder::floor_positions`).
//!
//! Cost per select: O(H + B + log) for H holders listed and B booked ranks, against O(W) ranks
//! for the scan. The partition's ranks in candidate order (`RankOrder`) are built on the first select
//! after a catalog change, O(W) once.
//!
//! The scan still serves what this path cannot prove equal without looking at every rank: a
//! partition with `prefill` or `decode` workers (roles filter the candidates) and the legs of a
//! disaggregated request, a pinned, allowed or taint-constrained request, an affinity target or bound session, a
//! temperature above zero, spreading between replicas, engine-reported loads, and busy
//! thresholds at or below zero.

use super::*;
use crate::event::Rank;
use crate::index::{Floor, RadixIndex};
use crate::schedule::{Candidate, Leg, tie_index};
use crate::selector::select::Overlaps;
use crate::selector::sessions::SessionLookup;
use std::sync::{Arc, Mutex};

/// A partition's schedulable ranks in the full scan's candidate order (its workers by id, each
/// worker's ranks in order), and each rank's place in it.
#[derive(Debug)]
pub(super) struct RankOrder {
    ranks: Vec<Rank>,
    position: HashMap<Rank, usize>,
    /// The block size prompts of the partition are hashed with (its first schedulable worker's).
    block_size: u32,
    /// Whether every schedulable worker has role `both`: with prefill or decode workers the
    /// candidates are filtered by role (`Selector::eligible`), which this path does not do.
    all_both: bool,
    /// The last floor met (its members' words) and its members' positions, sorted: a floor
    /// changes only when a rank first holds or drops the shared block, so the O(W) mapping is
    /// done once per floor (and catalog version: slots are reused only when a worker goes).
    floor_positions: Mutex<Option<FloorPositions>>,
}

/// A floor's members (its words, the cache key) and their positions in a `RankOrder`, sorted.
type FloorPositions = (Vec<u64>, Arc<Vec<usize>>);

impl RankOrder {
    /// The positions of `floor`'s members (an answer of `index`) in this order, sorted.
    fn floor_positions(&self, floor: &Floor, index: &RadixIndex) -> Arc<Vec<usize>> {
        let mut cache = locked(&self.floor_positions);
        if let Some((words, positions)) = cache.as_ref()
            && words.as_slice() == floor.words()
        {
            return Arc::clone(positions);
        }
        let mut positions: Vec<usize> = index
            .floor_members(floor)
            .into_iter()
            .filter_map(|rank| self.position.get(&rank).copied())
            .collect();
        positions.sort_unstable();
        let positions = Arc::new(positions);
        *cache = Some((floor.words().to_vec(), Arc::clone(&positions)));
        positions
    }
}

/// The rank orders built since the catalog last changed (`Selector::catalog_version`).
#[derive(Debug, Default)]
pub(super) struct RankOrders {
    version: u64,
    by_partition: HashMap<PartitionKey, Arc<RankOrder>>,
}

/// One explicitly scored rank.
struct Scored {
    position: usize,
    candidate: Candidate,
    /// `None` when busy.
    cost: Option<f64>,
}

impl Selector {
    /// Whether [`Self::select_at_fleet_size`] picks exactly as the full scan for this request.
    fn fleet_path_applies(
        &self,
        req: &SelectRequest<'_>,
        session: &SessionLookup,
        config: &SchedulerConfig,
    ) -> bool {
        // `pick` samples by cost at a finite positive temperature, which reads every cost.
        let sampled = config.router_temperature > 0.0 && config.router_temperature.is_finite();
        let spreads = self.replica_spread().is_some() && config.profile == RouterProfile::Kvroute;
        // A threshold at or below zero makes even an unloaded rank busy, per its spec.
        let idle_may_be_busy = config.busy_decode_fraction.is_some_and(|f| f <= 0.0)
            || config.busy_prefill_tokens == Some(0)
            || config.busy_prefill_fraction.is_some_and(|f| f <= 0.0);
        req.pinned_worker.is_none()
            && req.allowed_worker_ids.is_none()
            && req
                .routing_constraints
                .is_none_or(RoutingConstraints::is_empty)
            && req.affinity_target.is_none()
            && !session.is_bound()
            && !sampled
            && !spreads
            && !idle_may_be_busy
            && !self
                .engine_loads_reported
                .load(std::sync::atomic::Ordering::Acquire)
    }

    /// The partition's ranks in candidate order, built once per catalog version.
    fn rank_order(&self, key: &PartitionKey, p: &Partition) -> Arc<RankOrder> {
        let mut orders = locked(&self.rank_orders);
        if orders.version != self.catalog_version {
            orders.version = self.catalog_version;
            orders.by_partition.clear();
        }
        if let Some(order) = orders.by_partition.get(key) {
            return Arc::clone(order);
        }
        let ranks: Vec<Rank> = self
            .schedulable_in(p)
            .flat_map(|r| {
                let worker_id = r.spec.worker_id;
                r.spec.dp_ranks().map(move |d| Rank::new(worker_id, d))
            })
            .collect();
        let position = ranks.iter().enumerate().map(|(i, &r)| (r, i)).collect();
        let block_size = self
            .schedulable_in(p)
            .next()
            .and_then(|r| r.spec.block_size)
            .unwrap_or(1);
        let all_both = self
            .schedulable_in(p)
            .all(|r| r.spec.role == WorkerRole::Both);
        let order = Arc::new(RankOrder {
            ranks,
            position,
            block_size,
            all_both,
            floor_positions: Mutex::new(None),
        });
        orders.by_partition.insert(key.clone(), Arc::clone(&order));
        order
    }

    /// The full scan's selection, without looking at every rank; `Ok(None)` when this request
    /// needs the scan (module documentation). Errors are the scan's, in its order.
    pub(super) fn select_at_fleet_size(
        &self,
        req: &SelectRequest<'_>,
        session: &SessionLookup,
        config: &SchedulerConfig,
        rng: &mut impl Rng,
    ) -> Result<Option<Selection>, Error> {
        if !self.fleet_path_applies(req, session, config) {
            return Ok(None);
        }
        let no_workers = || Error::NoSchedulableWorkers {
            partition: req.partition.clone(),
        };
        let p = self.partitions.get(req.partition).ok_or_else(no_workers)?;
        let order = self.rank_order(req.partition, p);
        if order.ranks.is_empty() {
            return Err(no_workers());
        }
        if !order.all_both {
            return Ok(None);
        }
        let block_size = order.block_size;
        let hashes = req.prompt.hash(block_size)?;
        let overlaps = Self::overlaps(p, &hashes);
        let isl = hashes.isl_tokens;

        let load = locked(&self.load);
        let inputs = CandidateInputs {
            speeds: load.speeds(req.expected_output_tokens),
            potential: load.potential_decode(&hashes.sequence, isl, block_size),
            load: &load,
        };
        let candidate_at = |position: usize| -> Option<(Candidate, &WorkerRecord)> {
            let rank = *order.ranks.get(position)?;
            let record = self.workers.get(&rank.worker_id)?;
            Some((inputs.candidate(rank, record, &overlaps), record))
        };
        // Holders and booked ranks of this partition, each once, in candidate order.
        let mut positions: Vec<usize> = overlaps
            .listed()
            .map(|o| o.rank)
            .chain(load.ranks().map(|(rank, _)| rank))
            .filter_map(|rank| order.position.get(&rank).copied())
            .collect();
        positions.sort_unstable();
        positions.dedup();
        if let Some((floor, index)) = overlaps.floor() {
            // The floor's members not scored below all cost the same (the same overlap, no
            // load), as the idle ranks do: they may stand as one candidate when every rank not
            // scored is a member. Otherwise members and idle ranks would differ: score the
            // members too.
            let members = order.floor_positions(floor, index);
            let outside = positions
                .iter()
                .filter(|p| members.binary_search(p).is_err())
                .count();
            if members.len() + outside != order.ranks.len() {
                positions.extend(members.iter().copied());
                positions.sort_unstable();
                positions.dedup();
            }
        }
        let mut scored = Vec::with_capacity(positions.len());
        for position in positions {
            // The catalog and the order change together, under the write lock.
            let Some((candidate, _)) = candidate_at(position) else {
                return Ok(None);
            };
            let cost =
                (!config.is_busy(&candidate)).then(|| config.cost(&candidate, isl, block_size));
            scored.push(Scored {
                position,
                candidate,
                cost,
            });
        }
        let idle_ranks = order.ranks.len() - scored.len();
        // The first idle rank (in order: the first position no explicit rank takes) and what
        // every idle rank costs, that of any one of them (never busy, see above).
        let first_idle = (0..order.ranks.len())
            .find(|&i| scored.get(i).is_none_or(|s| s.position != i))
            .filter(|_| idle_ranks > 0);
        // (With a floor standing for the ranks not scored, "idle" ones are its members.)
        let (idle_cost, idle_device_blocks) = match first_idle {
            Some(position) => match candidate_at(position) {
                Some((candidate, _)) => (
                    Some(config.cost(&candidate, isl, block_size)),
                    candidate.device_blocks,
                ),
                None => return Ok(None),
            },
            None => (None, 0),
        };
        let first_free = scored
            .iter()
            .find(|s| s.cost.is_some())
            .map(|s| s.position)
            .into_iter()
            .chain(first_idle)
            .min();
        let Some(first_free) = first_free else {
            return Err(Error::AllWorkersBusy);
        };
        // As `schedule::pick` at temperature 0: the lowest cost (a NaN is never it), ties drawn
        // once; with no cost to compare, the first free rank.
        let min = scored
            .iter()
            .filter_map(|s| s.cost)
            .chain(idle_cost)
            .fold(f64::INFINITY, f64::min);
        let idle_ties = if idle_cost == Some(min) {
            idle_ranks
        } else {
            0
        };
        let explicit_ties = scored.iter().filter(|s| s.cost == Some(min)).count();
        let chosen = match explicit_ties + idle_ties {
            0 => first_free,
            ties => kth_tie(&scored, min, idle_ties > 0, tie_index(ties, rng)),
        };
        let best_device_blocks = scored
            .iter()
            .map(|s| s.candidate.device_blocks)
            .max()
            .unwrap_or(0)
            .max(idle_device_blocks);
        let Some((candidate, record)) = candidate_at(chosen) else {
            return Ok(None);
        };
        drop(load);
        Ok(Some(self.selection_for(
            req,
            Leg::Whole,
            session.clone(),
            config,
            &hashes,
            block_size,
            &overlaps,
            (candidate, record),
            best_device_blocks,
        )))
    }
}

/// The position of the `k`-th (from 0) rank costing `min`, in candidate order: explicit ranks
/// that cost `min`, and every idle rank (the positions no explicit rank takes) when `idle_tie`.
fn kth_tie(scored: &[Scored], min: f64, idle_tie: bool, mut k: usize) -> usize {
    let mut next = 0; // the first position not yet passed
    for s in scored {
        if idle_tie {
            let gap = s.position - next;
            if k < gap {
                return next + k;
            }
            k -= gap;
        }
        if s.cost == Some(min) {
            if k == 0 {
                return s.position;
            }
            k -= 1;
        }
        next = s.position + 1;
    }
    next + k
}

/// What building a candidate reads, shared by every rank of one select.
pub(super) struct CandidateInputs<'a> {
    pub(super) load: &'a crate::load::LoadTracker,
    pub(super) potential: crate::load::PotentialDecode<'a>,
    pub(super) speeds: crate::speed::EngineSpeeds,
}

impl CandidateInputs<'_> {
    /// One rank's candidate, before any engine-reported load.
    pub(super) fn candidate(
        &self,
        rank: Rank,
        record: &WorkerRecord,
        overlaps: &Overlaps,
    ) -> Candidate {
        let overlap = overlaps.get(&rank);
        let rank_load = self.load.rank_load(rank);
        Candidate {
            rank,
            device_blocks: overlap.map_or(0, |o| o.device_blocks),
            host_blocks: overlap.map_or(0, |o| o.host_blocks),
            disk_blocks: overlap.map_or(0, |o| o.disk_blocks),
            active_prefill_tokens: rank_load.active_prefill_tokens,
            active_decode_blocks: rank_load.active_decode_blocks,
            potential_decode_blocks: self.potential.blocks(rank),
            active_requests: rank_load.active_requests,
            total_kv_blocks: record.spec.total_kv_blocks,
            max_num_batched_tokens: record.spec.max_num_batched_tokens,
            speeds: self.speeds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Tier;
    use crate::hash::{BASE_SEED, PromptHashes};
    use crate::selector::tests::stored_event;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    const BS: u32 = 4;

    fn partition() -> PartitionKey {
        PartitionKey::new("m", "g")
    }

    fn prompt_of(rng: &mut SmallRng, bases: &[Vec<u32>]) -> Vec<u32> {
        let base = &bases[rng.random_range(0..bases.len())];
        let keep = rng.random_range(1..=base.len());
        let mut prompt = base[..keep].to_vec();
        let tail = rng.random_range(0..9);
        prompt.extend((0..tail).map(|_| rng.random_range(1..50_000)));
        prompt
    }

    fn request<'a>(
        p: &'a PartitionKey,
        tokens: &'a [u32],
        allowed: Option<&'a [WorkerId]>,
    ) -> SelectRequest<'a> {
        let mut req = SelectRequest::new(
            p,
            Prompt::Tokens {
                tokens,
                lora_name: None,
                cache_salt: None,
                extras: crate::hash::BlockExtras::default(),
            },
        );
        req.allowed_worker_ids = allowed;
        req
    }

    /// A random fleet: workers with 1–3 ranks and mixed specs, registered out of order, some
    /// incomplete, prefixes stored on random ranks and tiers, live bookings, deletions. With
    /// `shared`, first every rank of every worker (but, sometimes, one) stores the first two
    /// blocks of `bases[0]` on the device: a fleet-wide system prompt, whose holders the index
    /// answers as a floor.
    fn random_fleet_sharing(
        rng: &mut SmallRng,
        bases: &[Vec<u32>],
        now: Instant,
        shared: bool,
    ) -> Selector {
        let profile = RouterProfile::ALL[rng.random_range(0..2)];
        let mut config = SelectorConfig::for_profile(profile);
        if rng.random_bool(0.3) {
            config.scheduler.busy_prefill_tokens = Some(rng.random_range(1..200));
        }
        let mut s = Selector::new(config);
        let workers = rng.random_range(1..40u64);
        for _ in 0..workers {
            let worker_id = rng.random_range(1..200);
            let spec = WorkerSpec {
                worker_id,
                model_name: "m".into(),
                routing_group: "g".into(),
                endpoint: Some(format!("http://w{worker_id}")),
                // One worker in ten lacks a block size: incomplete, not a candidate.
                block_size: (!rng.random_bool(0.1)).then_some(BS),
                data_parallel_size: Some(rng.random_range(1..4)),
                total_kv_blocks: rng.random_bool(0.5).then(|| rng.random_range(8..64)),
                max_num_batched_tokens: rng.random_bool(0.5).then(|| rng.random_range(8..512)),
                ..WorkerSpec::default()
            };
            s.upsert_worker(spec).expect("valid spec");
        }
        let ids: Vec<WorkerId> = s.workers.keys().copied().collect();
        if shared {
            let hashes =
                PromptHashes::from_tokens(&bases[0][..2 * BS as usize], BS as usize, BASE_SEED);
            let skip = rng
                .random_bool(0.3)
                .then(|| ids[rng.random_range(0..ids.len())]);
            for &worker_id in ids.iter().filter(|&&w| Some(w) != skip) {
                for dp_rank in 0..s.workers[&worker_id].spec.dp_size() {
                    s.apply_events(worker_id, dp_rank, &[stored_event(&hashes, Tier::Device)]);
                }
            }
        }
        for _ in 0..rng.random_range(0..12) {
            let worker_id = ids[rng.random_range(0..ids.len())];
            let dp_size = s.workers[&worker_id].spec.dp_size();
            let prompt = prompt_of(rng, bases);
            let hashes = PromptHashes::from_tokens(&prompt, BS as usize, BASE_SEED);
            let tier = [Tier::Device, Tier::Host, Tier::Disk][rng.random_range(0..3)];
            let event = stored_event(&hashes, tier);
            s.apply_events(worker_id, rng.random_range(0..dp_size), &[event]);
        }
        let p = partition();
        for i in 0..rng.random_range(0..20) {
            let prompt = prompt_of(rng, bases);
            let id = format!("b{i}");
            // Busy fleets refuse some: what is booked is what counts.
            let _ = s.select_and_reserve(&request(&p, &prompt, None), Some(&id), now, rng);
        }
        if rng.random_bool(0.3) {
            s.delete_worker(ids[rng.random_range(0..ids.len())])
                .expect("registered");
        }
        s
    }

    /// The fleet-size path picks what the full scan picks, from the same random source, on
    /// random fleets: a request allowed every worker takes the scan with the same candidates.
    #[test]
    fn picks_the_full_scans_rank_on_random_fleets() {
        picks_the_full_scans_rank(false);
    }

    /// The same where every rank holds a shared prefix, so the walk answers with a floor, which
    /// stands for its members when every rank not scored is one (and is listed when not).
    #[test]
    fn picks_the_full_scans_rank_on_fleets_sharing_a_system_prompt() {
        picks_the_full_scans_rank(true);
    }

    fn picks_the_full_scans_rank(shared: bool) {
        let now = Instant::now();
        let mut fast_path_served = 0;
        let mut floors_met = 0;
        for seed in 0..300 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let bases: Vec<Vec<u32>> = (0..4)
                .map(|b| (0..40).map(|t| 1 + b * 1000 + t).collect())
                .collect();
            let s = random_fleet_sharing(&mut rng, &bases, now, shared);
            let all: Vec<WorkerId> = s.workers.keys().copied().collect();
            let p = partition();
            for _ in 0..10 {
                let prompt = prompt_of(&mut rng, &bases);
                let draw: u64 = rng.random();
                let fast = s.select(
                    &request(&p, &prompt, None),
                    now,
                    &mut SmallRng::seed_from_u64(draw),
                );
                let scan = s.select(
                    &request(&p, &prompt, Some(&all)),
                    now,
                    &mut SmallRng::seed_from_u64(draw),
                );
                assert_eq!(
                    format!("{fast:?}"),
                    format!("{scan:?}"),
                    "seed {seed}, prompt {prompt:?}"
                );
            }
            if let Some(order) = locked(&s.rank_orders).by_partition.get(&p) {
                fast_path_served += 1;
                if locked(&order.floor_positions).is_some() {
                    floors_met += 1;
                }
            }
        }
        assert!(fast_path_served > 250, "{fast_path_served} fleets");
        if shared {
            assert!(floors_met > 100, "{floors_met} fleets met a floor");
        }
    }

    /// Ties among idle ranks are drawn uniformly: every rank of an idle fleet gets picked.
    #[test]
    fn an_idle_fleet_spreads_over_every_rank() {
        let mut s = Selector::default();
        for worker_id in [5, 1, 9] {
            s.upsert_worker(WorkerSpec {
                worker_id,
                model_name: "m".into(),
                routing_group: "g".into(),
                endpoint: Some(format!("http://w{worker_id}")),
                block_size: Some(BS),
                data_parallel_size: Some(2),
                ..WorkerSpec::default()
            })
            .expect("valid spec");
        }
        let p = partition();
        let prompt: Vec<u32> = (1..=9).collect();
        let mut rng = SmallRng::seed_from_u64(7);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let sel = s
                .select(&request(&p, &prompt, None), Instant::now(), &mut rng)
                .expect("selects");
            seen.insert((sel.worker_id, sel.dp_rank));
        }
        assert_eq!(seen.len(), 6, "{seen:?}");
    }

    #[test]
    fn kth_tie_counts_idle_gaps_and_explicit_ties() {
        let scored = |position, cost| Scored {
            position,
            candidate: Candidate {
                rank: Rank::new(1, 0),
                device_blocks: 0,
                host_blocks: 0,
                disk_blocks: 0,
                active_prefill_tokens: 0,
                active_decode_blocks: 0,
                potential_decode_blocks: 0,
                active_requests: 0,
                total_kv_blocks: None,
                max_num_batched_tokens: None,
                speeds: crate::speed::EngineSpeeds::default(),
            },
            cost,
        };
        // Positions 0..6: 1 and 4 explicit (1 ties, 4 does not), the rest idle.
        let explicit = [scored(1, Some(2.0)), scored(4, Some(3.0))];
        let ties: Vec<usize> = (0..5).map(|k| kth_tie(&explicit, 2.0, true, k)).collect();
        assert_eq!(ties, [0, 1, 2, 3, 5]);
        // Idle ranks not tied: only the explicit tie.
        assert_eq!(kth_tie(&explicit, 2.0, false, 0), 1);
    }
}
