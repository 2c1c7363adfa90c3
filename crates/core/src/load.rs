//! Per-rank load tracking (SPEC §5): the load kvroute has sent to each rank and not yet seen
//! finish, kept under the reservation ids of the bookings that carry it.
//!
//! One [`LoadTracker`] serves the whole service (reservation ids are unique service-wide). For each
//! rank it reports [`RankLoad`]: active prefill tokens, active decode blocks and active requests.
//!
//! # Block accounting
//! A booking's prompt holds `ceil(isl_tokens / block_size)` blocks (SPEC §7.7). Its full blocks
//! (`sequence_hashes`) are reference counted per rank, so a block shared by several live bookings
//! on one rank counts once (and a hash repeated inside one prompt also counts once). Every other
//! block of the booking is *private*: the trailing partial block, and the output blocks reported by
//! [`LoadTracker::output_block`]. Each booking keeps one signed `private` adjustment, so that its
//! own contribution (its decode blocks if it were alone on the rank) is
//! `full blocks + private`:
//! - at booking, `private` = prompt blocks − full blocks (1 for a partial block, else 0);
//! - an output block without a decay fraction adds 1;
//! - an output block with decay fraction `f` sets the contribution to
//!   `round(f × (prompt blocks + output blocks so far))` (half rounds up), i.e. `private` becomes
//!   that target − full blocks, which is negative when the target is below the full blocks.
//!
//! A rank's decode blocks are `|distinct live full-block hashes| + Σ private`, reported clamped at
//! 0 (a decay can ask for fewer blocks than a shared prefix still holds).
//!
//! # Invariants
//! - A rank has state iff it has at least one live booking.
//! - `holders[h]` lists, sorted by slot, exactly the rank slots whose live bookings'
//!   `sequence_hashes` contain `h`, each with the number of occurrences (≥ 1); a rank's
//!   `distinct_blocks` is the number of lists naming its slot. One lookup books or frees a block,
//!   and this inverted index lets [`LoadTracker::potential_decode`] answer for every rank in one
//!   pass over the prompt.
//! - A rank's `private_blocks`, `prefill_tokens` and `requests` are the sums over its live bookings
//!   of their `private`, active prefill tokens and 1.
//! - The idle index, ordered by `(last_touched, serial)`, holds exactly one element per live
//!   booking (no tombstones). `serial` is unique per booking, so equal instants do not collide.
//! - An error leaves the tracker unchanged; arguments are validated before anything is mutated.
//!
//! # Complexity
//! `P` = blocks in a prompt, `n` = live bookings, `R` = ranks with bookings. Hash maps are O(1)
//! expected.
//! - `book` and `free`: O(P + log n) while few ranks share a block; a block held by `h` ranks
//!   costs O(log h) to find the rank in its sorted holder list (O(1) when the rank sits where it
//!   sat in the previous block's list) and O(h) to insert or remove it.
//! - `prefill_complete` and `output_block`: O(log n) (re-keying the idle index).
//! - `expire`: O((k + 1) log n + freed blocks) for `k` expired bookings; it never scans live ones.
//! - `free_rank` / `free_worker`: O(n) scan plus the frees (worker deletion is rare).
//! - `rank_load`, `bookings_of`: O(1). `ranks`: O(R).
//! - [`LoadTracker::potential_decode_blocks`] (one rank): O(P): it must see every prompt hash to be
//!   exact. To score many ranks use [`LoadTracker::potential_decode`]: one pass over the prompt,
//!   O(P + Σ over the prompt's distinct hashes of the ranks holding them) (the true size of the
//!   overlap, typically a shared prefix on a few ranks), then O(1) per rank.
//!
//! Memory: per live booking one map slot, one idle-index node and its shared `Arc` of hashes; per
//! distinct hash one `holders` slot with two holders inline, beyond that 8 bytes per (rank, hash)
//! pair.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::hash_map::Entry;
use hashbrown::{HashMap, HashSet};
use smallvec::SmallVec;

use crate::event::{Rank, WorkerId};
use crate::speed::{Calibration, EngineSpeeds};

