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

use actix::Addr;
use actix_web::web::Bytes;
use baton_common::ids::StreamId;
use baton_common::protocol::{FinishReason, PromptEcho, TokenLogprobs, ToolCall};
use futures::Stream;
use serde::Serialize;

use super::choices::{group_event_id, next, Member};
use super::error::ApiError;
use super::logprobs::LogprobsWriter;
use super::openai::{
    ChatChunk, ChatChunkChoice, Completion, CompletionChoice, Delta, ToolCallOut, Usage,
};
use super::validate::Endpoint;
use crate::actors::sessions::{Detach, Sessions, Update};
use crate::metrics::StreamTracker;

/// Tells the sessions when a client's answer is dropped (finished, or the client went
/// away): a stream nobody listens to any more stops on its worker.
#[derive(Debug)]
pub struct StreamGuard {
    stream: StreamId,
    sessions: Addr<Sessions>,
}

impl StreamGuard {
    /// Guards the subscription of one client to `stream`.
    pub fn new(stream: StreamId, sessions: Addr<Sessions>) -> Self {
        Self { stream, sessions }
    }

    /// The stream.
    pub fn stream(&self) -> StreamId {
        self.stream
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.sessions.do_send(Detach {
            stream: self.stream,
        });
    }
}

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

fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| {
        format!(r#"{{"error":{{"message":"serialization failed: {e}","type":"server_error","param":null,"code":"internal_error"}}}}"#)
    })
}

/// Builds the chunks of one stream in the shape of its endpoint.
#[derive(Debug, Clone)]
pub struct ChunkWriter {
    /// Chat or text completion shapes.
    endpoint: Endpoint,
    /// `chatcmpl-…` or `cmpl-…`, the same in every chunk.
    id: String,
    /// Unix seconds, the same in every chunk.
    created: u64,
    /// Model name.
    model: String,
    /// Whether a chat chunk already carried `role`.
    role_sent: bool,
    /// The logprobs of tokens not yet in a chunk.
    logprobs: LogprobsWriter,
    /// The choice's index.
    index: u32,
}

impl ChunkWriter {
    /// Chunks for `stream` of `model`, created at `created` (Unix seconds), with
    /// `logprobs` when the request asked for them.
    pub fn new(
        endpoint: Endpoint,
        stream: StreamId,
        model: String,
        created: u64,
        logprobs: bool,
    ) -> Self {
        Self {
            endpoint,
            id: response_id(endpoint, stream),
            created,
            model,
            role_sent: false,
            logprobs: LogprobsWriter::new(endpoint, logprobs),
            index: 0,
        }
    }

    /// Chunks of choice `index` (of a request's `n`).
    pub fn choice(mut self, index: u32) -> Self {
        self.index = index;
        self
    }

    /// The client already has the first chunk (a reattached stream): no `role` again.
    pub fn role_sent(&mut self) {
        self.role_sent = true;
    }

    /// The chunk of a token's new `text` and the tool calls it completed, if it has
    /// any (a token without either has its logprobs sent with the next chunk).
    pub fn token(
        &mut self,
        text: &str,
        logprobs: Option<&TokenLogprobs>,
        calls: &[ToolCall],
    ) -> Option<String> {
        self.logprobs.push(logprobs);
        if text.is_empty() && calls.is_empty() {
            return None;
        }
        let calls =
            (!calls.is_empty()).then(|| calls.iter().map(|c| ToolCallOut::of(c, true)).collect());
        Some(self.chunk(
            (!text.is_empty()).then(|| text.to_string()),
            calls,
            None,
            None,
        ))
    }

    /// The chunk of an echoed prompt (a completion's `echo`): its text, and its tokens'
    /// logprobs when asked.
    pub fn prompt(&mut self, prompt: &PromptEcho) -> String {
        self.logprobs.push_prompt(prompt);
        self.chunk(Some(prompt.text.clone()), None, None, None)
    }

    /// The final chunk, with `finish_reason` (and the logprobs not sent yet).
    pub fn finish(&mut self, reason: FinishReason) -> String {
        self.chunk(None, None, Some(reason.openai()), None)
    }

