//! Several routers of one policy in front of the same engines (`--router-replicas N`), each
//! hearing of the others' bookings `--sync-delay-ms` late, as kvroute replicas do over NATS.
//!
//! One router sees its own bookings at once; the requests are dealt round robin across the
//! replicas (a load balancer in front of them), and every replica reads every engine's KV events.
//! After each change of a booking (booked, first token, new output block, freed) its owner's
//! state of it reaches every other replica `sync_delay` later, through the same calls the
//! service's replica sync makes (`Selector::apply_synced_booking`, `remove_remote_booking`).
//! Blocks predicted on route are not shared, as in the service. This is where herding shows: two
//! replicas that have not yet heard of each other's last picks both send the next request to the
//! rank that looked best.
//!
//! Policies without bookings to share (`round_robin`, `cache_aware`, ...) run as N independent
//! instances: SGLang's router keeps its trees and counters in its own process.
//!
//! Messages are delivered lazily: before a replica routes a request or hears of a lifecycle
//! step at `now`, every message due by `now` is applied. Only `route` reads the state a message
//! changes, so this is the same as delivering each at its due time. The delay is the same for
//! every message, so they stay in the order they were sent.

use crate::policy::{OverlapTotals, Router, RouterDiagnostics};
use crate::{RequestId, SimError};
use hashbrown::HashMap;
use kvroute_core::event::KvEvent;
use kvroute_core::hash::PromptHashes;
use kvroute_core::selector::SyncedBooking;
use rand::rngs::SmallRng;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A booking's state on its way from its owner to the other replicas (`None`: freed).
struct Message {
    due: Instant,
    from: usize,
    id: RequestId,
    state: Option<SyncedBooking>,
}

/// N routers of one policy; see the module documentation.
pub struct Replicated {
    replicas: Vec<Box<dyn Router>>,
    sync_delay: Duration,
    owner: HashMap<RequestId, usize>,
    next: usize,
    in_transit: VecDeque<Message>,
}

impl Replicated {
    /// `replicas` must not be empty.
    pub fn new(replicas: Vec<Box<dyn Router>>, sync_delay: Duration) -> Result<Self, SimError> {
        if replicas.is_empty() {
            return Err(SimError::invalid(
                "router-replicas",
                "must be greater than 0",
            ));
        }
        Ok(Self {
            replicas,
            sync_delay,
            owner: HashMap::new(),
            next: 0,
            in_transit: VecDeque::new(),
        })
    }

    fn deliver_due(&mut self, now: Instant) -> Result<(), SimError> {
        while self.in_transit.front().is_some_and(|m| m.due <= now) {
            let Some(m) = self.in_transit.pop_front() else {
                break;
            };
            for (r, replica) in self.replicas.iter_mut().enumerate() {
                if r != m.from {
                    replica.import_booking(m.from, m.id, m.state.as_ref(), m.due)?;
                }
            }
        }
        Ok(())
    }

    /// Sends the owner's current state of `id` (or its absence) to the other replicas.
    fn publish(&mut self, from: usize, id: RequestId, now: Instant) {
        if self.replicas.len() < 2 {
            return;
        }
        let state = self.replicas[from].export_booking(id);
        if state.is_none() && !self.replicas[from].shares_bookings() {
            return;
        }
        self.in_transit.push_back(Message {
            due: now + self.sync_delay,
            from,
            id,
            state,
        });
    }

    fn owner_of(&self, id: RequestId) -> Result<usize, SimError> {
        self.owner
            .get(&id)
            .copied()
            .ok_or_else(|| SimError::Internal(format!("request {id} was never routed")))
    }

    /// Messages sent and not yet delivered (for tests).
    pub fn in_transit(&self) -> usize {
        self.in_transit.len()
    }
}

