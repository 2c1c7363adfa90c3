//! `cache_aware`: SGLang's cache-aware router. Each worker has an approximate prefix tree fed by
//! the router's own decisions (never by the engines). When loads are imbalanced (max − min > 64
//! requests and max > 1.5 × min) the least-loaded worker; else the worker whose tree matches the
//! most of the prompt, if it covers more than 30 % of it; else the worker with the smallest tree.

use super::*;

/// An approximate prefix tree of one worker, over sequence hashes: a node is present iff the
/// router sent a prompt holding that block there and it has not aged out. Parents are touched
/// with their children, so least-recently-used order evicts leaves first.
#[derive(Default)]
pub(super) struct ApproxTree {
    /// Sequence hash → (last access, depth).
    pub(super) nodes: HashMap<u64, (u64, u32)>,
    /// (last access, depth reversed, hash): eviction order, oldest and deepest first.
    pub(super) order: BTreeSet<(u64, std::cmp::Reverse<u32>, u64)>,
}

impl ApproxTree {
    fn matched_blocks(&self, sequence: &[u64]) -> usize {
        sequence
            .iter()
            .take_while(|h| self.nodes.contains_key(*h))
            .count()
    }

    fn insert(&mut self, sequence: &[u64], clock: u64, max_blocks: usize) {
        for (depth, &h) in sequence.iter().enumerate() {
            let depth = depth as u32;
            if let Some((old, d)) = self.nodes.insert(h, (clock, depth)) {
                self.order.remove(&(old, std::cmp::Reverse(d), h));
            }
            self.order.insert((clock, std::cmp::Reverse(depth), h));
        }
        while self.nodes.len() > max_blocks {
            let Some((_, _, h)) = self.order.pop_first() else {
                break;
            };
            self.nodes.remove(&h);
        }
    }
}

pub(super) struct CacheAware {
    pub(super) config: CacheAwareConfig,
    pub(super) trees: Vec<ApproxTree>,
    pub(super) in_flight: Vec<u64>,
    pub(super) owner: HashMap<RequestId, usize>,
    pub(super) clock: u64,
    pub(super) block_size: u64,
}

impl CacheAware {
    pub(super) fn new(workers: usize, engine: &EngineConfig, config: CacheAwareConfig) -> Self {
        Self {
            config,
            trees: (0..workers).map(|_| ApproxTree::default()).collect(),
            in_flight: vec![0; workers],
            owner: HashMap::new(),
            clock: 0,
            block_size: u64::from(engine.block_size),
        }
    }
}

impl Router for CacheAware {
    fn route(
        &mut self,
        id: RequestId,
        prompt: &PromptHashes,
        _session: Option<u64>,
        _now: Instant,
        rng: &mut SmallRng,
    ) -> Result<usize, SimError> {
        let max = self.in_flight.iter().copied().max().unwrap_or(0);
        let min = self.in_flight.iter().copied().min().unwrap_or(0);
        let imbalanced = max - min > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold;
        let worker = if imbalanced {
            argmin_random(&self.in_flight, rng)
        } else {
            let matched: Vec<usize> = self
                .trees
                .iter()
                .map(|t| t.matched_blocks(&prompt.sequence))
                .collect();
            // Best match (ties: fewer in-flight requests, then random).
            let keys: Vec<(std::cmp::Reverse<usize>, u64)> = matched
                .iter()
                .zip(&self.in_flight)
                .map(|(&m, &l)| (std::cmp::Reverse(m), l))
                .collect();
            let best = argmin_random(&keys, rng);
            let ratio =
                (matched[best] as u64 * self.block_size) as f64 / prompt.isl_tokens.max(1) as f64;
            if ratio > self.config.cache_threshold {
                best
            } else {
                let sizes: Vec<usize> = self.trees.iter().map(|t| t.nodes.len()).collect();
                argmin_random(&sizes, rng)
            }
        };
        self.clock += 1;
        self.trees[worker].insert(&prompt.sequence, self.clock, self.config.max_tree_blocks);
        self.in_flight[worker] += 1;
        self.owner.insert(id, worker);
        Ok(worker)
    }

    fn on_finished(&mut self, id: RequestId, _now: Instant) -> Result<(), SimError> {
        if let Some(w) = self.owner.remove(&id) {
            self.in_flight[w] = self.in_flight[w].saturating_sub(1);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn approximate_tree_evicts_least_recent_leaves_first() {
        let mut t = ApproxTree::default();
        t.insert(&[1, 2, 3], 1, 10);
        t.insert(&[1, 4], 2, 10);
        t.insert(&[5], 3, 4);
        // Over 4 nodes: the oldest (clock 1) deepest node, 3, goes first; then 2.
        assert!(!t.nodes.contains_key(&3));
        assert!(t.nodes.contains_key(&2));
        assert_eq!(t.matched_blocks(&[1, 2, 3]), 2);
        t.insert(&[6], 4, 4);
        assert!(!t.nodes.contains_key(&2));
        assert_eq!(t.matched_blocks(&[1, 4]), 2);
    }
}