    /// The usage chunk (no choices).
    pub fn usage(&mut self, usage: Usage) -> String {
        self.chunk(None, None, None, Some(usage))
    }

    fn chunk(
        &mut self,
        text: Option<String>,
        tool_calls: Option<Vec<ToolCallOut>>,
        finish: Option<&'static str>,
        usage: Option<Usage>,
    ) -> String {
        let with_choice = usage.is_none();
        let logprobs = if with_choice {
            self.logprobs.take()
        } else {
            None
        };
        match self.endpoint {
            Endpoint::Chat => {
                let role = if with_choice && !self.role_sent {
                    self.role_sent = true;
                    Some("assistant")
                } else {
                    None
                };
                let choices = if with_choice {
                    vec![ChatChunkChoice {
                        index: self.index,
                        delta: Delta {
                            role,
                            content: text,
                            tool_calls,
                        },
                        logprobs,
                        finish_reason: finish,
                    }]
                } else {
                    Vec::new()
                };
                to_json(&ChatChunk {
                    id: self.id.clone(),
                    object: "chat.completion.chunk",
                    created: self.created,
                    model: self.model.clone(),
                    choices,
                    usage,
                })
            }
            Endpoint::Completion => {
                let choices = if with_choice {
                    vec![CompletionChoice {
                        text: text.unwrap_or_default(),
                        index: self.index,
                        logprobs,
                        finish_reason: finish,
                    }]
                } else {
                    Vec::new()
                };
                to_json(&Completion {
                    id: self.id.clone(),
                    object: "text_completion",
                    created: self.created,
                    model: self.model.clone(),
                    choices,
                    usage,
                })
            }
        }
    }
}

/// The response id of `stream`: `chatcmpl-<id>` or `cmpl-<id>`.
pub fn response_id(endpoint: Endpoint, stream: StreamId) -> String {
    match endpoint {
        Endpoint::Chat => format!("chatcmpl-{stream}"),
        Endpoint::Completion => format!("cmpl-{stream}"),
    }
}

/// How an SSE body paces itself.
#[derive(Debug, Clone, Copy)]
pub struct SseSettings {
    /// Longest wait for the next event.
    pub idle_timeout: Duration,
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
    members: Vec<Member>,
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
    /// When the last event arrived (or the body started).
    idle_since: tokio::time::Instant,
    /// When the last bytes were queued (or the body started): keep-alives count from it,
    /// since events that write nothing (a long prompt's progress) are no traffic.
    written_at: tokio::time::Instant,
}

/// A comment frame: clients ignore it, proxies see traffic.
pub const KEEPALIVE: &str = ": keep-alive\n\n";

