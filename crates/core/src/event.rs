//! The internal KV event model: what an engine told us about its cache, reduced to what the index
//! needs (SPEC §3.2). The wire crate turns vLLM/SGLang msgpack batches into these values.
//!
//! Engine block hashes are **opaque** ids: the index navigates by the local hash kvroute computes
//! from the event's tokens, and uses the engine hash only to find the block again when the engine
//! removes it or names it as a parent.

/// A worker, unique service-wide.
pub type WorkerId = u64;

/// One data-parallel rank of a worker: the unit every score and load is kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rank {
    pub worker_id: WorkerId,
    pub dp_rank: u32,
}

impl Rank {
    pub fn new(worker_id: WorkerId, dp_rank: u32) -> Self {
        Self { worker_id, dp_rank }
    }
}

/// Where a cached block lives. `external` storage counts as [`Tier::Disk`] (SPEC §3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Tier {
    /// GPU memory.
    #[default]
    Device,
    /// CPU memory.
    Host,
    /// Disk or external / remote storage.
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// Index 0..3 of this tier, device first.
    pub fn index(self) -> usize {
        match self {
            Tier::Device => 0,
            Tier::Host => 1,
            Tier::Disk => 2,
        }
    }

    /// Maps an engine's `medium` string to a tier; `None` (absent) is the device. Unknown media
    /// return `None` so the caller can count them.
    pub fn from_medium(medium: Option<&str>) -> Option<Tier> {
        let Some(medium) = medium else {
            return Some(Tier::Device);
        };
        match medium.to_ascii_uppercase().as_str() {
            "GPU" | "DEVICE" | "CUDA" => Some(Tier::Device),
            "CPU" | "CPU_PINNED" | "CPU_TIER1" | "HOST" => Some(Tier::Host),
            "CPU_TIER2" | "DISK" | "NVME" | "EXTERNAL" | "NETWORK" | "REMOTE" | "SHARED" => {
                Some(Tier::Disk)
            }
            _ => None,
        }
    }
}

/// One block of a `Stored` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's own id for the block (opaque).
    pub engine_hash: u64,
    /// kvroute's local hash of the block's tokens (SPEC §2).
    pub local_hash: u64,
}

/// A KV cache event for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// New blocks extending the chain under `parent` (an engine hash), or starting a prompt when
    /// `parent` is `None`.
    Stored {
        parent: Option<u64>,
        blocks: Vec<StoredBlock>,
        tier: Tier,
    },
    /// Blocks (engine hashes) that left the given tier.
    Removed { engine_hashes: Vec<u64>, tier: Tier },
    /// Every block of the rank is gone.
    Cleared,
}

impl KvEvent {
    /// Blocks the event names: stored or removed ones (none for `Cleared`).
    pub fn blocks(&self) -> usize {
        match self {
            KvEvent::Stored { blocks, .. } => blocks.len(),
            KvEvent::Removed { engine_hashes, .. } => engine_hashes.len(),
            KvEvent::Cleared => 0,
        }
    }
}