/// Failures of the load tracker. `Display` renders the client-facing messages of SPEC §7.4.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoadError {
    /// A live booking already uses this reservation id (409).
    #[error("Request {reservation_id} already exists (assigned to worker {worker_id})")]
    Duplicate {
        reservation_id: String,
        worker_id: WorkerId,
    },
    /// No live booking has this reservation id (404).
    #[error("reservation {reservation_id} not found")]
    NotFound { reservation_id: String },
    /// `decay_fraction` outside `[0, 1]`, or NaN (400).
    #[error("decay_fraction must be between 0.0 and 1.0")]
    BadDecayFraction { decay_fraction: f64 },
    /// A booking with `block_size` 0 (the edge validates this first; the tracker refuses it too
    /// rather than divide by zero).
    #[error("block_size must be greater than 0")]
    ZeroBlockSize,
}

/// The inputs of one booking (SPEC §5 `book`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booking {
    pub reservation_id: String,
    pub rank: Rank,
    pub block_size: u32,
    /// Sequence hashes of the prompt's full blocks.
    pub sequence_hashes: Arc<[u64]>,
    pub isl_tokens: u64,
    pub effective_prefill_tokens: u64,
    pub expected_output_tokens: Option<u64>,
    /// Whether `effective_prefill_tokens` count as prefill load until `prefill_complete`.
    pub track_prefill_tokens: bool,
}

/// What a successful [`LoadTracker::book`] added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookOutcome {
    /// `ceil(isl_tokens / block_size)` (or the number of full hashes, if larger).
    pub prompt_blocks: u64,
    /// Full blocks the rank already counted (shared with its other live bookings).
    pub shared_blocks: u64,
    /// Prefill tokens added to the rank's load (0 when prefill is not tracked).
    pub prefill_tokens: u64,
}

/// A live booking as the tracker holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct BookingView {
    pub rank: Rank,
    pub block_size: u32,
    pub sequence_hashes: Arc<[u64]>,
    pub isl_tokens: u64,
    /// `max(ceil(isl_tokens / block_size), sequence_hashes.len())`.
    pub prompt_blocks: u64,
    pub effective_prefill_tokens: u64,
    pub expected_output_tokens: Option<u64>,
    pub track_prefill_tokens: bool,
    pub prefill_complete: bool,
    /// Prefill tokens this booking currently adds to its rank (0 once prefill completed).
    pub active_prefill_tokens: u64,
    /// Output blocks reported so far.
    pub output_blocks: u64,
    /// This booking's own decode contribution: its decode blocks were it alone on the rank.
    pub decode_blocks: u64,
    pub booked_at: Instant,
    /// The rank's active prefill tokens just before this booking: the prefill queued ahead of
    /// it (what its select → `prefill_complete` interval waited for; `crate::speed`).
    pub prefill_tokens_ahead: u64,
    /// The `now` of the last lifecycle call (or of the booking); expiry counts from here.
    pub last_touched: Instant,
}

/// A booking removed by `free`, `expire`, `free_rank` or `free_worker`.
#[derive(Debug, Clone, PartialEq)]
pub struct FreedBooking {
    pub reservation_id: Arc<str>,
    pub booking: BookingView,
}

/// The active load of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankLoad {
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u64,
}

/// Per-rank load of every live booking, keyed by reservation id. See the module docs.
#[derive(Debug, Default)]
pub struct LoadTracker {
    bookings: HashMap<Arc<str>, BookingState>,
    /// `(last_touched, serial)` of every live booking, oldest first.
    idle_order: BTreeMap<(Instant, u64), Arc<str>>,
    next_serial: u64,
    ranks: RankTable,
    /// Engine speeds learned from the lifecycle calls (`crate::speed`).
    calibration: Calibration,
    prior: EngineSpeeds,
}

#[derive(Debug)]
struct BookingState {
    view: BookingView,
    /// Contribution − full blocks (see the module docs); may be negative after a decay.
    private_blocks: i128,
    serial: u64,
}