impl Router for Replicated {
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        session: Option<u64>,
        now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        self.deliver_due(now)?;
        let r = self.next;
        self.next = (self.next + 1) % self.replicas.len();
        let worker = self.replicas[r].route(id, prompt, session, now, rng)?;
        self.owner.insert(id, r);
        self.publish(r, id, now);
        Ok(worker)
    }

    fn on_kv_events(&mut self, worker: usize, events: &[KvEvent]) {
        for replica in &mut self.replicas {
            replica.on_kv_events(worker, events);
        }
    }

    fn on_first_token(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.deliver_due(now)?;
        let r = self.owner_of(id)?;
        self.replicas[r].on_first_token(id, now)?;
        self.publish(r, id, now);
        Ok(())
    }

    fn on_output_block(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.deliver_due(now)?;
        let r = self.owner_of(id)?;
        self.replicas[r].on_output_block(id, now)?;
        self.publish(r, id, now);
        Ok(())
    }

    fn on_finished(&mut self, id: RequestId, now: Instant) -> Result<(), SimError> {
        self.deliver_due(now)?;
        let r = self.owner_of(id)?;
        self.replicas[r].on_finished(id, now)?;
        self.owner.remove(&id);
        self.publish(r, id, now);
        Ok(())
    }

    fn diagnostics(&self) -> RouterDiagnostics {
        // Every replica applies the same events: report one replica's view, not N copies.
        self.replicas[0].diagnostics()
    }

    fn selector_overlap(&self) -> Option<OverlapTotals> {
        self.replicas.iter().map(|r| r.selector_overlap()).try_fold(
            OverlapTotals::default(),
            |sum, o| {
                o.map(|o| OverlapTotals {
                    chosen_tokens: sum.chosen_tokens + o.chosen_tokens,
                    best_tokens: sum.best_tokens + o.best_tokens,
                })
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineConfig;
    use crate::policy::{Policy, PolicyKind, build_router, dynamo_policy};
    use kvroute_core::hash::BASE_SEED;
    use rand::SeedableRng;

    fn prompt(tokens: std::ops::Range<u32>) -> PromptHashes {
        PromptHashes::from_tokens(&tokens.collect::<Vec<u32>>(), 64, BASE_SEED)
    }

    fn replicated(workers: usize, delay: Duration) -> Replicated {
        let policy = Policy {
            name: "dynamo",
            kind: PolicyKind::Selector(dynamo_policy()),
            unavailable: None,
        };
        let engine = EngineConfig::default();
        let replicas = (0..2)
            .map(|_| build_router(&policy, workers, &engine).unwrap())
            .collect();
        Replicated::new(replicas, delay).unwrap()
    }

    /// Two unrelated prompts of equal size, the second through the other replica 10 ms after the
    /// first: the pair lands on two workers for every seed when the sync delay is 5 ms, and on
    /// one worker for some seed when the second replica has not heard of the first booking yet.
    fn herded_seeds(delay: Duration) -> usize {
        let now = Instant::now();
        (0..32)
            .filter(|&seed| {
                let mut rng = SmallRng::seed_from_u64(seed);
                let mut r = replicated(2, delay);
                let a = r.route(0, &prompt(0..6400), None, now, &mut rng).unwrap();
                let later = now + Duration::from_millis(10);
                let b = r
                    .route(1, &prompt(10_000..16_400), None, later, &mut rng)
                    .unwrap();
                a == b
            })
            .count()
    }

    #[test]
    fn a_replica_sees_the_others_bookings_after_the_sync_delay() {
        assert_eq!(herded_seeds(Duration::from_millis(5)), 0);
        assert!(herded_seeds(Duration::from_secs(3600)) > 0);
    }

    #[test]
    fn lifecycle_steps_and_frees_reach_the_other_replica() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let mut rng = SmallRng::seed_from_u64(1);
        let mut r = replicated(2, ms(5));
        let a = r.route(0, &prompt(0..6400), None, now, &mut rng).unwrap();
        assert_eq!(r.in_transit(), 1, "the booking is on its way");
        r.on_first_token(0, now + ms(1)).unwrap();
        r.on_output_block(0, now + ms(2)).unwrap();
        assert_eq!(r.in_transit(), 3);
        // Replica 1 has heard of all three by now; its export of its own bookings knows none.
        let b = r
            .route(1, &prompt(10_000..16_400), None, now + ms(10), &mut rng)
            .unwrap();
        assert_ne!(a, b);
        assert!(r.replicas[1].export_booking(0).is_none());
        assert!(r.replicas[0].export_booking(0).is_some());
        r.on_finished(0, now + ms(11)).unwrap();
        r.on_finished(1, now + ms(12)).unwrap();
        // The frees are delivered at the next call after they are due; then nothing is left.
        assert!(
            r.on_finished(1, now + ms(30)).is_err(),
            "a second free is refused"
        );
        assert_eq!(r.in_transit(), 0);
        for replica in &r.replicas {
            assert!(replica.export_booking(0).is_none());
            assert!(replica.export_booking(1).is_none());
        }
    }
}
