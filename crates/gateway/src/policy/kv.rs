//! `--gateway-policy kvroute` (the default): the selector's own choice, by cache and load.
//!
//! 1. The prompt is tokenized (`crate::tokenize`) so that the selector hashes its blocks as
//!    the engine will publish them.
//! 2. Among the model's schedulable workers the request may go to, the selector walks its
//!    index once for each worker's cached prefix (the overlap), and costs each by the prompt
//!    tokens it would still prefill and its booked load, weighted by `--router-profile`.
//! 3. The cheapest is booked under the selector's lock, as `POST /select_and_reserve` does.
//!
//! So this policy pins nothing: it asks for the tokens and leaves the choice to the selector.

/// The selector's choice.
#[derive(Debug, Default)]
pub struct CacheAware;

impl CacheAware {
    /// The prompt's tokens matter: they are the cache overlap's input.
    pub fn reads_prompt(&self) -> bool {
        true
    }

    /// No worker is pinned: the selector scores them all.
    pub fn pin(&self) -> Option<u64> {
        None
    }
}
