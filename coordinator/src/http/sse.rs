//! Server-Sent Events: OpenAI chunks, one frame per token.
//!
//! Each frame carries `id: <stream id>:<position>` (the token's index; the final frames
//! carry the number of generated tokens), so that a client knows how far it got. The
//! stream ends with a chunk holding `finish_reason`, an optional usage chunk, and
//! `data: [DONE]`. An error after the headers are out becomes one `event: error` frame
//! with an OpenAI error body, and the stream ends there.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use actix_web::web::Bytes;
use baton_common::ids::StreamId;
use futures::Stream;

use crate::api::answer::{Read, Reader};
use crate::api::choices::group_event_id;
use crate::api::chunks::{to_json, ChunkWriter};
use crate::api::error::ApiError;
use crate::api::open::StreamGuard;
use crate::api::openai::Usage;
use crate::metrics::StreamTracker;

/// The last frame of a successful stream.
pub const DONE: &str = "data: [DONE]\n\n";

/// One SSE frame: an optional `event:` and `id:`, and one `data:` line.
pub fn frame(event: Option<&str>, id: Option<&str>, data: &str) -> Bytes {
    let mut out = String::with_capacity(data.len() + 64);
    if let Some(event) = event {
        out.push_str("event: ");
        out.push_str(event);
        out.push('\n');
    }
    if let Some(id) = id {
        out.push_str("id: ");
        out.push_str(id);
        out.push('\n');
    }
    // JSON has no raw newlines, but a frame must never be split by one.
    for line in data.split('\n') {
        out.push_str("data: ");
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    Bytes::from(out)
}

/// The `event: error` frame of `error`.
pub fn error_frame(error: &ApiError) -> Bytes {
    frame(Some("error"), None, &to_json(&error.body()))
}

/// How an SSE body paces itself.
#[derive(Debug, Clone, Copy)]
pub struct SseSettings {
    /// How often a silent stream sends a keep-alive comment (`None`: never).
    pub keepalive: Option<Duration>,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Prompt tokens, as the worker counted at acceptance.
    pub prompt_tokens: u32,
}

/// What the SSE body needs of an accepted request: its choices' streams (one, or `n`).
#[derive(Debug)]
pub struct SseStream {
    /// The first choice's stream: event ids name it.
    group: StreamId,
    /// Each choice's updates. Declared before `guards`: dropped first, so that the
    /// sessions see the channels closed when the guards' detaches arrive.
    reader: Reader,
    /// Detach from the sessions when the body is dropped.
    _guards: Vec<StreamGuard>,
    /// The key's stream slots: freed when the body is dropped (the answer ended or its
    /// client went away), after the guards have detached.
    _slots: Vec<crate::auth::StreamSlot>,
    /// Latencies and outcome, for the metrics.
    tracker: StreamTracker,
    /// Shape the chunks, one per choice.
    writers: Vec<ChunkWriter>,
    settings: SseSettings,
    /// Each choice's last position sent (its token count once it finished).
    positions: Vec<Option<u32>>,
    /// The usage of each finished choice.
    usage: Vec<Option<Usage>>,
}

struct State {
    s: SseStream,
    pending: VecDeque<Bytes>,
    ended: bool,
    /// When the last bytes were queued (or the body started): keep-alives count from it,
    /// since events that write nothing (a long prompt's progress) are no traffic.
    written_at: tokio::time::Instant,
}

/// A comment line: clients ignore it, proxies see traffic. No blank line after it: a
/// blank line dispatches an event, and clients that keep the last event id (the
/// official `openai` Python client among them) would read an event with that id and no
/// data, and fail on its empty JSON.
pub const KEEPALIVE: &str = ": keep-alive\n";

impl SseStream {
    /// The body of the choices `reader` reads under the id `group`, their chunks shaped
    /// by `writers` (one each, in choice order).
    pub fn new(
        group: StreamId,
        reader: Reader,
        guards: Vec<StreamGuard>,
        slots: Vec<crate::auth::StreamSlot>,
        tracker: StreamTracker,
        writers: Vec<ChunkWriter>,
        settings: SseSettings,
    ) -> Self {
        let n = reader.members().len();
        Self {
            group,
            reader,
            _guards: guards,
            _slots: slots,
            tracker,
            writers,
            settings,
            positions: vec![None; n],
            usage: vec![None; n],
        }
    }

    /// The response body: frames until every choice ends. Dropping it (the client went
    /// away) drops the guards: a stream nobody listens to stops on its worker.
    pub fn into_body(self) -> impl Stream<Item = Result<Bytes, Infallible>> {
        let state = State {
            s: self,
            pending: VecDeque::new(),
            ended: false,
            written_at: tokio::time::Instant::now(),
        };
        futures::stream::unfold(state, |mut st| async move {
            loop {
                if let Some(bytes) = st.pending.pop_front() {
                    st.written_at = tokio::time::Instant::now();
                    return Some((Ok(bytes), st));
                }
                if st.ended {
                    return None;
                }
                st.step().await;
            }
        })
    }

    /// The id of an event of choice `i` that leaves it at `position`: one stream's
    /// `<stream>:<position>[:<hash>]`, or a group's positions.
    fn event_id(&mut self, i: usize, position: u32, hash: Option<u64>) -> String {
        self.positions[i] = Some(position);
        if self.positions.len() > 1 {
            return group_event_id(self.group, &self.positions);
        }
        let stream = self.reader.members()[i].stream;
        match hash {
            Some(hash) => format!("{stream}:{position}:{hash:016x}"),
            None => format!("{stream}:{position}"),
        }
    }
}

impl State {
    /// Waits for the next event and queues its frames, or a keep-alive comment when
    /// the wait runs long.
    async fn step(&mut self) {
        let wake = self
            .s
            .settings
            .keepalive
            .map(|every| self.written_at + every);
        let read = match self.s.reader.next(wake).await {
            Ok(read) => read,
            Err(error) => return self.fail(error),
        };
        match read {
            Read::Token {
                choice: i,
                index,
                text,
                hash,
                logprobs,
                tool_calls,
            } => {
                self.s.tracker.token();
                if let Some(data) = self.s.writers[i].token(&text, logprobs.as_ref(), &tool_calls) {
                    let id = self.s.event_id(i, index, Some(hash));
                    self.pending.push_back(frame(None, Some(&id), &data));
                }
            }
            Read::Prompt(i, p) => {
                // No id: a client that reconnects has it if it has any token.
                let data = self.s.writers[i].prompt(&p);
                self.pending.push_back(frame(None, None, &data));
            }
            Read::Finished(i, f) => {
                let id = self.s.event_id(i, f.completion_tokens, None);
                let data = self.s.writers[i].finish(f.reason);
                self.pending.push_back(frame(None, Some(&id), &data));
                self.s.usage[i] = Some(Usage::finished(&f, self.s.settings.prompt_tokens));
                if self.s.reader.members().iter().all(|m| m.done) {
                    self.s.tracker.finish("finished");
                    if self.s.settings.include_usage {
                        let usage = Usage::of_choices(self.s.usage.iter().flatten().copied());
                        let data = self.s.writers[0].usage(usage);
                        self.pending.push_back(frame(None, Some(&id), &data));
                    }
                    self.pending.push_back(Bytes::from_static(DONE.as_bytes()));
                    self.ended = true;
                }
            }
            Read::Quiet => self
                .pending
                .push_back(Bytes::from_static(KEEPALIVE.as_bytes())),
            // Every choice ended, yet the last end did not finish the body: never expected.
            Read::Done => self.fail(ApiError::Internal(
                "the answer ended without its end".into(),
            )),
        }
    }

    fn fail(&mut self, error: ApiError) {
        self.s.tracker.finish(error.code());
        tracing::warn!(stream = %self.s.group, code = error.code(), %error, "stream failed");
        self.pending.push_back(error_frame(&error));
        self.ended = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_have_id_and_data_lines() {
        assert_eq!(
            frame(None, Some("s:3"), "{}"),
            Bytes::from("id: s:3\ndata: {}\n\n")
        );
        assert_eq!(
            frame(Some("error"), None, "a\nb"),
            Bytes::from("event: error\ndata: a\ndata: b\n\n")
        );
        let e = error_frame(&ApiError::StreamTimeout(5));
        let text = std::str::from_utf8(&e).expect("utf8");
        assert!(text.starts_with("event: error\ndata: {\"error\":"));
        assert!(text.contains("\"code\":\"stream_timeout\""));
    }
}