impl LoadTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Books `booking` on its rank. Refuses a live duplicate id (naming the worker that holds it)
    /// and a zero block size; either way nothing changes.
    pub fn book(&mut self, booking: Booking, now: Instant) -> Result<BookOutcome, LoadError> {
        if booking.block_size == 0 {
            return Err(LoadError::ZeroBlockSize);
        }
        if let Some(existing) = self.bookings.get(booking.reservation_id.as_str()) {
            return Err(LoadError::Duplicate {
                reservation_id: booking.reservation_id,
                worker_id: existing.view.rank.worker_id,
            });
        }
        let full_blocks = booking.sequence_hashes.len() as u64;
        let prompt_blocks = booking
            .isl_tokens
            .div_ceil(u64::from(booking.block_size))
            .max(full_blocks);
        let private_blocks = i128::from(prompt_blocks - full_blocks);
        let prefill_tokens = if booking.track_prefill_tokens {
            booking.effective_prefill_tokens
        } else {
            0
        };

        let slot = self.ranks.slot_or_insert(booking.rank);
        let prefill_tokens_ahead = self
            .ranks
            .state_mut(slot)
            .map_or(0, |r| u64::try_from(r.prefill_tokens).unwrap_or(u64::MAX));
        self.ranks.reserve_blocks(booking.sequence_hashes.len());
        let mut shared_blocks = 0;
        let mut hint = 0;
        for &hash in booking.sequence_hashes.iter() {
            if self.ranks.add_block(slot, hash, &mut hint) {
                shared_blocks += 1;
            }
        }
        if let Some(rank) = self.ranks.state_mut(slot) {
            rank.private_blocks += private_blocks;
            rank.prefill_tokens += u128::from(prefill_tokens);
            rank.requests += 1;
        }

        let serial = self.next_serial;
        self.next_serial += 1;
        let id: Arc<str> = Arc::from(booking.reservation_id);
        self.idle_order.insert((now, serial), Arc::clone(&id));
        let view = BookingView {
            rank: booking.rank,
            block_size: booking.block_size,
            sequence_hashes: booking.sequence_hashes,
            isl_tokens: booking.isl_tokens,
            prompt_blocks,
            effective_prefill_tokens: booking.effective_prefill_tokens,
            expected_output_tokens: booking.expected_output_tokens,
            track_prefill_tokens: booking.track_prefill_tokens,
            prefill_complete: false,
            active_prefill_tokens: prefill_tokens,
            output_blocks: 0,
            decode_blocks: prompt_blocks,
            booked_at: now,
            prefill_tokens_ahead,
            last_touched: now,
        };
        self.bookings.insert(
            id,
            BookingState {
                view,
                private_blocks,
                serial,
            },
        );
        Ok(BookOutcome {
            prompt_blocks,
            shared_blocks,
            prefill_tokens,
        })
    }

    /// The booking's prefill has finished: its prefill tokens leave the rank's load. Idempotent.
    pub fn prefill_complete(
        &mut self,
        reservation_id: &str,
        now: Instant,
    ) -> Result<(), LoadError> {
        let Some((id, state)) = self.bookings.get_key_value_mut(reservation_id) else {
            return Err(not_found(reservation_id));
        };
        touch(&mut self.idle_order, id, state, now);
        if !state.view.prefill_complete {
            if state.view.track_prefill_tokens {
                self.calibration.observe_prefill(
                    state.view.prefill_tokens_ahead,
                    state.view.effective_prefill_tokens,
                    now.saturating_duration_since(state.view.booked_at),
                    &self.prior,
                );
            }
            state.view.prefill_complete = true;
            let released = std::mem::take(&mut state.view.active_prefill_tokens);
            if let Some(rank) = self.ranks.get_mut(state.view.rank) {
                rank.prefill_tokens = rank.prefill_tokens.saturating_sub(u128::from(released));
            }
        }
        Ok(())
    }

    /// The booking produced one more output block (SPEC §5). Without `decay_fraction` its decode
    /// contribution grows by 1; with `f ∈ [0, 1]` it becomes `round(f × (prompt blocks + output
    /// blocks so far))`, half rounding up. A fraction outside `[0, 1]` (or NaN) is refused before
    /// anything changes, also before the id is looked up.
    pub fn output_block(
        &mut self,
        reservation_id: &str,
        decay_fraction: Option<f64>,
        now: Instant,
    ) -> Result<(), LoadError> {
        if let Some(f) = decay_fraction
            && !(0.0..=1.0).contains(&f)
        {
            return Err(LoadError::BadDecayFraction { decay_fraction: f });
        }
        let Some((id, state)) = self.bookings.get_key_value_mut(reservation_id) else {
            return Err(not_found(reservation_id));
        };
        if state.view.output_blocks > 0 {
            // The previous call was this booking's previous output block: one block of steps.
            let rank = self.ranks.get(state.view.rank).map(RankState::load);
            if let Some(load) = rank {
                self.calibration.observe_decode_block(
                    load.active_requests,
                    load.active_decode_blocks
                        .saturating_mul(u64::from(state.view.block_size)),
                    state.view.block_size,
                    now.saturating_duration_since(state.view.last_touched),
                    &self.prior,
                );
            }
        }
        touch(&mut self.idle_order, id, state, now);
        let view = &mut state.view;
        view.output_blocks = view.output_blocks.saturating_add(1);
        let full_blocks = i128::from(view.sequence_hashes.len() as u64);
        let new_private = match decay_fraction {
            None => state.private_blocks + 1,
            Some(f) => {
                let blocks = view.prompt_blocks.saturating_add(view.output_blocks);
                // f64 `round` is half away from zero, i.e. half up for these non-negative values.
                let target = (f * blocks as f64).round() as u64;
                i128::from(target) - full_blocks
            }
        };
        if let Some(rank) = self.ranks.get_mut(view.rank) {
            rank.private_blocks += new_private - state.private_blocks;
        }
        state.private_blocks = new_private;
        view.decode_blocks = clamp_blocks(full_blocks + new_private);
        Ok(())
    }

    /// Sets the booking's output blocks and its own decode contribution (`decode_blocks`, as
    /// [`BookingView::decode_blocks`] reports it) to a state another tracker reached — replica
    /// sync replays states, not calls. Returns whether anything changed; when nothing does, the
    /// booking is not touched either (re-applying a state is a no-op).
    pub fn set_output_state(
        &mut self,
        reservation_id: &str,
        output_blocks: u64,
        decode_blocks: u64,
        now: Instant,
    ) -> Result<bool, LoadError> {
        let Some((id, state)) = self.bookings.get_key_value_mut(reservation_id) else {
            return Err(not_found(reservation_id));
        };
        let full_blocks = i128::from(state.view.sequence_hashes.len() as u64);
        let new_private = i128::from(decode_blocks) - full_blocks;
        if state.view.output_blocks == output_blocks && state.private_blocks == new_private {
            return Ok(false);
        }
        touch(&mut self.idle_order, id, state, now);
        if let Some(rank) = self.ranks.get_mut(state.view.rank) {
            rank.private_blocks += new_private - state.private_blocks;
        }
        state.private_blocks = new_private;
        state.view.output_blocks = output_blocks;
        state.view.decode_blocks = clamp_blocks(full_blocks + new_private);
        Ok(true)
    }

    /// Every live booking, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &BookingView)> + '_ {
        self.bookings.iter().map(|(id, state)| (id, &state.view))
    }

    /// Removes everything the booking holds (implies prefill complete). A second free of the same
    /// id is [`LoadError::NotFound`].
    pub fn free(&mut self, reservation_id: &str) -> Result<FreedBooking, LoadError> {
        let freed = self
            .remove(reservation_id)
            .ok_or_else(|| not_found(reservation_id))?;
        let view = &freed.booking;
        if view.output_blocks > 0 {
            // Reported blocks, plus half a block for the partial one never reported.
            let tokens = view
                .output_blocks
                .saturating_mul(u64::from(view.block_size))
                .saturating_add(u64::from(view.block_size) / 2);
            self.calibration.observe_output(tokens, &self.prior);
        }
        Ok(freed)
    }

    /// Sets the engine prior the calibration starts from (`crate::speed`).
    pub fn set_engine_prior(&mut self, prior: EngineSpeeds) {
        self.prior = prior;
    }

    /// The engine speeds now: the prior corrected by what the lifecycle calls measured.
    pub fn speeds(&self, expected_output_tokens: Option<u64>) -> EngineSpeeds {
        self.calibration.speeds(expected_output_tokens, &self.prior)
    }

    /// What the speeds were learned from.
    pub fn calibration(&self) -> &Calibration {
        &self.calibration
    }

    /// Frees every booking with no lifecycle call for at least `max_idle` before `now` (a
    /// `last_touched` later than `now` counts as idle for zero time), oldest first.
    pub fn expire(&mut self, now: Instant, max_idle: Duration) -> Vec<FreedBooking> {
        let mut freed = Vec::new();
        while let Some((&(last_touched, _), id)) = self.idle_order.first_key_value() {
            if now.saturating_duration_since(last_touched) < max_idle {
                break;
            }
            let id = Arc::clone(id);
            match self.remove(&id) {
                Some(booking) => freed.push(booking),
                // Unreachable while the idle index mirrors the bookings; drop the stray entry so
                // the loop still terminates.
                None => {
                    self.idle_order.pop_first();
                }
            }
        }
        freed
    }

    /// Frees every booking on `rank` (the rank went away); their ids may be booked again.
    /// O(n) in live bookings.
    pub fn free_rank(&mut self, rank: Rank) -> Vec<FreedBooking> {
        if self.bookings_of(rank) == 0 {
            return Vec::new();
        }
        self.remove_where(|view| view.rank == rank)
    }

    /// Frees every booking on any rank of `worker_id` (the worker was deleted); their ids may be
    /// booked again. O(n) in live bookings.
    pub fn free_worker(&mut self, worker_id: WorkerId) -> Vec<FreedBooking> {
        self.remove_where(|view| view.rank.worker_id == worker_id)
    }

    /// The rank's active load; zeros for a rank with no bookings.
    pub fn rank_load(&self, rank: Rank) -> RankLoad {
        self.ranks
            .get(rank)
            .map(RankState::load)
            .unwrap_or_default()
    }

    /// The rank's decode blocks if a prompt with these full-block `sequence_hashes` and
    /// `isl_tokens` were booked there now: its unique active blocks plus the prompt's full blocks
    /// it does not hold yet plus the prompt's private (partial) block. Equals
    /// `rank_load(rank).active_decode_blocks` right after such a `book`. A `block_size` of 0 counts
    /// no partial block.
    ///
    /// O(P) for one rank. To score many ranks for one prompt, use [`Self::potential_decode`].
    pub fn potential_decode_blocks(
        &self,
        rank: Rank,
        sequence_hashes: &[u64],
        isl_tokens: u64,
        block_size: u32,
    ) -> u64 {
        let slot = self.ranks.slot_of.get(&rank).copied();
        let state = slot.and_then(|slot| self.ranks.slots.get(slot)?.as_ref());
        let mut seen = HashSet::with_capacity(sequence_hashes.len());
        let mut new_blocks: u64 = 0;
        for &hash in sequence_hashes {
            if seen.insert(hash) && !slot.is_some_and(|slot| self.ranks.holds(slot, hash)) {
                new_blocks += 1;
            }
        }
        let raw = state.map_or(0, RankState::raw_decode_blocks);
        clamp_blocks(
            raw + i128::from(new_blocks)
                + i128::from(private_prompt_blocks(
                    sequence_hashes,
                    isl_tokens,
                    block_size,
                )),
        )
    }

    /// Prepares the potential decode blocks of one prompt on every rank at once: one pass over
    /// the prompt's distinct hashes and the ranks holding each (O(P + overlap)); then
    /// [`PotentialDecode::blocks`] answers each rank in O(1), with the same value as
    /// [`Self::potential_decode_blocks`].
    pub fn potential_decode(
        &self,
        sequence_hashes: &[u64],
        isl_tokens: u64,
        block_size: u32,
    ) -> PotentialDecode<'_> {
        let mut held_by_slot = vec![0u64; self.ranks.slots.len()];
        let mut distinct_full_blocks: u64 = 0;
        let mut seen = HashSet::with_capacity(sequence_hashes.len());
        // Consecutive blocks of a shared prefix are usually held by the same ranks in the same
        // order: count such a run once per rank instead of once per block and rank.
        let mut run: Option<(&[Holder], u64)> = None;
        for &hash in sequence_hashes {
            if !seen.insert(hash) {
                continue;
            }
            distinct_full_blocks += 1;
            let Some(holders) = self.ranks.holders.get(&hash) else {
                continue;
            };
            match &mut run {
                Some((previous, length)) if same_slots(previous, holders) => *length += 1,
                _ => {
                    add_run(&mut held_by_slot, run);
                    run = Some((holders.as_slice(), 1));
                }
            }
        }
        add_run(&mut held_by_slot, run);
        PotentialDecode {
            tracker: self,
            held_by_slot,
            distinct_full_blocks,
            private_blocks: private_prompt_blocks(sequence_hashes, isl_tokens, block_size),
        }
    }

    /// The live booking under `reservation_id`.
    pub fn booking(&self, reservation_id: &str) -> Option<&BookingView> {
        self.bookings.get(reservation_id).map(|state| &state.view)
    }

    /// Live bookings on `rank`.
    pub fn bookings_of(&self, rank: Rank) -> u64 {
        self.ranks.get(rank).map_or(0, |state| state.requests)
    }

    /// Every rank with at least one live booking and its load, in no particular order.
    pub fn ranks(&self) -> impl Iterator<Item = (Rank, RankLoad)> + '_ {
        self.ranks
            .slots
            .iter()
            .flatten()
            .map(|state| (state.rank, state.load()))
    }

    /// Live bookings.
    pub fn len(&self) -> usize {
        self.bookings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bookings.is_empty()
    }

    fn remove(&mut self, reservation_id: &str) -> Option<FreedBooking> {
        let (id, state) = self.bookings.remove_entry(reservation_id)?;
        self.idle_order
            .remove(&(state.view.last_touched, state.serial));
        if let Some(&slot) = self.ranks.slot_of.get(&state.view.rank) {
            self.ranks.remove_blocks(slot, &state.view.sequence_hashes);
            if let Some(rank) = self.ranks.state_mut(slot) {
                rank.private_blocks -= state.private_blocks;
                rank.prefill_tokens = rank
                    .prefill_tokens
                    .saturating_sub(u128::from(state.view.active_prefill_tokens));
                rank.requests = rank.requests.saturating_sub(1);
            }
            self.ranks.release_if_unused(slot);
        }
        Some(FreedBooking {
            reservation_id: id,
            booking: state.view,
        })
    }

    fn remove_where(&mut self, matches: impl Fn(&BookingView) -> bool) -> Vec<FreedBooking> {
        let ids: Vec<Arc<str>> = self
            .bookings
            .iter()
            .filter(|(_, state)| matches(&state.view))
            .map(|(id, _)| Arc::clone(id))
            .collect();
        ids.iter().filter_map(|id| self.remove(id)).collect()
    }
}

