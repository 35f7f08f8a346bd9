//! A generation streamed as server-sent events, for the front ends on the HTTP port (the
//! generate extension's `generate_stream`, OpenAI's streaming completions): each decoded piece
//! of text goes out as soon as it is whole, in the event the caller writes, and a client that
//! went away stops the generation. This module never decides what an event says.

use std::convert::Infallible;
use std::time::Instant;

use axum::response::sse::Event;

use crate::error::ServeError;
use crate::model::LoadedVersion;
use crate::text::Detokenizer;

/// Where a streamed generation's server-sent events go.
pub(crate) type EventSender = tokio::sync::mpsc::Sender<std::result::Result<Event, Infallible>>;

/// Sends each decoded piece of a generation's `tokens` on `tx` as `event(piece)` until the
/// generation ends, then accounts for it and returns its outcome (the detokenizer keeps what
/// it has not emitted yet). None when the client went away: dropping the receivers stops the
/// generation after its current step, and the instance counts it as cancelled unless it had
/// finished anyway.
pub(crate) async fn stream_pieces(
    lv: &LoadedVersion,
    mut tokens: tokio::sync::mpsc::UnboundedReceiver<u32>,
    mut done: tokio::sync::oneshot::Receiver<std::result::Result<Vec<u32>, ServeError>>,
    start: Instant,
    detok: &mut Detokenizer<'_>,
    tx: &EventSender,
    event: impl Fn(&str) -> std::result::Result<Event, Infallible>,
) -> Option<std::result::Result<Vec<u32>, ServeError>> {
    loop {
        let id = tokio::select! {
            id = tokens.recv() => id,
            // the client went away (the server dropped the event stream)
            _ = tx.closed() => None,
        };
        let Some(id) = id else { break };
        // The end of text a generation stops at is not text.
        if lv.eos.contains(&id) {
            continue;
        }
        let piece = detok.push(id);
        if !piece.is_empty() && tx.send(event(&piece)).await.is_err() {
            break;
        }
    }
    if tx.is_closed() {
        drop(tokens);
        if let Ok(out) = done.try_recv() {
            lv.account(&out, start);
        }
        return None;
    }
    let out = (&mut done).await.unwrap_or_else(|_| Err(lv.lost()));
    lv.account(&out, start);
    Some(out)
}
