//! The binding's renderer: the service's typed results as the JSON values `convert::to_py` turns
//! into dicts and lists. Each shape is the HTTP body's (`kvroute_service::http::render`), so a
//! Python caller and an HTTP client read the same fields.

use kvroute_core::selector::{
    OverlapScores, PartitionDump, PartitionLoads, RankLoadReport, ReadyState, Reservation,
    Selection, WorkerRecord,
};
use kvroute_service::api::{Booked, DisaggSelected};
use kvroute_service::http::render as http;
use serde_json::Value;

pub fn worker(record: &WorkerRecord) -> Value {
    http::worker(record)
}

pub fn workers(records: &[WorkerRecord]) -> Value {
    http::workers(records)
}

pub fn ready(ready: &ReadyState) -> Value {
    http::ready(ready)
}

pub fn selection(selection: &Selection) -> Value {
    http::selection(selection)
}

pub fn booked(booked: &Booked) -> Value {
    http::booked(booked)
}

pub fn disaggregated(selected: &DisaggSelected) -> Value {
    http::disaggregated(selected)
}

pub fn reservation(reservation: &Reservation) -> Value {
    http::reservation(reservation)
}

pub fn overlap_scores(scores: &OverlapScores) -> Value {
    http::overlap_scores(scores)
}

pub fn potential_loads(loads: &[RankLoadReport]) -> Value {
    http::potential_loads(loads)
}

/// With each degraded worker's reasons on its ranks, as `GET /loads` shows them.
pub fn loads(
    loads: &[PartitionLoads],
    degraded: &std::collections::BTreeMap<u64, Vec<kvroute_service::degraded::Degraded>>,
) -> Value {
    http::loads_with_degraded(loads, degraded)
}

/// The index in `GET /dump`'s shape (`indexer_snapshot`).
pub fn dump(partitions: Vec<PartitionDump>) -> Value {
    http::dump_json(partitions)
}