/// [`LoadTracker::potential_decode`]: one prompt's potential decode blocks on every rank.
#[derive(Debug)]
pub struct PotentialDecode<'a> {
    tracker: &'a LoadTracker,
    /// Per rank slot: how many of the prompt's distinct full blocks the rank already holds.
    held_by_slot: Vec<u64>,
    distinct_full_blocks: u64,
    private_blocks: u64,
}

impl PotentialDecode<'_> {
    /// The rank's decode blocks if the prompt were booked there now. O(1).
    pub fn blocks(&self, rank: Rank) -> u64 {
        let new_private = i128::from(self.private_blocks);
        let Some(&slot) = self.tracker.ranks.slot_of.get(&rank) else {
            return clamp_blocks(i128::from(self.distinct_full_blocks) + new_private);
        };
        let (raw, held) = match self.tracker.ranks.slots.get(slot) {
            Some(Some(state)) => (
                state.raw_decode_blocks(),
                self.held_by_slot.get(slot).copied().unwrap_or(0),
            ),
            _ => (0, 0),
        };
        clamp_blocks(raw + i128::from(self.distinct_full_blocks.saturating_sub(held)) + new_private)
    }
}

/// Credits `length` held blocks to each rank slot of a run.
fn add_run(held_by_slot: &mut [u64], run: Option<(&[Holder], u64)>) {
    if let Some((holders, length)) = run {
        for holder in holders {
            if let Some(count) = held_by_slot.get_mut(holder_slot(*holder) as usize) {
                *count += length;
            }
        }
    }
}

