//! The events of a Responses API stream, as far as the lifecycle reads them: which ones carry
//! generated text and which one ends the response.

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use std::fmt;

/// What a Responses event's `type` means for the lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Event {
    /// Generated text, reasoning or tool-call arguments.
    Delta,
    /// The response's end: `response.completed`, `response.incomplete`.
    Finished,
    /// `response.failed`: its end too.
    Failed,
    /// A stream's `error` event.
    Error,
    Other,
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Event;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an event type")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Event, E> {
                Ok(match s {
                    "response.output_text.delta"
                    | "response.reasoning_text.delta"
                    | "response.refusal.delta"
                    | "response.function_call_arguments.delta" => Event::Delta,
                    "response.completed" | "response.incomplete" => Event::Finished,
                    "response.failed" => Event::Failed,
                    "error" => Event::Error,
                    _ => Event::Other,
                })
            }
        }
        deserializer.deserialize_str(V)
    }
}

#[derive(Deserialize)]
pub(super) struct ResponseSkeleton {
    #[serde(default)]
    pub usage: Option<ResponseUsage>,
}

#[derive(Deserialize)]
pub(super) struct ResponseUsage {
    #[serde(default)]
    pub output_tokens: Option<u64>,
}
