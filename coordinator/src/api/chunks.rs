//! The chunks of a streamed answer in OpenAI's shapes (`chat.completion.chunk`,
//! `text_completion`), one choice's at a time: the same JSON over SSE and over NATS.

use baton_common::ids::StreamId;
use baton_common::protocol::{FinishReason, PromptEcho, TokenLogprobs, ToolCall};
use serde::Serialize;

use super::logprobs::LogprobsWriter;
use super::openai::{
    ChatChunk, ChatChunkChoice, Completion, CompletionChoice, Delta, ToolCallOut, Usage,
};
use super::validate::Endpoint;

/// `value` as JSON; a value that cannot be written becomes an internal error body.
pub fn to_json<T: Serialize>(value: &T) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn parse(chunk: &str) -> Value {
        serde_json::from_str(chunk).expect("json")
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
