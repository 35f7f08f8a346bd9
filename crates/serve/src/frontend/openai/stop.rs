//! The end of an OpenAI answer, for completions and chat completions alike: the generation's
//! tokens read into its text until the model's end of text (generation_config.json's eos ids,
//! the chat template's end of turn; not part of the answer, `finish_reason` "stop"), the first
//! of up to four `stop` strings (cut off with what follows, "stop") or `max_tokens`
//! ("length"). Streamed text is held back while it could be the start of a stop string, so no
//! event ever carries part of one. Stopping closes the generation's token channel, so the
//! instance ends it after its current step. This module never runs a model and never writes
//! an event's shape (its caller does).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::Event;

use super::{ApiError, Result};
use crate::error::ServeError;
use crate::model::LoadedVersion;
use crate::text::Detokenizer;

/// Why a generation ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// The answer's text as tokens arrive: stops at the end-of-turn id or a stop string, and says
/// how much is safe to send (never part of a stop string).
pub(super) struct Stopper {
    stop: Vec<String>,
    /// The ids that end the answer (empty: `ignore_eos`).
    eos: Arc<[u32]>,
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    /// Tokens of the answer (the end-of-turn token excluded).
    pub(super) tokens: usize,
}

impl Stopper {
    /// A stopper at `stop` strings and the `eos` ids.
    pub(super) fn new(stop: Vec<String>, eos: Arc<[u32]>) -> Stopper {
        Stopper {
            stop,
            eos,
            text: String::new(),
            sent: 0,
            tokens: 0,
        }
    }
}

impl Stopper {
    /// Adds a token and its decoded `piece`: Some when generation must stop.
    fn push(&mut self, id: u32, piece: &str) -> Option<Finish> {
        if self.eos.contains(&id) {
            return Some(Finish::Stop);
        }
        self.tokens += 1;
        self.text.push_str(piece);
        self.cut().then_some(Finish::Stop)
    }

    /// Adds the detokenizer's held-back rest at the end; true when it completes a stop string.
    fn finish(&mut self, rest: &str) -> bool {
        self.text.push_str(rest);
        self.cut()
    }

    /// Cuts the text at the first stop string; whether there was one.
    fn cut(&mut self) -> bool {
        let first = self
            .stop
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.text.truncate(at);
            return true;
        }
        false
    }

    /// The text not sent yet that cannot be the start of a stop string (`all`: everything).
    pub(super) fn take(&mut self, all: bool) -> String {
        let mut end = self.text.len();
        if !all {
            for s in &self.stop {
                for (i, _) in s.char_indices().skip(1) {
                    if self.text.ends_with(&s[..i]) {
                        end = end.min(self.text.len() - i);
                    }
                }
            }
        }
        let end = end.max(self.sent);
        let piece = self.text[self.sent..end].to_string();
        self.sent = end;
        piece
    }
}

pub(super) type Tokens = tokio::sync::mpsc::UnboundedReceiver<u32>;
pub(super) type Done = tokio::sync::oneshot::Receiver<std::result::Result<Vec<u32>, ServeError>>;
pub(super) type EventTx = tokio::sync::mpsc::Sender<std::result::Result<Event, Infallible>>;
/// The event a piece of streamed text goes out in (None for nothing to send).
pub(super) type PieceEvent<'a> = dyn Fn(String) -> Option<Event> + Send + Sync + 'a;

/// Reads the generation's tokens into `stopper` until it stops or the generation ends; when
/// streaming (`sink`), sends `event(text)` on the channel for each piece that is safe to send.
/// Stopping early closes the token channel, which ends the generation after its current step
/// (counted a success); a client gone (the event stream closed) drops both receivers, which
/// counts it cancelled.
pub(super) async fn run(
    lv: &LoadedVersion,
    mut tokens: Tokens,
    mut done: Done,
    start: Instant,
    mut stopper: Stopper,
    sink: Option<(&EventTx, &PieceEvent<'_>)>,
) -> Result<(Stopper, Finish)> {
    let codec = lv
        .text
        .as_ref()
        .map_err(|r| ApiError::invalid("model", r.clone()))?;
    let mut detok = Detokenizer::new(codec);
    while let Some(id) = tokens.recv().await {
        let piece = detok.push(id);
        if let Some(finish) = stopper.push(id, &piece) {
            // Closing the token channel ends the generation after its current step; the
            // instance then answers `done` as for a finished one, so it counts as a success.
            drop(tokens);
            let out = done.await.unwrap_or_else(|_| Err(lv.lost()));
            lv.account(&out, start);
            return Ok((stopper, finish));
        }
        if let Some((tx, event)) = sink {
            if let Some(e) = event(stopper.take(false)) {
                if tx.send(Ok(e)).await.is_err() {
                    break;
                }
            }
        }
    }
    if sink.is_some_and(|(tx, _)| tx.is_closed()) {
        drop(tokens);
        if let Ok(out) = done.try_recv() {
            lv.account(&out, start);
        }
        return Err(ApiError::invalid("stream", "the client went away"));
    }
    let out = (&mut done).await.unwrap_or_else(|_| Err(lv.lost()));
    lv.account(&out, start);
    out?;
    let finish = if stopper.finish(&detok.finish()) {
        Finish::Stop
    } else {
        Finish::Length
    };
    Ok((stopper, finish))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stopper(stop: &[&str]) -> Stopper {
        Stopper::new(
            stop.iter().map(|s| s.to_string()).collect(),
            Arc::from(vec![9, 7]),
        )
    }

    #[test]
    fn stop_strings_cut_the_text_and_are_never_streamed() {
        let mut s = stopper(&["END", "\n\n"]);
        let mut streamed = String::new();
        let pieces = ["hel", "lo E", "N", "x", " wor", "ld E", "ND more"];
        for (i, piece) in pieces.iter().enumerate() {
            let finish = s.push(1, piece);
            if i + 1 == pieces.len() {
                assert_eq!(finish, Some(Finish::Stop));
                break;
            }
            assert_eq!(finish, None);
            streamed += &s.take(false);
            if i == 1 {
                // "E" may start "END": held back.
                assert_eq!(streamed, "hello ");
            }
        }
        streamed += &s.take(true);
        assert_eq!(streamed, "hello ENx world ");
        let mut s = stopper(&[]);
        assert_eq!(s.push(3, "a"), None);
        assert_eq!(s.push(7, ""), Some(Finish::Stop));
        assert_eq!((s.take(true), s.tokens), ("a".to_string(), 1));
    }
}