/// Whether two holder lists name the same ranks (whatever their counts).
fn same_slots(a: &[Holder], b: &[Holder]) -> bool {
    // Equal counts too is the usual case (one `memcmp`); otherwise compare the slot halves.
    a == b || (a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x ^ y) >> 32 == 0))
}

fn not_found(reservation_id: &str) -> LoadError {
    LoadError::NotFound {
        reservation_id: reservation_id.to_owned(),
    }
}

/// Moves the booking to `now` in the idle index.
fn touch(
    idle_order: &mut BTreeMap<(Instant, u64), Arc<str>>,
    id: &Arc<str>,
    state: &mut BookingState,
    now: Instant,
) {
    if state.view.last_touched == now {
        return;
    }
    idle_order.remove(&(state.view.last_touched, state.serial));
    idle_order.insert((now, state.serial), Arc::clone(id));
    state.view.last_touched = now;
}

/// Prompt blocks beyond the full ones: the trailing partial block (and any tokens the caller
/// gave no hashes for).
fn private_prompt_blocks(sequence_hashes: &[u64], isl_tokens: u64, block_size: u32) -> u64 {
    if block_size == 0 {
        return 0;
    }
    isl_tokens
        .div_ceil(u64::from(block_size))
        .saturating_sub(sequence_hashes.len() as u64)
}

