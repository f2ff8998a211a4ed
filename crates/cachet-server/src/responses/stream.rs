//! A streamed response: `response.created`, `response.in_progress`, then each output item's
//! events as the text arrives (`output_item.added`, `content_part.added`,
//! `output_text.delta` ... `.done`, `content_part.done`, `function_call_arguments.delta` ...
//! `.done`, `output_item.done`), and `response.completed` (or `.incomplete`, `.failed`) with
//! the usage. Every event carries its `type` and a `sequence_number` from 0.

use std::convert::Infallible;

use axum::response::sse::Event;
use serde_json::{json, Value};

use crate::generate::{GenEvent, Generation};

use super::output::status;
use super::Turn;

struct Seq(u64);

impl Seq {
    fn event(&mut self, kind: &str, mut body: Value) -> Result<Event, Infallible> {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.0);
        self.0 += 1;
        Ok(Event::default().event(kind).data(body.to_string()))
    }
}

pub fn events(
    turn: Turn,
    mut gen: Generation,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> + Send + 'static {
    async_stream::stream! {
        let mut seq = Seq(0);
        yield seq.event("response.created", json!({"response": turn.skeleton}));
        yield seq.event("response.in_progress", json!({"response": turn.skeleton}));
        let mut items = turn.items();
        let mut fin = None;
        while let Some(ev) = gen.next().await {
            match ev {
                GenEvent::Delta(d) => {
                    for (kind, body) in items.push(Some(&d.text), d.generated) {
                        yield seq.event(kind, body);
                    }
                }
                GenEvent::Done(f) => fin = Some(f),
            }
        }
        for (kind, body) in items.push(None, 0) {
            yield seq.event(kind, body);
        }
        let fin = gen.final_or_abort(fin);
        let r = turn.finish(items, &fin);
        turn.keep(&r);
        let (_, _, _, last) = status(&fin);
        yield seq.event(last, json!({"response": r}));
    }
}