impl SseStream {
    /// The body of `members` (in choice order) under the id `group`, their chunks shaped
    /// by `writers` (one each).
    pub fn new(
        group: StreamId,
        members: Vec<Member>,
        guards: Vec<StreamGuard>,
        slots: Vec<crate::auth::StreamSlot>,
        tracker: StreamTracker,
        writers: Vec<ChunkWriter>,
        settings: SseSettings,
    ) -> Self {
        let n = members.len();
        Self {
            group,
            members,
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
            idle_since: tokio::time::Instant::now(),
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
        if self.members.len() > 1 {
            return group_event_id(self.group, &self.positions);
        }
        let stream = self.members[i].stream;
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
        let deadline = self.idle_since + self.s.settings.idle_timeout;
        let wake = match self.s.settings.keepalive {
            Some(every) => deadline.min(self.written_at + every),
            None => deadline,
        };
        let (i, event) = match tokio::time::timeout_at(wake, next(&mut self.s.members)).await {
            Ok(Some((i, Some(event)))) => (i, event),
            Ok(Some((_, None)) | None) => {
                return self.fail(ApiError::Internal("the stream's session closed".into()));
            }
            Err(_) if wake < deadline => {
                self.pending
                    .push_back(Bytes::from_static(KEEPALIVE.as_bytes()));
                return;
            }
            Err(_) => {
                let idle = self.s.settings.idle_timeout;
                let ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
                return self.fail(ApiError::StreamTimeout(ms));
            }
        };
        self.idle_since = tokio::time::Instant::now();
        match event {
            Update::Token {
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
            // A long prompt running: the wait starts again, nothing to send.
            Update::Progress => {}
            Update::Prompt(p) => {
                // No id: a client that reconnects has it if it has any token.
                let data = self.s.writers[i].prompt(&p);
                self.pending.push_back(frame(None, None, &data));
            }
            Update::Finished(f) => {
                self.s.members[i].done = true;
                let id = self.s.event_id(i, f.completion_tokens, None);
                let data = self.s.writers[i].finish(f.reason);
                self.pending.push_back(frame(None, Some(&id), &data));
                self.s.usage[i] = Some(Usage::finished(&f, self.s.settings.prompt_tokens));
                if self.s.members.iter().all(|m| m.done) {
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
            Update::Failed(error) => {
                let model = self.s.writers[i].model.clone();
                self.fail(ApiError::from_worker(error, &model));
            }
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
    use serde_json::{json, Value};

    fn parse(chunk: &str) -> Value {
        serde_json::from_str(chunk).expect("json")
    }

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

    #[test]
    fn chat_chunks_carry_the_role_first_then_content_then_finish() {
        let mut w = ChunkWriter::new(Endpoint::Chat, StreamId(1), "m".into(), 9, false);
        let id = format!("chatcmpl-{}", StreamId(1));
        assert_eq!(
            parse(&w.token("Hel", None, &[]).expect("text")),
            json!({"id": id, "object": "chat.completion.chunk", "created": 9, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"},
                                "logprobs": null, "finish_reason": null}]})
        );
        assert_eq!(
            parse(&w.token("lo", None, &[]).expect("text"))["choices"][0]["delta"],
            json!({"content": "lo"})
        );
        let fin = parse(&w.finish(FinishReason::Length));
        assert_eq!(fin["choices"][0]["delta"], json!({}));
        assert_eq!(fin["choices"][0]["finish_reason"], "length");
        let usage = parse(&w.usage(Usage::new(2, 3)));
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                   "prompt_tokens_details": {"cached_tokens": 0}})
        );
    }

    #[test]
    fn tool_calls_stream_as_deltas_with_their_index() {
        let mut w = ChunkWriter::new(Endpoint::Chat, StreamId(3), "m".into(), 9, false);
        assert_eq!(w.token("", None, &[]), None, "nothing new: no chunk");
        let call = ToolCall {
            index: 1,
            id: "call_x".into(),
            name: "get_weather".into(),
            arguments: r#"{"city":"Oslo"}"#.into(),
        };
        let chunk = parse(
            &w.token("", None, std::slice::from_ref(&call))
                .expect("a call"),
        );
        assert_eq!(
            chunk["choices"][0]["delta"],
            json!({"role": "assistant", "tool_calls": [{"index": 1, "id": "call_x",
                   "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]})
        );
        // A later piece of a call: its index and more arguments only.
        let more = ToolCall {
            index: 1,
            id: String::new(),
            name: String::new(),
            arguments: "}".into(),
        };
        let chunk = parse(&w.token("", None, &[more]).expect("a piece"));
        assert_eq!(
            chunk["choices"][0]["delta"],
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]})
        );
        let fin = parse(&w.finish(FinishReason::ToolCalls));
        assert_eq!(fin["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn completion_chunks_are_text_completions() {
        let mut w = ChunkWriter::new(Endpoint::Completion, StreamId(2), "m".into(), 9, false);
        assert_eq!(
            parse(&w.token("Hi", None, &[]).expect("text")),
            json!({"id": format!("cmpl-{}", StreamId(2)), "object": "text_completion",
                   "created": 9, "model": "m",
                   "choices": [{"text": "Hi", "index": 0, "logprobs": null, "finish_reason": null}]})
        );
        let fin = parse(&w.finish(FinishReason::Stop));
        assert_eq!(fin["choices"][0]["text"], "");
        assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    }
}