fn clamp_blocks(blocks: i128) -> u64 {
    u64::try_from(blocks.max(0)).unwrap_or(u64::MAX)
}

/// The load of one rank, summed over its live bookings.
#[derive(Debug)]
struct RankState {
    rank: Rank,
    /// Distinct full-block hashes of the live bookings (the holders entries naming this slot).
    distinct_blocks: u64,
    private_blocks: i128,
    prefill_tokens: u128,
    requests: u64,
}

/// One rank's references to a block in one word: its slot in the high half, in the low half how
/// often the block occurs in the rank's live bookings (≥ 1). Words sort by slot, and two lists
/// with equal words name the same ranks (compared as plain integers, i.e. with `memcmp`). A count
/// cannot overflow: 2^32 occurrences would take a request body of many gigabytes, far beyond any
/// body limit.
type Holder = u64;

fn holder(slot: u32, refcount: u32) -> Holder {
    (u64::from(slot) << 32) | u64::from(refcount)
}

fn holder_slot(holder: Holder) -> u32 {
    (holder >> 32) as u32
}

fn holder_count(holder: Holder) -> u32 {
    holder as u32
}

/// The ranks holding a block, sorted by slot.
type HolderList = SmallVec<[Holder; 2]>;

/// Blocks a free looks up together before removing them (see [`RankTable::remove_blocks`]).
const FREE_CHUNK: usize = 16;

