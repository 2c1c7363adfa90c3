//! `long_docs`: long shared documents whose popularity shifts. 64 documents of 16k–32k tokens
//! (uniform); each request is one document and a question of its own (log-normal, median 200
//! tokens). The document is drawn from a Zipf distribution (s = 1) over a ranking that is
//! reshuffled at the start of each of 4 equal time phases, so yesterday's hot document goes
//! cold. All documents (~1.5M tokens) do not fit one worker's pool (1M tokens), so where each is
//! kept matters, and a miss costs a ~0.5 s prefill. Output: log-normal, median 150 tokens. 1×: 3
//! requests/s.

use super::{MAX_REQUESTS, Shape, ShapeRng, in_arrival_order, request};
use crate::SimError;
use crate::workload::SimRequest;

const DOCUMENTS: usize = 64;
const MIN_DOCUMENT_TOKENS: usize = 16_384;
const MAX_DOCUMENT_TOKENS: usize = 32_768;
const PHASES: usize = 4;
const ZIPF_S: f64 = 1.0;
const REQUESTS: usize = 800;
const RATE_RPS: f64 = 3.0;

const DOCUMENT: u64 = 1;
const QUESTION: u64 = 2;

pub struct LongDocs;

impl Shape for LongDocs {
    fn name(&self) -> &str {
        "long_docs"
    }

    fn description(&self) -> String {
        format!(
            "{DOCUMENTS} documents of 16k-32k tokens, Zipf popularity reshuffled over {PHASES} \
             phases, {RATE_RPS} req/s at 1x"
        )
    }

    fn generate(&self, seed: u64, block_size: u32) -> Result<Vec<SimRequest>, SimError> {
        let mut rng = ShapeRng::new(self.name(), seed);
        let document_tokens: Vec<usize> = (0..DOCUMENTS)
            .map(|_| rng.between(MIN_DOCUMENT_TOKENS, MAX_DOCUMENT_TOKENS))
            .collect();
        let mut ranking: Vec<usize> = (0..DOCUMENTS).collect();
        let per_phase = REQUESTS.div_ceil(PHASES);
        let mut at = 0.0;
        let mut requests = Vec::with_capacity(REQUESTS);
        for i in 0..REQUESTS {
            if i % per_phase == 0 {
                rng.shuffle(&mut ranking);
            }
            if i > 0 {
                at += rng.exponential(1.0 / RATE_RPS);
            }
            let document = ranking[rng.zipf(DOCUMENTS, ZIPF_S)];
            let mut tokens = Vec::new();
            rng.push_segment(
                &mut tokens,
                DOCUMENT,
                document as u64,
                document_tokens[document],
            );
            let question = rng.lognormal(200.0, 0.8, 16, 2_048);
            rng.push_segment(&mut tokens, QUESTION, i as u64, question);
            let output = rng.lognormal(150.0, 0.8, 16, 1_024);
            requests.push(request(at, &tokens, output, None, block_size));
        }
        Ok(in_arrival_order(requests, MAX_REQUESTS))
    }
}