impl RankState {
    fn raw_decode_blocks(&self) -> i128 {
        i128::from(self.distinct_blocks) + self.private_blocks
    }

    fn load(&self) -> RankLoad {
        RankLoad {
            active_prefill_tokens: u64::try_from(self.prefill_tokens).unwrap_or(u64::MAX),
            active_decode_blocks: clamp_blocks(self.raw_decode_blocks()),
            active_requests: self.requests,
        }
    }
}

/// Rank states in a slab (slots are reused once a rank has no bookings), plus one map from block
/// hash to the slots holding it with their reference counts: booking or freeing a block is one
/// lookup, and the same map answers [`LoadTracker::potential_decode`].
#[derive(Debug, Default)]
struct RankTable {
    slots: Vec<Option<RankState>>,
    free_slots: Vec<usize>,
    slot_of: HashMap<Rank, usize>,
    holders: HashMap<u64, HolderList>,
}

/// Where `slot` is (or would go) in a sorted holder list.
fn holder_position(list: &[Holder], slot: u32) -> Result<usize, usize> {
    // Most blocks are held by one or two ranks: a scan beats a binary search there.
    if list.len() <= 8 {
        for (i, holder) in list.iter().enumerate() {
            if holder_slot(*holder) >= slot {
                return if holder_slot(*holder) == slot {
                    Ok(i)
                } else {
                    Err(i)
                };
            }
        }
        return Err(list.len());
    }
    list.binary_search_by_key(&slot, |holder| holder_slot(*holder))
}

/// [`holder_position`], trying `hint` first: consecutive blocks of a prompt are usually held by
/// the same ranks, so the rank's position in one block's list is its position in the next.
fn holder_position_near(list: &[Holder], slot: u32, hint: usize) -> Result<usize, usize> {
    match list.get(hint) {
        Some(&at) if holder_slot(at) == slot => return Ok(hint),
        at if at.is_none_or(|&at| holder_slot(at) > slot)
            && (hint == 0
                || list
                    .get(hint - 1)
                    .is_some_and(|&before| holder_slot(before) < slot)) =>
        {
            return Err(hint);
        }
        _ => {}
    }
    holder_position(list, slot)
}

impl RankTable {
    fn get(&self, rank: Rank) -> Option<&RankState> {
        let slot = *self.slot_of.get(&rank)?;
        self.slots.get(slot)?.as_ref()
    }

    fn get_mut(&mut self, rank: Rank) -> Option<&mut RankState> {
        let slot = *self.slot_of.get(&rank)?;
        self.state_mut(slot)
    }

    fn state_mut(&mut self, slot: usize) -> Option<&mut RankState> {
        self.slots.get_mut(slot)?.as_mut()
    }

    /// Whether the rank in `slot` holds `hash`.
    fn holds(&self, slot: usize, hash: u64) -> bool {
        let (Ok(slot), Some(list)) = (u32::try_from(slot), self.holders.get(&hash)) else {
            return false;
        };
        holder_position(list, slot).is_ok()
    }

    fn slot_or_insert(&mut self, rank: Rank) -> usize {
        if let Some(&slot) = self.slot_of.get(&rank) {
            return slot;
        }
        let state = RankState {
            rank,
            distinct_blocks: 0,
            private_blocks: 0,
            prefill_tokens: 0,
            requests: 0,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) if slot < self.slots.len() => {
                self.slots[slot] = Some(state);
                slot
            }
            _ => {
                self.slots.push(Some(state));
                self.slots.len() - 1
            }
        };
        self.slot_of.insert(rank, slot);
        slot
    }

    /// Makes room for `blocks` more hashes at once.
    fn reserve_blocks(&mut self, blocks: usize) {
        self.holders.reserve(blocks);
    }

    /// Adds one reference to `hash` on the rank; true if the rank already held it. `hint` is the
    /// rank's position in the previous block's list, updated to its position in this one.
    fn add_block(&mut self, slot: usize, hash: u64, hint: &mut usize) -> bool {
        // Slots number live ranks, far below 2^32.
        let Ok(key) = u32::try_from(slot) else {
            return false;
        };
        let list = match self.holders.entry(hash) {
            // A block no live booking holds (the usual case for a prompt's own blocks): its
            // list is written without being read, so the insertion's cache miss does not hold
            // up the next block.
            Entry::Vacant(vacant) => {
                let mut list = HolderList::new();
                list.push(holder(key, 1));
                vacant.insert(list);
                *hint = 0;
                if let Some(Some(state)) = self.slots.get_mut(slot) {
                    state.distinct_blocks += 1;
                }
                return false;
            }
            Entry::Occupied(occupied) => occupied.into_mut(),
        };
        match holder_position_near(list, key, *hint) {
            Ok(i) => {
                *hint = i;
                if holder_count(list[i]) < u32::MAX {
                    list[i] += 1;
                }
                true
            }
            Err(i) => {
                *hint = i;
                list.insert(i, holder(key, 1));
                if let Some(Some(state)) = self.slots.get_mut(slot) {
                    state.distinct_blocks += 1;
                }
                false
            }
        }
    }

    /// Drops one reference to each of `hashes` on the rank, a chunk at a time: the chunk's
    /// blocks are first looked up back to back, so that their cache misses (a booking is often
    /// freed on another core than the one that booked it, and the map outgrows the caches with
    /// many live bookings) overlap instead of each waiting behind the previous removal.
    fn remove_blocks(&mut self, slot: usize, hashes: &[u64]) {
        let mut hint = 0;
        for chunk in hashes.chunks(FREE_CHUNK) {
            let mut warm = 0usize;
            for hash in chunk {
                if let Some(list) = self.holders.get(hash) {
                    warm ^= list.len();
                }
            }
            std::hint::black_box(warm);
            for &hash in chunk {
                self.remove_block(slot, hash, &mut hint);
            }
        }
    }

    /// Drops one reference to `hash` on the rank; the last one unlinks the rank from the block.
    /// `hint` as for [`add_block`](Self::add_block).
    fn remove_block(&mut self, slot: usize, hash: u64, hint: &mut usize) {
        let Ok(key) = u32::try_from(slot) else {
            return;
        };
        let Entry::Occupied(mut entry) = self.holders.entry(hash) else {
            return;
        };
        let list = entry.get_mut();
        let Ok(i) = holder_position_near(list, key, *hint) else {
            return;
        };
        *hint = i;
        // Counts are ≥ 1 (a list drops a rank at 0); never borrow from the slot half.
        if holder_count(list[i]) > 0 {
            list[i] -= 1;
        }
        if holder_count(list[i]) > 0 {
            return;
        }
        list.remove(i);
        if list.is_empty() {
            entry.remove();
        }
        if let Some(Some(state)) = self.slots.get_mut(slot) {
            state.distinct_blocks = state.distinct_blocks.saturating_sub(1);
        }
    }

    /// Drops the rank's state once its last booking is gone, so departed ranks cost nothing.
    fn release_if_unused(&mut self, slot: usize) {
        let Some(Some(state)) = self.slots.get(slot) else {
            return;
        };
        if state.requests > 0 {
            return;
        }
        debug_assert!(state.distinct_blocks == 0 && state.private_blocks == 0);
        if state.distinct_blocks > 0
            && let Ok(key) = u32::try_from(slot)
        {
            // Unreachable while the invariants hold; unlink every leftover block (a full scan)
            // so the holders never name a reused slot.
            self.holders.retain(|_, list| {
                list.retain(|holder| holder_slot(*holder) != key);
                !list.is_empty()
            });
        }
        if let Some(state) = self.slots.get_mut(slot).and_then(Option::take) {
            self.slot_of.remove(&state.rank);
            self.free_slots.push(slot);
        }
    }
}

#[cfg(test)]
mod tests;
